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
pub(crate) enum Cursor {
    /// From the start.
    #[default]
    Start,
    /// An older owner's hash: HSCAN's cursor.
    Hash(u64),
    /// The claims after this one.
    After(u64),
    /// This claim's list, from position `from`, `step` positions a page (chosen when the claim was begun).
    Within { claim: u64, from: u64, step: u64 },
}

/// How much of a claim list one page reads (review M8: a claim of large tasks is never read whole at once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Window {
    /// The most positions of a claim list a page reads (an older owner's hash: HSCAN's COUNT).
    pub(crate) tasks: usize,
    /// `Some`: the bytes a page may read too, in kmqd's role (`MEMORY USAGE`, which the read-only roles lack):
    /// a claim list larger than `budget` in all is read `budget / largest` positions a page, `largest` being
    /// the largest a claimed task can be (the queue's `max_task_bytes`: claim.lua takes none larger).
    pub(crate) bytes: Option<Budget>,
}

/// See [`Window::bytes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Budget {
    pub(crate) budget: u64,
    pub(crate) largest: u64,
}

impl Window {
    /// At most `tasks` positions a page, whatever their size.
    pub fn tasks(tasks: usize) -> Window {
        Window { tasks, bytes: None }
    }

    /// The positions a page of a claim list of `usage` bytes in all (`MEMORY USAGE`) reads.
    fn step(&self, usage: Option<u64>) -> u64 {
        let most = self.tasks.max(1) as u64;
        match (self.bytes, usage) {
            (Some(Budget { budget, largest }), Some(usage)) if usage > budget => {
                (budget / largest.max(1)).clamp(1, most)
            }
            _ => most,
        }
    }
}

/// A page of what an owner holds at a level: its tasks not yet settled (token, envelope), and where to go on
/// (`None`: that was all). A page may hold no task and still have a next one (a window of a claim whose tasks
/// are all settled).
pub(crate) struct Page {
    pub(crate) tasks: Vec<(TokenId, Box<[u8]>)>,
    pub(crate) next: Option<Cursor>,
}

impl Page {
    fn end() -> Page {
        Page {
            tasks: Vec::new(),
            next: None,
        }
    }
}

/// A page of the tasks held by `owner` at `level`, from `cursor`: an older owner's hash, `window.tasks` fields
/// of it (about: HSCAN's COUNT); claim lists, one window of one claim's list (see [`Window`]).
pub(crate) fn held(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    owner: &str,
    level: usize,
    cursor: Cursor,
    window: Window,
) -> Result<Page> {
    let key = keys.processing(owner, level);
    if let Cursor::Within { claim, from, step } = cursor {
        return read_window(conn, keys, owner, level, claim, from, step);
    }
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
                .arg(window.tasks)
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
            // The next claim: a member whose list is gone (evicted, deleted by hand) reads as an empty page that
            // goes on to the claims after it.
            let Some(&claim) = claims.iter().min() else {
                return Ok(Page::end());
            };
            let usage = match window.bytes {
                Some(_) => redis::cmd("MEMORY")
                    .arg("USAGE")
                    .arg(keys.claim_list(owner, level, claim))
                    .arg("SAMPLES")
                    .arg(0)
                    .query::<Option<u64>>(conn)?,
                None => None,
            };
            read_window(conn, keys, owner, level, claim, 0, window.step(usage))
        }
        // Gone (or of another type than a cursor said: the key was replaced meanwhile): nothing more here.
        _ => Ok(Page::end()),
    }
}

/// The tasks of one claim list at positions `from` to `from + step - 1` whose bit in the claim's settled bitmap
/// is not set, and the next page: the list's next window, or the claims after this one.
fn read_window(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    owner: &str,
    level: usize,
    claim: u64,
    from: u64,
    step: u64,
) -> Result<Page> {
    let list = keys.claim_list(owner, level, claim);
    let (envelopes, settled, length): (Vec<Value>, Option<Vec<u8>>, u64) = redis::pipe()
        .cmd("LRANGE")
        .arg(&list)
        .arg(from)
        .arg(from + step - 1)
        .cmd("GET")
        .arg(keys.claim_settled(owner, level, claim))
        .cmd("LLEN")
        .arg(&list)
        .query(conn)?;
    let settled = settled.unwrap_or_default();
    let mut tasks = Vec::new();
    for (offset, envelope) in envelopes.into_iter().enumerate() {
        let position = from as usize + offset;
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
    let next = if from + step < length {
        Cursor::Within {
            claim,
            from: from + step,
            step,
        }
    } else {
        Cursor::After(claim)
    };
    Ok(Page {
        tasks,
        next: Some(next),
    })
}

/// How many tasks each of `keys` (an owner's processing keys: claim sets, or an older owner's hashes) holds: the
/// sum of a claim set's scores (each claim's tasks not yet settled), an older hash's length. Plain reads in two
/// round trips (the keys' types, then their contents), so that a read-only ACL user may make them.
pub(crate) fn counts(conn: &mut dyn ConnectionLike, keys: &[String]) -> Result<Vec<u64>> {
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
pub(crate) fn kinds(conn: &mut dyn ConnectionLike, keys: &[String]) -> Result<Vec<String>> {
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
pub(crate) fn add_count_reads(pipe: &mut redis::Pipeline, keys: &[String], kinds: &[String]) {
    for (key, kind) in keys.iter().zip(kinds) {
        match kind.as_str() {
            "hash" => pipe.cmd("HLEN").arg(key),
            // Anything else (gone, or not kmqd's) reads as an empty zset.
            _ => pipe.cmd("ZRANGE").arg(key).arg(0).arg(-1).arg("WITHSCORES"),
        };
    }
}

/// The count of tasks in the reply to one of [`add_count_reads`]'s reads.
pub(crate) fn count_of(reply: Value) -> Result<u64> {
    match reply.extract_error()? {
        Value::Int(n) => Ok(n.max(0) as u64),
        other => {
            let scored: Vec<(String, f64)> =
                redis::from_redis_value(other).map_err(redis::RedisError::from)?;
            Ok(scored.iter().map(|(_, held)| held.max(0.0) as u64).sum())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_list_over_the_budget_is_read_as_many_of_the_largest_tasks_as_fit() {
        let window = Window {
            tasks: 100,
            bytes: Some(Budget {
                budget: 16 << 20,
                largest: 5 << 20,
            }),
        };
        // Within the budget in all: the count alone bounds a page.
        assert_eq!(window.step(Some(16 << 20)), 100);
        assert_eq!(window.step(Some(1 << 20)), 100);
        // Over it: three tasks of the largest size fit in 16 MiB.
        assert_eq!(window.step(Some((16 << 20) + 1)), 3);
        // Tasks larger than the budget: one at a time.
        let huge = Window {
            bytes: Some(Budget {
                budget: 16 << 20,
                largest: 512 << 20,
            }),
            ..window
        };
        assert_eq!(huge.step(Some(1 << 30)), 1);
        // No size known (a read-only role), or none asked for: the count.
        assert_eq!(window.step(None), 100);
        assert_eq!(Window::tasks(7).step(Some(1 << 40)), 7);
        assert_eq!(
            Window::tasks(0).step(None),
            1,
            "a page reads at least one position"
        );
    }
}
