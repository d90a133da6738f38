//! Workers: `workers` threads per queue that run tasks through their plugin and send the outcome to the acker.
//!
//! A worker resolves its task only if nobody took it meanwhile (see `resolve`): a late outcome after an
//! execution timeout or a hand-back is dropped. A worker ends when the fetcher has gone and the jobs channel is
//! empty; after the daemon stops claiming it hands back, unstarted, whatever job it still receives.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use super::Lane;
use super::resolve::{Finished, Job, Outcome, Taken};
use crate::plugin::{MESSAGE_CAPACITY, Reader, Run, Status};
use crate::policy::Verdict;
use crate::shutdown::Listener;
use crate::task::{Envelope, LOGGED_PAYLOAD_BYTES, capped};

/// How often a worker whose task's lease is in doubt looks again (the heartbeat settles the doubt).
const LEASE_POLL: Duration = Duration::from_millis(5);

pub struct Worker {
    pub lane: Arc<Lane>,
    /// Read once per task: a reload's new plugins serve the tasks that start after it.
    pub plugins: Reader,
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
                    // Nothing waiting: let the fetcher claim now rather than wait for a full batch. Idle, the
                    // worker keeps no plugin alive that a reload replaced.
                    self.lane.capacity.nudge();
                    self.plugins.forget();
                    match self.jobs.recv() {
                        Ok(job) => job,
                        Err(_) => break,
                    }
                }
                Err(TryRecvError::Disconnected) => break,
            };
            // One clock read per task: the lease check, the start time and the task's age all use it.
            let now = Instant::now();
            let outcome = if !self.lease_allows(&job, now) || self.claiming.is_triggered() {
                (job.state.take() == Some(Taken::Waiting))
                    .then(|| self.lane.hand_back(job.id, &job.state))
            } else {
                self.run_job(job, now, &mut message)
            };
            if let Some(outcome) = outcome {
                // The acker stops only once every held task is settled, this one included, so it is there to
                // receive; a send fails only if the acker thread died, which the supervisor reports.
                if self.outcomes.send(outcome).is_err() {
                    tracing::error!(queue = %self.lane.name(), "acker is gone; outcome dropped");
                }
            }
        }
    }

    /// Safe mode: waits, if need be, until the task's owner holds a lease that is surely live, so that a daemon
    /// woken from a pause past its lease never starts a task the monitors may have given to another daemon. Returns
    /// false when the daemon stops meanwhile (the task is handed back); a task forgotten meanwhile (its lease was
    /// lost) is then skipped by `start`.
    fn lease_allows(&self, job: &Job, now: Instant) -> bool {
        let Some(token) = &job.state.token else {
            return true;
        };
        let ownership = &self.lane.ownership;
        let mut now = now;
        while !ownership.may_start(&token.owner, now) {
            if !job.state.is_waiting() {
                return true;
            }
            if self.claiming.wait(LEASE_POLL) {
                return false;
            }
            now = Instant::now();
        }
        true
    }

    fn run_job(&self, job: Job, now: Instant, message: &mut Vec<u8>) -> Option<Outcome> {
        let queue = &self.lane.queue;
        let state = &job.state;
        if !state.start(now) {
            return None;
        }
        let (verdict, envelope) = queue.judge(&state.payload, |envelope| {
            self.verdict(&job, envelope, now, message)
        });
        match state.finish() {
            Finished::Resolved => {}
            finished => {
                let id = envelope.as_ref().map_or("", Envelope::id_str);
                if finished == Finished::WasStuck {
                    self.lane.capacity.unstuck();
                    tracing::warn!(queue = %queue.config.name, id, "a stuck handler returned at last; its worker is back");
                }
                tracing::warn!(queue = %queue.config.name, id, "outcome after the execution timeout, a lost lease or the shutdown is ignored");
                return None;
            }
        }
        Some(self.lane.outcome(job.id, state, verdict, envelope.as_ref()))
    }

    /// Checks whether the task may run, runs it, and says how it went.
    fn verdict(
        &self,
        job: &Job,
        envelope: &Envelope,
        now: Instant,
        message: &mut Vec<u8>,
    ) -> Verdict {
        let queue = &self.lane.queue;
        let now_ms =
            job.claimed_at_ms + now.saturating_duration_since(job.claimed_at).as_millis() as i64;
        if let Some(reason) = queue.policy.too_old(envelope.created_at, now_ms) {
            return Verdict::Unrunnable { reason };
        }
        let registry = self.plugins.current();
        let Some(plugin) = registry.for_type(&envelope.kind) else {
            return Verdict::Unrunnable {
                reason: format!(
                    "no plugin handles task type {:?}",
                    capped(&envelope.kind, LOGGED_PAYLOAD_BYTES)
                ),
            };
        };
        let run = Run {
            id: envelope.id_str(),
            queue: &queue.config.name,
            kind: &envelope.kind,
            data: envelope.data.get(),
            attempt: envelope.attempt,
            created_at_ms: envelope.created_at.unwrap_or(0),
            deadline_ms: queue.config.execution_timeout.map_or(0, |timeout| {
                now_ms.saturating_add(i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX))
            }),
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
