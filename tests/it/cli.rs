//! The command line: exit codes, error messages that name file and line, push and stats.

use crate::support::*;

const QUEUE: &str =
    "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\npriorities = [\"high\", \"normal\", \"low\"]\n";

#[test]
fn check_config_accepts_a_good_config_and_loads_its_plugins() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let (code, out, err) = kmqd(
        &["--config", config.to_str().unwrap(), "check-config"],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("queue jobs: safe mode"), "{out}");
    assert!(out.contains("types [\"test\"]"), "{out}");
}

#[test]
fn check_config_warns_about_schedules_no_plugin_handles() {
    let dir = TestDir::new();
    let schedules = "[[schedules]]\nname = \"nightly\"\nqueue = \"jobs\"\ntype = \"report.build\"\nevery = \"1h\"\n\n\
                     [[schedules]]\nname = \"tick\"\nqueue = \"jobs\"\ntype = \"test\"\nevery = \"1m\"\n";
    let config = dir.config_raw(
        "url = \"redis://127.0.0.1:1\"",
        "",
        &format!("{QUEUE}\n{schedules}"),
    );
    let (code, out, err) = kmqd(
        &["--config", config.to_str().unwrap(), "check-config"],
        None,
    );
    assert_eq!(code, 0, "a warning, not an error: {err}");
    let warnings: Vec<&str> = out.lines().filter(|l| l.contains("warning:")).collect();
    assert_eq!(warnings.len(), 1, "only the unhandled schedule: {out}");
    assert!(
        warnings[0].contains("schedule \"nightly\" fires type \"report.build\""),
        "{out}"
    );
}

#[test]
fn check_config_names_file_line_and_key_and_exits_2() {
    let dir = TestDir::new();
    let path = dir.path("bad.toml");
    std::fs::write(
        &path,
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 0\n",
    )
    .unwrap();
    let (code, _, err) = kmqd(&["--config", path.to_str().unwrap(), "check-config"], None);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!(
            "{}:4:11: queues[0].workers: 0 is out of range",
            path.display()
        )),
        "{err}"
    );
}

#[test]
fn a_missing_plugin_file_is_refused_by_name() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &format!("{QUEUE}\n[plugins.gone]\nfile = \"libgone.so\"\n"),
    );
    let (code, _, err) = kmqd(
        &["--config", config.to_str().unwrap(), "check-config"],
        None,
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("libgone.so"), "{err}");
    // At the line of its [plugins.gone] section.
    let line = std::fs::read_to_string(&config)
        .unwrap()
        .lines()
        .position(|l| l == "[plugins.gone]")
        .unwrap()
        + 1;
    assert!(
        err.contains(&format!("{}:{line}:1: plugin ", config.display())),
        "{err}"
    );
}

#[test]
fn a_plugin_writable_by_others_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let plugin = dir.plugins_dir().join("libkmq_testkit.so");
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (code, _, err) = kmqd(
        &["--config", config.to_str().unwrap(), "check-config"],
        None,
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("writable by group or others") && err.contains("chmod go-w"),
        "{err}"
    );
}

#[test]
fn no_config_is_a_usage_error() {
    let (code, _, err) = kmqd(&["stats"], None);
    assert_eq!(code, 2);
    assert!(err.contains("--config"), "{err}");
}

#[test]
fn push_exit_codes() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let c = config.to_str().unwrap();
    let (code, out, err) = kmqd(
        &[
            "-c",
            c,
            "push",
            "jobs",
            "test",
            r#"{"a":1}"#,
            "--priority",
            "high",
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim().len(), 36, "prints the generated id: {out}");
    let (code, _, err) = kmqd(&["-c", c, "push", "nosuch", "test"], None);
    assert_eq!(code, 2);
    assert!(
        err.contains("queue \"nosuch\" is not in the config; configured queues: jobs"),
        "{err}"
    );
    let (code, _, err) = kmqd(&["-c", c, "push", "jobs", "test", "{oops"], None);
    assert_eq!(code, 2);
    assert!(err.contains("data is not valid JSON"), "{err}");
    let (code, _, err) = kmqd(
        &["-c", c, "push", "jobs", "test", "--priority", "urgent"],
        None,
    );
    assert_eq!(code, 2);
    assert!(err.contains("no priority \"urgent\""), "{err}");
    assert_eq!(
        kmqd(
            &["-c", c, "push", "jobs", "test", "--id", "u", "--unique"],
            None
        )
        .0,
        0
    );
    let (code, _, err) = kmqd(
        &["-c", c, "push", "jobs", "test", "--id", "u", "--unique"],
        None,
    );
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("task u is already queued"), "{err}");
    let high: i64 = redis.cmd(&["LLEN", "kmq:{jobs}:ready:high"]);
    let normal: i64 = redis.cmd(&["LLEN", "kmq:{jobs}:ready:normal"]);
    assert_eq!((high, normal), (1, 1));
}

