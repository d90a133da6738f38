//! What this daemon saw itself, as opposed to the queue-wide numbers read from Redis: its handlers' durations and
//! its tasks' outcomes per queue and type, and the Redis calls that failed.
//!
//! One process-wide [`Observed`] ([`observed`]): the threads that see these things (workers, the timeouts
//! thread, every thread that calls Redis through `retry::Trouble` or the settler) reach it without plumbing,
//! and a scrape clones its families (`Arc`s) into the page's registry.
//!
//! The per-task path is a worker's: it keeps a [`TypeCache`] of the histogram and counters of each task type it
//! ran, so a task costs a string compare (the same type as the last task) or one FxHash lookup, the histogram's
//! uncontended lock and one atomic add; never the families' label hash and read lock. Only types a plugin
//! handles get their own label value: the type comes from the producer, and a label per unknown string would
//! let any producer grow the page without bound.

use std::fmt::Write as _;
use std::sync::{Arc, LazyLock};

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
    pub duration: Histogram,
    outcomes: [Counter; TaskOutcome::ALL.len()],
}

impl TypeHandles {
    fn resolve(queue: &Arc<str>, kind: &str) -> TypeHandles {
        let observed = observed();
        let kind: Arc<str> = Arc::from(kind);
        let duration = observed.durations.get_or_create_owned(&TypeLabels {
            queue: Arc::clone(queue),
            r#type: Arc::clone(&kind),
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

    pub fn count(&self, outcome: TaskOutcome) {
        self.outcomes[outcome as usize].inc();
    }
}

/// A worker's handles per task type of its queue (see the module doc).
#[derive(Debug)]
pub struct TypeCache {
    queue: Arc<str>,
    last: Option<(Box<str>, TypeHandles)>,
    handled: FxHashMap<Box<str>, TypeHandles>,
    unknown: Option<TypeHandles>,
}

impl TypeCache {
    pub fn new(queue: &str) -> TypeCache {
        TypeCache {
            queue: Arc::from(queue),
            last: None,
            handled: FxHashMap::default(),
            unknown: None,
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
        if self.last.as_ref().is_some_and(|(last, _)| **last == *kind) {
            return &self.last.as_ref().expect("checked").1;
        }
        let handles = match self.handled.get(kind) {
            Some(handles) => handles.clone(),
            None if is_handled(kind) => {
                let handles = TypeHandles::resolve(&self.queue, kind);
                self.handled.insert(Box::from(kind), handles.clone());
                handles
            }
            None => return self.unknown(),
        };
        &self.last.insert((Box::from(kind), handles)).1
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
    fn the_outcome_indexes_match_their_order() {
        for (index, outcome) in TaskOutcome::ALL.iter().enumerate() {
            assert_eq!(*outcome as usize, index);
        }
    }
}
