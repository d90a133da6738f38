//! The workload: the queues and the daemons' two configs, the tasks the producers push (what each one's handler
//! does, chosen by its data), the producers themselves, and the seeded generator every random choice comes from.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kmqd::{Client, ClientError, NewTask};

use super::ledger::Pushed;
use super::world::{World, lock};

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
pub(super) const LIMIT_BOUND: u64 = if LIMIT_A > LIMIT_B { LIMIT_A } else { LIMIT_B };
/// How long after its start a run of the limited queue surely still holds its slot, at most: an execution timeout
/// (1 s after the worker started it) settles it and frees the slot while a deaf handler still sleeps.
pub(super) const HOLDS_AT_MOST_MS: u64 = 500;

/// The queues, each with its own ledger entries, dead list and conservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Queue {
    /// Safe, two levels, prefetch, no running limit: the suite's original queue.
    Jobs,
    /// Safe, one level, `max_running` ([`LIMIT_A`], [`LIMIT_B`] on config B): its count is checked throughout.
    Limited,
    /// Default mode (at most once), one level: judged by default mode's rules (see [`Mode`]).
    Popped,
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
    pub(super) const ALL: [Queue; 3] = [Queue::Jobs, Queue::Limited, Queue::Popped];

    pub(super) fn name(self) -> &'static str {
        match self {
            Queue::Jobs => "jobs",
            Queue::Limited => "limited",
            Queue::Popped => "popped",
        }
    }

    pub(super) fn mode(self) -> Mode {
        match self {
            Queue::Jobs | Queue::Limited => Mode::Safe,
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
}

/// The two configs of a rolling change. Both have `io_timeout = "1s"` (so a 2 s stall is a real timeout), and every
/// queue a 2 s lease, a 1 s execution timeout and `retry_times = 3`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shape {
    /// Both levels.
    A,
    /// Only "normal", fewer workers, more prefetch: while a daemon runs it, high tasks are served by the others;
    /// `limited`'s `max_running` halved, and fewer workers.
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
        let common = format!(
            "lease_timeout = \"{lease}s\"\nexecution_timeout = \"1s\"\nretry_times = {RETRY_TIMES}\n\
             backoff = \"200ms\"\nbackoff_max = \"2s\"\n",
            lease = LEASE.as_secs()
        );
        format!(
            "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\npriorities = {levels}\nworkers = {workers}\n\
             prefetch = {prefetch}\nbatch = {batch}\n{common}\n\
             [[queues]]\nname = \"limited\"\nmode = \"safe\"\nworkers = {limited_workers}\n\
             max_running = {limit}\n{common}\n\
             [[queues]]\nname = \"popped\"\nmode = \"default\"\nworkers = 2\nprefetch = 4\nbatch = 8\n{common}"
        )
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
                    NewTask::new("test", &task.data)
                        .unwrap()
                        .id(id.clone())
                        .priority(LEVELS[task.level])
                })
                .collect();
            (queue, tasks)
        };
        let epoch = self.epoch.load(Ordering::SeqCst) as usize;
        let started = Instant::now();
        loop {
            match client.push_batch(queue.name(), tasks.clone()) {
                Ok(results) => {
                    let mut ledger = lock(&self.ledger);
                    ledger.epochs[epoch].acked[queue.index()] += ids.len() as u64;
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

    /// Adds `count` tasks of `work` for `queue` to the ledger; returns their ids (`c...` for jobs, `l...` for
    /// limited, `p...` for popped). Limited tasks sleep longer, 50 to 150 ms, and are all "normal": a run's sleep is most of the time
    /// it holds its slot (claim, start, run, settle), which is what lets [`check_limit`] see an excess.
    pub(super) fn new_tasks(
        &self,
        rng: &mut Rng,
        queue: Queue,
        count: usize,
        work: impl Fn(&mut Rng) -> Work,
    ) -> Vec<String> {
        let mut ledger = lock(&self.ledger);
        (0..count)
            .map(|_| {
                let prefix = match queue {
                    Queue::Jobs => "c",
                    Queue::Limited => "l",
                    Queue::Popped => "p",
                };
                let id = format!("{prefix}{}", ledger.next);
                ledger.next += 1;
                let work = work(rng);
                let sleep_ms = match (work, queue) {
                    (Work::Pill, _) => 0,
                    (Work::Deaf, _) => 3000,
                    (_, Queue::Jobs | Queue::Popped) => 1 + rng.below(20),
                    (_, Queue::Limited) => 50 + rng.below(101),
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
                let level = match queue {
                    Queue::Jobs if rng.below(4) == 0 => 0,
                    _ => 1,
                };
                ledger.tasks.insert(
                    id.clone(),
                    Pushed {
                        queue,
                        work,
                        level,
                        data,
                        sleep_ms,
                        maybe_copies: 0,
                    },
                );
                ledger.order.push(id.clone());
                id
            })
            .collect()
    }
}

/// A steady stream for `queue`, 4 % of which fail their first run: for jobs, 1 to 4 tasks every 15 ms (about 150
/// a second), both levels; for limited, one every 50 ms (about 20 a second, against the 40 a second that four slots
/// of 50 to 150 ms runs allow: it reaches its limit after each fault that holds it back); for popped, 1 or 2 every
/// 50 ms (about 30 a second).
pub(super) fn produce(world: &World, client: &Client, queue: Queue, mut rng: Rng) {
    let (most, every) = match queue {
        Queue::Jobs => (4, Duration::from_millis(15)),
        Queue::Limited => (1, Duration::from_millis(50)),
        Queue::Popped => (2, Duration::from_millis(50)),
    };
    while world.producing.load(Ordering::SeqCst) {
        let count = 1 + rng.below(most) as usize;
        let ids = world.new_tasks(&mut rng, queue, count, |rng| match rng.below(100) {
            0..4 => Work::Flaky,
            4..6 => Work::Throttled,
            _ => Work::Normal,
        });
        {
            let _gate = world.gate.read().unwrap();
            world.push(client, &ids);
        }
        std::thread::sleep(every);
    }
}
