//! The `latency` scenario: what an application feels on every push (issue 38), the time from just before a
//! push to its handler's start, at p50, p99 and p999, for an idle queue (each task pushed once the daemon's
//! fetcher waits in Redis again: the wake path) and for a queue kept at half its drain rate (tasks that sleep
//! 1 ms, pushed one at a time at an even pace: the wake path with workers busy beside it, and the tasks that
//! queue behind them). A regression in either shows in the one-run table (docs/PERFORMANCE.md, "Push to start
//! on an idle queue").

use std::time::{Duration, Instant};

use super::{Bench, Figure, NewTask, Starts, figure, idle_samples, now_us, percentile};

/// Samples per run on the idle queue: enough for a p999 that is not the run's maximum.
pub const IDLE_SAMPLES: usize = 2000;

/// The busy queue's shape: `WORKERS` workers, tasks that sleep `HANDLER_MS`, pushed at half of
/// `WORKERS / HANDLER_MS` for `BUSY_SECONDS`.
const WORKERS: usize = 4;
const HANDLER_MS: u64 = 1;
const BUSY_SECONDS: u64 = 2;

/// Pushes per second on the busy queue: half of what its workers drain at most.
const BUSY_RATE: u64 = WORKERS as u64 * 1000 / HANDLER_MS / 2;

pub fn latency(bench: &Bench) -> Result<Vec<Figure>, String> {
    let mut figures = Vec::new();
    for mode in ["safe", "default"] {
        figures.push(idle(bench, mode)?);
        figures.push(busy(bench, mode)?);
    }
    Ok(figures)
}

/// The p50 of each run's samples, and their p99 and p999, as one figure.
fn percentiles_figure(name: String, runs: &[Vec<f64>]) -> Figure {
    let at = |p: f64| runs.iter().map(|samples| percentile(samples, p)).collect();
    figure(
        "latency",
        name,
        "µs",
        at(50.0),
        vec![("p99 µs".into(), at(99.0)), ("p999 µs".into(), at(99.9))],
    )
}

fn idle(bench: &Bench, mode: &str) -> Result<Figure, String> {
    let (client, daemon, mut starts) =
        super::recorded_daemon(bench, &format!("latency-idle-{mode}"), mode)?;
    let runs = (0..bench.options.runs)
        .map(|run| {
            idle_samples(
                bench,
                mode,
                &client,
                &mut starts,
                &format!("i{run}"),
                IDLE_SAMPLES,
            )
        })
        .collect::<Result<Vec<_>, String>>();
    daemon.stop();
    Ok(percentiles_figure(
        format!(
            "{mode} mode, idle queue ({IDLE_SAMPLES} pushes a run): push to handler start, p50"
        ),
        &runs?,
    ))
}

fn busy(bench: &Bench, mode: &str) -> Result<Figure, String> {
    let total = (BUSY_RATE * BUSY_SECONDS) as usize;
    let pace = Duration::from_secs(1) / BUSY_RATE as u32;
    let data = format!(r#"{{"sleep_ms":{HANDLER_MS}}}"#);
    let mut runs = Vec::new();
    for run in 0..bench.options.runs {
        let record = bench
            .dir
            .path()
            .join(format!("latency-busy-{mode}-{run}.log"));
        let _ = std::fs::remove_file(&record);
        let name = format!("latency-busy-{mode}");
        let config = bench.config_on(
            &bench.own().section,
            &name,
            mode,
            Some(&record),
            super::Shape::out_of_the_box(WORKERS),
        )?;
        let client = bench.client(&config)?;
        bench.flush()?;
        let daemon = bench.daemon(&config)?;
        super::wait_idle(bench, mode)?;
        let mut pushed = Vec::with_capacity(total);
        let begin = Instant::now();
        for i in 0..total {
            // An even pace, each push at its own time: a late one goes at once, and the next keeps its time.
            let due = begin + pace * i as u32;
            if let Some(early) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(early);
            }
            let at = now_us();
            client
                .push(
                    "q",
                    NewTask::new("test", &data)
                        .map_err(|e| e.to_string())?
                        .id(format!("b{run}-{i}")),
                )
                .map_err(|e| e.to_string())?;
            pushed.push(at);
        }
        let mut starts = Starts::new(record);
        let mut latencies = Vec::with_capacity(total);
        for (i, at) in pushed.into_iter().enumerate() {
            let started = starts.wait_for(&format!("b{run}-{i}"))?;
            latencies.push(started.saturating_sub(at) as f64);
        }
        daemon.stop();
        runs.push(latencies);
    }
    Ok(percentiles_figure(
        format!(
            "{mode} mode, a queue at half its drain rate ({WORKERS} workers, handlers of {HANDLER_MS} ms, \
             {BUSY_RATE} pushes/s one at a time for {BUSY_SECONDS} s): push to handler start, p50"
        ),
        &runs,
    ))
}
