//! Workers: `workers` threads per queue that run tasks through their plugin and send the outcome to the acker.
//! A plugin that starts tasks (kmq_plugin.h, `start`) completes them on its own thread instead (`started`); a
//! worker takes one of the lane's `slots` per task either way, so that no more than `workers` run at once.
//!
//! A worker resolves its task only if nobody took it meanwhile (see `resolve`): a late outcome after an
//! execution timeout or a hand-back is dropped. A worker ends when the fetcher has gone and the job queue is
//! empty; after the daemon stops claiming it hands back, unstarted, whatever job it still receives, as it does
//! (default mode) a unique task whose popping owner was lost (`lease_allows`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::jobs;
use super::resolve::{Job, Resolution, verdict_of};
use super::started::Started;
use super::{Lane, LeaseView};
use crate::observed::{TaskOutcome, TypeCache};
use crate::plugin::{MESSAGE_CAPACITY, Reader, Run};
use crate::policy::{Policy, Verdict};
use crate::settlement::Ran;
use crate::shutdown::Listener;
use crate::task::{Envelope, LOGGED_PAYLOAD_BYTES, Slot, capped};

/// How often a worker whose task's lease is in doubt looks again (the heartbeat settles the doubt).
const LEASE_POLL: Duration = Duration::from_millis(5);

/// A worker whose last task took less than this (from its start to the next's) takes jobs ahead (`jobs`): a
/// lock per job costs about 0.1 µs on two busy cores, a share of a short task worth saving and nothing against a
/// long one.
const SHORT_TASK_NS: u64 = 100_000;

pub struct Worker {
    pub lane: Arc<Lane>,
    /// Read once per task: a reload's new plugins serve the tasks that start after it.
    pub plugins: Reader,
    /// Fires when the daemon stops claiming: jobs still in the queue are handed back, not started.
    pub claiming: Listener,
    pub jobs: jobs::Receiver,
}

impl Worker {
    /// Runs jobs until the fetcher is gone and the queue is empty.
    pub fn run(self) {
        let mut message = Vec::with_capacity(MESSAGE_CAPACITY);
        let mut types = TypeCache::new(self.lane.name(), self.lane.epoch);
        let slots = &self.lane.slots;
        slots.thread_started();
        let nice = self.lane.queue.config.worker_nice;
        if nice > 0 {
            lower_priority(self.lane.name(), nice);
        }
        // Whether this worker holds a slot. It keeps the one it ran a task with for its next task: a slot taken
        // and given back per task was two atomic writes on a line every worker writes
        // (docs/PERFORMANCE.md, "Workers that share less"). A task handed to a plugin's `start` takes the slot
        // along.
        let mut holding = false;
        // When the last task started (ns since the lane's epoch), unless the worker went idle since.
        let mut last_start: Option<u64> = None;
        let mut lease = LeaseView::default();
        loop {
            // A slot first, then a job: a worker that waits for room holds no job another could run.
            if !holding {
                slots.take();
                holding = true;
            }
            let job = match self.jobs.try_take() {
                jobs::Next::Job(job) => job,
                jobs::Next::Empty => {
                    // Nothing waiting: let the fetcher claim now rather than wait for a full batch. Idle, the
                    // worker keeps no plugin alive that a reload replaced.
                    self.lane.capacity.nudge();
                    let idle_since = Instant::now();
                    types.ended(self.lane.since_epoch(idle_since));
                    types.flush();
                    self.plugins.forget();
                    self.lane.started.release_plugins();
                    last_start = None;
                    let job = self.jobs.take();
                    self.lane.idle.add(idle_since.elapsed());
                    match job {
                        Some(job) => job,
                        None => break,
                    }
                }
                jobs::Next::Closed => break,
            };
            // One clock read per task: the lease check, the start time, the task's age and the end of the last
            // task's run (for its duration histogram) all use it.
            let now = Instant::now();
            let now_ns = self.lane.since_epoch(now);
            types.ended(now_ns);
            if let Some(last) = last_start.replace(now_ns) {
                self.jobs
                    .take_ahead(now_ns.saturating_sub(last) < SHORT_TASK_NS);
            }
            if !self.lease_allows(&mut lease, &job, now) || self.claiming.is_triggered() {
                self.lane.hand_back_if_waiting(job.id, &job.task);
            } else {
                holding = self.run_job(job, &lease, (now, now_ns), &mut message, &mut types);
            }
        }
        if holding {
            slots.give_back();
        }
        types.ended(self.lane.since_epoch(Instant::now()));
        types.flush();
        // The lane's last worker waits for the tasks its plugins still run (see `slots`).
        slots.thread_ending();
        self.lane.started.release_plugins();
    }

