//! handover_plain.lua, the settle made for the handover of a plain queue at `max_running` (src/broker/
//! plain_handover.rs), against settle.lua with its claim block: from the same database, the same call sent each
//! way writes the same keys and answers the same reply (Redis's clock and the lease's time left aside), and each
//! script answers a copy of the other's call, sent again after a lost reply, from its stored result, writing
//! nothing. The cases it leaves to settle.lua write nothing before they do, and the call's answer is settle.lua's.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kmqd::broker::{self, SettleOp, Settlement};
use kmqd::queue::QueueContext;
use kmqd::{Config, NewTask};

use crate::safe_mode::{context, dead_daemon_claims, safe};
use crate::support::*;

const OWNER: &str = "plain.1";
const SETTLER: &str = "plain-acker";

/// Every key's type and what it holds (a hash's fields and a zset's members sorted, bytes past ASCII escaped), its
/// expiry aside; a dead record's time of death as 0 (the two calls are made at two times).
pub(crate) type Keys = BTreeMap<String, (String, Vec<String>)>;

pub(crate) fn keys(redis: &RedisServer) -> Keys {
    let mut conn = redis.connection();
    let names: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    names
        .into_iter()
        .map(|key| {
            let kind: String = redis::cmd("TYPE").arg(&key).query(&mut conn).unwrap();
            let mut content: Vec<Vec<u8>> = match kind.as_str() {
                "string" => vec![redis::cmd("GET").arg(&key).query(&mut conn).unwrap()],
                "list" => redis::cmd("LRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .query(&mut conn)
                    .unwrap(),
                "hash" => redis::cmd("HGETALL").arg(&key).query(&mut conn).unwrap(),
                "zset" => redis::cmd("ZRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query(&mut conn)
                    .unwrap(),
                other => panic!("{key} is a {other}"),
            };
            if kind == "hash" || kind == "zset" {
                let mut pairs: Vec<Vec<u8>> =
                    content.chunks(2).map(|pair| pair.join(&b'=')).collect();
                pairs.sort();
                content = pairs;
            }
            let dead_at = regex::bytes::Regex::new(r#""dead_at":[0-9]+"#).unwrap();
            let content = content
                .iter()
                .map(|bytes| {
                    let bytes = dead_at.replace_all(bytes, &br#""dead_at":0"#[..]);
                    bytes.escape_ascii().to_string()
                })
                .collect();
            (key, (kind, content))
        })
        .collect()
}

/// Every key's DUMP, to put the database back as it was.
pub(crate) fn dump(redis: &RedisServer) -> Vec<(String, Vec<u8>)> {
    let mut conn = redis.connection();
    let names: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    names
        .into_iter()
        .map(|key| {
            let bytes: Vec<u8> = redis::cmd("DUMP").arg(&key).query(&mut conn).unwrap();
            (key, bytes)
        })
        .collect()
}

pub(crate) fn restore(redis: &RedisServer, dumped: &[(String, Vec<u8>)]) {
    let mut conn = redis.connection();
    let _: () = redis::cmd("FLUSHALL").query(&mut conn).unwrap();
    for (key, bytes) in dumped {
        let _: () = redis::cmd("RESTORE")
            .arg(key)
            .arg(0)
            .arg(bytes.as_slice())
            .query(&mut conn)
            .unwrap();
    }
}

/// The settler's stored call (settle.lua, "Calls"), its number and its reply's integers.
fn stored_call(keys: &Keys) -> (String, Vec<i64>) {
    let (_, content) = &keys[&format!("kmq:{{jobs}}:settled:{SETTLER}")];
    let (call, reply) = content[0].split_once('|').unwrap();
    (
        call.to_string(),
        reply.split(',').map(|n| n.parse().unwrap()).collect(),
    )
}

/// A queue `jobs` (`extra` its config) of its own Redis, with tasks `t0`... pushed (`high`: how many of them at
/// the level `high`, first), claimed by `OWNER` up to `max` (claim 0), and what `before` does then.
struct Case {
    redis: RedisServer,
    _dir: TestDir,
    queue: Arc<QueueContext>,
    batch: broker::Batch,
    config: Config,
}

/// A safe-mode queue `jobs` (`extra` its config) of its own Redis, with tasks `t0`... pushed (`high`: how many of
/// them at the level `high`, first; the others at the default level), and every script loaded, so that each call's
/// EVALSHAs are its scripts' runs (no NOSCRIPT).
pub(crate) fn queue_with_tasks(
    extra: &str,
    (n, high): (usize, usize),
) -> (RedisServer, TestDir, Config, Arc<QueueContext>) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let path = dir.config(&redis, &safe(extra));
    let config = Config::load(&path).unwrap();
    let queue = context(&config);
    let tasks: Vec<NewTask> = (0..n)
        .map(|i| {
            let task = NewTask::new("test", "{}").unwrap().id(format!("t{i}"));
            if i < high {
                task.priority("high")
            } else {
                task
            }
        })
        .collect();
    if n > 0 {
        client(&path).push_batch("jobs", tasks).unwrap();
    }
    for (_, body) in kmqd::broker::sources::ALL {
        redis.cmd::<String>(&["SCRIPT", "LOAD", body]);
    }
    (redis, dir, config, queue)
}

impl Case {
    fn new(extra: &str, (n, high, max): (usize, usize, usize)) -> Case {
        let (redis, dir, config, queue) = queue_with_tasks(extra, (n, high));
        let batch = dead_daemon_claims(
            &mut redis.connection(),
            &queue,
            OWNER,
            0,
            max,
            Duration::from_secs(60),
        );
        Case {
            redis,
            _dir: dir,
            queue,
            batch,
            config,
        }
    }

    /// Call `number` of `SETTLER`: the acknowledgements of the claimed tasks `acked`, handing the slots they free
    /// over to claim `claim` of up to 4 tasks; by settle.lua alone when `generic`.
    fn ack(
        &self,
        number: u64,
        acked: &[usize],
        claim: u64,
        generic: bool,
    ) -> (broker::Settled, Option<broker::Batch>) {
        let limits = broker::ClaimLimits {
            daemon: "test:0",
            ..self.queue.claim_limits()
        };
        let settlements: Vec<Settlement> = acked
            .iter()
            .map(|&i| Settlement {
                popped_by: None,
                popped_scope: None,
                op: SettleOp::Ack,
                token: self.batch.tasks[i].token.clone(),
                unique_id: None,
                level: self.batch.tasks[i].level,
                payload: Vec::new(),
                failed: false,
                kept: None,
                note: None,
            })
            .collect();
        let call = broker::Call {
            settler: SETTLER,
            number,
        };
        let handover = broker::Handover {
            claim,
            max: 4,
            limits: &limits,
        };
        let settle = match generic {
            true => broker::settle_handing_over_generic,
            false => broker::settle_handing_over,
        };
        settle(
            &mut self.redis.connection(),
            &self.queue.keys,
            &call,
            self.queue.config.dead_max,
            &Arc::from(OWNER),
            &settlements,
            &handover,
        )
        .unwrap()
    }

    fn evalshas(&self) -> u64 {
        crate::protocol::command_calls(&self.redis, "evalsha")
    }
}

/// What a call answered, as the daemon reads it: the acknowledgements found stale, whether it was a late copy,
/// and the tasks handed over (the journal and the claim's state are compared in the stored reply).
type Answer = (usize, bool, Option<Vec<String>>);

fn answer((settled, batch): &(broker::Settled, Option<broker::Batch>)) -> Answer {
    (
        settled.stale_acks,
        settled.superseded,
        batch.as_ref().map(|batch| {
            (0..batch.tasks.len())
                .map(|i| String::from_utf8_lossy(batch.payloads.get(i)).into_owned())
                .collect()
        }),
    )
}

/// Sends call `number` (`acked`, claim `claim`) both ways from the database as it is, and compares them: the
/// keys each leaves (the stored call's time and lease aside) and the answers; then each script's answer to a copy
/// of the other's call. `lean`: whether handover_plain.lua applies the call itself (else it leaves it to
/// settle.lua). Returns the answer.
fn compare(
    case: &Case,
    what: &str,
    (number, acked, claim): (u64, &[usize], u64),
    lean: bool,
) -> Answer {
    let before = dump(&case.redis);
    let before_keys = keys(&case.redis);
    case.redis.cmd::<String>(&["CONFIG", "RESETSTAT"]);
    let chosen = case.ack(number, acked, claim, false);
    assert_eq!(
        case.evalshas(),
        if lean { 1 } else { 2 },
        "{what}: the scripts the call ran (handover_plain.lua alone, or then settle.lua)"
    );
    let chosen_keys = keys(&case.redis);
    let chosen_dump = dump(&case.redis);
    restore(&case.redis, &before);
    assert_eq!(keys(&case.redis), before_keys, "{what}: put back");
    let generic = case.ack(number, acked, claim, true);
    let generic_keys = keys(&case.redis);
    assert_eq!(answer(&chosen), answer(&generic), "{what}: the answers");
    // The stored calls: the same reply but for Redis's clock and the lease's time left (the claim's first and
    // last integers, when it claimed), which the two calls read at two times.
    let (mut chosen_call, mut generic_call) =
        (stored_call(&chosen_keys), stored_call(&generic_keys));
    assert_eq!(chosen_call.0, number.to_string());
    if chosen_call.1.len() > 2 && chosen_call.1[3] != -1 {
        let last = chosen_call.1.len() - 1;
        for call in [&mut chosen_call, &mut generic_call] {
            assert!(call.1[2] > 0 && call.1[last] > 0, "{what}: {call:?}");
            call.1[2] = 0;
            call.1[last] = 0;
        }
    }
    assert_eq!(chosen_call, generic_call, "{what}: the stored replies");
    let without_call = |keys: &Keys| {
        let mut keys = keys.clone();
        keys.remove(&format!("kmq:{{jobs}}:settled:{SETTLER}"));
        keys
    };
    assert_eq!(
        without_call(&chosen_keys),
        without_call(&generic_keys),
        "{what}: the keys written"
    );
    // A copy sent again after a lost reply: either script answers the other's from its stored result, and writes
    // nothing.
    let again = case.ack(number, acked, claim, false);
    assert_eq!(
        answer(&again),
        answer(&generic),
        "{what}: settle.lua's call sent again"
    );
    assert_eq!(
        keys(&case.redis),
        generic_keys,
        "{what}: sent again, wrote nothing"
    );
    restore(&case.redis, &chosen_dump);
    let again = case.ack(number, acked, claim, true);
    assert_eq!(
        answer(&again),
        answer(&chosen),
        "{what}: handover_plain.lua's call sent again"
    );
    assert_eq!(
        keys(&case.redis),
        chosen_keys,
        "{what}: sent again, wrote nothing"
    );
    answer(&chosen)
}

fn ids(answer: &Answer) -> Vec<String> {
    answer.2.as_ref().map_or(Vec::new(), |payloads| {
        payloads
            .iter()
            .map(|payload| {
                kmqd::task::Envelope::decode(payload)
                    .unwrap()
                    .id
                    .unwrap()
                    .to_string()
            })
            .collect()
    })
}

/// The calls an acker sends at a queue's limit, each compared with settle.lua's from the same database: part of
/// a claim, the rest of it (merged into its settled bits), a whole claim, an acknowledgement already applied (it
/// frees nothing), a limit with room left (the claim passes a wake-up marker on), an empty ready list (the settle
/// pushes the marker), a higher limit noted by another daemon, two priority levels.
#[test]
fn a_plain_handover_settle_writes_and_answers_what_settle_lua_does() {
    let case = Case::new("max_running = 3", (7, 0, 100));
    let first = compare(&case, "part of a claim", (1, &[0], 100), true);
    assert_eq!(ids(&first), ["t3"]);
    let stale = compare(
        &case,
        "an acknowledgement applied already",
        (2, &[0], 101),
        true,
    );
    assert_eq!((stale.0, ids(&stale)), (1, Vec::<String>::new()));
    let rest = compare(&case, "the rest of a claim", (3, &[1, 2], 102), true);
    assert_eq!(ids(&rest), ["t4", "t5"]);

    let case = Case::new("max_running = 2", (6, 0, 100));
    let whole = compare(&case, "a whole claim", (1, &[0, 1], 100), true);
    assert_eq!(ids(&whole), ["t2", "t3"]);
    assert_eq!(
        stored_call(&keys(&case.redis)).1[3],
        8,
        "the limit filled (state 8)"
    );

    let case = Case::new("max_running = 3", (6, 0, 2));
    let room = compare(&case, "a limit with room", (1, &[0], 100), true);
    assert_eq!(ids(&room), ["t2"]);
    assert_eq!(case.redis.cmd::<u64>(&["LLEN", "kmq:{jobs}:wake"]), 1);

    let case = Case::new("max_running = 2", (2, 0, 100));
    let empty = compare(&case, "an empty ready list", (1, &[0], 100), true);
    assert_eq!(ids(&empty), Vec::<String>::new());
    assert_eq!(case.redis.cmd::<u64>(&["LLEN", "kmq:{jobs}:wake"]), 1);

    let case = Case::new("max_running = 2", (6, 0, 100));
    case.redis
        .cmd::<()>(&["HSET", "kmq:{jobs}:running", "q:limit", "5"]);
    let noted = compare(&case, "a higher limit noted", (1, &[0, 1], 100), true);
    assert_eq!(ids(&noted), ["t2", "t3"]);

    let case = Case::new(
        "max_running = 2\npriorities = [\"high\", \"normal\"]\ndefault_priority = \"normal\"",
        (5, 3, 100),
    );
    let levels = compare(&case, "two levels", (1, &[0, 1], 100), true);
    assert_eq!(
        ids(&levels),
        ["t2", "t3"],
        "the high level's last, then the normal's first"
    );
    assert!(case.config.queues[0].priorities.len() == 2);
}

/// The cases handover_plain.lua leaves to settle.lua: it writes nothing before it does, and the call's answer and
/// writes are settle.lua's (a paused queue, an owner whose lease ran out, a quarantined task, a payload past
/// max_task_bytes, a claim gone).
#[test]
fn a_handover_settle_handover_plain_lua_is_not_made_for_is_settle_lua_s() {
    let case = Case::new("max_running = 2", (6, 0, 100));
    case.redis.cmd::<()>(&["SET", "kmq:{jobs}:paused", "1"]);
    let paused = compare(&case, "a paused queue", (1, &[0], 100), false);
    assert_eq!(ids(&paused), Vec::<String>::new());

    let case = Case::new("max_running = 2", (6, 0, 100));
    case.redis
        .cmd::<()>(&["ZADD", "kmq:{jobs}:owners", "1", OWNER]);
    let lost = compare(&case, "a lease run out", (1, &[0], 100), false);
    assert_eq!(lost.2, None, "nothing claimed");

    let case = Case::new("max_running = 2", (6, 0, 100));
    let quarantine = &case.queue.keys.quarantine[0];
    case.redis
        .cmd::<()>(&["LPUSH", quarantine, r#"{"id":"q","type":"test","data":{}}"#]);
    compare(&case, "a quarantined task", (1, &[0], 100), false);

    let case = Case::new("max_running = 2\nmax_task_bytes = 1024", (2, 0, 100));
    let ready = &case.queue.keys.ready[0];
    let large = format!(
        r#"{{"id":"large","type":"test","data":"{}"}}"#,
        "x".repeat(2000)
    );
    case.redis.cmd::<()>(&["RPUSH", ready, &large]);
    let dead = compare(
        &case,
        "a payload past max_task_bytes",
        (1, &[0], 100),
        false,
    );
    assert_eq!(
        ids(&dead),
        Vec::<String>::new(),
        "dead-lettered by settle.lua's claim"
    );

    let case = Case::new("max_running = 2", (6, 0, 100));
    let list = case.queue.keys.claim_list(OWNER, 0, 0);
    case.redis.cmd::<()>(&["DEL", &list]);
    compare(&case, "a claim gone", (1, &[0], 100), false);
}
