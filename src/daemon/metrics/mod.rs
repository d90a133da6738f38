//! The metrics endpoint: `GET /metrics` on `metrics_addr`, encoded by the `prometheus-client` crate and served
//! by [`crate::http`] (synchronous: this thread accepts and reads requests, [`HANDLERS`] threads answer them;
//! bounded in connections, sizes and time, so a client of the endpoint cannot exhaust the daemon: review H3).
//!
//! - [`page`]: one scrape's registry and its encoding;
//! - [`snapshot`]: the queue-wide numbers from Redis, read by a refresher thread that a scrape waits for at most
//!   [`snapshot::REDIS_WAIT`], so `/metrics` answers within a second with Redis down (`kmqd_redis_up 0`);
//! - [`crate::observed`]: what this daemon saw (handler durations, outcomes, Redis errors), cheap on the hot path;
//!   it lives below the daemon, since the lanes' workers and every thread that retries Redis calls count into it.
//!
//! Queue depths, counters, lag and live daemons come from Redis, so every daemon reports the same queue-wide
//! numbers (aggregate them with `max by (queue)`); the `kmqd_daemon_*` gauges and the observed families are this
//! daemon's own share (aggregate them with `sum`).
//!
//! Formats: the classic Prometheus text (0.0.4) by default and to a scraper that asks for `text/plain`, and
//! OpenMetrics 1.0.0 to one whose `Accept` prefers `application/openmetrics-text` (Prometheus itself does).
//! prometheus-client has an encoder for each (`encoding::prometheus_text` and `encoding::text`), so both are
//! encoded from the same registry rather than converted from one to the other: the classic encoder names a
//! counter's family as its samples (`# TYPE kmqd_tasks_done_total counter`, as promtool wants), OpenMetrics
//! without the suffix and with `# EOF`. `kmqd_build_info` is a gauge (`{version} 1`), not OpenMetrics' info
//! type, so both formats show it alike.

pub mod page;
pub mod snapshot;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::lane::LaneSet;
use crate::http::{Limits, Request, Response, Server};
use crate::shutdown::Listener;
use page::{Format, LaneNumbers};
use snapshot::RedisView;

/// Threads answering scrapes (`kmqd-metrics-0`, `-1`): one Prometheus and an operator's curl at a time, each
/// waiting at most [`snapshot::REDIS_WAIT`] for Redis.
pub const HANDLERS: usize = 2;

/// A scrape has no body.
const LIMITS: Limits = Limits::new(HANDLERS, 0);

/// Binds `addr` (port 0: a free port) and returns the listener with the address it got.
pub fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    Ok((listener, bound))
}

/// The `kmqd-metrics` thread: it accepts and reads the scrapes; [`HANDLERS`] threads of its own answer them.
pub struct Metrics {
    server: Server,
}

/// What a scrape reads, shared by the handler threads.
struct Page {
    lanes: Arc<LaneSet>,
    redis: RedisView,
}

impl Metrics {
    /// Starts the handler threads of `listener`; [`Metrics::run`] serves until the background phase of the
    /// shutdown.
    pub fn new(
        listener: TcpListener,
        lanes: Arc<LaneSet>,
        redis: RedisView,
        background: Listener,
    ) -> std::io::Result<Metrics> {
        let page = Page { lanes, redis };
        let server = Server::start(
            listener,
            "kmqd-metrics",
            LIMITS,
            move |request: &Request| page.serve(request),
            background,
        )?;
        Ok(Metrics { server })
    }

    /// Serves until the background phase of the shutdown; the handler threads are joined before it returns.
    pub fn run(self) {
        self.server.run();
        tracing::debug!("metrics endpoint stopped");
    }
}

impl Page {
    fn serve(&self, request: &Request) -> Response {
        let path = request.target().split('?').next().unwrap_or("");
        if path != "/metrics" {
            Response::text(404, "try /metrics\n")
        } else if !matches!(request.method(), "GET" | "HEAD") {
            Response::text(405, "GET /metrics\n")
        } else {
            let format = Format::negotiate(request.header("Accept"));
            let redis = self.redis.fresh(snapshot::REDIS_WAIT);
            let body = page::render(format, &self.numbers(), redis.as_deref());
            Response::new(200, format.content_type(), body)
        }
    }

    /// What the lanes know now.
    fn numbers(&self) -> Vec<LaneNumbers> {
        self.lanes
            .newest()
            .iter()
            .map(|lane| LaneNumbers {
                queue: Arc::from(lane.name()),
                workers: lane.queue.config.workers,
                busy: lane.held.count(|state| state.running_for().is_some()),
                stuck: lane.capacity.stuck_workers(),
                held: lane.held.len(),
                prefetch: lane.capacity.prefetch(),
                refused: lane.refused_outcomes.load(Ordering::Acquire),
            })
            .collect()
    }
}
