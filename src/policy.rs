//! Pure decisions: what happens to a task after a run (or instead of one). No I/O here, so every rule is
//! table-tested below; docs/RELIABILITY.md states the same rules in prose.

use std::time::Duration;

use crate::config::{OnHandlerError, QueueConfig};

/// The parts of a queue's config that decide a task's fate.
#[derive(Clone, Debug)]
pub struct Policy {
    pub retry_times: u32,
    pub on_handler_error: OnHandlerError,
    pub backoff: Duration,
    pub backoff_max: Duration,
    pub alive_timeout: Option<Duration>,
}

impl Policy {
    pub fn for_queue(queue: &QueueConfig) -> Policy {
        Policy {
            retry_times: queue.retry_times,
            on_handler_error: queue.on_handler_error,
            backoff: queue.backoff,
            backoff_max: queue.backoff_max,
            alive_timeout: queue.alive_timeout,
        }
    }

    /// Whether a task created at `created_at_ms` is past its alive timeout at `now_ms` (both Redis's clock).
    pub fn too_old(&self, created_at_ms: Option<i64>, now_ms: i64) -> Option<String> {
        let (alive, created_at) = (self.alive_timeout?, created_at_ms?);
        // `created_at` is the producer's: saturate rather than overflow on absurd values.
        let age = Duration::from_millis(now_ms.saturating_sub(created_at).max(0) as u64);
        (age > alive).then(|| {
            format!(
                "older than alive_timeout: {} > {}",
                humantime::format_duration(Duration::from_secs(age.as_secs())),
                humantime::format_duration(alive)
            )
        })
    }

    /// Whether a task that expires at `expires_at_ms` (its envelope's `expires_at`) may no longer start at `now_ms`
    /// (both Redis's clock): the reason it is dead-lettered with, unrun. An expiry is a deadline for the start, so
    /// a start at the very millisecond is too late.
    #[inline]
    pub fn expired(expires_at_ms: Option<i64>, now_ms: i64) -> Option<String> {
        (now_ms >= expires_at_ms?).then(|| EXPIRED.to_owned())
    }

    /// The backoff before retry number `attempt + 1`: `backoff * 2^attempt`, at most `backoff_max`, plus up to
    /// 25 % jitter so that tasks that failed together do not all come back together. The jitter comes from
    /// `seed` (a hash of the task id), so a decision is reproducible.
    pub fn backoff_for(&self, attempt: u32, seed: u64) -> Duration {
        let base = self
            .backoff
            .saturating_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX))
            .min(self.backoff_max);
        let jitter = base.mul_f64((seed % 1000) as f64 / 4000.0);
        base + jitter
    }
}

/// What a run came to, or why the task could not run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The handler finished the task.
    Done,
    /// `KMQ_RETRY`, a panic, an execution timeout or a status outside the ABI; `after` is the handler's own delay.
    HandlerError {
        reason: String,
        after: Option<Duration>,
    },
    /// `KMQ_FAIL`: the handler says the task can never succeed.
    Fail { reason: String },
    /// Safe mode: the daemon holding the task stopped renewing its lease (it died or hung). `ran_alone`: its owner
    /// ran it from the quarantine with nothing else (see docs/RELIABILITY.md, "Poison pills"), so the crash is
    /// charged to it (`crashes` before this one); otherwise it was merely held with whatever crashed, and
    /// `recoveries` says how often that happened to it before.
    LeaseExpired {
        ran_alone: bool,
        recoveries: u32,
        crashes: u32,
    },
    /// The task could not be run at all (malformed, too old).
    Unrunnable { reason: String },
    /// The handler answered back-pressure (`KMQ_THROTTLE`: its upstream said "too many requests"): the queue takes
    /// no task for `after` (`None`: [`DEFAULT_THROTTLE`]), and this one goes back uncharged.
    Throttled {
        reason: String,
        after: Option<Duration>,
    },
    /// No loaded plugin handles the task's type. What a rolling deploy makes (a producer or a newer daemon knows a
    /// type this daemon does not yet), so it is retried with the queue's backoff whatever `on_handler_error` says,
    /// and dead-lettered only after `retry_times`; nothing ran, so it does not count as failed.
    NoHandler { reason: String },
    /// No run counts: the daemon gave the task back (the shutdown, a reload, workers all stuck, a claim that
    /// landed once claiming stopped), unstarted or, in safe mode at the shutdown, while it still ran. The
    /// envelope's `recoveries` and `crashes` (zero for a payload that does not decode) say where it waited.
    HandedBack { recoveries: u32, crashes: u32 },
}

