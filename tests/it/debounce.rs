//! Debounce (docs/PROTOCOL.md, "Debounce, and unique for a time"): a debounced push replaces the delayed task of
//! its id and moves its due time, so only the last push of a burst runs, with the last data; racing the promotion
//! and the claims, a task never runs twice and the last data is never lost. And unique for a time: a
//! `unique_for` id stays held for its window after its task ended. In both modes.

use std::time::Duration;

use kmqd::NewTask;
use kmqd::client::DeadSelection;

use crate::support::*;

fn queue(mode: &str) -> String {
    format!("[[queues]]\nname = \"jobs\"\nmode = \"{mode}\"\nworkers = 2\n")
}

/// The testkit's data: `fail`, the handler fails the task (it is dead-lettered, with its data, at once).
fn data(n: usize, fail: bool) -> String {
    let outcome = if fail { "fail" } else { "done" };
    format!(r#"{{"n":{n},"outcome":"{outcome}"}}"#)
}

/// Ten debounced pushes of one id, each well within the delay of the one before: one task waits, with the last
/// data (the first nine would fail), and runs once.
fn a_burst_of_debounced_pushes_runs_once_with_the_last_data(mode: &str) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue(mode));
    let daemon = TestDaemon::start(&config);
    let client = client(&config);
    for n in 0..10 {
        let task = NewTask::new("test", &data(n, n < 9))
            .unwrap()
            .id("burst")
            .debounce(Duration::from_secs(2));
        assert!(client.push("jobs", task).unwrap().is_accepted(), "{mode}");
    }
    let waiting: String = redis.cmd(&["HGET", "kmq:{jobs}:delayed-tasks", "burst"]);
    assert!(waiting.contains(r#""n":9"#), "{mode}: {waiting}");
    let s = eventually(Duration::from_secs(20), "the burst's task to run", || {
        let s = stats(&config, "jobs");
        (s.done == 1, s)
    });
    assert_eq!(
        (s.pushed, s.dead_lettered, s.failed),
        (1, 0, 0),
        "{mode}: {s:?}"
    );
    assert_eq!(dir.records().runs_of("burst"), 1, "{mode}");
    daemon.stop();
}

#[test]
fn a_burst_of_debounced_pushes_runs_once_with_the_last_data_in_safe_mode() {
    a_burst_of_debounced_pushes_runs_once_with_the_last_data("safe");
}

#[test]
fn a_burst_of_debounced_pushes_runs_once_with_the_last_data_in_default_mode() {
    a_burst_of_debounced_pushes_runs_once_with_the_last_data("default");
}

/// Debounced pushes of one id with a delay of a few ms, while a daemon promotes and runs them: some replace the
/// waiting task, some find it promoted (or running) and queue a new one. Every task queued runs exactly once
/// (runs = done + dead = `pushed`), and the last push's data runs (it fails, so its record is its data).
fn debounced_pushes_racing_the_claims_run_each_task_once_and_lose_no_last_data(mode: &str) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue(mode));
    let daemon = TestDaemon::start(&config);
    let client = client(&config);
    let last = 299;
    for n in 0..=last {
        let task = NewTask::new("test", &data(n, n == last))
            .unwrap()
            .id("race")
            .debounce(Duration::from_millis(3));
        assert!(client.push("jobs", task).unwrap().is_accepted(), "{mode}");
    }
    let s = eventually(Duration::from_secs(30), "every queued task to end", || {
        let s = stats(&config, "jobs");
        (
            s.pushed > 0 && s.done + s.dead_lettered == s.pushed && s.delayed == 0,
            s,
        )
    });
    assert_eq!(
        s.dead_lettered, 1,
        "{mode}: only the last push fails: {s:?}"
    );
    let dead = dead_records(&redis, "jobs");
    assert!(
        dead[0]["task"]
            .as_str()
            .unwrap()
            .contains(&format!(r#""n":{last}"#)),
        "{mode}: the last data ran: {dead:?}"
    );
    assert_eq!(
        dir.records().runs_of("race") as u64,
        s.pushed,
        "{mode}: every task queued ran once: {s:?}"
    );
    daemon.stop();
}

#[test]
fn debounced_pushes_racing_the_claims_run_each_task_once_and_lose_no_last_data_in_safe_mode() {
    debounced_pushes_racing_the_claims_run_each_task_once_and_lose_no_last_data("safe");
}

#[test]
fn debounced_pushes_racing_the_claims_run_each_task_once_and_lose_no_last_data_in_default_mode() {
    debounced_pushes_racing_the_claims_run_each_task_once_and_lose_no_last_data("default");
}

/// A debounced push that cannot be (no delay, combined with unique, an unknown option) is refused whole, writing
/// nothing.
#[test]
fn push_lua_refuses_an_unknown_option_and_a_debounce_without_a_delay_writing_nothing() {
    let redis = RedisServer::start();
    let script = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/src/broker/scripts/push.lua"
    ))
    .unwrap();
    let keys = [
        "kmq:{jobs}:ready:normal",
        "kmq:{jobs}:delayed:normal",
        "kmq:{jobs}:delayed-tasks",
        "kmq:{jobs}:wake",
        "kmq:{jobs}:unique",
        "kmq:{jobs}:stats",
    ];
    let envelope = r#"{"id":"x","type":"test"}"#;
    for (delay, options, refusal) in [
        ("0", "debounce", "a debounced task needs a delay"),
        (
            "100",
            "unique,debounce",
            "debounce does not combine with unique",
        ),
        (
            "100",
            "debounce,unique_for=1000",
            "debounce does not combine with unique",
        ),
        ("100", "debounce,forever", "unknown option forever"),
        ("0", "unique_for=0", "unknown option unique_for=0"),
    ] {
        let mut command = redis::cmd("EVAL");
        command.arg(&script).arg(keys.len()).arg(&keys[..]);
        command.arg(delay).arg(0).arg("kmq:{jobs}:delay-wake");
        command.arg("x").arg(options).arg(envelope);
        let error = command
            .query::<Vec<i64>>(&mut redis.connection())
            .expect_err(&format!("{options} refused"));
        assert!(error.to_string().contains(refusal), "{options}: {error}");
        let keys: Vec<String> = redis.cmd(&["KEYS", "*"]);
        assert!(keys.is_empty(), "{options}: nothing written: {keys:?}");
    }
}

