//! Redis itself failing: down at start, refusing the credentials, gone mid-run, connections killed, restarted
//! (with and without its data), stalled past the read timeout. The daemon waits and reconnects, never exits for
//! it, never floods the log, and loses nothing safe mode promises.

use std::time::{Duration, Instant};

use crate::support::proxy::{Fault, FaultProxy};
use crate::support::*;

fn lines_containing(text: &str, needle: &str) -> usize {
    text.lines().filter(|line| line.contains(needle)).count()
}

/// Every pushed task ran at least once and is counted done exactly once.
fn assert_all_done_once(dir: &TestDir, config: &std::path::Path, prefix: &str, count: usize) {
    let s = stats(config, "jobs");
    assert_eq!(
        (s.done, s.dead, s.ready, s.processing),
        (count as u64, 0, 0, 0),
        "{s:?}"
    );
    let records = dir.records();
    for i in 0..count {
        let id = format!("{prefix}{i}");
        assert!(records.runs_of(&id) >= 1, "{id} never ran");
    }
}

#[test]
fn redis_down_at_start_is_waited_for_with_one_log_line() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    proxy.refuse(true);
    let dir = TestDir::new();
    let config = dir.config_for_url(&proxy.url(), "shutdown_grace = \"5s\"", &safe_queue(""));
    let mut daemon = Process::start(&config, dir.path("kmqd.log"));
    eventually(
        Duration::from_secs(10),
        "the first failure to be logged",
        || (daemon.log_text().contains("Redis unreachable"), ()),
    );
    // Several seconds of refused connections: the daemon waits, and says so once.
    let waiting_since = Instant::now();
    while waiting_since.elapsed() < Duration::from_secs(3) {
        assert!(
            daemon.child.try_wait().unwrap().is_none(),
            "exited: {}",
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = daemon.log_text();
    assert_eq!(lines_containing(&log, "Redis unreachable"), 1, "{log}");
    assert!(
        log.contains(&format!("server={}", proxy.url())),
        "the line names the server: {log}"
    );
    proxy.refuse(false);
    push_many(&config, "t", 5, "{}");
    eventually(
        Duration::from_secs(15),
        "the tasks to run once Redis is up",
        || {
            let s = stats(&config, "jobs");
            (s.done == 5, s)
        },
    );
    assert_eq!(
        lines_containing(&daemon.log_text(), "Redis reachable again"),
        1,
        "{}",
        daemon.log_text()
    );
    daemon.signal(15);
    assert_eq!(daemon.wait_within(Duration::from_secs(20)), Some(0));
}

#[test]
fn wrong_credentials_exit_2_with_the_reason() {
    let redis = RedisServer::start();
    let _: String = redis.cmd(&["CONFIG", "SET", "requirepass", "s3cret"]);
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue(""));
    let (code, _, stderr) = kmqd(&["--config", config.to_str().unwrap()], None);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("redis refused kmqd's credentials"),
        "{stderr}"
    );
}

