//! The only module that talks to Redis.
//!
//! Every state change of a task is one atomic step: a single command or one of the Lua scripts beside this file
//! (docs/PROTOCOL.md describes them). Functions here take a connection and a queue's [`QueueKeys`]; the threads
//! that call them own their connection for as long as they run, so a blocking call never starves anyone else.

pub mod keys;
pub mod lookup;

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

use redis::{Connection, ConnectionLike, IntoConnectionInfo, Value};
use serde::Serialize;

use crate::config::{RedisConfig, redact_url};
use crate::task::Envelope;
pub use keys::QueueKeys;
pub use lookup::{Found, Scope};

/// A Redis failure, with what was being done.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis connection pool: {0}")]
    Pool(#[from] r2d2::Error),
    #[error("redis replied to {what} with an unexpected shape: {detail}")]
    Reply { what: &'static str, detail: String },
    #[error(
        "queue {queue}: its keys were written by kmqd protocol version {found}, this kmqd speaks {expected}; \
         see docs/PROTOCOL.md, \"Versions\""
    )]
    ProtocolVersion {
        queue: String,
        found: String,
        expected: u32,
    },
}

pub type Result<T> = std::result::Result<T, BrokerError>;

/// The version of the key layout and scripts in docs/PROTOCOL.md.
pub const PROTOCOL_VERSION: u32 = 1;

/// The Lua scripts, loaded once per process; `redis::Script` sends EVALSHA and falls back to EVAL when the server
/// lost its script cache (a restart, SCRIPT FLUSH).
struct Scripts {
    push: redis::Script,
    claim: redis::Script,
    settle: redis::Script,
    expired: redis::Script,
    renew: redis::Script,
    promote: redis::Script,
    remove: redis::Script,
    fire: redis::Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    push: redis::Script::new(PUSH_SCRIPT),
    claim: redis::Script::new(include_str!("scripts/claim.lua")),
    settle: redis::Script::new(include_str!("scripts/settle.lua")),
    expired: redis::Script::new(include_str!("scripts/expired.lua")),
    renew: redis::Script::new(include_str!("scripts/renew.lua")),
    promote: redis::Script::new(include_str!("scripts/promote.lua")),
    remove: redis::Script::new(include_str!("scripts/remove.lua")),
    fire: redis::Script::new(include_str!("scripts/fire.lua")),
});

/// The published enqueue script (docs/PROTOCOL.md shows how to call it from any language).
pub const PUSH_SCRIPT: &str = include_str!("scripts/push.lua");

/// Opens connections with a connect timeout and read/write timeouts, so no Redis call can hang a thread forever.
#[derive(Debug)]
pub struct Connector {
    client: redis::Client,
    connect_timeout: Duration,
    display_url: String,
}

/// The read timeout of a connection outside blocking calls: a healthy Redis answers in microseconds, a stuck
/// one is noticed after this.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

impl Connector {
    pub fn new(config: &RedisConfig) -> Result<Connector> {
        let mut info = config.url.as_str().into_connection_info()?;
        if let Some(password) = &config.password {
            let settings = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(settings);
        }
        Ok(Connector {
            client: redis::Client::open(info)?,
            connect_timeout: config.connect_timeout,
            display_url: redact_url(&config.url),
        })
    }

    /// A new connection, outside any pool (the pub/sub listener needs one of its own).
    pub fn connect(&self) -> Result<Connection> {
        let connection = self
            .client
            .get_connection_with_timeout(self.connect_timeout)?;
        connection.set_read_timeout(Some(IO_TIMEOUT))?;
        connection.set_write_timeout(Some(IO_TIMEOUT))?;
        Ok(connection)
    }

    /// The URL with any password replaced, for logs.
    pub fn display_url(&self) -> &str {
        &self.display_url
    }
}

/// A pooled connection that can be marked broken, so that one which failed mid-reply (a timeout leaves the
/// unread reply in the socket) is closed instead of going back to the pool.
pub struct PoolConnection {
    inner: Connection,
    broken: bool,
}

impl std::ops::Deref for PoolConnection {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        &self.inner
    }
}

impl std::ops::DerefMut for PoolConnection {
    fn deref_mut(&mut self) -> &mut Connection {
        &mut self.inner
    }
}

impl r2d2::ManageConnection for Connector {
    type Connection = PoolConnection;
    type Error = redis::RedisError;

