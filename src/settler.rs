//! Settling a batch until Redis has answered for it: the acker's and the monitor's shared way to apply outcomes.
//!
//! A settle call whose reply is lost (a reset, a stall past the read timeout) is ambiguous: Redis may have applied
//! it. The call is then sent again as the same call, and Redis answers with what the first one did instead of
//! applying it twice (see `broker::settle`): so a dead letter is recorded once, its hook runs once, and a
//! default-mode retry is queued once.
//!
//! A batch is sent in calls of at most [`CALL_BYTES`] of records (review M8): a call's arguments sit in Redis's
//! memory while it runs, count against `maxmemory`, and must each stay under `proto-max-bulk-len`; a thousand
//! retried tasks of 15 MiB in one call would be 15 GiB of them. A call Redis refuses as it was sent
//! ([`BrokerError::refused`]: out of memory with its arguments counted, a record a script or the protocol
//! refuses), and never sent before without an answer, is split in halves, each settled alone, down to the one
//! outcome that cannot be applied: that one is *refused* ([`Report::refused`]), left to the caller to hold and
//! try again later, never resent in a loop that keeps the rest waiting. A call that may have run (its reply lost)
//! is never split: its halves would apply again what the first copy applied, so it is sent again as it was until
//! Redis answers.
//!
//! An owner's settle may hand the running slots it frees over to the next tasks ([`Settler::settle_handing_over`];
//! docs/design/flow-control.md, "The slot handed over in the settle"): the claim block rides on the batch's first
//! call, and on every copy of it sent again (the copy answers the same claim from its stored result, and claims
//! nothing more); a call Redis refused as sent ran nothing, and its halves go without it.

use std::ops::Range;
use std::sync::Arc;

use crate::broker::{
    self, Batch, BrokerError, Fence, Handover, Holder, QueueKeys, Session, Settled, Settlement,
};
use crate::pulse::Pulse;
use crate::retry::Backoff;
use crate::shutdown::Listener;

/// The most bytes of records (payloads, envelopes, dead records) one settle call carries, unless a single record
/// is larger: well under Redis's `proto-max-bulk-len` (512 MiB) and small beside a `maxmemory` worth running a
/// queue of large tasks with, while a call of a thousand tasks of 64 KiB still goes whole.
pub(crate) const CALL_BYTES: usize = 64 << 20;

/// What one record costs a call besides its payload: its op, token, unique id, level, delay and flag.
const RECORD_OVERHEAD: usize = 64;

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

/// What became of a batch handed to [`Settler::settle`].
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Per settlement, in order: whether it applied (false: stale, its task was recovered meanwhile); `None`
    /// for a plain acknowledgement (counted in `stale_acks`), for every settlement of a call Redis had
    /// already answered (`Settled::superseded`), and for a refused one.
    pub(crate) applied: Vec<Option<bool>>,
    /// The settlements Redis refused, each alone in its call (positions in the batch, ascending): not applied.
    pub(crate) refused: Vec<usize>,
    /// Plain acknowledgements whose token was no longer in the processing area.
    pub(crate) stale_acks: usize,
    /// How many calls were answered with the settling owner's journal: each added one to it (see
    /// `Settled::journal`).
    pub(crate) journaled: u64,
}

/// What every call of one [`Settler::settle`] settles against.
struct Target<'a> {
    keys: &'a QueueKeys,
    fence: Fence,
    dead_max: usize,
    holder: Holder<'a>,
}

/// What one call came to.
enum Answer {
    /// Applied (or answered from its stored result), with the tasks its handover claimed, if it carried one and
    /// that claimed any.
    Settled(Settled, Option<Batch>),
    /// An error reply that says Redis refused it as sent (nothing ran).
    Refused(BrokerError),
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
    pub(crate) fn with_pulse(mut self, pulse: Pulse) -> Settler {
        self.pulse = Some(pulse);
        self
    }