#[test]
fn redis_gone_mid_run_is_one_line_when_it_goes_and_one_when_it_is_back() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let config = dir.config_for_url(&proxy.url(), "shutdown_grace = \"5s\"", &safe_queue(""));
    let mut daemon = Process::start(&config, dir.path("kmqd.log"));
    eventually(Duration::from_secs(10), "the daemon to start", || {
        (daemon.log_text().contains("kmqd started"), ())
    });
    let before = daemon.log_text().lines().count();
    proxy.refuse(true);
    let down_since = Instant::now();
    while down_since.elapsed() < Duration::from_secs(4) {
        assert!(
            daemon.child.try_wait().unwrap().is_none(),
            "exited: {}",
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    proxy.refuse(false);
    push_many(&config, "t", 10, "{}");
    eventually(Duration::from_secs(15), "the tasks to run after", || {
        let s = stats(&config, "jobs");
        (s.done == 10, s)
    });
    // The outage ends with the next call of a thread that failed (the delay poller, the monitor, ...), which may
    // still be waiting out its backoff when the tasks, claimed by a thread that never failed, are done.
    eventually(
        Duration::from_secs(15),
        "the line that Redis is back",
        || {
            let log = daemon.log_text();
            (log.contains("Redis reachable again"), log)
        },
    );
    let log = daemon.log_text();
    let during: Vec<&str> = log.lines().skip(before).collect();
    // The daemon's outage, not each thread's (fetch, settle, renew, recover, delay, listener: 6 lines a
    // failure, and 40 a second before that): one line naming the server, one when it is back.
    let said = |needle: &str| during.iter().filter(|l| l.contains(needle)).count();
    assert_eq!(
        (
            said("Redis unreachable"),
            said("failed"),
            said("Redis reachable again")
        ),
        (1, 0, 1),
        "in 4 s of refused connections:\n{}",
        during.join("\n")
    );
    let first = during
        .iter()
        .find(|l| l.contains("Redis unreachable"))
        .unwrap();
    assert!(
        first.contains(&format!("server={}", proxy.url())),
        "{first}"
    );
    daemon.signal(15);
    assert_eq!(daemon.wait_within(Duration::from_secs(20)), Some(0));
}

#[test]
fn a_drain_under_client_kill_loses_nothing_and_keeps_going() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &safe_queue("workers = 4\nbatch = 100\nprefetch = 200"),
    );
    // Each task takes a millisecond: the drain outlasts many kills.
    push_many(&config, "k", 5000, r#"{"sleep_ms":1}"#);
    let daemon = TestDaemon::start(&config);
    let mut kills = 0;
    let s = eventually(Duration::from_secs(60), "the drain to end", || {
        // Every 50 ms every client but this one is disconnected.
        let _: i64 = redis.cmd(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
        kills += 1;
        std::thread::sleep(Duration::from_millis(50));
        let s = stats(&config, "jobs");
        (s.done == 5000, s)
    });
    daemon.stop();
    assert!(kills > 3, "the drain outlasted several kills: {kills}");
    assert_eq!((s.dead, s.processing, s.ready), (0, 0, 0), "{s:?}");
    assert_all_done_once(&dir, &config, "k", 5000);
}

#[test]
fn a_redis_restarted_with_its_append_only_file_loses_nothing() {
    for signal in [Signal::Term, Signal::Kill] {
        let mut redis = RedisServer::with_aof(Fsync::Always);
        let dir = TestDir::new();
        let config = dir.config_raw(
            &format!("url = \"{}\"\nio_timeout = \"1s\"", redis.url()),
            "shutdown_grace = \"5s\"",
            &safe_queue("workers = 4\nlease_timeout = \"2s\""),
        );
        push_many(&config, "a", 1000, r#"{"sleep_ms":2}"#);
        let daemon = TestDaemon::start(&config);
        eventually(Duration::from_secs(30), "progress", || {
            let s = stats(&config, "jobs");
            (s.done >= 200, s)
        });
        redis.stop(signal);
        redis.restart();
        let s = eventually(Duration::from_secs(60), "the drain to end", || {
            let s = stats(&config, "jobs");
            (s.done >= 1000 && s.processing == 0, s)
        });
        daemon.stop();
        assert_eq!((s.done, s.dead, s.ready), (1000, 0, 0), "{signal:?}: {s:?}");
        assert_all_done_once(&dir, &config, "a", 1000);
    }
}

#[test]
fn a_redis_stalled_past_the_read_timeout_loses_nothing() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let config = dir.config_raw(
        &format!("url = \"{}\"\nio_timeout = \"500ms\"", proxy.url()),
        "shutdown_grace = \"5s\"",
        &safe_queue("workers = 4\nlease_timeout = \"10s\""),
    );
    push_many(&config, "s", 1000, r#"{"sleep_ms":1}"#);
    let daemon = TestDaemon::start(&config);
    for _ in 0..3 {
        eventually(Duration::from_secs(30), "progress between stalls", || {
            let s = stats(&config, "jobs");
            (s.done > 0, s)
        });
        let rule = proxy.add(Fault::Stall {
            duration: Duration::from_millis(1500),
        });
        eventually(
            Duration::from_secs(10),
            "the stall to hold something",
            || (rule.fired() > 0, ()),
        );
    }
    let s = eventually(Duration::from_secs(60), "the drain to end", || {
        let s = stats(&config, "jobs");
        (s.done >= 1000 && s.processing == 0, s)
    });
    daemon.stop();
    assert_eq!((s.done, s.dead), (1000, 0), "{s:?}");
    assert_all_done_once(&dir, &config, "s", 1000);
}

/// Redis going back in time (a failover to a replica that lagged, a restart that lost the last second of an
/// `appendfsync everysec` file, a restored backup) leaves the owner's claims as they were back then:
/// tasks the daemon settled long ago, which it will never settle again, under a lease it keeps renewing. The
/// owner's journal (renew.lua) finds it out: the owner is given up, and the monitor runs those tasks again.
/// The owners of `jobs` with their lease deadlines (ms), and Redis's clock (ms).
fn leases(redis: &RedisServer) -> (Vec<(String, u64)>, u64) {
    let owners: Vec<(String, u64)> =
        redis.cmd(&["ZRANGE", "kmq:{jobs}:owners", "0", "-1", "WITHSCORES"]);
    let (seconds, micros): (u64, u64) = redis.cmd(&["TIME"]);
    (owners, seconds * 1000 + micros / 1000)
}

#[test]
fn a_redis_that_went_back_in_time_under_load_gives_up_the_owner_so_the_tasks_it_forgot_run_again() {
    const TASKS: usize = 200_000;
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("lease_timeout = \"3s\"\nworkers = 4"));
    push_many(&config, "b", TASKS, "{}");
    let daemon = TestDaemon::start(&config);
    let owner = eventually(Duration::from_secs(10), "the drain to be under way", || {
        let (owners, _) = leases(&redis);
        let done = stats(&config, "jobs").done;
        match &owners[..] {
            [(owner, _)] if done > 0 => (true, Some(owner.clone())),
            _ => (false, None),
        }
    })
    .unwrap();
    // What a rewind leaves mid-drain, in one step: a claim Redis forgot was settled, and the owner's journal three
    // bumps behind what it acknowledged (the claim and settles it lost). The drain goes on: its claims and settles
    // lift Redis's journal past any value it acknowledged before, long before the next renewal.
    let info = format!("kmq:{{jobs}}:owner:{owner}");
    let claims = format!("kmq:{{jobs}}:processing:{owner}:normal");
    let envelope = r#"{"id":"forgotten","type":"test","data":{},"attempt":0}"#;
    let _: () = redis::pipe()
        .atomic()
        .cmd("RPUSH")
        .arg(format!("{claims}:999999999"))
        .arg(envelope)
        .ignore()
        .cmd("ZADD")
        .arg(&claims)
        .arg(1)
        .arg(999_999_999)
        .ignore()
        .cmd("HINCRBY")
        .arg(&info)
        .arg("journal")
        .arg(-3)
        .ignore()
        .query(&mut redis.connection())
        .unwrap();
    let at_rewind = stats(&config, "jobs").done;
    assert!(
        at_rewind < TASKS as u64 / 2,
        "the rewind came mid-drain: {at_rewind} done"
    );
    wait_done(&config, TASKS as u64, Duration::from_secs(120));
    eventually(Duration::from_secs(15), "the forgotten task to run", || {
        let runs = dir.records().runs_of("forgotten");
        (runs >= 1, runs)
    });
    // Three renewals more: nothing else is left under any lease, and the task ran once.
    std::thread::sleep(Duration::from_secs(3));
    let s = stats(&config, "jobs");
    let (owners, now) = leases(&redis);
    daemon.stop();
    assert_eq!(dir.records().runs_of("forgotten"), 1);
    assert_eq!((s.processing, s.ready), (0, 0), "{s:?}");
    assert!(
        !owners.iter().any(|(name, _)| *name == owner),
        "the owner was given up: {owners:?}"
    );
    assert!(
        matches!(&owners[..], [(_, lease)] if *lease > now),
        "one live owner: {owners:?} at {now}"
    );
}

#[test]
fn a_redis_that_went_back_in_time_gives_up_the_owner_so_the_tasks_it_forgot_run_again() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("lease_timeout = \"1s\""));
    let daemon = TestDaemon::start(&config);
    push_many(&config, "t", 3, "{}");
    wait_done(&config, 3, Duration::from_secs(10));
    let owners: Vec<String> = redis.cmd(&["ZRANGE", "kmq:{jobs}:owners", "0", "-1"]);
    let [owner] = &owners[..] else {
        panic!("one owner: {owners:?}")
    };
    let info = format!("kmq:{{jobs}}:owner:{owner}");
    let journal: i64 = redis.cmd(&["HGET", &info, "journal"]);
    assert!(journal >= 2, "a claim and a settle at least: {journal}");
    // What Redis held before the last writes: a task still claimed, and the journal of then.
    let envelope = r#"{"id":"forgotten","type":"test","data":{},"attempt":0}"#;
    let claims = format!("kmq:{{jobs}}:processing:{owner}:normal");
    let _: i64 = redis.cmd(&["RPUSH", &format!("{claims}:424242"), envelope]);
    let _: i64 = redis.cmd(&["ZADD", &claims, "1", "424242"]);
    let _: i64 = redis.cmd(&["HSET", &info, "journal", "1"]);
    eventually(Duration::from_secs(15), "the forgotten task ran", || {
        let runs = dir.records().runs_of("forgotten");
        (runs == 1, runs)
    });
    let s = wait_done(&config, 4, Duration::from_secs(10));
    assert_eq!((s.processing, s.recovered), (0, 1), "{s:?}");
    let owners: Vec<String> = redis.cmd(&["ZRANGE", "kmq:{jobs}:owners", "0", "-1"]);
    assert!(
        !owners.contains(owner),
        "the owner was given up: {owners:?}"
    );
    daemon.stop();
}

