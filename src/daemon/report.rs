//! The queue reporter (the delay-queue design's queue monitor): one `kmqd-report` thread per daemon that reads
//! every queue's depths and counters (the same read as `kmqd stats`) and
//!
//! - every `[daemon] report_interval`, logs one `queue report` event per queue with the depth per level,
//!   processing, delayed, dead, done/s and failed/s over the interval, and lag, as structured fields (so
//!   `log_format = "json"` gives them as JSON fields);
//! - for each queue with `lag_warn`, logs one warning when the queue's lag passes it and one line when it is back
//!   under (nothing while it stays high). Lag is checked every quarter of the shortest `lag_warn` (100 ms to 5 s),
//!   whether or not `report_interval` is set, so that a warning is at most that late.
//!
//! The numbers are the queue's, not this daemon's: every daemon serving a queue reports the same queue-wide
//! depths and rates, so one daemon's report per queue is all an operator needs (docs/OPERATIONS.md, "Queue
//! reports and lag_warn"). The thread runs only when asked for (`Config::reports`). It is not one of the lanes
//! the systemd watchdog watches: its Redis calls are bounded by `[redis] io_timeout`, a failure is logged
//! ([`Trouble`]) and retried next period, and its end, like any thread's, stops the daemon.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::broker::{self, QueueStats, Session};
use crate::queue::QueueContext;
use crate::retry::Trouble;
use crate::shutdown::Listener;

pub struct Reporter {
    queues: Vec<Watched>,
    session: Session,
    report_interval: Option<Duration>,
    background: Listener,
}

/// One queue as the reporter follows it.
struct Watched {
    queue: Arc<QueueContext>,
    /// The read the next report's rates are measured from, and when it was taken.
    baseline: Option<(Instant, QueueStats)>,
    /// Whether the lag was above `lag_warn` at the last check (warned, not yet recovered).
    lagging: bool,
    trouble: Trouble,
}

/// A change of a queue's lag with respect to its `lag_warn`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LagChange {
    /// The lag passed `lag_warn`.
    Above,
    /// The lag is back at or under `lag_warn` (or nothing is ready).
    Recovered,
}

/// What a lag reading means, given whether the queue was lagging already: a change only when it crosses
/// `lag_warn`, so that a lag that stays high warns once.
fn lag_change(lagging: bool, lag_ms: Option<i64>, lag_warn: Duration) -> Option<LagChange> {
    let above = lag_ms.is_some_and(|ms| ms > lag_warn.as_millis() as i64);
    match (lagging, above) {
        (false, true) => Some(LagChange::Above),
        (true, false) => Some(LagChange::Recovered),
        _ => None,
    }
}

/// A rate rounded to hundredths, so that a log line reads `12.5`, not `12.499999999`.
fn rounded(rate: f64) -> f64 {
    (rate * 100.0).round() / 100.0
}

impl Reporter {
    pub fn new(
        queues: Vec<Arc<QueueContext>>,
        session: Session,
        report_interval: Option<Duration>,
        background: Listener,
    ) -> Reporter {
        let queues = queues
            .into_iter()
            .map(|queue| {
                let trouble = Trouble::new("reading the queue's stats", Some(&queue.config.name));
                Watched {
                    queue,
                    baseline: None,
                    lagging: false,
                    trouble,
                }
            })
            .collect();
        Reporter {
            queues,
            session,
            report_interval,
            background,
        }
    }

    /// How often lags are checked: a quarter of the shortest `lag_warn`, between 100 ms and 5 s; `None` when no
    /// queue has one.
    fn check_interval(&self) -> Option<Duration> {
        self.queues
            .iter()
            .filter_map(|q| q.queue.config.lag_warn)
            .min()
            .map(|shortest| {
                (shortest / 4).clamp(Duration::from_millis(100), Duration::from_secs(5))
            })
    }

