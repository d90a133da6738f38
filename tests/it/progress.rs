//! Progress (docs/PROTOCOL.md, "Progress"): a running task's latest report, written beside its claim only while
//! its owner's lease holds and the task is unsettled, deleted with the claim by the settle, the hand-back and the
//! recovery that end its last task; coalesced by the daemon, shown by `kmqd task show` (docs/RELIABILITY.md,
//! "Progress").

use std::time::Duration;

use kmqd::NewTask;
use kmqd::broker::progress::{self, Report};
use kmqd::broker::{self, SettleOp, TokenId};

use crate::results::claimed;
use crate::safe_mode::{context, monitor, safe, settle_as, settlement_of};
use crate::support::*;

/// Every progress hash of `jobs`, sorted.
fn progress_keys(redis: &RedisServer) -> Vec<String> {
    let mut keys: Vec<String> = redis.cmd(&["KEYS", "kmq:{jobs}:processing:*:progress"]);
    keys.sort();
    keys
}

/// A report for task `index` of `batch` (claimed at level 0).
fn report_of(batch: &broker::Batch, index: usize, fraction: f32, message: &str) -> Report {
    let (claim, position) = place(batch, index);
    Report {
        level: 0,
        claim,
        position,
        fraction,
        message: message.to_string(),
    }
}

/// Where task `index` of `batch` is held: its claim and its position there.
fn place(batch: &broker::Batch, index: usize) -> (u64, u32) {
    match batch.tasks[index].token.as_ref().map(|token| &token.id) {
        Some(TokenId::Listed { claim, position }) => (*claim, *position),
        other => panic!("a safe-mode claim's token, not {other:?}"),
    }
}

/// progress.lua writes a report only for a task its owner holds under a live lease and has not settled: a report
/// for a settled task, or from an owner whose lease ran out (a stalled daemon, whose tasks a monitor takes back),
/// writes nothing; and the recovery that ends the claim's last task deletes its progress hash.
#[test]
fn a_report_after_the_lease_was_lost_or_the_task_settled_is_ignored() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe("lease_timeout = \"300ms\""));
    let mut connection = redis.connection();
    let owner = "stalled.1";
    let (config, batch) = claimed(
        &path,
        &mut connection,
        owner,
        &["t0", "t1", "t2"],
        Duration::from_millis(300),
    );
    let queue = context(&config);
    let keys = &queue.keys;
    let reports = [
        report_of(&batch, 0, 0.25, "a quarter"),
        report_of(&batch, 1, 0.5, "half way"),
    ];
    assert_eq!(
        progress::report(&mut connection, keys, owner, &reports).unwrap(),
        2
    );
    let (claim, position) = place(&batch, 1);
    let read = progress::read(&mut connection, keys, owner, 0, claim, position)
        .unwrap()
        .expect("t1's report");
    assert_eq!((read.fraction, read.message.as_str()), (0.5, "half way"));
    assert!(read.at_ms > 0, "stamped with Redis's clock");
    assert_eq!(progress_keys(&redis).len(), 1, "one hash per claim");

    // t0 settles: its later report is dropped; t1's goes on.
    let done = settlement_of(&batch, 0, SettleOp::Ack);
    settle_as(&mut connection, &queue, (owner, "acker", 1), &[done]).unwrap();
    let later = [
        report_of(&batch, 0, 0.9, "after the settle"),
        report_of(&batch, 1, 0.75, "three quarters"),
    ];
    assert_eq!(
        progress::report(&mut connection, keys, owner, &later).unwrap(),
        1
    );
    let read = progress::read(&mut connection, keys, owner, 0, claim, position).unwrap();
    assert_eq!(read.unwrap().message, "three quarters");

    // The owner stalls past its lease: its report writes nothing, though its tasks are still in its claim.
    eventually(Duration::from_secs(5), "the lease to run out", || {
        let (now, owners) = broker::owners(&mut connection, keys).unwrap();
        (owners.iter().all(|(_, deadline)| *deadline <= now), owners)
    });
    let stalled = [report_of(&batch, 1, 1.0, "from a lost lease")];
    assert_eq!(
        progress::report(&mut connection, keys, owner, &stalled).unwrap(),
        0
    );
    let read = progress::read(&mut connection, keys, owner, 0, claim, position).unwrap();
    assert_eq!(read.unwrap().message, "three quarters");

    // A monitor recovers t1 and t2: the claim goes, and its progress hash with it; a late report recreates none.
    assert_eq!(monitor(&config, &queue, "progress").recover_now(), 2);
    assert_eq!(progress_keys(&redis), Vec::<String>::new());
    assert_eq!(
        progress::report(&mut connection, keys, owner, &stalled).unwrap(),
        0
    );
    assert_eq!(progress_keys(&redis), Vec::<String>::new());
}

