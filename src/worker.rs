//! Workers: `workers` threads per queue that run tasks through their plugin and send the outcome to the acker.

use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use crate::daemon::{Job, QueueContext};
use crate::plugin::{MESSAGE_CAPACITY, Registry, Run, Status};
use crate::policy::Verdict;
use crate::settlement::{self, Origin, Outcome};
use crate::shutdown::Listener;
use crate::task::Envelope;

pub struct Worker {
    pub queue: Arc<QueueContext>,
    pub registry: Arc<Registry>,
    pub daemon_id: Arc<str>,
    /// Fires when the daemon stops claiming: jobs still in the channel are handed back, not started.
    pub claiming: Listener,
    pub jobs: Receiver<Job>,
    pub outcomes: Sender<Outcome>,
}

impl Worker {
    /// Runs jobs until the fetcher is gone and the channel is empty.
    pub fn run(self) {
        let mut message = Vec::with_capacity(MESSAGE_CAPACITY);
        loop {
            let job = match self.jobs.try_recv() {
                Ok(job) => job,
                Err(TryRecvError::Empty) => {
                    // Nothing waiting: let the fetcher claim now rather than wait for a full batch of slots.
                    self.queue.slots.nudge();
                    match self.jobs.recv() {
                        Ok(job) => job,
                        Err(_) => break,
                    }
                }
                Err(TryRecvError::Disconnected) => break,
            };
            let outcome = if self.claiming.is_triggered() {
                self.hand_back(job)
            } else {
                self.run_job(job, &mut message)
            };
            if let Some(outcome) = outcome {
                // The acker outlives every worker (the supervisor stops it after them), so this fails only if
                // the acker thread died, which the supervisor reports; the task is then recovered by its lease.
                if self.outcomes.send(outcome).is_err() {
                    tracing::error!(queue = %self.queue.config.name, "acker is gone; outcome dropped");
                }
            }
        }
    }

    fn hand_back(&self, job: Job) -> Option<Outcome> {
        if !job.state.resolve() {
            return None;
        }
        let settlement =
            settlement::handback(job.state.token.clone(), job.state.level, &job.state.payload);
        Some(Outcome {
            job: job.id,
            settlement,
            dead_hook: None,
        })
    }

    fn run_job(&self, job: Job, message: &mut Vec<u8>) -> Option<Outcome> {
        let queue = &self.queue;
        let state = &job.state;
        if !state.start() {
            return None;
        }
        let (verdict, envelope) = queue.judge(&state.payload, |envelope| {
            self.verdict(&job, envelope, message)
        });
        if !state.resolve() {
            let id = envelope.as_ref().map_or("", Envelope::id_str);
            tracing::warn!(queue = %queue.config.name, id, "outcome after the execution timeout or shutdown is ignored");
            return None;
        }
        let origin = Origin {
            queue: &queue.config.name,
            daemon: &self.daemon_id,
        };
        let (settlement, dead_hook) = settlement::decide(
            &queue.policy,
            &origin,
            verdict,
            state.token.clone(),
            state.level,
            &state.payload,
            envelope.as_ref(),
        );
        Some(Outcome {
            job: job.id,
            settlement,
            dead_hook,
        })
    }

    /// Checks whether the task may run, runs it, and says how it went.
    fn verdict(&self, job: &Job, envelope: &Envelope, message: &mut Vec<u8>) -> Verdict {
        let queue = &self.queue;
        let now_ms = job.claimed_at_ms + job.claimed_at.elapsed().as_millis() as i64;
        if let Some(reason) = queue.policy.too_old(envelope.created_at, now_ms) {
            return Verdict::Unrunnable { reason };
        }
        let Some(plugin) = self.registry.for_type(&envelope.kind) else {
            return Verdict::Unrunnable {
                reason: format!("no plugin handles task type {:?}", envelope.kind),
            };
        };
        let run = Run {
            id: envelope.id_str(),
            queue: &queue.config.name,
            kind: &envelope.kind,
            data: envelope.data.get(),
            attempt: envelope.attempt,
            created_at_ms: envelope.created_at.unwrap_or(0),
            deadline_ms: queue
                .config
                .execution_timeout
                .map_or(0, |timeout| now_ms + timeout.as_millis() as i64),
            cancel: &job.state.cancel,
        };
        match plugin.handle(&run, message) {
            Status::Done => Verdict::Done,
            Status::Retry { after, message } => Verdict::HandlerError {
                reason: non_empty(message, "handler asked to retry"),
                after,
            },
            Status::Fail { message } => Verdict::Fail {
                reason: non_empty(message, "handler failed the task"),
            },
            Status::Unknown(status) => Verdict::HandlerError {
                reason: format!(
                    "plugin {} returned status {status}, which is not a kmq_status",
                    plugin.name
                ),
                after: None,
            },
        }
    }
}

fn non_empty(message: String, fallback: &str) -> String {
    if message.is_empty() {
        fallback.to_string()
    } else {
        message
    }
}
