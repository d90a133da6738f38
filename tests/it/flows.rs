//! Flows (`kmqd flow push`, docs/design/flows.md): a task that waits for others is released exactly once, after
//! every task it waits for ended, whatever fails; a dead dependency fails it unrun (`if_failed = "fail"`) or lets
//! it run (`"continue"`), and `kmqd flow show` tells which.

use std::path::Path;
use std::time::Duration;

use kmqd::broker::sources;

use crate::support::proxy::{AfterDrop, Fault, FaultProxy, Matcher};
use crate::support::*;

/// Two safe-mode queues, `a` and `b`, with `extra` keys each.
fn two_queues(extra: &str) -> String {
    format!(
        "[[queues]]\nname = \"a\"\nmode = \"safe\"\nretry_times = 0\n{extra}\n\
         [[queues]]\nname = \"b\"\nmode = \"safe\"\nretry_times = 0\n{extra}\n"
    )
}

/// A Redis, a test dir, a config of [`two_queues`] with `extra`, and a daemon serving it.
fn served(extra: &str) -> (RedisServer, TestDir, std::path::PathBuf, TestDaemon) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &two_queues(extra));
    let daemon = TestDaemon::start(&config);
    (redis, dir, config, daemon)
}

/// Pushes the flow `json` with `kmqd flow push -`; returns what it printed.
fn flow_push(config: &Path, json: &str) -> String {
    let (code, out, err) = kmqd(
        &["--config", config.to_str().unwrap(), "flow", "push", "-"],
        Some(json),
    );
    assert_eq!(code, 0, "flow push: {out}{err}");
    out
}

/// `kmqd flow show QUEUE ID --json`, parsed.
fn flow_show(config: &Path, queue: &str, id: &str) -> serde_json::Value {
    let out = kmqd_ok(config, &["flow", "show", queue, id, "--json"]);
    serde_json::from_str(&out).expect("flow show --json prints JSON")
}

/// The position of `line` among the testkit's record lines (panics when absent).
fn line_at(lines: &[String], line: &str) -> usize {
    lines
        .iter()
        .position(|l| l == line || l.starts_with(&format!("{line} ")))
        .unwrap_or_else(|| panic!("no line {line:?} in {lines:#?}"))
}

/// A `stats` hash field of `queue`, 0 when absent.
fn counter(redis: &RedisServer, queue: &str, field: &str) -> i64 {
    let value: Option<i64> = redis.cmd(&["HGET", &format!("kmq:{{{queue}}}:stats"), field]);
    value.unwrap_or(0)
}

/// Waits until the testkit recorded a run of `id` that ended.
fn wait_ended(dir: &TestDir, id: &str, within: Duration) {
    eventually(within, &format!("{id} to end"), || {
        let records = dir.records();
        (
            records.ends.iter().any(|(i, ..)| i == id),
            records.lines.len(),
        )
    });
}

/// `id`'s last end (of its runs, a part recovered or rewound may have run twice) came before `merge` started.
fn assert_ended_before_merge(lines: &[String], id: &str) {
    let last_end = lines
        .iter()
        .rposition(|line| line.starts_with(&format!("end {id} ")))
        .unwrap_or_else(|| panic!("{id} never ended"));
    assert!(
        last_end < line_at(lines, "start merge 0"),
        "{id} ended after merge started"
    );
}

/// `merge` ran once, after the last end of each of `part-0` to `part-{parts - 1}` (a part recovered from a killed
/// daemon may have run twice).
fn assert_merge_ran_once_after_its_parts(dir: &TestDir, parts: usize) {
    let records = dir.records();
    assert_eq!(records.runs_of("merge"), 1);
    let start = line_at(&records.lines, "start merge 0");
    for i in 0..parts {
        let id = format!("part-{i}");
        let last_end = records
            .lines
            .iter()
            .rposition(|line| line.starts_with(&format!("end {id} ")))
            .unwrap_or_else(|| panic!("{id} never ended"));
        assert!(last_end < start, "{id} ended after merge started");
    }
}

/// A chain across two queues: each task starts only after the one before it ended, each runs once, and the last
/// one's handler gets its dependency's outcome; `flow show` shows the graph with each state.
#[test]
fn a_chain_across_two_queues_runs_each_task_once_after_the_one_before() {
    let (redis, dir, config, daemon) = served("");
    flow_push(
        &config,
        r#"{"queue": "a", "type": "test", "id": "third",
            "after": [{"queue": "b", "type": "test", "id": "second", "data": {"result": {"rows": 2}},
                       "after": [{"queue": "a", "type": "test", "id": "first"}]}]}"#,
    );
    wait_ended(&dir, "third", Duration::from_secs(30));
    let records = dir.records();
    for id in ["first", "second", "third"] {
        assert_eq!(records.runs_of(id), 1, "{id}: {:#?}", records.lines);
    }
    assert!(line_at(&records.lines, "end first 0") < line_at(&records.lines, "start second 0"));
    assert!(line_at(&records.lines, "end second 0") < line_at(&records.lines, "start third 0"));
    // The handler got its dependency's outcome (`Task::dependencies`), result included.
    assert!(
        records.lines.contains(
            &r#"after third [{"queue":"b","id":"second","state":"done","result":{"rows":2}}]"#
                .to_string()
        ),
        "{:#?}",
        records.lines
    );
    assert!(
        !records
            .lines
            .iter()
            .any(|line| line.starts_with("after first"))
    );
    let shown = flow_show(&config, "a", "third");
    assert_eq!(shown["state"], "released");
    assert_eq!(shown["after"][0]["id"], "second");
    assert_eq!(shown["after"][0]["state"], "done");
    assert_eq!(shown["after"][0]["result"], serde_json::json!({"rows": 2}));
    assert_eq!(shown["after"][0]["after"][0]["id"], "first");
    assert_eq!(shown["after"][0]["after"][0]["state"], "done");
    assert_eq!(counter(&redis, "a", "released"), 1);
    assert_eq!(counter(&redis, "b", "released"), 1);
    daemon.stop();
}

