//! The typed queue's limits per task type (`[[queues.limits]]`; docs/RELIABILITY.md, "Limits per task type"):
//! what the sampler sees of them besides `slow`'s count ([`check::sample`](super::check::sample) samples it as the
//! limited queue's), the checks on the run records ([`SLOW`]'s runs at once, [`API`]'s starts per window of its
//! rate, [`OTHER`]'s waits), the state at rest, and their lines of the summary.
//!
//! The records time a run's start (the testkit's µs stamp) but not its claim, which the limits count on Redis's
//! clock; so each check leaves out what a fault may have moved between the two, by the stretches of the run it
//! names ([`rate_excused`], [`wait_excused`]), and says how much it left out.

use std::fmt::Write as _;

use kmqd::broker::keys::{QueueKeys, flow_member, type_scope};

use crate::support::RedisServer;

use super::check::{LimitCheck, LimitWatch, check_limit};
use super::faults::Kind;
use super::ledger::{Facts, Ledger, Pushed};
use super::workload::{
    API, API_BOUND, API_RATE_A, API_RATE_B, API_WINDOW, OTHER, Queue, SLOW, SLOW_BOUND,
    SLOW_LIMIT_A, SLOW_LIMIT_B, Work,
};
use super::world::{Event, What, World, lock, rel};

/// How late after its claim a run may start, in the checks of a rate: the dispatch skew RELIABILITY.md, "Running
/// limits", allows the rate tests (no 700 ms holds more than 10 starts of a `10/s` queue).
pub(super) const DISPATCH_US: u64 = 300_000;
/// The longest an [`OTHER`] task may wait from its push to its first start, but across a fault (see
/// [`wait_excused`]): one wake-up, one claim and one dispatch, which take tens of milliseconds on the loaded CI
/// machine: at most 0.14 s in eight runs (one of 300 s); in a ninth, three deaf handlers held most of the queue's
/// workers and a wait took 0.84 s, which is why their runs are left out. A type whose limit held it back would make
/// it wait for that limit: a `slow` slot (50 to 150 ms a run, after a burst of up to 30 tasks: seconds) or `api`'s
/// window (up to a second, after a burst).
pub(super) const WAIT_BOUND_US: u64 = 1_000_000;
/// A turn of the 20 ms sampler that comes this much later than the one before it: the machine starved the test
/// of CPU (or Redis did not answer), and the daemons likely with it.
pub(super) const STALL_US: u64 = 250_000;
/// How long after a fault that cut the daemons off Redis (a restart, a stall, connections killed, a late or held
/// call) a claim's reply may still be resolved, or a claim made: the threads retry at once, then back off from
/// 100 ms doubling while Redis stays away (after an outage of 2.5 s the next try comes within about 1.6 s), and
/// an owner whose lease ran out meanwhile registers anew.
const RECONNECT_US: u64 = 2_000_000;
/// As [`RECONNECT_US`], plus the lease renewal that finds the lease gone (every third of it) after a fault that
/// expires every lease (a stall past it, a forward step of Redis's clock).
const RECOVERY_US: u64 = 3_000_000;

/// What the sampler saw of the typed queue besides `slow`'s count.
#[derive(Default)]
pub(super) struct TypedWatch {
    /// `running` field `t:slow`, seen as the limited queue's count is.
    pub(super) count: LimitWatch,
    /// Samples in all, those that found `slow` at its bound with tasks waiting in its flow, and `api`'s window
    /// full (its log's sum at the bound) with tasks waiting in its flow.
    pub(super) samples: u64,
    pub(super) slow_held: u64,
    pub(super) api_held: u64,
    /// Every sample: (µs, slow held back, api held back), as above.
    pub(super) held: Vec<(u64, bool, bool)>,
    /// Samples that found `slow`'s throttle set, `api`'s, and the queue's own (never: only the limited types'
    /// tasks throttle, and a limited type's throttle is its own); whether the last sample found the queue's.
    pub(super) slow_throttled: u64,
    pub(super) api_throttled: u64,
    pub(super) queue_throttled: u64,
    queue_throttled_last: bool,
    /// Stretches (µs) with tasks in the quarantine: no owner claims a ready task meanwhile.
    pub(super) quarantined: Vec<(u64, u64)>,
    /// Turns of the sampler more than [`STALL_US`] after the one before (µs): the machine starved.
    pub(super) stalls: Vec<(u64, u64)>,
    last_turn: Option<u64>,
    /// Turns more than 100 ms after the one before (a stall or not): how loaded the machine was.
    pub(super) late_turns: u64,
    /// The flows that held tasks and the ring members left once every daemon stopped (none).
    pub(super) left: Vec<String>,
}

