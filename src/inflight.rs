//! What a daemon holds of one queue: the tasks it claimed and has not settled yet, and the worker capacity the
//! fetcher may claim for.
//!
//! Architecture Invariant: a task's entry exists from the moment the fetcher takes it until the acker has
//! settled it in Redis, so the heartbeat renews its lease for exactly that long. Exactly one party *resolves*
//! an entry (decides its outcome): the worker that ran it, the heartbeat when the execution timeout passes, or
//! the supervisor handing it back at shutdown. A later outcome for a resolved entry is dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A local handle for a task held by this daemon (unique within the process).
pub type JobId = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Claimed, waiting in the channel for a worker.
    Waiting,
    /// A worker is running it since this instant.
    Running(Instant),
    /// Its outcome is decided and on its way to the acker.
    Resolved,
}

/// One task held by the daemon.
#[derive(Debug)]
struct Entry {
    token: Option<Arc<str>>,
    level: usize,
    payload: Arc<str>,
    cancel: Arc<AtomicU32>,
    phase: Phase,
}

/// A task taken back from the table for someone other than its worker to settle.
#[derive(Debug)]
pub struct Reclaimed {
    pub id: JobId,
    pub token: Option<Arc<str>>,
    pub level: usize,
    pub payload: Arc<str>,
    /// Whether a worker had started it (false: still waiting in the channel).
    pub started: bool,
}

/// The tasks a daemon holds for one queue.
#[derive(Debug, Default)]
pub struct InFlight {
    entries: Mutex<HashMap<JobId, Entry>>,
    next_id: AtomicU64,
}

impl InFlight {
    fn lock(&self) -> MutexGuard<'_, HashMap<JobId, Entry>> {
        // A panic while holding this lock can only come from HashMap itself (allocation failure aborts anyway);
        // the data stays consistent, so a poisoned lock is still usable.
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records a newly taken task; returns its id and its cancel flag.
    pub fn insert(
        &self,
        token: Option<Arc<str>>,
        level: usize,
        payload: Arc<str>,
    ) -> (JobId, Arc<AtomicU32>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let cancel = Arc::new(AtomicU32::new(0));
        let entry = Entry {
            token,
            level,
            payload,
            cancel: Arc::clone(&cancel),
            phase: Phase::Waiting,
        };
        self.lock().insert(id, entry);
        (id, cancel)
    }

    /// A worker is about to run `id`; false when it was already resolved (handed back, timed out).
    pub fn start(&self, id: JobId) -> bool {
        match self.lock().get_mut(&id) {
            Some(entry) if entry.phase == Phase::Waiting => {
                entry.phase = Phase::Running(Instant::now());
                true
            }
            _ => false,
        }
    }

    /// Claims the right to decide `id`'s outcome; false when someone else already did.
    pub fn resolve(&self, id: JobId) -> bool {
        match self.lock().get_mut(&id) {
            Some(entry) if entry.phase != Phase::Resolved => {
                entry.phase = Phase::Resolved;
                true
            }
            _ => false,
        }
    }

    /// Forgets settled tasks.
    pub fn remove(&self, ids: impl IntoIterator<Item = JobId>) {
        let mut entries = self.lock();
        for id in ids {
            entries.remove(&id);
        }
    }

    /// The claim tokens of every held task, for the heartbeat to renew.
    pub fn tokens(&self) -> Vec<Arc<str>> {
        self.lock()
            .values()
            .filter_map(|entry| entry.token.clone())
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
        let now = Instant::now();
        self.take_where(
            |phase| matches!(phase, Phase::Running(since) if now.duration_since(since) > timeout),
        )
    }

    /// Resolves and cancels every task not resolved yet (shutdown: the grace period is over).
    pub fn take_unresolved(&self) -> Vec<Reclaimed> {
        self.take_where(|phase| phase != Phase::Resolved)
    }

    fn take_where(&self, mut matches: impl FnMut(Phase) -> bool) -> Vec<Reclaimed> {
        let mut taken = Vec::new();
        for (id, entry) in self.lock().iter_mut() {
            if matches(entry.phase) {
                let started = matches!(entry.phase, Phase::Running(_));
                entry.phase = Phase::Resolved;
                entry.cancel.store(1, Ordering::SeqCst);
                taken.push(Reclaimed {
                    id: *id,
                    token: entry.token.clone(),
                    level: entry.level,
                    payload: Arc::clone(&entry.payload),
                    started,
                });
            }
        }
        taken
    }
}

/// Free worker capacity of one queue: the fetcher claims only as many tasks as there are free slots, so no
/// claimed task waits in memory longer than the configured prefetch allows.
#[derive(Debug)]
pub struct Slots {
    free: Mutex<usize>,
    freed: Condvar,
}

impl Slots {
    pub fn new(capacity: usize) -> Slots {
        Slots {
            free: Mutex::new(capacity),
            freed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, usize> {
        // The guarded value is a plain counter; a poisoned lock still holds a valid count.
        self.free
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits up to `timeout` for a free slot, then takes up to `max` of them. Returns how many it took (0 on
    /// timeout).
    pub fn acquire(&self, max: usize, timeout: Duration) -> usize {
        let free = self.lock();
        let (mut free, _) = self
            .freed
            .wait_timeout_while(free, timeout, |free| *free == 0)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let taken = (*free).min(max);
        *free -= taken;
        taken
    }

    /// Gives back `n` slots.
    pub fn release(&self, n: usize) {
        if n > 0 {
            *self.lock() += n;
            self.freed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload() -> Arc<str> {
        Arc::from("{}")
    }

    #[test]
    fn exactly_one_party_resolves_an_entry() {
        let table = InFlight::default();
        let (id, cancel) = table.insert(Some(Arc::from("1:normal")), 0, payload());
        assert!(table.start(id));
        assert_eq!(
            table.take_unresolved().len(),
            1,
            "shutdown takes the running task"
        );
        assert_eq!(
            cancel.load(Ordering::SeqCst),
            1,
            "and raises its cancel flag"
        );
        assert!(!table.resolve(id), "the worker's late outcome is dropped");
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
        let (id, _) = table.insert(None, 0, payload());
        let taken = table.take_unresolved();
        assert!(!taken[0].started);
        assert!(!table.start(id));
    }

    #[test]
    fn only_running_tasks_overdue() {
        let table = InFlight::default();
        let (waiting, _) = table.insert(None, 0, payload());
        let (running, _) = table.insert(None, 0, payload());
        assert!(table.start(running));
        let overdue = table.take_overdue(Duration::ZERO);
        assert_eq!(overdue.iter().map(|r| r.id).collect::<Vec<_>>(), [running]);
        assert!(table.start(waiting));
        assert!(table.resolve(waiting));
    }

    #[test]
    fn slots_hand_out_at_most_what_is_free() {
        let slots = Slots::new(3);
        assert_eq!(slots.acquire(2, Duration::ZERO), 2);
        assert_eq!(slots.acquire(5, Duration::ZERO), 1);
        assert_eq!(slots.acquire(5, Duration::from_millis(1)), 0);
        slots.release(2);
        assert_eq!(slots.acquire(5, Duration::ZERO), 2);
    }
}
