//! What one check explores: the tasks, the daemons' configs, the bounds, and the deliberate mutations of the
//! "break it on purpose" experiments. The scenarios the CI check runs are at the end.

use std::fmt;

/// A set of priority levels (bit `i`: level `i`, level 0 the highest), iterated highest first.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Levels(pub u8);

impl Levels {
    pub const HIGH: Levels = Levels(0b01);
    pub const LOW: Levels = Levels(0b10);
    pub const BOTH: Levels = Levels(0b11);

    pub fn contains(self, level: u8) -> bool {
        self.0 & (1 << level) != 0
    }

    /// Highest first, as the scripts' KEYS are ordered.
    pub fn iter(self) -> impl Iterator<Item = u8> {
        (0..2u8).filter(move |level| self.contains(*level))
    }
}

impl fmt::Debug for Levels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// claim.lua under a lease: at least once.
    Safe,
    /// LMPOP: at most once (a crash loses what the daemon held).
    Default,
}

/// A daemon's config for the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    pub levels: Levels,
    pub mode: Mode,
    /// The queue's `max_running` in this config (claim.lua's `ARGV[8]`, pop.lua's `ARGV[3]`; 0: none). A
    /// scenario's configs use one limit value, or none.
    pub max_running: u8,
}

/// What a task's handler does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Behaviour {
    /// Returns done.
    Ok,
    /// Running it crashes its daemon (the handler aborts the process).
    Pill,
    /// Returns retry on its first attempt (to the retry zset, after a backoff), done after.
    Flaky,
    /// Answers throttle the first time its handler runs (the service it calls pushes back), done after:
    /// whether it has throttled is the handler's world, kept in the ghost ([`crate::model::Ghost::throttled`]),
    /// since the envelope Redis holds does not change.
    Throttles,
}

/// The protocol's safeguards, each removable on purpose to show that a property depends on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// claim.lua without `if info.floor and ARGV[7] < floor: FENCED`.
    NoFloorCheck,
    /// The fetcher forgets a claim whose reply was lost instead of running adopt.lua.
    NoAdopt,
    /// settle.lua without its `settled:` check: a call sent again after a lost reply is applied again.
    NoIdempotentSettle,
    /// The monitor recovers (and releases) an expired owner at the levels of its own config, not the levels
    /// the owner registered.
    MonitorOwnLevels,
    /// claim.lua's quarantine rule before the bisecting one (446e653): a quarantined group is taken while the
    /// owner holds other tasks (unless it runs a group already), and ready tasks fill the rest of the claim
    /// beside it. The monitor still charges every task of an owner that ran a group of 1.
    GroupBesideOthers,
    /// The worker starts a waiting task without `lease_allows` (as before 368df51).
    NoLeaseCheck,
    /// renew.lua without `if lease <= now: return 0`: an expired lease is renewed.
    RenewExpired,
    /// pop.lua is passed the ready lists only, not the quarantine lists.
    PopReadyOnly,
    /// register.lua as it was before it renewed a live lease on a retry: a registration sent again after a
    /// lost reply answers 1 and leaves the first call's deadline, while the fetcher counts its lease from when it
    /// sent the retry (the first finding of the model, now fixed).
    RegisterRetryKeepsLease,
    /// settle.lua subtracts every task whose bit it sets from `running`, without looking at the claim list's
    /// scopes string: a task claimed without a limit (by a daemon whose config has none) is subtracted too.
    SubtractUncounted,
    /// settle.lua subtracts, for each claim with a scopes string, the number of positions the call names for it
    /// (its `count`; the model, whose owner and monitor both send one record per task, counts the records naming
    /// the claim), not the number of bits it newly set: a monitor and a late owner that settle the same task both
    /// subtract it.
    SubtractCount,
    /// claim.lua (and pop.lua) take their tasks first and compare `running` with the limit only afterwards: they
    /// take up to `ARGV[2]` whatever the count, and add them all.
    LimitAfterTaking,
    /// settle.lua under the "expired" fence (a monitor recovering an expired owner's tasks) subtracts nothing:
    /// the running slots of a crashed daemon leak.
    MonitorSubtractsNothing,
    /// settle.lua's op "throttle" re-queues the task with `attempt + 1`: a throttle charged as a failed run.
    ThrottleCharges,
    /// claim.lua without its throttle check (state 6): a claim takes tasks while the queue is throttled.
    ClaimIgnoresThrottle,
    /// release.lua deletes a default-mode owner's `popped-running` share without giving it back to `running`.
    ReleaseForgetsShare,
    /// settle.lua (default mode) subtracts every task the call ends from `running`, whether the popping owner's
    /// share still holds it or not: a settle that comes after release.lua gave the share back gives it back twice.
    SettleAfterRelease,
    /// The fetcher keeps its owner after a pop's reply was lost (kmqd gives it up: `ownership.lose`), so the
    /// share of the lost tasks stays under a live owner that nothing releases.
    KeepOwnerAfterLostPop,
    /// pop.lua without its lease check (kmqd's before badf3e8; the model's third finding): a pop counts its tasks
    /// under an owner that may have been released already, in a share nothing will ever give back.
    PopWithoutLeaseCheck,
}

