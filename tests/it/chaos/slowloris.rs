//! Slow HTTP clients against a daemon's metrics endpoint (`metrics_addr`): a slowloris, which opens many
//! connections and sends each request's head a line at a time, never ending it. The endpoint bounds what such
//! clients hold (src/http.rs: 64 connections, 10 s for a head, no thread per connection); the suite checks that
//! the daemon under attack goes on starting tasks meanwhile, and that `/metrics` answers another client meanwhile
//! (a 503 once the clients hold every connection) and after.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::support::scrape_with;

use super::faults::{Injector, Kind, candidates};
use super::world::{What, World, lock, now_us};

/// How many connections the endpoint keeps open at most (src/http.rs, `Limits::max_connections`): below it, with
/// a margin for the others' scrapes, another client must get its answer itself.
const MAX_CONNECTIONS: usize = 64;

/// How often each slow client sends one more header line.
const TRICKLE: Duration = Duration::from_millis(300);
/// A stall of the machine (the test's sampler that late, µs) that explains a scrape nothing answered.
const MACHINE_STALL_US: u64 = 1_000_000;

impl Injector<'_, '_> {
    /// Opens 16 to 96 slow clients on a running daemon's metrics endpoint for 2 to 4 s, scrapes it from another
    /// client meanwhile and after they are gone, and checks that the daemon started tasks meanwhile.
    pub(super) fn slowloris(&mut self) -> String {
        let world = self.world;
        let target = {
            let mut daemons = lock(&world.daemons);
            let running = candidates(&mut daemons);
            if running.is_empty() {
                return "no daemon running: skipped".into();
            }
            let slot = self.rng.pick(&running);
            let instance = daemons.slots[slot].instance;
            let log = std::fs::read_to_string(&daemons.instances[instance].log).unwrap_or_default();
            (slot, instance, metrics_addr(&log))
        };
        let clients = 16 + self.rng.below(81) as usize;
        let hold = self.rng.ms(2000, 4000);
        let (slot, instance, addr) = target;
        let Some(addr) = addr else {
            return format!(
                "daemon {slot} (process #{instance}) does not serve its metrics yet: skipped"
            );
        };
        let from = now_us();
        let mut streams: Vec<TcpStream> = (0..clients)
            .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok())
            .collect();
        for stream in &mut streams {
            let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: chaos\r\n");
        }
        let during = std::thread::scope(|scope| {
            let scraper = scope.spawn(|| {
                std::thread::sleep(hold / 2);
                scrape_with(addr, None, Duration::from_secs(3)).status
            });
            let end = Instant::now() + hold;
            let mut line = 0;
            while Instant::now() < end {
                std::thread::sleep(TRICKLE);
                line += 1;
                for stream in &mut streams {
                    let _ = stream.write_all(format!("X-Slow-{line}: x\r\n").as_bytes());
                }
            }
            scraper.join().expect("the scraper thread")
        });
        let to = now_us();
        drop(streams);
        // The endpoint notices the closed connections at its next poll: a scrape answers within a few seconds.
        let deadline = Instant::now() + Duration::from_secs(5);
        let after = loop {
            let status = scrape_with(addr, None, Duration::from_secs(2)).status;
            if status.contains(" 200 ") || Instant::now() > deadline {
                break status;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        world.add("slowloris clients", clients as u64);
        world.event(
            What::Fault(Kind::Slowloris),
            Some(instance),
            from,
            format!("{clients} clients"),
        );
        let alive = {
            let mut daemons = lock(&world.daemons);
            let s = &mut daemons.slots[slot];
            s.instance == instance
                && s.process
                    .as_mut()
                    .is_some_and(|process| matches!(process.child.try_wait(), Ok(None)))
        };
        if !alive {
            return format!(
                "{clients} slow clients on daemon {slot} (process #{instance}), which stopped meanwhile (a pill?)"
            );
        }
        self.judge(clients, (from, to), instance, (&during, &after))
    }

    /// The checks of one slowloris on process `instance` from `from` to `to` (µs): another client got an answer
    /// meanwhile (a 200 while the slow clients leave room, else a 503) and a 200 after; the daemon started tasks
    /// meanwhile, if the others did (there was work).
    fn judge(
        &self,
        clients: usize,
        (from, to): (u64, u64),
        instance: usize,
        (during, after): (&str, &str),
    ) -> String {
        let world = self.world;
        let room = clients + 4 < MAX_CONNECTIONS;
        // A scrape that nothing answered within its 3 s while the machine stalled for a second or more (the test's
        // 20 ms sampler late by that much) says nothing of the endpoint: the daemon got no CPU either. The 1800 s
        // run of seed 796573398 (load 42 on two cores) had one: the attack's 2 to 4 s lasted 11.9 s, and the
        // daemon logged nothing for 5.6 s, then every slow client's timeout at once.
        let starved = during.is_empty()
            && lock(&world.typed)
                .stalls
                .iter()
                .any(|&(a, b)| b - a >= MACHINE_STALL_US && a <= to && b >= from);
        if during.contains(" 200 ") {
            world.count("slowloris scrapes answered 200 meanwhile");
        } else if during.contains(" 503 ") && !room {
            world.count("slowloris scrapes answered 503 meanwhile");
        } else if starved {
            world.count("slowloris scrapes left out (a stall of the machine)");
        } else {
            world.violation(format!(
                "with {clients} slow clients on process #{instance}'s metrics endpoint, another client's scrape got \
                 {during:?} ({} expected)",
                if room { "200" } else { "200 or 503" }
            ));
        }
        if !after.contains(" 200 ") {
            world.violation(format!(
                "after {clients} slow clients left process #{instance}'s metrics endpoint, a scrape got {after:?}"
            ));
        }
        let (mine, others) = starts_between(world, instance, from, to);
        world.add("slowloris starts meanwhile", mine);
        if mine == 0 && others > 0 {
            world.violation(format!(
                "process #{instance} started no task while {clients} slow clients held its metrics endpoint ({} to \
                 {}), while the other daemons started {others}",
                world.rel(from),
                world.rel(to)
            ));
        }
        format!(
            "{clients} slow clients on process #{instance} for {:.1} s: a scrape meanwhile got {during:?}, after \
             {after:?}; it started {mine} tasks meanwhile (the others {others})",
            (to - from) as f64 / 1e6
        )
    }
}

/// Runs started between `from` and `to` (µs): by process `instance`, and by the others.
fn starts_between(world: &World<'_>, instance: usize, from: u64, to: u64) -> (u64, u64) {
    let guard = world.facts();
    let (mut mine, mut others) = (0, 0);
    for run in guard.1.runs.values().flatten() {
        if run.start_us >= from && run.start_us <= to {
            if run.instance == instance {
                mine += 1;
            } else {
                others += 1;
            }
        }
    }
    (mine, others)
}

/// The address a daemon's metrics endpoint bound, from its log's "metrics on http://ADDR/metrics" line.
pub(super) fn metrics_addr(log: &str) -> Option<SocketAddr> {
    log.split("metrics on http://")
        .nth(1)?
        .split("/metrics")
        .next()?
        .parse()
        .ok()
}
