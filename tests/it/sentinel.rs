//! kmqd on a Sentinel-managed master (one master, one replica, three sentinels, started by the harness): a
//! failover mid-drain.

use std::collections::HashSet;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use kmqd_harness::Signal;
use kmqd_harness::sentinel::{SentinelOptions, SentinelSetup};

use crate::cluster::push_acknowledged;
use crate::support::{TestDaemon, TestDir, client, eventually, wait_drained};

#[test]
fn a_sentinel_failover_mid_drain_loses_no_acknowledged_task_with_wait_replicas() {
    // Two replicas: after the failover the new master still has one, so wait_replicas = 1 goes on acknowledging
    // (docs/OPERATIONS.md: run N + 1 replicas). Restarting the killed master instead, empty (no persistence), once
    // lost the data of the promoted replica in 1 of 8 runs: an empty master coming back is a hazard of its own.
    let mut setup = SentinelSetup::start(SentinelOptions {
        replicas: 2,
        ..SentinelOptions::default()
    })
    .expect("start sentinels");
    let seeds: Vec<String> = setup
        .sentinel_urls()
        .iter()
        .map(|url| format!("\"{url}\""))
        .collect();
    let dir = TestDir::new();
    let redis = format!(
        "sentinel = [{}]\nsentinel_master = \"{}\"\nwait_replicas = 1\nwait_timeout = \"500ms\"\nio_timeout = \"2s\"",
        seeds.join(", "),
        setup.master_name()
    );
    let config = dir.config_raw(
        &redis,
        "shutdown_grace = \"5s\"",
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 4\nlease_timeout = \"3s\"\n",
    );
    let daemon = TestDaemon::start(&config);
    let producer = {
        let config = config.clone();
        std::thread::spawn(move || {
            push_acknowledged(&config, "jobs", ("s", 2000, "{}"), &AtomicUsize::new(0))
        })
    };
    let watcher = client(&config);
    eventually(Duration::from_secs(20), "a drain under way", || {
        let done = watcher.stats("jobs").map(|s| s.done).unwrap_or(0);
        (done >= 200, done)
    });
    let old = setup.kill_master(Signal::Kill).unwrap();
    let new = setup.wait_failover().unwrap();
    assert_ne!(old, new);
    let acknowledged = producer.join().unwrap();
    assert_eq!(acknowledged.len(), 2000);
    // Nothing stranded under the live owner, and what the new master holds adds up: every task it counts pushed
    // is done, none dead.
    let drained = wait_drained(&watcher, "jobs");
    assert_eq!(
        (drained.done + drained.cancelled, drained.dead),
        (drained.pushed, 0),
        "{drained:?}"
    );
    daemon.stop();
    let ran: HashSet<String> = dir.records().starts.into_iter().map(|(id, _)| id).collect();
    let lost: Vec<&String> = acknowledged
        .iter()
        .filter(|id| !ran.contains(*id))
        .collect();
    assert!(lost.is_empty(), "{} never ran: {lost:?}; {}", lost.len(), {
        // What the master holds now, to tell a lost push from a task lost later.
        let master = setup.master().unwrap();
        let stats: redis::Value = master.query(&["HGETALL", "kmq:{jobs}:stats"]).unwrap();
        let keys: redis::Value = master.query(&["KEYS", "*"]).unwrap();
        format!("the master's stats {stats:?}, its keys {keys:?}")
    });
}