    pub fn run(mut self) {
        let check = self.check_interval();
        let mut next_report = self.report_interval.map(|every| Instant::now() + every);
        // The first pass reads every queue: the baseline of the first report's rates.
        self.pass(false);
        loop {
            let now = Instant::now();
            let wake = [next_report, check.map(|every| now + every)]
                .into_iter()
                .flatten()
                .min()
                .expect("the reporter runs with report_interval or a lag_warn");
            if self.background.wait(wake.saturating_duration_since(now)) {
                return;
            }
            let due = next_report.is_some_and(|at| Instant::now() >= at);
            if due {
                // On schedule, but never a burst of reports to catch up after a stall.
                next_report = next_report
                    .zip(self.report_interval)
                    .map(|(at, every)| (at + every).max(Instant::now()));
            }
            self.pass(due);
        }
    }

    /// Reads the queues that need it now (all of them when a report is due or a baseline is missing, else those
    /// with `lag_warn`), checks their lag, and logs their report when `report` is set.
    fn pass(&mut self, report: bool) {
        for watched in &mut self.queues {
            let config = &watched.queue.config;
            if !(report || config.lag_warn.is_some() || watched.baseline.is_none()) {
                continue;
            }
            let read = self
                .session
                .get()
                .and_then(|connection| broker::stats(connection, &watched.queue.keys));
            let stats = match read {
                Ok(stats) => {
                    watched.trouble.recovered();
                    stats
                }
                Err(error) => {
                    self.session.reset();
                    watched.trouble.failed(&error);
                    continue;
                }
            };
            let read_at = Instant::now();
            if let Some(lag_warn) = config.lag_warn {
                check_lag(watched, &stats, lag_warn);
            }
            if report {
                log_report(&watched.queue, &stats, watched.baseline.as_ref(), read_at);
            }
            if report || watched.baseline.is_none() {
                watched.baseline = Some((read_at, stats));
            }
        }
    }
}

/// Logs a lag change of a queue watched with `lag_warn`.
fn check_lag(watched: &mut Watched, stats: &QueueStats, lag_warn: Duration) {
    let queue = watched.queue.config.name.as_str();
    let lag_warn_ms = lag_warn.as_millis() as u64;
    match lag_change(watched.lagging, stats.lag_ms, lag_warn) {
        Some(LagChange::Above) => {
            watched.lagging = true;
            tracing::warn!(
                queue,
                lag_ms = stats.lag_ms,
                lag_warn_ms,
                ready = stats.ready,
                paused = stats.paused,
                "queue lag above lag_warn: its oldest ready task has waited longer than that"
            );
        }
        Some(LagChange::Recovered) => {
            watched.lagging = false;
            tracing::info!(
                queue,
                lag_ms = stats.lag_ms,
                lag_warn_ms,
                ready = stats.ready,
                "queue lag recovered: back under lag_warn"
            );
        }
        None => {}
    }
}

/// Logs one queue's report: its depths now and its rates since `baseline` (left out without one: the read
/// before failed).
fn log_report(
    queue: &QueueContext,
    stats: &QueueStats,
    baseline: Option<&(Instant, QueueStats)>,
    read_at: Instant,
) {
    let rates = baseline.map(|(at, before)| stats.rates_since(before, read_at - *at));
    tracing::info!(
        queue = %queue.config.name,
        mode = queue.config.mode.as_str(),
        paused = stats.paused,
        ready = stats.ready,
        ready_by_level = %stats.levels_text(),
        processing = stats.processing,
        delayed = stats.delayed,
        dead = stats.dead,
        done_per_s = rates.map(|r| rounded(r.done)),
        failed_per_s = rates.map(|r| rounded(r.failed)),
        lag_ms = stats.lag_ms,
        "queue report"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_warns_once_when_crossing_and_once_when_back() {
        let warn = Duration::from_millis(500);
        // Under, or nothing ready: nothing to say.
        assert_eq!(lag_change(false, Some(500), warn), None);
        assert_eq!(lag_change(false, None, warn), None);
        // Crossing up, then staying up: once.
        assert_eq!(lag_change(false, Some(501), warn), Some(LagChange::Above));
        assert_eq!(lag_change(true, Some(60_000), warn), None);
        // Back under, or drained: once.
        assert_eq!(lag_change(true, Some(10), warn), Some(LagChange::Recovered));
        assert_eq!(lag_change(true, None, warn), Some(LagChange::Recovered));
    }

    #[test]
    fn rates_are_rounded_to_hundredths() {
        assert_eq!(rounded(12.499_999_9), 12.5);
        assert_eq!(rounded(1.0 / 3.0), 0.33);
    }
}
