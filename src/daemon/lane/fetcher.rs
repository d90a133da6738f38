//! The fetcher: one thread per queue that takes tasks from Redis for the queue's workers.
//!
//! It claims only what the lane's [`Capacity`](super::capacity::Capacity) allows, so what the daemon holds stays
//! bounded; and it claims in batches: it waits until `batch` tasks (or half the bound) may be claimed, unless the
//! workers run out of work first. In safe mode it claims under this daemon's owner (registered on the first
//! claim, and again after a lost lease). When the queue is empty it blocks in Redis (safe mode: on the wake-up
//! list that every enqueue path touches; default mode: on the ready lists themselves) for at most `idle_poll`,
//! which also bounds how long shutdown waits for it; its next claim or pop is sent behind the blocking call, in the
//! same write, so that Redis runs it as soon as a push ends the wait (a reply lost is then a claim's or a pop's,
//! resolved as any other).
//!
//! A paused queue (`kmqd queue pause`, the key `PREFIX:{Q}:paused`) is checked by the claim or pop itself, in
//! the same atomic step as the take: a claim that runs after the pause takes nothing. The fetcher then sleeps
//! `idle_poll` in-process before it looks again (a blocking wait would return at once on a queue whose lists
//! hold tasks, and spin), so a resume is noticed within `idle_poll`, and a pause within one fetch (a claim or
//! pop that Redis ran before the pause may still bring tasks, which run and settle normally).
//!
//! A safe-mode claim whose reply is lost (a reset, a stall past the read timeout) is resolved, not guessed: the
//! fetcher knows its owner and tokens, and [`broker::adopt`] hands it what the claim took, or fences the claim
//! off if it has not run yet, so no task is left claimed by nobody. Until then the claim's capacity stays taken.
//!
//! Once the daemon stops claiming, whatever a claim still in flight brings back is handed back at once, never
//! given to a worker; then the fetcher marks the lane so and drops its end of the job queue, which is how the
//! workers learn that no more work comes. A lane a reload retired (the daemon goes on) first adopts a claim whose reply
//! was lost, however long Redis takes to answer, and hands back what it took: nothing bounds a retired lane's
//! end, and once it ended its owner's lease is renewed no more, so those tasks would otherwise wait a whole
//! `lease_timeout` in the processing area, then run as recovered. A stopping daemon does not wait for that: they
//! come back through the lease.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Lane;
use super::depth::Depth;
use super::jobs;
use super::ownership::Exchange;
use crate::broker::{self, Batch, BrokerError, Isolation, LeaseClock, Limited, OwnerInfo, Session};
use crate::config::{Mode, Prefetch};
use crate::observed;
use crate::retry::{Backoff, Trouble};
use crate::shutdown::Listener;

/// The smallest claim (tokens sent) after an empty or small one.
const MIN_CLAIM: usize = 16;

/// How often a fetcher waiting to run a quarantined group looks whether its lane holds nothing any more.
const ISOLATION_POLL: Duration = Duration::from_millis(5);

/// How long the fetcher waits for capacity before it looks at the shutdown flag again (and beats its pulse).
pub const CAPACITY_WAIT: Duration = Duration::from_millis(200);

