//! The `defaults` scenario: a queue as a user writes it (`workers = 16`, nothing else) against the bench's tuned
//! shape (`--workers`, `--batch`, `--prefetch`: 4, 1000, 4000 unless given), draining the same no-op backlog in
//! the same session, each mode. The two alternate run by run, so that a noisy neighbour slows both alike; the
//! figure is the out-of-the-box rate, with the tuned rate and their ratio beside it. The goal
//! (docs/PERFORMANCE.md, "Defaults that find the speed") is a ratio of at least 0.8 in safe mode.

use super::{Bench, Figure, Shape, drain_once, figure, median};

/// The worker count of the out-of-the-box queue: what a user sets, nothing else.
const USER_WORKERS: usize = 16;

pub(super) fn defaults(bench: &Bench) -> Result<Vec<Figure>, String> {
    let own = bench.own();
    let mut figures = Vec::new();
    for mode in ["safe", "default"] {
        let plain = bench.config_on(
            &own.section,
            &format!("defaults-{mode}"),
            mode,
            None,
            Shape::out_of_the_box(USER_WORKERS),
        )?;
        let tuned = bench.config_on(
            &own.section,
            &format!("tuned-{mode}"),
            mode,
            None,
            bench.shape(),
        )?;
        let (mut rates, mut tuned_rates, mut daemon_cpu, mut redis_cpu, mut rss) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let tasks = (bench.options.tasks, "1");
        for _ in 0..bench.options.runs {
            let run = drain_once(bench, &own, &plain, 1, tasks, None)?;
            rates.push(run.rate);
            daemon_cpu.push(run.daemon_cpu);
            redis_cpu.push(run.redis_cpu);
            rss.push(run.rss_mb);
            tuned_rates.push(drain_once(bench, &own, &tuned, 1, tasks, None)?.rate);
        }
        let ratio = median(&rates) / median(&tuned_rates).max(1e-9);
        figures.push(figure(
            "defaults",
            format!("{mode} mode, workers = {USER_WORKERS} only, 1 daemon"),
            "tasks/s",
            rates,
            vec![
                ("tuned tasks/s".into(), tuned_rates),
                ("÷ tuned".into(), vec![ratio]),
                ("daemon CPU µs/task".into(), daemon_cpu),
                ("redis CPU µs/task".into(), redis_cpu),
                ("peak daemon RSS MB".into(), rss),
            ],
        ));
    }
    Ok(figures)
}
