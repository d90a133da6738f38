//! The timeouts thread: one per daemon, with no Redis connection (so a slow Redis never delays it), that every
//! [`TICK`] enforces each lane's execution timeout and watches for stuck workers.
//!
//! - A run past `execution_timeout` is taken from its worker (cancel flag raised) and counted as a failed attempt.
//! - A handler still running [`STUCK_AFTER`] after its task was taken (it ignores its cancel flag) makes its
//!   worker *stuck*: logged once, counted in the `kmqd_daemon_stuck_workers` gauge, and left out of the lane's capacity
//!   until it returns, so the fetcher claims nothing for a worker that cannot start it.
//! - When every worker of a lane is stuck, the tasks waiting for one are handed back at once (front of their
//!   level), so another daemon runs them instead of leaving them behind handlers that may never return.

use std::sync::Arc;
use std::time::Duration;

use super::lane::{Lane, LaneSet};
use crate::shutdown::Listener;

/// How often timeouts are checked; a run is cancelled at most this late.
const TICK: Duration = Duration::from_millis(100);

/// How long a handler may keep running after its task was taken before its worker counts as stuck: long enough
/// for a handler that polls its cancel flag now and then to notice it.
pub const STUCK_AFTER: Duration = Duration::from_secs(1);

pub struct Timeouts {
    pub lanes: Arc<LaneSet>,
    /// Fires when the ackers stop taking outcomes: timeouts are no longer enforced after that.
    pub stop: Listener,
}

impl Timeouts {
    pub fn run(self) {
        loop {
            for lane in self.lanes.snapshot().iter() {
                check(lane);
            }
            if self.stop.wait(TICK) {
                break;
            }
        }
        tracing::debug!("timeouts stopped");
    }
}

/// One look at a lane.
pub fn check(lane: &Lane) {
    if let Some(timeout) = lane.queue.config.execution_timeout {
        lane.time_out_overdue(timeout);
    }
    for (state, since) in lane.orphans() {
        if since.elapsed() >= STUCK_AFTER && state.mark_stuck() {
            lane.capacity.stuck();
            tracing::warn!(
                queue = %lane.name(),
                payload = %super::lane::resolve::capped_payload(state.payload()),
                stuck = lane.capacity.stuck_workers(),
                workers = lane.queue.config.workers,
                "a handler ignores its cancel flag: its worker is stuck until it returns, and claims nothing"
            );
        }
    }
    if lane.capacity.live_workers() == 0 {
        let handed_back = lane.hand_back_waiting();
        if handed_back > 0 {
            tracing::warn!(
                queue = %lane.name(),
                handed_back,
                "every worker is stuck in a handler: tasks waiting for one were handed back for other daemons"
            );
        }
    }
}
