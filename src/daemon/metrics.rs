//! The metrics endpoint: `GET /metrics` on `metrics_addr`, in the Prometheus text format.
//!
//! Queue depths, counters and lag come from Redis, so every daemon reports the same queue-wide numbers (aggregate
//! them with `max by (queue)`); `kmqd_daemon_held_tasks` is this daemon's own share. A scrape costs one pipelined
//! round trip per queue. Requests are served one at a time on the `kmqd-metrics` thread: a scraper is not a
//! crowd.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use super::lane::{Lane, LaneSet};
use crate::broker::{self, QueueStats, Session};
use crate::shutdown::Listener;

/// How long a client may take to send its request line.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the accept loop looks at the shutdown trigger.
const ACCEPT_POLL: Duration = Duration::from_millis(100);

/// A metric with one sample per queue: name, Prometheus type, help text, and how to read it from the stats.
type PerQueue = (
    &'static str,
    &'static str,
    &'static str,
    fn(&QueueStats) -> f64,
);

const PER_QUEUE: [PerQueue; 10] = [
    (
        "kmqd_queue_processing",
        "gauge",
        "Tasks claimed and not settled (safe mode).",
        |s| s.processing as f64,
    ),
    (
        "kmqd_queue_delayed",
        "gauge",
        "Tasks waiting for their due time, retries included.",
        |s| s.delayed as f64,
    ),
    (
        "kmqd_queue_dead",
        "gauge",
        "Records in the dead-letter list.",
        |s| s.dead as f64,
    ),
    (
        "kmqd_queue_paused",
        "gauge",
        "1 while the queue is paused (kmqd queue pause): no daemon takes its tasks.",
        |s| if s.paused { 1.0 } else { 0.0 },
    ),
    (
        "kmqd_queue_lag_seconds",
        "gauge",
        "Age of the oldest task at the head of a ready list (0 when none is ready).",
        |s| s.lag_ms.unwrap_or(0) as f64 / 1000.0,
    ),
    (
        "kmqd_tasks_pushed_total",
        "counter",
        "Tasks accepted by the enqueue script.",
        |s| s.pushed as f64,
    ),
    (
        "kmqd_tasks_done_total",
        "counter",
        "Tasks acknowledged.",
        |s| s.done as f64,
    ),
    (
        "kmqd_tasks_retried_total",
        "counter",
        "Tasks queued again for another attempt.",
        |s| s.retried as f64,
    ),
    (
        "kmqd_task_runs_failed_total",
        "counter",
        "Runs that failed.",
        |s| s.failed as f64,
    ),
    (
        "kmqd_tasks_dead_lettered_total",
        "counter",
        "Tasks moved to the dead-letter list.",
        |s| s.dead_lettered as f64,
    ),
];

pub struct Metrics {
    pub listener: TcpListener,
    pub lanes: Arc<LaneSet>,
    pub connection: Session,
    pub background: Listener,
}

impl Metrics {
    pub fn run(mut self) {
        if let Err(error) = self.listener.set_nonblocking(true) {
            tracing::error!(%error, "metrics endpoint disabled");
            return;
        }
        while !self.background.is_triggered() {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if let Err(error) = self.serve(stream) {
                        tracing::debug!(%error, "metrics request failed");
                    }
                }
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                    self.background.wait(ACCEPT_POLL);
                }
                Err(error) => {
                    tracing::warn!(%error, "metrics endpoint: accept failed");
                    self.background.wait(ACCEPT_POLL);
                }
            }
        }
        tracing::debug!("metrics endpoint stopped");
    }

    fn serve(&mut self, stream: TcpStream) -> std::io::Result<()> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
        let mut request_line = String::new();
        BufReader::new(&stream).read_line(&mut request_line)?;
        let mut stream = stream;
        let path = request_line.split_whitespace().nth(1).unwrap_or("");
        let (status, body) = if path == "/metrics" {
            match self.render() {
                Ok(body) => ("200 OK", body),
                Err(error) => {
                    self.connection.reset();
                    ("503 Service Unavailable", format!("redis: {error}\n"))
                }
            }
        } else {
            ("404 Not Found", "try /metrics\n".to_string())
        };
        write!(
            stream,
            "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    }

    /// The metrics page.
    pub fn render(&mut self) -> broker::Result<String> {
        let lanes = self.lanes.newest();
        let mut stats = Vec::with_capacity(lanes.len());
        for lane in &lanes {
            let connection = self.connection.get()?;
            stats.push(broker::stats(connection, &lane.queue.keys)?);
        }
        let mut out = String::new();
        let mut family =
            |name: &str,
             kind: &str,
             help: &str,
             samples: &mut dyn Iterator<Item = (String, f64)>| {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
                for (labels, value) in samples {
                    let _ = writeln!(out, "{name}{{{labels}}} {value}");
                }
            };
        let queue_label = |lane: &Lane| format!("queue=\"{}\"", lane.name());
        let pairs = || lanes.iter().zip(&stats);
        family(
            "kmqd_queue_ready",
            "gauge",
            "Tasks waiting in a ready list.",
            &mut pairs().flat_map(|(q, s)| {
                s.ready_by_level.iter().map(move |(level, n)| {
                    (format!("{},level=\"{level}\"", queue_label(q)), *n as f64)
                })
            }),
        );
        for (name, kind, help, value) in PER_QUEUE {
            family(
                name,
                kind,
                help,
                &mut pairs().map(|(q, s)| (queue_label(q), value(s))),
            );
        }
        family(
            "kmqd_daemon_held_tasks",
            "gauge",
            "Tasks this daemon holds (claimed, running or being settled).",
            &mut lanes
                .iter()
                .map(|lane| (queue_label(lane), lane.held.len() as f64)),
        );
        family(
            "kmqd_daemon_stuck_workers",
            "gauge",
            "Workers stuck in a handler that kept running after its task was taken (it ignores its cancel flag).",
            &mut lanes
                .iter()
                .map(|lane| (queue_label(lane), lane.capacity.stuck_workers() as f64)),
        );
        Ok(out)
    }
}
