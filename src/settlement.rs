//! Turns a decision about a task ([`Action`]) into the record the settle script applies, and carries what the
//! plugin's final-failure hook needs once the record landed.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use base64::Engine as _;

use crate::broker::{Kept, SettleOp, Settlement, ThrottleScope, Token};
use crate::policy::Action;
use crate::task::{Envelope, LOGGED_PAYLOAD_BYTES, capped, new_id};

/// What `on_dead` is told.
#[derive(Debug)]
pub struct DeadHook {
    pub envelope: Envelope<'static>,
    pub reason: String,
}

/// A dead-letter record (docs/PROTOCOL.md, "Dead letters"); the settle script adds `dead_at`.
#[derive(Serialize)]
struct DeadRecord<'a> {
    queue: &'a str,
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    /// The priority level the task was taken from, so that `kmqd dead requeue` puts it back there (records
    /// written before this field, and claim.lua's records of oversized payloads, have none).
    #[serde(skip_serializing_if = "Option::is_none")]
    level: Option<&'a str>,
    attempt: u32,
    reason: &'a str,
    daemon: &'a str,
    /// The payload exactly as it was stored, so a malformed task is kept too: as text when it is UTF-8...
    #[serde(skip_serializing_if = "Option::is_none")]
    task: Option<&'a str>,
    /// ... and as base64 of its bytes when it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    task_base64: Option<String>,
    /// The payload's size, in the one case it is not kept: a record that would be over [`MAX_RECORD_BYTES`].
    #[serde(skip_serializing_if = "Option::is_none")]
    size: Option<usize>,
}

/// The largest record a settle call can carry: Redis's largest string, and its default `proto-max-bulk-len`. A
/// dead record is larger than its payload (JSON escapes `"` and control characters, up to six bytes for one;
/// base64 of a payload that is not UTF-8 is a third larger), so with `max_task_bytes` over about 85 MiB one can
/// be over it: Redis would refuse it, as often as it were sent (review M8). Such a record keeps the payload's
/// size instead of the payload, and says so in its reason.
pub const MAX_RECORD_BYTES: usize = 512 << 20;

impl DeadRecord<'_> {
    /// The record's JSON; without the payload (its `size` instead) when it would be over `limit` bytes.
    fn encode(self, payload_len: usize, limit: usize) -> Vec<u8> {
        // Strings and integers always serialize.
        let record = serde_json::to_vec(&self).expect("dead record serializes");
        if record.len() <= limit {
            return record;
        }
        let reason = format!(
            "{} (its payload, {payload_len} bytes, is not kept: with it this record would be {} bytes, over \
             Redis's largest string)",
            self.reason,
            record.len()
        );
        let without = DeadRecord {
            reason: &reason,
            task: None,
            task_base64: None,
            size: Some(payload_len),
            ..self
        };
        serde_json::to_vec(&without).expect("dead record serializes")
    }
}

/// Where a settlement comes from, for the records it writes.
pub struct Origin<'a> {
    pub queue: &'a str,
    /// `host:pid` of the daemon writing the record.
    pub daemon: &'a str,
    /// The queue's priority levels, highest first: a record names its task's level.
    pub levels: &'a [String],
    /// The queue's `[[queues.limits]]`: a throttle of a task of a listed type holds back that type, not the queue.
    pub type_limits: &'a [crate::config::TypeLimit],
    /// Whether the queue has `[queues.groups]`: a throttle holds back the task's group, not the queue.
    pub grouped: bool,
    /// The queue's `keep_results`: the record that ends a task keeps its result (or its reason) at least that
    /// long. `None`: nothing is kept.
    pub keep_results: Option<Duration>,
}

/// The largest result kept, as the handler's JSON text: a result is a field of its own, kept for `keep_results`,
/// and read whole by every `kmqd task result`; a handler with more to hand on writes it elsewhere and returns
/// where. A larger one (or one that is not JSON) does not fail its task: the task is done, and the result kept is
/// an error record saying why (`result` null, `result_error`), so a reader learns what happened.
pub const MAX_RESULT_BYTES: usize = 1 << 20;

