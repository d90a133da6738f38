//! docs/PROTOCOL.md is a contract: producers that follow it with plain Redis commands get their tasks run.

use std::time::{Duration, Instant};

use base64::Engine as _;

use crate::support::{self, *};

const SAFE_QUEUE: &str =
    "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 2\nidle_poll = \"200ms\"\n";

/// How many times Redis ran `command` (lowercase) since its stats were last reset (`INFO commandstats`).
pub(crate) fn command_calls(redis: &RedisServer, command: &str) -> u64 {
    let info: String = redis.cmd(&["INFO", "commandstats"]);
    info.lines()
        .find_map(|line| line.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// The code block after the `n`-th "tested" marker of docs/PROTOCOL.md.
fn documented_block(n: usize) -> String {
    support::documented_block("docs/PROTOCOL.md", "tests/it/protocol.rs", n)
}

/// Runs a documented redis-cli block against the test's own server, for the testkit's task type.
fn run_documented(block: &str, redis: &RedisServer) {
    support::run_documented(&block.replace("mail.send", "test"), redis);
}

const MAIL: &str = "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nworkers = 2\n";

/// A producer that pushes to its own list, as documented under "To a list of your own", gets its task run.
#[test]
fn task_pushed_to_a_source_list_as_documented_runs() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queue = "[[queues]]\nname = \"email\"\nmode = \"safe\"\nforeign_type_field = \"callback\"\n\
                 source_lists = [\"queue:email\"]\n";
    let config = dir.config(&redis, queue);
    let daemon = TestDaemon::start(&config);
    run_documented(&documented_block(2), &redis);
    eventually(
        Duration::from_secs(10),
        "the task to be acknowledged",
        || {
            let stats = stats(&config, "email");
            (stats.done == 1 && stats.moved == 1, stats)
        },
    );
    daemon.stop();
    assert_eq!(dir.records().runs_of("ria-7"), 1);
}

#[test]
fn task_pushed_with_plain_rpush_as_documented_runs() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, MAIL);
    let daemon = TestDaemon::start(&config);
    run_documented(&documented_block(1), &redis);
    eventually(
        Duration::from_secs(10),
        "the task to be acknowledged",
        || {
            let stats = stats(&config, "mail");
            (stats.done == 1 && stats.processing == 0, stats)
        },
    );
    assert_eq!(dir.records().runs_of("order-42"), 1);
    daemon.stop();
}

#[test]
fn task_pushed_with_the_published_script_as_documented_runs() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, MAIL);
    let daemon = TestDaemon::start(&config);
    run_documented(&documented_block(0), &redis);
    eventually(
        Duration::from_secs(10),
        "the scripted task to be done",
        || {
            let stats = stats(&config, "mail");
            (stats.done == 1 && stats.pushed == 1, stats)
        },
    );
    assert_eq!(dir.records().runs_of("order-42"), 1);
    daemon.stop();
}

/// A plain push writes a wake-up marker only when the wake list holds none: a marker that waits already means no
/// fetcher waits on the list (Redis would have handed it the marker), so push.lua writes nothing more there, and
/// a list found empty takes its marker without a trim. Before, every push ran `LPUSH` and `LTRIM`: two of a plain
/// push's seven commands in Redis, the largest part of its cost (issue 38; docs/PERFORMANCE.md, "push.lua's plain
/// path").
#[test]
fn a_plain_push_writes_a_wake_marker_only_to_an_empty_wake_list() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, SAFE_QUEUE);
    let _: String = redis.cmd(&["CONFIG", "RESETSTAT"]);
    let calls = |command: &str| command_calls(&redis, command);
    push_many(&config, "first", 1, "{}");
    assert_eq!(
        (calls("lpush"), calls("ltrim")),
        (1, 0),
        "a push to an empty wake list"
    );
    push_many(&config, "more", 3, "{}");
    push_many(&config, "last", 1, "{}");
    assert_eq!(
        (calls("lpush"), calls("ltrim")),
        (1, 0),
        "pushes behind a waiting marker"
    );
    let wake: i64 = redis.cmd(&["LLEN", "kmq:{jobs}:wake"]);
    let ready: i64 = redis.cmd(&["LLEN", "kmq:{jobs}:ready:normal"]);
    assert_eq!((wake, ready), (1, 5));
}

