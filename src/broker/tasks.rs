//! A task's life in Redis: push, claim (safe) or pop (default), settle, owners and their leases, promote.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use redis::{ConnectionLike, Value};

use super::Conn;
use crate::config::rate::RateLimit;
use crate::config::{Groups, TypeLimit};

use super::keys::{self, QUARANTINE_GROUPS};
use super::payloads::{Gather, Payloads};
use super::{BrokerError, QueueKeys, Result, SCRIPTS, Token, TokenId, int, reply_error};

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
    pub(crate) id: &'a str,
    /// Hold the id while the task is live, refusing other pushes of it.
    pub(crate) unique: bool,
    /// Replace the delayed task of this id at this level, if one waits (docs/PROTOCOL.md, "Debounce, and unique
    /// for a time"); the call must delay.
    pub(crate) debounce: bool,
    /// With `unique`: the id stays held this many ms after the task ended (0: freed as it ends; docs/PROTOCOL.md,
    /// "Debounce, and unique for a time").
    pub(crate) unique_for_ms: u64,
    pub(crate) envelope: &'a str,
}

/// Runs the enqueue script for tasks of one level. Returns, per task, whether it was accepted.
pub fn push(
    conn: &mut Conn,
    keys: &QueueKeys,
    level: usize,
    due: Due,
    items: &[PushItem<'_>],
) -> Result<Vec<bool>> {
    let (after_ms, at_ms) = match due {
        Due::Now => (0, 0),
        // A delay longer than an i64 of milliseconds holds (about 292 million years) is held at that: cast, it
        // wrapped to a negative one, and the task ran at once (the review's L11).
        Due::After(after) => (
            i64::try_from(after.as_millis()).unwrap_or(i64::MAX).max(1),
            0,
        ),
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
        .key(keys.routes())
        .arg(after_ms)
        .arg(at_ms)
        .arg(&keys.delay_channel);
    for item in items {
        invocation
            .arg(item.id)
            .arg(match (item.unique, item.debounce, item.unique_for_ms) {
                (_, true, _) => Cow::Borrowed("debounce"),
                (true, false, 0) => Cow::Borrowed("1"),
                (true, false, ms) => Cow::Owned(format!("unique_for={ms}")),
                (false, false, _) => Cow::Borrowed("0"),
            })
            .arg(item.envelope);
    }
    let accepted: Vec<i64> = invocation.invoke(conn)?;
    conn.replicated(&keys.stats)?;
    if accepted.len() != items.len() {
        return Err(reply_error(
            "push",
            format!("{} results for {} tasks", accepted.len(), items.len()),
        ));
    }
    Ok(accepted.into_iter().map(|ok| ok == 1).collect())
}

/// A task taken from a ready list; its payload is the one of the same index in its batch's `payloads`.
#[derive(Debug)]
pub struct Fetched {
    /// Safe mode: the claim token that fences its settlement; `None` in default mode.
    pub token: Option<Token>,
    /// Default mode: the owner that popped it, when Redis keeps something of the task under that owner: its
    /// running slot (a running limit: the owner's share of the count, which its settlement subtracts from) or
    /// its unique id (`holds_unique`). `None` otherwise: the task left Redis for good.
    pub(crate) popped_by: Option<Arc<str>>,
    /// Default mode: the running count of its type (`t:TYPE`, a `[[queues.limits]]` entry with `max_running`) that
    /// pop.lua counted it in, under `popped_by`'s share: its settlement names it, so that settle.lua subtracts it
    /// there (pop.lua, "Type limits"). `None`: counted in no type's count.
    pub(crate) popped_scope: Option<Arc<str>>,
    /// Default mode: pop.lua recorded the task's unique id as held by `popped_by` (the unique-popped hash). The
    /// id is freed by this task's settlement only while that owner still holds it, and the task starts only
    /// while that owner's lease is surely live: once it ran out, a monitor frees the id and a newer task with it
    /// may run (pop.lua, "The holder").
    pub holds_unique: bool,
    /// Index of the level it came from.
    pub level: usize,
}

/// The result of one claim or pop.
#[derive(Debug, Default)]
pub struct Batch {
    /// Redis's clock when the tasks were taken, ms since the epoch.
    pub(crate) now_ms: i64,
    pub tasks: Vec<Fetched>,
    /// The tasks' envelopes as stored (not yet decoded; not necessarily UTF-8), in the order of `tasks`.
    pub payloads: Payloads,
    /// Safe mode, a claim: the time left of the owner's lease at `now_ms` (its deadline minus `now_ms`, ms), by
    /// which the daemon sees Redis's clock step under its lease (`daemon::lane::ownership`).
    pub(crate) lease_left_ms: Option<i64>,
    /// Safe mode: whether the claim ran into the quarantine (see claim.lua).
    pub isolation: Isolation,
    /// The queue is paused (`kmqd queue pause`): nothing was taken, and the fetcher waits `idle_poll` before it
    /// looks again, instead of blocking on a list that may well hold tasks.
    pub(crate) paused: bool,
    /// Safe mode: nothing was taken, because a limit of the queue's held every task back.
    pub(crate) limited: Option<Limited>,
    /// Safe mode: tasks were taken, and they filled the queue's `max_running` (claim.lua's state 8): a claim
    /// before a settle frees a slot would take nothing, so the fetcher waits for the settle's wake-up marker
    /// first.
    pub(crate) running_full: bool,
}

/// Which of a queue's limits held a claim back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limited {
    /// `max_running` of its tasks are taken and not yet settled: a settle that frees some pushes a wake-up marker.
    Running,
    /// A window of its `rate_limit` is full until `retry_at_ms` (Redis's clock), when its oldest start ages out.
    Rate { retry_at_ms: i64 },
    /// A handler throttled the queue (back-pressure) until `retry_at_ms` (the batch's clock: Redis's, or 0 for a
    /// plain pop, whose batch carries no time).
    Throttle { retry_at_ms: i64 },
    /// Tasks wait, but their types' limits (`[[queues.limits]]`) hold every one back: a settle that frees a
    /// type's slot, or a push, pushes a wake-up marker; a type's rate window lets a start go at `retry_at_ms`
    /// (Redis's clock; 0: none is waiting for its rate).
    Types { retry_at_ms: i64 },
}

impl Limited {
    /// Until when (the batch's clock) the fetcher should not fetch again; `None`: until a settle's wake-up.
    pub(crate) fn retry_at_ms(self) -> Option<i64> {
        match self {
            // Other tasks may come meanwhile: the fetcher waits for a wake-up marker, at most until then.
            Limited::Running | Limited::Types { .. } => None,
            Limited::Rate { retry_at_ms } | Limited::Throttle { retry_at_ms } => Some(retry_at_ms),
        }
    }

    /// The config key (or outcome) that held the fetch back, for the log.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Limited::Running => "max_running",
            Limited::Rate { .. } => "rate_limit",
            Limited::Throttle { .. } => "throttle",
            Limited::Types { .. } => "limits",
        }
    }
}

/// The journal that ends a claim's, an adoption's or a settle's reply.
fn journal(value: Option<Value>, what: &'static str) -> Result<u64> {
    Ok(int(&value.unwrap_or(Value::Nil), what)?.max(0) as u64)
}

/// What a claim's quarantine rule did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Isolation {
    /// Ready tasks, or nothing, as usual.
    #[default]
    None,
    /// The tasks are one quarantined group, to run with nothing else.
    Group,
    /// Nothing was claimed: quarantined tasks wait to run alone, and this owner must first settle what it holds.
    Waiting,
}

/// What a claim needs beyond the owner and its tokens: how a payload that is too large is dead-lettered.
#[derive(Clone, Copy, Debug)]
pub struct ClaimLimits<'a> {
    /// A payload longer than this is dead-lettered by the claim itself, never handed to the daemon.
    pub max_task_bytes: usize,
    pub dead_max: usize,
    /// For the dead record: the queue's name and `host:pid` of the daemon.
    pub queue: &'a str,
    pub daemon: &'a str,
    /// The queue's `max_running`: the claim takes no more than leaves the queue's count of tasks taken and not yet
    /// settled, across every daemon, at most this.
    pub max_running: Option<usize>,
    /// The queue's `rate_limit`: the claim takes no more than every window's log of starts leaves.
    pub rate_limit: &'a [RateLimit],
    /// The queue's `priority_weights` (empty: strict order): the claim splits its tasks between the levels that
    /// have some by their turns (turns.lua).
    pub priority_weights: &'a [u32],
    /// The queue's `[[queues.limits]]`: the claim takes a task of a listed type only while its type's limits
    /// admit it too, and moves the others of the type to its flow (claim.lua, "Type limits").
    pub type_limits: &'a [TypeLimit],
    /// Flows (ring members) that hold tasks though this config neither limits their type nor has groups
    /// (another config's, or this one's before a reload): the claim drains them, unlimited, and routes nothing to
    /// them.
    pub drained_flows: &'a [String],
    /// The queue's `[queues.groups]`: the claim takes turns between the groups' flows, each group within its
    /// limits (groups.lua).
    pub groups: Option<&'a Groups>,
    /// The queue's `foreign_type_field`: where a foreign payload's type is, for the routing of type limits.
    pub foreign_type_field: Option<&'a str>,
}

/// The type-limit block (types.lua) of claim.lua and pop.lua: its keys, which follow the script's, and its
/// arguments, which follow the weights. The flows of `type_limits` come first, in their order (pop.lua's reply
/// names a task's counted type by its index among them), then the `drained_flows`.
fn type_block(
    keys: &QueueKeys,
    type_limits: &[TypeLimit],
    drained_flows: &[String],
    foreign_type_field: Option<&str>,
) -> (Vec<String>, Vec<String>) {
    let flows = type_limits.len() + drained_flows.len();
    let mut args = vec![
        flows.to_string(),
        foreign_type_field.unwrap_or("").to_string(),
    ];
    if flows == 0 {
        return (Vec::new(), args);
    }
    let mut block_keys = keys.rings();
    // A drained flow is named by its member, which stands in for its type: nothing is routed to it, and it has
    // no limit (so its throttle's name, built from the member, is never read).
    let drained = drained_flows
        .iter()
        .map(|member| (member, member.clone(), None, &[][..]));
    let limited = type_limits.iter().map(|limit| {
        (
            &limit.kind,
            keys::flow_member(&limit.kind),
            limit.max_running,
            &limit.rate_limit[..],
        )
    });
    for (kind, member, max_running, rates) in limited.chain(drained) {
        block_keys.extend((0..keys.levels()).map(|level| keys.flow(level, &member)));
        block_keys.push(keys.type_throttle(kind));
        let scope = keys::type_scope(kind);
        args.extend([
            kind.clone(),
            member,
            scope,
            max_running.unwrap_or(0).to_string(),
            rates.len().to_string(),
        ]);
        for rate in rates {
            let (log, sum) = keys.type_rate_log(kind, rate.window_ms());
            block_keys.extend([log, sum]);
            args.extend([rate.window_ms().to_string(), rate.starts.to_string()]);
        }
    }
    (block_keys, args)
}

