//! The heads of a queue's waiting tasks, as the dashboard's queue page shows them: the next tasks of each ready
//! list, the delayed tasks due soonest and the retries due soonest (each with its due time). Read-only, and
//! bounded by `limit` per list, so a page view of a queue with a million tasks costs a few small commands.

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

/// Reads at most `limit` tasks of each ready list, and the `limit` delayed tasks and retries due soonest, in two
/// round trips (the delayed tasks' envelopes are in the `delayed-tasks` hash, by id).
pub fn peek(conn: &mut Conn, keys: &QueueKeys, limit: usize) -> Result<Waiting> {
    if limit == 0 {
        return Ok(Waiting::default());
    }
    let stop = limit as i64 - 1;
    let mut pipe = redis::pipe();
    // A keyed command first: in a cluster a pipeline goes to its first key's node.
    for key in &keys.ready {
        pipe.cmd("LRANGE").arg(key).arg(0).arg(stop);
    }
    for key in keys.delayed.iter().chain(&keys.retry) {
        pipe.cmd("ZRANGE")
            .arg(key)
            .arg(0)
            .arg(stop)
            .arg("WITHSCORES");
    }
    pipe.cmd("TIME");
    let mut replies: Vec<Value> = pipe.query(conn)?;
    let now = time_ms(
        redis::from_redis_value(
            replies
                .pop()
                .ok_or_else(|| reply_error("peek", "no TIME"))?,
        )
        .map_err(|error| reply_error("peek", error.to_string()))?,
    );
    let levels = keys.levels.len();
    if replies.len() != 3 * levels {
        return Err(reply_error("peek", "fewer replies than commands"));
    }
    let mut replies = replies.into_iter();
    let mut ready = Vec::with_capacity(levels);
    for level in &keys.levels {
        let Some(Value::Array(items)) = replies.next() else {
            return Err(reply_error("peek", "LRANGE did not answer a list"));
        };
        let envelopes = items
            .into_iter()
            .map(|item| text(item, "peek"))
            .collect::<Result<_>>()?;
        ready.push(ReadyHead {
            level: level.clone(),
            envelopes,
        });
    }
    let scored = |replies: &mut std::vec::IntoIter<Value>| -> Result<Vec<(String, String, i64)>> {
        let mut out = Vec::new();
        for level in &keys.levels {
            let pairs: Vec<(String, f64)> = redis::from_redis_value(
                replies
                    .next()
                    .ok_or_else(|| reply_error("peek", "missing reply"))?,
            )
            .map_err(|error| reply_error("peek", error.to_string()))?;
            out.extend(
                pairs
                    .into_iter()
                    .map(|(member, due)| (level.clone(), member, due as i64)),
            );
        }
        out.sort_by_key(|(_, _, due)| *due);
        out.truncate(limit);
        Ok(out)
    };
    let delayed_ids = scored(&mut replies)?;
    let retrying = scored(&mut replies)?;
    let envelopes: Vec<Option<String>> = if delayed_ids.is_empty() {
        Vec::new()
    } else {
        redis::cmd("HMGET")
            .arg(&keys.delayed_tasks)
            .arg(delayed_ids.iter().map(|(_, id, _)| id).collect::<Vec<_>>())
            .query(conn)?
    };
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
