//! The workload: the queues and the daemons' two configs, the tasks the producers push (what each one's handler
//! does, chosen by its data), the producers themselves, and the seeded generator every random choice comes from.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kmqd::{Client, ClientError, NewTask};

use super::ledger::Pushed;
use super::world::{World, lock, now_us};

pub(super) const DAEMONS: usize = 3;
pub(super) const RETRY_TIMES: u32 = 3;
pub(super) const LEASE: Duration = Duration::from_secs(2);
pub(super) const LEVELS: [&str; 2] = ["high", "normal"];
pub(super) const DAEMON_SECTION: &str = "shutdown_grace = \"1s\"";
/// A daemon's `[daemon]` section: a metrics endpoint on a free port, which the slowloris fault attacks and the
/// drain asks what the daemon holds of the default-mode queue.
pub(super) const DAEMON_SERVING: &str = "shutdown_grace = \"1s\"\nmetrics_addr = \"127.0.0.1:0\"";
/// How a deaf handler behaves: three times the execution timeout, cancel ignored.
const DEAF: &str = r#"{"sleep_ms":3000,"ignore_cancel":true}"#;
const PILL: &str = r#"{"outcome":"abort"}"#;
/// `limited`'s `max_running` on config A and on config B (halved): the largest in use bounds its count.
pub(super) const LIMIT_A: u64 = 4;
pub(super) const LIMIT_B: u64 = 2;
pub(super) const LIMIT_BOUND: u64 = larger(LIMIT_A, LIMIT_B);

/// The larger of two limits (`max`, in a constant).
const fn larger(a: u64, b: u64) -> u64 {
    if a > b { a } else { b }
}
/// How long after its start a run of the limited queue surely still holds its slot, at most: an execution timeout
/// (1 s after the worker started it) settles it and frees the slot while a deaf handler still sleeps.
pub(super) const HOLDS_AT_MOST_MS: u64 = 500;
/// The task type of the queues without limits per type.
pub(super) const TEST: &str = "test";
/// The typed queue's task types: `slow` with its own `max_running`, `api` with its own `rate_limit`, `other`
/// with no limit of its own (docs/CONFIG.md, `[[queues.limits]]`).
pub(super) const SLOW: &str = "slow";
pub(super) const API: &str = "api";
pub(super) const OTHER: &str = "other";
/// The types the daemons' testkit plugin handles.
pub(super) const TYPES: [&str; 4] = [TEST, SLOW, API, OTHER];
/// `slow`'s `max_running` on config A and on config B (halved): the largest in use bounds its count.
pub(super) const SLOW_LIMIT_A: u64 = 2;
pub(super) const SLOW_LIMIT_B: u64 = 1;
pub(super) const SLOW_BOUND: u64 = larger(SLOW_LIMIT_A, SLOW_LIMIT_B);
/// `api`'s `rate_limit`, starts in any [`API_WINDOW`], on config A and on config B (halved): the largest in use
/// bounds its starts.
pub(super) const API_RATE_A: u64 = 20;
pub(super) const API_RATE_B: u64 = 10;
pub(super) const API_BOUND: u64 = larger(API_RATE_A, API_RATE_B);
pub(super) const API_WINDOW: Duration = Duration::from_secs(1);
/// The grouped queue's groups (`[queues.groups]`): [`WEIGHTED`] with weight 3 and 40 % of the steady load, the
/// others 20 % each, all under the same per-group limits.
pub(super) const GROUPS: [&str; 4] = ["g0", "g1", "g2", "g3"];
pub(super) const WEIGHTED: &str = "g0";
/// Each group's `max_running` on config A and on config B (halved): the largest in use bounds a group's count.
pub(super) const GROUP_LIMIT_A: u64 = 2;
pub(super) const GROUP_LIMIT_B: u64 = 1;
/// The grouped queue's limit on [`SLOW`] beside its groups (`[[queues.limits]]`): its `max_running` on config A
/// and on config B (halved); a quarter of the grouped queue's steady tasks are of that type.
pub(super) const GROUPED_SLOW_A: u64 = 2;
pub(super) const GROUPED_SLOW_B: u64 = 1;
pub(super) const GROUPED_SLOW_BOUND: u64 = larger(GROUPED_SLOW_A, GROUPED_SLOW_B);
pub(super) const GROUP_BOUND: u64 = larger(GROUP_LIMIT_A, GROUP_LIMIT_B);
/// Each group's `rate_limit`, starts in any [`API_WINDOW`], on config A and on config B (halved).
pub(super) const GROUP_RATE_A: u64 = 10;
pub(super) const GROUP_RATE_B: u64 = 5;
pub(super) const GROUP_RATE_BOUND: u64 = larger(GROUP_RATE_A, GROUP_RATE_B);

