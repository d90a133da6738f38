//! The wake-up of a claim that filled `max_running` (claim.lua's state 8), checked in a model of its own.
//!
//! A safe-mode queue under one `max_running` in Redis: the ready list, the running count `q` and the limit the
//! last claim counted under (`q:limit`), each claim list with its settled positions, the wake list (settle.lua,
//! push.lua and claim.lua push a marker and trim the list to one: `LPUSH wake 1; LTRIM wake 0 0`, so it holds 0
//! or 1), and `done`. Each daemon's fetcher either claims at once or, after a claim that answered state 8 (it took
//! tasks and filled the limit) or state 4 (the count was full), waits for a marker: its next claim is sent behind
//! a `BLPOP` of the wake list (`broker::claim_after_wake`, the fetcher's `running_full`). Step by step as the
//! scripts do it:
//!
//! - a claim (claim.lua under `max_running`): state 4 when `q` is at the caller's limit (the limit noted as
//!   `q:limit`); otherwise up to the caller's free workers, cut to what the limit leaves; what it took added to `q`
//!   and `q:limit` noted; when it took all it asked for and the limit leaves room while tasks still wait, it passes
//!   the wake-up on (a marker); state 8 when it took tasks and `q` reached the limit. A claim that ends at its own
//!   limit (state 4 or 8) with `q` below the limit noted before it (another daemon's, higher, in a rolling change)
//!   passes the wake-up on too while tasks wait (the sixth finding's fix);
//! - a wait's end: the fetcher's `BLPOP` takes the marker, and the claim sent behind it runs (one step: nothing
//!   another client does between the two can change what the claim sees but a marker pushed meanwhile, which this
//!   step's claim then leaves in the list as a later step would);
//! - a settle (settle.lua) of one of a daemon's tasks, by its owner (late too, after its lease ran out: stale) or by
//!   a monitor recovering an expired owner's list: an acknowledgement, or a retry at once (back to the ready
//!   list's head: a marker); each newly settled position leaves `q`, and a call that frees a slot of a count that
//!   was at `q:limit` pushes a marker;
//! - a push (push.lua: the task at the ready list's tail, and a marker);
//! - with `handover` (docs/design/flow-control.md, "The slot handed over in the settle"; handover.lua and the
//!   acker's `Settler::settle_handing_over`): an acknowledgement by its owner whose settle, in the same step, claims the next task for the slot
//!   it frees, for the worker that ran the ended task: claim.lua's logic for one task, under the daemon's current
//!   owner and its lease (an expired owner's settle claims nothing), counted in `q` like any claim and recovered
//!   like any claim if the daemon dies; no marker for the slot it handed over. Its reply may be lost: the call,
//!   sent again, is answered from its record (settle.lua's "Calls") and claims nothing more, and the daemon learns
//!   from the record which task was claimed;
//! - a daemon's lease running out (it may settle late; a monitor recovers its list), and its `kill -9` (it forgets
//!   what it held; the restarted fetcher claims at once).
//!
//! Not here: the fetcher's `idle_poll` bound on the wait (it claims again when no marker came: the properties say
//! when it would have to, which is what "no lost wake-up" forbids), rates and type or group limits (their own
//! states, 5 and 7), several levels, the quarantine, lost claim replies (an adopted claim's reply reads no state),
//! and a daemon's other fetchers (one fetcher a daemon, with `slots` workers).
//!
//! An idle fetcher (its last claim took nothing) also waits on the wake list in kmqd, and may take the marker that
//! a settle pushed for a fetcher at the limit: here any fetcher not waiting at the limit may claim either at once
//! or by taking the marker (more behaviours than kmqd has, so a property that holds here holds there).
//!
//! One order is Redis's, not any: `BLPOP` serves the client blocked longest first, so of the fetchers waiting at
//! their limit with a worker free (blocked in Redis), the one that began to wait first takes the marker
//! (`WakeState::blocked`). kmqd has another order only if a waiting fetcher's thread has not yet sent its wait (its
//! claim behind a `BLPOP`, one write right after the reply that made it wait) when a later one's is served: a race of
//! a thread's scheduling against a settle and a claim, which costs a wait of up to `idle_poll`.

