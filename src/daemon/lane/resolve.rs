//! Who decides a held task's outcome: the one place that says it, for every party that could.
//!
//! A task the fetcher took from Redis is *held* until the acker has settled its outcome there. While it is held,
//! exactly one party *resolves* it, that is, decides the outcome the acker will apply:
//!
//! - the **worker** that ran it, when the handler returned in time ([`Lane::finish`]; for a task a plugin took in
//!   `start`, the plugin's completion plays the worker's part, on the plugin's thread: `started`);
//! - the **execution timeout** (the `kmqd-timeouts` thread), when the handler ran too long;
//! - the **shutdown**, which hands back what did not finish within `shutdown_grace`;
//! - the **capacity guard**, which hands back tasks waiting behind workers that are all stuck;
//! - a **reload** that retires the lane, which hands back the tasks waiting for a worker;
//! - the **fetcher**, which hands back a claim that lands once claiming stopped, or that no worker is left to
//!   take;
//! - the **heartbeat** or the **fetcher**, when the owner's lease was lost: the monitors recover the task, this
//!   daemon forgets it. A claim that lands after its owner was lost is never held: the fetcher forgets it whole
//!   ([`Lane::hold`], [`Lane::forget_unheld`]); and a worker that finds its task's owner lost forgets the task
//!   rather than wait for a lease that will not come back ([`Lane::forget_if_waiting`]).
//!
//! Every resolution sends exactly one [`Resolution`] to the lane's acker, which is the only party that forgets a
//! held task and frees its capacity. What the outcome is comes from one place: every resolver hands the task's
//! verdict (what its run came to, or [`Verdict::HandedBack`]) to [`crate::queue::QueueContext::settle`], which asks
//! the policy for the action and builds the record; only a lost lease has no verdict (the task is forgotten, and a
//! monitor's verdict on it counts). The phases, one atomic per task ([`HeldState`]):
//!
//! ```text
//!             start (worker)                 finish (worker): its outcome counts
//!   WAITING ───────────────────▶ RUNNING ─────────────────────────────────────────▶ RESOLVED
//!      │                            │                                                  ▲  ▲
//!      │ take (anyone else):        │ take (anyone else): cancel raised,               │  │
//!      │ nobody runs it             ▼ the taker's outcome counts                       │  │
//!      └─────────────────────▶ RESOLVED   ORPHANED ── finish (worker): outcome dropped ─┘  │
//!                                            │                                             │
//!                                            │ still running STUCK_AFTER later (timeouts)  │
//!                                            ▼                                             │
//!                                          STUCK ──── finish (worker): outcome dropped, ───┘
//!                                                     its capacity given back
//! ```
//!
//! Every arrow is one compare-and-swap on the phase, so two parties can never both win a task: `take` reports
//! whether it found the task waiting or running (a waiting task nobody will run; a running one whose handler is
//! still inside the plugin). A worker that stays inside a handler after its task was taken counts as *stuck*
//! once STUCK_AFTER has passed: its thread is busy although it holds no task, and the lane's capacity shrinks by
//! one until the handler returns.
//!
//! The loom tests at the end check these claims under every interleaving loom explores
//! (`RUSTFLAGS="--cfg kmqd_loom" cargo test --release --lib loom`, which `scripts/test` runs).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

// Only the phase is what the loom tests model; the cancel flag (read by plugins through the C ABI) and the start
// time stay std atomics in every build.
#[cfg(kmqd_loom)]
use loom::sync::atomic::AtomicU8;
#[cfg(not(kmqd_loom))]
use std::sync::atomic::AtomicU8;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::Lane;
use crate::broker::payloads::Payloads;
use crate::broker::{Settlement, Token};
use crate::config::Mode;
use crate::observed::{self, TaskOutcome};
use crate::otel::RunTrace;
use crate::plugin::Status;
use crate::policy::Verdict;
use crate::settlement::{DeadHook, Ran, TaskParts};
use crate::task::Envelope;