/// Unique for a time: a task pushed with `unique_for` keeps its id held after it ended (done, or dead), so a unique
/// push of the id is refused until the window has passed, and accepted after; the hold is a key that expires by
/// itself (no sweeper). A plain unique id is free as its task ends, as before.
fn a_unique_for_id_stays_held_for_its_window_after_its_task_ended(mode: &str) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue(mode));
    let daemon = TestDaemon::start(&config);
    let client = client(&config);
    let push = |id: &str, n: usize, fail: bool, hold: Option<Duration>| {
        let task = NewTask::new("test", &data(n, fail)).unwrap().id(id);
        let task = match hold {
            Some(hold) => task.unique_for(hold),
            None => task.unique(),
        };
        client.push("jobs", task).unwrap().is_accepted()
    };
    let window = Duration::from_secs(600);
    assert!(push("done-1", 0, false, Some(window)), "{mode}");
    assert!(push("dead-1", 1, true, Some(window)), "{mode}");
    assert!(push("plain-1", 2, false, None), "{mode}");
    assert!(
        push("short-1", 3, false, Some(Duration::from_millis(300))),
        "{mode}"
    );
    eventually(Duration::from_secs(20), "the four tasks to end", || {
        let s = stats(&config, "jobs");
        (s.done == 3 && s.dead_lettered == 1, s)
    });
    for id in ["done-1", "dead-1"] {
        // Held after the end, by a key whose expiry is the window: refused, whether plain unique or unique_for.
        let ttl: i64 = redis.cmd(&["PTTL", &format!("kmq:{{jobs}}:unique:held:{id}")]);
        assert!(
            ttl > 0 && ttl <= window.as_millis() as i64,
            "{mode} {id}: {ttl}"
        );
        assert!(!push(id, 9, false, None), "{mode} {id}");
        assert!(!push(id, 9, false, Some(window)), "{mode} {id}");
    }
    // A plain unique id is free once its task ended.
    assert!(push("plain-1", 9, false, None), "{mode}");
    // A short window passes by itself: the id is accepted again.
    eventually(Duration::from_secs(20), "the short hold to pass", || {
        (push("short-1", 9, false, None), ())
    });
    daemon.stop();
}

#[test]
fn a_unique_for_id_stays_held_for_its_window_after_its_task_ended_in_safe_mode() {
    a_unique_for_id_stays_held_for_its_window_after_its_task_ended("safe");
}

#[test]
fn a_unique_for_id_stays_held_for_its_window_after_its_task_ended_in_default_mode() {
    a_unique_for_id_stays_held_for_its_window_after_its_task_ended("default");
}

