//! The faults: what is injected, how often, and how; the schedule that picks them from the seed.

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use kmqd::Client;
use kmqd::broker::sources;

use crate::support::proxy::{Fault, FaultProxy, Matcher, Rule};
use crate::support::*;

use super::workload::{DAEMONS, LEASE, Queue, Rng, Shape, Work};
use super::world::{Daemons, What, World, lock, now_us, send_signal, tail, wait_exit};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Kind {
    Kill9,
    ClientKill,
    RedisTerm,
    RedisKill,
    RedisStall,
    Zombie,
    RollingConfig,
    RedisEmpty,
    PoisonPill,
    DeafHandlers,
    DelayedReply,
    LateRequest,
    RedisRewind,
    ClockForward,
    ClockBack,
    Slowloris,
}

/// Every fault kind, its weight (how often it is picked, relative to the others, once each kind has happened
/// once) and how it is injected. A fault is injected every 1 to 3 s, one at a time.
pub(super) const FAULTS: &[(Kind, u64, &str)] = &[
    (
        Kind::Kill9,
        6,
        "kill -9 of a random daemon; the supervisor starts it again at once or a second later",
    ),
    (
        Kind::ClientKill,
        3,
        "CLIENT KILL TYPE normal on a direct connection: every connection of the daemons and the producer is cut",
    ),
    (
        Kind::RedisTerm,
        2,
        "redis-server stopped with SIGTERM, down for up to a second, started again on its append-only file",
    ),
    (
        Kind::RedisKill,
        2,
        "redis-server killed with SIGKILL, down for up to a second, started again on its append-only file",
    ),
    (
        Kind::RedisStall,
        3,
        "Redis stalled 1.5 to 2.5 s, past io_timeout: redis-server SIGSTOPped then SIGCONTed, or a proxy stall",
    ),
    (
        Kind::Zombie,
        2,
        "a daemon SIGSTOPped for its lease and 1 to 2 s more, then SIGCONTed",
    ),
    (
        Kind::RollingConfig,
        2,
        "a daemon stopped (SIGTERM) and started on config B (jobs: one level, other workers and prefetch; \
         limited: max_running halved; typed: its types' limits halved; grouped: its groups' limits halved); back \
         on A (the same way) 2 to 6 faults \
         later, or at the next rolling change",
    ),
    (
        Kind::RedisEmpty,
        1,
        "redis-server stopped (SIGTERM or SIGKILL), its append-only file deleted, started empty; the producer \
         re-pushes every task that has no final state (an outbox): a new epoch",
    ),
    (
        Kind::PoisonPill,
        2,
        "a task that aborts the daemon that runs it ({\"outcome\":\"abort\"}), on any queue",
    ),
    (
        Kind::DeafHandlers,
        2,
        "1 to 3 tasks whose handler sleeps 3 s ignoring cancel, past execution_timeout, on any queue",
    ),
    (
        Kind::DelayedReply,
        2,
        "the reply of one claim.lua, settle.lua, handover_plain.lua, renew.lua, push.lua or plain pop (its EXEC) held 200 to 900 ms by \
         the proxy, within io_timeout: the call ran in Redis at once, the caller learns of it late",
    ),
    (
        Kind::LateRequest,
        2,
        "one such request held 1.2 to 2.5 s by the proxy, past io_timeout: its caller gives up and sends it again; \
         the held copy still reaches Redis after the caller closed the connection, and runs there",
    ),
    (
        Kind::RedisRewind,
        2,
        "redis-server on appendfsync everysec killed (SIGKILL) with its host: the last 0.2 to 1 s of its append-only \
         file lost, started again on the rest (a rewind); the producer pushes again what Redis no longer holds and \
         has no final state (an outbox)",
    ),
    (
        Kind::ClockForward,
        1,
        "redis-server's wall clock stepped 3 to 6 s forward, past every lease (its monotonic clock left alone)",
    ),
    (
        Kind::ClockBack,
        1,
        "redis-server's wall clock stepped 1 to 3 s back",
    ),
    (
        Kind::Slowloris,
        2,
        "16 to 96 slow HTTP clients on a daemon's metrics_addr for 2 to 4 s (a header line every 300 ms, never the \
         end of the head): it goes on starting tasks, and /metrics answers another client meanwhile and after",
    ),
];