/// One bounded check.
#[derive(Clone, Debug)]
pub struct Setup {
    pub name: &'static str,
    /// Per task: its behaviour and the level it is pushed to.
    pub tasks: Vec<(Behaviour, u8)>,
    /// The configs a daemon may run with (`initial` picks each daemon's first). A daemon restarted by a crash
    /// or a graceful stop may come back with any of them (a rolling config change).
    pub configs: Vec<Config>,
    /// Initial config index of each daemon.
    pub initial: [u8; 2],
    /// `workers + prefetch`: the most tasks a daemon holds (every held task may run at once).
    pub slots: u8,
    pub retry_times: u8,
    /// `kill -9`s (with a restart), beyond the crashes pills cause, which are not budgeted: the protocol
    /// bounds those itself (a pill back from the quarantine is charged each time it crashes its daemon).
    pub crashes: u8,
    /// Leases of live daemons that run out anyway (a pause longer than the lease, or renewals that fail).
    pub stalls: u8,
    /// Replies lost: a claim's (it ran, or it is delayed and runs later), a register's, a settle's (it ran,
    /// or it never arrived).
    pub lost_replies: u8,
    /// Graceful stops (SIGTERM: hand back, settle, release the owner, restart).
    pub shutdowns: u8,
    pub mutation: Option<Mutation>,
    /// The `recovered` count tasks are pushed with, as if they had come back that often already (a producer may
    /// write the field; earlier crashes would too). Zero in every CI scenario but `recovered`; the experiments use
    /// it to reach the quarantine in few steps.
    pub recovered: u8,
    /// A safe-mode pill's handler runs a while (two steps: start, crash) and outlives a lost lease or a hand-back:
    /// an orphan that crashes its daemon later, whatever the daemon holds by then. Off in the CI scenarios (the
    /// model then forgets a task's handler with its task, and a `kill -9` stands for what an orphan would do);
    /// see README, "What the checker found".
    pub orphans: bool,
    /// The `always` properties known to fail in this scenario, because kmqd as it is breaks them (the test
    /// asserts that exactly these fail, so a fix, or a new failure, shows).
    pub known: &'static [&'static str],
}

impl Setup {
    pub fn with_mutation(mut self, mutation: Mutation) -> Setup {
        self.mutation = Some(mutation);
        self
    }
}

