//! The monitor: one thread per daemon that recovers the tasks of owners whose lease ran out, because the daemon
//! holding them died or hung. Each such task goes back uncharged (`recovered + 1`: it was merely held, maybe never
//! started) to the front of its level, or, recovered before, to the quarantine, to run in a group of 64, then 8,
//! then alone, with nothing else; a task the owner ran alone is charged the crash (`attempt + 1`, `crashes + 1`,
//! or the dead-letter list when out of retries: a poison pill). A task older than `alive_timeout` is dead-lettered. An owner with nothing left is
//! forgotten, and the unique ids a default-mode owner died with are freed.
//!
//! Every daemon runs a monitor, over every queue it serves whatever the queue's mode here (another daemon may
//! serve it in safe mode), and no lock is taken: an owner whose lease ran out never renews it again, and the
//! settle script marks each task settled in its claim (its bit) in the same step that queues it, so when two
//! monitors find the same task, exactly one moves it.
//!
//! It reads an owner's tasks a window at a time ([`BATCH`] tasks, and [`WINDOW_BYTES`] of a claim list larger
//! than that), and settles each window before it reads the next, so what it holds at once is bounded whatever
//! the claim that took the owner's daemon down (review M8). A task whose record Redis refuses, even alone in a
//! call, stays in its claim (logged) and is tried again on the next pass.
//!
//! Beside that, every [`history::SAMPLE_EVERY`] the monitor offers each queue's sample a minute for the
//! dashboard's charts (broker/history.rs): one short script call, off every task's path.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::lane::ownership::step_margin;
use crate::broker::{self, Fence, Holder, Session, Settlement, Token, history};
use crate::config::RedisConfig;
use crate::plugin::Plugins;
use crate::policy::Verdict;
use crate::pulse::Pulse;
use crate::queue::QueueContext;
use crate::retry::Trouble;
use crate::settlement::{DeadHook, TaskParts};
use crate::settler::Settler;
use crate::shutdown::Listener;

/// The most tasks handled per round trip.
const BATCH: usize = 100;

/// The most bytes of an expired owner's tasks read per round trip, unless one task is larger (review M8): a
/// claim of large tasks that took its daemon down must not take down every monitor that recovers it. A claim
/// list larger than this in all (`MEMORY USAGE`) is read in windows of as many tasks of the queue's
/// `max_task_bytes` as fit; the settle records built from a window are about as large again.
const WINDOW_BYTES: u64 = 16 << 20;

/// How long the monitor, looking every `interval` ([`Monitor::interval`]), may go without a beat before the
/// watchdog counts it as wedged: its wait between passes, then the steps between two beats (reading a page of an
/// owner's tasks: its claim set's type and claims, the next claim's size, a window of it; or one settle attempt),
/// then the settler's backoff after a failure; or one final-failure hook. With the defaults (a pass every 5 s):
/// 50.1 s.
pub(crate) fn stall_bound(redis: &RedisConfig, interval: Duration) -> Duration {
    interval + redis.call_bound(4) + crate::retry::Backoff::MAX
}

/// One queue as the monitor watches it.
pub struct Watched {
    pub(crate) queue: Arc<QueueContext>,
    /// This monitor's settling identity on the queue (its calls are answered, not re-applied, after a lost reply).
    pub(crate) settler: Settler,
    /// How Redis's clock moved against this daemon's between two looks: a forward step defers recoveries.
    clock: ClockWatch,
    trouble: Trouble,
    /// When the queue's history sample was last offered; `None` before the first.
    sampled: Option<Instant>,
    history_trouble: Trouble,
}

impl Watched {
    pub fn new(queue: Arc<QueueContext>, settler: Settler) -> Watched {
        let trouble = Trouble::new("recovering expired leases", Some(&queue.config.name));
        let history_trouble =
            Trouble::new("writing the dashboard's history", Some(&queue.config.name));
        Watched {
            queue,
            settler,
            clock: ClockWatch::default(),
            trouble,
            sampled: None,
            history_trouble,
        }
    }
}

