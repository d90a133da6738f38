//! What this daemon saw itself, as opposed to the queue-wide numbers read from Redis: its handlers' durations and
//! its tasks' outcomes per queue and type, and the Redis calls that failed.
//!
//! One process-wide [`Observed`] ([`observed`]): the threads that see these things (workers, the timeouts
//! thread, every thread that calls Redis through `retry::Trouble` or the settler) reach it without plumbing,
//! and a scrape of the metrics endpoint (`daemon::metrics`) clones its families (`Arc`s) into the page's
//! registry. It sits below the daemon, beside `retry` and `settler`, which count into it: it imports nothing of
//! the daemon.
//!
//! The per-task path is a worker's: it keeps a [`TypeCache`] of the histogram and counters of each task type it
//! ran, so a task costs no clock read of its own (the run's start and end are the reads the worker makes anyway
//! for this task and the next, see [`TypeCache::ran`]), a string compare (the same type as the last task) or one FxHash lookup, the histogram's lock (shared by the queue's
//! workers: held for a bucket search of 17) and one atomic add; never the families' label hash and read lock.
//! docs/PERFORMANCE.md, "What the metrics cost", has the measured figure. Only types a plugin
//! handles get their own label value: the type comes from the producer, and a label per unknown string would
//! let any producer grow the page without bound.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::{MetricType, TypedMetric};
use rustc_hash::FxHashMap;

use crate::broker::{SettleOp, Settlement};

/// The `type` label of tasks no plugin handles, or whose envelope could not be read.
pub const UNKNOWN_TYPE: &str = "(unknown)";

/// Handler durations from 1 ms to 5 min, about three buckets per decade.
pub const DURATION_BUCKETS: [f64; 17] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

/// What became of a task this daemon held: one count per task and resolution.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum TaskOutcome {
    /// The handler finished it: acknowledged.
    Done,
    /// The handler failed it and `on_handler_error = "finish"` acknowledged it anyway.
    Failed,
    /// Queued again for another attempt (a handler error or retry, with retries left).
    Retried,
    /// Moved to the dead-letter list (`KMQ_FAIL`, no retries left, unrunnable).
    Dead,
    /// Taken from its handler by `execution_timeout` (then retried or dead-lettered per the policy).
    TimedOut,
    /// Handed back to the queue unstarted, or at shutdown (uncharged).
    HandedBack,
    /// Back-pressure: its handler throttled the queue, and it went back uncharged.
    Throttled,
    /// Forgotten: its lease was lost (the monitors give it to another daemon), or, in default mode, still running
    /// after `shutdown_grace`.
    Lost,
}

impl TaskOutcome {
    const ALL: [TaskOutcome; 8] = [
        TaskOutcome::Done,
        TaskOutcome::Failed,
        TaskOutcome::Retried,
        TaskOutcome::Dead,
        TaskOutcome::TimedOut,
        TaskOutcome::HandedBack,
        TaskOutcome::Throttled,
        TaskOutcome::Lost,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskOutcome::Done => "done",
            TaskOutcome::Failed => "failed",
            TaskOutcome::Retried => "retried",
            TaskOutcome::Dead => "dead",
            TaskOutcome::TimedOut => "timed_out",
            TaskOutcome::HandedBack => "handed_back",
            TaskOutcome::Throttled => "throttled",
            TaskOutcome::Lost => "lost",
        }
    }

    /// What a settlement does with the task.
    pub fn of(settlement: &Settlement) -> TaskOutcome {
        match settlement.op {
            SettleOp::Ack if settlement.failed => TaskOutcome::Failed,
            SettleOp::Ack => TaskOutcome::Done,
            SettleOp::Retry { .. } => TaskOutcome::Retried,
            SettleOp::Dead => TaskOutcome::Dead,
            // A lane's own resolutions never recover (the monitors do, for other owners); counted as hand-backs.
            SettleOp::Back { .. } | SettleOp::Recover { .. } => TaskOutcome::HandedBack,
            SettleOp::Throttle { .. } => TaskOutcome::Throttled,
        }
    }
}