use arrayvec::ArrayVec;
use stateright::{Model, Property};

/// The most daemons.
const DAEMONS: usize = 2;
/// The most claim lists at once: each daemon's, and one left by each of their earlier owners.
const LISTS: usize = 6;

/// A daemon waiting at the limit is woken: while one waits, a slot is free under its limit and tasks wait, a
/// marker is in the wake list (its `BLPOP` takes it, and the claim behind it runs).
pub const NO_LOST_WAKE: &str = "no fetcher waits at the limit for a wake-up that will not come";
/// `q` equals the positions not yet settled of the claim lists.
pub const COUNT_EXACT: &str = "the running count is the claim lists' unsettled positions";
/// `q` never exceeds the largest `max_running`.
pub const COUNT_BOUND: &str = "the running count stays within the limit";
/// settle.lua never finds `q` below what it subtracts.
pub const NO_UNDERFLOW: &str = "the running count never goes below 0";
/// Every task is in the ready list, a claim list (unsettled) or `done`, once; none is pushed twice.
pub const CONSERVED: &str = "every pushed task is in exactly one place";
/// Each unsettled position of a live owner's claim lists is a task its daemon holds (or will learn of from the
/// record of a settle sent again): none sits under a lease that is renewed while nobody runs it.
pub const NO_STRANDED: &str = "every task claimed under a live owner is held by its daemon";

/// The deliberate mutations of the wake-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WakeMutation {
    /// settle.lua pushes no wake-up marker: neither for a slot it frees of a full count nor for a task it puts
    /// back in the ready list.
    SettleNoMarker,
    /// claim.lua does not pass the wake-up on when it took all it asked for and the limit leaves room.
    ClaimNoPassOn,
    /// claim.lua before the sixth finding's fix (model/README.md): a claim that ends at its own limit (state 4 or 8)
    /// passes nothing on, even when `q` is below the higher limit another daemon noted, so the marker it took was
    /// lost to that daemon.
    LowerLimitPassesNothing,
    /// The slot handed over in the settle: the settle sent again after a lost reply runs its claim again instead
    /// of answering from its record, so the first reply's task sits in a claim list of a live owner that its
    /// daemon never learns of.
    HandoverClaimsAgain,
    /// The slot handed over in the settle: the task claimed for it is not added to `q` (the settle subtracted the
    /// ended task, the claim's list carries no scopes string), so the count no longer says what runs.
    HandoverUncounted,
}

/// One bounded check of the wake-up.
#[derive(Clone, Debug)]
pub struct Woken {
    pub name: &'static str,
    /// Tasks in the ready list at the start, and pushed later.
    pub ready: u8,
    pub pushes: u8,
    /// Each daemon's `max_running` (a rolling change when they differ).
    pub limits: [u8; DAEMONS],
    /// Each daemon's workers (its claims ask for its free ones).
    pub slots: u8,
    /// How many of these may happen in a run: a retry, a lease running out, a crash.
    pub faults: u8,
    /// An owner's acknowledgement may claim the next task for the slot it frees, in its settle's step.
    pub handover: bool,
    /// A proposed fix of the sixth finding (not built): a claim whose fetcher waits at its limit raises a key of the
    /// highest limit a waiting fetcher uses (`Store::high`, its time to live longer than `idle_poll`, so that it
    /// outlives every wait begun under it), and a claim that ends at its own limit passes the wake-up on while `q`
    /// is below it as below `q:limit`.
    pub high_key: bool,
    pub mutation: Option<WakeMutation>,
}

impl Woken {
    pub fn with_mutation(mut self, mutation: WakeMutation) -> Woken {
        self.mutation = Some(mutation);
        self
    }

    fn limit_bound(&self) -> u8 {
        self.limits.into_iter().max().unwrap_or(0)
    }

    fn tasks(&self) -> u8 {
        self.ready + self.pushes
    }
}

/// Two daemons of two workers each under `max_running = 3` (above a daemon's workers, so that a claim may take all
/// it asks for with the limit leaving room, and pass the wake-up on), three tasks and one pushed later, two faults.
pub fn wake() -> Woken {
    Woken {
        name: "wake",
        ready: 3,
        pushes: 1,
        limits: [3, 3],
        slots: 2,
        faults: 2,
        handover: false,
        high_key: false,
        mutation: None,
    }
}