/// claim.lua's groups block (groups.lua): its keys (the levels' rings, the sched hash), which end the claim's, and
/// its arguments, which follow the types'.
fn group_block(keys: &QueueKeys, groups: Option<&Groups>) -> (Vec<String>, Vec<String>) {
    let Some(groups) = groups else {
        return (Vec::new(), vec!["0".to_string()]);
    };
    let mut block_keys = keys.rings();
    block_keys.push(keys.sched.clone());
    let mut args = vec!["1".to_string(), keys.base().to_string()];
    args.extend(keys.levels.iter().cloned());
    args.push(groups.max_running.unwrap_or(0).to_string());
    args.push(groups.rate_limit.len().to_string());
    for rate in &groups.rate_limit {
        args.extend([rate.window_ms().to_string(), rate.starts.to_string()]);
    }
    args.push(groups.weights.len().to_string());
    for (group, weight) in &groups.weights {
        args.extend([keys::encode_name(group), weight.to_string()]);
    }
    (block_keys, args)
}

/// The most bytes of ready tasks one safe-mode claim takes, unless its first task is larger (claim.lua, "Bytes"):
/// the pop's budget, for the same reason (a claim of a thousand tasks of 16 MiB would be 16 GiB in one reply, held
/// by the daemon and buffered by Redis; review M8).
pub const CLAIM_BYTES: usize = POP_BYTES;

/// Safe mode: claims up to `max` tasks into `owner`'s claim lists: a quarantined group, alone, when there is one
/// and the owner holds nothing; otherwise ready tasks, highest level first (see claim.lua). `claim` names the
/// claim; the caller must not reuse any of the `max` numbers from `claim` on. When this call fails without a
/// reply, [`adopt`] with the same numbers says what it took.
///
/// A queue with no limit, weights or groups has its claims made by claim_plain.lua, made for it
/// (src/broker/plain_claim.rs), and by claim.lua when that script leaves one (having written nothing): both
/// answer alike.
pub fn claim(
    conn: &mut Conn,
    keys: &QueueKeys,
    owner: &Arc<str>,
    claim: u64,
    max: usize,
    limits: &ClaimLimits<'_>,
) -> Result<Batch> {
    claim_after(conn, keys, owner, claim, max, limits, (None, true))
}

/// [`claim`] by claim.lua whatever the queue: the tests that compare claim_plain.lua's answers and writes with
/// claim.lua's send the same call both ways.
#[doc(hidden)]
pub fn claim_generic(
    conn: &mut Conn,
    keys: &QueueKeys,
    owner: &Arc<str>,
    claim: u64,
    max: usize,
    limits: &ClaimLimits<'_>,
) -> Result<Batch> {
    claim_after(conn, keys, owner, claim, max, limits, (None, false))
}

/// Safe mode: as [`claim`], once a wake-up marker came (or `wait` passed without one; the reply may take
/// `io_timeout` more): the claim is sent behind a `BLPOP` of the wake list, in the same write, so that Redis runs
/// it as soon as a settle pushes the marker, without the marker's trip to the fetcher and the claim's back. For a
/// queue at its `max_running`, whose every slot waits for a settle's marker: the two trips were a third of the
/// time from a settle that frees a slot to the next claim (docs/PERFORMANCE.md, "Limits: `max_running` and
/// `rate_limit`"). On a cluster's connection, the wait and then the claim.
#[allow(
    clippy::too_many_arguments,
    reason = "claim's arguments and the wait's two"
)]
pub fn claim_after_wake(
    conn: &mut Conn,
    keys: &QueueKeys,
    owner: &Arc<str>,
    claim: u64,
    max: usize,
    limits: &ClaimLimits<'_>,
    wait: Duration,
    io_timeout: Duration,
) -> Result<Batch> {
    if !conn.is_node() {
        wait_wake(conn, keys, wait, io_timeout)?;
        return self::claim(conn, keys, owner, claim, max, limits);
    }
    conn.set_read_timeout(Some(wait + io_timeout))?;
    let batch = claim_after(conn, keys, owner, claim, max, limits, (Some(wait), true));
    conn.set_read_timeout(Some(io_timeout))?;
    batch
}

impl ClaimLimits<'_> {
    /// Whether nothing but `max_running` (if set) counts this queue's claims: no rate limit, priority weights, type
    /// limits, drained flows or groups. The scripts made for the plain queue (claim_plain.lua, handover_plain.lua)
    /// are made for such claims alone.
    pub(super) fn none_but_max_running(&self, keys: &QueueKeys) -> bool {
        self.rate_limit.is_empty()
            && self.priority_weights.is_empty()
            && self.type_limits.is_empty()
            && self.drained_flows.is_empty()
            && self.groups.is_none()
            && !keys.grouped
    }
}

/// claim.lua's keys and arguments for claim number `claim` of up to `max` tasks: a claim's own call, or the claim
/// block of a settle that hands its freed slots over ([`settle_handing_over`]).
fn claim_call(
    keys: &QueueKeys,
    owner: &Arc<str>,
    claim: u64,
    max: usize,
    limits: &ClaimLimits<'_>,
) -> (Vec<String>, Vec<String>) {
    let mut script_keys = vec![
        keys.owners.clone(),
        keys.wake.clone(),
        keys.owner_info(owner),
        keys.dead.clone(),
        keys.stats.clone(),
        keys.paused.clone(),
        keys.throttle.clone(),
    ];
    script_keys.extend(keys.ready.iter().chain(&keys.quarantine).cloned());
    script_keys.extend(keys.processing_all(owner));
    script_keys.extend(keys.claim_lists(owner, claim));
    script_keys.extend(keys.claim_scopes_all(owner, claim));
    script_keys.push(keys.running.clone());
    for rate in limits.rate_limit {
        let (log, sum) = keys.rate_log(rate.window_ms());
        script_keys.push(log);
        script_keys.push(sum);
    }
    if !limits.priority_weights.is_empty() {
        script_keys.push(keys.sched.clone());
    }
    let (type_keys, type_args) = type_block(
        keys,
        limits.type_limits,
        limits.drained_flows,
        limits.foreign_type_field,
    );
    script_keys.extend(type_keys);
    let (group_keys, group_args) = group_block(keys, limits.groups);
    script_keys.extend(group_keys);
    let mut args = vec![
        owner.to_string(),
        max.to_string(),
        limits.max_task_bytes.to_string(),
        limits.dead_max.to_string(),
        limits.queue.to_string(),
        limits.daemon.to_string(),
        claim.to_string(),
        limits.max_running.unwrap_or(0).to_string(),
        limits.rate_limit.len().to_string(),
    ];
    for rate in limits.rate_limit {
        args.extend([rate.window_ms().to_string(), rate.starts.to_string()]);
    }
    args.push(limits.priority_weights.len().to_string());
    args.extend(limits.priority_weights.iter().map(u32::to_string));
    args.extend(type_args);
    args.extend(group_args);
    args.push(CLAIM_BYTES.to_string());
    (script_keys, args)
}

/// [`claim`], after a `BLPOP` of the wake list of up to `wait` when there is one.
fn claim_after(
    conn: &mut Conn,
    keys: &QueueKeys,
    owner: &Arc<str>,
    claim: u64,
    max: usize,
    limits: &ClaimLimits<'_>,
    (wait, lean): (Option<Duration>, bool),
) -> Result<Batch> {
    let lists = keys.claim_lists(owner, claim);
    let (script_keys, args) = claim_call(keys, owner, claim, max, limits);
    // claim_plain.lua first when it is made for the queue (and `lean`); whatever it leaves (GENERIC, having
    // written nothing) goes to claim.lua, with the same keys, arguments and claim number.
    let mut first = if lean {
        super::plain_claim::first(keys, limits)
    } else {
        None
    };
    let mut wake = wait.map(|wait| (keys.wake.as_str(), wait));
    let (reply, taken, collected) = loop {
        let (script, source) = first.unwrap_or((&SCRIPTS.claim, super::sources::CLAIM));
        let mut eval = evalsha(script, &script_keys);
        eval.arg(&args);
        match script_then_lists(conn, source, &eval, &lists, wake) {
            Err(error) if first.is_some() && error.code() == Some("GENERIC") => {
                first = None;
                // The wait returned (with the marker, if one came): the claim goes at once.
                wake = None;
            }
            outcome => break outcome.map_err(|error| owner_error(error, owner))?,
        }
    };
    // Not replicated: a may-have-run error, which the fetcher resolves with adopt() as a lost reply.
    conn.replicated(&keys.stats)?;
    let reply: Vec<Value> = redis::from_redis_value(reply).map_err(redis::RedisError::from)?;
    claim_batch(keys, owner, claim, reply, taken, collected)
}

/// A claim's [`Batch`]: claim.lua's reply (6 + L integers) and the claim's lists, read in its transaction.
fn claim_batch(
    keys: &QueueKeys,
    owner: &Arc<str>,
    claim: u64,
    reply: Vec<Value>,
    taken: Vec<Value>,
    collected: Payloads,
) -> Result<Batch> {
    if reply.len() != 6 + keys.levels() {
        return Err(reply_error("claim", format!("{} elements", reply.len())));
    }
    let mut reply = reply.into_iter();
    let lease_left_ms = int(&reply.next_back().unwrap_or(Value::Nil), "claim")?;
    // The owner's journal after the claim: read only to check the reply's shape. The daemon counts the claims
    // that took tasks itself (lane/ownership.rs), which is what renew.lua checks Redis's journal against.
    journal(reply.next_back(), "claim")?;
    let retry_at_ms = int(&reply.next_back().unwrap_or(Value::Nil), "claim")?;
    let mut next_int = || int(&reply.next().unwrap_or(Value::Nil), "claim");
    let now_ms = next_int()?;
    let state = next_int()?;
    let (tasks, payloads) = claimed(owner, claim, taken, collected, "claim")?;
    Ok(Batch {
        now_ms,
        tasks,
        payloads,
        lease_left_ms: Some(lease_left_ms),
        isolation: match state {
            1 => Isolation::Group,
            2 => Isolation::Waiting,
            _ => Isolation::None,
        },
        paused: state == 3,
        limited: match state {
            4 => Some(Limited::Running),
            5 => Some(Limited::Rate { retry_at_ms }),
            6 => Some(Limited::Throttle { retry_at_ms }),
            7 => Some(Limited::Types { retry_at_ms }),
            _ => None,
        },
        running_full: state == 8,
    })
}