    /// Waits, if need be, until the task's owner holds a lease that is surely live, so that a daemon woken from a
    /// pause past its lease never starts a task the monitors may have given to another daemon (safe mode), nor
    /// (default mode) a task whose popping owner Redis keeps something under (`popped_by`): a unique id the
    /// monitors may have freed for a newer task, or a running slot they may have given back, so that another
    /// daemon already runs `max_running` tasks without it (review, faults-a). Any other default-mode task left
    /// Redis for good and is not waited for. Returns false when the daemon stops meanwhile, or when a
    /// default-mode task's owner is lost (the task is handed back to the front of its level: settle.lua queues it
    /// again only while its id is its own or free, and subtracts no slot the owner's share no longer holds); a
    /// task forgotten meanwhile (its lease was lost) is then skipped by `start`. A safe-mode task whose owner is lost for good (not merely unrenewed) is not
    /// waited for: it is forgotten here, unless its lease's resolver took it first, for no lease will ever cover it
    /// again.
    fn lease_allows(&self, lease: &mut LeaseView, job: &Job, now: Instant) -> bool {
        let state = &job.task;
        let owner = match (&state.token, &state.popped_by) {
            (Some(token), _) => &token.owner,
            (None, Some(popper)) => popper,
            _ => return true,
        };
        let ownership = &self.lane.ownership;
        let mut now = now;
        while !ownership.may_start(lease, owner, now) {
            if !state.is_waiting() {
                return true;
            }
            if lease.is_lost(owner) {
                if state.token.is_none() {
                    tracing::warn!(
                        queue = %self.lane.name(),
                        %owner,
                        unique = state.holds_unique,
                        "a worker took a task whose popping owner's lease was lost; it is handed back unstarted \
                         (a monitor may have freed its unique id or given its running slot back once the lease \
                         ran out)"
                    );
                    return false;
                }
                if self.lane.forget_if_waiting(job.id, state) {
                    tracing::warn!(
                        queue = %self.lane.name(),
                        %owner,
                        "a worker took a task whose owner's lease was lost; it is forgotten, and the monitors \
                         return it to the queue"
                    );
                }
                return true;
            }
            if self.claiming.wait(LEASE_POLL) {
                return false;
            }
            now = Instant::now();
        }
        true
    }

    /// Runs a job with the slot this worker holds, and sends its outcome to the acker, if it is the one that
    /// counts. Returns whether the worker still holds the slot: not when a plugin's `start` took the task (and
    /// with it the slot, which its completion gives back).
    /// `lease`: this worker's view, which checked the task's lease. `now`: this task's clock read, as an `Instant`
    /// and as ns since the lane's epoch.
    fn run_job(
        &self,
        job: Job,
        lease: &LeaseView,
        now: (Instant, u64),
        message: &mut Vec<u8>,
        types: &mut TypeCache,
    ) -> bool {
        let queue = &self.lane.queue;
        let state = &job.task;
        if !state.start(now.1) {
            return true;
        }
        let mut ran = None;
        // The envelope stays where it is decoded (about 200 bytes: each move was a call of memcpy).
        let mut slot = Slot::new();
        let (verdict, envelope) = match queue.runnable_in(state.payload(), &mut slot) {
            Err(verdict) => (verdict, None),
            Ok(()) => {
                let envelope = slot.envelope();
                match self.attempt(&job, envelope, now, message, &mut ran, types) {
                    Attempt::Over(verdict) => (verdict, Some(envelope)),
                    Attempt::Started => return false,
                }
            }
        };
        // The settlement names the owner by this worker's own copy of its id (see `LeaseView::token`).
        let token = state.token.as_ref().map(|token| lease.token(token));
        let outcome = self
            .lane
            .finish(job.id, state, token, envelope, verdict, ran);
        if let Some(settlement) = outcome.as_ref().and_then(Resolution::settlement) {
            let kind = envelope.map(|envelope| &*envelope.kind);
            let is_handled = |kind: &str| self.plugins.current().for_type(kind).is_some();
            types
                .get(kind, is_handled)
                .count(TaskOutcome::of(settlement));
        }
        // The envelope borrows the task's payload: it goes before the task does.
        drop(slot);
        if let Some(mut outcome) = outcome {
            // The worker's reference to the task's claim goes with its outcome, for the acker to drop with the
            // table's: dropped here, it would write the claim's count, a line every worker shares, at every task.
            outcome.hold(job.task);
            // A worker of short tasks appends their outcomes to a list of its own (`outcomes`), for the reason it
            // takes jobs ahead; one of long tasks to the shared list, which the acker looks at without a lock per
            // worker.
            if self.jobs.takes_ahead() {
                self.lane.outcomes.push_own(self.jobs.index(), outcome);
            } else {
                self.lane.outcomes.push(outcome);
            }
        }
        true
    }

