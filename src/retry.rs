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
use crate::poison::lock;
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
    /// The server as the config names it (`[redis]`'s `describe`), for the first line; empty: not named yet.
    server: String,
    /// While it lasts: since when, and when it was last reported.
    lasting: Option<(Instant, Instant)>,
    /// When the last one ended: a thread whose failing call began before that (it waited out a timeout while
    /// Redis came back) has not yet seen Redis back, and starts no new outage.
    ended: Option<Instant>,
    failures: u64,
}

impl Outage {
    fn server(&self) -> &str {
        match self.server.as_str() {
            "" => "Redis",
            named => named,
        }
    }
}

static OUTAGE: Mutex<Outage> = Mutex::new(Outage {
    server: String::new(),
    lasting: None,
    ended: None,
    failures: 0,
});

fn outage() -> MutexGuard<'static, Outage> {
    lock(&OUTAGE)
}

/// Names the Redis deployment in the outage lines (the daemon calls it at start).
pub fn name_server(server: String) {
    outage().server = server;
}

/// A thread's call (`what`), in a run of failures that began at `run_began`, could not reach Redis.
fn unreachable(what: &str, error: &BrokerError, run_began: Instant) {
    let mut outage = outage();
    if outage.lasting.is_none() && outage.ended.is_some_and(|ended| run_began < ended) {
        tracing::debug!(%error, "{what}: Redis not reached by a call from before it came back; trying again");
        return;
    }
    outage.failures += 1;
    let Some((since, last_report)) = outage.lasting else {
        tracing::warn!(server = %outage.server(), %error, first = what, "Redis unreachable; every thread waits for it and retries");
        outage.lasting = Some((Instant::now(), Instant::now()));
        return;
    };
    if last_report.elapsed() >= SUMMARY_EVERY {
        tracing::error!(
            server = %outage.server(),
            %error,
            for_s = since.elapsed().as_secs(),
            failures = outage.failures,
            "Redis still unreachable; retrying"
        );
        outage.lasting = Some((since, Instant::now()));
    }
}

/// A thread that could not reach Redis did: the outage, if it still lasts, is over.
fn reached() {
    let mut outage = outage();
    if let Some((since, _)) = outage.lasting.take() {
        outage.ended = Some(Instant::now());
        tracing::info!(
            server = %outage.server(),
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
        crate::observed::redis_error(self.what);
        let queue = self.queue.as_deref().unwrap_or("-");
        if is_unreachable(error) {
            self.unreachable += 1;
            let run_began = *self.since.get_or_insert_with(Instant::now);
            if self.unreachable >= 2 {
                unreachable(self.what, error, run_began);
            } else {
                tracing::debug!(queue, %error, "{}: Redis not reached; trying again at once", self.what);
            }
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
}