/// As [`wake`], in a rolling change that lowers the limit on one daemon (3 and 2): a claim that ends at the lower
/// limit passes on the marker it took while `q` is below the higher one the claim before it noted; a lower limit
/// noted by a claim while the higher daemon waits still hides it (model/README.md, the sixth finding).
pub fn wake_rolling() -> Woken {
    Woken {
        name: "wake-rolling",
        limits: [3, 2],
        ..wake()
    }
}

/// As [`wake`], with the slot handed over in the settle beside the plain settles and claims: an acknowledgement that
/// claims the next task for the slot it frees, its reply delivered or lost (a fault: the call is sent again, or
/// the daemon dies first).
pub fn wake_handover() -> Woken {
    Woken {
        name: "wake-handover",
        handover: true,
        ..wake()
    }
}

/// As [`wake_rolling`], with the proposed key of the highest limit a waiting fetcher uses (`high_key`).
pub fn wake_rolling_high() -> Woken {
    Woken {
        name: "wake-rolling-high",
        high_key: true,
        ..wake_rolling()
    }
}

/// The scenarios of the wake-up the CI check runs.
pub fn scenarios() -> Vec<Woken> {
    vec![wake(), wake_handover()]
}

/// The wake-up's "break it on purpose" experiments: a mutated setup and a property it must break.
pub fn experiments() -> Vec<(Woken, &'static str)> {
    vec![
        (
            wake().with_mutation(WakeMutation::SettleNoMarker),
            NO_LOST_WAKE,
        ),
        (
            wake().with_mutation(WakeMutation::ClaimNoPassOn),
            NO_LOST_WAKE,
        ),
    ]
}

/// The handover's "break it on purpose" experiments: a settle sent again after a lost reply that claims again (a
/// task stranded under a live owner), and a handed-over task left out of the count.
pub fn handover_experiments() -> Vec<(Woken, &'static str)> {
    [
        (WakeMutation::HandoverClaimsAgain, NO_STRANDED),
        (WakeMutation::HandoverUncounted, COUNT_EXACT),
    ]
    .into_iter()
    .map(|(mutation, property)| (wake_handover().with_mutation(mutation), property))
    .collect()
}

/// A claim list: the daemon and owner (epoch) that made it, its size and how many of its positions are settled
/// (the tasks are alike: which positions does not matter here).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct List {
    pub daemon: u8,
    pub epoch: u8,
    pub size: u8,
    pub settled: u8,
}

/// What Redis holds of the queue.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Store {
    pub ready: u8,
    /// `running[q]` and `running[q:limit]` (0: not noted yet).
    pub running: u8,
    pub noted_limit: u8,
    /// With `high_key`: the highest limit a fetcher waits under, while its key lives (0: none).
    pub high: u8,
    /// The wake list holds a marker.
    pub marker: bool,
    pub lists: ArrayVec<List, LISTS>,
    pub done: u8,
    pub pushed: u8,
    pub underflow: bool,
}

/// A daemon's fetcher and workers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Daemon {
    /// Its owner's number: a new one after a crash or a lost lease.
    pub epoch: u8,
    /// Its lease ran out (it stalled): its next claim registers a new owner, its settles are stale.
    pub expired: bool,
    /// Tasks it holds (claimed, not settled), and the claim lists they are in (by epoch).
    pub held: ArrayVec<u8, 4>,
    /// Its last claim answered state 8 or 4: the next one waits for a marker (`running_full`).
    pub waiting: bool,
    /// A settle with a handover whose reply was lost, to be sent again: the owner (epoch) the call ran under and
    /// how many tasks its record says it claimed. Its worker waits for the reply: the slot stays busy.
    pub resend: Option<(u8, u8)>,
}

