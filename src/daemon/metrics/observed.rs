//! What this daemon saw itself, as opposed to the queue-wide numbers read from Redis: its handlers' durations and
//! its tasks' outcomes per queue and type, and the Redis calls that failed.
//!
//! One process-wide [`Observed`] ([`observed`]): the threads that see these things (workers, the timeouts
//! thread, every thread that calls Redis through `retry::Trouble` or the settler) reach it without plumbing,
//! and a scrape clones its families (`Arc`s) into the page's registry.
//!
//! The per-task path is a worker's: it keeps a [`TypeCache`] of the histogram and counters of each task type it
//! ran, so a task costs no clock read of its own (the run's start and end are the reads the worker makes anyway
//! for this task and the next, see [`TypeCache::ran`]), a string compare (the same type as the last task) or one FxHash lookup, the histogram's lock (shared by the queue's
//! workers: held for a bucket search of 17) and one atomic add; never the families' label hash and read lock.
//! docs/PERFORMANCE.md, "What the metrics cost", has the measured figure. Only types a plugin
//! handles get their own label value: the type comes from the producer, and a label per unknown string would
//! let any producer grow the page without bound.

use std::fmt::Write as _;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
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
    /// Forgotten: its lease was lost (the monitors give it to another daemon), or, in default mode, still running
    /// after `shutdown_grace`.
    Lost,
}

impl TaskOutcome {
    const ALL: [TaskOutcome; 7] = [
        TaskOutcome::Done,
        TaskOutcome::Failed,
        TaskOutcome::Retried,
        TaskOutcome::Dead,
        TaskOutcome::TimedOut,
        TaskOutcome::HandedBack,
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
            SettleOp::Back | SettleOp::Recover { .. } => TaskOutcome::HandedBack,
        }
    }
}

impl EncodeLabelValue for TaskOutcome {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
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
pub struct ErrorLabels {
    /// What failed, as the log line says it: "fetching tasks", "renewing the lease", "settling outcomes"...
    pub operation: &'static str,
}

type Constructor = fn() -> Histogram;

/// The families of what this daemon saw.
#[derive(Debug)]
pub struct Observed {
    pub durations: Family<TypeLabels, Histogram, Constructor>,
    pub outcomes: Family<OutcomeLabels, Counter>,
    pub redis_errors: Family<ErrorLabels, Counter>,
}

static OBSERVED: LazyLock<Observed> = LazyLock::new(|| Observed {
    durations: Family::new_with_constructor(|| Histogram::new(DURATION_BUCKETS)),
    outcomes: Family::default(),
    redis_errors: Family::default(),
});

/// This process's observations.
pub fn observed() -> &'static Observed {
    &OBSERVED
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

/// The metric handles of one (queue, type): resolved once, then used without a lookup.
#[derive(Clone, Debug)]
pub struct TypeHandles {
    /// `None` for [`UNKNOWN_TYPE`], which never reaches a handler (no empty histogram on the page).
    duration: Option<Histogram>,
    outcomes: [Counter; TaskOutcome::ALL.len()],
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
        TypeHandles { duration, outcomes }
    }

    /// Records a handler's run time.
    fn observe(&self, seconds: f64) {
        if let Some(duration) = &self.duration {
            duration.observe(seconds);
        }
    }

    pub fn count(&self, outcome: TaskOutcome) {
        self.outcomes[outcome as usize].inc();
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
    running: Option<(usize, Instant)>,
}

impl TypeCache {
    pub fn new(queue: &str) -> TypeCache {
        TypeCache {
            queue: Arc::from(queue),
            types: Vec::new(),
            index: FxHashMap::default(),
            last: 0,
            unknown: None,
            running: None,
        }
    }

    /// The handler of the type of the last [`TypeCache::get`] (a handled one), started at `started`, returned:
    /// its duration is recorded at the worker's next clock read ([`TypeCache::ended`]), which the worker makes
    /// anyway for its next task, so the histogram costs no clock read of its own.
    pub fn ran(&mut self, started: Instant) {
        self.running = Some((self.last, started));
    }

    /// The clock read after the last run: records its duration, if one is waiting.
    pub fn ended(&mut self, now: Instant) {
        if let Some((at, started)) = self.running.take() {
            self.types[at]
                .1
                .observe(now.saturating_duration_since(started).as_secs_f64());
        }
    }

    /// The handles of task type `kind`; `is_handled` (asked only the first time a type is seen) says whether a
    /// plugin handles it. `None`: the envelope could not be read.
    pub fn get(
        &mut self,
        kind: Option<&str>,
        is_handled: impl FnOnce(&str) -> bool,
    ) -> &TypeHandles {
        let Some(kind) = kind else {
            return self.unknown();
        };
        if self
            .types
            .get(self.last)
            .is_some_and(|(last, _)| **last == *kind)
        {
            return &self.types[self.last].1;
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
        &self.types[self.last].1
    }

    fn unknown(&mut self) -> &TypeHandles {
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
        let mut cache = TypeCache::new("cache-test");
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
    fn a_run_is_observed_at_the_next_clock_read() {
        let mut cache = TypeCache::new("run-test");
        let histogram = |kind: &str| {
            observed()
                .durations
                .get(&TypeLabels {
                    queue: Arc::from("run-test"),
                    r#type: Arc::from(kind),
                })
                .map(|histogram| histogram.clone())
        };
        let t0 = Instant::now();
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
        cache.ended(t0 + std::time::Duration::from_millis(3));
        cache.ended(t0 + std::time::Duration::from_secs(9));
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
