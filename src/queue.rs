//! What every thread of one queue shares, whatever its role: the queue's config, its Redis keys, its retry
//! policy, and the one way a payload becomes a verdict and a verdict becomes a settlement
//! ([`QueueContext::settle`], where every task's outcome is decided).
//!
//! This module sits below the daemon: the lane's stages (`daemon::lane`), the per-daemon threads (`daemon::*`)
//! and the producer API all import it, and it imports none of them.

use crate::broker::{ClaimLimits, QueueKeys, Settlement};
use std::sync::Arc;

use crate::config::{Config, QueueConfig};
use crate::otel::{Exporter, RunTrace};
use crate::policy::{self, Policy, Verdict};
use crate::settlement::{self, DeadHook, Origin, Ran, TaskParts};
use crate::task::{Envelope, EnvelopeError, Slot, new_id};

/// One configured queue, as every thread serving it sees it.
#[derive(Debug)]
pub struct QueueContext {
    pub config: QueueConfig,
    pub keys: QueueKeys,
    pub(crate) policy: Policy,
    /// `host:pid` of this daemon, written into the dead-letter records it makes.
    pub(crate) daemon_id: String,
    /// `[redis] io_timeout`: what a blocking call waits beyond its own timeout.
    pub(crate) io_timeout: std::time::Duration,
    /// The span exporter, with `[daemon] otlp_endpoint` (the daemon's one, shared by every queue); `None`: no
    /// tracing, and [`QueueContext::settle`] pays one branch for it.
    pub(crate) otel: Option<Arc<Exporter>>,
}

impl QueueContext {
    pub fn new(config: &Config, queue: &QueueConfig, daemon_id: &str) -> QueueContext {
        QueueContext {
            config: queue.clone(),
            keys: QueueKeys::for_queue(&config.redis.key_prefix, queue),
            policy: Policy::for_queue(queue),
            daemon_id: daemon_id.to_string(),
            io_timeout: config.redis.io_timeout,
            otel: None,
        }
    }

    /// The same context, each run of its tasks traced through `otel` (the daemon's exporter, when it has one).
    pub fn traced(mut self, otel: Option<Arc<Exporter>>) -> QueueContext {
        self.otel = otel;
        self
    }

    /// A run of `envelope` starts: its place in its trace, when the queue is traced (the one branch tracing
    /// costs a run where it starts, when it is off).
    pub(crate) fn begin_run(&self, envelope: &Envelope<'_>) -> Option<Box<RunTrace>> {
        self.otel.as_ref().map(|otel| otel.begin(envelope))
    }