/// An idle queue's claim (a task just pushed; the owner holds nothing, its marker was taken, nothing was
/// dead-lettered, no limit counts) checks the type of only the keys that exist and looks up all the others with one
/// EXISTS: each call a script makes costs Redis about 5,000 instructions, and this claim is on every idle push's way
/// to its handler (issue 38; docs/PERFORMANCE.md, "The idle claim's calls"). claim.lua made 14 TYPE calls, 3 EXISTS
/// and 3 LLEN before: 29 calls in all, then 15; of the keys that exist, the owners zset, the owner's info hash and
/// the stats hash are checked by the reads the claim makes of them, so the ready list alone needs a TYPE (4 before:
/// "A claim that pays only for the script code it uses"). claim_plain.lua, which a plain queue's claims go to first
/// ("A claim made for the plain queue"), needs none: its LLEN of the ready list is that list's check (and tells it
/// whether tasks are left for a marker), and it reads no dead count (it leaves dead-lettering to claim.lua): ten
/// calls, one script run.
#[test]
fn an_idle_claim_checks_the_types_of_only_the_keys_that_exist() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, SAFE_QUEUE);
    let config = kmqd::Config::load(&path).unwrap();
    let queue = crate::safe_mode::context(&config);
    let mut connection = redis.connection();
    let lease = Duration::from_secs(30);
    // An owner registered, whose first claim found nothing.
    let first = crate::safe_mode::dead_daemon_claims(&mut connection, &queue, "o.1", 0, 10, lease);
    assert!(first.tasks.is_empty());
    let limits = kmqd::broker::ClaimLimits {
        daemon: "test:0",
        ..queue.claim_limits()
    };
    let owner = std::sync::Arc::from("o.1");
    let calls = |command: &str| command_calls(&redis, command);
    for (number, by) in [(10, "claim.lua"), (20, "claim_plain.lua")] {
        client(&path)
            .push("jobs", kmqd::NewTask::new("test", "{}").unwrap().id(by))
            .unwrap();
        // As an idle fetcher's BLPOP takes the push's marker.
        let _: i64 = redis.cmd(&["DEL", "kmq:{jobs}:wake"]);
        // As after the settle of the claim before: the owner holds nothing.
        let _: i64 = redis.cmd(&["DEL", "kmq:{jobs}:processing:o.1:normal"]);
        let _: String = redis.cmd(&["CONFIG", "RESETSTAT"]);
        let claim = match by {
            "claim.lua" => kmqd::broker::claim_generic,
            _ => kmqd::broker::claim,
        };
        let batch = claim(&mut connection, &queue.keys, &owner, number, 10, &limits).unwrap();
        assert_eq!(batch.tasks.len(), 1);
        let (types, exists, llens) = (calls("type"), calls("exists"), calls("llen"));
        if by == "claim.lua" {
            assert_eq!(
                (types, exists, llens),
                (1, 1, 0),
                "{by}: TYPE, EXISTS and LLEN calls"
            );
        } else {
            assert_eq!(
                (types, exists, llens, calls("hget"), calls("evalsha")),
                (0, 1, 1, 0, 1),
                "{by}: TYPE, EXISTS, LLEN and HGET calls, and one script run"
            );
        }
    }
}

