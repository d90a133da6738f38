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
/// returns the positions, in the page it was given, of the records that are no longer in the list (it removed
/// them, or found them gone). Pages are read from the tail: records that daemons LPUSH meanwhile do not shift
/// them, and are not visited (a requeued task that is dead-lettered again is not requeued twice by one walk).
/// The records a page keeps stay at the tail, so the next page is read just before them.
///
/// Someone else may remove records the walk kept (another operator's requeue or purge, `dead_max` trimming the
/// tail), and then fewer are at the tail than the walk counted: read past them, the next page would skip as many
/// unvisited records (review L12). So each page is read together with the record the walk expects next to it,
/// the newest it kept (one element more); when that is not the one there, the walk finds where its kept records
/// now begin (`Kept::relocate`) and reads the page again from there. (Records someone else removes from the
/// part not yet visited still count toward the records the walk set out to visit: it may then visit as many
/// records pushed while it ran.)
pub fn walk(
    conn: &mut Conn,
    keys: &QueueKeys,
    mut act: impl FnMut(&mut Conn, Vec<DeadRecord>) -> Result<Vec<usize>>,
) -> Result<()> {
    let total = len(conn, keys)?;
    let mut seen = 0usize;
    let mut kept = Kept::default();
    while seen < total {
        let n = PAGE.min(total - seen);
        let mut page = if kept.count == 0 {
            range(conn, keys, -(n as i64), -1)?
        } else {
            // The page, and after it (nearer the tail) the newest record the walk kept.
            let stop = -(kept.count as i64);
            let mut read = range(conn, keys, stop - n as i64, stop)?;
            if read.last().map(|next| kept.fingerprint(&next.raw)) != kept.newest() {
                kept.relocate(conn, keys)?;
                continue;
            }
            read.pop();
            read
        };
        if page.is_empty() {
            break;
        }
        page.reverse();
        seen += page.len();
        let prints: Vec<u64> = page
            .iter()
            .map(|record| kept.fingerprint(&record.raw))
            .collect();
        let gone = act(conn, page)?;
        kept.page(
            prints
                .into_iter()
                .enumerate()
                .filter(|(at, _)| !gone.contains(at))
                .map(|(_, print)| print),
        );
    }
    Ok(())
}

/// The records a [`walk`] visited and left in the list: how many it believes are at the tail, and enough of them
/// to find where they begin when someone else removed some. Records are remembered by a keyed hash of their
/// bytes (keys drawn per walk, so that no payload can be made to collide): every record of the newest page that
/// kept any (up to [`PAGE`]), and the newest of each page before it, 8 bytes a page.
#[derive(Default)]
struct Kept {
    /// The records at the tail that the walk visited and kept, as far as it knows.
    count: usize,
    /// The newest page that kept records: theirs, oldest first.
    last: Vec<u64>,
    /// The newest record kept by each page before `last`'s, oldest first.
    earlier: Vec<u64>,
    hasher: std::hash::RandomState,
}

