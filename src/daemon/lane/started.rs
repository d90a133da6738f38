//! Tasks a plugin took in `start` (kmq_plugin.h): the worker goes on at once, and the plugin completes each
//! later on a thread of its own, where [`Started::complete`] resolves it as the worker would have.
//!
//! Why: a plugin that runs its tasks elsewhere (the exec plugin's persistent children) made a worker thread sleep
//! per task in flight and another thread wake it with the answer; half the daemon's CPU per task went to those
//! switches (docs/PERFORMANCE.md, "Handlers in other languages").
//!
//! Two things differ from a worker's resolution: the metrics of started tasks go through one cache per lane
//! behind a lock (a completion has no worker's cache), and a completion never drops the last reference to its
//! plugin: that would run the plugin's `shutdown` on the plugin's own thread (one it may be about to join), so
//! the lane keeps one reference per plugin, dropped by a worker thread once it is idle.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::Lane;
use super::resolve::{HeldTask, JobId, verdict_of};
use crate::observed::{TaskOutcome, TypeCache};
use crate::otel::RunTrace;
use crate::plugin::{LoadedPlugin, Status};
use crate::poison::lock;
use crate::task::Envelope;

/// What a lane keeps for its started tasks.
pub struct StartedTasks {
    /// The metric handles of the types its started tasks had.
    types: Mutex<TypeCache>,
    /// One reference to each plugin a completion used, so that a completion never drops the last one.
    plugins: Mutex<Vec<Arc<LoadedPlugin>>>,
}

impl std::fmt::Debug for StartedTasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StartedTasks")
            .field("plugins_kept", &lock(&self.plugins).len())
            .finish_non_exhaustive()
    }
}

impl StartedTasks {
    pub fn new(queue: &str, epoch: Instant) -> StartedTasks {
        StartedTasks {
            types: Mutex::new(TypeCache::new(queue, epoch)),
            plugins: Mutex::new(Vec::new()),
        }
    }

    /// Keeps a reference to `plugin`, unless the lane has one already (then `plugin` is not the last one either).
    fn keep(&self, plugin: Arc<LoadedPlugin>) {
        let mut plugins = lock(&self.plugins);
        if !plugins.iter().any(|kept| Arc::ptr_eq(kept, &plugin)) {
            plugins.push(plugin);
        }
    }

    /// Drops the references kept: called by a worker thread (a host thread), when idle or ending. A plugin a
    /// reload replaced is then shut down here, once its last task is over.
    pub fn release_plugins(&self) {
        let kept = std::mem::take(&mut *lock(&self.plugins));
        drop(kept);
    }
}

/// One task a plugin took: what its completion needs.
pub struct Started {
    pub lane: Arc<Lane>,
    pub job: JobId,
    pub state: HeldTask,
    /// When the worker started it (the run's duration is counted from here).
    pub at: Instant,
    pub plugin: Arc<LoadedPlugin>,
    /// The task's envelope, owned: an envelope borrows the payload it came from, and decoding it again costs
    /// more than the copy (and would give a task that came without an id another one).
    pub envelope: Envelope<'static>,
    /// The run's place in its trace, when its queue is traced: its span is made at the settle.
    pub trace: Option<Box<RunTrace>>,
}

impl Started {
    /// The plugin completed the task: resolves it (unless someone took it meanwhile), hands its outcome to the
    /// acker, and gives its slot back. Runs on the plugin's thread; never waits for Redis.
    pub fn complete(self, status: Status) {
        let Started {
            lane,
            job,
            state,
            at,
            plugin,
            envelope,
            trace,
        } = self;
        let (verdict, ran) = verdict_of(status, &plugin.name, at, trace);
        {
            let mut types = lock(&lane.started.types);
            types.get(Some(&envelope.kind), |_| true);
            types.ran(lane.since_epoch(at));
            types.ended(lane.since_epoch(Instant::now()));
            let token = state.token.clone();
            let outcome = lane.finish(job, &state, token, Some(&envelope), verdict, ran);
            if let Some(outcome) = outcome {
                if let Some(settlement) = outcome.settlement() {
                    types
                        .get(Some(&envelope.kind), |_| true)
                        .count(TaskOutcome::of(settlement));
                }
                lane.outcomes.push(outcome);
            }
            // No worker flushes this cache when it goes idle: each completion adds its counts at once.
            types.flush();
        }
        lane.started.keep(plugin);
        lane.slots.completed();
    }
}
