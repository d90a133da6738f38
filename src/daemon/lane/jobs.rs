//! The jobs the fetcher hands to the lane's workers: one queue under a lock, which the fetcher fills a claim at a
//! time, and beside it each worker's jobs taken ahead.
//!
//! Why not a channel: a channel moved each job in and out on its own, about 150 instructions a task with the
//! wake-up checks, and its receivers spin and yield before they sleep. Here the fetcher takes the lock once per
//! claim, and a worker with nothing to do sleeps on a condition variable at once (docs/PERFORMANCE.md, "The
//! daemon's hot path, cut down").
//!
//! Why jobs taken ahead: a lock every worker takes for every job moves its line between the cores at every task,
//! and four workers on two cores paid more for that than for the rest of a no-op task (docs/PERFORMANCE.md,
//! "Workers that share less"). So when the queue holds at least two jobs per worker, a worker whose tasks are
//! short (it says so: [`Receiver::take_ahead`]) takes its share of them (at most [`AHEAD`] more than the one it
//! runs) into a list of its own, which it then takes from under a lock nobody else takes while it has work. A job
//! taken ahead never waits behind a slow task while another worker idles: a worker looks into the lists of those
//! that took jobs ahead before it sleeps, and it does so under the queue's lock, under which alone jobs are taken
//! ahead; and jobs are taken ahead only from a queue that holds two per worker, whose arrival woke every sleeping
//! worker. A job taken ahead may run after jobs that came later (at most `AHEAD` of them per worker): the lane's
//! order is first come, first served only roughly, as with any pool of workers.
//!
//! Bounded without a capacity of its own: a job exists only for a held task, and the lane holds no more than its
//! capacity allows. The ends behave as a channel's: when the fetcher's [`Sender`] is dropped (it stopped, or its
//! thread died) the workers take what is left and then end; when every worker's [`Receiver`] is dropped, the
//! fetcher's jobs are refused and it hands them back.
//!
//! Two parties send: the fetcher, its claims' tasks, and the acker, the tasks a settle claimed for the running
//! slots it freed (docs/design/flow-control.md, "The slot handed over in the settle"). Both go through
//! [`Sender::dispatch`], the one way a taken task reaches a worker: held first ([`Lane::hold`]), then queued, or
//! handed back once the lane stops claiming. Only the fetcher's end closes the queue when dropped; the acker's
//! ([`Sender::also`]) is refused once it is closed, so a handover that lands after the workers ended hands its
//! tasks back rather than leaving them in a queue nobody reads.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

use crossbeam_utils::CachePadded;

use super::Lane;
use super::resolve::{HeldState, Job};
use crate::broker::Batch;
use crate::poison::{lock, recover};

/// The most jobs a worker takes ahead of the one it runs.
pub const AHEAD: usize = 31;

#[derive(Debug)]
struct Jobs {
    /// Padded, as each list in `ahead`: a lock taken on one line moves no other (docs/PERFORMANCE.md, "Workers
    /// that share less").
    queue: CachePadded<Mutex<Queue>>,
    arrived: Condvar,
    /// Each worker's jobs taken ahead, by its index. Taken ahead under `queue`'s lock (always taken first when
    /// both are); taken from by their worker, or by another with nothing else to do.
    ahead: Box<[CachePadded<Mutex<VecDeque<Job>>>]>,
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
    /// The workers that took jobs ahead and may still hold some (each listed once, flagged in `listed`): a worker
    /// about to sleep looks into these lists alone, so that a lane of 512 workers does not cost it 511 locks.
    holders: Vec<usize>,
    listed: Vec<bool>,
}

/// A lane's job queue: the fetcher's end and `workers` workers' ends.
pub fn queue(workers: usize) -> (Sender, Vec<Receiver>) {
    let jobs = Arc::new(Jobs {
        queue: CachePadded::new(Mutex::new(Queue {
            jobs: VecDeque::new(),
            waiting: 0,
            closed: false,
            receivers: workers,
            holders: Vec::new(),
            listed: vec![false; workers],
        })),
        arrived: Condvar::new(),
        ahead: (0..workers).map(|_| CachePadded::default()).collect(),
    });
    let receivers = (0..workers)
        .map(|index| Receiver {
            jobs: Arc::clone(&jobs),
            index,
            takes_ahead: Cell::new(true),
        })
        .collect();
    (Sender { jobs, closes: true }, receivers)
}

