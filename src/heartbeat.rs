//! The heartbeat: one thread per daemon that renews the daemon's lease on each safe-mode queue (one lease covers
//! every task the daemon holds there) and enforces execution timeouts (both modes).
//!
//! It runs on its own thread and connection, so busy or stuck handlers can never starve lease renewal (the
//! cause of BullMQ's "could not renew lock"). Leases are renewed every third of `lease_timeout`, one script call
//! per queue whatever the number of tasks held.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::broker::{self, Session};
use crate::config::Mode;
use crate::daemon::QueueContext;
use crate::policy::Verdict;
use crate::settlement::{self, Origin, Outcome};
use crate::shutdown::Listener;

/// How often execution timeouts are checked; a run is cancelled at most this late.
const TICK: Duration = Duration::from_millis(100);

pub struct Heartbeat {
    /// The queues, each with the sender to its acker (for runs that overran their execution timeout).
    pub queues: Vec<(Arc<QueueContext>, Sender<Outcome>)>,
    pub connection: Session,
    pub daemon_id: Arc<str>,
    /// Fires when outcomes may no longer be sent (the ackers are draining): timeouts are no longer enforced.
    pub settling: Listener,
    /// Fires last: stop renewing.
    pub background: Listener,
}

impl Heartbeat {
    pub fn run(mut self) {
        let mut next_renewal: Vec<Instant> = vec![Instant::now(); self.queues.len()];
        loop {
            for (index, next) in next_renewal.iter_mut().enumerate() {
                if self.queues[index].0.config.mode == Mode::Safe && Instant::now() >= *next {
                    *next = Instant::now() + self.renew(index);
                }
                if !self.settling.is_triggered() {
                    self.reap_overdue(index);
                }
            }
            if self.background.wait(TICK) {
                break;
            }
        }
        tracing::debug!("heartbeat stopped");
    }

    /// Renews the lease of this daemon's owner on the queue; returns when to renew next.
    fn renew(&mut self, index: usize) -> Duration {
        let queue = Arc::clone(&self.queues[index].0);
        let Some(owner) = queue.ownership.current() else {
            return TICK;
        };
        let lease = queue.config.lease_timeout;
        let result = self
            .connection
            .get()
            .and_then(|connection| broker::renew(connection, &queue.keys, &owner, lease));
        match result {
            Ok(true) => lease / 3,
            Ok(false) => {
                if queue.ownership.lose(&owner) {
                    tracing::warn!(
                        queue = %queue.config.name,
                        %owner,
                        held = queue.inflight.len(),
                        "lease ran out before renewal (was this daemon paused?); the monitors return the tasks it \
                         held to the queue, and the fetcher claims under a new owner"
                    );
                }
                TICK
            }
            Err(error) => {
                tracing::error!(queue = %queue.config.name, %error, "cannot renew the lease; retrying");
                self.connection.reset();
                // Try again soon: the lease is running out.
                TICK * 5
            }
        }
    }

    /// Cancels and fails every run of the queue that is past its execution timeout.
    fn reap_overdue(&self, index: usize) {
        let (queue, outcomes) = &self.queues[index];
        let Some(timeout) = queue.config.execution_timeout else {
            return;
        };
        for overdue in queue.inflight.take_overdue(timeout) {
            let state = &overdue.state;
            let envelope = queue.decode(&state.payload).ok();
            let reason = format!(
                "execution timeout: still running after {}",
                humantime::format_duration(timeout)
            );
            let origin = Origin {
                queue: &queue.config.name,
                daemon: &self.daemon_id,
            };
            let verdict = Verdict::HandlerError {
                reason,
                after: None,
            };
            let (settlement, dead_hook) = settlement::decide(
                &queue.policy,
                &origin,
                verdict,
                state.token.clone(),
                state.level,
                &state.payload,
                envelope.as_ref(),
            );
            // The channel has room for one outcome per slot, so this waits only if the acker is stuck; the bound
            // keeps the heartbeat (and so the lease) alive even then. A dropped outcome leaves the task held until
            // the daemon stops, then to the monitors.
            let _ = outcomes.send_timeout(
                Outcome {
                    job: overdue.id,
                    settlement,
                    dead_hook,
                },
                Duration::from_secs(1),
            );
        }
    }
}
