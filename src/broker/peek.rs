//! The heads of a queue's waiting tasks, as the dashboard's queue page shows them: the next tasks of each ready
//! list, the delayed tasks due soonest and the retries due soonest (each with its due time). Read-only, and
//! bounded by `limit` per list and by bytes ([`LIST_BYTES`]), so a page view of a queue with a million tasks, or
//! of tasks of 16 MiB, costs a few small commands.

use redis::Value;
use serde::Serialize;

use super::{Conn, QueueKeys, Result, reply_error, text, time_ms};

/// A task waiting for its due time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DueTask {
    pub level: String,
    /// When it is due, ms since the epoch on Redis's clock.
    pub due_at_ms: i64,
    /// How long until then (negative: overdue, waiting for the delay poller).
    pub due_in_ms: i64,
    pub envelope: String,
}

/// The next tasks of one ready list, head (the next taken) first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ReadyHead {
    pub level: String,
    pub envelopes: Vec<String>,
}

/// What [`peek`] read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Waiting {
    /// Per configured level, highest first.
    pub ready: Vec<ReadyHead>,
    /// The delayed tasks due soonest, across levels, soonest first (at most `limit`).
    pub delayed: Vec<DueTask>,
    /// The retries due soonest (their envelope's `last_error` says why the last attempt failed).
    pub retrying: Vec<DueTask>,
}

/// Elements a page's read takes from one list per round trip: what one round may bring beyond the list's
/// [`LIST_BYTES`] is at most this many tasks.
pub const CHUNK: usize = 4;

/// The most bytes of tasks read from one list for a page, unless its first task alone is larger (review M7: a page
/// of 20 tasks of 16 MiB from each list, every second, per open tab, is more than a dashboard should hold or
/// Redis send): the list shows fewer tasks than asked for.
pub const LIST_BYTES: usize = 4 << 20;

/// One list (or sorted set) of a queue being read for a page, [`CHUNK`] at a time.
struct Head<'a> {
    key: &'a str,
    level: usize,
    /// A sorted set, read by score with its scores (`ZRANGE ... WITHSCORES`), else a list (`LRANGE`).
    scored: bool,
    /// Members and scores (0 for a list's elements), in order.
    got: Vec<(String, i64)>,
    bytes: usize,
    done: bool,
}

