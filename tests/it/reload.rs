//! Reloading (docs/OPERATIONS.md, "Reloading"): the real binary, sent SIGHUP, re-reads its config: a broken one is
//! refused with check-config's message and the daemon serves on; new settings apply (a queue's lane is replaced
//! without losing or re-running a task); a plugin dropped into `plugins_dir`, or a plugin file replaced by a new
//! inode, serves its types after the reload.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kmqd::NewTask;

use crate::support::*;

const SIGHUP: i32 = 1;
const SIGTERM: i32 = 15;

/// The loader's test plugin (tests/it/c/configurable.c): one task type, one status for every task.
fn configurable_c() -> PathBuf {
    workspace_dir().join("tests/it/c/configurable.c")
}

/// Starts the real daemon on `config` and waits until it serves.
pub(crate) fn start(dir: &TestDir, config: &Path) -> Process {
    let daemon = Process::start(config, dir.path("kmqd.log"));
    wait_logged(&daemon, "kmqd started", 1);
    daemon
}

/// Waits until `needle` is in the daemon's log at least `times` times; returns the log.
pub(crate) fn wait_logged(daemon: &Process, needle: &str, times: usize) -> String {
    eventually(
        Duration::from_secs(20),
        &format!("{needle:?} logged {times} times"),
        || {
            let log = daemon.log_text();
            (log.matches(needle).count() >= times, log)
        },
    )
}

/// Sends SIGHUP and waits for the reload's outcome (the n-th reload of this daemon): applied or refused.
pub(crate) fn reload(daemon: &Process, n: usize) -> String {
    daemon.signal(SIGHUP);
    eventually(Duration::from_secs(20), "the reload to finish", || {
        let log = daemon.log_text();
        let finished =
            log.matches("config reloaded:").count() + log.matches("reload refused").count();
        (finished >= n, log)
    })
}

/// SIGTERM, and the daemon exits 0 within 30 s.
pub(crate) fn stop(mut daemon: Process) {
    daemon.signal(SIGTERM);
    assert_eq!(
        daemon.wait_within(Duration::from_secs(30)),
        Some(0),
        "{}",
        daemon.log_text()
    );
}

fn push(config: &Path, kind: &str, id: &str) {
    client(config)
        .push("jobs", NewTask::new(kind, "{}").unwrap().id(id))
        .unwrap();
}

#[test]
fn a_broken_config_is_refused_with_check_configs_message_and_the_daemon_serves_on() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("workers = 2"));
    let good = fs::read_to_string(&config).unwrap();
    let daemon = start(&dir, &config);
    // The producer's config: the daemon's is about to break.
    let producer = dir.path("producer.toml");
    fs::copy(&config, &producer).unwrap();
    push_many(&producer, "before", 3, "{}");
    wait_done(&producer, 3, Duration::from_secs(20));

    fs::write(&config, good.replace("workers = 2", "workers = \"many\"")).unwrap();
    let (code, _, expected) = kmqd(
        &["--config", config.to_str().unwrap(), "check-config"],
        None,
    );
    assert_eq!(code, 2, "{expected}");
    let expected = expected.trim().trim_start_matches("kmqd: ");
    let log = reload(&daemon, 1);
    assert!(
        log.contains(&format!(
            "reload refused, still serving the config loaded before: {expected}"
        )),
        "the log gives check-config's message ({expected}): {log}"
    );
    push_many(&producer, "after", 3, "{}");
    wait_done(&producer, 6, Duration::from_secs(20));
    stop(daemon);
}

#[test]
fn more_workers_apply_at_the_reload() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("workers = 1\nprefetch = 4"));
    let text = fs::read_to_string(&config).unwrap();
    let daemon = start(&dir, &config);
    fs::write(&config, text.replace("workers = 1", "workers = 3")).unwrap();
    let log = reload(&daemon, 1);
    assert!(
        log.contains("config reloaded: queues.jobs.workers 1 → 3"),
        "{log}"
    );
    // Three slow tasks, blocked until the test lets them go: with three workers all three run at once.
    let gate = dir.path("gate");
    let data = format!(r#"{{"wait_for_file":"{}"}}"#, gate.display());
    push_many(&config, "slow", 3, &data);
    eventually(Duration::from_secs(20), "three runs at once", || {
        let records = dir.records();
        (
            records.starts.len() == 3 && records.ends.is_empty(),
            records,
        )
    });
    fs::write(&gate, "").unwrap();
    wait_done(&config, 3, Duration::from_secs(20));
    stop(daemon);
}

