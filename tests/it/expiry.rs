//! Expiry (docs/PROTOCOL.md, "Expiry"): a task not started by its `expires_at` is dead-lettered unrun, with the
//! reason "expired" and its exact bytes, decided on Redis's clock, in both modes; a task started in time runs.

use std::time::Duration;

use kmqd::NewTask;

use crate::support::*;

fn queue(mode: &str) -> String {
    format!("[[queues]]\nname = \"jobs\"\nmode = \"{mode}\"\nworkers = 2\n")
}

fn redis_now_ms(redis: &RedisServer) -> i64 {
    let (seconds, micros): (i64, i64) = redis.cmd(&["TIME"]);
    seconds * 1000 + micros / 1000
}

/// The stored bytes of the task `id`: the ready list's element, or the delayed task's envelope.
fn stored(redis: &RedisServer, id: &str) -> String {
    let ready: Vec<String> = redis.cmd(&["LRANGE", "kmq:{jobs}:ready:normal", "0", "-1"]);
    let needle = format!(r#""id":"{id}""#);
    if let Some(task) = ready.into_iter().find(|task| task.contains(&needle)) {
        return task;
    }
    redis.cmd(&["HGET", "kmq:{jobs}:delayed-tasks", id])
}

/// Tasks pushed before any daemon runs (a backlog): one already expired, one that expires in an hour, one delayed
/// past its expiry and one delayed within it. The expired two are dead-lettered unrun with their bytes and the
/// reason "expired", the delayed one when it is due; the others run; nothing counts as failed.
fn expired_tasks_are_dead_lettered_unrun_and_the_others_run(mode: &str) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue(mode));
    let client = client(&config);
    let task = |id: &str| NewTask::new("test", r#"{"to":"ada"}"#).unwrap().id(id);
    let now_ms = redis_now_ms(&redis);
    let delay = Duration::from_millis(600);
    let tasks = [
        task("late").expires_at(now_ms - 1),
        task("live").expires_in(Duration::from_secs(3600)),
        task("late-delayed")
            .delay(delay)
            .expires_in(Duration::from_millis(200)),
        task("live-delayed")
            .delay(delay)
            .expires_in(Duration::from_secs(3600)),
    ];
    for task in tasks {
        assert!(client.push("jobs", task).unwrap().is_accepted());
    }
    let bytes = [stored(&redis, "late"), stored(&redis, "late-delayed")];
    assert!(
        bytes[1].contains(r#""expires_at":"#),
        "the envelope carries expires_at: {bytes:?}"
    );
    let daemon = TestDaemon::start(&config);
    let (dead, records) = eventually(
        Duration::from_secs(20),
        "two tasks run and two dead-lettered",
        || {
            let (dead, records) = (dead_records(&redis, "jobs"), dir.records());
            let over = dead.len() == 2 && records.runs_of("live") == 1;
            (
                over && records.runs_of("live-delayed") == 1,
                (dead, records),
            )
        },
    );
    for (id, bytes) in ["late", "late-delayed"].iter().zip(&bytes) {
        let record = dead
            .iter()
            .find(|record| record["task"].as_str() == Some(bytes.as_str()))
            .unwrap_or_else(|| panic!("{mode}: {id}'s record with its exact bytes: {dead:?}"));
        assert_eq!(record["reason"], "expired", "{mode}: {record:?}");
        assert_eq!(records.runs_of(id), 0, "{mode}: an expired task never runs");
    }
    let s = stats(&config, "jobs");
    assert_eq!(
        (s.done, s.dead_lettered, s.failed),
        (2, 2, 0),
        "{mode}: {s:?}"
    );
    daemon.stop();
}

#[test]
fn expired_tasks_are_dead_lettered_unrun_and_the_others_run_in_safe_mode() {
    expired_tasks_are_dead_lettered_unrun_and_the_others_run("safe");
}

#[test]
fn expired_tasks_are_dead_lettered_unrun_and_the_others_run_in_default_mode() {
    expired_tasks_are_dead_lettered_unrun_and_the_others_run("default");
}

/// Redis's clock an hour behind the daemon's (a step, as an NTP step or a failover to another host makes it): a
/// task whose `expires_at` is half an hour ahead on Redis's clock, and so half an hour past on the daemon's, runs;
/// one a second past on Redis's clock, and so most of an hour ahead on the daemon's, is dead-lettered. A daemon
/// that decided on its own clock would do the opposite of both.
#[test]
fn expiry_is_decided_on_redis_clock_not_the_daemons() {
    let redis = RedisServer::with_clock_shift();
    redis.set_clock_offset(-3_600_000);
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue("safe"));
    let client = client(&config);
    let now_ms = redis_now_ms(&redis);
    let task = |id: &str| NewTask::new("test", "{}").unwrap().id(id);
    let tasks = [
        task("live").expires_at(now_ms + 1_800_000),
        task("late").expires_at(now_ms - 1_000),
    ];
    client.push_batch("jobs", tasks).unwrap();
    let daemon = TestDaemon::start(&config);
    let (dead, records) = eventually(
        Duration::from_secs(20),
        "one task run and one dead-lettered",
        || {
            let (dead, records) = (dead_records(&redis, "jobs"), dir.records());
            (
                dead.len() == 1 && records.runs_of("live") == 1,
                (dead, records),
            )
        },
    );
    assert_eq!(dead[0]["reason"], "expired", "{dead:?}");
    assert!(dead[0]["task"].as_str().unwrap().contains(r#""id":"late""#));
    assert_eq!(records.runs_of("late"), 0);
    daemon.stop();
}

/// An `expires_at` that is not an integer is refused for what it is, not ignored: the task is dead-lettered unrun
/// with a reason naming the field, and keeps its bytes.
#[test]
fn an_expires_at_that_is_not_a_time_is_dead_lettered_with_the_reason() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue("safe"));
    let daemon = TestDaemon::start(&config);
    let task = r#"{"id":"odd","type":"test","expires_at":"tomorrow"}"#;
    let _: i64 = redis.cmd(&["RPUSH", "kmq:{jobs}:ready:normal", task]);
    let _: i64 = redis.cmd(&["LPUSH", "kmq:{jobs}:wake", "1"]);
    let dead = eventually(Duration::from_secs(10), "the task dead-lettered", || {
        let dead = dead_records(&redis, "jobs");
        (dead.len() == 1, dead)
    });
    let reason = dead[0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("expires_at \"tomorrow\" is not a time"),
        "{reason}"
    );
    assert_eq!(dead[0]["task"], task);
    assert_eq!(dir.records().runs_of("odd"), 0);
    daemon.stop();
}

