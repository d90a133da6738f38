//! Finding and cancelling tasks by id: the delay-queue operations (exists, remaining delay, cancel) and
//! `kmqd task show|cancel`.
//!
//! Delayed tasks are indexed by id (`delayed-tasks` hash, `delayed:L` zsets of ids), so finding one costs
//! O(log n). Ready lists, retry sets and the processing area hold envelopes and are scanned in chunks of
//! [`CHUNK`] (never one long command that would stall Redis): O(n) in their size, fine for an operator's
//! command, not for a hot path. Many ids are looked up in one pass. A lookup for a page ([`Budget`]: the
//! dashboard's, review M7) stops once it has read so many tasks or bytes, and says it did.

use std::collections::{HashMap, HashSet};

use redis::Value;

use crate::broker::Conn;
use serde::Serialize;

use super::{QueueKeys, Result, SCRIPTS, text, time_ms};
use crate::task::Envelope;

/// Elements read per command while scanning.
const CHUNK: usize = 1000;

/// Elements read per command while scanning within a [`Budget`]: what a command may read past the budget.
const BUDGETED_CHUNK: usize = 100;

/// How much one lookup may read before it leaves the rest unsearched: the tasks it looks at (each list's, each
/// retry set's as Redis scans it) and the bytes Redis sends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    pub tasks: usize,
    pub bytes: usize,
}

/// What a lookup found, and whether it searched everything it was asked to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Located {
    pub found: Vec<(String, Found)>,
    /// False when the budget ran out first: the task may be in what was not searched.
    pub complete: bool,
    /// The tasks it looked at.
    pub searched: usize,
}

/// What a lookup has read so far, against its budget (none: no end).
#[derive(Debug)]
struct Spent {
    budget: Option<Budget>,
    tasks: usize,
    bytes: usize,
}

impl Spent {
    fn new(budget: Option<Budget>) -> Spent {
        Spent {
            budget,
            tasks: 0,
            bytes: 0,
        }
    }

    fn add(&mut self, tasks: usize, bytes: usize) {
        self.tasks += tasks;
        self.bytes += bytes;
    }

    /// Whether the lookup must stop here.
    fn out(&self) -> bool {
        self.budget
            .is_some_and(|budget| self.tasks >= budget.tasks || self.bytes >= budget.bytes)
    }

    /// Elements per command.
    fn chunk(&self) -> usize {
        match self.budget {
            Some(_) => BUDGETED_CHUNK,
            None => CHUNK,
        }
    }
}

/// One place a task with a given id is in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Found {
    /// Waiting for its due time (a delayed push).
    Delayed {
        level: String,
        due_in_ms: i64,
        envelope: String,
    },
    /// Waiting out a retry backoff.
    Retrying {
        level: String,
        due_in_ms: i64,
        envelope: String,
    },
    /// In a ready list; `position` 0 is the next to be taken. `flow`: the limited type whose flow it waits in,
    /// held back by its type's limits (claim.lua, "Type limits"); `group`: the group whose flow it waits in (a
    /// queue with `[queues.groups]`; "" for tasks without a group); `position` is then its place in that flow.
    Ready {
        level: String,
        position: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        flow: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        group: Option<String>,
        envelope: String,
    },
    /// Claimed by a daemon (safe mode): the daemon's owner id and the task's token (claim.position);
    /// `lease_left_ms` until a monitor takes it back if the owner stops renewing its lease.
    Processing {
        owner: String,
        token: String,
        lease_left_ms: i64,
        envelope: String,
        /// Its handler's latest progress report, if it made one (docs/PROTOCOL.md, "Progress").
        #[serde(skip_serializing_if = "Option::is_none")]
        progress: Option<super::progress::Progress>,
    },
    /// In the dead-letter list.
    Dead { record: String },
}

impl Found {
    /// Whether the task is waiting (delayed, retrying or ready), so that it can be cancelled.
    pub fn is_waiting(&self) -> bool {
        matches!(
            self,
            Found::Delayed { .. } | Found::Retrying { .. } | Found::Ready { .. }
        )
    }
}

/// What to look through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Delayed, retrying and ready tasks: what `cancel` can remove.
    Waiting,
    /// Also the processing area and the dead-letter list.
    Everywhere,
    /// The processing area alone: which tasks run now (a flow's tree on the dashboard), a read bounded by what
    /// the daemons hold, not by the queue's backlog.
    Processing,
}

/// The id as it appears inside a JSON string (escaped), to pre-filter payloads before decoding them.
fn json_escaped(id: &str) -> String {
    let quoted = serde_json::to_string(id).expect("a string serializes");
    quoted[1..quoted.len() - 1].to_string()
}

