//! The grouped queue's fair groups (`[queues.groups]`, beside a limit on the type `slow`; docs/RELIABILITY.md,
//! "Groups" and "Groups beside type limits"): what the sampler sees of each group (its count `running[g:GROUP]`
//! within 0 and its largest limit, its flow, its rate window, its throttle, the queue's own throttle never set)
//! and of the type's count `running[t:slow]`, each group's count against the runs counted in it at every
//! atomic snapshot, the checks on the run records (each group's runs at once and its starts per window of its
//! rate), the state at rest, and their lines of the summary.
//!
//! As for the typed queue ([`super::types`]), the records time a run's start but not its claim, which the limits
//! count on Redis's clock: the rate check leaves out the starts near a fault that loses, delays or ages out
//! Redis's count of them ([`rate_excused`]), and the runs-at-once check the runs a fault may have taken from their
//! daemon ([`check_limit`]), and each says how much it left out.

use std::fmt::Write as _;

use kmqd::broker::keys::{QueueKeys, group_member, group_scope, type_scope};

use crate::support::RedisServer;

use super::check::{LimitCheck, LimitWatch, Snapshot, check_limit};
use super::ledger::{Facts, Ledger, Pushed};
use super::types::{DISPATCH_US, RateCheck, check_rate, rate_excused, starts_of};
use super::workload::{
    API_WINDOW, GROUP_BOUND, GROUP_LIMIT_A, GROUP_LIMIT_B, GROUP_RATE_A, GROUP_RATE_B,
    GROUP_RATE_BOUND, GROUPED_SLOW_A, GROUPED_SLOW_B, GROUPED_SLOW_BOUND, GROUPS, Queue, SLOW,
    WEIGHTED,
};
use super::world::{Event, World, lock};

/// What the sampler and the snapshots saw of the grouped queue.
#[derive(Default)]
pub(super) struct GroupWatch {
    /// Each group's count (`running` field `g:GROUP`, [`GROUPS`] in order), seen as the limited queue's count is.
    pub(super) counts: [LimitWatch; GROUPS.len()],
    /// The queue's `running_underflow` (one counter for all its scopes), as [`World::check_underflow`] keeps it.
    pub(super) queue: LimitWatch,
    /// The count of its limited type beside the groups (`running[t:slow]`), sampled and snapshotted as a group's.
    pub(super) slow: LimitWatch,
    /// Samples in all; group samples that found a group at its bound with tasks waiting in its flow, its rate
    /// window full with tasks waiting, its throttle set.
    pub(super) samples: u64,
    pub(super) full: u64,
    pub(super) rated: u64,
    pub(super) throttled: u64,
    /// Samples with tasks waiting in a flow, and the most seen waiting in all the flows at once.
    pub(super) waiting: u64,
    pub(super) most_waiting: i64,
    /// Samples that found the queue's own throttle set (never: a handler's throttle holds back its group only),
    /// and whether the last one did.
    pub(super) queue_throttled: u64,
    queue_throttled_last: bool,
    /// Snapshots that found the queue's own count `q` above 0 (never: the queue has no `max_running` of its own).
    pub(super) q_counted: u64,
    /// Once every daemon stopped: the flows that held tasks and the ring members left, and the fields of the
    /// running hash left (none of each).
    pub(super) left: Vec<String>,
    pub(super) running_left: Vec<String>,
}

/// The grouped queue's keys (one level, "normal").
fn keys() -> QueueKeys {
    QueueKeys::new("kmq", Queue::Grouped.name(), &["normal".to_string()])
}

