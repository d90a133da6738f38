//! The acker: one thread per queue that applies outcomes to Redis in batches (one settle script call for up to
//! [`MAX_SETTLE`] outcomes), then forgets the tasks, frees their capacity, and runs the final-failure hooks of
//! what was dead-lettered.
//!
//! An outcome is kept until Redis has answered for it: on a Redis error the same batch is sent again, as the same
//! call (see [`Settler`]), so a batch whose reply was lost is applied once and its hooks run once. Meanwhile the
//! tasks stay held (so the fetcher claims no more) and the heartbeat keeps the owner's lease alive. A batch Redis
//! refuses as sent (out of memory with the call's arguments counted, a record it cannot take) is split by the
//! settler down to the outcomes it refuses alone; those stay held, counted in `Lane::refused_outcomes` (the
//! metric `kmqd_daemon_refused_outcomes`, the status line) and logged, and are tried again alone, after a wait
//! that doubles from [`REFUSED_WAIT_FIRST`] to [`REFUSED_WAIT_MAX`], while the lane's other outcomes settle
//! (review M8).
//!
//! Small settles cost Redis nearly as much as large ones (the script's fixed part), and on a busy host each is a
//! Redis run that preempts a worker. So after a settle, while at least [`LINGER_BELOW`] claimed tasks wait for a
//! worker (so that holding back the capacity a settle frees starves no worker), the acker sleeps before it takes
//! the next batch (at most [`LINGER`] × [`MAX_LINGERS`]) while fewer outcomes have gathered than the next settle
//! should carry: [`LINGER_BELOW`], or what lets the fetcher claim its next batch, if more. A settle that frees
//! less than a claim's worth only makes the next settle come sooner, so with the lingers a busy lane makes about
//! one settle per claim. The acker sleeps rather than waits for outcomes, so the workers' sends do not wake it,
//! and it sleeps as long as the outcomes' rate says a settle's worth takes to gather: about two timer wake-ups
//! per settle (docs/PERFORMANCE.md, "Settles gather while workers are busy" and "The acker's lingers, timed").
//!
//! At a running limit (the queue's `max_running`, or a type's) in safe mode, the acker's settle hands the slots it
//! frees over to the next tasks (docs/design/flow-control.md, "The slot handed over in the settle"): it asks, in
//! the same script step, for up to as many tasks as it settles (the workers that ran them are free, and the
//! lane's capacity holds them still: [`Capacity::in_place_of`](super::capacity::Capacity::in_place_of)), under a
//! claim number of the fetcher's numbering, and gives what the settle claimed to the workers as the fetcher gives
//! its claims' ([`jobs::Sender::dispatch`]). The slot then passes from one task to the next without the wake-up
//! marker's relay to a fetcher and its claim's round trip. A queue without such a limit sends plain settles.
//!
//! The acker stops once the lane is drained: the fetcher has stopped and every task it claimed is settled. Every
//! held task is resolved exactly once (by its worker, a timeout, a hand-back or a lost lease), so every held task
//! sends the outcome the acker waits for; a worker stuck in a handler does not hold it up.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Lane;
use super::fetcher::watch_clock;
use super::jobs;
use super::progress::FLUSH_EVERY;
use super::resolve::{Apply, Resolution};
use crate::broker::progress::{self, Report};
use crate::broker::{Fence, Handover, Holder, Session, Settlement, Token, TokenId};
use crate::config::Mode;
use crate::config::RedisConfig;
use crate::plugin::Plugins;
use crate::settler::Settler;
use crate::shutdown::Listener;

/// The most resolutions one settle.lua call applies. Not `config::MAX_TAKE`, the most tasks one call takes.
pub const MAX_SETTLE: usize = 1000;

/// How often an idle acker looks whether the lane is drained (and beats its pulse).
pub const IDLE_CHECK: Duration = Duration::from_millis(50);

/// The fewest outcomes a settle gathers while this many tasks wait for a worker; the lingers stop below it.
pub const LINGER_BELOW: usize = 64;

