//! The monitor: one thread per daemon that recovers safe-mode tasks whose lease expired, because the daemon
//! holding them died or hung. Each such task goes back to the front of its level with `attempt + 1`, or to the
//! dead-letter list when it is out of retries or older than `alive_timeout`.
//!
//! Every daemon runs a monitor and no lock is taken: the settle script re-checks each lease inside Redis
//! (fence "expired"), so when two monitors find the same task, exactly one moves it.

use std::sync::Arc;
use std::time::Duration;

use crate::broker::{self, Fence, Session, Settlement, Token};
use crate::daemon::QueueContext;
use crate::plugin::Registry;
use crate::policy::Verdict;
use crate::settlement::{self, DeadHook, Origin};
use crate::shutdown::Listener;

/// The most expired leases handled per script call.
const BATCH: usize = 100;

pub struct Monitor {
    /// The safe-mode queues.
    pub queues: Vec<Arc<QueueContext>>,
    pub connection: Session,
    pub registry: Arc<Registry>,
    pub daemon_id: Arc<str>,
    pub background: Listener,
}

impl Monitor {
    /// How often to look: a quarter of the shortest lease, between 50 ms and 5 s.
    pub fn interval(queues: &[Arc<QueueContext>]) -> Duration {
        let shortest = queues
            .iter()
            .map(|q| q.config.lease_timeout)
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
            let queue = Arc::clone(&self.queues[index]);
            loop {
                match self.recover(&queue) {
                    Ok((found, applied)) => {
                        recovered += applied;
                        if found < BATCH {
                            break;
                        }
                    }
                    Err(error) => {
                        tracing::error!(queue = %queue.config.name, %error, "cannot recover expired leases; retrying");
                        self.connection.reset();
                        break;
                    }
                }
            }
        }
        recovered
    }

    /// Handles up to BATCH expired leases of `queue`; returns how many it found and how many it recovered (the
    /// rest were recovered by another monitor, or renewed, in between).
    fn recover(&mut self, queue: &QueueContext) -> broker::Result<(usize, usize)> {
        let connection = self.connection.get()?;
        let (now_ms, expired) = broker::expired(connection, &queue.keys, BATCH)?;
        let origin = Origin {
            queue: &queue.config.name,
            daemon: &self.daemon_id,
        };
        let mut settlements: Vec<Settlement> = Vec::with_capacity(expired.len());
        let mut hooks: Vec<Option<DeadHook>> = Vec::with_capacity(expired.len());
        for (token, payload) in &expired {
            if payload.is_empty() {
                // A lease without a task cannot come from kmqd's scripts (they write both at once); drop it so
                // it is not found again.
                redis::cmd("ZREM")
                    .arg(&queue.keys.leases)
                    .arg(token)
                    .exec(connection)?;
                continue;
            }
            let level =
                level_of(token, &queue.config.priorities).unwrap_or(queue.config.default_priority);
            let (verdict, envelope) = match queue.decode(payload) {
                Err(error) => (
                    Verdict::Unrunnable {
                        reason: error.to_string(),
                    },
                    None,
                ),
                Ok(envelope) => {
                    let verdict = match queue.policy.too_old(envelope.created_at, now_ms) {
                        Some(reason) => Verdict::Unrunnable { reason },
                        None => Verdict::LeaseExpired,
                    };
                    (verdict, Some(envelope))
                }
            };
            let (settlement, hook) = settlement::decide(
                &queue.policy,
                &origin,
                verdict,
                Some(Token::Text(token.clone())),
                level,
                payload,
                envelope.as_ref(),
            );
            settlements.push(settlement);
            hooks.push(hook);
        }
        if settlements.is_empty() {
            return Ok((expired.len(), 0));
        }
        let settled = broker::settle(
            connection,
            &queue.keys,
            Fence::Expired,
            queue.config.dead_max,
            &settlements,
        )?;
        let recovered = settled
            .applied
            .iter()
            .filter(|ok| **ok == Some(true))
            .count();
        if recovered > 0 {
            tracing::warn!(queue = %queue.config.name, recovered, "recovered tasks whose lease expired");
        }
        for (hook, applied) in hooks.iter().zip(settled.applied) {
            if let (Some(hook), Some(true)) = (hook, applied) {
                settlement::run_dead_hook(&self.registry, &queue.config.name, hook);
            }
        }
        Ok((expired.len(), recovered))
    }
}

/// The level a claim token names (`SEQ:LEVEL`), as an index into `levels`.
pub fn level_of(token: &str, levels: &[String]) -> Option<usize> {
    let (_, level) = token.split_once(':')?;
    levels.iter().position(|l| l == level)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_names_its_level() {
        let levels = ["high".to_string(), "low".to_string()];
        assert_eq!(level_of("17:low", &levels), Some(1));
        assert_eq!(level_of("17:gone", &levels), None);
        assert_eq!(level_of("17", &levels), None);
    }
}
