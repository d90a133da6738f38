//! The flows of a queue with type limits or groups, as readers see them: the lists where claim.lua moved the
//! tasks of a limited type that its limits held back (claim.lua, "Type limits"), or where push.lua and the claims
//! put a grouped queue's tasks (groups.lua), named by each level's ring. The daemon's
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
    /// Its member in the level's ring (`GROUP:TYPE`, encoded).
    pub member: String,
    /// The task type whose tasks it holds: a flow of `[[queues.limits]]`; `None` for a group's flow.
    pub kind: Option<String>,
    /// The group whose tasks it holds: a flow of `[queues.groups]` (the empty name: tasks without a group).
    pub group: Option<String>,
    /// Its list.
    pub key: String,
    /// How many tasks it holds (0: emptied since the last claim looked).
    pub len: u64,
}

/// Every flow the queue's rings name, level by level (two round trips, whatever the number of flows: each ring's
/// members, then each flow's length). A member this version does not make is skipped. For the daemon's look
/// once a minute and for `task show`; `stats` counts a grouped queue's flows by their rings instead.
pub fn flows(conn: &mut dyn ConnectionLike, keys: &QueueKeys) -> Result<Vec<Flow>> {
    let mut pipe = redis::pipe();
    for ring in keys.rings() {
        pipe.cmd("ZRANGE").arg(ring).arg(0).arg(-1);
    }
    let members: Vec<Vec<String>> = pipe.query(conn)?;
    let mut found: Vec<Flow> = Vec::new();
    for (level, members) in members.into_iter().enumerate() {
        for member in members {
            let kind = keys::member_type(&member);
            let group = keys::member_group(&member);
            if kind.is_some() || group.is_some() {
                found.push(Flow {
                    level,
                    key: keys.flow(level, &member),
                    member,
                    kind,
                    group,
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

/// The members of `flows` that hold tasks and that a claim of this config must drain, unlimited (each once, in the
/// order found): with groups none (the groups' turns serve every flow of the rings), otherwise those of a type
/// that `limited` does not name and those of groups (another config's).
pub fn drained(flows: &[Flow], limited: &[crate::config::TypeLimit], grouped: bool) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    if grouped {
        return out;
    }
    for flow in flows {
        let limits = flow
            .kind
            .as_ref()
            .is_some_and(|kind| limited.iter().any(|limit| limit.kind == *kind));
        if flow.len > 0 && !limits && !out.contains(&flow.member) {
            out.push(flow.member.clone());
        }
    }
    out
}

/// Tells push.lua whether to put the queue's tasks in their groups' flows (the routes hash's `groups`): set while
/// this daemon's config has `[queues.groups]` without `[[queues.limits]]` (beside type limits the claim's intake
/// routes each task by group and type, which push.lua does not), cleared otherwise, at its first claim and at each
/// look at the flows (once a minute). In a fleet whose configs disagree (a rolling change) the last to look wins
/// for a while; either way no task waits unseen: a grouped claim moves what reached the ready lists to the flows
/// (and sorts a limited type's tasks out of a group's flow as it serves it), and another claim drains the flows it
/// finds.
pub fn route_groups(conn: &mut dyn ConnectionLike, keys: &QueueKeys, grouped: bool) -> Result<()> {
    let mut cmd = if grouped {
        redis::cmd("HSET")
    } else {
        redis::cmd("HDEL")
    };
    cmd.arg(keys.routes()).arg("groups");
    if grouped {
        cmd.arg(1);
    }
    let _: i64 = cmd.query(conn)?;
    Ok(())
}