/// `kmqd push --expires` counts on Redis's clock (an hour behind this host's here), and `--expires-at` takes RFC 3339
/// and ms since the epoch; a time that is neither is refused before anything is pushed.
#[test]
fn kmqd_push_writes_expires_at_from_a_length_on_redis_clock_or_a_time() {
    let redis = RedisServer::with_clock_shift();
    redis.set_clock_offset(-3_600_000);
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue("safe"));
    let c = config.to_str().unwrap();
    let before = redis_now_ms(&redis);
    kmqd_ok(
        &config,
        &["push", "jobs", "test", "--id", "in", "--expires", "10m"],
    );
    let after = redis_now_ms(&redis);
    for (id, time) in [("ms", "4102444800000"), ("rfc", "2100-01-01T00:00:00Z")] {
        let args = ["push", "jobs", "test", "--id", id, "--expires-at", time];
        kmqd_ok(&config, &args);
    }
    let expires_at = |id: &str| {
        let task: serde_json::Value = serde_json::from_str(&stored(&redis, id)).unwrap();
        task["expires_at"].as_i64().unwrap()
    };
    let ten_minutes = 600_000;
    let relative = expires_at("in");
    assert!(
        (before + ten_minutes..=after + ten_minutes).contains(&relative),
        "{relative} is ten minutes after the push on Redis's clock ({before}..{after})"
    );
    assert_eq!(expires_at("ms"), 4_102_444_800_000);
    assert_eq!(expires_at("rfc"), 4_102_444_800_000);
    let (code, _, err) = kmqd(
        &["-c", c, "push", "jobs", "test", "--expires-at", "tomorrow"],
        None,
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("ms since the epoch"), "{err}");
    let ready: i64 = redis.cmd(&["LLEN", "kmq:{jobs}:ready:normal"]);
    assert_eq!(ready, 3, "the refused push wrote nothing");
}
