//! The watchdog's decision: is every lane making progress, or idle, rather than wedged? The `kmqd-notify`
//! thread ([`super::notify`]) tells systemd `WATCHDOG=1` only while it is, so that systemd restarts a daemon that
//! hangs (after `WatchdogSec`) instead of leaving it to hold its tasks' leases while doing nothing.
//!
//! "Wedged" is defined by what each stage of a lane does even when it has nothing to do, so that an idle daemon
//! is never mistaken for a hung one:
//!
//! - the fetcher and the acker loop at least every few seconds however idle (the fetcher waits at most
//!   `idle_poll` in Redis, the acker 50 ms for an outcome), and every call they make to Redis is bounded by the
//!   `[redis]` timeouts; each bumps a [`Pulse`] every turn (the acker also every settle attempt and every
//!   final-failure hook it runs). One whose pulse did not move for longer than its own [`Bounds`] (all its waits
//!   and timeouts added up, so that a Redis that is down or slow does not count: waiting for it is what the
//!   daemon should do) is stuck somewhere nothing bounds: a deadlock, a plugin hook that never returns;
//! - the heartbeat (one per daemon, which renews every lane's lease) loops at least every second, each renewal
//!   bounded by the same timeouts; it beats a [`Pulse`] every turn, and one silent for longer than its bound is
//!   wedged: its leases would run out while the daemon looks alive;
//! - the per-daemon threads a reload restarts ([`ThreadPulses`]) are watched the same way, each against the bound
//!   of its own loop: the monitor (which also runs the final-failure hooks of the tasks it dead-letters: a hook
//!   that never returns wedges it, and then no expired lease is recovered by this daemon), the delay listener
//!   and the scheduler; each queue's delay poller is a stage of its lane, beside the fetcher and the acker (a
//!   hung poller leaves that queue's delayed tasks and retries waiting forever), and so is its source mover when
//!   it has `source_lists`;
//! - the workers are wedged when every one of them is stuck in a handler that ignored its cancel flag past
//!   `execution_timeout` (the timeouts thread counts them, `Capacity::stuck_workers`): the queue can run
//!   nothing until one returns, and only a restart ends a handler that never does. Busy workers are not
//!   wedged, however long their handlers run within their timeout.
//!
//! Each thread's module says how long one turn of its loop may take (its `stall_bound`: the fetcher's is
//! `lane::fetcher_stall_bound`, the others' `acker::stall_bound`, `delay::poller_stall_bound`,
//! `sources::stall_bound`, `heartbeat::stall_bound`, `monitor::stall_bound`, `delay::listener_stall_bound`,
//! `scheduler::stall_bound`); the notify thread and the supervisor hand those bounds in. This module imports none
//! of the threads it watches, only the [`Pulse`] they beat, so it sits below all of them.
//!
//! The decision is pure (times come in as arguments), so the tests below drive it through every case.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::poison::lock;
use crate::pulse::Pulse;

/// How long each stage of a lane may go without a beat before it counts as wedged: what one turn of its loop may
/// wait, added up (each stage's `stall_bound`, assembled by `notify::lane_bounds`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub fetcher: Duration,
    pub acker: Duration,
    /// The queue's delay poller.
    pub delay: Duration,
    /// The queue's source mover, when it has `source_lists`.
    pub sources: Option<Duration>,
}

/// What the watchdog reads of one lane at one look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    pub fetcher: u64,
    pub acker: u64,
    pub delay: u64,
    pub sources: u64,
    pub workers: usize,
    pub stuck_workers: usize,
}

/// Why a lane counts as wedged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wedge {
    /// The fetcher's or acker's pulse has not moved for `silent`, longer than its bound.
    Stage {
        queue: String,
        stage: &'static str,
        silent: Duration,
        bound: Duration,
    },
    /// Every one of the queue's `workers` is stuck in a handler that ignored its cancel flag.
    Workers { queue: String, workers: usize },
    /// A per-daemon thread (the heartbeat, the monitor, ...) whose pulse has not moved for `silent`, longer than its bound.
    Thread {
        thread: &'static str,
        silent: Duration,
        bound: Duration,
    },
}

impl fmt::Display for Wedge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Wedge::Stage {
                queue,
                stage,
                silent,
                bound,
            } => write!(
                f,
                "queue {queue}: the {stage} has not moved for {}s (bound {}s)",
                silent.as_secs(),
                bound.as_secs()
            ),
            Wedge::Workers { queue, workers } => write!(
                f,
                "queue {queue}: every worker ({workers}) is stuck in a handler that ignores its cancel flag"
            ),
            Wedge::Thread {
                thread,
                silent,
                bound,
            } => write!(
                f,
                "the {thread} has not moved for {}s (bound {}s)",
                silent.as_secs(),
                bound.as_secs()
            ),
        }
    }
}

