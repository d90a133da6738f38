//! The jobs the fetcher hands to the lane's workers: one queue under a lock, which the fetcher fills a claim at a
//! time and each worker takes from a job at a time.
//!
//! Why not a channel: a channel moved each job in and out on its own, about 150 instructions a task with the
//! wake-up checks, and its receivers spin and yield before they sleep. Here the fetcher takes the lock once per
//! claim and a worker once per job, and a worker with nothing to do sleeps on a condition variable at once
//! (docs/PERFORMANCE.md, "The daemon's hot path, cut down").
//!
//! Bounded without a capacity of its own: a job exists only for a held task, and the lane holds no more than its
//! capacity allows. The ends behave as a channel's: when the fetcher's [`Sender`] is dropped (it stopped, or its
//! thread died) the workers take what is left and then end; when every worker's [`Receiver`] is dropped, the
//! fetcher's jobs are refused and it hands them back.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::resolve::Job;

#[derive(Debug)]
struct Jobs {
    queue: Mutex<Queue>,
    arrived: Condvar,
}

#[derive(Debug)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Workers waiting on `arrived`.
    waiting: usize,
    /// The fetcher is gone: no more jobs come.
    closed: bool,
    /// Workers not gone yet.
    receivers: usize,
}

/// A lane's job queue: the fetcher's end and `workers` workers' ends.
pub fn queue(workers: usize) -> (Sender, Vec<Receiver>) {
    let jobs = Arc::new(Jobs {
        queue: Mutex::new(Queue {
            jobs: VecDeque::new(),
            waiting: 0,
            closed: false,
            receivers: workers,
        }),
        arrived: Condvar::new(),
    });
    let receivers = (0..workers).map(|_| Receiver(Arc::clone(&jobs))).collect();
    (Sender(jobs), receivers)
}

impl Jobs {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A VecDeque's push and pop do not panic midway: a poisoned lock's queue is consistent.
        self.queue
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The fetcher's end; dropping it tells the workers that no more jobs come.
#[derive(Debug)]
pub struct Sender(Arc<Jobs>);

impl Sender {
    /// Adds a claim's jobs, in order; gives them back when no worker is left to take them.
    pub fn send(&self, jobs: Vec<Job>) -> Result<(), Vec<Job>> {
        let mut queue = self.0.lock();
        if queue.receivers == 0 {
            return Err(jobs);
        }
        let wake = queue.waiting.min(jobs.len());
        queue.jobs.extend(jobs);
        drop(queue);
        for _ in 0..wake {
            self.0.arrived.notify_one();
        }
        Ok(())
    }

    /// How many jobs wait for a worker.
    pub fn len(&self) -> usize {
        self.0.lock().jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.arrived.notify_all();
    }
}

/// What [`Receiver::try_take`] found.
#[derive(Debug)]
pub enum Taken {
    Job(Job),
    /// Nothing now; more may come.
    Empty,
    /// Nothing, and nothing more comes.
    Closed,
}

/// A worker's end; dropping it (the worker ended, or its thread died) counts it gone.
#[derive(Debug)]
pub struct Receiver(Arc<Jobs>);

impl Receiver {
    /// The next job, without waiting.
    pub fn try_take(&self) -> Taken {
        let mut queue = self.0.lock();
        match queue.jobs.pop_front() {
            Some(job) => Taken::Job(job),
            None if queue.closed => Taken::Closed,
            None => Taken::Empty,
        }
    }

    /// The next job, waiting for one; `None` once the fetcher is gone and every job was taken.
    pub fn take(&self) -> Option<Job> {
        let mut queue = self.0.lock();
        loop {
            if let Some(job) = queue.jobs.pop_front() {
                return Some(job);
            }
            if queue.closed {
                return None;
            }
            queue.waiting += 1;
            queue = self
                .0
                .arrived
                .wait(queue)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            queue.waiting -= 1;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.0.lock().receivers -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::lane::resolve::{JobState, Task};
    use std::time::Instant;

    fn job(id: u64) -> Job {
        Job {
            id,
            state: Task::alone(JobState::new(None, 0, Instant::now()), b""),
            claimed_at_ms: 0,
            claimed_ns: 0,
        }
    }

    #[test]
    fn jobs_go_in_order_and_the_workers_end_once_the_fetcher_is_gone_and_nothing_is_left() {
        let (sender, mut receivers) = queue(2);
        let (a, b) = (receivers.remove(0), receivers.remove(0));
        assert!(matches!(a.try_take(), Taken::Empty));
        sender.send(vec![job(1), job(2), job(3)]).unwrap();
        assert_eq!(sender.len(), 3);
        assert!(matches!(a.try_take(), Taken::Job(job) if job.id == 1));
        assert_eq!(b.take().map(|job| job.id), Some(2));
        drop(sender);
        assert!(matches!(a.try_take(), Taken::Job(job) if job.id == 3));
        assert!(matches!(a.try_take(), Taken::Closed));
        assert!(b.take().is_none());
    }

    #[test]
    fn a_waiting_worker_wakes_for_a_job_or_the_end() {
        let (sender, receivers) = queue(2);
        let waiting: Vec<_> = receivers
            .into_iter()
            .map(|receiver| std::thread::spawn(move || receiver.take().map(|job| job.id)))
            .collect();
        // Both wait (no sleep: the count says so).
        while sender.0.lock().waiting < 2 {
            std::thread::yield_now();
        }
        sender.send(vec![job(7)]).unwrap();
        drop(sender);
        let mut got: Vec<_> = waiting.into_iter().map(|t| t.join().unwrap()).collect();
        got.sort();
        assert_eq!(got, [None, Some(7)]);
    }

    #[test]
    fn jobs_are_refused_once_every_worker_is_gone() {
        let (sender, receivers) = queue(1);
        drop(receivers);
        let refused = sender.send(vec![job(1)]).expect_err("no worker");
        assert_eq!(refused.len(), 1);
    }
}
