//! Reading an owner's processing area, whichever layout it has: what it holds at a level (for the monitors'
//! recovery and `kmqd task show`) and how many tasks (for `kmqd stats` and `kmqd workers`).
//!
//! This kmqd keeps a claim's tasks in a list per claim and level, listed in the owner's claim set
//! (`processing:OWNER:LEVEL`, a zset claim -> tasks not yet settled) with a bitmap of the positions settled
//! (claim.lua, settle.lua); an owner registered by kmqd 0.1 kept a hash per level (token -> envelope), which a
//! monitor of this version still recovers, so that a rolling upgrade strands nothing.

use redis::{ConnectionLike, Value};

use super::{QueueKeys, Result, TokenId, bytes, reply_error, text};

/// Where to go on reading an owner's tasks at a level.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Cursor {
    /// From the start.
    #[default]
    Start,
    /// An older owner's hash: HSCAN's cursor.
    Hash(u64),
    /// The claims after this one.
    After(u64),
}

/// A page of what an owner holds at a level: its tasks not yet settled (token, envelope), and where to go on
/// (`None`: that was all).
pub struct Page {
    pub tasks: Vec<(TokenId, Box<[u8]>)>,
    pub next: Option<Cursor>,
}

/// Up to about `count` tasks held by `owner` at `level` (claim lists: one claim per page, whole), from `cursor`.
pub fn held(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    owner: &str,
    level: usize,
    cursor: Cursor,
    count: usize,
) -> Result<Page> {
    let key = keys.processing(owner, level);
    let kind: String = redis::cmd("TYPE").arg(&key).query(conn)?;
    match (kind.as_str(), cursor) {
        ("hash", Cursor::Start | Cursor::Hash(_)) => {
            let start = match cursor {
                Cursor::Hash(at) => at,
                _ => 0,
            };
            let (next, items): (u64, Vec<Value>) = redis::cmd("HSCAN")
                .arg(&key)
                .arg(start)
                .arg("COUNT")
                .arg(count)
                .query(conn)?;
            let mut tasks = Vec::with_capacity(items.len() / 2);
            let mut items = items.into_iter();
            while let (Some(field), Some(envelope)) = (items.next(), items.next()) {
                tasks.push((
                    TokenId::Field(text(field, "hscan")?),
                    bytes(envelope, "hscan")?,
                ));
            }
            Ok(Page {
                tasks,
                next: (next != 0).then_some(Cursor::Hash(next)),
            })
        }
        ("zset", Cursor::Start | Cursor::After(_)) => {
            let after = match cursor {
                Cursor::After(claim) => Some(claim),
                _ => None,
            };
            let members: Vec<String> = redis::cmd("ZRANGE").arg(&key).arg(0).arg(-1).query(conn)?;
            let mut claims: Vec<u64> = members
                .iter()
                .map(|member| {
                    member
                        .parse()
                        .map_err(|_| reply_error("claim set", format!("{key}: member {member}")))
                })
                .collect::<Result<_>>()?;
            claims.retain(|claim| after.is_none_or(|after| *claim > after));
            claims.sort_unstable();
            // The first claim that still holds a task: a member whose list is gone (evicted, deleted by hand)
            // must not hide the claims after it from the monitors.
            for (at, &claim) in claims.iter().enumerate() {
                let tasks = unsettled(conn, keys, owner, level, claim)?;
                if !tasks.is_empty() {
                    return Ok(Page {
                        tasks,
                        next: (at + 1 < claims.len()).then_some(Cursor::After(claim)),
                    });
                }
            }
            Ok(Page {
                tasks: Vec::new(),
                next: None,
            })
        }
        // Gone (or of another type than a cursor said: the key was replaced meanwhile): nothing more here.
        _ => Ok(Page {
            tasks: Vec::new(),
            next: None,
        }),
    }
}

/// The tasks of one claim list whose bit in its settled bitmap is not set.
fn unsettled(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    owner: &str,
    level: usize,
    claim: u64,
) -> Result<Vec<(TokenId, Box<[u8]>)>> {
    let (envelopes, settled): (Vec<Value>, Option<Vec<u8>>) = redis::pipe()
        .cmd("LRANGE")
        .arg(keys.claim_list(owner, level, claim))
        .arg(0)
        .arg(-1)
        .cmd("GET")
        .arg(keys.claim_settled(owner, level, claim))
        .query(conn)?;
    let settled = settled.unwrap_or_default();
    let mut tasks = Vec::new();
    for (position, envelope) in envelopes.into_iter().enumerate() {
        let bit = settled
            .get(position / 8)
            .is_some_and(|byte| byte & (0x80 >> (position % 8)) != 0);
        if !bit {
            let position = position as u32;
            tasks.push((
                TokenId::Listed { claim, position },
                bytes(envelope, "lrange")?,
            ));
        }
    }
    Ok(tasks)
}

/// How many tasks each of `keys` (an owner's processing keys: claim sets, or an older owner's hashes) holds: the
/// sum of a claim set's scores (each claim's tasks not yet settled), an older hash's length. Plain reads in two
/// round trips (the keys' types, then their contents), so that a read-only ACL user may make them.
pub fn counts(conn: &mut dyn ConnectionLike, keys: &[String]) -> Result<Vec<u64>> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let kinds = kinds(conn, keys)?;
    let mut pipe = redis::pipe();
    add_count_reads(&mut pipe, keys, &kinds);
    let replies: Vec<Value> = pipe.query(conn)?;
    replies.into_iter().map(count_of).collect()
}

/// The types of `keys` (TYPE, one round trip), which decide how [`add_count_reads`] reads each.
pub fn kinds(conn: &mut dyn ConnectionLike, keys: &[String]) -> Result<Vec<String>> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for key in keys {
        pipe.cmd("TYPE").arg(key);
    }
    Ok(pipe.query(conn)?)
}

/// Adds to `pipe` one read per key of `keys`, of type `kinds`, whose reply [`count_of`] turns into the key's
/// count of tasks: a hash's HLEN, a claim set's scores.
pub fn add_count_reads(pipe: &mut redis::Pipeline, keys: &[String], kinds: &[String]) {
    for (key, kind) in keys.iter().zip(kinds) {
        match kind.as_str() {
            "hash" => pipe.cmd("HLEN").arg(key),
            // Anything else (gone, or not kmqd's) reads as an empty zset.
            _ => pipe.cmd("ZRANGE").arg(key).arg(0).arg(-1).arg("WITHSCORES"),
        };
    }
}

/// The count of tasks in the reply to one of [`add_count_reads`]'s reads.
pub fn count_of(reply: Value) -> Result<u64> {
    match reply.extract_error()? {
        Value::Int(n) => Ok(n.max(0) as u64),
        other => {
            let scored: Vec<(String, f64)> =
                redis::from_redis_value(other).map_err(redis::RedisError::from)?;
            Ok(scored.iter().map(|(_, held)| held.max(0.0) as u64).sum())
        }
    }
}