/// An idle default-mode queue's pop (pop.lua: a task just pushed, no unique id held, no limit counts, no weights:
/// default mode's take behind its idle wait) checks the type of only the keys that exist (the ready list; the
/// owners zset's read of the lease is its check) and looks up all the others with one EXISTS, as an idle claim does
/// (docs/PERFORMANCE.md, "A claim that pays only for the script code it uses", "The idle take's Lua, line by
/// line"). It made 11 TYPE calls, 1 EXISTS and 1 HLEN before the first, 2 TYPE calls before the second.
#[test]
fn an_idle_pop_checks_the_types_of_only_the_keys_that_exist() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, "[[queues]]\nname = \"fast\"\nmode = \"default\"\n");
    let keys = kmqd::broker::QueueKeys::new("kmq", "fast", &["normal".to_string()]);
    client(&config)
        .push("fast", kmqd::NewTask::new("test", "{}").unwrap().id("t"))
        .unwrap();
    let mut connection = redis.connection();
    let lease = Duration::from_secs(30);
    let info = kmqd::broker::OwnerInfo::default();
    assert!(
        kmqd::broker::register(&mut connection, &keys, "o.1", lease, &info)
            .unwrap()
            .is_some()
    );
    let _: String = redis.cmd(&["CONFIG", "RESETSTAT"]);
    let owner = std::sync::Arc::from("o.1");
    let limits = kmqd::broker::PopLimits::default();
    let batch = kmqd::broker::Popper::default()
        .pop(&mut connection, &keys, &owner, 10, limits, None)
        .unwrap();
    assert_eq!(batch.tasks.len(), 1);
    let calls = |command: &str| command_calls(&redis, command);
    assert_eq!(
        (calls("type"), calls("exists"), calls("hlen")),
        (1, 1, 0),
        "TYPE, EXISTS and HLEN calls of one idle pop"
    );
}

/// A push whose first write Redis refuses for another reason than a key's type (here OOM: `maxmemory` below what
/// Redis uses, nothing to evict) is answered with Redis's own error, not as a wrong-typed ready list: an operator
/// reads what to fix. (A replica's READONLY is the same path; the Go client's Sentinel tests met it.)
#[test]
fn a_push_refused_for_memory_says_oom_not_wrongtype() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, SAFE_QUEUE);
    let _: String = redis.cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    let _: String = redis.cmd(&["CONFIG", "SET", "maxmemory", "1"]);
    let task = kmqd::NewTask::new("test", "{}").unwrap().id("t-1");
    let error = client(&config).push("jobs", task).unwrap_err().to_string();
    let _: String = redis.cmd(&["CONFIG", "SET", "maxmemory", "0"]);
    assert!(
        error.contains("OOM") && !error.contains("WRONGTYPE"),
        "{error}"
    );
    let ready: i64 = redis.cmd(&["LLEN", "kmq:{jobs}:ready:normal"]);
    assert_eq!(ready, 0);
}

/// An idle daemon's next claim (safe mode) or pop (default mode) is in Redis before a push comes: sent behind its
/// blocking wait in the same write, it waits in its connection's query buffer (`qbuf` in `CLIENT LIST`), and Redis
/// runs it as soon as a push ends the wait, a round trip sooner than a take sent once the wait answered (issue
/// 38; docs/PERFORMANCE.md, "Push to start on an idle queue").
#[test]
fn an_idle_daemon_waits_with_its_next_take_already_sent_behind_the_wait() {
    for (mode, command) in [("safe", "blpop"), ("default", "blmove")] {
        let redis = RedisServer::start();
        let dir = TestDir::new();
        let queue = format!(
            "[[queues]]\nname = \"jobs\"\nmode = \"{mode}\"\nworkers = 2\nidle_poll = \"5s\"\n"
        );
        let config = dir.config(&redis, &queue);
        let daemon = TestDaemon::start(&config);
        eventually(
            Duration::from_secs(10),
            &format!("{mode} mode: a fetcher blocked in {command} with its take queued behind"),
            || {
                let queued = redis.client_fields(command, "qbuf");
                let behind = queued
                    .iter()
                    .any(|bytes| bytes.parse::<u64>().is_ok_and(|n| n > 0));
                (behind, queued)
            },
        );
        push_many(&config, "t", 1, "{}");
        eventually(Duration::from_secs(10), "the task to run", || {
            (dir.records().runs_of("t0") == 1, ())
        });
        daemon.stop();
    }
}

#[test]
fn plain_rpush_without_a_wake_marker_is_picked_up_within_idle_poll() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, SAFE_QUEUE);
    let daemon = TestDaemon::start(&config);
    // Let the fetchers go idle (blocked on the wake list) first.
    redis.wait_blocked_in("blpop");
    let pushed = Instant::now();
    let _: i64 = redis.cmd(&[
        "RPUSH",
        "kmq:{jobs}:ready:normal",
        r#"{"id":"quiet","type":"test"}"#,
    ]);
    eventually(
        Duration::from_secs(5),
        "the unannounced task to run",
        || (dir.records().runs_of("quiet") == 1, ()),
    );
    // idle_poll is 200 ms; Redis rounds blocking timeouts up to its 100 ms tick. Generous slack for a busy host.
    assert!(
        pushed.elapsed() < Duration::from_secs(2),
        "picked up after {:?}",
        pushed.elapsed()
    );
    daemon.stop();
}