impl Jobs {
    /// How many jobs wait for a worker, taken ahead or not.
    fn len(&self) -> usize {
        let queue = lock(&self.queue);
        queue.jobs.len()
            + queue
                .holders
                .iter()
                .map(|&holder| lock(&self.ahead[holder]).len())
                .sum::<usize>()
    }
}

/// A sending end: the fetcher's, whose drop tells the workers that no more jobs come, or the acker's
/// ([`Sender::also`]).
#[derive(Debug)]
pub struct Sender {
    jobs: Arc<Jobs>,
    /// Whether dropping this end closes the queue: the fetcher's only.
    closes: bool,
}

impl Sender {
    /// A second end to the same workers, for the acker's handed-over tasks: dropping it closes nothing, and what
    /// it sends once the fetcher's end closed the queue is refused (the workers may have ended already).
    pub fn also(&self) -> Sender {
        Sender {
            jobs: Arc::clone(&self.jobs),
            closes: false,
        }
    }

    /// Adds a take's jobs, in order; gives them back when no worker is left to take them, or the queue is
    /// closed (a job queued then might find every worker gone).
    pub fn send(&self, jobs: Vec<Job>) -> Result<(), Vec<Job>> {
        let mut queue = lock(&self.jobs.queue);
        if queue.receivers == 0 || queue.closed {
            return Err(jobs);
        }
        let wake = queue.waiting.min(jobs.len());
        queue.jobs.extend(jobs);
        drop(queue);
        for _ in 0..wake {
            self.jobs.arrived.notify_one();
        }
        Ok(())
    }

    /// Records a take's tasks (a claim's or pop's, or a settle's handover) as held and gives them to the workers,
    /// or, once the lane stops claiming (`stopping`), hands them back at once: no worker may start a task after
    /// that. A take that lands after its owner's lease was lost (the heartbeat found it lost while the reply was
    /// on its way, and forgot what the owner held then) is forgotten at once instead, never held: its tasks are
    /// the monitors' (see [`Lane::hold`]). The caller counted the tasks in the lane's capacity.
    pub fn dispatch(&self, lane: &Lane, batch: Batch, stopping: bool) {
        let claimed_ns = lane.since_epoch(std::time::Instant::now());
        let states = batch.tasks.into_iter().map(|taken| {
            HeldState::new(taken.token, taken.level, lane.epoch).popped(
                taken.popped_by,
                taken.popped_scope,
                taken.holds_unique,
            )
        });
        let held = match lane.hold(states, batch.payloads) {
            Ok(held) => held,
            Err((owner, tasks)) => {
                let forgotten = lane.forget_unheld(tasks);
                tracing::warn!(
                    queue = %lane.name(),
                    %owner,
                    forgotten,
                    "a claim landed after its owner's lease was lost; its tasks are forgotten, and the monitors \
                     return them to the queue"
                );
                return;
            }
        };
        if stopping {
            for (id, state) in held {
                lane.hand_back_if_waiting(id, &state);
            }
            return;
        }
        let weights = &lane.queue.config.priority_weights;
        let held = if weights.is_empty() {
            held
        } else {
            in_turns(held, |(_, state)| state.level, weights)
        };
        let jobs = held
            .into_iter()
            .map(|(id, state)| Job {
                id,
                task: state,
                claimed_at_ms: batch.now_ms,
                claimed_ns,
            })
            .collect();
        // Refused only when every worker is gone, which happens after the fetcher, or (the acker's) once the
        // fetcher is gone.
        if let Err(jobs) = self.send(jobs) {
            for job in jobs {
                lane.hand_back_if_waiting(job.id, &job.task);
            }
        }
    }

    /// How many jobs wait for a worker.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        if self.closes {
            lock(&self.jobs.queue).closed = true;
            self.jobs.arrived.notify_all();
        }
    }
}