/// The size from which Redis (7.0, networking.c) reads an argument into a buffer of its own and keeps one as large
/// for the connection's next argument (`PROTO_MBULK_BIG_ARG`): see [`load_settle`].
pub(super) const LARGE_ARGUMENT: usize = 32 * 1024;

/// A script call's keys, gathered before its arguments (the `EVALSHA` names their count first).
#[derive(Default)]
pub(super) struct ScriptKeys(Vec<Vec<u8>>);

impl ScriptKeys {
    pub(super) fn key(&mut self, key: impl redis::ToRedisArgs) -> &mut Self {
        key.write_redis_args(&mut self.0);
        self
    }

    /// The `EVALSHA` of `script` with these keys; the arguments follow.
    pub(super) fn evalsha(self, script: &redis::Script) -> redis::Cmd {
        let mut eval = redis::cmd("EVALSHA");
        eval.arg(script.get_hash()).arg(self.0.len()).arg(self.0);
        eval
    }
}

/// Loads settle.lua into Redis's script cache; `conn` must be a connection that has sent no large argument
/// (a new one), which is why [`settle`] reloads the script itself on NOSCRIPT only after a call that carried none
/// ([`LARGE_ARGUMENT`]), and otherwise leaves it to its caller.
///
/// Redis (7.0 at least, networking.c) reads an argument of 32 KiB or more into a buffer of its own and then
/// keeps a buffer as large for the connection's next one, "assuming" another large argument follows; the
/// next argument of 32 KiB or more is stored in that buffer as it is. settle.lua is over 32 KiB, and its call
/// carries records: reloaded on the connection whose call with a record of N MiB just got NOSCRIPT, the
/// script's source would be cached in a buffer of N MiB for as long as the cache lives (seen: 16.9 MB of
/// `used_memory_scripts` after a 15 MiB recovery, which put Redis over its `maxmemory` and refused every
/// settle and claim after it; it/budgets::a_recovery_redis_refuses_is_left_for_a_later_pass_and_the_others_go).
pub fn load_settle(conn: &mut Conn) -> Result<()> {
    SCRIPTS.settle.load(conn)?;
    Ok(())
}

/// `EVALSHA` of `script` with `keys`, for a transaction (the arguments follow).
fn evalsha(script: &redis::Script, keys: &[String]) -> redis::Cmd {
    let mut eval = redis::cmd("EVALSHA");
    eval.arg(script.get_hash()).arg(keys.len()).arg(keys);
    eval
}

/// Runs `eval` (an [`evalsha`] of `script`, whose source is `source`), then reads each of `lists` whole, in one
/// transaction: the claim's tasks come back from Redis as list elements, never as Lua strings
/// (docs/PERFORMANCE.md, "What at-least-once costs Redis"). Returns the script's reply, each list, and the
/// lists' elements kmqd's own connection read into one buffer (see [`claimed`]). A server that lost its script
/// cache (a restart, a failover) gets the script loaded (on the node of the lists, in a cluster) and the
/// transaction again: the script did not run, so the lists it would have filled are empty and nothing was taken.
pub(super) fn script_then_lists(
    conn: &mut Conn,
    source: &str,
    eval: &redis::Cmd,
    lists: &[String],
    mut wake: Option<(&str, Duration)>,
) -> redis::RedisResult<(Value, Vec<Value>, Payloads)> {
    let mut loaded = false;
    loop {
        let mut pipe = redis::pipe();
        if let Some((list, wait)) = wake {
            // The transaction spelt out, behind the BLPOP: Redis reads it only once the BLPOP returns. A node's
            // connection only (`claim_after_wake`).
            pipe.ignore_errors()
                .cmd("BLPOP")
                .arg(list)
                .arg(wait.as_secs_f64())
                .ignore()
                .cmd("MULTI")
                .ignore()
                .add_command(eval.clone())
                .ignore();
            for list in lists {
                pipe.cmd("LRANGE").arg(list).arg(0).arg(-1).ignore();
            }
            pipe.cmd("EXEC");
        } else {
            pipe.atomic().ignore_errors().add_command(eval.clone());
            for list in lists {
                pipe.cmd("LRANGE").arg(list).arg(0).arg(-1);
            }
        }
        // The EXEC's reply is depth 1, each list depth 2, their elements (the tasks) depth 3 (the BLPOP's
        // marker is at depth 2).
        let outcome = conn.with_payloads(3, |conn| {
            let replies = pipe.query::<Vec<Value>>(conn)?;
            if wake.is_none() {
                return Ok(replies);
            }
            // The EXEC's, the only one not ignored.
            match replies.into_iter().next() {
                Some(Value::Array(replies)) => Ok(replies),
                Some(Value::ServerError(error)) => Err(error.into()),
                other => Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "a transaction's reply",
                    format!("{other:?}"),
                ))),
            }
        });
        // A cluster connection reports an error inside the transaction as the call's error; a node's leaves it
        // in its place among the replies.
        let outcome = outcome.and_then(|(replies, collected)| {
            let mut replies = replies.into_iter();
            let reply = replies.next().unwrap_or(Value::Nil).extract_error()?;
            // A list's reply is an error or the list: its elements are strings (not `extract_error`, which walks
            // and rebuilds every list, element by element).
            let lists = replies
                .map(|list| match list {
                    Value::ServerError(error) => Err(error.into()),
                    list => Ok(list),
                })
                .collect::<redis::RedisResult<Vec<Value>>>()?;
            Ok((reply, lists, collected))
        });
        match outcome {
            Err(error) if !loaded && is_no_script(&error) => {
                let load = redis::cmd("SCRIPT").arg("LOAD").arg(source).clone();
                let key = lists.first().map_or("", String::as_str);
                let _: String = conn.query_at(key, &load)?;
                loaded = true;
                // The BLPOP returned (and took the marker, if one came): the claim goes at once.
                wake = None;
            }
            outcome => return outcome,
        }
    }
}

/// Whether Redis had lost the script a call ran (a restart, a failover emptied its cache).
fn is_no_script(error: &redis::RedisError) -> bool {
    error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

/// The tasks of claim `claim`, read back from its lists (one per level, in level order), with their payloads
/// (`collected`: those kmqd's own connection read, see [`Gather`]).
fn claimed(
    owner: &Arc<str>,
    claim: u64,
    lists: Vec<Value>,
    collected: Payloads,
    what: &'static str,
) -> Result<(Vec<Fetched>, Payloads)> {
    let mut tasks = Vec::new();
    let mut payloads = Gather::new(collected);
    for (level, list) in lists.into_iter().enumerate() {
        let Value::Array(envelopes) = list else {
            return Err(reply_error(
                what,
                format!("level {level}: expected a list, got {list:?}"),
            ));
        };
        tasks.reserve(envelopes.len());
        for (position, envelope) in envelopes.into_iter().enumerate() {
            payloads.take(envelope, what)?;
            tasks.push(Fetched {
                token: Some(Token {
                    owner: Arc::clone(owner),
                    id: TokenId::Listed {
                        claim,
                        position: position as u32,
                    },
                }),
                popped_by: None,
                popped_scope: None,
                holds_unique: false,
                level,
            });
        }
    }
    Ok((tasks, payloads.finish(what)?))
}

/// Safe mode: what a claim whose reply was lost took, given its number and how many numbers it reserved: the
/// tasks in its lists, which the caller now holds. The lost claim, if Redis has not run it yet, will take nothing
/// (`adopt.lua` fences it off).
pub fn adopt(
    conn: &mut Conn,
    keys: &QueueKeys,
    owner: &Arc<str>,
    claim: u64,
    count: usize,
) -> Result<Batch> {
    let lists = keys.claim_lists(owner, claim);
    let mut script_keys = vec![keys.owners.clone(), keys.owner_info(owner)];
    script_keys.extend(lists.iter().cloned());
    let mut eval = evalsha(&SCRIPTS.adopt, &script_keys);
    eval.arg(&**owner).arg(claim).arg(count);
    let (reply, found, collected) =
        script_then_lists(conn, super::sources::ADOPT, &eval, &lists, None)
            .map_err(|error| owner_error(error, owner))?;
    conn.replicated(&keys.stats)?;
    // The journal before the adoption, like the claim's, is not kept: the daemon counts for itself.
    let (now_ms, _journal): (i64, i64) =
        redis::from_redis_value(reply).map_err(redis::RedisError::from)?;
    let (tasks, payloads) = claimed(owner, claim, found, collected, "adopt")?;
    Ok(Batch {
        now_ms,
        tasks,
        payloads,
        lease_left_ms: None,
        isolation: Isolation::None,
        paused: false,
        limited: None,
        running_full: false,
    })
}

/// The errors a script acting for an owner replies with, as [`BrokerError`]s the caller can act on.
fn owner_error(error: redis::RedisError, owner: &str) -> BrokerError {
    match error.code() {
        Some("LEASELOST") => BrokerError::LeaseLost {
            owner: owner.to_string(),
        },
        Some("FENCED") => BrokerError::Fenced {
            owner: owner.to_string(),
        },
        _ => error.into(),
    }
}

/// The smallest last pop after which the next one is plain: a plain pop costs a round trip more (the `WATCH`),
/// which outweighs what it saves Redis (0.5 µs per task) only for small batches, such as the first one after
/// an idle wait (docs/PERFORMANCE.md).
const PLAIN_POP_AFTER: usize = 32;

/// Default mode's pops, and what the last one learnt: whether the queue holds unique ids, which only pop.lua
/// can take (it records who popped each one, so that a daemon lost with the task does not leak its id), and
/// how many tasks it took.
#[derive(Debug, Default)]
pub struct Popper {
    /// No pop has said the queue holds none yet: pop.lua is always right, only slower.
    no_unique_held: bool,
    last_taken: usize,
}

impl Popper {
    /// Takes up to `max` tasks from the first non-empty list, each level's quarantine lists before its ready
    /// list, highest level first (a queue served in safe mode before keeps its recovered tasks there). The tasks
    /// leave Redis (at most once); unique ones keep their id held under `owner` until settled (see pop.lua).
    /// With no unique id held in the queue and a big batch expected, a plain `LMPOP` (Redis returns the
    /// payloads without converting them into Lua strings and back: 0.25 µs of Redis CPU per task against 0.8 µs
    /// through pop.lua, docs/PERFORMANCE.md); otherwise pop.lua.
    ///
    /// With a limit, always pop.lua, which counts the starts in the windows' logs as claim.lua does, and the tasks
    /// taken in the running count under `owner`'s share; with type limits (or flows to drain), it also sorts the
    /// tasks by type as claim.lua does (pop.lua, "Type limits"). A queue without any of them keeps the plain pop.
    ///
    /// With `wait`, once something may be there to pop (see [`wait_idle`]: up to `wait.0`; the reply may take
    /// `wait.1`, the I/O timeout, more): on a node's connection pop.lua is sent behind the blocking wait, in the
    /// same write, so that Redis runs it as soon as a push ends the wait, without the wait's reply's trip to the
    /// fetcher and the pop's back (docs/PERFORMANCE.md, "Push to start on an idle queue"). On a cluster's
    /// connection, the wait and then the pop. A reply lost is a pop's reply lost, whether the wait had ended or not
    /// (the caller gives its owner up, as after any pop's).
    pub fn pop(
        &mut self,
        conn: &mut Conn,
        keys: &QueueKeys,
        owner: &Arc<str>,
        max: usize,
        limits: PopLimits<'_>,
        wait: Option<(Duration, Duration)>,
    ) -> Result<Batch> {
        if let Some((timeout, io_timeout)) = wait {
            if !conn.is_node() {
                wait_idle(conn, keys, timeout, io_timeout)?;
                return self.pop(conn, keys, owner, max, limits, None);
            }
            conn.set_read_timeout(Some(timeout + io_timeout))?;
            let popped = pop_script(conn, keys, owner, max, limits, Some(timeout));
            conn.set_read_timeout(Some(io_timeout))?;
            let (batch, held) = popped?;
            return Ok(self.learn(batch, held));
        }
        let limited = limits.max_running.is_some()
            || !limits.rate_limit.is_empty()
            || !limits.priority_weights.is_empty()
            || !limits.type_limits.is_empty()
            || !limits.drained_flows.is_empty();
        if self.no_unique_held && self.last_taken >= PLAIN_POP_AFTER && !limited {
            match pop_plain(conn, keys, max)? {
                // Paused or throttled: keep what was learnt, so that the first pop after is plain again.
                Some(batch) if batch.paused || batch.limited.is_some() => return Ok(batch),
                Some(batch) => {
                    self.last_taken = batch.tasks.len();
                    return Ok(batch);
                }
                None => self.no_unique_held = false,
            }
        }
        let (batch, held) = pop_script(conn, keys, owner, max, limits, None)?;
        Ok(self.learn(batch, held))
    }

    /// What a pop.lua's `batch` says of the next pop (`held`: whether the queue holds unique ids).
    fn learn(&mut self, batch: Batch, held: bool) -> Batch {
        self.no_unique_held = !held;
        if !batch.paused && batch.limited.is_none() {
            self.last_taken = batch.tasks.len();
        }
        batch
    }
}

/// A default-mode queue's limits, as a pop counts them (see pop.lua).
#[derive(Clone, Copy, Debug, Default)]
pub struct PopLimits<'a> {
    pub(crate) max_running: Option<usize>,
    pub(crate) rate_limit: &'a [RateLimit],
    /// Turns between the levels (see [`ClaimLimits::priority_weights`]).
    pub(crate) priority_weights: &'a [u32],
    /// The queue's `[[queues.limits]]` (see [`ClaimLimits::type_limits`]).
    pub(crate) type_limits: &'a [TypeLimit],
    /// Flows to drain, unlimited (see [`ClaimLimits::drained_flows`]).
    pub(crate) drained_flows: &'a [String],
    /// Where a foreign payload's type is (see [`ClaimLimits::foreign_type_field`]).
    pub(crate) foreign_type_field: Option<&'a str>,
}

