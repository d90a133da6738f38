//! `kmqd dead list|show|requeue|purge` (docs/OPERATIONS.md, "Dead letters"): the records as a table and JSON, a
//! record shown whole, and requeue and purge, each record in one atomic step, while a daemon keeps
//! dead-lettering into the same list.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kmqd::broker::access::{self, Role};

use crate::support::*;

/// Two levels, and no retries: a failing task is dead-lettered at once.
const QUEUE: &str = "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\npriorities = [\"high\", \"low\"]\n\
    workers = 4\nretry_times = 0\nbackoff = \"10ms\"\nlease_timeout = \"2s\"\n";

const FAIL: &str = r#"{"outcome":"fail"}"#;
const DEAD: &str = "kmq:{jobs}:dead";

/// `kmqd -c CONFIG ARGS...`, asserting the exit code; returns standard output.
fn run(config: &Path, args: &[&str], code: i32) -> String {
    let mut all = vec!["-c", config.to_str().unwrap()];
    all.extend_from_slice(args);
    let (exit, out, err) = kmqd(&all, None);
    assert_eq!(exit, code, "kmqd {args:?}:\n{out}{err}");
    out
}

/// The dead list's records, newest first, parsed.
fn records(redis: &RedisServer) -> Vec<serde_json::Value> {
    let raw: Vec<String> = redis.cmd(&["LRANGE", DEAD, "0", "-1"]);
    raw.iter()
        .map(|record| serde_json::from_str(record).unwrap())
        .collect()
}

fn ids(records: &[serde_json::Value]) -> Vec<String> {
    records
        .iter()
        .map(|record| record["id"].as_str().unwrap().to_string())
        .collect()
}

fn wait_dead(redis: &RedisServer, count: usize) -> Vec<serde_json::Value> {
    eventually(
        Duration::from_secs(30),
        &format!("{count} dead letters"),
        || {
            let found = records(redis).len();
            (found == count, found)
        },
    );
    records(redis)
}

/// Pushes failing tasks with these ids at `level` and waits until all of them (and those dead before) are dead.
fn dead_letter(redis: &RedisServer, config: &Path, ids: &[&str], level: &str) {
    dead_letter_with(redis, config, ids, level, FAIL)
}

/// As [`dead_letter`], with the tasks' `data`.
fn dead_letter_with(redis: &RedisServer, config: &Path, ids: &[&str], level: &str, data: &str) {
    let before = records(redis).len();
    let tasks = ids.iter().map(|id| {
        kmqd::NewTask::new("test", data)
            .unwrap()
            .id(*id)
            .priority(level)
    });
    client(config).push_batch("jobs", tasks).unwrap();
    wait_dead(redis, before + ids.len());
}

/// The envelopes in a ready list, parsed.
fn ready(redis: &RedisServer, level: &str) -> Vec<serde_json::Value> {
    let raw: Vec<String> =
        redis.cmd(&["LRANGE", &format!("kmq:{{jobs}}:ready:{level}"), "0", "-1"]);
    raw.iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

#[test]
fn list_shows_the_newest_records_as_a_table_and_as_json() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let daemon = TestDaemon::start(&config);
    for id in ["first", "second", "third"] {
        dead_letter(&redis, &config, &[id], "low");
    }
    daemon.stop();

    let table = run(&config, &["dead", "list", "jobs"], 0);
    println!("{table}");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "a header and three records:\n{table}");
    for column in ["ID", "TYPE", "ATTEMPT", "REASON", "WHEN", "DAEMON"] {
        assert!(lines[0].contains(column), "{table}");
    }
    let host = kmqd::broker::hostname();
    for (line, id) in lines[1..].iter().zip(["third", "second", "first"]) {
        assert!(line.starts_with(id), "newest first:\n{table}");
        assert!(line.contains(" test "), "{table}");
        assert!(
            line.contains(" ago)") || line.contains("(just now)"),
            "{table}"
        );
        assert!(
            line.contains(&host),
            "the daemon that dead-lettered it:\n{table}"
        );
    }

    let limited = run(&config, &["dead", "list", "jobs", "--limit", "2"], 0);
    assert_eq!(limited.lines().count(), 3, "{limited}");
    assert!(
        limited.lines().nth(2).unwrap().starts_with("second"),
        "{limited}"
    );

    let json: serde_json::Value =
        serde_json::from_str(&run(&config, &["dead", "list", "jobs", "--json"], 0)).unwrap();
    let all = json.as_array().unwrap();
    assert_eq!(ids(all), ["third", "second", "first"]);
    assert_eq!(all[0]["level"], "low", "new records name their level");
    assert_eq!(all[0]["parsed_task"]["type"], "test");
    assert_eq!(all[0]["parsed_task"]["data"]["outcome"], "fail");
    assert!(all[0]["task"].is_string(), "the record's fields as stored");
    let none: serde_json::Value = serde_json::from_str(&run(
        &config,
        &["dead", "list", "jobs", "--json", "--limit", "0"],
        0,
    ))
    .unwrap();
    assert_eq!(none, serde_json::json!([]));
}

