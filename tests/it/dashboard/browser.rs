//! The pages in a real headless Chromium: tests/it/dashboard/browser.py drives it through Debian's
//! python3-selenium and chromium-driver (scripts/test installs them: `ensure_chromium`), against the Redis,
//! daemon and two dashboards (one `--read-only`) this test starts. It checks that the overview lists the queues
//! with the counts Redis holds and charts the hour of history in Redis, that a push shows on the page within two
//! seconds, that a dead task's Requeue button makes it run again, that Pause and Resume change the queue's state,
//! that the daemons page and a task found by id show what Redis holds, that a task's page looks it up once and
//! again only on its button (review M7: a lookup scans the queue's lists), that a queue's limits panel shows
//! its running count against `max_running`, its rate window, its limited type's counts and what holds it back
//! (and the overview its compact form), on a phone too, that a grouped queue's page lists its busiest groups (a
//! paused one, a busy one at its max_running) and a group's Resume button makes its tasks run, and that
//! `--read-only` draws no button and refuses an action sent anyway.
//!
//! Its screenshots go to the test's directory; with `KMQD_DASHBOARD_SCREENSHOTS=DIR` they are copied there
//! (`KMQD_DASHBOARD_SCREENSHOTS=docs` refreshes the pictures of docs/DASHBOARD.md and the README).

use std::process::Command;
use std::time::Duration;

use super::Dashboard;
use crate::support::*;

/// Debian's python3, whose python3-selenium package the test needs (not a python3 of pyenv or a venv).
pub(super) const PYTHON: &str = "/usr/bin/python3";

const QUEUES: &str = "\
[[queues]]\nname = \"mail\"\nmode = \"safe\"\npriorities = [\"high\", \"normal\", \"low\"]\nworkers = 4\n\n\
[[queues]]\nname = \"thumbnails\"\nmode = \"default\"\nworkers = 2\n\n\
[[queues]]\nname = \"billing\"\nmode = \"safe\"\nworkers = 2\n\n\
[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 2\nretry_times = 0\nlease_timeout = \"2s\"\n\n\
[[queues]]\nname = \"reports\"\nmode = \"safe\"\nworkers = 4\nmax_running = 3\nrate_limit = \"600/m\"\n\
[[queues.limits]]\ntype = \"report\"\nmax_running = 1\n\n\
[[queues]]\nname = \"tenants\"\nmode = \"safe\"\nworkers = 2\nidle_poll = \"100ms\"\n\
[queues.groups]\nmax_running = 1\n";

pub(super) fn chromium_is_here() {
    let probe = Command::new(PYTHON)
        .args(["-c", "import selenium"])
        .status()
        .map(|status| status.success());
    assert!(
        matches!(probe, Ok(true)) && std::path::Path::new("/usr/bin/chromedriver").exists(),
        "the browser test needs Debian's chromium, chromium-driver and python3-selenium; scripts/test installs \
         them (ensure_chromium in scripts/common.sh)"
    );
}

/// An hour of `queue`'s history as its daemons would have written it (broker/history.rs): a busy hour, a burst
/// of failures 20 minutes ago; the stats counters set to where the hour ends, so the daemon's own samples go on
/// from there. The charts' picture, and what the browser checks they draw.
fn seed_history(redis: &RedisServer, queue: &str) {
    let time: Vec<String> = redis.cmd(&["TIME"]);
    let now_ms = time[0].parse::<i64>().unwrap() * 1000;
    let minute = now_ms / 60_000;
    let (mut done, mut failed) = (0u64, 0u64);
    for ago in (1..=60).rev() {
        let phase = ago as f64 / 7.0;
        done += (60.0 * (300.0 + 80.0 * phase.sin())) as u64;
        failed += if (18..=21).contains(&ago) { 1800 } else { 6 };
        let ready = (2500.0 + 1800.0 * (phase / 2.0).cos()) as u64;
        let sample = format!(
            r#"{{"at":{},"done":{done},"failed":{failed},"ready":{ready},"delayed":{},"dead":{}}}"#,
            (minute - ago) * 60_000 + 2_000,
            40 + ago % 7,
            u64::from(ago <= 20),
        );
        let key = format!("kmq:{{{queue}}}:history");
        let _: i64 = redis.cmd(&["ZADD", &key, &(minute - ago).to_string(), &sample]);
    }
    let stats = format!("kmq:{{{queue}}}:stats");
    let _: i64 = redis.cmd(&[
        "HSET",
        &stats,
        "done",
        &done.to_string(),
        "failed",
        &failed.to_string(),
    ]);
}

