//! The end of a run: the daemons' logs read (lease losses, panics, errors), the final state of every task, the end
//! checks that need the whole run (recording violations), and the summary printed at the end.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, UNIX_EPOCH};

use kmqd::broker::QueueStats;

use super::check::{LimitCheck, RunCheck, check_limit, check_runs};
use super::faults::{FAULTS, Kind};
use super::groups::{check_groups, write_groups};
use super::ledger::{Epoch, Facts, Final, Ledger};
use super::types::{check_types, write_types};
use super::workload::{
    HOLDS_AT_MOST_MS, LEASE, LIMIT_A, LIMIT_B, LIMIT_BOUND, Mode, POPPED_HELD_MAX, QUEUES, Queue,
    RETRY_TIMES, Shape, Work,
};
use super::world::{Event, What, World, lock};

/// What the run was: its seed and length, and how long its faults and its drain took.
pub(super) struct Run {
    pub(super) seed: u64,
    pub(super) seconds: u64,
    pub(super) chaos_time: Duration,
    /// When the faults stopped (µs).
    pub(super) chaos_end_us: u64,
    pub(super) drain_time: Duration,
}

/// Runs the end checks (recording violations) and returns the summary.
pub(super) fn report(world: &World<'_>, all_stats: &[QueueStats], run: &Run) -> String {
    let logs = read_logs(world);
    let losses = explain_lease_losses(world);
    for text in &losses.unforced {
        world.say(&format!("lease loss without a fault: {text}"));
    }
    for panic in &logs.panics {
        world.violation(format!("a daemon thread panicked: {panic}"));
    }

    let guard = world.facts();
    let facts = &guard.1;
    let ledger = lock(&world.ledger);
    let events = lock(&world.events).clone();
    let check = check_runs(world.t0_us, facts, &ledger, &events, &logs.shapes);
    for text in check.over_runs.iter().chain(&check.over_attempts) {
        world.violation(format!("over-run: {text}"));
    }
    for text in &check.zombie_wake_ups {
        world.violation(format!("zombie wake-up: {text}"));
    }
    let finals = final_states(world, facts, &ledger);
    note_pills_and_deaf(world, facts, &ledger);
    check_conservation_at_end(world, all_stats, &ledger);
    let (bound, limit) = check_limit_from_runs(world, facts, &ledger, &events, &logs.shapes);
    let types = check_types(world, facts, &ledger, &events);
    let groups = check_groups(world, facts, &ledger, &events);

    let mut out = String::new();
    let _ = writeln!(out, "chaos summary");
    write_run(&mut out, world, run, &ledger, &finals);
    write_daemons(&mut out, world, &logs, &losses);
    write_runs(&mut out, facts, &check, &finals);
    write_limit(
        &mut out,
        world,
        all_stats,
        &finals,
        bound,
        &limit,
        run.chaos_end_us,
    );
    write_types(&mut out, world, &ledger, &types);
    write_groups(
        &mut out,
        world,
        &ledger,
        &groups,
        finals.per_queue[Queue::Grouped.index()],
    );
    write_conservation(&mut out, world, all_stats);
    write_recovery(&mut out, world, &events, run.chaos_end_us);
    let errors = if logs.errors.is_empty() {
        "none".to_string()
    } else {
        logs.errors
            .iter()
            .map(|(message, n)| format!("{n}x \"{message}\""))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let _ = writeln!(out, "  daemon errors {errors}");
    let _ = write!(out, "  violations    {}", lock(&world.violations).len());
    out
}

/// What the daemons' logs say.
struct Logs {
    /// Each process's slot and config, by its index.
    shapes: Vec<(usize, Shape)>,
    processes: usize,
    lease_losses: u64,
    panics: Vec<String>,
    /// The messages of ERROR lines, without their fields' values, and how often each came.
    errors: BTreeMap<String, u64>,
}

/// Reads every daemon process's log: its lease losses become events (they explain runs again), its panics and its
/// errors are counted.
fn read_logs(world: &World<'_>) -> Logs {
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
    Logs {
        shapes,
        processes: instances.len(),
        lease_losses,
        panics,
        errors,
    }
}

/// Parses a tracing timestamp at the start of a log line (`2026-12-01T10:16:31.123456Z ...`) into µs.
fn log_time_us(line: &str) -> Option<u64> {
    let stamp = line.split_whitespace().next()?;
    let time = humantime::parse_rfc3339(stamp).ok()?;
    Some(time.duration_since(UNIX_EPOCH).ok()?.as_micros() as u64)
}

/// Whether a daemon's log line says it found its lease gone, or gave its owner up because Redis lost writes it
/// had acknowledged (the journal check after a rewind): either way the tasks it held run again elsewhere.
fn is_lease_loss(line: &str) -> bool {
    line.contains("lease ran out before renewal")
        || line.contains("lease lost; registering")
        || line.contains("Redis lost claims or settlements it had acknowledged")
}

/// The lease losses the daemons logged, by what explains them.
struct LeaseLosses {
    /// Those logged while the daemon was being stopped (SIGTERM).
    at_shutdown: u64,
    /// Those no fault explains, described.
    unforced: Vec<String>,
}

/// A lease loss that no fault explains (no zombie of that daemon, no Redis-wide fault shortly before: a restart, a
/// stall, a loss or rewind of its data, a forward step of its clock): a daemon that could not renew within its
/// lease (CPU starvation on a loaded machine, or a weakness of kmqd).
fn explain_lease_losses(world: &World<'_>) -> LeaseLosses {
    let mut unforced = Vec::new();
    let mut at_shutdown = 0;
    let events = lock(&world.events);
    for loss in events.iter().filter(|event| event.what == What::LeaseLost) {
        let window = (LEASE + Duration::from_secs(3)).as_micros() as u64;
        let cause = events.iter().find(|event| {
            let near = event.from_us <= loss.to_us && event.to_us + window >= loss.to_us;
            let kind = match event.what {
                What::Fault(Kind::Zombie) => event.instance == loss.instance,
                What::Fault(kind) => kind.is_redis_wide(),
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
    LeaseLosses {
        at_shutdown,
        unforced,
    }
}

/// How the tasks ended, counted.
struct Finals {
    by_work: HashMap<Work, u64>,
    done: u64,
    dead_by_class: BTreeMap<&'static str, u64>,
    deaf_done: u64,
    /// Tasks without a final state: of a safe-mode queue (each one a violation), and of a default-mode queue
    /// (allowed: at most once loses what a daemon held when it died, and what a lost pop reply took).
    lost: Vec<String>,
    lost_at_most_once: Vec<String>,
    high: u64,
    /// Per queue ([`Queue::index`]): pushed, done, dead, and of the pushed, pills and deaf tasks.
    per_queue: [[u64; 5]; QUEUES],
}

/// The final state of every task: none of a safe-mode queue lost or never run, no pill done, nothing dead-lettered
/// but pills and deaf tasks.
fn final_states(world: &World<'_>, facts: &Facts, ledger: &Ledger) -> Finals {
    let mut finals = Finals {
        by_work: HashMap::new(),
        done: 0,
        dead_by_class: BTreeMap::new(),
        deaf_done: 0,
        lost: Vec::new(),
        lost_at_most_once: Vec::new(),
        high: 0,
        per_queue: [[0u64; 5]; QUEUES],
    };
    let mut never_ran = Vec::new();
    for id in &ledger.order {
        let task = &ledger.tasks[id];
        *finals.by_work.entry(task.work).or_default() += 1;
        let counts = &mut finals.per_queue[task.queue.index()];
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
            finals.high += 1;
        }
        let safe = task.queue.mode() == Mode::Safe;
        if safe && !facts.runs.contains_key(id) {
            never_ran.push(id.clone());
        }
        match world.final_state(id, task.work, facts, true) {
            None if safe => finals.lost.push(id.clone()),
            None => finals.lost_at_most_once.push(id.clone()),
            Some(Final::Done) => {
                finals.done += 1;
                match task.work {
                    Work::Pill => world.violation(format!("the poison pill {id} was done")),
                    Work::Deaf => finals.deaf_done += 1,
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
                *finals.dead_by_class.entry(class).or_default() += 1;
                if class == "other" {
                    world.violation(format!("{id} ({:?}) dead-lettered: {reason}", task.work));
                }
            }
        }
    }
    let lost = &finals.lost;
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
    finals
}

/// The life of every pill and deaf task, for the timeline file.
fn note_pills_and_deaf(world: &World<'_>, facts: &Facts, ledger: &Ledger) {
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
}

/// Conservation in Redis, for the last epoch (what Redis holds since it last came back empty or rewound), per
/// queue; and the pushes Redis counted against those the producer had acknowledged.
fn check_conservation_at_end(world: &World<'_>, all_stats: &[QueueStats], ledger: &Ledger) {
    let epoch = world.epoch.load(Ordering::SeqCst) as usize;
    for (queue, stats) in Queue::ALL.iter().zip(all_stats) {
        let accounted = stats.done
            + stats.dead
            + stats.cancelled
            + stats.ready
            + stats.processing
            + stats.delayed;
        // In default mode what daemons took with them is in none of these, and what they held when Redis lost its
        // data was settled into an epoch that never counted its push (see `World::check_conservation`).
        let balanced = match queue.mode() {
            Mode::Safe => accounted == stats.pushed,
            Mode::Default if epoch == 0 => accounted <= stats.pushed,
            Mode::Default => accounted <= stats.pushed + POPPED_HELD_MAX as u64,
        };
        if !balanced {
            world.violation(format!(
                "conservation of {} ({:?} mode): pushed {} against done {} + dead {} + cancelled {} + ready {} + \
                 processing {} + delayed {}",
                queue.name(),
                queue.mode(),
                stats.pushed,
                stats.done,
                stats.dead,
                stats.cancelled,
                stats.ready,
                stats.processing,
                stats.delayed
            ));
        }
        let Epoch { base, acked, maybe } = ledger.epochs[epoch];
        let (base, acked, maybe) = (
            base[queue.index()],
            acked[queue.index()],
            maybe[queue.index()],
        );
        let pushed = stats.pushed.saturating_sub(base);
        if stats.pushed < base || pushed < acked || pushed > acked + maybe {
            world.violation(format!(
                "Redis counted {pushed} pushes to {} in the last epoch ({} in all, {base} when it began); the \
                 producer had {acked} acknowledged and {maybe} more that may have been applied",
                queue.name(),
                stats.pushed
            ));
        }
    }
}

/// The limited queue: never more of its handlers at once than the largest limit of the configs in use, from the
/// run records. Returns that limit and what the check saw.
fn check_limit_from_runs(
    world: &World<'_>,
    facts: &Facts,
    ledger: &Ledger,
    events: &[Event],
    shapes: &[(usize, Shape)],
) -> (u64, LimitCheck) {
    let bound = shapes
        .iter()
        .map(|(_, shape)| shape.limit())
        .max()
        .unwrap_or(LIMIT_BOUND);
    let limit = check_limit(world.t0_us, facts, ledger, events, bound as usize, |task| {
        task.queue == Queue::Limited
    });
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
    (bound, limit)
}

/// The summary's first lines: the seed, the durations, the tasks and how they ended, the faults injected.
fn write_run(out: &mut String, world: &World<'_>, run: &Run, ledger: &Ledger, finals: &Finals) {
    let Run {
        seed,
        seconds,
        chaos_time,
        drain_time,
        ..
    } = run;
    let c = |name: &str| world.counter(name);
    let faults: u64 = FAULTS.iter().map(|(kind, _, _)| c(kind.label())).sum();
    let pushed = ledger.order.len() as u64;
    let by_work = |work: Work| finals.by_work.get(&work).copied().unwrap_or(0);
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
        "  tasks         {pushed} pushed ({} high, {} normal; {} flaky, {} throttling once, {} pills, {} deaf); \
         {} push calls \
         failed and were retried ({} tasks); {} pushed again after Redis lost its data",
        finals.high,
        pushed - finals.high,
        by_work(Work::Flaky),
        by_work(Work::Throttled),
        by_work(Work::Pill),
        by_work(Work::Deaf),
        ledger.failed_calls,
        ledger.failed_tasks,
        ledger.repushed
    );
    let _ = writeln!(
        out,
        "  final         {} done ({} of them deaf), {} dead ({})",
        finals.done,
        finals.deaf_done,
        finals.dead_by_class.values().sum::<u64>(),
        finals
            .dead_by_class
            .iter()
            .map(|(class, n)| format!("{class} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        out,
        "  faults        {faults}: kills {}, client kills {}, redis restarts {} term / {} kill / {} empty / {} rewound, \
         stalls {} ({} SIGSTOP, {} proxy), zombies {}, config changes {}, pills {}, deaf bursts {}, delayed replies \
         {}, late requests {}, clock steps {} forward / {} back, slowloris {}",
        c(Kind::Kill9.label()),
        c(Kind::ClientKill.label()),
        c(Kind::RedisTerm.label()),
        c(Kind::RedisKill.label()),
        c(Kind::RedisEmpty.label()),
        c(Kind::RedisRewind.label()),
        c(Kind::RedisStall.label()),
        c("stalls (SIGSTOP)"),
        c("stalls (proxy)"),
        c(Kind::Zombie.label()),
        c(Kind::RollingConfig.label()),
        c(Kind::PoisonPill.label()),
        c(Kind::DeafHandlers.label()),
        c(Kind::DelayedReply.label()),
        c(Kind::LateRequest.label()),
        c(Kind::ClockForward.label()),
        c(Kind::ClockBack.label()),
        c(Kind::Slowloris.label()),
    );
    write_new_faults(out, world, ledger);
}

/// What the faults of issue 34 did: which calls the proxy held, what the rewinds lost, where Redis's clock went,
/// what the slow HTTP clients met.
fn write_new_faults(out: &mut String, world: &World<'_>, ledger: &Ledger) {
    let c = |name: &str| world.counter(name);
    let calls = |prefix: &str| {
        let counters = lock(&world.counters);
        let by_call: Vec<String> = counters
            .iter()
            .filter_map(|(name, n)| Some(format!("{} {n}", name.strip_prefix(prefix)?)))
            .collect();
        if by_call.is_empty() {
            "none acted".to_string()
        } else {
            by_call.join(", ")
        }
    };
    let _ = writeln!(
        out,
        "  proxy         replies held 200-900 ms: {}; requests that reached Redis after their caller gave up: {}",
        calls("delayed reply: "),
        calls("late request: ")
    );
    let _ = writeln!(
        out,
        "  redis data    {} rewinds cut {} bytes off the append-only file ({} rewinds found it being rewritten), and \
         left {} ended tasks unsettled under live owners, each taken out in time; {} restarts empty; {} tasks \
         pushed again by the outbox, over {} epochs",
        c("rewinds"),
        c("rewound bytes"),
        c(Kind::RedisRewind.label()) - c("rewinds"),
        c("rewound settles"),
        c(Kind::RedisEmpty.label()),
        ledger.repushed,
        ledger.epochs.len()
    );
    let forward = c(&format!("{} ms", Kind::ClockForward.label())) as i64;
    let back = c(&format!("{} ms", Kind::ClockBack.label())) as i64;
    let _ = writeln!(
        out,
        "  redis clock   {} steps forward ({:+.1} s in all), {} back ({:+.1} s); it ends {:+.1} s off",
        c(Kind::ClockForward.label()),
        forward as f64 / 1e3,
        c(Kind::ClockBack.label()),
        -back as f64 / 1e3,
        (forward - back) as f64 / 1e3
    );
    let _ = writeln!(
        out,
        "  slowloris     {} attacks, {} slow clients in all; another client's scrape meanwhile answered 200 {} times, \
         503 {} times (the slow clients held every connection), nothing {} times in a stall of the machine (left \
         out); the daemons under attack started {} tasks meanwhile",
        c(Kind::Slowloris.label()),
        c("slowloris clients"),
        c("slowloris scrapes answered 200 meanwhile"),
        c("slowloris scrapes answered 503 meanwhile"),
        c("slowloris scrapes left out (a stall of the machine)"),
        c("slowloris starts meanwhile")
    );
}

/// The daemon processes, their restarts and their lease losses.
fn write_daemons(out: &mut String, world: &World<'_>, logs: &Logs, losses: &LeaseLosses) {
    let _ = writeln!(
        out,
        "  daemons       {} processes; {} supervisor restarts ({} crashes by pills), {} lease losses logged ({} \
         during a graceful stop, {} without a zombie or Redis fault to explain them)",
        logs.processes,
        world.counter("restarts"),
        world.counter("crashes"),
        logs.lease_losses,
        losses.at_shutdown,
        losses.unforced.len()
    );
}

/// The runs: how many, how many again and why, what was lost, the over-runs.
fn write_runs(out: &mut String, facts: &Facts, check: &RunCheck, finals: &Finals) {
    let causes = check
        .causes
        .iter()
        .map(|(cause, n)| format!("{cause} {n}"))
        .collect::<Vec<_>>()
        .join(", ");
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
    let _ = writeln!(
        out,
        "  at most once  popped (default mode): {} runs again at an attempt number it had run at, each after Redis \
         lost or rewound its writes, a throttle or a possibly duplicated push (an over-run otherwise)",
        check.at_most_once_repeats
    );
    let _ = writeln!(
        out,
        "  lost          {} of the safe queues; {} of popped (default mode: lost with the daemon that held them or a \
         pop whose reply was lost, as at most once allows)",
        finals.lost.len(),
        finals.lost_at_most_once.len()
    );
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
}

/// The queues' final states, and what the limited queue's count and runs were.
fn write_limit(
    out: &mut String,
    world: &World<'_>,
    all_stats: &[QueueStats],
    finals: &Finals,
    bound: u64,
    limit: &LimitCheck,
    chaos_end_us: u64,
) {
    let limited_stats = &all_stats[Queue::Limited.index()];
    let watch = lock(&world.watch);
    let [jobs, limited, popped, typed, _] = finals.per_queue;
    let _ = writeln!(
        out,
        "  queues        jobs {} pushed ({} pills, {} deaf), {} done, {} dead; limited (max_running {LIMIT_A}, \
         {LIMIT_B} on config B) {} pushed ({} pills, {} deaf), {} done, {} dead; popped (default mode) {} pushed ({} \
         pills, {} deaf), {} done, {} dead; typed (limits per task type) {} pushed ({} pills, {} deaf), {} done, {} \
         dead",
        jobs[0],
        jobs[3],
        jobs[4],
        jobs[1],
        jobs[2],
        limited[0],
        limited[3],
        limited[4],
        limited[1],
        limited[2],
        popped[0],
        popped[3],
        popped[4],
        popped[1],
        popped[2],
        typed[0],
        typed[3],
        typed[4],
        typed[1],
        typed[2]
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
    // What the count was meanwhile: slots held by tasks that did not finish.
    let gap = longest_gap(&watch.completions, chaos_end_us);
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
    let limited_gap = format!("{}; {meanwhile}", gap_text(world, gap));
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
}

/// The longest time between two completions while faults were injected (the drain ends with the slowest tasks:
/// pills and deaf handlers), and when it began (µs).
fn longest_gap(completions: &[u64], chaos_end_us: u64) -> Option<(u64, u64)> {
    completions
        .iter()
        .copied()
        .take_while(|&at| at <= chaos_end_us)
        .collect::<Vec<_>>()
        .windows(2)
        .map(|pair| (pair[1] - pair[0], pair[0]))
        .max()
}

fn gap_text(world: &World<'_>, gap: Option<(u64, u64)>) -> String {
    gap.map_or("none".to_string(), |(gap, from)| {
        format!("{:.2} s (from {})", gap as f64 / 1e6, world.rel(from))
    })
}

/// The conservation snapshots, and jobs' counters at the end.
fn write_conservation(out: &mut String, world: &World<'_>, all_stats: &[QueueStats]) {
    let epoch = world.epoch.load(Ordering::SeqCst) as usize;
    let stats = &all_stats[Queue::Jobs.index()];
    let _ = writeln!(
        out,
        "  conservation  {} atomic snapshots over {} epochs, all balanced unless listed below; at the end (kmqd \
         stats, epoch {}): pushed {} = done {} + dead {} + ready {} + processing {} + delayed {} (+ cancelled {}); \
         recovered {}, retried {}, failed {}",
        world.counter("conservation snapshots"),
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
}

/// Recovery: from the end of each fault to the next task completion; and the longest time without one.
fn write_recovery(out: &mut String, world: &World<'_>, events: &[Event], chaos_end_us: u64) {
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
    let median = recoveries
        .get(recoveries.len() / 2)
        .map_or(0.0, |(us, _)| *us as f64 / 1e6);
    let longest_gap = gap_text(world, longest_gap(&completions, chaos_end_us));
    let _ = writeln!(
        out,
        "  recovery      worst {worst}, median {median:.2} s, over {} faults (from the end of a fault to the next \
         task done); longest time without a task done while faults were injected {longest_gap}",
        recoveries.len()
    );
}