impl Daemon {
    /// The workers busy: a task held, or a settle's reply awaited.
    fn busy(&self) -> u8 {
        self.held.len() as u8 + u8::from(self.resend.is_some())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WakeState {
    pub redis: Store,
    pub daemons: [Daemon; DAEMONS],
    pub faults: u8,
    /// For the `sometimes`: a claim answered state 8, a waiting fetcher took a marker and its claim took tasks, a
    /// claim passed the wake-up on.
    pub filled: bool,
    pub woken: bool,
    pub passed_on: bool,
    /// A settle handed the slot it freed over to the next task (`handover`).
    pub handed: bool,
    /// The daemons whose fetchers wait at their limit with a worker free (blocked in a `BLPOP` of the wake list), in
    /// the order they began to: Redis serves the first.
    pub blocked: ArrayVec<u8, DAEMONS>,
}

/// One step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// claim.lua by `daemon`'s fetcher; `marker`: sent behind a `BLPOP` that took the wake list's marker.
    Claim { daemon: u8, marker: bool },
    /// settle.lua of one task `daemon` holds, in its list of epoch `epoch`: an acknowledgement or a retry at once.
    Settle { daemon: u8, epoch: u8, retry: bool },
    /// settle.lua of one acknowledgement of `daemon` that claims the next task for the slot it frees (`handover`);
    /// `lost`: its reply is lost (a fault), and the call is to be sent again.
    Handover { daemon: u8, epoch: u8, lost: bool },
    /// The settle with a handover sent again after its reply was lost: answered from its record.
    Resend { daemon: u8 },
    /// With `high_key`: the key of the highest waiting limit expires, once no fetcher waits under it.
    HighExpires,
    /// A monitor recovers the unsettled positions of list `list` (its owner's lease ran out).
    Recover { list: u8 },
    /// push.lua of one more task.
    Push,
    /// The daemon's lease runs out (a stall): it may settle late.
    Expire { daemon: u8 },
    /// `kill -9` and a restart: it forgets what it held.
    Crash { daemon: u8 },
}

/// The model of one [`Woken`].
pub struct Wake {
    pub setup: Woken,
}

impl Wake {
    pub fn new(setup: Woken) -> Wake {
        Wake { setup }
    }

    /// Whether the owner that made `list` is gone or its lease ran out: a monitor recovers what it holds.
    fn expired(state: &WakeState, list: &List) -> bool {
        let daemon = &state.daemons[list.daemon as usize];
        daemon.expired || daemon.epoch != list.epoch
    }

    /// claim.lua under `max_running` for `daemon`'s free workers.
    fn claim(&self, state: &mut WakeState, d: usize) {
        let daemon = &mut state.daemons[d];
        if daemon.expired {
            // LEASELOST: the fetcher registers a new owner and claims under it.
            daemon.expired = false;
            daemon.epoch += 1;
            daemon.held.clear();
        }
        let want = self.setup.slots - daemon.busy();
        let took = self.take(state, d, want, false);
        let daemon = &mut state.daemons[d];
        for _ in 0..took {
            daemon.held.push(daemon.epoch);
        }
    }

