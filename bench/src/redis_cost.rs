//! The `redis-cost` scenario: what taking a task and settling it costs Redis's one thread, for today's scripts
//! and for the shapes a cheaper safe mode could take (docs/PERFORMANCE.md, "What at-least-once costs Redis").
//! No daemon runs: each shape is one round of Redis commands on a backlog of [`BATCH`] envelopes of about 100
//! bytes, the size of a no-op task, and the figure is Redis's CPU time (`INFO cpu`, microsecond resolution) per
//! task over [`ROUNDS`] rounds, median of `--runs`.
//!
//! The shapes:
//! - **native LMPOP**: default mode's plain pop as it was (`LMPOP ... COUNT`): the floor, nothing kept;
//! - **take.lua**: default mode's plain pop now, bounded by bytes (review M8): the list's head weighed by its first
//!   nodes (`MEMORY USAGE ... SAMPLES n`, never under), and popped natively in its transaction (`LMPOP`) when that
//!   fits, as it does here; otherwise copied natively into `P:{Q}:taking` (`SORT ... STORE`), weighed, cut and
//!   popped from there;
//! - **pop.lua**: default mode's pop while unique ids are held (or under a limit), its payloads through Lua;
//! - **Lua LPOP, returned**: the same pop inside a script, whose payloads cross into Lua strings and back: the
//!   floor of any claim that handles its payloads in Lua;
//! - **kmqd 0.1's claim.lua + settle.lua** (copied into `scripts/`): a token per task into a processing hash,
//!   then one `HDEL` per task when acknowledged;
//! - **claim.lua + settle.lua**: safe mode as it is, through the daemon's own calls (`broker::register`,
//!   `broker::claim`, `broker::settle` on a queue the daemon's config parser built), so that the scripts' keys,
//!   arguments and preludes can never drift from the daemon's (they did once: the shapes built claim.lua's
//!   call by hand and failed once its keys grew); a list per claim filled by `SORT ... STORE` and read back in
//!   the claim's transaction, settled with a bitmap: the batch acknowledged in one settle call, in four (the
//!   bitmaps merged), or in forty of 25 (what the settles of two workers running 50 µs handlers carry: the
//!   settle's fixed part per task);
//! - **per-claim list, moved in Lua**: the claim `LPOP`s into Lua and `RPUSH`es the batch onto a list of its own
//!   (one key per claim, no token per task), the settle deletes the list;
//! - **per-claim list, SORT ... STORE**: the claim copies the head of the ready list onto the claim's list
//!   natively (`SORT ready BY nosort LIMIT 0 N STORE claim`, which keeps the order), trims it off the ready list,
//!   and the transaction around the script reads the batch with `LRANGE`: no payload ever becomes a Lua string;
//!   the settle deletes the list.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kmqd::broker::{self, Call, Fence, Holder, SettleOp, Settlement};
use kmqd::config::Config;
use kmqd::queue::QueueContext;
use kmqd_harness::RedisServer;

use super::{Bench, Figure, figure};

/// Tasks per claim: the daemon's largest claim, which today's scripts are at their cheapest per task with.
const BATCH: usize = 1000;
/// Claims (and settles) per run.
const ROUNDS: usize = 100;
/// A no-op task's envelope, as the daemon writes it (about 100 bytes).
const ENVELOPE: &str = r#"{"id":"0b6c8e0e-3c1f-4b0a-9c55-6a3d2f1e7b90","type":"test","queue":"q","data":{},"attempt":0}"#;

const TAKE: &str = kmqd::broker::sources::TAKE;
const POP: &str = kmqd::broker::sources::POP;
const HASH_CLAIM: &str = include_str!("scripts/hash_claim.lua");
const HASH_SETTLE: &str = include_str!("scripts/hash_settle.lua");
const LUA_POP: &str = "return redis.call('LPOP', KEYS[1], ARGV[1])";
const LUA_MOVE: &str = "local got = redis.call('LPOP', KEYS[1], ARGV[1])\n\
                        redis.call('RPUSH', KEYS[2], unpack(got))\n\
                        return got";
const SORT_MOVE: &str = "local n = redis.call('SORT', KEYS[1], 'BY', 'nosort', 'LIMIT', 0, ARGV[1], 'STORE', KEYS[2])\n\
     redis.call('LTRIM', KEYS[1], n, -1)\n\
     return n";

/// An `LMPOP`'s reply: the list popped from, and what it popped.
type Popped = (String, Vec<Vec<u8>>);

