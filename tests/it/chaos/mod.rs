//! The chaos suite: three real `kmqd` processes on five queues, four safe ones, `jobs` (two priority levels),
//! `limited` (one level, `max_running` 4 against the daemons' 12 workers), `typed` (limits per task type) and
//! `grouped` (fair groups with limits per group), and one in default mode, `popped`, under a steady load, while faults are injected at random ([`faults::FAULTS`]
//! lists them with their weights): `kill -9` and restarts, `CLIENT KILL`, Redis restarted on its append-only file
//! (after SIGTERM and after SIGKILL), Redis rewound (on `appendfsync everysec`, killed with its host: the tail of
//! its append-only file lost), Redis restarted empty, Redis stalled past the read timeout, steps of Redis's wall
//! clock (forward past every lease, and back), one call's reply delayed within the read timeout and one call's
//! request delivered after its caller gave up on it (the daemons' claims, settles and renewals, the producers'
//! pushes, default mode's pops), zombie daemons (SIGSTOP past the lease, then SIGCONT), rolling config changes
//! (which halve `limited`'s limit and `typed`'s), slow HTTP clients on a daemon's metrics endpoint, poison pills,
//! handlers that ignore cancel, and handlers that throttle their queue (their type on `typed`, their group on
//! `grouped`) for 100 ms once
//! (2 % of the tasks: each then runs again at the same attempt, a repeat its throttle explains, and is never
//! charged or dead-lettered for it). At the end it checks that no task of a safe queue was
//! lost, that no task ran more often than its mode's rules allow (at least once in safe mode, at most once in
//! default mode, but across Redis losing or rewinding its writes: see [`workload::Mode`]), that every queue is
//! drained under a live owner (and, after each rewind, that what Redis forgot was settled does not stay under a
//! live lease), conservation in Redis, and prints a summary (see [`report::report`]).
//!
//! The limited queue's invariant (docs/RELIABILITY.md, "Running limits") is checked throughout: Redis's count
//! (`kmq:{limited}:running` field `q`) never above the largest limit in use and `running_underflow` 0, sampled
//! every 20 ms; the count equal to the unsettled positions of the counted claim lists, at every atomic snapshot;
//! and, from the run records, never more of its handlers running at once than that limit, but for runs of a daemon
//! that a fault made lose its lease (see [`check::check_limit`]). At the end the count is absent and the queue drained.
//!
//! The typed queue's limits per task type (docs/RELIABILITY.md, "Limits per task type") are checked likewise, with
//! tasks of `slow` (`max_running` 2), `api` (`rate_limit` 20/s) and `other` (no limit of its own) pushed mixed and
//! in bursts: `running` field `t:slow` sampled within 0 and its largest limit and equal to the unsettled positions
//! of the runs counted in it at every snapshot, the queue's own throttle never set (its limited types' tasks
//! throttle their type); from the run records, `slow`'s runs at once, `api`'s starts per window and `other`'s
//! waits from push to first start, each but near the faults that explain more; at the end no flow and no ring
//! left (see [`types`]).
//!
//! The grouped queue's groups (docs/RELIABILITY.md, "Groups") likewise: four groups under `[queues.groups]`, each
//! with `max_running` 2 and `rate_limit` 10/s (halved on config B), `g0` of weight 3, pushed mixed and in bursts of
//! one group, 3 % of the tasks throttling their group once: each group's count (`running` field `g:GROUP`) sampled
//! within 0 and its largest limit, equal to the unsettled positions of the runs counted in it at every snapshot
//! (the flows' tasks counted as ready: waiting, not lost), the queue's own throttle never set; from the run records,
//! each group's runs at once and starts per window, each but near the faults that explain more; the drain completes
//! (no group stranded); at the end no count, no flow and no ring member left (see [`groups`]).
//!
//! Flows ([`flows`]) run on two queues of their own, `flowa` and `flowb`: a fan-in of thousands, chains and failing
//! parts under `fail` and `continue`; at the end every waiting task ran at most once, after its dependencies, and
//! ended as the flow's rules say (but for flows alive when Redis lost its data).
//!
//! Unique for a time ([`unique`]) runs on two queues of its own, `uniqs` (safe) and `uniqd` (default mode): a few
//! ids pushed again and again with a 200 ms `unique_for`; at the end no run of an id started within the window after
//! an earlier run's end, on Redis's clock (but near the faults known to lose a window, counted), and every id is
//! accepted again after the drain.
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
//! Topology: one private redis-server with the append-only file on and `appendfsync always` (so that a SIGKILL
//! loses nothing: the rewind fault switches it to `everysec` and cuts the file's tail itself, as a crash of the
//! host would), its wall clock movable ([`RedisOptions::clock_shift`]). The daemons and the producers talk to it
//! through a [`FaultProxy`] (stalls, delayed replies, late requests); the test's own reads (stats, the dead list,
//! `CLIENT KILL`, the completion sampler) go to its unix socket directly. Each daemon serves its metrics on a free
//! port: the slow clients attack it, and the drain asks it what it still holds of `popped`.
//!
//! Each daemon process gets its own config file and its own testkit record file, so that every run of a task is
//! known with the process that ran it: that is what lets the test check the run budget exactly (see
//! [`check::check_runs`]).
//!
//! One concern per file: [`workload`] (the queues, configs, tasks and producers), [`faults`] (what is injected and
//! the schedule), [`flows`] (the flows and their invariant), [`outbox`] (Redis losing its data or rewound, and the producer pushing again what it lost),
//! [`slowloris`] (the slow HTTP clients), [`world`] (what the threads share: the daemons, their supervisor, the
//! events), [`ledger`] (what was pushed, and what ran, from the record files), [`check`] (conservation, the running
//! counts, the run budget), [`types`] (the typed queue's limits), [`groups`] (the grouped queue's), [`unique`] (`unique_for`'s window) and [`report`]
//! (the end checks and the summary);
//! this file runs them.

