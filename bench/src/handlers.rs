//! The `handlers` scenario: kmqd out of the box (only `workers` set; `batch` and `prefetch` at the daemon's
//! defaults) running handlers shaped like real ones, each figure beside its physical limit:
//!
//! - **I/O-bound**: the testkit sleeps 1, 10 or 100 ms per task, with 64 and 512 workers. Nothing but the
//!   workers bounds such a drain, so the limit is `workers / handler time`; and, measured beside it, what as many
//!   threads sleeping in a loop with no queue at all make on this host ([`threads_alone`]), which at 1 ms is
//!   less: a sleep overshoots, and 512 threads' wake-ups take most of two cores.
//! - **CPU-bound**: the testkit spins 50 µs per task with one worker per core; the limit is
//!   `cores / handler time`, which the daemon's own threads and Redis, on the same cores, can only approach.
//! - **A mix** on one queue: 95 % no-op tasks, 5 % sleeping 100 ms, pushed at a steady rate that keeps the slow
//!   ones on half of the workers; the figure is the fast tasks' time from push to handler start (p99), which
//!   stays near the idle wake-up time only if the slow tasks do not hold the fast ones back.
//!
//! Task counts are chosen so that a drain takes about [`RUN_SECONDS`] at its limit: `--tasks` is for the no-op
//! drains and does not apply here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{Bench, Figure, NewTask, Shape, figure, now_us, percentile, read_starts};

/// How long one drain takes at its limit: long enough that the first and last waves are a small part of it.
const RUN_SECONDS: f64 = 3.0;
/// Most tasks per drain (a limit of 512,000/s would otherwise ask for 1.5 million).
const MAX_TASKS: usize = 200_000;
/// At least this many tasks per worker in a drain, for the same reason.
const MIN_TASKS_PER_WORKER: usize = 10;

/// The I/O-bound handlers: sleep times and worker counts.
const SLEEPS_MS: [u64; 3] = [1, 10, 100];
const IO_WORKERS: [usize; 2] = [64, 512];
/// The CPU-bound handler's spin.
const SPIN: Duration = Duration::from_micros(50);
/// The CPU-bound handler's second run: a fixed prefetch of 100 (what the adaptive one is compared with).
const SPIN_PREFETCH: usize = 100;

/// The mix: every `MIX_SLOW_EVERY`-th task sleeps `MIX_SLOW` (5 %), the others are no-ops.
const MIX_SLOW_EVERY: usize = 20;
const MIX_SLOW: Duration = Duration::from_millis(100);
const MIX_WORKERS: [usize; 2] = [16, 64];
/// The share of the workers the slow tasks occupy, on average, at the offered rate.
const MIX_LOAD: f64 = 0.5;
/// The mix's producer pushes one batch this often.
const MIX_TICK: Duration = Duration::from_millis(5);

/// The most tasks per second `workers` can finish when each task takes `handler`, all else being free.
pub(super) fn limit(workers: usize, handler: Duration) -> f64 {
    workers as f64 / handler.as_secs_f64()
}

/// Tasks for one drain: [`RUN_SECONDS`] at `limit`, within [`MIN_TASKS_PER_WORKER`] × `workers` and
/// [`MAX_TASKS`].
pub(super) fn task_count(limit: f64, workers: usize) -> usize {
    ((limit * RUN_SECONDS).round() as usize)
        .max(workers * MIN_TASKS_PER_WORKER)
        .min(MAX_TASKS)
}

/// The mix's offered rate, tasks/s: its slow tasks then keep `MIX_LOAD` of `workers` busy on average
/// (Little's law: busy workers = slow tasks/s × their time).
pub(super) fn mix_rate(workers: usize) -> f64 {
    // workers × load busy = (rate / every) × slow time; in ms, so that round figures stay exact.
    MIX_LOAD * workers as f64 * MIX_SLOW_EVERY as f64 * 1000.0 / MIX_SLOW.as_millis() as f64
}

/// Whether task `i` of the mix is a slow one.
fn is_slow(i: usize) -> bool {
    i % MIX_SLOW_EVERY == 0
}

/// Push-to-start latencies (µs) of the mix's fast and slow tasks: `pushed[i]` is when task `i` was pushed and
/// `started[i]` when its handler began (`None`: no record, left out).
pub(super) fn mix_latencies(pushed: &[u64], started: &[Option<u64>]) -> (Vec<f64>, Vec<f64>) {
    let (mut fast, mut slow) = (Vec::new(), Vec::new());
    for (i, (pushed, started)) in pushed.iter().zip(started).enumerate() {
        if let Some(started) = started {
            let latency = started.saturating_sub(*pushed) as f64;
            if is_slow(i) {
                slow.push(latency);
            } else {
                fast.push(latency);
            }
        }
    }
    (fast, slow)
}