    /// claim.lua's logic under `max_running`, for up to `want` tasks, under `d`'s current owner: a claim list of
    /// what it took (returned), counted in `q`, with the wake-ups the script passes on. A fetcher's claim
    /// (`handover` false) sets its wait at the limit (states 4 and 8); a settle's handover reads the same reply, but
    /// its fetcher's wait is not its to change.
    fn take(&self, state: &mut WakeState, d: usize, want: u8, handover: bool) -> u8 {
        let limit = self.setup.limits[d];
        let daemon = &mut state.daemons[d];
        let redis = &mut state.redis;
        // A claim that ends at its own limit below the one noted before it (another daemon's, higher) while tasks
        // wait passes the wake-up on: the marker it took may have been that daemon's.
        let noted = redis.noted_limit.max(redis.high);
        let below_noted = |redis: &Store| {
            redis.running < noted
                && redis.ready > 0
                && self.setup.mutation != Some(WakeMutation::LowerLimitPassesNothing)
        };
        // if running >= max_running: pass_wake_on() if running < q:limit; note_limit(); state 4
        if redis.running >= limit {
            if below_noted(redis) {
                redis.marker = true;
                state.passed_on = true;
            }
            redis.noted_limit = limit;
            if !handover {
                daemon.waiting = true;
                if self.setup.high_key {
                    redis.high = redis.high.max(limit);
                }
            }
            return 0;
        }
        // if max >= max_running - running: max, room = max_running - running, false
        let (max, room) = if want >= limit - redis.running {
            (limit - redis.running, false)
        } else {
            (want, true)
        };
        redis.noted_limit = limit;
        let took = max.min(redis.ready);
        redis.ready -= took;
        if took > 0 {
            redis.lists.push(List {
                daemon: d as u8,
                epoch: daemon.epoch,
                size: took,
                settled: 0,
            });
            redis.lists.sort();
        }
        let before = redis.running;
        if !(handover && self.setup.mutation == Some(WakeMutation::HandoverUncounted)) {
            redis.running += took;
        }
        // if taken == max and room and waiting(i) > 0: LPUSH wake 1; LTRIM wake 0 0
        if took == max
            && room
            && redis.ready > 0
            && self.setup.mutation != Some(WakeMutation::ClaimNoPassOn)
        {
            redis.marker = true;
            state.passed_on = true;
        }
        // state 8: took > 0 and running + took >= max_running (then pass_wake_on() if below q:limit noted before)
        let full = took > 0 && before + took >= limit;
        if !handover {
            daemon.waiting = full;
            state.filled |= full;
            if full && self.setup.high_key {
                redis.high = redis.high.max(limit);
            }
        }
        if full && below_noted(redis) {
            redis.marker = true;
            state.passed_on = true;
        }
        took
    }

    /// settle.lua of an acknowledgement of one task `d` holds in its list of `epoch`, handing the slot it frees
    /// over to the next task (`handover`): the settle as [`Wake::settle`] does it, then, under a live lease, the
    /// claim of one task for the worker that ran the ended one, in the same step; the marker for the freed slot
    /// only when no task took it. Returns what the handover claimed.
    fn handover(&self, state: &mut WakeState, d: usize, epoch: u8) -> u8 {
        let wake = self.settled(&mut state.redis, d as u8, epoch, true);
        let took = if state.daemons[d].expired {
            // claim.lua's lease check: an expired owner's settle applies, its claim takes nothing.
            0
        } else {
            self.take(state, d, 1, true)
        };
        if took == 0 && wake && self.setup.mutation != Some(WakeMutation::SettleNoMarker) {
            state.redis.marker = true;
        }
        took
    }

    /// settle.lua of one position of the list of (`daemon`, `epoch`), if it has one not settled yet (else the call
    /// is stale): acknowledged, or back at the ready list's head (a retry at once, a monitor's recovery).
    fn settle(&self, redis: &mut Store, daemon: u8, epoch: u8, done: bool) {
        if self.settled(redis, daemon, epoch, done)
            && self.setup.mutation != Some(WakeMutation::SettleNoMarker)
        {
            redis.marker = true;
        }
    }

    /// The settle's writes but the marker: whether the call owes one (it put a task back in the ready list, or
    /// freed a slot of a count at `q:limit`).
    fn settled(&self, redis: &mut Store, daemon: u8, epoch: u8, done: bool) -> bool {
        let Some(at) = redis
            .lists
            .iter()
            .position(|l| l.daemon == daemon && l.epoch == epoch && l.settled < l.size)
        else {
            return false;
        };
        let list = &mut redis.lists[at];
        list.settled += 1;
        if list.settled == list.size {
            redis.lists.remove(at);
        }
        let mut wake = false;
        if done {
            redis.done += 1;
        } else {
            // LPUSH ready: wake_fetchers
            redis.ready += 1;
            wake = true;
        }
        // A count that was at its limit (the last claim's) wakes an idle fetcher when the call frees a slot.
        let full = redis.noted_limit > 0 && redis.running >= redis.noted_limit;
        if redis.running == 0 {
            redis.underflow = true;
        } else {
            redis.running -= 1;
        }
        wake | full
    }
}

impl Model for Wake {
    type State = WakeState;
    type Action = Step;

    fn init_states(&self) -> Vec<WakeState> {
        vec![WakeState {
            redis: Store {
                ready: self.setup.ready,
                pushed: self.setup.ready,
                ..Store::default()
            },
            daemons: Default::default(),
            faults: self.setup.faults,
            filled: false,
            woken: false,
            passed_on: false,
            handed: false,
            blocked: ArrayVec::new(),
        }]
    }