#[test]
fn show_prints_the_whole_record_with_the_task_pretty_and_exits_4_for_an_unknown_id() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let daemon = TestDaemon::start(&config);
    dead_letter(&redis, &config, &["doomed"], "high");
    daemon.stop();

    let shown = run(&config, &["dead", "show", "jobs", "doomed"], 0);
    println!("{shown}");
    assert!(shown.contains("id: doomed\n"), "{shown}");
    assert!(shown.contains("level: high\n"), "{shown}");
    assert!(shown.contains("reason: "), "{shown}");
    assert!(
        shown.contains("task:\n{\n  \"created_at\": ")
            && shown.contains(",\n  \"id\": \"doomed\",\n  \"type\": \"test\",\n  \"data\": {\n    \"outcome\": \"fail\"\n  },"),
        "the task as JSON, not an escaped string:\n{shown}"
    );
    let (code, out, err) = kmqd(
        &[
            "-c",
            config.to_str().unwrap(),
            "dead",
            "show",
            "jobs",
            "nope",
        ],
        None,
    );
    assert_eq!(code, 4, "{out}{err}");
    assert!(err.contains("no dead-letter record of task nope"), "{err}");
}

/// The atomicity the commands promise, under a daemon that keeps dead-lettering: new failing tasks arrive
/// while the list is requeued, and every requeued task fails again and is dead-lettered again. At the end
/// every task has exactly one record (none lost between the list and the queue, none both requeued and kept),
/// and the counters add up.
#[test]
fn requeue_by_id_and_all_while_a_daemon_dead_letters_more() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let daemon = TestDaemon::start(&config);
    let first: Vec<String> = (0..300).map(|i| format!("a{i}")).collect();
    let first_refs: Vec<&str> = first.iter().map(String::as_str).collect();
    dead_letter(&redis, &config, &first_refs, "low");

    let out = run(
        &config,
        &["dead", "requeue", "jobs", "a0", "a1", "a2", "nope"],
        4,
    );
    assert_eq!(
        out.lines().next(),
        Some("requeued 3, not found 1, held 0, malformed 0"),
        "{out}"
    );
    println!("{out}");

    // More failing tasks, pushed while the whole list is requeued.
    let pusher = {
        let config = config.clone();
        std::thread::spawn(move || {
            for batch in 0..30 {
                let tasks = (0..10).map(|i| {
                    kmqd::NewTask::new("test", FAIL)
                        .unwrap()
                        .id(format!("b{}", batch * 10 + i))
                });
                client(&config).push_batch("jobs", tasks).unwrap();
            }
        })
    };
    let out = run(&config, &["dead", "requeue", "jobs", "--all"], 0);
    println!("{out}");
    pusher.join().unwrap();
    let line = out.lines().next().unwrap();
    let counts: Vec<usize> = line
        .split(", ")
        .map(|part| part.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(&counts[1..], [0, 0, 0], "{out}");
    assert!(counts[0] >= 297, "every record there at the start: {out}");

    let all = wait_dead(&redis, 600);
    let mut seen: HashMap<String, usize> = HashMap::new();
    for id in ids(&all) {
        *seen.entry(id).or_default() += 1;
    }
    assert_eq!(seen.len(), 600, "every task has a record");
    assert!(seen.values().all(|n| *n == 1), "and only one");
    let s = eventually(Duration::from_secs(10), "the queue to settle", || {
        let s = stats(&config, "jobs");
        (s.ready + s.processing == 0, s)
    });
    let requeued = 3 + counts[0] as u64;
    assert_eq!(s.requeued, requeued, "{s:?}");
    assert_eq!(s.dead_lettered, 600 + requeued, "{s:?}");
    assert_eq!(s.dead, 600, "{s:?}");
    daemon.stop();

    // A limit past one page of 100 is read in pages, in order.
    let listed: serde_json::Value = serde_json::from_str(&run(
        &config,
        &["dead", "list", "jobs", "--json", "--limit", "250"],
        0,
    ))
    .unwrap();
    assert_eq!(ids(listed.as_array().unwrap()), ids(&all)[..250]);
}

