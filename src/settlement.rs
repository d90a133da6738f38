//! Turns a decision about a task ([`Action`]) into the record the settle script applies, and carries what the
//! plugin's final-failure hook needs once the record landed.

use std::hash::{DefaultHasher, Hash, Hasher};

use serde::Serialize;

use crate::broker::{SettleOp, Settlement, Token};
use crate::inflight::JobId;
use crate::plugin::{Registry, Run};
use crate::policy::{self, Action, Policy, Verdict};
use crate::task::{Envelope, new_id};

/// An outcome on its way to the acker.
#[derive(Debug)]
pub struct Outcome {
    /// The in-flight entry to forget once settled.
    pub job: JobId,
    pub settlement: Settlement,
    /// Set for dead letters of a decodable task: the plugin's `on_dead` runs after the record landed.
    /// Boxed: an envelope is large, and outcomes travel through channels by value.
    pub dead_hook: Option<Box<DeadHook>>,
}

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
    attempt: u32,
    reason: &'a str,
    daemon: &'a str,
    /// The payload exactly as it was stored, so a malformed task is kept too.
    task: &'a str,
}

/// Where a settlement comes from, for the records it writes.
pub struct Origin<'a> {
    pub queue: &'a str,
    /// `host:pid` of the daemon writing the record.
    pub daemon: &'a str,
}

/// A reproducible jitter seed for a task's backoff.
pub fn seed(envelope: &Envelope) -> u64 {
    let mut hasher = DefaultHasher::new();
    envelope.id_str().hash(&mut hasher);
    envelope.attempt.hash(&mut hasher);
    hasher.finish()
}

