//! The fetcher: one thread per queue that takes tasks from Redis for the queue's workers.
//!
//! It claims only what the lane's [`Capacity`](super::capacity::Capacity) allows, so what the daemon holds stays
//! bounded; and it claims in batches: it waits until `batch` tasks (or half the bound) may be claimed, unless the
//! workers run out of work first. In safe mode it claims under this daemon's owner (registered on the first
//! claim, and again after a lost lease). When the queue is empty it blocks in Redis (safe mode: on the wake-up
//! list that every enqueue path touches; default mode: on the ready lists themselves) for at most `idle_poll`,
//! which also bounds how long shutdown waits for it.
//!
//! Once the daemon stops claiming, whatever a claim still in flight brings back is handed back at once, never
//! given to a worker; then the fetcher marks the lane so and drops the jobs channel, which is how the workers
//! learn that no more work comes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use super::Lane;
use super::resolve::{Job, JobState, Taken};
use crate::broker::{self, Batch, BrokerError, Session};
use crate::config::Mode;
use crate::retry::Backoff;
use crate::shutdown::Listener;

/// The smallest claim (tokens sent) after an empty or small one.
const MIN_CLAIM: usize = 16;

/// How long the fetcher waits for capacity before it looks at the shutdown flag again.
const CAPACITY_WAIT: Duration = Duration::from_millis(200);

pub struct Fetcher {
    pub lane: Arc<Lane>,
    pub connection: Session,
    /// Fires when the daemon stops claiming.
    pub claiming: Listener,
    /// To the queue's workers. Dropped when this thread ends, which is how workers learn no more work comes.
    pub jobs: Sender<Job>,
    /// How many tasks the next safe-mode claim asks for at most (see `fetch`).
    pub claim_size: usize,
}

impl Fetcher {
    pub fn new(
        lane: Arc<Lane>,
        connection: Session,
        claiming: Listener,
        jobs: Sender<Job>,
    ) -> Fetcher {
        let claim_size = lane.queue.config.batch;
        Fetcher {
            lane,
            connection,
            claiming,
            jobs,
            claim_size,
        }
    }

    pub fn run(mut self) {
        let mut backoff = Backoff::new();
        while !self.claiming.is_triggered() {
            let lane = Arc::clone(&self.lane);
            // Claim a batch's worth at once, or whatever is free when the workers run dry.
            let free = lane
                .capacity
                .acquire(lane.queue.config.batch, CAPACITY_WAIT, || {
                    self.jobs.is_empty()
                });
            if free == 0 {
                continue;
            }
            match self.fetch(free) {
                Ok(batch) => {
                    backoff.reset();
                    let taken = batch.tasks.len();
                    if taken > free {
                        // The scripts never return more than asked; if Redis did, run them all anyway (they are
                        // claimed) and let the count recover as they are settled.
                        tracing::error!(queue = %lane.name(), taken, free, "claim returned more tasks than asked");
                    }
                    lane.capacity.release(free.saturating_sub(taken));
                    self.dispatch(batch);
                }
                Err(error) => {
                    lane.capacity.release(free);
                    tracing::error!(queue = %lane.name(), %error, "cannot fetch tasks; retrying");
                    self.connection.reset();
                    backoff.wait(&self.claiming);
                }
            }
        }
        self.lane.fetcher_stopped();
        tracing::debug!(queue = %self.lane.name(), "fetcher stopped");
    }

    /// Takes up to `free` tasks; when none is ready, waits up to `idle_poll` for one.
    fn fetch(&mut self, free: usize) -> broker::Result<Batch> {
        let lane = &self.lane;
        let queue = &lane.queue;
        let connection = self.connection.get()?;
        match queue.config.mode {
            Mode::Safe => {
                let owner = match lane.ownership.current() {
                    Some(owner) => owner,
                    None => {
                        let owner =
                            broker::register(connection, &queue.keys, queue.config.lease_timeout)?;
                        tracing::info!(queue = %queue.config.name, %owner, "claiming as a new owner");
                        lane.ownership.set(Arc::clone(&owner));
                        owner
                    }
                };
                // Each claim carries a token per task it may take, which costs Redis a little per token: ask for
                // twice what the last claim got (at least MIN_CLAIM), so an idle queue's claims stay small and a
                // backlog's double up to the free capacity within a few round trips.
                let want = free.min(self.claim_size);
                let first_token = lane.ownership.tokens(want);
                let batch = match broker::claim(connection, &queue.keys, &owner, first_token, want)
                {
                    Err(BrokerError::LeaseLost { owner }) => {
                        // The tasks it held go back through the monitors; claim under a new owner from now on.
                        tracing::warn!(queue = %queue.config.name, %owner, "lease lost; registering a new owner");
                        if lane.ownership.lose(&owner) {
                            lane.forget_owner(&owner);
                        }
                        return Ok(Batch::default());
                    }
                    other => other?,
                };
                self.claim_size = (batch.tasks.len() * 2)
                    .max(MIN_CLAIM)
                    .min(queue.config.batch);
                if batch.tasks.is_empty() && !self.claiming.is_triggered() {
                    // A marker means "something was pushed": the next round claims it. No marker within
                    // idle_poll: the next round looks anyway, which picks up producers that push no marker.
                    broker::wait_wake(connection, &queue.keys, queue.config.idle_poll)?;
                }
                Ok(batch)
            }
            Mode::Default => {
                let batch = broker::pop(connection, &queue.keys, free, None)?;
                if batch.tasks.is_empty() && !self.claiming.is_triggered() {
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

    /// Records the tasks as held and gives them to the workers, or, once the daemon stops claiming, hands them
    /// back at once: no worker may start a task after that.
    fn dispatch(&self, batch: Batch) {
        let lane = &self.lane;
        let claimed_at = Instant::now();
        let states = batch
            .tasks
            .into_iter()
            .map(|taken| JobState::new(taken.token, taken.level, taken.payload, lane.epoch));
        let stopping = self.claiming.is_triggered();
        for (id, state) in lane.held.insert(states) {
            if stopping {
                if state.take() == Some(Taken::Waiting) {
                    lane.send(lane.hand_back(id, &state));
                }
                continue;
            }
            let job = Job {
                id,
                state,
                claimed_at_ms: batch.now_ms,
                claimed_at,
            };
            // The channel holds as many jobs as the lane may hold tasks, and a job exists only for a held task, so
            // this send never blocks. It fails only when every worker is gone, which happens after the fetcher.
            if let Err(error) = self.jobs.send(job) {
                let job = error.into_inner();
                if job.state.take() == Some(Taken::Waiting) {
                    lane.send(lane.hand_back(job.id, &job.state));
                }
            }
        }
    }
}
