//! Safe mode's guarantees (docs/RELIABILITY.md): nothing is lost, a live handler keeps its task, expired leases
//! are recovered once, and every outcome ends where the policy says.

use std::sync::Arc;
use std::time::Duration;

use kmqd::broker::{self, Fence, SettleOp, Settlement};
use kmqd::daemon::monitor::{Monitor, Watched};
use kmqd::plugin::{Plugins, Registry};
use kmqd::queue::QueueContext;
use kmqd::settler::Settler;
use kmqd::{Config, NewTask};

use crate::support::*;

pub(crate) fn safe(extra: &str) -> String {
    format!(
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 4\nbackoff = \"10ms\"\n{extra}\n"
    )
}

fn wait_drained(config: &std::path::Path) -> kmqd::broker::QueueStats {
    eventually(Duration::from_secs(30), "the queue to drain", || {
        let s = stats(config, "jobs");
        (s.ready + s.processing + s.delayed == 0, s)
    })
}

#[test]
fn every_pushed_task_ends_done_or_dead() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe("retry_times = 2"));
    let daemon = TestDaemon::start(&config);
    let outcomes = [
        r#"{}"#,
        r#"{"fail_attempts":1}"#,
        r#"{"outcome":"fail"}"#,
        r#"{"outcome":"retry"}"#,
        r#"{"outcome":"panic"}"#,
    ];
    let tasks: Vec<NewTask> = (0..300)
        .map(|i| NewTask::new("test", outcomes[i % outcomes.len()]).unwrap())
        .collect();
    let pushed = client(&config).push_batch("jobs", tasks).unwrap();
    assert!(pushed.iter().all(|p| p.is_accepted()));
    let s = wait_drained(&config);
    // 60 of each kind: plain and fail-once end done; fail, retry-forever and panic-forever end dead.
    assert_eq!((s.done, s.dead_lettered, s.dead), (120, 180, 180), "{s:?}");
    assert_eq!(s.done + s.dead, s.pushed, "conservation: {s:?}");
    // Retries: 60 fail-once retried once; retry and panic retried twice each.
    assert_eq!(s.retried, 60 + 2 * 60 + 2 * 60, "{s:?}");
    // on_dead runs after the dead letter is stored, so it may lag behind the stats: poll for it.
    eventually(
        Duration::from_secs(10),
        "on_dead to be called for every dead-lettered task",
        || {
            let deads = dir.records().deads.len();
            (deads == 180, deads)
        },
    );
    daemon.stop();
}

