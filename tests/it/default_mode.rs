//! Default mode: plain pops, no processing area; tasks still run, retry and dead-letter by the same policy.

use std::time::Duration;

use kmqd::NewTask;

use crate::support::*;

const QUEUE: &str = "[[queues]]\nname = \"fast\"\nmode = \"default\"\nworkers = 4\nbackoff = \"10ms\"\nretry_times = 1\n";

#[test]
fn tasks_run_retry_and_dead_letter() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let daemon = TestDaemon::start(&config);
    let client = client(&config);
    let tasks: Vec<NewTask> = (0..200)
        .map(|i| {
            let data = match i % 4 {
                0 => r#"{"fail_attempts":1}"#,
                1 => r#"{"outcome":"fail"}"#,
                _ => "7",
            };
            NewTask::new("test", data).unwrap().id(format!("d{i}"))
        })
        .collect();
    client.push_batch("fast", tasks).unwrap();
    let s = eventually(Duration::from_secs(30), "the queue to drain", || {
        let s = stats(&config, "fast");
        (
            s.ready + s.delayed == 0 && s.done + s.dead_lettered == 200,
            s,
        )
    });
    assert_eq!(
        (s.done, s.dead_lettered, s.retried, s.processing),
        (150, 50, 50, 0),
        "{s:?}"
    );
    let records = dir.records();
    assert_eq!(records.runs_of("d0"), 2, "failed once, retried once");
    daemon.stop();
}

#[test]
fn any_producer_wakes_an_idle_default_queue_at_once() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &QUEUE.replace("workers = 4", "workers = 1\nidle_poll = \"1s\""),
    );
    let daemon = TestDaemon::start(&config);
    redis.wait_blocked_in("blmove");
    // A plain RPUSH, no marker: the idle fetcher, blocked on the ready list itself, sees it at once.
    let _: i64 = redis.cmd(&[
        "RPUSH",
        "kmq:{fast}:ready:normal",
        r#"{"id":"bare","type":"test"}"#,
    ]);
    eventually(Duration::from_secs(5), "the task to run", || {
        (dir.records().runs_of("bare") == 1, ())
    });
    daemon.stop();
}