impl EncodeLabelValue for TaskOutcome {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        encoder.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TypeLabels {
    pub queue: Arc<str>,
    pub r#type: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub queue: Arc<str>,
    pub r#type: Arc<str>,
    pub outcome: TaskOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HeldBackLabels {
    pub queue: Arc<str>,
    /// The config key (or outcome) that held the fetch back: `max_running`, `rate_limit`, `throttle`.
    pub limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// What failed, as the log line says it: "fetching tasks", "renewing the lease", "settling outcomes"...
    pub operation: &'static str,
}

/// A handler-duration histogram of one (queue, type) whose buckets are atomics, added to in batches by each
/// worker's [`TypeHandles`]: prometheus-client's `Histogram` takes a lock per observation, which the workers of a
/// queue contended for (18 % of a worker's CPU in a no-op drain, measured with perf: docs/PERFORMANCE.md).
#[derive(Debug, Default, Clone)]
pub struct Durations(Arc<DurationsInner>);

#[derive(Debug, Default)]
struct DurationsInner {
    /// Per bucket of [`DURATION_BUCKETS`], then +Inf; not cumulative (the encoder adds them up).
    buckets: [AtomicU64; BUCKETS],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

/// The histogram's buckets, +Inf included.
const BUCKETS: usize = DURATION_BUCKETS.len() + 1;

/// The bucket of a run of `seconds`.
fn bucket_of(seconds: f64) -> usize {
    DURATION_BUCKETS.partition_point(|upper| *upper < seconds)
}

impl Durations {
    fn add(&self, batch: &Batch) {
        let inner = &self.0;
        for (bucket, count) in inner.buckets.iter().zip(&batch.buckets) {
            if *count > 0 {
                bucket.fetch_add(u64::from(*count), Ordering::Relaxed);
            }
        }
        inner
            .count
            .fetch_add(u64::from(batch.runs), Ordering::Relaxed);
        inner.sum_ns.fetch_add(batch.sum_ns, Ordering::Relaxed);
    }
}

impl TypedMetric for Durations {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Durations {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> std::fmt::Result {
        let inner = &self.0;
        let buckets: Vec<(f64, u64)> = DURATION_BUCKETS
            .iter()
            .copied()
            .chain(std::iter::once(f64::MAX))
            .zip(&inner.buckets)
            .map(|(upper, count)| (upper, count.load(Ordering::Relaxed)))
            .collect();
        let sum = inner.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(
            sum,
            inner.count.load(Ordering::Relaxed),
            &buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// What a worker saw of one (queue, type) since it last added it to the shared metrics.
#[derive(Debug, Default)]
struct Batch {
    buckets: [u32; BUCKETS],
    runs: u32,
    sum_ns: u64,
    outcomes: [u32; TaskOutcome::ALL.len()],
    /// Observations in the batch (runs and outcomes).
    pending: u32,
}

/// A worker adds its batch to the shared metrics after this many observations, after [`FLUSH_AFTER`], and
/// whenever it runs out of work: a scrape lags a busy worker by at most that much, an idle one not at all.
const FLUSH_EVERY: u32 = 64;
const FLUSH_AFTER: Duration = Duration::from_secs(1);

/// The families of what this daemon saw.
#[derive(Debug)]
pub struct Observed {
    pub durations: Family<TypeLabels, Durations>,
    pub outcomes: Family<OutcomeLabels, Counter>,
    pub redis_errors: Family<ErrorLabels, Counter>,
    pub held_back: Family<HeldBackLabels, Counter>,
    /// Run spans that never reached the collector: dropped with the exporter's queue full, or lost with an
    /// export that failed (`crate::otel`). Tracing is best effort; this says how best.
    pub spans_dropped: Counter,
}

static OBSERVED: LazyLock<Observed> = LazyLock::new(|| Observed {
    durations: Family::default(),
    outcomes: Family::default(),
    redis_errors: Family::default(),
    held_back: Family::default(),
    spans_dropped: Counter::default(),
});

/// This process's observations.
pub fn observed() -> &'static Observed {
    &OBSERVED
}

/// Counts a fetch of `queue` that `limit` held back: it took nothing (cold: a family lookup, never per task).
pub fn held_back(queue: &Arc<str>, limit: &'static str) {
    observed()
        .held_back
        .get_or_create(&HeldBackLabels {
            queue: Arc::clone(queue),
            limit,
        })
        .inc();
}

/// Counts a failed Redis call of `operation` (cold: a family lookup).
pub fn redis_error(operation: &'static str) {
    observed()
        .redis_errors
        .get_or_create(&ErrorLabels { operation })
        .inc();
}

/// Counts an outcome decided outside a worker (timeouts, hand-backs, lost leases; cold: two family lookups).
/// The task's type is its label only if a worker of this daemon ran that type (so a plugin handles it);
/// otherwise it is counted as [`UNKNOWN_TYPE`].
pub fn count_outcome(queue: &str, kind: Option<&str>, outcome: TaskOutcome) {
    let observed = observed();
    let mut labels = TypeLabels {
        queue: Arc::from(queue),
        r#type: Arc::from(kind.unwrap_or(UNKNOWN_TYPE)),
    };
    if observed.durations.get(&labels).is_none() {
        labels.r#type = Arc::from(UNKNOWN_TYPE);
    }
    observed
        .outcomes
        .get_or_create(&OutcomeLabels {
            queue: labels.queue,
            r#type: labels.r#type,
            outcome,
        })
        .inc();
}

/// The metric handles of one (queue, type), resolved once, and what the worker saw of them since it last added
/// that to them (its [`Batch`]: plain integers, no atomics or locks per task).
#[derive(Debug)]
pub struct TypeHandles {
    /// `None` for [`UNKNOWN_TYPE`], which never reaches a handler (no empty histogram on the page).
    duration: Option<Durations>,
    outcomes: [Counter; TaskOutcome::ALL.len()],
    batch: Batch,
    /// When the batch is added to the shared metrics at the latest ([`FLUSH_AFTER`] after the last time, or
    /// after the first observation), ns since the worker's epoch; 0 before the first.
    flush_at_ns: u64,
}

impl TypeHandles {
    fn resolve(queue: &Arc<str>, kind: &str) -> TypeHandles {
        let observed = observed();
        let kind: Arc<str> = Arc::from(kind);
        let duration = (&*kind != UNKNOWN_TYPE).then(|| {
            observed.durations.get_or_create_owned(&TypeLabels {
                queue: Arc::clone(queue),
                r#type: Arc::clone(&kind),
            })
        });
        let outcomes = TaskOutcome::ALL.map(|outcome| {
            observed.outcomes.get_or_create_owned(&OutcomeLabels {
                queue: Arc::clone(queue),
                r#type: Arc::clone(&kind),
                outcome,
            })
        });
        TypeHandles {
            duration,
            outcomes,
            batch: Batch::default(),
            flush_at_ns: 0,
        }
    }