#[test]
fn a_reload_while_tasks_run_loses_and_reruns_none_of_them() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("workers = 2\nprefetch = 4"));
    let text = fs::read_to_string(&config).unwrap();
    let daemon = start(&dir, &config);
    const TASKS: usize = 30;
    push_many(&config, "t", TASKS, r#"{"sleep_ms":100}"#);
    eventually(Duration::from_secs(20), "some runs to start", || {
        (dir.records().starts.len() >= 2, ())
    });
    // The lane is replaced twice while tasks run, are claimed and wait for a worker.
    fs::write(&config, text.replace("workers = 2", "workers = 3")).unwrap();
    reload(&daemon, 1);
    fs::write(&config, text.replace("workers = 2", "workers = 1")).unwrap();
    reload(&daemon, 2);
    let stats = eventually(Duration::from_secs(60), "every task done", || {
        let stats = stats(&config, "jobs");
        let done = stats.done >= TASKS as u64;
        (done, (stats, daemon.log_text()))
    })
    .0;
    assert_eq!((stats.dead, stats.retried), (0, 0), "{stats:?}");
    let records = dir.records();
    for i in 0..TASKS {
        assert_eq!(records.runs_of(&format!("t{i}")), 1, "t{i}: {records:?}");
    }
    assert_eq!(records.ends.len(), TASKS, "every run returned");
    let log = daemon.log_text();
    assert_eq!(
        log.matches("the replaced lane settled everything and stopped")
            .count(),
        2,
        "{log}"
    );
    stop(daemon);
}

#[test]
fn a_worker_that_outlives_its_replaced_lane_does_not_stop_the_daemon() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queue = "workers = 1\nexecution_timeout = \"1s\"\nretry_times = 0";
    let config = dir.config(&redis, &safe_queue(queue));
    let text = fs::read_to_string(&config).unwrap();
    let daemon = start(&dir, &config);
    // A handler that ignores its cancel flag: its task is resolved by the execution timeout (dead-lettered),
    // while its worker stays inside the handler until the gate opens.
    let gate = dir.path("gate");
    let data = format!(
        r#"{{"wait_for_file":"{}","ignore_cancel":true}}"#,
        gate.display()
    );
    push_many(&config, "stuck", 1, &data);
    eventually(Duration::from_secs(20), "the timeout to settle it", || {
        let stats = stats(&config, "jobs");
        (stats.dead == 1, stats)
    });
    fs::write(&config, text.replace("workers = 1", "workers = 2")).unwrap();
    reload(&daemon, 1);
    // The replaced lane holds nothing: it goes, its delay poller too, while its worker is still in the handler.
    wait_logged(
        &daemon,
        "the replaced lane settled everything and stopped",
        1,
    );
    wait_logged(&daemon, "delay poller stopped", 1);
    fs::write(&gate, "").unwrap();
    wait_logged(&daemon, "is ignored", 1);
    // Its end is expected: the daemon serves on.
    push_many(&config, "after", 1, "{}");
    eventually(Duration::from_secs(20), "the next task done", || {
        (stats(&config, "jobs").done == 1, daemon.log_text())
    });
    let log = daemon.log_text();
    assert!(!log.contains("ended unexpectedly"), "{log}");
    stop(daemon);
}

#[test]
fn a_plugin_dropped_into_plugins_dir_serves_its_tasks_after_the_reload() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("workers = 1\nretry_times = 0"));
    let daemon = start(&dir, &config);
    // Before: no plugin handles c.test; the testkit task pushed after it runs once it was judged.
    push(&config, "c.test", "early");
    push(&config, "test", "marker");
    wait_done(&config, 1, Duration::from_secs(20));
    assert_eq!(
        stats(&config, "jobs").done,
        1,
        "the c.test task is not done"
    );

    // Compiled aside under a hidden name (skipped by the loader), then moved in: what `install` does.
    let staged = dir.plugins_dir().join(".libdropped.so.tmp");
    compile_c_plugin(&configurable_c(), &[], &staged);
    fs::rename(&staged, dir.plugins_dir().join("libdropped.so")).unwrap();
    let log = reload(&daemon, 1);
    assert!(
        log.contains("config reloaded: plugin loaded: ") && log.contains("libdropped.so"),
        "{log}"
    );
    push(&config, "c.test", "late");
    wait_done(&config, 2, Duration::from_secs(20));
    stop(daemon);
}

