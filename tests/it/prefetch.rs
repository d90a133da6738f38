//! The adaptive prefetch (`src/daemon/lane/depth.rs`) as an operator sees it, through `kmqd_daemon_prefetch`: a
//! queue that leaves `prefetch` out deepens it for a backlog of quick tasks, up to what `max_held` allows, and
//! keeps it shallow for slow ones, so that a daemon does not hold tasks that another could run.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::*;

/// The prefetch gauge of queue `jobs` on the page at `addr` (`None` before the first scrape that shows it).
fn prefetch(addr: SocketAddr) -> Option<usize> {
    let page = scrape_with(addr, None, Duration::from_secs(30)).body;
    page.lines()
        .find_map(|line| line.strip_prefix("kmqd_daemon_prefetch{queue=\"jobs\"} "))
        .and_then(|value| value.trim().parse().ok())
}

/// Waits until every one of `n` tasks is done.
fn all_done(config: &std::path::Path, n: u64) {
    eventually(Duration::from_secs(120), "every task done", || {
        let stats = stats(config, "jobs");
        (stats.done == n, stats)
    });
}

#[test]
fn a_backlog_of_quick_tasks_deepens_the_prefetch_up_to_max_held() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(
        &redis,
        "metrics_addr = \"127.0.0.1:0\"",
        &safe_queue("workers = 4\nmax_held = 1004"),
    );
    let n = 100_000;
    push_many(&config, "quick", n, "{}");
    let daemon = Process::start(&config, dir.path("kmqd.log"));
    let addr = daemon.metrics_addr();
    // It starts at `workers` (4); idle workers with a backlog grow it within a few 25 ms windows.
    let deepest = eventually(Duration::from_secs(60), "a deeper prefetch", || {
        let now = prefetch(addr);
        (now.is_some_and(|p| p > 100), now)
    });
    all_done(&config, n as u64);
    let last = prefetch(addr).unwrap();
    assert!(
        deepest.unwrap() <= 1000 && last <= 1000,
        "never beyond max_held - workers: {deepest:?}, {last}"
    );
}

#[test]
fn slow_tasks_keep_the_prefetch_shallow() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(
        &redis,
        "metrics_addr = \"127.0.0.1:0\"",
        &safe_queue("workers = 8"),
    );
    // 50 ms each on 8 workers: 160 tasks/s, a backlog of about 4 s. Every task that waits for a worker waits
    // 50 ms or more, which no claim's round trip needs: the standing queue is taken off, from 8 down to the
    // floor of 20 ms of work (3 tasks at 160/s; 4 when a window's claims ran ahead of its rate).
    let n = 640;
    push_many(&config, "slow", n, r#"{"sleep_ms": 50}"#);
    let daemon = Process::start(&config, dir.path("kmqd.log"));
    let addr = daemon.metrics_addr();
    eventually(Duration::from_secs(60), "a prefetch of at most 4", || {
        let now = prefetch(addr);
        (now.is_some_and(|p| p <= 4), now)
    });
    let ready = stats(&config, "jobs").ready;
    assert!(
        ready > 0,
        "the prefetch came down while the backlog lasted (a slow machine may need more tasks)"
    );
    all_done(&config, n as u64);
}
