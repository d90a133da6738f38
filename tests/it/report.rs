//! The queue reporter (docs/OPERATIONS.md, "Queue reports and lag_warn"): with `[daemon] report_interval` the
//! daemon logs one `queue report` event per queue per interval, its numbers as JSON fields under
//! `log_format = "json"`; a queue's `lag_warn` warns once when its lag passes it and once when it recovers.

use std::path::Path;
use std::time::Duration;

use crate::support::*;

/// The log's JSON events with `message`, as parsed objects.
fn events(daemon: &Process, message: &str) -> Vec<serde_json::Value> {
    daemon
        .log_text()
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|event| {
            event["message"]
                .as_str()
                .is_some_and(|m| m.starts_with(message))
        })
        .collect()
}

fn of_queue(events: Vec<serde_json::Value>, queue: &str) -> Vec<serde_json::Value> {
    events
        .into_iter()
        .filter(|event| event["queue"] == queue)
        .collect()
}

fn cli(config: &Path, args: &[&str]) {
    let mut all = vec!["-c", config.to_str().unwrap()];
    all.extend_from_slice(args);
    let (code, _, err) = kmqd(&all, None);
    assert_eq!(code, 0, "{err}");
}

/// `held` is paused with 5 tasks; `idle` is empty. Every report of `held` has ready = 5 at its level, paused,
/// no rate; `idle` is reported too. `held`'s oldest task ages past its lag_warn: one warning, however many checks
/// follow while it stays high; the resume drains it: one "recovered" line.
#[test]
fn reports_per_queue_and_lag_warn_once_each_way() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(
        &redis,
        "shutdown_grace = \"5s\"\nreport_interval = \"200ms\"\nlog_format = \"json\"",
        "[[queues]]\nname = \"held\"\nmode = \"safe\"\npriorities = [\"high\", \"low\"]\nlag_warn = \"500ms\"\n\n\
         [[queues]]\nname = \"idle\"\nmode = \"default\"\n",
    );
    cli(&config, &["queue", "pause", "held"]);
    for i in 0..5 {
        cli(
            &config,
            &[
                "push",
                "--priority",
                "low",
                "--id",
                &format!("h{i}"),
                "held",
                "test",
            ],
        );
    }
    let mut daemon = Process::start(&config, dir.path("daemon.log"));
    let reports = eventually(Duration::from_secs(20), "3 reports of held", || {
        let reports = of_queue(events(&daemon, "queue report"), "held");
        (reports.len() >= 3, reports)
    });
    println!("{}", reports[0]);
    for report in &reports {
        assert_eq!(report["level"], "INFO");
        assert_eq!(report["ready"], 5, "{report}");
        assert_eq!(report["ready_by_level"], "high:0,low:5", "{report}");
        assert_eq!(report["paused"], true, "{report}");
        for zero in ["processing", "delayed", "dead"] {
            assert_eq!(report[zero], 0, "{zero}: {report}");
        }
        assert_eq!(report["done_per_s"], 0.0, "{report}");
        assert_eq!(report["failed_per_s"], 0.0, "{report}");
        assert!(report["lag_ms"].as_i64().is_some(), "{report}");
    }
    let idle = of_queue(events(&daemon, "queue report"), "idle");
    assert!(!idle.is_empty(), "every queue is reported");
    assert_eq!(idle[0]["ready"], 0, "{}", idle[0]);
    assert!(
        idle[0].get("lag_ms").is_none(),
        "no lag when nothing is ready"
    );

    let warning = eventually(Duration::from_secs(20), "the lag warning", || {
        let found = events(&daemon, "queue lag above lag_warn");
        (!found.is_empty(), found)
    });
    assert_eq!(warning.len(), 1, "one warning: {:?}", warning.get(1));
    assert_eq!(warning[0]["level"], "WARN");
    assert_eq!(warning[0]["queue"], "held");
    assert_eq!(warning[0]["lag_warn_ms"], 500);
    assert!(
        warning[0]["lag_ms"].as_i64().unwrap() > 500,
        "{}",
        warning[0]
    );
    // Many checks (every 125 ms) and reports later, still one warning.
    let seen = of_queue(events(&daemon, "queue report"), "held").len();
    eventually(Duration::from_secs(20), "5 more reports", || {
        let now = of_queue(events(&daemon, "queue report"), "held").len();
        (now >= seen + 5, now)
    });
    assert_eq!(events(&daemon, "queue lag above lag_warn").len(), 1);

    cli(&config, &["queue", "resume", "held"]);
    let recovered = eventually(Duration::from_secs(20), "the recovery", || {
        let found = events(&daemon, "queue lag recovered");
        (found.len() == 1, found)
    });
    assert_eq!(recovered[0]["queue"], "held");
    let seen = of_queue(events(&daemon, "queue report"), "held").len();
    let last = eventually(
        Duration::from_secs(20),
        "a report of the drained queue",
        || {
            let reports = of_queue(events(&daemon, "queue report"), "held");
            let last = reports.last().cloned().unwrap();
            (reports.len() > seen && last["ready"] == 0, last)
        },
    );
    println!("{last}");
    assert_eq!(events(&daemon, "queue lag above lag_warn").len(), 1);
    assert_eq!(events(&daemon, "queue lag recovered").len(), 1);
    daemon.signal(signal_hook::consts::SIGTERM);
    assert_eq!(daemon.wait_within(Duration::from_secs(30)), Some(0));
}