impl World<'_> {
    /// One sample of each group: its count (checked against its largest limit, and 0), its flow, its rate
    /// window's sum and its throttle; the queue's own throttle (never set) and `running_underflow` (0).
    pub(super) fn sample_groups(&self, conn: &mut redis::Connection) -> redis::RedisResult<()> {
        let keys = keys();
        let window_ms = API_WINDOW.as_millis() as u64;
        let mut pipe = redis::pipe();
        for group in GROUPS {
            pipe.cmd("HGET").arg(&keys.running).arg(group_scope(group));
        }
        for group in GROUPS {
            pipe.cmd("LLEN").arg(keys.flow(0, &group_member(group)));
        }
        for group in GROUPS {
            pipe.cmd("GET").arg(keys.group_rate_log(group, window_ms).1);
        }
        for group in GROUPS {
            pipe.cmd("EXISTS").arg(keys.group_throttle(group));
        }
        pipe.cmd("EXISTS")
            .arg(&keys.throttle)
            .cmd("HGET")
            .arg(&keys.stats)
            .arg("running_underflow")
            .cmd("HGET")
            .arg(&keys.running)
            .arg(type_scope(SLOW));
        let values: Vec<Option<i64>> = pipe.query(conn)?;
        let n = GROUPS.len();
        let at = super::world::now_us();
        let mut out_of_bounds = Vec::new();
        let mut watch = lock(&self.grouped);
        watch.samples += 1;
        let mut waiting = 0;
        for (g, group) in GROUPS.iter().enumerate() {
            let count = values[g].unwrap_or(0);
            let flow = values[n + g].unwrap_or(0);
            let rate = values[2 * n + g].unwrap_or(0);
            let throttled = values[3 * n + g].unwrap_or(0) > 0;
            let seen = &mut watch.counts[g];
            seen.samples += 1;
            seen.most = seen.most.max(count.max(0) as u64);
            seen.series.push((at, count.max(0) as u64));
            seen.at_limit += u64::from(count == GROUP_BOUND as i64);
            if count > GROUP_BOUND as i64 || count < 0 {
                out_of_bounds.push(format!("{group} at {count}"));
            }
            watch.full += u64::from(count >= GROUP_BOUND as i64 && flow > 0);
            watch.rated += u64::from(rate >= GROUP_RATE_BOUND as i64 && flow > 0);
            watch.throttled += u64::from(throttled);
            waiting += flow;
        }
        let slow = values[4 * n + 2].unwrap_or(0);
        watch.slow.samples += 1;
        watch.slow.most = watch.slow.most.max(slow.max(0) as u64);
        watch.slow.at_limit += u64::from(slow == GROUPED_SLOW_BOUND as i64);
        if slow > GROUPED_SLOW_BOUND as i64 || slow < 0 {
            out_of_bounds.push(format!("t:{SLOW} at {slow} (bound {GROUPED_SLOW_BOUND})"));
        }
        watch.waiting += u64::from(waiting > 0);
        watch.most_waiting = watch.most_waiting.max(waiting);
        let queue_throttle = values[4 * n].unwrap_or(0) > 0;
        watch.queue_throttled += u64::from(queue_throttle);
        let newly = queue_throttle && !watch.queue_throttled_last;
        watch.queue_throttled_last = queue_throttle;
        drop(watch);
        if !out_of_bounds.is_empty() {
            self.violation(format!(
                "the grouped queue's running counts (g:GROUP, t:slow) outside 0 to their largest limit ({GROUP_BOUND} \
                 a group): {}",
                out_of_bounds.join(", ")
            ));
        }
        if newly {
            self.violation(
                "the grouped queue's own throttle is set: a handler's throttle must hold back its group alone"
                    .to_string(),
            );
        }
        let underflow = values[4 * n + 1].unwrap_or(0).max(0) as u64;
        self.check_underflow(Queue::Grouped, underflow, "in a sample");
        Ok(())
    }

    /// The groups' invariant on one atomic snapshot of the grouped queue: each group's count equals the unsettled
    /// positions of the runs of claim lists counted in it, within 0 and its largest limit; the queue's own `q` is
    /// never counted (it has no `max_running`); no settle took a count below 0.
    pub(super) fn check_group_counts(&self, snap: &Snapshot, when: &str) {
        let mut wrong = Vec::new();
        {
            let mut watch = lock(&self.grouped);
            for (g, group) in GROUPS.iter().enumerate() {
                let (running, counted) = snap.groups[g];
                watch.counts[g].exact += 1;
                if running != counted || running > GROUP_BOUND as i64 || running < 0 {
                    wrong.push(format!(
                        "{group}: {running} in Redis, {counted} unsettled positions counted in it"
                    ));
                }
            }
            let (running, counted) = snap.slow;
            watch.slow.exact += 1;
            if running != counted || running > GROUPED_SLOW_BOUND as i64 || running < 0 {
                wrong.push(format!(
                    "t:{SLOW}: {running} in Redis, {counted} unsettled positions counted in it (bound \
                     {GROUPED_SLOW_BOUND})"
                ));
            }
            if snap.running != 0 || snap.counted != 0 {
                watch.q_counted += 1;
                wrong.push(format!(
                    "q: {} in Redis, {} unsettled positions counted in it (the queue has no max_running)",
                    snap.running, snap.counted
                ));
            }
        }
        if !wrong.is_empty() {
            self.violation(format!(
                "the grouped queue's running counts {when} (bound {GROUP_BOUND} a group): {}; {snap:?}",
                wrong.join("; ")
            ));
        }
        self.check_underflow(Queue::Grouped, snap.underflow.max(0) as u64, when);
    }

    /// At rest: no field left in the grouped queue's running hash (a count at 0 is deleted), no count went below
    /// 0, and no task is left in a flow nor a flow in a ring: no group stranded.
    pub(super) fn check_groups_at_rest(&self, redis: &RedisServer) {
        let keys = keys();
        // A count at 0 is deleted; `t:slow:limit`, the limit the claims counted the type under, stays.
        let running: Vec<String> = redis.cmd(&["HGETALL", &keys.running]);
        let running: Vec<String> = running
            .chunks(2)
            .filter(|pair| !pair[0].ends_with(":limit"))
            .flat_map(|pair| pair.iter().cloned())
            .collect();
        let underflow: Option<i64> = redis.cmd(&["HGET", &keys.stats, "running_underflow"]);
        let left = self.flows_left(redis, Queue::Grouped);
        if !running.is_empty() || underflow.unwrap_or(0) != 0 || !left.is_empty() {
            self.violation(format!(
                "at rest the grouped queue still has running counts {running:?} (none expected), running_underflow \
                 {underflow:?} (0 expected), flows and ring members {left:?} (none expected)"
            ));
        }
        let mut watch = lock(&self.grouped);
        watch.queue.at_rest = (None, underflow);
        watch.left = left;
        watch.running_left = running;
    }
}