#[test]
fn a_replaced_plugin_file_serves_its_types_after_the_next_reload() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("workers = 2\nretry_times = 0"));
    let plugin = dir.plugins_dir().join("libswap.so");
    // Version 1 fails every task of type "swap"; version 2 finishes them.
    compile_c_plugin(
        &configurable_c(),
        &["PLUGIN_TYPE=\"swap\"", "PLUGIN_STATUS=KMQ_FAIL"],
        &plugin,
    );
    let daemon = start(&dir, &config);
    push(&config, "swap", "v1");
    eventually(Duration::from_secs(20), "v1 to fail", || {
        let stats = stats(&config, "jobs");
        (stats.dead == 1, stats)
    });
    let staged = dir.plugins_dir().join(".libswap.so.new");
    compile_c_plugin(&configurable_c(), &["PLUGIN_TYPE=\"swap\""], &staged);
    fs::rename(&staged, &plugin).unwrap();
    // Not before the reload: the running daemon still has version 1.
    push(&config, "swap", "v1-again");
    eventually(Duration::from_secs(20), "v1-again to fail", || {
        let stats = stats(&config, "jobs");
        (stats.dead == 2, stats)
    });
    let log = reload(&daemon, 1);
    assert!(
        log.contains("plugin loaded: ") && log.contains("libswap.so"),
        "{log}"
    );
    push(&config, "swap", "v2");
    let stats = wait_done(&config, 1, Duration::from_secs(20));
    assert_eq!(stats.dead, 2, "{stats:?}");
    // An unchanged file is not loaded again.
    let log = reload(&daemon, 2);
    let last = log
        .lines()
        .rfind(|l| l.contains("config reloaded:"))
        .unwrap();
    assert!(last.contains("nothing changed"), "{last}");
    stop(daemon);
}

#[test]
fn a_new_queue_starts_and_a_removed_one_stops_at_the_reload() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("workers = 1"));
    let text = fs::read_to_string(&config).unwrap();
    let daemon = start(&dir, &config);
    let other = "[[queues]]\nname = \"other\"\nmode = \"default\"\n";
    let both = text.replace("[[queues]]", &format!("{other}\n[[queues]]"));
    fs::write(&config, &both).unwrap();
    // The producer's and the operator's config knows both queues.
    let producer = dir.path("producer.toml");
    fs::write(&producer, &both).unwrap();
    let log = reload(&daemon, 1);
    assert!(log.contains("queues started: other"), "{log}");
    client(&config)
        .push("other", NewTask::new("test", "{}").unwrap().id("o1"))
        .unwrap();
    eventually(Duration::from_secs(20), "o1 done", || {
        let stats = stats(&config, "other");
        (stats.done == 1, stats)
    });
    // Now only `other`: `jobs` stops, and what is pushed to it waits.
    let only_other = format!(
        "{}{other}{}",
        &text[..text.find("[[queues]]").unwrap()],
        &text[text.find("[plugins.testkit]").unwrap()..]
    );
    fs::write(&config, only_other).unwrap();
    let log = reload(&daemon, 2);
    assert!(log.contains("queues stopped: jobs"), "{log}");
    wait_logged(
        &daemon,
        "the replaced lane settled everything and stopped",
        1,
    );
    // Its owner is released: no daemon serves `jobs` any more, while `other` is still served.
    let serving = |queue: &str| client(&producer).workers(queue).unwrap().len();
    eventually(
        Duration::from_secs(20),
        "jobs to be served by nobody",
        || (serving("jobs") == 0, serving("jobs")),
    );
    assert_eq!(serving("other"), 1);
    stop(daemon);
}

#[test]
fn log_level_changes_at_the_reload() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(
        &redis,
        "shutdown_grace = \"5s\"\nlog_level = \"warn\"",
        &safe_queue("workers = 1"),
    );
    let text = fs::read_to_string(&config).unwrap();
    // RUST_LOG empty: the config's log_level decides (the harness sets kmqd=debug otherwise).
    let daemon = Process::start_with_env(&config, dir.path("kmqd.log"), &[("RUST_LOG", "")]);
    // Serving (its fetcher waits in Redis), and at warn nothing of that was logged.
    redis.wait_blocked_in("blpop");
    assert!(
        !daemon.log_text().contains("kmqd started"),
        "{}",
        daemon.log_text()
    );
    fs::write(
        &config,
        text.replace("log_level = \"warn\"", "log_level = \"info\""),
    )
    .unwrap();
    let log = reload(&daemon, 1);
    assert!(
        log.contains("config reloaded: daemon.log_level warn → info"),
        "{log}"
    );
    stop(daemon);
}