/// The typed queue's keys.
fn keys() -> QueueKeys {
    QueueKeys::new("kmq", Queue::Typed.name(), &["normal".to_string()])
}

impl World<'_> {
    /// Notes a turn of the sampler starting at `at` (µs): one long after the one before is a stall.
    pub(super) fn sampler_turn(&self, at: u64) {
        let mut typed = lock(&self.typed);
        if let Some(last) = typed.last_turn {
            let gap = at.saturating_sub(last);
            typed.late_turns += u64::from(gap > 100_000);
            if gap > STALL_US {
                typed.stalls.push((last, at));
            }
        }
        typed.last_turn = Some(at);
    }

    /// One sample of what holds the typed queue's types back: each limited type's flow, `slow`'s count, `api`'s
    /// window, the throttles (the queue's own must never be set), the quarantine.
    pub(super) fn sample_types(&self, conn: &mut redis::Connection) -> redis::RedisResult<()> {
        let keys = keys();
        let (_, api_sum) = keys.type_rate_log(API, API_WINDOW.as_millis() as u64);
        let mut pipe = redis::pipe();
        pipe.cmd("HGET")
            .arg(&keys.running)
            .arg(type_scope(SLOW))
            .cmd("LLEN")
            .arg(keys.flow(0, &flow_member(SLOW)))
            .cmd("GET")
            .arg(api_sum)
            .cmd("LLEN")
            .arg(keys.flow(0, &flow_member(API)))
            .cmd("EXISTS")
            .arg(&keys.throttle)
            .cmd("EXISTS")
            .arg(keys.type_throttle(SLOW))
            .cmd("EXISTS")
            .arg(keys.type_throttle(API));
        for list in &keys.quarantine {
            pipe.cmd("LLEN").arg(list);
        }
        type Sample = (
            Option<u64>,
            u64,
            Option<u64>,
            u64,
            bool,
            bool,
            bool,
            u64,
            u64,
            u64,
        );
        let (
            slow,
            slow_flow,
            api,
            api_flow,
            queue_throttle,
            slow_throttle,
            api_throttle,
            q1,
            q8,
            q64,
        ): Sample = pipe.query(conn)?;
        let at = super::world::now_us();
        let slow_held = slow.unwrap_or(0) >= SLOW_BOUND && slow_flow > 0;
        let api_held = api.unwrap_or(0) >= API_BOUND && api_flow > 0;
        let mut typed = lock(&self.typed);
        typed.samples += 1;
        typed.slow_held += u64::from(slow_held);
        typed.api_held += u64::from(api_held);
        typed.held.push((at, slow_held, api_held));
        typed.slow_throttled += u64::from(slow_throttle);
        typed.api_throttled += u64::from(api_throttle);
        if q1 + q8 + q64 > 0 {
            match typed.quarantined.last_mut() {
                Some((_, to)) if at.saturating_sub(*to) <= STALL_US => *to = at,
                _ => typed.quarantined.push((at, at)),
            }
        }
        typed.queue_throttled += u64::from(queue_throttle);
        let newly = queue_throttle && !typed.queue_throttled_last;
        typed.queue_throttled_last = queue_throttle;
        drop(typed);
        if newly {
            self.violation(
                "the typed queue's own throttle is set: only tasks of its limited types throttle, and their throttle \
                 must hold back their type alone"
                    .to_string(),
            );
        }
        Ok(())
    }

    /// The flows of `queue` (the typed or the grouped queue: one level each) that hold tasks and its rings'
    /// members (a ring names the flows that may hold tasks): none once it is drained.
    pub(super) fn flows_left(&self, redis: &RedisServer, queue: Queue) -> Vec<String> {
        let keys = QueueKeys::new("kmq", queue.name(), &["normal".to_string()]);
        let flows: Vec<String> = redis.cmd(&["KEYS", &format!("{}:flow:*", keys.base())]);
        let mut left: Vec<String> = flows
            .into_iter()
            .map(|flow| {
                let tasks: u64 = redis.cmd(&["LLEN", &flow]);
                format!("{flow} holds {tasks} tasks")
            })
            .collect();
        for ring in keys.rings() {
            let members: Vec<String> = redis.cmd(&["ZRANGE", &ring, "0", "-1"]);
            left.extend(
                members
                    .into_iter()
                    .map(|member| format!("{ring} names {member}")),
            );
        }
        left
    }

    /// At rest: `slow`'s count is gone (a field at 0 is deleted), no count of the queue went below 0, and no task
    /// is left in a flow nor a flow in a ring.
    pub(super) fn check_types_at_rest(&self, redis: &RedisServer) {
        let keys = keys();
        let running: Option<i64> = redis.cmd(&["HGET", &keys.running, &type_scope(SLOW)]);
        let underflow: Option<i64> = redis.cmd(&["HGET", &keys.stats, "running_underflow"]);
        if running.is_some() || underflow.unwrap_or(0) != 0 {
            self.violation(format!(
                "at rest the typed queue's running count t:{SLOW} is {running:?} (absent expected) and its \
                 running_underflow {underflow:?} (0 expected)"
            ));
        }
        let left = self.flows_left(redis, Queue::Typed);
        if !left.is_empty() {
            self.violation(format!(
                "at rest the typed queue's flows are not empty: {left:?}"
            ));
        }
        let mut typed = lock(&self.typed);
        typed.count.at_rest = (running, underflow);
        typed.left = left;
    }
}