    /// Records a handler's run time, `now_ns` being the worker's clock read after it.
    fn observe(&mut self, ran_ns: u64, now_ns: u64) {
        if self.duration.is_some() {
            let batch = &mut self.batch;
            batch.buckets[bucket_of(ran_ns as f64 / 1e9)] += 1;
            batch.runs += 1;
            batch.sum_ns = batch.sum_ns.saturating_add(ran_ns);
            batch.pending += 1;
        }
        if self.flush_at_ns == 0 {
            self.flush_at_ns = now_ns.saturating_add(FLUSH_AFTER.as_nanos() as u64);
        }
        if self.batch.pending >= FLUSH_EVERY || now_ns >= self.flush_at_ns {
            self.flush(now_ns);
        }
    }

    pub fn count(&mut self, outcome: TaskOutcome) {
        self.batch.outcomes[outcome as usize] += 1;
        self.batch.pending += 1;
    }

    /// Adds the batch to the shared metrics.
    fn flush(&mut self, now_ns: u64) {
        self.flush_at_ns = now_ns.saturating_add(FLUSH_AFTER.as_nanos() as u64);
        if self.batch.pending == 0 {
            return;
        }
        let batch = std::mem::take(&mut self.batch);
        if let Some(duration) = &self.duration {
            duration.add(&batch);
        }
        for (counter, count) in self.outcomes.iter().zip(batch.outcomes) {
            if count > 0 {
                counter.inc_by(u64::from(count));
            }
        }
    }
}

/// A worker's handles per task type of its queue (see the module doc): the same type as the last task is a string
/// compare, another type seen before one FxHash lookup; nothing is cloned or allocated once a type was seen.
#[derive(Debug)]
pub struct TypeCache {
    queue: Arc<str>,
    types: Vec<(Box<str>, TypeHandles)>,
    index: FxHashMap<Box<str>, usize>,
    last: usize,
    unknown: Option<TypeHandles>,
    /// A handler that returned, whose end is the worker's next clock read: its type's index and its start.
    running: Option<(usize, u64)>,
    /// What the times given in ns count from (the lane's epoch): one subtraction of `Instant`s per task, in the
    /// worker, rather than one here per run and per flush check.
    epoch: Instant,
}

impl TypeCache {
    pub fn new(queue: &str, epoch: Instant) -> TypeCache {
        TypeCache {
            queue: Arc::from(queue),
            types: Vec::new(),
            index: FxHashMap::default(),
            last: 0,
            unknown: None,
            running: None,
            epoch,
        }
    }

