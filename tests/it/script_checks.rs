//! Every script checks before it writes (ARCHITECTURE.md, "Invariants"): a key of the wrong type or a counter that
//! is not an integer makes a script answer an error having written nothing, because the daemon takes an error
//! reply for "did not run" (a claim is then neither adopted nor dispatched, a settle is sent again, a producer
//! pushes again). The table test drives real operations through a proxy that records each script call with the
//! database as it was just before, then replays every call with each of its keys replaced by a key of another
//! type, and each counter of its hashes replaced by `1.5`; the regression tests run the review's sequences
//! (docs/reviews, M1 and L1) through the real daemon.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kmqd::NewTask;
use kmqd::broker::{PUSH_SCRIPT, sources};
use kmqd::client::DeadSelection;

use crate::support::proxy::{AfterDrop, Fault, FaultProxy, Matcher};
use crate::support::*;

/// Every key of a database: its type, its DUMP (to put it back), whether it expires, and what it holds (to compare:
/// a DUMP is not, since a read of a hash whose table is being resized moves the resize on, which reorders its
/// DUMP: a hash of nine fields RESTOREd, then read with HGET, dumps other bytes, and the test once blamed
/// flow_apply.lua's refusal for a write it never made).
type Snapshot = BTreeMap<Vec<u8>, Stored>;

/// One key of a [`Snapshot`].
#[derive(Debug)]
struct Stored {
    kind: String,
    dump: Vec<u8>,
    expires: bool,
    content: Vec<Vec<u8>>,
}

impl PartialEq for Stored {
    /// Type, expiry and content: not the DUMP's bytes.
    fn eq(&self, other: &Stored) -> bool {
        self.kind == other.kind && self.expires == other.expires && self.content == other.content
    }
}

/// A script call as the proxy saw it (EVALSHA or EVAL, name first), and the database just before it.
struct Recorded {
    script: &'static str,
    args: Vec<Vec<u8>>,
    before: Snapshot,
}

/// kmqd's scripts that write, by name (access.lua writes nothing and touches no key).
fn scripts() -> Vec<(&'static str, &'static str)> {
    sources::ALL
        .into_iter()
        .filter(|(name, _)| *name != "access.lua")
        .collect()
}

/// The script a command runs, if it is one of [`scripts`].
fn script_of(
    args: &[Vec<u8>],
    by_sha: &HashMap<String, &'static str>,
    by_body: &HashMap<Vec<u8>, &'static str>,
) -> Option<&'static str> {
    let (name, first) = (args.first()?, args.get(1)?);
    if name.eq_ignore_ascii_case(b"EVALSHA") {
        by_sha
            .get(&String::from_utf8_lossy(first).to_ascii_lowercase())
            .copied()
    } else if name.eq_ignore_ascii_case(b"EVAL") {
        by_body.get(first).copied()
    } else {
        None
    }
}

/// The shape of a call: its script, how many keys, and each argument's kind (small words, such as settle's ops,
/// as they are; numbers as 0, 1 or n; anything else as s). One call of each shape is replayed.
fn shape(script: &str, args: &[Vec<u8>]) -> String {
    let mut shape = script.to_string();
    for arg in &args[2..] {
        let class = match std::str::from_utf8(arg) {
            Ok(text @ ("0" | "1")) => text.to_string(),
            Ok(text) if text.parse::<i64>().is_ok() => "n".to_string(),
            Ok(text)
                if !text.is_empty()
                    && text.len() <= 16
                    && text.chars().all(|c| c.is_ascii_lowercase() || c == '_') =>
            {
                text.to_string()
            }
            _ => "s".to_string(),
        };
        shape.push(' ');
        shape.push_str(&class);
    }
    shape
}

fn snapshot(conn: &mut redis::Connection) -> Snapshot {
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("*").query(conn).unwrap();
    if keys.is_empty() {
        return Snapshot::new();
    }
    let mut pipe = redis::pipe();
    for key in &keys {
        pipe.cmd("TYPE")
            .arg(key)
            .cmd("DUMP")
            .arg(key)
            .cmd("PTTL")
            .arg(key);
    }
    let values: Vec<redis::Value> = pipe.query(conn).unwrap();
    let mut stored: Vec<(Vec<u8>, Stored)> = keys
        .into_iter()
        .zip(values.chunks(3))
        .map(|(key, v)| {
            let kind: String = redis::from_redis_value(v[0].clone()).unwrap();
            let dump: Vec<u8> = redis::from_redis_value(v[1].clone()).unwrap_or_default();
            let ttl: i64 = redis::from_redis_value(v[2].clone()).unwrap();
            let stored = Stored {
                kind,
                dump,
                expires: ttl >= 0,
                content: Vec::new(),
            };
            (key, stored)
        })
        // A key gone between KEYS and DUMP (another client's write, while the proxy records).
        .filter(|(_, stored)| stored.kind != "none" && !stored.dump.is_empty())
        .collect();
    // What each key holds, read by its type, in an order its encoding does not decide: a hash's pairs and a
    // set's members sorted, a list's and a sorted set's (with their scores) in their order.
    let mut pipe = redis::pipe();
    for (key, stored) in &stored {
        match stored.kind.as_str() {
            "string" => pipe.cmd("GET").arg(key),
            "list" => pipe.cmd("LRANGE").arg(key).arg(0).arg(-1),
            "zset" => pipe.cmd("ZRANGE").arg(key).arg(0).arg(-1).arg("WITHSCORES"),
            "hash" => pipe.cmd("HGETALL").arg(key),
            "set" => pipe.cmd("SMEMBERS").arg(key),
            _ => pipe.cmd("ECHO").arg(""),
        };
    }
    let contents: Vec<redis::Value> = pipe.query(conn).unwrap();
    for ((_, stored), value) in stored.iter_mut().zip(contents) {
        stored.content = match value {
            redis::Value::BulkString(bytes) => vec![bytes],
            redis::Value::Array(items) => items
                .into_iter()
                .map(|item| redis::from_redis_value(item).unwrap_or_default())
                .collect(),
            _ => Vec::new(),
        };
        if stored.kind == "hash" {
            let mut pairs: Vec<&[Vec<u8>]> = stored.content.chunks(2).collect();
            pairs.sort();
            stored.content = pairs.concat();
        } else if stored.kind == "set" {
            stored.content.sort();
        }
    }
    stored.into_iter().collect()
}

