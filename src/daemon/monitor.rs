//! The monitor: one thread per daemon that recovers the tasks of owners whose lease ran out, because the daemon
//! holding them died or hung. Each such task goes back to the front of its level with `attempt + 1`, or to the
//! dead-letter list when it is out of retries or older than `alive_timeout`. An owner with nothing left is
//! forgotten.
//!
//! Every daemon runs a monitor, over every queue it serves whatever the queue's mode here (another daemon may
//! serve it in safe mode), and no lock is taken: an owner whose lease ran out never renews it again, and the
//! settle script takes each task out of the owner's processing hash in the same step that queues it, so when two
//! monitors find the same task, exactly one moves it.

use std::sync::Arc;
use std::time::Duration;

use crate::broker::{self, Fence, Session, Settlement, Token, TokenId};
use crate::daemon::settler::Settler;
use crate::plugin::Registry;
use crate::policy::Verdict;
use crate::queue::QueueContext;
use crate::retry::Trouble;
use crate::settlement::{self, DeadHook};
use crate::shutdown::Listener;

/// The most tasks handled per round trip.
const BATCH: usize = 100;

/// One queue as the monitor watches it.
pub struct Watched {
    pub queue: Arc<QueueContext>,
    /// This monitor's settling identity on the queue (its calls are answered, not re-applied, after a lost reply).
    pub settler: Settler,
    trouble: Trouble,
}

impl Watched {
    pub fn new(queue: Arc<QueueContext>, settler: Settler) -> Watched {
        let trouble = Trouble::new("recovering expired leases", Some(&queue.config.name));
        Watched {
            queue,
            settler,
            trouble,
        }
    }
}

pub struct Monitor {
    pub queues: Vec<Watched>,
    pub connection: Session,
    pub registry: Arc<Registry>,
    pub background: Listener,
}

impl Monitor {
    /// How often to look: a quarter of the shortest lease, between 50 ms and 5 s.
    pub fn interval(queues: &[Watched]) -> Duration {
        let shortest = queues
            .iter()
            .map(|q| q.queue.config.lease_timeout)
            .min()
            .unwrap_or(Duration::from_secs(20));
        (shortest / 4).clamp(Duration::from_millis(50), Duration::from_secs(5))
    }

    pub fn run(mut self) {
        let interval = Monitor::interval(&self.queues);
        loop {
            self.recover_now();
            if self.background.wait(interval) {
                break;
            }
        }
        tracing::debug!("monitor stopped");
    }

    /// One pass over every queue; returns how many tasks this monitor recovered (moved back or dead-lettered).
    pub fn recover_now(&mut self) -> usize {
        let mut recovered = 0;
        for index in 0..self.queues.len() {
            match self.recover_queue(index) {
                Ok(count) => {
                    self.queues[index].trouble.recovered();
                    recovered += count;
                }
                Err(error) => {
                    self.queues[index].trouble.failed(&error);
                    self.connection.reset();
                }
            }
        }
        recovered
    }

    fn recover_queue(&mut self, index: usize) -> broker::Result<usize> {
        let queue = Arc::clone(&self.queues[index].queue);
        let (now_ms, owners) = broker::owners(self.connection.get()?, &queue.keys)?;
        let mut recovered = 0;
        for (owner, deadline) in owners {
            if deadline > now_ms {
                continue;
            }
            let owner: Arc<str> = Arc::from(owner);
            for level in 0..queue.keys.levels() {
                loop {
                    let Some((found, applied)) =
                        self.recover_batch(index, &queue, &owner, level, now_ms)?
                    else {
                        return Ok(recovered);
                    };
                    recovered += applied;
                    // Nothing left, or another monitor is moving the same tasks: leave them to it.
                    if found == 0 || applied == 0 {
                        break;
                    }
                }
            }
            if broker::release(self.connection.get()?, &queue.keys, &owner, true)? {
                tracing::info!(queue = %queue.config.name, %owner, "forgot an owner whose lease ran out");
            }
        }
        if recovered > 0 {
            tracing::warn!(queue = %queue.config.name, recovered, "recovered tasks whose lease ran out");
        }
        Ok(recovered)
    }

    /// Handles up to BATCH tasks of an expired owner at one level; returns how many it found and how many it
    /// recovered, or `None` when the daemon stopped while Redis was failing.
    fn recover_batch(
        &mut self,
        index: usize,
        queue: &QueueContext,
        owner: &Arc<str>,
        level: usize,
        now_ms: i64,
    ) -> broker::Result<Option<(usize, usize)>> {
        let connection = self.connection.get()?;
        let (_, held) = broker::scan_processing(connection, &queue.keys, owner, level, 0, BATCH)?;
        if held.is_empty() {
            return Ok(Some((0, 0)));
        }
        let mut settlements: Vec<Settlement> = Vec::with_capacity(held.len());
        let mut hooks: Vec<Option<Box<DeadHook>>> = Vec::with_capacity(held.len());
        for (token, payload) in &held {
            let (verdict, envelope) = queue.judge(payload, |envelope| {
                match queue.policy.too_old(envelope.created_at, now_ms) {
                    Some(reason) => Verdict::Unrunnable { reason },
                    None => Verdict::LeaseExpired,
                }
            });
            let token = Token {
                owner: Arc::clone(owner),
                id: TokenId::Text(token.clone()),
            };
            let (settlement, hook) =
                queue.settle_verdict(verdict, Some(token), level, payload, envelope.as_ref());
            settlements.push(settlement);
            hooks.push(hook);
        }
        let watched = &mut self.queues[index];
        let Some(settled) = watched.settler.settle(
            &mut self.connection,
            &queue.keys,
            Fence::Expired,
            queue.config.dead_max,
            Some(owner),
            &settlements.iter().collect::<Vec<_>>(),
            &self.background,
        ) else {
            return Ok(None);
        };
        let recovered = settled
            .applied
            .iter()
            .filter(|ok| **ok == Some(true))
            .count();
        for (hook, applied) in hooks.iter().zip(settled.applied) {
            if let (Some(hook), Some(true)) = (hook, applied) {
                settlement::run_dead_hook(&self.registry, &queue.config.name, hook);
            }
        }
        Ok(Some((held.len(), recovered)))
    }
}