impl Verdict {
    /// Whether a run happened and failed; such runs are counted in the `failed` statistic.
    pub fn is_failed_run(&self) -> bool {
        matches!(
            self,
            Verdict::HandlerError { .. }
                | Verdict::Fail { .. }
                | Verdict::LeaseExpired {
                    ran_alone: true,
                    ..
                }
        )
    }
}

/// What to do with the task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Acknowledge it: it is done (also after a handler error under `on_handler_error = "finish"`).
    Ack,
    /// Queue it again with `attempt + 1` after `delay` (zero: at the front of its level at once), or, `isolated`,
    /// at the front of its level's quarantine.
    Retry {
        delay: Duration,
        reason: String,
        isolated: bool,
    },
    /// Queue it again as it is, uncharged (`recovered + 1`): at the front of its level, or of the level's
    /// quarantine list of stage `quarantine` (an index into `broker::keys::QUARANTINE_GROUPS`: the more often a
    /// task came back, the smaller the group it runs in, down to alone).
    Recover { quarantine: Option<usize> },
    /// Move it to the dead-letter list.
    Dead { reason: String },
    /// Back-pressure: queue it again at the front of its level exactly as it is, uncharged, and let no daemon take a
    /// task of the queue for `after` (a later throttle already set stands).
    Throttle { after: Duration, reason: String },
    /// Queue it again exactly as it is, at the front of its level, or of the quarantine stage it waited in
    /// (`quarantine`, as for [`Action::Recover`]): a task handed back is neither charged nor counted recovered.
    Back { quarantine: Option<usize> },
}

/// The reason of a task dead-lettered unrun because it was not started by its `expires_at` (docs/PROTOCOL.md,
/// "Expiry"): the one word the clients and `kmqd dead` show, so that a producer can tell it from a failure.
pub const EXPIRED: &str = "expired";

/// A throttle whose handler named no delay.
pub const DEFAULT_THROTTLE: Duration = Duration::from_secs(1);

/// The longest throttle: a handler that asks for more (a misread `Retry-After`, a date taken for seconds) holds
/// its queue back this long, and asks again if its upstream still refuses.
pub const MAX_THROTTLE: Duration = Duration::from_secs(3600);

/// The longest retry delay a handler may ask for (`retry_after_ms`): a longer one (a timestamp taken for a delay,
/// a unit mistaken) waits this long, and the task's lease, unique id and `alive_timeout` stay meaningful (the
/// review's L11).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(30 * 24 * 3600);