/// Every figure of the scenario, in both modes; `cores` is the CPU-bound handler's worker count.
pub(super) fn handlers(bench: &Bench, cores: usize) -> Result<Vec<Figure>, String> {
    let mut figures = vec![sleep_precision()];
    // Measured once for both modes.
    let mut alone = HashMap::new();
    for ms in SLEEPS_MS {
        for workers in IO_WORKERS {
            alone.insert(
                (ms, workers),
                threads_alone(workers, Duration::from_millis(ms)),
            );
        }
    }
    for mode in ["safe", "default"] {
        for ms in SLEEPS_MS {
            for workers in IO_WORKERS {
                figures.push(bounded_drain(
                    bench,
                    mode,
                    Shape::out_of_the_box(workers),
                    (
                        Duration::from_millis(ms),
                        alone.get(&(ms, workers)).copied(),
                    ),
                    &format!("{{\"sleep_ms\":{ms}}}"),
                    &format!("I/O-bound: sleep {ms} ms, {workers} workers"),
                )?);
            }
        }
        let cores = cores.max(1);
        // Out of the box, and with a prefetch deep enough for whole claim batches: with `prefetch = workers` a
        // 50 µs handler's claims carry a few tasks each, and their round trips cost more than the handler.
        for prefetch in [None, Some(SPIN_PREFETCH)] {
            let shape = Shape {
                prefetch,
                ..Shape::out_of_the_box(cores)
            };
            figures.push(bounded_drain(
                bench,
                mode,
                shape,
                (SPIN, None),
                &format!("{{\"spin_us\":{}}}", SPIN.as_micros()),
                &format!(
                    "CPU-bound: spin {} µs, {cores} workers (one per core){}",
                    SPIN.as_micros(),
                    prefetch.map_or(String::new(), |p| format!(", prefetch {p}"))
                ),
            )?);
        }
        for workers in MIX_WORKERS {
            figures.push(mix(bench, mode, workers)?);
        }
    }
    Ok(figures)
}

/// What a 1 ms handler really takes on this machine: the testkit sleeps a remainder shorter than its 20 ms
/// step in one `thread::sleep`, whose overshoot (timer slack, wake-up) sets how close a 1 ms drain can get.
fn sleep_precision() -> Figure {
    let samples: Vec<f64> = (0..200)
        .map(|_| {
            let start = Instant::now();
            std::thread::sleep(Duration::from_millis(1));
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    figure(
        "handlers",
        "thread::sleep(1 ms) in the bench process, as the testkit sleeps: time taken, p50",
        "µs",
        vec![percentile(&samples, 50.0)],
        vec![("p99 µs".into(), vec![percentile(&samples, 99.0)])],
    )
}

/// What `workers` threads that do nothing but `thread::sleep(handler)` in a loop finish per second on this host,
/// over about [`RUN_SECONDS`]: the limit that the kernel's timers and scheduler set for an I/O-bound row, with no
/// queue at all. On two cores, 512 threads sleeping 1 ms make about 90 % of `workers / handler`, at about 3 µs of
/// CPU per sleep (docs/PERFORMANCE.md, "The 1 ms rows").
fn threads_alone(workers: usize, handler: Duration) -> f64 {
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let threads: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    // Each thread's own rate, from the end of its first sleep to the end of its last: no window
                    // cuts a round of 100 ms sleeps in two.
                    std::thread::sleep(handler);
                    let (first, mut sleeps) = (Instant::now(), 0u32);
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(handler);
                        sleeps += 1;
                    }
                    f64::from(sleeps) / first.elapsed().as_secs_f64()
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs_f64(RUN_SECONDS));
        stop.store(true, Ordering::Relaxed);
        threads
            .into_iter()
            .map(|thread| thread.join().unwrap_or(0.0))
            .sum()
    })
}

/// A drain of tasks with `data`, each taking `handler.0`, by one daemon shaped `shape`, against `workers /
/// handler` and, for a sleeping handler, against `handler.1`: what threads sleeping alone made ([`threads_alone`]).
fn bounded_drain(
    bench: &Bench,
    mode: &str,
    shape: Shape,
    handler: (Duration, Option<f64>),
    data: &str,
    what: &str,
) -> Result<Figure, String> {
    let (handler, alone) = handler;
    let workers = shape.workers;
    let config = bench.config_on(
        &bench.own().section,
        &format!(
            "handlers-{mode}-{workers}{}",
            shape.prefetch.map_or(String::new(), |p| format!("-p{p}"))
        ),
        mode,
        None,
        shape,
    )?;
    let limit = limit(workers, handler);
    let n = task_count(limit, workers);
    let (mut rates, mut ratios, mut daemon_cpu, mut redis_cpu) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..bench.options.runs {
        let run = super::drain_once(bench, &bench.own(), &config, 1, (n, data), None)?;
        rates.push(run.rate);
        ratios.push(100.0 * run.rate / limit);
        daemon_cpu.push(run.daemon_cpu);
        redis_cpu.push(run.redis_cpu);
    }
    let mut also = vec![
        ("limit tasks/s".into(), vec![limit]),
        ("% of limit".into(), ratios),
    ];
    if let Some(alone) = alone {
        let of_alone = rates.iter().map(|rate| 100.0 * rate / alone).collect();
        also.push(("threads sleeping alone tasks/s".into(), vec![alone]));
        also.push(("% of threads alone".into(), of_alone));
    }
    also.push(("daemon CPU µs/task".into(), daemon_cpu));
    also.push(("redis CPU µs/task".into(), redis_cpu));
    Ok(figure(
        "handlers",
        format!("{what}, {mode} mode, {n} tasks"),
        "tasks/s",
        rates,
        also,
    ))
}

