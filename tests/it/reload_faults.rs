//! Reloading while Redis fails (docs/RELIABILITY.md, "Faults", the reload rows): the real binary, through the
//! fault proxy, sent SIGHUP while Redis is stalled, while its connections are refused, or while a reply of the
//! replaced lane is lost. Safe mode promises the same as with Redis healthy: no task lost, none run twice, none
//! left in the processing area, and the replaced lane's owner released.
//!
//! Every test starts from two tasks running, held by a gate (a file) the test opens, and a backlog behind them,
//! partly claimed (waiting for a worker), the rest ready. The lease is far longer than a test, so a task stranded in the
//! processing area would wait for it and fail the test rather than come back through a monitor.

use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use kmqd::broker::sources;

use crate::reload::{reload, start, stop, wait_logged};
use crate::support::proxy::{AfterDrop, Fault, FaultProxy, Matcher};
use crate::support::*;

/// Two workers and room for four tasks waiting: the reload makes it three workers, a new lane.
const QUEUE: &str = "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 2\nprefetch = 4\n\
                     lease_timeout = \"60s\"\n";
/// The tasks running at the reload (held by the gate).
const HELD: usize = 2;
/// The backlog behind them: four claimed, the rest ready.
const BACKLOG: usize = 20;

/// A daemon serving `jobs` through a fault proxy, with the held tasks running.
struct Reloading {
    redis: RedisServer,
    proxy: FaultProxy,
    dir: TestDir,
    /// The daemon's config, through the proxy.
    config: PathBuf,
    /// The test's own, straight to Redis (a stall or a cut must not hold up the test's reads), its client made
    /// once for the many polls.
    direct: PathBuf,
    producer: kmqd::Client,
    gate: PathBuf,
    daemon: Process,
}