pub struct Fetcher {
    lane: Arc<Lane>,
    session: Session,
    /// Fires when the lane stops claiming (the shutdown, or a reload that retires the lane).
    claiming: Listener,
    /// Fires when the daemon shuts down: a claim whose reply was lost is no longer adopted.
    shutdown: Listener,
    /// To the queue's workers. Dropped when this thread ends, which is how workers learn no more work comes.
    jobs: jobs::Sender,
    /// How many tasks the next safe-mode claim asks for at most (see `claim`).
    claim_size: usize,
    /// The prefetch's controller, when the config leaves `prefetch` to the lane.
    depth: Option<Depth>,
    /// Safe mode: an owner id chosen but not yet known to be registered (a register whose reply was lost is sent
    /// again with the same id, and registers it once).
    registering: Option<Arc<str>>,
    /// Safe mode: a claim whose reply was lost. Its capacity stays reserved until adopted.
    lost_claim: Option<LostClaim>,
    /// Default mode: pops, plain or through pop.lua (whichever the queue's unique ids allow).
    popper: broker::Popper,
    /// What this daemon registers about each of its owners.
    info: OwnerInfo,
    trouble: Trouble,
    /// Whether the last fetch found the queue paused (to log the change once, not every `idle_poll`).
    paused: bool,
    /// Which limit held the last claim back, if one did (likewise).
    limited: Option<&'static str>,
    /// The queue's name, as the metric of fetches held back labels it.
    queue: Arc<str>,
    /// Safe mode: the types whose flows hold tasks that this config does not limit (another config's flows, or
    /// this one's before a reload): its claims drain them (broker::flows).
    drained: Vec<String>,
    /// When the flows were last looked at (`None`: not yet): at the lane's start, then every [`FLOWS_LOOK`].
    flows_looked: Option<Instant>,
    /// Safe mode: the last claim filled the queue's `max_running`, or found it full, so the next claim waits in
    /// Redis for a settle's wake-up marker (`broker::claim_after_wake`): a claim sooner would take nothing (a
    /// script's run and a round trip per task at the limit), and one sent after the marker came back would start
    /// a round trip later (docs/PERFORMANCE.md, "Limits: `max_running` and `rate_limit`").
    running_full: bool,
    /// The last fetch found nothing to take (and no limit holding tasks back past a known time): the next one
    /// first waits in Redis up to this long for a push, in the same write as its claim or pop, so that Redis runs
    /// the take as soon as the push ends the wait, a round trip and a wake-up of this thread sooner than a take
    /// sent once the wait's reply came (docs/PERFORMANCE.md, "Push to start on an idle queue").
    idle_wait: Option<Duration>,
}

/// How often a lane looks for flows its config does not limit (a rolling change that removed a type's limit, or
/// a reload): their tasks wait at most about this long for a daemon of the new config.
const FLOWS_LOOK: Duration = Duration::from_secs(60);

/// The owner and the tokens of a claim whose reply never came.
#[derive(Debug)]
struct LostClaim {
    owner: Arc<str>,
    first_token: u64,
    count: usize,
}

impl Fetcher {
    pub fn new(
        lane: Arc<Lane>,
        session: Session,
        claiming: Listener,
        shutdown: Listener,
        jobs: jobs::Sender,
    ) -> Fetcher {
        let config = &lane.queue.config;
        let info = OwnerInfo {
            mode: config.mode.as_str().to_string(),
            levels: config.priorities.clone(),
            host: broker::hostname(),
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            started_at_ms: broker::local_now_ms(),
            group: None,
            draining: false,
            stuck: None,
        };
        let trouble = Trouble::new("fetching tasks", Some(&config.name));
        let queue = Arc::from(config.name.as_str());
        let depth = (config.prefetch == Prefetch::Auto)
            .then(|| Depth::new(config.max_held - config.workers, &lane.idle, Instant::now()));
        Fetcher {
            claim_size: config.batch,
            depth,
            lane,
            session,
            claiming,
            shutdown,
            jobs,
            registering: None,
            lost_claim: None,
            popper: broker::Popper::default(),
            info,
            trouble,
            paused: false,
            limited: None,
            queue,
            drained: Vec::new(),
            flows_looked: None,
            running_full: false,
            idle_wait: None,
        }
    }

