//! The results the settle keeps (a queue's `keep_results`; results.lua writes them): reading one back, as
//! `kmqd task result` and `Client::result` do (docs/PROTOCOL.md, "Results").

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

/// Reads task `id`'s kept result; `None` when there is none (never kept, expired, or the task has not ended).
pub fn read(conn: &mut dyn ConnectionLike, keys: &QueueKeys, id: &str) -> Result<Option<Ended>> {
    let key = keys.result(id);
    let bytes: Option<Vec<u8>> = redis::cmd("GET").arg(&key).query(conn)?;
    let Some(bytes) = bytes else {
        return Ok(None);
    };
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