impl<'a> Head<'a> {
    fn new(key: &'a str, level: usize, scored: bool) -> Head<'a> {
        Head {
            key,
            level,
            scored,
            got: Vec::new(),
            bytes: 0,
            done: false,
        }
    }

    fn ask(&self, pipe: &mut redis::Pipeline, limit: usize) {
        let start = self.got.len();
        let stop = (start + CHUNK).min(limit) - 1;
        if self.scored {
            pipe.cmd("ZRANGE")
                .arg(self.key)
                .arg(start)
                .arg(stop)
                .arg("WITHSCORES");
        } else {
            pipe.cmd("LRANGE").arg(self.key).arg(start).arg(stop);
        }
    }

    fn take(&mut self, reply: Value, limit: usize) -> Result<()> {
        let asked = (self.got.len() + CHUNK).min(limit) - self.got.len();
        let items: Vec<(String, i64)> = if self.scored {
            let pairs: Vec<(String, f64)> = redis::from_redis_value(reply)
                .map_err(|error| reply_error("peek", error.to_string()))?;
            pairs
                .into_iter()
                .map(|(member, score)| (member, score as i64))
                .collect()
        } else {
            let Value::Array(items) = reply else {
                return Err(reply_error("peek", "LRANGE did not answer a list"));
            };
            items
                .into_iter()
                .map(|item| Ok((text(item, "peek")?, 0)))
                .collect::<Result<_>>()?
        };
        let count = items.len();
        self.bytes += items.iter().map(|(member, _)| member.len()).sum::<usize>();
        self.got.extend(items);
        self.done = count < asked || self.got.len() >= limit || self.bytes >= LIST_BYTES;
        Ok(())
    }
}

/// Reads at most `limit` tasks of each ready list, and the `limit` delayed tasks and retries due soonest, [`CHUNK`]
/// of each list per round trip and at most about [`LIST_BYTES`] of each (fewer tasks when they are large); the
/// delayed tasks' envelopes are in the `delayed-tasks` hash, by id.
pub fn peek(conn: &mut Conn, keys: &QueueKeys, limit: usize) -> Result<Waiting> {
    if limit == 0 {
        return Ok(Waiting::default());
    }
    let levels = keys.levels.len();
    let mut heads: Vec<Head<'_>> = keys
        .ready
        .iter()
        .enumerate()
        .map(|(level, key)| Head::new(key, level, false))
        .chain(
            keys.delayed
                .iter()
                .chain(&keys.retry)
                .enumerate()
                .map(|(at, key)| Head::new(key, at % levels, true)),
        )
        .collect();
    let mut now = None;
    while now.is_none() || heads.iter().any(|head| !head.done) {
        let mut pipe = redis::pipe();
        // A keyed command first: in a cluster a pipeline goes to its first key's node.
        let asked: Vec<usize> = (0..heads.len()).filter(|&at| !heads[at].done).collect();
        for &at in &asked {
            heads[at].ask(&mut pipe, limit);
        }
        if now.is_none() {
            pipe.cmd("TIME");
        }
        // Never empty: the first round asks every list, and a later one happens only for a list not done.
        let mut replies: Vec<Value> = pipe.query(conn)?;
        if now.is_none() {
            let time = replies
                .pop()
                .ok_or_else(|| reply_error("peek", "no TIME"))?;
            now = Some(time_ms(
                redis::from_redis_value(time)
                    .map_err(|error| reply_error("peek", error.to_string()))?,
            ));
        }
        if replies.len() != asked.len() {
            return Err(reply_error("peek", "fewer replies than commands"));
        }
        for (at, reply) in asked.into_iter().zip(replies) {
            heads[at].take(reply, limit)?;
        }
    }
    let now = now.unwrap_or_default();
    let mut heads = heads.into_iter();
    let ready = keys
        .levels
        .iter()
        .zip(heads.by_ref())
        .map(|(level, head)| ReadyHead {
            level: level.clone(),
            envelopes: head.got.into_iter().map(|(envelope, _)| envelope).collect(),
        })
        .collect();
    let soonest = |heads: &mut dyn Iterator<Item = Head<'_>>| {
        let mut all: Vec<(String, String, i64)> = heads
            .take(levels)
            .flat_map(|head| {
                let level = keys.levels[head.level].clone();
                head.got
                    .into_iter()
                    .map(move |(member, due)| (level.clone(), member, due))
            })
            .collect();
        all.sort_by_key(|(_, _, due)| *due);
        all.truncate(limit);
        all
    };
    let delayed_ids = soonest(&mut heads);
    let retrying = soonest(&mut heads);
    let envelopes = delayed_envelopes(conn, keys, &delayed_ids)?;
    let due = |level: String, envelope: String, due_at_ms: i64| DueTask {
        level,
        due_at_ms,
        due_in_ms: due_at_ms - now,
        envelope,
    };
    Ok(Waiting {
        ready,
        // A delayed task promoted between the two reads has no envelope left here: it is ready now.
        delayed: delayed_ids
            .into_iter()
            .zip(envelopes)
            .filter_map(|((level, _, at), envelope)| Some(due(level, envelope?, at)))
            .collect(),
        retrying: retrying
            .into_iter()
            .map(|(level, envelope, at)| due(level, envelope, at))
            .collect(),
    })
}

/// The envelopes of the delayed tasks `ids` (level, id, due), [`CHUNK`] per round trip and at most about
/// [`LIST_BYTES`] of them: `None` for those not read (or promoted meanwhile).
fn delayed_envelopes(
    conn: &mut Conn,
    keys: &QueueKeys,
    ids: &[(String, String, i64)],
) -> Result<Vec<Option<String>>> {
    let mut envelopes = Vec::with_capacity(ids.len());
    let mut bytes = 0;
    for chunk in ids.chunks(CHUNK) {
        if bytes >= LIST_BYTES {
            break;
        }
        let got: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&keys.delayed_tasks)
            .arg(chunk.iter().map(|(_, id, _)| id).collect::<Vec<_>>())
            .query(conn)?;
        bytes += got.iter().flatten().map(String::len).sum::<usize>();
        envelopes.extend(got);
    }
    Ok(envelopes)
}