/// Puts the database back as `snapshot` was, every live lease (an owner's score above 0) a minute from now, so
/// that a claim or settle replayed later finds its owner alive.
fn restore(conn: &mut redis::Connection, snapshot: &Snapshot) {
    let _: () = redis::cmd("FLUSHALL").query(conn).unwrap();
    let (seconds, _): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
    let mut pipe = redis::pipe();
    for (key, stored) in snapshot {
        pipe.cmd("RESTORE")
            .arg(key)
            .arg(0)
            .arg(&stored.dump)
            .ignore();
    }
    if !snapshot.is_empty() {
        let _: () = pipe.query(conn).unwrap();
    }
    for (key, stored) in snapshot {
        if stored.kind == "zset" && key.ends_with(b":owners") {
            let owners: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
                .arg(key)
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES")
                .query(conn)
                .unwrap();
            for (owner, score) in owners {
                if score > 0.0 {
                    let _: i64 = redis::cmd("ZADD")
                        .arg(key)
                        .arg((seconds + 60) * 1000)
                        .arg(&owner)
                        .query(conn)
                        .unwrap();
                }
            }
        }
    }
}

/// What a replay does to one key before it runs.
#[derive(Clone, Debug)]
enum Mutation {
    /// The key becomes a value of this type.
    Type(&'static str),
    /// The hash's field becomes `1.5`.
    Counter(String),
}

/// The counters kmqd's scripts increment or read as numbers.
const COUNTERS: &[&str] = &[
    "pushed",
    "done",
    "retried",
    "recovered",
    "failed",
    "dead_lettered",
    "cancelled",
    "requeued",
    "purged",
    "moved",
    "journal",
    "floor",
];

fn mutations(conn: &mut redis::Connection, key: &[u8], before: &Snapshot) -> Vec<Mutation> {
    let current = before
        .get(key)
        .map_or("none", |stored| stored.kind.as_str());
    let mut all: Vec<Mutation> = ["string", "list", "hash", "zset"]
        .into_iter()
        .filter(|kind| *kind != current)
        .map(Mutation::Type)
        .collect();
    if current == "hash" || (current == "none" && key.ends_with(b":stats")) {
        let mut fields: BTreeSet<String> = COUNTERS.iter().map(|c| c.to_string()).collect();
        if current == "hash" {
            let hash: Vec<(String, String)> = redis::cmd("HGETALL").arg(key).query(conn).unwrap();
            if hash.len() <= 32 {
                fields.extend(
                    hash.into_iter()
                        .filter(|(_, value)| value.parse::<i64>().is_ok())
                        .map(|(field, _)| field),
                );
            }
        }
        all.extend(fields.into_iter().map(Mutation::Counter));
    }
    all
}

fn mutate(conn: &mut redis::Connection, key: &[u8], mutation: &Mutation) {
    match mutation {
        Mutation::Type(kind) => {
            let _: i64 = redis::cmd("DEL").arg(key).query(conn).unwrap();
            let mut command = match *kind {
                "string" => redis::cmd("SET"),
                "list" => redis::cmd("RPUSH"),
                "hash" => redis::cmd("HSET"),
                _ => redis::cmd("ZADD"),
            };
            match *kind {
                "string" | "list" => command.arg(key).arg("x"),
                _ => command.arg(key).arg("1").arg("x"),
            };
            let _: redis::Value = command.query(conn).unwrap();
        }
        Mutation::Counter(field) => {
            let _: i64 = redis::cmd("HSET")
                .arg(key)
                .arg(field)
                .arg("1.5")
                .query(conn)
                .unwrap();
        }
    }
}

fn show(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    if text.chars().count() > 80 {
        format!("{}...", text.chars().take(80).collect::<String>())
    } else {
        text.into_owned()
    }
}

/// The keys whose type, content or expiry differ.
fn changed(a: &Snapshot, b: &Snapshot) -> Vec<String> {
    let keys: BTreeSet<&Vec<u8>> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|key| a.get(*key) != b.get(*key))
        .map(|key| show(key))
        .collect()
}