/// What a task that ended keeps (docs/PROTOCOL.md, "Results"): `{"state":"done","result":...}` with the
/// handler's JSON (`null` when it gave none), or `{"state":"dead","reason":"..."}`; results.lua adds `ended_at`.
#[derive(Serialize)]
struct KeptRecord<'a> {
    state: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<&'a serde_json::value::RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    result_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'a str>,
}

/// The value kept for a task done with `result` (the handler's JSON text, if any).
fn done_record(result: Option<&str>) -> Vec<u8> {
    let null = serde_json::value::RawValue::NULL;
    let (result, result_error) = match result {
        None => (null, None),
        Some(text) if text.len() > MAX_RESULT_BYTES => (
            null,
            Some(format!(
                "the handler's result, {} bytes, is over the {MAX_RESULT_BYTES}-byte bound; it was not kept",
                text.len()
            )),
        ),
        Some(text) => match serde_json::from_str::<&serde_json::value::RawValue>(text) {
            Ok(raw) => (raw, None),
            Err(error) => (
                null,
                Some(format!(
                    "the handler's result is not JSON ({error}); it was not kept"
                )),
            ),
        },
    };
    let record = KeptRecord {
        state: "done",
        result: Some(result),
        result_error,
        reason: None,
    };
    // A string and raw JSON that parsed always serialize.
    serde_json::to_vec(&record).expect("kept record serializes")
}

/// The value kept for a task that ended dead, with why.
fn dead_record(reason: &str) -> Vec<u8> {
    let record = KeptRecord {
        state: "dead",
        result: None,
        result_error: None,
        reason: Some(reason),
    };
    serde_json::to_vec(&record).expect("kept record serializes")
}

/// The task a settlement is for, as its resolver holds it: everything the record is made of besides the decision.
#[derive(Debug)]
pub struct TaskParts<'a> {
    /// Safe mode: the claim that fences the settlement, as the resolver names it (a worker, by its lease view's
    /// copy of the owner's id: see `LeaseView::token`).
    pub token: Option<Token>,
    /// Default mode under a running limit: the owner that popped the task.
    pub popped_by: Option<Arc<str>>,
    /// Default mode: the type's running count its pop counted it in (`broker::Settlement::popped_scope`).
    pub popped_scope: Option<Arc<str>>,
    /// The priority level the task was taken from.
    pub level: usize,
    /// The payload exactly as taken from Redis.
    pub payload: &'a [u8],
    /// The payload decoded; `None` when it does not decode (such a task can only be dead-lettered).
    pub envelope: Option<&'a Envelope<'a>>,
}

impl TaskParts<'_> {
    /// The id a unique task holds: a settlement releases it (or keeps it held, for a task queued again).
    fn unique_id(&self) -> Option<Box<str>> {
        self.envelope
            .filter(|envelope| envelope.unique)
            .and_then(|envelope| envelope.id.as_deref().map(Box::from))
    }
}

/// A reproducible jitter seed for a task's backoff.
pub fn seed(envelope: &Envelope<'_>) -> u64 {
    let mut hasher = DefaultHasher::new();
    envelope.id_str().hash(&mut hasher);
    envelope.attempt.hash(&mut hasher);
    hasher.finish()
}

/// Builds the record for `action`; `failed` says whether the run counts as failed
/// ([`crate::policy::Verdict::is_failed_run`]). A task whose payload did not decode (no `envelope`) can only be
/// dead-lettered or acknowledged, never retried (there is no attempt count to raise), so a retry becomes a dead
/// letter. `result`: the JSON its handler returned with done, kept with a queue's `keep_results`.
pub fn record(
    origin: &Origin<'_>,
    action: &Action,
    failed: bool,
    task: TaskParts<'_>,
    result: Option<&str>,
) -> (Settlement, Option<Box<DeadHook>>) {
    // Only with `keep_results`: a queue without it does nothing more per task.
    let id = origin.keep_results.and_then(|_| match task.envelope {
        Some(envelope) => Some(envelope.id_str().to_string()),
        None => crate::task::salvage_id(task.payload),
    });
    // Only for a task of a flow that others wait for (its envelope's `waiters`, written by `kmqd flow push`).
    let waiters = task.envelope.and_then(|envelope| {
        let (_, waiters) = envelope.extra.iter().find(|(name, _)| name == "waiters")?;
        Some((
            envelope.id_str().to_string(),
            waiters.clone(),
            crate::broker::workflow::run_of(envelope),
        ))
    });
    let (mut settlement, hook) = record_without_result(origin, action, failed, task);
    if let (Some(ttl), Some(id)) = (origin.keep_results, id) {
        settlement.kept = kept(ttl, action, result, &settlement.op, id);
    }
    if let Some((id, waiters, run)) = waiters {
        settlement.note = note(
            origin.queue,
            &id,
            &waiters,
            run,
            action,
            result,
            &settlement.op,
        );
    }
    (settlement, hook)
}