/// A look that comes this long after the previous one means the whole process was not running (stopped with
/// SIGSTOP, a paused VM, a host swapping hard): the other threads were not either, so their silence over that
/// gap proves nothing, and their clocks start again. The notify thread looks at least every second.
pub const PAUSE_GAP: Duration = Duration::from_secs(5);

/// The per-daemon threads that a reload restarts, with their pulses and bounds: the supervisor replaces the set
/// each time it starts them, and the notify thread samples whatever set is current.
#[derive(Debug, Default)]
pub struct ThreadPulses(Mutex<Vec<(&'static str, Pulse, Duration)>>);

impl ThreadPulses {
    /// From now on, watch these threads (name, pulse, bound) instead of the previous set.
    pub fn replace(&self, threads: Vec<(&'static str, Pulse, Duration)>) {
        *lock(&self.0) = threads;
    }

    pub fn samples(&self) -> Vec<ThreadSample> {
        lock(&self.0)
            .iter()
            .map(|(thread, pulse, bound)| ThreadSample {
                thread,
                count: pulse.count(),
                bound: *bound,
            })
            .collect()
    }
}

/// A per-daemon thread at one look: its name, its pulse's count, and how long it may be silent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadSample {
    pub thread: &'static str,
    pub count: u64,
    pub bound: Duration,
}

/// The watchdog's memory: when each pulse was last seen to move.
#[derive(Debug)]
pub struct Watchdog {
    lanes: Vec<Watched>,
    /// The per-daemon threads' pulses, by name: a reload may add or drop one (the scheduler).
    threads: Vec<(&'static str, Seen)>,
    last_look: Instant,
}

#[derive(Debug)]
struct Watched {
    queue: String,
    bounds: Bounds,
    fetcher: Seen,
    acker: Seen,
    delay: Seen,
    sources: Seen,
}

/// A pulse's count when it last moved, and when that was seen.
#[derive(Debug, Clone, Copy)]
struct Seen {
    count: u64,
    since: Instant,
}

impl Seen {
    /// Records `count`; returns how long the pulse has been still.
    fn update(&mut self, count: u64, now: Instant) -> Duration {
        if count != self.count {
            *self = Seen { count, since: now };
        }
        now.saturating_duration_since(self.since)
    }
}

impl Watchdog {
    /// Watches lanes (queue name, bounds); every pulse counts as having just moved at `now`.
    pub fn new(lanes: impl IntoIterator<Item = (String, Bounds)>, now: Instant) -> Watchdog {
        let fresh = Seen {
            count: 0,
            since: now,
        };
        Watchdog {
            lanes: lanes
                .into_iter()
                .map(|(queue, bounds)| Watched {
                    queue,
                    bounds,
                    fetcher: fresh,
                    acker: fresh,
                    delay: fresh,
                    sources: fresh,
                })
                .collect(),
            threads: Vec::new(),
            last_look: now,
        }
    }

    /// One look at every lane, `samples` in the order the lanes were given, and at the per-daemon `threads`
    /// (a thread first sampled now counts as having just moved, and one no longer sampled is forgotten): what is
    /// wedged (nothing: the daemon makes progress or is idle, and systemd may be told so).
    pub fn look(
        &mut self,
        now: Instant,
        samples: &[Sample],
        threads: &[ThreadSample],
    ) -> Vec<Wedge> {
        let paused = now.saturating_duration_since(self.last_look) > PAUSE_GAP;
        self.last_look = now;
        let mut wedges = Vec::new();
        self.threads
            .retain(|(name, _)| threads.iter().any(|t| t.thread == *name));
        for sample in threads {
            let index = match self
                .threads
                .iter()
                .position(|(name, _)| *name == sample.thread)
            {
                Some(index) => index,
                None => {
                    self.threads.push((
                        sample.thread,
                        Seen {
                            count: sample.count,
                            since: now,
                        },
                    ));
                    self.threads.len() - 1
                }
            };
            let seen = &mut self.threads[index].1;
            if paused {
                seen.since = now;
            }
            let silent = seen.update(sample.count, now);
            if silent > sample.bound {
                wedges.push(Wedge::Thread {
                    thread: sample.thread,
                    silent,
                    bound: sample.bound,
                });
            }
        }
        for (lane, sample) in self.lanes.iter_mut().zip(samples) {
            if paused {
                lane.fetcher.since = now;
                lane.acker.since = now;
                lane.delay.since = now;
                lane.sources.since = now;
            }
            let stages = [
                (
                    "fetcher",
                    &mut lane.fetcher,
                    sample.fetcher,
                    Some(lane.bounds.fetcher),
                ),
                (
                    "acker",
                    &mut lane.acker,
                    sample.acker,
                    Some(lane.bounds.acker),
                ),
                (
                    "delay poller",
                    &mut lane.delay,
                    sample.delay,
                    Some(lane.bounds.delay),
                ),
                (
                    "source mover",
                    &mut lane.sources,
                    sample.sources,
                    lane.bounds.sources,
                ),
            ];
            for (stage, seen, count, bound) in stages {
                // A stage the lane does not run (no source lists) is not watched.
                let Some(bound) = bound else { continue };
                let silent = seen.update(count, now);
                if silent > bound {
                    wedges.push(Wedge::Stage {
                        queue: lane.queue.clone(),
                        stage,
                        silent,
                        bound,
                    });
                }
            }
            if sample.workers > 0 && sample.stuck_workers >= sample.workers {
                wedges.push(Wedge::Workers {
                    queue: lane.queue.clone(),
                    workers: sample.workers,
                });
            }
        }
        wedges
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn watchdog(t0: Instant) -> Watchdog {
        let bounds = Bounds {
            fetcher: 10 * S,
            acker: 5 * S,
            delay: 20 * S,
            sources: None,
        };
        Watchdog::new(
            [("mail".to_string(), bounds), ("img".to_string(), bounds)],
            t0,
        )
    }

    fn sample(fetcher: u64, acker: u64) -> Sample {
        Sample {
            fetcher,
            acker,
            // The delay pollers beat with the fetchers, unless a test says otherwise; no source mover runs.
            delay: fetcher,
            sources: 0,
            workers: 2,
            stuck_workers: 0,
        }
    }

    /// Looks every second from `from` to `to` seconds after `t0`, the pulses given by `at(second)`; returns the
    /// last look's wedges.
    fn looks(
        watchdog: &mut Watchdog,
        t0: Instant,
        seconds: std::ops::RangeInclusive<u64>,
        at: impl Fn(u64) -> [Sample; 2],
    ) -> Vec<Wedge> {
        let mut last = Vec::new();
        for second in seconds {
            last = watchdog.look(t0 + S * second as u32, &at(second), &[]);
        }
        last
    }

    #[test]
    fn beating_pulses_are_healthy_however_long() {
        let t0 = Instant::now();
        let mut dog = watchdog(t0);
        let wedges = looks(&mut dog, t0, 1..=120, |s| {
            [sample(s, s), sample(s / 3, s * 7)]
        });
        assert_eq!(wedges, []);
    }

    #[test]
    fn a_pulse_still_for_longer_than_its_bound_is_a_wedge() {
        let t0 = Instant::now();
        let mut dog = watchdog(t0);
        // The second lane's acker stops at second 20; its bound is 5 s.
        let at = |s: u64| [sample(s, s), sample(s, s.min(20))];
        assert_eq!(looks(&mut dog, t0, 1..=25, at), [], "exactly at its bound");
        let wedges = looks(&mut dog, t0, 26..=26, at);
        assert_eq!(
            wedges,
            [Wedge::Stage {
                queue: "img".to_string(),
                stage: "acker",
                silent: 6 * S,
                bound: 5 * S
            }]
        );
        assert_eq!(
            wedges[0].to_string(),
            "queue img: the acker has not moved for 6s (bound 5s)"
        );
        // It moves again: healthy at once.
        assert_eq!(looks(&mut dog, t0, 27..=27, |s| [sample(s, s); 2]), []);
    }

    #[test]
    fn each_stage_has_its_own_bound() {
        let t0 = Instant::now();
        let mut dog = watchdog(t0);
        // The first lane's fetcher is still from the start: within its 10 s bound at second 10, wedged at 11.
        let at = |s: u64| [sample(0, s), sample(s, s)];
        assert_eq!(looks(&mut dog, t0, 1..=10, at), []);
        let wedges = looks(&mut dog, t0, 11..=11, at);
        assert!(
            matches!(&wedges[..], [Wedge::Stage { queue, stage: "fetcher", .. }] if queue == "mail"),
            "{wedges:?}"
        );
    }

    #[test]
    fn a_queue_whose_every_worker_is_stuck_is_a_wedge_and_some_stuck_is_not() {
        let t0 = Instant::now();
        let mut dog = watchdog(t0);
        let stuck = |n: usize| Sample {
            stuck_workers: n,
            ..sample(1, 1)
        };
        assert_eq!(dog.look(t0 + S, &[stuck(1), sample(1, 1)], &[]), []);
        assert_eq!(
            dog.look(t0 + 2 * S, &[sample(2, 2), stuck(2)], &[]),
            [Wedge::Workers {
                queue: "img".to_string(),
                workers: 2
            }]
        );
        assert_eq!(
            dog.look(t0 + 3 * S, &[sample(3, 3), stuck(1)], &[]),
            [],
            "a handler returned"
        );
    }

    #[test]
    fn a_late_look_after_a_pause_restarts_every_clock() {
        let t0 = Instant::now();
        let mut dog = watchdog(t0);
        // The whole process was stopped for a minute: nothing moved, the watchdog did not look either.
        assert_eq!(dog.look(t0 + 60 * S, &[sample(0, 0); 2], &[]), []);
        // From then on, silence counts again.
        assert_eq!(looks(&mut dog, t0, 61..=65, |_| [sample(0, 0); 2]), []);
        let wedges = looks(&mut dog, t0, 66..=66, |_| [sample(0, 0); 2]);
        assert_eq!(wedges.len(), 2, "both ackers (5 s): {wedges:?}");
        let wedges = looks(&mut dog, t0, 67..=71, |_| [sample(0, 0); 2]);
        assert_eq!(wedges.len(), 4, "and both fetchers (10 s): {wedges:?}");
    }

    #[test]
    fn a_silent_heartbeat_is_a_wedge_after_its_bound_and_a_beating_one_never() {
        let t0 = Instant::now();
        let mut dog = watchdog(t0);
        let heartbeat = |count: u64| ThreadSample {
            thread: "heartbeat",
            count,
            bound: 3 * S,
        };
        for second in 1..=30 {
            let at = t0 + S * second;
            let wedges = dog.look(
                at,
                &[sample(second as u64, second as u64); 2],
                &[heartbeat(second as u64)],
            );
            assert_eq!(wedges, [], "beating, second {second}");
        }
        // It stops at 30: within its bound at 33, wedged at 34; the lanes are fine all along.
        let lanes = |s: u64| [sample(s, s); 2];
        assert_eq!(dog.look(t0 + 33 * S, &lanes(33), &[heartbeat(30)]), []);
        let wedges = dog.look(t0 + 34 * S, &lanes(34), &[heartbeat(30)]);
        assert_eq!(
            wedges,
            [Wedge::Thread {
                thread: "heartbeat",
                silent: 4 * S,
                bound: 3 * S
            }]
        );
        assert_eq!(
            wedges[0].to_string(),
            "the heartbeat has not moved for 4s (bound 3s)"
        );
        assert_eq!(
            dog.look(t0 + 35 * S, &lanes(35), &[heartbeat(31)]),
            [],
            "it moves again"
        );
    }

    #[test]
    fn a_silent_delay_poller_is_a_wedge_of_its_lane() {
        let t0 = Instant::now();
        let mut dog = watchdog(t0);
        // The first lane's poller stops at second 1 while its fetcher and acker go on; its bound is 20 s.
        let at = |s: u64| {
            [
                Sample {
                    delay: s.min(1),
                    ..sample(s, s)
                },
                sample(s, s),
            ]
        };
        assert_eq!(looks(&mut dog, t0, 1..=21, at), []);
        let wedges = looks(&mut dog, t0, 22..=22, at);
        assert_eq!(
            wedges.iter().map(Wedge::to_string).collect::<Vec<_>>(),
            ["queue mail: the delay poller has not moved for 21s (bound 20s)"]
        );
    }

    #[test]
    fn threads_are_watched_by_name_as_a_reload_changes_their_set() {
        let t0 = Instant::now();
        let mut dog = watchdog(t0);
        let thread = |thread: &'static str, count: u64| ThreadSample {
            thread,
            count,
            bound: 3 * S,
        };
        let lanes = |s: u64| [sample(s, s); 2];
        assert_eq!(
            dog.look(
                t0 + S,
                &lanes(1),
                &[thread("monitor", 1), thread("scheduler", 1)]
            ),
            []
        );
        // A reload dropped the scheduler and restarted the monitor (a new pulse, counting from 0); the monitor
        // then hangs at once.
        assert_eq!(dog.look(t0 + 2 * S, &lanes(2), &[thread("monitor", 0)]), []);
        assert_eq!(dog.look(t0 + 5 * S, &lanes(5), &[thread("monitor", 0)]), []);
        let wedges = dog.look(t0 + 6 * S, &lanes(6), &[thread("monitor", 0)]);
        assert_eq!(
            wedges.iter().map(Wedge::to_string).collect::<Vec<_>>(),
            ["the monitor has not moved for 4s (bound 3s)"]
        );
        // A scheduler that comes back counts as having just moved, whatever its count was before.
        assert_eq!(
            dog.look(
                t0 + 7 * S,
                &lanes(7),
                &[thread("monitor", 1), thread("scheduler", 1)]
            ),
            []
        );
        assert_eq!(
            dog.look(
                t0 + 10 * S,
                &lanes(10),
                &[thread("monitor", 2), thread("scheduler", 1)]
            ),
            []
        );
        assert_eq!(
            dog.look(
                t0 + 11 * S,
                &lanes(11),
                &[thread("monitor", 3), thread("scheduler", 1)]
            )
            .len(),
            1,
            "the scheduler, silent past its bound since it came back"
        );
    }
}
