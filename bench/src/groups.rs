//! The `groups` scenario: a no-op safe drain spread over [`GROUPS`] groups (`[queues.groups]`, each task of its
//! own group in turn) against the same drain without groups, one daemon, `prefetch = 0` in both (what groups
//! imply): issue 33's target is at least 0.5x, and Redis's CPU a task says what the turns cost.
//!
//! The grouped tasks are pushed as a producer of a grouped queue pushes them: routed by push.lua into their
//! groups' flows (the routes hash is set first, as a running daemon sets it), so the drain measures the turns,
//! not the claims' intake of a ready list.
//!
//! Two more scenarios measure groups at scale (docs/PERFORMANCE.md, "Fair groups"):
//! - `groups-scale`: the same drain over no groups, [`GROUPS`] and [`MANY_GROUPS`] groups, every group with tasks
//!   waiting throughout, so that a claim's cost (Redis CPU and `EVALSHA` µs a task, `INFO commandstats`) shows how
//!   it grows with the groups waiting: the ring's reads are O(log n).
//! - `groups-limit`: `[queues.groups] max_running = 2` over [`LIMITED_GROUPS`] groups, 3 daemons x 16 workers,
//!   2 ms handlers; half of the tasks spread over every group and half over [`HOT_GROUPS`] of them, so that once
//!   the spread ones are done the limit holds the hot groups back (at most 20 running). The drain rate, and the
//!   most tasks any group ran at once, sampled from the running hash throughout.
//! - `groups-rate`: `[queues.groups] rate_limit = "5/s"` over [`LIMITED_GROUPS`] groups, every group with a
//!   backlog, 3 daemons x 16 workers, no-op handlers, against the same drain with `[queues.groups]` and no limit:
//!   the rate against the pace the groups' limits allow, and what a group's rate log costs Redis a task at scale.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kmqd::client::{Client, NewTask};

use super::{Bench, Daemon, Drains, Figure, Progress, Shape, drain_filled, figure};

/// The groups the tasks are spread over.
pub(super) const GROUPS: usize = 10_000;

pub(super) fn groups(bench: &Bench) -> Result<Vec<Figure>, String> {
    let o = &bench.options;
    let mut figures = vec![fairness(bench)?];
    for (what, extra, groups) in [
        ("no groups", "", 1),
        ("groups", "[queues.groups]\n", GROUPS),
    ] {
        let shape = unprefetched(bench, extra);
        let name = format!("groups-{}", what.replace(' ', "-"));
        let config = bench.config_on(&bench.own().section, &name, "safe", None, shape)?;
        let fill = |client: &Client| fill_groups(bench, client, &config, o.tasks, groups);
        let drains = Drains::run(o.runs, || {
            drain_filled(bench, &bench.own(), &config, 1, (o.tasks, &fill), None)
        })?;
        let name = format!(
            "no-op drain, prefetch 0, {what}, {} tasks over {groups} groups",
            o.tasks
        );
        figures.push(drains.figure("groups", name, false));
    }
    Ok(figures)
}

/// The groups of `groups-scale`'s largest drain.
pub(super) const MANY_GROUPS: usize = 100_000;

/// `groups-scale`: drains of the same no-op tasks over none, [`GROUPS`] and [`MANY_GROUPS`] groups, one daemon,
/// `prefetch = 0`; at least two tasks a group, so that every group has tasks waiting until the drain's last turn.
pub(super) fn scale(bench: &Bench) -> Result<Vec<Figure>, String> {
    let o = &bench.options;
    let tasks = o.tasks.max(2 * MANY_GROUPS);
    let mut figures = Vec::new();
    for (what, extra, groups) in [
        ("no groups", "", 1),
        ("groups", "[queues.groups]\n", GROUPS),
        ("groups", "[queues.groups]\n", MANY_GROUPS),
    ] {
        let shape = unprefetched(bench, extra);
        let name = format!("groups-scale-{groups}");
        let config = bench.config_on(&bench.own().section, &name, "safe", None, shape)?;
        // The pushes run push.lua by EVALSHA too: the counts start after them.
        let fill = |client: &Client| {
            fill_groups(bench, client, &config, tasks, groups)?;
            redis::cmd("CONFIG")
                .arg("RESETSTAT")
                .exec(&mut bench.redis()?)
                .map_err(|e| format!("CONFIG RESETSTAT: {e}"))
        };
        let (mut rates, mut redis_cpu, mut script_us, mut calls) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..o.runs {
            let run = drain_filled(bench, &bench.own(), &config, 1, (tasks, &fill), None)?;
            let (evalsha_calls, evalsha_us) = evalsha(bench)?;
            rates.push(run.rate);
            redis_cpu.push(run.redis_cpu);
            script_us.push(evalsha_us as f64 / tasks as f64);
            calls.push(evalsha_calls as f64 / tasks as f64);
        }
        let what = if groups > 1 {
            format!("{groups} {what}")
        } else {
            what.to_string()
        };
        figures.push(figure(
            "groups-scale",
            format!("no-op drain, prefetch 0, {tasks} tasks over {what}"),
            "tasks/s",
            rates,
            vec![
                ("redis CPU µs/task".into(), redis_cpu),
                ("EVALSHA µs/task".into(), script_us),
                ("EVALSHA calls/task".into(), calls),
            ],
        ));
    }
    Ok(figures)
}

