//! Task results (`keep_results`): the settle that ends a task keeps what its handler returned, or a dead task's
//! reason, under its owner's lease only, and `kmqd task result` reads it back (docs/PROTOCOL.md, "Results";
//! docs/RELIABILITY.md, "Results").

use std::time::Duration;

use kmqd::broker::{self, Kept, SettleOp, Settlement};
use kmqd::{Config, NewTask};

use crate::safe_mode::{context, dead_daemon_claims, monitor, safe, settle_as, settlement_of};
use crate::support::*;

const HOUR_MS: i64 = 3_600_000;

/// The kept record of task `id` of `jobs`, parsed; `None` when there is none.
fn kept(redis: &RedisServer, id: &str) -> Option<serde_json::Value> {
    redis.kept_result("jobs", id)
}

/// The buckets of `jobs`'s kept results, newest first (the index's members: their STARTs).
fn buckets(redis: &RedisServer) -> Vec<String> {
    let starts: Vec<String> = redis.cmd(&["ZRANGE", "kmq:{jobs}:results", "0", "-1", "REV"]);
    starts
        .iter()
        .map(|start| format!("kmq:{{jobs}}:results:{start}"))
        .collect()
}

/// The ids of every result `jobs` keeps, sorted.
fn kept_ids(redis: &RedisServer) -> Vec<String> {
    let mut ids: Vec<String> = buckets(redis)
        .iter()
        .flat_map(|bucket| redis.cmd::<Vec<String>>(&["HKEYS", bucket]))
        .collect();
    ids.sort();
    ids
}

/// Every key of `jobs`'s results (its index and its buckets), sorted.
fn result_keys(redis: &RedisServer) -> Vec<String> {
    let mut keys: Vec<String> = redis.cmd(&["KEYS", "kmq:{jobs}:result*"]);
    keys.sort();
    keys
}

/// The settlement of task `t{index}` of `batch` (claimed at level 0) that keeps `value` for `ttl`.
fn keeping(
    batch: &broker::Batch,
    index: usize,
    op: SettleOp,
    value: &str,
    ttl: Duration,
) -> Settlement {
    Settlement {
        kept: Some(Box::new(Kept {
            id: format!("t{index}"),
            value: value.as_bytes().to_vec(),
            ttl,
        })),
        ..settlement_of(batch, index, op)
    }
}

/// Pushes tasks `ids` to `jobs` and claims them as `owner`, a daemon that will not renew its lease of `lease`.
pub(crate) fn claimed(
    path: &std::path::Path,
    connection: &mut broker::Conn,
    owner: &str,
    ids: &[&str],
    lease: Duration,
) -> (Config, broker::Batch) {
    let config = Config::load(path).unwrap();
    let tasks: Vec<NewTask> = ids
        .iter()
        .map(|id| NewTask::new("test", "{}").unwrap().id(*id))
        .collect();
    client(path).push_batch("jobs", tasks).unwrap();
    let queue = context(&config);
    let batch = dead_daemon_claims(connection, &queue, owner, 0, ids.len(), lease);
    assert_eq!(batch.tasks.len(), ids.len());
    (config, batch)
}