mod check;
mod faults;
mod flows;
mod groups;
mod ledger;
mod outbox;
mod report;
mod slowloris;
mod types;
mod unique;
mod workload;
mod world;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

use kmqd::Client;
use kmqd::broker::QueueStats;

use crate::support::proxy::FaultProxy;
use crate::support::*;

use check::{LimitWatch, sample};
use faults::{FAULTS, Injector, Schedule};
use groups::GroupWatch;
use ledger::{Epoch, Facts, Ledger};
use types::TypedWatch;
use workload::{DAEMON_SECTION, DAEMONS, Mode, Queue, Rng, Shape, produce};
use world::{
    Daemons, Slot, StopOnDrop, What, World, lock, now_us, send_signal, supervise, tail, wait_exit,
};

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

    // The append-only file on `always` (a SIGKILL loses nothing: the rewind fault loses a tail itself), never
    // rewritten (the rewind cuts the file Redis appends to), and a wall clock the clock steps move.
    let redis = RedisServer::start_with(RedisOptions {
        appendonly: Some(Fsync::Always),
        clock_shift: true,
        extra_args: vec!["--auto-aof-rewrite-percentage".into(), "0".into()],
        ..RedisOptions::default()
    });
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
    let world = new_world(&dir, redis_section);
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
    let popped_rng = Rng::new(seed ^ 0x0070_6F70_7065_6400);
    let typed_rng = Rng::new(seed ^ 0x0000_7479_7065_6400);
    let grouped_rng = Rng::new(seed ^ 0x0067_726F_7570_6564);
    let flows_rng = Rng::new(seed ^ 0x0000_666C_6F77_7300);
    let unique_rng = Rng::new(seed ^ 0x0075_6E69_7175_6500);
    let unique_book = unique::Book::default();
    let redis_url = redis.url();
    let mut injector = Injector {
        world: &world,
        redis,
        proxy,
        client: client(&direct),
        rng: Rng::new(rng.next()),
        on_b: None,
        clock_offset_ms: 0,
    };
    let producer_client = client(&producer_config);
    let limited_client = client(&producer_config);
    let popped_client = client(&producer_config);
    let typed_client = client(&producer_config);
    let grouped_client = client(&producer_config);
    let flows_client = client(&producer_config);
    let unique_client = client(&producer_config);

    let (chaos_time, chaos_end_us, drain_time) = std::thread::scope(|scope| {
        let _stop = StopOnDrop(&world);
        let producer = scope.spawn(|| produce(&world, &producer_client, Queue::Jobs, producer_rng));
        let limited_producer =
            scope.spawn(|| produce(&world, &limited_client, Queue::Limited, limited_rng));
        let popped_producer =
            scope.spawn(|| produce(&world, &popped_client, Queue::Popped, popped_rng));
        let typed_producer =
            scope.spawn(|| produce(&world, &typed_client, Queue::Typed, typed_rng));
        let grouped_producer =
            scope.spawn(|| produce(&world, &grouped_client, Queue::Grouped, grouped_rng));
        let unique_producer = scope
            .spawn(|| unique::produce_unique(&world, &unique_client, &unique_book, unique_rng));
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

        // The flows' producer starts with the faults: its large fan-in drains under them.
        let flows_producer = scope.spawn(|| flows::produce_flows(&world, &flows_client, flows_rng));
        let schedule = Schedule::new(Rng::new(rng.next()));
        let chaos_started = Instant::now();
        inject_faults(&mut injector, schedule, seconds);
        let chaos_time = chaos_started.elapsed();
        let chaos_end_us = now_us();

        // The end: every daemon back on config A and running, the producer stopped, the queue drained.
        world.say("faults stop; every daemon back on config A");
        injector.back_on_a();
        world.producing.store(false, Ordering::SeqCst);
        producer.join().expect("the producer thread");
        limited_producer
            .join()
            .expect("the limited queue's producer thread");
        popped_producer
            .join()
            .expect("the default-mode queue's producer thread");
        typed_producer
            .join()
            .expect("the typed queue's producer thread");
        grouped_producer
            .join()
            .expect("the grouped queue's producer thread");
        flows_producer.join().expect("the flows' producer thread");
        unique_producer
            .join()
            .expect("the unique_for tasks' producer thread");
        let drain_started = Instant::now();
        drain(&world, &harness, &injector.redis);
        world.drain_flows(&injector.redis);
        unique::check_free_after_window(
            &world,
            &harness,
            &unique_book,
            Rng::new(seed ^ 0x0066_7265_6500),
        );
        let drain_time = drain_started.elapsed();
        world.running.store(false, Ordering::SeqCst);
        supervisor.join().expect("the supervisor thread");
        sampler.join().expect("the sampler thread");
        (chaos_time, chaos_end_us, drain_time)
    });

    let final_stats = stop_daemons(&world, &harness);
    check_at_rest(&world, &injector.redis);
    let flows = world.check_flows(&injector.redis);
    world.say(&format!(
        "flows: {:?} pushed ({} pushes sent again), {} judged, {} exempt (alive when Redis lost its data), {} never \
         acknowledged; {} waiting tasks: {} released and done, {} dead-lettered unrun",
        flows.flows, flows.failed_pushes, flows.judged, flows.exempt, flows.unacked, flows.waiters, flows.released,
        flows.failed
    ));
    for (queue, check) in world.check_unique(&unique_book) {
        world.say(&format!(
            "unique_for on {queue} (window {} ms): pushes {:?}; {} runs; {} pairs (a run's end, the next start) \
             judged, the shortest {:?} ms on Redis's clock; not judged, by the fault known to lose a window: {:?}",
            unique::WINDOW.as_millis(),
            check.pushes,
            check.runs,
            check.judged,
            check.shortest_us.map(|us| us as f64 / 1000.0),
            check.exempt
        ));
    }
    let report = report::report(
        &world,
        &final_stats,
        &report::Run {
            seed,
            seconds,
            chaos_time,
            chaos_end_us,
            drain_time,
        },
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

/// The shared state of a run whose daemons and producers reach Redis through `redis_section`, before any daemon
/// started.
fn new_world(dir: &TestDir, redis_section: String) -> World<'_> {
    World {
        dir,
        t0: Instant::now(),
        t0_us: now_us(),
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
            epochs: vec![Epoch::default()],
            ..Ledger::default()
        }),
        gate: RwLock::new(()),
        epoch: AtomicU32::new(0),
        producing: AtomicBool::new(true),
        running: AtomicBool::new(true),
        violations: Mutex::new(Vec::new()),
        completions: Mutex::new(Vec::new()),
        watch: Mutex::new(LimitWatch::default()),
        typed: Mutex::new(TypedWatch::default()),
        grouped: Mutex::new(GroupWatch::default()),
        counters: Mutex::new(BTreeMap::new()),
        tails: Mutex::new((Vec::new(), Facts::default())),
        dead_seen: Mutex::new(HashMap::new()),
        flows: Mutex::new(flows::FlowBook::default()),
        timeline: Mutex::new(Vec::new()),
    }
}