/// A local handle for a task held by this daemon (unique within the process).
pub type JobId = u64;

const WAITING: u8 = 0;
const RUNNING: u8 = 1;
const RESOLVED: u8 = 2;
const ORPHANED: u8 = 3;
const STUCK: u8 = 4;

/// One task held by the daemon, shared by the lane's table of held tasks and the worker that runs it.
#[derive(Debug)]
pub struct HeldState {
    /// Safe mode: the claim that fences the task's settlement.
    pub token: Option<Token>,
    /// Default mode: the owner that popped it, when Redis keeps its running slot or unique id under that owner
    /// (`broker::Fetched::popped_by`).
    pub popped_by: Option<Arc<str>>,
    /// Default mode: the type's running count its pop counted it in under `popped_by`'s share
    /// (`broker::Fetched::popped_scope`), which its settlement gives back.
    pub popped_scope: Option<Arc<str>>,
    /// Default mode: its unique id is recorded as held by `popped_by` (`broker::Fetched::holds_unique`), so it
    /// starts only while that owner's lease is surely live (the worker's lease check).
    pub holds_unique: bool,
    /// The priority level it came from.
    pub level: usize,
    /// Raised (non-zero) to ask the handler to stop; the ABI points plugins at it.
    pub cancel: AtomicU32,
    phase: AtomicU8,
    /// When a worker started it, ns since `epoch`.
    started_ns: AtomicU64,
    /// The lane's reference point for times kept in atomics.
    epoch: Instant,
    /// A copy of the run's place in its trace (its queue traced), kept by the worker that started it, so that a
    /// party that takes the running task (the execution timeout, a safe-mode hand-back) exports the span whose
    /// context the handler was handed, not one with a new id that the handler's own spans do not nest under.
    /// Set once, after [`HeldState::start`], before the handler runs.
    trace: OnceLock<Box<RunTrace>>,
}

/// What `take` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TakenWhile {
    /// No worker had started it: nobody will.
    Waiting,
    /// A worker is running it; its cancel flag is now raised, and whatever the handler returns is dropped.
    Running,
}

/// What `finish` found, for the worker whose handler returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finished {
    /// The worker resolves the task: its outcome is the one applied.
    Resolved,
    /// Someone took the task while it ran: the outcome is dropped.
    Orphaned,
    /// As `Orphaned`, and the worker had been counted stuck: its capacity is to be given back.
    WasStuck,
}

impl HeldState {
    /// The same task, popped by `owner` (default mode: see [`HeldState::popped_by`]), holding its unique id
    /// through it or not, counted in `scope` (a type's running count) or not.
    pub fn popped(
        self,
        owner: Option<Arc<str>>,
        scope: Option<Arc<str>>,
        holds_unique: bool,
    ) -> HeldState {
        HeldState {
            popped_by: owner,
            popped_scope: scope,
            holds_unique,
            ..self
        }
    }

    pub fn new(token: Option<Token>, level: usize, epoch: Instant) -> HeldState {
        HeldState {
            token,
            popped_by: None,
            popped_scope: None,
            holds_unique: false,
            level,
            cancel: AtomicU32::new(0),
            phase: AtomicU8::new(WAITING),
            started_ns: AtomicU64::new(0),
            epoch,
            trace: OnceLock::new(),
        }
    }

    /// Keeps a copy of the run's `trace` for whoever takes the running task ([`HeldState::trace`]).
    pub fn keep_trace(&self, trace: &RunTrace) {
        // A task starts once, so this is its first and only trace; a second set would be ignored, not wrong.
        let _ = self.trace.set(Box::new(trace.clone()));
    }

    /// The run's place in its trace, when a worker started the run with tracing on: for a taker's [`Ran`].
    fn trace(&self) -> Option<Box<RunTrace>> {
        self.trace.get().cloned()
    }