    /// The handler of the type of the last [`TypeCache::get`] (a handled one), started at `started_ns` (since the
    /// epoch), returned: its duration is recorded at the worker's next clock read ([`TypeCache::ended`]), which
    /// the worker makes anyway for its next task, so the histogram costs no clock read of its own.
    pub fn ran(&mut self, started_ns: u64) {
        self.running = Some((self.last, started_ns));
    }

    /// The clock read after the last run, ns since the epoch: records its duration, if one is waiting.
    pub fn ended(&mut self, now_ns: u64) {
        if let Some((at, started_ns)) = self.running.take() {
            self.types[at]
                .1
                .observe(now_ns.saturating_sub(started_ns), now_ns);
        }
    }

    /// Adds every type's batch to the shared metrics: the worker is out of work (or stops).
    pub fn flush(&mut self) {
        let now_ns = self.epoch.elapsed().as_nanos() as u64;
        for (_, handles) in &mut self.types {
            handles.flush(now_ns);
        }
        if let Some(unknown) = &mut self.unknown {
            unknown.flush(now_ns);
        }
    }

    /// The handles of task type `kind`; `is_handled` (asked only the first time a type is seen) says whether a
    /// plugin handles it. `None`: the envelope could not be read.
    pub fn get(
        &mut self,
        kind: Option<&str>,
        is_handled: impl FnOnce(&str) -> bool,
    ) -> &mut TypeHandles {
        let Some(kind) = kind else {
            return self.unknown();
        };
        if self
            .types
            .get(self.last)
            .is_some_and(|(last, _)| **last == *kind)
        {
            return &mut self.types[self.last].1;
        }
        match self.index.get(kind) {
            Some(&at) => self.last = at,
            None if is_handled(kind) => {
                self.last = self.types.len();
                self.types
                    .push((Box::from(kind), TypeHandles::resolve(&self.queue, kind)));
                self.index.insert(Box::from(kind), self.last);
            }
            None => return self.unknown(),
        }
        &mut self.types[self.last].1
    }

