//! The `limits` scenario: a queue's `max_running` and `rate_limit` (docs/CONFIG.md) against issue 33's targets,
//! and what each costs a drain when it is configured but never reached.
//!
//! - `max_running = 8` with 3 daemons x 16 workers and 10 ms handlers: the rate against 8 / 10 ms (target: at
//!   least 95 %), since a slot is held from the claim to the settle of its task. The testkit's records (a start
//!   and an end time a run) split a slot's cycle (8 / the rate) into the handler's run (its sleep and the
//!   sleep's overrun) and the rest, the daemon's and Redis's turnaround: the claim's reply, the job to a worker,
//!   the outcome to the acker, the settle, the wake-up marker and the next claim. The same records say how that
//!   turnaround falls: the share of the drain's middle during which every slot ran a handler, and the share of
//!   starts in step with another (within [`IN_STEP`] of it), which a settle of several tasks at once, handing
//!   their slots over together, makes (docs/PERFORMANCE.md, "Slots in step, settles in parallel, and the claim
//!   after a settle").
//! - `rate_limit = "1000/s"` with 3 daemons and a backlog of no-op tasks: the rate of starts (the testkit's
//!   records: those after the first window's, over the time from the first to the last) against the limit
//!   (target: 98 % to 100 %), and the most runs that started in any 1 s (the limit counts claims on Redis's
//!   clock, and a run starts within a dispatch of its claim).
//! - No-op drains with `prefetch = 0` (what a limit implies), without a limit, with `max_running` and with
//!   `rate_limit` far above the rate: Redis's and the daemon's CPU a task, for the cost of counting.

use std::time::Duration;

use super::{Bench, Drains, Figure, Shape, drain_once, figure};

/// How long each drain at a limit lasts, at its limit.
const AT_LIMIT: Duration = Duration::from_secs(20);

/// The daemons of the drains at a limit.
const DAEMONS: usize = 3;

pub(super) fn limits(bench: &Bench) -> Result<Vec<Figure>, String> {
    let mut figures = vec![running(bench)?, rate(bench)?];
    figures.extend(cost(bench)?);
    Ok(figures)
}

/// `max_running = 8`, 3 daemons x 16 workers, 10 ms handlers.
fn running(bench: &Bench) -> Result<Figure, String> {
    const LIMIT: usize = 8;
    const HANDLER: Duration = Duration::from_millis(10);
    let shape = Shape {
        extra: "max_running = 8\n",
        ..Shape::out_of_the_box(16)
    };
    let record = bench.dir.path().join("limits-running.log");
    let config = bench.config_timed(
        &bench.own().section,
        "limits-running",
        "safe",
        &record,
        shape,
    )?;
    let limit = LIMIT as f64 / HANDLER.as_secs_f64();
    let n = (limit * AT_LIMIT.as_secs_f64()) as usize;
    let data = format!("{{\"sleep_ms\":{}}}", HANDLER.as_millis());
    let (mut rates, mut ratios, mut redis_cpu) = (Vec::new(), Vec::new(), Vec::new());
    let (mut handler, mut turnaround) = (Vec::new(), Vec::new());
    let (mut full, mut in_step) = (Vec::new(), Vec::new());
    for _ in 0..bench.options.runs {
        let _ = std::fs::remove_file(&record);
        let run = drain_once(bench, &bench.own(), &config, DAEMONS, (n, &data), None)?;
        let text =
            std::fs::read_to_string(&record).map_err(|e| format!("{}: {e}", record.display()))?;
        let ran = mean_run(&text).ok_or("no run in the testkit's records")?;
        rates.push(run.rate);
        ratios.push(100.0 * run.rate / limit);
        redis_cpu.push(run.redis_cpu);
        // A slot's cycle at this rate, less the handler's mean run.
        handler.push(ran);
        turnaround.push(1e6 * LIMIT as f64 / run.rate - ran);
        let shares = occupancy(&text, LIMIT).ok_or("too few runs in the testkit's records")?;
        full.push(shares.full);
        in_step.push(shares.in_step);
    }
    Ok(figure(
        "limits",
        format!("max_running {LIMIT}, {DAEMONS} daemons x 16 workers, sleep 10 ms, {n} tasks"),
        "tasks/s",
        rates,
        vec![
            ("limit tasks/s".into(), vec![limit]),
            ("% of limit".into(), ratios),
            ("redis CPU µs/task".into(), redis_cpu),
            ("handler run µs (mean)".into(), handler),
            ("slot turnaround µs (cycle - run)".into(), turnaround),
            ("% of time at the limit".into(), full),
            ("% of starts in step".into(), in_step),
        ],
    ))
}