/// The settle that ends a claim's last task deletes its progress hash (an acknowledgement, and a hand-back).
#[test]
fn the_progress_hash_is_gone_after_the_settle_and_after_a_hand_back() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe("lease_timeout = \"1h\""));
    let mut connection = redis.connection();
    let owner = "daemon.1";
    let (config, batch) = claimed(
        &path,
        &mut connection,
        owner,
        &["t0", "t1"],
        Duration::from_secs(3600),
    );
    let queue = context(&config);
    let reports = [
        report_of(&batch, 0, 0.1, "one"),
        report_of(&batch, 1, 0.2, "two"),
    ];
    assert_eq!(
        progress::report(&mut connection, &queue.keys, owner, &reports).unwrap(),
        2
    );
    assert_eq!(progress_keys(&redis).len(), 1);
    let hash = &progress_keys(&redis)[0];
    let ttl: i64 = redis.cmd(&["PTTL", hash]);
    assert!(
        ttl > 0,
        "a progress hash expires, should anything but the settle ever delete its claim"
    );

    let done = settlement_of(&batch, 0, SettleOp::Ack);
    settle_as(&mut connection, &queue, (owner, "acker", 1), &[done]).unwrap();
    assert_eq!(progress_keys(&redis).len(), 1, "t1 still runs");
    let back = settlement_of(
        &batch,
        1,
        SettleOp::Back {
            quarantine: None,
            group: None,
        },
    );
    settle_as(&mut connection, &queue, (owner, "acker", 2), &[back]).unwrap();
    assert_eq!(progress_keys(&redis), Vec::<String>::new());
}

/// A Rust plugin's `task.progress` reaches `kmqd task show` (and its `--json`) while the task runs; once it is
/// done, its claim and the claim's progress hash are gone.
#[test]
fn a_rust_handlers_progress_is_shown_by_task_show_while_it_runs() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe(""));
    let release = dir.path("release");
    let data = serde_json::json!({
        "progress": [0.4, "page 40 of 100"],
        "wait_for_file": release,
    });
    client(&path)
        .push(
            "jobs",
            NewTask::new("test", &data.to_string())
                .unwrap()
                .id("report-7"),
        )
        .unwrap();
    let daemon = TestDaemon::start(&path);
    let shown = eventually(
        Duration::from_secs(30),
        "task show to print the progress",
        || {
            let out = kmqd_ok(&path, &["task", "show", "jobs", "report-7"]);
            (
                out.contains("progress 40% (page 40 of 100), reported "),
                out,
            )
        },
    );
    assert!(shown.contains("processing (owner "), "{shown}");
    let json: serde_json::Value = serde_json::from_str(&kmqd_ok(
        &path,
        &["task", "show", "jobs", "report-7", "--json"],
    ))
    .unwrap();
    let progress = &json[0]["progress"];
    assert_eq!(progress["message"], "page 40 of 100", "{json}");
    assert_eq!(progress["fraction"], 0.4, "{json}");
    assert!(progress["at"].as_i64().unwrap() > 0 && progress["age_ms"].as_i64().unwrap() >= 0);

    std::fs::write(&release, "").unwrap();
    eventually(
        Duration::from_secs(30),
        "the task done, its progress gone",
        || {
            let done = stats(&path, "jobs").done == 1;
            (
                done && progress_keys(&redis).is_empty(),
                progress_keys(&redis),
            )
        },
    );
    daemon.stop();
}

/// A handler that reports 20,000 times costs Redis a handful of progress.lua calls: the lane keeps each task's
/// latest report and the acker writes it at most every 250 ms (each call that writes sets its hash's expiry once:
/// PEXPIRE, which nothing else of a plain safe queue sends, counts them).
#[test]
fn a_flood_of_progress_reports_is_coalesced() {
    const REPORTS: u64 = 20_000;
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe(""));
    let data = serde_json::json!({
        "progress_flood": REPORTS,
        "progress_pause_us": 20,
        "progress": [1.0, "last"],
        "sleep_ms": 600,
    });
    client(&path)
        .push(
            "jobs",
            NewTask::new("test", &data.to_string()).unwrap().id("flood"),
        )
        .unwrap();
    let _: String = redis.cmd(&["CONFIG", "RESETSTAT"]);
    let daemon = TestDaemon::start(&path);
    eventually(Duration::from_secs(60), "the flood's task done", || {
        let s = stats(&path, "jobs");
        (s.done == 1, s)
    });
    daemon.stop();
    let info: String = redis.cmd(&["INFO", "commandstats"]);
    let calls: u64 = info
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_pexpire:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|calls| calls.parse().ok())
        .unwrap_or(0);
    assert!(calls >= 1, "the reports were written: {info}");
    assert!(
        calls * 100 <= REPORTS,
        "{calls} progress.lua calls for {REPORTS} reports: not coalesced"
    );
}

/// A daemon killed while its task reported: a monitor of another daemon recovers the claim once the lease runs
/// out, and the claim's progress hash goes with it.
#[test]
fn the_progress_hash_is_gone_after_recovery_of_a_killed_daemon() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe("lease_timeout = \"1s\""));
    let data = serde_json::json!({"progress": [0.3, "before the kill"], "until_cancelled": true});
    client(&path)
        .push(
            "jobs",
            NewTask::new("test", &data.to_string())
                .unwrap()
                .id("killed"),
        )
        .unwrap();
    let mut first = Process::start(&path, dir.path("first.log"));
    eventually(Duration::from_secs(30), "the report written", || {
        let keys = progress_keys(&redis);
        (!keys.is_empty(), keys)
    });
    let killed = progress_keys(&redis);
    first.kill9();
    let second = TestDaemon::start(&path);
    eventually(
        Duration::from_secs(30),
        "the killed daemon's claim recovered",
        || {
            let s = stats(&path, "jobs");
            (s.recovered >= 1, s)
        },
    );
    // The task runs again under the second daemon, in a claim of its own: the killed daemon's hash is gone.
    let now = progress_keys(&redis);
    assert!(
        killed.iter().all(|hash| !now.contains(hash)),
        "{killed:?} left: {now:?}"
    );
    second.stop();
}
