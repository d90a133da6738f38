//! The only module that talks to Redis.
//!
//! Every state change of a task is one atomic step: a single command or one of the Lua scripts beside this file
//! (docs/PROTOCOL.md describes them). Functions here take a connection and a queue's [`QueueKeys`]; the threads
//! that call them own their connection for as long as they run, so a blocking call never starves anyone else.
//!
//! - [`access`]: the ACL rules each kind of kmqd process needs, and the check at start that its user has them;
//! - [`admin`]: pausing and resuming a queue, and the daemons serving it;
//! - [`connection`]: connecting, the pool, a thread's own [`Session`];
//! - [`tasks`]: a task's life: push, claim or pop, settle, leases, promote, the move from source lists;
//! - [`lookup`]: finding and cancelling tasks by id;
//! - [`processing`]: what an owner holds (the monitors' recovery, `task show`, the counts);
//! - [`peek`]: the heads of a queue's ready lists, delayed tasks and retries (the dashboard's queue page);
//! - [`dead`]: the dead-letter list: reading, requeueing and purging records;
//! - [`progress`]: the progress running tasks report (fenced by the owner's lease), and reading it back;
//! - [`results`]: the results the settle keeps (`keep_results`), read back;
//! - [`workflow`]: flows of tasks that wait for each other (`kmqd flow push`, the outboxes' mover, `flow show`);
//! - [`eviction`]: Redis's `maxmemory-policy`, read at start: anything that may evict kmqd's keys is refused;
//! - [`history`]: a sample a minute of each queue's counters and depths, for the dashboard's charts;
//! - [`schedule`]: firing periodic tasks;
//! - [`stats`](mod@stats): depths and counters, and the protocol-version check.

pub mod access;
pub(crate) mod admin;
pub mod connection;
pub mod dead;
pub(crate) mod eviction;
pub(crate) mod flows;
pub(crate) mod groups;
pub(crate) mod history;
pub mod keys;
pub mod levels;
pub(crate) mod lookup;
mod node;
pub mod owners;
pub mod payloads;
pub(crate) mod peek;
mod plain_claim;
mod plain_handover;
pub mod processing;
pub mod progress;
mod resp;
pub mod results;
pub(crate) mod schedule;
pub(crate) mod stats;
pub mod tasks;
mod tls;
pub mod workflow;

use std::fmt;
use std::sync::{Arc, LazyLock};

use redis::{ConnectionLike, Value};

pub use connection::{Conn, Connector, Pool, PooledConnection, Session, named_pool, pool};
pub use keys::QueueKeys;
pub use lookup::{Found, Scope};
pub use owners::{LeaseClock, OwnerInfo, Renewal, owner_info, owners, register, release, renew};
pub use schedule::{Fired, fire, schedule_state};
pub use stats::{QueueStats, Rates, TypeUsage, check_protocol, rate_used, stats, type_usage};
pub use tasks::{
    Batch, Call, ClaimLimits, Due, Fence, Fetched, Handover, Holder, Isolation, Kept, Limited,
    PopLimits, Popper, PushItem, SettleOp, Settled, Settlement, ThrottleScope, adopt, claim,
    claim_after_wake, claim_generic, load_settle, move_sources, promote, push, release_unique,
    settle, settle_handing_over, settle_handing_over_generic, wait_idle, wait_list, wait_wake,
};
pub use tls::tls_refusal;

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
    #[error(
        "owner {owner}: its lease ran out (was this daemon paused?); the monitors return its tasks to the queue"
    )]
    LeaseLost { owner: String },
    #[error("owner {owner}: the claim was fenced off after its reply was given up for lost")]
    Fenced { owner: String },
    /// The Redis user lacks ACL rules its role needs (found by [`access::check`] at start).
    #[error("{}", access::describe(.user.as_deref(), *.role, .refused, .hint))]
    Permission {
        /// The ACL user, once the caller has said which ([`BrokerError::for_user`]).
        user: Option<String>,
        /// The role whose rules it lacks.
        role: access::Role,
        /// Every refused pair, the first one named in the message.
        refused: Vec<access::Refusal>,
        /// The rules to add, as `ACL SETUSER` takes them: `+blmove ~kmq:*`.
        hint: String,
    },
    #[error(
        "this Redis does not know the command {command}, which kmqd sends (renamed or disabled with \
         rename-command? kmqd needs Redis 7.0 or newer)"
    )]
    UnknownCommand { command: String },
    /// Redis may evict kmqd's keys (its `maxmemory-policy` is not `noeviction`) and `[redis] allow_eviction`
    /// does not accept it (found by [`eviction::check`] at start).
    #[error("{}", eviction::describe_refusal(.policy, .node.as_deref()))]
    Eviction {
        policy: String,
        /// The master's address, in a cluster.
        node: Option<String>,
    },
    #[error(
        "only {acknowledged} of the {wanted} replicas ([redis] wait_replicas) acknowledged a change within \
         [redis] wait_timeout; it is made on the master, but a failover now could undo it"
    )]
    NotReplicated { acknowledged: u32, wanted: u32 },
}