    fn actions(&self, state: &WakeState, actions: &mut Vec<Step>) {
        let fault = state.faults > 0;
        for (d, daemon) in state.daemons.iter().enumerate() {
            let d = d as u8;
            if daemon.busy() < self.setup.slots {
                if !daemon.waiting {
                    actions.push(Step::Claim {
                        daemon: d,
                        marker: false,
                    });
                }
                // Redis serves the longest-blocked `BLPOP` first: of the fetchers waiting at their limit, the
                // first to wait.
                let served = !daemon.waiting || state.blocked.first() == Some(&d);
                if state.redis.marker && served {
                    actions.push(Step::Claim {
                        daemon: d,
                        marker: true,
                    });
                }
            }
            let mut epochs: ArrayVec<u8, 4> = ArrayVec::new();
            for &epoch in &daemon.held {
                if !epochs.contains(&epoch) {
                    epochs.push(epoch);
                }
            }
            if daemon.resend.is_some() {
                // The acker makes one call at a time: the lost one is sent again before any other.
                actions.push(Step::Resend { daemon: d });
                epochs.clear();
            }
            for epoch in epochs {
                // Each settle as it goes, then (a fault) a retry, or a handover whose reply is lost.
                for faulty in [false, true].into_iter().filter(|f| !f || fault) {
                    if self.setup.handover {
                        actions.push(Step::Handover {
                            daemon: d,
                            epoch,
                            lost: faulty,
                        });
                    }
                    actions.push(Step::Settle {
                        daemon: d,
                        epoch,
                        retry: faulty,
                    });
                }
            }
            if fault && !daemon.expired {
                actions.push(Step::Expire { daemon: d });
            }
            if fault && !daemon.held.is_empty() {
                actions.push(Step::Crash { daemon: d });
            }
        }
        for (k, list) in state.redis.lists.iter().enumerate() {
            if Self::expired(state, list) {
                actions.push(Step::Recover { list: k as u8 });
            }
        }
        if state.redis.pushed < self.setup.tasks() {
            actions.push(Step::Push);
        }
        let high = state.redis.high;
        if high > 0
            && !state
                .daemons
                .iter()
                .zip(self.setup.limits)
                .any(|(daemon, limit)| daemon.waiting && limit >= high)
        {
            actions.push(Step::HighExpires);
        }
    }