    /// A worker is about to run the task, `now_ns` after the lane's epoch; false when someone took it first (it
    /// must not run).
    pub fn start(&self, now_ns: u64) -> bool {
        self.started_ns.store(now_ns, Ordering::Relaxed);
        self.phase
            .compare_exchange(WAITING, RUNNING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The worker's handler returned: resolves the task unless someone took it meanwhile.
    pub fn finish(&self) -> Finished {
        match self.phase.swap(RESOLVED, Ordering::AcqRel) {
            RUNNING => Finished::Resolved,
            STUCK => Finished::WasStuck,
            // ORPHANED; RESOLVED and WAITING cannot be seen by the worker that started the task.
            _ => Finished::Orphaned,
        }
    }

    /// Someone other than the worker resolves the task; `None` when it was resolved already (by its worker or
    /// another taker). A running task gets its cancel flag raised.
    pub fn take(&self) -> Option<TakenWhile> {
        let mut phase = self.phase.load(Ordering::Acquire);
        loop {
            let (next, taken) = match phase {
                WAITING => (RESOLVED, TakenWhile::Waiting),
                RUNNING => (ORPHANED, TakenWhile::Running),
                _ => return None,
            };
            match self
                .phase
                .compare_exchange(phase, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    if taken == TakenWhile::Running {
                        self.cancel.store(1, Ordering::SeqCst);
                    }
                    return Some(taken);
                }
                Err(current) => phase = current,
            }
        }
    }

    /// A taken task whose handler has not returned yet is declared stuck; true if this call did it (so the
    /// caller counts the worker out of the lane's capacity exactly once).
    pub fn mark_stuck(&self) -> bool {
        self.phase
            .compare_exchange(ORPHANED, STUCK, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Whether the task was taken while running and its handler has not returned yet.
    pub fn is_orphaned(&self) -> bool {
        matches!(self.phase.load(Ordering::Acquire), ORPHANED | STUCK)
    }

    /// Whether no worker has started it and nobody took it.
    pub fn is_waiting(&self) -> bool {
        self.phase.load(Ordering::Acquire) == WAITING
    }

    /// How long it has been running, if it is.
    pub fn running_for(&self) -> Option<Duration> {
        (self.phase.load(Ordering::Acquire) == RUNNING).then(|| {
            let started = Duration::from_nanos(self.started_ns.load(Ordering::Relaxed));
            self.epoch.elapsed().saturating_sub(started)
        })
    }
}

/// A held task: its [`HeldState`] and its payload. The states and payloads of one claim's tasks are one allocation
/// each, shared by the lane's table of held tasks, the worker that runs a task and whoever resolves it, and freed
/// when the last of them lets go: a few allocations per claim instead of two per task (docs/PERFORMANCE.md, "One
/// allocation per claim, one lock per settle"). A task that outlives its claim's others (a slow handler) keeps
/// their states and payloads in memory until it is settled, as it keeps their claim list in Redis: at most `batch`
/// of them.
#[derive(Clone, Debug)]
pub struct HeldTask {
    claim: Arc<Claim>,
    index: usize,
}

#[derive(Debug)]
struct Claim {
    states: Box<[HeldState]>,
    payloads: Payloads,
}

impl HeldTask {
    /// The tasks of one claim, in its order: `states[i]`'s payload is `payloads`' `i`th.
    pub fn claim(
        states: impl IntoIterator<Item = HeldState>,
        payloads: Payloads,
    ) -> impl Iterator<Item = HeldTask> {
        let claim = Arc::new(Claim {
            states: states.into_iter().collect(),
            payloads,
        });
        assert_eq!(
            claim.states.len(),
            claim.payloads.len(),
            "a payload per task"
        );
        (0..claim.states.len()).map(move |index| HeldTask {
            claim: Arc::clone(&claim),
            index,
        })
    }

    /// The payload exactly as taken from Redis (not necessarily UTF-8: a bad one is dead-lettered as it is).
    pub fn payload(&self) -> &[u8] {
        self.claim.payloads.get(self.index)
    }

    /// What a settlement of this task is made of: `token` names its claim as the resolver does (a worker by its
    /// lease view's copy of the owner's id), `envelope` is its payload decoded, if it decodes.
    pub fn parts<'a>(
        &'a self,
        token: Option<Token>,
        envelope: Option<&'a Envelope<'a>>,
    ) -> TaskParts<'a> {
        TaskParts {
            token,
            popped_by: self.popped_by.clone(),
            popped_scope: self.popped_scope.clone(),
            level: self.level,
            payload: self.payload(),
            envelope,
        }
    }

    /// A task claimed alone.
    #[cfg(test)]
    pub fn alone(state: HeldState, payload: &[u8]) -> HeldTask {
        let mut payloads = Payloads::default();
        payloads.push(payload);
        HeldTask::claim([state], payloads).next().expect("one task")
    }
}

impl std::ops::Deref for HeldTask {
    type Target = HeldState;