/// `kmqd stats` reads a queue in one transaction: while a daemon claims, settles and retries, every snapshot has
/// each task in exactly one place. Read one key after another, a snapshot showed a task that moved meanwhile
/// twice (ready and done: a drained queue with 4 of 20 tasks still ready) or not at all.
#[test]
fn a_stats_snapshot_counts_each_task_once_while_a_daemon_drains() {
    const TASKS: u64 = 3000;
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe("batch = 10"));
    // Every other task fails once: its retry goes through the retry set and back to ready.
    let tasks: Vec<NewTask> = (0..TASKS)
        .map(|i| NewTask::new("test", ["{}", r#"{"fail_attempts":1}"#][i as usize % 2]).unwrap())
        .collect();
    client(&config).push_batch("jobs", tasks).unwrap();
    let daemon = TestDaemon::start(&config);
    let reader = client(&config);
    let mut mid_drain = 0;
    let last = eventually(Duration::from_secs(60), "the queue to drain", || {
        let s = reader.stats("jobs").unwrap();
        assert_eq!(
            s.ready + s.processing + s.delayed + s.done + s.dead,
            TASKS,
            "each task once: {s:?}"
        );
        if s.done > 0 && s.done < TASKS {
            mid_drain += 1;
        }
        (s.done == TASKS, s)
    });
    daemon.stop();
    assert_eq!(last.retried, TASKS / 2, "{last:?}");
    assert!(
        mid_drain >= 3,
        "only {mid_drain} snapshots while tasks moved"
    );
}

#[test]
fn slow_live_handler_keeps_its_task_past_the_lease() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe("lease_timeout = \"500ms\""));
    let daemon = TestDaemon::start(&config);
    client(&config)
        .push(
            "jobs",
            NewTask::new("test", r#"{"sleep_ms":2000}"#)
                .unwrap()
                .id("slow"),
        )
        .unwrap();
    let s = eventually(Duration::from_secs(20), "the slow task to finish", || {
        let s = stats(&config, "jobs");
        (s.done == 1, s)
    });
    assert_eq!((s.retried, s.failed), (0, 0), "{s:?}");
    assert_eq!(
        dir.records().runs_of("slow"),
        1,
        "never run twice while its lease is renewed"
    );
    daemon.stop();
}

#[test]
fn fail_dead_letters_at_once_with_the_handler_reason() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe("retry_times = 5"));
    let daemon = TestDaemon::start(&config);
    client(&config)
        .push(
            "jobs",
            NewTask::new("test", r#"{"outcome":"fail"}"#)
                .unwrap()
                .id("f1"),
        )
        .unwrap();
    let records = eventually(Duration::from_secs(10), "the dead letter", || {
        let dead = dead_records(&redis, "jobs");
        (dead.len() == 1, dead)
    });
    assert_eq!(records[0]["reason"], "testkit: asked to fail");
    assert_eq!(records[0]["id"], "f1");
    assert!(records[0]["dead_at"].as_i64().unwrap() > 0);
    assert_eq!(dir.records().runs_of("f1"), 1);
    eventually(Duration::from_secs(5), "on_dead", || {
        (dir.records().deads.len() == 1, ())
    });
    daemon.stop();
}

#[test]
fn on_handler_error_finish_counts_the_task_done() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe("on_handler_error = \"finish\""));
    let daemon = TestDaemon::start(&config);
    client(&config)
        .push(
            "jobs",
            NewTask::new("test", r#"{"outcome":"retry"}"#).unwrap(),
        )
        .unwrap();
    let s = eventually(Duration::from_secs(10), "the task to be finished", || {
        let s = stats(&config, "jobs");
        (s.done == 1, s)
    });
    assert_eq!((s.failed, s.retried, s.dead), (1, 0, 0), "{s:?}");
    daemon.stop();
}

#[test]
fn on_handler_error_dead_skips_retries() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &safe("on_handler_error = \"dead\"\nretry_times = 5"),
    );
    let daemon = TestDaemon::start(&config);
    client(&config)
        .push(
            "jobs",
            NewTask::new("test", r#"{"outcome":"panic"}"#)
                .unwrap()
                .id("p"),
        )
        .unwrap();
    let records = eventually(Duration::from_secs(10), "the dead letter", || {
        let dead = dead_records(&redis, "jobs");
        (dead.len() == 1, dead)
    });
    assert!(
        records[0]["reason"]
            .as_str()
            .unwrap()
            .starts_with("panic: testkit: asked to panic"),
        "{records:?}"
    );
    assert_eq!(dir.records().runs_of("p"), 1);
    daemon.stop();
}

#[test]
fn handler_panics_fail_their_task_and_the_daemon_keeps_working() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe("retry_times = 0"));
    let daemon = TestDaemon::start(&config);
    let client = client(&config);
    let tasks: Vec<NewTask> = (0..100)
        .map(|i| {
            let data = if i % 10 == 0 {
                r#"{"outcome":"panic"}"#
            } else {
                "{}"
            };
            NewTask::new("test", data).unwrap().id(format!("t{i}"))
        })
        .collect();
    client.push_batch("jobs", tasks).unwrap();
    let s = wait_drained(&config);
    assert_eq!((s.done, s.dead), (90, 10), "{s:?}");
    for record in dead_records(&redis, "jobs") {
        let id = record["id"].as_str().unwrap();
        assert!(
            id.trim_start_matches('t').parse::<u32>().unwrap() % 10 == 0,
            "only panicking tasks are dead: {id}"
        );
    }
    daemon.stop();
}

