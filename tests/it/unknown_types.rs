//! Task types no plugin of this daemon handles: what a rolling deploy makes. They wait, retried with the queue's
//! backoff, for a daemon that handles them, and are dead-lettered only after `retry_times` (docs/RELIABILITY.md,
//! "Bad input").

use std::time::Duration;

use kmqd::NewTask;

use crate::support::*;

/// The warning the daemon logs once per unknown type.
const WARNING: &str = "no plugin handles this task type";

fn queue(mode: &str, extra: &str) -> String {
    format!(
        "[[queues]]\nname = \"jobs\"\nmode = \"{mode}\"\nworkers = 2\nbackoff = \"20ms\"\n\
         backoff_max = \"100ms\"\n{extra}\n"
    )
}

#[test]
fn a_task_of_an_unknown_type_is_retried_then_dead_lettered_after_retry_times_with_one_warning() {
    for mode in ["safe", "default"] {
        let redis = RedisServer::start();
        let dir = TestDir::new();
        let config = dir.config(&redis, &queue(mode, "retry_times = 2"));
        let mut daemon = Process::start(&config, dir.path("daemon.log"));
        let client = client(&config);
        for id in ["a", "b"] {
            let task = NewTask::new("nobody.handles", "{}").unwrap().id(id);
            assert!(client.push("jobs", task).unwrap().is_accepted());
        }
        let s = eventually(Duration::from_secs(20), "both tasks dead", || {
            let s = stats(&config, "jobs");
            (s.dead == 2, s)
        });
        assert_eq!(
            (s.retried, s.failed, s.done),
            (4, 0, 0),
            "{mode}: two retries each, and no run counted as failed: {s:?}"
        );
        let records: Vec<String> = redis.cmd(&["LRANGE", "kmq:{jobs}:dead", "0", "-1"]);
        for record in &records {
            let record: serde_json::Value = serde_json::from_str(record).unwrap();
            assert_eq!(
                record["reason"],
                "no plugin handles task type \"nobody.handles\"; no retries left after 3 attempts",
                "{mode}: {record}"
            );
            assert_eq!(record["attempt"], 2, "{mode}: {record}");
        }
        let log = daemon.log_text();
        assert_eq!(
            log.matches(WARNING).count(),
            1,
            "{mode}: one warning for the type, not one per task or retry:\n{log}"
        );
        daemon.signal(15);
        assert_eq!(daemon.wait_within(Duration::from_secs(30)), Some(0));
    }
}

#[test]
fn a_task_of_a_type_only_a_newer_daemon_handles_waits_for_it_and_runs_there() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    // The old daemon: the testkit plugin and the echo drop-in, for type `echo` only; it could retry the task for
    // a long while.
    let old = dir.config(&redis, &queue("safe", "retry_times = 1000"));
    let mut old_daemon = Process::start(&old, dir.path("old.log"));
    let task = NewTask::new("report.build", "{}").unwrap().id("new-type");
    assert!(client(&old).push("jobs", task).unwrap().is_accepted());
    eventually(
        Duration::from_secs(20),
        "the old daemon to retry it",
        || {
            let s = stats(&old, "jobs");
            (s.retried >= 2, s)
        },
    );
    assert!(old_daemon.log_text().contains(WARNING));
    // The newer daemon's echo plugin also handles the new type.
    let newer = dir.path("newer.toml");
    let text = std::fs::read_to_string(&old).unwrap()
        + "\n[plugins.echo]\nfile = \"libkmq_echo.so\"\nconfig = { types = [\"echo\", \"report.build\"] }\n";
    std::fs::write(&newer, text).unwrap();
    let new_daemon = TestDaemon::start(&newer);
    let s = eventually(Duration::from_secs(20), "the task done", || {
        let s = stats(&old, "jobs");
        (s.done == 1, s)
    });
    assert_eq!((s.dead, s.failed), (0, 0), "{s:?}");
    new_daemon.stop();
    old_daemon.signal(15);
    assert_eq!(old_daemon.wait_within(Duration::from_secs(30)), Some(0));
}
