//! kmqd on a real Redis Cluster (three masters, three replicas, started by the harness): queues on different
//! masters, a master killed mid-drain, a queue's slot migrated while it is busy.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kmqd_harness::Signal;
use kmqd_harness::cluster::{Cluster, ClusterOptions, key_slot};

use crate::support::{TestDaemon, TestDir, client, eventually, kmqd, wait_drained};

fn cluster() -> Cluster {
    Cluster::start(ClusterOptions::default()).expect("start a Redis Cluster")
}

/// The `[redis]` keys for `cluster`, plus `extra`.
pub(crate) fn redis_section(cluster: &Cluster, extra: &str) -> String {
    let seeds: Vec<String> = cluster
        .seeds()
        .unwrap()
        .iter()
        .map(|seed| format!("\"{seed}\""))
        .collect();
    format!("cluster = [{}]\n{extra}", seeds.join(", "))
}

/// Whether the node at `addr` holds `key`, asked directly (a keyed command would be redirected).
fn node_has_key(cluster: &Cluster, addr: &str, key: &str) -> bool {
    let server = cluster.server(addr).expect("our node");
    let slot = key_slot(key.as_bytes()).to_string();
    let keys: Vec<String> = server
        .query_as(&["CLUSTER", "GETKEYSINSLOT", &slot, "1000"])
        .unwrap();
    keys.iter().any(|k| k == key)
}

#[test]
fn queues_on_three_masters_serve_every_feature_and_the_admin_commands() {
    let cluster = cluster();
    let placed = cluster.queue_names_on_distinct_masters(1).unwrap();
    let [
        (safe_master, safe),
        (default_master, default),
        (sched_master, sched),
    ] = &placed[..]
    else {
        panic!("three masters: {placed:?}");
    };
    let (safe, default, sched) = (&safe[0], &default[0], &sched[0]);
    let dir = TestDir::new();
    let queues = format!(
        "[[queues]]\nname = \"{safe}\"\nmode = \"safe\"\npriorities = [\"high\", \"low\"]\nworkers = 1\nbatch = 1\n\
         prefetch = 0\n\n[[queues]]\nname = \"{default}\"\nmode = \"default\"\n\n\
         [[queues]]\nname = \"{sched}\"\nmode = \"safe\"\n\n\
         [[schedules]]\nname = \"tick\"\nqueue = \"{sched}\"\ntype = \"test\"\nevery = \"1s\"\n"
    );
    let config = dir.config_raw(
        &redis_section(&cluster, ""),
        "shutdown_grace = \"5s\"",
        &queues,
    );
    let c = config.to_str().unwrap();

    // Producers and inspectors before any daemon runs: priorities, a delay, a unique id, show and cancel.
    for (id, priority) in [("low-1", "low"), ("high-1", "high"), ("low-2", "low")] {
        let (code, _, err) = kmqd(
            &[
                "-c",
                c,
                "push",
                safe,
                "test",
                "--id",
                id,
                "--priority",
                priority,
            ],
            None,
        );
        assert_eq!(code, 0, "{err}");
    }
    let (code, _, err) = kmqd(
        &["-c", c, "push", default, "test", "--id", "u", "--unique"],
        None,
    );
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = kmqd(
        &["-c", c, "push", default, "test", "--id", "u", "--unique"],
        None,
    );
    assert_eq!(
        code, 3,
        "a second push of a live unique id is refused: {err}"
    );
    for id in ["later", "never"] {
        let (code, _, err) = kmqd(
            &[
                "-c", c, "push", default, "test", "--id", id, "--delay", "2s",
            ],
            None,
        );
        assert_eq!(code, 0, "{err}");
    }
    let (code, out, err) = kmqd(&["-c", c, "task", "show", default, "never"], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("delayed"), "{out}");
    let (code, _, err) = kmqd(&["-c", c, "task", "cancel", default, "never"], None);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = kmqd(&["-c", c, "stats", "--json"], None);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(safe.as_str()) && out.contains(default.as_str()),
        "{out}"
    );

    // Each queue's keys are on the master its hash tag names, and nowhere else.
    for (master, queue) in [(safe_master, safe), (default_master, default)] {
        let stats_key = format!("kmq:{{{queue}}}:stats");
        assert_eq!(key_slot(stats_key.as_bytes()), key_slot(queue.as_bytes()));
        for node in cluster.masters().unwrap() {
            assert_eq!(
                node_has_key(&cluster, &node.addr, &stats_key),
                node.addr == master.addr,
                "{stats_key} on {}",
                node.addr
            );
        }
    }

    let daemon = TestDaemon::start(&config);
    let producer = client(&config);
    eventually(Duration::from_secs(20), "every task done", || {
        let (s, d) = (
            producer.stats(safe).unwrap(),
            producer.stats(default).unwrap(),
        );
        (s.done == 3 && d.done == 2, (s, d))
    });
    // Pause and resume on a cluster: the paused key is in the queue's slot, in claim.lua's and pop.lua's KEYS.
    for queue in [safe, default] {
        let (code, out, err) = kmqd(&["-c", c, "queue", "pause", queue], None);
        assert_eq!((code, out), (0, format!("paused {queue}\n")), "{err}");
    }
    let (code, out, err) = kmqd(&["-c", c, "workers", "--json"], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.matches("\"paused\":true").count() >= 2, "{out}");
    for queue in [safe, default] {
        producer
            .push(
                queue,
                kmqd::NewTask::new("test", "{}").unwrap().id("paused-1"),
            )
            .unwrap();
    }
    // Longer than the idle_poll (1 s) of a fetcher that was blocked when the pause came.
    std::thread::sleep(Duration::from_millis(1500));
    for queue in [safe, default] {
        let s = producer.stats(queue).unwrap();
        assert_eq!((s.ready, s.paused), (1, true), "{queue}: {s:?}");
        let (code, _, err) = kmqd(&["-c", c, "queue", "resume", queue], None);
        assert_eq!(code, 0, "{err}");
    }
    eventually(Duration::from_secs(20), "the paused tasks done", || {
        let (s, d) = (
            producer.stats(safe).unwrap(),
            producer.stats(default).unwrap(),
        );
        (s.done == 4 && d.done == 3, (s, d))
    });
    let ticks = eventually(Duration::from_secs(20), "the schedule fired", || {
        let ticks = producer.stats(sched).unwrap().done;
        (ticks >= 1, ticks)
    });
    assert!(ticks >= 1);
    assert!(node_has_key(
        &cluster,
        &sched_master.addr,
        &format!("kmq:{{{sched}}}:schedules")
    ));
    daemon.stop();

    let records = dir.records();
    let safe_order: Vec<&str> = records
        .starts
        .iter()
        .map(|(id, _)| id.as_str())
        .filter(|id| ["low-1", "high-1", "low-2"].contains(id))
        .collect();
    assert_eq!(
        safe_order,
        ["high-1", "low-1", "low-2"],
        "strict priorities"
    );
    assert_eq!(records.runs_of("u"), 1);
    assert_eq!(records.runs_of("later"), 1);
    assert_eq!(records.runs_of("never"), 0, "cancelled");
}