/// The keys of one queue `q` with one level, as src/broker/keys.rs names them for owner `o`.
const READY: &str = "kmq:{q}:ready:normal";
/// The lists a default-mode pop takes from, in order: the level's quarantine lists, then its ready list.
const POP_LISTS: [&str; 4] = [
    "kmq:{q}:quarantine:1:normal",
    "kmq:{q}:quarantine:8:normal",
    "kmq:{q}:quarantine:64:normal",
    READY,
];
const OWNER: &str = "o";

#[derive(Clone, Copy)]
enum Shape {
    NativePop,
    Take,
    PopLua,
    LuaPop,
    Hash,
    Today,
    TodaySplit,
    TodaySmall,
    LuaMove,
    SortStore,
}

impl Shape {
    const ALL: [Shape; 10] = [
        Shape::NativePop,
        Shape::Take,
        Shape::PopLua,
        Shape::LuaPop,
        Shape::Hash,
        Shape::Today,
        Shape::TodaySplit,
        Shape::TodaySmall,
        Shape::LuaMove,
        Shape::SortStore,
    ];

    fn name(self) -> &'static str {
        match self {
            Shape::NativePop => {
                "native LMPOP (default mode's plain pop before take.lua), nothing kept"
            }
            Shape::Take => "take.lua and LMPOP, guarded (default mode's plain pop), nothing kept",
            Shape::PopLua => "pop.lua (default mode's pop with unique ids held), nothing kept",
            Shape::LuaPop => "LPOP in Lua, returned, nothing kept",
            Shape::Hash => "kmqd 0.1's claim.lua + settle.lua (a hash field per task)",
            Shape::Today => "claim.lua + settle.lua (safe mode today), one settle",
            Shape::TodaySplit => "claim.lua + settle.lua (safe mode today), four settles",
            Shape::TodaySmall => {
                "claim.lua + settle.lua (safe mode today), forty settles of 25 (a busy CPU-bound lane's)"
            }
            Shape::LuaMove => "per-claim list moved in Lua, returned; settle DEL",
            Shape::SortStore => "per-claim list by SORT BY nosort STORE, LRANGE; settle DEL",
        }
    }
}

pub(super) fn redis_cost(bench: &Bench) -> Result<Vec<Figure>, String> {
    let runs = measure(&bench.server, bench.options.runs, ROUNDS)?;
    Ok(Shape::ALL
        .into_iter()
        .zip(runs)
        .map(|(shape, runs)| {
            figure(
                "redis-cost",
                format!("{}, {BATCH} per call", shape.name()),
                "Redis CPU µs/task",
                runs,
                vec![],
            )
        })
        .collect())
}

/// Redis's CPU µs per task of each shape (in [`Shape::ALL`]'s order), one figure per run of `rounds` rounds.
fn measure(server: &RedisServer, runs: usize, rounds: usize) -> Result<Vec<Vec<f64>>, String> {
    let mut conn = server.connection().map_err(|e| format!("redis: {e}"))?;
    let mut safe = Safe::new(server)?;
    let scripts = Scripts {
        hash_claim: redis::Script::new(HASH_CLAIM),
        hash_settle: redis::Script::new(HASH_SETTLE),
        lua_pop: redis::Script::new(LUA_POP),
        take: redis::Script::new(TAKE),
        pop: redis::Script::new(POP),
        lua_move: redis::Script::new(LUA_MOVE),
        sort_move: redis::Script::new(SORT_MOVE),
    };
    let mut figures: Vec<Vec<f64>> = vec![Vec::new(); Shape::ALL.len()];
    // The shapes alternate within each run, so that a noisy neighbour weighs on all of them alike.
    for _ in 0..runs {
        for (i, shape) in Shape::ALL.into_iter().enumerate() {
            redis::cmd("FLUSHALL")
                .exec(&mut conn)
                .map_err(|e| format!("FLUSHALL: {e}"))?;
            let mut spent = 0.0;
            for round in 0..rounds {
                fill(&mut conn)?;
                let before = redis_cpu_us(&mut conn)?;
                one_round(&mut conn, &mut safe, &scripts, shape, round)?;
                spent += redis_cpu_us(&mut conn)? - before;
            }
            figures[i].push(spent / (rounds * BATCH) as f64);
        }
    }
    Ok(figures)
}

struct Scripts {
    hash_claim: redis::Script,
    hash_settle: redis::Script,
    lua_pop: redis::Script,
    take: redis::Script,
    pop: redis::Script,
    lua_move: redis::Script,
    sort_move: redis::Script,
}