/// The lists a default-mode pop takes from, in order: per level, the quarantine lists (most suspect first),
/// then the ready list.
fn pop_lists(keys: &QueueKeys) -> impl Iterator<Item = &str> + '_ {
    (0..keys.levels()).flat_map(move |level| {
        (0..QUARANTINE_GROUPS.len())
            .map(move |stage| keys.quarantine_list(stage, level))
            .chain(std::iter::once(keys.ready[level].as_str()))
    })
}

/// The level of the `index`th list of [`pop_lists`] (0-based).
fn pop_level(index: usize) -> usize {
    index / (QUARANTINE_GROUPS.len() + 1)
}

/// The most bytes of tasks one pop hands the daemon (both ways of popping), unless one task is larger: a pop of
/// a thousand tasks of 16 MiB would be 16 GiB in one reply, which Redis would buffer too (review M8).
pub(crate) const POP_BYTES: usize = 64 << 20;

/// take.lua in a transaction that runs only if the unique hash stayed empty and the queue unpaused and
/// unthrottled since they were read (`WATCH` on the three): a task popped this way can hold no unique id, and none
/// is popped after a pause or a throttle. `None`: the hash is not empty (or one of the keys was written
/// meanwhile, or Redis had lost the script, now loaded again), nothing was popped, use pop.lua (which checks them
/// itself). A paused queue is a batch marked `paused`, a throttled one a batch [`Limited::Throttle`] until the
/// throttle's time to live ran out (`now_ms` 0: the batch carries no time of Redis's, only that wait).
fn pop_plain(conn: &mut Conn, keys: &QueueKeys, max: usize) -> Result<Option<Batch>> {
    let (held, paused, throttle_ms): (usize, bool, i64) = redis::pipe()
        .cmd("WATCH")
        .arg(&keys.unique)
        .arg(&keys.paused)
        .arg(&keys.throttle)
        .ignore()
        .cmd("HLEN")
        .arg(&keys.unique)
        .cmd("EXISTS")
        .arg(&keys.paused)
        .cmd("PTTL")
        .arg(&keys.throttle)
        .query(conn)?;
    // -2: no throttle; -1: one set by hand without an expiry, looked at again in a second (as pop.lua).
    let throttled = throttle_ms != -2;
    if held > 0 || paused || throttled {
        // To the node of the WATCH: in a cluster, UNWATCH alone would go to any node.
        conn.query_at::<()>(&keys.unique, &redis::cmd("UNWATCH"))?;
        return Ok(if paused {
            Some(Batch {
                paused: true,
                ..Batch::default()
            })
        } else if throttled {
            let wait = if throttle_ms < 0 {
                1000
            } else {
                throttle_ms.max(1)
            };
            Some(Batch {
                limited: Some(Limited::Throttle { retry_at_ms: wait }),
                ..Batch::default()
            })
        } else {
            None
        });
    }
    let mut script_keys = vec![keys.taking.clone()];
    script_keys.extend(pop_lists(keys).map(str::to_string));
    let mut take = evalsha(&SCRIPTS.take, &script_keys);
    take.arg(max).arg(POP_BYTES);
    let mut pipe = redis::pipe();
    // The taking list's guard, the script, then the pop of what take.lua weighed: from the taking list it filled,
    // or (a head surely within the bytes, the taking list left absent) from the first non-empty list itself,
    // natively. Had the script not run, the pop fails on the guard and takes nothing (take.lua). In a cluster a
    // transaction goes to its first key's node (`broker::Conn`): the taking list's, the queue's slot.
    pipe.atomic()
        .ignore_errors()
        .cmd("SET")
        .arg(&keys.taking)
        .arg(1)
        .ignore()
        .add_command(take)
        .cmd("LMPOP")
        .arg(script_keys.len())
        .arg(&script_keys)
        .arg("LEFT")
        .arg("COUNT")
        .arg(max)
        .cmd("DEL")
        .arg(&keys.taking)
        .ignore();
    // A nil EXEC (the unique hash was written after WATCH) reads as None. The EXEC's reply is depth 1, the pop's
    // depth 2 (nil, or the list's name and its tasks), its tasks depth 4 (and nothing else: the script's reply
    // holds only integers, Redis's clock among them, where TIME's would be strings at depth 3). A cluster
    // connection reports an error inside the transaction as the call's error; a node's leaves it in its place
    // among the replies.
    let outcome = conn
        .with_payloads(4, |conn| pipe.query::<Option<Vec<Value>>>(conn))
        .and_then(|(reply, collected)| {
            let Some(replies) = reply else {
                return Ok(None);
            };
            let mut replies = replies.into_iter();
            let first = replies.next().unwrap_or(Value::Nil).extract_error()?;
            Ok(Some((first, replies, collected)))
        });
    let (taken, mut replies, collected) = match outcome {
        Ok(Some(replies)) => replies,
        Ok(None) => return Ok(None),
        Err(error) if is_no_script(&error) => {
            // Redis lost its scripts (a restart, a failover): nothing ran. pop.lua's call loads its own.
            let load = redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(super::sources::TAKE)
                .clone();
            let _: String = conn.query_at(&keys.taking, &load)?;
            return Ok(None);
        }
        Err(error) => return Err(error.into()),
    };
    let Some(popped) = replies.next() else {
        return Err(reply_error(
            "pop",
            "a transaction of two replies".to_string(),
        ));
    };
    let (index, count, now_ms): (usize, usize, i64) =
        redis::from_redis_value(taken).map_err(redis::RedisError::from)?;
    let items = match popped {
        Value::Nil => Vec::new(),
        Value::ServerError(error) => return Err(redis::RedisError::from(error).into()),
        Value::Array(mut popped) if popped.len() == 2 => match popped.pop() {
            Some(Value::Array(items)) => items,
            other => {
                return Err(reply_error(
                    "pop",
                    format!("expected the popped tasks, got {other:?}"),
                ));
            }
        },
        other => {
            return Err(reply_error(
                "pop",
                format!("expected a list's name and its tasks, got {other:?}"),
            ));
        }
    };
    if items.len() != count {
        return Err(reply_error(
            "pop",
            format!("take.lua took {count}, the list held {}", items.len()),
        ));
    }
    let mut tasks = Vec::with_capacity(items.len());
    let mut payloads = Gather::new(collected);
    for item in items {
        payloads.take(item, "pop")?;
        tasks.push(Fetched {
            token: None,
            popped_by: None,
            popped_scope: None,
            holds_unique: false,
            // `index` is 1-based when something was taken.
            level: pop_level(index.saturating_sub(1)),
        });
    }
    Ok(Some(Batch {
        now_ms,
        tasks,
        payloads: payloads.finish("pop")?,
        ..Batch::default()
    }))
}