/// A fan-in of 1,000 tasks into one: it starts once, after the last of them ended, and its hashes are gone from
/// the waiting set.
#[test]
fn a_fan_in_of_a_thousand_releases_its_waiter_once_after_the_last() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &two_queues("workers = 8"));
    let parts: Vec<String> = (0..1000)
        .map(|i| format!(r#"{{"queue": "a", "type": "test", "id": "part-{i}"}}"#))
        .collect();
    flow_push(
        &config,
        &format!(
            r#"{{"queue": "b", "type": "test", "id": "merge", "after": [{}]}}"#,
            parts.join(",")
        ),
    );
    let waiting: i64 = redis.cmd(&["HLEN", "kmq:{b}:deps-waiting"]);
    assert_eq!(waiting, 1, "the waiting task waits before any part ran");
    let daemon = TestDaemon::start(&config);
    wait_ended(&dir, "merge", Duration::from_secs(60));
    let records = dir.records();
    assert_eq!(records.runs_of("merge"), 1);
    let start = line_at(&records.lines, "start merge 0");
    for i in 0..1000 {
        assert_eq!(records.runs_of(&format!("part-{i}")), 1, "part-{i}");
        assert!(
            line_at(&records.lines, &format!("end part-{i} 0")) < start,
            "part-{i} ended after merge started"
        );
    }
    let waiting: i64 = redis.cmd(&["HLEN", "kmq:{b}:deps-waiting"]);
    assert_eq!(waiting, 0);
    assert_eq!(counter(&redis, "b", "released"), 1);
    let outbox: i64 = redis.cmd(&["LLEN", "kmq:{a}:deps-outbox"]);
    assert_eq!(outbox, 0, "every note applied and removed");
    let ttl: i64 = redis.cmd(&["PTTL", "kmq:{b}:deps-ended:merge"]);
    assert!(ttl > 0, "a finished waiter's outcomes expire: {ttl}");
    daemon.stop();
}

/// Under `if_failed = "fail"` (the default) a dead dependency dead-letters its waiter unrun, with a reason that
/// names it, and so on up the graph; under `"continue"` the waiter runs, and `flow show` shows which failed.
#[test]
fn a_dead_dependency_fails_its_waiters_unrun_up_the_graph_unless_they_continue() {
    let (redis, dir, config, daemon) = served("");
    flow_push(
        &config,
        r#"{"queue": "b", "type": "test", "id": "top",
            "after": [{"queue": "b", "type": "test", "id": "mid",
                       "after": [{"queue": "a", "type": "test", "id": "bad", "data": {"outcome": "fail"}}]}]}"#,
    );
    flow_push(
        &config,
        r#"{"queue": "b", "type": "test", "id": "brave", "if_failed": "continue",
            "after": [{"queue": "a", "type": "test", "id": "bad-2", "data": {"outcome": "fail"}},
                      {"queue": "a", "type": "test", "id": "good"}]}"#,
    );
    wait_ended(&dir, "brave", Duration::from_secs(30));
    let dead: Vec<String> =
        eventually(Duration::from_secs(10), "mid and top dead-lettered", || {
            let dead: Vec<String> = redis.cmd(&["LRANGE", "kmq:{b}:dead", "0", "-1"]);
            (dead.len() == 2, dead)
        });
    let reasons: Vec<(String, String)> = dead
        .iter()
        .map(|record| {
            let record: serde_json::Value = serde_json::from_str(record).unwrap();
            (
                record["id"].as_str().unwrap().to_string(),
                record["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert!(
        reasons
            .iter()
            .any(|(id, reason)| id == "mid" && reason.starts_with("dependency a/bad ended dead")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|(id, reason)| id == "top" && reason.starts_with("dependency b/mid ended dead")),
        "{reasons:?}"
    );
    let records = dir.records();
    assert_eq!(records.runs_of("mid"), 0);
    assert_eq!(records.runs_of("top"), 0);
    assert_eq!(records.runs_of("brave"), 1);
    let shown = flow_show(&config, "b", "top");
    assert_eq!(shown["state"], "dead");
    assert_eq!(shown["after"][0]["state"], "dead");
    assert_eq!(shown["after"][0]["after"][0]["state"], "dead");
    let brave = flow_show(&config, "b", "brave");
    let states: Vec<(&str, &str)> = brave["after"]
        .as_array()
        .unwrap()
        .iter()
        .map(|dep| (dep["id"].as_str().unwrap(), dep["state"].as_str().unwrap()))
        .collect();
    assert_eq!(states, [("bad-2", "dead"), ("good", "done")]);
    daemon.stop();
}

/// The dead letter of `id` in queue `a` once it is there (the newest), with its task's `data` replaced by
/// `data` when given (an operator who fixed the cause before requeueing it); returns its task.
fn dead_letter_of(
    redis: &RedisServer,
    id: &str,
    data: Option<serde_json::Value>,
) -> serde_json::Value {
    let (at, record): (usize, String) = eventually(
        Duration::from_secs(30),
        &format!("{id} dead-lettered"),
        || {
            let dead: Vec<String> = redis.cmd(&["LRANGE", "kmq:{a}:dead", "0", "-1"]);
            let found = dead.iter().enumerate().find(|(_, record)| {
                serde_json::from_str::<serde_json::Value>(record).unwrap()["id"] == id
            });
            (
                found.is_some(),
                found.map(|(at, r)| (at, r.clone())).unwrap_or_default(),
            )
        },
    );
    let mut record: serde_json::Value = serde_json::from_str(&record).unwrap();
    let mut task: serde_json::Value =
        serde_json::from_str(record["task"].as_str().unwrap()).unwrap();
    if let Some(data) = data {
        task["data"] = data;
        record["task"] = serde_json::Value::String(task.to_string());
        let _: () = redis.cmd(&["LSET", "kmq:{a}:dead", &at.to_string(), &record.to_string()]);
    }
    task
}

/// `kmqd dead requeue` of a dead dependency re-arms the task that waits for it while it still waits (here under
/// `if_failed = "continue"`): it waits for the requeued run, even when its other dependency ends meanwhile, and
/// runs with that run's outcome, not the dead run's. Requeued twice (dead again, then done), it runs once, after
/// the last run ended, with the last run's outcome. Without the withdrawal the requeue writes, the waiter is
/// released with the dead run as soon as its other dependency ends.
#[test]
fn a_requeued_dead_dependency_re_arms_its_waiting_task_which_runs_with_the_new_outcome() {
    let (redis, dir, config, daemon) = served("");
    let (gate, fixed) = (dir.path("gate"), dir.path("fixed"));
    flow_push(
        &config,
        &format!(
            r#"{{"queue": "b", "type": "test", "id": "merge", "if_failed": "continue",
                "after": [{{"queue": "a", "type": "test", "id": "flaky", "data": {{"outcome": "fail"}}}},
                          {{"queue": "a", "type": "test", "id": "slow",
                            "data": {{"wait_for_file": {:?}}}}}]}}"#,
            gate.to_str().unwrap()
        ),
    );
    let requeue = || kmqd_ok(&config, &["dead", "requeue", "a", "flaky"]);
    let merge = || flow_show(&config, "b", "merge");
    // The dead run is recorded at the waiter, which waits for `slow`.
    let task = dead_letter_of(&redis, "flaky", None);
    assert!(task.get("run").is_none(), "{task}");
    eventually(
        Duration::from_secs(10),
        "the dead run recorded at merge",
        || {
            let shown = merge();
            (shown["after"][0]["state"] == "dead", shown)
        },
    );
    // Requeued as it is: it runs (run 1) and is dead again.
    requeue();
    eventually(Duration::from_secs(30), "flaky's second run to end", || {
        let runs = dir.records().runs_of("flaky");
        (runs == 2, runs)
    });
    // Fixed (it now waits for a file, then is done), and requeued again: run 2.
    let data = serde_json::json!({"wait_for_file": fixed.to_str().unwrap(), "result": "fixed"});
    let task = dead_letter_of(&redis, "flaky", Some(data));
    assert_eq!(task["run"], 1, "{task}");
    requeue();
    eventually(
        Duration::from_secs(30),
        "flaky's third run to start",
        || {
            let runs = dir.records().runs_of("flaky");
            (runs == 3, runs)
        },
    );
    // `slow` ends while run 2 runs: merge records it, and still waits (for run 2, not the dead run 1).
    std::fs::write(&gate, b"").unwrap();
    let shown = eventually(Duration::from_secs(30), "slow recorded at merge", || {
        let shown = merge();
        (shown["after"][1]["state"] == "done", shown)
    });
    assert_eq!(shown["state"], "waiting", "{shown}");
    std::fs::write(&fixed, b"").unwrap();
    wait_ended(&dir, "merge", Duration::from_secs(30));
    let records = dir.records();
    assert_eq!(records.runs_of("merge"), 1, "{:#?}", records.lines);
    assert_ended_before_merge(&records.lines, "flaky");
    let after = records
        .lines
        .iter()
        .find(|line| line.starts_with("after merge "))
        .unwrap_or_else(|| panic!("{:#?}", records.lines));
    let after: serde_json::Value = serde_json::from_str(&after["after merge ".len()..]).unwrap();
    let flaky = after
        .as_array()
        .unwrap()
        .iter()
        .find(|dep| dep["id"] == "flaky")
        .unwrap();
    assert_eq!(flaky["state"], "done", "{after}");
    assert_eq!(flaky["result"], "fixed", "{after}");
    assert_eq!(counter(&redis, "b", "released"), 1);
    daemon.stop();
}