/// `INFO commandstats`' `EVALSHA` line: calls, and µs of Redis's time in them.
fn evalsha(bench: &Bench) -> Result<(u64, u64), String> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut bench.redis()?)
        .map_err(|e| format!("INFO commandstats: {e}"))?;
    let line = info
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:"))
        .unwrap_or("");
    let field = |name: &str| -> u64 {
        line.split(',')
            .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
            .and_then(|value| value.parse().ok())
            .unwrap_or(0)
    };
    Ok((field("calls"), field("usec")))
}

/// The groups of `groups-limit`, and the few of them that hold half of its tasks.
const LIMITED_GROUPS: usize = 1_000;
const HOT_GROUPS: usize = 10;

/// `groups-limit`'s `max_running` a group.
const LIMIT: u64 = 2;

/// How often `groups-limit` reads the running hash.
const SAMPLE_EVERY: Duration = Duration::from_millis(2);

/// `groups-limit`: `[queues.groups] max_running = 2`, [`DAEMONS`] daemons x [`WORKERS`] workers, 2 ms handlers,
/// over [`LIMITED_GROUPS`] groups (half of the tasks spread over all, half over [`HOT_GROUPS`] of them); the
/// running hash is sampled every [`SAMPLE_EVERY`] meanwhile.
pub(super) fn limit(bench: &Bench) -> Result<Figure, String> {
    let tasks = bench.options.tasks.min(40_000);
    let shape = Shape {
        extra: "[queues.groups]\nmax_running = 2\n",
        ..Shape::out_of_the_box(WORKERS)
    };
    let config = bench.config_on(&bench.own().section, "groups-limit", "safe", None, shape)?;
    let running_key = {
        let config = kmqd::config::Config::load(&config).map_err(|e| e.to_string())?;
        kmqd::broker::QueueKeys::for_queue(&config.redis.key_prefix, &config.queues[0]).running
    };
    let data = kmqd::task::data_from_str(r#"{"sleep_ms":2}"#).map_err(|e| e.to_string())?;
    let fill = |client: &Client| {
        route(bench, &config)?;
        let mut pushed = 0;
        while pushed < tasks {
            let chunk = (tasks - pushed).min(10_000);
            let batch = (pushed..pushed + chunk).map(|i| {
                let groups = if i % 2 == 0 {
                    LIMITED_GROUPS
                } else {
                    HOT_GROUPS
                };
                NewTask::with_data("test", data.clone()).group(format!("g{}", (i / 2) % groups))
            });
            client.push_batch("q", batch).map_err(|e| e.to_string())?;
            pushed += chunk;
        }
        Ok(())
    };
    let (mut rates, mut most, mut at_limit) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..bench.options.runs {
        let stop = AtomicBool::new(false);
        let mut connection = bench.redis()?;
        let (run, sampled) = std::thread::scope(|scope| {
            let sampler = scope.spawn(|| sample_running(&mut connection, &running_key, &stop));
            let run = drain_filled(bench, &bench.own(), &config, DAEMONS, (tasks, &fill), None);
            stop.store(true, Ordering::Relaxed);
            let sampled = sampler
                .join()
                .unwrap_or_else(|_| Err("the sampler panicked".into()));
            (run, sampled)
        });
        let (run, sampled) = (run?, sampled?);
        if sampled.most > LIMIT {
            return Err(format!(
                "a group ran {} tasks at once under max_running = {LIMIT}",
                sampled.most
            ));
        }
        rates.push(run.rate);
        most.push(sampled.most as f64);
        at_limit.push(100.0 * sampled.at_limit as f64 / sampled.samples.max(1) as f64);
    }
    Ok(figure(
        "groups-limit",
        format!(
            "[queues.groups] max_running = {LIMIT}, {tasks} tasks over {LIMITED_GROUPS} groups (half over \
             {HOT_GROUPS}), {DAEMONS} daemons x {WORKERS} workers, 2 ms handlers"
        ),
        "tasks/s",
        rates,
        vec![
            ("most running in a group".into(), most),
            ("% of samples with a group at its limit".into(), at_limit),
        ],
    ))
}

/// `groups-rate`'s limit a group, and what [`LIMITED_GROUPS`] groups of it allow in all.
/// Half or less of what the daemons drain without it here, so that the drain's pace is the limits', not theirs.
const GROUP_RATE: &str = "5/s";
const GROUPS_RATE_SUM: f64 = 5.0 * LIMITED_GROUPS as f64;

/// `groups-rate`: the same no-op drain over [`LIMITED_GROUPS`] groups (task i in group i mod that, so every group
/// keeps a backlog of several windows), [`DAEMONS`] daemons x [`WORKERS`] workers, with `[queues.groups]` and no
/// limit, then with a group `rate_limit` of [`GROUP_RATE`]: the rate reached against the pace the limits allow (a
/// backlog of k windows in k - 1 s), and Redis's CPU a task (each claim reads and writes the rate log of every
/// group it takes from).
pub(super) fn rate(bench: &Bench) -> Result<Vec<Figure>, String> {
    let tasks = bench.options.tasks.min(40_000);
    let mut figures = Vec::new();
    let shapes = [
        ("no limit", "[queues.groups]\n"),
        ("rate_limit 5/s", "[queues.groups]\nrate_limit = \"5/s\"\n"),
    ]
    .map(|(what, extra)| (what, extra, Shape::out_of_the_box(WORKERS)));
    for (what, extra, mut shape) in shapes {
        shape.extra = extra;
        let name = format!(
            "groups-rate-{}",
            if extra.contains("rate") { "5" } else { "none" }
        );
        let config = bench.config_on(&bench.own().section, &name, "safe", None, shape)?;
        let fill = |client: &Client| fill_groups(bench, client, &config, tasks, LIMITED_GROUPS);
        let (mut rates, mut ratios, mut redis_cpu, mut daemon_cpu) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..bench.options.runs {
            let run = drain_filled(bench, &bench.own(), &config, DAEMONS, (tasks, &fill), None)?;
            rates.push(run.rate);
            // A backlog of k windows a group drains in k - 1 s at the limit (the first window's starts go at
            // once): the rate's share of that pace.
            let windows = tasks as f64 / GROUPS_RATE_SUM;
            ratios.push(100.0 * (windows - 1.0) * run.rate / tasks as f64);
            redis_cpu.push(run.redis_cpu);
            daemon_cpu.push(run.daemon_cpu);
        }
        figures.push(figure(
            &name,
            format!(
                "[queues.groups] {what}, {tasks} no-op tasks over {LIMITED_GROUPS} groups, {DAEMONS} daemons x \
                 {WORKERS} workers"
            ),
            "tasks/s",
            rates,
            vec![
                (format!("% of {LIMITED_GROUPS} x {GROUP_RATE}'s pace"), ratios),
                ("redis CPU µs/task".into(), redis_cpu),
                ("daemon CPU µs/task".into(), daemon_cpu),
            ],
        ));
    }
    Ok(figures)
}

/// What the running hash's samples saw.
#[derive(Default)]
struct Sampled {
    samples: u64,
    /// The most tasks any group was counted running in a sample.
    most: u64,
    /// Samples in which some group was at [`LIMIT`].
    at_limit: u64,
}

/// Reads the running hash every [`SAMPLE_EVERY`] until `stop`: each group's count (`g:GROUP`; `g:GROUP:limit`
/// is the limit it was counted under, not a count).
fn sample_running(
    connection: &mut redis::Connection,
    key: &str,
    stop: &AtomicBool,
) -> Result<Sampled, String> {
    let mut sampled = Sampled::default();
    while !stop.load(Ordering::Relaxed) {
        let counts: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(key)
            .query(connection)
            .map_err(|e| format!("HGETALL {key}: {e}"))?;
        let most = counts
            .iter()
            .filter(|(field, _)| field.starts_with("g:") && !field.ends_with(":limit"))
            .filter_map(|(_, count)| count.parse::<u64>().ok())
            .max()
            .unwrap_or(0);
        sampled.samples += 1;
        sampled.most = sampled.most.max(most);
        sampled.at_limit += u64::from(most >= LIMIT);
        std::thread::sleep(SAMPLE_EVERY);
    }
    Ok(sampled)
}

/// The bench's queue shape with `prefetch = 0`, what groups imply, and `extra`.
fn unprefetched(bench: &Bench, extra: &'static str) -> Shape {
    Shape {
        prefetch: Some(0),
        extra,
        ..bench.shape()
    }
}

/// The backlog of one group the fairness run pushes first.
const BACKLOG: usize = 10_000;

/// The daemons and workers of the fairness run.
const DAEMONS: usize = 3;
const WORKERS: usize = 16;

/// Issue 33's fairness through the daemons' buffers: behind a backlog of [`BACKLOG`] tasks of one group (2 ms
/// handlers, [`DAEMONS`] daemons x [`WORKERS`] workers), a task of another group pushed once the backlog runs
/// should start within about (groups waiting x workers) starts: the figure is the backlog's starts between its
/// push and its start (the testkit's records, one clock).
fn fairness(bench: &Bench) -> Result<Figure, String> {
    let record = bench.dir.path().join("groups-fairness.log");
    let shape = Shape {
        extra: "[queues.groups]\n",
        ..Shape::out_of_the_box(WORKERS)
    };
    let target = bench.own();
    let config = bench.config_on(
        &target.section,
        "groups-fairness",
        "safe",
        Some(&record),
        shape,
    )?;
    let mut ahead = Vec::new();
    for _ in 0..bench.options.runs {
        let _ = std::fs::remove_file(&record);
        target.flush()?;
        let client = bench.client(&config)?;
        route(bench, &config)?;
        let data = kmqd::task::data_from_str(r#"{"sleep_ms":2}"#).map_err(|e| e.to_string())?;
        let backlog = (0..BACKLOG).map(|_| NewTask::with_data("test", data.clone()).group("big"));
        client.push_batch("q", backlog).map_err(|e| e.to_string())?;
        let mut progress = Progress::new(&config, target.holder)?;
        let daemons: Vec<Daemon> = (0..DAEMONS)
            .map(|_| bench.daemon(&config))
            .collect::<Result<_, _>>()?;
        let deadline = Instant::now() + Duration::from_secs(300);
        while progress.left()? > (BACKLOG - 500) as u64 {
            if Instant::now() > deadline {
                return Err("the backlog did not start within 300 s".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let pushed_at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_err(|e| e.to_string())?
            .as_micros() as u64;
        client
            .push(
                "q",
                NewTask::new("test", "1")
                    .map_err(|e| e.to_string())?
                    .id("late")
                    .group("late"),
            )
            .map_err(|e| e.to_string())?;
        while progress.left()? > 0 {
            if Instant::now() > deadline {
                return Err("the fairness run did not drain within 300 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for daemon in daemons {
            daemon.stop();
        }
        let text =
            std::fs::read_to_string(&record).map_err(|e| format!("{}: {e}", record.display()))?;
        let starts: Vec<(&str, u64)> = text
            .lines()
            .filter(|line| line.starts_with("start "))
            .filter_map(|line| {
                let mut parts = line.split(' ');
                let id = parts.nth(1)?;
                Some((id, parts.nth(2)?.parse().ok()?))
            })
            .collect();
        let late = starts
            .iter()
            .find(|(id, _)| *id == "late")
            .map(|(_, at)| *at)
            .ok_or("the late task's start is not in the records")?;
        let between = starts
            .iter()
            .filter(|(id, at)| *id != "late" && *at >= pushed_at && *at < late)
            .count();
        ahead.push(between as f64);
    }
    Ok(figure(
        "groups",
        format!(
            "fairness: a task of another group pushed behind {BACKLOG} of one, {DAEMONS} daemons x {WORKERS} \
             workers, 2 ms handlers"
        ),
        "starts ahead of it",
        ahead,
        vec![(
            "issue 33's bound: groups x workers".into(),
            vec![(2 * DAEMONS * WORKERS) as f64],
        )],
    ))
}

/// Sets the queue's routes hash, as a running grouped daemon does, so that pushes go to the groups' flows.
fn route(bench: &Bench, config: &std::path::Path) -> Result<(), String> {
    let config = kmqd::config::Config::load(config).map_err(|e| e.to_string())?;
    let keys = kmqd::broker::QueueKeys::for_queue(&config.redis.key_prefix, &config.queues[0]);
    let _: i64 = redis::cmd("HSET")
        .arg(keys.routes())
        .arg("groups")
        .arg(1)
        .query(&mut bench.redis()?)
        .map_err(|e| format!("redis: {e}"))?;
    Ok(())
}

/// Pushes `n` no-op tasks, task i of group `g{i % groups}` (with one group: none), routed to their flows when
/// the queue has groups.
fn fill_groups(
    bench: &Bench,
    client: &Client,
    config: &std::path::Path,
    n: usize,
    groups: usize,
) -> Result<(), String> {
    if groups > 1 {
        route(bench, config)?;
    }
    let mut pushed = 0;
    while pushed < n {
        let chunk = (n - pushed).min(10_000);
        let tasks = (pushed..pushed + chunk).map(|i| {
            let task = NewTask::new("test", "1").expect("1 is JSON");
            if groups > 1 {
                task.group(format!("g{}", i % groups))
            } else {
                task
            }
        });
        client.push_batch("q", tasks).map_err(|e| e.to_string())?;
        pushed += chunk;
    }
    Ok(())
}