/// The mean time (µs) from a run's start to its end in a testkit record file with end times (`end <id>
/// <attempt> <outcome> <unix µs>`); `None` without a run that has both.
fn mean_run(text: &str) -> Option<f64> {
    let mut starts = std::collections::HashMap::new();
    let (mut total, mut runs) = (0u64, 0u64);
    for line in text.lines() {
        let parts: Vec<&str> = line.split(' ').collect();
        match parts.as_slice() {
            ["start", id, attempt, _, at] => {
                starts.insert((*id, *attempt), at.parse::<u64>().ok()?);
            }
            ["end", id, attempt, _, at] => {
                if let Some(start) = starts.get(&(*id, *attempt)) {
                    total += at.parse::<u64>().ok()?.saturating_sub(*start);
                    runs += 1;
                }
            }
            _ => {}
        }
    }
    (runs > 0).then(|| total as f64 / runs as f64)
}

/// How close two starts are to count as in step: well under a settle's round trip (a few hundred µs here), well
/// over the hand-out of one claim's tasks to the workers.
const IN_STEP: u64 = 100;

/// How a drain at a running limit filled its slots, from the testkit's records, over the middle 80 % of its starts
/// (the first and last tenth are the slots filling and emptying).
#[derive(Debug, PartialEq)]
struct Occupancy {
    /// The share of that time (%) during which `limit` handlers ran.
    full: f64,
    /// The share of its starts (%) within [`IN_STEP`] µs of the start before or after.
    in_step: f64,
}

/// `None` without ten starts with times.
fn occupancy(text: &str, limit: usize) -> Option<Occupancy> {
    // (time, +1 for a start or -1 for an end), and the starts' times.
    let (mut changes, mut starts) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let parts: Vec<&str> = line.split(' ').collect();
        match parts.as_slice() {
            ["start", _, _, _, at] => {
                let at = at.parse::<u64>().ok()?;
                starts.push(at);
                changes.push((at, 1i64));
            }
            ["end", _, _, _, at] => changes.push((at.parse::<u64>().ok()?, -1)),
            _ => {}
        }
    }
    if starts.len() < 10 {
        return None;
    }
    starts.sort_unstable();
    // Ends before starts at the same µs: a slot handed over within a µs was never short.
    changes.sort_unstable();
    let (from, to) = (starts[starts.len() / 10], starts[starts.len() * 9 / 10]);
    let (mut running, mut last, mut at_limit) = (0i64, 0u64, 0u64);
    for (at, change) in changes {
        if running >= limit as i64 && at > from && last < to {
            at_limit += at.min(to) - last.max(from);
        }
        running += change;
        last = at;
    }
    // Each start of the middle, against its neighbours in all of them.
    let middle: Vec<usize> = (0..starts.len())
        .filter(|&i| (from..=to).contains(&starts[i]))
        .collect();
    let stepped = middle
        .iter()
        .filter(|&&i| {
            (i > 0 && starts[i] - starts[i - 1] <= IN_STEP)
                || (i + 1 < starts.len() && starts[i + 1] - starts[i] <= IN_STEP)
        })
        .count();
    Some(Occupancy {
        full: 100.0 * at_limit as f64 / (to - from).max(1) as f64,
        in_step: 100.0 * stepped as f64 / middle.len() as f64,
    })
}

/// `rate_limit = "1000/s"`, 3 daemons, a backlog of no-op tasks.
fn rate(bench: &Bench) -> Result<Figure, String> {
    const LIMIT: f64 = 1000.0;
    let record = bench.dir.path().join("limits-rate.log");
    let shape = Shape {
        extra: "rate_limit = \"1000/s\"\n",
        ..Shape::out_of_the_box(16)
    };
    let config = bench.config_on(
        &bench.own().section,
        "limits-rate",
        "safe",
        Some(&record),
        shape,
    )?;
    let n = (LIMIT * AT_LIMIT.as_secs_f64()) as usize;
    let (mut rates, mut ratios, mut most) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..bench.options.runs {
        let _ = std::fs::remove_file(&record);
        drain_once(bench, &bench.own(), &config, DAEMONS, (n, "1"), None)?;
        let text =
            std::fs::read_to_string(&record).map_err(|e| format!("{}: {e}", record.display()))?;
        let starts = starts(&text);
        // The first window's starts come at once, when the drain begins: the rate is the starts after them
        // over the time from the first start to the last (a drain's own rate would count them in).
        let span = starts
            .last()
            .zip(starts.first())
            .map_or(0, |(last, first)| last - first);
        let rate = (starts.len() as f64 - LIMIT) / (span as f64 / 1e6).max(1e-6);
        rates.push(rate);
        ratios.push(100.0 * rate / LIMIT);
        most.push(most_within(&starts, Duration::from_secs(1)) as f64);
    }
    Ok(figure(
        "limits",
        format!("rate_limit 1000/s, {DAEMONS} daemons x 16 workers, no-op, {n} tasks"),
        "tasks/s",
        rates,
        vec![
            ("limit tasks/s".into(), vec![LIMIT]),
            ("% of limit".into(), ratios),
            ("most starts in 1 s".into(), most),
        ],
    ))
}