/// The mix: [`RUN_SECONDS`] of tasks pushed at [`mix_rate`] in batches every [`MIX_TICK`], to an idle daemon
/// with `workers`; the fast tasks' push-to-start latency.
fn mix(bench: &Bench, mode: &str, workers: usize) -> Result<Figure, String> {
    let rate = mix_rate(workers);
    let total = (rate * RUN_SECONDS) as usize;
    let per_tick = ((rate * MIX_TICK.as_secs_f64()).round() as usize).max(1);
    let record = bench.dir.path().join(format!("mix-{mode}-{workers}.log"));
    let config = bench.config_on(
        &bench.own().section,
        &format!("mix-{mode}-{workers}"),
        mode,
        Some(&record),
        Shape::out_of_the_box(workers),
    )?;
    let client = bench.client(&config)?;
    let no_op = kmqd::task::data_from_str("1").expect("JSON");
    let slow = kmqd::task::data_from_str(&format!("{{\"sleep_ms\":{}}}", MIX_SLOW.as_millis()))
        .expect("JSON");
    let (mut fast_p99, mut fast_p50, mut slow_p99) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..bench.options.runs {
        let _ = std::fs::remove_file(&record);
        bench.flush()?;
        let daemon = bench.daemon(&config)?;
        super::wait_idle(bench, mode)?;
        let id = |i: usize| format!("m{run}-{i}");
        let mut pushed = vec![0; total];
        let start = Instant::now();
        for (tick, first) in (0..total).step_by(per_tick).enumerate() {
            let due = start + MIX_TICK * tick as u32;
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let last = (first + per_tick).min(total);
            let tasks = (first..last).map(|i| {
                let data = if is_slow(i) { &slow } else { &no_op };
                NewTask::with_data("test", data.clone()).id(id(i))
            });
            let at = now_us();
            client.push_batch("q", tasks).map_err(|e| e.to_string())?;
            pushed[first..last].fill(at);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while client.stats("q").map_err(|e| e.to_string())?.done < total as u64 {
            if Instant::now() > deadline {
                return Err(format!(
                    "the mix's {total} tasks did not all run within 60 s"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        daemon.stop();
        let mut starts = HashMap::new();
        read_starts(&record, 0, &mut starts)?;
        let started: Vec<Option<u64>> = (0..total).map(|i| starts.get(&id(i)).copied()).collect();
        let (fast, slow) = mix_latencies(&pushed, &started);
        fast_p50.push(percentile(&fast, 50.0) / 1000.0);
        fast_p99.push(percentile(&fast, 99.0) / 1000.0);
        slow_p99.push(percentile(&slow, 99.0) / 1000.0);
    }
    Ok(figure(
        "handlers",
        format!(
            "mix: {}% no-op + {}% sleep {} ms, {workers} workers, {rate:.0} tasks/s offered for {RUN_SECONDS} s, \
             {mode} mode: fast tasks' push to handler start, p99",
            100 - 100 / MIX_SLOW_EVERY,
            100 / MIX_SLOW_EVERY,
            MIX_SLOW.as_millis()
        ),
        "ms",
        fast_p99,
        vec![
            ("fast p50 ms".into(), fast_p50),
            ("slow p99 ms".into(), slow_p99),
        ],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_and_task_counts() {
        assert_eq!(limit(512, Duration::from_millis(100)), 5120.0);
        assert_eq!(limit(2, Duration::from_micros(50)), 40_000.0);
        // Three seconds at the limit...
        assert_eq!(task_count(5120.0, 512), 15_360);
        assert_eq!(task_count(640.0, 64), 1920);
        // ...capped for limits no machine reaches, and at least ten tasks per worker.
        assert_eq!(task_count(512_000.0, 512), MAX_TASKS);
        assert_eq!(task_count(100.0, 64), 640);
    }

    #[test]
    fn the_mix_keeps_half_the_workers_on_slow_tasks() {
        // 5 % of 6,400 tasks/s sleep 100 ms: 32 of 64 workers busy on average.
        assert_eq!(mix_rate(64), 6400.0);
        assert_eq!(mix_rate(16), 1600.0);
        let slow = (0..1000).filter(|i| is_slow(*i)).count();
        assert_eq!(slow, 50);
    }

    #[test]
    fn mix_latencies_split_fast_from_slow_and_skip_unrecorded() {
        let pushed = [100, 100, 100, 200, 200];
        let started = [Some(1100), Some(150), None, Some(260), Some(190)];
        let (fast, slow) = mix_latencies(&pushed, &started);
        // Task 0 is slow; 2 has no record; 4 started before its push time was taken (clamped to 0).
        assert_eq!(slow, [1000.0]);
        assert_eq!(fast, [50.0, 60.0, 0.0]);
    }
}
