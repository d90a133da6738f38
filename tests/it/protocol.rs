//! docs/PROTOCOL.md is a contract: producers that follow it with plain Redis commands get their tasks run.

use std::time::{Duration, Instant};

use crate::support::*;

const SAFE_QUEUE: &str =
    "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 2\nidle_poll = \"200ms\"\n";

#[test]
fn task_pushed_with_plain_rpush_as_documented_runs() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, SAFE_QUEUE);
    let daemon = TestDaemon::start(&config);
    // Exactly the two commands docs/PROTOCOL.md shows for redis-cli.
    let envelope = r#"{"id":"plain-1","type":"test","data":{"x":1}}"#;
    let _: i64 = redis.cmd(&["RPUSH", "kmq:{jobs}:ready:normal", envelope]);
    let _: i64 = redis.cmd(&["LPUSH", "kmq:{jobs}:wake", "1"]);
    eventually(Duration::from_secs(10), "the task to run", || {
        let records = dir.records();
        (
            records
                .ends
                .iter()
                .any(|(id, _, outcome)| id == "plain-1" && outcome == "done"),
            records,
        )
    });
    eventually(
        Duration::from_secs(10),
        "the task to be acknowledged",
        || {
            let stats = stats(&config, "jobs");
            (stats.done == 1 && stats.processing == 0, stats)
        },
    );
    daemon.stop();
}

#[test]
fn task_pushed_with_the_published_script_runs() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, SAFE_QUEUE);
    let daemon = TestDaemon::start(&config);
    let script = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/src/broker/scripts/push.lua"
    ))
    .unwrap();
    let envelope = r#"{"id":"scripted-1","type":"test","data":null,"trace":"keep-me"}"#;
    let accepted: Vec<i64> = redis.cmd(&[
        "EVAL",
        &script,
        "5",
        "kmq:{jobs}:ready:normal",
        "kmq:{jobs}:delayed:normal",
        "kmq:{jobs}:wake",
        "kmq:{jobs}:unique",
        "kmq:{jobs}:stats",
        "0",
        "0",
        "kmq:{jobs}:delay-wake",
        "",
        envelope,
    ]);
    assert_eq!(accepted, [1]);
    eventually(
        Duration::from_secs(10),
        "the scripted task to be done",
        || {
            let stats = stats(&config, "jobs");
            (stats.done == 1 && stats.pushed == 1, stats)
        },
    );
    assert_eq!(dir.records().runs_of("scripted-1"), 1);
    daemon.stop();
}

#[test]
fn plain_rpush_without_a_wake_marker_is_picked_up_within_idle_poll() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, SAFE_QUEUE);
    let daemon = TestDaemon::start(&config);
    // Let the fetchers go idle (blocked on the wake list) first.
    eventually(
        Duration::from_secs(10),
        "the fetcher to block on the wake list",
        || {
            let clients: String = redis.cmd(&["CLIENT", "LIST"]);
            (clients.contains("cmd=blpop"), clients)
        },
    );
    let pushed = Instant::now();
    let _: i64 = redis.cmd(&[
        "RPUSH",
        "kmq:{jobs}:ready:normal",
        r#"{"id":"quiet","type":"test"}"#,
    ]);
    eventually(
        Duration::from_secs(5),
        "the unannounced task to run",
        || (dir.records().runs_of("quiet") == 1, ()),
    );
    // idle_poll is 200 ms; Redis rounds blocking timeouts up to its 100 ms tick. Generous slack for a busy host.
    assert!(
        pushed.elapsed() < Duration::from_secs(2),
        "picked up after {:?}",
        pushed.elapsed()
    );
    daemon.stop();
}

#[test]
fn unknown_envelope_fields_survive_a_retry_into_the_dead_letter_record() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queue =
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nretry_times = 1\nbackoff = \"10ms\"\n";
    let config = dir.config(&redis, queue);
    let daemon = TestDaemon::start(&config);
    let envelope = r#"{"id":"keep","type":"test","data":{"outcome":"retry","n":12345678901234567890},"trace":{"span":[1,2]}}"#;
    let _: i64 = redis.cmd(&["RPUSH", "kmq:{jobs}:ready:normal", envelope]);
    let _: i64 = redis.cmd(&["LPUSH", "kmq:{jobs}:wake", "1"]);
    let records: Vec<String> = eventually(
        Duration::from_secs(10),
        "the task to be dead-lettered",
        || {
            let dead: Vec<String> = redis.cmd(&["LRANGE", "kmq:{jobs}:dead", "0", "-1"]);
            (dead.len() == 1, dead)
        },
    );
    let record: serde_json::Value = serde_json::from_str(&records[0]).unwrap();
    let task = record["task"].as_str().unwrap();
    assert!(
        task.contains(r#""trace":{"span":[1,2]}"#),
        "unknown field kept byte for byte: {task}"
    );
    assert!(
        task.contains("12345678901234567890"),
        "big integers in data are not rounded: {task}"
    );
    assert!(task.contains(r#""attempt":1"#), "{task}");
    assert_eq!(
        record["reason"],
        "testkit: asked to retry; no retries left after 2 runs"
    );
    daemon.stop();
}