#[test]
fn a_replaced_plugins_old_instance_is_shut_down_only_after_its_last_task_returned() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("workers = 2"));
    let daemon = start(&dir, &config);
    let gate = dir.path("gate");
    let data = format!(r#"{{"wait_for_file":"{}"}}"#, gate.display());
    push_many(&config, "held", 1, &data);
    eventually(Duration::from_secs(20), "the run to start", || {
        (dir.records().starts.len() == 1, ())
    });
    // A new build of the same plugin (a new inode at the same path), then the reload.
    let staged = dir.plugins_dir().join(".libkmq_testkit.so.new");
    fs::copy(built_plugins().join("libkmq_testkit.so"), &staged).unwrap();
    fs::rename(&staged, dir.plugins_dir().join("libkmq_testkit.so")).unwrap();
    let log = reload(&daemon, 1);
    assert!(log.contains("plugin loaded: "), "{log}");
    // The new instance serves the tasks that start now; the old one still runs `held`: no shutdown yet.
    push_many(&config, "new", 1, "{}");
    eventually(Duration::from_secs(20), "new to run", || {
        let records = dir.records();
        (records.ends.iter().any(|(id, _, _)| id == "new0"), records)
    });
    assert!(
        !dir.records().lines.iter().any(|l| l == "shutdown"),
        "the old instance still runs a task: {:?}",
        dir.records().lines
    );
    fs::write(&gate, "").unwrap();
    let records = eventually(
        Duration::from_secs(20),
        "the old instance's shutdown",
        || {
            let records = dir.records();
            (records.lines.iter().any(|l| l == "shutdown"), records)
        },
    );
    let end = records
        .lines
        .iter()
        .position(|l| l.starts_with("end held0"));
    let shutdown = records.lines.iter().position(|l| l == "shutdown");
    assert!(end.is_some() && end < shutdown, "{records:?}");
    stop(daemon);
    // The new instance's own shutdown, at the daemon's stop.
    let shutdowns = dir
        .records()
        .lines
        .iter()
        .filter(|l| *l == "shutdown")
        .count();
    assert_eq!(shutdowns, 2, "{:?}", dir.records().lines);
}

#[test]
fn a_refused_plugin_section_refuses_the_reload_and_the_old_plugins_serve_on() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("workers = 1"));
    let text = fs::read_to_string(&config).unwrap();
    let daemon = start(&dir, &config);
    // Beside a change that would apply on its own: a reload is all or nothing.
    let broken = format!(
        "{}\n[plugins.gone]\nfile = \"libgone.so\"\n",
        text.replace("workers = 1", "workers = 2")
    );
    fs::write(&config, broken).unwrap();
    let log = reload(&daemon, 1);
    assert!(
        log.contains("reload refused, still serving the config loaded before: ")
            && log.contains("libgone.so: no such file"),
        "{log}"
    );
    assert!(!log.contains("workers 1 → 2"), "{log}");
    push_many(&config, "after", 2, "{}");
    wait_done(&config, 2, Duration::from_secs(20));
    stop(daemon);
}

/// A producer in another language learns a queue's levels from its meta hash (docs/PROTOCOL.md, "The queue's
/// shape"): the daemon writes them at start, and again when a reload changes them.
#[test]
fn the_meta_hash_describes_the_queues_levels_at_start_and_after_a_reload_changes_them() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("priorities = [\"high\", \"normal\"]"));
    let text = fs::read_to_string(&config).unwrap();
    let daemon = start(&dir, &config);
    let meta = || -> std::collections::BTreeMap<String, String> {
        redis.cmd(&["HGETALL", "kmq:{jobs}:meta"])
    };
    let shape = |meta: &std::collections::BTreeMap<String, String>| {
        (meta["levels"].clone(), meta["default_priority"].clone())
    };
    assert_eq!(
        shape(&meta()),
        ("high,normal".to_string(), "high".to_string())
    );
    assert_eq!(meta()["protocol"], "1");
    fs::write(
        &config,
        text.replace(
            "priorities = [\"high\", \"normal\"]",
            "priorities = [\"high\", \"normal\", \"low\"]\ndefault_priority = \"low\"",
        ),
    )
    .unwrap();
    let log = reload(&daemon, 1);
    assert!(log.contains("config reloaded:"), "{log}");
    assert_eq!(
        shape(&meta()),
        ("high,normal,low".to_string(), "low".to_string())
    );
    stop(daemon);
}