/// A Redis glob that matches any member containing `needle`.
fn glob_containing(needle: &str) -> String {
    let mut pattern = String::with_capacity(needle.len() + 2);
    pattern.push('*');
    for c in needle.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push('*');
    pattern
}

/// The ids we look for, with their escaped forms for the pre-filter.
struct Wanted<'a> {
    ids: HashSet<&'a str>,
    escaped: Vec<String>,
}

impl<'a> Wanted<'a> {
    fn new(ids: &'a [&'a str]) -> Wanted<'a> {
        Wanted {
            ids: ids.iter().copied().collect(),
            escaped: ids.iter().map(|id| json_escaped(id)).collect(),
        }
    }

    /// The id of `payload` when it is one of the wanted ones.
    fn matching(&self, payload: &str) -> Option<String> {
        if !self
            .escaped
            .iter()
            .any(|needle| payload.contains(needle.as_str()))
        {
            return None;
        }
        let id = Envelope::decode(payload).ok()?.id?;
        self.ids.contains(&*id).then(|| id.into_owned())
    }
}

/// Finds every place the tasks with these ids are in. A non-unique id may be in several.
pub fn locate(
    conn: &mut Conn,
    keys: &QueueKeys,
    ids: &[&str],
    scope: Scope,
) -> Result<Vec<(String, Found)>> {
    Ok(locate_within(conn, keys, ids, scope, None)?.found)
}

/// As [`locate`], reading no more than `budget` (none: everything): delayed tasks first (by their index, whatever
/// the budget), then retries, ready lists, the processing area and the dead list, until the budget runs out.
pub fn locate_within(
    conn: &mut Conn,
    keys: &QueueKeys,
    ids: &[&str],
    scope: Scope,
    budget: Option<Budget>,
) -> Result<Located> {
    let mut found = Vec::new();
    let mut spent = Spent::new(budget);
    if ids.is_empty() {
        return Ok(Located {
            found,
            complete: true,
            searched: 0,
        });
    }
    let wanted = Wanted::new(ids);
    if scope == Scope::Processing {
        let complete = locate_processing(conn, keys, &wanted, &mut found, &mut spent)?;
        return Ok(Located {
            found,
            complete,
            searched: spent.tasks,
        });
    }
    // The clock of the queue's node: in a cluster, TIME alone would go to any node.
    let now = time_ms(conn.query_at(&keys.meta, &redis::cmd("TIME"))?);
    locate_delayed(conn, keys, ids, now, &mut found)?;
    let mut complete = locate_retrying(conn, keys, &wanted, now, &mut found, &mut spent)?
        && locate_ready(conn, keys, &wanted, &mut found, &mut spent)?;
    if scope == Scope::Everywhere {
        complete = complete
            && locate_processing(conn, keys, &wanted, &mut found, &mut spent)?
            && locate_dead(conn, keys, &wanted, &mut found, &mut spent)?;
    }
    Ok(Located {
        found,
        complete,
        searched: spent.tasks,
    })
}

/// Delayed: by id, through the index.
fn locate_delayed(
    conn: &mut Conn,
    keys: &QueueKeys,
    ids: &[&str],
    now: i64,
    found: &mut Vec<(String, Found)>,
) -> Result<()> {
    let envelopes: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(&keys.delayed_tasks)
        .arg(ids)
        .query(conn)?;
    for (id, envelope) in ids.iter().zip(envelopes) {
        let Some(envelope) = envelope else { continue };
        let mut pipe = redis::pipe();
        for zset in &keys.delayed {
            pipe.cmd("ZSCORE").arg(zset).arg(*id);
        }
        let scores: Vec<Option<f64>> = pipe.query(conn)?;
        if let Some((level, due)) = scores
            .iter()
            .enumerate()
            .find_map(|(l, s)| s.map(|due| (l, due)))
        {
            found.push((
                id.to_string(),
                Found::Delayed {
                    level: keys.levels[level].clone(),
                    due_in_ms: due as i64 - now,
                    envelope,
                },
            ));
        }
    }
    Ok(())
}

