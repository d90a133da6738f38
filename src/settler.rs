//! Settling a batch until Redis has answered for it: the acker's and the monitor's shared way to apply outcomes.
//!
//! A settle call whose reply is lost (a reset, a stall past the read timeout) is ambiguous: Redis may have applied
//! it. The call is then sent again as the same call, and Redis answers with what the first one did instead of
//! applying it twice (see `broker::settle`): so a dead letter is recorded once, its hook runs once, and a
//! default-mode retry is queued once.

use crate::broker::{self, Fence, Holder, QueueKeys, Session, Settled, Settlement};
use crate::pulse::Pulse;
use crate::retry::Backoff;
use crate::shutdown::Listener;

/// One settling party (a lane's acker, or a monitor on one queue), and the calls it made.
#[derive(Debug)]
pub struct Settler {
    /// Identifies this party's calls in Redis: unique to this daemon's run and role.
    identity: String,
    calls: u64,
    /// Beaten every attempt (the acker's), so that the watchdog sees an acker retrying through a Redis outage
    /// as alive: retrying is bounded, each attempt by the `[redis]` timeouts.
    pulse: Option<Pulse>,
}

impl Settler {
    pub fn new(identity: String) -> Settler {
        Settler {
            identity,
            calls: 0,
            pulse: None,
        }
    }

    /// Beats `pulse` at every attempt.
    pub fn with_pulse(mut self, pulse: Pulse) -> Settler {
        self.pulse = Some(pulse);
        self
    }

    /// Applies `settlements` (all of `holder`'s tasks), sending the same call again after each
    /// failure, with backoff, until Redis answers. `None` when `stop` fired first (the batch may or may not have
    /// been applied: safe-mode tasks are recovered through their lease either way).
    #[expect(
        clippy::too_many_arguments,
        reason = "each is an input of the settle script (`broker::settle`) that the acker and the monitor hold apart; a struct for them would only name them twice"
    )]
    pub fn settle(
        &mut self,
        session: &mut Session,
        keys: &QueueKeys,
        fence: Fence,
        dead_max: usize,
        holder: Holder<'_>,
        settlements: &[&Settlement],
        stop: &Listener,
    ) -> Option<Settled> {
        self.calls += 1;
        let call = broker::Call {
            settler: &self.identity,
            number: self.calls,
        };
        let mut backoff = Backoff::new();
        let mut failures = 0u32;
        loop {
            if let Some(pulse) = &self.pulse {
                pulse.beat();
            }
            let result = session.get().and_then(|connection| {
                broker::settle(
                    connection,
                    keys,
                    &call,
                    fence,
                    dead_max,
                    holder,
                    settlements.iter().copied(),
                )
            });
            match result {
                Ok(settled) => {
                    if settled.superseded {
                        // Unreachable while this settler is the only one with its identity (see
                        // `Settled::superseded`): said, and taken as applied before.
                        tracing::warn!(
                            call = call.number,
                            outcomes = settlements.len(),
                            "Redis has a newer settle call of this settler than this one; taken as applied before"
                        );
                    }
                    if failures > 0 {
                        tracing::info!(
                            outcomes = settlements.len(),
                            failures,
                            "settled after retrying"
                        );
                    }
                    return Some(settled);
                }
                Err(error) => {
                    failures += 1;
                    crate::observed::redis_error("settling outcomes");
                    session.reset();
                    // The first failure is most often one dropped connection: try a new one at once.
                    if failures == 1 {
                        tracing::warn!(%error, outcomes = settlements.len(), "cannot settle outcomes; retrying");
                        continue;
                    }
                    if failures == 2 || failures.is_power_of_two() {
                        tracing::error!(%error, outcomes = settlements.len(), failures, "cannot settle outcomes; retrying with backoff");
                    }
                    if backoff.wait(stop) {
                        return None;
                    }
                }
            }
        }
    }
}