const SAFE_HIGH: Config = Config {
    levels: Levels::HIGH,
    mode: Mode::Safe,
    max_running: 0,
};
const SAFE_BOTH: Config = Config {
    levels: Levels::BOTH,
    mode: Mode::Safe,
    max_running: 0,
};
const DEFAULT_HIGH: Config = Config {
    levels: Levels::HIGH,
    mode: Mode::Default,
    max_running: 0,
};
/// Safe mode, the high level, and `max_running = N`.
const fn limited(max_running: u8) -> Config {
    Config {
        max_running,
        ..SAFE_HIGH
    }
}

/// A monitor charges a task for a crash only if its owner held nothing else when its lease ran out. kmqd broke it
/// before 446e653 (a quarantined task was claimed together with ready tasks; [`Mutation::GroupBesideOthers`]
/// shows it); it breaks it still when an orphaned handler crashes the daemon ([`orphan`]; see README, "What the
/// checker found").
pub const UNFAIR_CHARGE: &str = "ok tasks are charged only for crashes they were alone for";
/// Its consequence with `retry_times = 0`: an ok task dead-lettered as "crashed the daemon 1 times".
pub const UNFAIR_DEAD: &str = "no ok task is dead-lettered for a neighbour's crash";
/// A worker starts a task only while its owner still holds it: never one a monitor has recovered (and another
/// daemon may be running). kmqd broke it after a registration sent again, until register.lua renewed a live lease
/// on a retry ([`Mutation::RegisterRetryKeepsLease`] shows it; see README, "What the checker found").
pub const ZOMBIE_START: &str = "no daemon starts a task it lost";

/// Safe mode, the high level, `max_running = 2`: with two tasks the limit never holds a claim back, so a
/// scenario explores the same states as without it, and checks the running count in each.
const SAFE_LIMITED: Config = limited(2);

fn base(name: &'static str, tasks: Vec<(Behaviour, u8)>) -> Setup {
    Setup {
        name,
        tasks,
        configs: vec![SAFE_LIMITED],
        initial: [0, 0],
        slots: 2,
        retry_times: 1,
        crashes: 0,
        stalls: 0,
        lost_replies: 0,
        shutdowns: 0,
        mutation: None,
        recovered: 0,
        orphans: false,
        known: &[],
    }
}

/// Safe mode, one level: a pill and an ok task, the pill's own crashes (through every quarantine stage) and one
/// `kill -9`.
pub fn pill() -> Setup {
    Setup {
        crashes: 1,
        ..base("pill", vec![(Behaviour::Pill, 0), (Behaviour::Ok, 0)])
    }
}

/// A pill and an ok task, and a daemon that stalls past its lease (paused, or its renewals fail) and carries
/// on: late settlements fenced by their tokens, claims refused by LEASELOST, a new owner; a woken daemon starts
/// nothing it lost.
pub fn stall() -> Setup {
    Setup {
        stalls: 1,
        ..base("stall", vec![(Behaviour::Pill, 0), (Behaviour::Ok, 0)])
    }
}

/// Safe mode, one level: lost replies (a claim that ran, a claim still on its way that runs later, a register,
/// a settle that ran or never arrived) with adopt.lua, retries through the retry zset, and a `kill -9`.
pub fn lost_replies() -> Setup {
    Setup {
        crashes: 1,
        lost_replies: 2,
        ..base(
            "lost-replies",
            vec![(Behaviour::Ok, 0), (Behaviour::Flaky, 0)],
        )
    }
}

/// Two levels: a daemon restarted (crash or graceful stop) with fewer levels, or in default mode, while an
/// owner registered with both levels still holds tasks.
pub fn rolling() -> Setup {
    Setup {
        configs: vec![
            Config {
                max_running: 2,
                ..SAFE_BOTH
            },
            SAFE_LIMITED,
            DEFAULT_HIGH,
        ],
        crashes: 1,
        lost_replies: 1,
        shutdowns: 1,
        ..base("rolling", vec![(Behaviour::Ok, 1), (Behaviour::Ok, 0)])
    }
}

