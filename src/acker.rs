//! The acker: one thread per queue that applies outcomes to Redis in batches (one settle script call for up to
//! [`MAX_BATCH`] outcomes), then forgets the tasks and runs the final-failure hooks of what was dead-lettered.
//!
//! An outcome is kept until Redis has accepted it: on a Redis error the same batch is retried with backoff. In
//! the meantime the tasks stay in the in-flight table and hold their slots (so the fetcher claims no more), and
//! the heartbeat keeps the owner's lease alive. Only once settled are their slots freed.

use std::sync::Arc;

use crossbeam_channel::{Receiver, select};

use crate::broker::{self, Fence, Session};
use crate::daemon::QueueContext;
use crate::plugin::Registry;
use crate::settlement::{self, Outcome};
use crate::shutdown::{Backoff, Listener};

/// The most outcomes settled in one script call.
pub const MAX_BATCH: usize = 1000;

pub struct Acker {
    pub queue: Arc<QueueContext>,
    pub registry: Arc<Registry>,
    pub connection: Session,
    pub outcomes: Receiver<Outcome>,
    /// Fires when every outcome that will come has been sent: the acker settles what is queued and stops.
    pub settling: Listener,
    /// Fires when the daemon gives up waiting: the acker stops even if Redis keeps failing.
    pub background: Listener,
}

impl Acker {
    pub fn run(mut self) {
        loop {
            let first = select! {
                recv(self.outcomes) -> outcome => match outcome {
                    Ok(outcome) => outcome,
                    Err(_) => break,
                },
                recv(self.settling.receiver()) -> _ => {
                    let rest: Vec<Outcome> = self.outcomes.try_iter().collect();
                    for chunk in rest.chunks(MAX_BATCH) {
                        self.settle(chunk);
                    }
                    break;
                }
            };
            let mut batch = Vec::with_capacity(64);
            batch.push(first);
            batch.extend(self.outcomes.try_iter().take(MAX_BATCH - 1));
            self.settle(&batch);
        }
        tracing::debug!(queue = %self.queue.config.name, "acker stopped");
    }

    /// Settles a batch, one script call per owner (nearly always one: a daemon claims under a new owner only
    /// after losing its lease).
    fn settle(&mut self, batch: &[Outcome]) {
        fn owner_of(outcome: &Outcome) -> Option<&str> {
            outcome.settlement.token.as_ref().map(|token| &*token.owner)
        }
        let mut owners: Vec<Option<&str>> = Vec::with_capacity(1);
        for outcome in batch {
            if !owners.contains(&owner_of(outcome)) {
                owners.push(owner_of(outcome));
            }
        }
        if owners.len() == 1 {
            self.settle_owned(owners[0], &batch.iter().collect::<Vec<_>>());
            return;
        }
        for owner in owners {
            let group: Vec<&Outcome> = batch
                .iter()
                .filter(|outcome| owner_of(outcome) == owner)
                .collect();
            self.settle_owned(owner, &group);
        }
    }

    fn settle_owned(&mut self, owner: Option<&str>, batch: &[&Outcome]) {
        let queue = &self.queue;
        let mut backoff = Backoff::new();
        let settled = loop {
            let result = self.connection.get().and_then(|connection| {
                broker::settle(
                    connection,
                    &queue.keys,
                    Fence::Owner,
                    queue.config.dead_max,
                    owner,
                    batch.iter().map(|o| &o.settlement),
                )
            });
            match result {
                Ok(settled) => break settled,
                Err(error) => {
                    tracing::error!(queue = %queue.config.name, %error, outcomes = batch.len(), "cannot settle outcomes; retrying");
                    self.connection.reset();
                    if backoff.wait(&self.background) {
                        tracing::error!(
                            queue = %queue.config.name,
                            outcomes = batch.len(),
                            "shutting down with unsettled outcomes: safe-mode tasks run again once their leases expire"
                        );
                        return;
                    }
                }
            }
        };
        queue
            .inflight
            .remove(batch.iter().map(|outcome| outcome.job));
        // The tasks are settled: their slots may be claimed again. Releasing only now bounds what the daemon
        // holds, outcomes waiting for Redis included, by `workers + prefetch`.
        queue.slots.release(batch.len());
        let stale = settled.stale_acks
            + settled
                .applied
                .iter()
                .filter(|ok| **ok == Some(false))
                .count();
        if stale > 0 {
            tracing::warn!(
                queue = %queue.config.name,
                stale,
                "outcomes arrived after their leases expired; a monitor had already queued those tasks again"
            );
        }
        for (outcome, applied) in batch.iter().zip(settled.applied) {
            if let (Some(hook), Some(true)) = (&outcome.dead_hook, applied) {
                settlement::run_dead_hook(&self.registry, &queue.config.name, hook);
            }
        }
    }
}
