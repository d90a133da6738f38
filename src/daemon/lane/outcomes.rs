//! The lane's outcomes on their way to its acker: a list every resolver appends to and the acker takes whole.
//!
//! Why not a channel: a channel moves each outcome in and out on its own (its send and receive were about 450
//! instructions a task together, the outcome copied at each end), while the acker wants them all at once, in
//! batches of up to a thousand. Here a resolver appends under a lock held for the copy alone, and the acker swaps
//! the whole list for its own empty one: one lock per batch on its side, no copy (docs/PERFORMANCE.md, "One
//! allocation per claim, one lock per settle").
//!
//! Bounded without a capacity of its own: every held task is resolved once, so the list never holds more
//! outcomes than the lane may hold tasks. The acker is woken only when it waits for the first outcome (a
//! resolver that appends while the acker lingers or settles wakes nobody).

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::resolve::Outcome;

#[derive(Debug, Default)]
pub struct Outcomes {
    queued: Mutex<Queued>,
    arrived: Condvar,
}

#[derive(Debug, Default)]
struct Queued {
    outcomes: Vec<Outcome>,
    /// The acker waits on `arrived` for the first outcome.
    waiting: bool,
}

impl Outcomes {
    fn lock(&self) -> MutexGuard<'_, Queued> {
        // Pushing and swapping a Vec do not panic midway: a poisoned lock's list is consistent.
        self.queued
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues a resolved task's outcome for the acker.
    pub fn push(&self, outcome: Outcome) {
        let mut queued = self.lock();
        queued.outcomes.push(outcome);
        let wake = queued.waiting;
        queued.waiting = false;
        drop(queued);
        if wake {
            self.arrived.notify_one();
        }
    }

    /// How many outcomes wait for the acker.
    pub fn queued(&self) -> usize {
        self.lock().outcomes.len()
    }

    /// The acker's take: every queued outcome, swapped into `batch` (which must be empty; its allocation is
    /// reused), waiting up to `timeout` for the first one. Returns whether it took any.
    pub fn take(&self, batch: &mut Vec<Outcome>, timeout: Duration) -> bool {
        debug_assert!(batch.is_empty());
        let mut queued = self.lock();
        if queued.outcomes.is_empty() {
            queued.waiting = true;
            queued = self
                .arrived
                .wait_timeout(queued, timeout)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
            queued.waiting = false;
        }
        std::mem::swap(&mut queued.outcomes, batch);
        !batch.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_acker_takes_every_queued_outcome_in_order_and_waits_for_the_first() {
        let outcomes = Arc::new(Outcomes::default());
        let mut batch = Vec::new();
        assert!(!outcomes.take(&mut batch, Duration::from_millis(1)));
        for job in 0..3 {
            outcomes.push(Outcome::forget(job));
        }
        assert_eq!(outcomes.queued(), 3);
        assert!(outcomes.take(&mut batch, Duration::from_millis(1)));
        assert_eq!(batch.iter().map(|o| o.job).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(outcomes.queued(), 0);

        // A waiting acker is woken by the first push, long before its timeout.
        batch.clear();
        let pusher = {
            let outcomes = Arc::clone(&outcomes);
            std::thread::spawn(move || {
                while !outcomes.lock().waiting {
                    std::thread::yield_now();
                }
                outcomes.push(Outcome::forget(7));
            })
        };
        assert!(outcomes.take(&mut batch, Duration::from_secs(600)));
        assert_eq!(batch.iter().map(|o| o.job).collect::<Vec<_>>(), [7]);
        pusher.join().unwrap();
    }
}
