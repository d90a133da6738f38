//! The dead-letter list `P:{Q}:dead`: reading records, and requeueing or purging them, one atomic step per
//! record (dead_requeue.lua, dead_purge.lua; docs/PROTOCOL.md, "Dead letters").
//!
//! Daemons LPUSH records at the head while an operator works on the list, so a record is addressed by its exact
//! bytes (the scripts LREM that value), never by its index; and a walk over the whole list ([`walk`]) reads it
//! from the tail, whose indices new records do not shift.

use redis::Value;
use serde_json::{Map, Value as Json};

use super::{Conn, QueueKeys, Result, SCRIPTS, bytes, reply_error};

/// Records read per command, and given to one script call: a list is worked on in steps short enough not to
/// stall Redis for anyone else. (A step is short because the scripts look for each record from the tail, where
/// the page was read: `LREM dead -1` scans the records the walk left in place there, not the whole list.)
pub const PAGE: usize = 100;

/// One dead-letter record: its exact bytes, which the scripts address it by, and its fields.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadRecord {
    pub raw: Vec<u8>,
    /// The record's fields; empty when the record is not a JSON object (kmqd never writes such a record).
    pub fields: Map<String, Json>,
}

impl DeadRecord {
    pub fn parse(raw: Vec<u8>) -> DeadRecord {
        let fields = match serde_json::from_slice(&raw) {
            Ok(Json::Object(fields)) => fields,
            _ => Map::new(),
        };
        DeadRecord { raw, fields }
    }

    /// A string field; `None` when missing or not a string.
    pub fn text(&self, name: &str) -> Option<&str> {
        self.fields.get(name).and_then(Json::as_str)
    }

    /// An integer field.
    pub fn int(&self, name: &str) -> Option<i64> {
        self.fields.get(name).and_then(Json::as_i64)
    }

    /// The task's id: "" when the payload had none that could be read.
    pub fn id(&self) -> &str {
        self.text("id").unwrap_or("")
    }

    /// The payload as it was stored, when it was UTF-8 (otherwise it is kept as `task_base64`).
    pub fn task(&self) -> Option<&str> {
        self.text("task")
    }

    /// The record's fields as stored, with `parsed_task` beside them: the task as JSON, or null when it is not
    /// JSON (`kmqd dead list --json`, the dashboard's API).
    pub fn with_parsed_task(&self) -> Json {
        let mut fields = self.fields.clone();
        let parsed = self
            .task()
            .and_then(|task| serde_json::from_str::<Json>(task).ok())
            .unwrap_or(Json::Null);
        fields.insert("parsed_task".to_string(), parsed);
        Json::Object(fields)
    }
}

/// How many records the dead list holds.
pub fn len(conn: &mut Conn, keys: &QueueKeys) -> Result<usize> {
    Ok(redis::cmd("LLEN").arg(&keys.dead).query(conn)?)
}

/// The records from index `start` to `stop` (inclusive; negative counts from the tail, as LRANGE does), in list
/// order: newest first.
pub fn range(conn: &mut Conn, keys: &QueueKeys, start: i64, stop: i64) -> Result<Vec<DeadRecord>> {
    let values: Vec<Value> = redis::cmd("LRANGE")
        .arg(&keys.dead)
        .arg(start)
        .arg(stop)
        .query(conn)?;
    values
        .into_iter()
        .map(|value| Ok(DeadRecord::parse(bytes(value, "dead")?.into_vec())))
        .collect()
}