/// Injects a fault at each turn of `schedule` for `seconds`, with a conservation snapshot of each queue before
/// each one.
fn inject_faults(injector: &mut Injector<'_, '_>, mut schedule: Schedule, seconds: u64) {
    let world = injector.world;
    let chaos_started = Instant::now();
    let mut number = 0;
    while chaos_started.elapsed() < Duration::from_secs(seconds) {
        let (gap, kind) = schedule.next();
        std::thread::sleep(gap);
        injector.before_next_fault();
        number += 1;
        for queue in Queue::ALL {
            world.check_conservation(&injector.redis, queue, &format!("before fault #{number}"));
        }
        let what = injector.inject(kind);
        world.say(&format!("fault #{number} {}: {what}", kind.label()));
    }
    let never = schedule.never_injected();
    if !never.is_empty() {
        world.say(&format!(
            "{} fault kinds did not get a turn in {seconds} s: {never:?}",
            never.len()
        ));
    }
}

/// Waits until every queue is drained under a live owner (nothing ready, processing or delayed while a daemon
/// serves it) and every task has its final state (in default mode, or was lost: see below), checking conservation
/// on the way; a drain that takes longer than its bound is a violation.
fn drain(world: &World<'_>, harness: &Client, redis: &RedisServer) {
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
    // Default mode's tasks in a daemon's memory are in no key of Redis: its queue is settled once Redis holds
    // none of them and no daemon holds one, at two looks in a row with its counters unchanged in between (so that
    // nothing was on its way between Redis and a daemon). What has no final state then was lost.
    let mut idle_counts = None;
    loop {
        let looks: Vec<_> = Queue::ALL
            .iter()
            .map(|queue| drained_under_a_live_owner(harness, queue.name()))
            .collect();
        let flows_left: Vec<String> = [Queue::Typed, Queue::Grouped]
            .into_iter()
            .flat_map(|queue| world.flows_left(redis, queue))
            .collect();
        let empty = looks.iter().all(|(drained, _)| *drained) && flows_left.is_empty();
        let stats: Vec<_> = looks.into_iter().map(|(_, stats)| stats).collect();
        let counts = stats[Queue::Popped.index()]
            .as_ref()
            .ok()
            .map(|s| (s.done, s.dead, s.retried, s.failed));
        let idle = empty && world.held_by_daemons(Queue::Popped) == Some(0);
        let settled = idle && idle_counts.is_some() && idle_counts == counts;
        idle_counts = if idle { counts } else { None };
        world.read_dead_list(redis);
        for queue in Queue::ALL {
            world.check_conservation(redis, queue, "while draining");
        }
        let unfinished: Vec<String> = world
            .unfinished(empty)
            .into_iter()
            .filter(|(queue, _)| !(settled && queue.mode() == Mode::Default))
            .map(|(_, id)| id)
            .collect();
        if empty && unfinished.is_empty() {
            break;
        }
        if drain_started.elapsed() > within {
            world.violation(format!(
                "the drain did not end within {} s: {stats:?}; {} tasks have no final state, e.g. {:?}; flows left                  (a group or type stranded?): {flows_left:?}",
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
}

/// Checks that every queue is drained under a live owner (harness item 5 of the fault review: nothing stranded in
/// a claim list under a lease that is still renewed), then SIGTERMs every daemon (each must exit 0) and checks that
/// nothing changed after the drain. Returns the queues' stats before the stop.
fn stop_daemons(world: &World<'_>, harness: &Client) -> Vec<QueueStats> {
    for queue in Queue::ALL {
        let (drained, stats) = drained_under_a_live_owner(harness, queue.name());
        if !drained {
            world.violation(format!(
                "{} is not drained under a live owner at the end: {stats:?}, owners {:?}",
                queue.name(),
                harness.workers(queue.name())
            ));
        }
    }
    let final_stats: Vec<QueueStats> = Queue::ALL
        .iter()
        .map(|queue| harness.stats(queue.name()).expect("stats at the end"))
        .collect();
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
        let status = wait_exit(&mut process, Duration::from_secs(30));
        world.event(What::Stopped, Some(instance), from, String::new());
        if status.and_then(|s| s.code()) != Some(0) {
            world.violation(format!(
                "daemon {slot} (process #{instance}) did not exit 0 on SIGTERM at the end: {status:?}; its log ends:\n{}",
                tail(&process.log_text(), 20)
            ));
        }
    }
    drop(daemons);
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
    final_stats
}

/// At rest: the limited queue's count is gone (a field at 0 is deleted) and never went below 0; the typed queue's
/// as well, its flows empty and its rings too; the grouped queue's counts as well, its flows and rings empty.
fn check_at_rest(world: &World<'_>, redis: &RedisServer) {
    let at_rest = Queue::Limited.base();
    let running: Option<i64> = redis.cmd(&["HGET", &format!("{at_rest}:running"), "q"]);
    let underflow: Option<i64> =
        redis.cmd(&["HGET", &format!("{at_rest}:stats"), "running_underflow"]);
    if running.is_some() || underflow.unwrap_or(0) != 0 {
        world.violation(format!(
            "at rest the limited queue's running count is {running:?} (absent expected) and its running_underflow \
             {underflow:?} (0 expected)"
        ));
    }
    lock(&world.watch).at_rest = (running, underflow);
    world.check_types_at_rest(redis);
    world.check_groups_at_rest(redis);
}