#[test]
fn requeue_puts_tasks_back_at_their_level_and_reset_attempts_starts_them_again() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queue = QUEUE.replace("retry_times = 0", "retry_times = 1");
    let config = dir.config(&redis, &queue);
    let daemon = TestDaemon::start(&config);
    // A retry, once, then dead at attempt 1 ("fail" is never retried).
    let retry = r#"{"outcome":"retry"}"#;
    dead_letter_with(&redis, &config, &["kept", "reset"], "low", retry);
    daemon.stop();
    assert!(records(&redis).iter().all(|r| r["attempt"] == 1));

    let out = run(&config, &["dead", "requeue", "jobs", "kept"], 0);
    assert!(
        out.starts_with("requeued 1, not found 0, held 0, malformed 0\n"),
        "{out}"
    );
    let out = run(
        &config,
        &["dead", "requeue", "jobs", "reset", "--reset-attempts"],
        0,
    );
    assert!(out.starts_with("requeued 1,"), "{out}");
    let low = ready(&redis, "low");
    assert_eq!(
        ids(&low),
        ["kept", "reset"],
        "back at the level they died at"
    );
    assert_eq!(low[0]["attempt"], 1);
    assert_eq!(low[1]["attempt"], 0);
    assert_eq!(low[1]["data"]["outcome"], "retry", "the rest kept");
    assert!(ready(&redis, "high").is_empty());
    assert!(records(&redis).is_empty());

    // A record written before records named their level goes to the queue's default level (the highest).
    let old = serde_json::json!({"dead_at": 1, "queue": "jobs", "id": "old", "type": "test", "attempt": 0,
        "reason": "r", "daemon": "h:1", "task": r#"{"id":"old","type":"test"}"#});
    let _: i64 = redis.cmd(&["LPUSH", DEAD, &old.to_string()]);
    let out = run(&config, &["dead", "requeue", "jobs", "--all"], 0);
    assert!(out.starts_with("requeued 1,"), "{out}");
    assert_eq!(ids(&ready(&redis, "high")), ["old"]);
    let wake: i64 = redis.cmd(&["LLEN", "kmq:{jobs}:wake"]);
    assert_eq!(wake, 1, "a requeue wakes an idle fetcher");
}

#[test]
fn a_requeued_unique_task_takes_its_id_again_and_stays_dead_while_the_id_is_held() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let daemon = TestDaemon::start(&config);
    let pushed = client(&config)
        .push(
            "jobs",
            kmqd::NewTask::new("test", FAIL).unwrap().id("u1").unique(),
        )
        .unwrap();
    assert!(pushed.is_accepted());
    wait_dead(&redis, 1);
    daemon.stop();
    let held: Option<String> = redis.cmd(&["HGET", "kmq:{jobs}:unique", "u1"]);
    assert_eq!(held, None, "a dead task's id is released");
    let record: String = redis.cmd(&["LINDEX", DEAD, "0"]);

    run(&config, &["dead", "requeue", "jobs", "u1"], 0);
    let held: Option<String> = redis.cmd(&["HGET", "kmq:{jobs}:unique", "u1"]);
    assert!(held.is_some(), "the requeued task holds its id again");
    let refused = client(&config)
        .push(
            "jobs",
            kmqd::NewTask::new("test", "{}").unwrap().id("u1").unique(),
        )
        .unwrap();
    assert!(!refused.is_accepted(), "so a duplicate push is refused");

    // A second record of the same unique task, while the first is queued: not requeued, kept.
    let _: i64 = redis.cmd(&["LPUSH", DEAD, &record]);
    let out = run(&config, &["dead", "requeue", "jobs", "u1"], 0);
    assert!(
        out.starts_with("requeued 0, not found 0, held 1, malformed 0\n"),
        "{out}"
    );
    assert_eq!(records(&redis).len(), 1, "the held record stays");
    assert_eq!(ready(&redis, "high").len(), 1, "one copy queued");
}

