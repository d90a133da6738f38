//! Flows of tasks that wait for each other (docs/design/flows.md): writing a flow's waiting tasks
//! (flow_push.lua), moving the notes a settle writes to their waiters (the outbox's mover: flow_apply.lua, then
//! flow_outbox.lua), and reading a waiting task back for `kmqd flow show`.
//!
//! A task's end reaches the tasks that wait for it in two steps, each atomic in one slot: the settle that ends it
//! appends a note to its queue's outbox (after.lua, exactly once), and a mover applies the note to each waiter
//! in the waiter's slot, then removes it. A mover may die between the two, or two movers may read the same note:
//! the apply records which dependency ended, keyed by the dependency, so applying a note again changes nothing,
//! and a waiter is released in the one apply that records its last dependency.

use std::borrow::Cow;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::time::Duration;

use redis::ConnectionLike;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Conn, QueueKeys, Result, SCRIPTS, reply_error};

/// The most notes one turn of the mover reads from an outbox: a turn costs five round trips (the promote, the
/// read, a waiter's `HGET` and apply, the removal) whatever its size. A note carries the outcomes of one settle
/// call's tasks with the same waiters (after.lua), so a fan-in's note holds up to a claim's thousand, and 64
/// notes a turn move up to tens of thousands of outcomes (with turns of 256 one-outcome notes, the waiter of a
/// fan-in of 100,000 ran about a second after its last part: docs/PERFORMANCE.md, "A fan-in of 100,000"),
/// while a turn's read stays a few MiB at most.
pub const MOVE_BATCH: usize = 64;

/// The most outcomes one flow_apply.lua call applies to a waiter: a turn's outcomes for one waiter go in calls of
/// this many, so that no call holds Redis for long (about a µs an outcome).
pub const APPLY_BATCH: usize = 4096;

/// The most waiting tasks one call of flow_push.lua writes: a fan-in of 100,000 is pushed in calls of this many,
/// each all or nothing.
pub const PUSH_BATCH: usize = 1000;

/// A task that waits for others, as `kmqd flow push` writes it.
#[derive(Debug, Clone)]
pub struct Waiter {
    pub id: String,
    pub kind: String,
    /// The envelope it is released with (before the `after` list release adds): a JSON object.
    pub envelope: String,
    /// The ready list it joins when released (0-based level of its queue).
    pub level: usize,
    /// `if_failed = "continue"`: it runs when a dependency ended dead; otherwise it is dead-lettered unrun.
    pub continue_if_failed: bool,
    /// The tasks it waits for: (queue, id).
    pub deps: Vec<(String, String)>,
    /// The tasks that wait for it: (queue, id).
    pub up: Vec<(String, String)>,
}

/// `[{"queue": Q, "id": ID}, ...]`: the waiters list of an envelope and of a waiting task's hash.
pub fn waiters_json(waiters: &[(String, String)]) -> String {
    #[derive(serde::Serialize)]
    struct Named<'a> {
        queue: &'a str,
        id: &'a str,
    }
    let list: Vec<Named<'_>> = waiters
        .iter()
        .map(|(queue, id)| Named { queue, id })
        .collect();
    serde_json::to_string(&list).expect("strings serialize")
}

