//! Unique for a time under chaos (issue 37, "Expiry and debounce"; docs/RELIABILITY.md, "Unique tasks"): a producer pushes a few ids again and again with `unique_for` [`WINDOW`] into two queues of their
//! own, [`UNIQUE_SAFE`] (safe mode) and [`UNIQUE_DEFAULT`] (default mode), while the faults run; most pushes are
//! refused (the id is live, or held after its task ended), the others run. The model checker's invariant
//! (model/src/unique.rs) is checked at the end on the testkit's records:
//! - no run of an id starts within the window after an earlier run's end, on Redis's clock (the hold expires on
//!   it): a run's end and the next start are read on the host's clock and moved by the steps of Redis's clock
//!   made before them. A handler's end comes before the settle that writes the hold, so the check is, if anything,
//!   lenient by that settle's latency;
//! - the id is free again after the window: after the drain every id is pushed once more, and must be accepted
//!   within [`FREE_WITHIN`] (a backward step of Redis's clock lengthens a hold by up to 3 s).
//!
//! Some faults are known to break the window, and are documented so (docs/RELIABILITY.md, the `unique_for` rows):
//! a pair of runs near them is not judged but counted, by cause, in the summary:
//! - Redis emptied or rewound loses holds as it loses any unique id ([`Cause::LostWrites`]);
//! - a step of Redis's clock at a run's end or the next start leaves the pair's order on Redis's clock unknown
//!   ([`Cause::ClockStep`]);
//! - in safe mode, a run again of the same task after a fault took it from its daemon (at least once: the same
//!   explanation as the run budget's, [`Event::explains`]) ([`Cause::RunAgain`]);
//! - in default mode, a lost owner's task back after its hold expired takes the id plain and its end leaves no
//!   hold (the open gap: model/README.md, "Unique for a time"); an owner is lost by a zombie pause, a stall of
//!   Redis, a forward step of its clock or a daemon's logged lease loss ([`Cause::LostOwner`]).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kmqd::{Client, NewTask, Pushed};

use super::faults::Kind;
use super::ledger::Run;
use super::workload::{Mode, Rng, TEST};
use super::world::{Event, SLACK_US, What, World, lock};

/// The unique_for tasks' two queues, one per mode.
pub(super) const UNIQUE_SAFE: &str = "uniqs";
pub(super) const UNIQUE_DEFAULT: &str = "uniqd";
/// The window of every push: short, so that an id cycles many times in a run.
pub(super) const WINDOW: Duration = Duration::from_millis(200);
/// Ids per queue.
const IDS: usize = 3;
/// How long after the drain an id may stay held: the window, a backward step of Redis's clock (up to 3 s), a task
/// of it still queued, on a loaded machine.
const FREE_WITHIN: Duration = Duration::from_secs(20);
/// What Redis's millisecond expiry and the two processes' readings of the clock may round away.
const ROUNDING_US: u64 = 2_000;
/// How long after a lost owner's fault its task may come back (handed back on waking, or retried).
const LOST_OWNER_US: u64 = 3_000_000;

/// The queues: (name, mode, the ids' prefix).
const QUEUES: [(&str, Mode, &str); 2] = [
    (UNIQUE_SAFE, Mode::Safe, "us"),
    (UNIQUE_DEFAULT, Mode::Default, "ud"),
];

/// The two queues' sections, with the suite's `common` settings (lease, timeouts, retries).
pub(super) fn queues(workers: u32, common: &str) -> String {
    QUEUES
        .iter()
        .map(|(name, mode, _)| {
            let mode = match mode {
                Mode::Safe => "safe",
                Mode::Default => "default",
            };
            format!(
                "[[queues]]\nname = \"{name}\"\nmode = \"{mode}\"\nworkers = {workers}\n{common}\n"
            )
        })
        .collect()
}

/// The pushes' outcomes per id.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Pushes {
    pub(super) accepted: u64,
    pub(super) refused: u64,
    pub(super) failed: u64,
}

/// What the producer did, shared with the end checks.
#[derive(Default)]
pub(super) struct Book {
    pushes: Mutex<BTreeMap<String, Pushes>>,
    /// Ids not accepted again within [`FREE_WITHIN`] after the drain.
    stuck: Mutex<Vec<String>>,
}

impl Book {
    fn count(&self, id: &str, outcome: impl FnOnce(&mut Pushes)) {
        outcome(lock(&self.pushes).entry(id.to_string()).or_default());
    }
}