/// The settle applies a kept result only with the record that ends the task, while the task is its settler's:
/// an owner's late outcome for a task a monitor took back after its lease ran out (a stalled daemon's) writes
/// nothing, and a call sent again (its reply lost) writes nothing twice.
#[test]
fn a_result_is_kept_only_by_the_settle_that_ends_the_task_under_its_owners_lease() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(
        &redis,
        &safe("lease_timeout = \"300ms\"\nkeep_results = \"1h\""),
    );
    let mut connection = redis.connection();
    let owner = "stalled.1";
    let lease = Duration::from_millis(300);
    let (config, batch) = claimed(&path, &mut connection, owner, &["t0", "t1", "t2"], lease);
    let queue = context(&config);
    let settlement = |index: usize, op: SettleOp, value: &str| {
        keeping(&batch, index, op, value, Duration::from_secs(3600))
    };
    let done = settlement(0, SettleOp::Ack, r#"{"state":"done","result":{"rows":3}}"#);
    let dead = settlement(
        1,
        SettleOp::Dead,
        r#"{"state":"dead","reason":"no such customer"}"#,
    );
    let first = settle_as(
        &mut connection,
        &queue,
        (owner, "acker", 1),
        &[done.clone(), dead.clone()],
    );
    // The done task's acknowledgement goes in its claim's bitmap (its result with it), the dead one as a record.
    let first = first.unwrap();
    assert_eq!(
        (first.applied, first.stale_acks),
        (vec![None, Some(true)], 0)
    );
    let t0 = kept(&redis, "t0").expect("t0's result");
    assert_eq!(t0["state"], "done");
    assert_eq!(t0["result"], serde_json::json!({"rows": 3}));
    let ended_at = t0["ended_at"].as_i64().expect("ended_at stamped");
    assert_eq!(kept(&redis, "t1").unwrap()["reason"], "no such customer");
    // One bucket, which expires keep_results after its last result (so does the index that lists it).
    let bucket = buckets(&redis);
    assert_eq!(bucket.len(), 1, "{bucket:?}");
    for key in [bucket[0].as_str(), "kmq:{jobs}:results"] {
        let ttl: i64 = redis.cmd(&["PTTL", key]);
        assert!(
            ttl > HOUR_MS - 60_000 && ttl <= HOUR_MS,
            "{key} kept for keep_results: {ttl}"
        );
    }

    // The same call again (its reply lost): the first call's answer, and nothing written again.
    let _: i64 = redis.cmd(&["HDEL", &bucket[0], "t1"]);
    let again = settle_as(&mut connection, &queue, (owner, "acker", 1), &[done, dead]).unwrap();
    assert_eq!(
        (again.applied, again.stale_acks),
        (vec![None, Some(true)], 0)
    );
    assert_eq!(kept(&redis, "t1"), None, "a call sent again writes nothing");
    assert_eq!(kept(&redis, "t0").unwrap()["ended_at"], ended_at);

    // A duplicate outcome for t0 in a later call (its bit set before): stale, and t0's result stays the first's.
    let duplicate = settlement(0, SettleOp::Ack, r#"{"state":"done","result":"duplicate"}"#);
    let settled = settle_as(&mut connection, &queue, (owner, "acker", 2), &[duplicate]).unwrap();
    assert_eq!((settled.applied, settled.stale_acks), (vec![None], 1));
    assert_eq!(
        kept(&redis, "t0").unwrap()["result"],
        serde_json::json!({"rows": 3})
    );

    // The owner stalls past its lease; a monitor takes t2 back. The owner's late outcome for t2 is stale.
    eventually(Duration::from_secs(5), "the lease to run out", || {
        let (now, owners) = broker::owners(&mut connection, &queue.keys).unwrap();
        (owners.iter().all(|(_, deadline)| *deadline <= now), owners)
    });
    assert_eq!(monitor(&config, &queue, "results").recover_now(), 1);
    let late = settlement(2, SettleOp::Ack, r#"{"state":"done","result":"late"}"#);
    let settled = settle_as(&mut connection, &queue, (owner, "acker", 3), &[late]).unwrap();
    assert_eq!((settled.applied, settled.stale_acks), (vec![None], 1));
    assert_eq!(
        kept(&redis, "t2"),
        None,
        "a daemon that lost the lease writes no result"
    );
    assert_eq!(kept_ids(&redis), ["t0"]);
}

/// Through a daemon and the command line: a done task's result, a dead task's reason, a waiting task and an
/// unknown id, each with its exit code; a task whose handler returned nothing keeps `null`.
#[test]
fn task_result_prints_what_the_settle_kept_with_its_exit_code() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &safe_queue("keep_results = \"1h\"\nbackoff = \"10ms\""),
    );
    let daemon = TestDaemon::start(&config);
    let client = client(&config);
    let push = |id: &str, data: &str| {
        client
            .push("jobs", NewTask::new("test", data).unwrap().id(id))
            .unwrap();
    };
    push("built", r#"{"result": {"rows": 3, "file": "a.csv"}}"#);
    push("plain", "{}");
    push("broken", r#"{"outcome": "fail"}"#);
    wait_done(&config, 2, Duration::from_secs(30));
    eventually(
        Duration::from_secs(30),
        "the dead task's reason kept",
        || (kept(&redis, "broken").is_some(), ()),
    );
    let path = config.to_str().unwrap();
    let result = |id: &str, extra: &[&str]| {
        let mut args = vec!["--config", path, "task", "result", "jobs", id];
        args.extend_from_slice(extra);
        kmqd(&args, None)
    };
    let (code, out, _) = result("built", &[]);
    assert_eq!(code, 0);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).unwrap(),
        serde_json::json!({"rows": 3, "file": "a.csv"})
    );
    let (code, out, _) = result("plain", &[]);
    assert_eq!(
        (code, out.as_str()),
        (0, "null\n"),
        "done without a result: null"
    );
    let (code, out, _) = result("broken", &[]);
    assert_eq!((code, out.as_str()), (6, "testkit: asked to fail\n"));
    let (code, _, err) = result("nobody", &["--wait", "100ms"]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("no result kept"), "{err}");

    // A task still waiting when the wait ends: exit 5; once it ran, its result.
    kmqd_ok(&config, &["queue", "pause", "jobs"]);
    push("later", r#"{"result": "later"}"#);
    let (code, _, err) = result("later", &["--wait", "300ms"]);
    assert_eq!(code, 5, "{err}");
    kmqd_ok(&config, &["queue", "resume", "jobs"]);
    let (code, out, _) = result("later", &["--wait", "30s"]);
    assert_eq!((code, out.as_str()), (0, "\"later\"\n"));
    daemon.stop();
}

/// A queue without `keep_results` keeps nothing, and `task result` says why it finds nothing.
#[test]
fn without_keep_results_the_settle_keeps_nothing() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue(""));
    let daemon = TestDaemon::start(&config);
    push_many(&config, "t", 1, r#"{"result": 1}"#);
    wait_done(&config, 1, Duration::from_secs(30));
    assert_eq!(result_keys(&redis), Vec::<String>::new());
    let (code, _, err) = kmqd(
        &[
            "--config",
            config.to_str().unwrap(),
            "task",
            "result",
            "jobs",
            "t0",
        ],
        None,
    );
    assert_eq!(code, 4);
    assert!(err.contains("keeps no results (set keep_results"), "{err}");
    daemon.stop();
}

