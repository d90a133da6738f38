//! `worker_nice` as an operator sees it in `/proc`: the queue's worker threads run that much nicer than the
//! daemon's other threads (its fetcher and acker among them), which keep the daemon's own priority.

use std::time::Duration;

use crate::support::*;

/// The name and niceness of each thread of process `pid`.
fn threads(pid: u32) -> Vec<(String, i32)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| {
            let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            // Field 19 of stat(5), counted after the name in parentheses (which may hold spaces): state is 3.
            let nice = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(16)?
                .parse()
                .ok()?;
            Some((comm.trim().to_string(), nice))
        })
        .collect()
}

#[test]
fn worker_nice_lowers_the_queues_workers_and_no_other_thread() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(&redis, "", &safe_queue("workers = 3\nworker_nice = 7"));
    let daemon = Process::start(&config, dir.path("kmqd.log"));
    let pid = daemon.child.id();
    // The main thread is named after the binary; thread names are cut at 15 bytes ("kmqd-worker-job").
    let expected = |threads: &[(String, i32)], name: &str| {
        let base = base(threads);
        if name.starts_with("kmqd-worker-") {
            (base + 7).min(19)
        } else {
            base
        }
    };
    let seen = eventually(Duration::from_secs(30), "three workers, lowered", || {
        let seen = threads(pid);
        let lowered = seen
            .iter()
            .filter(|(name, nice)| {
                name.starts_with("kmqd-worker-") && *nice == expected(&seen, name)
            })
            .count();
        (lowered == 3, seen)
    });
    for (name, nice) in &seen {
        assert_eq!(*nice, expected(&seen, name), "thread {name}: {seen:?}");
    }
    assert!(
        seen.iter()
            .any(|(name, _)| name.starts_with("kmqd-fetcher-")),
        "the fetcher was looked at too: {seen:?}"
    );
}

/// The niceness of the daemon's main thread, which the others start with.
fn base(threads: &[(String, i32)]) -> i32 {
    threads
        .iter()
        .find(|(name, _)| name == "kmqd")
        .map_or(i32::MIN, |(_, nice)| *nice)
}