    fn connect(&self) -> std::result::Result<PoolConnection, redis::RedisError> {
        let inner = Connector::connect(self).map_err(|error| match error {
            BrokerError::Redis(error) => error,
            other => redis::RedisError::from((redis::ErrorKind::Io, "connect", other.to_string())),
        })?;
        Ok(PoolConnection {
            inner,
            broken: false,
        })
    }

    fn is_valid(
        &self,
        connection: &mut PoolConnection,
    ) -> std::result::Result<(), redis::RedisError> {
        redis::cmd("PING")
            .query::<String>(&mut connection.inner)
            .map(drop)
    }

    fn has_broken(&self, connection: &mut PoolConnection) -> bool {
        connection.broken || !connection.inner.is_open()
    }
}

pub type Pool = r2d2::Pool<Connector>;
pub type PooledConnection = r2d2::PooledConnection<Connector>;

/// Builds the connection pool. Connections are made lazily, so this succeeds while Redis is down; the first
/// `get()` reports the failure.
pub fn pool(config: &RedisConfig) -> Result<Pool> {
    let connector = Connector::new(config)?;
    Ok(r2d2::Pool::builder()
        .max_size(config.pool_size)
        .min_idle(Some(0))
        .connection_timeout(config.connect_timeout)
        .build_unchecked(connector))
}

/// A long-lived thread's own connection: taken from the pool on first use, dropped after a failure (a broken
/// connection must not go back to the pool) and taken anew on the next use.
pub struct Session {
    pool: Pool,
    held: Option<PooledConnection>,
}

impl Session {
    pub fn new(pool: Pool) -> Session {
        Session { pool, held: None }
    }

    /// The connection, connecting first if needed.
    pub fn get(&mut self) -> Result<&mut Connection> {
        if self.held.is_none() {
            self.held = Some(self.pool.get()?);
        }
        // Just filled above.
        Ok(self.held.as_mut().expect("connection present"))
    }

    /// Closes the connection after a failure; the next `get` opens a new one.
    pub fn reset(&mut self) {
        if let Some(mut connection) = self.held.take() {
            connection.broken = true;
        }
    }
}

/// When a pushed task becomes ready.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Due {
    /// Ready at once.
    #[default]
    Now,
    /// Ready this long after the push, on Redis's clock.
    After(Duration),
    /// Ready at this time, ms since the epoch (in the past: ready at once).
    At(i64),
}

/// One task to enqueue.
pub struct PushItem<'a> {
    /// The task id (the envelope's `id`): needed for delayed and unique tasks.
    pub id: &'a str,
    /// Hold the id while the task is live, refusing other pushes of it.
    pub unique: bool,
    pub envelope: &'a str,
}

