//! The metrics endpoint: `GET /metrics` on `metrics_addr`, encoded by the `prometheus-client` crate and served
//! by `tiny_http` (synchronous: one thread here, tiny_http's own for the connections; no async runtime).
//!
//! - [`page`]: one scrape's registry and its encoding;
//! - [`snapshot`]: the queue-wide numbers from Redis, read by a refresher thread that a scrape waits for at most
//!   [`snapshot::REDIS_WAIT`], so `/metrics` answers within a second with Redis down (`kmqd_redis_up 0`);
//! - [`observed`]: what this daemon saw (handler durations, outcomes, Redis errors), cheap on the hot path.
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

pub mod observed;
pub mod page;
pub mod snapshot;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use tiny_http::{Header, Method, Request, Response, Server};

use super::lane::LaneSet;
use crate::shutdown::Listener;
use page::{Format, LaneNumbers};
use snapshot::RedisView;

/// How often the serving loop looks at the shutdown trigger.
const ACCEPT_POLL: Duration = Duration::from_millis(100);

/// Binds `addr` (port 0: a free port) and returns the listener with the address it got.
pub fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    Ok((listener, bound))
}

/// The `kmqd-metrics` thread.
pub struct Metrics {
    server: Server,
    lanes: Arc<LaneSet>,
    redis: RedisView,
    background: Listener,
}

impl Metrics {
    /// Serves on `listener` (tiny_http starts its connection threads now).
    pub fn new(
        listener: TcpListener,
        lanes: Arc<LaneSet>,
        redis: RedisView,
        background: Listener,
    ) -> std::io::Result<Metrics> {
        let server = Server::from_listener(listener, None).map_err(std::io::Error::other)?;
        Ok(Metrics {
            server,
            lanes,
            redis,
            background,
        })
    }

    pub fn run(self) {
        while !self.background.is_triggered() {
            match self.server.recv_timeout(ACCEPT_POLL) {
                Ok(Some(request)) => self.serve(request),
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(%error, "metrics endpoint: accept failed");
                    self.background.wait(ACCEPT_POLL);
                }
            }
        }
        tracing::debug!("metrics endpoint stopped");
    }

    fn serve(&self, request: Request) {
        let path = request.url().split('?').next().unwrap_or("");
        let response = if path != "/metrics" {
            text_response(404, "try /metrics\n")
        } else if !matches!(request.method(), Method::Get | Method::Head) {
            text_response(405, "GET /metrics\n")
        } else {
            let accept = request
                .headers()
                .iter()
                .find(|header| header.field.equiv("Accept"))
                .map(|header| header.value.as_str());
            let format = Format::negotiate(accept);
            let redis = self.redis.fresh(snapshot::REDIS_WAIT);
            let body = page::render(format, &self.numbers(), redis.as_deref());
            Response::from_string(body).with_header(content_type(format.content_type()))
        };
        if let Err(error) = request.respond(response) {
            tracing::debug!(%error, "metrics request failed");
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
            })
            .collect()
    }
}

fn content_type(value: &str) -> Header {
    Header::from_bytes("Content-Type", value).expect("a valid header")
}

fn text_response(code: u16, body: &str) -> Response<std::io::Cursor<Vec<u8>>> {
    Response::from_string(body)
        .with_status_code(code)
        .with_header(content_type("text/plain; charset=utf-8"))
}