/// The queues, each with its own ledger entries, dead list and conservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Queue {
    /// Safe, two levels, prefetch, no running limit: the suite's original queue.
    Jobs,
    /// Safe, one level, `max_running` ([`LIMIT_A`], [`LIMIT_B`] on config B): its count is checked throughout.
    Limited,
    /// Default mode (at most once), one level: judged by default mode's rules (see [`Mode`]).
    Popped,
    /// Safe, one level, limits per task type ([`SLOW`]'s `max_running`, [`API`]'s `rate_limit`) beside a type
    /// without ([`OTHER`]): the type's count, its starts per window and the other type's waits are checked.
    Typed,
    /// Safe, one level, fair groups ([`GROUPS`], each with its own `max_running` and `rate_limit`, [`WEIGHTED`]
    /// weighted): each group's count, its starts per window and the flows at rest are checked.
    Grouped,
}

/// The most tasks of `popped` its daemons hold at once: each its `workers` and its `prefetch` (both configs), the
/// tasks taken from Redis and not settled yet. Default mode's tasks in a daemon's memory are in no key of Redis,
/// so those a daemon held when Redis lost its data are settled into the new epoch, where nothing counted their
/// push: up to this many more tasks than were pushed (see [`World::check_conservation`]).
pub(super) const POPPED_HELD_MAX: i64 = (2 + 4) * DAEMONS as i64;

/// How many queues there are: the ledger counts pushes per queue.
pub(super) const QUEUES: usize = Queue::ALL.len();

/// A queue's mode, which decides what the checks allow (docs/RELIABILITY.md, "The two modes"): in safe mode
/// nothing is lost and a task runs again at the same attempt only after a fault took it from its daemon (or Redis
/// lost or rewound its writes); in default mode a task never runs again at the same attempt, but for a push that
/// was repeated or Redis losing or rewinding its writes (at most once holds only while Redis keeps them), and
/// a task may be lost with the daemon that held it or a pop whose reply was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Safe,
    Default,
}

impl Queue {
    pub(super) const ALL: [Queue; 5] = [
        Queue::Jobs,
        Queue::Limited,
        Queue::Popped,
        Queue::Typed,
        Queue::Grouped,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            Queue::Jobs => "jobs",
            Queue::Limited => "limited",
            Queue::Popped => "popped",
            Queue::Typed => "typed",
            Queue::Grouped => "grouped",
        }
    }

    pub(super) fn mode(self) -> Mode {
        match self {
            Queue::Jobs | Queue::Limited | Queue::Typed | Queue::Grouped => Mode::Safe,
            Queue::Popped => Mode::Default,
        }
    }

    /// The prefix of its keys, `kmq:{name}`.
    pub(super) fn base(self) -> String {
        format!("kmq:{{{}}}", self.name())
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }

    /// The running count checked throughout, if the queue has one: its field of the `running` hash and the most
    /// it may hold (the limited queue's own, the typed queue's [`SLOW`]).
    pub(super) fn counted(self) -> Option<(&'static str, u64)> {
        match self {
            Queue::Limited => Some(("q", LIMIT_BOUND)),
            Queue::Typed => Some(("t:slow", SLOW_BOUND)),
            // The grouped queue's counts are one per group: see [`super::groups`].
            Queue::Jobs | Queue::Popped | Queue::Grouped => None,
        }
    }

    /// A task type for one of the queue's tasks: [`TEST`], but on the typed queue [`OTHER`] (40 %), [`API`]
    /// (35 %) or [`SLOW`] (25 %), and on the grouped queue [`SLOW`] (25 %, limited beside the groups).
    pub(super) fn pick_type(self, rng: &mut Rng) -> &'static str {
        if self == Queue::Grouped {
            return if rng.below(4) == 0 { SLOW } else { TEST };
        }
        if self != Queue::Typed {
            return TEST;
        }
        match rng.below(20) {
            0..8 => OTHER,
            8..15 => API,
            _ => SLOW,
        }
    }

    /// A group for one of the queue's tasks: none but on the grouped queue, [`WEIGHTED`] (40 %) or one of the
    /// others (20 % each).
    pub(super) fn pick_group(self, rng: &mut Rng) -> Option<&'static str> {
        if self != Queue::Grouped {
            return None;
        }
        Some(match rng.below(5) {
            0 | 1 => WEIGHTED,
            n => GROUPS[n as usize - 1],
        })
    }
}