#[test]
fn purge_removes_records_by_id_and_all() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let daemon = TestDaemon::start(&config);
    dead_letter(&redis, &config, &["p1", "p2", "p3", "p4"], "high");
    daemon.stop();

    let out = run(&config, &["dead", "purge", "jobs", "p1", "p2", "nope"], 4);
    assert_eq!(out, "purged 2, not found 1\n");
    let mut left = ids(&records(&redis));
    left.sort();
    assert_eq!(left, ["p3", "p4"]);
    let out = run(&config, &["dead", "purge", "jobs", "--all"], 0);
    assert_eq!(out, "purged 2, not found 0\n");
    assert!(records(&redis).is_empty());
    assert_eq!(stats(&config, "jobs").purged, 4);
    assert!(ready(&redis, "high").is_empty(), "purged, not requeued");
    let (code, _, err) = kmqd(
        &["-c", config.to_str().unwrap(), "dead", "purge", "jobs"],
        None,
    );
    assert_eq!(code, 2, "an id or --all is needed: {err}");
}

/// Payloads that are not envelopes are dead-lettered with their bytes; their records keep a string `id` when
/// the payload had one, are found by it, and cannot be requeued: there is no task to queue.
#[test]
fn malformed_records_are_found_by_their_id_and_reported_not_requeued() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let daemon = TestDaemon::start(&config);
    let _: i64 = redis.cmd(&[
        "RPUSH",
        "kmq:{jobs}:ready:high",
        r#"{"id":"bad-1","data":1}"#,
    ]);
    let _: i64 = redis.cmd(&["RPUSH", "kmq:{jobs}:ready:high", "not json"]);
    let _: i64 = redis.cmd(&["LPUSH", "kmq:{jobs}:wake", "1"]);
    wait_dead(&redis, 2);
    daemon.stop();

    let shown = run(&config, &["dead", "show", "jobs", "bad-1"], 0);
    assert!(
        shown.contains("task:\n{\n  \"id\": \"bad-1\",\n  \"data\": 1\n}"),
        "{shown}"
    );
    let shown = run(&config, &["task", "show", "jobs", "bad-1"], 0);
    assert!(shown.contains("dead"), "{shown}");

    let out = run(&config, &["dead", "requeue", "jobs", "bad-1"], 0);
    assert!(
        out.starts_with("requeued 0, not found 0, held 0, malformed 1\n"),
        "{out}"
    );
    let out = run(&config, &["dead", "requeue", "jobs", "--all"], 0);
    assert!(
        out.starts_with("requeued 0, not found 0, held 0, malformed 2\n"),
        "{out}"
    );
    // Either order: two workers dead-letter the two payloads side by side.
    assert!(
        out.contains("bad-1, (no id)") || out.contains("(no id), bad-1"),
        "{out}"
    );
    assert_eq!(records(&redis).len(), 2, "both records stay");
    assert!(ready(&redis, "high").is_empty());
}

const PASSWORD: &str = "dead-test-password";

/// A config that logs in as the documented user of `role`, created from the line docs/OPERATIONS.md quotes.
fn config_as(dir: &TestDir, redis: &RedisServer, role: Role) -> PathBuf {
    let line = access::setuser_line(role, "kmq").replace(">PASSWORD", &format!(">{PASSWORD}"));
    let _: String = redis.cmd(&line.split(' ').collect::<Vec<_>>());
    let password = dir.path("redis.password");
    std::fs::write(&password, format!("{PASSWORD}\n")).unwrap();
    let redis_keys = format!(
        "url = \"{}\"\nusername = \"{}\"\npassword_file = \"{}\"",
        redis.url(),
        role.user(),
        password.display()
    );
    dir.config_named(
        &format!("as-{}.toml", role.user()),
        &redis_keys,
        "",
        QUEUE,
        &dir.record_file(),
    )
}