/// Runs the enqueue script for tasks of one level. Returns, per task, whether it was accepted.
pub fn push(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    level: usize,
    due: Due,
    items: &[PushItem<'_>],
) -> Result<Vec<bool>> {
    let (after_ms, at_ms) = match due {
        Due::Now => (0, 0),
        Due::After(after) => (after.as_millis().max(1) as i64, 0),
        Due::At(at) => (0, at.max(1)),
    };
    let mut invocation = SCRIPTS.push.prepare_invoke();
    invocation
        .key(&keys.ready[level])
        .key(&keys.delayed[level])
        .key(&keys.delayed_tasks)
        .key(&keys.wake)
        .key(&keys.unique)
        .key(&keys.stats)
        .arg(after_ms)
        .arg(at_ms)
        .arg(&keys.delay_channel);
    for item in items {
        invocation
            .arg(item.id)
            .arg(if item.unique { "1" } else { "0" })
            .arg(item.envelope);
    }
    let accepted: Vec<i64> = invocation.invoke(conn)?;
    if accepted.len() != items.len() {
        return Err(BrokerError::Reply {
            what: "push",
            detail: format!("{} results for {} tasks", accepted.len(), items.len()),
        });
    }
    Ok(accepted.into_iter().map(|ok| ok == 1).collect())
}

/// A task taken from a ready list.
#[derive(Debug)]
pub struct Taken {
    /// Safe mode: the claim token that fences its settlement; `None` in default mode.
    pub token: Option<String>,
    /// Index of the level it came from.
    pub level: usize,
    /// The envelope as stored (not yet decoded).
    pub payload: String,
}

/// The result of one claim or pop.
#[derive(Debug, Default)]
pub struct Batch {
    /// Redis's clock when the tasks were taken, ms since the epoch.
    pub now_ms: i64,
    pub tasks: Vec<Taken>,
}

fn reply_error(what: &'static str, detail: impl Into<String>) -> BrokerError {
    BrokerError::Reply {
        what,
        detail: detail.into(),
    }
}

fn int(value: &Value, what: &'static str) -> Result<i64> {
    match value {
        Value::Int(n) => Ok(*n),
        other => Err(reply_error(
            what,
            format!("expected an integer, got {other:?}"),
        )),
    }
}

/// A payload as text. A producer may have pushed bytes that are not UTF-8; they are replaced (U+FFFD), which
/// makes the payload fail to decode as an envelope, so it is dead-lettered rather than run with altered data.
fn text(value: Value, what: &'static str) -> Result<String> {
    match value {
        Value::BulkString(bytes) => Ok(String::from_utf8(bytes).unwrap_or_else(|error| {
            format!("\u{fffd}{}", String::from_utf8_lossy(error.as_bytes()))
        })),
        Value::SimpleString(text) => Ok(text),
        other => Err(reply_error(
            what,
            format!("expected a string, got {other:?}"),
        )),
    }
}

/// Safe mode: claims up to `max` tasks, highest level first, into the processing area under a lease.
pub fn claim(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    levels: &[String],
    max: usize,
    lease: Duration,
) -> Result<Batch> {
    let mut invocation = SCRIPTS.claim.prepare_invoke();
    invocation
        .key(&keys.processing)
        .key(&keys.leases)
        .key(&keys.seq)
        .key(&keys.wake);
    for ready in &keys.ready {
        invocation.key(ready);
    }
    invocation.arg(max).arg(lease.as_millis() as u64);
    for level in levels {
        invocation.arg(level);
    }
    let reply: Vec<Value> = invocation.invoke(conn)?;
    let level_count = keys.levels();
    if reply.len() < 2 + level_count {
        return Err(reply_error("claim", format!("{} elements", reply.len())));
    }
    let mut reply = reply.into_iter();
    let now_ms = int(&reply.next().unwrap_or(Value::Nil), "claim")?;
    let first_seq = int(&reply.next().unwrap_or(Value::Nil), "claim")?;
    let counts: Vec<i64> = reply
        .by_ref()
        .take(level_count)
        .map(|v| int(&v, "claim"))
        .collect::<Result<_>>()?;
    let mut tasks = Vec::with_capacity(counts.iter().sum::<i64>() as usize);
    let mut seq = first_seq;
    for (level, count) in counts.into_iter().enumerate() {
        for _ in 0..count {
            let payload = text(
                reply
                    .next()
                    .ok_or_else(|| reply_error("claim", "fewer envelopes than counted"))?,
                "claim",
            )?;
            tasks.push(Taken {
                token: Some(format!("{seq}:{}", levels[level])),
                level,
                payload,
            });
            seq += 1;
        }
    }
    Ok(Batch { now_ms, tasks })
}

/// Default mode: pops up to `max` tasks from the highest non-empty level. With `block`, waits that long for a
/// task when all levels are empty (BLMPOP, which a plain RPUSH by any producer wakes at once).
pub fn pop(
    conn: &mut Connection,
    keys: &QueueKeys,
    max: usize,
    block: Option<Duration>,
) -> Result<Batch> {
    let mut pipe = redis::pipe();
    match block {
        Some(timeout) => {
            // Redis rounds blocking timeouts up to its 100 ms tick; the read timeout must outlast that.
            conn.set_read_timeout(Some(timeout + IO_TIMEOUT))?;
            pipe.cmd("BLMPOP").arg(timeout.as_secs_f64());
        }
        None => {
            pipe.cmd("LMPOP");
        }
    }
    pipe.arg(keys.levels())
        .arg(&keys.ready)
        .arg("LEFT")
        .arg("COUNT")
        .arg(max);
    // TIME runs after the pop returns, so it is Redis's clock when the tasks were taken.
    pipe.cmd("TIME");
    let result: redis::RedisResult<(Value, (i64, i64))> = pipe.query(conn);
    if block.is_some() {
        conn.set_read_timeout(Some(IO_TIMEOUT))?;
    }
    let (popped, (seconds, micros)) = result?;
    let now_ms = seconds * 1000 + micros / 1000;
    let mut tasks = Vec::new();
    if let Value::Array(mut parts) = popped {
        if parts.len() != 2 {
            return Err(reply_error("pop", format!("{} elements", parts.len())));
        }
        let items = parts.pop().unwrap_or(Value::Nil);
        let key = text(parts.pop().unwrap_or(Value::Nil), "pop")?;
        let level = keys
            .ready
            .iter()
            .position(|k| *k == key)
            .ok_or_else(|| reply_error("pop", format!("unknown key {key}")))?;
        if let Value::Array(items) = items {
            for item in items {
                tasks.push(Taken {
                    token: None,
                    level,
                    payload: text(item, "pop")?,
                });
            }
        }
    }
    Ok(Batch { now_ms, tasks })
}

/// Safe mode: waits up to `timeout` for a wake-up marker. Returns whether one came.
pub fn wait_wake(conn: &mut Connection, keys: &QueueKeys, timeout: Duration) -> Result<bool> {
    conn.set_read_timeout(Some(timeout + IO_TIMEOUT))?;
    let result: redis::RedisResult<Option<(String, String)>> = redis::cmd("BLPOP")
        .arg(&keys.wake)
        .arg(timeout.as_secs_f64())
        .query(conn);
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    Ok(result?.is_some())
}

/// What happens to a settled task; see settle.lua.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SettleOp {
    Ack,
    Retry { delay: Duration },
    Back,
    Dead,
}

