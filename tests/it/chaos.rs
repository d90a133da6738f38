//! The chaos suite: three real `kmqd` processes on two safe queues, `jobs` (two priority levels) and `limited`
//! (one level, `max_running` 4 against the daemons' 12 workers), under a steady load, while faults are injected at
//! random: `kill -9` and restarts, `CLIENT KILL`, Redis restarted on its append-only file (after SIGTERM and after
//! SIGKILL), Redis stalled past the read timeout, zombie daemons (SIGSTOP past the lease, then SIGCONT), rolling
//! config changes (which halve `limited`'s limit), Redis restarted empty, poison pills, handlers that ignore
//! cancel, and handlers that throttle their queue for 100 ms once (2 % of the tasks: each then runs again at the
//! same attempt, a repeat its throttle explains, and is never charged or dead-lettered for it). At the end it checks that nothing was lost, that no task ran more often than kmqd's rules allow,
//! conservation in Redis, and prints a summary (see [`report`]).
//!
//! The limited queue's invariant (docs/RELIABILITY.md, "Running limits") is checked throughout: Redis's count
//! (`kmq:{limited}:running` field `q`) never above the largest limit in use and `running_underflow` 0, sampled
//! every 20 ms; the count equal to the unsettled positions of the counted claim lists, at every atomic snapshot;
//! and, from the run records, never more of its handlers running at once than that limit, but for runs of a daemon
//! that a fault made lose its lease (see [`check_limit`]). At the end the count is absent and the queue drained.
//!
//! One `#[ignore]`d test, run by `scripts/chaos` (`--short` in CI through `scripts/test`, `--long` by hand):
//!
//! - `KMQD_CHAOS_SECONDS`: how long faults are injected (default 60);
//! - `KMQD_CHAOS_SEED`: the seed of the faults, their timing and the workload (default: from the clock, printed).
//!   A seed replays the same sequence of faults (kinds, gaps, targets) and of tasks; the interleavings differ, as
//!   they do between any two runs on a shared machine;
//! - `KMQD_CHAOS_KEEP`: when set, keep the run's directory (daemon logs, record files, configs, `timeline.txt`)
//!   even when it passes; a failing run always keeps it;
//!
//! Topology: one private redis-server with the append-only file on and `appendfsync always` (with `everysec` a
//! SIGKILL may lose acknowledged writes, which is Redis's documented behaviour, not kmqd's). The daemons and the
//! producer talk to it through a [`FaultProxy`] (which injects one kind of stall); the test's own reads (stats,
//! the dead list, `CLIENT KILL`, the completion sampler) go to its unix socket directly.
//!
//! Each daemon process gets its own config file and its own testkit record file, so that every run of a task is
//! known with the process that ran it: that is what lets the test check the run budget exactly (see
//! [`check_runs`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kmqd::{Client, ClientError, NewTask};

use crate::support::proxy::{Fault, FaultProxy};
use crate::support::*;

// ----------------------------------------------------------------------------------------------------------------
// The faults: what is injected, how often, and how.
// ----------------------------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Kind {
    Kill9,
    ClientKill,
    RedisTerm,
    RedisKill,
    RedisStall,
    Zombie,
    RollingConfig,
    RedisEmpty,
    PoisonPill,
    DeafHandlers,
}

/// The queues, each with its own ledger entries, dead list and conservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Queue {
    /// Two levels, prefetch, no running limit: the suite's original queue.
    Jobs,
    /// One level, `max_running` ([`LIMIT_A`], [`LIMIT_B`] on config B): its count is checked throughout.
    Limited,
}

impl Queue {
    const ALL: [Queue; 2] = [Queue::Jobs, Queue::Limited];

    fn name(self) -> &'static str {
        match self {
            Queue::Jobs => "jobs",
            Queue::Limited => "limited",
        }
    }

    /// The prefix of its keys, `kmq:{name}`.
    fn base(self) -> String {
        format!("kmq:{{{}}}", self.name())
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Every fault kind, its weight (how often it is picked, relative to the others, once each kind has happened
/// once) and how it is injected. A fault is injected every 1 to 3 s, one at a time.
const FAULTS: &[(Kind, u64, &str)] = &[
    (
        Kind::Kill9,
        6,
        "kill -9 of a random daemon; the supervisor starts it again at once or a second later",
    ),
    (
        Kind::ClientKill,
        3,
        "CLIENT KILL TYPE normal on a direct connection: every connection of the daemons and the producer is cut",
    ),
    (
        Kind::RedisTerm,
        2,
        "redis-server stopped with SIGTERM, down for up to a second, started again on its append-only file",
    ),
    (
        Kind::RedisKill,
        2,
        "redis-server killed with SIGKILL, down for up to a second, started again on its append-only file",
    ),
    (
        Kind::RedisStall,
        3,
        "Redis stalled 1.5 to 2.5 s, past io_timeout: redis-server SIGSTOPped then SIGCONTed, or a proxy stall",
    ),
    (
        Kind::Zombie,
        2,
        "a daemon SIGSTOPped for its lease and 1 to 2 s more, then SIGCONTed",
    ),
    (
        Kind::RollingConfig,
        2,
        "a daemon stopped (SIGTERM) and started on config B (jobs: one level, other workers and prefetch; \
         limited: max_running halved); back on A (the same way) 2 to 6 faults later, or at the next rolling change",
    ),
    (
        Kind::RedisEmpty,
        1,
        "redis-server stopped (SIGTERM or SIGKILL), its append-only file deleted, started empty; the producer \
         re-pushes every task that has no final state (an outbox): a new epoch",
    ),
    (
        Kind::PoisonPill,
        2,
        "a task that aborts the daemon that runs it ({\"outcome\":\"abort\"}), on either queue",
    ),
    (
        Kind::DeafHandlers,
        2,
        "1 to 3 tasks whose handler sleeps 3 s ignoring cancel, past execution_timeout, on either queue",
    ),
];

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Kill9 => "kill -9",
            Kind::ClientKill => "client kill",
            Kind::RedisTerm => "redis restart (SIGTERM)",
            Kind::RedisKill => "redis restart (SIGKILL)",
            Kind::RedisStall => "redis stall",
            Kind::Zombie => "zombie",
            Kind::RollingConfig => "config change",
            Kind::RedisEmpty => "redis restarted empty",
            Kind::PoisonPill => "poison pill",
            Kind::DeafHandlers => "deaf handlers",
        }
    }
}

// ----------------------------------------------------------------------------------------------------------------
// The daemons' configs and the workload.
// ----------------------------------------------------------------------------------------------------------------

const DAEMONS: usize = 3;
const RETRY_TIMES: u32 = 3;
const LEASE: Duration = Duration::from_secs(2);
const LEVELS: [&str; 2] = ["high", "normal"];
const DAEMON_SECTION: &str = "shutdown_grace = \"1s\"";
/// How a deaf handler behaves: three times the execution timeout, cancel ignored.
const DEAF: &str = r#"{"sleep_ms":3000,"ignore_cancel":true}"#;
const PILL: &str = r#"{"outcome":"abort"}"#;
/// `limited`'s `max_running` on config A and on config B (halved): the largest in use bounds its count.
const LIMIT_A: u64 = 4;
const LIMIT_B: u64 = 2;
const LIMIT_BOUND: u64 = if LIMIT_A > LIMIT_B { LIMIT_A } else { LIMIT_B };
/// How long after its start a run of the limited queue surely still holds its slot, at most: an execution timeout
/// (1 s after the worker started it) settles it and frees the slot while a deaf handler still sleeps.
const HOLDS_AT_MOST_MS: u64 = 500;
/// One atomic look at a queue's keys (ARGV[1]: `kmq:{queue}`): the tasks in each place, the counters, the running
/// count and what it must equal.
const SNAPSHOT: &str = r"
local base = ARGV[1]
local function sum(pattern, command)
  local n = 0
  for _, key in ipairs(redis.call('KEYS', pattern)) do
    n = n + redis.call(command, key)
  end
  return n
end
-- What the owners hold: each claim set's scores (a claim's tasks not yet settled); claim lists and their bitmaps,
-- which match the same pattern, are counted through their set.
local function held()
  local n = 0
  for _, key in ipairs(redis.call('KEYS', base .. ':processing:*')) do
    if redis.call('TYPE', key).ok == 'zset' then
      local scored = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
      for j = 2, #scored, 2 do n = n + tonumber(scored[j]) end
    end
  end
  return n
end
-- The positions not yet settled of the claim lists counted under the running limit: those with a scopes string
-- (claim.lua writes `N q` beside each list it takes under a limit), each counted by its claim set's score.
local function counted()
  local n = 0
  for _, key in ipairs(redis.call('KEYS', base .. ':processing:*')) do
    if redis.call('TYPE', key).ok == 'zset' then
      local scored = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
      for j = 1, #scored, 2 do
        local scopes = redis.call('GET', key .. ':' .. scored[j] .. ':scopes')
        if scopes and string.find(' ' .. scopes .. ' ', ' q ', 1, true) then n = n + tonumber(scored[j + 1]) end
      end
    end
  end
  return n
end
local function counter(name)
  return tonumber(redis.call('HGET', base .. ':stats', name) or '0')
end
return {
  sum(base .. ':ready:*', 'LLEN'), sum(base .. ':quarantine:*', 'LLEN'), held(),
  sum(base .. ':delayed:*', 'ZCARD'), sum(base .. ':retry:*', 'ZCARD'), redis.call('LLEN', base .. ':dead'),
  counter('pushed'), counter('done'), counter('cancelled'),
  tonumber(redis.call('HGET', base .. ':running', 'q') or '0'), counted(), counter('running_underflow')
}
";

/// Slack when comparing the test's clock readings with the testkit's (the same clock, read by two processes).
const SLACK_US: u64 = 100_000;

/// The two configs of a rolling change. Both have `io_timeout = "1s"` (so a 2 s stall is a real timeout), and both
/// queues a 2 s lease, a 1 s execution timeout and `retry_times = 3`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    /// Both levels.
    A,
    /// Only "normal", fewer workers, more prefetch: while a daemon runs it, high tasks are served by the others;
    /// `limited`'s `max_running` halved, and fewer workers.
    B,
}

impl Shape {
    /// Both queues' sections.
    fn queue(self) -> String {
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
             max_running = {limit}\n{common}"
        )
    }

    /// `limited`'s `max_running` on this config.
    fn limit(self) -> u64 {
        match self {
            Shape::A => LIMIT_A,
            Shape::B => LIMIT_B,
        }
    }
}

/// What a task's handler does, chosen by its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Work {
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
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)).max(1))
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// A duration between `lo` and `hi` ms.
    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }

    fn coin(&mut self) -> bool {
        self.below(2) == 0
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

/// `us` as seconds since `t0_us`, as the timeline prints times.
fn rel(t0_us: u64, us: u64) -> String {
    format!("+{:.2}s", us.saturating_sub(t0_us) as f64 / 1e6)
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_micros() as u64
}

/// Sends `signal` (a name: STOP, CONT, TERM) to `pid` through kill(1); false when it failed (the process is gone).
fn send_signal(pid: u32, signal: &str) -> bool {
    Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|status| status.success())
}

// ----------------------------------------------------------------------------------------------------------------
// What happened: events, daemons, pushes, runs.
// ----------------------------------------------------------------------------------------------------------------

/// Something that may make a task run again at the same attempt number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum What {
    /// A fault the test injected.
    Fault(Kind),
    /// A daemon process exited by itself (a poison pill aborted it).
    Crashed,
    /// A daemon logged that its lease ran out or was lost (a zombie waking up, or a lease lost to Redis's data
    /// loss or a stall; also a daemon starved of CPU longer than its lease on a loaded machine).
    LeaseLost,
    /// A daemon was stopped with SIGTERM (the end of the run): tasks still running after `shutdown_grace` are
    /// handed back.
    Stopped,
}