/// A default-mode daemon beside a safe one: tokenless settlements (never stale: only settle.lua's record of
/// the last call keeps them from being applied twice), a graceful stop, a crash.
pub fn mixed_modes() -> Setup {
    Setup {
        configs: vec![SAFE_LIMITED, DEFAULT_HIGH],
        initial: [0, 1],
        crashes: 1,
        lost_replies: 1,
        shutdowns: 1,
        ..base(
            "mixed-modes",
            vec![(Behaviour::Flaky, 0), (Behaviour::Ok, 0)],
        )
    }
}

/// [`mixed_modes`] with tasks that already came back once (`recovered = 1`): the next recovery sends them to
/// the quarantine (groups of 64), where a default-mode daemon pops them too (pop.lua reads the quarantine lists
/// before the ready list), and a safe one claims them as a group.
pub fn recovered() -> Setup {
    Setup {
        name: "recovered",
        recovered: 1,
        ..mixed_modes()
    }
}

/// A register reply lost and a stall: the daemon registers again (the retry finds its owner registered and
/// renews its lease), and its lease runs out while it holds a task: the woken daemon starts nothing it lost.
/// Safe mode, an ok and a flaky task. (The first finding's scenario: with
/// [`Mutation::RegisterRetryKeepsLease`], "no daemon starts a task it lost" fails.)
pub fn zombie() -> Setup {
    Setup {
        stalls: 1,
        lost_replies: 1,
        ..base("zombie", vec![(Behaviour::Ok, 0), (Behaviour::Flaky, 0)])
    }
}

/// A safe-mode queue's `max_running` (flow control, step 1) at 1, with one daemon whose config has it and one
/// whose config has not: claims counted and claims not counted side by side, and a `kill -9` that restarts either
/// daemon with either config (a rolling change that adds the limit, or takes it away). An ok and a flaky task
/// (its retry comes back through the retry zset and is claimed again), and a lost reply (a claim adopted, a
/// settle sent again, a monitor's call sent again). Every other scenario's safe-mode configs have
/// `max_running = 2`, which two tasks never reach: the same states, with every count checked in each.
pub fn limit() -> Setup {
    Setup {
        configs: vec![limited(1), SAFE_HIGH],
        initial: [0, 1],
        crashes: 1,
        lost_replies: 1,
        ..base("limit", vec![(Behaviour::Ok, 0), (Behaviour::Flaky, 0)])
    }
}

/// Default mode, `max_running = N`, the high level.
const fn popping(max_running: u8) -> Config {
    Config {
        max_running,
        ..DEFAULT_HIGH
    }
}

/// Default mode's `max_running` (pop.lua's count under the popping owner's share, settle.lua's give-back of each
/// ended task, release.lua's of what is left when the owner goes) at 1, beside a safe-mode daemon under the same
/// limit (one count for claims and pops), an ok and a flaky task, with a lost reply (a pop that ran, or that runs
/// later, whose owner the daemon gives up; a settle sent again) and a stall (an owner expired while its daemon
/// still runs what it popped: a monitor gives its share back, and the late settle subtracts nothing): the third
/// finding's scenario. With a `kill -9` too it is 12.5 million states (132 s); each pair of the three faults is
/// a scenario of its own ([`popped_crash`], [`popped_crash_stall`]).
pub fn popped() -> Setup {
    Setup {
        configs: vec![popping(1), limited(1)],
        initial: [0, 1],
        stalls: 1,
        lost_replies: 1,
        ..base("popped", vec![(Behaviour::Ok, 0), (Behaviour::Flaky, 0)])
    }
}

/// [`popped`] with a `kill -9` (what a default-mode daemon held is lost, its share comes back with its owner; a
/// restart may switch the daemon's mode) instead of the stall.
pub fn popped_crash() -> Setup {
    Setup {
        name: "popped-crash",
        crashes: 1,
        stalls: 0,
        ..popped()
    }
}