impl BrokerError {
    /// Whether the command may have run although no reply came (a lost reply: a reset, a timeout): its caller
    /// must then find out what it did rather than assume either way. An error reply, or a connection that was
    /// never made, says the command did not run: every script checks everything that could fail (key types,
    /// counters, arguments) before its first write (ARCHITECTURE.md, "Invariants").
    pub fn may_have_run(&self) -> bool {
        match self {
            BrokerError::Redis(error) => {
                error.is_io_error()
                    || error.is_timeout()
                    || error.is_connection_dropped()
                    || (error.kind() == redis::ErrorKind::Client
                        && error.to_string().contains(connection::LOST_REPLY))
            }
            // It ran on the master; whether it survives a failover is what is unknown.
            BrokerError::NotReplicated { .. } => true,
            _ => false,
        }
    }

    /// Whether Redis refused the call as it was sent, which a smaller call may get through: an error reply
    /// (nothing ran) that is not about the server's state. `OOM` (the call's arguments count in Redis's memory),
    /// `ERR` (a protocol error such as a bulk over `proto-max-bulk-len`, a script's refusal of a record),
    /// `WRONGTYPE` (a key one record names) are; a server loading, read-only, failing over, busy with a
    /// script, out of disk (`MISCONF`), without replicas, a redirect, a missing script or a permission are
    /// about the server, and refuse any call alike: they are waited out, not split (`settler.rs`).
    pub fn refused(&self) -> bool {
        const ABOUT_THE_SERVER: [&str; 13] = [
            "LOADING",
            "READONLY",
            "MASTERDOWN",
            "CLUSTERDOWN",
            "TRYAGAIN",
            "BUSY",
            "MISCONF",
            "NOREPLICAS",
            "MOVED",
            "ASK",
            "NOSCRIPT",
            "NOPERM",
            "NOAUTH",
        ];
        match self {
            BrokerError::Redis(error) if !self.may_have_run() => error
                .code()
                .is_some_and(|code| !ABOUT_THE_SERVER.contains(&code)),
            _ => false,
        }
    }
}

impl BrokerError {
    /// Whether Redis answered NOSCRIPT: its script cache lost the script called (nothing ran).
    pub fn is_missing_script(&self) -> bool {
        matches!(self, BrokerError::Redis(error) if error.code() == Some("NOSCRIPT"))
    }

    /// Names the ACL user in a [`BrokerError::Permission`] (the check only has the connection).
    pub fn for_user(self, name: &str) -> BrokerError {
        match self {
            BrokerError::Permission {
                role,
                refused,
                hint,
                ..
            } => BrokerError::Permission {
                user: Some(name.to_string()),
                role,
                refused,
                hint,
            },
            other => other,
        }
    }

    /// Whether the failure is the setup's, which no retry fixes: wrong credentials, missing ACL rules, keys of
    /// another protocol version, a command this Redis lacks, a `maxmemory-policy` that may evict kmqd's keys.
    /// `kmqd` exits 2 on these, not 1.
    pub fn is_config_error(&self) -> bool {
        match self {
            BrokerError::Redis(error) => is_auth_error(error),
            BrokerError::Permission { .. }
            | BrokerError::UnknownCommand { .. }
            | BrokerError::Eviction { .. }
            | BrokerError::ProtocolVersion { .. } => true,
            _ => false,
        }
    }
}