    /// Checks whether the task may run, and runs it (`Over`, with how it went; `ran` gets how long its handler
    /// ran and the output of a run that finished it), or hands it to a plugin that starts it (`Started`).
    fn attempt(
        &self,
        job: &Job,
        envelope: &Envelope<'_>,
        now: (Instant, u64),
        message: &mut Vec<u8>,
        ran: &mut Option<Ran>,
        types: &mut TypeCache,
    ) -> Attempt {
        let queue = &self.lane.queue;
        let (now, now_ns) = now;
        let now_ms = job.claimed_at_ms + (now_ns.saturating_sub(job.claimed_ns) / 1_000_000) as i64;
        if let Some(reason) = queue.policy.too_old(envelope.created_at, now_ms) {
            return Attempt::Over(Verdict::Unrunnable { reason });
        }
        // `now_ms` is Redis's clock (the claim's or pop's TIME) moved on by this daemon's monotonic clock, so a
        // daemon whose own clock is wrong neither expires a task early nor runs it late.
        match envelope.expires_at() {
            Err(malformed) => {
                return Attempt::Over(Verdict::Unrunnable {
                    reason: malformed.to_string(),
                });
            }
            Ok(expires_at) => {
                if let Some(reason) = Policy::expired(expires_at, now_ms) {
                    return Attempt::Over(Verdict::Unrunnable { reason });
                }
            }
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
            return Attempt::Over(Verdict::NoHandler {
                reason: format!("no plugin handles task type {kind:?}"),
            });
        };
        let deadline_ms = queue.config.execution_timeout.map_or(0, |timeout| {
            now_ms.saturating_add(i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX))
        });
        let trace = queue.begin_run(envelope);
        if let Some(trace) = &trace {
            // For a party that takes the running task: its span is then still the one the handler was handed.
            job.task.keep_trace(trace);
        }
        // The handler is handed the run span's context, so that its spans nest under the run.
        let traceparent = trace.as_ref().map(|trace| trace.traceparent());
        let run = Run::of(
            envelope,
            &queue.config.name,
            deadline_ms,
            &job.task.cancel,
            traceparent.as_deref(),
            Some((&self.lane.progress_sink, job.id)),
        );
        tracing::debug!(
            queue = %queue.config.name,
            id = %capped(envelope.id_str(), LOGGED_PAYLOAD_BYTES),
            kind = %capped(&envelope.kind, LOGGED_PAYLOAD_BYTES),
            attempt = envelope.attempt,
            "task started"
        );
        if plugin.starts() {
            let started = Started {
                lane: Arc::clone(&self.lane),
                job: job.id,
                // The cancel flag the plugin watches lives here, as long as the completion.
                state: job.task.clone(),
                at: now,
                plugin: Arc::clone(plugin),
                envelope: envelope.clone().into_owned(),
                // A copy: a plugin that declines drops the completion, and the run goes on here with its own.
                trace: trace.clone(),
            };
            self.lane.slots.starting();
            match plugin.start(&run, Box::new(move |status| started.complete(status))) {
                Ok(()) => return Attempt::Started,
                Err(_declined) => self.lane.slots.declined(),
            }
        }
        types.get(Some(&envelope.kind), |_| true);
        let status = plugin.handle(&run, message);
        // The histogram's run is timed from this task's clock read to the next task's (the lease check, the
        // envelope's decoding and the outcome's sending included, microseconds against buckets that start at
        // 1 ms): no read of its own.
        types.ran(now_ns);
        let (verdict, outcome_ran) = verdict_of(status, &plugin.name, now, trace);
        *ran = outcome_ran;
        Attempt::Over(verdict)
    }
}

/// What [`Worker::attempt`] came to.
enum Attempt {
    /// The task ran, or cannot run: its verdict.
    Over(Verdict),
    /// A plugin took it; its completion resolves it (`started`).
    Started,
}

/// Runs this thread `nice` lower than it runs now (niceness added, at most 19), as the queue's `worker_nice` asks
/// (docs/CONFIG.md): raising one's own niceness needs no privilege. A failure is logged and the worker runs on.
fn lower_priority(queue: &str, nice: i32) {
    let thread = rustix::thread::gettid();
    let lowered = rustix::process::getpriority_process(Some(thread)).and_then(|now| {
        rustix::process::setpriority_process(Some(thread), now.saturating_add(nice).min(19))
    });
    if let Err(error) = lowered {
        tracing::warn!(queue, %error, "could not lower a worker thread's priority (worker_nice)");
    }
}