#[test]
fn execution_timeout_cancels_the_run_and_counts_it_failed() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &safe("execution_timeout = \"300ms\"\nretry_times = 1"),
    );
    let daemon = TestDaemon::start(&config);
    client(&config)
        .push(
            "jobs",
            NewTask::new("test", r#"{"until_cancelled":true}"#)
                .unwrap()
                .id("stuck"),
        )
        .unwrap();
    let records = eventually(
        Duration::from_secs(20),
        "the timed-out task to be dead-lettered",
        || {
            let dead = dead_records(&redis, "jobs");
            (dead.len() == 1, dead)
        },
    );
    assert!(
        records[0]["reason"]
            .as_str()
            .unwrap()
            .starts_with("execution timeout: still running after 300ms"),
        "{records:?}"
    );
    let runs = dir.records();
    assert_eq!(
        runs.starts,
        [("stuck".to_string(), 0), ("stuck".to_string(), 1)]
    );
    // The handler saw its cancel flag and returned; those late outcomes were ignored.
    eventually(Duration::from_secs(5), "both runs to return", || {
        (dir.records().ends.len() == 2, ())
    });
    let s = stats(&config, "jobs");
    assert_eq!((s.failed, s.retried, s.done), (2, 1, 0), "{s:?}");
    daemon.stop();
}

#[test]
fn task_older_than_alive_timeout_is_dead_lettered_unrun() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe("alive_timeout = \"1s\""));
    let daemon = TestDaemon::start(&config);
    let (seconds, _): (i64, i64) = redis.cmd(&["TIME"]);
    let old = format!(
        r#"{{"id":"old","type":"test","created_at":{}}}"#,
        (seconds - 60) * 1000
    );
    let _: i64 = redis.cmd(&["RPUSH", "kmq:{jobs}:ready:normal", &old]);
    let _: i64 = redis.cmd(&["LPUSH", "kmq:{jobs}:wake", "1"]);
    let records = eventually(
        Duration::from_secs(10),
        "the old task to be dead-lettered",
        || {
            let dead = dead_records(&redis, "jobs");
            (dead.len() == 1, dead)
        },
    );
    assert!(
        records[0]["reason"]
            .as_str()
            .unwrap()
            .starts_with("older than alive_timeout: 1m"),
        "{records:?}"
    );
    assert_eq!(
        dir.records().runs_of("old"),
        0,
        "a task past its alive timeout never runs"
    );
    daemon.stop();
}

#[test]
fn malformed_tasks_are_dead_lettered_with_a_reason() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe(""));
    let daemon = TestDaemon::start(&config);
    for payload in ["not json at all", r#"{"id":"nt","data":1}"#] {
        let _: i64 = redis.cmd(&["RPUSH", "kmq:{jobs}:ready:normal", payload]);
    }
    let _: i64 = redis.cmd(&["LPUSH", "kmq:{jobs}:wake", "1"]);
    let records = eventually(Duration::from_secs(10), "two dead letters", || {
        let dead = dead_records(&redis, "jobs");
        (dead.len() == 2, dead)
    });
    let reason_of = |task: &str| {
        records
            .iter()
            .find(|r| r["task"] == task)
            .map(|r| r["reason"].as_str().unwrap().to_string())
            .unwrap()
    };
    assert!(reason_of("not json at all").starts_with("malformed task: expected"));
    assert_eq!(
        reason_of(r#"{"id":"nt","data":1}"#),
        "malformed task: missing field `type` at line 1 column 20"
    );
    let s = stats(&config, "jobs");
    assert_eq!(
        (s.dead_lettered, s.failed, s.processing),
        (2, 0, 0),
        "nothing ran, so nothing failed: {s:?}"
    );
    daemon.stop();
}