fn ids() -> impl Iterator<Item = (&'static str, Mode, String)> {
    QUEUES.iter().flat_map(|&(queue, mode, prefix)| {
        (0..IDS).map(move |n| (queue, mode, format!("{prefix}{n}")))
    })
}

/// Pushes `id` once with the window; whether Redis took it (`None`: the call failed, the push may or may not
/// have been applied).
fn push(world: &World<'_>, client: &Client, rng: &mut Rng, queue: &str, id: &str) -> Option<bool> {
    let data = serde_json::json!({"sleep_ms": 1 + rng.below(20)}).to_string();
    // Cannot fail: the data is JSON and the window within what push.lua takes.
    let task = NewTask::new(TEST, &data).unwrap().id(id).unique_for(WINDOW);
    let _gate = world.gate.read().unwrap();
    client
        .push(queue, task)
        .ok()
        .map(|pushed| matches!(pushed, Pushed::Accepted(_)))
}

/// The producer: every 20 to 50 ms, a push of each id (most refused while the id is live or held).
pub(super) fn produce_unique(world: &World<'_>, client: &Client, book: &Book, mut rng: Rng) {
    while world.producing.load(Ordering::SeqCst) {
        for (queue, _, id) in ids() {
            match push(world, client, &mut rng, queue, &id) {
                Some(true) => book.count(&id, |p| p.accepted += 1),
                Some(false) => book.count(&id, |p| p.refused += 1),
                None => book.count(&id, |p| p.failed += 1),
            }
        }
        std::thread::sleep(rng.ms(20, 50));
    }
}