#[test]
fn unknown_envelope_fields_survive_a_retry_into_the_dead_letter_record() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queue =
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nretry_times = 1\nbackoff = \"10ms\"\n";
    let config = dir.config(&redis, queue);
    let daemon = TestDaemon::start(&config);
    let envelope = r#"{"id":"keep","type":"test","data":{"outcome":"retry","n":12345678901234567890},"trace":{"span":[1,2]}}"#;
    let _: i64 = redis.cmd(&["RPUSH", "kmq:{jobs}:ready:normal", envelope]);
    let _: i64 = redis.cmd(&["LPUSH", "kmq:{jobs}:wake", "1"]);
    let records: Vec<String> = eventually(
        Duration::from_secs(10),
        "the task to be dead-lettered",
        || {
            let dead: Vec<String> = redis.cmd(&["LRANGE", "kmq:{jobs}:dead", "0", "-1"]);
            (dead.len() == 1, dead)
        },
    );
    let record: serde_json::Value = serde_json::from_str(&records[0]).unwrap();
    let task = record["task"].as_str().unwrap();
    assert!(
        task.contains(r#""trace":{"span":[1,2]}"#),
        "unknown field kept byte for byte: {task}"
    );
    assert!(
        task.contains("12345678901234567890"),
        "big integers in data are not rounded: {task}"
    );
    assert!(task.contains(r#""attempt":1"#), "{task}");
    assert_eq!(
        record["reason"],
        "testkit: asked to retry; no retries left after 2 runs"
    );
    daemon.stop();
}

/// A payload that is not UTF-8 (here: with a 0xFF byte) taken in the middle of a batch must come back whole, be
/// dead-lettered, and leave its neighbours intact.
#[test]
fn a_payload_that_is_not_utf8_is_dead_lettered_and_its_neighbours_run() {
    for mode in ["safe", "default"] {
        let redis = RedisServer::start();
        let dir = TestDir::new();
        let queue =
            format!("[[queues]]\nname = \"jobs\"\nmode = \"{mode}\"\nworkers = 2\nbatch = 10\n");
        let config = dir.config(&redis, &queue);
        let mut connection = redis.connection();
        let mut pipe = redis::pipe();
        for i in 0..5 {
            pipe.cmd("RPUSH")
                .arg("kmq:{jobs}:ready:normal")
                .arg(format!(r#"{{"id":"n{i}","type":"test"}}"#));
        }
        pipe.cmd("RPUSH")
            .arg("kmq:{jobs}:ready:normal")
            .arg(&b"{\"id\":\"bad\",\"type\":\"t\xff\"}"[..]);
        for i in 5..10 {
            pipe.cmd("RPUSH")
                .arg("kmq:{jobs}:ready:normal")
                .arg(format!(r#"{{"id":"n{i}","type":"test"}}"#));
        }
        pipe.exec(&mut connection).unwrap();
        let daemon = TestDaemon::start(&config);
        let s = eventually(Duration::from_secs(10), "the batch to be settled", || {
            let s = stats(&config, "jobs");
            (s.done + s.dead_lettered == 11, s)
        });
        daemon.stop();
        assert_eq!((s.done, s.dead_lettered), (10, 1), "{mode}: {s:?}");
        let dead: Vec<String> = redis.cmd(&["LRANGE", "kmq:{jobs}:dead", "0", "-1"]);
        let record: serde_json::Value = serde_json::from_str(&dead[0]).unwrap();
        assert_eq!(
            record["reason"],
            "malformed task: not UTF-8 text (invalid byte 0xff at offset 21); an envelope is a UTF-8 JSON object",
            "{mode}: {record}"
        );
        assert_eq!(record["id"], "bad", "{mode}: found by its id: {record}");
        let kept = base64::engine::general_purpose::STANDARD
            .decode(record["task_base64"].as_str().unwrap())
            .unwrap();
        assert_eq!(
            kept, b"{\"id\":\"bad\",\"type\":\"t\xff\"}",
            "{mode}: its exact bytes: {record}"
        );
        let records = dir.records();
        assert!(
            (0..10).all(|i| records.runs_of(&format!("n{i}")) == 1),
            "{mode}: {records:?}"
        );
    }
}

/// A payload over `max_task_bytes` is dead-lettered unrun, kept whole with its size; in safe mode it never even
/// leaves Redis (the claim dead-letters it).
#[test]
fn a_task_over_max_task_bytes_is_dead_lettered_unrun_with_its_size() {
    for mode in ["safe", "default"] {
        let redis = RedisServer::start();
        let dir = TestDir::new();
        let queue =
            format!("[[queues]]\nname = \"jobs\"\nmode = \"{mode}\"\nmax_task_bytes = 1024\n");
        let config = dir.config(&redis, &queue);
        let big = format!(
            r#"{{"id":"big","type":"test","data":"{}"}}"#,
            "x".repeat(2000)
        );
        let _: i64 = redis.cmd(&["RPUSH", "kmq:{jobs}:ready:normal", &big]);
        let _: i64 = redis.cmd(&[
            "RPUSH",
            "kmq:{jobs}:ready:normal",
            r#"{"id":"small","type":"test"}"#,
        ]);
        let daemon = TestDaemon::start(&config);
        let s = eventually(Duration::from_secs(10), "both to be settled", || {
            let s = stats(&config, "jobs");
            (s.done == 1 && s.dead == 1, s)
        });
        daemon.stop();
        assert_eq!(s.dead_lettered, 1, "{mode}: {s:?}");
        let dead: Vec<String> = redis.cmd(&["LRANGE", "kmq:{jobs}:dead", "0", "-1"]);
        let record: serde_json::Value = serde_json::from_str(&dead[0]).unwrap();
        let reason = record["reason"].as_str().unwrap();
        assert!(
            reason.starts_with(&format!(
                "task is {} bytes, more than max_task_bytes (1024)",
                big.len()
            )),
            "{mode}: {record}"
        );
        assert_eq!(record["task"], big.as_str(), "{mode}: kept whole");
        let records = dir.records();
        assert_eq!(
            (records.runs_of("big"), records.runs_of("small")),
            (0, 1),
            "{mode}"
        );
    }
}

/// Review L13: claim.lua wrote an oversized payload into its dead record with cjson, which passes bytes through,
/// so the record of a payload that is not UTF-8 was not UTF-8 either: no reader could parse it (`dead list`
/// showed no fields, `dead requeue` and `purge` could not find it by its id). Each payload here is over
/// max_task_bytes and ends with a byte sequence that UTF-8 allows or refuses (overlong forms, surrogates, past
/// U+10FFFF, cut short), or with the quotes and control bytes JSON escapes: every record must parse, and keep the
/// payload's exact bytes as `task` exactly when Rust finds them UTF-8, as `task_base64` otherwise, as the
/// daemon's own records do.
#[test]
fn an_oversized_payload_is_dead_lettered_in_a_valid_record_whatever_its_bytes() {
    let tails: &[&[u8]] = &[
        b"",
        "é€𝄞\u{7ff}\u{800}\u{d7ff}\u{e000}\u{ffff}\u{10000}\u{10ffff}".as_bytes(),
        b"\"quoted\" \\ back\\slash \x00\x01\x1f\x7f\t\n\r/",
        b"\x80",
        b"\xc0\x80",
        b"\xc1\xbf",
        b"\xc2",
        b"\xc3\x41",
        b"\xe0\x9f\xbf",
        b"\xe2\x82",
        b"\xed\xa0\x80",
        b"\xef\xbf",
        b"\xf0\x8f\xbf\xbf",
        b"\xf0\x9d\x84",
        b"\xf4\x90\x80\x80",
        b"\xf5\x80\x80\x80",
        b"\xff",
        b"\xff\xfe",
        b"\xfe\xff\x00",
    ];
    let mut payloads: Vec<Vec<u8>> = tails
        .iter()
        .map(|tail| [&b"x".repeat(1100)[..], tail].concat())
        .collect();
    // The script reads 4,096 bytes at a time from the first that is not ASCII: characters across that boundary,
    // whole or cut, and text of many such chunks, with a bad byte deep inside or none.
    for across in [
        "€".as_bytes(),
        "𝄞".as_bytes(),
        b"\xe2\x82x",
        b"\xf0\x9d\x84x",
    ] {
        payloads.push(
            [
                &b"x".repeat(1100)[..],
                "é".as_bytes(),
                &b"x".repeat(4093)[..],
                across,
            ]
            .concat(),
        );
    }
    payloads.push("é".repeat(5000).into_bytes());
    payloads.push(
        [
            "é".repeat(5000).as_bytes(),
            b"\xff",
            "é".repeat(10).as_bytes(),
        ]
        .concat(),
    );
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &SAFE_QUEUE.replace("workers = 2", "workers = 2\nmax_task_bytes = 1024"),
    );
    let mut connection = redis.connection();
    let mut pipe = redis::pipe();
    for payload in &payloads {
        pipe.cmd("RPUSH")
            .arg("kmq:{jobs}:ready:normal")
            .arg(payload.as_slice());
    }
    pipe.exec(&mut connection).unwrap();
    let daemon = TestDaemon::start(&config);
    eventually(Duration::from_secs(10), "every payload dead", || {
        let s = stats(&config, "jobs");
        (s.dead as usize == payloads.len(), s)
    });
    daemon.stop();
    let dead: Vec<Vec<u8>> = redis::cmd("LRANGE")
        .arg("kmq:{jobs}:dead")
        .arg(0)
        .arg(-1)
        .query(&mut connection)
        .unwrap();
    let mut kept: Vec<Vec<u8>> = dead
        .iter()
        .map(|raw| {
            let record: serde_json::Value = serde_json::from_slice(raw)
                .unwrap_or_else(|error| panic!("{error}: {}", String::from_utf8_lossy(raw)));
            let bytes = match (record.get("task"), record.get("task_base64")) {
                (Some(task), None) => task.as_str().unwrap().as_bytes().to_vec(),
                (None, Some(encoded)) => {
                    let bytes = base64::engine::general_purpose::STANDARD
                        .decode(encoded.as_str().unwrap())
                        .unwrap();
                    assert!(
                        std::str::from_utf8(&bytes).is_err(),
                        "UTF-8, kept in base64: {record}"
                    );
                    bytes
                }
                _ => panic!("the payload is kept once: {record}"),
            };
            assert_eq!(record["size"], bytes.len(), "{record}");
            bytes
        })
        .collect();
    let mut pushed = payloads.clone();
    kept.sort();
    pushed.sort();
    assert!(kept == pushed, "each payload kept byte for byte");
}

/// A grouped task pushed with the published script and the routes key, as documented under "Groups", waits in its
/// group's flow (not the ready list) and runs.
#[test]
fn a_grouped_task_pushed_as_documented_waits_in_its_groups_flow_and_runs() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &format!("{MAIL}[queues.groups]\n"));
    let daemon = TestDaemon::start(&config);
    eventually(Duration::from_secs(10), "the daemon routes groups", || {
        let routes: Option<String> = redis.cmd(&["HGET", "kmq:{mail}:routes", "groups"]);
        (routes.as_deref() == Some("1"), routes)
    });
    kmqd_ok(&config, &["group", "pause", "mail", "tenant-42"]);
    run_documented(&documented_block(3), &redis);
    let (flow, ready): (u64, u64) = (
        redis.cmd(&["LLEN", "kmq:{mail}:flow:normal:tenant-42:"]),
        redis.cmd(&["LLEN", "kmq:{mail}:ready:normal"]),
    );
    assert_eq!((flow, ready), (1, 0), "the task waits in its group's flow");
    kmqd_ok(&config, &["group", "resume", "mail", "tenant-42"]);
    eventually(Duration::from_secs(10), "the task done", || {
        let stats = stats(&config, "mail");
        (stats.done == 1, stats)
    });
    assert_eq!(dir.records().runs_of("order-43"), 1);
    daemon.stop();
}