/// One outcome to apply to Redis.
#[derive(Clone, Debug)]
pub struct Settlement {
    pub op: SettleOp,
    /// Safe mode: the claim token; `None` in default mode.
    pub token: Option<String>,
    /// Released on ack or dead-letter when the task is unique.
    pub unique_id: Option<String>,
    pub level: usize,
    /// Retry/back: the envelope to queue; dead: the dead record (a JSON object); ack: unused.
    pub payload: String,
    /// Whether this run counts as a failed attempt.
    pub failed: bool,
}

/// Who is settling: the owner of the claim, or a monitor recovering an expired lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    Owner,
    Expired,
}

/// Applies many outcomes in one round trip. Returns, per settlement, whether it applied (false: stale).
pub fn settle(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    fence: Fence,
    dead_max: usize,
    settlements: &[Settlement],
) -> Result<Vec<bool>> {
    let mut invocation = SCRIPTS.settle.prepare_invoke();
    invocation
        .key(&keys.processing)
        .key(&keys.leases)
        .key(&keys.stats)
        .key(&keys.dead)
        .key(&keys.unique)
        .key(&keys.wake);
    for ready in &keys.ready {
        invocation.key(ready);
    }
    for retry in &keys.retry {
        invocation.key(retry);
    }
    invocation
        .arg(match fence {
            Fence::Owner => "owner",
            Fence::Expired => "expired",
        })
        .arg(dead_max)
        .arg(keys.levels())
        .arg(&keys.delay_channel);
    for s in settlements {
        let (op, delay_ms) = match &s.op {
            SettleOp::Ack => ("ack", 0),
            SettleOp::Retry { delay } => ("retry", delay.as_millis() as u64),
            SettleOp::Back => ("back", 0),
            SettleOp::Dead => ("dead", 0),
        };
        invocation
            .arg(op)
            .arg(s.token.as_deref().unwrap_or(""))
            .arg(s.unique_id.as_deref().unwrap_or(""))
            .arg(s.level + 1)
            .arg(delay_ms)
            .arg(&s.payload)
            .arg(if s.failed { "1" } else { "0" });
    }
    let applied: Vec<i64> = invocation.invoke(conn)?;
    if applied.len() != settlements.len() {
        return Err(reply_error(
            "settle",
            format!(
                "{} results for {} records",
                applied.len(),
                settlements.len()
            ),
        ));
    }
    Ok(applied.into_iter().map(|ok| ok == 1).collect())
}

/// Safe mode: renews the leases of `tokens`. Returns the tokens whose lease was already gone (recovered by a
/// monitor because this daemon was silent too long).
pub fn renew(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    lease: Duration,
    tokens: &[&str],
) -> Result<Vec<String>> {
    if tokens.is_empty() {
        return Ok(Vec::new());
    }
    let mut invocation = SCRIPTS.renew.prepare_invoke();
    invocation.key(&keys.leases).arg(lease.as_millis() as u64);
    for token in tokens {
        invocation.arg(*token);
    }
    Ok(invocation.invoke(conn)?)
}