#[test]
fn push_stdin_pushes_every_line_and_stops_at_a_bad_one() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let c = config.to_str().unwrap();
    let lines: String = (0..2500).map(|i| format!("{{\"n\":{i}}}\n")).collect();
    let (code, out, err) = kmqd(&["-c", c, "push", "jobs", "test", "--stdin"], Some(&lines));
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), "pushed 2500 tasks to jobs");
    assert_eq!(stats(&config, "jobs").ready, 2500);
    let (code, _, err) = kmqd(
        &["-c", c, "push", "jobs", "test", "--stdin"],
        Some("1\n2\n\n{bad\n3\n"),
    );
    assert_eq!(code, 2);
    assert!(
        err.contains("line 4: data is not valid JSON")
            && err.contains("the 2 tasks before it were pushed"),
        "{err}"
    );
    assert_eq!(stats(&config, "jobs").ready, 2502);
}

#[test]
fn stats_json_has_the_documented_shape() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let c = config.to_str().unwrap();
    assert_eq!(
        kmqd(
            &["-c", c, "push", "jobs", "test", "--priority", "low"],
            None
        )
        .0,
        0
    );
    let (code, out, err) = kmqd(&["-c", c, "stats", "--json"], None);
    assert_eq!(code, 0, "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    let jobs = &json["queues"]["jobs"];
    for key in [
        "ready",
        "processing",
        "delayed",
        "dead",
        "done",
        "retried",
        "failed",
        "dead_lettered",
    ] {
        assert!(jobs[key].is_u64(), "{key} missing in {out}");
    }
    assert_eq!(jobs["ready"], 1);
    assert_eq!(
        jobs["ready_by_level"],
        serde_json::json!({"high": 0, "normal": 0, "low": 1})
    );
    let (code, out, _) = kmqd(&["-c", c, "stats"], None);
    assert_eq!(code, 0);
    assert!(out.lines().nth(1).unwrap().starts_with("jobs"), "{out}");
}

#[test]
fn push_to_an_unreachable_redis_is_a_runtime_error() {
    let dir = TestDir::new();
    let path = dir.path("down.toml");
    let socket = dir.path("nobody-listens.sock");
    std::fs::write(
        &path,
        format!(
            "[redis]\nurl = \"unix://{}\"\nconnect_timeout = \"1s\"\n{QUEUE}",
            socket.display()
        ),
    )
    .unwrap();
    let (code, _, err) = kmqd(
        &["-c", path.to_str().unwrap(), "push", "jobs", "test"],
        None,
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("redis"), "{err}");
}

#[test]
fn every_example_config_parses() {
    let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/config"));
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            kmqd::Config::load(&path).unwrap_or_else(|e| panic!("{e}"));
            seen += 1;
        }
    }
    assert!(seen >= 2, "config/ holds the example configs");
}

#[test]
fn metrics_endpoint_serves_queue_depths_and_counters() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let port = free_port();
    let daemon_keys = format!("metrics_addr = \"127.0.0.1:{port}\"");
    let config = dir.config_with(&redis, &daemon_keys, QUEUE);
    let c = config.to_str().unwrap();
    assert_eq!(
        kmqd(
            &["-c", c, "push", "jobs", "test", "--priority", "high"],
            None
        )
        .0,
        0
    );
    let daemon = TestDaemon::start(&config);
    // Redis counts the task done (its settle) before the daemon lets go of it: wait for both.
    let scraped = eventually(
        std::time::Duration::from_secs(10),
        "the task to show as done and no longer held",
        || {
            let scraped = scrape(port);
            (
                scraped
                    .body
                    .contains("kmqd_tasks_done_total{queue=\"jobs\"} 1")
                    && scraped
                        .body
                        .contains("kmqd_daemon_held_tasks{queue=\"jobs\"} 0"),
                scraped,
            )
        },
    );
    assert!(scraped.status.ends_with("200 OK"), "{scraped:?}");
    let page = scraped.body;
    assert!(
        page.contains("kmqd_queue_ready{queue=\"jobs\",level=\"high\"} 0"),
        "{page}"
    );
    assert!(
        page.contains("# TYPE kmqd_queue_lag_seconds gauge"),
        "{page}"
    );
    daemon.stop();
}

