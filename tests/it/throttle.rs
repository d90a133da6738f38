//! Back-pressure from a handler (`Outcome::Throttle`: its upstream said 429): the task goes back uncharged, and
//! no daemon takes a task of the queue until the throttle ends (docs/HANDLERS.md, "Back-pressure";
//! docs/RELIABILITY.md, "Throttles").

use std::path::Path;
use std::time::Duration;

use crate::support::*;

/// How long the first task throttles the queue.
const THROTTLE: Duration = Duration::from_millis(1500);

/// Pushes `first0`, which throttles the queue once for [`THROTTLE`], waits until its throttle is in Redis, then
/// pushes `then` tasks with `data`; waits until all are done. Returns the µs `first0`'s first run started at.
fn throttle_then_push(config: &Path, dir: &TestDir, then: usize, data: &str) -> u64 {
    let marker = dir.path("throttled-once");
    let first =
        serde_json::json!({ "throttle_once": marker, "throttle_ms": THROTTLE.as_millis() as u64 });
    push_many(config, "first", 1, &first.to_string());
    // The counter, not the key: on a slow machine the key may be gone by the time this looks.
    eventually(Duration::from_secs(30), "the throttle settled", || {
        let s = stats(config, "jobs");
        (s.throttled == 1, s)
    });
    push_many(config, "t", then, data);
    wait_done(config, then as u64 + 1, Duration::from_secs(60));
    let records = dir.records();
    let (_, started) = records.start_times[0].clone();
    assert_eq!(records.start_times[0].0, "first0", "{:?}", records.starts);
    started
}

/// The runs that started before `at` µs, other than `first0`'s first.
fn started_before(dir: &TestDir, at: u64) -> Vec<(String, u64)> {
    dir.records()
        .start_times
        .into_iter()
        .skip(1)
        .filter(|(_, micros)| *micros < at)
        .collect()
}

#[test]
fn a_throttle_holds_every_daemon_back_and_the_task_comes_back_uncharged() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("workers = 4\nidle_poll = \"100ms\""));
    let (a, b) = (TestDaemon::start(&config), TestDaemon::start(&config));
    let started = throttle_then_push(&config, &dir, 6, "7");
    // The throttle was set by the settle after the run, so it ends after `started + THROTTLE`: nothing may
    // start before, on either daemon (a slower machine only starts them later).
    let end = started + THROTTLE.as_micros() as u64;
    assert_eq!(started_before(&dir, end), [], "started while throttled");
    let records = dir.records();
    assert_eq!(
        records
            .starts
            .iter()
            .filter(|(id, _)| id == "first0")
            .collect::<Vec<_>>(),
        [&("first0".to_string(), 0), &("first0".to_string(), 0)],
        "throttled, then run again at the same attempt"
    );
    let s = stats(&config, "jobs");
    assert_eq!(
        (s.done, s.throttled, s.retried, s.failed, s.dead_lettered),
        (7, 1, 0, 0, 0),
        "{s:?}"
    );
    let ttl: i64 = redis.cmd(&["PTTL", "kmq:{jobs}:throttle:q"]);
    assert_eq!(ttl, -2, "the throttle expired with its time");
    a.stop();
    b.stop();
}

#[test]
fn a_default_mode_throttle_holds_pops_back_until_it_ends() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &default_queue("workers = 2\nidle_poll = \"100ms\""));
    let daemon = TestDaemon::start(&config);
    let started = throttle_then_push(&config, &dir, 6, "7");
    let end = started + THROTTLE.as_micros() as u64;
    assert_eq!(started_before(&dir, end), [], "popped while throttled");
    assert_eq!(dir.records().runs_of("first0"), 2);
    let s = stats(&config, "jobs");
    assert_eq!((s.done, s.throttled, s.retried), (7, 1, 0), "{s:?}");
    daemon.stop();
}

/// Default mode pops a backlog with a plain `LMPOP` (no script) once pops are big: the plain pop checks the
/// throttle too. Tasks popped before the throttle landed still run; the rest wait in Redis.
#[test]
fn a_throttle_holds_a_backlogs_plain_pops_back() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &default_queue("workers = 32\nprefetch = 64\nidle_poll = \"100ms\""),
    );
    let marker = dir.path("throttled-once");
    let first = serde_json::json!({
        "throttle_once": marker,
        "throttle_ms": THROTTLE.as_millis() as u64,
        "sleep_ms": 100,
    });
    // A backlog big enough for plain pops, with the throttling task near its head: 32 workers run about 1,600
    // of these 20 ms tasks a second, so most of `b` is still in Redis when it throttles.
    push_many(&config, "a", 100, r#"{"sleep_ms":20}"#);
    push_many(&config, "first", 1, &first.to_string());
    push_many(&config, "b", 1000, r#"{"sleep_ms":20}"#);
    let daemon = TestDaemon::start(&config);
    wait_done(&config, 1101, Duration::from_secs(120));
    let records = dir.records();
    let started = records
        .start_times
        .iter()
        .find(|(run, _)| run == "first0")
        .map(|(_, micros)| *micros)
        .unwrap();
    // From when its settle surely landed (its run, plus 50 ms) to when the throttle surely ended.
    let (from, end) = (
        started + 150_000,
        started + 100_000 + THROTTLE.as_micros() as u64,
    );
    let b = |micros: &u64| {
        records
            .start_times
            .iter()
            .filter(|(id, at)| id.starts_with('b') && at < micros)
            .count()
    };
    // What the daemon held (at most workers + prefetch) and a pop in flight when the throttle landed may start;
    // without the check the rest of the backlog would.
    let during = b(&end) - b(&from);
    assert!(
        during <= 2 * (32 + 64),
        "{during} tasks started while the queue was throttled"
    );
    assert!(
        1000 - b(&end) >= 300,
        "the backlog ran out before the throttle ended: the test shows nothing ({} left)",
        1000 - b(&end)
    );
    let s = stats(&config, "jobs");
    assert_eq!((s.done, s.throttled, s.retried), (1101, 1, 0), "{s:?}");
    daemon.stop();
}