/// One claim of [`BATCH`] tasks, then the settle of all of them, in `shape`; checks that all were taken.
fn one_round(
    conn: &mut redis::Connection,
    safe: &mut Safe,
    scripts: &Scripts,
    shape: Shape,
    round: usize,
) -> Result<(), String> {
    let claim_key = format!("kmq:{{q}}:processing:{OWNER}:normal:{round}");
    let taken = match shape {
        Shape::NativePop => {
            let (_, got): (String, Vec<Vec<u8>>) = redis::cmd("LMPOP")
                .arg(1)
                .arg(READY)
                .arg("LEFT")
                .arg("COUNT")
                .arg(BATCH)
                .query(conn)
                .map_err(|e| format!("LMPOP: {e}"))?;
            got.len()
        }
        Shape::Take => {
            let _: String = scripts
                .take
                .prepare_invoke()
                .load(conn)
                .map_err(|e| format!("SCRIPT LOAD: {e}"))?;
            let taking = "kmq:{q}:taking";
            let ((_, _, _), (_, got)): ((usize, usize, i64), Popped) = redis::pipe()
                .atomic()
                .cmd("SET")
                .arg(taking)
                .arg(1)
                .ignore()
                .cmd("EVALSHA")
                .arg(scripts.take.get_hash())
                .arg(5)
                .arg(taking)
                .arg(&POP_LISTS)
                .arg(BATCH)
                .arg(64 << 20)
                .cmd("LMPOP")
                .arg(5)
                .arg(taking)
                .arg(&POP_LISTS)
                .arg("LEFT")
                .arg("COUNT")
                .arg(BATCH)
                .cmd("DEL")
                .arg(taking)
                .ignore()
                .query(conn)
                .map_err(|e| format!("take.lua: {e}"))?;
            got.len()
        }
        Shape::PopLua => {
            // pop.lua pops only under a live lease.
            lease(conn)?;
            let p = |suffix: &str| format!("kmq:{{q}}:{suffix}");
            let mut pop = scripts.pop.prepare_invoke();
            for key in [
                "unique",
                "unique-popped",
                "paused",
                "throttle:q",
                "running",
                "popped-running:o",
                "sched",
                "owners",
            ] {
                pop.key(p(key));
            }
            for list in POP_LISTS {
                pop.key(list);
            }
            // owner, max, max_running, R, W, then the type limits' block (no flows, no foreign type field), the
            // byte budget.
            pop.arg(OWNER)
                .arg(BATCH)
                .arg(0)
                .arg(0)
                .arg(0)
                .arg(0)
                .arg("")
                .arg(64 << 20);
            // {now, the list's index, the payloads, ...}: see pop.lua.
            let reply: Vec<redis::Value> = pop.invoke(conn).map_err(|e| format!("pop.lua: {e}"))?;
            match reply.get(2) {
                Some(redis::Value::Array(got)) => got.len(),
                other => return Err(format!("pop.lua replied {other:?}")),
            }
        }
        Shape::LuaPop => {
            let got: Vec<Vec<u8>> = scripts
                .lua_pop
                .key(READY)
                .arg(BATCH)
                .invoke(conn)
                .map_err(|e| format!("Lua LPOP: {e}"))?;
            got.len()
        }
        Shape::Hash => hash(conn, scripts, round)?,
        Shape::Today => safe.round(round, 1)?,
        Shape::TodaySplit => safe.round(round, 4)?,
        Shape::TodaySmall => safe.round(round, 40)?,
        Shape::LuaMove => {
            let got: Vec<Vec<u8>> = scripts
                .lua_move
                .key(READY)
                .key(&claim_key)
                .arg(BATCH)
                .invoke(conn)
                .map_err(|e| format!("Lua move: {e}"))?;
            delete(conn, &claim_key)?;
            got.len()
        }
        Shape::SortStore => {
            // The script must be loaded for EVALSHA inside the transaction.
            let _: String = scripts
                .sort_move
                .prepare_invoke()
                .load(conn)
                .map_err(|e| format!("SCRIPT LOAD: {e}"))?;
            let (_, got): (usize, Vec<Vec<u8>>) = redis::pipe()
                .atomic()
                .cmd("EVALSHA")
                .arg(scripts.sort_move.get_hash())
                .arg(2)
                .arg(READY)
                .arg(&claim_key)
                .arg(BATCH)
                .cmd("LRANGE")
                .arg(&claim_key)
                .arg(0)
                .arg(-1)
                .query(conn)
                .map_err(|e| format!("SORT STORE: {e}"))?;
            delete(conn, &claim_key)?;
            got.len()
        }
    };
    if taken != BATCH {
        return Err(format!(
            "redis-cost: {} took {taken} of {BATCH} tasks",
            shape.name()
        ));
    }
    Ok(())
}

