//! The `groups` scenario: a no-op safe drain spread over [`GROUPS`] groups (`[queues.groups]`, each task of its
//! own group in turn) against the same drain without groups, one daemon, `prefetch = 0` in both (what groups
//! imply): issue 33's target is at least 0.5x, and Redis's CPU a task says what the turns cost.
//!
//! The grouped tasks are pushed as a producer of a grouped queue pushes them: routed by push.lua into their
//! groups' flows (the routes hash is set first, as a running daemon sets it), so the drain measures the turns,
//! not the claims' intake of a ready list.

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
        let shape = Shape {
            workers: o.workers,
            batch: Some(o.batch),
            prefetch: Some(0),
            extra,
        };
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
