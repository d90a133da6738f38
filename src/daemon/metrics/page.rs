//! One scrape's page: a registry built for the scrape from what the lanes know now, the Redis snapshot (when
//! Redis answered) and the families of what this daemon saw, encoded in the format the scraper asked for.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeLabelSet, prometheus_text, text};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::snapshot::{QueueSnapshot, Snapshot};
use crate::broker::QueueStats;
use crate::observed::{TypeLabels, observed};

/// The classic Prometheus text format, version 0.0.4.
pub const PROMETHEUS_TEXT: &str = prometheus_text::CONTENT_TYPE;
/// OpenMetrics 1.0.0 text.
pub const OPENMETRICS_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The two exposition formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Prometheus,
    OpenMetrics,
}

impl Format {
    /// The format an `Accept` header prefers: OpenMetrics when it asks for `application/openmetrics-text` at
    /// least as strongly (`q`) as for `text/plain` or anything else; the classic text otherwise, and without the
    /// header.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Prometheus;
        };
        let (mut openmetrics, mut other) = (0.0f64, 0.0f64);
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|param| param.strip_prefix("q="))
                .find_map(|q| q.trim().parse::<f64>().ok())
                .unwrap_or(1.0);
            if media == "application/openmetrics-text" {
                openmetrics = openmetrics.max(q);
            } else {
                other = other.max(q);
            }
        }
        if openmetrics > 0.0 && openmetrics >= other {
            Format::OpenMetrics
        } else {
            Format::Prometheus
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => PROMETHEUS_TEXT,
            Format::OpenMetrics => OPENMETRICS_TEXT,
        }
    }
}

