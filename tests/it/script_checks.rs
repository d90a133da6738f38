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

/// Every key of a database: its type, its DUMP and whether it expires.
type Snapshot = BTreeMap<Vec<u8>, (String, Vec<u8>, bool)>;

/// A script call as the proxy saw it (EVALSHA or EVAL, name first), and the database just before it.
struct Recorded {
    script: &'static str,
    args: Vec<Vec<u8>>,
    before: Snapshot,
}

/// kmqd's scripts that write, by name (access.lua writes nothing and touches no key).
fn scripts() -> Vec<(&'static str, &'static str)> {
    vec![
        ("push.lua", PUSH_SCRIPT),
        ("claim.lua", sources::CLAIM),
        ("adopt.lua", sources::ADOPT),
        ("pop.lua", sources::POP),
        ("release_unique.lua", sources::RELEASE_UNIQUE),
        ("settle.lua", sources::SETTLE),
        ("renew.lua", sources::RENEW),
        ("register.lua", sources::REGISTER),
        ("release.lua", sources::RELEASE),
        ("promote.lua", sources::PROMOTE),
        ("remove.lua", sources::REMOVE),
        ("fire.lua", sources::FIRE),
        ("dead_requeue.lua", sources::DEAD_REQUEUE),
        ("dead_purge.lua", sources::DEAD_PURGE),
        ("drain.lua", sources::DRAIN),
        ("move.lua", sources::MOVE),
        ("history.lua", sources::HISTORY),
    ]
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
    keys.into_iter()
        .zip(values.chunks(3))
        .map(|(key, v)| {
            let kind: String = redis::from_redis_value(v[0].clone()).unwrap();
            let dump: Vec<u8> = redis::from_redis_value(v[1].clone()).unwrap_or_default();
            let ttl: i64 = redis::from_redis_value(v[2].clone()).unwrap();
            (key, (kind, dump, ttl >= 0))
        })
        // A key gone between KEYS and DUMP (another client's write, while the proxy records).
        .filter(|(_, (kind, dump, _))| kind != "none" && !dump.is_empty())
        .collect()
}

/// Puts the database back as `snapshot` was, every live lease (an owner's score above 0) a minute from now, so
/// that a claim or settle replayed later finds its owner alive.
fn restore(conn: &mut redis::Connection, snapshot: &Snapshot) {
    let _: () = redis::cmd("FLUSHALL").query(conn).unwrap();
    let (seconds, _): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
    let mut pipe = redis::pipe();
    for (key, (_, dump, _)) in snapshot {
        pipe.cmd("RESTORE").arg(key).arg(0).arg(dump).ignore();
    }
    if !snapshot.is_empty() {
        let _: () = pipe.query(conn).unwrap();
    }
    for (key, (kind, ..)) in snapshot {
        if kind == "zset" && key.ends_with(b":owners") {
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
    let current = before.get(key).map_or("none", |(kind, ..)| kind.as_str());
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
/// source mover, a schedule, the history, a default-mode daemon's pops of unique tasks, cancels, dead requeue
/// and purge, and the stop (drain, release).
fn record_calls() -> (RedisServer, Vec<Recorded>) {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let queues = "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 2\nlease_timeout = \"3s\"\n\
                  max_task_bytes = 1024\nretry_times = 1\nbackoff = \"10ms\"\nsource_lists = [\"queue:src\"]\n\n\
                  [[queues]]\nname = \"fast\"\nmode = \"default\"\nworkers = 2\nlease_timeout = \"3s\"\n\
                  retry_times = 1\nbackoff = \"10ms\"\n\n\
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
            let shape = shape(script, args);
            if shapes.contains_key(&shape) || per_script >= 8 {
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
    jobs.push(NewTask::new("nobody", "{}").unwrap().id("unknown"));
    jobs.push(test("7", "unique-1").unique());
    jobs.push(test("7", "cancelled-ready"));
    client.push_batch("jobs", jobs).unwrap();
    client
        .push("jobs", test("7", "soon").delay(Duration::from_millis(300)))
        .unwrap();
    client
        .push("jobs", test("7", "never").delay(Duration::from_secs(3600)))
        .unwrap();
    client
        .push(
            "jobs",
            test(&format!("\"{}\"", "x".repeat(2000)), "oversized"),
        )
        .unwrap();
    assert_eq!(client.cancel("jobs", "never").unwrap(), 1);
    assert_eq!(client.cancel("jobs", "cancelled-ready").unwrap(), 1);
    let fast: Vec<NewTask> = (0..10)
        .map(|i| test("7", &format!("fast-{i}")).unique())
        .chain([test(r#"{"fail_attempts":1}"#, "fast-retry")])
        .collect();
    client.push_batch("fast", fast).unwrap();
    for i in 0..5 {
        let _: i64 = redis.cmd(&[
            "RPUSH",
            "queue:src",
            &format!(r#"{{"type":"test","data":7,"id":"src-{i}"}}"#),
        ]);
    }

    // The second claim's reply is lost: the daemon adopts it.
    proxy.add(Fault::DropReply {
        matching: Matcher::script(sources::CLAIM),
        nth: 2,
        then: AfterDrop::Close,
    });
    let daemon = TestDaemon::start(&config);
    eventually(Duration::from_secs(30), "both queues drained", || {
        let (jobs, fast) = (stats(&config, "jobs"), stats(&config, "fast"));
        (
            jobs.ready + jobs.delayed + jobs.processing + fast.ready + fast.delayed == 0
                && jobs.dead >= 3
                && fast.done >= 11,
            (jobs, fast),
        )
    });
    client
        .dead_requeue("jobs", DeadSelection::Ids(&["failing"]), true)
        .unwrap();
    client
        .dead_purge("jobs", DeadSelection::Ids(&["unknown"]))
        .unwrap();
    eventually(
        Duration::from_secs(20),
        "a schedule fired and a lease renewed",
        || {
            let fired = proxy.seen(&Matcher::script(sources::FIRE));
            let renewed = proxy.seen(&Matcher::script(sources::RENEW));
            (fired > 0 && renewed > 1, (fired, renewed))
        },
    );
    daemon.stop();
    let recorded = std::mem::take(&mut *recorded.lock().unwrap());
    (redis, recorded)
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
        "{} of {replays} replays answered an error after writing:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        refused.len() >= 10,
        "the replays reached the scripts' checks: {refused:?}"
    );
}
