//! The lane's outcomes on their way to its acker: lists the resolvers append to and the acker takes whole.
//!
//! Why not a channel: a channel moves each outcome in and out on its own (its send and receive were about 450
//! instructions a task together, the outcome copied at each end), while the acker wants them all at once, in
//! batches of up to a thousand. Here a resolver appends under a lock held for the copy alone, and the acker takes
//! each list whole: one lock per list per batch on its side (docs/PERFORMANCE.md, "One allocation per claim, one
//! lock per settle").
//!
//! Why a list per worker: a lock every worker takes for every task moves its line between the cores at every task
//! (docs/PERFORMANCE.md, "Workers that share less"). A worker of short tasks (the worker decides: see `jobs`)
//! appends to a list of its own, whose lock only the acker's take contends for, and takes the shared lock only for
//! its first append after a take, to list itself; the other resolvers (a worker of longer tasks, a started task's
//! completion, an execution timeout, a hand-back) append to the shared list. The acker swaps the shared list for
//! its batch, then appends the listed workers' lists in the order they were listed (a copy of each outcome but the
//! first list's, traded for the shared line): the outcomes of one worker stay in the order it resolved them.
//!
//! Bounded without a capacity of its own: every held task is resolved once, so the lists never hold more
//! outcomes than the lane may hold tasks. The acker is woken only when it waits for the first outcome (a
//! resolver that appends while the acker lingers or settles wakes nobody).

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crossbeam_utils::CachePadded;

use super::resolve::Resolution;
use crate::poison::{lock, recover};

#[derive(Debug)]
pub struct Outcomes {
    /// Padded, as each worker's list: a lock taken on one line moves no other (docs/PERFORMANCE.md, "Workers that
    /// share less").
    queued: CachePadded<Mutex<Queued>>,
    arrived: Condvar,
    /// Each worker's own list, by its index.
    workers: Box<[CachePadded<Mutex<Own>>]>,
}

#[derive(Debug, Default)]
struct Queued {
    outcomes: Vec<Resolution>,
    /// The workers whose own lists hold outcomes (each listed once): the acker looks at these alone, so that a
    /// lane of 512 workers does not cost it 512 locks a take.
    listed: Vec<usize>,
    /// The acker waits on `arrived` for the first outcome.
    waiting: bool,
}

#[derive(Debug, Default)]
struct Own {
    outcomes: Vec<Resolution>,
    /// In `Queued::listed`: set by the worker's first append after a take, cleared by the acker's take.
    listed: bool,
}

impl Outcomes {
    /// The outcomes of a lane with `workers` worker threads.
    pub fn new(workers: usize) -> Outcomes {
        Outcomes {
            queued: CachePadded::default(),
            arrived: Condvar::new(),
            workers: (0..workers).map(|_| CachePadded::default()).collect(),
        }
    }

    /// Queues a resolved task's outcome for the acker, from any thread.
    pub fn push(&self, outcome: Resolution) {
        let mut queued = lock(&self.queued);
        queued.outcomes.push(outcome);
        self.wake(queued);
    }

    /// Queues an outcome that worker `worker` resolved, in its own list. Only the first append after the acker's
    /// take takes the shared lock (to list the worker, and wake the acker if it waits): while the list is listed,
    /// the acker's next take, which cannot be a wait, takes it.
    pub fn push_own(&self, worker: usize, outcome: Resolution) {
        let Some(own) = self.workers.get(worker) else {
            return self.push(outcome);
        };
        let mut own = lock(own);
        own.outcomes.push(outcome);
        let first = !std::mem::replace(&mut own.listed, true);
        drop(own);
        if first {
            let mut queued = lock(&self.queued);
            queued.listed.push(worker);
            self.wake(queued);
        }
    }

    /// Wakes the acker if it waits (with `queued`'s lock held, so that it cannot be between its look and its wait).
    fn wake(&self, mut queued: MutexGuard<'_, Queued>) {
        let wake = std::mem::take(&mut queued.waiting);
        drop(queued);
        if wake {
            self.arrived.notify_one();
        }
    }

    /// How many outcomes wait for the acker.
    pub fn queued(&self) -> usize {
        let queued = lock(&self.queued);
        queued.outcomes.len()
            + queued
                .listed
                .iter()
                .map(|&worker| lock(&self.workers[worker]).outcomes.len())
                .sum::<usize>()
    }