/// `kmqd dead requeue` of a dead dependency whose note has not reached its waiter yet (the mover's apply of it was
/// lost on the way, so the note is still in the outbox) re-arms a waiter under `if_failed = "fail"`: the
/// withdrawal goes to the head of the outbox, the next mover applies it first and the dead run's note after it is
/// stale, so the waiter is not failed, and runs once the requeued run is done. Without the withdrawal at the
/// head, the dead note is applied first and fails it.
#[test]
fn a_dependency_requeued_before_its_dead_note_was_applied_re_arms_a_failing_waiter() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let config = dir.config_raw(
        &format!("url = \"{}\"\nio_timeout = \"4s\"", proxy.url()),
        "shutdown_grace = \"5s\"",
        &two_queues("lease_timeout = \"10s\""),
    );
    let lost = proxy.add(Fault::DropRequest {
        matching: Matcher::script(sources::FLOW_APPLY),
        nth: 1,
        then: AfterDrop::Hang,
    });
    let daemon = TestDaemon::start(&config);
    flow_push(
        &config,
        r#"{"queue": "b", "type": "test", "id": "merge",
            "after": [{"queue": "a", "type": "test", "id": "flaky", "data": {"outcome": "fail"}}]}"#,
    );
    // The mover read the dead note and its apply is lost: the note stays in the outbox until the mover's
    // connection times out and its next turn reads it again.
    eventually(
        Duration::from_secs(30),
        "the dead note's apply lost",
        || (lost.fired() > 0, lost.fired()),
    );
    dead_letter_of(
        &redis,
        "flaky",
        Some(serde_json::json!({"result": "fixed"})),
    );
    kmqd_ok(&config, &["dead", "requeue", "a", "flaky"]);
    wait_ended(&dir, "merge", Duration::from_secs(30));
    let records = dir.records();
    assert_eq!(records.runs_of("merge"), 1, "{:#?}", records.lines);
    assert_ended_before_merge(&records.lines, "flaky");
    let shown = flow_show(&config, "b", "merge");
    assert_eq!(shown["state"], "released", "{shown}");
    assert_eq!(shown["after"][0]["state"], "done", "{shown}");
    let dead: i64 = redis.cmd(&["LLEN", "kmq:{b}:dead"]);
    assert_eq!(dead, 0, "merge was not failed");
    daemon.stop();
}