/// The operator's documented rules are enough for every `dead` command (Redis refuses nothing, `ACL LOG` stays
/// empty); the reader's are enough to list and show, and not to requeue or purge, which it is refused before
/// anything is moved, exit 2.
#[test]
fn the_operator_s_rules_suffice_and_the_reader_cannot_requeue() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let admin = dir.config(&redis, QUEUE);
    let daemon = TestDaemon::start(&admin);
    let unique = kmqd::NewTask::new("test", FAIL).unwrap().id("u").unique();
    client(&admin).push("jobs", unique).unwrap();
    wait_dead(&redis, 1);
    dead_letter(&redis, &admin, &["x1", "x2", "x3"], "low");
    daemon.stop();
    let operator = config_as(&dir, &redis, Role::Operator);
    let reader = config_as(&dir, &redis, Role::Reader);

    let listed = run(&reader, &["dead", "list", "jobs"], 0);
    assert_eq!(listed.lines().count(), 5, "{listed}");
    run(&reader, &["dead", "show", "jobs", "x1"], 0);
    let (code, out, err) = kmqd(
        &[
            "-c",
            reader.to_str().unwrap(),
            "dead",
            "requeue",
            "jobs",
            "x1",
        ],
        None,
    );
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("Redis user \"kmqd-reader\" may not run EVALSHA on key kmq:{jobs}:ready:high")
            && err.contains("(the operators' rules: docs/OPERATIONS.md, \"ACL rules\")"),
        "{err}"
    );
    let (code, _, err) = kmqd(
        &[
            "-c",
            reader.to_str().unwrap(),
            "dead",
            "purge",
            "jobs",
            "--all",
        ],
        None,
    );
    assert_eq!(code, 2, "{err}");
    assert_eq!(records(&redis).len(), 4, "nothing moved");
    let _: String = redis.cmd(&["ACL", "LOG", "RESET"]);

    run(&operator, &["dead", "list", "jobs", "--json"], 0);
    run(&operator, &["dead", "show", "jobs", "x1"], 0);
    let out = run(
        &operator,
        &["dead", "requeue", "jobs", "x1", "u", "--reset-attempts"],
        0,
    );
    assert!(out.starts_with("requeued 2,"), "{out}");
    let out = run(&operator, &["dead", "purge", "jobs", "x2"], 0);
    assert!(out.starts_with("purged 1,"), "{out}");
    let out = run(&operator, &["dead", "requeue", "jobs", "--all"], 0);
    assert!(out.starts_with("requeued 1,"), "{out}");
    let log: Vec<redis::Value> = redis.cmd(&["ACL", "LOG"]);
    assert!(log.is_empty(), "{log:#?}");
    assert_eq!(ready(&redis, "low").len(), 2);
    assert_eq!(ready(&redis, "high").len(), 1);
}