pub type Result<T> = std::result::Result<T, BrokerError>;

/// Whether Redis refused the credentials or the ACL user's rights: a config error that no retry fixes.
pub fn is_auth_error(error: &redis::RedisError) -> bool {
    error.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(error.code(), Some("NOAUTH" | "WRONGPASS" | "NOPERM"))
}

/// The version of the key layout and scripts in docs/PROTOCOL.md.
pub const PROTOCOL_VERSION: u32 = 1;

/// The Lua scripts, loaded once per process; `redis::Script` sends EVALSHA and, when the server lost its script
/// cache (a restart, a failover, SCRIPT FLUSH), loads the script (SCRIPT LOAD) and sends EVALSHA again.
struct Scripts {
    push: redis::Script,
    claim: redis::Script,
    claim_plain: redis::Script,
    adopt: redis::Script,
    pop: redis::Script,
    take: redis::Script,
    release_unique: redis::Script,
    settle: redis::Script,
    handover_plain: redis::Script,
    renew: redis::Script,
    register: redis::Script,
    release: redis::Script,
    promote: redis::Script,
    remove: redis::Script,
    fire: redis::Script,
    access: redis::Script,
    dead_requeue: redis::Script,
    dead_purge: redis::Script,
    drain: redis::Script,
    moves: redis::Script,
    history: redis::Script,
    group_resume: redis::Script,
    flow_push: redis::Script,
    flow_apply: redis::Script,
    flow_outbox: redis::Script,
    progress: redis::Script,
}

/// The scripts' sources, for tests that pick out one script's calls (a fault-injecting proxy matches them).
pub mod sources {
    /// A script with checks.lua (the checks it makes before it writes) before it, and after the `#!lua` that
    /// must open a script that has one: one copy of those checks in the repository rather than one a script.
    macro_rules! checked {
        (#!lua $file:literal) => {
            concat!(
                "#!lua\n",
                include_str!("scripts/checks.lua"),
                include_str!($file)
            )
        };
        ($file:literal) => {
            concat!(include_str!("scripts/checks.lua"), include_str!($file))
        };
    }