/// One flow_apply.lua call carries every note a mover read for a waiter (a fan-in's thousand); it decides the
/// waiter exactly as the notes applied one call each would, though it steps the waiter only on the note that may
/// decide it: a duplicate in the call does not count, a dead dependency under `fail` fails it even when the
/// count reaches `need` in the same call, and a withdrawal after the note that released it changes nothing (a
/// step once at the end of the call would have forgotten the outcome and left the waiter waiting).
#[test]
fn one_apply_of_many_notes_decides_the_waiter_as_one_apply_a_note_would() {
    let redis = RedisServer::start();
    let apply_needing = |id: &str, if_failed: &str, need: usize, notes: &[[&str; 4]]| -> String {
        let meta = format!("kmq:{{b}}:deps:{id}");
        let ready = "kmq:{b}:ready".to_string();
        let _: i64 = redis.cmd(&["HSETNX", &meta, "ready", &ready]);
        let _: i64 = redis.cmd(&[
            "HSET",
            &meta,
            "queue",
            "b",
            "id",
            id,
            "type",
            "test",
            "envelope",
            r#"{"id":"x","type":"test"}"#,
            "if_failed",
            if_failed,
            "need",
            &need.to_string(),
            "deps",
            "[]",
            "up",
            "[]",
            "dead_max",
            "100",
            "keep_ms",
            "60000",
        ]);
        let _: i64 = redis.cmd(&["HSETNX", &meta, "state", "waiting"]);
        let keys = [
            meta.clone(),
            format!("kmq:{{b}}:deps-ended:{id}"),
            "kmq:{b}:deps-waiting".to_string(),
            ready,
            "kmq:{b}:wake".to_string(),
            "kmq:{b}:dead".to_string(),
            "kmq:{b}:stats".to_string(),
            "kmq:{b}:deps-outbox".to_string(),
            format!("kmq:{{b}}:deps-run:{id}"),
        ];
        let mut args: Vec<&str> = vec!["EVAL", sources::FLOW_APPLY, "9"];
        args.extend(keys.iter().map(String::as_str));
        for note in notes {
            args.extend(note);
        }
        redis.cmd(&args)
    };
    let apply =
        |id: &str, if_failed: &str, notes: &[[&str; 4]]| apply_needing(id, if_failed, 2, notes);
    let done = |n: &str| format!(r#"{{"queue":"a","id":"{n}","state":"done","result":null}}"#);
    let (p1, p2) = (done("p1"), done("p2"));
    let dead = r#"{"queue":"a","id":"p1","state":"dead","reason":"boom"}"#;
    // A duplicate in the call counts once: one of two dependencies ended.
    let said = apply(
        "dup",
        "fail",
        &[["a\np1", &p1, "done", "0"], ["a\np1", &p1, "done", "0"]],
    );
    assert_eq!(said, "waiting");
    // A dead one under `fail`, then the last: failed, never released, with the dead one's reason.
    let said = apply(
        "failing",
        "fail",
        &[["a\np1", dead, "dead", "0"], ["a\np2", &p2, "done", "0"]],
    );
    assert_eq!(said, "failed");
    let state: String = redis.cmd(&["HGET", "kmq:{b}:deps:failing", "state"]);
    assert_eq!(state, "dead");
    let reason: String = redis.cmd(&["HGET", "kmq:{b}:deps:failing", "reason"]);
    assert_eq!(reason, "dependency a/p1 ended dead: boom");
    // Released by the second note; the withdrawal after it finds a task that no longer waits.
    let said = apply(
        "released",
        "fail",
        &[
            ["a\np1", &p1, "done", "0"],
            ["a\np2", &p2, "done", "0"],
            ["a\np1", "", "withdraw", "1"],
        ],
    );
    assert_eq!(said, "released");
    let ended: i64 = redis.cmd(&["HLEN", "kmq:{b}:deps-ended:released"]);
    assert_eq!(ended, 2, "the released task keeps the outcomes it ran with");
    let ready: i64 = redis.cmd(&["LLEN", "kmq:{b}:ready"]);
    assert_eq!(ready, 1, "only the released task is ready, once");
    // The same notes again (a second mover): nothing changes.
    let said = apply(
        "released",
        "fail",
        &[["a\np1", &p1, "done", "0"], ["a\np2", &p2, "done", "0"]],
    );
    assert_eq!(said, "duplicate");
    let ready: i64 = redis.cmd(&["LLEN", "kmq:{b}:ready"]);
    assert_eq!(ready, 1);
    // A mover's turn of thousands of notes (up to `APPLY_BATCH`), a thousand of them delivered twice in the same
    // call: 2,500 distinct dependencies released the task once, on the last distinct one, with every outcome
    // once; the notes after it are recorded, not counted again.
    let ids: Vec<String> = (0..2_600).map(|n| format!("a\nf{n}")).collect();
    let outcomes: Vec<String> = (0..2_600).map(|n| done(&format!("f{n}"))).collect();
    let order = (0..2_500).chain(0..1_000).chain(2_500..2_600);
    let notes: Vec<[&str; 4]> = order
        .map(|n| [ids[n].as_str(), outcomes[n].as_str(), "done", "0"])
        .collect();
    let said = apply_needing("wide", "fail", 2_500, &notes);
    assert_eq!(said, "released");
    let ended: i64 = redis.cmd(&["HLEN", "kmq:{b}:deps-ended:wide"]);
    assert_eq!(ended, 2_600, "every outcome recorded once");
    let ready: Vec<String> = redis.cmd(&["LRANGE", "kmq:{b}:ready", "0", "-1"]);
    assert_eq!(
        ready.len(),
        2,
        "the wide task released once: {}",
        ready.len()
    );
    let released: serde_json::Value = serde_json::from_str(&ready[1]).unwrap();
    assert_eq!(released["after"].as_array().map(Vec::len), Some(2_500));
    assert_eq!(apply_needing("wide", "fail", 2_500, &notes), "duplicate");
}

/// A daemon killed with -9 in the middle of a fan-in (tasks held, notes written but not moved, an apply cut
/// short): another daemon recovers its tasks and moves its notes, and the waiter is released exactly once, after
/// every part ended.
#[test]
fn a_daemon_killed_mid_flow_leaves_its_waiter_released_exactly_once() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &two_queues("workers = 4\nlease_timeout = \"1s\""));
    let parts: Vec<String> = (0..300)
        .map(|i| {
            format!(
                r#"{{"queue": "a", "type": "test", "id": "part-{i}", "data": {{"sleep_ms": 2}}}}"#
            )
        })
        .collect();
    flow_push(
        &config,
        &format!(
            r#"{{"queue": "b", "type": "test", "id": "merge", "after": [{}]}}"#,
            parts.join(",")
        ),
    );
    let mut first = Process::start(&config, dir.path("first.log"));
    eventually(Duration::from_secs(30), "progress before the kill", || {
        let ended = counter(&redis, "a", "done");
        (ended >= 100, ended)
    });
    first.kill9();
    let second = TestDaemon::start(&config);
    wait_ended(&dir, "merge", Duration::from_secs(60));
    assert_merge_ran_once_after_its_parts(&dir, 300);
    assert_eq!(counter(&redis, "b", "released"), 1);
    second.stop();
}