/// The stretches (µs) in which a start of a rate-limited type may be more than [`DISPATCH_US`] after its claim,
/// or its claim counted against a log that missed starts: a fault that loses Redis's writes (a rewind, a restart
/// empty: the log's last second gone) or steps its clock forward (the log's entries age out early, its keys
/// expire: "Running limits" allows the window that holds the step twice its limit), from a window before it to a
/// window after; a fault that delays a claim's reply or loses it (a restart, a stall, killed connections, a held
/// or late call: the claim is adopted once Redis answers again), up to [`RECONNECT_US`] after it; and a stall of
/// the machine (`stalls`), up to a dispatch after it.
pub(super) fn rate_excused(events: &[Event], stalls: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let window = API_WINDOW.as_micros() as u64;
    let mut spans: Vec<(u64, u64)> = events
        .iter()
        .filter_map(|event| {
            let (before, after) = match event.what {
                What::Fault(Kind::RedisRewind | Kind::RedisEmpty) => (window, window + DISPATCH_US),
                What::Fault(Kind::ClockForward) => (DISPATCH_US, window + DISPATCH_US),
                What::Fault(
                    Kind::RedisTerm
                    | Kind::RedisKill
                    | Kind::RedisStall
                    | Kind::ClientKill
                    | Kind::DelayedReply
                    | Kind::LateRequest,
                ) => (DISPATCH_US, RECONNECT_US),
                _ => return None,
            };
            Some((event.from_us.saturating_sub(before), event.to_us + after))
        })
        .collect();
    spans.extend(stalls.iter().map(|&(from, to)| (from, to + DISPATCH_US)));
    spans
}