/// `log_format = "json"`: every line the daemon writes is one JSON object with a level and a message, a task's
/// failure and a plugin's panic included (the SDK's panic hook prints nothing; the reason carries it), and every
/// task state change is a debug event with the task's queue, id, type, attempt and handler duration.
#[test]
fn json_logs_are_one_object_per_line() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(
        &redis,
        "shutdown_grace = \"5s\"\nlog_format = \"json\"",
        &safe_queue("retry_times = 0"),
    );
    let mut daemon = Process::start(&config, dir.path("kmqd.log"));
    let client = client(&config);
    for (id, data) in [
        ("fails", r#"{"outcome":"fail"}"#),
        ("panics", r#"{"outcome":"panic"}"#),
        ("works", r#"{"output":"3 rows\nwritten"}"#),
    ] {
        let task = kmqd::NewTask::new("test", data).unwrap().id(id);
        assert!(client.push("jobs", task).unwrap().is_accepted());
    }
    eventually(
        std::time::Duration::from_secs(20),
        "two tasks dead-lettered, one done",
        || {
            let s = stats(&config, "jobs");
            (s.dead_lettered == 2 && s.done == 1, s)
        },
    );
    daemon.signal(signal_hook::consts::SIGTERM);
    assert_eq!(
        daemon.wait_within(std::time::Duration::from_secs(20)),
        Some(0)
    );
    let log = daemon.log_text();
    let mut levels = std::collections::BTreeSet::new();
    let mut events = Vec::new();
    for line in log.lines() {
        let event: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|error| {
            panic!("not a JSON object ({error}): {line:?}\nthe whole log:\n{log}")
        });
        assert!(event["message"].is_string(), "{line}");
        levels.insert(event["level"].as_str().unwrap_or("?").to_string());
        events.push(event);
    }
    assert!(
        levels.contains("INFO") && levels.contains("WARN") && levels.contains("DEBUG"),
        "{levels:?}\n{log}"
    );
    let event = |id: &str, message: &str| {
        events
            .iter()
            .find(|e| e["id"] == id && e["message"] == message)
            .unwrap_or_else(|| panic!("no {message:?} event for {id}:\n{log}"))
    };
    let started = event("works", "task started");
    assert_eq!(
        (&started["queue"], &started["kind"], &started["attempt"]),
        (&"jobs".into(), &"test".into(), &0.into()),
        "{started}"
    );
    let done = event("works", "task done");
    assert_eq!(done["kind"], "test", "{done}");
    assert!(done["duration"].as_f64().is_some(), "seconds: {done}");
    assert_eq!(
        done["output"], "3 rows\nwritten",
        "the handler's output, one field: {done}"
    );
    let panicked = event("panics", "task dead-lettered");
    let reason = panicked["reason"].as_str().unwrap();
    assert!(
        reason.starts_with(
            "panic: testkit: asked to panic (task panics) at plugins/testkit/src/lib.rs:"
        ),
        "{panicked}"
    );
}

/// A misspelled level silenced every log line before (tracing takes `warning` for a target): now the config and
/// `RUST_LOG` are checked, exit 2 with the level meant.
#[test]
fn a_misspelled_log_level_is_a_config_error() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(&redis, "log_level = \"warning\"", QUEUE);
    let c = config.to_str().unwrap();
    let (code, _, err) = kmqd(&["-c", c, "check-config"], None);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("daemon.log_level") && err.contains("did you mean \"warn\""),
        "{err}"
    );
    let good = dir.config_named(
        "good.toml",
        &format!("url = \"{}\"", redis.url()),
        "",
        QUEUE,
        &dir.record_file(),
    );
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kmqd"))
        .args(["-c", good.to_str().unwrap(), "check-config"])
        .env("RUST_LOG", "kmqd=verbose")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(
        err.contains("RUST_LOG") && err.contains("did you mean \"trace\""),
        "{err}"
    );
}