/// What [`Receiver::try_take`] found.
#[derive(Debug)]
pub enum Next {
    Job(Job),
    /// Nothing now; more may come.
    Empty,
    /// Nothing, and nothing more comes.
    Closed,
}

/// A worker's end; dropping it (the worker ended, or its thread died) counts it gone, and puts the jobs it took
/// ahead back in the queue.
#[derive(Debug)]
pub struct Receiver {
    jobs: Arc<Jobs>,
    /// This worker's list in `Jobs::ahead`.
    index: usize,
    /// Whether it takes jobs ahead (see [`Receiver::take_ahead`]).
    takes_ahead: Cell<bool>,
}

impl Receiver {
    /// Whether this worker takes jobs ahead from now on: the worker says so while its tasks are short (where a
    /// lock per job is a share of a task worth saving); with long ones it takes a job at a time, and nothing it
    /// holds waits for one to end. Yes, to begin with.
    pub fn take_ahead(&self, yes: bool) {
        self.takes_ahead.set(yes);
    }

    /// Whether this worker takes jobs ahead: whether its tasks are short.
    pub fn takes_ahead(&self) -> bool {
        self.takes_ahead.get()
    }

    /// This worker's index among the lane's, 0 to `workers - 1`: its lists are found by it (here, and its own
    /// outcomes' in `outcomes`).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The next job, without waiting.
    pub fn try_take(&self) -> Next {
        if let Some(job) = self.own_next() {
            return Next::Job(job);
        }
        let mut queue = lock(&self.jobs.queue);
        match self.next(&mut queue) {
            Some(job) => Next::Job(job),
            None if queue.closed => Next::Closed,
            None => Next::Empty,
        }
    }

    /// The next job, waiting for one; `None` once the fetcher is gone and every job was taken.
    pub fn take(&self) -> Option<Job> {
        if let Some(job) = self.own_next() {
            return Some(job);
        }
        let mut queue = lock(&self.jobs.queue);
        loop {
            if let Some(job) = self.next(&mut queue) {
                return Some(job);
            }
            if queue.closed {
                return None;
            }
            queue.waiting += 1;
            queue = recover(self.jobs.arrived.wait(queue));
            queue.waiting -= 1;
        }
    }

    /// The oldest job this worker took ahead.
    fn own_next(&self) -> Option<Job> {
        lock(&self.jobs.ahead[self.index]).pop_front()
    }

    /// With the queue's lock held and nothing taken ahead: the queue's next job (and this worker's share of the
    /// rest, taken ahead), or else the oldest job another worker took ahead.
    fn next(&self, queue: &mut Queue) -> Option<Job> {
        if let Some(job) = queue.jobs.pop_front() {
            let share = (queue.jobs.len() + 1) / queue.receivers.max(1);
            let ahead = if self.takes_ahead.get() {
                share.saturating_sub(1).min(AHEAD)
            } else {
                0
            };
            if ahead > 0 {
                lock(&self.jobs.ahead[self.index]).extend(queue.jobs.drain(..ahead));
                if !std::mem::replace(&mut queue.listed[self.index], true) {
                    queue.holders.push(self.index);
                }
            }
            return Some(job);
        }
        // The oldest job of the first holder that has one; holders found empty (this worker among them: it looks
        // here only with its own list empty) are no longer listed.
        let mut found = None;
        let Queue {
            holders, listed, ..
        } = queue;
        holders.retain(|&holder| {
            if found.is_some() {
                return true;
            }
            let mut ahead = lock(&self.jobs.ahead[holder]);
            found = ahead.pop_front();
            let keep = !ahead.is_empty();
            listed[holder] = keep;
            keep
        });
        found
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let mut queue = lock(&self.jobs.queue);
        queue.receivers -= 1;
        let index = self.index;
        queue.holders.retain(|&holder| holder != index);
        queue.listed[index] = false;
        let left = std::mem::take(&mut *lock(&self.jobs.ahead[index]));
        if !left.is_empty() {
            for job in left.into_iter().rev() {
                queue.jobs.push_front(job);
            }
            drop(queue);
            self.jobs.arrived.notify_all();
        }
    }
}