/// The stretches (µs) in which a task of a type without limits may wait for something other than the limited
/// types: a fault that cut every daemon off Redis or expired every lease (a restart, a stall, a loss or rewind of
/// its data, a forward step of its clock, killed connections), up to [`RECOVERY_US`] after it; a held or late
/// call, up to [`RECONNECT_US`] after it; a daemon lost (killed, crashed, paused past its lease, stopped, its
/// lease lost), while it lasted: a task it had claimed waits for the monitors; tasks in the quarantine
/// (`quarantined`: no owner claims a ready task while they wait); a run of a handler that ignores its cancel
/// (`deaf`: it holds its worker for its whole sleep, past the execution timeout that settles it, and the task's
/// next run takes another: a burst of three can hold most of the queue's workers, and a task then waits for one);
/// and a stall of the machine (`stalls`).
pub(super) fn wait_excused(
    events: &[Event],
    quarantined: &[(u64, u64)],
    deaf: &[(u64, u64)],
    stalls: &[(u64, u64)],
) -> Vec<(u64, u64)> {
    let mut spans: Vec<(u64, u64)> = events
        .iter()
        .filter_map(|event| {
            let after = match event.what {
                What::Fault(Kind::DelayedReply | Kind::LateRequest) => RECONNECT_US,
                What::Fault(Kind::Kill9 | Kind::Zombie | Kind::RollingConfig)
                | What::Crashed
                | What::LeaseLost
                | What::Stopped => 0,
                What::Fault(kind) if kind.is_redis_wide() || kind == Kind::ClientKill => {
                    RECOVERY_US
                }
                // A slowloris attack, a step back of the clock, a pill or a deaf handler pushed stop no claim.
                What::Fault(_) => return None,
            };
            Some((event.from_us, event.to_us + after))
        })
        .collect();
    // A quarantined group is taken by an owner that holds nothing, once the tasks it holds are settled.
    spans.extend(quarantined.iter().map(|&(from, to)| (from, to + STALL_US)));
    spans.extend_from_slice(deaf);
    spans.extend_from_slice(stalls);
    spans
}

/// Whether `from..=to` meets one of `spans`.
fn meets(spans: &[(u64, u64)], from: u64, to: u64) -> bool {
    spans.iter().any(|&(a, b)| a <= to && b >= from)
}

/// Every recorded start (id, µs) of the tasks `counts` picks, in the ledger's order: what a rate check reads.
pub(super) fn starts_of(
    facts: &Facts,
    ledger: &Ledger,
    counts: impl Fn(&Pushed) -> bool,
) -> Vec<(String, u64)> {
    ledger
        .order
        .iter()
        .filter(|id| counts(&ledger.tasks[*id]))
        .flat_map(|id| {
            let runs = facts.runs.get(id).into_iter().flatten();
            runs.map(|run| (id.clone(), run.start_us))
        })
        .collect()
}

/// What the records say of a rate-limited type's starts.
#[derive(Debug, Default)]
pub(super) struct RateCheck {
    /// Within the window less [`DISPATCH_US`]: the most starts and when that window ended, the starts counted
    /// and left out (in a stretch of [`rate_excused`]), those that made more than the limit.
    pub(super) within: LimitCheck,
    /// The most starts within the whole window.
    pub(super) most_whole: usize,
    /// Starts that ended a whole window holding the limit: how often the limit was reached.
    pub(super) at_limit: usize,
}

