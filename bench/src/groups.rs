//! The `groups` scenario: a no-op safe drain spread over [`GROUPS`] groups (`[queues.groups]`, each task of its
//! own group in turn) against the same drain without groups, one daemon, `prefetch = 0` in both (what groups
//! imply): issue 33's target is at least 0.5x, and Redis's CPU a task says what the turns cost.
//!
//! The grouped tasks are pushed as a producer of a grouped queue pushes them: routed by push.lua into their
//! groups' flows (the routes hash is set first, as a running daemon sets it), so the drain measures the turns,
//! not the claims' intake of a ready list.

use kmqd::client::{Client, NewTask};

use super::{Bench, Figure, Shape, drain_filled, figure};

/// The groups the tasks are spread over.
pub(super) const GROUPS: usize = 10_000;

pub(super) fn groups(bench: &Bench) -> Result<Vec<Figure>, String> {
    let o = &bench.options;
    let mut figures = Vec::new();
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
        let (mut rates, mut daemon_cpu, mut redis_cpu) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..o.runs {
            let run = drain_filled(bench, &bench.own(), &config, 1, (o.tasks, &fill), None)?;
            rates.push(run.rate);
            daemon_cpu.push(run.daemon_cpu);
            redis_cpu.push(run.redis_cpu);
        }
        figures.push(figure(
            "groups",
            format!(
                "no-op drain, prefetch 0, {what}, {} tasks over {groups} groups",
                o.tasks
            ),
            "tasks/s",
            rates,
            vec![
                ("daemon CPU µs/task".into(), daemon_cpu),
                ("redis CPU µs/task".into(), redis_cpu),
            ],
        ));
    }
    Ok(figures)
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
        let config = kmqd::config::Config::load(config).map_err(|e| e.to_string())?;
        let keys = kmqd::broker::QueueKeys::for_queue(&config.redis.key_prefix, &config.queues[0]);
        let _: i64 = redis::cmd("HSET")
            .arg(keys.routes())
            .arg("groups")
            .arg(1)
            .query(&mut bench.redis()?)
            .map_err(|e| format!("redis: {e}"))?;
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