/// What one lane knows now, read at the scrape.
#[derive(Clone, Debug)]
pub struct LaneNumbers {
    pub queue: Arc<str>,
    pub workers: usize,
    /// Workers running a handler whose task is still theirs.
    pub busy: usize,
    /// Workers stuck in a handler that ignored its cancel flag.
    pub stuck: usize,
    pub held: usize,
    /// The prefetch now (adapted by the lane unless the config sets it).
    pub prefetch: usize,
    /// Outcomes Redis refused, which the acker holds and tries again.
    pub refused: usize,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabel {
    queue: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LevelLabels {
    queue: Arc<str>,
    level: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabel {
    version: &'static str,
}

#[derive(Clone, Copy)]
enum Kind {
    /// A count: an integer gauge.
    Gauge,
    /// A time in seconds: a float gauge.
    Seconds,
    Counter,
}

/// A metric with one sample per queue read from Redis: its name as the samples have it, kind, help (the encoder
/// ends it with a period), value.
type PerQueue = (&'static str, Kind, &'static str, fn(&QueueStats) -> f64);

const PER_QUEUE: [PerQueue; 16] = [
    (
        "kmqd_queue_processing",
        Kind::Gauge,
        "Tasks claimed and not settled (safe mode)",
        |s| s.processing as f64,
    ),
    (
        "kmqd_queue_running",
        Kind::Gauge,
        "Tasks claimed under the queue's max_running and not settled, by every daemon (0 without the limit)",
        |s| s.running as f64,
    ),
    (
        "kmqd_queue_delayed",
        Kind::Gauge,
        "Tasks waiting for their due time, retries included",
        |s| s.delayed as f64,
    ),
    (
        "kmqd_queue_waiting_dependencies",
        Kind::Gauge,
        "Tasks of flows waiting for their dependencies: pushed, not yet released nor failed",
        |s| s.waiting as f64,
    ),
    (
        "kmqd_queue_dead",
        Kind::Gauge,
        "Records in the dead-letter list",
        |s| s.dead as f64,
    ),
    (
        "kmqd_queue_paused",
        Kind::Gauge,
        "1 while the queue is paused (kmqd queue pause): no daemon takes its tasks",
        |s| if s.paused { 1.0 } else { 0.0 },
    ),
    (
        "kmqd_queue_throttled_seconds",
        Kind::Seconds,
        "How long a handler's throttle still holds the queue back: no daemon takes its tasks (0 when none)",
        |s| s.throttle_ms.unwrap_or(0) as f64 / 1000.0,
    ),
    (
        "kmqd_queue_lag_seconds",
        Kind::Seconds,
        "Age of the oldest task at the head of a ready list (0 when none is ready)",
        |s| s.lag_ms.unwrap_or(0) as f64 / 1000.0,
    ),
    (
        "kmqd_tasks_pushed_total",
        Kind::Counter,
        "Tasks accepted by the enqueue script or moved from a source list",
        |s| s.pushed as f64,
    ),
    (
        "kmqd_tasks_moved_total",
        Kind::Counter,
        "Tasks moved from the queue's source_lists (counted in pushed too)",
        |s| s.moved as f64,
    ),
    (
        "kmqd_tasks_done_total",
        Kind::Counter,
        "Tasks acknowledged",
        |s| s.done as f64,
    ),
    (
        "kmqd_tasks_retried_total",
        Kind::Counter,
        "Tasks queued again for another attempt",
        |s| s.retried as f64,
    ),
    (
        "kmqd_task_runs_throttled_total",
        Kind::Counter,
        "Runs whose handler answered throttle (back-pressure): each task went back uncharged",
        |s| s.throttled as f64,
    ),
    (
        "kmqd_task_runs_failed_total",
        Kind::Counter,
        "Runs that failed",
        |s| s.failed as f64,
    ),
    (
        "kmqd_tasks_dead_lettered_total",
        Kind::Counter,
        "Tasks moved to the dead-letter list",
        |s| s.dead_lettered as f64,
    ),
    (
        "kmqd_tasks_cancelled_total",
        Kind::Counter,
        "Waiting tasks removed by kmqd task cancel",
        |s| s.cancelled as f64,
    ),
];

/// A gauge with one sample per lane: name, help, value.
type LaneGauge = (&'static str, &'static str, fn(&LaneNumbers) -> usize);

/// The page for `lanes`, with the Redis-derived families when `redis` is there.
pub fn render(format: Format, lanes: &[LaneNumbers], redis: Option<&Snapshot>) -> String {
    let registry = registry(lanes, redis);
    let mut page = String::new();
    // Writing into a String cannot fail, and every value encodes.
    let _ = match format {
        Format::Prometheus => prometheus_text::encode(&mut page, &registry),
        Format::OpenMetrics => text::encode(&mut page, &registry),
    };
    page
}

/// A family with one sample per queue, of counts (`Gauge<i64>`) or seconds (`Gauge<f64>`), or a counter.
fn per_queue<'a>(
    registry: &mut Registry,
    (name, kind, help): (&str, Kind, &str),
    samples: impl IntoIterator<Item = (&'a Arc<str>, f64)>,
) {
    let label = |queue: &Arc<str>| QueueLabel {
        queue: Arc::clone(queue),
    };
    match kind {
        Kind::Gauge => {
            let family = Family::<QueueLabel, Gauge>::default();
            for (queue, value) in samples {
                family.get_or_create(&label(queue)).set(value as i64);
            }
            registry.register(name, help, family);
        }
        Kind::Seconds => {
            let family = Family::<QueueLabel, Gauge<f64, AtomicU64>>::default();
            for (queue, value) in samples {
                family.get_or_create(&label(queue)).set(value);
            }
            registry.register(name, help, family);
        }
        Kind::Counter => {
            let family = Family::<QueueLabel, Counter>::default();
            for (queue, value) in samples {
                family.get_or_create(&label(queue)).inc_by(value as u64);
            }
            // The encoders add the `_total` the table's names carry.
            registry.register(name.strip_suffix("_total").unwrap_or(name), help, family);
        }
    }
}

/// The families of the queues' `[[queues.limits]]` entries, a sample per queue and type: bounded by the config
/// (at most 64 types a queue), never by what producers push.
fn per_type<'a>(
    registry: &mut Registry,
    queues: impl Iterator<Item = (&'a Arc<str>, &'a QueueSnapshot)> + Clone,
) {
    let running = Family::<TypeLabels, Gauge>::default();
    let waiting = Family::<TypeLabels, Gauge>::default();
    let throttled = Family::<TypeLabels, Gauge<f64, AtomicU64>>::default();
    for (queue, read) in queues {
        for (kind, usage) in &read.types {
            let labels = TypeLabels {
                queue: Arc::clone(queue),
                r#type: Arc::from(kind.as_str()),
            };
            running
                .get_or_create(&labels)
                .set(i64::try_from(usage.running).unwrap_or(i64::MAX));
            waiting
                .get_or_create(&labels)
                .set(i64::try_from(usage.waiting).unwrap_or(i64::MAX));
            throttled
                .get_or_create(&labels)
                .set(usage.throttle_ms.unwrap_or(0) as f64 / 1000.0);
        }
    }
    registry.register(
        "kmqd_type_running",
        "Tasks of a type with its own max_running ([[queues.limits]]) taken and not settled, by every daemon",
        running,
    );
    registry.register(
        "kmqd_type_waiting",
        "Tasks of a type with its own limits that they hold back, waiting in the type's own list",
        waiting,
    );
    registry.register(
        "kmqd_type_throttled_seconds",
        "How long a handler's throttle still holds a type with its own limits back (0 when none)",
        throttled,
    );
}

fn registry(lanes: &[LaneNumbers], redis: Option<&Snapshot>) -> Registry {
    let mut registry = Registry::default();
    let build = Family::<VersionLabel, Gauge>::default();
    build
        .get_or_create(&VersionLabel {
            version: env!("CARGO_PKG_VERSION"),
        })
        .set(1);
    registry.register(
        "kmqd_build_info",
        "The kmqd version that serves this page (always 1)",
        build,
    );
    let up = Gauge::<i64>::default();
    up.set(i64::from(redis.is_some()));
    registry.register(
        "kmqd_redis_up",
        "1 when Redis answered this scrape's reads in time; 0 when it did not (the queue-wide families are then \
         left out)",
        up,
    );
    if let Some(snapshot) = redis {
        let queues = || lanes.iter().map(|lane| &lane.queue).zip(snapshot);
        let ready = Family::<LevelLabels, Gauge>::default();
        for (queue, read) in queues() {
            for (level, n) in &read.stats.ready_by_level {
                ready
                    .get_or_create(&LevelLabels {
                        queue: Arc::clone(queue),
                        level: level.clone(),
                    })
                    .set(i64::try_from(*n).unwrap_or(i64::MAX));
            }
        }
        registry.register("kmqd_queue_ready", "Tasks waiting in a ready list", ready);
        for (name, kind, help, value) in PER_QUEUE {
            let samples = queues().map(|(queue, read)| (queue, value(&read.stats)));
            per_queue(&mut registry, (name, kind, help), samples);
        }
        per_type(&mut registry, queues());
        // A sample per grouped queue only: a queue without [queues.groups] has no groups to count.
        per_queue(
            &mut registry,
            (
                "kmqd_groups_waiting",
                Kind::Gauge,
                "Groups of a grouped queue ([queues.groups]) with tasks waiting in their own lists (a group per \
                 level it waits at)",
            ),
            queues().filter_map(|(queue, read)| Some((queue, read.groups_waiting? as f64))),
        );
        per_queue(
            &mut registry,
            (
                "kmqd_queue_daemons",
                Kind::Gauge,
                "Daemons whose lease on the queue is live (what kmqd workers lists)",
            ),
            queues().map(|(queue, read)| (queue, read.daemons as f64)),
        );
    }
    let lane_gauges: [LaneGauge; 6] = [
        (
            "kmqd_daemon_held_tasks",
            "Tasks this daemon holds (claimed, running or being settled)",
            |l| l.held,
        ),
        (
            "kmqd_daemon_workers",
            "Workers this daemon runs for the queue (its config's workers)",
            |l| l.workers,
        ),
        (
            "kmqd_daemon_busy_workers",
            "Workers of this daemon running a handler (stuck ones not included)",
            |l| l.busy,
        ),
        (
            "kmqd_daemon_stuck_workers",
            "Workers stuck in a handler that kept running after its task was taken (it ignores its cancel flag)",
            |l| l.stuck,
        ),
        (
            "kmqd_daemon_prefetch",
            "Tasks this daemon may claim beyond one per worker: the config's prefetch, or what the lane adapted it to",
            |l| l.prefetch,
        ),
        (
            "kmqd_daemon_refused_outcomes",
            "Outcomes Redis refused to settle, even alone in a call (out of memory with the call counted, a record it cannot take): their tasks stay held and are tried again",
            |l| l.refused,
        ),
    ];
    for (name, help, value) in lane_gauges {
        per_queue(
            &mut registry,
            (name, Kind::Gauge, help),
            lanes.iter().map(|lane| (&lane.queue, value(lane) as f64)),
        );
    }
    let observed = observed();
    registry.register(
        "kmqd_task_duration_seconds",
        "How long this daemon's handlers ran, per queue and task type (tasks no plugin handles: type \"(unknown)\")",
        observed.durations.clone(),
    );
    registry.register(
        "kmqd_task_outcomes",
        "What became of the tasks this daemon held, per queue, type and outcome",
        observed.outcomes.clone(),
    );
    registry.register(
        "kmqd_fetches_held_back",
        "Fetches of this daemon that a limit held back (took nothing), per queue and limit: max_running, \
         rate_limit, throttle, limits (its types' [[queues.limits]] held every waiting task back)",
        observed.held_back.clone(),
    );
    registry.register(
        "kmqd_redis_errors",
        "Redis calls of this daemon that failed, per operation (each is retried)",
        observed.redis_errors.clone(),
    );
    registry.register(
        "kmqd_otel_spans_dropped",
        "Run spans this daemon never got to its otlp_endpoint: dropped with the export queue full, or lost with \
         an export that failed (0 without tracing)",
        observed.spans_dropped.clone(),
    );
    registry
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes() -> Vec<LaneNumbers> {
        vec![LaneNumbers {
            queue: Arc::from("page-test"),
            workers: 4,
            busy: 1,
            stuck: 0,
            refused: 0,
            held: 3,
            prefetch: 12,
        }]
    }

    fn snapshot() -> Snapshot {
        vec![QueueSnapshot {
            stats: QueueStats {
                ready_by_level: vec![("high".into(), 2), ("low".into(), 0)],
                done: 7,
                cancelled: 1,
                waiting: 4,
                lag_ms: Some(1500),
                ..QueueStats::default()
            },
            daemons: 2,
            types: vec![(
                "report".into(),
                crate::broker::TypeUsage {
                    running: 2,
                    rate_used: vec![5],
                    waiting: 14,
                    throttle_ms: Some(1500),
                },
            )],
            groups_waiting: Some(12),
        }]
    }

    #[test]
    fn the_accept_header_picks_the_format() {
        let prometheus_2 = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;\
                            q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(Format::negotiate(Some(prometheus_2)), Format::OpenMetrics);
        assert_eq!(Format::negotiate(None), Format::Prometheus);
        assert_eq!(Format::negotiate(Some("text/plain")), Format::Prometheus);
        assert_eq!(Format::negotiate(Some("*/*")), Format::Prometheus);
        assert_eq!(
            Format::negotiate(Some(
                "text/plain;version=0.0.4,application/openmetrics-text;q=0.5"
            )),
            Format::Prometheus
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0")),
            Format::Prometheus,
            "q=0 refuses it"
        );
    }

    #[test]
    fn the_classic_page_has_help_and_type_on_every_family_named_as_its_samples() {
        let page = render(Format::Prometheus, &lanes(), Some(&snapshot()));
        assert!(page.contains("kmqd_build_info{version=\""), "{page}");
        assert!(page.contains("# TYPE kmqd_build_info gauge"), "{page}");
        assert!(page.contains("kmqd_redis_up 1"), "{page}");
        assert!(
            page.contains("kmqd_queue_ready{queue=\"page-test\",level=\"high\"} 2"),
            "{page}"
        );
        assert!(
            page.contains("# TYPE kmqd_tasks_done_total counter"),
            "{page}"
        );
        assert!(
            page.contains("kmqd_tasks_done_total{queue=\"page-test\"} 7"),
            "{page}"
        );
        for sample in [
            "kmqd_type_running{queue=\"page-test\",type=\"report\"} 2",
            "kmqd_type_waiting{queue=\"page-test\",type=\"report\"} 14",
            "kmqd_type_throttled_seconds{queue=\"page-test\",type=\"report\"} 1.5",
            "kmqd_groups_waiting{queue=\"page-test\"} 12",
        ] {
            assert!(page.contains(sample), "{sample} in {page}");
        }
        assert!(
            page.contains("kmqd_tasks_cancelled_total{queue=\"page-test\"} 1"),
            "{page}"
        );
        assert!(
            page.contains("kmqd_queue_waiting_dependencies{queue=\"page-test\"} 4"),
            "{page}"
        );
        assert!(
            page.contains("kmqd_queue_lag_seconds{queue=\"page-test\"} 1.5"),
            "{page}"
        );
        assert!(
            page.contains("kmqd_queue_daemons{queue=\"page-test\"} 2"),
            "{page}"
        );
        assert!(
            page.contains("kmqd_daemon_busy_workers{queue=\"page-test\"} 1"),
            "{page}"
        );
        assert!(!page.contains("# EOF"), "{page}");
        // Every sample's family has HELP and TYPE lines before it, under the name its samples carry.
        let mut family = String::new();
        for line in page.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                family = rest.split(' ').next().unwrap().to_string();
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap();
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suffix| name.strip_suffix(suffix).filter(|base| *base == family))
                    .unwrap_or(name);
                assert_eq!(base, family, "{line} under # TYPE {family}");
                assert!(page.contains(&format!("# HELP {family} ")), "{family}");
            }
        }
    }

    #[test]
    fn without_redis_the_page_says_so_and_keeps_what_the_daemon_knows() {
        let page = render(Format::Prometheus, &lanes(), None);
        assert!(page.contains("kmqd_redis_up 0"), "{page}");
        assert!(
            page.contains("kmqd_daemon_held_tasks{queue=\"page-test\"} 3")
                && page.contains("kmqd_daemon_prefetch{queue=\"page-test\"} 12"),
            "{page}"
        );
        assert!(!page.contains("kmqd_queue_ready"), "{page}");
    }

    #[test]
    fn openmetrics_names_counter_families_without_total_and_ends_with_eof() {
        let page = render(Format::OpenMetrics, &lanes(), Some(&snapshot()));
        assert!(page.contains("# TYPE kmqd_tasks_done counter"), "{page}");
        assert!(
            page.contains("kmqd_tasks_done_total{queue=\"page-test\"} 7"),
            "{page}"
        );
        assert!(page.ends_with("# EOF\n"), "{page}");
    }
}