/// How long the acker lets outcomes gather after a settle, before it looks again.
pub const LINGER: Duration = Duration::from_micros(500);

/// The most lingers after one settle: an outcome waits at most 10 ms longer for its settle. A claim of a 50 µs
/// handler's lane on two workers takes about 200 tasks, 5 ms of their work.
pub const MAX_LINGERS: usize = 20;

/// How long a refused outcome waits before it is tried again, at first, and at most.
pub const REFUSED_WAIT_FIRST: Duration = Duration::from_secs(1);
pub const REFUSED_WAIT_MAX: Duration = Duration::from_secs(60);

/// How long the acker may go without a beat of its pulse before the watchdog counts it as wedged: waiting for an
/// outcome, then one settle attempt (and a redirect), then its lingers or the backoff before the next. With the
/// defaults (`connect_timeout` 5 s, `io_timeout` 10 s, `wait_timeout` 100 ms): 30.16 s.
pub fn stall_bound(redis: &RedisConfig) -> Duration {
    IDLE_CHECK + redis.call_bound(2) + crate::retry::Backoff::MAX + LINGER * MAX_LINGERS as u32
}

pub struct Acker {
    pub lane: Arc<Lane>,
    pub plugins: Arc<Plugins>,
    pub session: Session,
    pub settler: Settler,
    /// Fires when the daemon gives up waiting: the acker stops even if Redis keeps failing.
    pub background: Listener,
    /// Fires when the lane stops claiming: no settle hands slots over any more, and what one still in flight
    /// claimed is handed back.
    claiming: Listener,
    /// To the lane's workers, beside the fetcher: the tasks a settle claimed for the slots it freed.
    jobs: jobs::Sender,
    /// Whether this lane's settles hand their slots over: safe mode, and a running limit that a settle frees
    /// slots of (the queue's `max_running` or a type's). Decided once: a lane without one does no work per
    /// settle for it.
    hands_over: bool,
    /// Outcomes Redis refused, each alone in its call: held until it takes them.
    refused: Vec<Resolution>,
    /// When they are tried again (`None`: not scheduled yet), and the wait after that.
    refused_due: Option<Instant>,
    refused_wait: Duration,
    /// When the lane's progress reports were last written (`progress::FLUSH_EVERY` apart at least).
    progress_written: Instant,
}

impl Acker {
    pub fn new(
        lane: Arc<Lane>,
        plugins: Arc<Plugins>,
        session: Session,
        settler: Settler,
        background: Listener,
        claiming: Listener,
        jobs: jobs::Sender,
    ) -> Acker {
        let config = &lane.queue.config;
        let hands_over = config.mode == Mode::Safe
            && (config.max_running.is_some()
                || config.type_limits.iter().any(|t| t.max_running.is_some()));
        Acker {
            claiming,
            jobs,
            hands_over,
            lane,
            plugins,
            session,
            settler,
            background,
            refused: Vec::new(),
            refused_due: None,
            refused_wait: REFUSED_WAIT_FIRST,
            progress_written: Instant::now(),
        }
    }