    fn deref(&self) -> &HeldState {
        &self.claim.states[self.index]
    }
}

/// A task handed from the fetcher to a worker.
#[derive(Debug)]
pub struct Job {
    pub id: JobId,
    /// Shared with the table of held tasks.
    pub task: HeldTask,
    /// Redis's clock when the task was taken, ms.
    pub claimed_at_ms: i64,
    /// The local clock at the same moment (ns since the lane's epoch), to advance `claimed_at_ms` without asking
    /// Redis.
    pub claimed_ns: u64,
}

/// What the one party that resolved a held task sends the acker (through the lane's `outcomes` queue): what to apply
/// in Redis, and which held task to forget once it is applied.
#[derive(Debug)]
pub struct Resolution {
    /// The held task to forget once this is applied.
    pub job: JobId,
    pub apply: Apply,
    /// The worker's reference to the task, dropped by the acker with the table's (see [`Resolution::hold`]).
    _task: Option<HeldTask>,
}

/// What the acker does for a [`Resolution`].
#[derive(Debug)]
pub enum Apply {
    /// Apply this to Redis; then, for a dead letter of a decodable task, call the plugin's `on_dead`.
    /// Boxed: an envelope is large, and outcomes travel through channels by value.
    Settle {
        settlement: Settlement,
        dead_hook: Option<Box<DeadHook>>,
    },
    /// Nothing to apply: the task is no longer this daemon's (its lease was lost, or a default-mode task whose
    /// handler outlived the shutdown). Only forget it.
    Forget,
}

impl Resolution {
    /// The outcome `QueueContext::settle` decided for held task `job`.
    pub fn settle(
        job: JobId,
        (settlement, dead_hook): (Settlement, Option<Box<DeadHook>>),
    ) -> Resolution {
        Resolution {
            job,
            apply: Apply::Settle {
                settlement,
                dead_hook,
            },
            _task: None,
        }
    }

    /// Gives this resolution its worker's reference to the task, for the acker: the acker drops it with the
    /// table's, a batch at a time, where a worker dropping its own would write the count of the task's claim at
    /// every task, a line the lane's workers share (docs/PERFORMANCE.md, "Workers that share less"). In place: a
    /// resolution rebuilt around it was one more copy of the whole struct a task (docs/PERFORMANCE.md, "The hot
    /// path after tracing, expiry and progress (2026-12-07)").
    pub fn hold(&mut self, task: HeldTask) {
        self._task = Some(task);
    }

    pub fn forget(job: JobId) -> Resolution {
        Resolution {
            job,
            apply: Apply::Forget,
            _task: None,
        }
    }