/// The note to the tasks waiting for a task that this settlement ends (docs/design/flows.md): its outcome as
/// [`kept`] decides it; nothing for a settlement that does not end the task.
fn note(
    queue: &str,
    id: &str,
    waiters: &serde_json::value::RawValue,
    run: u64,
    action: &Action,
    result: Option<&str>,
    op: &SettleOp,
) -> Option<Box<crate::broker::tasks::Note>> {
    use crate::broker::workflow::{self, Ended};
    let ended = match (action, op) {
        (Action::Ack, SettleOp::Ack) => Ended::Done(result),
        (Action::Dead { reason } | Action::Retry { reason, .. }, SettleOp::Dead) => {
            Ended::Dead(reason)
        }
        (Action::Recover { .. }, SettleOp::Dead) => Ended::Dead("malformed task"),
        _ => return None,
    };
    Some(Box::new(crate::broker::tasks::Note {
        to: waiters.get().into(),
        run,
        outcome: workflow::outcome(queue, id, ended, MAX_RESULT_BYTES),
    }))
}

/// What a settlement that ends a task keeps: nothing for a task that does not end (a retry, a recovery, a
/// throttle), or whose id is unknown (a payload that is not even a JSON object).
fn kept(
    ttl: Duration,
    action: &Action,
    result: Option<&str>,
    op: &SettleOp,
    id: String,
) -> Option<Box<Kept>> {
    let value = match (action, op) {
        (Action::Ack, SettleOp::Ack) => done_record(result),
        (Action::Dead { reason } | Action::Retry { reason, .. }, SettleOp::Dead) => {
            dead_record(reason)
        }
        (Action::Recover { .. }, SettleOp::Dead) => dead_record("malformed task"),
        _ => return None,
    };
    Some(Box::new(Kept { id, value, ttl }))
}

