//! What a daemon holds of one queue: the tasks it claimed and has not settled yet, and the worker capacity the
//! fetcher may claim for.
//!
//! Architecture Invariant: a task's entry (and its slot) exists from the moment the fetcher takes it until the
//! acker has settled it in Redis; all that time the task sits in its owner's processing hash, covered by the
//! owner's lease, which the heartbeat renews while the daemon lives. Exactly one party *resolves*
//! a task (decides its outcome): the worker that ran it, the heartbeat when the execution timeout passes, or
//! the supervisor handing it back at shutdown. A later outcome for a resolved task is dropped.
//!
//! The hot path takes no lock per task: a task's phase is an atomic in its [`JobState`], shared by the table
//! and the worker; the table's lock is taken once per claimed batch (insert) and once per settled batch
//! (remove).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::broker::Token;

/// A local handle for a task held by this daemon (unique within the process).
pub type JobId = u64;

const WAITING: u8 = 0;
const RUNNING: u8 = 1;
const RESOLVED: u8 = 2;

/// The reference point for run start times, so that they fit an atomic.
static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

/// One task held by the daemon, shared by the in-flight table and the worker that runs it.
#[derive(Debug)]
pub struct JobState {
    /// Safe mode: the claim that fences the task's settlement.
    pub token: Option<Token>,
    /// The priority level it came from.
    pub level: usize,
    /// The envelope as taken from Redis.
    pub payload: String,
    /// Raised (non-zero) to ask the handler to stop; the ABI points plugins at it.
    pub cancel: AtomicU32,
    phase: AtomicU8,
    /// When a worker started it, ns since [`EPOCH`].
    started_ns: AtomicU64,
}

impl JobState {
    pub fn new(token: Option<Token>, level: usize, payload: String) -> JobState {
        JobState {
            token,
            level,
            payload,
            cancel: AtomicU32::new(0),
            phase: AtomicU8::new(WAITING),
            started_ns: AtomicU64::new(0),
        }
    }