impl Reloading {
    /// Starts the daemon (`io_timeout` bounds each call through the proxy) and the held tasks.
    fn start(io_timeout: &str) -> Reloading {
        let redis = RedisServer::start();
        let proxy = FaultProxy::start(&redis);
        let dir = TestDir::new();
        let redis_keys = format!(
            "url = \"{}\"\nio_timeout = \"{io_timeout}\"\nconnect_timeout = \"1s\"",
            proxy.url()
        );
        let config = dir.config_raw(&redis_keys, "shutdown_grace = \"5s\"", QUEUE);
        let direct = dir.config_named(
            "direct.toml",
            &format!("url = \"{}\"", redis.url()),
            "",
            QUEUE,
            &dir.record_file(),
        );
        let daemon = start(&dir, &config);
        let gate = dir.path("gate");
        let held = format!(r#"{{"wait_for_file":"{}"}}"#, gate.display());
        push_many(&direct, "held", HELD, &held);
        eventually(Duration::from_secs(20), "the held tasks to run", || {
            let records = dir.records();
            (records.starts.len() == HELD, records)
        });
        Reloading {
            redis,
            proxy,
            dir,
            config,
            producer: client(&direct),
            direct,
            gate,
            daemon,
        }
    }

    /// Pushes the backlog and waits until the lane is full: the held tasks running, four claimed waiting.
    fn backlog(&self) {
        self.push_backlog();
        eventually(Duration::from_secs(20), "the lane to be full", || {
            let stats = self.stats();
            (stats.processing == 6, stats)
        });
    }

    fn push_backlog(&self) {
        push_many(&self.direct, "t", BACKLOG, r#"{"sleep_ms":10}"#);
    }

    /// Waits until the backlog is done while the held tasks still run: the four the replaced lane had claimed were
    /// handed back and ran on the new lane, as did the rest.
    fn wait_backlog_done(&self) {
        eventually(Duration::from_secs(20), "the backlog to be done", || {
            let stats = self.stats();
            (
                stats.done == BACKLOG as u64,
                (stats, self.daemon.log_text()),
            )
        });
    }

    fn stats(&self) -> kmqd::broker::QueueStats {
        self.producer.stats("jobs").unwrap()
    }

    /// The owner registered for `jobs` now (there is one).
    fn owner(&self) -> String {
        let owners = self.owners();
        let [owner] = &owners[..] else {
            panic!("one owner: {owners:?}")
        };
        owner.clone()
    }

    fn owners(&self) -> Vec<String> {
        self.redis.cmd(&["ZRANGE", "kmq:{jobs}:owners", "0", "-1"])
    }

    /// Writes the config with three workers and sends SIGHUP; returns once the reload is applied.
    fn reload(&self) {
        let text = fs::read_to_string(&self.config).unwrap();
        fs::write(&self.config, text.replace("workers = 2", "workers = 3")).unwrap();
        let log = reload(&self.daemon, 1);
        assert!(
            log.contains("config reloaded: queues.jobs.workers 2 → 3"),
            "{log}"
        );
    }

    /// Lets the held tasks finish.
    fn open_gate(&self) {
        fs::write(&self.gate, "").unwrap();
    }

    /// Waits until every task is done, then checks that each ran once, that nothing is left in Redis nor came back
    /// through a lease, and that the replaced lane's owner `old` is released. Returns the daemon's log.
    fn assert_each_done_once(&self, old: &str) -> String {
        let total = (HELD + BACKLOG) as u64;
        let stats = eventually(Duration::from_secs(20), "every task done", || {
            let stats = self.stats();
            let settled = stats.done >= total && stats.ready == 0 && stats.processing == 0;
            (settled, (stats, self.daemon.log_text()))
        })
        .0;
        assert_eq!(
            (stats.done, stats.dead, stats.retried, stats.recovered),
            (total, 0, 0, 0),
            "{stats:?}"
        );
        let records = self.dir.records();
        for id in (0..HELD)
            .map(|i| format!("held{i}"))
            .chain((0..BACKLOG).map(|i| format!("t{i}")))
        {
            assert_eq!(records.runs_of(&id), 1, "{id}: {records:?}");
        }
        assert_eq!(records.ends.len(), total as usize, "every run returned");
        // Its last settle is in Redis a moment before the supervisor learns that its acker stopped.
        let log = wait_logged(
            &self.daemon,
            "the replaced lane settled everything and stopped",
            1,
        );
        let owners = self.owners();
        assert!(
            owners.len() == 1 && owners[0] != old,
            "the old owner {old} released, the new lane's serving: {owners:?}\n{log}"
        );
        log
    }

    /// SIGTERM: the daemon exits 0.
    fn stop(self) {
        stop(self.daemon);
    }
}

#[test]
fn a_reload_while_redis_stalls_loses_and_reruns_no_task() {
    let reloading = Reloading::start("1s");
    reloading.backlog();
    let old = reloading.owner();
    // Every byte held both ways for 4 s, past the 1 s read timeout: the replaced lane's hand-backs and last
    // settles time out and are sent again as the same calls, its owner's draining mark is given up, the new lane
    // waits to register.
    let stall = reloading.proxy.add(Fault::Stall {
        duration: Duration::from_secs(4),
    });
    reloading.reload();
    reloading.open_gate();
    eventually(Duration::from_secs(10), "the stall to hold traffic", || {
        (stall.fired() > 0, stall.fired())
    });
    reloading.assert_each_done_once(&old);
    reloading.stop();
}

#[test]
fn a_reload_while_redis_refuses_connections_loses_and_reruns_no_task() {
    let reloading = Reloading::start("1s");
    reloading.backlog();
    let old = reloading.owner();
    // The first release of the replaced lane's owner never reaches Redis: it is tried again on a new connection.
    let release = reloading.proxy.add(Fault::DropRequest {
        matching: Matcher::script(sources::RELEASE),
        nth: 1,
        then: AfterDrop::Close,
    });
    reloading.proxy.refuse(true);
    reloading.reload();
    reloading.open_gate();
    // Held off until both lanes met the refusal: the old one's settles, the new one's registration.
    eventually(
        Duration::from_secs(15),
        "settles and the registration to fail",
        || {
            let log = reloading.daemon.log_text();
            let since = &log[log.find("config reloaded").unwrap_or(log.len())..];
            // The replaced lane's fetcher stopped without a call: this is the new lane's.
            let failed = since.contains("cannot settle outcomes")
                && since.contains("fetching tasks: Redis not reached");
            (failed, log)
        },
    );
    reloading.proxy.refuse(false);
    eventually(Duration::from_secs(20), "the release to be dropped", || {
        (release.fired() == 1, ())
    });
    reloading.assert_each_done_once(&old);
    reloading.stop();
}

/// Settle calls for the owner `owner` (one of their arguments) that carry a hand-back (op `back`), or none.
fn settles_of(owner: &str, hand_back: bool) -> Matcher {
    let settle = Matcher::script(sources::SETTLE);
    let owner = owner.as_bytes().to_vec();
    Matcher::new(move |args| {
        settle.matches(args)
            && args.contains(&owner)
            && args.iter().any(|arg| arg == b"back") == hand_back
    })
}

#[test]
fn a_reload_whose_hand_back_and_last_settle_replies_are_lost_loses_and_reruns_no_task() {
    let reloading = Reloading::start("1s");
    reloading.backlog();
    let old = reloading.owner();
    // The replaced lane's hand-back of its four waiting tasks runs in Redis, and its answer is lost with the
    // connection; the settle of its last two runs runs too, and its connection goes silent. Each is sent again
    // as the same call, which Redis answers without applying it twice.
    let hand_back = reloading.proxy.add(Fault::DropReply {
        matching: settles_of(&old, true),
        nth: 1,
        then: AfterDrop::Close,
    });
    let last = reloading.proxy.add(Fault::DropReply {
        matching: settles_of(&old, false),
        nth: 1,
        then: AfterDrop::Hang,
    });
    reloading.reload();
    // Every hand-back applied (the backlog ran on the new lane) before the held runs end: their settle carries
    // no hand-back.
    reloading.wait_backlog_done();
    assert_eq!(hand_back.fired(), 1);
    reloading.open_gate();
    eventually(
        Duration::from_secs(20),
        "the last settle's reply to be dropped",
        || (last.fired() == 1, reloading.daemon.log_text()),
    );
    reloading.assert_each_done_once(&old);
    reloading.stop();
}

#[test]
fn a_claim_whose_reply_is_lost_as_the_reload_retires_its_lane_is_adopted_and_handed_back() {
    // A read timeout long enough for the reload to land while the claim waits for its reply.
    let reloading = Reloading::start("3s");
    let old = reloading.owner();
    // The replaced lane's last claim takes four tasks in Redis; its answer never comes.
    let claim = reloading.proxy.add(Fault::DropReply {
        matching: Matcher::claims(),
        nth: 1,
        then: AfterDrop::Hang,
    });
    reloading.push_backlog();
    eventually(
        Duration::from_secs(20),
        "the claim's reply to be dropped",
        || (claim.fired() == 1, ()),
    );
    reloading.reload();
    reloading.open_gate();
    let log = reloading.assert_each_done_once(&old);
    let adopted = log.find("a claim's reply was lost; the tasks it took are held now");
    assert!(
        adopted.is_some() && log.find("SIGHUP: reloading") < adopted,
        "the reload retired the lane while the claim waited for its reply, and the lane adopted it: {log}"
    );
    reloading.stop();
}

#[test]
fn a_reload_hands_back_the_waiting_tasks_at_once_not_after_the_running_ones() {
    let reloading = Reloading::start("1s");
    reloading.backlog();
    let old = reloading.owner();
    reloading.reload();
    reloading.wait_backlog_done();
    reloading.open_gate();
    reloading.assert_each_done_once(&old);
    reloading.stop();
}

/// Review I3: the owners of a reload's replaced lanes are released off the supervisor's thread. Every try of
/// their release is lost here (its connection goes silent, and each waits out `io_timeout`, 10 s, before the
/// next): three lanes, three tries each, 90 s of Redis calls. A SIGTERM sent while the first try waits is acted
/// upon within one `io_timeout` (released on the supervisor's thread, it waited for the three tries of at least
/// one lane, 30 s), and the daemon exits 0 within a bound of its own, not after the 90 s.
#[test]
fn a_sigterm_while_replaced_lanes_owners_cannot_be_released_is_acted_upon_at_once() {
    const IO_TIMEOUT: Duration = Duration::from_secs(10);
    const LANES: usize = 3;
    const SIGTERM: i32 = 15;
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let queues: String = (1..=LANES)
        .map(|i| format!("[[queues]]\nname = \"q{i}\"\nmode = \"safe\"\nworkers = 1\n"))
        .collect();
    let redis_keys = format!(
        "url = \"{}\"\nio_timeout = \"{}s\"\nconnect_timeout = \"1s\"",
        proxy.url(),
        IO_TIMEOUT.as_secs()
    );
    let config = dir.config_raw(&redis_keys, "", &queues);
    let mut daemon = start(&dir, &config);
    // A release begins with an HSCAN of the queue's unique-popped hash (`broker::release_unique`); nothing else
    // of an idle daemon sends one.
    let unique_popped_scan = Matcher::new(|args| {
        args.first()
            .is_some_and(|name| name.eq_ignore_ascii_case(b"HSCAN"))
            && args
                .get(1)
                .is_some_and(|key| key.ends_with(b":unique-popped"))
    });
    // Each rule loses one of them, the nth from now: three tries of each lane's release.
    let lost: Vec<_> = (1..=3 * LANES)
        .map(|nth| {
            proxy.add(Fault::DropRequest {
                matching: unique_popped_scan.clone(),
                nth,
                then: AfterDrop::Hang,
            })
        })
        .collect();
    let text = fs::read_to_string(&config).unwrap();
    fs::write(&config, text.replace("workers = 1", "workers = 2")).unwrap();
    let log = reload(&daemon, 1);
    assert!(log.contains("config reloaded: "), "{log}");
    eventually(
        Duration::from_secs(30),
        "a replaced lane's first release to be lost",
        || (lost[0].fired() == 1, daemon.log_text()),
    );
    daemon.signal(SIGTERM);
    eventually(IO_TIMEOUT, "the supervisor to act on the SIGTERM", || {
        let log = daemon.log_text();
        (log.contains("stopping: no new tasks are taken"), log)
    });
    assert_eq!(
        daemon.wait_within(Duration::from_secs(60)),
        Some(0),
        "{}",
        daemon.log_text()
    );
}