    /// How a claim or pop of this queue dead-letters a payload that is too large.
    pub fn claim_limits(&self) -> ClaimLimits<'_> {
        ClaimLimits {
            max_task_bytes: self.config.max_task_bytes,
            dead_max: self.config.dead_max,
            queue: &self.config.name,
            daemon: &self.daemon_id,
            max_running: self.config.max_running,
            rate_limit: &self.config.rate_limit,
            priority_weights: &self.config.priority_weights,
            type_limits: &self.config.type_limits,
            drained_flows: &[],
            groups: self.config.groups.as_ref(),
            foreign_type_field: self.config.foreign_type_field.as_deref(),
        }
    }

    /// Decodes a payload of this queue: an envelope, or a foreign payload when the queue accepts them. A task
    /// without an id gets a fresh one, which retries and dead letters then carry.
    pub(crate) fn decode<'a>(&self, payload: &'a [u8]) -> Result<Envelope<'a>, EnvelopeError> {
        let mut slot = Slot::new();
        self.decode_in(payload, &mut slot)?;
        Ok(slot.into_envelope())
    }

    /// [`QueueContext::decode`] into `slot`, where the envelope stays (the worker's: see [`Envelope::decode_in`]).
    pub(crate) fn decode_in<'a>(
        &self,
        payload: &'a [u8],
        slot: &mut Slot<'a>,
    ) -> Result<(), EnvelopeError> {
        let text = crate::task::utf8(payload)?;
        match &self.config.foreign_type_field {
            Some(field) => slot.set(Envelope::decode_foreign(text, field)?),
            None => Envelope::decode_in(text, slot)?,
        }
        slot.envelope_mut().ensure_id(new_id);
        if self.config.groups.is_some() {
            slot.envelope_mut().group()?;
        }
        Ok(())
    }

    /// The verdict on a held task: `verdict_of` judges one that decodes; one that does not is unrunnable (and
    /// so dead-lettered with the decode error as its reason). Returns the envelope too, for the settlement.
    pub(crate) fn judge<'a>(
        &self,
        payload: &'a [u8],
        verdict_of: impl FnOnce(&Envelope<'a>) -> Verdict,
    ) -> (Verdict, Option<Envelope<'a>>) {
        match self.runnable(payload) {
            Ok(envelope) => (verdict_of(&envelope), Some(envelope)),
            Err(verdict) => (verdict, None),
        }
    }

    /// A held task's envelope, or, when it cannot run (too large, or not an envelope), the verdict on it.
    pub(crate) fn runnable<'a>(&self, payload: &'a [u8]) -> Result<Envelope<'a>, Verdict> {
        let mut slot = Slot::new();
        self.runnable_in(payload, &mut slot)?;
        Ok(slot.into_envelope())
    }

    /// [`QueueContext::runnable`] into `slot`, where the envelope stays (the worker's).
    pub(crate) fn runnable_in<'a>(
        &self,
        payload: &'a [u8],
        slot: &mut Slot<'a>,
    ) -> Result<(), Verdict> {
        // Safe mode's claim keeps such payloads in Redis; default mode's pop has read them, but they never run.
        if payload.len() > self.config.max_task_bytes {
            let reason = format!(
                "task is {} bytes, more than max_task_bytes ({}); it was not run",
                payload.len(),
                self.config.max_task_bytes
            );
            return Err(Verdict::Unrunnable { reason });
        }
        self.decode_in(payload, slot)
            .map_err(|error| Verdict::Unrunnable {
                reason: error.to_string(),
            })
    }

    /// The one place a task's outcome is decided, whoever resolves it (ARCHITECTURE.md, "Who resolves a task"):
    /// a held task's worker or the plugin that completed it, the execution timeout, the shutdown, a reload, the
    /// capacity guard and the fetcher (through the lane's resolutions, `task` from `HeldTask::parts`), and a
    /// monitor for an expired owner's tasks. The policy turns `verdict` into an action ([`policy::decide`]), the
    /// action is logged, and it becomes the record settle.lua applies ([`settlement::record`], with the origin
    /// the records name); a dead letter of a task that decodes brings the plugin's final-failure hook along.
    /// `ran`: what the handler's run left (how long, its output, its result), when one ran.
    #[inline]
    pub fn settle(
        &self,
        task: TaskParts<'_>,
        verdict: Verdict,
        ran: Option<Ran>,
    ) -> (Settlement, Option<Box<DeadHook>>) {
        let envelope = task.envelope;
        let failed = verdict.is_failed_run();
        let quiet_retry = matches!(verdict, Verdict::NoHandler { .. });
        let attempt = envelope.map_or(0, |envelope| envelope.attempt);
        let action = policy::decide(&self.policy, attempt, verdict, || {
            envelope.map_or(0, settlement::seed)
        });
        settlement::log(
            &self.config.name,
            &action,
            failed,
            quiet_retry,
            envelope,
            ran.as_ref(),
        );
        // Tracing off, this is the one branch it costs a task (a run's span is made here, where its outcome is
        // decided: no second path decides one).
        if let (Some(otel), Some(envelope)) = (&self.otel, envelope) {
            let trace = ran.as_ref().and_then(|ran| ran.trace.as_deref());
            let ran_for = ran.as_ref().and_then(|ran| ran.duration);
            otel.run_span(&self.config.name, envelope, &action, trace, ran_for);
        }
        let origin = Origin {
            queue: &self.config.name,
            daemon: &self.daemon_id,
            levels: &self.keys.levels,
            type_limits: &self.config.type_limits,
            grouped: self.config.groups.is_some(),
            keep_results: self.config.keep_results,
        };
        let result = ran.as_ref().and_then(|ran| ran.result.as_deref());
        settlement::record(&origin, &action, failed, task, result)
    }
}