/// Builds the settlement for `action`; `failed` says whether the run counts as failed
/// ([`crate::policy::Verdict::is_failed_run`]). `envelope` is `None` when the payload did not decode; such a task can only
/// be dead-lettered or acknowledged, never retried (there is no attempt count to raise), so a retry becomes a
/// dead letter.
pub fn settlement(
    origin: &Origin<'_>,
    action: &Action,
    failed: bool,
    token: Option<Token>,
    level: usize,
    payload: &str,
    envelope: Option<&Envelope>,
) -> (Settlement, Option<Box<DeadHook>>) {
    let unique_id = envelope
        .filter(|e| e.unique)
        .and_then(|e| e.id.as_deref().map(str::to_string));
    // Called once, whichever the branch.
    let base = move |op, payload: String| Settlement {
        op,
        token,
        unique_id,
        level,
        payload,
        failed,
    };
    match (action, envelope) {
        (Action::Ack, _) => (base(SettleOp::Ack, String::new()), None),
        (Action::Retry { delay, reason }, Some(envelope)) => {
            let mut next = envelope.clone();
            next.ensure_id(new_id);
            next.attempt += 1;
            next.last_error = Some(reason.clone().into());
            (base(SettleOp::Retry { delay: *delay }, next.encode()), None)
        }
        (Action::Dead { reason }, _) | (Action::Retry { reason, .. }, None) => {
            let record = DeadRecord {
                queue: origin.queue,
                id: envelope.map_or("", Envelope::id_str),
                kind: envelope.map_or("", |e| &*e.kind),
                attempt: envelope.map_or(0, |e| e.attempt),
                reason,
                daemon: origin.daemon,
                task: payload,
            };
            // Strings and integers always serialize.
            let record = serde_json::to_string(&record).expect("dead record serializes");
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

/// Decides a task's fate from `verdict`, logs it, and builds the settlement: the one path every outcome takes,
/// whether it comes from a worker, an execution timeout or a monitor.
pub fn decide(
    policy: &Policy,
    origin: &Origin<'_>,
    verdict: Verdict,
    token: Option<Token>,
    level: usize,
    payload: &str,
    envelope: Option<&Envelope>,
) -> (Settlement, Option<Box<DeadHook>>) {
    let attempt = envelope.map_or(0, |e| e.attempt);
    let failed = verdict.is_failed_run();
    let action = policy::decide(policy, attempt, verdict, envelope.map_or(0, seed));
    let (queue, id) = (origin.queue, envelope.map_or("", Envelope::id_str));
    match &action {
        Action::Ack if !failed => tracing::debug!(queue, id, attempt, "task done"),
        Action::Ack => tracing::warn!(
            queue,
            id,
            attempt,
            "task failed; counted as done (on_handler_error = \"finish\")"
        ),
        Action::Retry { delay, reason } => {
            tracing::warn!(queue, id, attempt, %reason, retry_in = ?delay, "task failed; will retry")
        }
        Action::Dead { reason } => {
            tracing::warn!(queue, id, attempt, %reason, "task dead-lettered")
        }
    }
    settlement(origin, &action, failed, token, level, payload, envelope)
}

/// A hand-back at shutdown: the task goes to the front of its level unchanged.
pub fn handback(token: Option<Token>, level: usize, payload: &str) -> Settlement {
    Settlement {
        op: SettleOp::Back,
        token,
        unique_id: None,
        level,
        payload: payload.to_string(),
        failed: false,
    }
}

/// Calls the `on_dead` hook of the plugin that handles the task's type, if any.
pub fn run_dead_hook(registry: &Registry, queue: &str, hook: &DeadHook) {
    let Some(plugin) = registry.for_type(&hook.envelope.kind) else {
        return;
    };
    let cancel = std::sync::atomic::AtomicU32::new(0);
    let envelope = &hook.envelope;
    let run = Run {
        id: envelope.id_str(),
        queue,
        kind: &envelope.kind,
        data: envelope.data.get(),
        attempt: envelope.attempt,
        created_at_ms: envelope.created_at.unwrap_or(0),
        deadline_ms: 0,
        cancel: &cancel,
    };
    plugin.on_dead(&run, &hook.reason);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn token() -> Token {
        Token {
            owner: std::sync::Arc::from("o1"),
            id: crate::broker::TokenId::Seq(7),
        }
    }

    fn origin() -> Origin<'static> {
        Origin {
            queue: "mail",
            daemon: "host:1",
        }
    }

    #[test]
    fn retry_raises_attempt_and_records_the_error() {
        let envelope =
            Envelope::decode(r#"{"id":"a","type":"t","data":[1],"attempt":1,"unique":true,"x":2}"#)
                .unwrap();
        let action = Action::Retry {
            delay: Duration::from_secs(2),
            reason: "boom".into(),
        };
        let (s, hook) = settlement(
            &origin(),
            &action,
            true,
            Some(token()),
            0,
            "",
            Some(&envelope),
        );
        assert_eq!(
            s.op,
            SettleOp::Retry {
                delay: Duration::from_secs(2)
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
            r#"{"id":"a","type":"t","data":[1],"attempt":2,"unique":true,"last_error":"boom","x":2}"#
        );
        assert!(hook.is_none());
    }

    #[test]
    fn malformed_payload_is_dead_lettered_verbatim() {
        let action = Action::Retry {
            delay: Duration::ZERO,
            reason: "malformed task: x".into(),
        };
        let (s, hook) = settlement(&origin(), &action, false, None, 0, "not json", None);
        assert_eq!(s.op, SettleOp::Dead);
        let record: serde_json::Value = serde_json::from_str(&s.payload).unwrap();
        assert_eq!(record["task"], "not json");
        assert_eq!(record["reason"], "malformed task: x");
        assert_eq!(record["queue"], "mail");
        assert!(
            hook.is_none(),
            "no plugin can be told about a task without a type"
        );
    }

    #[test]
    fn dead_letter_of_a_task_calls_the_hook() {
        let envelope = Envelope::decode(r#"{"id":"a","type":"t"}"#).unwrap();
        let action = Action::Dead {
            reason: "bad".into(),
        };
        let (s, hook) = settlement(
            &origin(),
            &action,
            true,
            None,
            0,
            r#"{"id":"a","type":"t"}"#,
            Some(&envelope),
        );
        let record: serde_json::Value = serde_json::from_str(&s.payload).unwrap();
        assert_eq!(
            (record["id"].as_str(), record["type"].as_str()),
            (Some("a"), Some("t"))
        );
        assert_eq!(hook.unwrap().reason, "bad");
        assert!(s.failed);
    }
}