/// In no window of `window_us` less [`DISPATCH_US`] more than `limit` of `starts` (id, µs), leaving out those in
/// `excused`: the limit counts claims on Redis's clock, and a run starts within a dispatch of its claim.
pub(super) fn check_rate(
    t0_us: u64,
    starts: &[(String, u64)],
    excused: &[(u64, u64)],
    window_us: u64,
    limit: usize,
) -> RateCheck {
    let mut check = RateCheck::default();
    let mut kept: Vec<(u64, &str)> = Vec::new();
    for (id, at) in starts {
        if meets(excused, *at, *at) {
            check.within.excused += 1;
        } else {
            kept.push((*at, id));
        }
    }
    kept.sort_unstable();
    check.within.counted = kept.len();
    let span = window_us - DISPATCH_US;
    let (mut first, mut first_whole, mut was_over) = (0, 0, false);
    for (last, &(at, _)) in kept.iter().enumerate() {
        while kept[first].0 + span <= at {
            first += 1;
        }
        while kept[first_whole].0 + window_us <= at {
            first_whole += 1;
        }
        let within = last + 1 - first;
        let whole = last + 1 - first_whole;
        if within > check.within.most {
            (check.within.most, check.within.most_at) = (within, at);
        }
        check.most_whole = check.most_whole.max(whole);
        if whole >= limit {
            check.at_limit += 1;
        }
        let over = within > limit;
        if over {
            check.within.over_count += 1;
        }
        // One line for each stretch of starts over the limit, at its first.
        if over && !was_over && check.within.over.len() < 10 {
            let ids: Vec<String> = kept[first..=last]
                .iter()
                .map(|(at, id)| format!("{id}@{}", rel(t0_us, *at)))
                .collect();
            check.within.over.push(format!(
                "{within} starts within {} ms up to {}: {}",
                span / 1000,
                rel(t0_us, at),
                ids.join(" ")
            ));
        }
        was_over = over;
    }
    check
}

/// What the records say of the waits of a type without limits.
#[derive(Debug, Default)]
pub(super) struct WaitCheck {
    /// Tasks whose wait was checked, and those left out (their wait met a stretch of [`wait_excused`]).
    pub(super) checked: usize,
    pub(super) excused: usize,
    /// The checked waits (µs), sorted; the longest one's task, wait and push (µs).
    pub(super) waits: Vec<u64>,
    pub(super) longest: Option<(String, u64, u64)>,
    /// Waits longer than the bound, and the first ten of them.
    pub(super) over_count: usize,
    pub(super) over: Vec<String>,
}

impl WaitCheck {
    /// The `share` quantile of the checked waits (µs).
    pub(super) fn quantile(&self, share: f64) -> u64 {
        let at =
            ((self.waits.len() as f64 * share) as usize).min(self.waits.len().saturating_sub(1));
        self.waits.get(at).copied().unwrap_or(0)
    }
}

/// Every task of `waits` (id, pushed, first started, µs) started within `bound_us` of its push, but those whose
/// wait met a stretch of `excused`.
pub(super) fn check_waits(
    t0_us: u64,
    waits: &[(String, u64, u64)],
    excused: &[(u64, u64)],
    bound_us: u64,
) -> WaitCheck {
    let mut check = WaitCheck::default();
    for (id, pushed, started) in waits {
        if meets(excused, *pushed, *started) {
            check.excused += 1;
            continue;
        }
        check.checked += 1;
        let wait = started.saturating_sub(*pushed);
        check.waits.push(wait);
        if check
            .longest
            .as_ref()
            .is_none_or(|(_, longest, _)| wait > *longest)
        {
            check.longest = Some((id.clone(), wait, *pushed));
        }
        if wait > bound_us {
            check.over_count += 1;
            if check.over.len() < 10 {
                check.over.push(format!(
                    "{id} pushed at {} first started at {}: {:.2} s later",
                    rel(t0_us, *pushed),
                    rel(t0_us, *started),
                    wait as f64 / 1e6
                ));
            }
        }
    }
    check.waits.sort_unstable();
    check
}

/// What the end checks of the typed queue found, for the summary.
pub(super) struct TypeChecks {
    slow: LimitCheck,
    rate: RateCheck,
    waits: WaitCheck,
    /// [`OTHER`]'s first starts while `slow` was held back by its limit (the sample before showed it at its
    /// bound with tasks in its flow), and while `api` was (its window full, tasks in its flow).
    other_past_slow: usize,
    other_past_api: usize,
}