/// A settle's reply lost (the settle ran: its notes are written), then a mover's apply's and its removal's
/// replies lost: the settle sent again writes no note twice, the note applied again changes nothing, and the
/// waiter runs exactly once.
#[test]
fn lost_settle_apply_and_removal_replies_release_the_waiter_exactly_once() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let config = dir.config_through(&proxy, &two_queues("lease_timeout = \"10s\""));
    let settle = proxy.add(Fault::DropReply {
        matching: Matcher::script(sources::SETTLE),
        nth: 1,
        then: AfterDrop::Close,
    });
    let apply = proxy.add(Fault::DropReply {
        matching: Matcher::script(sources::FLOW_APPLY),
        nth: 1,
        then: AfterDrop::Close,
    });
    let removal = proxy.add(Fault::DropReply {
        matching: Matcher::script(sources::FLOW_OUTBOX),
        nth: 1,
        then: AfterDrop::Hang,
    });
    let daemon = TestDaemon::start(&config);
    flow_push(
        &config,
        r#"{"queue": "b", "type": "test", "id": "merge",
            "after": [{"queue": "a", "type": "test", "id": "p1"}, {"queue": "a", "type": "test", "id": "p2"},
                      {"queue": "b", "type": "test", "id": "p3"}]}"#,
    );
    wait_ended(&dir, "merge", Duration::from_secs(60));
    let fired = eventually(Duration::from_secs(10), "every fault to strike", || {
        let fired = (settle.fired(), apply.fired(), removal.fired());
        (fired.0 > 0 && fired.1 > 0 && fired.2 > 0, fired)
    });
    assert_eq!(fired, (1, 1, 1));
    let records = dir.records();
    assert_eq!(records.runs_of("merge"), 1);
    // Nothing more is released later: the notes are all gone, the count stays 1.
    eventually(Duration::from_secs(10), "both outboxes empty", || {
        let a: i64 = redis.cmd(&["LLEN", "kmq:{a}:deps-outbox"]);
        let b: i64 = redis.cmd(&["LLEN", "kmq:{b}:deps-outbox"]);
        (a + b == 0, (a, b))
    });
    assert_eq!(counter(&redis, "b", "released"), 1);
    assert_eq!(dir.records().runs_of("merge"), 1);
    daemon.stop();
}