/// [`popped`] with a `kill -9` instead of the lost reply.
pub fn popped_crash_stall() -> Setup {
    Setup {
        name: "popped-crash-stall",
        crashes: 1,
        lost_replies: 0,
        ..popped()
    }
}

/// A handler's back-pressure: a task whose handler throttles on its first run and an ok task, a safe-mode daemon
/// beside a default-mode one (the throttle settled by either, claims and pops held back by the key), a `kill -9`
/// and a stall (a late owner's throttle found stale, the task recovered by a monitor, which never throttles). A
/// lost reply too would make it 7.8 million states (108 s); with a lost reply instead of the stall it is 146,118.
pub fn throttle() -> Setup {
    Setup {
        configs: vec![SAFE_LIMITED, DEFAULT_HIGH],
        initial: [0, 1],
        crashes: 1,
        stalls: 1,
        ..base(
            "throttle",
            vec![(Behaviour::Throttles, 0), (Behaviour::Ok, 0)],
        )
    }
}

/// The properties of the throttle.
pub const THROTTLE_UNCHARGED: &str = "throttles are uncharged";
pub const NO_TAKE_THROTTLED: &str = "no take while throttled";

/// The throttle's "break it on purpose" experiments.
pub fn throttle_experiments() -> Vec<(Setup, &'static str)> {
    vec![
        (
            throttle().with_mutation(Mutation::ThrottleCharges),
            THROTTLE_UNCHARGED,
        ),
        (
            throttle().with_mutation(Mutation::ClaimIgnoresThrottle),
            NO_TAKE_THROTTLED,
        ),
    ]
}

/// The scenarios the CI check runs exhaustively.
pub fn ci() -> Vec<Setup> {
    vec![
        pill(),
        stall(),
        lost_replies(),
        rolling(),
        mixed_modes(),
        recovered(),
        zombie(),
        limit(),
        throttle(),
        popped(),
        popped_crash(),
        popped_crash_stall(),
    ]
}

/// Larger bounds, for a run by hand (`cargo run -p kmq-model --release -- large`, or the ignored test):
/// minutes, not seconds (`zombie-large` did not finish in 17 minutes: see README, "Larger bounds").
pub fn large() -> Vec<Setup> {
    let three = vec![
        (Behaviour::Pill, 0),
        (Behaviour::Ok, 0),
        (Behaviour::Flaky, 0),
    ];
    vec![
        Setup {
            name: "lost-replies-large",
            shutdowns: 1,
            ..lost_replies()
        },
        Setup {
            name: "rolling-large",
            crashes: 2,
            ..rolling()
        },
        Setup {
            name: "pill-large",
            tasks: three,
            slots: 3,
            // Unlimited, as measured: `max_running = 2` would hold back three tasks.
            configs: vec![SAFE_HIGH],
            ..pill()
        },
        Setup {
            name: "zombie-large",
            tasks: vec![(Behaviour::Pill, 0), (Behaviour::Ok, 0)],
            ..zombie()
        },
    ]
}

/// A pill whose handler outlives its lease (`Setup::orphans`), an ok task, both already recovered three times,
/// and a stall: kmqd charges the ok task, run alone, for the orphaned pill's crash (see README, "What the checker
/// found"). Not in the CI list: the finding's test checks it.
pub fn orphan() -> Setup {
    Setup {
        name: "orphan",
        recovered: 3,
        stalls: 1,
        orphans: true,
        known: &[UNFAIR_CHARGE],
        ..base("orphan", vec![(Behaviour::Pill, 0), (Behaviour::Ok, 0)])
    }
}

/// A pill and an ok task pushed as if they had come back three times already (`recovered = 3`): the next
/// recovery puts them in `quarantine:1`. For the experiments on the quarantine rule.
fn pill_quarantined() -> Setup {
    Setup {
        name: "pill-quarantined",
        recovered: 3,
        ..pill()
    }
}