/// The typed queue's checks on the run records: `slow`'s runs at once, `api`'s starts per window, `other`'s
/// waits (each over its bound a violation).
pub(super) fn check_types(
    world: &World<'_>,
    facts: &Facts,
    ledger: &Ledger,
    events: &[Event],
) -> TypeChecks {
    let slow = check_limit(
        world.t0_us,
        facts,
        ledger,
        events,
        SLOW_BOUND as usize,
        |task| task.queue == Queue::Typed && task.kind == SLOW,
    );
    for text in &slow.over {
        world.violation(format!(
            "more {SLOW} runs at once than its max_running {SLOW_BOUND}: {text}"
        ));
    }
    let typed = lock(&world.typed);
    let of_type = |kind: &'static str| {
        ledger.order.iter().filter(move |id| {
            ledger.tasks[*id].queue == Queue::Typed && ledger.tasks[*id].kind == kind
        })
    };
    let rate = check_rate(
        world.t0_us,
        &starts_of(facts, ledger, |task| {
            task.queue == Queue::Typed && task.kind == API
        }),
        &rate_excused(events, &typed.stalls),
        API_WINDOW.as_micros() as u64,
        API_BOUND as usize,
    );
    for text in &rate.within.over {
        world.violation(format!(
            "more {API} starts than its rate_limit {API_BOUND} a second: {text}"
        ));
    }
    let deaf: Vec<(u64, u64)> = ledger
        .order
        .iter()
        .filter(|id| {
            ledger.tasks[*id].queue == Queue::Typed && ledger.tasks[*id].work == Work::Deaf
        })
        .flat_map(|id| {
            let holds_us = ledger.tasks[id].sleep_ms * 1000;
            let runs = facts.runs.get(id).into_iter().flatten();
            runs.map(move |run| (run.start_us, run.start_us + holds_us))
        })
        .collect();
    let waits: Vec<(String, u64, u64)> = of_type(OTHER)
        .filter_map(|id| {
            let pushed = ledger.tasks[id].acked_us?;
            let first = facts.runs.get(id)?.iter().map(|run| run.start_us).min()?;
            Some((id.clone(), pushed, first))
        })
        .collect();
    let waits_check = check_waits(
        world.t0_us,
        &waits,
        &wait_excused(events, &typed.quarantined, &deaf, &typed.stalls),
        WAIT_BOUND_US,
    );
    for text in &waits_check.over {
        world.violation(format!(
            "an {OTHER} task waited longer than {:.1} s with no fault to explain it (held back by the limited \
             types?): {text}",
            WAIT_BOUND_US as f64 / 1e6
        ));
    }
    for (listed, over, what) in [
        (
            slow.over.len(),
            slow.over_count,
            "starts made more slow runs at once than its limit",
        ),
        (
            rate.within.over.len(),
            rate.within.over_count,
            "api starts made more within a window than its limit",
        ),
        (
            waits_check.over.len(),
            waits_check.over_count,
            "other tasks waited longer than the bound",
        ),
    ] {
        if over > listed {
            world.violation(format!("{over} {what} in all (the first listed above)"));
        }
    }
    let held_at = |at: u64| {
        let next = typed.held.partition_point(|(sampled, ..)| *sampled <= at);
        next.checked_sub(1).map(|before| typed.held[before])
    };
    let (mut other_past_slow, mut other_past_api) = (0, 0);
    for (_, _, first) in &waits {
        if let Some((_, slow_held, api_held)) = held_at(*first) {
            other_past_slow += usize::from(slow_held);
            other_past_api += usize::from(api_held);
        }
    }
    TypeChecks {
        slow,
        rate,
        waits: waits_check,
        other_past_slow,
        other_past_api,
    }
}

