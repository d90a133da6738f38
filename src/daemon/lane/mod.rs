//! A lane: the pipeline of one queue, in the order a task flows through it.
//!
//! ```text
//!  Redis ──claim/pop──▶ fetcher ──jobs (bounded)──▶ workers ──outcomes (bounded)──▶ acker ──settle──▶ Redis
//!                          │                           │                             ▲
//!                          └──── held tasks, capacity ─┴── timeouts, heartbeat, shutdown (resolve.rs) ──┘
//! ```
//!
//! - [`fetcher`]: takes tasks from Redis, never more than [`capacity`] allows;
//! - [`worker`]: `workers` threads that run tasks through their plugin;
//! - [`jobs`]: the claimed tasks on their way to the workers;
//! - [`outcomes`]: the resolved tasks' outcomes on their way to the acker;
//! - [`acker`]: applies outcomes to Redis in batches, then forgets the tasks and frees their capacity;
//! - [`resolve`]: who decides a held task's outcome (exactly one party), with the state diagram;
//! - [`capacity`]: how many tasks the lane may hold, counting workers stuck in a handler as used;
//! - [`depth`]: the prefetch, adapted to what the lane measures when the config does not set it;
//! - [`slots`]: the `workers` slots a task holds while it runs, in a worker or started in its plugin;
//! - [`started`]: what a plugin's `complete` does with a task it took in `start`;
//! - [`progress`]: the latest progress report of each running task, which the acker writes to Redis;
//! - [`held`]: the table of the tasks the lane holds, from their claim until they are settled;
//! - [`ownership`]: this daemon's owner on the queue, what it knows of its lease, and each worker's view of it.
//!
//! The lane sits below the per-daemon threads that act on it (heartbeat, timeouts, notify, metrics) and names
//! nothing of the daemon but itself (ARCHITECTURE.md, "Layout"): what its stages beat for the watchdog is a
//! [`Pulse`], and how long each may go without a beat its own `stall_bound` (the fetcher's: [`fetcher_stall_bound`]).
//!
//! Each stage ends when its upstream is done: the workers when the fetcher has dropped the job queue and it
//! is empty; the acker when the fetcher is gone and every task it claimed is settled (held reaches zero). The
//! acker counts held tasks rather than waiting for every outcome sender to drop, because a worker stuck in a
//! handler that ignores its cancel flag never returns, so its sender would never drop; its task was resolved by
//! someone else, whose outcome the acker does wait for. The supervisor (`daemon`) joins the stages in that order,
//! each with a bounded wait.

pub mod acker;
pub mod capacity;
pub mod depth;
pub mod fetcher;
pub mod held;
pub mod jobs;
pub mod outcomes;
pub mod ownership;
pub mod progress;
pub mod resolve;
pub mod slots;
pub mod started;
pub mod worker;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rustc_hash::FxHashSet;

use crate::broker::payloads::Payloads;
use crate::config::{QueueConfig, RedisConfig};
use crate::poison::{lock, read, write};
use crate::pulse::Pulse;
use crate::queue::QueueContext;
use capacity::Capacity;
use depth::IdleTime;
pub use held::{HeldTable, Tasks};
pub use ownership::{LeaseView, Ownership};
use resolve::{HeldState, HeldTask};

/// How long the lane's fetcher may go without a beat of its pulse before the watchdog counts it as wedged:
/// everything one turn of its loop may wait, added up, so that a Redis that is down, slow or failing over never
/// counts (the daemon is right to wait for it) and only a hang nothing bounds does: waiting for capacity, then
/// register + claim (or pop) + the idle wait in Redis (`idle_poll` beyond its read timeout), one more reply for a
/// cluster's redirect, then the retry backoff after a failure. With the defaults (`idle_poll` 1 s,
/// `connect_timeout` 5 s, `io_timeout` 10 s, `wait_timeout` 100 ms): 51.3 s.
pub fn fetcher_stall_bound(redis: &RedisConfig, queue: &QueueConfig) -> Duration {
    fetcher::CAPACITY_WAIT + queue.idle_poll + redis.call_bound(4) + crate::retry::Backoff::MAX
}