    pub fn run(mut self) {
        let mut taken = Vec::with_capacity(64);
        'lane: loop {
            self.lane.acker_pulse.beat();
            if self.lane.progress.waiting() && self.progress_written.elapsed() >= FLUSH_EVERY {
                self.write_progress();
            }
            if self.lane.outcomes.take(&mut taken, IDLE_CHECK) {
                // At most MAX_SETTLE a settle, in the order they came. Each outcome is moved once: draining a
                // prefix moved the whole tail each time (callgrind: a no-op drain's largest memcpy).
                if taken.len() > MAX_SETTLE {
                    let mut all = std::mem::take(&mut taken).into_iter();
                    loop {
                        let mut batch: Vec<Resolution> = all.by_ref().take(MAX_SETTLE).collect();
                        if all.len() == 0 {
                            // The last batch is settled below, and its allocation kept for the next take.
                            taken = batch;
                            break;
                        }
                        if !self.settle(&mut batch) {
                            break 'lane;
                        }
                    }
                }
                // Emptied by the settle, its allocation is what the next take swaps in.
                if !self.settle(&mut taken) {
                    break;
                }
                self.linger();
            }
            if !self.refused.is_empty() {
                // Held until Redis takes them, or the daemon gives up on them (its shutdown's last stage).
                if self.background.is_triggered() || !self.retry_refused() {
                    break;
                }
            }
            if self.lane.drained() {
                break;
            }
        }
        let left = self.lane.capacity.held();
        if left > 0 {
            tracing::error!(
                queue = %self.lane.name(),
                left,
                "stopping with unsettled outcomes: safe-mode tasks run again once their lease expires"
            );
        } else {
            tracing::debug!(queue = %self.lane.name(), "acker stopped");
        }
    }

    /// Writes the latest progress report of each task of the lane that reported since the last write: one
    /// progress.lua call per owner (nearly always one), fenced by the owner's lease. Best effort: a report whose
    /// call fails is dropped (the task's next report takes its place), and the settles go on.
    fn write_progress(&mut self) {
        self.progress_written = Instant::now();
        let reports = self.lane.progress.take();
        let mut by_owner: Vec<(Arc<str>, Vec<Report>)> = Vec::with_capacity(1);
        for (job, task) in self.lane.held.some(reports.keys().copied()) {
            // Default mode holds no claim list to fence a report by: its tasks report nothing.
            let Some(Token {
                owner,
                id: TokenId::Listed { claim, position },
            }) = &task.token
            else {
                continue;
            };
            let (fraction, message) = &reports[&job];
            let report = Report {
                level: task.level,
                claim: *claim,
                position: *position,
                fraction: *fraction,
                message: message.clone(),
            };
            match by_owner.iter_mut().find(|(o, _)| o == owner) {
                Some((_, listed)) => listed.push(report),
                None => by_owner.push((Arc::clone(owner), vec![report])),
            }
        }
        for (owner, reports) in by_owner {
            let written = self
                .session
                .get()
                .and_then(|conn| progress::report(conn, &self.lane.queue.keys, &owner, &reports));
            if let Err(error) = written {
                tracing::debug!(queue = %self.lane.name(), %error, "progress reports not written");
                self.session.reset();
            }
        }
    }

    /// Lets outcomes gather after a settle, at most [`LINGER`] × [`MAX_LINGERS`] in all, while fewer outcomes are
    /// queued than the next settle should carry and at least [`LINGER_BELOW`] tasks wait for a worker. The first
    /// sleep is a [`LINGER`]; each later one lasts until, at the rate outcomes came in during the one before, a
    /// settle's worth has gathered or the tasks waiting for a worker are down to [`LINGER_BELOW`], whichever
    /// comes first: so the workers stay fed, and a busy lane's acker wakes about twice per settle rather than
    /// every [`LINGER`] (each wake-up on a busy host preempts a worker; docs/PERFORMANCE.md, "The acker's
    /// lingers, timed").
    fn linger(&self) {
        let deadline = Instant::now() + LINGER * MAX_LINGERS as u32;
        let mut last: Option<(usize, Instant)> = None;
        loop {
            let (queued, worth, waiting) = (
                self.lane.outcomes.queued(),
                self.worth_a_settle(),
                self.waiting(),
            );
            let now = Instant::now();
            if queued >= worth || waiting < LINGER_BELOW || now >= deadline {
                return;
            }
            let pause = match last {
                Some((before, then)) if queued > before && now > then => {
                    let per_second = (queued - before) as f64 / (now - then).as_secs_f64();
                    let outcomes = (worth - queued).min(waiting - LINGER_BELOW);
                    Duration::from_secs_f64(outcomes as f64 / per_second).max(LINGER)
                }
                _ => LINGER,
            };
            last = Some((queued, now));
            std::thread::sleep(pause.min(deadline - now));
        }
    }

    /// How many outcomes the next settle should carry: [`LINGER_BELOW`], or as many as the fetcher still needs
    /// freed before it claims its next batch, if more (at most what one settle takes).
    fn worth_a_settle(&self) -> usize {
        LINGER_BELOW
            .max(self.lane.capacity.short_of_a_claim())
            .min(MAX_SETTLE)
    }

    /// At least how many claimed tasks wait for a worker: the lane holds each task from its claim to its settle,
    /// and of those at most one per worker runs, and the queued outcomes wait for this acker.
    fn waiting(&self) -> usize {
        let held = self.lane.capacity.held();
        held.saturating_sub(self.lane.queue.config.workers + self.lane.outcomes.queued())
    }

    /// Applies a batch and empties it; false when the daemon gave up on Redis before it was applied. An outcome
    /// Redis refuses (alone in its call: `settler.rs`) moves to [`Acker::refused`], still held.
    fn settle(&mut self, batch: &mut Vec<Resolution>) -> bool {
        // One script call per owner (nearly always one: a daemon claims under a new owner only after losing its
        // lease); forgotten tasks need no call at all.
        let mut holders: Vec<Holder<'_>> = Vec::with_capacity(1);
        for settlement in batch.iter().filter_map(Resolution::settlement) {
            let holder = Holder::of(settlement);
            if !holders.contains(&holder) {
                holders.push(holder);
            }
        }
        let mut refused = vec![false; batch.len()];
        // Tasks the settles claimed in the place of those they settled (handed over; held already).
        let mut claimed = 0;
        for holder in holders {
            let (at, group): (Vec<usize>, Vec<&Resolution>) = batch
                .iter()
                .enumerate()
                .filter(|(_, o)| o.settlement().is_some_and(|s| Holder::of(s) == holder))
                .unzip();
            let Some((left_out, handed_over)) = self.settle_owned(holder, &group) else {
                return false;
            };
            claimed += handed_over;
            for position in left_out {
                refused[at[position]] = true;
            }
        }
        let lane = &self.lane;
        let mut settled = 0;
        let mut kept = Vec::new();
        for (outcome, refused) in batch.drain(..).zip(refused) {
            if refused {
                kept.push(outcome);
            } else {
                settled += 1;
                lane.held.remove([outcome.job]);
            }
        }
        // The tasks are settled: their capacity may be claimed again, less what the settles claimed in their
        // place. Releasing only now bounds what the daemon holds, outcomes waiting for Redis included.
        lane.capacity.settled(settled, claimed);
        self.refused.extend(kept);
        lane.refused_outcomes
            .store(self.refused.len(), std::sync::atomic::Ordering::Release);
        true
    }

    /// Tries the refused outcomes again once their wait is over: apart from the new ones, so that a refusal costs
    /// them nothing, and each alone. The wait doubles while Redis keeps refusing them all, up to
    /// [`REFUSED_WAIT_MAX`]; false when the daemon gave up on Redis meanwhile.
    fn retry_refused(&mut self) -> bool {
        let Some(due) = self.refused_due else {
            if !self.refused.is_empty() {
                self.refused_wait = REFUSED_WAIT_FIRST;
                self.refused_due = Some(Instant::now() + self.refused_wait);
            }
            return true;
        };
        if Instant::now() < due {
            return true;
        }
        let mut again = std::mem::take(&mut self.refused);
        let before = again.len();
        // Smallest first, each alone: after reading a large argument Redis keeps a buffer as large on the
        // connection for a moment, which a small outcome sent right after a refused large one would find still
        // counted against maxmemory; an outcome refused only for being next to a large one goes through here.
        again.sort_by_key(|outcome| outcome.settlement().map_or(0, |s| s.payload.len()));
        for outcome in again {
            if !self.settle(&mut vec![outcome]) {
                return false;
            }
        }
        self.refused_due = if self.refused.is_empty() {
            tracing::info!(queue = %self.lane.name(), outcomes = before, "Redis took the outcomes it refused before");
            None
        } else {
            if self.refused.len() >= before {
                self.refused_wait = (self.refused_wait * 2).min(REFUSED_WAIT_MAX);
            }
            Some(Instant::now() + self.refused_wait)
        };
        true
    }

    /// Settles `group` (of one holder); returns the positions in it of the outcomes Redis refused and how many
    /// tasks the settle claimed in their place (given to the workers, held, not yet counted in the capacity), or
    /// `None` when the daemon gave up on Redis first.
    fn settle_owned(
        &mut self,
        holder: Holder<'_>,
        group: &[&Resolution],
    ) -> Option<(Vec<usize>, usize)> {
        let lane = &self.lane;
        let queue = &lane.queue;
        // Every outcome of the group has a settlement (the caller picked them by it).
        let settlements: Vec<&Settlement> = group.iter().filter_map(|o| o.settlement()).collect();
        let handing_over = match holder {
            Holder::Claimed(_) if self.hands_over && !self.claiming.is_triggered() => {
                // The current owner's tasks only (a lost owner's settle would claim nothing), for the workers
                // that ran them.
                lane.ownership
                    .current()
                    .filter(|owner| Holder::Claimed(owner) == holder)
                    .map(|owner| (owner, lane.capacity.in_place_of(settlements.len())))
                    .filter(|(_, max)| *max > 0)
            }
            _ => None,
        };
        let (report, claimed) = match handing_over {
            None => {
                let report = self.settler.settle(
                    &mut self.session,
                    &queue.keys,
                    Fence::Owner,
                    queue.config.dead_max,
                    holder,
                    &settlements,
                    &self.background,
                )?;
                (report, 0)
            }
            Some((owner, max)) => {
                let limits = queue.claim_limits();
                let handover = Handover {
                    // Numbered as the fetcher's claims are, from the same counter: a number used twice would be
                    // fenced inside the script, and the claim would take nothing.
                    claim: lane.ownership.tokens(max),
                    max,
                    limits: &limits,
                };
                let sent = Instant::now();
                let (report, batch) = self.settler.settle_handing_over(
                    &mut self.session,
                    &queue.keys,
                    queue.config.dead_max,
                    &owner,
                    &settlements,
                    &handover,
                    &self.background,
                )?;
                let claimed = batch.map_or(0, |batch| {
                    // The claim bumped the owner's journal exactly when it took tasks, beside the settle's bump;
                    // one answer per call (a copy sent again answers the stored claim), counted once.
                    if !batch.tasks.is_empty() {
                        lane.ownership.bumped(&owner);
                    }
                    watch_clock(lane, &owner, sent, &batch);
                    let claimed = batch.tasks.len();
                    self.jobs
                        .dispatch(lane, batch, self.claiming.is_triggered());
                    claimed
                });
                (report, claimed)
            }
        };
        if let Holder::Claimed(owner) = holder {
            // Each call's answer (the first, or the stored one to a call sent again): one bump, counted once.
            for _ in 0..report.journaled {
                lane.ownership.bumped(owner);
            }
        }
        let stale = report.stale_acks
            + report
                .applied
                .iter()
                .filter(|ok| **ok == Some(false))
                .count();
        if stale > 0 && matches!(holder, Holder::Claimed(_)) {
            tracing::warn!(
                queue = %queue.config.name,
                stale,
                "outcomes arrived after their lease expired; a monitor had already queued those tasks again"
            );
        } else if stale > 0 {
            // Default mode: only a unique task's record is ever refused (settle.lua, "Unique ids").
            tracing::warn!(
                queue = %queue.config.name,
                stale,
                "unique tasks were not queued again: a monitor freed their ids when their owner's lease ran out, \
                 and newer tasks with those ids hold them now"
            );
        }
        let hooks = group.iter().map(|outcome| match &outcome.apply {
            Apply::Settle { dead_hook, .. } => dead_hook.as_deref(),
            Apply::Forget => None,
        });
        self.plugins.current().run_dead_hooks(
            &queue.config.name,
            hooks.zip(report.applied.iter().copied()),
            || lane.acker_pulse.beat(),
        );
        Some((report.refused, claimed))
    }
}
