//! The table of the tasks a lane holds, from their claim until the acker has settled them. Its own module
//! because it is one lock and a map that every stage of the lane shares; who may change a held task's phase is
//! [`super::resolve`]'s, and holding a claim only while its owner is current is [`super::Lane::hold`]'s.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use rustc_hash::FxHashMap;

use super::resolve::{HeldState, HeldTask, JobId};
use crate::broker::payloads::Payloads;
use crate::poison::lock;

/// The tasks of one claim (or pop), each with its id in the lane's table of held tasks.
pub type Tasks = Vec<(JobId, HeldTask)>;

/// The table of the tasks a lane holds. The hot path takes its lock once per claimed batch (insert) and once per
/// settled batch (remove); a task's phase is an atomic in its [`HeldState`], shared with the worker.
#[derive(Debug, Default)]
pub struct HeldTable {
    entries: Mutex<FxHashMap<JobId, HeldTask>>,
    next_id: AtomicU64,
}

impl HeldTable {
    /// The newly taken tasks of one claim (or pop), each with an id of its own; not held yet (see
    /// [`HeldTable::insert`]).
    pub fn number(&self, claim: impl IntoIterator<Item = HeldState>, payloads: Payloads) -> Tasks {
        HeldTask::claim(claim, payloads)
            .map(|task| (self.next_id.fetch_add(1, Ordering::Relaxed), task))
            .collect()
    }

    /// Records the tasks of one claim (or pop) as held, under one lock.
    pub fn insert(&self, tasks: &[(JobId, HeldTask)]) {
        let mut entries = lock(&self.entries);
        for (id, task) in tasks {
            entries.insert(*id, task.clone());
        }
    }

    /// Forgets settled tasks.
    pub fn remove(&self, ids: impl IntoIterator<Item = JobId>) {
        let mut entries = lock(&self.entries);
        for id in ids {
            entries.remove(&id);
        }
    }

    /// The held tasks among `ids` (the others were settled), each with its id, under one lock.
    pub fn some(&self, ids: impl IntoIterator<Item = JobId>) -> Vec<(JobId, HeldTask)> {
        let entries = lock(&self.entries);
        ids.into_iter()
            .filter_map(|id| entries.get(&id).map(|task| (id, task.clone())))
            .collect()
    }

    pub fn len(&self) -> usize {
        lock(&self.entries).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many held tasks `matches` selects (for the metrics).
    pub fn count(&self, mut matches: impl FnMut(&HeldState) -> bool) -> usize {
        lock(&self.entries)
            .values()
            .filter(|state| matches(state))
            .count()
    }

    /// The held tasks `matches` selects, for a resolver to take.
    pub fn select(&self, mut matches: impl FnMut(&HeldState) -> bool) -> Vec<(JobId, HeldTask)> {
        lock(&self.entries)
            .iter()
            .filter(|(_, state)| matches(state))
            .map(|(id, state)| (*id, state.clone()))
            .collect()
    }
}
