//! The flows of a queue with type limits, as readers see them: the lists where claim.lua moved the tasks of a
//! limited type that its limits held back (claim.lua, "Type limits"), named by each level's ring. The daemon's
//! fetcher reads them to drain the flows its config no longer limits; `stats` and the task lookup count and
//! search them as waiting tasks, beside the ready lists.

use redis::ConnectionLike;

use super::keys::{self, QueueKeys};
use super::{Result, reply_error};

/// One flow that may hold tasks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Flow {
    /// Index of its level.
    pub level: usize,
    /// The task type whose tasks it holds.
    pub kind: String,
    /// Its list.
    pub key: String,
    /// How many tasks it holds (0: emptied since the last claim looked).
    pub len: u64,
}

/// Every flow the queue's rings name, level by level (two round trips, whatever the number of flows: each ring's
/// members, then each flow's length). A member this version does not make is skipped.
pub fn flows(conn: &mut dyn ConnectionLike, keys: &QueueKeys) -> Result<Vec<Flow>> {
    let mut pipe = redis::pipe();
    for ring in keys.rings() {
        pipe.cmd("ZRANGE").arg(ring).arg(0).arg(-1);
    }
    let members: Vec<Vec<String>> = pipe.query(conn)?;
    let mut found: Vec<Flow> = Vec::new();
    for (level, members) in members.into_iter().enumerate() {
        for member in members {
            if let Some(kind) = keys::member_type(&member) {
                found.push(Flow {
                    level,
                    kind,
                    key: keys.flow(level, &member),
                    len: 0,
                });
            }
        }
    }
    if found.is_empty() {
        return Ok(found);
    }
    let mut pipe = redis::pipe();
    for flow in &found {
        pipe.cmd("LLEN").arg(&flow.key);
    }
    let lengths: Vec<u64> = pipe.query(conn)?;
    if lengths.len() != found.len() {
        return Err(reply_error(
            "flows",
            format!("{} lengths for {} flows", lengths.len(), found.len()),
        ));
    }
    for (flow, len) in found.iter_mut().zip(lengths) {
        flow.len = len;
    }
    Ok(found)
}

/// The types of `flows` that hold tasks and that `limited` does not name: flows a claim of this config must
/// drain, unlimited (each once, in the order found).
pub fn drained_types(flows: &[Flow], limited: &[crate::config::TypeLimit]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for flow in flows {
        if flow.len > 0
            && !limited.iter().any(|limit| limit.kind == flow.kind)
            && !out.contains(&flow.kind)
        {
            out.push(flow.kind.clone());
        }
    }
    out
}