    /// The settlement, unless the task is only forgotten.
    pub fn settlement(&self) -> Option<&Settlement> {
        match &self.apply {
            Apply::Settle { settlement, .. } => Some(settlement),
            Apply::Forget => None,
        }
    }
}

/// A handler's status as a verdict, with what its run left for the log: its duration (read only when an event
/// will carry it: a run that did not finish the task, whose event is a warning, or `task done` at debug), its
/// output, and `trace`, the run's place in its trace (`QueueContext::begin_run`).
pub fn verdict_of(
    status: Status,
    plugin: &str,
    started: Instant,
    trace: Option<Box<RunTrace>>,
) -> (Verdict, Option<Ran>) {
    let logged = !matches!(status, Status::Done { .. }) || tracing::enabled!(tracing::Level::DEBUG);
    let duration = logged.then(|| started.elapsed());
    let (verdict, output) = match status {
        Status::Done { output, result } => {
            return (
                Verdict::Done,
                Some(Ran {
                    duration,
                    output,
                    result,
                    trace,
                }),
            );
        }
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
        Status::Throttle { after, message } => (
            Verdict::Throttled {
                reason: non_empty(message, "handler asked to throttle"),
                after,
            },
            String::new(),
        ),
        Status::Unknown(status) => (
            Verdict::HandlerError {
                reason: format!(
                    "plugin {plugin} returned status {status}, which is not a kmq_status"
                ),
                after: None,
            },
            String::new(),
        ),
    };
    (
        verdict,
        Some(Ran {
            duration,
            output,
            result: None,
            trace,
        }),
    )
}

fn non_empty(message: String, fallback: &str) -> String {
    if message.is_empty() {
        fallback.to_string()
    } else {
        message
    }
}

/// The worker's resolution: its task's run is over.
impl Lane {
    /// The run of `task` is over with `verdict`: its outcome for the acker, unless someone took the task while it
    /// ran (`None`: the outcome is dropped, and a worker counted stuck is given back). `token`: the task's, as
    /// the resolver names it (see [`HeldTask::parts`]); `envelope`: its payload decoded, when it decodes; `ran`: what
    /// the handler's run left, when one ran. Inlined into the worker's loop: a call of its own, with the task's
    /// parts passed on by value, cost about 40 instructions a task (scripts/drain-instructions).
    #[inline]
    pub fn finish(
        &self,
        job: JobId,
        task: &HeldTask,
        token: Option<Token>,
        envelope: Option<&Envelope<'_>>,
        verdict: Verdict,
        ran: Option<Ran>,
    ) -> Option<Resolution> {
        match task.finish() {
            Finished::Resolved => {
                let decided = self.queue.settle(task.parts(token, envelope), verdict, ran);
                Some(Resolution::settle(job, decided))
            }
            finished => {
                let id = envelope.map_or("", Envelope::id_str);
                let queue = self.name();
                if finished == Finished::WasStuck {
                    self.capacity.unstuck();
                    tracing::warn!(
                        queue,
                        id,
                        "a stuck handler returned at last; its worker is back"
                    );
                }
                tracing::warn!(
                    queue,
                    id,
                    "outcome after the execution timeout, a lost lease or the shutdown is ignored"
                );
                None
            }
        }
    }
}

/// The resolutions made outside the workers: each takes tasks with [`HeldState::take`] and sends exactly one
/// outcome for each task it won.
impl Lane {
    /// Execution timeouts: every run of the queue past `timeout` is taken (its cancel flag raised) and counted as
    /// a failed attempt; whatever the handler returns later is dropped.
    pub fn time_out_overdue(&self, timeout: Duration) {
        let overdue = self
            .held
            .select(|state| state.running_for().is_some_and(|running| running > timeout));
        for (job, state) in overdue {
            if state.take() != Some(TakenWhile::Running) {
                continue;
            }
            self.orphaned(state.clone());
            let envelope = self.queue.decode(state.payload()).ok();
            self.count(envelope.as_ref(), TaskOutcome::TimedOut);
            let verdict = Verdict::HandlerError {
                reason: format!(
                    "execution timeout: still running after {}",
                    humantime::format_duration(timeout)
                ),
                after: None,
            };
            // The run's span, as its worker began it: the handler's spans nest under it (without one, when the
            // worker had not kept it yet, a span of its own that starts `timeout` ago).
            let ran = Ran {
                duration: Some(timeout),
                output: String::new(),
                result: None,
                trace: state.trace(),
            };
            let task = state.parts(state.token.clone(), envelope.as_ref());
            let decided = self.queue.settle(task, verdict, Some(ran));
            self.outcomes.push(Resolution::settle(job, decided));
        }
    }