/// pop.lua; also says whether the queue holds unique ids now. With `wait`, behind a wait of up to that long for
/// something to pop ([`wait_idle`]'s), in the same write (a node's connection only: [`Popper::pop`]).
fn pop_script(
    conn: &mut Conn,
    keys: &QueueKeys,
    owner: &Arc<str>,
    max: usize,
    limits: PopLimits<'_>,
    mut wait: Option<Duration>,
) -> Result<(Batch, bool)> {
    let rate_limit = limits.rate_limit;
    let mut script_keys = vec![
        keys.unique.clone(),
        keys.unique_popped.clone(),
        keys.paused.clone(),
        keys.throttle.clone(),
        keys.running.clone(),
        keys.popped_running(owner),
        keys.sched.clone(),
        keys.owners.clone(),
    ];
    script_keys.extend(pop_lists(keys).map(str::to_string));
    for rate in rate_limit {
        let (log, sum) = keys.rate_log(rate.window_ms());
        script_keys.push(log);
        script_keys.push(sum);
    }
    let (type_keys, type_args) = type_block(
        keys,
        limits.type_limits,
        limits.drained_flows,
        limits.foreign_type_field,
    );
    script_keys.extend(type_keys);
    let mut eval = evalsha(&SCRIPTS.pop, &script_keys);
    eval.arg(&**owner)
        .arg(max)
        .arg(limits.max_running.unwrap_or(0))
        .arg(rate_limit.len());
    for rate in rate_limit {
        eval.arg(rate.window_ms()).arg(rate.starts);
    }
    eval.arg(limits.priority_weights.len());
    for weight in limits.priority_weights {
        eval.arg(*weight);
    }
    for arg in &type_args {
        eval.arg(arg);
    }
    eval.arg(POP_BYTES);
    // The script's reply is depth 1, its list of tasks depth 2, the tasks depth 3 (a wait's reply: depth 1, the
    // element BLMOVE moved, or 2, the marker BLPOP took).
    type Reply = (
        i64,
        usize,
        Vec<Value>,
        i64,
        i64,
        i64,
        Vec<usize>,
        Vec<usize>,
        Vec<usize>,
    );
    let mut loaded = false;
    let (reply, collected) = loop {
        let outcome = conn.with_payloads(3, |conn| {
            let reply = match wait {
                None => eval.query::<Value>(conn)?,
                Some(wait) => {
                    // Each reply in its place, errors too: the wait's is ignored (pop.lua checks its keys
                    // itself), and the pop ran whatever the wait answered.
                    let mut pipe = redis::pipe();
                    pipe.ignore_errors()
                        .add_command(wait_command(keys, wait))
                        .ignore()
                        .add_command(eval.clone());
                    let replies = pipe.query::<Vec<Value>>(conn)?;
                    replies.into_iter().next().unwrap_or(Value::Nil)
                }
            };
            // Its error is the reply itself (not `extract_error`, which rebuilds every list it walks).
            match reply {
                Value::ServerError(error) => Err(error.into()),
                reply => Ok(reply),
            }
        });
        match outcome {
            Err(error) if !loaded && is_no_script(&error) => {
                // Nothing ran but the wait, which took nothing: pop at once.
                let _: String = conn.query_at(
                    &keys.unique,
                    redis::cmd("SCRIPT").arg("LOAD").arg(super::sources::POP),
                )?;
                loaded = true;
                wait = None;
            }
            outcome => break outcome.map_err(|error| owner_error(error, owner))?,
        }
    };
    let (now_ms, list, items, held, state, retry_at_ms, counts, recorded, flows): Reply =
        redis::from_redis_value(reply).map_err(redis::RedisError::from)?;
    // The types' running scopes, by their 1-based index in the reply's `flows` (the type limits' order), each one
    // `Arc` shared by the batch's tasks.
    let scopes: Vec<Arc<str>> = limits
        .type_limits
        .iter()
        .map(|limit| Arc::from(keys::type_scope(&limit.kind)))
        .collect();
    if !flows.is_empty() && flows.len() != items.len() {
        return Err(reply_error(
            "pop",
            format!("{} types counted for {} tasks", flows.len(), items.len()),
        ));
    }
    let mut flows = flows.into_iter();
    let mut tasks = Vec::with_capacity(items.len());
    let mut payloads = Gather::new(collected);
    // One list's tasks, or (priority weights) each level's in level order, as many as `counts` says.
    let mut levels = counts
        .iter()
        .enumerate()
        .flat_map(|(level, count)| std::iter::repeat_n(level, *count));
    // The 1-based positions of the tasks whose unique id the pop recorded, in order.
    let mut recorded = recorded.into_iter().peekable();
    for (position, item) in (1..).zip(items) {
        let level = match list {
            0 => levels
                .next()
                .ok_or_else(|| reply_error("pop", "more tasks than its counts".to_string()))?,
            list => pop_level(list - 1),
        };
        payloads.take(item, "pop")?;
        let holds_unique = recorded.next_if_eq(&position).is_some();
        let popped_scope = match flows.next().unwrap_or(0) {
            0 => None,
            flow => Some(Arc::clone(scopes.get(flow - 1).ok_or_else(|| {
                reply_error(
                    "pop",
                    format!("a task counted in type {flow} of {}", scopes.len()),
                )
            })?)),
        };
        let shared = holds_unique || limits.max_running.is_some() || popped_scope.is_some();
        tasks.push(Fetched {
            token: None,
            popped_by: shared.then(|| Arc::clone(owner)),
            popped_scope,
            holds_unique,
            level,
        });
    }
    if let Some(position) = recorded.next() {
        return Err(reply_error(
            "pop",
            format!("a unique id recorded at position {position}, not among its tasks"),
        ));
    }
    let batch = Batch {
        now_ms,
        tasks,
        payloads: payloads.finish("pop")?,
        paused: state == 1,
        limited: match state {
            2 => Some(Limited::Throttle { retry_at_ms }),
            3 => Some(Limited::Rate { retry_at_ms }),
            4 => Some(Limited::Running),
            7 => Some(Limited::Types { retry_at_ms }),
            _ => None,
        },
        ..Batch::default()
    };
    Ok((batch, held > 0))
}

/// Default mode: waits up to `timeout` for something to pop, taking nothing itself (the reply may take
/// `io_timeout` more). A queue with one level waits on its ready list, so that a plain RPUSH by any producer
/// wakes it at once (`BLMOVE` of the list onto itself, head to head: the list is left as it was); a queue with
/// several levels waits for a wake-up marker, as safe mode does (plain-RPUSH producers should push one).
pub fn wait_idle(
    conn: &mut Conn,
    keys: &QueueKeys,
    timeout: Duration,
    io_timeout: Duration,
) -> Result<()> {
    if keys.levels() > 1 {
        return wait_wake(conn, keys, timeout, io_timeout).map(drop);
    }
    wait_list(conn, &keys.ready[0], timeout, io_timeout).map(drop)
}

/// [`wait_idle`]'s blocking command, for a pipeline (its reply: nil after `timeout` without a push).
fn wait_command(keys: &QueueKeys, timeout: Duration) -> redis::Cmd {
    let mut wait;
    if keys.levels() > 1 {
        wait = redis::cmd("BLPOP");
        wait.arg(&keys.wake);
    } else {
        let ready = &keys.ready[0];
        wait = redis::cmd("BLMOVE");
        wait.arg(ready).arg(ready).arg("LEFT").arg("LEFT");
    }
    wait.arg(timeout.as_secs_f64());
    wait
}

/// Waits up to `timeout` for the list `key` to hold something, taking nothing (`BLMOVE` of the list onto itself,
/// head to head: the list is left as it was, and a push wakes the wait at once). Returns whether it holds
/// something. The reply may take `io_timeout` more.
pub fn wait_list(
    conn: &mut Conn,
    key: &str,
    timeout: Duration,
    io_timeout: Duration,
) -> Result<bool> {
    conn.set_read_timeout(Some(timeout + io_timeout))?;
    let result: redis::RedisResult<Option<Vec<u8>>> = redis::cmd("BLMOVE")
        .arg(key)
        .arg(key)
        .arg("LEFT")
        .arg("LEFT")
        .arg(timeout.as_secs_f64())
        .query(conn);
    conn.set_read_timeout(Some(io_timeout))?;
    Ok(result?.is_some())
}

/// Moves up to `max` tasks from the queue's source lists to the back of their levels' ready lists (move.lua),
/// starting with source `first` (an index into `keys.sources`, taken modulo their number). Returns
/// how many moved; fewer than `max` means every source was empty. A lost reply needs no resolving: the script
/// ran whole or not at all, and each task is in its source or in the ready list, so the next call moves
/// whatever is left.
pub fn move_sources(conn: &mut Conn, keys: &QueueKeys, max: usize, first: usize) -> Result<usize> {
    let mut invocation = SCRIPTS.moves.prepare_invoke();
    // The wake list first: a cluster routes the call by its first key, which must be one of the queue's.
    invocation.key(&keys.wake).key(&keys.stats);
    for source in &keys.sources {
        invocation.key(source);
    }
    for &level in &keys.source_levels {
        invocation.key(&keys.ready[level]);
    }
    let first = first % keys.sources.len().max(1) + 1;
    let moved: usize = invocation.arg(max).arg(first).invoke(conn)?;
    conn.replicated(&keys.stats)?;
    Ok(moved)
}

/// Default mode: releases the unique ids `owner` popped and never settled (read from the unique-popped hash):
/// its daemon died with those tasks, or stopped without being able to hand them back. Returns how many.
pub fn release_unique(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    owner: &str,
) -> Result<usize> {
    let mut released = 0;
    let mut cursor = 0u64;
    loop {
        let (next, pairs): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
            .arg(&keys.unique_popped)
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query(conn)?;
        let ids: Vec<&str> = pairs
            .iter()
            .filter(|(_, by)| by == owner)
            .map(|(id, _)| id.as_str())
            .collect();
        if !ids.is_empty() {
            let mut invocation = SCRIPTS.release_unique.prepare_invoke();
            invocation
                .key(&keys.unique)
                .key(&keys.unique_popped)
                .arg(owner);
            for id in ids {
                invocation.arg(id);
            }
            let count: usize = invocation.invoke(conn)?;
            released += count;
        }
        cursor = next;
        if cursor == 0 {
            return Ok(released);
        }
    }
}

/// Safe mode: waits up to `timeout` for a wake-up marker (the reply may take `io_timeout` more). Returns whether
/// one came.
pub fn wait_wake(
    conn: &mut Conn,
    keys: &QueueKeys,
    timeout: Duration,
    io_timeout: Duration,
) -> Result<bool> {
    conn.set_read_timeout(Some(timeout + io_timeout))?;
    let result: redis::RedisResult<Option<(String, String)>> = redis::cmd("BLPOP")
        .arg(&keys.wake)
        .arg(timeout.as_secs_f64())
        .query(conn);
    conn.set_read_timeout(Some(io_timeout))?;
    Ok(result?.is_some())
}