/// What the end checks of the grouped queue found, for the summary: per group (in [`GROUPS`] order) its runs at
/// once and its starts per window.
pub(super) struct GroupChecks {
    limits: Vec<LimitCheck>,
    rates: Vec<RateCheck>,
}

/// The grouped queue's checks on the run records: each group's runs at once (never more than its largest
/// `max_running`) and its starts per window (never more than its largest `rate_limit` within the window less a
/// dispatch), each over its bound a violation, but what a fault explains.
pub(super) fn check_groups(
    world: &World<'_>,
    facts: &Facts,
    ledger: &Ledger,
    events: &[Event],
) -> GroupChecks {
    let stalls = lock(&world.typed).stalls.clone();
    let excused = rate_excused(events, &stalls);
    let mut checks = GroupChecks {
        limits: Vec::new(),
        rates: Vec::new(),
    };
    for group in GROUPS {
        let of_group = |task: &Pushed| task.queue == Queue::Grouped && task.group == Some(group);
        let limit = check_limit(
            world.t0_us,
            facts,
            ledger,
            events,
            GROUP_BOUND as usize,
            of_group,
        );
        let rate = check_rate(
            world.t0_us,
            &starts_of(facts, ledger, of_group),
            &excused,
            API_WINDOW.as_micros() as u64,
            GROUP_RATE_BOUND as usize,
        );
        for (listed, over, text) in [
            (
                &limit.over,
                limit.over_count,
                format!("more runs of group {group} at once than its max_running {GROUP_BOUND}"),
            ),
            (
                &rate.within.over,
                rate.within.over_count,
                format!(
                    "more starts of group {group} than its rate_limit {GROUP_RATE_BOUND} a second"
                ),
            ),
        ] {
            for one in listed {
                world.violation(format!("{text}: {one}"));
            }
            if over > listed.len() {
                world.violation(format!(
                    "{text}: {over} starts in all (the first listed above)"
                ));
            }
        }
        checks.limits.push(limit);
        checks.rates.push(rate);
    }
    checks
}