/// Retrying: scans each level's zset for members that contain one of the ids. False when `spent` ran out first.
fn locate_retrying(
    conn: &mut Conn,
    keys: &QueueKeys,
    wanted: &Wanted<'_>,
    now: i64,
    found: &mut Vec<(String, Found)>,
    spent: &mut Spent,
) -> Result<bool> {
    for (level, zset) in keys.retry.iter().enumerate() {
        for needle in &wanted.escaped {
            let mut cursor = 0u64;
            loop {
                if spent.out() {
                    return Ok(false);
                }
                let (next, items): (u64, Vec<(String, f64)>) = redis::cmd("ZSCAN")
                    .arg(zset)
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(glob_containing(needle))
                    .arg("COUNT")
                    .arg(spent.chunk())
                    .query(conn)?;
                // Redis looks at about COUNT members a call, and sends only those that match.
                let bytes = items.iter().map(|(payload, _)| payload.len()).sum();
                spent.add(spent.chunk(), bytes);
                for (payload, due) in items {
                    if let Some(id) = wanted.matching(&payload) {
                        let entry = Found::Retrying {
                            level: keys.levels[level].clone(),
                            due_in_ms: due as i64 - now,
                            envelope: payload,
                        };
                        // A member that contains two of the ids is matched by both scans.
                        if !found.iter().any(|(i, f)| *i == id && *f == entry) {
                            found.push((id, entry));
                        }
                    }
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
    }
    Ok(true)
}

/// Ready: reads each list in chunks. False when `spent` ran out first.
fn locate_ready(
    conn: &mut Conn,
    keys: &QueueKeys,
    wanted: &Wanted<'_>,
    found: &mut Vec<(String, Found)>,
    spent: &mut Spent,
) -> Result<bool> {
    let flows = super::flows::flows(conn, keys)?;
    let lists = keys
        .ready
        .iter()
        .enumerate()
        .map(|(level, list)| (level, list, None))
        .chain(flows.iter().map(|flow| (flow.level, &flow.key, Some(flow))));
    for (level, list, flow) in lists {
        let whole = scan_list(conn, list, spent, |position, payload| {
            if let Some(id) = wanted.matching(&payload) {
                let place = Found::Ready {
                    level: keys.levels[level].clone(),
                    position,
                    flow: flow.and_then(|flow| flow.kind.clone()),
                    group: flow.and_then(|flow| flow.group.clone()),
                    envelope: payload,
                };
                found.push((id, place));
            }
        })?;
        if !whole {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Calls `visit` with each element of the list `key` and its position, reading `spent`'s chunk of elements per
/// command; false when `spent` ran out before the list's end.
fn scan_list(
    conn: &mut Conn,
    key: &str,
    spent: &mut Spent,
    mut visit: impl FnMut(u64, String),
) -> Result<bool> {
    let mut start = 0usize;
    loop {
        if spent.out() {
            return Ok(false);
        }
        let size = spent.chunk();
        let chunk: Vec<Value> = redis::cmd("LRANGE")
            .arg(key)
            .arg(start)
            .arg(start + size - 1)
            .query(conn)?;
        let count = chunk.len();
        for (offset, value) in chunk.into_iter().enumerate() {
            let value = text(value, "lookup")?;
            spent.add(1, value.len());
            visit((start + offset) as u64, value);
        }
        if count < size {
            return Ok(true);
        }
        start += size;
    }
}

/// The processing area, owner by owner. False when `spent` ran out first.
fn locate_processing(
    conn: &mut Conn,
    keys: &QueueKeys,
    wanted: &Wanted<'_>,
    found: &mut Vec<(String, Found)>,
    spent: &mut Spent,
) -> Result<bool> {
    let (now, owners) = super::owners(conn, keys)?;
    for (owner, deadline) in owners {
        for level in 0..keys.levels() {
            let mut cursor = super::processing::Cursor::Start;
            loop {
                if spent.out() {
                    return Ok(false);
                }
                let page = super::processing::held(
                    conn,
                    keys,
                    &owner,
                    level,
                    cursor,
                    super::processing::Window::tasks(spent.chunk()),
                )?;
                let bytes = page.tasks.iter().map(|(_, payload)| payload.len()).sum();
                spent.add(page.tasks.len(), bytes);
                for (token, payload) in page.tasks {
                    let payload = String::from_utf8_lossy(&payload);
                    if let Some(id) = wanted.matching(&payload) {
                        let progress = match token {
                            super::TokenId::Listed { claim, position } => {
                                super::progress::read(conn, keys, &owner, level, claim, position)?
                                    .map(|progress| progress.aged(now))
                            }
                            super::TokenId::Field(_) => None,
                        };
                        let place = Found::Processing {
                            owner: owner.clone(),
                            token: token.to_string(),
                            lease_left_ms: deadline - now,
                            envelope: payload.into_owned(),
                            progress,
                        };
                        found.push((id, place));
                    }
                }
                match page.next {
                    Some(next) => cursor = next,
                    None => break,
                }
            }
        }
    }
    Ok(true)
}

/// The dead list, newest first. False when `spent` ran out first.
fn locate_dead(
    conn: &mut Conn,
    keys: &QueueKeys,
    wanted: &Wanted<'_>,
    found: &mut Vec<(String, Found)>,
    spent: &mut Spent,
) -> Result<bool> {
    #[derive(serde::Deserialize)]
    struct Head {
        id: String,
    }
    scan_list(conn, &keys.dead, spent, |_, record| {
        if let Ok(head) = serde_json::from_str::<Head>(&record) {
            if wanted.ids.contains(head.id.as_str()) {
                found.push((head.id, Found::Dead { record }));
            }
        }
    })
}

/// Cancels every waiting copy (delayed, retrying, ready) of the tasks with these ids. Returns, per id, how many
/// copies were removed (0: none was waiting: unknown, running, done, or dead). Unique ids are released.
pub fn cancel(conn: &mut Conn, keys: &QueueKeys, ids: &[&str]) -> Result<HashMap<String, usize>> {
    let levels = &keys.levels;
    let mut removed: HashMap<String, usize> = ids.iter().map(|id| (id.to_string(), 0)).collect();
    for (id, found) in locate(conn, keys, ids, Scope::Waiting)? {
        let level_of = |name: &str| levels.iter().position(|l| l == name).unwrap_or(0);
        let (key, kind, task, expected, envelope) = match &found {
            Found::Delayed {
                level, envelope, ..
            } => (
                &keys.delayed[level_of(level)],
                "delayed",
                id.as_str(),
                envelope.as_str(),
                envelope,
            ),
            Found::Retrying {
                level, envelope, ..
            } => (
                &keys.retry[level_of(level)],
                "retry",
                envelope.as_str(),
                "",
                envelope,
            ),
            Found::Ready {
                level,
                flow,
                group,
                envelope,
                ..
            } => (
                &match (flow, group) {
                    (Some(kind), _) => keys.flow(level_of(level), &super::keys::flow_member(kind)),
                    (None, Some(group)) => {
                        keys.flow(level_of(level), &super::keys::group_member(group))
                    }
                    (None, None) => keys.ready[level_of(level)].clone(),
                },
                "list",
                envelope.as_str(),
                "",
                envelope,
            ),
            Found::Processing { .. } | Found::Dead { .. } => continue,
        };
        let unique = Envelope::decode(envelope)
            .map(|e| e.unique)
            .unwrap_or(false);
        let done: i64 = SCRIPTS
            .remove
            .key(key)
            .key(&keys.delayed_tasks)
            .key(&keys.unique)
            .key(&keys.stats)
            .arg(kind)
            .arg(task)
            .arg(expected)
            .arg(if unique { id.as_str() } else { "" })
            .invoke(conn)?;
        if done == 1 {
            *removed.entry(id).or_default() += 1;
        }
    }
    Ok(removed)
}

/// How long until the delayed or retrying task `id` is due (`None`: it is not waiting for a due time).
pub fn remaining_delay(conn: &mut Conn, keys: &QueueKeys, id: &str) -> Result<Option<i64>> {
    let found = locate(conn, keys, &[id], Scope::Waiting)?;
    Ok(found.into_iter().find_map(|(_, f)| match f {
        Found::Delayed { due_in_ms, .. } | Found::Retrying { due_in_ms, .. } => {
            Some(due_in_ms.max(0))
        }
        _ => None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_escape_their_special_characters() {
        assert_eq!(glob_containing("a*b?[c]\\d"), "*a\\*b\\?\\[c\\]\\\\d*");
    }

    #[test]
    fn ids_are_matched_as_json_text_then_decoded() {
        let ids = ["x\"y", "plain"];
        let wanted = Wanted::new(&ids);
        assert_eq!(
            wanted.matching(r#"{"id":"x\"y","type":"t"}"#).as_deref(),
            Some("x\"y")
        );
        assert_eq!(
            wanted.matching(r#"{"id":"other","type":"t","data":"plain"}"#),
            None,
            "data that contains the id"
        );
        assert_eq!(
            wanted.matching(r#"{"type":"t","id":"plain"}"#).as_deref(),
            Some("plain")
        );
    }

    #[test]
    fn only_waiting_tasks_can_be_cancelled() {
        let ready = Found::Ready {
            level: "normal".into(),
            position: 0,
            flow: None,
            group: None,
            envelope: String::new(),
        };
        let running = Found::Processing {
            owner: "o1".into(),
            token: "1".into(),
            lease_left_ms: 0,
            envelope: String::new(),
            progress: None,
        };
        assert!(ready.is_waiting());
        assert!(!running.is_waiting());
    }
}