#[test]
fn unique_id_is_refused_while_live_and_accepted_once_done() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe(""));
    let client = client(&config);
    let unique = |data: &str| NewTask::new("test", data).unwrap().id("only-one").unique();
    assert!(client.push("jobs", unique("{}")).unwrap().is_accepted());
    assert!(
        !client.push("jobs", unique("{}")).unwrap().is_accepted(),
        "refused while ready"
    );
    let daemon = TestDaemon::start(&config);
    eventually(
        Duration::from_secs(10),
        "the unique task to be done",
        || (stats(&config, "jobs").done == 1, ()),
    );
    assert!(
        client.push("jobs", unique("{}")).unwrap().is_accepted(),
        "accepted again once done"
    );
    eventually(Duration::from_secs(10), "the second one to be done", || {
        (stats(&config, "jobs").done == 2, ())
    });
    daemon.stop();
}

/// A queue context like the daemon builds, for driving one component directly.
pub(crate) fn context(config: &Config) -> Arc<QueueContext> {
    Arc::new(QueueContext::new(config, &config.queues[0], "test:0"))
}

pub(crate) fn monitor(config: &Config, queue: &Arc<QueueContext>, name: &str) -> Monitor {
    Monitor {
        queues: vec![Watched::new(
            Arc::clone(queue),
            Settler::new(format!("test-{name}:monitor")),
        )],
        session: broker::Session::new(broker::pool(&config.redis).unwrap()),
        pulse: Default::default(),
        plugins: Plugins::new(Arc::new(Registry::empty())),
        background: kmqd::shutdown::Trigger::new().listener(),
    }
}

/// Registers an owner the way a daemon does, with the queue's levels, and claims up to `max` tasks under it
/// (tokens from `first_token`): a daemon that then dies.
/// The settlement `op` of task `index` of `batch` (claimed at level 0), as an acker sends it.
pub(crate) fn settlement_of(batch: &broker::Batch, index: usize, op: SettleOp) -> Settlement {
    Settlement {
        popped_by: None,
        popped_scope: None,
        op,
        token: batch.tasks[index].token.clone(),
        unique_id: None,
        level: 0,
        payload: batch.payloads.get(index).to_vec(),
        failed: false,
        kept: None,
        note: None,
    }
}

pub(crate) fn dead_daemon_claims(
    connection: &mut kmqd::broker::Conn,
    queue: &QueueContext,
    owner: &str,
    first_token: u64,
    max: usize,
    lease: Duration,
) -> broker::Batch {
    let info = broker::OwnerInfo {
        mode: "safe".into(),
        levels: queue.config.priorities.clone(),
        ..broker::OwnerInfo::default()
    };
    assert!(
        broker::register(connection, &queue.keys, owner, lease, &info)
            .unwrap()
            .is_some()
    );
    claim_as(connection, queue, owner, first_token, max).unwrap()
}

fn claim_as(
    connection: &mut kmqd::broker::Conn,
    queue: &QueueContext,
    owner: &str,
    first_token: u64,
    max: usize,
) -> broker::Result<broker::Batch> {
    let limits = broker::ClaimLimits {
        daemon: "test:0",
        ..queue.claim_limits()
    };
    broker::claim(
        connection,
        &queue.keys,
        &Arc::from(owner),
        first_token,
        max,
        &limits,
    )
}

/// Pushes `n` tasks of type `test` to `jobs`, with the ids `t0`, `t1`, ...
fn push_numbered(path: &std::path::Path, n: usize) {
    let tasks: Vec<NewTask> = (0..n)
        .map(|i| NewTask::new("test", "{}").unwrap().id(format!("t{i}")))
        .collect();
    client(path).push_batch("jobs", tasks).unwrap();
}

/// A done task's plain acknowledgement (level 0, no unique id), as a worker's outcome makes it.
fn plain_ack(token: Option<broker::Token>) -> Settlement {
    Settlement {
        popped_by: None,
        popped_scope: None,
        op: SettleOp::Ack,
        token,
        unique_id: None,
        level: 0,
        payload: Vec::new(),
        failed: false,
        kept: None,
        note: None,
    }
}