    fn next_state(&self, last: &WakeState, step: Step) -> Option<WakeState> {
        let mut state = last.clone();
        match step {
            Step::Claim { daemon, marker } => {
                if marker {
                    // BLPOP wake: the marker is taken, and the claim behind it runs.
                    state.redis.marker = false;
                    state.woken |= state.daemons[daemon as usize].waiting;
                    // Its wait ended: if the claim makes it wait again, it queues at the end.
                    state.blocked.retain(|d| *d != daemon);
                }
                self.claim(&mut state, daemon as usize);
            }
            Step::Settle {
                daemon,
                epoch,
                retry,
            } => {
                let held = &mut state.daemons[daemon as usize].held;
                let at = held.iter().position(|e| *e == epoch)?;
                held.remove(at);
                if retry {
                    state.faults -= 1;
                }
                self.settle(&mut state.redis, daemon, epoch, !retry);
            }
            Step::Handover {
                daemon,
                epoch,
                lost,
            } => {
                let d = daemon as usize;
                let held = &mut state.daemons[d].held;
                let at = held.iter().position(|e| *e == epoch)?;
                held.remove(at);
                let under = state.daemons[d].epoch;
                let took = self.handover(&mut state, d, epoch);
                state.handed |= took > 0;
                let daemon = &mut state.daemons[d];
                if lost {
                    state.faults -= 1;
                    daemon.resend = Some((under, took));
                } else {
                    for _ in 0..took {
                        daemon.held.push(under);
                    }
                }
            }
            Step::Resend { daemon } => {
                let d = daemon as usize;
                let (under, mut took) = state.daemons[d].resend.take()?;
                if self.setup.mutation == Some(WakeMutation::HandoverClaimsAgain)
                    && !state.daemons[d].expired
                    && state.daemons[d].epoch == under
                {
                    // (mutated) the claim runs again; the daemon holds what this reply says.
                    took = self.take(&mut state, d, 1, true);
                }
                // Answered from the call's record: the daemon learns the task its first run claimed.
                for _ in 0..took {
                    state.daemons[d].held.push(under);
                }
            }
            Step::HighExpires => state.redis.high = 0,
            Step::Recover { list } => {
                let l = state.redis.lists[list as usize];
                for _ in l.settled..l.size {
                    self.settle(&mut state.redis, l.daemon, l.epoch, false);
                }
            }
            Step::Push => {
                state.redis.ready += 1;
                state.redis.pushed += 1;
                state.redis.marker = true;
            }
            Step::Expire { daemon } => {
                state.daemons[daemon as usize].expired = true;
                state.faults -= 1;
            }
            Step::Crash { daemon } => {
                let daemon = &mut state.daemons[daemon as usize];
                *daemon = Daemon {
                    epoch: daemon.epoch + 1,
                    ..Daemon::default()
                };
                state.faults -= 1;
            }
        }
        // Who waits in Redis now: those that stopped leave the queue, those that began join its end.
        let slots = self.setup.slots;
        let in_redis = |daemon: &Daemon| daemon.waiting && daemon.busy() < slots;
        state
            .blocked
            .retain(|d| in_redis(&state.daemons[*d as usize]));
        for (d, daemon) in state.daemons.iter().enumerate() {
            if in_redis(daemon) && !state.blocked.contains(&(d as u8)) {
                state.blocked.push(d as u8);
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(NO_LOST_WAKE, |model: &Wake, s: &WakeState| {
                s.redis.marker
                    || s.redis.ready == 0
                    || s.daemons.iter().enumerate().all(|(d, daemon)| {
                        !daemon.waiting || s.redis.running >= model.setup.limits[d]
                    })
            }),
            Property::always(COUNT_EXACT, |_, s: &WakeState| {
                let unsettled: u8 = s.redis.lists.iter().map(|l| l.size - l.settled).sum();
                s.redis.running == unsettled
            }),
            Property::always(COUNT_BOUND, |model: &Wake, s: &WakeState| {
                s.redis.running <= model.setup.limit_bound()
            }),
            Property::always(NO_UNDERFLOW, |_, s: &WakeState| !s.redis.underflow),
            Property::always(CONSERVED, |_, s: &WakeState| {
                let unsettled: u8 = s.redis.lists.iter().map(|l| l.size - l.settled).sum();
                s.redis.ready + unsettled + s.redis.done == s.redis.pushed
            }),
            Property::always(NO_STRANDED, |_, s: &WakeState| {
                s.daemons.iter().enumerate().all(|(d, daemon)| {
                    if daemon.expired {
                        return true;
                    }
                    let epoch = daemon.epoch;
                    let unsettled: u8 = s
                        .redis
                        .lists
                        .iter()
                        .filter(|l| l.daemon as usize == d && l.epoch == epoch)
                        .map(|l| l.size - l.settled)
                        .sum();
                    let held = daemon.held.iter().filter(|e| **e == epoch).count() as u8;
                    let learned = match daemon.resend {
                        Some((under, took)) if under == epoch => took,
                        _ => 0,
                    };
                    unsettled == held + learned
                })
            }),
            Property::sometimes("every task is done", |model: &Wake, s: &WakeState| {
                s.redis.done == model.setup.tasks()
            }),
            Property::sometimes("a claim fills the limit (state 8)", |_, s: &WakeState| {
                s.filled
            }),
            Property::sometimes(
                "a fetcher waiting at the limit is woken by a marker",
                |_, s: &WakeState| s.woken,
            ),
            Property::sometimes("a claim passes the wake-up on", |_, s: &WakeState| {
                s.passed_on
            }),
            Property::sometimes(
                "a settle hands its slot over to the next task",
                |model: &Wake, s: &WakeState| s.handed || !model.setup.handover,
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A claim that fills the limit answers state 8 (its fetcher waits); the settle that frees a slot of the full
    /// count pushes the marker that wakes it.
    #[test]
    fn a_claim_that_fills_the_limit_waits_and_a_settle_wakes_it() {
        let model = Wake::new(wake());
        let mut state = model.init_states().remove(0);
        model.claim(&mut state, 0);
        assert!(!state.daemons[0].waiting, "two taken under a limit of 3");
        model.claim(&mut state, 1);
        assert!(state.daemons[1].waiting, "one more fills it: state 8");
        assert_eq!((state.redis.running, state.redis.ready), (3, 0));
        state.redis.marker = false;
        model.settle(&mut state.redis, 0, 0, true);
        assert!(state.redis.marker);
        assert_eq!(state.redis.running, 2);
    }

    /// At the limit, the acknowledgement that hands its slot over claims the next task in its step: the count stays
    /// at the limit, the daemon holds the new task, and no marker calls another fetcher to a slot already taken.
    /// Sent again after a lost reply, it claims nothing more: the daemon learns the task from the call's record.
    #[test]
    fn a_settle_that_hands_its_slot_over_claims_one_task_and_pushes_no_marker() {
        let model = Wake::new(wake_handover());
        let mut state = model.init_states().remove(0);
        state.redis.ready = 5;
        model.claim(&mut state, 0);
        model.claim(&mut state, 1);
        assert_eq!(state.redis.running, 3, "filled");
        state.redis.marker = false;
        let next = model
            .next_state(
                &state,
                Step::Handover {
                    daemon: 0,
                    epoch: 0,
                    lost: false,
                },
            )
            .unwrap();
        assert_eq!((next.redis.running, next.redis.ready), (3, 1));
        assert_eq!(next.daemons[0].held.len(), 2);
        assert!(
            !next.redis.marker,
            "the freed slot was taken in the same step"
        );
        let lost = model
            .next_state(
                &state,
                Step::Handover {
                    daemon: 0,
                    epoch: 0,
                    lost: true,
                },
            )
            .unwrap();
        assert_eq!(lost.daemons[0].resend, Some((0, 1)));
        let again = model.next_state(&lost, Step::Resend { daemon: 0 }).unwrap();
        assert_eq!((again.redis.running, again.redis.ready), (3, 1));
        assert_eq!(again.daemons[0].held.len(), 2, "learned from the record");
    }

    /// A claim that took all it asked for while the limit leaves room and tasks wait passes the wake-up on.
    #[test]
    fn a_claim_that_took_all_it_asked_for_passes_the_wake_up_on() {
        let model = Wake::new(wake());
        let mut state = model.init_states().remove(0);
        model.claim(&mut state, 0);
        assert!(
            !state.daemons[0].waiting,
            "two taken, the limit of 3 leaves room"
        );
        assert!(state.redis.marker, "one task still waits");
    }

    /// In a rolling change (3 and 2), the claim at the lower limit that finds `q` at its 2 answers state 4 and passes
    /// on the marker it took, since the higher limit noted before it leaves a slot (the sixth finding's fix); the
    /// next state-4 claim at 2 passes nothing on, as it noted its own limit. A claim that fills the lower limit
    /// (state 8) below the higher one passes it on too.
    #[test]
    fn a_state_4_claim_below_the_limit_another_daemon_noted_passes_the_wake_up_on() {
        let model = Wake::new(wake_rolling());
        let mut state = model.init_states().remove(0);
        state.redis.ready = 1;
        state.redis.running = 2;
        state.redis.noted_limit = 3;
        model.claim(&mut state, 1);
        assert!(state.daemons[1].waiting, "state 4 at its own limit of 2");
        assert!(state.redis.marker, "the daemon at 3 may take the task");
        assert_eq!(state.redis.noted_limit, 2);
        state.redis.marker = false;
        model.claim(&mut state, 1);
        assert!(
            !state.redis.marker,
            "no marker ping-pong at the lower limit"
        );
        let mut state = model.init_states().remove(0);
        state.redis.running = 1;
        state.redis.noted_limit = 3;
        model.claim(&mut state, 1);
        assert!(state.daemons[1].waiting, "state 8: one taken fills its 2");
        assert!(
            state.redis.marker,
            "two tasks wait and the daemon at 3 has a slot"
        );
    }
}
