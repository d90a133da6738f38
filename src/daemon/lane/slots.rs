//! How many tasks of a lane run at once: at most the queue's `workers`, whether a worker thread waits inside
//! `handle` for each, or a plugin that starts tasks (kmq_plugin.h, `start`) holds many while the threads go on.
//!
//! A worker takes a slot before it takes a job. It keeps that slot for its next job while its tasks run in
//! `handle` (a slot given back and taken again per task was two atomic writes, on a line every worker shares, per
//! task), and gives it back when it ends. A task handed to a plugin's `start` takes the worker's slot along: the
//! task's completion gives it back, on the plugin's thread, and the worker takes a new one for its next job. With
//! `handle` alone the slots never run out (a thread holds at most one, and there are `workers` threads); with
//! `start`, one thread can fill them all, and then waits. It is woken only once [`Slots::refill`] of them are
//! free again, and takes them all (its next jobs find a slot at once): one wake-up per batch of completions, not
//! per task, which is what `start` is for. The slots a stuck task holds (one that ignored its cancel flag) stay
//! taken, as a stuck worker thread stays busy.
//!
//! A lane's last worker thread to end waits for the tasks it started to complete, so that the daemon's
//! shutdown, which waits for the worker threads, knows whether a plugin still runs a task (then it skips the
//! plugins' `shutdown`, as it does for a handler that never returned).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use crate::poison::{lock, recover};

#[derive(Debug)]
pub struct Slots {
    limit: usize,
    /// How many must be free before a waiting worker is woken.
    refill: usize,
    /// Taken: by a worker that waits for a job or runs one, or by a started task.
    used: AtomicUsize,
    /// Started tasks not completed yet (each holds one of `used`).
    started: AtomicUsize,
    /// Worker threads running (the last to end waits for `started`).
    threads: AtomicUsize,
    /// Workers waiting for a slot; read without the lock by whoever frees one.
    waiting: AtomicUsize,
    lock: Mutex<()>,
    freed: Condvar,
    /// Signalled when the last started task completes.
    idle: Condvar,
}

impl Slots {
    /// `workers` slots, for `workers` threads.
    pub fn new(workers: usize) -> Slots {
        let limit = workers.max(1);
        Slots {
            limit,
            refill: Self::refill(limit),
            used: AtomicUsize::new(0),
            started: AtomicUsize::new(0),
            threads: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            lock: Mutex::new(()),
            freed: Condvar::new(),
            idle: Condvar::new(),
        }
    }

    /// An eighth of the slots (at least one): a plugin holding `limit` tasks runs at least 7/8 of them while
    /// the worker that refills it sleeps.
    fn refill(limit: usize) -> usize {
        (limit / 8).max(1)
    }

    fn try_take(&self) -> bool {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                (used < self.limit).then_some(used + 1)
            })
            .is_ok()
    }

    /// Takes a slot, waiting while every one is taken (until a batch is free, see the module's doc).
    pub fn take(&self) {
        if self.try_take() {
            return;
        }
        let mut guard = lock(&self.lock);
        self.waiting.fetch_add(1, Ordering::SeqCst);
        loop {
            if self.used.load(Ordering::SeqCst) + self.refill <= self.limit && self.try_take() {
                break;
            }
            guard = recover(self.freed.wait(guard));
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        drop(guard);
        // The others may find room too.
        if self.used.load(Ordering::SeqCst) + self.refill <= self.limit {
            self.freed.notify_one();
        }
    }

    /// Gives a slot back.
    pub fn give_back(&self) {
        let after = self.used.fetch_sub(1, Ordering::SeqCst) - 1;
        // Used only falls one at a time, so a wait for `limit - refill` always sees this crossing.
        if after + self.refill == self.limit && self.waiting.load(Ordering::SeqCst) > 0 {
            let _guard = lock(&self.lock);
            self.freed.notify_one();
        }
    }

    /// A task is handed to a plugin's `start`: its slot is the completion's to give back.
    pub fn starting(&self) {
        self.started.fetch_add(1, Ordering::SeqCst);
    }

    /// A started task completed (or its `start` declined it): gives its slot back.
    pub fn completed(&self) {
        self.give_back();
        if self.started.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _guard = lock(&self.lock);
            self.idle.notify_all();
        }
    }

    /// A started task's `start` declined it: the worker runs it, and keeps its slot.
    pub fn declined(&self) {
        if self.started.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _guard = lock(&self.lock);
            self.idle.notify_all();
        }
    }

    /// A worker thread begins.
    pub fn thread_started(&self) {
        self.threads.fetch_add(1, Ordering::SeqCst);
    }

    /// A worker thread ends: the last one waits until every started task completed.
    pub fn thread_ending(&self) {
        if self.threads.fetch_sub(1, Ordering::SeqCst) != 1 {
            return;
        }
        let mut guard = lock(&self.lock);
        while self.started.load(Ordering::SeqCst) > 0 {
            guard = recover(self.idle.wait(guard));
        }
    }

    /// Started tasks not completed yet.
    #[cfg(test)]
    pub fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn a_full_lane_wakes_its_waiting_worker_only_once_a_batch_of_slots_is_free() {
        let slots = Arc::new(Slots::new(16));
        for _ in 0..16 {
            slots.take();
        }
        let (sender, receiver) = std::sync::mpsc::channel();
        let waiter = {
            let slots = Arc::clone(&slots);
            std::thread::spawn(move || {
                slots.take();
                sender.send(()).unwrap();
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while slots.waiting.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "the worker never waited");
            std::thread::yield_now();
        }
        // One free slot is not a batch (refill is 2 of 16): the worker sleeps on.
        slots.give_back();
        assert!(receiver.recv_timeout(Duration::from_millis(100)).is_err());
        slots.give_back();
        receiver
            .recv_timeout(Duration::from_secs(10))
            .expect("two free slots wake the worker");
        waiter.join().unwrap();
        assert_eq!(slots.used.load(Ordering::SeqCst), 15);
    }

    #[test]
    fn the_last_worker_thread_waits_for_the_tasks_started_to_complete() {
        let slots = Arc::new(Slots::new(4));
        slots.thread_started();
        slots.thread_started();
        slots.take();
        slots.starting();
        // Not the last thread: it ends at once.
        slots.thread_ending();
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let last = {
            let (slots, ended) = (Arc::clone(&slots), Arc::clone(&ended));
            std::thread::spawn(move || {
                slots.thread_ending();
                ended.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !ended.load(Ordering::SeqCst),
            "the last thread ended with a task running"
        );
        slots.completed();
        last.join().unwrap();
        assert!(ended.load(Ordering::SeqCst));
        assert_eq!(slots.started(), 0);
    }
}