    fn unknown(&mut self) -> &mut TypeHandles {
        let queue = &self.queue;
        self.unknown
            .get_or_insert_with(|| TypeHandles::resolve(queue, UNKNOWN_TYPE))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(queue: &str, kind: &str, outcome: TaskOutcome) -> u64 {
        observed()
            .outcomes
            .get(&OutcomeLabels {
                queue: Arc::from(queue),
                r#type: Arc::from(kind),
                outcome,
            })
            .map_or(0, |counter| counter.get())
    }

    #[test]
    fn cached_handles_count_into_the_shared_families() {
        let mut cache = TypeCache::new("cache-test", Instant::now());
        cache.get(Some("mail"), |_| true).count(TaskOutcome::Done);
        cache.get(Some("sms"), |_| true).count(TaskOutcome::Retried);
        // Back to a type seen before: from the map, not resolved again (the closure would panic).
        cache
            .get(Some("mail"), |_| panic!("asked again"))
            .count(TaskOutcome::Done);
        cache
            .get(Some("random-junk"), |_| false)
            .count(TaskOutcome::Dead);
        cache.get(None, |_| true).count(TaskOutcome::Dead);
        assert_eq!(
            count("cache-test", "mail", TaskOutcome::Done),
            0,
            "batched until the worker flushes"
        );
        cache.flush();
        assert_eq!(count("cache-test", "mail", TaskOutcome::Done), 2);
        assert_eq!(count("cache-test", "sms", TaskOutcome::Retried), 1);
        assert_eq!(count("cache-test", UNKNOWN_TYPE, TaskOutcome::Dead), 2);
        assert_eq!(
            count("cache-test", "random-junk", TaskOutcome::Dead),
            0,
            "no label per unknown type"
        );
        count_outcome("cache-test", Some("mail"), TaskOutcome::TimedOut);
        assert_eq!(count("cache-test", "mail", TaskOutcome::TimedOut), 1);
        count_outcome("cache-test", Some("never-ran"), TaskOutcome::HandedBack);
        assert_eq!(
            count("cache-test", UNKNOWN_TYPE, TaskOutcome::HandedBack),
            1
        );
    }

    #[test]
    fn a_busy_worker_s_batch_is_added_every_64_observations_or_after_a_second() {
        let mut cache = TypeCache::new("batch-test", Instant::now());
        let ms = |ms: u64| ms * 1_000_000;
        let t0 = ms(1);
        for i in 0..FLUSH_EVERY / 2 - 1 {
            cache.get(Some("mail"), |_| true);
            cache.ran(t0);
            cache.get(Some("mail"), |_| true).count(TaskOutcome::Done);
            cache.ended(t0 + ms(u64::from(i)));
        }
        assert_eq!(count("batch-test", "mail", TaskOutcome::Done), 0);
        cache.get(Some("mail"), |_| true);
        cache.ran(t0);
        cache.get(Some("mail"), |_| true).count(TaskOutcome::Done);
        cache.ended(t0 + ms(40));
        assert_eq!(
            count("batch-test", "mail", TaskOutcome::Done),
            u64::from(FLUSH_EVERY / 2),
            "64 observations: a run and an outcome per task"
        );
        cache.get(Some("mail"), |_| true);
        cache.ran(t0);
        cache.get(Some("mail"), |_| true).count(TaskOutcome::Done);
        cache.ended(t0 + ms(40) + FLUSH_AFTER.as_nanos() as u64);
        assert_eq!(
            count("batch-test", "mail", TaskOutcome::Done),
            u64::from(FLUSH_EVERY / 2) + 1,
            "a slow task's outcome is added within a second"
        );
    }

    #[test]
    fn a_run_is_observed_at_the_next_clock_read() {
        let mut cache = TypeCache::new("run-test", Instant::now());
        let histogram = |kind: &str| {
            observed()
                .durations
                .get(&TypeLabels {
                    queue: Arc::from("run-test"),
                    r#type: Arc::from(kind),
                })
                .map(|histogram| histogram.clone())
        };
        let t0 = 1_000_000;
        cache.get(Some("mail"), |_| true);
        cache.ran(t0);
        cache.get(Some("mail"), |_| true).count(TaskOutcome::Done);
        let mut page = String::new();
        let encode = |page: &mut String| {
            let mut registry = prometheus_client::registry::Registry::default();
            registry.register("d", "d", histogram("mail").unwrap());
            page.clear();
            prometheus_client::encoding::text::encode(page, &registry).unwrap();
        };
        encode(&mut page);
        assert!(
            page.contains("d_count 0"),
            "not before its end is read: {page}"
        );
        cache.ended(t0 + 3_000_000);
        cache.ended(t0 + 9_000_000_000);
        cache.flush();
        encode(&mut page);
        assert!(page.contains("d_count 1"), "once: {page}");
        assert!(page.contains("d_bucket{le=\"0.005\"} 1"), "3 ms: {page}");
        assert!(histogram(UNKNOWN_TYPE).is_none());
    }

    #[test]
    fn the_outcome_indexes_match_their_order() {
        for (index, outcome) in TaskOutcome::ALL.iter().enumerate() {
            assert_eq!(*outcome as usize, index);
        }
    }
}
