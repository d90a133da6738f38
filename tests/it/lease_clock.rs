//! Redis's clock steps while daemons hold leases (review M2): the leases are deadlines on Redis's `TIME`, which an
//! NTP step (a VM resumed, `chronyc makestep`, a failover to a host whose clock runs ahead) moves at once for
//! every owner, while each daemon's belief in its lease runs on its own monotonic clock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kmqd::broker::sources;

use crate::support::proxy::{FaultProxy, Matcher};
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

/// Asserts that no id ran twice at once ([`overlapping_runs`]).
fn assert_never_twice_at_once(records: &Records) {
    let overlapping = overlapping_runs(records);
    assert!(
        overlapping.is_empty(),
        "tasks ran twice at once: {overlapping:?}; records:\n{}",
        records.lines.join("\n")
    );
}

/// The owners of `jobs` with their lease deadlines (Redis's clock, ms).
fn owners(redis: &RedisServer) -> Vec<(String, i64)> {
    redis.cmd(&["ZRANGE", "kmq:{jobs}:owners", "0", "-1", "WITHSCORES"])
}

/// The one owner of `jobs`, once there is one, with its lease deadline.
fn sole_owner(redis: &RedisServer) -> (String, i64) {
    eventually(Duration::from_secs(10), "the first owner", || {
        let owners = owners(redis);
        (
            owners.len() == 1,
            owners.first().cloned().unwrap_or_default(),
        )
    })
}

/// `owner`'s lease deadline (Redis's clock, ms; 0 once it is gone).
fn deadline_of(redis: &RedisServer, owner: &str) -> i64 {
    owners(redis)
        .into_iter()
        .find(|(o, _)| o == owner)
        .map_or(0, |(_, deadline)| deadline)
}

/// Waits for `owner`'s next renewal: a deadline later than `deadline`.
fn wait_renewal(redis: &RedisServer, owner: &str, deadline: i64) {
    eventually(Duration::from_secs(15), "the first owner's renewal", || {
        let now = deadline_of(redis, owner);
        (now > deadline, now)
    });
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
    let (owner, _) = sole_owner(&redis);
    let second = TestDaemon::start(&config);
    eventually(Duration::from_secs(10), "the second owner", || {
        let owners = owners(&redis);
        (owners.len() == 2, owners)
    });
    // Step just after the first daemon's renewal: it believes in its lease for the longest then.
    wait_renewal(&redis, &owner, deadline_of(&redis, &owner));
    redis.set_clock_offset(step_ms);
    wait_done(&config, count as u64, Duration::from_secs(60));
    let s = eventually(Duration::from_secs(10), "nothing held", || {
        let s = stats(&config, "jobs");
        (s.processing == 0 && s.ready == 0, s)
    });
    first.stop();
    second.stop();
    let records = dir.records();
    assert_never_twice_at_once(&records);
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

/// The time on this host's wall clock, as the testkit plugin stamps a run's start (µs since the epoch).
fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros() as u64)
}

/// The daemon's own watch on Redis's clock (review M2's rest). Just after a renewal of a daemon's 12 s lease,
/// Redis's clock steps forward by 9 s: 3 s of the lease are left on Redis's clock, where the daemon believes in
/// 12, and its heartbeat's next renewal, 4 s later, would find it run out. The claim of the tasks pushed next
/// answers the lease's time left: from it the daemon knows the step, starts none of them until a renewal sent
/// after that claim confirms the lease on Redis's new clock, and has its heartbeat send one at once, in time. A
/// second daemon, started after the step, has a monitor that never saw it (no allowance: `ClockWatch` in
/// src/daemon/monitor.rs) and would recover the first's tasks the moment its lease ran out. Before, the tasks
/// started at once, the lease ran out under them, and the second daemon ran them again beside them.
#[test]
fn a_claim_that_finds_redis_clock_stepped_starts_nothing_until_a_renewal_confirms_the_lease() {
    let redis = RedisServer::with_clock_shift();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let queue = safe_queue("workers = 4\nlease_timeout = \"12s\"");
    let daemon = "shutdown_grace = \"5s\"";
    let record = dir.record_file();
    // The first daemon reaches Redis through the proxy, which notes when each of its renewals went out; the
    // second directly. Both record their runs in the one file.
    let config = |name: &str, url: String| {
        dir.config_named(name, &format!("url = \"{url}\""), daemon, &queue, &record)
    };
    let (stepped, late) = (
        config("stepped.toml", proxy.url()),
        config("late.toml", redis.url()),
    );
    let renewals = Arc::new(Mutex::new(Vec::new()));
    {
        let (renewals, renew) = (Arc::clone(&renewals), Matcher::script(sources::RENEW));
        proxy.observe(move |command| {
            if renew.matches(command) {
                renewals.lock().unwrap().push(unix_us());
            }
        });
    }
    let first = TestDaemon::start(&stepped);
    let (owner, registered) = sole_owner(&redis);
    wait_renewal(&redis, &owner, registered);
    let step_us = unix_us();
    redis.set_clock_offset(9_000);
    // Runs that outlast any recovery, and ignore the cancel of a lost lease: a second run would overlap the first.
    let count = 4;
    push_many(
        &late,
        "t",
        count,
        r#"{"sleep_ms":9000,"ignore_cancel":true}"#,
    );
    wait_starts(&dir, count);
    let second = TestDaemon::start(&late);
    wait_done(&late, count as u64, Duration::from_secs(60));
    let (seconds, micros): (i64, i64) = redis.cmd(&["TIME"]);
    let redis_now_ms = seconds * 1000 + micros / 1000;
    let deadline = deadline_of(&redis, &owner);
    let s = stats(&late, "jobs");
    first.stop();
    second.stop();
    let records = dir.records();
    assert_never_twice_at_once(&records);
    let first_start = records.start_times.iter().map(|(_, at)| *at).min();
    let confirmed = renewals
        .lock()
        .unwrap()
        .iter()
        .copied()
        .find(|at| *at > step_us);
    assert!(
        confirmed
            .zip(first_start)
            .is_some_and(|(renewed, started)| renewed < started),
        "a task started at {first_start:?} µs before a renewal sent after the step at {step_us} µs confirmed the \
         lease (the first: {confirmed:?})"
    );
    for i in 0..count {
        assert_eq!(records.runs_of(&format!("t{i}")), 1, "t{i} ran once");
    }
    assert_eq!((s.done, s.recovered, s.dead), (count as u64, 0, 0), "{s:?}");
    assert!(
        deadline > redis_now_ms,
        "the first owner's lease is live after the step (its deadline {deadline}, Redis's clock {redis_now_ms})"
    );
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
    assert!(
        kmqd::broker::register(&mut connection, &queue.keys, "o.1", lease, &info)
            .unwrap()
            .is_some()
    );
    match kmqd::broker::renew(&mut connection, &queue.keys, "o.1", lease, 0, 0) {
        Err(kmqd::broker::BrokerError::NotReplicated {
            acknowledged: 0,
            wanted: 1,
        }) => {}
        other => panic!("a renewal no replica has: {other:?}"),
    }
}