/// A live lease for the bench's owner.
fn lease(conn: &mut redis::Connection) -> Result<(), String> {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    redis::cmd("ZADD")
        .arg("kmq:{q}:owners")
        .arg(now_ms + 3_600_000)
        .arg(OWNER)
        .exec(conn)
        .map_err(|e| format!("ZADD: {e}"))
}

/// Safe mode as the daemon runs it: a queue `q` built by the daemon's config parser, one owner registered
/// with a long lease, and the daemon's own claim and settle calls (their keys, arguments and script preludes are
/// the daemon's, whatever they become).
struct Safe {
    conn: broker::Conn,
    queue: QueueContext,
    owner: Arc<str>,
    /// The settling party's call counter: a new number for each settle call (settle.lua, "Calls").
    calls: u64,
}

impl Safe {
    fn new(server: &RedisServer) -> Result<Safe, String> {
        let text = format!(
            "[redis]\nurl = \"{}\"\n\n[[queues]]\nname = \"q\"\nmode = \"safe\"\nbatch = {BATCH}\n",
            server.url()
        );
        let config =
            Config::parse(Path::new("redis-cost.toml"), &text).map_err(|e| e.to_string())?;
        let queue = QueueContext::new(&config, &config.queues[0], "bench:1");
        // The other shapes name the queue's keys themselves: they must be the ones the daemon uses.
        if queue.keys.ready[..] != [READY.to_string()] {
            return Err(format!(
                "redis-cost: the queue's ready lists are {:?}, not [{READY}]",
                queue.keys.ready
            ));
        }
        let conn = broker::Connector::new(&config.redis)
            .and_then(|connector| connector.connect())
            .map_err(|e| format!("redis: {e}"))?;
        Ok(Safe {
            conn,
            queue,
            owner: Arc::from(OWNER),
            calls: 0,
        })
    }

    /// One claim of [`BATCH`] tasks under a fresh lease (the round's flush removed the last), then their plain
    /// acknowledgements in `settles` calls; checks that every acknowledgement applied and that the claim's lists
    /// are gone. Returns how many tasks the claim took.
    fn round(&mut self, round: usize, settles: usize) -> Result<usize, String> {
        let keys = &self.queue.keys;
        let info = broker::OwnerInfo {
            mode: "safe".into(),
            levels: self.queue.config.priorities.clone(),
            ..broker::OwnerInfo::default()
        };
        let lease = Duration::from_secs(3600);
        broker::register(&mut self.conn, keys, OWNER, lease, &info)
            .map_err(|e| format!("register.lua: {e}"))?
            .ok_or("register.lua: the bench's owner was refused")?;
        // Each round's claim numbers its tokens afresh: no two claims of one run share a number.
        let claim = (round * BATCH) as u64 + 1;
        let batch = broker::claim(
            &mut self.conn,
            keys,
            &self.owner,
            claim,
            BATCH,
            &self.queue.claim_limits(),
        )
        .map_err(|e| format!("claim.lua: {e}"))?;
        let taken = batch.tasks.len();
        let acks: Vec<Settlement> = batch
            .tasks
            .into_iter()
            .map(|task| Settlement {
                op: SettleOp::Ack,
                token: task.token,
                popped_by: None,
                popped_scope: None,
                unique_id: None,
                level: task.level,
                payload: Vec::new(),
                failed: false,
                kept: None,
                note: None,
            })
            .collect();
        for call in acks.chunks(taken.div_ceil(settles).max(1)) {
            self.calls += 1;
            let call_id = Call {
                settler: "bench:acker",
                number: self.calls,
            };
            let settled = broker::settle(
                &mut self.conn,
                keys,
                &call_id,
                Fence::Owner,
                self.queue.config.dead_max,
                Holder::Claimed(OWNER),
                call,
            )
            .map_err(|e| format!("settle.lua: {e}"))?;
            if settled.stale_acks != 0 || settled.superseded {
                return Err(format!("settle.lua: {settled:?} (stale acknowledgements)"));
            }
        }
        let list = keys.claim_list(OWNER, 0, claim);
        let left: bool = redis::cmd("EXISTS")
            .arg(&list)
            .query(&mut self.conn)
            .map_err(|e| format!("EXISTS: {e}"))?;
        if left {
            return Err("settle.lua left a fully settled claim list behind".into());
        }
        Ok(taken)
    }
}