/// Call `number` of the settling party `settler`: `owner`'s outcomes, as its acker sends them.
pub(crate) fn settle_as(
    connection: &mut kmqd::broker::Conn,
    queue: &QueueContext,
    (owner, settler, number): (&str, &str, u64),
    settlements: &[Settlement],
) -> broker::Result<broker::Settled> {
    let call = broker::Call { settler, number };
    broker::settle(
        connection,
        &queue.keys,
        &call,
        Fence::Owner,
        queue.config.dead_max,
        broker::Holder::Claimed(owner),
        settlements,
    )
}

#[test]
fn expired_lease_returns_its_tasks_to_the_front_uncharged() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe("lease_timeout = \"300ms\""));
    let config = Config::load(&path).unwrap();
    let queue = context(&config);
    let client = client(&path);
    client
        .push("jobs", NewTask::new("test", "{}").unwrap().id("claimed"))
        .unwrap();
    // A daemon claims the task, then dies: nobody renews its lease.
    let mut connection = redis.connection();
    let owner = "dead-daemon.1";
    let batch = dead_daemon_claims(
        &mut connection,
        &queue,
        owner,
        0,
        10,
        Duration::from_millis(300),
    );
    assert_eq!(batch.tasks.len(), 1);
    client
        .push("jobs", NewTask::new("test", "{}").unwrap().id("behind"))
        .unwrap();
    let mut monitor = monitor(&config, &queue, "one");
    assert_eq!(monitor.recover_now(), 0, "the lease has not expired yet");
    eventually(
        Duration::from_secs(5),
        "the lease to expire and be recovered",
        || (monitor.recover_now() == 1, ()),
    );
    let ready: Vec<String> = redis.cmd(&["LRANGE", "kmq:{jobs}:ready:normal", "0", "-1"]);
    assert_eq!(ready.len(), 2);
    let first = kmqd::task::Envelope::decode(&ready[0]).unwrap();
    assert_eq!(
        (first.id.as_deref(), first.attempt, first.recovered),
        (Some("claimed"), 0, 1),
        "recovered task is first in line, not charged a run (it may never have started)"
    );
    let s = stats(&path, "jobs");
    assert_eq!(
        (s.processing, s.recovered, s.retried, s.failed),
        (0, 1, 0, 0),
        "{s:?}"
    );
    // The dead daemon's acknowledgement, arriving late, is fenced off.
    let token = batch.tasks[0].token.clone();
    let late = plain_ack(token);
    let settled = settle_as(
        &mut connection,
        &queue,
        (owner, "test-late:acker", 1),
        &[late],
    )
    .unwrap();
    assert_eq!((settled.stale_acks, settled.applied), (1, vec![None]));
    assert_eq!(stats(&path, "jobs").done, 0);
    // An owner whose lease ran out is gone for good: it can neither renew nor claim, and the monitor forgot it.
    assert_eq!(
        broker::renew(
            &mut connection,
            &queue.keys,
            owner,
            Duration::from_secs(30),
            0,
            0
        )
        .unwrap(),
        broker::Renewal::Lost
    );
    match claim_as(&mut connection, &queue, owner, 10, 10) {
        Err(broker::BrokerError::LeaseLost { .. }) => {}
        other => panic!("claim under a dead owner: {other:?}"),
    }
    let owners: i64 = redis.cmd(&["ZCARD", "kmq:{jobs}:owners"]);
    assert_eq!(owners, 0);
}