impl Kind {
    /// Whether the fault takes Redis from every daemon at once, or every lease: a restart, a stall, a loss or a
    /// rewind of its data, a forward step of its clock.
    pub(super) fn is_redis_wide(self) -> bool {
        matches!(
            self,
            Kind::RedisTerm
                | Kind::RedisKill
                | Kind::RedisStall
                | Kind::RedisEmpty
                | Kind::RedisRewind
                | Kind::ClockForward
        )
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            Kind::Kill9 => "kill -9",
            Kind::ClientKill => "client kill",
            Kind::RedisTerm => "redis restart (SIGTERM)",
            Kind::RedisKill => "redis restart (SIGKILL)",
            Kind::RedisStall => "redis stall",
            Kind::Zombie => "zombie",
            Kind::RollingConfig => "config change",
            Kind::RedisEmpty => "redis restarted empty",
            Kind::PoisonPill => "poison pill",
            Kind::DeafHandlers => "deaf handlers",
            Kind::DelayedReply => "delayed reply",
            Kind::LateRequest => "late request",
            Kind::RedisRewind => "redis rewind (everysec)",
            Kind::ClockForward => "redis clock forward",
            Kind::ClockBack => "redis clock back",
            Kind::Slowloris => "slowloris",
        }
    }
}

/// The running daemons the fault loop may act on.
pub(super) fn candidates(daemons: &mut Daemons) -> Vec<usize> {
    (0..DAEMONS)
        .filter(|&slot| {
            let s = &mut daemons.slots[slot];
            !s.held
                && s.process
                    .as_mut()
                    .is_some_and(|process| matches!(process.child.try_wait(), Ok(None)))
        })
        .collect()
}

pub(super) fn kill9(world: &World<'_>, rng: &mut Rng) -> String {
    let mut daemons = lock(&world.daemons);
    let running = candidates(&mut daemons);
    if running.is_empty() {
        return "no daemon running: skipped".into();
    }
    let slot = rng.pick(&running);
    let instance = daemons.slots[slot].instance;
    let mut process = daemons.slots[slot].process.take().unwrap();
    let from = now_us();
    let _ = process.child.kill();
    let _ = process.child.wait();
    let later = rng.coin();
    daemons.slots[slot].restart_at = Some(
        Instant::now()
            + if later {
                Duration::from_secs(1)
            } else {
                Duration::ZERO
            },
    );
    world.event(
        What::Fault(Kind::Kill9),
        Some(instance),
        from,
        String::new(),
    );
    format!(
        "daemon {slot} (process #{instance}) killed; restart {}",
        if later { "in 1 s" } else { "at once" }
    )
}

pub(super) fn zombie(world: &World<'_>, rng: &mut Rng) -> String {
    let (slot, instance, pid) = {
        let mut daemons = lock(&world.daemons);
        let running = candidates(&mut daemons);
        if running.is_empty() {
            return "no daemon running: skipped".into();
        }
        let slot = rng.pick(&running);
        let s = &mut daemons.slots[slot];
        s.held = true;
        (slot, s.instance, s.process.as_ref().unwrap().child.id())
    };
    let from = now_us();
    let pause = LEASE + rng.ms(1000, 2000);
    assert!(send_signal(pid, "STOP"), "SIGSTOP {pid}");
    std::thread::sleep(pause);
    assert!(send_signal(pid, "CONT"), "SIGCONT {pid}");
    lock(&world.daemons).slots[slot].held = false;
    world.event(
        What::Fault(Kind::Zombie),
        Some(instance),
        from,
        String::new(),
    );
    format!(
        "daemon {slot} (process #{instance}) stopped for {:.1} s, then continued",
        pause.as_secs_f64()
    )
}