/// Pushes `count` tasks one at a time, with ids `prefix0...`, keeping the ids Redis acknowledged (and counting
/// them in `acked`); a push that fails (during a failover) is tried again under the same id, as a producer
/// would, for at most two minutes.
pub fn push_acknowledged(
    config: &Path,
    queue: &str,
    (prefix, count, data): (&str, usize, &str),
    acked: &AtomicUsize,
) -> Vec<String> {
    let producer = client(config);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut acknowledged = Vec::new();
    let mut i = 0;
    while i < count && Instant::now() < deadline {
        let id = format!("{prefix}{i}");
        let task = kmqd::NewTask::new("test", data).unwrap().id(id.clone());
        match producer.push(queue, task) {
            Ok(_) => {
                acknowledged.push(id);
                acked.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    acknowledged
}

/// A master killed (SIGKILL) while its replica lags (stopped with SIGSTOP and its link cut: as a replica behind
/// a broken link), a producer pushes to a queue on it and a daemon drains it; the replica then takes over.
/// Returns (acknowledged pushes, of them never run).
fn kill_master_mid_drain(wait_replicas: u32) -> (usize, usize) {
    let mut cluster = cluster();
    let placed = cluster.queue_names_on_distinct_masters(1).unwrap();
    let (master, names) = &placed[0];
    let queue = names[0].clone();
    let replica = cluster.replicas_of(&master.id).unwrap()[0].addr.clone();
    let dir = TestDir::new();
    let redis = redis_section(
        &cluster,
        &format!("wait_replicas = {wait_replicas}\nwait_timeout = \"500ms\"\nio_timeout = \"2s\""),
    );
    let queues = format!(
        "[[queues]]\nname = \"{queue}\"\nmode = \"safe\"\nworkers = 4\nlease_timeout = \"3s\"\n"
    );
    let config = dir.config_raw(&redis, "shutdown_grace = \"5s\"", &queues);
    let daemon = TestDaemon::start(&config);
    let acked = Arc::new(AtomicUsize::new(0));
    let producer = {
        let (config, queue, acked) = (config.clone(), queue.clone(), Arc::clone(&acked));
        // Slower to run than to push: a backlog builds up, as in a real drain.
        std::thread::spawn(move || {
            push_acknowledged(&config, &queue, ("t", 3000, r#"{"sleep_ms": 5}"#), &acked)
        })
    };
    let watcher = client(&config);
    eventually(Duration::from_secs(20), "a drain under way", || {
        let done = watcher.stats(&queue).map(|s| s.done).unwrap_or(0);
        (done >= 100, done)
    });
    // Stopped, and cut off: what the master writes from now on reaches no replica (what it wrote before is in
    // the replica's socket buffer, which the replica reads when it goes on).
    cluster.server(&replica).unwrap().pause().unwrap();
    cluster
        .server(&master.addr)
        .unwrap()
        .query(&["CLIENT", "KILL", "TYPE", "replica"])
        .unwrap();
    // The replica's lag: 200 pushes acknowledged meanwhile, or a second (with wait_replicas none is).
    let before = acked.load(Ordering::Relaxed);
    let lag_end = Instant::now() + Duration::from_secs(1);
    while acked.load(Ordering::Relaxed) < before + 200 && Instant::now() < lag_end {
        std::thread::sleep(Duration::from_millis(10));
    }
    cluster.kill_master(&master.addr, Signal::Kill).unwrap();
    cluster.server(&replica).unwrap().resume().unwrap();
    cluster.wait_failover().unwrap();
    // The promoted replica has no replica of its own, so with wait_replicas it acknowledges nothing until the
    // old master comes back, as its replica.
    cluster.restart_node(&master.addr).unwrap();
    let acknowledged = producer.join().unwrap();
    // Every acknowledged task still in Redis runs; what is neither run nor in Redis is lost. What the surviving
    // master holds adds up (its counters and lists change in the same scripts, so a lost write loses both): every
    // task it counts pushed is done, none dead, nothing left under the live owner.
    let drained = wait_drained(&watcher, &queue);
    assert_eq!(
        (drained.done + drained.cancelled, drained.dead),
        (drained.pushed, 0),
        "{drained:?}"
    );
    daemon.stop();
    let ran: HashSet<String> = dir.records().starts.into_iter().map(|(id, _)| id).collect();
    let lost = acknowledged.iter().filter(|id| !ran.contains(*id)).count();
    eprintln!(
        "master killed mid-drain behind a lagging replica, wait_replicas = {wait_replicas}: {} acknowledged, \
         {lost} lost",
        acknowledged.len()
    );
    (acknowledged.len(), lost)
}

#[test]
fn with_wait_replicas_a_master_killed_mid_drain_loses_no_acknowledged_task() {
    let (acknowledged, lost) = kill_master_mid_drain(1);
    assert_eq!(acknowledged, 3000);
    assert_eq!(lost, 0);
}

#[test]
fn without_wait_replicas_a_master_killed_mid_drain_is_measured() {
    // Redis replicates asynchronously: what the master acknowledged in its last moments may never have reached
    // the replica that takes over: here, what it acknowledged while its replica lagged. This measures it
    // (docs/OPERATIONS.md, "Deployments"), and shows what wait_replicas is for; the daemon itself comes through
    // the failover and drains what survived.
    let (acknowledged, lost) = kill_master_mid_drain(0);
    assert_eq!(acknowledged, 3000);
    assert!(
        lost > 0,
        "pushes acknowledged by a master whose replica lagged are lost with it"
    );
    assert!(
        lost < acknowledged - 100,
        "the drain went on after the failover"
    );
}

#[test]
fn a_busy_queue_whose_slot_migrates_loses_nothing() {
    let cluster = cluster();
    let placed = cluster.queue_names_on_distinct_masters(1).unwrap();
    let (_, names) = &placed[0];
    let (target, _) = &placed[1];
    let queue = names[0].clone();
    let dir = TestDir::new();
    let queues = format!(
        "[[queues]]\nname = \"{queue}\"\nmode = \"safe\"\nworkers = 4\npriorities = [\"high\", \"low\"]\n"
    );
    let config = dir.config_raw(
        &redis_section(&cluster, ""),
        "shutdown_grace = \"5s\"",
        &queues,
    );
    let daemon = TestDaemon::start(&config);
    let producer = {
        let (config, queue) = (config.clone(), queue.clone());
        std::thread::spawn(move || {
            push_acknowledged(&config, &queue, ("m", 4000, "{}"), &AtomicUsize::new(0))
        })
    };
    let watcher = client(&config);
    eventually(Duration::from_secs(20), "a drain under way", || {
        let done = watcher.stats(&queue).map(|s| s.done).unwrap_or(0);
        (done >= 200, done)
    });
    let moved = cluster
        .reshard_slot(key_slot(queue.as_bytes()), &target.addr)
        .unwrap();
    assert!(moved > 0, "the slot held the queue's keys");
    let acknowledged = producer.join().unwrap();
    assert_eq!(acknowledged.len(), 4000);
    eventually(Duration::from_secs(60), "every task done", || {
        let done = watcher.stats(&queue).map(|s| s.done).unwrap_or(0);
        (done >= 4000, done)
    });
    // Nothing stranded on the slot's new node under the live owner; a push sent again after an error may have
    // queued a task twice, so the target's count is at least what was acknowledged.
    let drained = wait_drained(&watcher, &queue);
    assert_eq!(
        (drained.done, drained.dead),
        (drained.pushed, 0),
        "{drained:?}"
    );
    assert!(drained.pushed >= 4000, "{drained:?}");
    daemon.stop();
    let ran: HashSet<String> = dir.records().starts.into_iter().map(|(id, _)| id).collect();
    let lost: Vec<&String> = acknowledged
        .iter()
        .filter(|id| !ran.contains(*id))
        .collect();
    assert!(lost.is_empty(), "never ran: {lost:?}");
    assert!(node_has_key(
        &cluster,
        &target.addr,
        &format!("kmq:{{{queue}}}:stats")
    ));
}