    /// Applies `settlements` (all of `holder`'s tasks) in calls of at most [`CALL_BYTES`], each sent again after
    /// a failure, with backoff, until Redis answers, and each that Redis refuses split until only the
    /// settlements it refuses alone are left out ([`Report::refused`]). `None` when `stop` fired first (the
    /// batch may or may not have been applied, in part: safe-mode tasks are recovered through their lease
    /// either way).
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
    ) -> Option<Report> {
        self.settle_with(
            session,
            keys,
            fence,
            dead_max,
            holder,
            settlements,
            None,
            stop,
        )
        .map(|(report, _)| report)
    }

    /// [`Settler::settle`] of an owner's settlements (`Holder::Claimed(owner)`, fenced by its lease), whose first
    /// call hands the running slots it frees over to claim `handover.claim` (`broker::settle_handing_over`).
    /// Returns the tasks that claim took beside the report (`None`: it took none, or the first call went without
    /// the block: Redis refused it as sent, or it carried a record too large for it).
    #[expect(
        clippy::too_many_arguments,
        reason = "settle's arguments and the handover's"
    )]
    pub fn settle_handing_over(
        &mut self,
        session: &mut Session,
        keys: &QueueKeys,
        dead_max: usize,
        owner: &Arc<str>,
        settlements: &[&Settlement],
        handover: &Handover<'_>,
        stop: &Listener,
    ) -> Option<(Report, Option<Batch>)> {
        self.settle_with(
            session,
            keys,
            Fence::Owner,
            dead_max,
            Holder::Claimed(owner),
            settlements,
            Some((owner, handover)),
            stop,
        )
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "settle's arguments and the handover's"
    )]
    fn settle_with(
        &mut self,
        session: &mut Session,
        keys: &QueueKeys,
        fence: Fence,
        dead_max: usize,
        holder: Holder<'_>,
        settlements: &[&Settlement],
        mut handover: Option<(&Arc<str>, &Handover<'_>)>,
        stop: &Listener,
    ) -> Option<(Report, Option<Batch>)> {
        let target = Target {
            keys,
            fence,
            dead_max,
            holder,
        };
        let mut report = Report {
            applied: vec![None; settlements.len()],
            ..Report::default()
        };
        // Last to first, so that the calls go out in the batch's order.
        let mut pending = by_bytes(settlements, CALL_BYTES);
        pending.reverse();
        let mut handed_over = None;
        while let Some(range) = pending.pop() {
            let part = &settlements[range.clone()];
            // The first call only: once it is answered or refused, the claim block goes no more.
            match self.call(session, &target, part, handover.take(), stop)? {
                Answer::Settled(settled, batch) => {
                    handed_over = handed_over.or(batch);
                    if settled.journal > 0 {
                        report.journaled += 1;
                    }
                    report.stale_acks += settled.stale_acks;
                    for (slot, applied) in report.applied[range].iter_mut().zip(settled.applied) {
                        *slot = applied;
                    }
                }
                Answer::Refused(error) if range.len() > 1 => {
                    let middle = range.start + range.len() / 2;
                    tracing::warn!(
                        %error,
                        outcomes = range.len(),
                        bytes = bytes_of(part),
                        "Redis refused a settle call; settling its halves apart"
                    );
                    pending.push(middle..range.end);
                    pending.push(range.start..middle);
                }
                Answer::Refused(error) => {
                    let record = part[0];
                    tracing::error!(
                        %error,
                        op = record.op.name(),
                        bytes = record.payload.len(),
                        "Redis refuses the outcome of one task, even alone in a call: it is left as it is and tried again \
                         later (an acker counts it in kmqd_daemon_refused_outcomes)"
                    );
                    report.refused.push(range.start);
                }
            }
        }
        Some((report, handed_over))
    }

    /// Sends `settlements` as one call until Redis answers it, or refuses it before it was ever sent without an
    /// answer; `None` when `stop` fired first. With `handover` (the owner's, `target.holder`), every copy of the
    /// call carries the same claim block.
    fn call(
        &mut self,
        session: &mut Session,
        target: &Target<'_>,
        settlements: &[&Settlement],
        handover: Option<(&Arc<str>, &Handover<'_>)>,
        stop: &Listener,
    ) -> Option<Answer> {
        self.calls += 1;
        let call = broker::Call {
            settler: &self.identity,
            number: self.calls,
        };
        let mut backoff = Backoff::new();
        let mut failures = 0u32;
        // Whether an attempt's reply was lost: Redis may have applied the call, which is then only ever sent
        // again as it is.
        let mut may_have_run = false;
        let mut reloads = 0u32;
        loop {
            if let Some(pulse) = &self.pulse {
                pulse.beat();
            }
            let result = session.get().and_then(|connection| match handover {
                Some((owner, handover)) => broker::settle_handing_over(
                    connection,
                    target.keys,
                    &call,
                    target.dead_max,
                    owner,
                    settlements.iter().copied(),
                    handover,
                ),
                None => broker::settle(
                    connection,
                    target.keys,
                    &call,
                    target.fence,
                    target.dead_max,
                    target.holder,
                    settlements.iter().copied(),
                )
                .map(|settled| (settled, None)),
            });
            match result {
                Ok((settled, batch)) => {
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
                    return Some(Answer::Settled(settled, batch));
                }
                Err(error) if error.refused() && !may_have_run => {
                    crate::observed::redis_error("settling outcomes");
                    return Some(Answer::Refused(error));
                }
                // Redis lost its scripts (a restart, a failover, a SCRIPT FLUSH; nothing ran): settle.lua is loaded
                // on a new connection, before any record is sent on it (`broker::load_settle` says why), and the
                // call sent again at once; only a script lost again waits.
                Err(error) if error.is_missing_script() => {
                    reloads += 1;
                    session.reset();
                    if let Err(load) = session.get().and_then(broker::load_settle) {
                        tracing::warn!(error = %load, "cannot load the settle script; retrying");
                        session.reset();
                    }
                    if reloads > 1 && backoff.wait(stop) {
                        return None;
                    }
                }
                Err(error) => {
                    failures += 1;
                    may_have_run |= error.may_have_run();
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

/// What `settlements` weigh in a call.
fn bytes_of(settlements: &[&Settlement]) -> usize {
    settlements
        .iter()
        .map(|s| s.bytes() + RECORD_OVERHEAD)
        .sum()
}

/// Cuts `settlements` into consecutive calls of at most `budget` bytes each (a record larger than that alone).
fn by_bytes(settlements: &[&Settlement], budget: usize) -> Vec<Range<usize>> {
    let mut calls = Vec::with_capacity(1);
    let (mut start, mut bytes) = (0, 0);
    for (at, settlement) in settlements.iter().enumerate() {
        let size = settlement.bytes() + RECORD_OVERHEAD;
        if at > start && bytes + size > budget {
            calls.push(start..at);
            (start, bytes) = (at, 0);
        }
        bytes += size;
    }
    if start < settlements.len() {
        calls.push(start..settlements.len());
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::SettleOp;

    fn record(bytes: usize) -> Settlement {
        Settlement {
            op: SettleOp::Dead,
            token: None,
            popped_by: None,
            popped_scope: None,
            unique_id: None,
            level: 0,
            payload: vec![b'x'; bytes],
            failed: true,
            kept: None,
            note: None,
        }
    }

    #[test]
    fn a_batch_is_cut_into_calls_by_bytes_in_order_a_large_record_alone() {
        // The calls as (first, past the last).
        let check = |sizes: &[usize], budget: usize, expected: &[(usize, usize)]| {
            let records: Vec<Settlement> = sizes.iter().map(|&size| record(size)).collect();
            let refs: Vec<&Settlement> = records.iter().collect();
            let calls: Vec<(usize, usize)> = by_bytes(&refs, budget)
                .into_iter()
                .map(|call| (call.start, call.end))
                .collect();
            assert_eq!(calls, expected, "{sizes:?} within {budget}");
        };
        let o = RECORD_OVERHEAD;
        check(&[], 1000, &[]);
        check(&[0, 0, 0], 1000, &[(0, 3)]);
        check(&[100 - o, 100 - o, 100 - o], 200, &[(0, 2), (2, 3)]);
        // Larger than the budget: alone, wherever it is.
        check(&[10, 5000, 10], 1000, &[(0, 1), (1, 2), (2, 3)]);
        check(&[5000], 1000, &[(0, 1)]);
        check(&[300 - o; 7], 1000, &[(0, 3), (3, 6), (6, 7)]);
    }

    #[test]
    fn only_refusals_of_the_call_as_sent_split_it() {
        let server = |line: &str| {
            let value = redis::Value::ServerError(
                redis::parse_redis_value(format!("-{line}\r\n").as_bytes())
                    .ok()
                    .and_then(|value| match value {
                        redis::Value::ServerError(error) => Some(error),
                        _ => None,
                    })
                    .expect("an error line parses"),
            );
            BrokerError::from(value.extract_error().expect_err("an error reply"))
        };
        for refused in [
            "OOM command not allowed when used memory > 'maxmemory'.",
            "ERR Protocol error: invalid bulk length",
            "WRONGTYPE settle.lua: kmq:{q}:dead is a string, not a list; nothing was applied",
        ] {
            assert!(server(refused).refused(), "{refused}");
        }
        for waited_out in [
            "LOADING Redis is loading the dataset in memory",
            "READONLY You can't write against a read only replica.",
            "BUSY Redis is busy running a script.",
            "MISCONF Redis is configured to save RDB snapshots",
            "NOSCRIPT No matching script.",
        ] {
            assert!(!server(waited_out).refused(), "{waited_out}");
        }
        let lost = BrokerError::from(redis::RedisError::from(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )));
        assert!(!lost.refused(), "a lost reply may have run: never split");
    }
}