/// A requeue whose reply is lost (the script ran, the connection closed before its answer came) says so, exit 1,
/// and running it again requeues what is left: every record ends in the ready list exactly once, none twice and
/// none lost, since each record moves in one step of the script.
#[test]
fn a_requeue_whose_reply_is_lost_is_finished_by_running_it_again_with_no_task_twice() {
    use crate::support::proxy::{AfterDrop, Fault, FaultProxy, Matcher};
    use kmqd::broker::sources;

    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let daemon = TestDaemon::start(&config);
    let all: Vec<String> = (0..250).map(|i| format!("r{i}")).collect();
    let all_refs: Vec<&str> = all.iter().map(String::as_str).collect();
    dead_letter(&redis, &config, &all_refs, "low");
    daemon.stop();

    let proxy = FaultProxy::start(&redis);
    let through = dir.config_named(
        "through.toml",
        &format!("url = \"{}\"\nio_timeout = \"2s\"", proxy.url()),
        "",
        QUEUE,
        &dir.record_file(),
    );
    // The second page's call: the first page is requeued and answered, the second runs but its answer is lost.
    let rule = proxy.add(Fault::DropReply {
        matching: Matcher::script(sources::DEAD_REQUEUE),
        nth: 2,
        then: AfterDrop::Close,
    });
    let mut args = vec!["-c", through.to_str().unwrap()];
    args.extend_from_slice(&["dead", "requeue", "jobs", "--all"]);
    let (code, out, err) = kmqd(&args, None);
    assert_eq!(rule.fired(), 1, "{out}{err}");
    assert_eq!(code, 1, "a runtime failure: {out}{err}");
    assert!(
        err.contains("may have been applied") && err.contains("kmqd dead list"),
        "says what may have happened and how to see: {err}"
    );
    let left = records(&redis).len();
    assert!(left < 250 - 100, "two pages ran in Redis: {left} left");

    let out = run(&through, &["dead", "requeue", "jobs", "--all"], 0);
    assert_eq!(
        out.lines().next(),
        Some(format!("requeued {left}, not found 0, held 0, malformed 0").as_str()),
        "{out}"
    );
    assert!(records(&redis).is_empty());
    let mut seen: HashMap<String, usize> = HashMap::new();
    for envelope in ready(&redis, "low") {
        *seen
            .entry(envelope["id"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    assert_eq!(seen.len(), 250, "every task is back");
    assert!(seen.values().all(|n| *n == 1), "and only once: {seen:?}");
}

/// The scripts remove a record's copy nearest the tail (`LREM dead -1`), where the walk reads its pages, so that
/// finding it costs a scan of the few records between it and the tail, not of the whole list (review M6: with
/// `LREM dead 1` every record of a page was looked for from the head, O(dead_max) per record, seconds of a
/// blocked Redis on a list of millions). Which end the scan starts from is seen with a record twice in the list,
/// the same bytes at the head and at the tail, and another record between them: the copy at the tail goes.
#[test]
fn requeue_and_purge_remove_the_copy_of_a_record_nearest_the_tail_where_the_walk_reads() {
    use kmqd::broker::dead::{self, Fate, RequeueItem};

    let redis = RedisServer::start();
    let keys = kmqd::broker::QueueKeys::new("kmq", "jobs", &["high".into(), "low".into()]);
    let mut connection = redis.connection();
    let (twice, between) = (r#"{"id":"twice"}"#, r#"{"id":"between"}"#);
    let _: i64 = redis.cmd(&["RPUSH", DEAD, twice, between, twice]);

    let purged = dead::purge(&mut connection, &keys, &[twice.as_bytes()]).unwrap();
    assert_eq!(purged, [Fate::Done]);
    let left: Vec<String> = redis.cmd(&["LRANGE", DEAD, "0", "-1"]);
    assert_eq!(left, [twice, between], "purge took the copy at the tail");

    let _: i64 = redis.cmd(&["RPUSH", DEAD, twice]);
    let item = RequeueItem {
        record: twice.as_bytes(),
        level: 1,
        unique_id: None,
        envelope: br#"{"id":"twice","type":"test","data":null}"#,
        withdrawal: None,
    };
    let requeued = dead::requeue(&mut connection, &keys, &[item]).unwrap();
    assert_eq!(requeued, [Fate::Done]);
    let left: Vec<String> = redis.cmd(&["LRANGE", DEAD, "0", "-1"]);
    assert_eq!(left, [twice, between], "requeue took the copy at the tail");
    assert_eq!(ready(&redis, "low").len(), 1);
}

/// A walk over the dead list (what requeue and purge page through) visits every record it set out to, once and
/// oldest first, when someone else removes records it visited and kept between its pages (another operator's
/// requeue or purge): it counted them at the tail, and read past them its next page would skip as many unvisited
/// records (review L12). The removals here are made from inside the walk's own calls, so they fall between two
/// pages for certain: some of the kept records of the first page and its newest, the newest kept by the second
/// (which also removes half its page itself), and every record kept by the third.
#[test]
fn a_walk_skips_no_record_when_another_operator_removes_records_it_kept() {
    use kmqd::broker::dead;

    let redis = RedisServer::start();
    let keys = kmqd::broker::QueueKeys::new("kmq", "jobs", &["high".into(), "low".into()]);
    let name = |i: usize| format!(r#"{{"id":"r{i}"}}"#);
    // Dead-lettered in order: r0 is the oldest, at the tail.
    for i in 0..350 {
        let _: i64 = redis.cmd(&["LPUSH", DEAD, &name(i)]);
    }
    let remove = |i: usize| {
        let removed: i64 = redis.cmd(&["LREM", DEAD, "1", &name(i)]);
        assert_eq!(removed, 1, "r{i}");
    };
    let mut visited: Vec<String> = Vec::new();
    let mut pages = 0;
    dead::walk(&mut redis.connection(), &keys, |_, page| {
        pages += 1;
        let ids: Vec<String> = page.iter().map(|record| record.id().to_string()).collect();
        visited.extend(ids);
        let mut gone = Vec::new();
        match pages {
            1 => (10..20).chain([99]).for_each(remove),
            2 => {
                for at in 0..50 {
                    remove(100 + at);
                    gone.push(at);
                }
                (160..165).chain([199]).for_each(remove);
            }
            3 => (200..300).for_each(remove),
            _ => {}
        }
        Ok(gone)
    })
    .unwrap();
    let expected: Vec<String> = (0..350).map(|i| format!("r{i}")).collect();
    assert_eq!(visited, expected, "every record once, oldest first");
    assert_eq!(pages, 4);
}