/// A take's tasks in the order of `weights`' turns between their levels (`level_of`), each level's in its own
/// order: a claim or pop of a weighted queue holds each level's tasks together (a list each), and its workers
/// would start them level by level, so that the first 1,000 starts of two big takes would be mostly the highest
/// level's. The same smooth weighted round-robin as turns.lua's, with credits of its own: the take's split
/// already followed the queue's shared credits.
fn in_turns<T>(items: Vec<T>, level_of: impl Fn(&T) -> usize, weights: &[u32]) -> Vec<T> {
    let mut levels: Vec<std::collections::VecDeque<T>> =
        (0..weights.len()).map(|_| Default::default()).collect();
    let count = items.len();
    for item in items {
        let level = level_of(&item).min(weights.len() - 1);
        levels[level].push_back(item);
    }
    let mut credits = vec![0i64; weights.len()];
    let mut ordered = Vec::with_capacity(count);
    while ordered.len() < count {
        let (mut total, mut best) = (0i64, None::<usize>);
        for (level, queued) in levels.iter().enumerate() {
            if queued.is_empty() {
                continue;
            }
            let weight = i64::from(weights[level]);
            total += weight;
            credits[level] += weight;
            if best.is_none_or(|best| credits[level] > credits[best]) {
                best = Some(level);
            }
        }
        // Some level has an item while fewer than `count` are ordered.
        let best = best.expect("an item is left");
        credits[best] -= total;
        ordered.extend(levels[best].pop_front());
    }
    ordered
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::lane::resolve::{HeldState, HeldTask};
    use std::time::Instant;

    fn job(id: u64) -> Job {
        Job {
            id,
            task: HeldTask::alone(HeldState::new(None, 0, Instant::now()), b""),
            claimed_at_ms: 0,
            claimed_ns: 0,
        }
    }

    #[test]
    fn jobs_go_in_order_and_the_workers_end_once_the_fetcher_is_gone_and_nothing_is_left() {
        let (sender, mut receivers) = queue(2);
        let (a, b) = (receivers.remove(0), receivers.remove(0));
        assert!(matches!(a.try_take(), Next::Empty));
        sender.send(vec![job(1), job(2), job(3)]).unwrap();
        assert_eq!(sender.len(), 3);
        assert!(matches!(a.try_take(), Next::Job(job) if job.id == 1));
        assert_eq!(b.take().map(|job| job.id), Some(2));
        drop(sender);
        assert!(matches!(a.try_take(), Next::Job(job) if job.id == 3));
        assert!(matches!(a.try_take(), Next::Closed));
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
        while lock(&sender.jobs.queue).waiting < 2 {
            std::thread::yield_now();
        }
        sender.send(vec![job(7)]).unwrap();
        drop(sender);
        let mut got: Vec<_> = waiting.into_iter().map(|t| t.join().unwrap()).collect();
        got.sort();
        assert_eq!(got, [None, Some(7)]);
    }

    /// A queue of two workers, and a claim of `jobs` sent to it.
    fn two_workers(jobs: impl Iterator<Item = u64>) -> (Sender, Receiver, Receiver) {
        let (sender, mut receivers) = queue(2);
        let (a, b) = (receivers.remove(0), receivers.remove(0));
        sender.send(jobs.map(job).collect()).unwrap();
        (sender, a, b)
    }

    fn ids(receiver: &Receiver, n: usize) -> Vec<u64> {
        (0..n)
            .map(|_| match receiver.try_take() {
                Next::Job(job) => job.id,
                other => panic!("expected a job, got {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_worker_takes_its_share_ahead_and_an_idle_worker_takes_the_oldest_of_them() {
        let (sender, a, b) = two_workers(1..=8);
        // 8 jobs, 2 workers: a runs 1 and takes 2, 3 and 4 ahead; b runs 5 and takes 6 ahead (of 4 left).
        assert_eq!(ids(&a, 1), [1]);
        assert_eq!(sender.len(), 7, "jobs taken ahead still wait for a worker");
        assert_eq!(ids(&b, 4), [5, 6, 7, 8]);
        // Nothing left in the queue: b takes what a took ahead, oldest first, as a (busy) would have.
        assert_eq!(ids(&b, 1), [2]);
        assert_eq!(b.take().map(|job| job.id), Some(3));
        assert_eq!(ids(&a, 1), [4]);
        assert!(matches!(a.try_take(), Next::Empty));
        assert!(matches!(b.try_take(), Next::Empty));
        assert!(sender.is_empty());
    }

    #[test]
    fn a_worker_takes_at_most_ahead_jobs_ahead_and_none_from_a_short_queue() {
        let (sender, a, b) = two_workers(0..200);
        a.try_take();
        assert_eq!(lock(&a.jobs.ahead[a.index]).len(), AHEAD);
        assert_eq!(sender.len(), 199);
        drop(ids(&b, 199));
        // Three jobs for two workers: less than two each, so none is taken ahead.
        sender.send((0..3).map(job).collect()).unwrap();
        a.try_take();
        assert!(lock(&a.jobs.ahead[a.index]).is_empty());
    }

    #[test]
    fn a_worker_of_long_tasks_takes_one_job_at_a_time() {
        let (_sender, a, _b) = two_workers(1..=8);
        a.take_ahead(false);
        assert_eq!(ids(&a, 1), [1]);
        assert!(lock(&a.jobs.ahead[a.index]).is_empty());
        a.take_ahead(true);
        assert_eq!(ids(&a, 1), [2]);
        assert_eq!(
            lock(&a.jobs.ahead[a.index]).len(),
            2,
            "3 and 4, of the 6 left for 2 workers"
        );
    }

    #[test]
    fn a_worker_gone_gives_back_the_jobs_it_took_ahead_in_their_order() {
        let (sender, a, b) = two_workers(1..=8);
        assert_eq!(ids(&a, 1), [1]);
        drop(a);
        assert_eq!(sender.len(), 7);
        assert_eq!(ids(&b, 7), [2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn the_ackers_end_closes_nothing_and_is_refused_once_the_fetchers_end_is_gone() {
        let (sender, receivers) = queue(1);
        let acker = sender.also();
        acker.send(vec![job(1)]).unwrap();
        drop(acker);
        assert!(matches!(receivers[0].try_take(), Next::Job(job) if job.id == 1));
        assert!(matches!(receivers[0].try_take(), Next::Empty), "still open");
        let acker = sender.also();
        drop(sender);
        assert!(matches!(receivers[0].try_take(), Next::Closed));
        let refused = acker.send(vec![job(2)]).expect_err("the queue is closed");
        assert_eq!(refused.len(), 1);
    }

    #[test]
    fn jobs_are_refused_once_every_worker_is_gone() {
        let (sender, receivers) = queue(1);
        drop(receivers);
        let refused = sender.send(vec![job(1)]).expect_err("no worker");
        assert_eq!(refused.len(), 1);
    }

    #[test]
    fn a_take_is_ordered_by_the_levels_turns_and_a_dry_level_gives_its_turns_away() {
        let take: Vec<(usize, u32)> = (0..6)
            .map(|i| (0, i))
            .chain((0..3).map(|i| (1, i)))
            .chain((0..1).map(|i| (2, i)))
            .collect();
        let ordered = in_turns(take, |(level, _)| *level, &[6, 3, 1]);
        let levels: Vec<usize> = ordered.iter().map(|(level, _)| *level).collect();
        assert_eq!(
            levels,
            [0, 1, 0, 0, 1, 0, 2, 0, 1, 0],
            "nginx's sequence for 6:3:1"
        );
        let firsts: Vec<u32> = ordered
            .iter()
            .filter(|(level, _)| *level == 0)
            .map(|(_, n)| *n)
            .collect();
        assert_eq!(firsts, [0, 1, 2, 3, 4, 5], "each level in its own order");
        let dry = in_turns(
            vec![(0, 0), (0, 1), (2, 0)],
            |(level, _)| *level,
            &[1, 5, 1],
        );
        assert_eq!(dry, [(0, 0), (2, 0), (0, 1)]);
    }
}
