//! The progress a lane's running tasks report (docs/PROTOCOL.md, "Progress"), coalesced: a handler may report
//! at any rate, and the lane keeps only the latest report of each task, which the acker writes to Redis in one
//! fenced call (progress.lua) at most every [`FLUSH_EVERY`].
//!
//! The acker, not a thread of its own: it already wakes at least every `acker::IDLE_CHECK` (50 ms), holds the
//! lane's connection to the queue's slot, and is the one that settles the tasks. A report flushed after its task
//! was settled is dropped by progress.lua (the task's bit is set, or its claim is gone); one whose task left the
//! lane's table first is dropped here. A lane whose handlers never report costs one relaxed load per acker turn.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kmq_plugin::host::ProgressSink;
use rustc_hash::FxHashMap;

use super::resolve::JobId;
use crate::broker::progress::{fraction, message};
use crate::poison::lock;

/// How often at most the acker writes the lane's reports: a quarter of a second, so that a human watching a task
/// sees it move, and a handler reporting 10,000 times a second costs Redis four calls a second.
pub const FLUSH_EVERY: Duration = Duration::from_millis(250);

/// The latest report of each task of the lane that reported since the last flush, by the held task's id.
#[derive(Debug, Default)]
pub struct Reports {
    /// Whether a report waits for the acker: its one check per turn.
    waiting: AtomicBool,
    latest: Mutex<FxHashMap<JobId, (f32, String)>>,
}

impl Reports {
    /// Whether a report waits to be written.
    pub fn waiting(&self) -> bool {
        self.waiting.load(Ordering::Relaxed)
    }

    /// The reports since the last take, emptied.
    pub fn take(&self) -> FxHashMap<JobId, (f32, String)> {
        self.waiting.store(false, Ordering::Relaxed);
        std::mem::take(&mut *lock(&self.latest))
    }
}

impl ProgressSink for Reports {
    /// Keeps the report as its task's latest: a NaN fraction is dropped, others clamped to 0..=1; the message is
    /// cut to its first KiB. Its string's allocation is reused while a task reports between two flushes.
    fn progress(&self, run: u64, given: f32, text: &str) {
        let Some(fraction) = fraction(given) else {
            return;
        };
        let text = message(text);
        let mut latest = lock(&self.latest);
        let report = latest.entry(run).or_default();
        report.0 = fraction;
        report.1.clear();
        report.1.push_str(text);
        drop(latest);
        self.waiting.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_latest_report_of_each_task_is_kept() {
        let reports = Reports::default();
        assert!(!reports.waiting());
        for n in 0..10_000 {
            reports.progress(7, n as f32 / 10_000.0, &format!("item {n}"));
        }
        reports.progress(8, f32::NAN, "nothing");
        reports.progress(9, 2.0, "past the end");
        assert!(reports.waiting());
        let taken = reports.take();
        assert_eq!(taken.len(), 2);
        assert_eq!(taken[&7], (0.9999, "item 9999".to_string()));
        assert_eq!(taken[&9], (1.0, "past the end".to_string()));
        assert!(!reports.waiting() && reports.take().is_empty());
    }
}