    /// Takes a task nobody started and hands it back (see [`Lane::hand_back`]); false when it was running or
    /// resolved already, and so is not this caller's.
    pub fn hand_back_if_waiting(&self, job: JobId, task: &HeldTask) -> bool {
        let waiting = task.take() == Some(TakenWhile::Waiting);
        if waiting {
            self.outcomes.push(self.hand_back(job, task));
        }
        waiting
    }

    /// The outcome of a task taken back before it ran (or, in safe mode, while it ran): it goes back where it
    /// waited, unchanged ([`Verdict::HandedBack`]).
    fn hand_back(&self, job: JobId, task: &HeldTask) -> Resolution {
        let envelope = self.queue.decode(task.payload()).ok();
        self.count(envelope.as_ref(), TaskOutcome::HandedBack);
        let verdict = Verdict::HandedBack {
            recoveries: envelope.as_ref().map_or(0, |envelope| envelope.recovered),
            crashes: envelope.as_ref().map_or(0, |envelope| envelope.crashes),
        };
        // A run taken back (safe mode's shutdown) ends the span its handler was handed.
        let ran = task.trace().map(|trace| Ran {
            trace: Some(trace),
            ..Ran::default()
        });
        let parts = task.parts(task.token.clone(), envelope.as_ref());
        Resolution::settle(job, self.queue.settle(parts, verdict, ran))
    }

    /// Shutdown, once `shutdown_grace` is over: takes every task not resolved yet. Waiting ones are handed back;
    /// running ones are handed back too in safe mode (they may run twice: at least once), and in default mode are
    /// reported lost (handing them back could run them twice while they still run).
    pub fn hand_back_unresolved(&self) {
        for (job, state) in latest_first(self.held.select(|_| true)) {
            match state.take() {
                None => {}
                Some(TakenWhile::Waiting) => self.outcomes.push(self.hand_back(job, &state)),
                Some(TakenWhile::Running) => {
                    self.orphaned(state.clone());
                    if self.queue.config.mode == Mode::Safe {
                        self.outcomes.push(self.hand_back(job, &state));
                    } else {
                        tracing::warn!(
                            queue = %self.name(),
                            payload = %capped_payload(state.payload()),
                            "handler still running after shutdown_grace; default mode cannot hand it back, the task is lost"
                        );
                        self.forget(job, &state);
                    }
                }
            }
        }
    }

    /// Hands back the tasks waiting for a worker, so that another lane or daemon runs them: every worker is
    /// stuck, or a reload retires the lane. Returns how many.
    pub fn hand_back_waiting(&self) -> usize {
        latest_first(self.held.select(HeldState::is_waiting))
            .into_iter()
            .filter(|(job, state)| self.hand_back_if_waiting(*job, state))
            .count()
    }

    /// `owner`'s lease was lost: the monitors return its tasks to the queue, so this daemon forgets them. Running
    /// ones get their cancel flag raised (another daemon will run them). Returns how many it forgot.
    pub fn forget_owner(&self, owner: &str) -> usize {
        let mut forgotten = 0;
        let owned = self.held.select(|state| {
            state
                .token
                .as_ref()
                .is_some_and(|token| &*token.owner == owner)
        });
        for (job, state) in owned {
            match state.take() {
                None => continue,
                Some(TakenWhile::Waiting) => {}
                Some(TakenWhile::Running) => self.orphaned(state.clone()),
            }
            self.forget(job, &state);
            forgotten += 1;
        }
        forgotten
    }
}

/// The resolutions of the tasks of a lost owner that no other party resolved: a claim that landed after its owner
/// was forgotten, and (in case one ever reaches a worker) a task whose worker finds its owner lost.
impl Lane {
    /// The tasks of a claim that landed after its owner's lease was lost, which [`Lane::hold`] did not hold: no
    /// worker saw them and no other party can take them, and the monitors return them to the queue, so each is
    /// forgotten (counted lost), its outcome freeing its capacity at the acker as every resolution's does.
    /// Returns how many.
    pub fn forget_unheld(&self, tasks: super::Tasks) -> usize {
        let forgotten = tasks.len();
        for (job, task) in tasks {
            self.forget(job, &task);
        }
        forgotten
    }

