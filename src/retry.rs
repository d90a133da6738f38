//! Going on through Redis failures: how long to wait before trying again ([`Backoff`]), and how to say so
//! without flooding the log ([`Trouble`]).
//!
//! Every long-lived thread retries what failed for as long as the daemon runs: a Redis that is down, restarting
//! or failing over is waited for, never a reason to exit. What the operator sees of a Redis that cannot be
//! reached is the daemon's, not each thread's: one warning naming the server when the first thread's calls fail,
//! a summary every [`SUMMARY_EVERY`] while they keep failing, one line when a call reaches it again ([`Outage`]).
//! Other failures (an error reply, a reply of the wrong shape) are each thread's: one line when its calls start
//! failing, summaries, and one when they work again.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::broker::BrokerError;
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

/// Redis as every thread of this process sees it: whether calls fail because it cannot be reached, and since
/// when. One per process, since the log it writes is the process's. The outage ends with the first call that
/// reaches Redis again (threads still waiting out their backoff then find it up).
struct Outage {
    /// The server as the config names it (`[redis]`'s `describe`), for the first line.
    server: String,
    since: Option<Instant>,
    failures: u64,
    last_report: Instant,
}

impl Outage {
    fn new(server: String) -> Outage {
        Outage {
            server,
            since: None,
            failures: 0,
            last_report: Instant::now(),
        }
    }
}

static OUTAGE: Mutex<Option<Outage>> = Mutex::new(None);

fn outage() -> MutexGuard<'static, Option<Outage>> {
    OUTAGE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Names the Redis deployment in the outage lines (the daemon calls it at start).
pub fn name_server(server: String) {
    outage()
        .get_or_insert_with(|| Outage::new(String::new()))
        .server = server;
}

/// A thread's call (`what`) could not reach Redis.
fn unreachable(what: &str, error: &BrokerError) {
    let mut guard = outage();
    let outage = guard.get_or_insert_with(|| Outage::new("Redis".to_string()));
    outage.failures += 1;
    let Some(since) = outage.since else {
        outage.since = Some(Instant::now());
        outage.last_report = Instant::now();
        tracing::warn!(server = %outage.server, %error, first = what, "Redis unreachable; every thread waits for it and retries");
        return;
    };
    if outage.last_report.elapsed() >= SUMMARY_EVERY {
        outage.last_report = Instant::now();
        tracing::error!(
            server = %outage.server,
            %error,
            for_s = since.elapsed().as_secs(),
            failures = outage.failures,
            "Redis still unreachable; retrying"
        );
    }
}

/// A thread that could not reach Redis did: the outage, if it still lasts, is over.
fn reached() {
    let mut guard = outage();
    if let Some(outage) = guard.as_mut()
        && let Some(since) = outage.since.take()
    {
        tracing::info!(
            server = %outage.server,
            failures = outage.failures,
            after_ms = since.elapsed().as_millis() as u64,
            "Redis reachable again"
        );
        outage.failures = 0;
    }
}

/// Whether `error` says Redis could not be reached (refused, reset, timed out, no connection in the pool), as
/// opposed to an answer the call did not want.
fn is_unreachable(error: &BrokerError) -> bool {
    match error {
        // A lost reply (`may_have_run`) covers the cluster client's wrapped I/O errors too.
        BrokerError::Redis(redis) => redis.is_connection_refusal() || error.may_have_run(),
        BrokerError::Pool(_) => true,
        // Not replicated in time, a reply of the wrong shape, ...: Redis answered.
        _ => false,
    }
}

/// A call got an answer from Redis after a run (`streak`) of calls of its thread that did not reach it: Redis is
/// back, so the process's outage, if one is on, is over. Returns whether there was such a run.
fn end_streak(streak: &mut u32) -> bool {
    let calls = std::mem::take(streak);
    if calls > 0 {
        reached();
    }
    calls > 0
}

/// The failures of one kind of call of one thread: Redis being unreachable goes to the process's [`Outage`];
/// anything else is reported as one line, then summaries.
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
    /// How many calls in a row failed to reach Redis. The first is most often one dropped connection (a `CLIENT
    /// KILL`, a pooled connection that broke while idle), tried again at once ([`Backoff::wait_unless_first`]):
    /// only the second counts as the [`Outage`], so such a blip is no warning, and a stale connection found just
    /// after an outage does not start another.
    unreachable: u32,
}

impl Trouble {
    pub fn new(what: &'static str, queue: Option<&str>) -> Trouble {
        Trouble {
            what,
            queue: queue.map(str::to_string),
            since: None,
            failures: 0,
            last_report: Instant::now(),
            unreachable: 0,
        }
    }

    /// Records a failure (counted in `kmqd_redis_errors_total` under `what`); logs the first of a run, then a
    /// summary every [`SUMMARY_EVERY`] (the process's, for a Redis that cannot be reached).
    pub fn failed(&mut self, error: &BrokerError) {
        self.failures += 1;
        crate::daemon::metrics::observed::redis_error(self.what);
        let queue = self.queue.as_deref().unwrap_or("-");
        if is_unreachable(error) {
            self.unreachable += 1;
            if self.unreachable >= 2 {
                unreachable(self.what, error);
            } else {
                tracing::debug!(queue, %error, "{}: Redis not reached; trying again at once", self.what);
            }
            self.since.get_or_insert_with(Instant::now);
            return;
        }
        if end_streak(&mut self.unreachable) {
            // Reached, but refused: the outage is over for this thread; the refusal is reported as its own.
            self.since = None;
        }
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
        if end_streak(&mut self.unreachable) {
            self.since = None;
            self.failures = 0;
            return;
        }
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
