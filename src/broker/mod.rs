//! The only module that talks to Redis.
//!
//! Every state change of a task is one atomic step: a single command or one of the Lua scripts beside this file
//! (docs/PROTOCOL.md describes them). Functions here take a connection and a queue's [`QueueKeys`]; the threads
//! that call them own their connection for as long as they run, so a blocking call never starves anyone else.
//!
//! - [`connection`]: connecting, the pool, a thread's own [`Session`];
//! - [`tasks`]: a task's life: push, claim or pop, settle, renew, expire, promote;
//! - [`lookup`]: finding and cancelling tasks by id;
//! - [`schedule`]: firing periodic tasks;
//! - [`stats`]: depths and counters, and the protocol-version check.

pub mod connection;
pub mod keys;
pub mod lookup;
pub mod schedule;
pub mod stats;
pub mod tasks;

use std::fmt;
use std::sync::LazyLock;

use redis::{RedisWrite, ToRedisArgs, Value};

pub use connection::{Connector, IO_TIMEOUT, Pool, PooledConnection, Session, pool};
pub use keys::QueueKeys;
pub use lookup::{Found, Scope};
pub use schedule::{Fired, fire, schedule_state};
pub use stats::{QueueStats, check_protocol, stats};
pub use tasks::{
    Batch, Due, Fence, PushItem, SettleOp, Settled, Settlement, Taken, claim, expired, pop,
    promote, push, renew, settle, wait_wake,
};

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

/// A claim token, `SEQ:LEVEL` in Redis. Tokens this daemon claimed are kept as numbers and rendered only when
/// sent, so the hot path allocates no string per task; tokens read back from Redis (the monitor's) stay text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Token {
    /// Claimed by this daemon: the claim's sequence number and the index of its level.
    Claim { seq: u64, level: usize },
    /// As stored in Redis.
    Text(String),
}

impl Token {
    /// The token as Redis stores it, given the queue's level names.
    pub fn render<'a>(&'a self, levels: &'a [String]) -> TokenArg<'a> {
        TokenArg {
            token: self,
            levels,
        }
    }
}

/// A token with its queue's level names: what is written to Redis (and shown in logs).
pub struct TokenArg<'a> {
    token: &'a Token,
    levels: &'a [String],
}

impl fmt::Display for TokenArg<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.token {
            Token::Claim { seq, level } => write!(
                f,
                "{seq}:{}",
                self.levels.get(*level).map_or("?", String::as_str)
            ),
            Token::Text(text) => f.write_str(text),
        }
    }
}

impl ToRedisArgs for TokenArg<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        match self.token {
            Token::Text(text) => out.write_arg(text.as_bytes()),
            Token::Claim { .. } => {
                // A u64, a colon and a level name (at most 64 bytes) fit the stack buffer.
                let mut buffer = [0u8; 96];
                let mut cursor = std::io::Cursor::new(&mut buffer[..]);
                let _ = std::io::Write::write_fmt(&mut cursor, format_args!("{self}"));
                let len = cursor.position() as usize;
                out.write_arg(&buffer[..len]);
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_render_as_redis_stores_them() {
        let levels = ["high".to_string(), "low".to_string()];
        let claimed = Token::Claim {
            seq: 18_342,
            level: 1,
        };
        assert_eq!(claimed.render(&levels).to_string(), "18342:low");
        assert_eq!(
            claimed.render(&levels).to_redis_args(),
            [b"18342:low".to_vec()]
        );
        let read = Token::Text("7:high".into());
        assert_eq!(read.render(&levels).to_redis_args(), [b"7:high".to_vec()]);
    }
}