/// Drives real operations of both modes through a proxy that records each script call of a new shape with the
/// database just before it: pushes (plain, delayed, unique, oversized), a safe daemon's register, claims (one
/// whose reply is lost: adopt), settles (acks, retries now and later, dead letters), renewals, promotions, the
/// source mover, a schedule, the history, a default-mode daemon's pops of unique tasks and plain pops, cancels,
/// dead requeue and purge, and the stop (drain, release).
fn record_calls() -> (RedisServer, Vec<Recorded>) {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let queues = "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 2\nlease_timeout = \"3s\"\n\
                  max_task_bytes = 1024\nretry_times = 1\nbackoff = \"10ms\"\nsource_lists = [\"queue:src\"]\n\n\
                  [[queues]]\nname = \"fast\"\nmode = \"default\"\nworkers = 2\nlease_timeout = \"3s\"\n\
                  retry_times = 1\nbackoff = \"10ms\"\nrate_limit = \"1000/s\"\nmax_running = 4\n\n\
                  [[queues]]\nname = \"limited\"\nmode = \"safe\"\nworkers = 2\nmax_running = 2\n\
                  rate_limit = [\"50/s\", \"1000/m\"]\nretry_times = 1\nbackoff = \"10ms\"\nkeep_results = \"1h\"\n\n\
                  [[queues]]\nname = \"plain\"\nmode = \"default\"\nworkers = 2\nbatch = 40\n\n\
                  [[queues]]\nname = \"typed\"\nmode = \"safe\"\nworkers = 2\nmax_running = 2\n\
                  retry_times = 1\nbackoff = \"10ms\"\n\
                  [[queues.limits]]\ntype = \"test\"\nmax_running = 1\nrate_limit = \"50/s\"\n\n\
                  [[queues]]\nname = \"dtyped\"\nmode = \"default\"\nworkers = 2\nmax_running = 2\n\
                  retry_times = 1\nbackoff = \"10ms\"\n\
                  [[queues.limits]]\ntype = \"test\"\nmax_running = 1\nrate_limit = \"50/s\"\n\n\
                  [[queues]]\nname = \"grouped\"\nmode = \"safe\"\nworkers = 2\nretry_times = 1\n\
                  backoff = \"10ms\"\n[queues.groups]\nmax_running = 1\nrate_limit = \"50/s\"\n\
                  weights = { \"b\" = 2 }\n\n\
                  [[schedules]]\nname = \"tick\"\nqueue = \"jobs\"\ntype = \"test\"\nevery = \"1s\"\n";
    let config = dir.config_for_url(&proxy.url(), "shutdown_grace = \"5s\"", queues);

    let by_sha: HashMap<String, &'static str> = scripts()
        .into_iter()
        .map(|(name, body)| (redis::Script::new(body).get_hash().to_string(), name))
        .collect();
    let by_body: HashMap<Vec<u8>, &'static str> = scripts()
        .into_iter()
        .map(|(name, body)| (body.as_bytes().to_vec(), name))
        .collect();
    let recorded: Arc<Mutex<Vec<Recorded>>> = Arc::default();
    {
        let recorded = Arc::clone(&recorded);
        let shapes: Mutex<HashMap<String, usize>> = Mutex::default();
        let looker = Mutex::new(
            redis::Client::open(redis.url())
                .unwrap()
                .get_connection()
                .unwrap(),
        );
        proxy.observe(move |args| {
            let Some(script) = script_of(args, &by_sha, &by_body) else {
                return;
            };
            let mut shapes = shapes.lock().unwrap();
            let seen = shapes.len();
            let per_script = shapes.keys().filter(|s| s.starts_with(script)).count();
            let mut shape = shape(script, args);
            // The grouped queue's calls have the typed queue's shapes: each is recorded for its own.
            if args.iter().any(|arg| arg.starts_with(b"kmq:{grouped}")) {
                shape.insert_str(0, "grouped ");
            }
            // A handler's throttle is rare in a run, and the type-limited queue's calls come last: their calls
            // are recorded whatever came before them.
            let throttle = args.iter().any(|arg| arg.as_slice() == b"throttle");
            let typed = args.iter().any(|arg| {
                arg.starts_with(b"kmq:{typed}")
                    || arg.starts_with(b"kmq:{dtyped}")
                    || arg.starts_with(b"kmq:{grouped}")
            });
            // So are settles that keep results (results.lua's trailer, the limited queue's), and those that write
            // a flow's notes (after.lua's trailer).
            let kept = args
                .iter()
                .any(|arg| arg.as_slice() == b"results" || arg.as_slice() == b"notes");
            // And a debounced push (push.lua's replacement of a delayed task), which comes after many pushes.
            let debounced = args.iter().any(|arg| arg.as_slice() == b"debounce");
            // And the settle that hands its freed slots over (handover.lua's trailer), made last.
            let handover = args.iter().any(|arg| arg.as_slice() == b"handover");
            if shapes.contains_key(&shape)
                || (per_script >= 8 && !throttle && !typed && !kept && !debounced && !handover)
            {
                return;
            }
            shapes.insert(shape, seen);
            let before = snapshot(&mut looker.lock().unwrap());
            recorded.lock().unwrap().push(Recorded {
                script,
                args: args.to_vec(),
                before,
            });
        });
    }

    let client = client(&config);
    let test = |data: &str, id: &str| NewTask::new("test", data).unwrap().id(id);
    let mut jobs: Vec<NewTask> = (0..20).map(|i| test("7", &format!("plain-{i}"))).collect();
    jobs.push(test(r#"{"fail_attempts":1}"#, "retry-now"));
    jobs.push(test(
        r#"{"fail_attempts":1,"retry_after_ms":300}"#,
        "retry-later",
    ));
    jobs.push(test(r#"{"outcome":"fail"}"#, "failing"));
    let throttle_once = |name: &str| {
        serde_json::json!({ "throttle_once": dir.path(name), "throttle_ms": 50 }).to_string()
    };
    jobs.push(test(&throttle_once("jobs-throttle"), "throttled"));
    jobs.push(NewTask::new("nobody", "{}").unwrap().id("unknown"));
    jobs.push(test("7", "unique-1").unique());
    jobs.push(test("7", "cancelled-ready"));
    // A handler that reports progress while it runs (progress.lua, flushed by the acker a quarter second apart).
    jobs.push(test(
        r#"{"progress": [0.5, "half way"], "sleep_ms": 600}"#,
        "progressing",
    ));
    client.push_batch("jobs", jobs).unwrap();
    client
        .push("jobs", test("7", "soon").delay(Duration::from_millis(300)))
        .unwrap();
    client
        .push("jobs", test("7", "never").delay(Duration::from_secs(3600)))
        .unwrap();
    // A debounced push that finds the delayed task of its id and replaces it (recorded with that task there).
    client
        .push(
            "jobs",
            test("7", "debounced").delay(Duration::from_secs(3600)),
        )
        .unwrap();
    client
        .push(
            "jobs",
            test("8", "debounced").debounce(Duration::from_secs(3600)),
        )
        .unwrap();
    client
        .push(
            "jobs",
            test(&format!("\"{}\"", "x".repeat(2000)), "oversized"),
        )
        .unwrap();
    assert_eq!(client.cancel("jobs", "never").unwrap(), 1);
    assert_eq!(client.cancel("jobs", "debounced").unwrap(), 1);
    assert_eq!(client.cancel("jobs", "cancelled-ready").unwrap(), 1);
    let fast: Vec<NewTask> = (0..10)
        .map(|i| test("7", &format!("fast-{i}")).unique())
        .chain([test(r#"{"fail_attempts":1}"#, "fast-retry")])
        .chain([test(&throttle_once("fast-throttle"), "fast-throttled")])
        .collect();
    client.push_batch("fast", fast).unwrap();
    let limited: Vec<NewTask> = (0..8)
        .map(|i| test("7", &format!("limited-{i}")))
        .chain([test(r#"{"fail_attempts":1}"#, "limited-retry")])
        .chain([test(
            &throttle_once("limited-throttle"),
            "limited-throttled",
        )])
        .collect();
    client.push_batch("limited", limited).unwrap();
    // Tasks of the limited type behind one another, and of a type it does not limit (unknown here: retried, then
    // dead-lettered), so that claims (and, in default mode, pops) move some to the type's flow and take from it;
    // settles give default mode's owner's share of the type's count back.
    for queue in ["typed", "dtyped"] {
        let typed: Vec<NewTask> = (0..8)
            .map(|i| test("7", &format!("{queue}-{i}")))
            .chain([test(r#"{"fail_attempts":1}"#, &format!("{queue}-retry"))])
            .chain([test(
                &throttle_once(&format!("{queue}-throttle")),
                &format!("{queue}-throttled"),
            )])
            .chain((0..3).map(|i| {
                NewTask::new("other", "{}")
                    .unwrap()
                    .id(format!("{queue}-other-{i}"))
            }))
            .collect();
        client.push_batch(queue, typed).unwrap();
    }
    // Two groups at their limit behind one another, a retry and a throttle of a group, a task pushed by plain
    // RPUSH (the claim's intake routes it), and a paused group resumed (group_resume.lua).
    let grouped: Vec<NewTask> = (0..6)
        .map(|i| test("7", &format!("grouped-{i}")).group(["a", "b"][i % 2]))
        .chain([test(r#"{"fail_attempts":1}"#, "grouped-retry").group("a")])
        .chain([test(&throttle_once("grouped-throttle"), "grouped-throttled").group("b")])
        .collect();
    client.push_batch("grouped", grouped).unwrap();
    let _: i64 = redis.cmd(&[
        "RPUSH",
        "kmq:{grouped}:ready:normal",
        r#"{"type":"test","data":7,"id":"grouped-rpush","group":"c"}"#,
    ]);
    assert!(client.pause_group("grouped", "c").unwrap());
    // A default-mode queue without limits or unique ids: its pops after the first full one are plain (take.lua).
    let plain: Vec<NewTask> = (0..100).map(|i| test("7", &format!("plain-{i}"))).collect();
    client.push_batch("plain", plain).unwrap();
    // A flow across a safe-mode and a default-mode queue: flow_push.lua writes the waiters; the settles of the
    // parts write notes (after.lua), which the delay pollers apply (flow_apply.lua) and remove (flow_outbox.lua);
    // `flow-failed` waits for a part that fails, and is dead-lettered unrun.
    client
        .push_flow(
            r#"{"queue": "fast", "type": "test", "id": "flow-root", "data": 7,
                "after": [{"queue": "jobs", "type": "test", "id": "flow-part", "data": 7},
                          {"queue": "jobs", "type": "test", "id": "flow-mid", "data": 7,
                           "after": [{"queue": "fast", "type": "test", "id": "flow-leaf", "data": 7}]}]}"#,
        )
        .unwrap();
    client
        .push_flow(
            r#"{"queue": "jobs", "type": "test", "id": "flow-failed", "data": 7,
                "after": [{"queue": "fast", "type": "test", "id": "flow-bad", "data": {"outcome": "fail"}}]}"#,
        )
        .unwrap();
    for i in 0..5 {
        let _: i64 = redis.cmd(&[
            "RPUSH",
            "queue:src",
            &format!(r#"{{"type":"test","data":7,"id":"src-{i}"}}"#),
        ]);
    }

    // The second claim's reply is lost: the daemon adopts it.
    proxy.add(Fault::DropReply {
        matching: Matcher::claims(),
        nth: 2,
        then: AfterDrop::Close,
    });
    let daemon = TestDaemon::start(&config);
    eventually(Duration::from_secs(30), "both queues drained", || {
        let (jobs, fast) = (stats(&config, "jobs"), stats(&config, "fast"));
        let (limited, typed) = (stats(&config, "limited"), stats(&config, "typed"));
        let plain = stats(&config, "plain");
        let grouped = stats(&config, "grouped");
        let dtyped = stats(&config, "dtyped");
        (
            jobs.ready + jobs.delayed + jobs.processing + fast.ready + fast.delayed == 0
                && jobs.dead >= 3
                && fast.done >= 12
                && limited.done >= 10
                && typed.done >= 10
                && typed.dead >= 3
                && plain.done == 100
                && grouped.done >= 8
                && dtyped.done >= 10
                && dtyped.dead >= 3,
            (jobs, fast, limited, typed, plain, grouped, dtyped),
        )
    });
    client
        .dead_requeue("jobs", DeadSelection::Ids(&["failing"]), true)
        .unwrap();
    client
        .dead_purge("jobs", DeadSelection::Ids(&["unknown"]))
        .unwrap();
    // Pushed once the daemon routes: to the groups' flows (push.lua's routed path); then the paused group resumed.
    let routed: Vec<NewTask> = (0..2)
        .map(|i| test("7", &format!("grouped-routed-{i}")).group("a"))
        .collect();
    client.push_batch("grouped", routed).unwrap();
    assert!(client.resume_group("grouped", "c").unwrap());
    eventually(Duration::from_secs(20), "the grouped queue drained", || {
        let grouped = stats(&config, "grouped");
        (grouped.done >= 11, grouped)
    });
    eventually(
        Duration::from_secs(20),
        "the flows released and failed",
        || {
            let root: Option<String> = redis.cmd(&["HGET", "kmq:{fast}:deps:flow-root", "state"]);
            let failed: Option<String> =
                redis.cmd(&["HGET", "kmq:{jobs}:deps:flow-failed", "state"]);
            (
                root.as_deref() == Some("released") && failed.as_deref() == Some("dead"),
                (root, failed),
            )
        },
    );
    eventually(
        Duration::from_secs(20),
        "a schedule fired and a lease renewed",
        || {
            let fired = proxy.seen(&Matcher::script(sources::FIRE));
            let renewed = proxy.seen(&Matcher::script(sources::RENEW));
            (fired > 0 && renewed > 1, (fired, renewed))
        },
    );
    // A grouped task still running at the stop: handed back to the head of its group's flow once shutdown_grace
    // runs out (settle.lua's op "back" with a group's scope).
    client
        .push_batch(
            "grouped",
            [test(r#"{"until_cancelled":true}"#, "grouped-back").group("a")],
        )
        .unwrap();
    eventually(Duration::from_secs(20), "the grouped task running", || {
        let started = dir.records().runs_of("grouped-back");
        (started == 1, started)
    });
    daemon.stop();
    handover_through(&proxy, &config);
    let recorded = std::mem::take(&mut *recorded.lock().unwrap());
    for (script, key) in [
        ("claim.lua", ":rate:q:"),
        ("pop.lua", ":rate:q:"),
        ("pop.lua", ":popped-running:"),
        ("settle.lua", ":popped-running:"),
        ("settle.lua", ":scopes"),
        ("claim.lua", ":flow:normal::test"),
        ("claim.lua", ":rate:t:test:"),
        ("settle.lua", "kmq:{typed}:processing"),
        ("settle.lua", ":throttle:t:test"),
        ("claim.lua", ":throttle:t:test"),
        ("claim.lua", "kmq:{grouped}:ring:"),
        ("settle.lua", ":throttle:g:b"),
        ("pop.lua", "kmq:{dtyped}:flow:normal::test"),
        ("pop.lua", "kmq:{dtyped}:rate:t:test:"),
        ("settle.lua", "kmq:{dtyped}:popped-running:"),
        ("settle.lua", "kmq:{dtyped}:throttle:t:test"),
        ("push.lua", "kmq:{grouped}:routes"),
        ("settle.lua", "kmq:{grouped}:flow:normal:a:"),
        ("group_resume.lua", ":hold:g:c"),
        ("settle.lua", "kmq:{jobs}:deps-outbox"),
        ("settle.lua", "kmq:{fast}:deps-outbox"),
        ("flow_apply.lua", ":deps:flow-"),
        ("flow_apply.lua", "kmq:{jobs}:deps:flow-failed"),
        ("flow_outbox.lua", ":deps-outbox"),
        ("settle.lua", "handover"),
    ] {
        let named = |call: &Recorded| {
            call.script == script
                && call
                    .args
                    .iter()
                    .any(|arg| String::from_utf8_lossy(arg).contains(key))
        };
        assert!(
            recorded.iter().any(named),
            "a call of {script} with a key of a limited queue ({key}) is recorded"
        );
    }
    for queue in ["jobs", "fast", "limited"] {
        assert!(
            recorded.iter().any(|call| call.script == "settle.lua"
                && call.args.iter().any(|arg| arg.as_slice() == b"throttle")
                && call
                    .args
                    .iter()
                    .any(|arg| arg.as_slice() == format!("kmq:{{{queue}}}:throttle:q").as_bytes())),
            "a settle of {queue}'s throttle is recorded"
        );
    }
    (redis, recorded)
}

/// Two settles of the limited queue at its `max_running` that hand the slot they free over to the next task, sent
/// through `proxy` as an acker sends them: one by handover_plain.lua, one by settle.lua with its claim block
/// (handover.lua).
fn handover_through(proxy: &FaultProxy, config: &std::path::Path) {
    let loaded = kmqd::Config::load(config).unwrap();
    let at = loaded
        .queues
        .iter()
        .position(|q| q.name == "limited")
        .unwrap();
    let queue = kmqd::queue::QueueContext::new(&loaded, &loaded.queues[at], "test:0");
    let tasks = (0..3).map(|i| {
        NewTask::new("test", "7")
            .unwrap()
            .id(format!("handover-{i}"))
    });
    client(config).push_batch("limited", tasks).unwrap();
    let mut connection: kmqd::broker::Conn = redis::Client::open(proxy.url())
        .unwrap()
        .get_connection()
        .unwrap()
        .into();
    let owner = "handover.1";
    let batch = crate::safe_mode::dead_daemon_claims(
        &mut connection,
        &queue,
        owner,
        0,
        100,
        Duration::from_secs(60),
    );
    assert_eq!(batch.tasks.len(), 2, "the limit's two");
    let limits = kmqd::broker::ClaimLimits {
        daemon: "test:0",
        ..queue.claim_limits()
    };
    // The first as a daemon whose config has no rate limit for the queue sends it (a rolling change): a plain
    // queue's, which handover_plain.lua is made for; the second by settle.lua with its claim block, as a call that
    // script leaves to settle.lua goes.
    let plain = kmqd::broker::ClaimLimits {
        rate_limit: &[],
        ..limits
    };
    for (number, generic, limits) in [(1, false, &plain), (2, true, &limits)] {
        let settle = match generic {
            true => kmqd::broker::settle_handing_over_generic,
            false => kmqd::broker::settle_handing_over,
        };
        let (_, handed) = settle(
            &mut connection,
            &queue.keys,
            &kmqd::broker::Call {
                settler: "handover-acker",
                number,
            },
            queue.config.dead_max,
            &Arc::from(owner),
            &[crate::safe_mode::settlement_of(
                &batch,
                number as usize - 1,
                kmqd::broker::SettleOp::Ack,
            )],
            &kmqd::broker::Handover {
                claim: 99 + number,
                max: 4,
                limits,
            },
        )
        .unwrap();
        // The first takes the third task for its slot; the second finds none left.
        let handed = handed.map_or(0, |batch| batch.tasks.len());
        assert_eq!(handed, if number == 1 { 1 } else { 0 });
    }
}

/// Replays every recorded call with each of its keys of another type and each counter of its hashes not an
/// integer: the call either succeeds, or answers an error and leaves every key of the database as it was. Catches
/// a script that writes, then fails (claim.lua's LPUSH on a wrong-typed wake key after moving the batch,
/// push.lua's RPUSH before a failing wake or stats key, settle.lua's HINCRBY of a counter `1.5` after applying).
#[test]
fn every_script_that_answers_an_error_wrote_nothing() {
    let (redis, recorded) = record_calls();
    let mut conn = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    for (_, body) in scripts() {
        let _: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(body)
            .query(&mut conn)
            .unwrap();
    }
    let covered: BTreeSet<&str> = recorded.iter().map(|r| r.script).collect();
    let missing: Vec<&str> = scripts()
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| !covered.contains(name) && *name != "release_unique.lua")
        .collect();
    assert!(missing.is_empty(), "no call recorded of {missing:?}");

    let mut failures = Vec::new();
    let mut refused: BTreeMap<&str, usize> = BTreeMap::new();
    let mut replays = 0;
    for call in &recorded {
        let keys: usize = String::from_utf8_lossy(&call.args[2]).parse().unwrap();
        for key in &call.args[3..3 + keys] {
            restore(&mut conn, &call.before);
            for mutation in mutations(&mut conn, key, &call.before) {
                restore(&mut conn, &call.before);
                mutate(&mut conn, key, &mutation);
                let before = snapshot(&mut conn);
                let mut command = redis::cmd(std::str::from_utf8(&call.args[0]).unwrap());
                for arg in &call.args[1..] {
                    command.arg(arg.as_slice());
                }
                let reply: redis::RedisResult<redis::Value> = command.query(&mut conn);
                replays += 1;
                if let Err(error) = reply {
                    *refused.entry(call.script).or_default() += 1;
                    // A refusal for a key's type or a counter names the script and the key.
                    let text = error.to_string();
                    if (text.contains("WRONGTYPE") || text.contains("not an integer"))
                        && !(text.contains(call.script)
                            && text.contains(&*String::from_utf8_lossy(key)))
                    {
                        failures.push(format!(
                            "{} with {} made {mutation:?}: answered \"{}\", which names neither",
                            call.script,
                            show(key),
                            show(text.as_bytes())
                        ));
                    }
                    let after = snapshot(&mut conn);
                    if after != before {
                        failures.push(format!(
                            "{} with {} made {mutation:?}: answered \"{}\" and changed {:?}",
                            call.script,
                            show(key),
                            show(error.to_string().as_bytes()),
                            changed(&before, &after)
                        ));
                    }
                }
            }
        }
    }
    eprintln!(
        "{replays} replays of {} calls; errors answered, by script: {refused:?}",
        recorded.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {replays} replays answered an error after writing, or one that does not name the script and \
         the key:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        refused.len() >= 10,
        "the replays reached the scripts' checks: {refused:?}"
    );
}

/// The tasks in `queue`'s claim lists (safe mode's processing area), read with plain commands: `kmqd stats`
/// refuses a queue whose keys have the wrong type.
fn claimed(redis: &RedisServer, queue: &str) -> i64 {
    let lists: Vec<String> = redis.cmd(&["KEYS", &format!("kmq:{{{queue}}}:processing:*:*")]);
    lists
        .iter()
        .filter(|key| !key.ends_with(":settled"))
        .map(|key| {
            let kind: String = redis.cmd(&["TYPE", key]);
            if kind == "list" {
                redis.cmd::<i64>(&["LLEN", key])
            } else {
                0
            }
        })
        .sum()
}

fn ready(redis: &RedisServer, queue: &str) -> i64 {
    redis.cmd(&["LLEN", &format!("kmq:{{{queue}}}:ready:normal")])
}

/// A safe daemon that reaches Redis through `proxy`, which counts its claims and settles; its log in the dir.
fn daemon_through(
    dir: &TestDir,
    proxy: &FaultProxy,
    queues: &str,
) -> (std::path::PathBuf, Process) {
    let config = dir.config_for_url(&proxy.url(), "shutdown_grace = \"5s\"", queues);
    let daemon = crate::reload::start(dir, &config);
    (config, daemon)
}

/// Waits until the proxy forwarded `n` more calls of `script` than `since`.
fn wait_calls(proxy: &FaultProxy, script: &str, since: usize, n: usize) -> usize {
    eventually(
        Duration::from_secs(20),
        &format!("{n} more calls of a script"),
        || {
            let seen = proxy.seen(&Matcher::script(script));
            (seen >= since + n, seen)
        },
    )
}

/// Review M1: a wake key that is not a list (a third-party producer's SET) under a backlog. Each full claim used
/// to move its batch into the claim lists of the live, renewing owner, then fail at LPUSH wake; the daemon took
/// the error for "did not run" and claimed again, until the whole backlog sat under the lease and nothing ran.
/// Now every claim refuses before it writes, the log names the key, the tasks stay ready, and once the key is
/// fixed each runs once.
#[test]
fn a_wrong_typed_wake_key_strands_no_task_under_a_live_lease() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let queues = safe_queue("batch = 20\nprefetch = 20\nworkers = 2");
    let (config, daemon) = {
        // The backlog first, then the broken key (push.lua would refuse to push beside it).
        let config = dir.config(&redis, &queues);
        push_many(&config, "t", 300, "7");
        let _: i64 = redis.cmd(&["DEL", "kmq:{jobs}:wake"]);
        let _: String = redis.cmd(&["SET", "kmq:{jobs}:wake", "not a list"]);
        daemon_through(&dir, &proxy, &queues)
    };
    wait_calls(&proxy, sources::CLAIM, 0, 5);
    assert_eq!(
        (ready(&redis, "jobs"), claimed(&redis, "jobs")),
        (300, 0),
        "refused claims take nothing"
    );
    crate::reload::wait_logged(&daemon, "kmq:{jobs}:wake is a string, not a list", 1);
    assert!(dir.records().starts.is_empty(), "nothing ran");
    let _: i64 = redis.cmd(&["DEL", "kmq:{jobs}:wake"]);
    wait_done(&config, 300, Duration::from_secs(30));
    crate::reload::stop(daemon);
    let records = dir.records();
    assert_eq!(records.starts.len(), 300, "each task ran once");
    for i in 0..300 {
        assert_eq!(records.runs_of(&format!("t{i}")), 1, "t{i}");
    }
}

/// Review M1: a dead key that is not a list, and a payload over max_task_bytes in the batch. The claim used to
/// take the batch off the ready list, delete its claim list to check the payloads one by one, then fail at
/// LPUSH dead: the batch was in no list at all. Now the claim refuses before it writes; once the key is fixed,
/// every small task runs and the oversized one is dead-lettered.
#[test]
fn a_wrong_typed_dead_key_with_an_oversized_task_loses_nothing() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let queues = safe_queue("max_task_bytes = 1024");
    let config = dir.config(&redis, &queues);
    push_many(&config, "t", 20, "7");
    client(&config)
        .push(
            "jobs",
            NewTask::new("test", &format!("\"{}\"", "x".repeat(2000)))
                .unwrap()
                .id("big"),
        )
        .unwrap();
    let _: String = redis.cmd(&["SET", "kmq:{jobs}:dead", "not a list"]);
    let (config, daemon) = daemon_through(&dir, &proxy, &queues);
    wait_calls(&proxy, sources::CLAIM, 0, 3);
    assert_eq!(
        (ready(&redis, "jobs"), claimed(&redis, "jobs")),
        (21, 0),
        "refused claims take nothing"
    );
    crate::reload::wait_logged(&daemon, "kmq:{jobs}:dead is a string, not a list", 1);
    let _: i64 = redis.cmd(&["DEL", "kmq:{jobs}:dead"]);
    let s = eventually(Duration::from_secs(30), "the queue drained", || {
        let s = stats(&config, "jobs");
        (s.done == 20 && s.dead == 1, s)
    });
    crate::reload::stop(daemon);
    assert_eq!((s.ready, s.processing), (0, 0), "{s:?}");
    assert_eq!(dead_records(&redis, "jobs").len(), 1);
    assert_eq!(dir.records().starts.len(), 20);
}

/// A grouped claim's intake (a task pushed by plain RPUSH goes from the ready list to its group's flow) used to
/// move the task and write the ring, then read the group's running count in its turns and refuse the claim for a
/// count that is not an integer: the error said "nothing was written" with the task already out of the ready
/// list (script_checks' replay found it now and then, by which calls it recorded). Now every group the claim will
/// read is checked before its first write: the refused claims leave the task where it was, and once the count is
/// fixed it runs once.
#[test]
fn a_grouped_claim_refused_for_a_group_count_moves_no_task_to_its_group() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let queues =
        safe_queue("workers = 2\nidle_poll = \"100ms\"\n[queues.groups]\nmax_running = 1\n");
    let _: i64 = redis.cmd(&[
        "RPUSH",
        "kmq:{jobs}:ready:normal",
        r#"{"type":"test","data":7,"id":"g0","group":"a"}"#,
    ]);
    let _: i64 = redis.cmd(&["HSET", "kmq:{jobs}:running", "g:a", "1.5"]);
    let (config, daemon) = daemon_through(&dir, &proxy, &queues);
    wait_calls(&proxy, sources::CLAIM, 0, 3);
    let ring: i64 = redis.cmd(&["EXISTS", "kmq:{jobs}:ring:normal"]);
    assert_eq!(
        (ready(&redis, "jobs"), ring, claimed(&redis, "jobs")),
        (1, 0, 0),
        "refused claims move nothing: the task stays ready, no ring is written"
    );
    crate::reload::wait_logged(&daemon, "kmq:{jobs}:running field g:a is not an integer", 1);
    let _: i64 = redis.cmd(&["HDEL", "kmq:{jobs}:running", "g:a"]);
    wait_done(&config, 1, Duration::from_secs(30));
    crate::reload::stop(daemon);
    assert_eq!(dir.records().runs_of("g0"), 1, "the task ran once");
}

/// Review M1: push.lua used to RPUSH the tasks (and take their unique ids) before it failed on a wake or stats
/// key of the wrong type or a `pushed` counter that is not an integer: every push was stored and answered with an
/// error, so producers pushed again and duplicated it. Now such a push stores nothing, holds no id, and the same
/// push succeeds once the key is fixed.
#[test]
fn a_push_beside_a_wrong_typed_wake_or_stats_key_stores_nothing_and_can_be_sent_again() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue(""));
    let client = client(&config);
    let batch = || {
        (0..3).map(|i| {
            NewTask::new("test", "7")
                .unwrap()
                .id(format!("u{i}"))
                .unique()
        })
    };
    let breaks: [(&[&str], &str); 3] = [
        (
            &["SET", "kmq:{jobs}:wake", "x"],
            "kmq:{jobs}:wake is a string",
        ),
        (
            &["SET", "kmq:{jobs}:stats", "x"],
            "kmq:{jobs}:stats is a string",
        ),
        (
            &["HSET", "kmq:{jobs}:stats", "pushed", "1.5"],
            "kmq:{jobs}:stats field pushed is not an integer",
        ),
    ];
    for (broken, message) in breaks {
        let _: i64 = redis.cmd(&["DEL", "kmq:{jobs}:wake", "kmq:{jobs}:stats"]);
        let _: redis::Value = redis.cmd(broken);
        let errors: Vec<String> = (0..3)
            .map(|_| match client.push_batch("jobs", batch()) {
                Err(error) => error.to_string(),
                Ok(pushed) => format!("answered {pushed:?}"),
            })
            .collect();
        let unique: i64 = redis.cmd(&["HLEN", "kmq:{jobs}:unique"]);
        assert_eq!(
            (ready(&redis, "jobs"), unique),
            (0, 0),
            "{broken:?}: nothing stored, no id held"
        );
        assert!(errors.iter().all(|e| e.contains(message)), "{errors:?}");
    }
    let _: i64 = redis.cmd(&["DEL", "kmq:{jobs}:stats"]);
    let pushed = client.push_batch("jobs", batch()).unwrap();
    assert!(pushed.iter().all(|p| p.is_accepted()));
    assert_eq!(ready(&redis, "jobs"), 3, "each task once");
}

/// Review M1: settle.lua incremented its counters after applying the outcomes and before storing the call's
/// result, so a counter that is not an integer (`HSET stats retried 1.5`, a monitoring tool's HINCRBYFLOAT)
/// failed every settle after it applied; the acker sent the same call again and default mode queued the retry
/// again each time, without end. Now the settle refuses before it writes: the retry is queued once the counter
/// is fixed, and only then.
#[test]
fn a_counter_that_is_not_an_integer_does_not_make_default_mode_settle_apply_again() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let queues = default_queue("workers = 1\nbackoff = \"10ms\"");
    let _: i64 = redis.cmd(&["HSET", "kmq:{jobs}:stats", "retried", "1.5"]);
    let (config, daemon) = daemon_through(&dir, &proxy, &queues);
    client(&config)
        .push(
            "jobs",
            NewTask::new("test", r#"{"fail_attempts":1}"#)
                .unwrap()
                .id("r"),
        )
        .unwrap();
    wait_calls(&proxy, sources::SETTLE, 0, 4);
    let retry: i64 = redis.cmd(&["ZCARD", "kmq:{jobs}:retry:normal"]);
    assert_eq!(
        (ready(&redis, "jobs"), retry, dir.records().runs_of("r")),
        (0, 0, 1),
        "the refused settles queued no retry"
    );
    crate::reload::wait_logged(
        &daemon,
        "kmq:{jobs}:stats field retried is not an integer",
        1,
    );
    let _: i64 = redis.cmd(&["HDEL", "kmq:{jobs}:stats", "retried"]);
    let s = eventually(Duration::from_secs(20), "the retry done", || {
        let s = stats(&config, "jobs");
        (s.done == 1, s)
    });
    crate::reload::stop(daemon);
    assert_eq!((s.retried, s.ready, s.delayed), (1, 0, 0), "{s:?}");
    assert_eq!(dir.records().runs_of("r"), 2, "run, retried once, run");
}

/// Review L1: one push.lua call of 10,000 unique tasks used to take every id (HSETNX), then fail in `unpack`
/// (Lua's stack holds about 8,000 values): no task queued, every id held for ever, each retry refused as a
/// duplicate. Now it pushes them 1,000 at a time: all queued, each id held once.
#[test]
fn a_push_of_10000_tasks_in_one_call_queues_them_all_or_nothing() {
    let redis = RedisServer::start();
    let mut connection = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let mut call = redis::cmd("EVAL");
    call.arg(PUSH_SCRIPT).arg(6);
    for key in [
        "ready:normal",
        "delayed:normal",
        "delayed-tasks",
        "wake",
        "unique",
        "stats",
    ] {
        call.arg(format!("kmq:{{jobs}}:{key}"));
    }
    call.arg(0).arg(0).arg("kmq:{jobs}:delay-wake");
    for i in 0..10_000 {
        call.arg(format!("u{i}")).arg(1).arg(format!(
            r#"{{"id":"u{i}","type":"test","data":7,"unique":true}}"#
        ));
    }
    let reply: redis::RedisResult<Vec<i64>> = call.query(&mut connection);
    let unique: i64 = redis.cmd(&["HLEN", "kmq:{jobs}:unique"]);
    match reply {
        Ok(accepted) => {
            assert_eq!(accepted, vec![1; 10_000]);
            assert_eq!((ready(&redis, "jobs"), unique), (10_000, 10_000));
            let first: String = redis.cmd(&["LINDEX", "kmq:{jobs}:ready:normal", "0"]);
            let last: String = redis.cmd(&["LINDEX", "kmq:{jobs}:ready:normal", "-1"]);
            assert!(
                first.contains("\"u0\"") && last.contains("\"u9999\""),
                "in order"
            );
        }
        Err(error) => assert_eq!(
            (ready(&redis, "jobs"), unique),
            (0, 0),
            "a refused push stores nothing and holds no id: {error}"
        ),
    }
}