/// After the drain, with the daemons serving: each id is pushed until accepted, within [`FREE_WITHIN`]; one that
/// never is stays held past its window (a hold without its expiry, or a task of it stranded).
pub(super) fn check_free_after_window(
    world: &World<'_>,
    client: &Client,
    book: &Book,
    mut rng: Rng,
) {
    let deadline = Instant::now() + FREE_WITHIN;
    for (queue, _, id) in ids() {
        loop {
            if push(world, client, &mut rng, queue, &id) == Some(true) {
                book.count(&id, |p| p.accepted += 1);
                break;
            }
            if Instant::now() > deadline {
                lock(&book.stuck).push(format!("{queue}/{id}"));
                world.violation(format!(
                    "unique_for: {queue}/{id} was not free again {} s after the drain (window {} ms): a hold that \
                     does not expire, or a task of it stranded?",
                    FREE_WITHIN.as_secs(),
                    WINDOW.as_millis()
                ));
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Why a pair of runs was not judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Cause {
    LostWrites,
    ClockStep,
    RunAgain,
    LostOwner,
}

/// What the end check saw, per mode, for the summary.
#[derive(Debug, Default)]
pub(super) struct UniqueCheck {
    pub(super) pushes: Pushes,
    pub(super) runs: u64,
    /// Pairs judged: each run's end with the next start of its id after it, and any other start within the window
    /// after that end.
    pub(super) judged: u64,
    /// Pairs within the window not judged, by the fault known to lose a window near them.
    pub(super) exempt: BTreeMap<Cause, u64>,
    /// The shortest time from a run's end to the next start of the id, on Redis's clock, among judged pairs (µs;
    /// below the window only in a violation).
    pub(super) shortest_us: Option<i64>,
}

/// The steps of Redis's clock: when (the host's µs) and by how much (ms), from each fault's note (`{step:+} ms`,
/// as the injector writes it).
fn clock_steps(events: &[Event]) -> Vec<(u64, i64)> {
    events
        .iter()
        .filter(|e| matches!(e.what, What::Fault(Kind::ClockForward | Kind::ClockBack)))
        .filter_map(|e| Some((e.from_us, e.note.strip_suffix(" ms")?.parse().ok()?)))
        .collect()
}

/// `at` (the host's µs) on Redis's clock: moved by every step made before it.
fn on_redis_clock(steps: &[(u64, i64)], at: u64) -> i64 {
    let offset_ms: i64 = steps
        .iter()
        .filter(|(from, _)| *from <= at)
        .map(|(_, step)| step)
        .sum();
    at as i64 + offset_ms * 1000
}

/// Why the pair (`earlier` ended at `end_us`, `later` started at `later.start_us`) is not judged, if it is not.
fn exempt(
    mode: Mode,
    events: &[Event],
    steps: &[(u64, i64)],
    earlier: &Run,
    end_us: u64,
    later: &Run,
) -> Option<Cause> {
    let overlaps =
        |e: &Event, from: u64, to: u64| e.from_us <= to + SLACK_US && e.to_us + SLACK_US >= from;
    if events.iter().any(|e| {
        matches!(e.what, What::Fault(Kind::RedisEmpty | Kind::RedisRewind))
            && overlaps(e, earlier.start_us, later.start_us)
    }) {
        return Some(Cause::LostWrites);
    }
    let near = |at: u64, t: u64| at.abs_diff(t) <= SLACK_US;
    if steps
        .iter()
        .any(|&(from, _)| near(from, end_us) || near(from, later.start_us))
    {
        return Some(Cause::ClockStep);
    }
    match mode {
        Mode::Safe => events
            .iter()
            .any(|e| {
                e.explains(
                    Mode::Safe,
                    earlier.instance,
                    earlier.start_us,
                    later.start_us,
                )
            })
            .then_some(Cause::RunAgain),
        Mode::Default => events
            .iter()
            .any(|e| {
                let loses_owner = matches!(
                    e.what,
                    What::Fault(Kind::Zombie | Kind::RedisStall | Kind::ClockForward)
                        | What::LeaseLost
                );
                loses_owner
                    && e.from_us <= later.start_us + SLACK_US
                    && e.to_us + LOST_OWNER_US >= earlier.start_us
            })
            .then_some(Cause::LostOwner),
    }
}

/// When `run` ended: the first done end of its attempt on its process after its start (`None`: it was killed, or
/// its handler did not return done).
fn end_of(ends: &[(u32, usize, u64)], run: &Run) -> Option<u64> {
    ends.iter()
        .filter(|(attempt, instance, at)| {
            *attempt == run.attempt && *instance == run.instance && *at >= run.start_us
        })
        .map(|(_, _, at)| *at)
        .min()
}

impl World<'_> {
    /// The unique_for invariant (see the module's doc), checked at the end; returns what it saw, per mode.
    pub(super) fn check_unique(&self, book: &Book) -> BTreeMap<&'static str, UniqueCheck> {
        let guard = self.facts();
        let facts = &guard.1;
        let events = lock(&self.events).clone();
        let steps = clock_steps(&events);
        let pushes = lock(&book.pushes).clone();
        let window_us = WINDOW.as_micros() as i64;
        let mut checks: BTreeMap<&'static str, UniqueCheck> = BTreeMap::new();
        let mut violations = Vec::new();
        for (queue, mode, id) in ids() {
            let check = checks.entry(queue).or_default();
            let p = pushes.get(&id).copied().unwrap_or_default();
            check.pushes.accepted += p.accepted;
            check.pushes.refused += p.refused;
            check.pushes.failed += p.failed;
            let mut runs = facts.runs.get(&id).cloned().unwrap_or_default();
            runs.sort_by_key(|run| run.start_us);
            check.runs += runs.len() as u64;
            let ends = facts.ends.get(&id).cloned().unwrap_or_default();
            for earlier in &runs {
                let Some(end_us) = end_of(&ends, earlier) else {
                    continue;
                };
                let end_redis = on_redis_clock(&steps, end_us);
                // The starts after its end, nearest first: those within the window, then the first outside it.
                for later in runs.iter().filter(|later| later.start_us >= end_us) {
                    let gap_us = on_redis_clock(&steps, later.start_us) - end_redis;
                    let within = gap_us + (ROUNDING_US as i64) < window_us;
                    let cause = within
                        .then(|| exempt(mode, &events, &steps, earlier, end_us, later))
                        .flatten();
                    if let Some(cause) = cause {
                        *check.exempt.entry(cause).or_default() += 1;
                        continue;
                    }
                    check.judged += 1;
                    check.shortest_us = Some(check.shortest_us.map_or(gap_us, |s| s.min(gap_us)));
                    if !within {
                        break;
                    }
                    violations.push(format!(
                        "{queue}/{id} started at {} (attempt {}, process #{}) {} ms after a run of it ended at {} \
                         (attempt {}, process #{}), within its window of {} ms on Redis's clock, with no fault known \
                         to lose a window near: a hold expired early, or was never written?",
                        later.start_us,
                        later.attempt,
                        later.instance,
                        gap_us / 1000,
                        end_us,
                        earlier.attempt,
                        earlier.instance,
                        WINDOW.as_millis()
                    ));
                }
            }
        }
        drop(guard);
        self.violations("unique_for", violations, 30, "runs within a window");
        checks
    }
}