/// A fan-in of `parts` parts of queue `a` (`part-{i}`, `data` each, and `extra` nodes after them) into `merge` of
/// queue `b`, as a flow file.
fn fan_in(parts: usize, data: &str, extra: &str) -> String {
    let mut nodes: Vec<String> = (0..parts)
        .map(|i| format!(r#"{{"queue": "a", "type": "test", "id": "part-{i}", "data": {data}}}"#))
        .collect();
    if !extra.is_empty() {
        nodes.push(extra.to_string());
    }
    format!(
        r#"{{"queue": "b", "type": "test", "id": "merge", "after": [{}]}}"#,
        nodes.join(",")
    )
}

/// Redis killed (SIGKILL) and restarted on its append-only file (`appendfsync always`) in the middle of a fan-in:
/// every write it acknowledged is in the file, so every note written and every record applied survives; the
/// daemon reconnects, a settle whose reply was lost is sent again (its stored answer, no second note), and the
/// waiter runs once, after every part's last end.
#[test]
fn a_redis_restarted_on_its_append_only_file_mid_flow_releases_the_waiter_once_after_its_parts() {
    let mut redis = RedisServer::with_aof(Fsync::Always);
    let dir = TestDir::new();
    let config = dir.config_raw(
        &format!("url = \"{}\"\nio_timeout = \"1s\"", redis.url()),
        "shutdown_grace = \"5s\"",
        &two_queues("workers = 4\nlease_timeout = \"2s\""),
    );
    flow_push(&config, &fan_in(300, r#"{"sleep_ms": 2}"#, ""));
    let daemon = TestDaemon::start(&config);
    eventually(Duration::from_secs(30), "progress before the kill", || {
        let ended = counter(&redis, "a", "done");
        (ended >= 100, ended)
    });
    redis.stop(Signal::Kill);
    redis.restart();
    wait_ended(&dir, "merge", Duration::from_secs(90));
    assert_merge_ran_once_after_its_parts(&dir, 300);
    assert_eq!(counter(&redis, "b", "released"), 1);
    eventually(Duration::from_secs(10), "the outbox empty", || {
        let left: i64 = redis.cmd(&["LLEN", "kmq:{a}:deps-outbox"]);
        (left == 0, left)
    });
    daemon.stop();
    assert_eq!(dir.records().runs_of("merge"), 1);
}

/// Redis rewound mid-flow (its append-only file cut back to a mark, as a restored older backup or a failover to
/// a lagging replica leaves it): the parts that ended after the mark are forgotten with their notes and their
/// records at the waiter, all of one consistent past; their owner is given up (its journal is behind), they run
/// again and write their notes again, and the waiter, which had not been released by the mark, is released once,
/// after every part's last end. (A release after the mark would be forgotten too, and happen again: the waiter
/// would run twice, as any task whose settle a rewind undoes: docs/RELIABILITY.md, "Flows".)
#[test]
fn a_redis_rewound_mid_flow_releases_the_waiter_once_after_its_parts_run_again() {
    let mut redis = RedisServer::start_with(RedisOptions {
        appendonly: Some(Fsync::Always),
        extra_args: vec!["--auto-aof-rewrite-percentage".into(), "0".into()],
        ..RedisOptions::default()
    });
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let config = dir.config_raw(
        &format!("url = \"{}\"\nio_timeout = \"1s\"", redis.url()),
        "shutdown_grace = \"5s\"",
        &two_queues("workers = 4\nlease_timeout = \"1s\""),
    );
    let last = format!(
        r#"{{"queue": "a", "type": "test", "id": "last", "data": {{"wait_for_file": {:?}}}}}"#,
        gate.to_str().unwrap()
    );
    flow_push(&config, &fan_in(60, r#"{"sleep_ms": 20}"#, &last));
    let daemon = TestDaemon::start(&config);
    eventually(Duration::from_secs(30), "progress before the mark", || {
        let ended = counter(&redis, "a", "done");
        (ended >= 10, ended)
    });
    let mark = redis.aof_mark();
    let at_mark = counter(&redis, "a", "done");
    let after = eventually(Duration::from_secs(30), "progress after the mark", || {
        let ended = counter(&redis, "a", "done");
        (ended >= at_mark + 10, ended)
    });
    let cut = redis.crash_back_to(mark);
    assert!(cut > 0, "the writes after the mark were in the file");
    assert!(
        counter(&redis, "a", "done") < after,
        "the rewind forgot the parts that ended after the mark"
    );
    std::fs::write(&gate, b"").unwrap();
    wait_ended(&dir, "merge", Duration::from_secs(90));
    assert_merge_ran_once_after_its_parts(&dir, 60);
    let records = dir.records();
    assert_ended_before_merge(&records.lines, "last");
    assert!(
        (0..60).any(|i| records.runs_of(&format!("part-{i}")) > 1),
        "some part ran again after the rewind"
    );
    assert_eq!(counter(&redis, "b", "released"), 1);
    daemon.stop();
    assert_eq!(dir.records().runs_of("merge"), 1);
}

/// `flow push` refuses a flow it cannot push whole, naming the task and what is wrong, and writes nothing.
#[test]
fn a_bad_flow_is_refused_whole_with_the_task_named() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &two_queues(""));
    let (code, _, err) = kmqd(
        &["--config", config.to_str().unwrap(), "flow", "push", "-"],
        Some(
            r#"{"queue": "a", "type": "test", "id": "x", "after": [{"queue": "nope", "type": "test"}]}"#,
        ),
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("after[0]: queue \"nope\" is not in the config"),
        "{err}"
    );
    let keys: Vec<String> = redis.cmd(&["KEYS", "*"]);
    assert!(keys.is_empty(), "nothing written: {keys:?}");
    let (code, _, err) = kmqd(
        &[
            "--config",
            config.to_str().unwrap(),
            "flow",
            "show",
            "a",
            "x",
        ],
        None,
    );
    assert_eq!(code, 4, "not a waiting task: {err}");
    assert!(err.contains("a x is not a waiting task of a flow"), "{err}");
}

/// On a Redis Cluster, a chain whose queues are on three different masters (no shared hash tag): each task runs
/// once, after the one before it; a dead dependency fails its waiter on another master.
#[test]
fn on_a_cluster_a_chain_across_three_masters_runs_each_task_once_in_order() {
    use kmqd_harness::cluster::{Cluster, ClusterOptions};
    let cluster = Cluster::start(ClusterOptions::default()).expect("start a Redis Cluster");
    let placed = cluster.queue_names_on_distinct_masters(1).unwrap();
    let names: Vec<&str> = placed.iter().map(|(_, names)| names[0].as_str()).collect();
    let [one, two, three] = names[..] else {
        panic!("three masters: {placed:?}");
    };
    let dir = TestDir::new();
    let queues: String = [one, two, three]
        .iter()
        .map(|name| format!("[[queues]]\nname = \"{name}\"\nmode = \"safe\"\nretry_times = 0\n\n"))
        .collect();
    let config = dir.config_raw(
        &crate::cluster::redis_section(&cluster, ""),
        "shutdown_grace = \"5s\"",
        &queues,
    );
    let daemon = TestDaemon::start(&config);
    flow_push(
        &config,
        &format!(
            r#"{{"queue": "{three}", "type": "test", "id": "last",
                 "after": [{{"queue": "{two}", "type": "test", "id": "middle",
                            "after": [{{"queue": "{one}", "type": "test", "id": "first"}}]}}]}}"#
        ),
    );
    flow_push(
        &config,
        &format!(
            r#"{{"queue": "{one}", "type": "test", "id": "doomed",
                 "after": [{{"queue": "{three}", "type": "test", "id": "bad", "data": {{"outcome": "fail"}}}}]}}"#
        ),
    );
    wait_ended(&dir, "last", Duration::from_secs(60));
    let records = dir.records();
    for id in ["first", "middle", "last"] {
        assert_eq!(records.runs_of(id), 1, "{id}: {:#?}", records.lines);
    }
    assert!(line_at(&records.lines, "end first 0") < line_at(&records.lines, "start middle 0"));
    assert!(line_at(&records.lines, "end middle 0") < line_at(&records.lines, "start last 0"));
    let shown = eventually(Duration::from_secs(30), "doomed failed", || {
        let shown = flow_show(&config, one, "doomed");
        (shown["state"] == "dead", shown)
    });
    assert_eq!(shown["after"][0]["state"], "dead");
    assert_eq!(dir.records().runs_of("doomed"), 0);
    daemon.stop();
}