/// The summary's lines of the grouped queue; `finals` its [pushed, done, dead, pills, deaf].
pub(super) fn write_groups(
    out: &mut String,
    world: &World<'_>,
    ledger: &Ledger,
    checks: &GroupChecks,
    finals: [u64; 5],
) {
    let watch = lock(&world.grouped);
    let pushed: Vec<String> = GROUPS
        .iter()
        .map(|group| {
            let n = ledger
                .order
                .iter()
                .filter(|id| ledger.tasks[*id].group == Some(group))
                .count();
            format!("{group} {n}")
        })
        .collect();
    let _ = writeln!(
        out,
        "  grouped       {} pushed ({} pills, {} deaf), {} done, {} dead; by group {} ({WEIGHTED} of weight 3); \
         each group max_running {GROUP_LIMIT_A} ({GROUP_LIMIT_B} on config B), rate_limit {GROUP_RATE_A}/s \
         ({GROUP_RATE_B}/s on B)",
        finals[0],
        finals[3],
        finals[4],
        finals[1],
        finals[2],
        pushed.join(", ")
    );
    let share = |n: u64| 100.0 * n as f64 / (watch.samples * GROUPS.len() as u64).max(1) as f64;
    let counts = per_group(&watch.counts, |seen| {
        format!(
            "most {} at the bound {:.0} %",
            seen.most,
            100.0 * seen.at_limit as f64 / seen.samples.max(1) as f64
        )
    });
    let _ = writeln!(
        out,
        "  group counts  {} samples of running[g:GROUP] (every 20 ms; bound {GROUP_BOUND}): {}; of the group \
         samples {:.0} % full with tasks waiting, {:.0} % with the rate window full and tasks waiting, {:.0} % \
         throttled; tasks waiting in a flow in {} samples (most {}); {} atomic snapshots found every group's count \
         equal to the unsettled positions counted in it (unless listed below); running_underflow {} at most; \
         beside the groups, t:{SLOW} (max_running {GROUPED_SLOW_A}, {GROUPED_SLOW_B} on B) most {} in {} samples, \
         at its bound {:.0} %, checked exact in {} snapshots",
        watch.samples,
        counts,
        share(watch.full),
        share(watch.rated),
        share(watch.throttled),
        watch.waiting,
        watch.most_waiting,
        watch.counts[0].exact,
        watch.queue.underflow,
        watch.slow.most,
        watch.slow.samples,
        100.0 * watch.slow.at_limit as f64 / watch.slow.samples.max(1) as f64,
        watch.slow.exact
    );
    let runs = per_group(&checks.limits, |limit| {
        format!(
            "most {} ({} counted, {} left out, {} over)",
            limit.most, limit.counted, limit.excused, limit.over_count
        )
    });
    let _ = writeln!(
        out,
        "  group runs    runs at once from the records (bound {GROUP_BOUND}; left out: a fault may have taken their \
         daemon's lease): {}",
        runs
    );
    let rates = per_group(&checks.rates, |rate| {
        format!(
            "most {} ({} within 1 s; {} counted, {} left out, {} over)",
            rate.within.most,
            rate.most_whole,
            rate.within.counted,
            rate.within.excused,
            rate.within.over_count
        )
    });
    let _ = writeln!(
        out,
        "  group rate    starts within {} ms (the 1 s window less a dispatch; bound {GROUP_RATE_BOUND}; left out: near \
         a fault that loses, delays or ages out Redis's count of them, or a stall): {}",
        (API_WINDOW.as_micros() as u64 - DISPATCH_US) / 1000,
        rates
    );
    let _ = writeln!(
        out,
        "  group rest    the queue's own throttle seen in {} samples and q counted in {} snapshots (never expected); \
         at rest: flows and rings {}, running counts {}",
        watch.queue_throttled,
        watch.q_counted,
        if watch.left.is_empty() {
            "empty".to_string()
        } else {
            format!("{:?}", watch.left)
        },
        if watch.running_left.is_empty() {
            "none".to_string()
        } else {
            format!("{:?}", watch.running_left)
        }
    );
}

/// One item of `items` for each group of [`GROUPS`] (in order), as `line` writes it after the group's name.
fn per_group<T>(items: &[T], line: impl Fn(&T) -> String) -> String {
    GROUPS
        .iter()
        .zip(items)
        .map(|(group, item)| format!("{group} {}", line(item)))
        .collect::<Vec<_>>()
        .join(", ")
}