/// Writes the waiting tasks of one queue (`keys`), in calls of [`PUSH_BATCH`]. Returns, per task, what
/// flow_push.lua said: "waiting", "exists" (written before: left as it is), "released" or "failed" (its
/// dependencies had already ended).
pub fn push_waiters(
    conn: &mut Conn,
    keys: &QueueKeys,
    dead_max: usize,
    keep: Duration,
    waiters: &[Waiter],
) -> Result<Vec<String>> {
    let queue = keys.queue_name();
    let mut said = Vec::with_capacity(waiters.len());
    for chunk in waiters.chunks(PUSH_BATCH) {
        let mut invocation = SCRIPTS.flow_push.prepare_invoke();
        invocation
            .key(keys.deps_waiting())
            .key(&keys.wake)
            .key(&keys.dead)
            .key(&keys.stats)
            .key(keys.deps_outbox());
        invocation
            .arg(queue)
            .arg(dead_max)
            .arg(keep.as_millis().max(1) as u64);
        for waiter in chunk {
            let deps: Vec<[&str; 2]> = waiter
                .deps
                .iter()
                .map(|(queue, id)| [queue.as_str(), id.as_str()])
                .collect();
            invocation
                .key(keys.deps(&waiter.id))
                .key(keys.deps_ended(&waiter.id))
                .key(&keys.ready[waiter.level]);
            invocation
                .arg(&waiter.id)
                .arg(&waiter.kind)
                .arg(&waiter.envelope)
                .arg(if waiter.continue_if_failed {
                    "continue"
                } else {
                    "fail"
                })
                .arg(waiter.deps.len())
                .arg(serde_json::to_string(&deps).expect("strings serialize"))
                .arg(waiters_json(&waiter.up));
        }
        let reply: Vec<String> = invocation.invoke(conn)?;
        conn.replicated(&keys.stats)?;
        if reply.len() != chunk.len() {
            return Err(reply_error(
                "flow push",
                format!("{} answers for {} tasks", reply.len(), chunk.len()),
            ));
        }
        said.extend(reply);
    }
    Ok(said)
}

/// A note in an outbox, as after.lua writes it (the outcomes of a settle call's tasks with these waiters and this
/// run), deps.lua (an outcome: a failed waiting task's, up the graph), or dead_requeue.lua (a withdrawal).
#[derive(Deserialize)]
struct Note<'a> {
    #[serde(borrow)]
    to: Vec<Task<'a>>,
    /// The dependency's run: 0 until it is first requeued from its dead letters ([`RUN`]).
    #[serde(default)]
    run: u64,
    #[serde(borrow, default)]
    outcome: Option<&'a RawValue>,
    /// The outcomes of several dependencies, each applied as a note of its own would be.
    #[serde(borrow, default)]
    outcomes: Option<Vec<&'a RawValue>>,
    /// The dependency that was requeued: its waiters forget its dead run's outcome while they wait.
    #[serde(borrow, default)]
    withdraw: Option<Task<'a>>,
}

/// The envelope's field that numbers a task's runs for its waiters: absent (0) until `dead requeue` requeues it,
/// which adds 1, so that a waiter tells the requeued run's note from the dead one's (docs/design/flows.md,
/// "A requeued dependency").
pub const RUN: &str = "run";

/// A task named in a note: borrowed from the note read (a name with an escape is copied), so that a mover's turn of
/// a thousand notes makes no string of its own a note but the dependency's field.
#[derive(Deserialize, Clone, PartialEq, Eq, Hash)]
struct Task<'a> {
    #[serde(borrow)]
    queue: Cow<'a, str>,
    #[serde(borrow)]
    id: Cow<'a, str>,
}

/// A note's outcome, as much as the mover reads of it (a dead one's `reason` is read by flow_apply.lua, from the
/// outcome it records, only when it fails the waiting task).
#[derive(Deserialize, Clone)]
struct Outcome<'a> {
    #[serde(borrow)]
    queue: Cow<'a, str>,
    #[serde(borrow)]
    id: Cow<'a, str>,
    #[serde(borrow)]
    state: Cow<'a, str>,
}

/// The field of a waiting task's ended hash that names a dependency: a queue name holds no newline (config
/// validation), so the first one splits it.
pub fn dependency_field(queue: &str, id: &str) -> String {
    format!("{queue}\n{id}")
}