#[test]
fn monitors_racing_on_the_same_leases_recover_each_task_once() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe("lease_timeout = \"300ms\""));
    let config = Config::load(&path).unwrap();
    let queue = context(&config);
    let tasks: Vec<NewTask> = (0..500)
        .map(|i| NewTask::new("test", "{}").unwrap().id(format!("t{i}")))
        .collect();
    client(&path).push_batch("jobs", tasks).unwrap();
    // Five daemons claim a hundred tasks each, then all die.
    let mut connection = redis.connection();
    for daemon in 0..5 {
        let owner = format!("dead-daemon-{daemon}.1");
        let lease = Duration::from_millis(300);
        dead_daemon_claims(&mut connection, &queue, &owner, 0, 100, lease);
    }
    eventually(Duration::from_secs(5), "the leases to run out", || {
        let (now, owners) = broker::owners(&mut connection, &queue.keys).unwrap();
        (
            owners.len() == 5 && owners.iter().all(|(_, deadline)| *deadline <= now),
            owners,
        )
    });
    let recovered: usize = std::thread::scope(|scope| {
        let racers: Vec<_> = (0..4)
            .map(|index| {
                let mut monitor = monitor(&config, &queue, &format!("racer{index}"));
                scope.spawn(move || (0..20).map(|_| monitor.recover_now()).sum::<usize>())
            })
            .collect();
        racers.into_iter().map(|r| r.join().unwrap()).sum()
    });
    assert_eq!(
        recovered, 500,
        "each expired lease recovered by exactly one monitor"
    );
    let mut ids = redis.ids_in("kmq:{jobs}:ready:normal");
    let ready = ids.len();
    ids.sort();
    ids.dedup();
    assert_eq!(
        (ready, ids.len()),
        (500, 500),
        "no task duplicated, none lost"
    );
    let s = stats(&path, "jobs");
    assert_eq!((s.processing, s.recovered), (0, 500), "{s:?}");
    let owners: i64 = redis.cmd(&["ZCARD", "kmq:{jobs}:owners"]);
    assert_eq!(owners, 0, "every dead owner forgotten");
}

#[test]
fn a_quarantined_group_is_claimed_alone_and_nothing_is_claimed_beside_it() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe("prefetch = 8"));
    let config = Config::load(&path).unwrap();
    let queue = context(&config);
    // A task that came back four times (it runs alone) and two in the ready list.
    let suspect = r#"{"id":"suspect","type":"test","recovered":4}"#;
    let _: i64 = redis.cmd(&["RPUSH", "kmq:{jobs}:quarantine:1:normal", suspect]);
    client(&path)
        .push_batch(
            "jobs",
            ["r1", "r2"].map(|id| NewTask::new("test", "{}").unwrap().id(id)),
        )
        .unwrap();
    let mut connection = redis.connection();
    let lease = Duration::from_secs(30);
    let batch = dead_daemon_claims(&mut connection, &queue, "d.1", 0, 10, lease);
    let ids = |batch: &broker::Batch| -> Vec<String> {
        (0..batch.tasks.len())
            .map(|index| {
                kmqd::task::Envelope::decode(
                    std::str::from_utf8(batch.payloads.get(index)).unwrap(),
                )
                .unwrap()
                .id
                .unwrap()
                .into_owned()
            })
            .collect()
    };
    assert_eq!(
        ids(&batch),
        ["suspect"],
        "the group alone, nothing beside it"
    );
    assert_eq!(batch.isolation, broker::Isolation::Group);
    let waiting = claim_as(&mut connection, &queue, "d.1", 10, 10).unwrap();
    assert_eq!(
        (waiting.tasks.len(), waiting.isolation),
        (0, broker::Isolation::Waiting),
        "nothing more while the group is held"
    );
    // Settled: the next claim takes the ready tasks.
    let ack = plain_ack(batch.tasks[0].token.clone());
    settle_as(&mut connection, &queue, ("d.1", "test:acker", 1), &[ack]).unwrap();
    let next = claim_as(&mut connection, &queue, "d.1", 20, 10).unwrap();
    assert_eq!(ids(&next), ["r1", "r2"]);
    assert_eq!(next.isolation, broker::Isolation::None);
}