fn record_without_result(
    origin: &Origin<'_>,
    action: &Action,
    failed: bool,
    task: TaskParts<'_>,
) -> (Settlement, Option<Box<DeadHook>>) {
    let unique_id = task.unique_id();
    let TaskParts {
        token,
        popped_by,
        popped_scope,
        level,
        payload,
        envelope,
    } = task;
    // A malformed payload has no envelope to queue again: it can only be dead-lettered. Built only then: this
    // runs once per task.
    let malformed;
    let action = match (action, envelope) {
        (Action::Recover { .. }, None) => {
            malformed = Action::Dead {
                reason: "malformed task".to_string(),
            };
            &malformed
        }
        _ => action,
    };
    // Called once, whichever the branch.
    let base = move |op, payload: Vec<u8>| Settlement {
        op,
        token,
        popped_by,
        popped_scope,
        unique_id,
        level,
        payload,
        failed,
        kept: None,
        note: None,
    };
    match (action, envelope) {
        (Action::Ack, _) => (base(SettleOp::Ack, Vec::new()), None),
        (
            Action::Retry {
                delay,
                reason,
                isolated,
            },
            Some(envelope),
        ) => {
            let mut next = envelope.clone();
            next.ensure_id(new_id);
            // The attempt count is the producer's to begin with: saturate rather than overflow.
            next.attempt = next.attempt.saturating_add(1);
            if *isolated {
                next.crashes = next.crashes.saturating_add(1);
            }
            next.last_error = Some(reason.clone().into());
            let op = SettleOp::Retry {
                delay: *delay,
                isolated: *isolated,
            };
            (base(op, next.encode().into_bytes()), None)
        }
        (Action::Recover { quarantine }, Some(envelope)) => {
            let mut next = envelope.clone();
            next.ensure_id(new_id);
            next.recovered = next.recovered.saturating_add(1);
            let op = SettleOp::Recover {
                quarantine: *quarantine,
            };
            (base(op, next.encode().into_bytes()), None)
        }
        // Exactly as it was taken, as a hand-back: nothing of the task changed (the stats count throttles). On a
        // grouped queue a task throttles its group; otherwise a task of a type with its own limits its type
        // (issue 33: "a task without a group: its type, or the queue"); any other, the queue.
        (Action::Throttle { after, .. }, _) => {
            let scope = if origin.grouped {
                envelope.map(group_scope)
            } else {
                envelope
                    .map(|e| &*e.kind)
                    .filter(|kind| origin.type_limits.iter().any(|limit| limit.kind == *kind))
                    .map(|kind| ThrottleScope::Type(kind.to_string()))
            };
            let op = SettleOp::Throttle {
                after: *after,
                scope,
            };
            (base(op, payload.to_vec()), None)
        }
        // A hand-back (the shutdown, a reload, stuck workers): the task goes to the front of its level (or of the
        // quarantine stage it waited in) unchanged, and a unique one keeps its id held, as a waiting task again
        // (default mode: no longer by the popping owner). A payload that does not decode goes back too, as it is.
        // On a grouped queue any other goes to the front of its group's flow, keeping its place among its group's
        // tasks (docs/design/flow-control.md, departure (f)).
        (Action::Back { quarantine }, _) => {
            let group = envelope
                .filter(|_| origin.grouped && quarantine.is_none())
                .map(|envelope| Box::new(group_scope(envelope)));
            let op = SettleOp::Back {
                quarantine: *quarantine,
                group,
            };
            (base(op, payload.to_vec()), None)
        }
        (Action::Recover { .. }, None) => unreachable!("replaced by a dead letter above"),
        (Action::Dead { reason }, _) | (Action::Retry { reason, .. }, None) => {
            // A payload that is a JSON object but not an envelope still has its id found, for `task show`.
            let salvaged = match envelope {
                Some(_) => None,
                None => crate::task::salvage_id(payload),
            };
            let text = std::str::from_utf8(payload).ok();
            let record = DeadRecord {
                queue: origin.queue,
                id: envelope.map_or(salvaged.as_deref().unwrap_or(""), Envelope::id_str),
                kind: envelope.map_or("", |e| &*e.kind),
                level: origin.levels.get(level).map(String::as_str),
                attempt: envelope.map_or(0, |e| e.attempt),
                reason,
                daemon: origin.daemon,
                task: text,
                task_base64: match text {
                    Some(_) => None,
                    None => Some(base64::engine::general_purpose::STANDARD.encode(payload)),
                },
                size: None,
            };
            let record = record.encode(payload.len(), MAX_RECORD_BYTES);
            let hook = envelope.map(|e| {
                Box::new(DeadHook {
                    envelope: e.clone().into_owned(),
                    reason: reason.clone(),
                })
            });
            (base(SettleOp::Dead, record), hook)
        }
    }
}

/// What a run of a handler left besides its verdict, for the task's log event.
#[derive(Debug, Default)]
pub struct Ran {
    /// How long the handler ran, when measured: for every run whose event is logged (kmqd reads the clock for
    /// it only then; the duration histogram has its own, cheaper timing).
    pub duration: Option<Duration>,
    /// What a handler that finished the task had to show for it (`Outcome::DoneWithOutput`; the exec plugin's
    /// output); empty when nothing. A failure's output is in its reason.
    pub output: String,
    /// The JSON a handler that finished the task returned with it (`Outcome::done_with_result`, the line
    /// protocol's `result`), kept with a queue's `keep_results`; `None` when it returned none.
    pub result: Option<String>,
    /// The run's place in its trace, when the queue is traced and a worker started the run (its span is made at
    /// the settle: `crate::otel`).
    pub(crate) trace: Option<Box<crate::otel::RunTrace>>,
}

