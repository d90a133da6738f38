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
//! - [`started`]: what a plugin's `complete` does with a task it took in `start`.
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
pub mod jobs;
pub mod outcomes;
pub mod resolve;
pub mod slots;
pub mod started;
pub mod worker;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use rustc_hash::{FxHashMap, FxHashSet};

use crate::broker::Token;
use crate::broker::payloads::Payloads;
use crate::config::{QueueConfig, RedisConfig};
use crate::pulse::Pulse;
use crate::queue::QueueContext;
use capacity::Capacity;
use depth::IdleTime;
use resolve::{JobId, JobState, Outcome, Task};

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
    pub held: Held,
    /// This daemon's claim identity on the queue.
    pub ownership: Ownership,
    /// Tasks taken from their worker while it ran them, whose handler has not returned yet (the timeouts thread
    /// declares their workers stuck after a while, and forgets them when the handler returns).
    orphans: Mutex<Vec<(Task, Instant)>>,
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
    /// Task types that came with no plugin to handle them, so that each is warned about once, not per task.
    unhandled_types: Mutex<FxHashSet<String>>,
}

impl Lane {
    /// A lane for `queue`.
    pub fn new(queue: Arc<QueueContext>, instance: &str, epoch: Instant) -> Lane {
        let config = &queue.config;
        let prefetch = config.initial_prefetch();
        Lane {
            capacity: Capacity::new(config.workers, prefetch, config.batch),
            slots: slots::Slots::new(config.workers),
            started: started::StartedTasks::new(&config.name, epoch),
            idle: IdleTime::default(),
            held: Held::default(),
            ownership: Ownership::new(instance),
            orphans: Mutex::new(Vec::new()),
            fetcher_done: AtomicBool::new(false),
            outcomes: outcomes::Outcomes::new(config.workers),
            epoch,
            fetcher_pulse: Pulse::default(),
            acker_pulse: Pulse::default(),
            delay_pulse: Pulse::default(),
            sources_pulse: Pulse::default(),
            unhandled_types: Mutex::default(),
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

    /// Sends a resolved task's outcome to the acker.
    pub fn send(&self, outcome: Outcome) {
        self.outcomes.push(outcome);
    }

    /// Records a task taken from its worker while it ran.
    pub fn orphaned(&self, state: Task) {
        lock(&self.orphans).push((state, Instant::now()));
    }

    /// The orphans whose handler has not returned, with when they were orphaned; forgets the others.
    pub fn orphans(&self) -> Vec<(Task, Instant)> {
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
        claim: impl IntoIterator<Item = JobState>,
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
        Arc::clone(&self.lanes.read().unwrap_or_else(|p| p.into_inner()))
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
        let mut lanes = self.lanes.write().unwrap_or_else(|p| p.into_inner());
        let mut next = Vec::clone(&lanes);
        next.push(lane);
        *lanes = Arc::new(next);
    }

    pub fn remove(&self, lane: &Arc<Lane>) {
        let mut lanes = self.lanes.write().unwrap_or_else(|p| p.into_inner());
        let next = lanes
            .iter()
            .filter(|l| !Arc::ptr_eq(l, lane))
            .cloned()
            .collect();
        *lanes = Arc::new(next);
    }
}

/// A lock of the lane's (here and in its modules: the job and outcome lists, the started tasks' plugins).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every lock here guards plain collections whose operations (push, pop, drain, swap) do not panic midway; a
    // poisoned one is consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The tasks of one claim (or pop), each with its id in the lane's table of held tasks.
pub type Tasks = Vec<(JobId, Task)>;

/// The table of the tasks a lane holds. The hot path takes its lock once per claimed batch (insert) and once per
/// settled batch (remove); a task's phase is an atomic in its [`JobState`], shared with the worker.
#[derive(Debug, Default)]
pub struct Held {
    entries: Mutex<FxHashMap<JobId, Task>>,
    next_id: AtomicU64,
}

impl Held {
    /// The newly taken tasks of one claim (or pop), each with an id of its own; not held yet (see
    /// [`Held::insert`]).
    pub fn number(&self, claim: impl IntoIterator<Item = JobState>, payloads: Payloads) -> Tasks {
        Task::claim(claim, payloads)
            .map(|task| (self.next_id.fetch_add(1, Ordering::Relaxed), task))
            .collect()
    }

    /// Records the tasks of one claim (or pop) as held, under one lock.
    pub fn insert(&self, tasks: &[(JobId, Task)]) {
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

    pub fn len(&self) -> usize {
        lock(&self.entries).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many held tasks `matches` selects (for the metrics).
    pub fn count(&self, mut matches: impl FnMut(&JobState) -> bool) -> usize {
        lock(&self.entries)
            .values()
            .filter(|state| matches(state))
            .count()
    }

    /// The held tasks `matches` selects, for a resolver to take.
    pub fn select(&self, mut matches: impl FnMut(&JobState) -> bool) -> Vec<(JobId, Task)> {
        lock(&self.entries)
            .iter()
            .filter(|(_, state)| matches(state))
            .map(|(id, state)| (*id, state.clone()))
            .collect()
    }
}

/// This daemon's owner on the queue (its identity, with one lease for every task it holds), what this daemon
/// knows of that lease, and the counter its claim tokens come from.
///
/// The fetcher registers an owner on its first fetch; when the lease is lost (the daemon was silent longer than
/// `lease_timeout`, or Redis lost it), the heartbeat or the fetcher drops it and the fetcher registers a new one.
/// Tasks claimed under the old owner keep their tokens, so their late outcomes are fenced against the monitors.
/// Owner ids are this daemon run's instance id and a generation: unique without asking Redis.
///
/// The lease is known good until `lease_timeout` after the last registration or renewal was *sent* (Redis
/// counts from when it ran, a little later), by the local monotonic clock, which also runs while the process is
/// stopped: a worker starts a task only while that holds ([`Ownership::may_start`]), so a daemon woken from a
/// pause longer than its lease starts nothing the monitors may have handed to another daemon meanwhile.
#[derive(Debug)]
pub struct Ownership {
    instance: String,
    current: Mutex<Option<Current>>,
    /// Bumped under `current`'s lock by every change that [`Ownership::may_start`] reads (a registration, a
    /// renewal, a loss): a worker's [`LeaseView`] is good while it is unchanged.
    changes: AtomicU64,
    generation: AtomicU64,
    next_token: AtomicU64,
}

/// One worker's copy of the current owner and how long its lease is surely live, kept while
/// [`Ownership`]'s `changes` is unchanged: a task's lease check costs one load of a line written once per
/// heartbeat, instead of a lock every worker would take for every task and bounce between the cores
/// (docs/PERFORMANCE.md, "Workers that share less"), as [`crate::plugin::Reader`] does for the plugins.
#[derive(Debug)]
pub struct LeaseView {
    seen: u64,
    lease: Option<ViewedLease>,
}

#[derive(Debug)]
struct ViewedLease {
    /// The current owner's id, as its tokens share it: compared by pointer first.
    owner: Arc<str>,
    /// The same id in an allocation of this view's own, which the settlements of this worker's tasks name (see
    /// [`LeaseView::token`]).
    own: Arc<str>,
    good_until: Instant,
}

impl LeaseView {
    /// `token` as a settlement of this worker's carries it: naming its owner by this view's own copy of the id
    /// when it is the current owner. A copy of the shared `Arc` per task would write its count, a line the
    /// fetcher, every worker and the acker would write for every task; with its own copy, a worker shares the
    /// count with the acker alone, which drops a batch of them at once.
    pub fn token(&self, token: &Token) -> Token {
        let owner = match &self.lease {
            Some(lease) if Arc::ptr_eq(&lease.owner, &token.owner) => &lease.own,
            _ => &token.owner,
        };
        Token {
            owner: Arc::clone(owner),
            id: token.id.clone(),
        }
    }

    /// Whether `owner`, the owner of a task of this worker's that [`Ownership::may_start`] just refused with this
    /// view, was lost for good: it is not the current owner (an owner was current before any task of it was
    /// claimed, and never is again once lost: a new owner has a new id). Otherwise it is only in doubt: current,
    /// its lease not renewed yet.
    pub fn is_lost(&self, owner: &Arc<str>) -> bool {
        self.lease
            .as_ref()
            .is_none_or(|lease| !Arc::ptr_eq(&lease.owner, owner) && lease.owner != *owner)
    }
}

impl Default for LeaseView {
    fn default() -> LeaseView {
        LeaseView {
            // No count of changes: the first check reads the current owner.
            seen: u64::MAX,
            lease: None,
        }
    }
}

#[derive(Debug)]
struct Current {
    owner: Arc<str>,
    /// Until when the lease is surely live.
    good_until: Instant,
    /// How many of the owner's journal bumps Redis acknowledged (renew.lua): one per claim that took tasks, per
    /// adoption that found a lost claim's tasks, per settle call of the owner answered with a bump (a call sent
    /// again is answered once). A count, not the highest value seen: after a rewind lost k bumps, Redis's journal
    /// stays k below it whatever is claimed and settled next.
    journal: u64,
}

impl Ownership {
    pub fn new(instance: &str) -> Ownership {
        Ownership {
            instance: instance.to_string(),
            current: Mutex::new(None),
            changes: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            next_token: AtomicU64::new(0),
        }
    }

    /// The owner to claim under, if one is registered.
    pub fn current(&self) -> Option<Arc<str>> {
        lock(&self.current)
            .as_ref()
            .map(|current| Arc::clone(&current.owner))
    }

    /// An owner id never used before, to register.
    pub fn new_id(&self) -> Arc<str> {
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        Arc::from(format!("{}.{generation}", self.instance))
    }

    /// Records a newly registered owner whose registration was sent at `sent` with a lease of `lease`.
    pub fn set(&self, owner: Arc<str>, sent: Instant, lease: Duration) {
        let mut current = lock(&self.current);
        *current = Some(Current {
            owner,
            good_until: sent + lease,
            journal: 0,
        });
        self.changed();
    }

    /// Tells the workers' views that what `may_start` reads changed; called with `current`'s lock held, after the
    /// change, so that a view that sees the new count reads the new value.
    fn changed(&self) {
        self.changes.fetch_add(1, Ordering::Release);
    }

    /// Redis answered a call of `owner` that added one to its journal: a claim that took tasks, an adoption that
    /// found the lost claim's tasks (that claim's bump), a settle call's answer with a journal (the first or the
    /// stored one: the settler reads one answer per call). Counted only from an answer, never for a call whose
    /// reply was lost: so the count never exceeds Redis's journal unless Redis lost writes, and falls behind it
    /// only until the lost reply is resolved (the claim adopted, the settle call answered); the fetcher's and the
    /// acker's bumps add up in any order.
    pub fn bumped(&self, owner: &str) {
        if let Some(current) = lock(&self.current).as_mut()
            && &*current.owner == owner
        {
            current.journal += 1;
        }
    }

    /// How many journal bumps of `owner` Redis acknowledged (0 if it is not current): Redis's journal is at least
    /// this unless it lost acknowledged writes (renew.lua).
    pub fn journal(&self, owner: &str) -> u64 {
        lock(&self.current)
            .as_ref()
            .filter(|current| &*current.owner == owner)
            .map_or(0, |current| current.journal)
    }

    /// `owner`'s lease was renewed by a call sent at `sent`.
    pub fn renewed(&self, owner: &str, sent: Instant, lease: Duration) {
        if let Some(current) = lock(&self.current).as_mut() {
            if &*current.owner == owner {
                current.good_until = current.good_until.max(sent + lease);
                self.changed();
            }
        }
    }

    /// Whether a task claimed under `owner` may start at `now`: it is the current owner and its lease is surely live.
    /// `view`: the calling worker's, read again only when something changed since it was.
    pub fn may_start(&self, view: &mut LeaseView, owner: &Arc<str>, now: Instant) -> bool {
        if self.changes.load(Ordering::Acquire) != view.seen {
            let current = lock(&self.current);
            view.seen = self.changes.load(Ordering::Relaxed);
            view.lease = current.as_ref().map(|current| ViewedLease {
                owner: Arc::clone(&current.owner),
                own: Arc::from(&*current.owner),
                good_until: current.good_until,
            });
        }
        view.lease.as_ref().is_some_and(|lease| {
            (Arc::ptr_eq(&lease.owner, owner) || lease.owner == *owner) && now < lease.good_until
        })
    }

    /// Runs `f` if `owner` is the current owner, with the lock [`Ownership::lose`] takes held: `owner` cannot be
    /// lost between the look and the end of `f`. `None` when it is not current: its lease was lost, for good (a
    /// newer owner has a new id).
    pub fn while_current<R>(&self, owner: &str, f: impl FnOnce() -> R) -> Option<R> {
        let current = lock(&self.current);
        current
            .as_ref()
            .is_some_and(|current| &*current.owner == owner)
            .then(f)
    }

    /// Forgets `owner` after its lease was lost (unless a newer one replaced it already); true if it was current.
    pub fn lose(&self, owner: &str) -> bool {
        let mut current = lock(&self.current);
        if current.as_ref().is_some_and(|c| &*c.owner == owner) {
            *current = None;
            self.changed();
            return true;
        }
        false
    }

    /// Reserves `n` claim tokens; returns the first.
    pub fn tokens(&self, n: usize) -> u64 {
        self.next_token.fetch_add(n as u64, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_starts_only_while_its_owner_is_current_and_its_lease_surely_live() {
        let ownership = Ownership::new("h-1-2-ab");
        let owner = ownership.new_id();
        let t0 = Instant::now();
        // One view throughout, as a worker keeps it: each change below must reach it.
        let mut view = LeaseView::default();
        assert!(
            !ownership.may_start(&mut view, &owner, t0),
            "not registered yet"
        );
        let lease = Duration::from_millis(50);
        ownership.set(Arc::clone(&owner), t0, lease);
        assert!(ownership.may_start(&mut view, &owner, t0));
        assert!(!ownership.may_start(&mut view, &Arc::from("someone-else.1"), t0));
        let later = t0 + lease;
        assert!(
            !ownership.may_start(&mut view, &owner, later),
            "past the lease, as after a pause"
        );
        ownership.renewed(&owner, later, lease);
        assert!(ownership.may_start(&mut view, &owner, later), "renewed");
        assert!(ownership.lose(&owner));
        assert!(!ownership.may_start(&mut view, &owner, later));
    }

    #[test]
    fn a_workers_settlements_name_the_current_owner_by_its_own_copy_of_the_id() {
        let ownership = Ownership::new("h-1-2-ab");
        let owner = ownership.new_id();
        let now = Instant::now();
        ownership.set(Arc::clone(&owner), now, Duration::from_secs(30));
        let mut view = LeaseView::default();
        assert!(ownership.may_start(&mut view, &owner, now));
        let token = Token {
            owner: Arc::clone(&owner),
            id: crate::broker::TokenId::Listed {
                claim: 7,
                position: 3,
            },
        };
        let named = view.token(&token);
        assert_eq!(named, token, "the same owner and place");
        assert!(
            !Arc::ptr_eq(&named.owner, &owner),
            "the view's own copy: the shared id's count is not written"
        );
        assert!(Arc::ptr_eq(&view.token(&token).owner, &named.owner));
        let other = Token {
            owner: Arc::from("h-1-2-ab.0"),
            ..token
        };
        assert!(
            Arc::ptr_eq(&view.token(&other).owner, &other.owner),
            "another owner's token is named as it is"
        );
    }

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
        lane.ownership
            .set(Arc::clone(&owner), Instant::now(), Duration::from_secs(30));
        (lane, owner)
    }

    /// The states and payloads of a claim of `count` tasks under `owner`.
    fn claim(lane: &Lane, owner: &Arc<str>, count: u32) -> (Vec<JobState>, Payloads) {
        let mut payloads = Payloads::default();
        let states = (0..count)
            .map(|position| {
                payloads.push(b"{}");
                let token = Token {
                    owner: Arc::clone(owner),
                    id: crate::broker::TokenId::Listed { claim: 0, position },
                };
                JobState::new(Some(token), 0, lane.epoch)
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

    #[test]
    fn the_journal_counts_every_bump_of_the_current_owner_in_any_order() {
        let ownership = Arc::new(Ownership::new("h-1-2-ab"));
        let first = ownership.new_id();
        ownership.set(Arc::clone(&first), Instant::now(), Duration::from_secs(30));
        // The fetcher's claims and the acker's settles, concurrently: a count, whatever the interleaving (the
        // highest value seen would be beaten by bumps made after a rewind).
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (ownership, owner) = (Arc::clone(&ownership), Arc::clone(&first));
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        ownership.bumped(&owner);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(ownership.journal(&first), 2000);
        // A new owner counts from 0; a late answer for the old one counts for nobody.
        assert!(ownership.lose(&first));
        let second = ownership.new_id();
        ownership.set(Arc::clone(&second), Instant::now(), Duration::from_secs(30));
        ownership.bumped(&first);
        ownership.bumped(&second);
        assert_eq!(
            (ownership.journal(&first), ownership.journal(&second)),
            (0, 1)
        );
    }

    #[test]
    fn a_view_tells_a_lost_owner_from_one_in_doubt() {
        let ownership = Ownership::new("h-1-2-ab");
        let owner = ownership.new_id();
        let t0 = Instant::now();
        let lease = Duration::from_millis(50);
        ownership.set(Arc::clone(&owner), t0, lease);
        let mut view = LeaseView::default();
        assert!(!ownership.may_start(&mut view, &owner, t0 + lease));
        assert!(!view.is_lost(&owner), "current, not renewed yet: in doubt");
        assert!(ownership.lose(&owner));
        assert!(!ownership.may_start(&mut view, &owner, t0));
        assert!(view.is_lost(&owner), "forgotten");
        ownership.set(ownership.new_id(), t0, lease);
        assert!(!ownership.may_start(&mut view, &owner, t0));
        assert!(view.is_lost(&owner), "replaced by a newer owner");
    }

    #[test]
    fn a_lost_owner_is_forgotten_only_if_still_current() {
        let ownership = Ownership::new("host-1-2-ab");
        let (first, second) = (ownership.new_id(), ownership.new_id());
        assert_eq!((&*first, &*second), ("host-1-2-ab.1", "host-1-2-ab.2"));
        let lease = Duration::from_secs(30);
        ownership.set(Arc::from("o1"), Instant::now(), lease);
        ownership.set(Arc::from("o2"), Instant::now(), lease);
        assert!(!ownership.lose("o1"), "o2 replaced it");
        assert_eq!(ownership.current().as_deref(), Some("o2"));
        assert!(ownership.lose("o2"));
        assert_eq!(ownership.current(), None);
        assert_eq!((ownership.tokens(10), ownership.tokens(5)), (0, 10));
    }
}