/// Stops the slot's daemon gracefully (SIGTERM) and starts it on `shape`. Returns what happened.
pub(super) fn change_config(world: &World<'_>, slot: usize, shape: Shape, what: What) -> String {
    let (process, instance, old) = {
        let mut daemons = lock(&world.daemons);
        let s = &mut daemons.slots[slot];
        s.held = true;
        let old = s.shape;
        s.shape = shape;
        (s.process.take(), s.instance, old)
    };
    let from = now_us();
    let mut how = String::from("was not running");
    if let Some(mut process) = process {
        // A process meets SIGTERM's default action until it installs its handlers; kmqd does so before its
        // first log line (src/cli/daemon.rs, run_daemon), so wait for that line, as an operator's stop would not race
        // the exec either.
        let started = Instant::now() + Duration::from_secs(10);
        while process.log_text().is_empty()
            && matches!(process.child.try_wait(), Ok(None))
            && Instant::now() < started
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        if matches!(process.child.try_wait(), Ok(None)) {
            send_signal(process.child.id(), "TERM");
        }
        let status = wait_exit(&mut process, Duration::from_secs(30));
        how = match status {
            Some(status) if status.code() == Some(0) => "exited 0".to_string(),
            Some(status) if status.signal() == Some(6) => {
                // A poison pill it was running aborted it during the grace.
                world.count("crashes");
                world.event(What::Crashed, Some(instance), now_us(), format!("{status}"));
                format!("{status} (a poison pill)")
            }
            Some(status) => {
                world.violation(format!(
                    "daemon {slot} (process #{instance}) stopped with SIGTERM exited with {status}; its log ends:\n{}",
                    tail(&process.log_text(), 20)
                ));
                format!("{status}")
            }
            None => {
                world.violation(format!(
                    "daemon {slot} (process #{instance}) did not exit within 30 s of SIGTERM; its log ends:\n{}",
                    tail(&process.log_text(), 20)
                ));
                process.kill9();
                "killed after 30 s".to_string()
            }
        };
    }
    world.event(what, Some(instance), from, format!("{old:?} -> {shape:?}"));
    let mut daemons = lock(&world.daemons);
    world.start_daemon(
        &mut daemons,
        slot,
        &format!("config change {old:?} -> {shape:?}"),
    );
    daemons.slots[slot].held = false;
    format!("daemon {slot} (process #{instance}) {how}; now on config {shape:?}")
}

/// The fault loop's own state.
pub(super) struct Injector<'w, 'a> {
    pub(super) world: &'w World<'a>,
    pub(super) redis: RedisServer,
    pub(super) proxy: FaultProxy,
    /// The test's own producer (direct to Redis): pills, deaf handlers, the outbox's re-pushes.
    pub(super) client: Client,
    pub(super) rng: Rng,
    /// The slot on config B, and how many more faults it stays there.
    pub(super) on_b: Option<(usize, u64)>,
    /// How far Redis's wall clock is off the real one now (ms), after the clock steps so far.
    pub(super) clock_offset_ms: i64,
}

