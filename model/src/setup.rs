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
    /// Not kmqd's claim.lua but a proposed fix, to show that it restores the fairness properties: an owner
    /// takes a quarantined task only when it holds nothing, takes nothing else with it, and takes nothing while
    /// it runs. kmqd's script takes ready tasks alongside (see README, "What the checker found").
    pub alone: bool,
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
};
const SAFE_BOTH: Config = Config {
    levels: Levels::BOTH,
    mode: Mode::Safe,
};
const DEFAULT_HIGH: Config = Config {
    levels: Levels::HIGH,
    mode: Mode::Default,
};

/// The property kmqd's claim.lua breaks (see README, "What the checker found"): a quarantined task is claimed
/// together with ready tasks, so a neighbour's crash is charged to it.
pub const UNFAIR_CHARGE: &str = "ok tasks are charged only for crashes they were alone for";
/// Its consequence with `retry_times = 0`: an ok task dead-lettered as "crashed the daemon 1 times".
pub const UNFAIR_DEAD: &str = "no ok task is dead-lettered for a neighbour's crash";

fn base(name: &'static str, tasks: Vec<(Behaviour, u8)>) -> Setup {
    Setup {
        name,
        tasks,
        configs: vec![SAFE_HIGH],
        initial: [0, 0],
        slots: 2,
        retry_times: 1,
        crashes: 0,
        stalls: 0,
        lost_replies: 0,
        shutdowns: 0,
        mutation: None,
        alone: false,
        known: &[],
    }
}

/// Safe mode, one level: a pill and an ok task, the pill's own crashes and one `kill -9`.
pub fn pill() -> Setup {
    Setup {
        crashes: 1,
        known: &[UNFAIR_CHARGE],
        ..base("pill", vec![(Behaviour::Pill, 0), (Behaviour::Ok, 0)])
    }
}

/// [`pill`] with the proposed claim.lua (a quarantined task runs alone): every property holds.
pub fn pill_alone() -> Setup {
    Setup {
        name: "pill-alone",
        alone: true,
        known: &[],
        ..pill()
    }
}

/// A pill and an ok task, and a daemon that stalls past its lease (paused, or its renewals fail) and carries
/// on: late settlements fenced by their tokens, claims refused by LEASELOST, a new owner.
pub fn stall() -> Setup {
    Setup {
        stalls: 1,
        known: &[UNFAIR_CHARGE],
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
        configs: vec![SAFE_BOTH, SAFE_HIGH, DEFAULT_HIGH],
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
        configs: vec![SAFE_HIGH, DEFAULT_HIGH],
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

/// The scenarios the CI check runs exhaustively.
pub fn ci() -> Vec<Setup> {
    vec![
        pill(),
        pill_alone(),
        stall(),
        lost_replies(),
        rolling(),
        mixed_modes(),
    ]
}

/// Larger bounds, for a run by hand (`cargo run -p kmq-model --release -- large`, or the ignored test):
/// minutes, not seconds.
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
            // Two kill -9s are enough for the unfair charge without any pill.
            known: &[UNFAIR_CHARGE],
            ..rolling()
        },
        Setup {
            name: "pill-large",
            tasks: three.clone(),
            slots: 3,
            known: &[UNFAIR_CHARGE, UNFAIR_DEAD],
            ..pill()
        },
        Setup {
            name: "pill-large-alone",
            tasks: three,
            slots: 3,
            ..pill_alone()
        },
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
            rolling().with_mutation(Mutation::MonitorOwnLevels),
            "no stranded task",
        ),
    ]
}