/// One turn of the mover of `keys`' outbox: reads up to [`MOVE_BATCH`] of its oldest notes, applies each outcome
/// to each of its waiters (each apply replicated, with `wait_replicas`, before anything is removed), then removes
/// them. Returns how many notes it read. A note that is not one (written by something else than kmqd) is logged
/// and removed with the others: it names no waiter it could be applied to.
/// `beat` is called before each waiter's apply (the delay poller's pulse, for the watchdog).
pub fn move_outbox(conn: &mut Conn, keys: &QueueKeys, beat: &dyn Fn()) -> Result<usize> {
    let outbox = keys.deps_outbox();
    let notes: Vec<Vec<u8>> = redis::cmd("LRANGE")
        .arg(&outbox)
        .arg(0)
        .arg(MOVE_BATCH - 1)
        .query(conn)?;
    if notes.is_empty() {
        return Ok(0);
    }
    // The outcomes for each waiter, in the order read: one apply a waiter (a fan-in's notes come in runs). Found
    // by name through `at`, so that a note to many waiters (a fan-out) costs a look-up a waiter, not a scan.
    let mut waiters: Vec<(Task<'_>, Vec<Applied<'_>>)> = Vec::new();
    let mut at: HashMap<Task<'_>, usize> = HashMap::new();
    for bytes in &notes {
        let parsed = serde_json::from_slice::<Note<'_>>(bytes).and_then(|note| {
            let outcomes = match (note.outcome, &note.outcomes, &note.withdraw) {
                (Some(raw), None, None) => vec![applied(raw, note.run)?],
                (None, Some(many), None) if !many.is_empty() => many
                    .iter()
                    .map(|raw| applied(raw, note.run))
                    .collect::<serde_json::Result<_>>()?,
                (None, None, Some(task)) => vec![Applied {
                    outcome: Outcome {
                        queue: task.queue.clone(),
                        id: task.id.clone(),
                        state: Cow::Borrowed("withdraw"),
                    },
                    raw: "",
                    run: note.run,
                }],
                _ => {
                    return Err(<serde_json::Error as serde::de::Error>::custom(
                        "a note has either an outcome, outcomes or a withdrawal",
                    ));
                }
            };
            Ok((note.to, outcomes))
        });
        let (to, outcomes) = match parsed {
            Ok(parsed) => parsed,
            Err(error) => {
                tracing::error!(
                    outbox,
                    %error,
                    note = %String::from_utf8_lossy(&bytes[..bytes.len().min(512)]),
                    "a note in a flow's outbox is not one kmqd wrote; removed"
                );
                continue;
            }
        };
        for waiter in to {
            match at.entry(waiter.clone()) {
                Entry::Occupied(known) => waiters[*known.get()].1.extend_from_slice(&outcomes),
                Entry::Vacant(new) => {
                    new.insert(waiters.len());
                    waiters.push((waiter, outcomes.clone()));
                }
            }
        }
    }
    for (waiter, outcomes) in &waiters {
        for outcomes in outcomes.chunks(APPLY_BATCH) {
            beat();
            apply(conn, keys, waiter, outcomes)?;
        }
    }
    let mut invocation = SCRIPTS.flow_outbox.prepare_invoke();
    invocation.key(&outbox);
    for bytes in &notes {
        invocation.arg(bytes.as_slice());
    }
    let _popped: usize = invocation.invoke(conn)?;
    conn.replicated(&outbox)?;
    Ok(notes.len())
}

/// One outcome as flow_apply.lua takes it: the outcome (state "withdraw" for a withdrawal), its JSON ("" for a
/// withdrawal), and the dependency's run.
#[derive(Clone)]
struct Applied<'a> {
    outcome: Outcome<'a>,
    raw: &'a str,
    run: u64,
}

/// The outcome `raw` of a note of run `run`, as flow_apply.lua takes it.
fn applied<'a>(raw: &'a RawValue, run: u64) -> serde_json::Result<Applied<'a>> {
    Ok(Applied {
        outcome: serde_json::from_str::<Outcome<'_>>(raw.get())?,
        raw: raw.get(),
        run,
    })
}