    /// Takes a held task nobody started, whose owner was lost, and forgets it as [`Lane::forget_owner`] would; false
    /// when it was running or resolved already (by `forget_owner` itself, for one).
    pub fn forget_if_waiting(&self, job: JobId, task: &HeldTask) -> bool {
        let waiting = task.take() == Some(TakenWhile::Waiting);
        if waiting {
            self.forget(job, task);
        }
        waiting
    }
}

/// The outcome counters of resolutions made outside the workers (cold paths: a family lookup each).
impl Lane {
    /// A task this daemon no longer answers for (its lease was lost, or a default-mode task outlived the
    /// shutdown): counted lost, and only forgotten at the acker, which frees its capacity.
    fn forget(&self, job: JobId, task: &HeldTask) {
        self.count_payload(task.payload(), TaskOutcome::Lost);
        self.outcomes.push(Resolution::forget(job));
    }

    fn count(&self, envelope: Option<&Envelope<'_>>, outcome: TaskOutcome) {
        observed::count_outcome(
            self.name(),
            envelope.map(|envelope| &*envelope.kind),
            outcome,
        );
    }

    fn count_payload(&self, payload: &[u8], outcome: TaskOutcome) {
        self.count(self.queue.decode(payload).ok().as_ref(), outcome);
    }
}

/// Tasks to hand back, the latest taken first: each goes to the front of its list (its group's flow, its ready or
/// quarantine list), so that the earliest ends at the head and they keep the order they were taken in, however the
/// acker splits them into settle calls (it sends them in order). Job ids grow in the order tasks are taken.
fn latest_first(mut tasks: Vec<(JobId, HeldTask)>) -> Vec<(JobId, HeldTask)> {
    tasks.sort_unstable_by_key(|(job, _)| std::cmp::Reverse(*job));
    tasks
}

/// A payload for a log line: at most a few hundred bytes of it, so one huge task cannot flood the log.
pub fn capped_payload(payload: &[u8]) -> String {
    crate::task::capped(
        &String::from_utf8_lossy(payload),
        crate::task::LOGGED_PAYLOAD_BYTES,
    )
    .into_owned()
}

#[cfg(all(test, not(kmqd_loom)))]
mod tests {
    use super::*;

    fn job() -> HeldState {
        HeldState::new(None, 0, Instant::now())
    }

