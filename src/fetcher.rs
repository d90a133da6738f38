//! The fetcher: one thread per queue that takes tasks from Redis for the queue's workers.
//!
//! It claims only as many tasks as there are free slots (`workers + prefetch`, each held from claim to
//! settlement), so what the daemon holds stays bounded; and it claims in batches: it waits until `batch` slots (or
//! half of them all) are free, unless the workers run out of work first. In safe mode it claims under this
//! daemon's owner (registered on the first claim, and again after a lost lease). When the queue is empty it blocks
//! in Redis (safe mode: on the wake-up list that every enqueue path touches; default mode: on the ready lists
//! themselves) for at most `idle_poll`, which also bounds how long shutdown waits for it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::broker::{self, Batch, BrokerError, Session};
use crate::config::Mode;
use crate::daemon::{Job, QueueContext};
use crate::inflight::JobState;
use crate::shutdown::{Backoff, Listener};

/// The smallest claim (tokens sent) after an empty or small one.
const MIN_CLAIM: usize = 16;

/// How long the fetcher waits for a free slot before it looks at the shutdown flag again.
const SLOT_WAIT: Duration = Duration::from_millis(200);

pub struct Fetcher {
    pub queue: Arc<QueueContext>,
    pub connection: Session,
    /// Fires when the daemon stops claiming.
    pub claiming: Listener,
    /// To the queue's workers. Dropped when this thread ends, which is how workers learn no more work comes.
    pub jobs: Sender<Job>,
    /// How many tasks the next safe-mode claim asks for at most (see `fetch`).
    pub claim_size: usize,
}

impl Fetcher {
    pub fn run(mut self) {
        let mut backoff = Backoff::new();
        while !self.claiming.is_triggered() {
            // Claim a batch's worth of slots at once, or whatever is free when the workers run dry.
            let free = self
                .queue
                .slots
                .acquire(self.queue.config.batch, SLOT_WAIT, || self.jobs.is_empty());
            if free == 0 {
                continue;
            }
            match self.fetch(free) {
                Ok(batch) => {
                    backoff.reset();
                    let taken = batch.tasks.len();
                    if taken > free {
                        // The scripts never return more than asked; if Redis did, run them all anyway (they are
                        // claimed) and let the slot count recover as they finish.
                        tracing::error!(queue = %self.queue.config.name, taken, free, "claim returned more tasks than asked");
                    }
                    self.queue.slots.release(free.saturating_sub(taken));
                    self.dispatch(batch);
                }
                Err(error) => {
                    self.queue.slots.release(free);
                    tracing::error!(queue = %self.queue.config.name, %error, "cannot fetch tasks; retrying");
                    self.connection.reset();
                    backoff.wait(&self.claiming);
                }
            }
        }
        tracing::debug!(queue = %self.queue.config.name, "fetcher stopped");
    }

    /// Takes up to `free` tasks; when none is ready, waits up to `idle_poll` for one.
    fn fetch(&mut self, free: usize) -> broker::Result<Batch> {
        let queue = &self.queue;
        let connection = self.connection.get()?;
        match queue.config.mode {
            Mode::Safe => {
                let owner = match queue.ownership.current() {
                    Some(owner) => owner,
                    None => {
                        let owner =
                            broker::register(connection, &queue.keys, queue.config.lease_timeout)?;
                        tracing::info!(queue = %queue.config.name, %owner, "claiming as a new owner");
                        queue.ownership.set(Arc::clone(&owner));
                        owner
                    }
                };
                // Each claim carries a token per task it may take, which costs Redis a little per token: ask for
                // twice what the last claim got (at least MIN_CLAIM), so an idle queue's claims stay small and a
                // backlog's double up to the free slots within a few round trips.
                let want = free.min(self.claim_size);
                let first_token = queue.ownership.tokens(want);
                let batch = match broker::claim(connection, &queue.keys, &owner, first_token, want)
                {
                    Err(BrokerError::LeaseLost { owner }) => {
                        // The tasks it held go back through the monitors; claim under a new owner from now on.
                        tracing::warn!(queue = %queue.config.name, %owner, "lease lost; registering a new owner");
                        queue.ownership.lose(&owner);
                        return Ok(Batch::default());
                    }
                    other => other?,
                };
                self.claim_size = (batch.tasks.len() * 2)
                    .max(MIN_CLAIM)
                    .min(queue.config.batch);
                if batch.tasks.is_empty() {
                    // A marker means "something was pushed": the next round claims it. No marker within
                    // idle_poll: the next round looks anyway, which picks up producers that push no marker.
                    broker::wait_wake(connection, &queue.keys, queue.config.idle_poll)?;
                }
                Ok(batch)
            }
            Mode::Default => {
                let batch = broker::pop(connection, &queue.keys, free, None)?;
                if batch.tasks.is_empty() {
                    return broker::pop(
                        connection,
                        &queue.keys,
                        free,
                        Some(queue.config.idle_poll),
                    );
                }
                Ok(batch)
            }
        }
    }

    fn dispatch(&self, batch: Batch) {
        let claimed_at = Instant::now();
        let states = batch
            .tasks
            .into_iter()
            .map(|taken| JobState::new(taken.token, taken.level, taken.payload));
        for (id, state) in self.queue.inflight.insert(states) {
            let job = Job {
                id,
                state,
                claimed_at_ms: batch.now_ms,
                claimed_at,
            };
            // The channel holds as many jobs as there are slots, and a job exists only for a taken slot, so this
            // send never blocks. It fails only when every worker is gone, which happens after the fetcher stops.
            if self.jobs.send(job).is_err() {
                tracing::error!(queue = %self.queue.config.name, "workers are gone; the task stays held until its lease expires");
            }
        }
    }
}