/// The task's log event for `action`, which the policy decided (`crate::queue::QueueContext::settle`, the one
/// place that decides): `failed`, whether the run counts as failed ([`crate::policy::Verdict::is_failed_run`]); `quiet_retry`, a
/// retry of a task no plugin handles, which the worker warned about once for its type (a warning per task would
/// flood the log during a rolling deploy); `ran`, what its handler's run left (how long, its output), when one ran.
pub(crate) fn log(
    queue: &str,
    action: &Action,
    failed: bool,
    quiet_retry: bool,
    envelope: Option<&Envelope<'_>>,
    ran: Option<&Ran>,
) {
    let attempt = envelope.map_or(0, |e| e.attempt);
    // Ids and reasons come from producers and plugins: cap them, so one huge one cannot flood the log. Every state
    // change is an event with the task's queue, id, type, attempt and, when a handler ran, how long (seconds): at
    // debug for the ordinary ones, so a production log at info stays quiet. The fields are made only for an event
    // that is logged: a plain acknowledgement at info makes none (docs/PERFORMANCE.md, "The daemon's hot path,
    // cut down").
    let id = || capped(envelope.map_or("", Envelope::id_str), LOGGED_PAYLOAD_BYTES);
    let kind = || capped(envelope.map_or("", |e| &*e.kind), LOGGED_PAYLOAD_BYTES);
    let duration = || {
        ran.and_then(|ran| ran.duration)
            .map(|ran| ran.as_secs_f64())
    };
    let output = || {
        ran.map(|ran| ran.output.as_str())
            .filter(|output| !output.is_empty())
    };
    match action {
        Action::Ack if !failed => tracing::debug!(
            queue,
            id = &*id(),
            kind = &*kind(),
            attempt,
            duration = duration(),
            output = output(),
            "task done"
        ),
        Action::Ack => tracing::warn!(
            queue,
            id = &*id(),
            kind = &*kind(),
            attempt,
            duration = duration(),
            "task failed; counted as done (on_handler_error = \"finish\")"
        ),
        Action::Recover { quarantine } => tracing::info!(
            queue,
            id = &*id(),
            kind = &*kind(),
            attempt,
            group = quarantine.map(|stage| crate::broker::keys::QUARANTINE_GROUPS[stage]),
            "task held by a daemon whose lease expired goes back, uncharged"
        ),
        Action::Throttle { after, reason } => {
            let reason = capped(reason, LOGGED_PAYLOAD_BYTES);
            tracing::debug!(queue, id = &*id(), kind = &*kind(), attempt, %reason, throttle = ?after, "task throttled its queue; it goes back, uncharged")
        }
        Action::Retry { delay, reason, .. } if quiet_retry => {
            let reason = capped(reason, LOGGED_PAYLOAD_BYTES);
            tracing::debug!(queue, id = &*id(), kind = &*kind(), attempt, %reason, retry_in = ?delay, "task not run; will retry")
        }
        Action::Retry { delay, reason, .. } => {
            let reason = capped(reason, LOGGED_PAYLOAD_BYTES);
            tracing::warn!(queue, id = &*id(), kind = &*kind(), attempt, duration = duration(), %reason, retry_in = ?delay, "task failed; will retry")
        }
        Action::Dead { reason } => {
            let reason = capped(reason, LOGGED_PAYLOAD_BYTES);
            tracing::warn!(queue, id = &*id(), kind = &*kind(), attempt, duration = duration(), %reason, "task dead-lettered")
        }
        // The resolver that gave it back counts it; the shutdown and a reload log their own totals.
        Action::Back { .. } => {}
    }
}