/// What happens to a settled task; see settle.lua.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SettleOp {
    Ack,
    /// A charged retry (the payload carries `attempt + 1`): after `delay`, or at once to the front of the level,
    /// or (`isolated`: a crash while it ran alone) to the front of the level's quarantine for tasks that run alone.
    Retry {
        delay: Duration,
        isolated: bool,
    },
    /// Handed back (the shutdown, a reload, stuck workers): to the front of its level, unchanged and uncounted,
    /// or of the level's quarantine list of stage `quarantine` (an index into `QUARANTINE_GROUPS`) for a task that
    /// waited there, so that a poison pill handed back runs alone again rather than with a full batch. With a
    /// `group` (a grouped queue's task, not from the quarantine), to the front of its group's flow: through the
    /// ready list the intake would put it at the flow's tail, behind the tasks of its group that waited after it.
    /// Boxed: a settlement travels through channels by value, and few hand-backs carry one.
    Back {
        quarantine: Option<usize>,
        group: Option<Box<ThrottleScope>>,
    },
    /// Back from an expired lease, uncharged (the payload carries `recovered + 1`): to the front of the level, or
    /// to the front of the quarantine list of stage `quarantine` (an index into `QUARANTINE_GROUPS`).
    Recover {
        quarantine: Option<usize>,
    },
    Dead,
    /// Back-pressure from the handler: to the front of its level, unchanged and uncharged, and the queue's throttle
    /// key set to end in `after` unless a later throttle is set (settle.lua); with a `scope` (its group, or a type
    /// with its own limits), to the front of that scope's flow, and that scope's throttle set instead.
    Throttle {
        after: Duration,
        scope: Option<ThrottleScope>,
    },
}

/// What a throttled task's back-pressure holds back when not the whole queue: issue 33's "its group (a task without
/// a group: its type, or the queue)".
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ThrottleScope {
    /// A task type with a `[[queues.limits]]` entry.
    Type(String),
    /// A group of a queue with `[queues.groups]` (the empty name: tasks without a group); also the flow a grouped
    /// task is handed back to (`SettleOp::Back`).
    Group(String),
}

impl ThrottleScope {
    /// Its flows' member in the rings.
    fn member(&self) -> String {
        match self {
            ThrottleScope::Type(kind) => keys::flow_member(kind),
            ThrottleScope::Group(group) => keys::group_member(group),
        }
    }

    /// Its throttle's key.
    fn throttle(&self, keys: &QueueKeys) -> String {
        match self {
            ThrottleScope::Type(kind) => keys.type_throttle(kind),
            ThrottleScope::Group(group) => keys.group_throttle(group),
        }
    }
}

impl SettleOp {
    /// The scope whose flow the task goes back to (and, for a throttle, whose throttle it sets), if not the ready
    /// list's.
    fn flow_scope(&self) -> Option<&ThrottleScope> {
        match self {
            SettleOp::Throttle { scope, .. } => scope.as_ref(),
            SettleOp::Back {
                quarantine: None,
                group,
            } => group.as_deref(),
            _ => None,
        }
    }

    /// What it does, in a word, for the log.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            SettleOp::Ack => "ack",
            SettleOp::Retry { .. } => "retry",
            SettleOp::Back { .. } => "back",
            SettleOp::Recover { .. } => "recover",
            SettleOp::Dead => "dead",
            SettleOp::Throttle { .. } => "throttle",
        }
    }
}

/// One outcome to apply to Redis.
#[derive(Clone, Debug)]
pub struct Settlement {
    pub op: SettleOp,
    /// Safe mode: where the task is held; `None` in default mode.
    pub token: Option<Token>,
    /// Default mode: the owner that popped the task, when Redis keeps its running slot or its unique id under
    /// that owner ([`Fetched::popped_by`]).
    pub popped_by: Option<Arc<str>>,
    /// Default mode: the type's running count the pop counted the task in, under `popped_by`'s share
    /// ([`Fetched::popped_scope`]), which this settlement gives back.
    pub popped_scope: Option<Arc<str>>,
    /// Released on ack or dead-letter when the task is unique (in default mode, only while the owner that popped
    /// it still holds it: settle.lua, "Unique ids").
    /// A boxed `str`, not a `String`: a settlement travels through channels by value, and the acker's
    /// `Apply` is kept within clippy's size bound.
    pub unique_id: Option<Box<str>>,
    pub level: usize,
    /// Retry/back: the envelope to queue; dead: the dead record (a JSON object); ack: unused.
    pub payload: Vec<u8>,
    /// Whether this run counts as a failed attempt.
    pub failed: bool,
    /// The result the settle keeps when this record ends the task (an "ack" or a "dead" that applies): a queue
    /// with `keep_results` (results.lua). `None`: nothing is kept.
    pub kept: Option<Box<Kept>>,
    /// The note to the tasks of a flow that wait for this one, written to the queue's outbox when this record
    /// ends the task (an "ack" or a "dead" that applies: after.lua; docs/design/flows.md). `None`: nothing
    /// waits for it.
    pub note: Option<Box<Note>>,
}

/// A note to the tasks waiting for a task of a flow: whom it goes to, the task's run and its outcome
/// (`broker::workflow::outcome`). Kept apart, not as one note's JSON, so that a settle call writes one note for
/// all its tasks with the same waiters and run (after.lua): a fan-in's settle of a thousand parts writes one
/// list element, which the mover reads, parses and removes as one. Boxed in a [`Settlement`], which most tasks
/// settle without: a settlement travels through channels by value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    /// The envelope's `waiters`, as it is (a JSON array).
    pub to: Box<str>,
    /// The task's run (`broker::workflow::RUN`).
    pub run: u64,
    /// Its outcome: the JSON object each waiter's ended hash keeps.
    pub outcome: Vec<u8>,
}

impl Note {
    /// The bytes it adds to a settle call (its waiters and its outcome; the run is a number).
    fn bytes(&self) -> usize {
        self.to.len() + self.outcome.len()
    }
}

/// A settle call's notes (after.lua's trailer), grouped by their waiters and run in the order first seen: each
/// group's outcomes with their places in the call.
#[derive(Default)]
struct NoteGroups<'a> {
    groups: Vec<NoteGroup<'a>>,
    /// Where each group is in `groups` (a fan-out's tasks each have waiters of their own).
    at: std::collections::HashMap<(&'a str, u64), usize>,
}

/// The outcomes of a settle call's tasks with waiters `to` and run `run`: one note, if any applied.
struct NoteGroup<'a> {
    to: &'a str,
    run: u64,
    outcomes: Vec<((usize, u64), &'a [u8])>,
}

impl<'a> NoteGroups<'a> {
    fn add(&mut self, place: (usize, u64), note: &'a Note) {
        let (to, run) = (&*note.to, note.run);
        let at = *self.at.entry((to, run)).or_insert_with(|| {
            self.groups.push(NoteGroup {
                to,
                run,
                outcomes: Vec::new(),
            });
            self.groups.len() - 1
        });
        self.groups[at]
            .outcomes
            .push((place, note.outcome.as_slice()));
    }

    fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }
}

/// A task's result as the settle that ends it keeps it: its task's id (its field in the queue's bucket hash of the
/// time: results.lua), its value (a JSON object: docs/PROTOCOL.md, "Results"; the script adds `ended_at`) and how
/// long it is kept at least (the queue's `keep_results`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept {
    pub id: String,
    pub value: Vec<u8>,
    pub ttl: Duration,
}

impl Settlement {
    /// The bytes this settlement adds to a call's arguments besides its fixed fields: its payload and the result
    /// it keeps (the settler sizes its calls by it).
    pub fn bytes(&self) -> usize {
        self.payload.len()
            + self
                .kept
                .as_ref()
                .map_or(0, |kept| kept.id.len() + kept.value.len())
            + self.note.as_ref().map_or(0, |note| note.bytes())
    }

    /// A plain acknowledgement: sent as its bare token (or only counted, in default mode), not as a record. Its
    /// kept result, if any, goes with it (results.lua: written only if its bit is new).
    pub(super) fn is_plain_ack(&self) -> bool {
        self.op == SettleOp::Ack && self.unique_id.is_none() && !self.failed
    }
}

/// Whose tasks one settle call settles.
#[derive(Clone, Copy, Debug, Eq)]
pub enum Holder<'a> {
    /// Default mode, tasks that left Redis for good: nobody holds anything of theirs in Redis.
    Nobody,
    /// Safe mode: the owner whose claim lists hold them.
    Claimed(&'a str),
    /// Default mode: the owner that popped them, under which Redis keeps their share of the running count (see
    /// settle.lua, "Running limits") or their unique ids (settle.lua, "Unique ids").
    Popped(&'a str),
}

/// The acker compares the holder of every settlement it sends: the tasks of one claim (or pop) name their owner
/// through one `Arc`, so the pointer nearly always answers before the bytes are compared (a `memcmp` per task was
/// 0.5 % of a no-op drain's daemon instructions, callgrind).
impl PartialEq for Holder<'_> {
    fn eq(&self, other: &Self) -> bool {
        let same = |a: &str, b: &str| std::ptr::eq(a, b) || a == b;
        match (self, other) {
            (Holder::Nobody, Holder::Nobody) => true,
            (Holder::Claimed(a), Holder::Claimed(b)) | (Holder::Popped(a), Holder::Popped(b)) => {
                same(a, b)
            }
            _ => false,
        }
    }
}

impl<'a> Holder<'a> {
    /// The holder a settlement names.
    pub(crate) fn of(settlement: &'a Settlement) -> Holder<'a> {
        match (&settlement.token, &settlement.popped_by) {
            (Some(token), _) => Holder::Claimed(&token.owner),
            (None, Some(owner)) => Holder::Popped(owner),
            (None, None) => Holder::Nobody,
        }
    }
}

/// Who is settling: the owner of the tasks, or a monitor recovering the tasks of an owner whose lease ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    Owner,
    Expired,
}

/// What a settle call did.
#[derive(Debug, PartialEq, Eq)]
pub struct Settled {
    /// Per settlement: whether it applied (false: stale, its task was recovered meanwhile); `None` for plain
    /// acknowledgements, which are applied in bulk and counted in `stale_acks` instead.
    pub applied: Vec<Option<bool>>,
    /// Plain acknowledgements whose token was no longer in the processing area.
    pub stale_acks: usize,
    /// The settling owner's journal after the call, which the call added one to (0 when it added nothing: no
    /// owner settled, a monitor settled, the owner's info hash was gone, or a late copy was superseded). The same
    /// in the stored answer to a call sent again: the acker counts one bump per answered call that has a journal,
    /// as the fetcher counts one per claim that took tasks (`lane::ownership`).
    pub(crate) journal: u64,
    /// Redis had already stored a newer call of this settling party: this one is a late copy of a call that was
    /// answered before, and it applied nothing now (settle.lua, "Calls"). A settler sends a call again only until
    /// it is answered and numbers its calls upwards, so a reply of this kind goes to a connection it gave up on
    /// and is never read; one that were read would be of a call answered before: it is taken as "applied
    /// before" (`applied` all `None`, nothing stale, no journal).
    pub superseded: bool,
}