/// The summary's lines of the typed queue.
pub(super) fn write_types(
    out: &mut String,
    world: &World<'_>,
    ledger: &Ledger,
    checks: &TypeChecks,
) {
    let typed = lock(&world.typed);
    let pushed = |kind: &str| {
        ledger
            .order
            .iter()
            .filter(|id| ledger.tasks[*id].queue == Queue::Typed && ledger.tasks[*id].kind == kind)
            .count()
    };
    let share = |n: u64| 100.0 * n as f64 / typed.samples.max(1) as f64;
    let count = &typed.count;
    let _ = writeln!(
        out,
        "  typed         {} {SLOW} (max_running {SLOW_LIMIT_A}, {SLOW_LIMIT_B} on config B), {} {API} (rate_limit \
         {API_RATE_A}/s, {API_RATE_B}/s on B), {} {OTHER} (no limit of its own) pushed, mixed and in bursts",
        pushed(SLOW),
        pushed(API),
        pushed(OTHER)
    );
    let _ = writeln!(
        out,
        "  type count    {} samples of running[t:{SLOW}] (every 20 ms): most {} (bound {SLOW_BOUND}), at the bound \
         in {:.0} %, with tasks waiting in its flow in {:.0} %; {} atomic snapshots found it equal to the \
         unsettled positions of the runs counted in it (unless listed below); running_underflow {} at most; at \
         rest {}",
        count.samples,
        count.most,
        100.0 * count.at_limit as f64 / count.samples.max(1) as f64,
        share(typed.slow_held),
        count.exact,
        count.underflow,
        count
            .at_rest
            .0
            .map_or("absent".to_string(), |n| n.to_string())
    );
    let slow = &checks.slow;
    let _ = writeln!(
        out,
        "  type runs     most {} {SLOW} runs at once at {} (bound {SLOW_BOUND}): {} runs counted, {} left out (a \
         fault may have taken their daemon's lease), {} starts above the bound",
        slow.most,
        world.rel(slow.most_at),
        slow.counted,
        slow.excused,
        slow.over_count
    );
    let rate = &checks.rate;
    let within = &rate.within;
    let _ = writeln!(
        out,
        "  type rate     most {} {API} starts within {} ms (its 1 s window less a dispatch; bound {API_BOUND}) at \
         {}, {} within 1 s; {} starts ended a second holding the limit; {} starts counted, {} left out (near a \
         fault that loses, delays or ages out Redis's count of them, or a stall); its window full with tasks \
         waiting in {:.0} % of the samples",
        within.most,
        (API_WINDOW.as_micros() as u64 - DISPATCH_US) / 1000,
        world.rel(within.most_at),
        rate.most_whole,
        rate.at_limit,
        within.counted,
        within.excused,
        share(typed.api_held)
    );
    let waits = &checks.waits;
    let longest = waits
        .longest
        .as_ref()
        .map_or("none".to_string(), |(id, wait, pushed)| {
            format!(
                "{:.3} s ({id}, pushed at {})",
                *wait as f64 / 1e6,
                world.rel(*pushed)
            )
        });
    let _ = writeln!(
        out,
        "  type waits    {OTHER}: {} waits from push to first start checked (bound {:.1} s), longest {longest}, \
         median {:.3} s, 99th percentile {:.3} s; {} left out (a fault, the quarantine, a deaf handler or a stall in \
         their wait); {} \
         started while {SLOW} was held back by its limit, {} while {API} was",
        waits.checked,
        WAIT_BOUND_US as f64 / 1e6,
        waits.quantile(0.5) as f64 / 1e6,
        waits.quantile(0.99) as f64 / 1e6,
        waits.excused,
        checks.other_past_slow,
        checks.other_past_api
    );
    let longest_stall = typed
        .stalls
        .iter()
        .map(|(from, to)| to - from)
        .max()
        .unwrap_or(0);
    let _ = writeln!(
        out,
        "  type rest     {SLOW}'s throttle seen in {} samples, {API}'s in {}, the queue's own in {} (never \
         expected); quarantine seen {} times; flows and rings at rest: {}; {} stalls of the sampler (longest {:.2} s; \
         {} of its turns came more than 100 ms after the one before)",
        typed.slow_throttled,
        typed.api_throttled,
        typed.queue_throttled,
        typed.quarantined.len(),
        if typed.left.is_empty() {
            "empty".to_string()
        } else {
            format!("{:?}", typed.left)
        },
        typed.stalls.len(),
        longest_stall as f64 / 1e6,
        typed.late_turns
    );
}