/// What the threads of one lane, and the per-daemon threads that act on it, share.
#[derive(Debug)]
pub struct Lane {
    pub queue: Arc<QueueContext>,
    pub capacity: Capacity,
    /// How many of its tasks run at once (the queue's `workers`), in worker threads or started in a plugin.
    pub slots: slots::Slots,
    /// What its tasks started in a plugin share.
    pub started: started::StartedTasks,
    /// The time the workers spent waiting for a task (what an adaptive prefetch watches).
    pub idle: IdleTime,
    /// The tasks this daemon holds for the queue: claimed and not yet settled.
    pub held: HeldTable,
    /// This daemon's claim identity on the queue.
    pub ownership: Ownership,
    /// Tasks taken from their worker while it ran them, whose handler has not returned yet (the timeouts thread
    /// declares their workers stuck after a while, and forgets them when the handler returns).
    orphans: Mutex<Vec<(HeldTask, Instant)>>,
    /// Set by the fetcher when it stops: nothing will be claimed any more.
    fetcher_done: AtomicBool,
    /// Every resolution's outcome, for the acker: the workers', and those made outside them (timeouts,
    /// hand-backs, lost leases, tasks a plugin started).
    pub outcomes: outcomes::Outcomes,
    /// The reference point for the times kept in atomics.
    pub epoch: Instant,
    /// Bumped by the fetcher every turn of its loop, and by the acker every turn and every settle attempt: the
    /// watchdog's sign that they are not hung (`daemon::watchdog`).
    pub fetcher_pulse: Pulse,
    pub acker_pulse: Pulse,
    /// Bumped by the queue's delay poller every turn, and by its source mover (if it has `source_lists`).
    pub delay_pulse: Pulse,
    pub sources_pulse: Pulse,
    /// Outcomes Redis refused (alone in a settle call), which the acker holds and tries again: for the metrics
    /// and the status line, since such a task neither runs nor leaves until Redis takes its outcome.
    pub refused_outcomes: AtomicUsize,
    /// The latest progress report of each of its tasks that reported, for the acker to write; the same table as
    /// the sink its runs report to ([`Lane::progress_sink`]).
    pub progress: Arc<progress::Reports>,
    pub progress_sink: Arc<dyn kmq_plugin::host::ProgressSink>,
    /// Task types that came with no plugin to handle them, so that each is warned about once, not per task.
    unhandled_types: Mutex<FxHashSet<String>>,
}

impl Lane {
    /// A lane for `queue`, holding nothing and under no owner yet: its fetcher registers one at its first claim,
    /// named from `instance` (this daemon run's id, so that owners of two runs never collide). `epoch` is the
    /// daemon's: the reference point of the times the lane keeps in atomics.
    pub fn new(queue: Arc<QueueContext>, instance: &str, epoch: Instant) -> Lane {
        let config = &queue.config;
        let prefetch = config.initial_prefetch();
        let progress = Arc::new(progress::Reports::default());
        Lane {
            capacity: Capacity::new(config.workers, prefetch, config.batch),
            slots: slots::Slots::new(config.workers),
            started: started::StartedTasks::new(&config.name, epoch),
            idle: IdleTime::default(),
            held: HeldTable::default(),
            ownership: Ownership::new(instance),
            orphans: Mutex::new(Vec::new()),
            fetcher_done: AtomicBool::new(false),
            outcomes: outcomes::Outcomes::new(config.workers),
            epoch,
            fetcher_pulse: Pulse::default(),
            acker_pulse: Pulse::default(),
            delay_pulse: Pulse::default(),
            sources_pulse: Pulse::default(),
            refused_outcomes: AtomicUsize::new(0),
            unhandled_types: Mutex::default(),
            progress: Arc::clone(&progress),
            progress_sink: progress,
            queue,
        }
    }

    pub fn name(&self) -> &str {
        &self.queue.config.name
    }

