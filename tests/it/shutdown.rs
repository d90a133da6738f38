//! Graceful shutdown: SIGTERM stops claiming, lets running tasks finish within `shutdown_grace`, hands back what
//! did not (safe mode), and exits 0. A second signal exits at once.

use std::time::Duration;

use kmqd::NewTask;

use crate::support::*;

const SIGINT: i32 = 2;
const SIGTERM: i32 = 15;
const SIGHUP: i32 = 1;

fn queue(extra: &str) -> String {
    format!("[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 1\nprefetch = 5\n{extra}\n")
}

fn wait_started(dir: &TestDir, id: &str) {
    eventually(Duration::from_secs(10), "the task to start", || {
        (dir.records().runs_of(id) == 1, ())
    });
}

#[test]
fn sigterm_lets_the_running_task_finish_and_hands_back_the_prefetched_ones() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue(""));
    let release = dir.path("release");
    let client = client(&config);
    let first = format!(r#"{{"wait_for_file":"{}"}}"#, release.display());
    client
        .push("jobs", NewTask::new("test", &first).unwrap().id("running"))
        .unwrap();
    client
        .push_batch(
            "jobs",
            (0..5).map(|i| {
                NewTask::new("test", "{}")
                    .unwrap()
                    .id(format!("waiting{i}"))
            }),
        )
        .unwrap();
    let mut daemon = Process::start(&config, dir.path("kmqd.log"));
    wait_started(&dir, "running");
    eventually(
        Duration::from_secs(10),
        "the prefetch to be claimed",
        || {
            let s = stats(&config, "jobs");
            (s.processing == 6, s)
        },
    );
    daemon.signal(SIGTERM);
    eventually(
        Duration::from_secs(10),
        "the daemon to stop claiming",
        || (daemon.log_text().contains("no new tasks are taken"), ()),
    );
    // The running task may finish within the grace period.
    std::fs::write(&release, "").unwrap();
    let code = daemon.wait_within(Duration::from_secs(20));
    assert_eq!(code, Some(0), "{}", daemon.log_text());
    let s = stats(&config, "jobs");
    assert_eq!(
        (s.done, s.ready, s.processing),
        (1, 5, 0),
        "{s:?}\n{}",
        daemon.log_text()
    );
    let records = dir.records();
    assert_eq!(
        records.starts.len(),
        1,
        "prefetched tasks were handed back, not started: {records:?}"
    );
    let ready: Vec<String> = redis.cmd(&["LRANGE", "kmq:{jobs}:ready:normal", "0", "-1"]);
    assert!(
        ready.iter().all(|p| p.contains(r#""attempt":0"#)),
        "a hand-back is not a failed attempt: {ready:?}"
    );
}

#[test]
fn a_task_still_running_after_the_grace_is_handed_back() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(&redis, "shutdown_grace = \"300ms\"", &queue(""));
    client(&config)
        .push(
            "jobs",
            NewTask::new("test", r#"{"until_cancelled":true}"#)
                .unwrap()
                .id("long"),
        )
        .unwrap();
    let mut daemon = Process::start(&config, dir.path("kmqd.log"));
    wait_started(&dir, "long");
    daemon.signal(SIGTERM);
    assert_eq!(
        daemon.wait_within(Duration::from_secs(20)),
        Some(0),
        "{}",
        daemon.log_text()
    );
    let s = stats(&config, "jobs");
    assert_eq!(
        (s.ready, s.processing, s.done, s.failed),
        (1, 0, 0, 0),
        "handed back, not failed: {s:?}"
    );
}

#[test]
fn a_handler_that_ignores_cancel_does_not_hold_the_daemon() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(&redis, "shutdown_grace = \"300ms\"", &queue(""));
    let data = r#"{"until_cancelled":true,"ignore_cancel":true}"#;
    client(&config)
        .push("jobs", NewTask::new("test", data).unwrap().id("deaf"))
        .unwrap();
    let mut daemon = Process::start(&config, dir.path("kmqd.log"));
    wait_started(&dir, "deaf");
    daemon.signal(SIGTERM);
    assert_eq!(
        daemon.wait_within(Duration::from_secs(30)),
        Some(0),
        "{}",
        daemon.log_text()
    );
    assert!(
        daemon.log_text().contains("plugin shutdown skipped"),
        "{}",
        daemon.log_text()
    );
    let s = stats(&config, "jobs");
    assert_eq!((s.ready, s.processing), (1, 0), "handed back: {s:?}");
}

#[test]
fn a_second_signal_exits_at_once() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(&redis, "shutdown_grace = \"1h\"", &queue(""));
    client(&config)
        .push(
            "jobs",
            NewTask::new("test", r#"{"until_cancelled":true,"ignore_cancel":true}"#)
                .unwrap()
                .id("x"),
        )
        .unwrap();
    let mut daemon = Process::start(&config, dir.path("kmqd.log"));
    wait_started(&dir, "x");
    daemon.signal(SIGINT);
    eventually(
        Duration::from_secs(10),
        "the first signal to be logged",
        || (daemon.log_text().contains("shutting down gracefully"), ()),
    );
    daemon.signal(SIGINT);
    assert_eq!(
        daemon.wait_within(Duration::from_secs(10)),
        Some(128 + SIGINT),
        "{}",
        daemon.log_text()
    );
    // The task stays in the processing area; its lease brings it back.
    assert_eq!(stats(&config, "jobs").processing, 1);
}

#[test]
fn sighup_is_logged_and_the_daemon_keeps_running() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue(""));
    let mut daemon = Process::start(&config, dir.path("kmqd.log"));
    eventually(Duration::from_secs(10), "the daemon to start", || {
        (daemon.log_text().contains("kmqd started"), ())
    });
    daemon.signal(SIGHUP);
    eventually(Duration::from_secs(10), "SIGHUP to be logged", || {
        (daemon.log_text().contains("SIGHUP"), daemon.log_text())
    });
    client(&config)
        .push("jobs", NewTask::new("test", "{}").unwrap().id("after"))
        .unwrap();
    wait_started(&dir, "after");
    assert!(daemon.child.try_wait().unwrap().is_none(), "still running");
    daemon.signal(SIGTERM);
    assert_eq!(daemon.wait_within(Duration::from_secs(20)), Some(0));
}