    pub fn run(mut self) {
        let mut backoff = Backoff::new();
        while !self.claiming.is_triggered() {
            self.lane.fetcher_pulse.beat();
            if self.lost_claim.is_some() {
                if !self.adopt_lost_claim() && backoff.wait(&self.claiming) {
                    break;
                }
                continue;
            }
            let lane = Arc::clone(&self.lane);
            // Claim a batch's worth at once, or whatever is free when the workers run dry; never more than a batch,
            // which bounds a default-mode pop too: it asks for all it reserved (review L7).
            let free = lane
                .capacity
                .acquire(lane.queue.config.batch, CAPACITY_WAIT, || {
                    self.jobs.is_empty()
                });
            if free == 0 {
                continue;
            }
            let asked = self.asks_for(free);
            match self.fetch(free) {
                Ok(batch) => {
                    backoff.reset();
                    self.trouble.recovered();
                    let taken = batch.tasks.len();
                    if !batch.paused {
                        // What is left for the workers as the claim's tasks arrive: the low point of the cycle.
                        self.adapt((self.jobs.len(), asked, taken));
                    }
                    if taken > free {
                        // The scripts never return more than asked; if Redis did, run them all anyway (they are
                        // claimed) and let the count recover as they are settled.
                        tracing::error!(queue = %lane.name(), taken, free, "claim returned more tasks than asked");
                    }
                    lane.capacity.release(free.saturating_sub(taken));
                    self.jobs
                        .dispatch(&self.lane, batch, self.claiming.is_triggered());
                }
                Err(error) => {
                    // A claim whose reply was lost keeps its capacity until adopted.
                    let kept = self.lost_claim.as_ref().map_or(0, |lost| lost.count);
                    lane.capacity.release(free - kept);
                    self.trouble.failed(&error);
                    self.session.reset();
                    if backoff.wait_unless_first(&self.claiming) {
                        break;
                    }
                }
            }
        }
        // Retired by a reload: what the lost claim took is adopted, and handed back (`jobs::Sender::dispatch`, stopping).
        let mut backoff = Backoff::new();
        while self.lost_claim.is_some() && !self.shutdown.is_triggered() {
            self.lane.fetcher_pulse.beat();
            if !self.adopt_lost_claim() && backoff.wait(&self.shutdown) {
                break;
            }
        }
        if let Some(lost) = self.lost_claim.take() {
            // Stopping while Redis fails: the lost claim's tasks, if it took any, return through the lease.
            self.lane.capacity.release(lost.count);
        }
        self.lane.fetcher_stopped();
        tracing::debug!(queue = %self.lane.name(), "fetcher stopped");
    }

    /// An adaptive prefetch watches each fetch (tasks still waiting for a worker when it returned, `asked`,
    /// `taken`).
    fn adapt(&mut self, fetch: (usize, usize, usize)) {
        let Some(depth) = &mut self.depth else {
            return;
        };
        let lane = &self.lane;
        if let Some(change) = depth.fetched(&lane.capacity, &lane.idle, fetch, Instant::now()) {
            tracing::debug!(
                queue = %lane.name(),
                from = change.from,
                to = change.to,
                idle = format!("{:.1}%", change.idle * 100.0),
                low_water = change.low_water,
                "prefetch adapted"
            );
        }
    }

    /// How many tasks a fetch asks for when `free` may be claimed (at most `batch`: `run` reserves no more, so a
    /// pop's one call is bounded like a claim's, whatever `max_held` is): all of them for a pop, at most
    /// `claim_size` for a safe-mode claim.
    fn asks_for(&self, free: usize) -> usize {
        match self.lane.queue.config.mode {
            Mode::Safe => free.min(self.claim_size),
            Mode::Default => free,
        }
    }

    /// Takes up to `free` tasks; when none is ready, waits up to `idle_poll` for one.
    fn fetch(&mut self, free: usize) -> broker::Result<Batch> {
        let Some(owner) = self.owner()? else {
            return Ok(Batch::default());
        };
        let batch = match self.lane.queue.config.mode {
            Mode::Safe => self.claim(owner, free)?,
            Mode::Default => self.pop(owner, free)?,
        };
        if batch.paused != self.paused {
            self.paused = batch.paused;
            let queue = self.lane.name();
            if batch.paused {
                tracing::info!(%queue, "queue paused: taking no task until it is resumed");
            } else {
                tracing::info!(%queue, "queue resumed");
            }
        }
        if batch.paused {
            // Not a blocking wait in Redis: the lists may hold tasks, and BLMOVE would return at once.
            self.claiming.wait(self.lane.queue.config.idle_poll);
        }
        let limited = batch.limited.map(Limited::name);
        if let Some(limit) = limited {
            observed::held_back(&self.queue, limit);
        }
        if limited != self.limited {
            // At debug: a busy limited queue is held back and let go many times a second.
            let queue = self.lane.name();
            match limited {
                Some(limit) => tracing::debug!(%queue, limit, "queue held back by a limit"),
                None => tracing::debug!(%queue, limit = self.limited, "queue no longer held back"),
            }
            self.limited = limited;
        }
        if let Some(retry_at_ms) = batch.limited.and_then(Limited::retry_at_ms) {
            // Until the window's oldest start ages out, or the throttle ends, by Redis's clock (the reply carries
            // both times).
            let wait = u64::try_from(retry_at_ms.saturating_sub(batch.now_ms)).unwrap_or(0);
            self.claiming.wait(Duration::from_millis(wait.max(1)));
        }
        Ok(batch)
    }