/// On a Redis Cluster with `wait_replicas = 1`, the master of a fan-in's parts (their claims, settles and the
/// outbox of their notes) killed mid-flow: its replica takes over, and the waiting task on another master is
/// released exactly once, after every part ended.
#[test]
fn on_a_cluster_a_master_killed_mid_flow_releases_the_waiter_exactly_once() {
    fan_in_across_a_failover(false);
}

/// As `on_a_cluster_a_master_killed_mid_flow_releases_the_waiter_exactly_once`, but the master killed is the
/// waiting task's own (its hashes, its ready list, the applies): with `wait_replicas = 1` each apply is on the
/// replica before its note is removed, so the replica that takes over has every record whose note is gone, and
/// a note whose apply it lacks is still in its outbox, applied again. The waiter runs once, after every part.
#[test]
fn on_a_cluster_the_waiting_task_s_own_master_killed_mid_flow_releases_it_exactly_once() {
    fan_in_across_a_failover(true);
}

/// A fan-in of 400 parts on one master into a waiting task on another, `wait_replicas = 1`, with the parts'
/// master (or, `waiters_master`, the waiting task's) killed mid-drain and failed over: the waiter runs once,
/// after every part's last end.
fn fan_in_across_a_failover(waiters_master: bool) {
    use kmqd_harness::Signal;
    use kmqd_harness::cluster::{Cluster, ClusterOptions};
    let mut cluster = Cluster::start(ClusterOptions::default()).expect("start a Redis Cluster");
    let placed = cluster.queue_names_on_distinct_masters(1).unwrap();
    let (parts_master, parts) = (placed[0].0.clone(), placed[0].1[0].clone());
    let (merges_master, merges) = (placed[1].0.clone(), placed[1].1[0].clone());
    let killed = if waiters_master {
        merges_master
    } else {
        parts_master
    };
    let dir = TestDir::new();
    let queues = format!(
        "[[queues]]\nname = \"{parts}\"\nmode = \"safe\"\nworkers = 4\nlease_timeout = \"3s\"\n\n\
         [[queues]]\nname = \"{merges}\"\nmode = \"safe\"\nlease_timeout = \"3s\"\n"
    );
    let config = dir.config_raw(
        &crate::cluster::redis_section(
            &cluster,
            "wait_replicas = 1\nwait_timeout = \"500ms\"\nio_timeout = \"2s\"",
        ),
        "shutdown_grace = \"5s\"",
        &queues,
    );
    let tasks: Vec<String> = (0..400)
        .map(|i| format!(r#"{{"queue": "{parts}", "type": "test", "id": "part-{i}", "data": {{"sleep_ms": 3}}}}"#))
        .collect();
    flow_push(
        &config,
        &format!(
            r#"{{"queue": "{merges}", "type": "test", "id": "merge", "after": [{}]}}"#,
            tasks.join(",")
        ),
    );
    let daemon = TestDaemon::start(&config);
    eventually(Duration::from_secs(30), "a drain under way", || {
        let ended = dir.records().ends.len();
        (ended >= 100, ended)
    });
    cluster.kill_master(&killed.addr, Signal::Kill).unwrap();
    cluster.wait_failover().unwrap();
    cluster.restart_node(&killed.addr).unwrap();
    wait_ended(&dir, "merge", Duration::from_secs(120));
    assert_merge_ran_once_after_its_parts(&dir, 400);
    let shown = flow_show(&config, &merges, "merge");
    assert_eq!(shown["state"], "released");
    daemon.stop();
}

/// A settle call writes one note for all the tasks it ends that have the same waiters and run (after.lua), with
/// the outcome of each that applied, not a note a task: a fan-in's settle of a thousand parts is one list
/// element to move. Exact as notes a task were: a call sent again after its reply was lost writes nothing, a task
/// of another run gets a note of its own, and a later call's stale settlement (its bit set before) adds nothing.
#[test]
fn a_settle_call_writes_one_note_a_waiter_and_run_with_each_task_it_ended() {
    use kmqd::broker::{SettleOp, Settlement, tasks::Note};

    use crate::results::claimed;
    use crate::safe_mode::{context, safe, settle_as, settlement_of};

    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe(""));
    let mut connection = redis.connection();
    let owner = "settler.1";
    let ids = ["t0", "t1", "t2", "t3"];
    let (config, batch) = claimed(&path, &mut connection, owner, &ids, Duration::from_secs(60));
    let queue = context(&config);
    let to = r#"[{"queue":"jobs","id":"root"}]"#;
    let noted = |index: usize, op: SettleOp, run: u64| {
        let state = if op == SettleOp::Dead { "dead" } else { "done" };
        Settlement {
            note: Some(Box::new(Note {
                to: to.into(),
                run,
                outcome: format!(r#"{{"queue":"jobs","id":"t{index}","state":"{state}"}}"#)
                    .into_bytes(),
            })),
            ..settlement_of(&batch, index, op)
        }
    };
    let outbox = || -> Vec<String> { redis.cmd(&["LRANGE", "kmq:{jobs}:deps-outbox", "0", "-1"]) };
    let call = [
        noted(0, SettleOp::Ack, 0),
        noted(1, SettleOp::Dead, 0),
        noted(2, SettleOp::Ack, 0),
        noted(3, SettleOp::Ack, 2),
    ];
    settle_as(&mut connection, &queue, (owner, "acker", 1), &call).unwrap();
    let outcome =
        |n: usize, state: &str| format!(r#"{{"queue":"jobs","id":"t{n}","state":"{state}"}}"#);
    let first = format!(
        r#"{{"to":{to},"outcomes":[{},{},{}]}}"#,
        outcome(0, "done"),
        outcome(2, "done"),
        outcome(1, "dead")
    );
    let run_2 = format!(
        r#"{{"to":{to},"run":2,"outcomes":[{}]}}"#,
        outcome(3, "done")
    );
    // The plain acknowledgements' outcomes (in their claim's bitmap) come before the dead record's.
    assert_eq!(outbox(), [first.clone(), run_2.clone()]);
    // The same call again (its reply lost): the stored answer, no note.
    settle_as(&mut connection, &queue, (owner, "acker", 1), &call).unwrap();
    assert_eq!(outbox(), [first.clone(), run_2.clone()]);
    // A later call's duplicate of t0 (its bit set before): stale, no note.
    settle_as(
        &mut connection,
        &queue,
        (owner, "acker", 2),
        &[noted(0, SettleOp::Ack, 0)],
    )
    .unwrap();
    assert_eq!(outbox(), [first, run_2]);
}