    /// A worker is about to run the task; false when it was already resolved (handed back, timed out).
    pub fn start(&self) -> bool {
        self.started_ns
            .store(EPOCH.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.phase
            .compare_exchange(WAITING, RUNNING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Claims the right to decide the task's outcome; false when someone else already did.
    pub fn resolve(&self) -> bool {
        self.phase.swap(RESOLVED, Ordering::AcqRel) != RESOLVED
    }

    fn running_for(&self) -> Option<Duration> {
        (self.phase.load(Ordering::Acquire) == RUNNING).then(|| {
            let started = Duration::from_nanos(self.started_ns.load(Ordering::Relaxed));
            EPOCH.elapsed().saturating_sub(started)
        })
    }
}

/// A task taken back from the table for someone other than its worker to settle.
#[derive(Debug)]
pub struct Reclaimed {
    pub id: JobId,
    pub state: Arc<JobState>,
    /// Whether a worker had started it (false: still waiting in the channel).
    pub started: bool,
}

/// The tasks a daemon holds for one queue.
#[derive(Debug, Default)]
pub struct InFlight {
    entries: Mutex<HashMap<JobId, Arc<JobState>>>,
    next_id: AtomicU64,
}

impl InFlight {
    fn lock(&self) -> MutexGuard<'_, HashMap<JobId, Arc<JobState>>> {
        // A panic while holding this lock can only come from HashMap itself (allocation failure aborts anyway);
        // the data stays consistent, so a poisoned lock is still usable.
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records newly taken tasks, under one lock.
    pub fn insert(&self, tasks: impl IntoIterator<Item = JobState>) -> Vec<(JobId, Arc<JobState>)> {
        let tasks: Vec<(JobId, Arc<JobState>)> = tasks
            .into_iter()
            .map(|state| {
                (
                    self.next_id.fetch_add(1, Ordering::Relaxed),
                    Arc::new(state),
                )
            })
            .collect();
        let mut entries = self.lock();
        for (id, state) in &tasks {
            entries.insert(*id, Arc::clone(state));
        }
        tasks
    }

    /// Forgets settled tasks.
    pub fn remove(&self, ids: impl IntoIterator<Item = JobId>) {
        let mut entries = self.lock();
        for id in ids {
            entries.remove(&id);
        }
    }

    /// The claim tokens of every held task, for the heartbeat to renew.
    pub fn tokens(&self) -> Vec<Token> {
        self.lock()
            .values()
            .filter_map(|state| state.token.clone())
            .collect()
    }

    /// Number of held tasks.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves and cancels every task running longer than `timeout`.
    pub fn take_overdue(&self, timeout: Duration) -> Vec<Reclaimed> {
        self.take_where(|state| state.running_for().is_some_and(|running| running > timeout))
    }

    /// Resolves and cancels every task not resolved yet (shutdown: the grace period is over).
    pub fn take_unresolved(&self) -> Vec<Reclaimed> {
        self.take_where(|_| true)
    }

    fn take_where(&self, mut matches: impl FnMut(&JobState) -> bool) -> Vec<Reclaimed> {
        let mut taken = Vec::new();
        for (id, state) in self.lock().iter() {
            if !matches(state) {
                continue;
            }
            let started = state.phase.load(Ordering::Acquire) == RUNNING;
            if state.resolve() {
                state.cancel.store(1, Ordering::SeqCst);
                taken.push(Reclaimed {
                    id: *id,
                    state: Arc::clone(state),
                    started,
                });
            }
        }
        taken
    }
}

/// Safe mode: this daemon's owner on the queue (its claim identity, with one lease for every task it holds) and
/// the counter its claim tokens come from.
///
/// The fetcher registers an owner on its first claim; when the lease is lost (the daemon was silent longer than
/// `lease_timeout`), the heartbeat or the fetcher drops it and the fetcher registers a new one. Tasks claimed
/// under the old owner keep their tokens, so their late outcomes are fenced against the monitors.
#[derive(Debug, Default)]
pub struct Ownership {
    current: Mutex<Option<Arc<str>>>,
    next_token: AtomicU64,
}

impl Ownership {
    fn lock(&self) -> MutexGuard<'_, Option<Arc<str>>> {
        // Holds an Option only; a poisoned lock still holds a valid one.
        self.current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The owner to claim under, if one is registered.
    pub fn current(&self) -> Option<Arc<str>> {
        self.lock().clone()
    }

    /// Records a newly registered owner.
    pub fn set(&self, owner: Arc<str>) {
        *self.lock() = Some(owner);
    }

    /// Forgets `owner` after its lease was lost (unless a newer one replaced it already); true if it was current.
    pub fn lose(&self, owner: &str) -> bool {
        let mut current = self.lock();
        if current.as_deref() == Some(owner) {
            *current = None;
            return true;
        }
        false
    }

    /// Reserves `n` claim tokens; returns the first.
    pub fn tokens(&self, n: usize) -> u64 {
        self.next_token.fetch_add(n as u64, Ordering::Relaxed)
    }
}

/// What one queue may hold (`workers + prefetch` slots): a slot is taken when a task is claimed and freed when its
/// outcome is settled in Redis, so claimed tasks waiting for a worker, running, or waiting for their settlement
/// together never exceed it, and the daemon's memory stays bounded however far Redis or the acker fall behind.
///
/// To claim in batches rather than one task per freed slot, the fetcher waits until `threshold` slots are free,
/// unless the workers run dry first (a worker that finds no job [`Slots::nudge`]s it). Releasing a slot is an
/// atomic add; the fetcher is woken only when the count crosses the threshold.
#[derive(Debug)]
pub struct Slots {
    free: AtomicUsize,
    threshold: usize,
    lock: Mutex<()>,
    wake: Condvar,
}

impl Slots {
    /// `capacity` slots; the fetcher wakes when `threshold` (at least 1) are free.
    pub fn new(capacity: usize, threshold: usize) -> Slots {
        Slots {
            free: AtomicUsize::new(capacity),
            threshold: threshold.clamp(1, capacity.max(1)),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        }
    }

    fn guard(&self) -> MutexGuard<'_, ()> {
        // The mutex guards no data, only the wait; a poisoned one is as good.
        self.lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits up to `timeout` until the threshold is reached, or until some slot is free and `starving()` says the
    /// workers have nothing to do; then takes up to `max` free slots. Returns how many it took (0 on timeout).
    pub fn acquire(&self, max: usize, timeout: Duration, starving: impl Fn() -> bool) -> usize {
        let deadline = Instant::now() + timeout;
        let mut guard = self.guard();
        loop {
            let free = self.free.load(Ordering::Acquire);
            if free >= self.threshold || (free > 0 && starving()) {
                // Only the fetcher takes slots, so `free` cannot shrink between the load and the subtraction.
                let taken = free.min(max);
                self.free.fetch_sub(taken, Ordering::AcqRel);
                return taken;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return 0;
            };
            guard = self
                .wake
                .wait_timeout(guard, left)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    /// Gives back `n` slots.
    pub fn release(&self, n: usize) {
        if n == 0 {
            return;
        }
        let before = self.free.fetch_add(n, Ordering::AcqRel);
        if before < self.threshold && before + n >= self.threshold {
            let _guard = self.guard();
            self.wake.notify_one();
        }
    }

    /// A worker found no job waiting: wake the fetcher even below the threshold.
    pub fn nudge(&self) {
        let _guard = self.guard();
        self.wake.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claimed(seq: u64) -> Option<Token> {
        Some(Token {
            owner: Arc::from("o1"),
            id: crate::broker::TokenId::Seq(seq),
        })
    }

    fn job(table: &InFlight, token: Option<Token>) -> (JobId, Arc<JobState>) {
        table
            .insert([JobState::new(token, 0, "{}".to_string())])
            .remove(0)
    }

    #[test]
    fn exactly_one_party_resolves_a_task() {
        let table = InFlight::default();
        let (id, state) = job(&table, claimed(1));
        assert!(state.start());
        assert_eq!(
            table.take_unresolved().len(),
            1,
            "shutdown takes the running task"
        );
        assert_eq!(
            state.cancel.load(Ordering::SeqCst),
            1,
            "and raises its cancel flag"
        );
        assert!(!state.resolve(), "the worker's late outcome is dropped");
        assert_eq!(
            table.tokens().len(),
            1,
            "the lease is renewed until the settlement lands"
        );
        table.remove([id]);
        assert!(table.is_empty());
    }

    #[test]
    fn a_handed_back_task_is_not_started() {
        let table = InFlight::default();
        let (_, state) = job(&table, None);
        let taken = table.take_unresolved();
        assert!(!taken[0].started);
        assert!(!state.start());
    }

    #[test]
    fn only_running_tasks_are_overdue() {
        let table = InFlight::default();
        let (_, waiting) = job(&table, None);
        let (running, state) = job(&table, None);
        assert!(state.start());
        let overdue = table.take_overdue(Duration::ZERO);
        assert_eq!(overdue.iter().map(|r| r.id).collect::<Vec<_>>(), [running]);
        assert!(waiting.start());
        assert!(waiting.resolve());
    }

    #[test]
    fn a_lost_owner_is_forgotten_only_if_still_current() {
        let ownership = Ownership::default();
        ownership.set(Arc::from("o1"));
        ownership.set(Arc::from("o2"));
        assert!(!ownership.lose("o1"), "o2 replaced it");
        assert_eq!(ownership.current().as_deref(), Some("o2"));
        assert!(ownership.lose("o2"));
        assert_eq!(ownership.current(), None);
        assert_eq!((ownership.tokens(10), ownership.tokens(5)), (0, 10));
    }

    #[test]
    fn slots_batch_up_to_the_threshold_unless_workers_starve() {
        let slots = Slots::new(10, 4);
        assert_eq!(slots.acquire(100, Duration::ZERO, || false), 10);
        slots.release(2);
        assert_eq!(
            slots.acquire(100, Duration::from_millis(1), || false),
            0,
            "2 free, below the threshold"
        );
        assert_eq!(
            slots.acquire(100, Duration::ZERO, || true),
            2,
            "starving workers get what is free"
        );
        slots.release(5);
        assert_eq!(slots.acquire(3, Duration::ZERO, || false), 3, "at most max");
        assert_eq!(slots.acquire(100, Duration::ZERO, || true), 2);
    }

    #[test]
    fn crossing_the_threshold_wakes_a_waiting_fetcher() {
        let slots = Arc::new(Slots::new(4, 2));
        assert_eq!(slots.acquire(4, Duration::ZERO, || false), 4);
        let waiter = {
            let slots = Arc::clone(&slots);
            std::thread::spawn(move || slots.acquire(4, Duration::from_secs(60), || false))
        };
        slots.release(1);
        slots.release(1);
        assert_eq!(
            waiter.join().unwrap(),
            2,
            "woken by the release that reached the threshold, not the timeout"
        );
    }
}