/// The rate check itself, on made-up starts: a window less the dispatch skew holding more than the limit is
/// flagged, one holding the limit is not, and starts near a fault that loses Redis's count are left out.
#[test]
fn the_rate_check_flags_more_starts_than_the_limit_within_a_window_less_a_dispatch() {
    let starts = |name: &str, from: u64, count: u64, every: u64| -> Vec<(String, u64)> {
        (0..count)
            .map(|n| (format!("{name}{n}"), from + n * every))
            .collect()
    };
    // 20 a second, evenly: at the limit, never over it.
    let even = starts("e", 1_000_000, 60, 50_000);
    let check = check_rate(0, &even, &[], 1_000_000, 20);
    assert_eq!(
        (check.within.over_count, check.most_whole),
        (0, 20),
        "{check:?}"
    );
    assert!(check.at_limit > 0);
    // 21 within 600 ms: over.
    let burst = starts("b", 10_000_000, 21, 30_000);
    let check = check_rate(0, &burst, &[], 1_000_000, 20);
    assert_eq!(check.within.over_count, 1, "{check:?}");
    assert!(
        check.within.over[0].starts_with("21 starts within 700 ms"),
        "{check:?}"
    );
    // The same around a rewind: left out.
    let rewind = Event {
        what: What::Fault(Kind::RedisRewind),
        instance: None,
        from_us: 10_100_000,
        to_us: 10_200_000,
        note: String::new(),
    };
    let check = check_rate(0, &burst, &rate_excused(&[rewind], &[]), 1_000_000, 20);
    assert_eq!(
        (check.within.over_count, check.within.excused),
        (0, 21),
        "{check:?}"
    );
    // 20 claimed in a burst, then 20 more a second later that started 250 ms early and late: within a dispatch.
    let mut skewed = starts("s", 20_250_000, 20, 1_000);
    skewed.extend(starts("t", 21_000_000, 20, 1_000));
    let check = check_rate(0, &skewed, &[], 1_000_000, 20);
    assert_eq!(check.within.over_count, 0, "{check:?}");
}

/// The wait check itself, on made-up waits: a wait past the bound is flagged unless a fault, the quarantine, a
/// deaf handler's run or a stall met it.
#[test]
fn the_wait_check_flags_a_long_wait_that_no_fault_explains() {
    let waits = [
        ("quick".to_string(), 1_000_000, 1_020_000),
        ("held".to_string(), 2_000_000, 3_500_000),
        ("killed".to_string(), 5_000_000, 8_000_000),
        ("stalled".to_string(), 10_000_000, 14_000_000),
        ("quarantined".to_string(), 20_000_000, 21_500_000),
        ("after".to_string(), 30_000_000, 31_200_000),
        ("deafened".to_string(), 40_000_000, 41_500_000),
    ];
    let event = |what: What, from_us: u64, to_us: u64| Event {
        what,
        instance: Some(0),
        from_us,
        to_us,
        note: String::new(),
    };
    let events = [
        event(What::Fault(Kind::Kill9), 6_000_000, 6_000_000),
        event(What::Fault(Kind::RedisStall), 9_000_000, 11_000_000),
        // A slowloris attack explains nothing.
        event(What::Fault(Kind::Slowloris), 30_100_000, 30_500_000),
    ];
    let deaf = [(39_000_000, 42_000_000)];
    let excused = wait_excused(&events, &[(20_500_000, 20_600_000)], &deaf, &[]);
    let check = check_waits(0, &waits, &excused, 1_000_000);
    assert_eq!((check.checked, check.excused), (3, 4), "{check:?}");
    assert_eq!(check.over_count, 2, "{check:?}");
    assert!(check.over[0].starts_with("held "), "{check:?}");
    assert!(check.over[1].starts_with("after "), "{check:?}");
    assert_eq!(
        check.longest,
        Some(("held".to_string(), 1_500_000, 2_000_000))
    );
}