/// Redis's clock against this daemon's monotonic one, from one look at the owners to the next (review M2).
///
/// A lease is a deadline on Redis's clock, but its owner believes in it on its own monotonic clock: good until
/// a lease after its last renewal was sent. When Redis's clock steps forward (an NTP step after a VM resumed,
/// `chronyc makestep`, a failover to a host whose clock runs ahead), every deadline falls due at once, while
/// each owner may start the tasks it holds until its next claim or renewal, up to a third of the lease later,
/// shows it the step (`Ownership` in src/daemon/lane/ownership.rs: from then it starts none until a renewal
/// confirms its lease). Recovering their tasks on the spot would run them twice at once. So a forward step larger than
/// [`ClockWatch::margin`] is added to an allowance: an owner counts as expired only once its deadline plus the
/// allowance has passed, which is when its lease would have run out had the clock not stepped. The allowance
/// lasts one lease: by then every live owner has renewed on the new clock (or found its lease lost and stopped
/// starting tasks), and every owner whose deadline the step moved is past it anyway. A backward step only
/// lengthens the leases, as Redis counts them: recoveries come later, nothing runs twice. A monitor that
/// started after the step never saw it: the owners' own claims and renewals (a third of the lease) bound that
/// case.
#[derive(Debug, Default)]
struct ClockWatch {
    /// Redis's clock (ms) and this daemon's when the last look was sent.
    last: Option<(i64, Instant)>,
    /// How far Redis's clock stepped forward, in all, in the steps whose allowance still runs (ms).
    allowance_ms: i64,
    /// When the allowance ends.
    until: Option<Instant>,
}

impl ClockWatch {
    /// The jitter a step must exceed, as the daemon's own watch on its leases counts it ([`step_margin`]: a tenth
    /// of the lease, at least a second). A look here knows only when it was sent, so the time its reply waited (a
    /// slow Redis, a loaded machine) counts as jitter too; a false alarm only defers recoveries for a lease.
    fn margin(lease: Duration) -> i64 {
        i64::try_from(step_margin(lease).as_millis()).unwrap_or(i64::MAX)
    }

    /// Records a look sent at `sent` that read Redis's clock as `now_ms`; returns the allowance (ms) to add to
    /// every deadline now.
    fn observe(&mut self, now_ms: i64, sent: Instant, lease: Duration) -> i64 {
        if self.until.is_some_and(|until| sent >= until) {
            (self.allowance_ms, self.until) = (0, None);
        }
        if let Some((last_ms, last_sent)) = self.last {
            let local = i64::try_from(sent.saturating_duration_since(last_sent).as_millis())
                .unwrap_or(i64::MAX);
            let step = (now_ms - last_ms).saturating_sub(local);
            if step > ClockWatch::margin(lease) {
                self.allowance_ms = self.allowance_ms.saturating_add(step);
                self.until = Some(sent + lease);
                tracing::warn!(
                    step_ms = step,
                    "Redis's clock stepped forward (an NTP step, a resumed VM, a failover to a host whose clock \
                     runs ahead?): leases that ran out by the step alone are recovered only once they would have \
                     run out without it"
                );
            }
        }
        self.last = Some((now_ms, sent));
        self.allowance_ms
    }
}

/// An owner whose lease ran out, as its tasks are recovered.
struct Expired {
    owner: Arc<str>,
    /// The queue's keys at the levels the owner registered with.
    keys: broker::QueueKeys,
    /// The size of the quarantined group it ran with nothing else, if it ran one.
    group: Option<usize>,
    /// Redis's clock when its lease was seen expired.
    now_ms: i64,
}

pub struct Monitor {
    pub queues: Vec<Watched>,
    pub session: Session,
    /// Beaten every pass, before every Redis call that may start a step (its settlers beat every attempt) and
    /// before every final-failure hook, for the watchdog: a hook that never returns leaves it still.
    pub pulse: Pulse,
    pub plugins: Arc<Plugins>,
    pub background: Listener,
}