#[derive(Clone, Debug)]
struct Event {
    what: What,
    /// The daemon process it hit; `None` for Redis-wide events.
    instance: Option<usize>,
    from_us: u64,
    to_us: u64,
    note: String,
}

impl Event {
    fn label(&self) -> &'static str {
        match self.what {
            What::Fault(kind) => kind.label(),
            What::Crashed => "crash (pill)",
            What::LeaseLost => "lease lost (logged)",
            What::Stopped => "graceful stop",
        }
    }

    /// Whether this event can explain that a run of a task on `instance` that started at `first_us` was run again
    /// at the same attempt number at `again_us`: kmqd hands a task back uncharged only when the daemon holding it
    /// lost it (killed, crashed, paused past its lease, stopped past its grace, its lease lost to Redis).
    fn explains(&self, instance: usize, first_us: u64, again_us: u64) -> bool {
        let overlaps = self.from_us <= again_us + SLACK_US && self.to_us + SLACK_US >= first_us;
        let redis_wide = matches!(
            self.what,
            What::Fault(Kind::RedisTerm | Kind::RedisKill | Kind::RedisStall | Kind::RedisEmpty)
        );
        let this_daemon = self.instance == Some(instance)
            && matches!(
                self.what,
                What::Fault(Kind::Kill9 | Kind::Zombie | Kind::RollingConfig)
                    | What::Crashed
                    | What::LeaseLost
                    | What::Stopped
            );
        overlaps && (redis_wide || this_daemon)
    }
}

/// One daemon position: systemd's unit, as it were. Its process changes with every restart.
struct Slot {
    shape: Shape,
    process: Option<Process>,
    /// The current (or last) process's index in `Daemons::instances`.
    instance: usize,
    /// The fault loop is handling this slot (a zombie, a config change): the supervisor leaves it alone.
    held: bool,
    /// When the supervisor is to start it again (after a kill or a crash).
    restart_at: Option<Instant>,
}

/// One daemon process.
struct Instance {
    slot: usize,
    shape: Shape,
    log: PathBuf,
}

struct Daemons {
    slots: Vec<Slot>,
    instances: Vec<Instance>,
}

/// A task id the producer pushed.
struct Pushed {
    queue: Queue,
    work: Work,
    level: usize,
    data: String,
    /// How long its handler sleeps (ms): a run lasts at least that long.
    sleep_ms: u64,
    /// Push attempts that failed in a way that may still have queued the task (a lost reply): each may be one
    /// more copy of it in the queue, with its own run budget.
    maybe_copies: u32,
}

#[derive(Default)]
struct Ledger {
    tasks: HashMap<String, Pushed>,
    order: Vec<String>,
    next: u64,
    /// Push calls that failed (and were retried), and the tasks in them.
    failed_calls: u64,
    failed_tasks: u64,
    /// Per epoch (a Redis that came back empty starts a new one) and queue ([`Queue::index`]): tasks whose push was
    /// acknowledged, and tasks of failed calls that may have been applied anyway.
    acked: Vec<[u64; 2]>,
    maybe: Vec<[u64; 2]>,
    /// Tasks pushed again after Redis lost its data.
    repushed: u64,
}

/// A run of a task, as the testkit recorded it.
#[derive(Clone, Copy, Debug)]
struct Run {
    start_us: u64,
    attempt: u32,
    instance: usize,
}

/// What the testkit record files say so far.
#[derive(Default)]
struct Facts {
    runs: HashMap<String, Vec<Run>>,
    starts: u64,
    /// Ids with a run whose handler returned done (which kmqd may have ignored: after an execution timeout, or
    /// from a zombie whose lease was gone).
    done: HashSet<String>,
    /// id -> reason, from `on_dead` (the final-failure hook).
    dead_hooks: HashMap<String, String>,
    /// (id, attempt, process) -> runs that answered throttle there: each explains one more run at that attempt
    /// after a run of that process.
    throttles: HashMap<(String, u32, usize), usize>,
}

/// Reads the new complete lines of one record file.
struct Tail {
    path: PathBuf,
    instance: usize,
    offset: u64,
    partial: String,
}

impl Tail {
    fn read(&mut self, facts: &mut Facts) {
        let Ok(mut file) = std::fs::File::open(&self.path) else {
            return;
        };
        if file.seek(SeekFrom::Start(self.offset)).is_err() {
            return;
        }
        let mut text = String::new();
        let Ok(read) = file.read_to_string(&mut text) else {
            return;
        };
        self.offset += read as u64;
        self.partial.push_str(&text);
        let Some(end) = self.partial.rfind('\n') else {
            return;
        };
        let complete: String = self.partial.drain(..=end).collect();
        for line in complete.lines() {
            let mut parts = line.splitn(4, ' ');
            let (Some(kind), Some(id), Some(attempt)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let rest = parts.next().unwrap_or("");
            let attempt: u32 = attempt.parse().unwrap_or(u32::MAX);
            match kind {
                "start" => {
                    let start_us = rest
                        .split(' ')
                        .nth(1)
                        .and_then(|t| t.parse().ok())
                        .unwrap_or(0);
                    facts.starts += 1;
                    facts.runs.entry(id.to_string()).or_default().push(Run {
                        start_us,
                        attempt,
                        instance: self.instance,
                    });
                }
                "end" if rest == "done" => {
                    facts.done.insert(id.to_string());
                }
                "end" if rest == "throttle" => {
                    *facts
                        .throttles
                        .entry((id.to_string(), attempt, self.instance))
                        .or_default() += 1;
                }
                "dead" => {
                    facts.dead_hooks.insert(id.to_string(), rest.to_string());
                }
                _ => {}
            }
        }
    }
}

/// What was seen of the limited queue's running count while the suite ran.
#[derive(Default)]
struct LimitWatch {
    /// Samples of `running` field `q` (every 20 ms), how many found it at [`LIMIT_BOUND`], and the most seen.
    samples: u64,
    at_limit: u64,
    most: u64,
    /// The most `running_underflow` seen (it must stay 0).
    underflow: u64,
    /// Atomic snapshots that compared the count with the unsettled positions of the counted claim lists.
    exact: u64,
    /// `running` field `q` and `running_underflow` once every daemon stopped.
    at_rest: (Option<i64>, Option<i64>),
    /// The queue's `done` counter, and when it was seen to grow (µs): a limited queue stuck shows as a long gap.
    done: Option<u64>,
    completions: Vec<u64>,
    /// Every sample of the count: (µs, running[q]).
    series: Vec<(u64, u64)>,
}

/// One atomic look at a queue (the [`SNAPSHOT`] script).
#[derive(Clone, Copy, Debug)]
struct Snapshot {
    ready: i64,
    quarantine: i64,
    processing: i64,
    delayed: i64,
    retry: i64,
    dead: i64,
    pushed: i64,
    done: i64,
    cancelled: i64,
    /// `running` field `q`, the unsettled positions of the claim lists counted in it, and `running_underflow`.
    running: i64,
    counted: i64,
    underflow: i64,
}

fn snapshot(
    connection: &mut impl redis::ConnectionLike,
    queue: Queue,
) -> redis::RedisResult<Snapshot> {
    let parts: Vec<i64> = redis::Script::new(SNAPSHOT)
        .arg(queue.base())
        .invoke(connection)?;
    let [
        ready,
        quarantine,
        processing,
        delayed,
        retry,
        dead,
        pushed,
        done,
        cancelled,
        running,
        counted,
        underflow,
    ] = parts[..]
    else {
        panic!("the snapshot script returns twelve numbers: {parts:?}");
    };
    Ok(Snapshot {
        ready,
        quarantine,
        processing,
        delayed,
        retry,
        dead,
        pushed,
        done,
        cancelled,
        running,
        counted,
        underflow,
    })
}

/// How a task ended.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Final {
    Done,
    Dead(String),
}