/// No-op drains by one daemon with `prefetch = 0`: no limit, `max_running` and `rate_limit` never reached, and a
/// `[[queues.limits]]` entry (never reached) on another type and on the drained one.
fn cost(bench: &Bench) -> Result<Vec<Figure>, String> {
    let o = &bench.options;
    let mut figures = Vec::new();
    for (what, extra) in [
        ("no limit", ""),
        ("max_running 1000000", "max_running = 1000000\n"),
        ("rate_limit 100000000/s", "rate_limit = \"100000000/s\"\n"),
        // [[queues.limits]]: the claim's flow path (payloads through Lua), routing with nothing to decode...
        (
            "type limit on another type",
            "[[queues.limits]]\ntype = \"other\"\nrate_limit = \"100000000/s\"\n",
        ),
        // ...and with every task decoded and counted in its type's scope.
        (
            "type limit on its type",
            "[[queues.limits]]\ntype = \"test\"\nrate_limit = \"100000000/s\"\n",
        ),
    ] {
        let shape = Shape {
            workers: o.workers,
            batch: Some(o.batch),
            prefetch: Some(0),
            extra,
        };
        let name: String = what
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let name = format!("limits-cost-{name}");
        let config = bench.config_on(&bench.own().section, &name, "safe", None, shape)?;
        let drains = Drains::run(o.runs, || {
            drain_once(bench, &bench.own(), &config, 1, (o.tasks, "1"), None)
        })?;
        let name = format!("no-op drain, prefetch 0, {what}, {} tasks", o.tasks);
        figures.push(drains.figure("limits", name, false));
    }
    Ok(figures)
}

/// The start times (µs) in a testkit record file: `start <id> <attempt> <type> <unix µs>` lines.
fn starts(text: &str) -> Vec<u64> {
    let mut starts: Vec<u64> = text
        .lines()
        .filter(|line| line.starts_with("start "))
        .filter_map(|line| line.split(' ').nth(4)?.parse().ok())
        .collect();
    starts.sort_unstable();
    starts
}

/// The most of the sorted `starts` within any `window`.
fn most_within(starts: &[u64], window: Duration) -> usize {
    let window = window.as_micros() as u64;
    let mut first = 0;
    let mut most = 0;
    for (last, at) in starts.iter().enumerate() {
        while starts[first] + window <= *at {
            first += 1;
        }
        most = most.max(last + 1 - first);
    }
    most
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_starts_in_a_window_slides_over_the_records() {
        let text = "start a 0 test 1000000\nend a 0 done\nstart b 0 test 1500000\nstart c 0 test 1999999\n\
                    start d 0 test 2000000\nstart e 0 test 2600000\n";
        let starts = starts(text);
        assert_eq!(starts.len(), 5);
        assert_eq!(most_within(&starts, Duration::from_secs(1)), 3);
        assert_eq!(most_within(&starts, Duration::from_millis(500)), 2);
        assert_eq!(most_within(&[], Duration::from_secs(1)), 0);
    }

    #[test]
    fn a_runs_mean_is_taken_from_its_start_and_end_times() {
        let text = "start a 0 test 1000\nend a 0 done 11000\nstart b 0 test 2000\nstart c 1 test 5000\n\
                    end c 1 retry 25000\nend b 0 done\n";
        // b's end has no time: only a's 10,000 µs and c's 20,000 count.
        assert_eq!(mean_run(text), Some(15_000.0));
        assert_eq!(mean_run("start a 0 test 1000\n"), None);
    }

    #[test]
    fn occupancy_is_the_time_every_slot_ran_and_the_starts_close_to_another() {
        // Two slots, ten pairs of starts 2,000 µs apart, the second of a pair 50 µs after the first, each run 900
        // µs: both slots run from a pair's second start to its first end, 850 µs of every 2,000. The middle runs
        // from the third start (pair 1's) to the nineteenth (pair 9's): pairs 1 to 8, all in step.
        let mut text = String::new();
        for i in 0..20u64 {
            let start = 1_000_000 + 2_000 * (i / 2) + 50 * (i % 2);
            text.push_str(&format!(
                "start t{i} 0 test {start}\nend t{i} 0 done {}\n",
                start + 900
            ));
        }
        let shares = occupancy(&text, 2).unwrap();
        assert_eq!(shares.full, 100.0 * 8.0 * 850.0 / 16_000.0);
        assert_eq!(shares.in_step, 100.0);
        // Spread out, nothing is in step, and one slot of two is never at the limit.
        let spread: String = (0..20u64)
            .map(|i| {
                format!(
                    "start t{i} 0 test {}\nend t{i} 0 done {}\n",
                    1_000 * i,
                    1_000 * i + 900
                )
            })
            .collect();
        assert_eq!(
            occupancy(&spread, 2),
            Some(Occupancy {
                full: 0.0,
                in_step: 0.0
            })
        );
        assert_eq!(occupancy("start a 0 test 1\n", 1), None);
    }
}