impl Monitor {
    /// How often to look: a quarter of the shortest lease, between 50 ms and 5 s.
    pub(crate) fn interval(queues: &[Watched]) -> Duration {
        let shortest = queues
            .iter()
            .map(|q| q.queue.config.lease_timeout)
            .min()
            .unwrap_or(Duration::from_secs(20));
        (shortest / 4).clamp(Duration::from_millis(50), Duration::from_secs(5))
    }

    pub(crate) fn run(mut self) {
        let interval = Monitor::interval(&self.queues);
        loop {
            self.pulse.beat();
            self.recover_now();
            self.sample_history();
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
                    self.session.reset();
                }
            }
        }
        recovered
    }

    /// Offers the history sample of each queue whose last offer is [`history::SAMPLE_EVERY`] old.
    fn sample_history(&mut self) {
        for watched in &mut self.queues {
            if watched
                .sampled
                .is_some_and(|at| at.elapsed() < history::SAMPLE_EVERY)
            {
                continue;
            }
            watched.sampled = Some(Instant::now());
            self.pulse.beat();
            let recorded = self
                .session
                .get()
                .and_then(|conn| history::record(conn, &watched.queue.keys));
            match recorded {
                Ok(_) => watched.history_trouble.recovered(),
                Err(error) => {
                    watched.history_trouble.failed(&error);
                    self.session.reset();
                }
            }
        }
    }

    fn recover_queue(&mut self, index: usize) -> broker::Result<usize> {
        self.pulse.beat();
        let queue = Arc::clone(&self.queues[index].queue);
        let sent = Instant::now();
        let (now_ms, owners) = broker::owners(self.session.get()?, &queue.keys)?;
        let allowance_ms =
            self.queues[index]
                .clock
                .observe(now_ms, sent, queue.config.lease_timeout);
        let mut recovered = 0;
        for (owner, deadline) in owners {
            if deadline.saturating_add(allowance_ms) > now_ms {
                continue;
            }
            self.pulse.beat();
            // The owner's own levels, whatever this daemon's config says (a rolling config change); an owner
            // registered by a kmqd that recorded none is taken to have this daemon's levels.
            let info = broker::owner_info(self.session.get()?, &queue.keys, &owner)?;
            let keys = match &info {
                Some(info) if info.levels != queue.keys.levels => {
                    queue.keys.with_levels(&info.levels)
                }
                _ => queue.keys.clone(),
            };
            let expired = Expired {
                owner: Arc::from(owner),
                keys,
                group: info.and_then(|info| info.group),
                now_ms,
            };
            for level in 0..expired.keys.levels() {
                let window = broker::processing::Window {
                    tasks: BATCH,
                    bytes: Some(broker::processing::Budget {
                        budget: WINDOW_BYTES,
                        largest: queue.config.max_task_bytes as u64,
                    }),
                };
                let mut cursor = broker::processing::Cursor::Start;
                loop {
                    self.pulse.beat();
                    let page = broker::processing::held(
                        self.session.get()?,
                        &expired.keys,
                        &expired.owner,
                        level,
                        cursor,
                        window,
                    )?;
                    if !page.tasks.is_empty() {
                        let Some((applied, refused)) =
                            self.recover_page(index, &queue, &expired, level, &page.tasks)
                        else {
                            return Ok(recovered);
                        };
                        recovered += applied;
                        // Another monitor is moving the same tasks: leave them to it. (Tasks Redis refused wait
                        // for the next pass; the windows after them go on.)
                        if applied == 0 && refused == 0 {
                            break;
                        }
                    }
                    match page.next {
                        Some(next) => cursor = next,
                        None => break,
                    }
                }
            }
            // A default-mode owner that died with unique tasks: their ids must not stay held for ever.
            let released =
                broker::release_unique(self.session.get()?, &queue.keys, &expired.owner)?;
            if released > 0 {
                tracing::warn!(queue = %queue.config.name, owner = %expired.owner, released, "released the unique ids of tasks lost with a default-mode daemon");
            }
            if broker::release(self.session.get()?, &expired.keys, &expired.owner, true)? {
                tracing::info!(queue = %queue.config.name, owner = %expired.owner, "forgot an owner whose lease ran out");
            }
        }
        if recovered > 0 {
            tracing::warn!(queue = %queue.config.name, recovered, "recovered tasks whose lease ran out");
        }
        Ok(recovered)
    }

    /// Recovers `held`, a page of an expired owner's tasks at one level; returns how many it recovered and how
    /// many Redis refused, or `None` when the daemon stopped while Redis was failing. A task whose record Redis
    /// refuses stays where it is, for the next pass (the settler logs it).
    fn recover_page(
        &mut self,
        index: usize,
        queue: &QueueContext,
        expired: &Expired,
        level: usize,
        held: &[(broker::TokenId, Box<[u8]>)],
    ) -> Option<(usize, usize)> {
        let keys = &expired.keys;
        let mut settlements: Vec<Settlement> = Vec::with_capacity(held.len());
        let mut hooks: Vec<Option<Box<DeadHook>>> = Vec::with_capacity(held.len());
        for (token, payload) in held {
            // The owner ran a quarantined task alone (claim.lua let it hold nothing else): the crash was its doing.
            let ran_alone = expired.group == Some(1);
            let (verdict, envelope) = queue.judge(payload, |envelope| {
                match queue.policy.too_old(envelope.created_at, expired.now_ms) {
                    Some(reason) => Verdict::Unrunnable { reason },
                    None => Verdict::LeaseExpired {
                        ran_alone,
                        recoveries: envelope.recovered,
                        crashes: envelope.crashes,
                    },
                }
            });
            let token = Token {
                owner: Arc::clone(&expired.owner),
                id: token.clone(),
            };
            let task = TaskParts {
                token: Some(token),
                popped_by: None,
                popped_scope: None,
                level,
                payload,
                envelope: envelope.as_ref(),
            };
            let (settlement, hook) = queue.settle(task, verdict, None);
            settlements.push(settlement);
            hooks.push(hook);
        }
        let watched = &mut self.queues[index];
        let report = watched.settler.settle(
            &mut self.session,
            keys,
            Fence::Expired,
            queue.config.dead_max,
            Holder::Claimed(&expired.owner),
            &settlements.iter().collect::<Vec<_>>(),
            &self.background,
        )?;
        let recovered = report
            .applied
            .iter()
            .filter(|ok| **ok == Some(true))
            .count();
        self.plugins.current().run_dead_hooks(
            &queue.config.name,
            hooks
                .iter()
                .map(Option::as_deref)
                .zip(report.applied.iter().copied()),
            || self.pulse.beat(),
        );
        Some((recovered, report.refused.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(6);

    #[test]
    fn a_forward_step_of_redis_clock_defers_recoveries_for_one_lease() {
        let mut clock = ClockWatch::default();
        let t0 = Instant::now();
        assert_eq!(clock.observe(1_000_000, t0, LEASE), 0);
        // 1.5 s later here, Redis's clock ran 1.5 s plus a step of 10 s.
        let t1 = t0 + Duration::from_millis(1500);
        assert_eq!(clock.observe(1_011_500, t1, LEASE), 10_000);
        // Still within a lease of the step: the allowance holds.
        let t2 = t1 + Duration::from_millis(4500);
        assert_eq!(clock.observe(1_016_000, t2, LEASE), 10_000);
        // A lease after the step: gone.
        let t3 = t1 + LEASE;
        assert_eq!(clock.observe(1_017_500, t3, LEASE), 0);
    }

    #[test]
    fn jitter_and_backward_steps_defer_nothing() {
        let mut clock = ClockWatch::default();
        let t0 = Instant::now();
        clock.observe(1_000_000, t0, LEASE);
        // A reply that waited 900 ms: under the margin of a second.
        let t1 = t0 + Duration::from_millis(1500);
        assert_eq!(clock.observe(1_002_400, t1, LEASE), 0);
        // Redis's clock stepped back 10 s.
        let t2 = t1 + Duration::from_millis(1500);
        assert_eq!(clock.observe(993_900, t2, LEASE), 0);
        assert_eq!(ClockWatch::margin(Duration::from_secs(60)), 6_000);
    }
}