/// Safe mode as kmqd 0.1 ran it: claim.lua under a live lease with a token per task, then settle.lua
/// acknowledging every token.
fn hash(conn: &mut redis::Connection, scripts: &Scripts, round: usize) -> Result<usize, String> {
    let p = |suffix: &str| format!("kmq:{{q}}:{suffix}");
    let info = p(&format!("owner:{OWNER}"));
    let processing = p(&format!("processing:{OWNER}:hash"));
    lease(conn)?;
    let first = (round * BATCH) as u64 + 1;
    let mut claim = scripts.hash_claim.prepare_invoke();
    for key in claim_keys().into_iter().chain([processing.clone()]) {
        claim.key(key);
    }
    claim
        .arg(OWNER)
        .arg(BATCH)
        .arg(16 << 20)
        .arg(1000)
        .arg("q")
        .arg("bench:1");
    for token in first..first + BATCH as u64 {
        claim.arg(token);
    }
    let reply: Vec<redis::Value> = claim.invoke(conn).map_err(|e| format!("claim.lua: {e}"))?;
    let taken = match reply.get(4) {
        Some(redis::Value::Array(got)) => got.len(),
        other => return Err(format!("claim.lua: unexpected reply {other:?}")),
    };
    let mut settle = scripts.hash_settle.prepare_invoke();
    for key in settle_keys().into_iter().chain([processing, info]) {
        settle.key(key);
    }
    settle
        .arg("owner")
        .arg(1000)
        .arg(1)
        .arg("kmq:{q}:due")
        .arg(OWNER)
        .arg(round)
        .arg(taken);
    for token in first..first + taken as u64 {
        settle.arg(token);
    }
    settle.arg(0);
    let result: Vec<i64> = settle
        .invoke(conn)
        .map_err(|e| format!("settle.lua: {e}"))?;
    if result.first() != Some(&0) {
        return Err(format!(
            "settle.lua: {result:?} (stale acknowledgements: the claim stored other tokens)"
        ));
    }
    Ok(taken)
}

/// The keys claim.lua takes before the owner's (both versions, one level), as src/broker/tasks.rs names them.
fn claim_keys() -> [String; 10] {
    let p = |suffix: &str| format!("kmq:{{q}}:{suffix}");
    [
        p("owners"),
        p("wake"),
        p(&format!("owner:{OWNER}")),
        p("dead"),
        p("stats"),
        p("paused"),
        READY.to_string(),
        p("quarantine:1:normal"),
        p("quarantine:8:normal"),
        p("quarantine:64:normal"),
    ]
}

/// The keys settle.lua takes before the owner's (both versions, one level), as src/broker/tasks.rs names them.
fn settle_keys() -> [String; 12] {
    let p = |suffix: &str| format!("kmq:{{q}}:{suffix}");
    [
        p("owners"),
        p("stats"),
        p("dead"),
        p("unique"),
        p("wake"),
        p(&format!("settled:{OWNER}:acker")),
        p("unique_popped"),
        READY.to_string(),
        p("retry:normal"),
        p("quarantine:1:normal"),
        p("quarantine:8:normal"),
        p("quarantine:64:normal"),
    ]
}

/// A backlog of [`BATCH`] envelopes on the ready list.
fn fill(conn: &mut redis::Connection) -> Result<(), String> {
    redis::cmd("RPUSH")
        .arg(READY)
        .arg(vec![ENVELOPE; BATCH])
        .exec(conn)
        .map_err(|e| format!("RPUSH: {e}"))
}

fn delete(conn: &mut redis::Connection, key: &str) -> Result<(), String> {
    redis::cmd("DEL")
        .arg(key)
        .exec(conn)
        .map_err(|e| format!("DEL: {e}"))
}

/// Redis's CPU time so far (user and system), in microseconds, from `INFO cpu`.
fn redis_cpu_us(conn: &mut redis::Connection) -> Result<f64, String> {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query(conn)
        .map_err(|e| format!("INFO cpu: {e}"))?;
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|value| value.trim().parse::<f64>().ok())
    };
    match (field("used_cpu_user:"), field("used_cpu_sys:")) {
        (Some(user), Some(sys)) => Ok((user + sys) * 1e6),
        _ => Err(format!(
            "INFO cpu: no used_cpu_user/used_cpu_sys in {info:?}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kmqd_harness::Listen;

    /// Each shape once, on a Redis of its own: a shape whose calls no longer match the scripts fails here rather
    /// than at the next measurement (the safe-mode shapes did once, silently for days).
    #[test]
    fn every_shape_takes_and_settles_its_batch() {
        let server = RedisServer::start(Listen::Loopback).unwrap();
        let figures = measure(&server, 1, 2).unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(figures.len(), Shape::ALL.len());
        for (shape, runs) in Shape::ALL.into_iter().zip(&figures) {
            assert_eq!(runs.len(), 1, "{}", shape.name());
        }
    }
}