/// Decides the fate of a task whose run number `attempt` (0 = first) came to `verdict`. `seed` (see
/// [`Policy::backoff_for`]) is asked only for a retry's backoff: hashing the id of every task that is simply done
/// was 1 % of a no-op drain's daemon CPU.
pub fn decide(
    policy: &Policy,
    attempt: u32,
    verdict: Verdict,
    seed: impl FnOnce() -> u64,
) -> Action {
    let out_of_retries = attempt >= policy.retry_times;
    match verdict {
        Verdict::Done => Action::Ack,
        Verdict::Fail { reason } => Action::Dead { reason },
        Verdict::Unrunnable { reason } => Action::Dead { reason },
        // Never charged, never dead-lettered, whatever `attempt` and `on_handler_error` say: the task did not fail,
        // its upstream asked for time. A task that throttles for ever is bounded by `alive_timeout`.
        Verdict::Throttled { reason, after } => Action::Throttle {
            after: after
                .unwrap_or(DEFAULT_THROTTLE)
                .clamp(Duration::from_millis(1), MAX_THROTTLE),
            reason,
        },
        Verdict::NoHandler { reason } if out_of_retries => Action::Dead {
            reason: format!(
                "{reason}; no retries left after {} attempts",
                attempt.saturating_add(1)
            ),
        },
        Verdict::NoHandler { reason } => Action::Retry {
            delay: policy.backoff_for(attempt, seed()),
            reason,
            isolated: false,
        },
        Verdict::LeaseExpired {
            ran_alone: true,
            crashes,
            ..
        } => {
            if out_of_retries {
                Action::Dead {
                    reason: format!(
                        "crashed the daemon {} times while it ran alone (its lease expired each time); no \
                         retries left after {} runs",
                        crashes.saturating_add(1),
                        attempt.saturating_add(1)
                    ),
                }
            } else {
                Action::Retry {
                    delay: Duration::ZERO,
                    reason: "lease expired while it ran alone: it crashed or hung its daemon"
                        .to_string(),
                    isolated: true,
                }
            }
        }
        Verdict::LeaseExpired {
            ran_alone: false,
            recoveries,
            ..
        } => Action::Recover {
            quarantine: crate::broker::keys::quarantine_stage(recoveries.saturating_add(1)),
        },
        // Back where it waited: a task that crashed a daemon running alone goes back to run alone, one that came back
        // from expired leases to its quarantine stage. Handed back to the ready list, a poison pill would crash a
        // full batch on every rolling restart, uncharged (the review's L2).
        Verdict::HandedBack {
            recoveries,
            crashes,
        } => Action::Back {
            quarantine: if crashes > 0 {
                Some(0)
            } else {
                crate::broker::keys::quarantine_stage(recoveries)
            },
        },
        Verdict::HandlerError { reason, after } => match policy.on_handler_error {
            OnHandlerError::Finish => Action::Ack,
            OnHandlerError::Dead => Action::Dead { reason },
            OnHandlerError::Retry if out_of_retries => Action::Dead {
                reason: format!(
                    "{reason}; no retries left after {} runs",
                    attempt.saturating_add(1)
                ),
            },
            OnHandlerError::Retry => Action::Retry {
                delay: after.map_or_else(
                    || policy.backoff_for(attempt, seed()),
                    |after| after.min(MAX_RETRY_AFTER),
                ),
                reason,
                isolated: false,
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(on_handler_error: OnHandlerError) -> Policy {
        Policy {
            retry_times: 2,
            on_handler_error,
            backoff: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            alive_timeout: Some(Duration::from_secs(3600)),
        }
    }

    fn error(after: Option<u64>) -> Verdict {
        Verdict::HandlerError {
            reason: "boom".into(),
            after: after.map(Duration::from_millis),
        }
    }

    fn retry(ms: u64) -> Action {
        retry_with(ms, "boom")
    }

    fn retry_with(ms: u64, reason: &str) -> Action {
        Action::Retry {
            delay: Duration::from_millis(ms),
            reason: reason.into(),
            isolated: false,
        }
    }

    fn throttled(after: Option<u64>) -> Verdict {
        Verdict::Throttled {
            reason: "429".into(),
            after: after.map(Duration::from_millis),
        }
    }

    fn throttle(ms: u64) -> Action {
        Action::Throttle {
            after: Duration::from_millis(ms),
            reason: "429".into(),
        }
    }

    fn no_handler() -> Verdict {
        Verdict::NoHandler {
            reason: "none".into(),
        }
    }

    fn lease(ran_alone: bool, recoveries: u32) -> Verdict {
        Verdict::LeaseExpired {
            ran_alone,
            recoveries,
            crashes: 1,
        }
    }

    fn handed_back(recoveries: u32, crashes: u32) -> Verdict {
        Verdict::HandedBack {
            recoveries,
            crashes,
        }
    }

    #[test]
    fn decisions() {
        use OnHandlerError::*;
        let alone = "lease expired while it ran alone: it crashed or hung its daemon";
        let cases: Vec<(OnHandlerError, u32, Verdict, Action)> = vec![
            (Retry, 0, Verdict::Done, Action::Ack),
            (Retry, 0, error(None), retry(1000)),
            (Retry, 1, error(None), retry(2000)),
            (Retry, 1, error(Some(250)), retry(250)),
            // A handler's delay past 30 days (the review's L11) is held at 30 days.
            (
                Retry,
                1,
                error(Some(u64::MAX)),
                retry(MAX_RETRY_AFTER.as_millis() as u64),
            ),
            (
                Retry,
                2,
                error(None),
                Action::Dead {
                    reason: "boom; no retries left after 3 runs".into(),
                },
            ),
            (Finish, 0, error(None), Action::Ack),
            (
                Dead,
                0,
                error(None),
                Action::Dead {
                    reason: "boom".into(),
                },
            ),
            (
                Retry,
                0,
                Verdict::Fail {
                    reason: "bad".into(),
                },
                Action::Dead {
                    reason: "bad".into(),
                },
            ),
            (
                Finish,
                0,
                Verdict::Fail {
                    reason: "bad".into(),
                },
                Action::Dead {
                    reason: "bad".into(),
                },
            ),
            (Retry, 0, lease(false, 0), Action::Recover { quarantine: None }),
            (
                Retry,
                2,
                lease(false, 1),
                Action::Recover {
                    quarantine: Some(2),
                },
            ),
            (
                Retry,
                2,
                lease(false, 2),
                Action::Recover {
                    quarantine: Some(1),
                },
            ),
            (
                Dead,
                2,
                lease(false, 7),
                Action::Recover {
                    quarantine: Some(0),
                },
            ),
            (
                Finish,
                0,
                lease(true, 2),
                Action::Retry {
                    delay: Duration::ZERO,
                    reason: alone.into(),
                    isolated: true,
                },
            ),
            (
                Retry,
                2,
                lease(true, 2),
                Action::Dead {
                    reason: "crashed the daemon 2 times while it ran alone (its lease expired each time); no \
                             retries left after 3 runs"
                        .into(),
                },
            ),
            (
                Retry,
                0,
                Verdict::Unrunnable { reason: "x".into() },
                Action::Dead { reason: "x".into() },
            ),
            // A throttle is never charged nor dead-lettered, whatever the attempt and on_handler_error.
            (Dead, 2, throttled(Some(250)), throttle(250)),
            (Retry, 5, throttled(None), throttle(1000)),
            (Finish, 0, throttled(Some(0)), throttle(1)),
            (Retry, 0, throttled(Some(86_400_000)), throttle(3_600_000)),
            // An unknown type waits for a daemon that knows it, whatever on_handler_error says.
            (Finish, 1, no_handler(), retry_with(2000, "none")),
            (Dead, 0, no_handler(), retry_with(1000, "none")),
            (
                Retry,
                2,
                no_handler(),
                Action::Dead {
                    reason: "none; no retries left after 3 attempts".into(),
                },
            ),
            // A hand-back is never charged, whatever the attempt: back where it waited.
            (Dead, 2, handed_back(0, 0), Action::Back { quarantine: None }),
            (
                Retry,
                0,
                handed_back(2, 0),
                Action::Back {
                    quarantine: Some(2),
                },
            ),
            (
                Finish,
                0,
                handed_back(2, 1),
                Action::Back {
                    quarantine: Some(0),
                },
            ),
        ];
        for (mode, attempt, verdict, expected) in cases {
            let label = format!("{mode:?} attempt {attempt} {verdict:?}");
            assert_eq!(
                decide(&policy(mode), attempt, verdict, || 0),
                expected,
                "{label}"
            );
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_with_bounded_jitter() {
        let policy = policy(OnHandlerError::Retry);
        let secs = |attempt| policy.backoff_for(attempt, 0).as_secs();
        assert_eq!(
            [secs(0), secs(1), secs(2), secs(5), secs(6), secs(40)],
            [1, 2, 4, 32, 60, 60]
        );
        assert_eq!(
            policy.backoff_for(1, 999),
            Duration::from_micros(2_000_000 + 499_500),
            "999/4000 of the base"
        );
    }

    #[test]
    fn absurd_producer_values_saturate_instead_of_overflowing() {
        let policy = policy(OnHandlerError::Retry);
        assert!(policy.too_old(Some(i64::MIN), i64::MAX).is_some());
        assert_eq!(policy.too_old(Some(i64::MAX), i64::MIN), None);
        assert_eq!(
            decide(&policy, u32::MAX, error(None), || 0),
            Action::Dead {
                reason: format!("boom; no retries left after {} runs", u32::MAX),
            }
        );
    }

    #[test]
    fn a_task_expires_at_its_expires_at_and_not_before() {
        assert_eq!(Policy::expired(None, i64::MAX), None, "no expiry");
        assert_eq!(Policy::expired(Some(1_000), 999), None);
        assert_eq!(
            Policy::expired(Some(1_000), 1_000).as_deref(),
            Some("expired")
        );
        assert_eq!(
            Policy::expired(Some(i64::MIN), 0).as_deref(),
            Some("expired")
        );
    }

    #[test]
    fn age_is_checked_against_alive_timeout() {
        let policy = policy(OnHandlerError::Retry);
        let hour = 3_600_000;
        assert_eq!(policy.too_old(Some(0), hour), None);
        assert_eq!(
            policy.too_old(Some(0), hour + 1_000).as_deref(),
            Some("older than alive_timeout: 1h 1s > 1h")
        );
        assert_eq!(
            policy.too_old(None, hour * 10),
            None,
            "no created_at: age unknown"
        );
        let forever = Policy {
            alive_timeout: None,
            ..policy
        };
        assert_eq!(forever.too_old(Some(0), hour * 10), None);
    }
}