/// One settle call of one settling party (an acker, a monitor): sent again as the same call after a lost reply,
/// so that Redis applies it once (see settle.lua, "Calls").
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    /// The settling party, unique to a daemon's run and role.
    pub settler: &'a str,
    /// Its calls' counter: a new number for each new call.
    pub number: u64,
}

/// The claims one settle call touches, each with the bitmap of its plain acknowledgements (settle.lua).
#[derive(Default)]
pub(super) struct Touched {
    /// (level, claim, bitmap of acknowledged positions in `GETBIT`'s order).
    pub(super) claims: Vec<(usize, u64, Vec<u8>)>,
}

impl Touched {
    /// The 1-based index of (level, claim) among the claims touched, added if new. A call touches a handful of
    /// claims, so a scan of them costs less than a map.
    fn index(&mut self, level: usize, claim: u64) -> usize {
        if let Some(at) = self
            .claims
            .iter()
            .rposition(|(l, c, ..)| *l == level && *c == claim)
        {
            return at + 1;
        }
        self.claims.push((level, claim, Vec::new()));
        self.claims.len()
    }

    /// The keys of the claims touched, as settle.lua and handover_plain.lua name them after their others: for each,
    /// its list, its settled bitmap and its scopes string.
    pub(super) fn keys(&self, invocation: &mut ScriptKeys, keys: &QueueKeys, owner: &str) {
        for (level, claim, _) in &self.claims {
            invocation
                .key(keys.claim_list(owner, *level, *claim))
                .key(keys.claim_settled(owner, *level, *claim))
                .key(keys.claim_scopes(owner, *level, *claim));
        }
    }

    /// The claims as settle.lua's (and handover_plain.lua's) arguments name them: their count K, then for each its
    /// level (1-based), its number, the bitmap of its acknowledgements and how many bits it sets.
    pub(super) fn args(&self, invocation: &mut redis::Cmd) {
        invocation.arg(self.claims.len());
        for (level, claim, bits) in &self.claims {
            let count: u32 = bits.iter().map(|byte| byte.count_ones()).sum();
            invocation
                .arg(level + 1)
                .arg(claim)
                .arg(bits.as_slice())
                .arg(count);
        }
    }

    pub(super) fn acknowledge(&mut self, level: usize, claim: u64, position: u32) {
        let at = self.index(level, claim) - 1;
        let bits = &mut self.claims[at].2;
        let byte = position as usize / 8;
        if bits.len() <= byte {
            bits.resize(byte + 1, 0);
        }
        bits[byte] |= 0x80 >> (position % 8);
    }
}

/// Applies many outcomes in one round trip (`settle.lua`). Every settlement must be of `holder`'s tasks (in safe
/// mode their tokens name it; in default mode, their `popped_by`). Plain acknowledgements, the bulk of the traffic, go as a bitmap per claim that
/// the script merges into the claim's own; everything else goes as a record checked one by one. Sending the same
/// `call` again returns what the first one did, without applying it twice.
pub fn settle<'a>(
    conn: &mut Conn,
    keys: &QueueKeys,
    call: &Call<'_>,
    fence: Fence,
    dead_max: usize,
    holder: Holder<'_>,
    settlements: impl IntoIterator<Item = &'a Settlement> + Clone,
) -> Result<Settled> {
    settle_with(conn, keys, call, fence, dead_max, holder, settlements, None)
        .map(|(settled, _)| settled)
}

/// The claim a settle makes for the running slots it frees ([`settle_handing_over`]).
#[derive(Clone, Copy, Debug)]
pub struct Handover<'a> {
    /// The claim's number, reserved from the owner's claim numbers as a fetcher's claim's are (one number: the
    /// claim's lists are those of `claim`).
    pub claim: u64,
    /// The most tasks to take: the settling daemon's workers free for them. The settle takes no more than it
    /// freed slots of a limit, and what the limits leave.
    pub max: usize,
    pub limits: &'a ClaimLimits<'a>,
}

/// Safe mode, the owner's settle that hands the running slots it frees over to the next tasks (handover.lua;
/// docs/design/flow-control.md, "The slot handed over in the settle"): as [`settle`], and in the same script step,
/// once the ended tasks are subtracted from the running counts, claim.lua's claim of up to `handover.max` tasks,
/// as many as the call freed slots of the queue's `max_running` (or of a type's). Returns the claim's batch too,
/// read in the call's transaction: `None` when it claimed nothing (it freed no slot, the claim was refused, or
/// the call was a late copy), or when the call carried a record of 32 KiB or more (sent without the claim, so
/// that a NOSCRIPT may be answered on this connection: see [`load_settle`]). Sent again after a lost reply, the
/// call answers the same claim (its stored result) and claims nothing more. The owner's journal counts the claim
/// as one more bump when it took tasks, beside the settle's own.
///
/// A call of acknowledgements only, of a queue whose claims are plain but for `max_running`, goes to
/// handover_plain.lua, made for it (src/broker/plain_handover.rs), and to settle.lua when that script leaves it
/// (having written nothing): both answer alike.
pub fn settle_handing_over<'a>(
    conn: &mut Conn,
    keys: &QueueKeys,
    call: &Call<'_>,
    dead_max: usize,
    owner: &Arc<str>,
    settlements: impl IntoIterator<Item = &'a Settlement> + Clone,
    handover: &Handover<'_>,
) -> Result<(Settled, Option<Batch>)> {
    if let Some(answer) =
        super::plain_handover::settle(conn, keys, call, owner, settlements.clone(), handover)?
    {
        return Ok(answer);
    }
    settle_handing_over_generic(conn, keys, call, dead_max, owner, settlements, handover)
}

/// [`settle_handing_over`] by settle.lua whatever the call: the tests that compare the two scripts' answers and
/// writes send the same call both ways.
#[doc(hidden)]
pub fn settle_handing_over_generic<'a>(
    conn: &mut Conn,
    keys: &QueueKeys,
    call: &Call<'_>,
    dead_max: usize,
    owner: &Arc<str>,
    settlements: impl IntoIterator<Item = &'a Settlement> + Clone,
    handover: &Handover<'_>,
) -> Result<(Settled, Option<Batch>)> {
    settle_with(
        conn,
        keys,
        call,
        Fence::Owner,
        dead_max,
        Holder::Claimed(owner),
        settlements,
        Some((owner, handover)),
    )
}