/// A claim whose tasks are settled in several calls (the acker settles what is done, the rest still runs) keeps
/// only its unsettled positions for the monitors: after the owner dies, exactly those come back, each once; the
/// owner's late outcomes for them are stale; and the claim list, its bitmap and its entry go once all is settled.
#[test]
fn a_claim_settled_in_parts_gives_back_only_its_unsettled_tasks_and_fences_late_outcomes() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe("lease_timeout = \"300ms\""));
    let config = Config::load(&path).unwrap();
    let queue = context(&config);
    push_numbered(&path, 100);
    let mut connection = redis.connection();
    let owner = "part.1";
    let lease = Duration::from_millis(300);
    let batch = dead_daemon_claims(&mut connection, &queue, owner, 0, 100, lease);
    assert_eq!(batch.tasks.len(), 100);
    let settlement = |index: usize, op: SettleOp| settlement_of(&batch, index, op);
    let mut number = 0;
    let mut settle = |connection: &mut broker::Conn, settlements: &[Settlement]| {
        number += 1;
        settle_as(
            connection,
            &queue,
            (owner, "part-acker", number),
            settlements,
        )
        .unwrap()
    };
    // Two calls of plain acknowledgements (the bitmaps merged), then a retry (a record: its own bit).
    for range in [0..30, 30..60] {
        let acks: Vec<Settlement> = range.map(|i| settlement(i, SettleOp::Ack)).collect();
        assert_eq!(settle(&mut connection, &acks).stale_acks, 0);
    }
    // Sent again (a duplicate outcome), those already settled are stale, and the one new among them is not.
    let again: Vec<Settlement> = (55..61).map(|i| settlement(i, SettleOp::Ack)).collect();
    assert_eq!(settle(&mut connection, &again).stale_acks, 5);
    let retry = SettleOp::Retry {
        delay: Duration::from_secs(3600),
        isolated: false,
    };
    let settled = settle(&mut connection, &[settlement(61, retry.clone())]);
    assert_eq!(settled.applied, [Some(true)]);
    assert_eq!(stats(&path, "jobs").processing, 38);
    let settled_bits: Vec<String> = redis.cmd(&["KEYS", "kmq:{jobs}:processing:*:settled"]);
    assert_eq!(settled_bits.len(), 1, "one partly settled claim");

    eventually(Duration::from_secs(5), "the lease to run out", || {
        let (now, owners) = broker::owners(&mut connection, &queue.keys).unwrap();
        (owners.iter().all(|(_, deadline)| *deadline <= now), owners)
    });
    let recovered = monitor(&config, &queue, "parts").recover_now();
    assert_eq!(recovered, 38, "the unsettled positions, and only them");
    let mut ids = redis.ids_in("kmq:{jobs}:ready:normal");
    ids.sort_by_key(|id| id[1..].parse::<usize>().unwrap());
    let expected: Vec<String> = (62..100).map(|i| format!("t{i}")).collect();
    assert_eq!(ids, expected);

    // The owner's late outcomes for what the monitor took back change nothing.
    let late: Vec<Settlement> = (62..72).map(|i| settlement(i, SettleOp::Ack)).collect();
    assert_eq!(settle(&mut connection, &late).stale_acks, 10);
    let settled = settle(&mut connection, &[settlement(72, retry)]);
    assert_eq!(settled.applied, [Some(false)]);
    let s = stats(&path, "jobs");
    assert_eq!(
        (s.done, s.retrying, s.recovered, s.ready, s.processing),
        (61, 1, 38, 38, 0),
        "{s:?}"
    );
    let left: Vec<String> = redis.cmd(&["KEYS", "kmq:{jobs}:processing:*"]);
    assert!(left.is_empty(), "the settled claim is gone: {left:?}");
}