#[test]
fn a_closed_standard_error_does_not_stop_the_daemon() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue(""));
    // `kmqd 2>&1 | head`: whoever reads the log goes away while the daemon keeps logging.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kmqd"))
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "kmqd=debug")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first_line = [0u8; 1];
    std::io::Read::read_exact(child.stderr.as_mut().unwrap(), &mut first_line).unwrap();
    drop(child.stderr.take());
    client(&config)
        .push_batch(
            "jobs",
            (0..20).map(|i| NewTask::new("test", "{}").unwrap().id(format!("t{i}"))),
        )
        .unwrap();
    eventually(Duration::from_secs(10), "the tasks to run", || {
        let s = stats(&config, "jobs");
        (s.done == 20, s)
    });
    assert!(child.try_wait().unwrap().is_none(), "still running");
    let kill = std::process::Command::new("kill")
        .arg(format!("-{SIGTERM}"))
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(kill.success());
    let status = eventually(Duration::from_secs(20), "kmqd to exit", || {
        let status = child.try_wait().unwrap();
        (status.is_some(), status)
    });
    assert_eq!(status.and_then(|s| s.code()), Some(0));
}

#[test]
fn plugins_are_shut_down_only_after_their_last_final_failure_hook_returned() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue(""));
    // The hook outlasts the time the ackers get to settle: shutdown must still wait for it.
    let data = r#"{"outcome":"fail","dead_sleep_ms":12000}"#;
    client(&config)
        .push("jobs", NewTask::new("test", data).unwrap().id("doomed"))
        .unwrap();
    let mut daemon = Process::start(&config, dir.path("kmqd.log"));
    eventually(Duration::from_secs(10), "the run to fail", || {
        let records = dir.records();
        (records.ends.iter().any(|(id, _, _)| id == "doomed"), ())
    });
    eventually(Duration::from_secs(10), "the dead letter to land", || {
        (stats(&config, "jobs").dead == 1, ())
    });
    daemon.signal(SIGTERM);
    assert_eq!(
        daemon.wait_within(Duration::from_secs(40)),
        Some(0),
        "{}",
        daemon.log_text()
    );
    let lines = dir.records().lines;
    let dead = lines
        .iter()
        .position(|line| line.starts_with("dead doomed"));
    let shutdown = lines.iter().position(|line| line == "shutdown");
    assert!(
        dead.is_some() && (shutdown.is_none() || shutdown > dead),
        "the hook returned before the plugin was shut down: {lines:?}"
    );
}

/// The review's L2: a task taken from the quarantine and handed back at shutdown went to the ready list, where a
/// poison pill would crash a full batch, uncharged, on every rolling restart. It goes back to its quarantine list.
#[test]
fn a_quarantined_task_handed_back_at_shutdown_goes_back_to_the_quarantine() {
    for (envelope, list) in [
        (
            r#"{"id":"suspect","type":"test","data":{"until_cancelled":true},"recovered":3}"#,
            "kmq:{jobs}:quarantine:8:normal",
        ),
        (
            r#"{"id":"suspect","type":"test","data":{"until_cancelled":true},"attempt":1,"crashes":1}"#,
            "kmq:{jobs}:quarantine:1:normal",
        ),
    ] {
        let redis = RedisServer::start();
        let dir = TestDir::new();
        let config = dir.config_with(&redis, "shutdown_grace = \"300ms\"", &queue(""));
        let _: i64 = redis.cmd(&["RPUSH", list, envelope]);
        let mut daemon = Process::start(&config, dir.path("kmqd.log"));
        wait_started(&dir, "suspect");
        daemon.signal(SIGTERM);
        assert_eq!(
            daemon.wait_within(Duration::from_secs(20)),
            Some(0),
            "{}",
            daemon.log_text()
        );
        let (quarantined, ready): (i64, i64) = (
            redis.cmd(&["LLEN", list]),
            redis.cmd(&["LLEN", "kmq:{jobs}:ready:normal"]),
        );
        assert_eq!((quarantined, ready), (1, 0), "{list}");
        let back: String = redis.cmd(&["LINDEX", list, "0"]);
        assert_eq!(back, envelope, "handed back unchanged");
    }
}