impl Injector<'_, '_> {
    pub(super) fn inject(&mut self, kind: Kind) -> String {
        let world = self.world;
        world.count(kind.label());
        let from = now_us();
        match kind {
            Kind::Kill9 => kill9(world, &mut self.rng),
            Kind::Zombie => zombie(world, &mut self.rng),
            Kind::ClientKill => {
                let killed: i64 = self
                    .redis
                    .cmd(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
                world.event(What::Fault(kind), None, from, String::new());
                format!("{killed} connections killed")
            }
            Kind::RedisTerm | Kind::RedisKill => {
                let signal = if kind == Kind::RedisTerm {
                    Signal::Term
                } else {
                    Signal::Kill
                };
                self.redis.stop(signal);
                let down = self.rng.ms(0, 1000);
                std::thread::sleep(down);
                self.redis.restart();
                world.event(What::Fault(kind), None, from, String::new());
                format!(
                    "redis-server stopped ({signal:?}), down {:.1} s, restarted on its AOF",
                    down.as_secs_f64()
                )
            }
            Kind::RedisStall => {
                let stall = self.rng.ms(1500, 2500);
                let how = if self.rng.coin() {
                    world.count("stalls (SIGSTOP)");
                    self.redis.pause();
                    std::thread::sleep(stall);
                    self.redis.resume();
                    "redis-server SIGSTOPped"
                } else {
                    world.count("stalls (proxy)");
                    let rule = self.proxy.add(Fault::Stall { duration: stall });
                    std::thread::sleep(stall);
                    rule.remove();
                    "the proxy held all traffic"
                };
                world.event(What::Fault(kind), None, from, how.to_string());
                format!("{how} for {:.1} s", stall.as_secs_f64())
            }
            Kind::RollingConfig => match self.on_b.take() {
                Some((slot, _)) => {
                    change_config(world, slot, Shape::A, What::Fault(Kind::RollingConfig))
                }
                None => {
                    let slot = self.rng.below(DAEMONS as u64) as usize;
                    self.on_b = Some((slot, 2 + self.rng.below(5)));
                    change_config(world, slot, Shape::B, What::Fault(Kind::RollingConfig))
                }
            },
            Kind::RedisEmpty => self.empty_redis(),
            Kind::RedisRewind => self.rewind_redis(),
            Kind::DelayedReply | Kind::LateRequest => self.hold_a_call(kind),
            Kind::ClockForward | Kind::ClockBack => {
                let step = if kind == Kind::ClockForward {
                    self.rng.ms(3000, 6000).as_millis() as i64
                } else {
                    -(self.rng.ms(1000, 3000).as_millis() as i64)
                };
                self.clock_offset_ms += step;
                self.redis.set_clock_offset(self.clock_offset_ms);
                world.add(&format!("{} ms", kind.label()), step.unsigned_abs());
                // A forward step expires every lease at once: the daemons learn it at their next claim or renewal, and
                // the monitors defer their recoveries for a lease; runs again within that time are its doing.
                let until = if kind == Kind::ClockForward {
                    from + 2 * LEASE.as_micros() as u64
                } else {
                    now_us()
                };
                world.event_until(
                    What::Fault(kind),
                    None,
                    (from, until),
                    format!("{step:+} ms"),
                );
                format!(
                    "redis-server's clock stepped {step:+} ms, now {:+} ms off",
                    self.clock_offset_ms
                )
            }
            Kind::Slowloris => self.slowloris(),
            Kind::PoisonPill => {
                let queue = self.rng.pick(&Queue::ALL);
                let ids = world.new_tasks(&mut self.rng, queue, 1, |rng| {
                    (queue.pick_type(rng), Work::Pill)
                });
                let _gate = world.gate.read().unwrap();
                world.push(&self.client, &ids);
                format!("pushed {}", ids[0])
            }
            Kind::DeafHandlers => {
                let count = 1 + self.rng.below(3) as usize;
                let queue = self.rng.pick(&Queue::ALL);
                let ids = world.new_tasks(&mut self.rng, queue, count, |rng| {
                    (queue.pick_type(rng), Work::Deaf)
                });
                let _gate = world.gate.read().unwrap();
                world.push(&self.client, &ids);
                format!("pushed {}", ids.join(" "))
            }
        }
    }

    /// A call for the proxy faults to act on: the daemons' claims, settles (settle.lua's, and handover_plain.lua's,
    /// which the `limited` queue's acknowledgements at its limit go to) and renewals, the producers' pushes, or
    /// default mode's plain pops (a transaction, answered by its EXEC). Returns its name and a matcher.
    fn pick_call(&mut self) -> (&'static str, Matcher) {
        match self.rng.below(6) {
            0 => ("a claim (claim_plain.lua or claim.lua)", Matcher::claims()),
            1 => ("settle.lua", Matcher::script(sources::SETTLE)),
            2 => ("renew.lua", Matcher::script(sources::RENEW)),
            3 => ("push.lua", Matcher::script(kmqd::broker::PUSH_SCRIPT)),
            4 => ("plain pop (EXEC)", Matcher::command("EXEC")),
            _ => (
                "handover_plain.lua",
                Matcher::script(sources::HANDOVER_PLAIN),
            ),
        }
    }

    /// Holds one call in the proxy: its reply 200 to 900 ms (a delayed reply: the call ran, its caller learns of it
    /// late, within `io_timeout`), or its request 1.2 to 2.5 s (a late request: its caller gives up after
    /// `io_timeout` and sends it again; the held copy still reaches Redis after the connection was closed, and runs
    /// there). Waits for what was held to be delivered, so that its effects come before the next fault.
    fn hold_a_call(&mut self, kind: Kind) -> String {
        let from = now_us();
        let (name, matching) = self.pick_call();
        let nth = 1 + self.rng.below(5) as usize;
        let (fault, delay, counter) = if kind == Kind::DelayedReply {
            let delay = self.rng.ms(200, 900);
            let fault = Fault::DelayReply {
                matching,
                nth,
                delay,
            };
            (fault, delay, "delayed reply")
        } else {
            let delay = self.rng.ms(1200, 2500);
            let fault = Fault::DelayRequest {
                matching,
                nth,
                delay,
                survive_close: true,
            };
            (fault, delay, "late request")
        };
        let rule = self.proxy.add(fault);
        let fired = fired_within(&rule, Duration::from_secs(3));
        if fired {
            self.world.count(&format!("{counter}: {name}"));
            std::thread::sleep(delay + Duration::from_millis(200));
        }
        rule.remove();
        self.world
            .event(What::Fault(kind), None, from, name.to_string());
        match (fired, kind) {
            (false, _) => format!("no {name} in 3 s: nothing held"),
            (true, Kind::DelayedReply) => format!(
                "the reply of a {name} (number {nth} after the fault) held {} ms",
                delay.as_millis()
            ),
            (true, _) => format!(
                "a {name} (number {nth} after the fault) reached Redis {} ms late",
                delay.as_millis()
            ),
        }
    }

    /// Counts down the faults the slot on config B stays there, and puts it back on A when they are over.
    pub(super) fn before_next_fault(&mut self) {
        match self.on_b {
            Some((slot, 0)) => {
                self.on_b = None;
                self.world.count(Kind::RollingConfig.label());
                let what =
                    change_config(self.world, slot, Shape::A, What::Fault(Kind::RollingConfig));
                self.world.say(&format!("config change back: {what}"));
            }
            Some((slot, left)) => self.on_b = Some((slot, left - 1)),
            None => {}
        }
    }

    /// Puts the slot on config B, if any, back on A: the end of the faults.
    pub(super) fn back_on_a(&mut self) {
        if let Some((slot, _)) = self.on_b.take() {
            self.world.count(Kind::RollingConfig.label());
            let what = change_config(self.world, slot, Shape::A, What::Fault(Kind::RollingConfig));
            self.world.say(&format!("config change back: {what}"));
        }
    }
}

/// Waits at most `within` for a one-shot proxy fault to act; whether it did.
fn fired_within(rule: &Rule, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while rule.fired() == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    rule.fired() > 0
}

/// Which fault comes next, and when: every kind once, in a random order; then random kinds by weight, a fault
/// every 1 to 3 s. The schedule (gaps and kinds) has its own generator, two draws per fault, so that a seed replays
/// the same sequence of faults however long each takes on this run.
pub(super) struct Schedule {
    rng: Rng,
    /// The kinds that have not had their first turn yet, the next one last.
    first: Vec<Kind>,
    total_weight: u64,
}

impl Schedule {
    pub(super) fn new(mut rng: Rng) -> Schedule {
        let mut first: Vec<Kind> = FAULTS.iter().map(|(kind, _, _)| *kind).collect();
        for i in (1..first.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            first.swap(i, j);
        }
        first.reverse();
        Schedule {
            rng,
            first,
            total_weight: FAULTS.iter().map(|(_, weight, _)| weight).sum(),
        }
    }

    /// The gap to wait before the next fault, and its kind.
    pub(super) fn next(&mut self) -> (Duration, Kind) {
        let gap = self.rng.ms(1000, 3000);
        let draw = self.rng.next();
        let kind = self.first.pop().unwrap_or_else(|| {
            let mut pick = draw % self.total_weight;
            FAULTS
                .iter()
                .find(|(_, weight, _)| {
                    if pick < *weight {
                        true
                    } else {
                        pick -= weight;
                        false
                    }
                })
                .unwrap()
                .0
        });
        (gap, kind)
    }

    /// The kinds that did not get their first turn.
    pub(super) fn never_injected(&self) -> &[Kind] {
        &self.first
    }
}