    /// `at` as ns since the lane's epoch: a worker's one clock read per task, in the form its other times take
    /// (a task's start, its claim, its handler's run).
    pub fn since_epoch(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// Records a task taken from its worker while it ran.
    pub fn orphaned(&self, state: HeldTask) {
        lock(&self.orphans).push((state, Instant::now()));
    }

    /// The orphans whose handler has not returned, with when they were orphaned; forgets the others.
    pub fn orphans(&self) -> Vec<(HeldTask, Instant)> {
        let mut orphans = lock(&self.orphans);
        orphans.retain(|(state, _)| state.is_orphaned());
        orphans.clone()
    }

    /// Whether `kind` is a type this lane meets without a handler for the first time (the caller warns).
    pub fn first_unhandled(&self, kind: &str) -> bool {
        let mut seen = lock(&self.unhandled_types);
        !seen.contains(kind) && seen.insert(kind.to_string())
    }

    pub fn fetcher_stopped(&self) {
        self.fetcher_done.store(true, Ordering::Release);
    }

    /// Whether the lane is done: the fetcher stopped and every task it claimed is settled or forgotten.
    pub fn drained(&self) -> bool {
        self.fetcher_done.load(Ordering::Acquire) && self.capacity.held() == 0
    }

    /// Records the tasks of one claim (or pop) as held, unless they were claimed under an owner whose lease was
    /// lost meanwhile: those are returned, with their owner, for the caller to forget (no worker may see them;
    /// the monitors return them to the queue). The look at the owner and the insertion are one step under the
    /// lock [`Ownership::lose`] takes, so either the tasks are held before the owner is lost, and the resolver
    /// that lost it ([`Lane::forget_owner`], after `lose`) finds them, or they are never held: a claim whose reply
    /// is handled after its owner was forgotten cannot leave tasks in the table that nobody will resolve. One
    /// lock of the ownership's per claim, beside the table's.
    pub fn hold(
        &self,
        claim: impl IntoIterator<Item = HeldState>,
        payloads: Payloads,
    ) -> Result<Tasks, (Arc<str>, Tasks)> {
        let tasks = self.held.number(claim, payloads);
        // A claim's tasks share its owner (default mode's pops have none: no lease covers them).
        let owner = tasks
            .first()
            .and_then(|(_, task)| task.token.as_ref())
            .map(|token| Arc::clone(&token.owner));
        debug_assert!(
            tasks.iter().all(|(_, task)| {
                task.token.as_ref().map(|token| &token.owner) == owner.as_ref()
            })
        );
        let Some(owner) = owner else {
            self.held.insert(&tasks);
            return Ok(tasks);
        };
        match self
            .ownership
            .while_current(&owner, || self.held.insert(&tasks))
        {
            Some(()) => Ok(tasks),
            None => Err((owner, tasks)),
        }
    }
}

/// The lanes the daemon runs, as the per-daemon threads that act on every lane (heartbeat, timeouts, notify,
/// metrics) see them: a reload adds a queue's new lane and, once a replaced or removed lane has settled
/// everything and released its owner, takes the old one out. Each reader takes a snapshot per turn.
#[derive(Debug, Default)]
pub struct LaneSet {
    lanes: RwLock<Arc<Vec<Arc<Lane>>>>,
}

impl LaneSet {
    pub fn new(lanes: Vec<Arc<Lane>>) -> Arc<LaneSet> {
        Arc::new(LaneSet {
            lanes: RwLock::new(Arc::new(lanes)),
        })
    }

    /// The lanes now, in the order they were started.
    pub fn snapshot(&self) -> Arc<Vec<Arc<Lane>>> {
        Arc::clone(&read(&self.lanes))
    }

    /// One lane per queue, the newest: while a reload replaces a queue's lane, the old one (finishing its running
    /// tasks) is left out.
    pub fn newest(&self) -> Vec<Arc<Lane>> {
        let lanes = self.snapshot();
        let mut newest: Vec<Arc<Lane>> = Vec::with_capacity(lanes.len());
        for lane in lanes.iter() {
            match newest.iter_mut().find(|l| l.name() == lane.name()) {
                Some(slot) => *slot = Arc::clone(lane),
                None => newest.push(Arc::clone(lane)),
            }
        }
        newest
    }

    pub fn add(&self, lane: Arc<Lane>) {
        let mut lanes = write(&self.lanes);
        let mut next = Vec::clone(&lanes);
        next.push(lane);
        *lanes = Arc::new(next);
    }