/// Safe mode: up to `max` tasks whose lease ran out, with Redis's clock.
pub fn expired(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    max: usize,
) -> Result<(i64, Vec<(String, String)>)> {
    let reply: Vec<Value> = SCRIPTS
        .expired
        .key(&keys.leases)
        .key(&keys.processing)
        .arg(max)
        .invoke(conn)?;
    let mut reply = reply.into_iter();
    let now_ms = int(&reply.next().unwrap_or(Value::Nil), "expired")?;
    let mut found = Vec::new();
    while let Some(token) = reply.next() {
        let envelope = reply
            .next()
            .ok_or_else(|| reply_error("expired", "token without envelope"))?;
        found.push((text(token, "expired")?, text(envelope, "expired")?));
    }
    Ok((now_ms, found))
}

/// Moves up to `max` due tasks to their ready lists. Returns how many moved and how long until the next one is
/// due (`None`: nothing is delayed).
pub fn promote(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    max: usize,
) -> Result<(usize, Option<Duration>)> {
    let mut invocation = SCRIPTS.promote.prepare_invoke();
    invocation.key(&keys.wake).key(&keys.delayed_tasks);
    for key in keys.ready.iter().chain(&keys.delayed).chain(&keys.retry) {
        invocation.key(key);
    }
    let (moved, next_ms): (i64, i64) = invocation.arg(max).invoke(conn)?;
    Ok((
        moved as usize,
        (next_ms >= 0).then(|| Duration::from_millis(next_ms as u64)),
    ))
}

/// What became of an attempt to fire a periodic task's slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fired {
    /// This call queued the task.
    Now,
    /// The slot (or a later one) was fired already, by this daemon or another.
    Already,
    /// The slot is still in the future on Redis's clock.
    NotYet,
}

/// Fires `slot` of the schedule `name`: queues `envelope` on `level` unless the slot was fired already.
/// Returns what happened and Redis's clock.
pub fn fire(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    level: usize,
    name: &str,
    slot_ms: i64,
    envelope: &str,
) -> Result<(Fired, i64)> {
    let (result, now_ms): (i64, i64) = SCRIPTS
        .fire
        .key(&keys.schedules)
        .key(&keys.ready[level])
        .key(&keys.wake)
        .key(&keys.stats)
        .arg(name)
        .arg(slot_ms)
        .arg(envelope)
        .invoke(conn)?;
    let fired = match result {
        1 => Fired::Now,
        0 => Fired::Already,
        _ => Fired::NotYet,
    };
    Ok((fired, now_ms))
}

/// The last slot fired for the schedule `name` (if any) and Redis's clock.
pub fn schedule_state(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    name: &str,
) -> Result<(Option<i64>, i64)> {
    let (last, (seconds, micros)): (Option<i64>, (i64, i64)) = redis::pipe()
        .cmd("HGET")
        .arg(&keys.schedules)
        .arg(name)
        .cmd("TIME")
        .query(conn)?;
    Ok((last, seconds * 1000 + micros / 1000))
}

/// Records the protocol version in the queue's meta hash, or refuses keys written by another version.
pub fn check_protocol(conn: &mut dyn ConnectionLike, keys: &QueueKeys, queue: &str) -> Result<()> {
    let (_, found): (i64, String) = redis::pipe()
        .cmd("HSETNX")
        .arg(&keys.meta)
        .arg("protocol")
        .arg(PROTOCOL_VERSION)
        .cmd("HGET")
        .arg(&keys.meta)
        .arg("protocol")
        .query(conn)?;
    if found != PROTOCOL_VERSION.to_string() {
        return Err(BrokerError::ProtocolVersion {
            queue: queue.to_string(),
            found,
            expected: PROTOCOL_VERSION,
        });
    }
    Ok(())
}

