//! Redis's clock steps while daemons hold leases (review M2): the leases are deadlines on Redis's `TIME`, which an
//! NTP step (a VM resumed, `chronyc makestep`, a failover to a host whose clock runs ahead) moves at once for
//! every owner, while each daemon's belief in its lease runs on its own monotonic clock.

use std::collections::HashMap;
use std::time::Duration;

use crate::support::*;

/// A safe daemon's config of 8 workers, a lease of 6 s and 8 tasks taken ahead: while its first tasks run, it holds
/// more that have not started, which a monitor recovering its owner would hand to another daemon.
fn config(dir: &TestDir, redis: &RedisServer) -> std::path::PathBuf {
    dir.config(
        redis,
        &safe_queue("workers = 8\nprefetch = 8\nlease_timeout = \"6s\""),
    )
}

/// Waits until `count` runs started.
fn wait_starts(dir: &TestDir, count: usize) {
    eventually(
        Duration::from_secs(10),
        &format!("{count} runs started"),
        || {
            let starts = dir.records().starts.len();
            (starts >= count, starts)
        },
    );
}

/// The ids with two runs at once, from the order of the start and end lines of the one record file both daemons
/// append to (each line one `write`, so the file's order is the order the runs began and ended).
fn overlapping_runs(records: &Records) -> Vec<String> {
    let mut running: HashMap<&str, usize> = HashMap::new();
    let mut overlapping = Vec::new();
    for line in &records.lines {
        let mut parts = line.split(' ');
        match (parts.next(), parts.next()) {
            (Some("start"), Some(id)) => {
                let count = running.entry(id).or_default();
                *count += 1;
                if *count > 1 {
                    overlapping.push(id.to_string());
                }
            }
            (Some("end"), Some(id)) => {
                if let Some(count) = running.get_mut(id) {
                    *count = count.saturating_sub(1);
                }
            }
            _ => {}
        }
    }
    overlapping
}

/// The owners of `jobs` with their lease deadlines (Redis's clock, ms).
fn owners(redis: &RedisServer) -> Vec<(String, i64)> {
    redis.cmd(&["ZRANGE", "kmq:{jobs}:owners", "0", "-1", "WITHSCORES"])
}

/// One daemon runs 8 tasks of 2 s and holds 8 more; a second one idles beside it. Just after the first renews its
/// lease, Redis's clock steps by `step_ms`: forward, past every lease, the monitors may recover the first's tasks
/// and the idle daemon take them while the first still runs them (it learns of the loss at its next renewal, a
/// third of the lease later). Checks that every task is done once, none dead, and no id ever ran twice at once.
fn step_redis_clock_under_load(step_ms: i64) {
    let redis = RedisServer::with_clock_shift();
    let dir = TestDir::new();
    let config = config(&dir, &redis);
    let count = 16;
    push_many(&config, "t", count, r#"{"sleep_ms":2000}"#);
    let first = TestDaemon::start(&config);
    wait_starts(&dir, 8);
    let (owner, _) = eventually(Duration::from_secs(10), "the first owner", || {
        let owners = owners(&redis);
        (
            owners.len() == 1,
            owners.first().cloned().unwrap_or_default(),
        )
    });
    let second = TestDaemon::start(&config);
    eventually(Duration::from_secs(10), "the second owner", || {
        let owners = owners(&redis);
        (owners.len() == 2, owners)
    });
    // Step just after the first daemon's renewal: it believes in its lease for the longest then.
    let deadline = |owners: Vec<(String, i64)>| {
        owners
            .into_iter()
            .find(|(o, _)| *o == owner)
            .map_or(0, |(_, deadline)| deadline)
    };
    let renewed = deadline(owners(&redis));
    eventually(Duration::from_secs(10), "the first owner's renewal", || {
        let now = deadline(owners(&redis));
        (now > renewed, now)
    });
    redis.set_clock_offset(step_ms);
    wait_done(&config, count as u64, Duration::from_secs(60));
    let s = eventually(Duration::from_secs(10), "nothing held", || {
        let s = stats(&config, "jobs");
        (s.processing == 0 && s.ready == 0, s)
    });
    first.stop();
    second.stop();
    let records = dir.records();
    let overlapping = overlapping_runs(&records);
    assert!(
        overlapping.is_empty(),
        "tasks ran twice at once: {overlapping:?}; records:\n{}",
        records.lines.join("\n")
    );
    assert_eq!(s.done, count as u64, "each task counted done once: {s:?}");
    assert_eq!(s.dead, 0, "{:?}", dead_reasons(&redis, "jobs"));
    for i in 0..count {
        assert!(records.runs_of(&format!("t{i}")) >= 1, "t{i} never ran");
    }
}

#[test]
fn a_forward_step_of_redis_clock_never_runs_a_task_twice_at_once() {
    step_redis_clock_under_load(10_000);
}

#[test]
fn a_backward_step_of_redis_clock_loses_and_repeats_nothing() {
    step_redis_clock_under_load(-10_000);
}

/// With `wait_replicas`, a renewal the replicas do not have is not counted: after a failover to one of them, the
/// promoted master's deadline would be a renewal older than the daemon's belief (review M2's variant).
#[test]
fn with_wait_replicas_a_renewal_no_replica_acknowledged_is_not_counted() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config_raw(
        &format!(
            "url = \"{}\"\nwait_replicas = 1\nwait_timeout = \"50ms\"",
            redis.url()
        ),
        "",
        &safe_queue(""),
    );
    let config = kmqd::Config::load(&path).unwrap();
    let queue = kmqd::queue::QueueContext::new(&config, &config.queues[0], "test:0");
    let connector = kmqd::broker::Connector::new(&config.redis).unwrap();
    let mut connection = connector.connect().unwrap();
    let info = kmqd::broker::OwnerInfo {
        mode: "safe".into(),
        levels: queue.config.priorities.clone(),
        ..kmqd::broker::OwnerInfo::default()
    };
    let lease = Duration::from_secs(30);
    assert!(kmqd::broker::register(&mut connection, &queue.keys, "o.1", lease, &info).unwrap());
    match kmqd::broker::renew(&mut connection, &queue.keys, "o.1", lease, 0, 0) {
        Err(kmqd::broker::BrokerError::NotReplicated {
            acknowledged: 0,
            wanted: 1,
        }) => {}
        other => panic!("a renewal no replica has: {other:?}"),
    }
}