/// Calls `act` with every record the list held when the walk began, [`PAGE`] at a time, oldest first; `act`
/// returns how many of its page it removed from the list. Pages are read from the tail: records that daemons
/// LPUSH meanwhile do not shift them, and are not visited (a requeued task that is dead-lettered again is not
/// requeued twice by one walk). The records a page keeps stay at the tail, so the next page is read just
/// before them. (If `dead_max` trims the list meanwhile, the records it drops from the tail are gone anyway,
/// and as many unvisited ones may be skipped.)
pub fn walk(
    conn: &mut Conn,
    keys: &QueueKeys,
    mut act: impl FnMut(&mut Conn, Vec<DeadRecord>) -> Result<usize>,
) -> Result<()> {
    let total = len(conn, keys)?;
    let (mut seen, mut kept) = (0usize, 0usize);
    while seen < total {
        let n = PAGE.min(total - seen);
        let stop = -(kept as i64) - 1;
        let start = stop - n as i64 + 1;
        let mut page = range(conn, keys, start, stop)?;
        if page.is_empty() {
            break;
        }
        page.reverse();
        seen += page.len();
        let count = page.len();
        let removed = act(conn, page)?;
        kept += count.saturating_sub(removed);
    }
    Ok(())
}

/// A record to requeue: its exact bytes, and what to queue where.
pub struct RequeueItem<'a> {
    pub record: &'a [u8],
    /// The level (index into the queue's levels) whose ready list the task joins, at the back.
    pub level: usize,
    /// The unique id to take again, for a unique task.
    pub unique_id: Option<&'a str>,
    pub envelope: &'a [u8],
}

/// What became of one record given to [`requeue`] or [`purge`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Requeued or purged.
    Done,
    /// No longer in the dead list (requeued or purged meanwhile by someone else, or trimmed).
    NotFound,
    /// Not requeued: its unique id is held by a live task. The record stays.
    Held,
}

/// Moves each record's task back to a ready list with dead_requeue.lua, all in one call (give at most [`PAGE`]):
/// each record is removed and its task pushed in one step, or neither. Counts `requeued` and wakes an idle
/// fetcher.
pub fn requeue(
    conn: &mut Conn,
    keys: &QueueKeys,
    items: &[RequeueItem<'_>],
) -> Result<Vec<Outcome>> {
    if items.is_empty() {
        return Ok(Vec::new());
    }
    let mut call = SCRIPTS.dead_requeue.prepare_invoke();
    call.key(&keys.dead)
        .key(&keys.unique)
        .key(&keys.wake)
        .key(&keys.stats);
    for ready in &keys.ready {
        call.key(ready);
    }
    for item in items {
        call.arg(item.record)
            .arg(item.level + 1)
            .arg(item.unique_id.unwrap_or(""))
            .arg(item.envelope);
    }
    let reply: Vec<i64> = call.invoke(conn)?;
    outcomes(reply, items.len(), "dead_requeue")
}

/// Removes the records with dead_purge.lua, in one call (give at most [`PAGE`]); counts `purged`.
pub fn purge(conn: &mut Conn, keys: &QueueKeys, records: &[&[u8]]) -> Result<Vec<Outcome>> {
    if records.is_empty() {
        return Ok(Vec::new());
    }
    let mut call = SCRIPTS.dead_purge.prepare_invoke();
    call.key(&keys.dead).key(&keys.stats);
    for record in records {
        call.arg(*record);
    }
    let reply: Vec<i64> = call.invoke(conn)?;
    outcomes(reply, records.len(), "dead_purge")
}

fn outcomes(reply: Vec<i64>, wanted: usize, what: &'static str) -> Result<Vec<Outcome>> {
    if reply.len() != wanted {
        return Err(reply_error(
            what,
            format!("{} results for {wanted} records", reply.len()),
        ));
    }
    reply
        .into_iter()
        .map(|n| match n {
            1 => Ok(Outcome::Done),
            0 => Ok(Outcome::NotFound),
            2 => Ok(Outcome::Held),
            other => Err(reply_error(what, format!("unknown result {other}"))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_read_by_its_fields_and_kept_by_its_bytes() {
        let raw = br#"{"dead_at":5,"id":"a","task":"{\"type\":\"t\"}","attempt":2}"#.to_vec();
        let record = DeadRecord::parse(raw.clone());
        assert_eq!(record.raw, raw);
        assert_eq!(
            (record.id(), record.int("attempt"), record.task()),
            ("a", Some(2), Some(r#"{"type":"t"}"#))
        );
        let odd = DeadRecord::parse(b"[1]".to_vec());
        assert!(odd.fields.is_empty() && odd.id().is_empty());
    }
}
