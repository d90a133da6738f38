//! kmqd on a Sentinel-managed master (one master, one replica, three sentinels, started by the harness): a
//! failover mid-drain.

use std::collections::HashSet;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use kmqd::redis_server::Signal;
use kmqd::redis_server::sentinel::{SentinelOptions, SentinelSetup};

use crate::cluster::{push_acknowledged, wait_drained};
use crate::support::{TestDaemon, TestDir, client, eventually};

#[test]
fn a_sentinel_failover_mid_drain_loses_no_acknowledged_task_with_wait_replicas() {
    let mut setup = SentinelSetup::start(SentinelOptions::default()).expect("start sentinels");
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
    // With wait_replicas = 1 the new master, alone, acknowledges nothing: the old one comes back as its replica
    // (the sentinels reconfigure it), and the drain goes on.
    setup.server_mut(&old).unwrap().restart().unwrap();
    let acknowledged = producer.join().unwrap();
    assert_eq!(acknowledged.len(), 2000);
    wait_drained(&watcher, "jobs");
    daemon.stop();
    let ran: HashSet<String> = dir.records().starts.into_iter().map(|(id, _)| id).collect();
    let lost: Vec<&String> = acknowledged
        .iter()
        .filter(|id| !ran.contains(*id))
        .collect();
    assert!(lost.is_empty(), "{} never ran: {lost:?}", lost.len());
}
