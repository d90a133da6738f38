//! Going on through Redis failures: how long to wait before trying again ([`Backoff`]), and how to say so
//! without flooding the log ([`Trouble`]).
//!
//! Every long-lived thread retries what failed for as long as the daemon runs: a Redis that is down, restarting
//! or failing over is waited for, never a reason to exit. What the operator sees is one line when a thread's
//! calls start failing, a summary every [`SUMMARY_EVERY`] while they keep failing, and one line when they work
//! again.

use std::fmt::Display;
use std::time::{Duration, Instant};

use crate::shutdown::Listener;

/// How often a thread whose calls keep failing says so again.
pub const SUMMARY_EVERY: Duration = Duration::from_secs(30);

/// A doubling retry delay for Redis failures: 100 ms up to 5 s, reset by a success.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
    /// No failure since the last success.
    first: bool,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);
    /// The longest wait between two tries (the watchdog's bounds count it).
    pub const MAX: Duration = Duration::from_secs(5);

    pub fn new() -> Backoff {
        Backoff {
            next: Self::FIRST,
            first: true,
        }
    }

    /// Waits before the next try; returns `true` when `stop` fired meanwhile.
    pub fn wait(&mut self, stop: &Listener) -> bool {
        self.first = false;
        let delay = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        stop.wait(delay)
    }

    /// As [`Backoff::wait`], but the first failure after a success is tried again at once: it is most often one
    /// dropped connection (a `CLIENT KILL`, a proxy's idle timeout), which a new connection fixes.
    pub fn wait_unless_first(&mut self, stop: &Listener) -> bool {
        if self.first {
            self.first = false;
            return stop.is_triggered();
        }
        self.wait(stop)
    }

    pub fn reset(&mut self) {
        self.next = Self::FIRST;
        self.first = true;
    }
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff::new()
    }
}

/// The failures of one kind of call of one thread, reported as one line, then summaries.
#[derive(Debug)]
pub struct Trouble {
    /// What fails, for the log: "fetching tasks", "renewing the lease".
    what: &'static str,
    /// The queue, when the calls are a queue's.
    queue: Option<String>,
    /// When the current run of failures began, and how many there were.
    since: Option<Instant>,
    failures: u64,
    last_report: Instant,
}

impl Trouble {
    pub fn new(what: &'static str, queue: Option<&str>) -> Trouble {
        Trouble {
            what,
            queue: queue.map(str::to_string),
            since: None,
            failures: 0,
            last_report: Instant::now(),
        }
    }

    /// Records a failure (counted in `kmqd_redis_errors_total` under `what`); logs the first of a run, then a
    /// summary every [`SUMMARY_EVERY`].
    pub fn failed(&mut self, error: &dyn Display) {
        self.failures += 1;
        crate::daemon::metrics::observed::redis_error(self.what);
        let queue = self.queue.as_deref().unwrap_or("-");
        let Some(since) = self.since else {
            self.since = Some(Instant::now());
            self.last_report = Instant::now();
            tracing::warn!(queue, %error, "{} failed; retrying (Redis down or unreachable?)", self.what);
            return;
        };
        if self.last_report.elapsed() >= SUMMARY_EVERY {
            self.last_report = Instant::now();
            tracing::error!(
                queue,
                %error,
                failures = self.failures,
                for_s = since.elapsed().as_secs(),
                "{} still failing; retrying",
                self.what
            );
        }
    }

    /// Records a success; logs the end of a run of failures.
    pub fn recovered(&mut self) {
        if let Some(since) = self.since.take() {
            let queue = self.queue.as_deref().unwrap_or("-");
            tracing::info!(
                queue,
                failures = self.failures,
                after_ms = since.elapsed().as_millis() as u64,
                "{} works again",
                self.what
            );
            self.failures = 0;
        }
    }

    /// Whether the last call failed.
    pub fn failing(&self) -> bool {
        self.since.is_some()
    }
}