/// The group a grouped queue's task belongs to, as its flow is named (the empty name: no group; a malformed one
/// never reaches a claim list, the intake dead-letters it).
fn group_scope(envelope: &Envelope<'_>) -> ThrottleScope {
    ThrottleScope::Group(envelope.group().ok().flatten().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn token() -> Token {
        Token {
            owner: std::sync::Arc::from("o1"),
            id: crate::broker::TokenId::Listed {
                claim: 7,
                position: 0,
            },
        }
    }

    /// [`record`] of a task given by its parts.
    fn record_of(
        origin: &Origin<'_>,
        action: &Action,
        failed: bool,
        token: Option<Token>,
        level: usize,
        payload: &[u8],
        envelope: Option<&Envelope<'_>>,
    ) -> (Settlement, Option<Box<DeadHook>>) {
        let task = TaskParts {
            token,
            popped_by: None,
            popped_scope: None,
            level,
            payload,
            envelope,
        };
        record(origin, action, failed, task, None)
    }

    fn origin() -> Origin<'static> {
        Origin {
            queue: "mail",
            daemon: "host:1",
            levels: &[],
            type_limits: &[],
            grouped: false,
            keep_results: None,
        }
    }

    /// What a done task with `result` keeps, parsed; the kept key and expiry checked.
    fn kept_for(result: Option<&str>) -> serde_json::Value {
        let origin = Origin {
            keep_results: Some(Duration::from_secs(60)),
            ..origin()
        };
        let envelope = Envelope::decode(r#"{"id":"a","type":"t"}"#).unwrap();
        let (settlement, _) = record(
            &origin,
            &Action::Ack,
            false,
            TaskParts {
                token: Some(token()),
                popped_by: None,
                popped_scope: None,
                level: 0,
                payload: b"{}",
                envelope: Some(&envelope),
            },
            result,
        );
        let kept = settlement.kept.expect("a done task keeps its result");
        assert_eq!(kept.id, "a");
        assert_eq!(kept.ttl, Duration::from_secs(60));
        serde_json::from_slice(&kept.value).unwrap()
    }

    #[test]
    fn a_result_over_its_bound_is_replaced_by_an_error_record() {
        assert_eq!(
            kept_for(Some(r#"{"rows": 3}"#)),
            serde_json::json!({"state": "done", "result": {"rows": 3}})
        );
        assert_eq!(
            kept_for(None),
            serde_json::json!({"state": "done", "result": null})
        );
        let large = format!("\"{}\"", "x".repeat(MAX_RESULT_BYTES));
        let over = kept_for(Some(&large));
        assert_eq!(over["state"], "done", "the task is still done");
        assert_eq!(over["result"], serde_json::Value::Null);
        let error = over["result_error"].as_str().unwrap();
        assert!(
            error.contains("1048578 bytes, is over the 1048576-byte bound"),
            "{error}"
        );
        let broken = kept_for(Some("{rows"));
        assert!(
            broken["result_error"]
                .as_str()
                .unwrap()
                .contains("is not JSON"),
            "{broken}"
        );
    }

    #[test]
    fn only_a_queue_with_keep_results_keeps_anything() {
        let envelope = Envelope::decode(r#"{"id":"a","type":"t"}"#).unwrap();
        let task = || TaskParts {
            token: Some(token()),
            popped_by: None,
            popped_scope: None,
            level: 0,
            payload: b"{}",
            envelope: Some(&envelope),
        };
        let (plain, _) = record(&origin(), &Action::Ack, false, task(), Some("1"));
        assert_eq!(plain.kept, None);
        let keeping = Origin {
            keep_results: Some(Duration::from_secs(60)),
            ..origin()
        };
        let dead = Action::Dead {
            reason: "no such customer".into(),
        };
        let (settlement, _) = record(&keeping, &dead, true, task(), None);
        let kept: serde_json::Value =
            serde_json::from_slice(&settlement.kept.unwrap().value).unwrap();
        assert_eq!(
            kept,
            serde_json::json!({"state": "dead", "reason": "no such customer"})
        );
        let retry = Action::Retry {
            delay: Duration::from_secs(1),
            reason: "busy".into(),
            isolated: false,
        };
        let (settlement, _) = record(&keeping, &retry, true, task(), None);
        assert_eq!(
            settlement.kept, None,
            "a task that does not end keeps nothing"
        );
    }

    #[test]
    fn retry_raises_attempt_and_records_the_error() {
        let envelope =
            Envelope::decode(r#"{"id":"a","type":"t","data":[1],"attempt":1,"unique":true,"x":2}"#)
                .unwrap();
        let action = Action::Retry {
            delay: Duration::from_secs(2),
            reason: "boom".into(),
            isolated: false,
        };
        let (s, hook) = record_of(
            &origin(),
            &action,
            true,
            Some(token()),
            0,
            b"",
            Some(&envelope),
        );
        assert_eq!(
            s.op,
            SettleOp::Retry {
                delay: Duration::from_secs(2),
                isolated: false,
            }
        );
        assert_eq!(s.token, Some(token()));
        assert_eq!(
            s.unique_id.as_deref(),
            Some("a"),
            "a retried unique task keeps its id held; the script ignores it"
        );
        assert_eq!(
            s.payload,
            br#"{"id":"a","type":"t","data":[1],"attempt":2,"unique":true,"last_error":"boom","x":2}"#
        );
        assert!(hook.is_none());
    }

    /// A hand-back is decided like any outcome now (`Action::Back`), and its record is what `handback` built
    /// apart: the payload as taken, a malformed one too (never dead-lettered), the unique id still held, nothing
    /// counted failed or kept.
    #[test]
    fn a_hand_back_goes_back_as_it_was_taken() {
        let back = |quarantine, payload: &[u8], envelope: Option<&Envelope<'_>>| {
            let action = Action::Back { quarantine };
            record_of(&origin(), &action, false, None, 1, payload, envelope)
        };
        let payload = br#"{"id":"a","type":"t","unique":true,"recovered":2}"#;
        let envelope = Envelope::decode(std::str::from_utf8(payload).unwrap()).unwrap();
        let (s, hook) = back(Some(2), payload, Some(&envelope));
        assert_eq!(
            (&s.op, s.payload.as_slice(), s.unique_id.as_deref(), s.level),
            (
                &SettleOp::Back {
                    quarantine: Some(2),
                    group: None
                },
                &payload[..],
                Some("a"),
                1
            )
        );
        assert!(!s.failed && s.kept.is_none() && hook.is_none());
        let (s, _) = back(None, b"not json", None);
        assert_eq!(
            (s.op, s.payload.as_slice()),
            (
                SettleOp::Back {
                    quarantine: None,
                    group: None
                },
                &b"not json"[..]
            )
        );
    }

    #[test]
    fn malformed_payload_is_dead_lettered_verbatim() {
        let action = Action::Retry {
            delay: Duration::ZERO,
            reason: "malformed task: x".into(),
            isolated: false,
        };
        let (s, hook) = record_of(&origin(), &action, false, None, 0, b"not json", None);
        assert_eq!(s.op, SettleOp::Dead);
        let record: serde_json::Value = serde_json::from_slice(&s.payload).unwrap();
        assert_eq!(record["task"], "not json");
        assert!(record.get("task_base64").is_none());
        assert_eq!(record["reason"], "malformed task: x");
        assert_eq!(record["queue"], "mail");
        assert!(
            hook.is_none(),
            "no plugin can be told about a task without a type"
        );
    }

    #[test]
    fn an_uncharged_recovery_keeps_the_attempt_and_counts_the_recovery() {
        let envelope = Envelope::decode(r#"{"id":"a","type":"t","attempt":1}"#).unwrap();
        let action = Action::Recover {
            quarantine: Some(2),
        };
        let (s, hook) = record_of(
            &origin(),
            &action,
            false,
            Some(token()),
            0,
            b"",
            Some(&envelope),
        );
        assert_eq!(
            s.op,
            SettleOp::Recover {
                quarantine: Some(2)
            }
        );
        assert_eq!(
            s.payload,
            br#"{"id":"a","type":"t","data":null,"attempt":1,"recovered":1}"#
        );
        assert!(!s.failed && hook.is_none());
    }

    #[test]
    fn a_payload_that_is_not_utf8_keeps_its_bytes_as_base64() {
        let action = Action::Dead {
            reason: "malformed task: not UTF-8".into(),
        };
        let payload = b"{\"id\":\"x\",\"type\":\"t\",\"data\":\"\xff\xfe\"}";
        let (s, _) = record_of(&origin(), &action, false, None, 0, payload, None);
        let record: serde_json::Value = serde_json::from_slice(&s.payload).unwrap();
        assert!(record.get("task").is_none());
        let kept = base64::engine::general_purpose::STANDARD
            .decode(record["task_base64"].as_str().unwrap())
            .unwrap();
        assert_eq!(kept, payload, "the exact bytes");
    }

    #[test]
    fn a_malformed_object_keeps_its_string_id_in_the_dead_record() {
        let action = Action::Dead {
            reason: "malformed task: missing field `type`".into(),
        };
        let (s, _) = record_of(
            &origin(),
            &action,
            false,
            None,
            0,
            br#"{"id":"lost-1"}"#,
            None,
        );
        let record: serde_json::Value = serde_json::from_slice(&s.payload).unwrap();
        assert_eq!(record["id"], "lost-1");
    }

    #[test]
    fn a_dead_record_over_the_limit_keeps_the_payloads_size_instead_of_the_payload() {
        // Control characters escape to six bytes each: 100 bytes of payload, a record of over 600.
        let payload = "\u{1}".repeat(100);
        let record = |limit: usize| {
            let text = DeadRecord {
                queue: "jobs",
                id: "big-1",
                kind: "t",
                level: Some("normal"),
                attempt: 3,
                reason: "no retries left",
                daemon: "host:1",
                task: Some(&payload),
                task_base64: None,
                size: None,
            }
            .encode(payload.len(), limit);
            assert!(text.len() <= limit, "{} bytes over {limit}", text.len());
            serde_json::from_slice::<serde_json::Value>(&text).unwrap()
        };
        let kept = record(1000);
        assert_eq!(kept["task"], payload.as_str());
        assert_eq!(
            (kept["reason"].as_str(), kept.get("size")),
            (Some("no retries left"), None)
        );
        let cut = record(300);
        assert_eq!((cut.get("task"), cut.get("task_base64")), (None, None));
        assert_eq!(cut["size"], 100);
        assert_eq!(cut["id"], "big-1");
        let reason = cut["reason"].as_str().unwrap();
        assert!(
            reason.starts_with("no retries left (its payload, 100 bytes, is not kept"),
            "{reason}"
        );
    }

    #[test]
    fn dead_letter_of_a_task_calls_the_hook() {
        let envelope = Envelope::decode(r#"{"id":"a","type":"t"}"#).unwrap();
        let action = Action::Dead {
            reason: "bad".into(),
        };
        let (s, hook) = record_of(
            &origin(),
            &action,
            true,
            None,
            0,
            br#"{"id":"a","type":"t"}"#,
            Some(&envelope),
        );
        let record: serde_json::Value = serde_json::from_slice(&s.payload).unwrap();
        assert_eq!(
            (record["id"].as_str(), record["type"].as_str()),
            (Some("a"), Some("t"))
        );
        assert_eq!(hook.unwrap().reason, "bad");
        assert!(s.failed);
    }

    /// `kmqd dead requeue` puts a task back at the level it was taken from, which only the record can say.
    #[test]
    fn a_dead_record_names_the_task_s_level() {
        let levels = ["high".to_string(), "low".to_string()];
        let origin = Origin {
            levels: &levels,
            ..origin()
        };
        let envelope = Envelope::decode(r#"{"id":"a","type":"t"}"#).unwrap();
        let action = Action::Dead {
            reason: "bad".into(),
        };
        let payload = br#"{"id":"a","type":"t"}"#;
        let (s, _) = record_of(&origin, &action, true, None, 1, payload, Some(&envelope));
        let record: serde_json::Value = serde_json::from_slice(&s.payload).unwrap();
        assert_eq!(record["level"], "low");
        let (s, _) = record_of(&origin, &action, true, None, 0, b"not json", None);
        let record: serde_json::Value = serde_json::from_slice(&s.payload).unwrap();
        assert_eq!(record["level"], "high", "a malformed payload's level too");
    }
}