    #[test]
    fn a_waiting_task_taken_is_never_started() {
        let state = job();
        assert_eq!(state.take(), Some(TakenWhile::Waiting));
        assert!(!state.start(0), "the worker skips it");
        assert_eq!(state.take(), None, "and nobody takes it twice");
        assert_eq!(state.cancel.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_running_task_taken_drops_the_workers_outcome_and_raises_cancel() {
        let state = job();
        assert!(state.start(0));
        assert!(state.running_for().is_some());
        assert_eq!(state.take(), Some(TakenWhile::Running));
        assert_eq!(state.cancel.load(Ordering::SeqCst), 1);
        assert!(state.is_orphaned());
        assert_eq!(state.finish(), Finished::Orphaned);
        assert!(!state.is_orphaned());
    }

    #[test]
    fn a_stuck_worker_is_counted_once_and_given_back_when_it_returns() {
        let state = job();
        assert!(state.start(0));
        assert_eq!(state.take(), Some(TakenWhile::Running));
        assert!(state.mark_stuck());
        assert!(!state.mark_stuck(), "counted once");
        assert_eq!(state.take(), None);
        assert_eq!(state.finish(), Finished::WasStuck);
    }

    #[test]
    fn a_worker_that_finishes_first_wins() {
        let state = job();
        assert!(state.start(0));
        assert_eq!(state.finish(), Finished::Resolved);
        assert_eq!(state.take(), None, "the timeout comes too late");
        assert!(!state.mark_stuck());
    }
}

/// Under every interleaving loom explores: exactly one party resolves a task; a task taken while waiting never
/// runs; a worker is counted stuck at most once and given back exactly when it was counted.
#[cfg(all(test, kmqd_loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicUsize;
    use loom::thread;

    /// The worker's side: start, (run), finish. Returns whether it resolved the task, and whether it gave back a
    /// stuck count.
    fn worker(state: &HeldState) -> (bool, bool) {
        if !state.start(0) {
            return (false, false);
        }
        match state.finish() {
            Finished::Resolved => (true, false),
            Finished::Orphaned => (false, false),
            Finished::WasStuck => (false, true),
        }
    }

    #[test]
    fn exactly_one_of_worker_timeout_and_shutdown_resolves() {
        loom::model(|| {
            let state = HeldTask::alone(HeldState::new(None, 0, Instant::now()), b"");
            let resolved = Arc::new(AtomicUsize::new(0));
            let stuck = Arc::new(AtomicUsize::new(0));
            let given_back = Arc::new(AtomicUsize::new(0));
            let ran = Arc::new(AtomicUsize::new(0));
            let w = {
                let (state, resolved, given_back, ran) = (
                    state.clone(),
                    Arc::clone(&resolved),
                    Arc::clone(&given_back),
                    Arc::clone(&ran),
                );
                thread::spawn(move || {
                    let started = state.start(0);
                    if started {
                        ran.fetch_add(1, Ordering::SeqCst);
                        match state.finish() {
                            Finished::Resolved => {
                                resolved.fetch_add(1, Ordering::SeqCst);
                            }
                            Finished::Orphaned => {}
                            Finished::WasStuck => {
                                given_back.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    }
                })
            };
            // The execution timeout: takes a running task, later declares its worker stuck.
            let t = {
                let (state, resolved, stuck) =
                    (state.clone(), Arc::clone(&resolved), Arc::clone(&stuck));
                thread::spawn(move || {
                    if state.running_for().is_some() && state.take().is_some() {
                        resolved.fetch_add(1, Ordering::SeqCst);
                    }
                    if state.mark_stuck() {
                        stuck.fetch_add(1, Ordering::SeqCst);
                    }
                })
            };
            // The shutdown: takes whatever is not resolved yet.
            let taken_waiting = match state.take() {
                Some(taken) => {
                    resolved.fetch_add(1, Ordering::SeqCst);
                    taken == TakenWhile::Waiting
                }
                None => false,
            };
            w.join().unwrap();
            t.join().unwrap();
            assert_eq!(resolved.load(Ordering::SeqCst), 1, "exactly one resolver");
            if taken_waiting {
                assert_eq!(
                    ran.load(Ordering::SeqCst),
                    0,
                    "taken while waiting: never ran"
                );
            }
            assert_eq!(
                stuck.load(Ordering::SeqCst),
                given_back.load(Ordering::SeqCst),
                "a worker counted stuck is given back exactly once, when its handler returns"
            );
        });
    }

    #[test]
    fn two_takers_never_both_win() {
        loom::model(|| {
            let state = HeldTask::alone(HeldState::new(None, 0, Instant::now()), b"");
            let other = {
                let state = state.clone();
                thread::spawn(move || state.take().is_some())
            };
            let (started, _) = worker(&state);
            let mine = state.take().is_some();
            let theirs = other.join().unwrap();
            assert!(!(mine && theirs), "two takers won");
            if !started {
                assert!(mine || theirs, "a task that never started was taken");
            }
        });
    }
}