#[allow(
    clippy::too_many_arguments,
    reason = "settle's arguments and the handover's"
)]
fn settle_with<'a>(
    conn: &mut Conn,
    keys: &QueueKeys,
    call: &Call<'_>,
    fence: Fence,
    dead_max: usize,
    holder: Holder<'_>,
    settlements: impl IntoIterator<Item = &'a Settlement> + Clone,
    handover: Option<(&Arc<str>, &Handover<'_>)>,
) -> Result<(Settled, Option<Batch>)> {
    let (owner, popper) = match holder {
        Holder::Claimed(owner) => (Some(owner), None),
        Holder::Popped(popper) => (None, Some(popper)),
        Holder::Nobody => (None, None),
    };
    // Bulk sections only for the owner: a monitor's settlements go through the lease check one by one. A default
    // mode acknowledgement that keeps a result goes as a record: only counted, it has no place to name.
    let bulk = |s: &Settlement| {
        fence == Fence::Owner
            && s.is_plain_ack()
            && match &s.token {
                Some(Token {
                    id: TokenId::Field(_),
                    ..
                }) => false,
                Some(_) => true,
                None => s.kept.is_none() && s.note.is_none(),
            }
    };
    let mut touched = Touched::default();
    let mut counted = 0;
    for s in settlements.clone() {
        match s.token.as_ref().map(|token| &token.id) {
            Some(TokenId::Listed { claim, position }) if bulk(s) => {
                touched.acknowledge(s.level, *claim, *position)
            }
            Some(TokenId::Listed { claim, .. }) => {
                touched.index(s.level, *claim);
            }
            None if bulk(s) => counted += 1,
            _ => {}
        }
    }
    let mut invocation = ScriptKeys::default();
    invocation
        .key(&keys.owners)
        .key(&keys.stats)
        .key(&keys.dead)
        .key(&keys.unique)
        .key(&keys.wake)
        .key(keys.settled(call.settler))
        .key(&keys.unique_popped)
        .key(&keys.throttle);
    for key in keys.ready.iter().chain(&keys.retry).chain(&keys.quarantine) {
        invocation.key(key);
    }
    if let Some(owner) = owner {
        for level in 0..keys.levels() {
            invocation.key(keys.processing(owner, level));
        }
        invocation
            .key(keys.owner_info(owner))
            .key(keys.settle_scratch(call.settler))
            .key(&keys.running);
        if keys.grouped {
            for ring in keys.rings() {
                invocation.key(ring);
            }
            invocation.key(&keys.sched);
        }
        touched.keys(&mut invocation, keys, owner);
    }
    if let Holder::Popped(popper) = holder {
        invocation
            .key(&keys.running)
            .key(keys.popped_running(popper));
    }
    // The scopes whose throttles this call sets (a type's or a group's own throttle, flows and rings), or whose
    // flows it hands tasks back to, each once.
    let mut throttled: Vec<&ThrottleScope> = Vec::new();
    // Default mode: the types' running counts this call's tasks were counted in by their pop, and how many of them
    // each (every default-mode settlement ends its task: settle.lua subtracts them from the popper's share).
    let mut shares: Vec<(&str, usize)> = Vec::new();
    for s in settlements.clone() {
        if let Some(scope) = s.op.flow_scope()
            && !throttled.contains(&scope)
        {
            throttled.push(scope);
        }
        if let (Holder::Popped(_), Some(scope)) = (holder, &s.popped_scope) {
            match shares.iter_mut().find(|(counted, _)| *counted == &**scope) {
                Some((_, n)) => *n += 1,
                None => shares.push((scope, 1)),
            }
        }
    }
    for scope in &throttled {
        let member = scope.member();
        invocation.key(scope.throttle(keys));
        for level in 0..keys.levels() {
            invocation.key(keys.flow(level, &member));
        }
        for level in 0..keys.levels() {
            invocation.key(keys.ring(level));
        }
    }
    // The results this call keeps (results.lua's trailer): each with its task's place in the call (0 and N, the Nth
    // record; K and P, position P of the Kth claim touched, acknowledged in its bitmap); their keys go last.
    let mut kept: Vec<((usize, u64), &Kept)> = Vec::new();
    // The notes to the tasks waiting for those this call ends (after.lua's trailer, before results.lua's), placed
    // as the results are, by the same two numbers, and grouped by their waiters and run: after.lua writes one note
    // a group, of the outcomes that applied; the outbox is their one key, before the result keys.
    let mut notes = NoteGroups::default();
    let mut record = 0;
    for s in settlements.clone() {
        let place = match (&s.token, bulk(s)) {
            (
                Some(Token {
                    id: TokenId::Listed { claim, position },
                    ..
                }),
                true,
            ) => (touched.index(s.level, *claim), u64::from(*position)),
            (_, true) => continue,
            (_, false) => {
                record += 1;
                (0, record)
            }
        };
        if let Some(note) = s.note.as_deref()
            && matches!(s.op, SettleOp::Ack | SettleOp::Dead)
        {
            notes.add(place, note);
        }
        if let Some(result) = s.kept.as_deref()
            && matches!(s.op, SettleOp::Ack | SettleOp::Dead)
        {
            kept.push((place, result));
        }
    }
    if !notes.is_empty() {
        invocation.key(keys.deps_outbox());
    }
    // One bucket for the call (results.lua): the results of a queue are kept alike, so the longest expiry is the
    // queue's `keep_results` (a reload between two records of a call keeps the longer).
    let bucket = kept.iter().map(|(_, result)| result.ttl).max().map(|ttl| {
        (
            ttl,
            super::results::bucket_start(std::time::SystemTime::now(), ttl),
        )
    });
    if let Some((_, start)) = bucket {
        invocation
            .key(keys.results_index())
            .key(keys.results_bucket(start));
    }
    // A reload on this connection only when the call carried no argument of 32 KiB or more (see `load_settle`):
    // otherwise the caller loads the script on a new connection (the settler does) and sends the call again.
    let large = settlements.clone().into_iter().any(|s| {
        let sent = match bulk(s) {
            // A plain acknowledgement sends only its kept result and its note, in the trailers.
            true => {
                s.kept.as_ref().map_or(0, |kept| kept.value.len())
                    + s.note.as_ref().map_or(0, |note| note.bytes())
            }
            false => s.bytes(),
        };
        sent >= LARGE_ARGUMENT
    });
    // The claim for the freed slots (handover.lua's trailer, the last): its keys after every other.
    let handover = handover
        .filter(|_| !large && fence == Fence::Owner)
        .map(|(owner, handover)| {
            let (claim_keys, claim_args) =
                claim_call(keys, owner, handover.claim, handover.max, handover.limits);
            for key in &claim_keys {
                invocation.key(key);
            }
            (owner, handover.claim, claim_keys.len(), claim_args)
        });
    let mut invocation = invocation.evalsha(&SCRIPTS.settle);
    invocation
        .arg(match fence {
            Fence::Owner => "owner",
            Fence::Expired => "expired",
        })
        .arg(dead_max)
        .arg(keys.levels())
        .arg(&keys.delay_channel)
        .arg(owner.or(popper).unwrap_or(""))
        .arg(call.number);
    touched.args(&mut invocation);
    invocation.arg(counted).arg(throttled.len());
    for scope in &throttled {
        invocation.arg(scope.member());
    }
    invocation.arg(shares.len());
    for (scope, n) in &shares {
        invocation.arg(*scope).arg(*n);
    }
    let mut records = 0;
    for s in settlements.clone().into_iter().filter(|s| !bulk(s)) {
        let (op, delay_ms) = match &s.op {
            SettleOp::Ack => ("ack", 0),
            // For the quarantine ops, the delay field carries the quarantine stage (1-based).
            SettleOp::Retry { isolated: true, .. } => ("retry_isolated", 1),
            SettleOp::Retry { delay, .. } => ("retry", delay.as_millis() as u64),
            SettleOp::Back {
                quarantine: None, ..
            } => ("back", 0),
            SettleOp::Back {
                quarantine: Some(stage),
                ..
            } => ("back_isolated", *stage as u64 + 1),
            SettleOp::Recover { quarantine: None } => ("recover", 0),
            SettleOp::Recover {
                quarantine: Some(stage),
            } => ("recover_isolated", *stage as u64 + 1),
            SettleOp::Dead => ("dead", 0),
            SettleOp::Throttle { after, .. } => ("throttle", after.as_millis().max(1) as u64),
        };
        // The scope whose throttle a throttle sets, or whose flow a hand-back goes to (1-based among this call's;
        // 0: the queue's throttle, the ready list).
        let scope = s.op.flow_scope().map_or(0, |scope| {
            throttled
                .iter()
                .position(|throttled| *throttled == scope)
                .map_or(0, |at| at + 1)
        });
        invocation.arg(op);
        match s.token.as_ref().map(|token| &token.id) {
            Some(TokenId::Listed { claim, position }) => {
                invocation.arg(touched.index(s.level, *claim)).arg(position)
            }
            Some(TokenId::Field(field)) => invocation.arg(0).arg(field),
            None => invocation.arg(0).arg(""),
        };
        invocation
            .arg(s.unique_id.as_deref().unwrap_or(""))
            .arg(s.level + 1)
            .arg(delay_ms)
            .arg(&s.payload)
            .arg(if s.failed { "1" } else { "0" })
            .arg(scope);
        records += 1;
    }
    if !notes.is_empty() {
        let mut args = 0;
        for NoteGroup { to, run, outcomes } in &notes.groups {
            invocation.arg(*to).arg(*run).arg(outcomes.len());
            for ((claim, place), outcome) in outcomes {
                invocation.arg(*claim).arg(*place).arg(*outcome);
            }
            args += 3 + 3 * outcomes.len();
        }
        invocation.arg(args).arg("notes");
    }
    if let Some((ttl, start)) = bucket {
        for ((claim, place), result) in &kept {
            invocation
                .arg(*claim)
                .arg(*place)
                .arg(result.id.as_str())
                .arg(result.value.as_slice());
        }
        invocation
            .arg(start)
            .arg(ttl.as_millis().max(1) as u64)
            .arg(kept.len())
            .arg("results");
    }
    let (reply, claimed_lists) = match handover {
        None => {
            let reply: Vec<i64> = match invocation.query(conn) {
                Err(error) if is_no_script(&error) && !large => {
                    load_settle(conn)?;
                    invocation.query(conn)?
                }
                reply => reply?,
            };
            (reply, None)
        }
        Some((owner, claim, key_count, claim_args)) => {
            let count = claim_args.len();
            invocation
                .arg(claim_args)
                .arg(count)
                .arg(key_count)
                .arg("handover");
            // The claim's lists are read in the call's transaction, as a claim's (a call sent again reads them
            // again: its stored result names the same claim).
            let lists = keys.claim_lists(owner, claim);
            let (reply, taken, collected) =
                script_then_lists(conn, super::sources::SETTLE, &invocation, &lists, None)?;
            let (reply, claim_reply) = split_settle_reply(reply, records)?;
            (reply, Some((owner, claim, claim_reply, taken, collected)))
        }
    };
    settle_answer(conn, keys, settlements, bulk, records, reply, claimed_lists)
}

/// A settle's reply with a claim's: its integers up to the claim's (the stale acknowledgements, one per record,
/// the journal; or a late copy's two), and claim.lua's reply.
pub(super) fn split_settle_reply(reply: Value, records: usize) -> Result<(Vec<i64>, Vec<Value>)> {
    let mut reply: Vec<Value> = redis::from_redis_value(reply).map_err(redis::RedisError::from)?;
    let split = (records + 2).min(reply.len());
    let claim_reply = reply.split_off(split);
    let reply = reply
        .iter()
        .map(|value| int(value, "settle"))
        .collect::<Result<Vec<i64>>>()?;
    Ok((reply, claim_reply))
}

/// A settle's claim, with its reply and the lists read in the call's transaction ([`script_then_lists`]): the
/// owner, the claim's number, claim.lua's reply, the lists, their payloads.
pub(super) type HandedOver<'o> = (&'o Arc<str>, u64, Vec<Value>, Vec<Value>, Payloads);

/// What a settle call's reply says (settle.lua's, or handover_plain.lua's, which answers as it does): `reply`, its
/// integers up to the claim's (the stale acknowledgements, one per record, the journal), and the claim's
/// (`claimed`). `bulk`: whether a settlement went as a plain acknowledgement, not a record.
pub(super) fn settle_answer<'a>(
    conn: &mut Conn,
    keys: &QueueKeys,
    settlements: impl IntoIterator<Item = &'a Settlement>,
    bulk: impl Fn(&Settlement) -> bool,
    records: usize,
    reply: Vec<i64>,
    claimed: Option<HandedOver<'_>>,
) -> Result<(Settled, Option<Batch>)> {
    // Not replicated: a may-have-run error; the settler sends the same call again, which applies nothing twice.
    conn.replicated(&keys.stats)?;
    if reply.len() == 2 && reply[0] == -1 {
        return Ok((
            Settled {
                applied: settlements.into_iter().map(|_| None).collect(),
                stale_acks: 0,
                journal: 0,
                superseded: true,
            },
            None,
        ));
    }
    if reply.len() != records + 2 {
        return Err(reply_error(
            "settle",
            format!("{} results for {records} records", reply.len()),
        ));
    }
    // The claim's reply: state -1 when it claimed nothing for the slots (handover_run.lua, `handover_none`).
    let batch = match claimed {
        Some((owner, claim, claim_reply, taken, collected))
            if claim_reply
                .get(1)
                .and_then(|state| int(state, "settle").ok())
                != Some(-1) =>
        {
            Some(claim_batch(
                keys,
                owner,
                claim,
                claim_reply,
                taken,
                collected,
            )?)
        }
        _ => None,
    };
    let mut flags = reply[1..=records].iter().map(|ok| *ok == 1);
    let applied = settlements
        .into_iter()
        .map(|s| if bulk(s) { None } else { flags.next() })
        .collect();
    Ok((
        Settled {
            applied,
            stale_acks: reply[0] as usize,
            journal: reply[records + 1].max(0) as u64,
            superseded: false,
        },
        batch,
    ))
}

/// Moves up to `max` due tasks to their ready lists. Returns how many moved and how long until the next one is
/// due (`None`: nothing is delayed).
pub fn promote(conn: &mut Conn, keys: &QueueKeys, max: usize) -> Result<(usize, Option<Duration>)> {
    let mut invocation = SCRIPTS.promote.prepare_invoke();
    invocation.key(&keys.wake).key(&keys.delayed_tasks);
    for key in keys.ready.iter().chain(&keys.delayed).chain(&keys.retry) {
        invocation.key(key);
    }
    let (moved, next_ms): (i64, i64) = invocation.arg(max).invoke(conn)?;
    conn.replicated(&keys.stats)?;
    Ok((
        moved as usize,
        (next_ms >= 0).then(|| Duration::from_millis(next_ms as u64)),
    ))
}