/// A result stays readable for `keep_results` after its task ended, and then goes, with its bucket and the index
/// (nothing is left behind by a queue that stops keeping results).
#[test]
fn a_kept_result_is_readable_for_keep_results_then_gone() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("keep_results = \"1s\""));
    let daemon = TestDaemon::start(&config);
    push_many(&config, "t", 1, r#"{"result": 1}"#);
    let ended_at = eventually(Duration::from_secs(30), "t0's result kept", || {
        let kept = kept(&redis, "t0");
        let ended_at = kept.as_ref().and_then(|kept| kept["ended_at"].as_i64());
        (ended_at.is_some(), ended_at.unwrap_or_default())
    });
    daemon.stop();
    let gone_at = eventually(Duration::from_secs(30), "the result gone", || {
        let time: Vec<String> = redis.cmd(&["TIME"]);
        let now_ms =
            time[0].parse::<i64>().unwrap() * 1000 + time[1].parse::<i64>().unwrap() / 1000;
        (kept(&redis, "t0").is_none(), now_ms)
    });
    assert!(
        gone_at - ended_at >= 1000,
        "kept at least keep_results: ended at {ended_at}, gone by {gone_at}"
    );
    eventually(
        Duration::from_secs(30),
        "the bucket and the index gone",
        || {
            let keys = result_keys(&redis);
            (keys.is_empty(), keys)
        },
    );
}

/// A bucket's expiry is only ever pushed back: a call keeping a result for less (a reload shortened
/// `keep_results`) does not cut short the results already in its bucket.
#[test]
fn a_shorter_keep_results_does_not_cut_short_a_result_already_kept() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe("keep_results = \"1h\""));
    let mut connection = redis.connection();
    let owner = "keeper.1";
    let lease = Duration::from_secs(60);
    let (config, batch) = claimed(&path, &mut connection, owner, &["t0", "t1"], lease);
    let queue = context(&config);
    // 30 and 25 days share a bucket length (131,072 s: `broker::results::bucket_length`), so both calls write the
    // bucket of the time (unless a 36-hour boundary falls between them).
    const DAY: u64 = 24 * 3600;
    let settlement = |index: usize, ttl: Duration| {
        keeping(
            &batch,
            index,
            SettleOp::Ack,
            r#"{"state":"done","result":null}"#,
            ttl,
        )
    };
    // t0 kept for 30 days, then t1 for 25 in a later call.
    for (number, days) in [30, 25].into_iter().enumerate() {
        let sent = [settlement(number, Duration::from_secs(days * DAY))];
        let call = (owner, "acker", number as u64 + 1);
        settle_as(&mut connection, &queue, call, &sent).unwrap();
    }
    assert!(kept(&redis, "t1").is_some());
    assert_eq!(kept_ids(&redis), ["t0", "t1"]);
    let bucket = buckets(&redis);
    assert_eq!(bucket.len(), 1, "one bucket: {bucket:?}");
    let month_ms = 30 * DAY as i64 * 1000;
    for key in [bucket[0].as_str(), "kmq:{jobs}:results"] {
        let ttl: i64 = redis.cmd(&["PTTL", key]);
        assert!(
            ttl > month_ms - 60_000,
            "{key} kept for t0's 30 days: {ttl}"
        );
    }
}
