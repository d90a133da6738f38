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
use crate::daemon::metrics::observed::{TaskOutcome, TypeCache};
use crate::plugin::{MESSAGE_CAPACITY, Reader, Run, Status};
use crate::policy::Verdict;
use crate::settlement::Ran;
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
        let mut types = TypeCache::new(self.lane.name());
        loop {
            let job = match self.jobs.try_recv() {
                Ok(job) => job,
                Err(TryRecvError::Empty) => {
                    // Nothing waiting: let the fetcher claim now rather than wait for a full batch. Idle, the
                    // worker keeps no plugin alive that a reload replaced.
                    self.lane.capacity.nudge();
                    let idle_since = Instant::now();
                    types.ended(idle_since);
                    types.flush();
                    self.plugins.forget();
                    let job = self.jobs.recv();
                    self.lane.idle.add(idle_since.elapsed());
                    match job {
                        Ok(job) => job,
                        Err(_) => break,
                    }
                }
                Err(TryRecvError::Disconnected) => break,
            };
            // One clock read per task: the lease check, the start time, the task's age and the end of the last
            // task's run (for its duration histogram) all use it.
            let now = Instant::now();
            types.ended(now);
            let outcome = if !self.lease_allows(&job, now) || self.claiming.is_triggered() {
                (job.state.take() == Some(Taken::Waiting))
                    .then(|| self.lane.hand_back(job.id, &job.state))
            } else {
                self.run_job(job, now, &mut message, &mut types)
            };
            if let Some(outcome) = outcome {
                // The acker stops only once every held task is settled, this one included, so it is there to
                // receive; a send fails only if the acker thread died, which the supervisor reports.
                if self.outcomes.send(outcome).is_err() {
                    tracing::error!(queue = %self.lane.name(), "acker is gone; outcome dropped");
                }
            }
        }
        types.ended(Instant::now());
        types.flush();
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

    fn run_job(
        &self,
        job: Job,
        now: Instant,
        message: &mut Vec<u8>,
        types: &mut TypeCache,
    ) -> Option<Outcome> {
        let queue = &self.lane.queue;
        let state = &job.state;
        if !state.start(now) {
            return None;
        }
        let mut ran = None;
        let (verdict, envelope) = queue.judge(&state.payload, |envelope| {
            self.verdict(&job, envelope, now, message, &mut ran, types)
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
        let outcome = self
            .lane
            .outcome(job.id, state, verdict, ran, envelope.as_ref());
        if let Some(settlement) = outcome.settlement() {
            let kind = envelope.as_ref().map(|envelope| &*envelope.kind);
            types
                .get(kind, |kind| self.plugins.current().for_type(kind).is_some())
                .count(TaskOutcome::of(settlement));
        }
        Some(outcome)
    }

    /// Checks whether the task may run, runs it, and says how it went; `ran` gets how long its handler ran and
    /// the output of a run that finished it.
    fn verdict(
        &self,
        job: &Job,
        envelope: &Envelope,
        now: Instant,
        message: &mut Vec<u8>,
        ran: &mut Option<Ran>,
        types: &mut TypeCache,
    ) -> Verdict {
        let queue = &self.lane.queue;
        let now_ms =
            job.claimed_at_ms + now.saturating_duration_since(job.claimed_at).as_millis() as i64;
        if let Some(reason) = queue.policy.too_old(envelope.created_at, now_ms) {
            return Verdict::Unrunnable { reason };
        }
        let registry = self.plugins.current();
        let Some(plugin) = registry.for_type(&envelope.kind) else {
            let kind = capped(&envelope.kind, LOGGED_PAYLOAD_BYTES);
            if self.lane.first_unhandled(&envelope.kind) {
                tracing::warn!(
                    queue = %queue.config.name,
                    %kind,
                    retry_times = queue.policy.retry_times,
                    "no plugin handles this task type; its tasks are retried with backoff (a daemon that \
                     handles it may take them) and dead-lettered after retry_times (warned once per type)"
                );
            }
            return Verdict::NoHandler {
                reason: format!("no plugin handles task type {kind:?}"),
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
        tracing::debug!(
            queue = %queue.config.name,
            id = %capped(run.id, LOGGED_PAYLOAD_BYTES),
            kind = %capped(run.kind, LOGGED_PAYLOAD_BYTES),
            attempt = run.attempt,
            "task started"
        );
        types.get(Some(&envelope.kind), |_| true);
        let status = plugin.handle(&run, message);
        // The histogram's run is timed from this task's clock read to the next task's (the lease check, the
        // envelope's decoding and the outcome's sending included, microseconds against buckets that start at
        // 1 ms): no read of its own. The log's duration takes one only when an event will carry it: a run that
        // did not finish the task (its event is a warning), or `task done` at debug.
        types.ran(now);
        let logged =
            !matches!(status, Status::Done { .. }) || tracing::enabled!(tracing::Level::DEBUG);
        let duration = logged.then(|| now.elapsed());
        let (verdict, output) = match status {
            Status::Done { output } => (Verdict::Done, output),
            Status::Retry { after, message } => (
                Verdict::HandlerError {
                    reason: non_empty(message, "handler asked to retry"),
                    after,
                },
                String::new(),
            ),
            Status::Fail { message } => (
                Verdict::Fail {
                    reason: non_empty(message, "handler failed the task"),
                },
                String::new(),
            ),
            Status::Unknown(status) => (
                Verdict::HandlerError {
                    reason: format!(
                        "plugin {} returned status {status}, which is not a kmq_status",
                        plugin.name
                    ),
                    after: None,
                },
                String::new(),
            ),
        };
        *ran = Some(Ran { duration, output });
        verdict
    }
}

fn non_empty(message: String, fallback: &str) -> String {
    if message.is_empty() {
        fallback.to_string()
    } else {
        message
    }
}
