//! The metrics endpoint as a scraper and an operator meet it: both exposition formats, checked by promtool on a
//! real scrape; the page with Redis stalled or down; port 0 and `--metrics-addr` for several daemons on a host;
//! the sample alert rules of docs/OPERATIONS.md.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::*;

/// What Prometheus 2.x sends.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                                 version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
/// Generous: the endpoint answers within about a second, but the machine may be busy.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs promtool with `args` and `stdin`; returns whether it succeeded, with what it printed.
fn promtool(args: &[&str], stdin: &str) -> (bool, String) {
    use std::io::Write;
    let mut child = Command::new("promtool")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| {
            panic!("cannot run promtool ({error}); scripts/test installs it (Debian's prometheus package)")
        });
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), printed)
}

fn page(addr: SocketAddr) -> String {
    scrape_with(addr, None, SCRAPE_TIMEOUT).body
}

fn has(page: &str, sample: &str) -> bool {
    page.lines().any(|line| line == sample)
}

#[test]
fn a_scrape_after_tasks_ran_passes_promtool_and_shows_every_family() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(
        &redis,
        "shutdown_grace = \"5s\"\nmetrics_addr = \"127.0.0.1:0\"",
        &safe_queue(
            "retry_times = 1\nbackoff = \"10ms\"\nexecution_timeout = \"300ms\"\n\
             [[queues.limits]]\ntype = \"test\"\nmax_running = 100\n",
        ),
    );
    push_many(&config, "ok", 2, "{}");
    push_many(&config, "fail", 1, r#"{"outcome": "fail"}"#);
    push_many(&config, "again", 1, r#"{"fail_attempts": 1}"#);
    push_many(&config, "slow", 1, r#"{"until_cancelled": true}"#);
    client(&config)
        .push_batch(
            "jobs",
            vec![kmqd::NewTask::new("nobody-handles-this", "{}").unwrap()],
        )
        .unwrap();
    let mut daemon = Process::start(&config, dir.path("kmqd.log"));
    let addr = daemon.metrics_addr();

    let outcome = |kind: &str, outcome: &str, n: u64| {
        format!(
            "kmqd_task_outcomes_total{{queue=\"jobs\",type=\"{kind}\",outcome=\"{outcome}\"}} {n}"
        )
    };
    let text = eventually(Duration::from_secs(30), "every task's outcome", || {
        let text = page(addr);
        let all = has(&text, &outcome("test", "done", 3))
            && has(&text, &outcome("test", "retried", 1))
            && has(&text, &outcome("test", "dead", 1))
            && has(&text, &outcome("(unknown)", "dead", 1))
            && has(&text, &outcome("test", "timed_out", 2))
            && has(&text, "kmqd_tasks_done_total{queue=\"jobs\"} 3")
            && has(&text, "kmqd_queue_dead{queue=\"jobs\"} 3");
        (all, text)
    });
    println!("{text}");
    // Seven runs of type test: two done, one failed, one retried then done, one timed out twice (retried, then
    // dead-lettered: counted as timed out each time); the timed-out ones ran 300 ms or more.
    let runs = |le: &str, n: u64| {
        format!("kmqd_task_duration_seconds_bucket{{queue=\"jobs\",type=\"test\",le=\"{le}\"}} {n}")
    };
    // A timed-out handler returns after its outcome was settled (once it sees its cancel flag).
    let text = eventually(Duration::from_secs(10), "every run timed", || {
        let text = page(addr);
        let timed = "kmqd_task_duration_seconds_count{queue=\"jobs\",type=\"test\"} 7";
        (has(&text, timed), text)
    });
    assert!(
        has(&text, &runs("0.25", 5)) && has(&text, &runs("300", 7)),
        "{text}"
    );
    for sample in [
        "kmqd_redis_up 1",
        "kmqd_queue_daemons{queue=\"jobs\"} 1",
        "kmqd_queue_paused{queue=\"jobs\"} 0",
        "kmqd_queue_dead{queue=\"jobs\"} 3",
        "kmqd_queue_ready{queue=\"jobs\",level=\"normal\"} 0",
        "kmqd_tasks_cancelled_total{queue=\"jobs\"} 0",
        "kmqd_daemon_workers{queue=\"jobs\"} 8",
        "kmqd_daemon_busy_workers{queue=\"jobs\"} 0",
        "kmqd_daemon_stuck_workers{queue=\"jobs\"} 0",
        "kmqd_daemon_held_tasks{queue=\"jobs\"} 0",
        "kmqd_type_running{queue=\"jobs\",type=\"test\"} 0",
        "kmqd_type_waiting{queue=\"jobs\",type=\"test\"} 0",
        "kmqd_type_throttled_seconds{queue=\"jobs\",type=\"test\"} 0.0",
        &format!(
            "kmqd_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        ),
    ] {
        assert!(has(&text, sample), "{sample} in\n{text}");
    }
    let (ok, printed) = promtool(&["check", "metrics"], &text);
    assert!(ok, "promtool check metrics: {printed}\n{text}");

    let classic = scrape_with(addr, Some("text/plain"), SCRAPE_TIMEOUT);
    assert!(classic.status.ends_with("200 OK"), "{classic:?}");
    assert_eq!(
        classic.content_type,
        "text/plain; version=0.0.4; charset=utf-8"
    );
    assert!(!classic.body.contains("# EOF"), "{classic:?}");
    let open = scrape_with(addr, Some(PROMETHEUS_ACCEPT), SCRAPE_TIMEOUT);
    assert_eq!(
        open.content_type,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(
        open.body.contains("# TYPE kmqd_tasks_done counter\n"),
        "{open:?}"
    );
    assert!(
        open.body
            .contains("kmqd_tasks_done_total{queue=\"jobs\"} 3\n"),
        "{open:?}"
    );
    assert!(open.body.ends_with("# EOF\n"), "{open:?}");

    daemon.signal(15);
    assert_eq!(
        daemon.wait_within(Duration::from_secs(30)),
        Some(0),
        "{}",
        daemon.log_text()
    );
}

/// A stalled Redis (SIGSTOP) holds the metrics' reads for all of `io_timeout`, longer than the scraper waits: the
/// page must come without them. A Redis that is down refuses at once; its failed reads are counted.
#[test]
fn with_redis_stalled_or_down_a_scrape_answers_and_says_redis_up_0() {
    let mut redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_raw(
        &format!("url = \"{}\"\nio_timeout = \"60s\"", redis.url()),
        "shutdown_grace = \"5s\"\nmetrics_addr = \"127.0.0.1:0\"",
        &safe_queue(""),
    );
    let daemon = Process::start(&config, dir.path("kmqd.log"));
    let addr = daemon.metrics_addr();
    eventually(Duration::from_secs(30), "Redis to be up", || {
        let text = page(addr);
        (has(&text, "kmqd_redis_up 1"), text)
    });

    redis.pause();
    let stalled = scrape_with(addr, None, SCRAPE_TIMEOUT);
    assert!(
        stalled.status.ends_with("200 OK"),
        "answered before the scraper gave up: {stalled:?}"
    );
    assert!(has(&stalled.body, "kmqd_redis_up 0"), "{stalled:?}");
    assert!(
        has(&stalled.body, "kmqd_daemon_held_tasks{queue=\"jobs\"} 0"),
        "{stalled:?}"
    );
    assert!(
        !stalled.body.contains("kmqd_queue_ready"),
        "no stale depths: {stalled:?}"
    );
    let (ok, printed) = promtool(&["check", "metrics"], &stalled.body);
    assert!(ok, "promtool check metrics: {printed}");
    redis.resume();
    eventually(Duration::from_secs(30), "Redis up again", || {
        let text = page(addr);
        (has(&text, "kmqd_redis_up 1"), text)
    });

    redis.stop(Signal::Term);
    let down = scrape_with(addr, None, SCRAPE_TIMEOUT);
    assert!(has(&down.body, "kmqd_redis_up 0"), "{down:?}");
    eventually(Duration::from_secs(30), "the failed reads counted", || {
        let text = page(addr);
        let errors = text.lines().any(|line| {
            line.starts_with(
                "kmqd_redis_errors_total{operation=\"reading queues for the metrics\"} ",
            )
        });
        (errors, text)
    });
}

#[test]
fn port_0_and_metrics_addr_give_each_daemon_of_one_config_its_own_endpoint() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(
        &redis,
        "shutdown_grace = \"5s\"\nmetrics_addr = \"127.0.0.1:0\"",
        &safe_queue(""),
    );
    let free_port = free_port();
    let chosen = format!("127.0.0.1:{free_port}");
    let daemons = [
        Process::start(&config, dir.path("a.log")),
        Process::start(&config, dir.path("b.log")),
        Process::start_with_args(&config, dir.path("c.log"), &["--metrics-addr", &chosen]),
    ];
    let addrs: Vec<SocketAddr> = daemons.iter().map(Process::metrics_addr).collect();
    assert_eq!(addrs[2].to_string(), chosen, "the command line wins");
    assert!(addrs[0] != addrs[1] && addrs[0].port() != 0, "{addrs:?}");
    for addr in addrs {
        eventually(Duration::from_secs(30), "every daemon on the queue", || {
            let text = page(addr);
            (has(&text, "kmqd_queue_daemons{queue=\"jobs\"} 3"), text)
        });
    }
}

/// docs/alerts.yml is the rules block of docs/OPERATIONS.md, and promtool accepts it.
#[test]
fn the_sample_alert_rules_are_valid_and_the_doc_shows_them() {
    let docs = workspace_dir().join("docs");
    let rules = std::fs::read_to_string(docs.join("alerts.yml")).unwrap();
    let operations = std::fs::read_to_string(docs.join("OPERATIONS.md")).unwrap();
    let block = operations
        .split("<!-- docs/alerts.yml -->\n```yaml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("OPERATIONS.md shows docs/alerts.yml after its marker");
    assert_eq!(
        block, rules,
        "docs/OPERATIONS.md and docs/alerts.yml differ"
    );
    let path = docs.join("alerts.yml");
    let (ok, printed) = promtool(&["check", "rules", path.to_str().unwrap()], "");
    assert!(ok, "promtool check rules: {printed}");
}