/// The two configs of a rolling change. Both have `io_timeout = "1s"` (so a 2 s stall is a real timeout), and every
/// queue a 2 s lease, a 1 s execution timeout and `retry_times = 3`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shape {
    /// Both levels.
    A,
    /// Only "normal", fewer workers, more prefetch: while a daemon runs it, high tasks are served by the others;
    /// `limited`'s `max_running` halved, and fewer workers; the typed queue's limits halved, and fewer workers; the
    /// grouped queue's limits per group halved, and fewer workers.
    B,
}

impl Shape {
    /// The queues' sections. `popped` takes at most 4 tasks ahead (its adaptive prefetch could take thousands,
    /// which a kill -9 would lose at once: RELIABILITY.md, "The two modes").
    pub(super) fn queue(self) -> String {
        let (levels, workers, prefetch, batch) = match self {
            Shape::A => (r#"["high", "normal"]"#, 4, 4, 16),
            Shape::B => (r#"["normal"]"#, 2, 8, 8),
        };
        let limited_workers = match self {
            Shape::A => 4,
            Shape::B => 2,
        };
        let limit = self.limit();
        let (slow_limit, api_rate) = self.type_limits();
        let (group_limit, group_rate) = self.group_limits();
        let grouped_slow = match self {
            Shape::A => GROUPED_SLOW_A,
            Shape::B => GROUPED_SLOW_B,
        };
        let common = format!(
            "lease_timeout = \"{lease}s\"\nexecution_timeout = \"1s\"\nretry_times = {RETRY_TIMES}\n\
             backoff = \"200ms\"\nbackoff_max = \"2s\"\n",
            lease = LEASE.as_secs()
        );
        let flows = super::flows::queues(limited_workers, &common);
        let unique = super::unique::queues(2, &common);
        format!(
            "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\npriorities = {levels}\nworkers = {workers}\n\
             prefetch = {prefetch}\nbatch = {batch}\n{common}\n\
             [[queues]]\nname = \"limited\"\nmode = \"safe\"\nworkers = {limited_workers}\n\
             max_running = {limit}\n{common}\n\
             [[queues]]\nname = \"popped\"\nmode = \"default\"\nworkers = 2\nprefetch = 4\nbatch = 8\n{common}\n\
             [[queues]]\nname = \"typed\"\nmode = \"safe\"\nworkers = {limited_workers}\n{common}\n\
             [[queues.limits]]\ntype = \"{SLOW}\"\nmax_running = {slow_limit}\n\n\
             [[queues.limits]]\ntype = \"{API}\"\nrate_limit = \"{api_rate}/s\"\n\n\
             [[queues]]\nname = \"grouped\"\nmode = \"safe\"\nworkers = {limited_workers}\n{common}\n\
             [queues.groups]\nmax_running = {group_limit}\nrate_limit = \"{group_rate}/s\"\n\
             weights = {{ \"{WEIGHTED}\" = 3 }}\n\
             [[queues.limits]]\ntype = \"{SLOW}\"\nmax_running = {grouped_slow}\n\n{flows}{unique}"
        )
    }

    /// The grouped queue's limits of each group on this config: `max_running`, starts a second.
    pub(super) fn group_limits(self) -> (u64, u64) {
        match self {
            Shape::A => (GROUP_LIMIT_A, GROUP_RATE_A),
            Shape::B => (GROUP_LIMIT_B, GROUP_RATE_B),
        }
    }

    /// The typed queue's limits on this config: [`SLOW`]'s `max_running`, [`API`]'s starts a second.
    pub(super) fn type_limits(self) -> (u64, u64) {
        match self {
            Shape::A => (SLOW_LIMIT_A, API_RATE_A),
            Shape::B => (SLOW_LIMIT_B, API_RATE_B),
        }
    }

    /// `limited`'s `max_running` on this config.
    pub(super) fn limit(self) -> u64 {
        match self {
            Shape::A => LIMIT_A,
            Shape::B => LIMIT_B,
        }
    }
}

/// What a task's handler does, chosen by its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Work {
    /// Sleeps 1 to 20 ms: done.
    Normal,
    /// Fails its first run, then done.
    Flaky,
    /// Aborts the daemon: dead-lettered "crashed the daemon N times".
    Pill,
    /// Sleeps 3 s ignoring cancel: dead after its retries ("execution timeout"), or done if a run finished.
    Deaf,
    /// Its first run throttles the queue for 100 ms (back-pressure, `throttle_once`), then done: it runs again at
    /// the same attempt, a repeat the throttle explains.
    Throttled,
}

/// xorshift64*, seeded through splitmix64: enough randomness for picking faults, reproducible from one number.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)).max(1))
    }

    pub(super) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n`.
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// A duration between `lo` and `hi` ms.
    pub(super) fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }

    pub(super) fn coin(&mut self) -> bool {
        self.below(2) == 0
    }

    pub(super) fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

impl World<'_> {
    /// Pushes `ids` (already in the ledger, all of one queue) until Redis takes them; the caller holds the gate.
    pub(super) fn push(&self, client: &Client, ids: &[String]) {
        let Some(first) = ids.first() else {
            return;
        };
        let (queue, tasks): (Queue, Vec<NewTask>) = {
            let ledger = lock(&self.ledger);
            let queue = ledger.tasks[first].queue;
            assert!(ids.iter().all(|id| ledger.tasks[id].queue == queue));
            let tasks = ids
                .iter()
                .map(|id| {
                    let task = &ledger.tasks[id];
                    let new = NewTask::new(task.kind, &task.data)
                        .unwrap()
                        .id(id.clone())
                        .priority(LEVELS[task.level]);
                    match task.group {
                        Some(group) => new.group(group),
                        None => new,
                    }
                })
                .collect();
            (queue, tasks)
        };
        let epoch = self.epoch.load(Ordering::SeqCst) as usize;
        let started = Instant::now();
        loop {
            match client.push_batch(queue.name(), tasks.clone()) {
                Ok(results) => {
                    let acked_us = now_us();
                    let mut ledger = lock(&self.ledger);
                    ledger.epochs[epoch].acked[queue.index()] += ids.len() as u64;
                    for id in ids {
                        let task = ledger.tasks.get_mut(id).unwrap();
                        task.acked_us.get_or_insert(acked_us);
                    }
                    drop(ledger);
                    for result in results {
                        if !result.is_accepted() {
                            self.violation(format!("push of {} refused: {result:?}", result.id()));
                        }
                    }
                    return;
                }
                Err(error) => {
                    let maybe =
                        matches!(&error, ClientError::Broker(broker) if broker.may_have_run());
                    let mut ledger = lock(&self.ledger);
                    ledger.failed_calls += 1;
                    ledger.failed_tasks += ids.len() as u64;
                    if maybe {
                        ledger.epochs[epoch].maybe[queue.index()] += ids.len() as u64;
                        for id in ids {
                            ledger.tasks.get_mut(id).unwrap().maybe_copies += 1;
                        }
                    }
                    drop(ledger);
                    if started.elapsed() > Duration::from_secs(60) {
                        self.violation(format!("a push failed for 60 s; last error: {error}"));
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// Adds `count` tasks for `queue` to the ledger, each of the type and work `pick` draws; returns their ids
    /// (`c...` for jobs, `l...` for limited, `p...` for popped, `t...` for typed, `g...` for grouped, each of the
    /// latter in the group [`Queue::pick_group`] draws). Limited and grouped tasks and the typed queue's [`SLOW`]
    /// ones sleep longer, 50 to 150 ms: a run's sleep is most of the time it holds its slot (claim, start, run,
    /// settle), which is what lets [`check_limit`] see an excess.
    ///
    /// [`check_limit`]: super::check::check_limit
    pub(super) fn new_tasks(
        &self,
        rng: &mut Rng,
        queue: Queue,
        count: usize,
        pick: impl Fn(&mut Rng) -> (&'static str, Work),
    ) -> Vec<String> {
        let mut ledger = lock(&self.ledger);
        (0..count)
            .map(|_| {
                let prefix = match queue {
                    Queue::Jobs => "c",
                    Queue::Limited => "l",
                    Queue::Popped => "p",
                    Queue::Typed => "t",
                    Queue::Grouped => "g",
                };
                let id = format!("{prefix}{}", ledger.next);
                ledger.next += 1;
                let (kind, work) = pick(rng);
                let sleep_ms = match (work, queue, kind) {
                    (Work::Pill, ..) => 0,
                    (Work::Deaf, ..) => 3000,
                    (_, Queue::Limited | Queue::Grouped, _) | (_, Queue::Typed, SLOW) => {
                        50 + rng.below(101)
                    }
                    _ => 1 + rng.below(20),
                };
                let data = match work {
                    Work::Normal => format!(r#"{{"sleep_ms":{sleep_ms}}}"#),
                    Work::Throttled => serde_json::json!({
                        "throttle_once": self.dir.path(&format!("throttled-{id}")),
                        "throttle_ms": 100,
                        "sleep_ms": sleep_ms,
                    })
                    .to_string(),
                    Work::Flaky => format!(r#"{{"fail_attempts":1,"sleep_ms":{sleep_ms}}}"#),
                    Work::Pill => PILL.to_string(),
                    Work::Deaf => DEAF.to_string(),
                };
                let group = queue.pick_group(rng);
                let level = match queue {
                    Queue::Jobs if rng.below(4) == 0 => 0,
                    _ => 1,
                };
                ledger.tasks.insert(
                    id.clone(),
                    Pushed {
                        queue,
                        kind,
                        group,
                        work,
                        level,
                        data,
                        sleep_ms,
                        maybe_copies: 0,
                        acked_us: None,
                    },
                );
                ledger.order.push(id.clone());
                id
            })
            .collect()
    }
}

impl World<'_> {
    /// Adds a burst of `count` tasks of one group of the grouped queue, drawn from [`GROUPS`], each of the work
    /// `work` draws: it takes its group to its limits while the others go on.
    fn group_burst(
        &self,
        rng: &mut Rng,
        count: usize,
        work: impl Fn(&mut Rng) -> Work,
    ) -> Vec<String> {
        let group = rng.pick(&GROUPS);
        let ids = self.new_tasks(rng, Queue::Grouped, count, |rng| (TEST, work(rng)));
        let mut ledger = lock(&self.ledger);
        for id in &ids {
            ledger.tasks.get_mut(id).unwrap().group = Some(group);
        }
        ids
    }
}

/// A steady stream for `queue`, 4 % of which fail their first run and 2 % throttle once: for jobs, 1 to 4 tasks
/// every 15 ms (about 150 a second), both levels; for limited, one every 50 ms (about 20 a second, against the 40 a
/// second that four slots of 50 to 150 ms runs allow: it reaches its limit after each fault that holds it back);
/// for popped, 1 or 2 every 50 ms (about 30 a second); for typed, one every 40 ms of the mix of
/// [`Queue::pick_type`] (3 % of the limited types' tasks throttling their type, none of [`OTHER`]'s), and every
/// 2 s or so a burst of 10 to 30 tasks of [`SLOW`] or of [`API`]: each type's limit is reached after every burst,
/// its tasks wait in its flow meanwhile, and about 24 tasks a second of both (against 17 a second that two slots
/// of 50 to 150 ms runs allow, and 20 starts a second) leave the limits room to drain what the faults hold back;
/// for grouped, one every 60 ms in the groups of [`Queue::pick_group`] (3 % throttling their group), and every 3 s
/// or so a burst of 10 to 30 of one group: about 6 a second of [`WEIGHTED`] and 3 of each other group, plus the
/// bursts, against each group's 10 starts a second (5 on config B), so each burst reaches its group's limits.
pub(super) fn produce(world: &World<'_>, client: &Client, queue: Queue, mut rng: Rng) {
    let (most, every) = match queue {
        Queue::Jobs => (4, Duration::from_millis(15)),
        Queue::Limited => (1, Duration::from_millis(50)),
        Queue::Popped => (2, Duration::from_millis(50)),
        Queue::Typed => (1, Duration::from_millis(40)),
        Queue::Grouped => (1, Duration::from_millis(60)),
    };
    // Percent of the tasks that throttle once: the typed queue's unlimited type never does (its throttle would
    // be the queue's, holding every type back).
    let work = |rng: &mut Rng, kind: &'static str| {
        let throttling = match (queue, kind) {
            (Queue::Typed, OTHER) => 0,
            (Queue::Typed | Queue::Grouped, _) => 3,
            _ => 2,
        };
        match rng.below(100) {
            0..4 => Work::Flaky,
            n if n < 4 + throttling => Work::Throttled,
            _ => Work::Normal,
        }
    };
    while world.producing.load(Ordering::SeqCst) {
        let count = 1 + rng.below(most) as usize;
        let mut ids = world.new_tasks(&mut rng, queue, count, |rng| {
            let kind = queue.pick_type(rng);
            (kind, work(rng, kind))
        });
        if queue == Queue::Typed && rng.below(50) == 0 {
            let kind = if rng.coin() { SLOW } else { API };
            let burst = 10 + rng.below(21) as usize;
            ids.extend(world.new_tasks(&mut rng, queue, burst, |rng| (kind, work(rng, kind))));
        }
        if queue == Queue::Grouped && rng.below(50) == 0 {
            let burst = 10 + rng.below(21) as usize;
            ids.extend(world.group_burst(&mut rng, burst, |rng| work(rng, TEST)));
        }
        {
            let _gate = world.gate.read().unwrap();
            world.push(client, &ids);
        }
        std::thread::sleep(every);
    }
}