    /// This daemon's owner on the queue, registered first if there is none (`None`: a registration refused, try
    /// again with a new id).
    fn owner(&mut self) -> broker::Result<Option<Arc<str>>> {
        let lane = Arc::clone(&self.lane);
        if let Some(owner) = lane.ownership.current() {
            return Ok(Some(owner));
        }
        let queue = &lane.queue;
        let owner = self
            .registering
            .get_or_insert_with(|| lane.ownership.new_id())
            .clone();
        let sent = Instant::now();
        let registered = broker::register(
            self.session.get()?,
            &queue.keys,
            &owner,
            queue.config.lease_timeout,
            &self.info,
        )?;
        let answered = Instant::now();
        self.registering = None;
        // Refused: its first registration went through and its lease ran out before this retry.
        let Some(lease) = registered else {
            return Ok(None);
        };
        tracing::info!(queue = %queue.config.name, %owner, "serving as a new owner");
        lane.ownership
            .set(Arc::clone(&owner), Exchange { sent, answered }, lease);
        Ok(Some(owner))
    }

    /// Default mode: pops up to `free` tasks; when none is ready, waits up to `idle_poll` for a push (and takes
    /// it on the next round).
    fn pop(&mut self, owner: Arc<str>, free: usize) -> broker::Result<Batch> {
        let lane = Arc::clone(&self.lane);
        let queue = &lane.queue;
        let connection = self.session.get()?;
        if self
            .flows_looked
            .is_none_or(|looked| looked.elapsed() >= FLOWS_LOOK)
        {
            // The flows another config's type limits left tasks in (a reload, a rolling change, or a queue
            // served in safe mode before): popped as unlimited tasks, by pop.lua.
            let flows = broker::flows::flows(connection, &queue.keys)?;
            self.drained = broker::flows::drained(&flows, &queue.config.type_limits, false);
            self.flows_looked = Some(Instant::now());
        }
        let limits = broker::PopLimits {
            max_running: queue.config.max_running,
            rate_limit: &queue.config.rate_limit,
            priority_weights: &queue.config.priority_weights,
            type_limits: &queue.config.type_limits,
            drained_flows: &self.drained,
            foreign_type_field: queue.config.foreign_type_field.as_deref(),
        };
        // Claiming stopped meanwhile: no wait, the round ends at once.
        let wait = (self.idle_wait.take())
            .filter(|_| !self.claiming.is_triggered())
            .map(|wait| (wait, queue.io_timeout));
        let popped = self
            .popper
            .pop(connection, &queue.keys, &owner, free, limits, wait);
        match &popped {
            Ok(batch)
                if batch.tasks.is_empty()
                    && !batch.paused
                    && batch.limited.is_none()
                    && !self.claiming.is_triggered() =>
            {
                self.idle_wait = Some(queue.config.idle_poll);
            }
            Ok(Batch {
                tasks,
                limited: Some(limited @ (Limited::Running | Limited::Types { .. })),
                now_ms,
                ..
            }) if tasks.is_empty() && !self.claiming.is_triggered() => {
                // A full running count (the queue's or a type's), or types held back: a settle that frees a slot
                // pushes a wake-up marker, as does a push; a type's rate window lets a start go at its time.
                // Popping again at once would only spin on pop.lua until then.
                let mut wait = queue.config.idle_poll;
                if let Limited::Types { retry_at_ms } = limited
                    && *retry_at_ms > 0
                {
                    let until = u64::try_from(retry_at_ms.saturating_sub(*now_ms)).unwrap_or(0);
                    wait = wait.min(Duration::from_millis(until.max(1)));
                }
                broker::wait_wake(connection, &queue.keys, wait, queue.io_timeout)?;
            }
            Err(BrokerError::LeaseLost { owner }) => {
                // pop.lua takes nothing under an owner whose lease ran out (the monitors may have released its
                // unique ids): pop under a new one.
                self.lost_lease(owner);
                return Ok(Batch::default());
            }
            Err(error) if error.may_have_run() => {
                // The unique ids it took are recorded as held by this owner, and its running slots counted under
                // its share, and nothing would give them back while it lives (the ids were refused as duplicates
                // for the daemon's life, review M4): it is given up (renewed no more), so that its lease runs out
                // and a monitor releases both (release_unique.lua, release.lua); the next pop registers a new
                // owner. Tasks held from its earlier pops settle against it meanwhile; those not started yet
                // that hold a unique id or a running slot under it are handed back (the worker's lease check).
                lane.ownership.lose(&owner);
                tracing::error!(
                    queue = %lane.name(),
                    %error,
                    %owner,
                    "a pop's reply was lost: the tasks it took, if any, are lost (default mode is at most once); \
                     their unique ids and running slots come back when this owner's lease runs out"
                );
            }
            _ => {}
        }
        popped
    }