/// A settle is all or nothing across the claims it touches: a second claim whose bitmap is broken stops it
/// before it writes the first claim's (settle.lua checks every key it may write before its first write).
#[test]
fn a_settle_over_two_claims_whose_second_bitmap_is_no_string_applies_nothing() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe(""));
    let config = Config::load(&path).unwrap();
    let queue = context(&config);
    push_numbered(&path, 20);
    let mut connection = redis.connection();
    let owner = "two.1";
    let first = dead_daemon_claims(
        &mut connection,
        &queue,
        owner,
        0,
        10,
        Duration::from_secs(60),
    );
    let second = claim_as(&mut connection, &queue, owner, 10, 10).unwrap();
    assert_eq!((first.tasks.len(), second.tasks.len()), (10, 10));
    let claim_of = |batch: &broker::Batch| match &batch.tasks[0].token.as_ref().unwrap().id {
        broker::TokenId::Listed { claim, .. } => *claim,
        other => panic!("a claim's token: {other:?}"),
    };
    let (a, b) = (claim_of(&first), claim_of(&second));
    assert_ne!(a, b);
    let broken = queue.keys.claim_settled(owner, 0, b);
    let _: i64 = redis.cmd(&["RPUSH", &broken, "not a bitmap"]);
    // Part of each claim, plain acknowledgements: the first claim's bitmap would be written first.
    let acks: Vec<Settlement> = first.tasks[..3]
        .iter()
        .chain(&second.tasks[..3])
        .map(|task| plain_ack(task.token.clone()))
        .collect();
    let settle = |connection: &mut broker::Conn, number: u64| {
        settle_as(connection, &queue, (owner, "two-acker", number), &acks)
    };
    let error = settle(&mut connection, 1).unwrap_err();
    assert!(error.to_string().contains("WRONGTYPE"), "{error}");
    let exists: i64 = redis.cmd(&["EXISTS", &queue.keys.claim_settled(owner, 0, a)]);
    assert_eq!(exists, 0, "the first claim's bitmap was not written");
    let s = stats(&path, "jobs");
    assert_eq!((s.done, s.processing), (0, 20), "nothing applied: {s:?}");
    // Repaired, the same outcomes apply, once.
    let _: i64 = redis.cmd(&["DEL", &broken]);
    let settled = settle(&mut connection, 2).unwrap();
    assert_eq!(settled.stale_acks, 0);
    let s = stats(&path, "jobs");
    assert_eq!((s.done, s.processing), (6, 14), "{s:?}");
}

/// A rolling upgrade from kmqd 0.1, whose owners kept their tasks in a hash per level: what a crashed 0.1 daemon
/// held comes back through this version's monitor, each task once.
#[test]
fn a_monitor_recovers_what_a_kmqd_0_1_owner_left_in_its_processing_hash() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe(""));
    let _: i64 = redis.cmd(&[
        "HSET",
        "kmq:{jobs}:owner:old-host-1-2-3.1",
        "mode",
        "safe",
        "levels",
        "normal",
    ]);
    let _: i64 = redis.cmd(&["ZADD", "kmq:{jobs}:owners", "1", "old-host-1-2-3.1"]);
    let _: i64 = redis.cmd(&[
        "HSET",
        "kmq:{jobs}:processing:old-host-1-2-3.1:normal",
        "17",
        r#"{"id":"a","type":"test","data":{},"attempt":0}"#,
        "18",
        r#"{"id":"b","type":"test","data":{},"attempt":0}"#,
    ]);
    let daemon = TestDaemon::start(&path);
    let s = wait_done(&path, 2, Duration::from_secs(15));
    daemon.stop();
    assert_eq!((s.recovered, s.processing), (2, 0), "{s:?}");
    let records = dir.records();
    assert_eq!((records.runs_of("a"), records.runs_of("b")), (1, 1));
    let owners: Vec<String> = redis.cmd(&["ZRANGE", "kmq:{jobs}:owners", "0", "-1"]);
    assert!(
        !owners.contains(&"old-host-1-2-3.1".to_string()),
        "the old owner is forgotten: {owners:?}"
    );
}
