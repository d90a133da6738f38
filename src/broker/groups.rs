//! A grouped queue's groups (`[queues.groups]`), as operators see and steer them: `kmqd groups` lists the
//! busiest, `kmqd group pause|resume` stops and restarts one group's claims on every daemon. The claims' side is
//! groups.lua's (prepended to claim.lua).

use std::collections::HashMap;

use redis::ConnectionLike;

use super::keys::{self, QueueKeys};
use super::{Result, SCRIPTS, reply_error};

/// One group: what waits, what runs, what holds it back.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Group {
    /// Its name (the tasks' `group`; "" for tasks without one).
    pub name: String,
    /// Tasks waiting in its flows, over every level.
    pub waiting: u64,
    /// Its tasks taken and not yet settled, counted under `[queues.groups] max_running` (0 without it).
    pub running: u64,
    /// How long its throttle (a handler's back-pressure) still lasts, in ms; `None`: not throttled.
    pub throttled_ms: Option<u64>,
    /// Paused by `kmqd group pause`.
    pub paused: bool,
    /// A claim found it held back (paused, at its `max_running`, throttled or out of rate) and took it out of the
    /// turns until a settle, a resume or its time brings it back.
    pub held_back: bool,
}

/// How many ring members and flow lengths one round trip reads.
const PAGE: usize = 1000;

/// The groups that have tasks waiting or running, busiest first (most waiting, then most running), at most
/// `limit` of them, each with its throttle and pause. Reads the rings and the running counts in pages of
/// [`PAGE`], never in one call: a queue with 100,000 groups waiting costs a few hundred round trips, and Redis
/// stays free for the claims between them.
pub fn groups(conn: &mut dyn ConnectionLike, keys: &QueueKeys, limit: usize) -> Result<Vec<Group>> {
    let mut by_name: HashMap<String, Group> = HashMap::new();
    for level in 0..keys.levels() {
        let ring = keys.ring(level);
        let mut start = 0;
        loop {
            let page: Vec<(String, f64)> = redis::cmd("ZRANGE")
                .arg(&ring)
                .arg(start)
                .arg(start + PAGE - 1)
                .arg("WITHSCORES")
                .query(conn)?;
            let named: Vec<(String, String, f64)> = page
                .iter()
                // Every flow of a group counts: `GROUP:` and, beside type limits, `GROUP:TYPE`; a type's flow
                // `:TYPE` counts as the group with the empty name (its tasks have none).
                .filter_map(|(member, score)| {
                    let (group, _) = member.split_once(':')?;
                    keys::decode_name(group).map(|name| (name, member.clone(), *score))
                })
                .collect();
            let mut pipe = redis::pipe();
            for (_, member, _) in &named {
                pipe.cmd("LLEN").arg(keys.flow(level, member));
            }
            let lengths: Vec<u64> = if named.is_empty() {
                Vec::new()
            } else {
                pipe.query(conn)?
            };
            if lengths.len() != named.len() {
                return Err(reply_error("groups", "a flow's length is missing"));
            }
            for ((name, _, score), len) in named.into_iter().zip(lengths) {
                let group = by_name.entry(name.clone()).or_insert_with(|| Group {
                    name,
                    ..Group::default()
                });
                group.waiting += len;
                group.held_back |= score >= keys::GROUP_TIMED;
            }
            if page.len() < PAGE {
                break;
            }
            start += PAGE;
        }
    }
    let mut cursor = 0u64;
    loop {
        let (next, fields): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
            .arg(&keys.running)
            .arg(cursor)
            .arg("MATCH")
            .arg("g:*")
            .arg("COUNT")
            .arg(PAGE)
            .query(conn)?;
        for (field, value) in fields {
            let Some(name) = field.strip_prefix("g:").and_then(keys::decode_name) else {
                continue;
            };
            let running = value.parse().unwrap_or(0);
            by_name
                .entry(name.clone())
                .or_insert_with(|| Group {
                    name,
                    ..Group::default()
                })
                .running = running;
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    let mut out: Vec<Group> = by_name.into_values().collect();
    out.sort_by(|a, b| (b.waiting, b.running, &a.name).cmp(&(a.waiting, a.running, &b.name)));
    out.truncate(limit);
    if out.is_empty() {
        return Ok(out);
    }
    let mut pipe = redis::pipe();
    for group in &out {
        pipe.cmd("PTTL").arg(keys.group_throttle(&group.name));
        pipe.cmd("EXISTS").arg(keys.group_hold(&group.name));
    }
    let states: Vec<i64> = pipe.query(conn)?;
    for (group, state) in out.iter_mut().zip(states.chunks(2)) {
        group.throttled_ms = match state[0] {
            -2 => None,
            // A throttle set by hand without an expiry: the claims look again every second.
            left if left < 0 => Some(1000),
            left => Some(left as u64),
        };
        group.paused = state[1] == 1;
    }
    Ok(out)
}

/// How many groups have tasks waiting, summed over the levels: each level's ring names the flows that hold tasks
/// (an emptied flow leaves it, groups.lua), so one ZCARD a level, in one round trip, whatever the number of groups:
/// cheap enough for `kmqd stats`, the dashboard's poll and every metrics scrape. A group with tasks at two levels
/// counts at each; tasks a push left in the ready lists (routes not yet set, claims move them) are in no group yet.
pub fn waiting(conn: &mut dyn ConnectionLike, keys: &QueueKeys) -> Result<u64> {
    let mut pipe = redis::pipe();
    for ring in keys.rings() {
        pipe.cmd("ZCARD").arg(ring);
    }
    let counts: Vec<u64> = pipe.query(conn)?;
    if counts.len() != keys.levels() {
        return Err(reply_error("groups waiting", "a ring's count is missing"));
    }
    Ok(counts.iter().sum())
}

/// Pauses group `group` of the queue of `keys` on every daemon: the claims take none of its tasks (its running
/// tasks finish) until [`resume`]. Returns false when it was paused already. `now_ms` is the key's value, for
/// people looking at it.
pub fn pause(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    group: &str,
    now_ms: i64,
) -> Result<bool> {
    let set: Option<String> = redis::cmd("SET")
        .arg(keys.group_hold(group))
        .arg(now_ms)
        .arg("NX")
        .query(conn)?;
    Ok(set.is_some())
}

/// Resumes group `group`: its flows take turns again at the next claim (group_resume.lua). Returns false when it
/// was not paused.
pub fn resume(conn: &mut dyn ConnectionLike, keys: &QueueKeys, group: &str) -> Result<bool> {
    let mut invocation = SCRIPTS.group_resume.prepare_invoke();
    invocation
        .key(keys.group_hold(group))
        .key(&keys.sched)
        .key(&keys.wake)
        .key(keys.park(&keys::group_scope(group)));
    for ring in keys.rings() {
        invocation.key(ring);
    }
    invocation.arg(keys::group_member(group));
    let was: i64 = invocation.invoke(conn)?;
    Ok(was == 1)
}