    /// Safe mode: claims up to `free` tasks under `owner`; when none is ready, waits up to `idle_poll` for a
    /// wake-up marker.
    fn claim(&mut self, owner: Arc<str>, free: usize) -> broker::Result<Batch> {
        let lane = Arc::clone(&self.lane);
        let queue = &lane.queue;
        // Ask for twice what the last claim got (at least MIN_CLAIM), so an idle queue's claims stay small and a
        // backlog's double up to the free capacity within a few round trips. The claim is numbered by the first
        // of the `want` numbers it reserves (its tasks' tokens are positions in its lists).
        let want = self.asks_for(free);
        let connection = self.session.get()?;
        if self
            .flows_looked
            .is_none_or(|looked| looked.elapsed() >= FLOWS_LOOK)
        {
            let grouped = queue.config.groups.is_some();
            // Beside type limits producers push to the ready list, and the claim's intake routes each task by
            // group and limited type (push.lua routes by group only).
            let routed = grouped && queue.config.type_limits.is_empty();
            broker::flows::route_groups(connection, &queue.keys, routed)?;
            let flows = broker::flows::flows(connection, &queue.keys)?;
            self.drained = broker::flows::drained(&flows, &queue.config.type_limits, grouped);
            self.flows_looked = Some(Instant::now());
        }
        let first_token = lane.ownership.tokens(want);
        let limits = broker::ClaimLimits {
            drained_flows: &self.drained,
            ..queue.claim_limits()
        };
        let sent = Instant::now();
        // An idle queue's wait for a push, or a full running count's for a settle's marker.
        let wait = (self.idle_wait.take())
            .or(std::mem::take(&mut self.running_full).then_some(queue.config.idle_poll));
        let claimed = if let Some(wait) = wait.filter(|_| !self.claiming.is_triggered()) {
            // The marker may have come already: it stays in the wake list until a fetcher takes it. Claiming
            // stopped during the wait: what the claim takes is handed back (`jobs::Sender::dispatch`).
            let io_timeout = queue.io_timeout;
            broker::claim_after_wake(
                connection,
                &queue.keys,
                &owner,
                first_token,
                want,
                &limits,
                wait,
                io_timeout,
            )
        } else {
            broker::claim(connection, &queue.keys, &owner, first_token, want, &limits)
        };
        let batch = match claimed {
            Ok(batch) => {
                // claim.lua bumps the journal exactly when it stored tasks in the claim's lists, which this
                // transaction read back.
                if !batch.tasks.is_empty() {
                    lane.ownership.bumped(&owner);
                }
                watch_clock(&lane, &owner, sent, &batch);
                batch
            }
            Err(BrokerError::LeaseLost { owner }) => {
                self.lost_lease(&owner);
                return Ok(Batch::default());
            }
            Err(error) => {
                if error.may_have_run() {
                    self.lost_claim = Some(LostClaim {
                        owner,
                        first_token,
                        count: want,
                    });
                }
                return Err(error);
            }
        };
        if batch.paused {
            return Ok(batch);
        }
        self.running_full = batch.running_full || batch.limited == Some(Limited::Running);
        self.claim_size = (batch.tasks.len() * 2)
            .max(MIN_CLAIM)
            .min(queue.config.batch);
        if batch.isolation == Isolation::Waiting {
            // Quarantined tasks wait to run in a group with nothing else: settle what this lane holds first (no Redis
            // call meanwhile).
            let until = Instant::now() + queue.config.idle_poll;
            while !lane.held.is_empty() && Instant::now() < until {
                if self.claiming.wait(ISOLATION_POLL) {
                    break;
                }
            }
            return Ok(batch);
        }
        // A limit that ends at a known time is slept out by `fetch`; a full running count waits for a settle's marker.
        let timed = batch.limited.and_then(Limited::retry_at_ms).is_some();
        // A full running count: the next claim waits for the marker itself (`running_full`).
        if batch.tasks.is_empty() && !timed && !self.running_full && !self.claiming.is_triggered() {
            // A marker means "something was pushed": the next round claims it. No marker within idle_poll: the
            // next round looks anyway, which picks up producers that push no marker. Tasks held back by their
            // types' rate windows: at most until the first window lets one go.
            let mut wait = queue.config.idle_poll;
            if let Some(broker::Limited::Types { retry_at_ms }) = batch.limited
                && retry_at_ms > 0
            {
                let until = u64::try_from(retry_at_ms.saturating_sub(batch.now_ms)).unwrap_or(0);
                wait = wait.min(Duration::from_millis(until.max(1)));
            }
            self.idle_wait = Some(wait);
        }
        Ok(batch)
    }