#[test]
fn the_pages_show_redis_and_their_buttons_act() {
    chromium_is_here();
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_for_types(&redis, QUEUES, &["test", "report"]);
    seed_history(&redis, "mail");
    let daemon = TestDaemon::start(&config);
    let client = client(&config);
    client
        .push(
            "jobs",
            kmqd::NewTask::new("test", r#"{"outcome":"fail"}"#)
                .unwrap()
                .id("doomed"),
        )
        .unwrap();
    eventually(Duration::from_secs(30), "doomed to be dead", || {
        (stats(&config, "jobs").dead == 1, ())
    });
    client.pause("billing").unwrap();
    let task = |data: &str| kmqd::NewTask::new("test", data).unwrap();
    client
        .push_batch("billing", (0..5).map(|_| task("{}")))
        .unwrap();
    client
        .push_batch(
            "thumbnails",
            (0..3).map(|_| task("{}").delay(Duration::from_secs(600))),
        )
        .unwrap();
    // A backlog that drains for the length of the test: the overview's rates move.
    let backlog = (0..6000).map(|n| {
        let level = ["high", "normal", "low"][n % 3];
        task(r#"{"sleep_ms": 10}"#).priority(level)
    });
    client.push_batch("mail", backlog).unwrap();
    // A queue its limits hold back for the length of the test: 3 tasks running of its max_running 3, one of them
    // the "report" its type's max_running 1 lets run (the first pushed: a claim takes the head first), the other
    // two reports waiting in their flow; each runs until the daemon's shutdown cancels it.
    let forever = |kind: &str| kmqd::NewTask::new(kind, r#"{"until_cancelled": true}"#).unwrap();
    client
        .push_batch(
            "reports",
            (0..3)
                .map(|_| forever("report"))
                .chain((0..4).map(|_| forever("test"))),
        )
        .unwrap();

    // A grouped queue: acme paused with 3 tasks waiting; busy at its max_running 1, one task running until the
    // daemon's shutdown cancels it and two waiting behind it.
    client.pause_group("tenants", "acme").unwrap();
    // The one that runs (busy0, the group's head) reports progress, which its task page shows.
    let reporting = r#"{"until_cancelled": true, "progress": [0.5, "half way"]}"#;
    let grouped = (0..3)
        .map(|n| task(reporting).id(format!("busy{n}")).group("busy"))
        .chain((0..3).map(|n| task("{}").id(format!("acme{n}")).group("acme")));
    client.push_batch("tenants", grouped).unwrap();

    let dashboard = Dashboard::start(&config, &dir, &[]);
    let read_only = Dashboard::start_named(&config, &dir, "dashboard-ro.log", &["--read-only"]);
    let shots = dir.path("screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let args = serde_json::json!({
        "url": format!("http://{}", dashboard.addr),
        "read_only_url": format!("http://{}", read_only.addr),
        "kmqd": env!("CARGO_BIN_EXE_kmqd"),
        "config": config,
        "shots": shots,
        "expect": {
            "billing": {"ready": 5, "dead": 0, "daemons": 1},
            "jobs": {"ready": 0, "dead": 1},
            "thumbnails": {"delayed": 3},
            "reports": {"processing": 3, "ready": 4},
        },
        "daemons": 6,
    });
    let script = workspace_dir().join("tests/it/dashboard/browser.py");
    let output = Command::new(PYTHON)
        .arg(&script)
        .arg(args.to_string())
        .output()
        .expect("run browser.py");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "browser.py: {stdout}{stderr}\ndashboard log:\n{}",
        dashboard.log()
    );
    println!("browser.py measured: {stdout}");

    // What the button did, seen from Redis: doomed ran a second time; the read-only refusal changed nothing.
    assert_eq!(dir.records().runs_of("doomed"), 2);
    assert_ran_once(&dir, "acme", 3);
    assert_eq!(
        redis.cmd::<i64>(&["EXISTS", "kmq:{jobs}:paused"]),
        0,
        "paused, then resumed"
    );
    for action in ["dead requeue", "pause", "resume", "group resume"] {
        assert!(
            dashboard.log().contains(&format!(r#"action="{action}""#)),
            "{action}"
        );
    }
    assert!(
        !read_only.log().contains("dashboard action"),
        "{}",
        read_only.log()
    );

    for name in [
        "dashboard-overview.png",
        "dashboard-queue.png",
        "dashboard-phone.png",
        "dashboard-limits.png",
        "dashboard-groups.png",
    ] {
        let shot = shots.join(name);
        assert!(
            std::fs::metadata(&shot).is_ok_and(|m| m.len() > 0),
            "{name}"
        );
        if let Some(to) = std::env::var_os("KMQD_DASHBOARD_SCREENSHOTS") {
            let to = workspace_dir().join(to);
            std::fs::copy(&shot, to.join(name)).unwrap();
        }
    }
    drop(dashboard);
    drop(read_only);
    daemon.stop();
}