    // claim.lua and its preludes: claim.lua defines the claim as a function (`claim_run`), which CLAIM calls and
    // settle.lua too (the slot handed over in the settle: SETTLE).
    macro_rules! claim_parts {
        () => {
            concat!(
                include_str!("scripts/checks.lua"),
                include_str!("scripts/rate.lua"),
                include_str!("scripts/turns.lua"),
                include_str!("scripts/types.lua"),
                include_str!("scripts/groups.lua"),
                include_str!("scripts/claim.lua")
            )
        };
    }
    /// claim.lua and pop.lua both count a rate limit's starts and split a take between weighted levels:
    /// rate.lua and turns.lua, their shared parts, go before each (after the shebang, which must open a script,
    /// and checks.lua), and types.lua, the limits per task type; groups.lua, the fair groups, before claim.lua only.
    /// Each of these four defines its functions in one function of its own (`rate_parts`, `turns_parts`,
    /// `types_parts`, `groups_parts`), which a call runs only when its arguments configure the feature, as the
    /// fields of one table (`rate`, `turns`, `types`, `groups`): a take without them creates one closure for each
    /// file, not one for each of its functions, and its own functions name one upvalue for each file, not one for
    /// each function they call (rate.lua says what each costs).
    pub const CLAIM: &str = concat!("#!lua\n", claim_parts!(), "return claim_run(false)\n");
    pub const ADOPT: &str = checked!(#!lua "scripts/adopt.lua");
    pub const POP: &str = concat!(
        "#!lua\n",
        include_str!("scripts/checks.lua"),
        include_str!("scripts/rate.lua"),
        include_str!("scripts/turns.lua"),
        include_str!("scripts/types.lua"),
        include_str!("scripts/pop.lua")
    );
    pub const TAKE: &str = include_str!("scripts/take.lua");
    /// unique_hold.lua frees a unique id as its task ends, leaving the hold of a `unique_for` task, and takes
    /// one again with its window: before release_unique.lua, settle.lua, dead_requeue.lua and remove.lua.
    pub const RELEASE_UNIQUE: &str = concat!(
        "#!lua\n",
        include_str!("scripts/checks.lua"),
        include_str!("scripts/unique_hold.lua"),
        include_str!("scripts/release_unique.lua")
    );
    /// results.lua, the results a settle keeps (`keep_results`), after.lua, the notes it writes for the tasks
    /// of a flow that wait (docs/design/flows.md), and unique_hold.lua go before settle.lua (after the shebang);
    /// then handover.lua, the trailer of a settle that hands the slots it frees over to the next tasks, and
    /// claim.lua with its preludes and handover_run.lua inside a function (`handover_parts(KEYS, ARGV)`) that only
    /// such a settle calls: every other settle creates one closure for them, where Lua would create one for each
    /// of their top level's `local function`s, on every call (the preludes' own functions are defined only for a
    /// call that uses them: rate.lua's `rate_parts` and the others); its parameters, the claim block's own keys
    /// and arguments, shadow the globals for all of those parts.
    pub const SETTLE: &str = concat!(
        "#!lua\n",
        include_str!("scripts/results.lua"),
        include_str!("scripts/after.lua"),
        include_str!("scripts/unique_hold.lua"),
        include_str!("scripts/handover.lua"),
        "local function handover_parts(KEYS, ARGV)\n",
        claim_parts!(),
        include_str!("scripts/handover_run.lua"),
        "end\n",
        include_str!("scripts/settle.lua")
    );
    /// The claim made for a plain queue (src/broker/plain_claim.rs), with CLAIM's keys and arguments, which leaves
    /// every other call to CLAIM.
    pub const CLAIM_PLAIN: &str = concat!("#!lua\n", include_str!("scripts/claim_plain.lua"));
    /// The settle made for the handover of a plain queue at `max_running` (src/broker/plain_handover.rs), which
    /// leaves every other call to SETTLE.
    pub const HANDOVER_PLAIN: &str = concat!("#!lua\n", include_str!("scripts/handover_plain.lua"));
    pub const RENEW: &str = checked!(#!lua "scripts/renew.lua");
    pub const REGISTER: &str = checked!(#!lua "scripts/register.lua");
    pub const RELEASE: &str = checked!(#!lua "scripts/release.lua");
    pub const PROMOTE: &str = checked!("scripts/promote.lua");
    /// unique_hold.lua leaves a cancelled `unique_for` task's hold.
    pub const REMOVE: &str = concat!(
        include_str!("scripts/checks.lua"),
        include_str!("scripts/unique_hold.lua"),
        include_str!("scripts/remove.lua")
    );
    pub const FIRE: &str = checked!("scripts/fire.lua");
    pub const ACCESS: &str = include_str!("scripts/access.lua");
    /// unique_hold.lua takes a requeued task's unique id again with its window.
    pub const DEAD_REQUEUE: &str = concat!(
        "#!lua\n",
        include_str!("scripts/checks.lua"),
        include_str!("scripts/unique_hold.lua"),
        include_str!("scripts/dead_requeue.lua")
    );
    pub const DEAD_PURGE: &str = checked!(#!lua "scripts/dead_purge.lua");
    pub const DRAIN: &str = checked!(#!lua "scripts/drain.lua");
    pub const MOVE: &str = checked!("scripts/move.lua");
    pub const HISTORY: &str = checked!(#!lua "scripts/history.lua");
    pub const GROUP_RESUME: &str = checked!("scripts/group_resume.lua");
    /// deps.lua, what becomes of a waiting task of a flow, goes before both scripts that record its dependencies'
    /// outcomes (after checks.lua, whose checks it uses).
    pub const FLOW_PUSH: &str = concat!(
        "#!lua\n",
        include_str!("scripts/checks.lua"),
        include_str!("scripts/deps.lua"),
        include_str!("scripts/flow_push.lua")
    );
    pub const FLOW_APPLY: &str = concat!(
        "#!lua\n",
        include_str!("scripts/checks.lua"),
        include_str!("scripts/deps.lua"),
        include_str!("scripts/flow_apply.lua")
    );
    pub const FLOW_OUTBOX: &str = checked!(#!lua "scripts/flow_outbox.lua");
    pub const PROGRESS: &str = checked!(#!lua "scripts/progress.lua");

    /// Every script the broker runs, by its file's name, push.lua first.
    pub const ALL: [(&str, &str); 26] = [
        ("push.lua", super::PUSH_SCRIPT),
        ("claim.lua", CLAIM),
        ("claim_plain.lua", CLAIM_PLAIN),
        ("adopt.lua", ADOPT),
        ("pop.lua", POP),
        ("take.lua", TAKE),
        ("release_unique.lua", RELEASE_UNIQUE),
        ("settle.lua", SETTLE),
        ("handover_plain.lua", HANDOVER_PLAIN),
        ("renew.lua", RENEW),
        ("register.lua", REGISTER),
        ("release.lua", RELEASE),
        ("promote.lua", PROMOTE),
        ("remove.lua", REMOVE),
        ("fire.lua", FIRE),
        ("access.lua", ACCESS),
        ("dead_requeue.lua", DEAD_REQUEUE),
        ("dead_purge.lua", DEAD_PURGE),
        ("drain.lua", DRAIN),
        ("move.lua", MOVE),
        ("history.lua", HISTORY),
        ("group_resume.lua", GROUP_RESUME),
        ("flow_push.lua", FLOW_PUSH),
        ("flow_apply.lua", FLOW_APPLY),
        ("flow_outbox.lua", FLOW_OUTBOX),
        ("progress.lua", PROGRESS),
    ];

    /// The scripts that may be 32 KiB or more (`tasks::LARGE_ARGUMENT`), each loaded only on a
    /// connection that sends no argument that large, since Redis would cache a source that large in whatever
    /// buffer the connection's last large argument left (see [`super::tasks::load_settle`]): claim.lua (safe
    /// mode) and pop.lua (default mode, past 32 KiB since types.lua became its prelude) on the fetcher's
    /// connection, whose calls carry ids, counts and keys; settle.lua by `load_settle`, on a new connection after
    /// a call that carried a large record. A script not named here is held under 32 KiB by a test, so that the
    /// next one to grow past it is seen.
    pub const LOADED_APART: [&str; 3] = ["claim.lua", "pop.lua", "settle.lua"];
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    push: redis::Script::new(PUSH_SCRIPT),
    claim: redis::Script::new(sources::CLAIM),
    claim_plain: redis::Script::new(sources::CLAIM_PLAIN),
    adopt: redis::Script::new(sources::ADOPT),
    pop: redis::Script::new(sources::POP),
    take: redis::Script::new(sources::TAKE),
    release_unique: redis::Script::new(sources::RELEASE_UNIQUE),
    settle: redis::Script::new(sources::SETTLE),
    handover_plain: redis::Script::new(sources::HANDOVER_PLAIN),
    renew: redis::Script::new(sources::RENEW),
    register: redis::Script::new(sources::REGISTER),
    release: redis::Script::new(sources::RELEASE),
    promote: redis::Script::new(sources::PROMOTE),
    remove: redis::Script::new(sources::REMOVE),
    fire: redis::Script::new(sources::FIRE),
    access: redis::Script::new(sources::ACCESS),
    dead_requeue: redis::Script::new(sources::DEAD_REQUEUE),
    dead_purge: redis::Script::new(sources::DEAD_PURGE),
    drain: redis::Script::new(sources::DRAIN),
    moves: redis::Script::new(sources::MOVE),
    history: redis::Script::new(sources::HISTORY),
    group_resume: redis::Script::new(sources::GROUP_RESUME),
    flow_push: redis::Script::new(sources::FLOW_PUSH),
    flow_apply: redis::Script::new(sources::FLOW_APPLY),
    flow_outbox: redis::Script::new(sources::FLOW_OUTBOX),
    progress: redis::Script::new(sources::PROGRESS),
});

/// The published enqueue script (docs/PROTOCOL.md shows how to call it from any language).
pub const PUSH_SCRIPT: &str = include_str!("scripts/push.lua");

/// Where a claimed task is: its owner (one daemon's claim identity on the queue) and where in the owner's
/// processing area it is held.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Token {
    pub owner: Arc<str>,
    pub id: TokenId,
}

/// A claimed task's place in its owner's processing area (at the task's level, which the settlement carries).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenId {
    /// Position `position` of the list of claim `claim` (claim.lua).
    Listed { claim: u64, position: u32 },
    /// A field of the processing hash of an owner registered by a kmqd that kept one (0.1, docs/PROTOCOL.md
    /// "Versions"): read back by a monitor that recovers its tasks.
    Field(String),
}

impl fmt::Display for TokenId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenId::Listed { claim, position } => write!(f, "{claim}.{position}"),
            TokenId::Field(field) => f.write_str(field),
        }
    }
}

/// This host's name, kept to the characters that are safe in key names (`[A-Za-z0-9._-]`, others become `_`).
pub fn hostname() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host: String = host
        .trim()
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if host.is_empty() {
        "unknown".to_string()
    } else {
        host
    }
}

/// Milliseconds since the Unix epoch on this host's clock (0 before 1970): for ids, for values only people read
/// (when a daemon started, when a queue was paused) and for the scheduler's offset to Redis's clock. Nothing that
/// decides a task's fate reads it: that is Redis's clock (ARCHITECTURE.md, "Invariants").
pub fn local_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as i64)
}