    /// The acker's take: every queued outcome, moved into `batch` (which must be empty; its allocation is
    /// reused), waiting up to `timeout` for the first one. Returns whether it took any.
    pub fn take(&self, batch: &mut Vec<Resolution>, timeout: Duration) -> bool {
        debug_assert!(batch.is_empty());
        let mut queued = lock(&self.queued);
        if queued.outcomes.is_empty() && queued.listed.is_empty() {
            queued.waiting = true;
            queued = recover(self.arrived.wait_timeout(queued, timeout)).0;
            queued.waiting = false;
        }
        std::mem::swap(&mut queued.outcomes, batch);
        for worker in std::mem::take(&mut queued.listed) {
            let mut own = lock(&self.workers[worker]);
            // The first list is swapped, not copied, when the shared one was empty (the usual case in a busy lane).
            if batch.is_empty() {
                std::mem::swap(&mut own.outcomes, batch);
            } else {
                batch.append(&mut own.outcomes);
            }
            own.listed = false;
        }
        !batch.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    fn jobs(batch: &[Resolution]) -> Vec<u64> {
        batch.iter().map(|outcome| outcome.job).collect()
    }

    /// Waits, with a deadline, until the acker waits for its first outcome.
    fn until_the_acker_waits(outcomes: &Outcomes) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !lock(&outcomes.queued).waiting {
            assert!(Instant::now() < deadline, "the acker never waited");
            std::thread::yield_now();
        }
    }

    #[test]
    fn the_acker_takes_every_queued_outcome_in_order_and_waits_for_the_first() {
        let outcomes = Arc::new(Outcomes::new(1));
        let mut batch = Vec::new();
        assert!(!outcomes.take(&mut batch, Duration::from_millis(1)));
        for job in 0..3 {
            outcomes.push(Resolution::forget(job));
        }
        assert_eq!(outcomes.queued(), 3);
        assert!(outcomes.take(&mut batch, Duration::from_millis(1)));
        assert_eq!(jobs(&batch), [0, 1, 2]);
        assert_eq!(outcomes.queued(), 0);

        // A waiting acker is woken by the first push, long before its timeout.
        batch.clear();
        let pusher = {
            let outcomes = Arc::clone(&outcomes);
            std::thread::spawn(move || {
                until_the_acker_waits(&outcomes);
                outcomes.push(Resolution::forget(7));
            })
        };
        assert!(outcomes.take(&mut batch, Duration::from_secs(600)));
        assert_eq!(jobs(&batch), [7]);
        pusher.join().unwrap();
    }

    #[test]
    fn the_acker_takes_the_workers_own_outcomes_each_in_its_order_after_the_shared_ones() {
        let outcomes = Outcomes::new(2);
        outcomes.push_own(1, Resolution::forget(10));
        outcomes.push_own(0, Resolution::forget(20));
        outcomes.push(Resolution::forget(30));
        outcomes.push_own(1, Resolution::forget(11));
        outcomes.push_own(0, Resolution::forget(21));
        // A worker the lane does not have (none should) still reaches the acker.
        outcomes.push_own(2, Resolution::forget(40));
        assert_eq!(outcomes.queued(), 6);
        let mut batch = Vec::new();
        assert!(outcomes.take(&mut batch, Duration::from_millis(1)));
        assert_eq!(jobs(&batch), [30, 40, 10, 11, 20, 21]);
        assert_eq!(outcomes.queued(), 0);
        // Taken, a worker's list is listed again by its next append.
        outcomes.push_own(1, Resolution::forget(50));
        batch.clear();
        assert!(outcomes.take(&mut batch, Duration::from_millis(1)));
        assert_eq!(jobs(&batch), [50]);
    }

    #[test]
    fn a_waiting_acker_is_woken_by_a_workers_own_outcome() {
        let outcomes = Arc::new(Outcomes::new(2));
        let pusher = {
            let outcomes = Arc::clone(&outcomes);
            std::thread::spawn(move || {
                until_the_acker_waits(&outcomes);
                outcomes.push_own(1, Resolution::forget(7));
            })
        };
        let mut batch = Vec::new();
        // Unwoken, the take would still return the outcome, at its timeout: a minute, where a wake-up takes
        // microseconds (half of it allows for any slow machine).
        let started = Instant::now();
        assert!(outcomes.take(&mut batch, Duration::from_secs(60)));
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the worker's outcome did not wake the acker"
        );
        assert_eq!(jobs(&batch), [7]);
        pusher.join().unwrap();
    }
}