/// Applies dependencies' outcomes to one waiting task (flow_apply.lua), naming the ready list its hash names.
fn apply(
    conn: &mut Conn,
    keys: &QueueKeys,
    waiter: &Task<'_>,
    outcomes: &[Applied<'_>],
) -> Result<String> {
    let theirs = keys.other_queue(&waiter.queue);
    let hash = theirs.deps(&waiter.id);
    // Read again if the hash names another list by the time the script runs (it cannot, but for a task written
    // between the read and the call, which the script tells).
    for _ in 0..3 {
        let ready: Option<String> = redis::cmd("HGET").arg(&hash).arg("ready").query(conn)?;
        // A waiter not written yet gets only the record: any list of its slot stands in for its ready list.
        let ready = ready.unwrap_or_else(|| theirs.deps_ended(&waiter.id) + ":none");
        let mut invocation = SCRIPTS.flow_apply.prepare_invoke();
        invocation
            .key(&hash)
            .key(theirs.deps_ended(&waiter.id))
            .key(theirs.deps_waiting())
            .key(&ready)
            .key(&theirs.wake)
            .key(&theirs.dead)
            .key(&theirs.stats)
            .key(theirs.deps_outbox())
            .key(theirs.deps_run(&waiter.id));
        for Applied { outcome, raw, run } in outcomes {
            invocation
                .arg(dependency_field(&outcome.queue, &outcome.id))
                .arg(*raw)
                .arg(outcome.state.as_ref())
                .arg(*run);
        }
        let said: String = invocation.invoke(conn)?;
        // Replicated before the note may be removed (`[redis] wait_replicas`): a failover of the waiter's master
        // must not undo a record whose note is gone. Not replicated: an error, and the note stays for the next
        // turn, whose apply is then a duplicate or the record again.
        conn.replicated(&hash)?;
        if said != "moved" {
            if said == "released" || said == "failed" {
                tracing::debug!(queue = %waiter.queue, id = %waiter.id, said, "a flow's waiting task");
            }
            return Ok(said);
        }
    }
    Err(reply_error(
        "flow apply",
        format!(
            "the waiting task {}/{} named another ready list three times",
            waiter.queue, waiter.id
        ),
    ))
}

/// A waiting task as its hash and ended hash hold it (`kmqd flow show`).
#[derive(Debug, Clone, Default)]
pub struct WaitingTask {
    /// "waiting", "released" or "dead".
    pub state: String,
    pub kind: String,
    pub reason: Option<String>,
    pub if_failed: String,
    /// The tasks it waits for, in the order the flow named them.
    pub deps: Vec<(String, String)>,
    /// Each dependency that ended, by [`dependency_field`]: its outcome object.
    pub ended: HashMap<String, serde_json::Value>,
}

/// The waiting task `id` of `keys`' queue, if it has a hash (it waits, or it finished within its expiry).
pub fn waiting_task(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    id: &str,
) -> Result<Option<WaitingTask>> {
    let fields: HashMap<String, String> = redis::cmd("HGETALL").arg(keys.deps(id)).query(conn)?;
    if fields.is_empty() {
        return Ok(None);
    }
    let ended: HashMap<String, String> =
        redis::cmd("HGETALL").arg(keys.deps_ended(id)).query(conn)?;
    let field = |name: &str| fields.get(name).cloned().unwrap_or_default();
    let deps: Vec<(String, String)> = serde_json::from_str::<Vec<[String; 2]>>(&field("deps"))
        .map_err(|error| reply_error("flow show", format!("{}: deps: {error}", keys.deps(id))))?
        .into_iter()
        .map(|[queue, id]| (queue, id))
        .collect();
    Ok(Some(WaitingTask {
        state: field("state"),
        kind: field("type"),
        reason: fields.get("reason").cloned(),
        if_failed: field("if_failed"),
        deps,
        ended: ended
            .into_iter()
            .map(|(dep, outcome)| {
                let value =
                    serde_json::from_str(&outcome).unwrap_or(serde_json::Value::String(outcome));
                (dep, value)
            })
            .collect(),
    }))
}

/// How a task with waiters ended, for its note.
#[derive(Debug, Clone, Copy)]
pub enum Ended<'a> {
    /// Done, with the handler's JSON result if it gave one.
    Done(Option<&'a str>),
    /// Dead-lettered, and why.
    Dead(&'a str),
}

/// The run of a task of a flow: its envelope's [`RUN`], 0 when absent (never requeued) or not a number.
pub fn run_of(envelope: &crate::task::Envelope<'_>) -> u64 {
    envelope
        .extra
        .iter()
        .find(|(name, _)| name == RUN)
        .and_then(|(_, value)| value.get().parse().ok())
        .unwrap_or(0)
}

/// The envelope `envelope` as run `run` of its task: its [`RUN`] field set (added after its other fields).
pub fn set_run(envelope: &mut crate::task::Envelope<'_>, run: u64) {
    let value = RawValue::from_string(run.to_string()).expect("a number is JSON");
    match envelope.extra.iter_mut().find(|(name, _)| name == RUN) {
        Some((_, old)) => *old = std::borrow::Cow::Owned(value),
        None => envelope.extra.push((
            std::borrow::Cow::Borrowed(RUN),
            std::borrow::Cow::Owned(value),
        )),
    }
}

/// The outcome of task `id` of `queue` that the settle that ends it notes for its waiters: `{"queue", "id",
/// "state", "result" | "reason"}`, what each waiter's ended hash keeps and its handler receives in `after`.
/// after.lua writes it into the note of its call's tasks with the same waiters and run: `{"to": WAITERS, "run":
/// RUN, "outcomes": [OUTCOME, ...]}`, `run` (the envelope's [`RUN`]) left out while it is 0, as it is unless the
/// task was requeued. A result that is not JSON, or over `max_result` bytes, travels as `null` (the task is done
/// all the same: its waiters run).
pub fn outcome(queue: &str, id: &str, ended: Ended<'_>, max_result: usize) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct Outcome<'a> {
        queue: &'a str,
        id: &'a str,
        state: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        result: Option<Option<&'a RawValue>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<&'a str>,
    }
    let outcome = match ended {
        Ended::Done(result) => Outcome {
            queue,
            id,
            state: "done",
            result: Some(
                result
                    .filter(|text| text.len() <= max_result)
                    .and_then(|text| serde_json::from_str::<&RawValue>(text).ok()),
            ),
            reason: None,
        },
        Ended::Dead(reason) => Outcome {
            queue,
            id,
            state: "dead",
            result: None,
            reason: Some(reason),
        },
    };
    serde_json::to_vec(&outcome).expect("an outcome serializes")
}

/// The note `dead requeue` writes to the head of the outbox of task `id` of `queue` when it requeues the task as
/// run `run` (its waiters: the envelope's `waiters`, as it is): `{"to": WAITERS, "run": RUN, "withdraw":
/// {"queue", "id"}}`. Applied, it withdraws the dead run's outcome from each waiter that still waits, so that the
/// waiter waits for the new run (flow_apply.lua). At the head, so that a mover applies it before the dead run's
/// note if that is still in the outbox: the waiter is then never failed by a run that was requeued.
pub fn withdrawal(queue: &str, id: &str, waiters: &RawValue, run: u64) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct Named<'a> {
        queue: &'a str,
        id: &'a str,
    }
    #[derive(serde::Serialize)]
    struct Withdrawal<'a> {
        to: &'a RawValue,
        run: u64,
        withdraw: Named<'a>,
    }
    serde_json::to_vec(&Withdrawal {
        to: waiters,
        run,
        withdraw: Named { queue, id },
    })
    .expect("a withdrawal serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outcome_is_what_a_waiter_keeps() {
        let done = outcome("parts", "p-1", Ended::Done(Some(r#"{"rows": 3}"#)), 100);
        assert_eq!(
            String::from_utf8(done).unwrap(),
            r#"{"queue":"parts","id":"p-1","state":"done","result":{"rows": 3}}"#
        );
        let none = outcome("parts", "p-1", Ended::Done(None), 100);
        assert!(
            String::from_utf8(none)
                .unwrap()
                .ends_with(r#""state":"done","result":null}"#)
        );
        let large = outcome("parts", "p-1", Ended::Done(Some("[1,2,3]")), 3);
        assert!(
            String::from_utf8(large)
                .unwrap()
                .ends_with(r#""result":null}"#)
        );
        let dead = outcome("parts", "p-1", Ended::Dead("no \"luck\""), 100);
        assert!(
            String::from_utf8(dead)
                .unwrap()
                .ends_with(r#""state":"dead","reason":"no \"luck\""}"#)
        );
    }
}