/// Everything the threads share.
struct World<'a> {
    dir: &'a TestDir,
    t0: Instant,
    t0_us: u64,
    /// The `[redis]` section of the daemons and the producer: through the proxy.
    redis_section: String,
    daemons: Mutex<Daemons>,
    events: Mutex<Vec<Event>>,
    ledger: Mutex<Ledger>,
    /// Pushes hold it shared; a Redis emptied under the producer holds it exclusively, so that no push straddles
    /// the loss (a real outbox would know which pushes were lost; this one knows there were none in flight).
    gate: RwLock<()>,
    epoch: AtomicU32,
    producing: AtomicBool,
    running: AtomicBool,
    violations: Mutex<Vec<String>>,
    /// When Redis's `done` counter was seen to grow (µs), sampled every 20 ms on a direct connection.
    completions: Mutex<Vec<u64>>,
    /// What the samples and snapshots of the limited queue's count saw.
    watch: Mutex<LimitWatch>,
    counters: Mutex<BTreeMap<&'static str, u64>>,
    tails: Mutex<(Vec<Tail>, Facts)>,
    /// Dead-lettered ids and their reasons, from every dead list read (before each loss of Redis's data, and at
    /// the end).
    dead_seen: Mutex<HashMap<String, String>>,
    timeline: Mutex<Vec<String>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A thread that panicked already failed the test; what it guarded is still worth reporting.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl World<'_> {
    fn at(&self) -> String {
        format!("+{:7.2}s", self.t0.elapsed().as_secs_f64())
    }

    fn rel(&self, us: u64) -> String {
        rel(self.t0_us, us)
    }

    fn say(&self, message: &str) {
        let line = format!("chaos {}: {message}", self.at());
        eprintln!("{line}");
        lock(&self.timeline).push(line);
    }

    /// A line for the timeline file only.
    fn note(&self, message: String) {
        lock(&self.timeline).push(message);
    }

    fn violation(&self, message: String) {
        self.say(&format!("VIOLATION: {message}"));
        lock(&self.violations).push(message);
    }

    fn count(&self, name: &'static str) {
        *lock(&self.counters).entry(name).or_default() += 1;
    }

    fn counter(&self, name: &str) -> u64 {
        lock(&self.counters).get(name).copied().unwrap_or(0)
    }

    fn event(&self, what: What, instance: Option<usize>, from_us: u64, note: String) {
        lock(&self.events).push(Event {
            what,
            instance,
            from_us,
            to_us: now_us(),
            note,
        });
    }

    /// Starts the slot's daemon on its shape: a new process, config file, record file and log.
    fn start_daemon(&self, daemons: &mut Daemons, slot: usize, why: &str) {
        let n = daemons.instances.len();
        let shape = daemons.slots[slot].shape;
        let record = self.dir.path(&format!("runs-{n}.log"));
        let log = self.dir.path(&format!("kmqd-{n}-d{slot}-{shape:?}.log"));
        let config = self.dir.config_named(
            &format!("kmqd-{n}-{shape:?}.toml"),
            &self.redis_section,
            DAEMON_SECTION,
            &shape.queue(),
            &record,
        );
        let process = Process::start_with_env(&config, log.clone(), &[("RUST_BACKTRACE", "0")]);
        lock(&self.tails).0.push(Tail {
            path: record,
            instance: n,
            offset: 0,
            partial: String::new(),
        });
        daemons.instances.push(Instance { slot, shape, log });
        let s = &mut daemons.slots[slot];
        s.process = Some(process);
        s.instance = n;
        s.restart_at = None;
        self.say(&format!(
            "daemon {slot} started as process #{n} on config {shape:?} ({why})"
        ));
    }

    /// Reads what the record files gained and returns the facts (locked).
    fn facts(&self) -> MutexGuard<'_, (Vec<Tail>, Facts)> {
        let mut guard = lock(&self.tails);
        let (tails, facts) = &mut *guard;
        for tail in tails.iter_mut() {
            tail.read(facts);
        }
        guard
    }

    /// How the task ended so far, as an outbox would know it: dead-lettered (the dead list or the hook), or its
    /// handler ran to done. A deaf handler returns done after its run was timed out, so for those only the dead
    /// list counts, unless `drained` (the queue is empty: a deaf task not dead-lettered was acknowledged).
    fn final_state(&self, id: &str, work: Work, facts: &Facts, drained: bool) -> Option<Final> {
        if let Some(reason) = lock(&self.dead_seen).get(id) {
            return Some(Final::Dead(reason.clone()));
        }
        if let Some(reason) = facts.dead_hooks.get(id) {
            return Some(Final::Dead(reason.clone()));
        }
        if facts.done.contains(id) && (work != Work::Deaf || drained) {
            return Some(Final::Done);
        }
        None
    }

    /// Checks conservation on one atomic snapshot of the queue's keys (a script: nothing moves while it runs):
    /// every task pushed since Redis last came back empty is ready, quarantined, processing (under any owner,
    /// registered or not), delayed, waiting to retry, dead, done or cancelled. For the limited queue, also its
    /// running count (see [`World::check_count`]).
    fn check_conservation(&self, redis: &RedisServer, queue: Queue, when: &str) {
        let snap = match snapshot(&mut redis.connection(), queue) {
            Ok(snap) => snap,
            Err(error) => {
                self.violation(format!(
                    "the conservation snapshot of {} failed {when}: {error}",
                    queue.name()
                ));
                return;
            }
        };
        self.count("conservation snapshots");
        let Snapshot {
            ready,
            quarantine,
            processing,
            delayed,
            retry,
            dead,
            pushed,
            done,
            cancelled,
            ..
        } = snap;
        let held = ready + quarantine + processing + delayed + retry + dead + done + cancelled;
        if held != pushed {
            self.violation(format!(
                "conservation of {} {when}: pushed {pushed} != {held}: ready {ready} + quarantined {quarantine} + \
                 processing {processing} + delayed {delayed} + retrying {retry} + dead {dead} + done {done} + cancelled \
                 {cancelled}",
                queue.name()
            ));
        }
        if queue == Queue::Limited {
            self.check_count(&snap, when);
        }
    }

    /// The limited queue's invariant on one atomic snapshot: its running count equals the unsettled positions of
    /// the counted claim lists, is at most the largest limit in use, and no settle took it below 0.
    fn check_count(&self, snap: &Snapshot, when: &str) {
        lock(&self.watch).exact += 1;
        if snap.running != snap.counted || snap.running > LIMIT_BOUND as i64 || snap.running < 0 {
            self.violation(format!(
                "the limited queue's running count {when}: {} in Redis, {} unsettled positions of counted claim lists \
                 (bound {LIMIT_BOUND}); {snap:?}",
                snap.running, snap.counted
            ));
        }
        self.check_underflow(snap.underflow as u64, when);
    }

    /// `running_underflow` of the limited queue must stay 0; a new value is a violation once.
    fn check_underflow(&self, underflow: u64, when: &str) {
        let mut watch = lock(&self.watch);
        if underflow > watch.underflow {
            watch.underflow = underflow;
            drop(watch);
            self.violation(format!(
                "the limited queue's running_underflow is {underflow} {when}: a settle would have taken its count \
                 below 0"
            ));
        }
    }

    /// Records the dead lists' ids and reasons.
    fn read_dead_list(&self, redis: &RedisServer) -> usize {
        let mut records: Vec<String> = Vec::new();
        for queue in Queue::ALL {
            let dead: Vec<String> =
                redis.cmd(&["LRANGE", &format!("{}:dead", queue.base()), "0", "-1"]);
            records.extend(dead);
        }
        let mut seen = lock(&self.dead_seen);
        for record in &records {
            let value: serde_json::Value = match serde_json::from_str(record) {
                Ok(value) => value,
                Err(error) => {
                    drop(seen);
                    self.violation(format!("a dead record is not JSON ({error}): {record}"));
                    seen = lock(&self.dead_seen);
                    continue;
                }
            };
            let id = value["id"].as_str().unwrap_or("").to_string();
            let reason = value["reason"].as_str().unwrap_or("").to_string();
            seen.insert(id, reason);
        }
        records.len()
    }

    /// Pushes `ids` (already in the ledger, all of one queue) until Redis takes them; the caller holds the gate.
    fn push(&self, client: &Client, ids: &[String]) {
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
                    ledger.acked[epoch][queue.index()] += ids.len() as u64;
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
                        ledger.maybe[epoch][queue.index()] += ids.len() as u64;
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
    /// limited). Limited tasks sleep longer, 50 to 150 ms, and are all "normal": a run's sleep is most of the time
    /// it holds its slot (claim, start, run, settle), which is what lets [`check_limit`] see an excess.
    fn new_tasks(
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
                };
                let id = format!("{prefix}{}", ledger.next);
                ledger.next += 1;
                let work = work(rng);
                let sleep_ms = match (work, queue) {
                    (Work::Pill, _) => 0,
                    (Work::Deaf, _) => 3000,
                    (_, Queue::Jobs) => 1 + rng.below(20),
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

/// Sets every stop flag when dropped, so that a panicking fault loop does not leave the scoped threads running.
struct StopOnDrop<'a, 'b>(&'a World<'b>);

impl Drop for StopOnDrop<'_, '_> {
    fn drop(&mut self) {
        self.0.producing.store(false, Ordering::SeqCst);
        self.0.running.store(false, Ordering::SeqCst);
    }
}

// ----------------------------------------------------------------------------------------------------------------
// The threads: producer, supervisor, completion sampler.
// ----------------------------------------------------------------------------------------------------------------

/// A steady stream for `queue`, 4 % of which fail their first run: for jobs, 1 to 4 tasks every 15 ms (about 150
/// a second), both levels; for limited, one every 50 ms (about 20 a second, against the 40 a second that four slots
/// of 50 to 150 ms runs allow: it reaches its limit after each fault that holds it back).
fn produce(world: &World, client: &Client, queue: Queue, mut rng: Rng) {
    let (most, every) = match queue {
        Queue::Jobs => (4, Duration::from_millis(15)),
        Queue::Limited => (1, Duration::from_millis(50)),
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

/// Starts again every daemon process that exited, as systemd would (`Restart=always`), and logs it.
fn supervise(world: &World) {
    while world.running.load(Ordering::SeqCst) {
        {
            let mut daemons = lock(&world.daemons);
            for slot in 0..DAEMONS {
                if daemons.slots[slot].held {
                    continue;
                }
                let instance = daemons.slots[slot].instance;
                let exited = daemons.slots[slot]
                    .process
                    .as_mut()
                    .and_then(|process| process.child.try_wait().ok().flatten());
                if let Some(status) = exited {
                    let log = daemons.slots[slot].process.take().unwrap().log_text();
                    world.event(What::Crashed, Some(instance), now_us(), format!("{status}"));
                    world.count("crashes");
                    if status.signal() == Some(6) {
                        world.say(&format!(
                            "daemon {slot} (process #{instance}) aborted (SIGABRT: a poison pill)"
                        ));
                    } else {
                        let tail: Vec<&str> = log.lines().rev().take(20).collect();
                        world.violation(format!(
                            "daemon {slot} (process #{instance}) exited by itself with {status}; its log ends:\n{}",
                            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                        ));
                    }
                    daemons.slots[slot].restart_at = Some(Instant::now());
                }
                let due = daemons.slots[slot]
                    .restart_at
                    .is_some_and(|at| Instant::now() >= at);
                if daemons.slots[slot].process.is_none() && due {
                    world.count("restarts");
                    world.start_daemon(&mut daemons, slot, "supervisor restart");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Samples, every 20 ms on a direct connection: jobs' `done` counter, recording when it grew; the limited queue's
/// running count and `running_underflow`, each sample checked against the bound; and every 25th time an atomic
/// snapshot of the limited queue, its count checked against its claim lists (a failed read, Redis being down or
/// stalled, is read again).
fn sample(world: &World, url: &str) {
    let mut connection: Option<redis::Connection> = None;
    let mut last: Option<u64> = None;
    let mut turn: u64 = 0;
    while world.running.load(Ordering::SeqCst) {
        turn += 1;
        if connection.is_none() {
            connection = redis::Client::open(url)
                .and_then(|client| client.get_connection_with_timeout(Duration::from_millis(500)))
                .ok();
            if let Some(connection) = &connection {
                let _ = connection.set_read_timeout(Some(Duration::from_millis(500)));
            }
        }
        if let Some(conn) = connection.as_mut() {
            let done: redis::RedisResult<Option<u64>> = redis::cmd("HGET")
                .arg("kmq:{jobs}:stats")
                .arg("done")
                .query(conn);
            match done {
                Ok(done) => {
                    let done = done.unwrap_or(0);
                    if last.is_some_and(|last| last != done) && done != 0 {
                        lock(&world.completions).push(now_us());
                    }
                    last = Some(done);
                }
                Err(_) => connection = None,
            }
        }
        if let Some(conn) = connection.as_mut() {
            let base = Queue::Limited.base();
            let counts: redis::RedisResult<(Option<u64>, Option<u64>, Option<u64>)> = redis::pipe()
                .cmd("HGET")
                .arg(format!("{base}:running"))
                .arg("q")
                .cmd("HGET")
                .arg(format!("{base}:stats"))
                .arg("running_underflow")
                .cmd("HGET")
                .arg(format!("{base}:stats"))
                .arg("done")
                .query(conn);
            match counts {
                Ok((running, underflow, done)) => {
                    let running = running.unwrap_or(0);
                    let mut watch = lock(&world.watch);
                    watch.samples += 1;
                    let done = done.unwrap_or(0);
                    if watch.done.is_some_and(|last| last != done) && done != 0 {
                        watch.completions.push(now_us());
                    }
                    watch.done = Some(done);
                    watch.most = watch.most.max(running);
                    watch.series.push((now_us(), running));
                    if running == LIMIT_BOUND {
                        watch.at_limit += 1;
                    }
                    drop(watch);
                    if running > LIMIT_BOUND {
                        world.violation(format!(
                            "the limited queue's running count is {running}, above its largest limit \
                             {LIMIT_BOUND}"
                        ));
                    }
                    world.check_underflow(underflow.unwrap_or(0), "in a sample");
                }
                Err(_) => connection = None,
            }
        }
        if turn % 25 == 0 {
            if let Some(conn) = connection.as_mut() {
                match snapshot(conn, Queue::Limited) {
                    Ok(snap) => world.check_count(&snap, "in a sample"),
                    Err(_) => connection = None,
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ----------------------------------------------------------------------------------------------------------------
// Injecting faults.
// ----------------------------------------------------------------------------------------------------------------

/// The running daemons the fault loop may act on.
fn candidates(daemons: &mut Daemons) -> Vec<usize> {
    (0..DAEMONS)
        .filter(|&slot| {
            let s = &mut daemons.slots[slot];
            !s.held
                && s.process
                    .as_mut()
                    .is_some_and(|process| matches!(process.child.try_wait(), Ok(None)))
        })
        .collect()
}

fn kill9(world: &World, rng: &mut Rng) -> String {
    let mut daemons = lock(&world.daemons);
    let running = candidates(&mut daemons);
    if running.is_empty() {
        return "no daemon running: skipped".into();
    }
    let slot = rng.pick(&running);
    let instance = daemons.slots[slot].instance;
    let mut process = daemons.slots[slot].process.take().unwrap();
    let from = now_us();
    let _ = process.child.kill();
    let _ = process.child.wait();
    let later = rng.coin();
    daemons.slots[slot].restart_at = Some(
        Instant::now()
            + if later {
                Duration::from_secs(1)
            } else {
                Duration::ZERO
            },
    );
    world.event(
        What::Fault(Kind::Kill9),
        Some(instance),
        from,
        String::new(),
    );
    format!(
        "daemon {slot} (process #{instance}) killed; restart {}",
        if later { "in 1 s" } else { "at once" }
    )
}

fn zombie(world: &World, rng: &mut Rng) -> String {
    let (slot, instance, pid) = {
        let mut daemons = lock(&world.daemons);
        let running = candidates(&mut daemons);
        if running.is_empty() {
            return "no daemon running: skipped".into();
        }
        let slot = rng.pick(&running);
        let s = &mut daemons.slots[slot];
        s.held = true;
        (slot, s.instance, s.process.as_ref().unwrap().child.id())
    };
    let from = now_us();
    let pause = LEASE + rng.ms(1000, 2000);
    assert!(send_signal(pid, "STOP"), "SIGSTOP {pid}");
    std::thread::sleep(pause);
    assert!(send_signal(pid, "CONT"), "SIGCONT {pid}");
    lock(&world.daemons).slots[slot].held = false;
    world.event(
        What::Fault(Kind::Zombie),
        Some(instance),
        from,
        String::new(),
    );
    format!(
        "daemon {slot} (process #{instance}) stopped for {:.1} s, then continued",
        pause.as_secs_f64()
    )
}

/// Stops the slot's daemon gracefully (SIGTERM) and starts it on `shape`. Returns what happened.
fn change_config(world: &World, slot: usize, shape: Shape, what: What) -> String {
    let (process, instance, old) = {
        let mut daemons = lock(&world.daemons);
        let s = &mut daemons.slots[slot];
        s.held = true;
        let old = s.shape;
        s.shape = shape;
        (s.process.take(), s.instance, old)
    };
    let from = now_us();
    let mut how = String::from("was not running");
    if let Some(mut process) = process {
        // A process meets SIGTERM's default action until it installs its handlers; kmqd does so before its
        // first log line (src/cli/daemon.rs, run_daemon), so wait for that line, as an operator's stop would not race
        // the exec either.
        let started = Instant::now() + Duration::from_secs(10);
        while process.log_text().is_empty()
            && matches!(process.child.try_wait(), Ok(None))
            && Instant::now() < started
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        if matches!(process.child.try_wait(), Ok(None)) {
            send_signal(process.child.id(), "TERM");
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Ok(Some(status)) = process.child.try_wait() {
                break Some(status);
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        how = match status {
            Some(status) if status.code() == Some(0) => "exited 0".to_string(),
            Some(status) if status.signal() == Some(6) => {
                // A poison pill it was running aborted it during the grace.
                world.count("crashes");
                world.event(What::Crashed, Some(instance), now_us(), format!("{status}"));
                format!("{status} (a poison pill)")
            }
            Some(status) => {
                world.violation(format!(
                    "daemon {slot} (process #{instance}) stopped with SIGTERM exited with {status}; its log ends:\n{}",
                    tail(&process.log_text(), 20)
                ));
                format!("{status}")
            }
            None => {
                world.violation(format!(
                    "daemon {slot} (process #{instance}) did not exit within 30 s of SIGTERM; its log ends:\n{}",
                    tail(&process.log_text(), 20)
                ));
                process.kill9();
                "killed after 30 s".to_string()
            }
        };
    }
    world.event(what, Some(instance), from, format!("{old:?} -> {shape:?}"));
    let mut daemons = lock(&world.daemons);
    world.start_daemon(
        &mut daemons,
        slot,
        &format!("config change {old:?} -> {shape:?}"),
    );
    daemons.slots[slot].held = false;
    format!("daemon {slot} (process #{instance}) {how}; now on config {shape:?}")
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The fault loop's own state.
struct Injector<'w, 'a> {
    world: &'w World<'a>,
    redis: RedisServer,
    proxy: FaultProxy,
    /// The test's own producer (direct to Redis): pills, deaf handlers, the outbox's re-pushes.
    client: Client,
    rng: Rng,
    /// The slot on config B, and how many more faults it stays there.
    on_b: Option<(usize, u64)>,
}

impl Injector<'_, '_> {
    fn inject(&mut self, kind: Kind) -> String {
        let world = self.world;
        world.count(kind.label());
        let from = now_us();
        match kind {
            Kind::Kill9 => kill9(world, &mut self.rng),
            Kind::Zombie => zombie(world, &mut self.rng),
            Kind::ClientKill => {
                let killed: i64 = self
                    .redis
                    .cmd(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
                world.event(What::Fault(kind), None, from, String::new());
                format!("{killed} connections killed")
            }
            Kind::RedisTerm | Kind::RedisKill => {
                let signal = if kind == Kind::RedisTerm {
                    Signal::Term
                } else {
                    Signal::Kill
                };
                self.redis.stop(signal);
                let down = self.rng.ms(0, 1000);
                std::thread::sleep(down);
                self.redis.restart();
                world.event(What::Fault(kind), None, from, String::new());
                format!(
                    "redis-server stopped ({signal:?}), down {:.1} s, restarted on its AOF",
                    down.as_secs_f64()
                )
            }
            Kind::RedisStall => {
                let stall = self.rng.ms(1500, 2500);
                let how = if self.rng.coin() {
                    world.count("stalls (SIGSTOP)");
                    self.redis.pause();
                    std::thread::sleep(stall);
                    self.redis.resume();
                    "redis-server SIGSTOPped"
                } else {
                    world.count("stalls (proxy)");
                    let rule = self.proxy.add(Fault::Stall { duration: stall });
                    std::thread::sleep(stall);
                    rule.remove();
                    "the proxy held all traffic"
                };
                world.event(What::Fault(kind), None, from, how.to_string());
                format!("{how} for {:.1} s", stall.as_secs_f64())
            }
            Kind::RollingConfig => match self.on_b.take() {
                Some((slot, _)) => {
                    change_config(world, slot, Shape::A, What::Fault(Kind::RollingConfig))
                }
                None => {
                    let slot = self.rng.below(DAEMONS as u64) as usize;
                    self.on_b = Some((slot, 2 + self.rng.below(5)));
                    change_config(world, slot, Shape::B, What::Fault(Kind::RollingConfig))
                }
            },
            Kind::RedisEmpty => self.empty_redis(),
            Kind::PoisonPill => {
                let queue = self.rng.pick(&Queue::ALL);
                let ids = world.new_tasks(&mut self.rng, queue, 1, |_| Work::Pill);
                let _gate = world.gate.read().unwrap();
                world.push(&self.client, &ids);
                format!("pushed {}", ids[0])
            }
            Kind::DeafHandlers => {
                let count = 1 + self.rng.below(3) as usize;
                let queue = self.rng.pick(&Queue::ALL);
                let ids = world.new_tasks(&mut self.rng, queue, count, |_| Work::Deaf);
                let _gate = world.gate.read().unwrap();
                world.push(&self.client, &ids);
                format!("pushed {}", ids.join(" "))
            }
        }
    }

    /// Redis loses everything; the producer, as one with an outbox would, pushes again every task that has no
    /// final state yet.
    fn empty_redis(&mut self) -> String {
        let world = self.world;
        let from = now_us();
        let _gate = world.gate.write().unwrap();
        for queue in Queue::ALL {
            world.check_conservation(&self.redis, queue, "at the end of an epoch");
        }
        // What was dead-lettered is known to the outbox (the dead list is where one learns of it).
        world.read_dead_list(&self.redis);
        let signal = if self.rng.coin() {
            Signal::Term
        } else {
            Signal::Kill
        };
        self.redis.stop(signal);
        let aof = self.redis.dir().join("appendonlydir");
        std::fs::remove_dir_all(&aof).unwrap_or_else(|e| panic!("remove {}: {e}", aof.display()));
        self.redis.restart();
        let epoch = world.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        {
            let mut ledger = lock(&world.ledger);
            ledger.acked.push([0; 2]);
            ledger.maybe.push([0; 2]);
        }
        let missing: Vec<(Queue, String)> = {
            let guard = world.facts();
            let facts = &guard.1;
            let ledger = lock(&world.ledger);
            ledger
                .order
                .iter()
                .filter(|id| {
                    world
                        .final_state(id, ledger.tasks[*id].work, facts, false)
                        .is_none()
                })
                .map(|id| (ledger.tasks[id].queue, id.clone()))
                .collect()
        };
        for queue in Queue::ALL {
            let ids: Vec<String> = missing
                .iter()
                .filter(|(of, _)| *of == queue)
                .map(|(_, id)| id.clone())
                .collect();
            for chunk in ids.chunks(500) {
                world.push(&self.client, chunk);
            }
        }
        lock(&world.ledger).repushed += missing.len() as u64;
        world.event(
            What::Fault(Kind::RedisEmpty),
            None,
            from,
            format!("epoch {epoch}"),
        );
        format!(
            "redis-server stopped ({signal:?}), AOF deleted, restarted empty (epoch {epoch}); {} tasks pushed again",
            missing.len()
        )
    }
}

// ----------------------------------------------------------------------------------------------------------------
// The checks.
// ----------------------------------------------------------------------------------------------------------------

/// The run budget, from kmqd's documented rules (docs/RELIABILITY.md, "Outcomes" and "Poison pills"):
///
/// - a run that fails (handler error, execution timeout) or a crash while the task ran alone is *charged*: the
///   task's next run has `attempt + 1`, and it is dead-lettered once `attempt == retry_times`, so the attempt
///   numbers of its runs stay within `0..=retry_times`: at most `retry_times + 1` charged runs;
/// - a task merely held by a daemon that lost it (killed, crashed by a neighbour, paused past its lease, stopped
///   past `shutdown_grace`, or whose lease Redis lost in a restart, a stall or a data loss) comes back
///   *uncharged*: it may run again with the same attempt number, once per such loss;
/// - a push whose reply was lost may have queued the task anyway: each such copy has a budget of its own.
///
/// So the bound is `runs <= (retry_times + 1) * copies + losses`, which grows with the kills: checked in its
/// stronger, per-run form: every attempt number is at most `retry_times`, and every run of a task at an attempt
/// number it already ran at must follow an event that took the previous such run from the daemon that ran it
/// (an [`Event`] that [`Event::explains`] it), except at most one such run per possibly duplicated push. A run
/// again without such a cause is an **over-run**.
struct RunCheck {
    /// Tasks with an unexplained run.
    over_runs: Vec<String>,
    /// Runs at an attempt number above retry_times.
    over_attempts: Vec<String>,
    /// Repeated runs by the event that explains them.
    causes: BTreeMap<&'static str, u64>,
    /// The most runs of one task.
    max_runs: usize,
    /// Tasks run more than once.
    rerun_tasks: usize,
    /// Tasks run more than retry_times + 1 times (allowed by the rules above when losses explain it).
    past_naive_bound: usize,
    /// Runs again explained only by the kmqd defect [`zombie_wake_up`] describes.
    zombie_wake_ups: Vec<String>,
    /// Runs at an attempt number the task had already run at, and the tasks with such runs.
    same_attempt_runs: usize,
    same_attempt_tasks: usize,
}

fn check_runs(
    t0_us: u64,
    facts: &Facts,
    ledger: &Ledger,
    events: &[Event],
    instances: &[(usize, Shape)],
) -> RunCheck {
    let mut check = RunCheck {
        over_runs: Vec::new(),
        over_attempts: Vec::new(),
        causes: BTreeMap::new(),
        max_runs: 0,
        rerun_tasks: 0,
        past_naive_bound: 0,
        zombie_wake_ups: Vec::new(),
        same_attempt_runs: 0,
        same_attempt_tasks: 0,
    };
    for id in &ledger.order {
        let Some(runs) = facts.runs.get(id) else {
            continue;
        };
        let mut runs = runs.clone();
        runs.sort_by_key(|run| run.start_us);
        check.max_runs = check.max_runs.max(runs.len());
        if runs.len() > 1 {
            check.rerun_tasks += 1;
        }
        if runs.len() > RETRY_TIMES as usize + 1 {
            check.past_naive_bound += 1;
        }
        let duplicates = ledger.tasks[id].maybe_copies as usize;
        let mut by_attempt: BTreeMap<u32, Vec<Run>> = BTreeMap::new();
        for run in &runs {
            if run.attempt > RETRY_TIMES {
                check
                    .over_attempts
                    .push(format!("{id} ran at attempt {}", run.attempt));
            }
            by_attempt.entry(run.attempt).or_default().push(*run);
        }
        let repeats: usize = by_attempt.values().map(|group| group.len() - 1).sum();
        check.same_attempt_runs += repeats;
        if repeats > 0 {
            check.same_attempt_tasks += 1;
        }
        for (attempt, group) in &by_attempt {
            let mut unexplained = Vec::new();
            // A run that answered throttle is followed by another at the same attempt, by design: the
            // throttles its process recorded for it explain as many runs after a run of that process (a run
            // cut short by a fault before it could throttle is the fault's).
            let mut throttled: HashMap<usize, usize> = HashMap::new();
            for pair in group.windows(2) {
                let (first, again) = (pair[0], pair[1]);
                let left = throttled.entry(first.instance).or_insert_with(|| {
                    facts
                        .throttles
                        .get(&(id.clone(), *attempt, first.instance))
                        .copied()
                        .unwrap_or(0)
                });
                let event = events
                    .iter()
                    .find(|event| event.explains(first.instance, first.start_us, again.start_us));
                match event {
                    None if *left > 0 => {
                        *left -= 1;
                        *check.causes.entry("handler throttle").or_default() += 1;
                    }
                    Some(event) => *check.causes.entry(event.label()).or_default() += 1,
                    None if zombie_wake_up(events, again) => {
                        check.zombie_wake_ups.push(format!(
                            "{id} ran at {} on process #{}, then again at {} on process #{} as it woke from a \
                             pause past its lease",
                            rel(t0_us, first.start_us),
                            first.instance,
                            rel(t0_us, again.start_us),
                            again.instance
                        ));
                    }
                    None => unexplained.push((first, again)),
                }
            }
            let allowed = unexplained.len().min(duplicates);
            if allowed > 0 {
                *check.causes.entry("duplicate push").or_default() += allowed as u64;
            }
            if unexplained.len() > duplicates {
                let mut text = format!(
                    "{id} ({:?}, {} possible duplicate pushes) ran again at attempt {attempt} without a cause:",
                    ledger.tasks[id].work, duplicates
                );
                for (first, again) in &unexplained {
                    let (slot, shape) = instances[first.instance];
                    let _ = write!(
                        text,
                        " run at {} on process #{} (daemon {slot}, config {shape:?}) then at {} on process #{}; \
                         events around:",
                        rel(t0_us, first.start_us),
                        first.instance,
                        rel(t0_us, again.start_us),
                        again.instance
                    );
                    let around = events.iter().filter(|event| {
                        event.to_us + 3_000_000 >= first.start_us
                            && event.from_us <= again.start_us + 1_000_000
                    });
                    for event in around {
                        let _ = write!(
                            text,
                            " [{} {}..{} on {:?} {}]",
                            event.label(),
                            rel(t0_us, event.from_us),
                            rel(t0_us, event.to_us),
                            event.instance,
                            event.note
                        );
                    }
                    text.push(';');
                }
                text.push_str(" all its runs:");
                for run in &runs {
                    let _ = write!(
                        text,
                        " [attempt {} at {} on #{}]",
                        run.attempt,
                        rel(t0_us, run.start_us),
                        run.instance
                    );
                }
                check.over_runs.push(text);
            }
        }
    }
    check
}

/// Whether `run` started on a daemon in the second after it woke from a pause past its lease (a zombie).
///
/// Such a run is a violation: a daemon woken after its lease ran out must not start the tasks it had claimed
/// before the pause and that were waiting for a worker (the monitors handed them to other daemons meanwhile). This
/// suite found kmqd doing it, in the milliseconds before its heartbeat found the lease gone; workers now start a
/// safe-mode task only while its lease is surely live (`Ownership::may_start`), and
/// `faults::a_daemon_woken_from_a_pause_past_its_lease_starts_none_of_the_tasks_it_lost` pins it.
fn zombie_wake_up(events: &[Event], run: Run) -> bool {
    events.iter().any(|event| {
        event.what == What::Fault(Kind::Zombie)
            && event.instance == Some(run.instance)
            && event.to_us <= run.start_us + SLACK_US
            && run.start_us <= event.to_us + 1_000_000
    })
}

/// What the run records say of the limited queue's runs at once.
struct LimitCheck {
    /// The most runs at once, each counted from its start for as long as it surely held its slot.
    most: usize,
    /// When that was first reached (µs).
    most_at: u64,
    /// Runs counted, and runs left out because a fault may have taken their daemon's lease meanwhile.
    counted: usize,
    excused: usize,
    /// Starts that made more than `bound` runs at once, and the first ten of them with those runs.
    over_count: usize,
    over: Vec<String>,
}

/// At no instant more than `bound` handlers of the limited queue running, from the run records.
///
/// The records give each run's start (testkit's µs stamp) but not its end, so a run counts from its start for as
/// long as it surely held its slot: its sleep (a run lasts at least that; nothing cancels it earlier but a lost
/// lease, and its execution timeout is longer), at most [`HOLDS_AT_MOST_MS`] (a deaf handler's slot is freed by its
/// execution timeout while it still sleeps); a pill's run, which aborts at once, counts for nothing. A slot is given
/// back only by the settle after the run, so two such stretches that overlap held two slots at once. Runs that a
/// fault may have taken from their daemon meanwhile are left out: those an [`Event`] explains a run again for (its
/// daemon killed, crashed, paused, stopped or its lease lost, or a Redis-wide fault), the same attribution as
/// [`check_runs`]: the monitors give such a run's slot to another daemon while it may still run (RELIABILITY.md,
/// "Running limits").
fn check_limit(
    t0_us: u64,
    facts: &Facts,
    ledger: &Ledger,
    events: &[Event],
    bound: usize,
) -> LimitCheck {
    let mut check = LimitCheck {
        most: 0,
        most_at: 0,
        counted: 0,
        excused: 0,
        over_count: 0,
        over: Vec::new(),
    };
    // (time, +1 at a start or -1 at an end, run): ends before starts at the same µs.
    let mut edges: Vec<(u64, i8, usize)> = Vec::new();
    let mut runs: Vec<(&str, Run, u64)> = Vec::new();
    for id in &ledger.order {
        let task = &ledger.tasks[id];
        if task.queue != Queue::Limited {
            continue;
        }
        let holds_us = task.sleep_ms.min(HOLDS_AT_MOST_MS) * 1000;
        if holds_us == 0 {
            continue;
        }
        for run in facts.runs.get(id).into_iter().flatten() {
            let end = run.start_us + holds_us;
            if events
                .iter()
                .any(|event| event.explains(run.instance, run.start_us, end))
            {
                check.excused += 1;
                continue;
            }
            check.counted += 1;
            edges.push((run.start_us, 1, runs.len()));
            edges.push((end, -1, runs.len()));
            runs.push((id, *run, end));
        }
    }
    edges.sort_by_key(|&(at, delta, _)| (at, delta));
    let mut now: BTreeSet<usize> = BTreeSet::new();
    for (at, delta, run) in edges {
        if delta < 0 {
            now.remove(&run);
            continue;
        }
        now.insert(run);
        if now.len() > check.most {
            check.most = now.len();
            check.most_at = at;
        }
        if now.len() > bound {
            check.over_count += 1;
        }
        if now.len() > bound && check.over.len() < 10 {
            let mut text = format!("{} runs at {}:", now.len(), rel(t0_us, at));
            for &n in &now {
                let (id, run, end) = runs[n];
                let _ = write!(
                    text,
                    " [{id} attempt {} on process #{} {}..{}]",
                    run.attempt,
                    run.instance,
                    rel(t0_us, run.start_us),
                    rel(t0_us, end)
                );
            }
            check.over.push(text);
        }
    }
    check
}

/// Parses a tracing timestamp at the start of a log line (`2026-12-01T10:16:31.123456Z ...`) into µs.
fn log_time_us(line: &str) -> Option<u64> {
    let stamp = line.split_whitespace().next()?;
    let time = humantime::parse_rfc3339(stamp).ok()?;
    Some(time.duration_since(UNIX_EPOCH).ok()?.as_micros() as u64)
}

/// Whether a daemon's log line says it found its lease gone.
fn is_lease_loss(line: &str) -> bool {
    line.contains("lease ran out before renewal") || line.contains("lease lost; registering")
}

// ----------------------------------------------------------------------------------------------------------------
// The test.
// ----------------------------------------------------------------------------------------------------------------

#[test]
#[ignore = "the chaos suite: minutes long; run by scripts/chaos (scripts/test runs --short)"]
fn chaos() {
    let seconds: u64 = std::env::var("KMQD_CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let seed: u64 = std::env::var("KMQD_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| now_us() % 1_000_000_000);
    eprintln!(
        "chaos: seed {seed}, {seconds} s of faults (replay: KMQD_CHAOS_SEED={seed} KMQD_CHAOS_SECONDS={seconds})"
    );
    eprintln!("chaos: fault kinds (weight: how):");
    for (kind, weight, how) in FAULTS {
        eprintln!("chaos:   {:<24} {weight}: {how}", kind.label());
    }

    let redis = RedisServer::with_aof(Fsync::Always);
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let direct = dir.config_named(
        "direct.toml",
        &format!("url = \"{}\"\nio_timeout = \"5s\"", redis.url()),
        DAEMON_SECTION,
        &Shape::A.queue(),
        &dir.path("unused-record.log"),
    );
    let redis_section = format!("url = \"{}\"\nio_timeout = \"1s\"", proxy.url());
    let producer_config = dir.config_named(
        "producer.toml",
        &redis_section,
        DAEMON_SECTION,
        &Shape::A.queue(),
        &dir.path("unused-record.log"),
    );
    let t0_us = now_us();
    let world = World {
        dir: &dir,
        t0: Instant::now(),
        t0_us,
        redis_section,
        daemons: Mutex::new(Daemons {
            slots: (0..DAEMONS)
                .map(|_| Slot {
                    shape: Shape::A,
                    process: None,
                    instance: 0,
                    held: false,
                    restart_at: None,
                })
                .collect(),
            instances: Vec::new(),
        }),
        events: Mutex::new(Vec::new()),
        ledger: Mutex::new(Ledger {
            acked: vec![[0; 2]],
            maybe: vec![[0; 2]],
            ..Ledger::default()
        }),
        gate: RwLock::new(()),
        epoch: AtomicU32::new(0),
        producing: AtomicBool::new(true),
        running: AtomicBool::new(true),
        violations: Mutex::new(Vec::new()),
        completions: Mutex::new(Vec::new()),
        watch: Mutex::new(LimitWatch::default()),
        counters: Mutex::new(BTreeMap::new()),
        tails: Mutex::new((Vec::new(), Facts::default())),
        dead_seen: Mutex::new(HashMap::new()),
        timeline: Mutex::new(Vec::new()),
    };
    {
        let mut daemons = lock(&world.daemons);
        for slot in 0..DAEMONS {
            world.start_daemon(&mut daemons, slot, "first start");
        }
    }
    let harness = client(&direct);
    let mut rng = Rng::new(seed);
    let producer_rng = Rng::new(rng.next());
    // Its own generator, off the seed, so that the other draws of a seed are those of the suite before it.
    let limited_rng = Rng::new(seed ^ 0x006C_696D_6974_6564);
    let redis_url = redis.url();
    let mut injector = Injector {
        world: &world,
        redis,
        proxy,
        client: client(&direct),
        rng: Rng::new(rng.next()),
        on_b: None,
    };
    let producer_client = client(&producer_config);
    let limited_client = client(&producer_config);

    let (chaos_time, chaos_end_us, drain_time) = std::thread::scope(|scope| {
        let _stop = StopOnDrop(&world);
        let producer = scope.spawn(|| produce(&world, &producer_client, Queue::Jobs, producer_rng));
        let limited_producer =
            scope.spawn(|| produce(&world, &limited_client, Queue::Limited, limited_rng));
        let supervisor = scope.spawn(|| supervise(&world));
        let sampler = scope.spawn(|| sample(&world, &redis_url));

        // Warm up: the three daemons serve before the first fault.
        eventually(
            Duration::from_secs(60),
            "the first tasks to be done",
            || {
                let s = harness.stats("jobs");
                let done = s.as_ref().map_or(0, |s| s.done);
                (done >= 100, done)
            },
        );

        // Every kind once, in a random order; then random kinds by weight. The schedule (gaps and kinds) has its
        // own generator, two draws per fault, so that a seed replays the same sequence of faults however long
        // each takes on this run.
        let mut schedule = Rng::new(rng.next());
        let mut first: Vec<Kind> = FAULTS.iter().map(|(kind, _, _)| *kind).collect();
        for i in (1..first.len()).rev() {
            let j = schedule.below(i as u64 + 1) as usize;
            first.swap(i, j);
        }
        first.reverse();
        let total_weight: u64 = FAULTS.iter().map(|(_, weight, _)| weight).sum();
        let chaos_started = Instant::now();
        let mut number = 0;
        while chaos_started.elapsed() < Duration::from_secs(seconds) {
            let gap = schedule.ms(1000, 3000);
            let draw = schedule.next();
            std::thread::sleep(gap);
            match injector.on_b {
                Some((slot, 0)) => {
                    injector.on_b = None;
                    world.count(Kind::RollingConfig.label());
                    let what =
                        change_config(&world, slot, Shape::A, What::Fault(Kind::RollingConfig));
                    world.say(&format!("config change back: {what}"));
                }
                Some((slot, left)) => injector.on_b = Some((slot, left - 1)),
                None => {}
            }
            let kind = first.pop().unwrap_or_else(|| {
                let mut pick = draw % total_weight;
                FAULTS
                    .iter()
                    .find(|(_, weight, _)| {
                        if pick < *weight {
                            true
                        } else {
                            pick -= weight;
                            false
                        }
                    })
                    .unwrap()
                    .0
            });
            number += 1;
            for queue in Queue::ALL {
                world.check_conservation(
                    &injector.redis,
                    queue,
                    &format!("before fault #{number}"),
                );
            }
            let what = injector.inject(kind);
            world.say(&format!("fault #{number} {}: {what}", kind.label()));
        }
        let chaos_time = chaos_started.elapsed();
        let chaos_end_us = now_us();
        if !first.is_empty() {
            world.say(&format!(
                "{} fault kinds did not get a turn in {seconds} s: {first:?}",
                first.len()
            ));
        }

        // The end: every daemon back on config A and running, the producer stopped, the queue drained.
        world.say("faults stop; every daemon back on config A");
        if let Some((slot, _)) = injector.on_b.take() {
            world.count(Kind::RollingConfig.label());
            let what = change_config(&world, slot, Shape::A, What::Fault(Kind::RollingConfig));
            world.say(&format!("config change back: {what}"));
        }
        world.producing.store(false, Ordering::SeqCst);
        producer.join().expect("the producer thread");
        limited_producer
            .join()
            .expect("the limited queue's producer thread");
        let drain_started = Instant::now();
        let backlog: u64 = Queue::ALL
            .iter()
            .map(|queue| {
                harness
                    .stats(queue.name())
                    .map_or(0, |s| s.ready + s.delayed + s.processing)
            })
            .sum();
        let within = Duration::from_secs(90) + Duration::from_millis(50 * backlog);
        world.say(&format!(
            "producer stopped; draining a backlog of {backlog} (at most {} s)",
            within.as_secs()
        ));
        let mut last_report = Instant::now();
        loop {
            let stats: Vec<_> = Queue::ALL
                .iter()
                .map(|queue| harness.stats(queue.name()))
                .collect();
            let empty = stats.iter().all(|stats| {
                stats
                    .as_ref()
                    .is_ok_and(|s| s.ready + s.processing + s.delayed == 0)
            });
            world.read_dead_list(&injector.redis);
            for queue in Queue::ALL {
                world.check_conservation(&injector.redis, queue, "while draining");
            }
            let unfinished: Vec<String> = {
                let guard = world.facts();
                let ledger = lock(&world.ledger);
                ledger
                    .order
                    .iter()
                    .filter(|id| {
                        world
                            .final_state(id, ledger.tasks[*id].work, &guard.1, empty)
                            .is_none()
                    })
                    .cloned()
                    .collect()
            };
            if empty && unfinished.is_empty() {
                break;
            }
            if drain_started.elapsed() > within {
                world.violation(format!(
                    "the drain did not end within {} s: {stats:?}; {} tasks have no final state, e.g. {:?}",
                    within.as_secs(),
                    unfinished.len(),
                    &unfinished[..unfinished.len().min(20)]
                ));
                break;
            }
            if last_report.elapsed() > Duration::from_secs(10) {
                last_report = Instant::now();
                world.say(&format!(
                    "draining: {} tasks without a final state; {stats:?}",
                    unfinished.len()
                ));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        let drain_time = drain_started.elapsed();
        world.running.store(false, Ordering::SeqCst);
        supervisor.join().expect("the supervisor thread");
        sampler.join().expect("the sampler thread");
        (chaos_time, chaos_end_us, drain_time)
    });

    // SIGTERM every daemon: each exits 0.
    let final_stats: Vec<kmqd::broker::QueueStats> = Queue::ALL
        .iter()
        .map(|queue| harness.stats(queue.name()).expect("stats at the end"))
        .collect();
    {
        let mut daemons = lock(&world.daemons);
        let mut stopping = Vec::new();
        for slot in 0..DAEMONS {
            let instance = daemons.slots[slot].instance;
            match daemons.slots[slot].process.take() {
                Some(process) => {
                    send_signal(process.child.id(), "TERM");
                    stopping.push((slot, instance, process, now_us()));
                }
                None => world.violation(format!("daemon {slot} was not running at the end")),
            }
        }
        for (slot, instance, mut process, from) in stopping {
            let deadline = Instant::now() + Duration::from_secs(30);
            let status = loop {
                if let Ok(Some(status)) = process.child.try_wait() {
                    break Some(status);
                }
                if Instant::now() > deadline {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            world.event(What::Stopped, Some(instance), from, String::new());
            if status.and_then(|s| s.code()) != Some(0) {
                world.violation(format!(
                    "daemon {slot} (process #{instance}) did not exit 0 on SIGTERM at the end: {status:?}; its log ends:\n{}",
                    tail(&process.log_text(), 20)
                ));
            }
        }
        drop(daemons);
    }
    for (queue, final_stats) in Queue::ALL.iter().zip(&final_stats) {
        let after_stop = harness.stats(queue.name()).expect("stats after the stop");
        if after_stop.done != final_stats.done
            || after_stop.ready + after_stop.processing + after_stop.delayed != 0
        {
            world.violation(format!(
                "{} changed after the drain: {final_stats:?} then {after_stop:?}",
                queue.name()
            ));
        }
    }
    // At rest: the limited queue's count is gone (a field at 0 is deleted) and never went below 0.
    let at_rest = Queue::Limited.base();
    let running: Option<i64> = injector
        .redis
        .cmd(&["HGET", &format!("{at_rest}:running"), "q"]);
    let underflow: Option<i64> =
        injector
            .redis
            .cmd(&["HGET", &format!("{at_rest}:stats"), "running_underflow"]);
    if running.is_some() || underflow.unwrap_or(0) != 0 {
        world.violation(format!(
            "at rest the limited queue's running count is {running:?} (absent expected) and its running_underflow \
             {underflow:?} (0 expected)"
        ));
    }
    lock(&world.watch).at_rest = (running, underflow);

    let report = report(
        &world,
        &final_stats,
        seed,
        seconds,
        (chaos_time, chaos_end_us),
        drain_time,
    );
    eprintln!("{report}");
    let violations = lock(&world.violations).clone();
    // Keep what a failure needs to be understood: every daemon's log and record file, the configs, the timeline.
    let timeline = lock(&world.timeline).join("\n");
    std::fs::write(
        dir.path("timeline.txt"),
        format!("{timeline}\n\n{report}\n"),
    )
    .unwrap();
    std::fs::write(dir.path("redis.log"), injector.redis.log_text()).unwrap();
    let keep = std::env::var_os("KMQD_CHAOS_KEEP").is_some_and(|v| !v.is_empty());
    if keep && violations.is_empty() {
        drop(injector);
        drop(world);
        eprintln!("chaos: logs kept in {}", dir.dir.keep().display());
    } else if !violations.is_empty() {
        drop(injector);
        drop(world);
        let kept = dir.dir.keep();
        panic!(
            "chaos (seed {seed}, KMQD_CHAOS_SEED={seed} KMQD_CHAOS_SECONDS={seconds} to replay): {} violations; logs \
             kept in {}:\n- {}",
            violations.len(),
            kept.display(),
            violations.join("\n- ")
        );
    }
}

/// Runs the end checks (recording violations) and returns the summary.
fn report(
    world: &World,
    all_stats: &[kmqd::broker::QueueStats],
    seed: u64,
    seconds: u64,
    (chaos_time, chaos_end_us): (Duration, u64),
    drain_time: Duration,
) -> String {
    // Lease losses the daemons logged are events too.
    let instances: Vec<(usize, PathBuf)> = lock(&world.daemons)
        .instances
        .iter()
        .enumerate()
        .map(|(n, instance)| (n, instance.log.clone()))
        .collect();
    let shapes: Vec<(usize, Shape)> = lock(&world.daemons)
        .instances
        .iter()
        .map(|instance| (instance.slot, instance.shape))
        .collect();
    let mut lease_losses = 0;
    let mut panics = Vec::new();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    for (n, log) in &instances {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        for line in text.lines() {
            if is_lease_loss(line) {
                if let Some(at) = log_time_us(line) {
                    lease_losses += 1;
                    // The lease ran out some time before the daemon found out.
                    let from =
                        at.saturating_sub((LEASE + Duration::from_secs(1)).as_micros() as u64);
                    lock(&world.events).push(Event {
                        what: What::LeaseLost,
                        instance: Some(*n),
                        from_us: from,
                        to_us: at,
                        note: String::new(),
                    });
                }
            }
            if line.contains("panicked") {
                panics.push(format!("process #{n}: {line}"));
            }
            if line.contains(" ERROR ") {
                // The message without its fields' values: "cannot settle outcomes; retrying with backoff".
                let message = line
                    .split_once(": ")
                    .map_or(line, |(_, message)| message)
                    .split(" error=")
                    .next()
                    .unwrap_or("");
                let key: String = message
                    .split_whitespace()
                    .filter(|word| !word.contains('='))
                    .collect::<Vec<_>>()
                    .join(" ");
                *errors.entry(key).or_default() += 1;
            }
        }
    }
    // A lease loss that no fault explains (no zombie of that daemon, no Redis-wide fault shortly before): a
    // daemon that could not renew within its lease (CPU starvation on a loaded machine, or a weakness of kmqd).
    let mut unforced = Vec::new();
    let mut at_shutdown = 0;
    {
        let events = lock(&world.events);
        for loss in events.iter().filter(|event| event.what == What::LeaseLost) {
            let window = (LEASE + Duration::from_secs(3)).as_micros() as u64;
            let cause = events.iter().find(|event| {
                let near = event.from_us <= loss.to_us && event.to_us + window >= loss.to_us;
                let kind = match event.what {
                    What::Fault(Kind::Zombie) => event.instance == loss.instance,
                    What::Fault(
                        Kind::RedisTerm | Kind::RedisKill | Kind::RedisStall | Kind::RedisEmpty,
                    ) => true,
                    _ => false,
                };
                near && kind
            });
            // The daemon was being stopped (SIGTERM): its owner was released before its heartbeat stopped.
            let stopping = events.iter().any(|event| {
                matches!(event.what, What::Stopped | What::Fault(Kind::RollingConfig))
                    && event.instance == loss.instance
                    && event.from_us <= loss.to_us
            });
            if stopping {
                at_shutdown += 1;
            } else if cause.is_none() {
                let before: Vec<String> = events
                    .iter()
                    .filter(|event| {
                        matches!(event.what, What::Fault(_))
                            && event.from_us <= loss.to_us
                            && event.to_us + 10_000_000 >= loss.to_us
                    })
                    .map(|event| {
                        format!(
                            "{} {}..{} on {:?}",
                            event.label(),
                            world.rel(event.from_us),
                            world.rel(event.to_us),
                            event.instance
                        )
                    })
                    .collect();
                unforced.push(format!(
                    "process #{} logged a lease loss at {}; faults in the 10 s before: {before:?}",
                    loss.instance.unwrap_or(0),
                    world.rel(loss.to_us)
                ));
            }
        }
    }
    for text in &unforced {
        world.say(&format!("lease loss without a fault: {text}"));
    }
    for panic in &panics {
        world.violation(format!("a daemon thread panicked: {panic}"));
    }

    let guard = world.facts();
    let facts = &guard.1;
    let ledger = lock(&world.ledger);
    let events = lock(&world.events).clone();
    let check = check_runs(world.t0_us, facts, &ledger, &events, &shapes);
    for text in check.over_runs.iter().chain(&check.over_attempts) {
        world.violation(format!("over-run: {text}"));
    }
    for text in &check.zombie_wake_ups {
        world.violation(format!("zombie wake-up: {text}"));
    }

    // Final states.
    let mut by_work: HashMap<Work, u64> = HashMap::new();
    let mut done = 0;
    let mut dead_by_class: BTreeMap<&str, u64> = BTreeMap::new();
    let mut deaf_done = 0;
    let mut lost = Vec::new();
    let mut never_ran = Vec::new();
    let mut high = 0;
    // Per queue ([`Queue::index`]): pushed, done, dead, and of the pushed, pills and deaf tasks.
    let mut per_queue = [[0u64; 5]; 2];
    for id in &ledger.order {
        let task = &ledger.tasks[id];
        *by_work.entry(task.work).or_default() += 1;
        let counts = &mut per_queue[task.queue.index()];
        counts[0] += 1;
        match task.work {
            Work::Pill => counts[3] += 1,
            Work::Deaf => counts[4] += 1,
            _ => {}
        }
        match world.final_state(id, task.work, facts, true) {
            Some(Final::Done) => counts[1] += 1,
            Some(Final::Dead(_)) => counts[2] += 1,
            None => {}
        }
        if task.level == 0 {
            high += 1;
        }
        if !facts.runs.contains_key(id) {
            never_ran.push(id.clone());
        }
        match world.final_state(id, task.work, facts, true) {
            None => lost.push(id.clone()),
            Some(Final::Done) => {
                done += 1;
                match task.work {
                    Work::Pill => world.violation(format!("the poison pill {id} was done")),
                    Work::Deaf => deaf_done += 1,
                    _ => {}
                }
            }
            Some(Final::Dead(reason)) => {
                let crash = reason.starts_with("crashed the daemon");
                let timeout = reason.contains("execution timeout");
                let class = match task.work {
                    Work::Pill if crash => "pill",
                    Work::Deaf if timeout => "deaf",
                    Work::Deaf if crash => "deaf (crash charged)",
                    _ => "other",
                };
                *dead_by_class.entry(class).or_default() += 1;
                if class == "other" {
                    world.violation(format!("{id} ({:?}) dead-lettered: {reason}", task.work));
                }
            }
        }
    }
    // The life of every pill and deaf task, for the timeline file.
    for id in &ledger.order {
        let work = ledger.tasks[id].work;
        if !matches!(work, Work::Pill | Work::Deaf) {
            continue;
        }
        let mut runs = facts.runs.get(id).cloned().unwrap_or_default();
        runs.sort_by_key(|run| run.start_us);
        let runs: Vec<String> = runs
            .iter()
            .map(|run| {
                format!(
                    "{}@#{} {}",
                    run.attempt,
                    run.instance,
                    world.rel(run.start_us)
                )
            })
            .collect();
        world.note(format!(
            "{work:?} {id}: {} runs (attempt@process time): {}; final: {:?}",
            runs.len(),
            runs.join(", "),
            world.final_state(id, work, facts, true)
        ));
    }
    if !lost.is_empty() {
        world.violation(format!(
            "{} tasks lost (pushed, no final state): {:?}",
            lost.len(),
            &lost[..lost.len().min(20)]
        ));
    }
    if !never_ran.is_empty() {
        world.violation(format!(
            "{} tasks never ran: {:?}",
            never_ran.len(),
            &never_ran[..never_ran.len().min(20)]
        ));
    }

    // Conservation in Redis, for the last epoch (what Redis holds since it last came back empty), per queue.
    let epoch = world.epoch.load(Ordering::SeqCst) as usize;
    for (queue, stats) in Queue::ALL.iter().zip(all_stats) {
        let accounted = stats.done
            + stats.dead
            + stats.cancelled
            + stats.ready
            + stats.processing
            + stats.delayed;
        if accounted != stats.pushed {
            world.violation(format!(
                "conservation of {}: pushed {} != done {} + dead {} + cancelled {} + ready {} + processing {} + \
                 delayed {}",
                queue.name(),
                stats.pushed,
                stats.done,
                stats.dead,
                stats.cancelled,
                stats.ready,
                stats.processing,
                stats.delayed
            ));
        }
        let (acked, maybe) = (
            ledger.acked[epoch][queue.index()],
            ledger.maybe[epoch][queue.index()],
        );
        if stats.pushed < acked || stats.pushed > acked + maybe {
            world.violation(format!(
                "Redis counted {} pushes to {} in the last epoch; the producer had {acked} acknowledged and {maybe} \
                 more that may have been applied",
                stats.pushed,
                queue.name()
            ));
        }
    }
    let stats = &all_stats[Queue::Jobs.index()];
    let limited_stats = &all_stats[Queue::Limited.index()];

    // The limited queue: never more of its handlers at once than the largest limit of the configs in use, from
    // the run records.
    let bound = shapes
        .iter()
        .map(|(_, shape)| shape.limit())
        .max()
        .unwrap_or(LIMIT_BOUND);
    let limit = check_limit(world.t0_us, facts, &ledger, &events, bound as usize);
    for text in &limit.over {
        world.violation(format!(
            "more limited runs at once than max_running {bound}: {text}"
        ));
    }
    if limit.over_count > limit.over.len() {
        world.violation(format!(
            "{} more starts with more limited runs at once than max_running {bound}",
            limit.over_count - limit.over.len()
        ));
    }

    // Recovery: from the end of each fault to the next task completion.
    let completions = lock(&world.completions).clone();
    let mut recoveries: Vec<(u64, String)> = events
        .iter()
        .filter(|event| matches!(event.what, What::Fault(_)))
        .filter_map(|event| {
            let next = completions.partition_point(|&at| at < event.to_us);
            completions.get(next).map(|&at| {
                (
                    at - event.to_us,
                    format!("{} at {}", event.label(), world.rel(event.from_us)),
                )
            })
        })
        .collect();
    recoveries.sort();
    let worst = recoveries
        .last()
        .map_or("none measured".to_string(), |(us, what)| {
            format!("{:.2} s (after the {what})", *us as f64 / 1e6)
        });
    // While faults were injected (the drain ends with the slowest tasks: pills and deaf handlers).
    let longest_gap = |completions: &[u64]| {
        completions
            .iter()
            .copied()
            .take_while(|&at| at <= chaos_end_us)
            .collect::<Vec<_>>()
            .windows(2)
            .map(|pair| (pair[1] - pair[0], pair[0]))
            .max()
    };
    let gap_text = |gap: Option<(u64, u64)>| {
        gap.map_or("none".to_string(), |(gap, from)| {
            format!("{:.2} s (from {})", gap as f64 / 1e6, world.rel(from))
        })
    };
    let limited_gap = {
        let watch = lock(&world.watch);
        let gap = longest_gap(&watch.completions);
        // What the count was meanwhile: slots held by tasks that did not finish.
        let during: Vec<u64> = gap.map_or(Vec::new(), |(gap, from)| {
            watch
                .series
                .iter()
                .filter(|(at, _)| *at > from && *at < from + gap)
                .map(|(_, running)| *running)
                .collect()
        });
        let at_bound = during.iter().filter(|&&n| n == LIMIT_BOUND).count();
        let meanwhile = match (during.iter().min(), during.iter().max()) {
            (Some(least), Some(most)) => format!(
                "running[q] meanwhile {least} to {most}, at the bound in {at_bound} of {} samples",
                during.len()
            ),
            _ => "no sample of running[q] meanwhile (Redis unreachable)".to_string(),
        };
        format!("{}; {meanwhile}", gap_text(gap))
    };
    let longest_gap = gap_text(longest_gap(&completions));
    let median = recoveries
        .get(recoveries.len() / 2)
        .map_or(0.0, |(us, _)| *us as f64 / 1e6);

    let c = |name: &str| world.counter(name);
    let faults: u64 = FAULTS.iter().map(|(kind, _, _)| c(kind.label())).sum();
    let causes = check
        .causes
        .iter()
        .map(|(cause, n)| format!("{cause} {n}"))
        .collect::<Vec<_>>()
        .join(", ");
    let errors = if errors.is_empty() {
        "none".to_string()
    } else {
        errors
            .iter()
            .map(|(message, n)| format!("{n}x \"{message}\""))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let violations = lock(&world.violations).len();
    let pushed = ledger.order.len();
    let mut out = String::new();
    let _ = writeln!(out, "chaos summary");
    let _ = writeln!(
        out,
        "  seed          {seed} (KMQD_CHAOS_SEED={seed} KMQD_CHAOS_SECONDS={seconds})"
    );
    let _ = writeln!(
        out,
        "  duration      {:.0} s of faults, {:.1} s drain",
        chaos_time.as_secs_f64(),
        drain_time.as_secs_f64()
    );
    let _ = writeln!(
        out,
        "  tasks         {pushed} pushed ({high} high, {} normal; {} flaky, {} throttling once, {} pills, {} deaf); \
         {} push calls \
         failed and were retried ({} tasks); {} pushed again after Redis lost its data",
        pushed - high,
        by_work.get(&Work::Flaky).unwrap_or(&0),
        by_work.get(&Work::Throttled).unwrap_or(&0),
        by_work.get(&Work::Pill).unwrap_or(&0),
        by_work.get(&Work::Deaf).unwrap_or(&0),
        ledger.failed_calls,
        ledger.failed_tasks,
        ledger.repushed
    );
    let _ = writeln!(
        out,
        "  final         {done} done ({deaf_done} of them deaf), {} dead ({})",
        dead_by_class.values().sum::<u64>(),
        dead_by_class
            .iter()
            .map(|(class, n)| format!("{class} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        out,
        "  faults        {faults}: kills {}, client kills {}, redis restarts {} term / {} kill / {} empty, stalls {} \
         ({} SIGSTOP, {} proxy), zombies {}, config changes {}, pills {}, deaf bursts {}",
        c(Kind::Kill9.label()),
        c(Kind::ClientKill.label()),
        c(Kind::RedisTerm.label()),
        c(Kind::RedisKill.label()),
        c(Kind::RedisEmpty.label()),
        c(Kind::RedisStall.label()),
        c("stalls (SIGSTOP)"),
        c("stalls (proxy)"),
        c(Kind::Zombie.label()),
        c(Kind::RollingConfig.label()),
        c(Kind::PoisonPill.label()),
        c(Kind::DeafHandlers.label()),
    );
    let _ = writeln!(
        out,
        "  daemons       {} processes; {} supervisor restarts ({} crashes by pills), {} lease losses logged ({} \
         during a graceful stop, {} without a zombie or Redis fault to explain them)",
        instances.len(),
        c("restarts"),
        c("crashes"),
        lease_losses,
        at_shutdown,
        unforced.len()
    );
    let _ = writeln!(
        out,
        "  runs          {} starts; {} tasks ran more than once, {} of them {} times again at an attempt number \
         they had run at (the rest are retries); {} past retry_times + 1 = {}; most runs of one task {}",
        facts.starts,
        check.rerun_tasks,
        check.same_attempt_tasks,
        check.same_attempt_runs,
        check.past_naive_bound,
        RETRY_TIMES + 1,
        check.max_runs
    );
    let _ = writeln!(out, "  re-run causes {causes}");
    let _ = writeln!(out, "  lost          {}", lost.len());
    let _ = writeln!(
        out,
        "  zombie starts {} runs started by a daemon as it woke, of tasks already handed to other daemons",
        check.zombie_wake_ups.len(),
    );
    let _ = writeln!(
        out,
        "  over-run      {}",
        check.over_runs.len() + check.over_attempts.len()
    );
    let watch = lock(&world.watch);
    let [jobs, limited] = per_queue;
    let _ = writeln!(
        out,
        "  queues        jobs {} pushed ({} pills, {} deaf), {} done, {} dead; limited (max_running {LIMIT_A}, \
         {LIMIT_B} on config B) {} pushed ({} pills, {} deaf), {} done, {} dead",
        jobs[0],
        jobs[3],
        jobs[4],
        jobs[1],
        jobs[2],
        limited[0],
        limited[3],
        limited[4],
        limited[1],
        limited[2]
    );
    let _ = writeln!(
        out,
        "  limit, Redis  {} samples of running[q] (every 20 ms): most {} (bound {LIMIT_BOUND}), at the bound in {:.0} %; \
         {} atomic snapshots found it equal to the unsettled positions of its counted claim lists (unless listed \
         below); running_underflow {} at most",
        watch.samples,
        watch.most,
        100.0 * watch.at_limit as f64 / watch.samples.max(1) as f64,
        watch.exact,
        watch.underflow
    );
    let _ = writeln!(
        out,
        "  limit, runs   most {} limited runs at once at {} (each from its start for its sleep, up to {:.1} s; bound \
         {bound}): {} runs counted, {} left out (a fault may have taken their daemon's lease), {} starts above \
         the bound",
        limit.most,
        world.rel(limit.most_at),
        HOLDS_AT_MOST_MS as f64 / 1e3,
        limit.counted,
        limit.excused,
        limit.over_count
    );
    let _ = writeln!(
        out,
        "  limit, rest   limited: ready {} + processing {} + delayed {}; running[q] {}, running_underflow {}; pushed {} \
         = done {} + dead {} (+ cancelled {}) in the last epoch; longest time without a limited task done while \
         faults were injected {limited_gap}",
        limited_stats.ready,
        limited_stats.processing,
        limited_stats.delayed,
        watch
            .at_rest
            .0
            .map_or("absent".to_string(), |n| n.to_string()),
        watch.at_rest.1.unwrap_or(0),
        limited_stats.pushed,
        limited_stats.done,
        limited_stats.dead,
        limited_stats.cancelled
    );
    drop(watch);
    let _ = writeln!(
        out,
        "  conservation  {} atomic snapshots over {} epochs, all balanced unless listed below; at the end (kmqd \
         stats, epoch {}): pushed {} = done {} + dead {} + ready {} + processing {} + delayed {} (+ cancelled {}); \
         recovered {}, retried {}, failed {}",
        c("conservation snapshots"),
        epoch + 1,
        epoch + 1,
        stats.pushed,
        stats.done,
        stats.dead,
        stats.ready,
        stats.processing,
        stats.delayed,
        stats.cancelled,
        stats.recovered,
        stats.retried,
        stats.failed
    );
    let _ = writeln!(
        out,
        "  recovery      worst {worst}, median {median:.2} s, over {} faults (from the end of a fault to the next \
         task done); longest time without a task done while faults were injected {longest_gap}",
        recoveries.len()
    );
    let _ = writeln!(out, "  daemon errors {errors}");
    let _ = write!(out, "  violations    {violations}");
    out
}

/// The run-budget check itself, on made-up runs: a run again at the same attempt number passes only with a cause
/// (a loss of the daemon that ran it, a Redis-wide fault, or a possibly duplicated push).
#[test]
fn the_run_budget_check_flags_runs_again_without_a_cause() {
    let run = |start_us: u64, attempt: u32, instance: usize| Run {
        start_us,
        attempt,
        instance,
    };
    let event = |what: What, instance: Option<usize>, from_us: u64, to_us: u64| Event {
        what,
        instance,
        from_us,
        to_us,
        note: String::new(),
    };
    let mut facts = Facts::default();
    let mut ledger = Ledger::default();
    let tasks: [(&str, u32, Vec<Run>); 7] = [
        // Retried: two attempt numbers, no cause needed.
        (
            "retried",
            0,
            vec![run(1_000_000, 0, 0), run(2_000_000, 1, 1)],
        ),
        // Its daemon was killed after the first run started.
        (
            "killed",
            0,
            vec![run(1_000_000, 0, 0), run(4_000_000, 0, 1)],
        ),
        // Again at the same attempt with nothing in between: an over-run.
        (
            "again",
            0,
            vec![run(10_000_000, 0, 1), run(11_000_000, 0, 2)],
        ),
        // The same, but a push of it may have been applied twice.
        (
            "duplicate",
            1,
            vec![run(10_000_000, 0, 1), run(11_000_000, 0, 2)],
        ),
        // Process 0 was killed, but this ran on process 2: the kill explains nothing here.
        (
            "elsewhere",
            0,
            vec![run(1_000_000, 0, 2), run(4_000_000, 0, 1)],
        ),
        // A Redis stall explains a run again on any daemon.
        (
            "stalled",
            0,
            vec![run(20_000_000, 0, 2), run(23_000_000, 0, 1)],
        ),
        // Recovered from the zombie process 2 and run on process 1, then started by the zombie as it woke.
        (
            "woke",
            0,
            vec![run(31_000_000, 0, 1), run(33_050_000, 0, 2)],
        ),
    ];
    for (id, maybe_copies, runs) in tasks {
        facts.runs.insert(id.to_string(), runs);
        ledger.order.push(id.to_string());
        ledger.tasks.insert(
            id.to_string(),
            Pushed {
                queue: Queue::Jobs,
                work: Work::Normal,
                level: 1,
                data: "{}".to_string(),
                sleep_ms: 10,
                maybe_copies,
            },
        );
    }
    let events = [
        event(What::Fault(Kind::Kill9), Some(0), 2_000_000, 2_000_000),
        event(What::Fault(Kind::ClientKill), None, 10_500_000, 10_500_000),
        event(What::Fault(Kind::RedisStall), None, 21_000_000, 23_000_000),
        event(What::Fault(Kind::Zombie), Some(2), 29_000_000, 33_000_000),
    ];
    let instances = [(0, Shape::A), (1, Shape::A), (2, Shape::B)];
    let check = check_runs(0, &facts, &ledger, &events, &instances);
    let flagged: Vec<&str> = check
        .over_runs
        .iter()
        .map(|text| text.split(' ').next().unwrap())
        .collect();
    assert_eq!(flagged, ["again", "elsewhere"], "{:#?}", check.over_runs);
    assert_eq!(
        check.causes.into_iter().collect::<Vec<_>>(),
        [("duplicate push", 1), ("kill -9", 1), ("redis stall", 1)]
    );
    assert_eq!(
        check.zombie_wake_ups.len(),
        1,
        "{:?}",
        check.zombie_wake_ups
    );
    assert!(check.zombie_wake_ups[0].starts_with("woke "));
    assert_eq!((check.same_attempt_runs, check.same_attempt_tasks), (6, 6));
    assert!(check.over_attempts.is_empty());
}

/// The limit check itself, on made-up runs: runs count from their start for their sleep (a deaf one for at most
/// [`HOLDS_AT_MOST_MS`], a pill not at all), only the limited queue's, and a run a fault may have taken from its
/// daemon is left out.
#[test]
fn the_limit_check_counts_runs_at_once_and_leaves_out_those_a_fault_took() {
    let mut facts = Facts::default();
    let mut ledger = Ledger::default();
    let mut add = |id: &str, queue: Queue, work: Work, sleep_ms: u64, runs: Vec<(u64, usize)>| {
        let runs = runs
            .into_iter()
            .map(|(start_us, instance)| Run {
                start_us,
                attempt: 0,
                instance,
            })
            .collect();
        facts.runs.insert(id.to_string(), runs);
        ledger.order.push(id.to_string());
        ledger.tasks.insert(
            id.to_string(),
            Pushed {
                queue,
                work,
                level: 1,
                data: "{}".to_string(),
                sleep_ms,
                maybe_copies: 0,
            },
        );
    };
    // Four at once, then each start after an end: never more than four.
    for (n, start) in [
        1_000_000, 1_010_000, 1_020_000, 1_030_000, 1_060_000, 1_065_000,
    ]
    .into_iter()
    .enumerate()
    {
        add(
            &format!("a{n}"),
            Queue::Limited,
            Work::Normal,
            50,
            vec![(start, n % 3)],
        );
    }
    // Five at once: one start above the bound.
    for n in 0..5 {
        add(
            &format!("b{n}"),
            Queue::Limited,
            Work::Normal,
            50,
            vec![(10_000_000 + n * 4_000, 1)],
        );
    }
    // A jobs task and a pill beside them count for nothing.
    add("jobs", Queue::Jobs, Work::Normal, 50, vec![(10_001_000, 0)]);
    add("pill", Queue::Limited, Work::Pill, 0, vec![(10_002_000, 0)]);
    // Five at once, one of them on a daemon killed as it ran: left out.
    for n in 0..4 {
        add(
            &format!("c{n}"),
            Queue::Limited,
            Work::Normal,
            50,
            vec![(20_000_000 + n * 1_000, 0)],
        );
    }
    add(
        "killed",
        Queue::Limited,
        Work::Normal,
        50,
        vec![(20_010_000, 2)],
    );
    // A deaf run holds its slot for at most HOLDS_AT_MOST_MS, then four more.
    add(
        "deaf",
        Queue::Limited,
        Work::Deaf,
        3000,
        vec![(30_000_000, 0)],
    );
    for n in 0..4 {
        add(
            &format!("d{n}"),
            Queue::Limited,
            Work::Normal,
            50,
            vec![(30_000_000 + HOLDS_AT_MOST_MS * 1000 + n * 1_000, 1)],
        );
    }
    let events = [Event {
        what: What::Fault(Kind::Kill9),
        instance: Some(2),
        from_us: 20_030_000,
        to_us: 20_030_000,
        note: String::new(),
    }];
    let check = check_limit(0, &facts, &ledger, &events, 4);
    assert_eq!(check.over_count, 1, "{:?}", check.over);
    assert!(
        check.over[0].starts_with("5 runs at +10.02s: [b0 "),
        "{:?}",
        check.over
    );
    assert_eq!((check.most, check.most_at), (5, 10_016_000));
    assert_eq!((check.counted, check.excused), (6 + 5 + 4 + 1 + 4, 1));
}