/// A new id that no other daemon run anywhere shares, made without asking Redis: host, pid, time and 32 random
/// bits. Each run of the daemon makes one (tests run several daemons in one process); owner ids and settling
/// parties are made from it, so that a Redis that lost its data (a restart without persistence, a restored
/// backup, a failover to a replica that lagged) can never hand two live daemons the same identity.
pub fn instance_id() -> String {
    let now_ms = local_now_ms();
    let random = uuid::Uuid::new_v4().as_u128() as u32;
    format!(
        "{}-{}-{now_ms}-{random:08x}",
        hostname(),
        std::process::id()
    )
}

/// Redis's `TIME` reply (seconds, microseconds) as ms since the epoch. Deadlines and due times are all on
/// Redis's clock, so that daemons on hosts whose clocks disagree still agree on them.
fn time_ms((seconds, micros): (i64, i64)) -> i64 {
    seconds * 1000 + micros / 1000
}

/// Redis's clock now, ms since the epoch.
pub fn redis_now(conn: &mut dyn ConnectionLike) -> Result<i64> {
    Ok(time_ms(redis::cmd("TIME").query(conn)?))
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

/// A payload exactly as stored: producers may push bytes that are not UTF-8, and such a task is dead-lettered
/// with its bytes intact, never altered.
fn bytes(value: Value, what: &'static str) -> Result<Box<[u8]>> {
    match value {
        Value::BulkString(bytes) => Ok(bytes.into_boxed_slice()),
        Value::SimpleString(text) => Ok(text.into_bytes().into_boxed_slice()),
        other => Err(reply_error(
            what,
            format!("expected a string, got {other:?}"),
        )),
    }
}

/// A reply that is text (a key name, an owner id, a token); bytes that are not UTF-8 are replaced (U+FFFD), which
/// only ever happens with keys or members kmqd did not write.
fn text(value: Value, what: &'static str) -> Result<String> {
    let bytes = bytes(value, what)?;
    Ok(String::from_utf8(bytes.into_vec())
        .unwrap_or_else(|error| String::from_utf8_lossy(error.as_bytes()).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_show_their_claim_and_position() {
        let listed = TokenId::Listed {
            claim: 18_342,
            position: 7,
        };
        assert_eq!(listed.to_string(), "18342.7");
        assert_eq!(TokenId::Field("7".into()).to_string(), "7");
    }

    /// The body of a script's `local function NAME` (up to its closing `end` at the start of a line).
    fn lua_function<'a>(script: &'a str, name: &str) -> &'a str {
        let start = script
            .find(&format!("local function {name}("))
            .unwrap_or_else(|| panic!("no function {name}"));
        let end = script[start..].find("\nend\n").expect("its end") + start;
        &script[start..end]
    }

    /// A script of 32 KiB or more loaded on a connection that just carried a large argument stays in the
    /// script cache at that argument's size (16.9 MB for settle.lua after a 15 MiB recovery, over `maxmemory`):
    /// only the scripts loaded apart may grow that large. Fails when a script grows past it: load it apart (and
    /// name it in `LOADED_APART`), or make it smaller.
    #[test]
    fn every_script_is_under_32_kib_but_those_loaded_where_no_large_argument_goes() {
        for (name, source) in sources::ALL {
            if sources::LOADED_APART.contains(&name) {
                continue;
            }
            assert!(
                source.len() < tasks::LARGE_ARGUMENT,
                "{name} is {} bytes with its preludes, at least the {} Redis keeps a large argument's buffer \
                 for (see broker::load_settle): make it smaller, or load it apart (sources::LOADED_APART)",
                source.len(),
                tasks::LARGE_ARGUMENT
            );
        }
    }

    /// `sources::ALL`, which the size check and tests/it/script_checks walk, names every script: each file of
    /// scripts/ is one, or one's prelude.
    #[test]
    fn every_script_file_is_in_a_source_the_broker_runs() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/broker/scripts");
        for entry in std::fs::read_dir(&dir).expect("the scripts' directory") {
            let path = entry.expect("an entry").path();
            let name = path
                .file_name()
                .and_then(|name| name.to_str())
                .expect("a name");
            let text = std::fs::read_to_string(&path).expect("a script");
            assert!(
                sources::ALL
                    .iter()
                    .any(|(script, source)| *script == name || source.contains(&text)),
                "{name} is in no script of sources::ALL"
            );
        }
    }

    /// The preludes of claim.lua and pop.lua keep their functions in one table a file (`rate`, `turns`, `types`,
    /// `groups`), made by the file's `*_parts` function, not in locals of the script's top level: a function that
    /// names a top-level local holds it as an upvalue, which Lua finds or makes each time it creates that function,
    /// on every call (`claim_run` named 38 of them: 21,000 of an idle claim's instructions, docs/PERFORMANCE.md,
    /// "The idle take's Lua, line by line"). Fails when a prelude declares another top-level local.
    #[test]
    fn each_prelude_names_one_table_at_the_top_level() {
        let preludes: [(&str, &str, &[&str]); 4] = [
            (
                "rate.lua",
                include_str!("scripts/rate.lua"),
                &["local rate", "local function rate_parts()"],
            ),
            (
                "turns.lua",
                include_str!("scripts/turns.lua"),
                &["local turns", "local function turns_parts()"],
            ),
            (
                "types.lua",
                include_str!("scripts/types.lua"),
                &[
                    "local function types_size(at)",
                    "local types",
                    "local function types_parts()",
                ],
            ),
            (
                "groups.lua",
                include_str!("scripts/groups.lua"),
                &[
                    "local GROUP_TIMED, GROUP_PARKED = 1e15, 2e15",
                    "local groups",
                    "local function groups_parts()",
                ],
            ),
        ];
        for (name, source, expected) in preludes {
            let top: Vec<&str> = source
                .lines()
                .filter(|line| line.starts_with("local "))
                .collect();
            assert_eq!(
                top, expected,
                "{name}'s top level declares other locals: define a function inside its parts function, as a field \
                 of its table"
            );
        }
    }

    /// push.lua is published whole (producers EVAL the file), so fire.lua cannot include its `created_at`
    /// splice and carries a copy; the copy must stay the same function.
    #[test]
    fn push_and_fire_stamp_created_at_with_the_same_function() {
        assert_eq!(
            lua_function(PUSH_SCRIPT, "stamped"),
            lua_function(sources::FIRE, "stamped")
        );
    }
}