/// A queue's depth and counters, as `kmqd stats` shows them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct QueueStats {
    /// Tasks waiting in the ready lists.
    pub ready: u64,
    /// Ready tasks per level, highest first (a JSON object in level order).
    #[serde(serialize_with = "pairs_as_map")]
    pub ready_by_level: Vec<(String, u64)>,
    /// Safe mode: tasks claimed and not yet settled.
    pub processing: u64,
    /// Tasks waiting for their due time, retries in backoff included.
    pub delayed: u64,
    /// Of `delayed`, the retries waiting out their backoff.
    pub retrying: u64,
    /// Records in the dead-letter list (bounded by `dead_max`).
    pub dead: u64,
    /// Tasks accepted by the enqueue script (plain RPUSH producers are not counted).
    pub pushed: u64,
    /// Tasks acknowledged.
    pub done: u64,
    /// Tasks queued again for another attempt.
    pub retried: u64,
    /// Runs that failed (handler error, panic, timeout, lost lease).
    pub failed: u64,
    /// Tasks moved to the dead-letter list.
    pub dead_lettered: u64,
    /// Waiting tasks removed by `task cancel` (or `Client::cancel`).
    pub cancelled: u64,
    /// Age of the oldest task at the head of a ready list, ms; `None` when nothing is ready.
    pub lag_ms: Option<i64>,
}

fn pairs_as_map<S: serde::Serializer>(
    pairs: &[(String, u64)],
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    serializer.collect_map(pairs.iter().map(|(k, v)| (k, v)))
}

/// Reads a queue's depth and counters in one round trip.
pub fn stats(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    levels: &[String],
) -> Result<QueueStats> {
    let mut pipe = redis::pipe();
    pipe.cmd("TIME");
    for key in &keys.ready {
        pipe.cmd("LLEN").arg(key);
    }
    for key in &keys.ready {
        pipe.cmd("LINDEX").arg(key).arg(0);
    }
    for key in keys.delayed.iter().chain(&keys.retry) {
        pipe.cmd("ZCARD").arg(key);
    }
    pipe.cmd("HLEN").arg(&keys.processing);
    pipe.cmd("LLEN").arg(&keys.dead);
    pipe.cmd("HGETALL").arg(&keys.stats);
    type Reply = (
        (i64, i64),
        Vec<u64>,
        Vec<Option<Vec<u8>>>,
        Vec<u64>,
        u64,
        u64,
        HashMap<String, u64>,
    );
    // The pipeline's replies in order, grouped as the commands above.
    let mut replies: Vec<Value> = pipe.query(conn)?;
    let level_count = levels.len();
    let mut take = |n: usize| -> Value {
        let group: Vec<Value> = replies.drain(..n.min(replies.len())).collect();
        if n == 1 {
            group.into_iter().next().unwrap_or(Value::Nil)
        } else {
            Value::Array(group)
        }
    };
    let reply: Reply = (
        parse(take(1), "stats")?,
        parse(list(take(level_count)), "stats")?,
        parse(list(take(level_count)), "stats")?,
        parse(list(take(2 * level_count)), "stats")?,
        parse(take(1), "stats")?,
        parse(take(1), "stats")?,
        parse(take(1), "stats")?,
    );
    let ((seconds, micros), ready_counts, heads, zset_counts, processing, dead, counters) = reply;
    let now_ms = seconds * 1000 + micros / 1000;
    let lag_ms = heads
        .into_iter()
        .flatten()
        .filter_map(|head| {
            Envelope::decode(&String::from_utf8_lossy(&head))
                .ok()?
                .created_at
        })
        .map(|created_at| (now_ms - created_at).max(0))
        .max();
    let counter = |name: &str| counters.get(name).copied().unwrap_or(0);
    let retrying: u64 = zset_counts[level_count..].iter().sum();
    Ok(QueueStats {
        ready: ready_counts.iter().sum(),
        ready_by_level: levels.iter().cloned().zip(ready_counts).collect(),
        processing,
        delayed: zset_counts.iter().sum(),
        retrying,
        dead,
        pushed: counter("pushed"),
        done: counter("done"),
        retried: counter("retried"),
        failed: counter("failed"),
        dead_lettered: counter("dead_lettered"),
        cancelled: counter("cancelled"),
        lag_ms,
    })
}

/// A group of pipelined replies that is a list even when it has one element.
fn list(value: Value) -> Value {
    match value {
        Value::Array(items) => Value::Array(items),
        single => Value::Array(vec![single]),
    }
}

fn parse<T: redis::FromRedisValue>(value: Value, what: &'static str) -> Result<T> {
    redis::from_redis_value(value).map_err(|error| reply_error(what, error.to_string()))
}