impl Kept {
    fn fingerprint(&self, raw: &[u8]) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(raw)
    }

    /// The newest record kept: the one at index `-count`.
    fn newest(&self) -> Option<u64> {
        self.last.last().copied()
    }

    /// A page was acted on: it kept these records, oldest first.
    fn page(&mut self, kept: impl Iterator<Item = u64>) {
        let kept: Vec<u64> = kept.collect();
        if kept.is_empty() {
            return;
        }
        self.count += kept.len();
        if let Some(newest) = self.newest() {
            self.earlier.push(newest);
        }
        self.last = kept;
    }

    /// Finds how many kept records are still at the tail: the kept records only ever leave, so the newest still
    /// there is at most `count` from the tail. Reads from there toward the tail (short: usually as many records
    /// as were removed) until it meets a remembered one; every record before it is taken as unvisited. Records
    /// kept by an earlier page and newer than the first remembered one met are visited again, then: only when
    /// every record of the newest page that kept any, and that earlier page's newest, were removed.
    fn relocate(&mut self, conn: &mut Conn, keys: &QueueKeys) -> Result<()> {
        let remembered: std::collections::HashSet<u64> =
            self.last.iter().chain(&self.earlier).copied().collect();
        let mut from = self.count.min(len(conn, keys)?);
        while from > 0 {
            let to = from.saturating_sub(PAGE).max(1);
            let read = range(conn, keys, -(from as i64), -(to as i64))?;
            if read.len() != from - to + 1 {
                // The list became shorter than `from` since it was measured (LRANGE started at its head).
                from = from.min(len(conn, keys)?);
                continue;
            }
            // List order: newest first, so the first one met is the newest remembered record left.
            for (offset, record) in read.iter().enumerate() {
                if remembered.contains(&self.fingerprint(&record.raw)) {
                    self.count = from - offset;
                    self.forget_newer_than(self.fingerprint(&record.raw));
                    return Ok(());
                }
            }
            from = to - 1;
        }
        // None of them is left.
        *self = Kept {
            hasher: std::mem::take(&mut self.hasher),
            ..Kept::default()
        };
        Ok(())
    }

    /// `print` is now the newest kept record: the ones remembered as newer are gone.
    fn forget_newer_than(&mut self, print: u64) {
        if let Some(at) = self.last.iter().rposition(|kept| *kept == print) {
            self.last.truncate(at + 1);
            return;
        }
        if let Some(at) = self.earlier.iter().rposition(|kept| *kept == print) {
            // Of that page only its newest is remembered: it stands for the page.
            self.earlier.truncate(at);
            self.last = vec![print];
        }
    }
}

/// A record to requeue: its exact bytes, and what to queue where.
pub struct RequeueItem<'a> {
    pub record: &'a [u8],
    /// The level (index into the queue's levels) whose ready list the task joins, at the back.
    pub level: usize,
    /// The unique id to take again, for a unique task.
    pub unique_id: Option<&'a str>,
    pub envelope: &'a [u8],
    /// For a task of a flow that others wait for: the note that withdraws its dead run from them
    /// (`workflow::withdrawal`), pushed onto the head of the queue's outbox in the requeue's step.
    pub withdrawal: Option<&'a [u8]>,
}

/// What became of one record given to [`requeue`] or [`purge`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// Requeued or purged.
    Done,
    /// No longer in the dead list (requeued or purged meanwhile by someone else, or trimmed).
    NotFound,
    /// Not requeued: its unique id is held by a live task, or by a `unique_for` task's window after it ended. The
    /// record stays.
    Held,
}

/// Moves each record's task back to a ready list with dead_requeue.lua, all in one call (give at most [`PAGE`]):
/// each record is removed and its task pushed in one step, or neither. Counts `requeued` and wakes an idle
/// fetcher.
pub fn requeue(conn: &mut Conn, keys: &QueueKeys, items: &[RequeueItem<'_>]) -> Result<Vec<Fate>> {
    if items.is_empty() {
        return Ok(Vec::new());
    }
    let mut call = SCRIPTS.dead_requeue.prepare_invoke();
    call.key(&keys.dead)
        .key(&keys.unique)
        .key(&keys.wake)
        .key(&keys.stats)
        .key(keys.deps_outbox());
    for ready in &keys.ready {
        call.key(ready);
    }
    for item in items {
        call.arg(item.record)
            .arg(item.level + 1)
            .arg(item.unique_id.unwrap_or(""))
            .arg(item.envelope)
            .arg(item.withdrawal.unwrap_or(b""));
    }
    let reply: Vec<i64> = call.invoke(conn)?;
    outcomes(reply, items.len(), "dead_requeue")
}

/// Removes the records with dead_purge.lua, in one call (give at most [`PAGE`]); counts `purged`.
pub fn purge(conn: &mut Conn, keys: &QueueKeys, records: &[&[u8]]) -> Result<Vec<Fate>> {
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

fn outcomes(reply: Vec<i64>, wanted: usize, what: &'static str) -> Result<Vec<Fate>> {
    if reply.len() != wanted {
        return Err(reply_error(
            what,
            format!("{} results for {wanted} records", reply.len()),
        ));
    }
    reply
        .into_iter()
        .map(|n| match n {
            1 => Ok(Fate::Done),
            0 => Ok(Fate::NotFound),
            2 => Ok(Fate::Held),
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