    /// A claim's reply was lost: asks Redis what it took (and fences it off if it has not run yet), and holds
    /// that. Returns false when Redis failed again (try later).
    fn adopt_lost_claim(&mut self) -> bool {
        let lane = Arc::clone(&self.lane);
        let Some(lost) = self.lost_claim.as_ref() else {
            return true;
        };
        let adopted = self.session.get().and_then(|connection| {
            broker::adopt(
                connection,
                &lane.queue.keys,
                &lost.owner,
                lost.first_token,
                lost.count,
            )
        });
        match adopted {
            Ok(batch) => {
                // The lost claim bumped the journal exactly when it stored tasks, found here; adopt.lua bumps
                // nothing. Only this answer counts it: a claim whose reply was lost was not counted.
                if !batch.tasks.is_empty() {
                    lane.ownership.bumped(&lost.owner);
                }
                self.trouble.recovered();
                tracing::warn!(
                    queue = %lane.name(),
                    owner = %lost.owner,
                    adopted = batch.tasks.len(),
                    "a claim's reply was lost; the tasks it took are held now, and it can take no more"
                );
                lane.capacity
                    .release(lost.count.saturating_sub(batch.tasks.len()));
                self.lost_claim = None;
                self.jobs
                    .dispatch(&self.lane, batch, self.claiming.is_triggered());
                true
            }
            Err(BrokerError::LeaseLost { owner }) => {
                // Its tasks belong to the monitors now.
                lane.capacity.release(lost.count);
                self.lost_claim = None;
                self.lost_lease(&owner);
                true
            }
            Err(error) => {
                self.trouble.failed(&error);
                self.session.reset();
                false
            }
        }
    }

    /// The owner's lease ran out: the tasks it held go back through the monitors; claim under a new owner.
    fn lost_lease(&self, owner: &str) {
        let lane = &self.lane;
        if lane.ownership.lose(owner) {
            let forgotten = lane.forget_owner(owner);
            tracing::warn!(queue = %lane.name(), %owner, forgotten, "lease lost; registering a new owner");
        }
    }
}

/// Compares the lease's time left that a claim sent at `sent` answered with this daemon's belief in it: when
/// Redis's clock stepped forward under the lease, no task starts until a renewal confirms it (see
/// [`Ownership`](super::Ownership)), which the heartbeat sends at once.
pub(super) fn watch_clock(lane: &Lane, owner: &str, sent: Instant, batch: &Batch) {
    let Some(left_ms) = batch.lease_left_ms else {
        return;
    };
    let call = Exchange {
        sent,
        answered: Instant::now(),
    };
    let lease = LeaseClock {
        now_ms: batch.now_ms,
        left_ms,
    };
    if let Some(step_ms) =
        lane.ownership
            .claimed(owner, call, lease, lane.queue.config.lease_timeout)
    {
        tracing::warn!(
            queue = %lane.name(),
            %owner,
            step_ms,
            left_ms,
            "Redis's clock stepped forward under the lease (an NTP step, a resumed VM, a failover to a host \
             whose clock runs ahead?): no task starts until a renewal confirms the lease on it"
        );
    }
}