/// Unique for a time, issue 37: `kmqd dead requeue` of a dead `unique_for` task. Its record carries the window
/// (`"unique_for": MS`, settle.lua); the requeue leaves it dead while the id's hold is there, as a push is refused,
/// and once the window passed takes the id again with it, so that the requeued run's end holds the id again. The
/// requeue took it as a plain unique id (`NOW`) whether or not the hold was there: a second run within the window,
/// and none after it.
fn a_requeued_unique_for_task_waits_out_its_window_and_holds_it_again_after_it_ends(mode: &str) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue(mode));
    let daemon = TestDaemon::start(&config);
    let client = client(&config);
    let window = Duration::from_secs(600);
    let task = NewTask::new("test", &data(0, true))
        .unwrap()
        .id("doomed")
        .unique_for(window);
    assert!(client.push("jobs", task).unwrap().is_accepted(), "{mode}");
    let dead_ends = |n: u64| {
        eventually(
            Duration::from_secs(20),
            "the task to be dead-lettered",
            || {
                let s = stats(&config, "jobs");
                (s.dead_lettered == n, s)
            },
        )
    };
    dead_ends(1);
    let record: String = redis.cmd(&["LINDEX", "kmq:{jobs}:dead", "0"]);
    assert!(
        record.contains(r#""unique_for":600000,"#),
        "{mode}: {record}"
    );
    let requeued = client
        .dead_requeue("jobs", DeadSelection::Ids(&["doomed"]), false)
        .unwrap();
    assert_eq!(requeued.held, ["doomed"], "{mode}: {requeued:?}");
    let field: Option<String> = redis.cmd(&["HGET", "kmq:{jobs}:unique", "doomed"]);
    assert_eq!(field, None, "{mode}: nothing taken while held");
    // The window passes (its hold expires).
    let _: i64 = redis.cmd(&["DEL", "kmq:{jobs}:unique:held:doomed"]);
    let requeued = client
        .dead_requeue("jobs", DeadSelection::Ids(&["doomed"]), false)
        .unwrap();
    assert_eq!(requeued.requeued, ["doomed"], "{mode}: {requeued:?}");
    dead_ends(2);
    let ttl: i64 = redis.cmd(&["PTTL", "kmq:{jobs}:unique:held:doomed"]);
    assert!(
        ttl > 0 && ttl <= window.as_millis() as i64,
        "{mode}: the requeued run's end holds the id for its window: {ttl}"
    );
    let again = NewTask::new("test", &data(1, false))
        .unwrap()
        .id("doomed")
        .unique();
    assert!(!client.push("jobs", again).unwrap().is_accepted(), "{mode}");
    daemon.stop();
}

#[test]
fn a_requeued_unique_for_task_waits_out_its_window_and_holds_it_again_after_it_ends_in_safe_mode() {
    a_requeued_unique_for_task_waits_out_its_window_and_holds_it_again_after_it_ends("safe");
}

#[test]
fn a_requeued_unique_for_task_waits_out_its_window_and_holds_it_again_after_it_ends_in_default_mode()
 {
    a_requeued_unique_for_task_waits_out_its_window_and_holds_it_again_after_it_ends("default");
}

/// Unique for a time, issue 37: a cancel ends a `unique_for` task too, and its id stays held for the window from
/// then (remove.lua, unique_hold.lua): a cancel cannot tell a task that never ran from a retry's, whose run started
/// less than the window ago. It freed the id at once, and a push of the id ran again within the window.
#[test]
fn a_cancelled_unique_for_task_holds_its_id_for_its_window() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue("safe"));
    let client = client(&config);
    let window = Duration::from_secs(600);
    let push = |id: &str, hold: Option<Duration>| {
        let task = NewTask::new("test", &data(0, false))
            .unwrap()
            .id(id)
            .delay(Duration::from_secs(3600));
        let task = match hold {
            Some(hold) => task.unique_for(hold),
            None => task.unique(),
        };
        client.push("jobs", task).unwrap().is_accepted()
    };
    assert!(push("throttled", Some(window)));
    assert!(push("plain", None));
    assert_eq!(client.cancel("jobs", "throttled").unwrap(), 1);
    assert_eq!(client.cancel("jobs", "plain").unwrap(), 1);
    let ttl: i64 = redis.cmd(&["PTTL", "kmq:{jobs}:unique:held:throttled"]);
    assert!(ttl > 0 && ttl <= window.as_millis() as i64, "{ttl}");
    assert!(
        !push("throttled", None),
        "held for its window once cancelled"
    );
    assert!(
        push("plain", None),
        "a plain unique id is free once cancelled"
    );
}