    pub fn remove(&self, lane: &Arc<Lane>) {
        let mut lanes = write(&self.lanes);
        let next = lanes
            .iter()
            .filter(|l| !Arc::ptr_eq(l, lane))
            .cloned()
            .collect();
        *lanes = Arc::new(next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::Token;

    /// A safe-mode lane of its own, its owner registered with a long lease.
    fn lane_with_owner() -> (Lane, Arc<str>) {
        let config = crate::config::Config::parse(
            std::path::Path::new("kmqd.toml"),
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\n",
        )
        .unwrap();
        let context = QueueContext::new(&config, &config.queues[0], "daemon");
        let lane = Lane::new(Arc::new(context), "h-1-2-ab", Instant::now());
        let owner = lane.ownership.new_id();
        let now = Instant::now();
        let lease = crate::broker::LeaseClock {
            now_ms: 0,
            left_ms: 30_000,
        };
        let call = ownership::Exchange {
            sent: now,
            answered: now,
        };
        lane.ownership.set(Arc::clone(&owner), call, lease);
        (lane, owner)
    }

    /// The states and payloads of a claim of `count` tasks under `owner`.
    fn claim(lane: &Lane, owner: &Arc<str>, count: u32) -> (Vec<HeldState>, Payloads) {
        let mut payloads = Payloads::default();
        let states = (0..count)
            .map(|position| {
                payloads.push(b"{}");
                let token = Token {
                    owner: Arc::clone(owner),
                    id: crate::broker::TokenId::Listed { claim: 0, position },
                };
                HeldState::new(Some(token), 0, lane.epoch)
            })
            .collect();
        (states, payloads)
    }

    fn forgotten(lane: &Lane) -> usize {
        let mut outcomes = Vec::new();
        lane.outcomes.take(&mut outcomes, Duration::ZERO);
        assert!(
            outcomes
                .iter()
                .all(|outcome| outcome.settlement().is_none())
        );
        outcomes.len()
    }

    #[test]
    fn a_claim_held_before_its_owner_is_lost_is_forgotten_with_it_and_one_after_is_never_held() {
        let (lane, owner) = lane_with_owner();
        let (states, payloads) = claim(&lane, &owner, 2);
        let held = lane.hold(states, payloads).expect("the owner is current");
        assert_eq!((held.len(), lane.held.len()), (2, 2));
        assert!(lane.ownership.lose(&owner));
        assert_eq!(
            lane.forget_owner(&owner),
            2,
            "the held ones are the loser's"
        );
        // A claim of the lost owner that lands now is not held: its tasks come back for the fetcher to forget.
        let (states, payloads) = claim(&lane, &owner, 3);
        let (lost, tasks) = lane.hold(states, payloads).expect_err("the owner was lost");
        assert_eq!((&*lost, tasks.len(), lane.held.len()), (&*owner, 3, 2));
        assert_eq!(lane.forget_unheld(tasks), 3);
        assert_eq!(
            forgotten(&lane),
            5,
            "one outcome each, to free its capacity"
        );
    }

    #[test]
    fn every_task_of_a_claim_racing_its_owners_loss_is_forgotten_once_by_one_side() {
        for _ in 0..200 {
            let (lane, owner) = lane_with_owner();
            let (states, payloads) = claim(&lane, &owner, 4);
            let (forgotten_by_loser, by_fetcher) = std::thread::scope(|scope| {
                let loser = scope.spawn(|| {
                    assert!(lane.ownership.lose(&owner));
                    lane.forget_owner(&owner)
                });
                let by_fetcher = match lane.hold(states, payloads) {
                    Ok(_) => 0,
                    Err((_, tasks)) => lane.forget_unheld(tasks),
                };
                (loser.join().unwrap(), by_fetcher)
            });
            assert_eq!(forgotten_by_loser + by_fetcher, 4);
            assert!(
                forgotten_by_loser == 0 || by_fetcher == 0,
                "a claim is forgotten whole"
            );
            assert_eq!(forgotten(&lane), 4);
        }
    }
}