/// Review M3, what docs/RELIABILITY.md promises of default mode when Redis on `appendfsync everysec` dies with its
/// host and starts again on its append-only file without its last second: the pops of that second are undone
/// (their tasks run again: at most once holds only while Redis keeps its writes), the pushes of that second are
/// lost, and so are its settles (a retry never queued, `done` not counted). The lost second is made exactly: the
/// file is cut back to where it ended before it (the chaos suite's rewind, without its randomness).
#[test]
fn a_default_mode_task_popped_in_the_second_redis_lost_runs_again_and_that_seconds_pushes_and_settles_are_lost()
 {
    const KEPT: usize = 20;
    const LOST: usize = 5;
    let mut redis = RedisServer::start_with(RedisOptions {
        appendonly: Some(Fsync::Always),
        extra_args: vec!["--auto-aof-rewrite-percentage".into(), "0".into()],
        ..RedisOptions::default()
    });
    let dir = TestDir::new();
    // One task held at a time, so that the tasks pushed behind `r` wait in Redis until the mark.
    let config = dir.config(&redis, &default_queue("workers = 1\nprefetch = 0"));
    let gate = dir.path("gate");
    let daemon = TestDaemon::start(&config);
    let retry = serde_json::json!({
        "wait_for_file": gate, "outcome": "retry", "retry_after_ms": 600_000,
    });
    push_many(&config, "r", 1, &retry.to_string());
    eventually(Duration::from_secs(10), "r to start", || {
        (dir.records().runs_of("r0") == 1, ())
    });
    push_many(&config, "kept", KEPT, "{}");
    // Everything so far was fsynced before it was acknowledged (`always`): the mark is where the last second
    // begins. From here on Redis runs as production does, on `everysec`.
    let mark = redis.aof_mark();
    let _: () = redis.cmd(&["CONFIG", "SET", "appendfsync", "everysec"]);
    std::fs::write(&gate, "").unwrap();
    push_many(&config, "lost", LOST, "{}");
    let before = wait_done(&config, (KEPT + LOST) as u64, Duration::from_secs(30));
    assert_eq!(
        (before.pushed, before.retrying),
        ((1 + KEPT + LOST) as u64, 1),
        "{before:?}"
    );
    let cut = redis.crash_back_to(mark);
    assert!(cut > 0, "the last second's writes were in the file");
    let s = eventually(
        Duration::from_secs(30),
        "the kept tasks to run again",
        || {
            let s = stats(&config, "jobs");
            (
                s.done >= KEPT as u64 && s.ready == 0 && s.processing == 0,
                s,
            )
        },
    );
    daemon.stop();
    let records = dir.records();
    for i in 0..KEPT {
        assert_eq!(
            records.runs_of(&format!("kept{i}")),
            2,
            "kept{i}: its pop was undone"
        );
    }
    for i in 0..LOST {
        assert_eq!(
            records.runs_of(&format!("lost{i}")),
            1,
            "lost{i}: its push was lost"
        );
    }
    assert_eq!(records.runs_of("r0"), 1, "r's pop was kept, its retry lost");
    assert_eq!(
        (s.pushed, s.done, s.retried, s.retrying, s.ready, s.dead),
        ((1 + KEPT) as u64, KEPT as u64, 0, 0, 0, 0),
        "the pushes and settles of the lost second are not counted: {s:?}"
    );
}