/// The properties of the running limit.
pub const RUNNING_EXACT: &str = "running counts are exact";
pub const RUNNING_BOUND: &str = "never above the limit";
pub const NO_UNDERFLOW: &str = "no underflow";
pub const NO_LEAK: &str = "nothing leaks at rest";
pub const ADMITS_BELOW: &str = "a take admits only below its limit";
pub const SHARE_COMES_BACK: &str = "every share comes back";

/// The running limit's "break it on purpose" experiments, in safe mode and in default mode: a mutated setup and a
/// property it must break (each mutation has its own test in `tests/check.rs`).
pub fn limit_experiments() -> Vec<(Setup, &'static str)> {
    vec![
        (
            limit().with_mutation(Mutation::SubtractUncounted),
            RUNNING_EXACT,
        ),
        (
            limit().with_mutation(Mutation::SubtractUncounted),
            NO_UNDERFLOW,
        ),
        (
            zombie().with_mutation(Mutation::SubtractCount),
            NO_UNDERFLOW,
        ),
        (
            zombie().with_mutation(Mutation::SubtractCount),
            RUNNING_EXACT,
        ),
        (
            limit().with_mutation(Mutation::LimitAfterTaking),
            RUNNING_BOUND,
        ),
        (
            limit().with_mutation(Mutation::MonitorSubtractsNothing),
            NO_LEAK,
        ),
        (
            popped_crash().with_mutation(Mutation::ReleaseForgetsShare),
            RUNNING_EXACT,
        ),
        (
            popped_crash().with_mutation(Mutation::ReleaseForgetsShare),
            NO_LEAK,
        ),
        (
            popped().with_mutation(Mutation::SettleAfterRelease),
            NO_UNDERFLOW,
        ),
        (
            popped().with_mutation(Mutation::SettleAfterRelease),
            RUNNING_EXACT,
        ),
        (
            popped().with_mutation(Mutation::KeepOwnerAfterLostPop),
            SHARE_COMES_BACK,
        ),
        (
            popped().with_mutation(Mutation::LimitAfterTaking),
            ADMITS_BELOW,
        ),
        (
            popped().with_mutation(Mutation::PopWithoutLeaseCheck),
            SHARE_COMES_BACK,
        ),
        (
            popped().with_mutation(Mutation::PopWithoutLeaseCheck),
            "drained at rest",
        ),
    ]
}

/// The "break it on purpose" experiments: a mutated setup and the property it must break.
pub fn experiments() -> Vec<(Setup, &'static str)> {
    vec![
        (
            lost_replies().with_mutation(Mutation::NoFloorCheck),
            "no stranded task",
        ),
        (
            lost_replies().with_mutation(Mutation::NoAdopt),
            "no stranded task",
        ),
        (
            mixed_modes().with_mutation(Mutation::NoIdempotentSettle),
            "settled once",
        ),
        (
            mixed_modes().with_mutation(Mutation::NoIdempotentSettle),
            "conservation",
        ),
        (
            rolling().with_mutation(Mutation::MonitorOwnLevels),
            "no stranded task",
        ),
        (
            pill_quarantined().with_mutation(Mutation::GroupBesideOthers),
            UNFAIR_CHARGE,
        ),
        (
            Setup {
                retry_times: 0,
                ..pill_quarantined()
            }
            .with_mutation(Mutation::GroupBesideOthers),
            UNFAIR_DEAD,
        ),
        (stall().with_mutation(Mutation::NoLeaseCheck), ZOMBIE_START),
        (
            stall().with_mutation(Mutation::RenewExpired),
            "held tasks are in Redis",
        ),
        (
            Setup {
                lost_replies: 0,
                ..recovered()
            }
            .with_mutation(Mutation::PopReadyOnly),
            "drained at rest",
        ),
        (
            zombie().with_mutation(Mutation::RegisterRetryKeepsLease),
            ZOMBIE_START,
        ),
    ]
}
