//! The results the settle keeps (a queue's `keep_results`; results.lua writes them): reading one back, as
//! `kmqd task result` and `Client::result` do (docs/PROTOCOL.md, "Results").
//!
//! Results are kept in a hash per queue and time bucket (`PREFIX:{QUEUE}:results:START`), listed in the queue's
//! index (`PREFIX:{QUEUE}:results`, a sorted set of START by the bucket's expiry): a key per result cost a drain
//! 6x its time, for the expiry each key carries (docs/PERFORMANCE.md, "Results").

use std::time::{Duration, SystemTime};

use redis::ConnectionLike;
use serde::Deserialize;

use super::{QueueKeys, Result, reply_error};

/// A task's kept result, as the settle that ended the task wrote it.
#[derive(Clone, Debug, PartialEq)]
pub enum Ended {
    /// The task was done: `result` is what its handler returned (`null` when nothing); `result_error` says why a
    /// result was not kept (over the size bound, not JSON).
    Done {
        result: serde_json::Value,
        result_error: Option<String>,
        ended_at_ms: i64,
    },
    /// The task ended dead (dead-lettered), and why.
    Dead { reason: String, ended_at_ms: i64 },
}

/// The record as results.lua stores it.
#[derive(Deserialize)]
struct Record {
    state: String,
    #[serde(default)]
    ended_at: i64,
    #[serde(default)]
    result: serde_json::Value,
    #[serde(default)]
    result_error: Option<String>,
    #[serde(default)]
    reason: Option<String>,
}

/// How long a bucket takes results for: the longest whole power of two seconds within a sixteenth of
/// `keep_results`, at least a second (so between a 32nd and a 16th). A bucket expires `keep_results` after its
/// last result, so a result outlives its `keep_results` by at most a bucket length; and a reader looks in at most
/// 33 buckets. Powers of two line the buckets up across a reload that changes `keep_results` by less than half:
/// its calls go on writing the bucket of the time, whose expiry is only ever pushed back.
pub fn bucket_length(keep_results: Duration) -> Duration {
    let seconds = (keep_results / 16).as_secs().max(1);
    Duration::from_secs(1 << seconds.ilog2())
}

/// The bucket a result ending at `now` goes into (its START: `now` in ms since the epoch, cut down to a multiple
/// of the bucket length). On the daemon's clock, not Redis's: the caller names the bucket among the call's keys
/// (declared, for a Cluster), and a clock that is off only moves the result to another bucket, which expires
/// `keep_results` after its last write on Redis's clock all the same.
pub fn bucket_start(now: SystemTime, keep_results: Duration) -> u64 {
    let now_ms = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64;
    let length = bucket_length(keep_results).as_millis() as u64;
    now_ms - now_ms % length
}

/// Reads task `id`'s kept result; `None` when there is none (never kept, expired, or the task has not ended).
/// Two round trips: the queue's buckets from its index, then the id in each of them (newest first: a task id
/// pushed again after it ended reads as its latest end).
pub fn read(conn: &mut dyn ConnectionLike, keys: &QueueKeys, id: &str) -> Result<Option<Ended>> {
    let starts: Vec<u64> = redis::cmd("ZRANGE")
        .arg(keys.results_index())
        .arg(0)
        .arg(-1)
        .arg("REV")
        .query(conn)?;
    if starts.is_empty() {
        return Ok(None);
    }
    let mut lookups = redis::pipe();
    for start in &starts {
        lookups.cmd("HGET").arg(keys.results_bucket(*start)).arg(id);
    }
    let found: Vec<Option<Vec<u8>>> = lookups.query(conn)?;
    let Some((start, bytes)) = starts
        .iter()
        .zip(found)
        .find_map(|(start, bytes)| bytes.map(|bytes| (start, bytes)))
    else {
        return Ok(None);
    };
    let key = format!("{} field {id}", keys.results_bucket(*start));
    let record: Record = serde_json::from_slice(&bytes).map_err(|error| {
        reply_error(
            "result",
            format!("{key} does not hold a kept result ({error})"),
        )
    })?;
    match record.state.as_str() {
        "done" => Ok(Some(Ended::Done {
            result: record.result,
            result_error: record.result_error,
            ended_at_ms: record.ended_at,
        })),
        "dead" => Ok(Some(Ended::Dead {
            reason: record.reason.unwrap_or_default(),
            ended_at_ms: record.ended_at,
        })),
        other => Err(reply_error(
            "result",
            format!("{key} holds a result of state {other:?}, not \"done\" or \"dead\""),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_is_a_power_of_two_seconds_within_a_sixteenth_of_keep_results() {
        for (keep_results, length) in [
            (1, 1),
            (16, 1),
            (63, 2),
            (3600, 128),
            (2400, 128),
            (30 * 24 * 3600, 131_072),
        ] {
            assert_eq!(
                bucket_length(Duration::from_secs(keep_results)),
                Duration::from_secs(length),
                "keep_results {keep_results} s"
            );
        }
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_000_000_123);
        assert_eq!(bucket_start(at, Duration::from_secs(3600)), 999_936_000);
    }
}
