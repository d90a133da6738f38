//! Flows (issue 36, docs/design/flows.md): a waiting task released exactly once, after all its dependencies,
//! checked in a model of its own.
//!
//! One waiting task and its dependencies, each in a safe-mode queue. Step by step as the scripts and the daemons
//! do it:
//!
//! - a claim of a ready dependency by a daemon (claim.lua: it is held under the daemon's owner, a fresh tag a
//!   claim);
//! - its settle (settle.lua with after.lua's trailer): applied only while the dependency is still held under that
//!   claim (its bit unset), and then in the same step it ends and its note is appended to the outbox; a stale
//!   settle (the dependency was recovered meanwhile) writes nothing; or one settle call of every claim a daemon
//!   holds, which appends one note a run for the dependencies it ended (after.lua: the outcomes of a call's
//!   tasks with the same waiters and run make one note), none for those that were stale;
//! - a settle sent again after its reply was lost: the stored answer, nothing written (settle.lua, "Calls");
//! - a monitor recovering a held dependency (its owner's lease ran out): back to ready, its owner's late settle
//!   stale; a daemon's `kill -9` (it forgets what it held);
//! - each of two movers (delay pollers): reading the outbox's oldest notes, applying them one at a time to the
//!   waiter (flow_apply.lua: each outcome of a note in turn, the dependency recorded with HSETNX, then released
//!   when every dependency is recorded, or failed at once by a dead one under `if_failed = "fail"`), then popping from the head each note it read
//!   while it is the head (flow_outbox.lua); a mover killed between any two of these (it forgets what it read).
//!
//! - `kmqd dead requeue` of a dead dependency (dead_requeue.lua): back to ready as its next run, and in the same
//!   step a withdrawal pushed onto the HEAD of the outbox; flow_apply.lua keeps the highest run heard of each
//!   dependency, ignores a note of an older run, and on a withdrawal of a newer run, while the waiter waits,
//!   forgets the dependency's recorded outcome (docs/design/flows.md, "A requeued dependency").
//!   A requeued run is done unless the scenario says it dies again ([`Flowed::dead_runs`]).
//!
//! Not here: several waiters and the notes a failed waiter sends up the graph (each waiter is this model again,
//! one slot up), the ready list's order, retries (a retried dependency is held again: as a recovery here).

use arrayvec::ArrayVec;
use stateright::{Model, Property};

/// The most dependencies.
const DEPS: usize = 3;
/// The most requeues of a scenario.
const REQUEUES: usize = 2;
/// The most notes in the outbox: one a run of a dependency (or fewer, a settle call's of one run in one), and a
/// withdrawal a requeue.
const NOTES: usize = DEPS + 2 * REQUEUES;
const DAEMONS: usize = 2;
const MOVERS: usize = 2;
/// The most claims a daemon holds: one a dependency, and a stale one left by each fault.
const HELD: usize = DEPS + 3;

/// The waiter enters a ready list at most once.
pub const ONCE: &str = "a waiting task is released at most once";
/// It is released only once every dependency ended (and was recorded).
pub const AFTER_ALL: &str = "a waiting task is released only after all its dependencies ended";
/// A waiter failed by a dead dependency is never released.
pub const FAILED_NEVER_RUNS: &str = "a failed waiting task is never released";
/// A dependency that ended is recorded at the waiter, or its note waits in the outbox.
pub const NO_LOST_NOTE: &str = "no dependency's end is lost";
/// A waiter is never released or failed with an outcome of a run whose withdrawal it applied before (a requeued
/// dead dependency re-arms it).
pub const NOT_WITHDRAWN: &str = "a waiting task is decided only by runs not withdrawn";
/// Once nothing more can happen, the waiter is released or failed.
pub const DECIDED: &str = "the waiting task is released or failed in the end";

/// The deliberate mutations of flows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlowMutation {
    /// flow_apply.lua counts outcomes (a counter compared with `need`) instead of recording which dependency
    /// ended: a note applied twice counts twice (Sidekiq's batches, sidekiq#4361).
    CountNotes,
    /// The mover removes the notes it read before it applies them (at-most-once delivery).
    RemoveFirst,
    /// flow_apply.lua ignores runs: a withdrawal changes nothing and every outcome is HSETNX (the first slice,
    /// before a requeue re-armed its waiter).
    IgnoreRuns,
    /// flow_apply.lua forgets the withdrawn outcome but keeps no run: the dead run's note delivered again (by a
    /// second mover) records it again.
    ForgetRuns,
}

/// One bounded check of flows.
#[derive(Clone, Debug)]
pub struct Flowed {
    pub name: &'static str,
    /// Each dependency's outcome when it runs: `true` dead.
    pub dead: ArrayVec<bool, DEPS>,
    /// `if_failed = "continue"`.
    pub continues: bool,
    /// How many crashes, recoveries and lost replies may happen in a run.
    pub faults: u8,
    /// How many times an operator may requeue a dead dependency (`kmqd dead requeue`).
    pub requeues: u8,
    /// A dead dependency's runs before this one die too (then it is done: the operator fixed the cause).
    pub dead_runs: u8,
    pub mutation: Option<FlowMutation>,
}

impl Flowed {
    pub fn with_mutation(mut self, mutation: FlowMutation) -> Flowed {
        self.mutation = Some(mutation);
        self
    }
}

/// Three dependencies, all done; two faults.
pub fn fan_in() -> Flowed {
    Flowed {
        name: "flows",
        dead: [false, false, false].into_iter().collect(),
        continues: false,
        faults: 2,
        requeues: 0,
        dead_runs: 1,
        mutation: None,
    }
}

const _: () = assert!(
    HELD >= DEPS + 2,
    "a daemon's held claims fit within the faults of every scenario"
);

/// Two dependencies, one dead, under `fail`.
pub fn failing() -> Flowed {
    Flowed {
        name: "flows-failing",
        dead: [false, true].into_iter().collect(),
        ..fan_in()
    }
}

/// As [`failing`], under `continue`.
pub fn continuing() -> Flowed {
    Flowed {
        name: "flows-continuing",
        continues: true,
        ..failing()
    }
}

/// [`failing`] with its dead dependency requeued once (a `fail` waiter is re-armed only if the withdrawal is
/// applied before the dead run's note); no fault beyond the two movers' interleavings (with one, the debug
/// build's check took minutes).
pub fn requeued() -> Flowed {
    Flowed {
        name: "flows-requeued",
        requeues: 1,
        faults: 0,
        ..failing()
    }
}

/// [`continuing`] with its dead dependency requeued twice, dead again after the first requeue; no fault, as
/// [`requeued`].
pub fn requeued_twice() -> Flowed {
    Flowed {
        name: "flows-requeued-twice",
        requeues: 2,
        dead_runs: 2,
        faults: 0,
        ..continuing()
    }
}

/// The scenarios of flows the CI check runs.
pub fn scenarios() -> Vec<Flowed> {
    vec![
        fan_in(),
        failing(),
        continuing(),
        requeued(),
        requeued_twice(),
    ]
}

/// The "break it on purpose" experiments: a mutated setup and a property it must break.
pub fn experiments() -> Vec<(Flowed, &'static str)> {
    vec![
        (fan_in().with_mutation(FlowMutation::CountNotes), AFTER_ALL),
        (
            fan_in().with_mutation(FlowMutation::RemoveFirst),
            NO_LOST_NOTE,
        ),
        (
            requeued_twice().with_mutation(FlowMutation::IgnoreRuns),
            NOT_WITHDRAWN,
        ),
        (
            requeued_twice().with_mutation(FlowMutation::ForgetRuns),
            NOT_WITHDRAWN,
        ),
    ]
}

/// Where a dependency is in Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dep {
    Ready,
    /// Held under the claim of tag `tag`.
    Held {
        tag: u8,
    },
    /// Its settle applied (its bit is set): done or dead.
    Ended {
        dead: bool,
    },
}

/// A note in the outbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Note {
    /// The dependencies it names (a bit each): one for a withdrawal; for outcomes, those a settle call ended
    /// of this run.
    pub deps: u8,
    /// The dependencies' run.
    pub run: u8,
    pub kind: NoteKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NoteKind {
    /// The runs' outcomes: the dependencies of `dead` (a bit each) dead, the others done.
    Outcome { dead: u8 },
    /// `dead requeue`'s withdrawal of the runs before `run`.
    Withdraw,
}

/// The waiting task.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Waiter {
    #[default]
    Waiting,
    Released,
    Failed,
}

/// A mover's memory: the notes it read (oldest first) and how many it applied.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Mover {
    pub read: ArrayVec<Note, NOTES>,
    pub applied: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FlowState {
    pub deps: ArrayVec<Dep, DEPS>,
    /// Each daemon's held claims: (dependency, tag).
    pub held: [ArrayVec<(u8, u8), HELD>; DAEMONS],
    /// The next claim's tag.
    pub tag: u8,
    /// Each dependency's run (0 until it is requeued).
    pub run: ArrayVec<u8, DEPS>,
    pub requeues: u8,
    /// The outbox, oldest first.
    pub outbox: ArrayVec<Note, NOTES>,
    pub movers: [Mover; MOVERS],
    /// The waiter's ended hash: which dependencies are recorded (a bit each); with `CountNotes`, a count.
    pub recorded: u8,
    /// The run of each recorded outcome, and the waiter's run hash (the highest run heard of each).
    pub recorded_run: [u8; DEPS],
    pub heard: [u8; DEPS],
    pub count: u8,
    /// Ghosts, for the properties: the dependencies that ended at least once, the highest withdrawal each
    /// dependency's waiter applied while it waited, and whether a decision used a run withdrawn before.
    pub ended_once: u8,
    pub withdrawn: [u8; DEPS],
    pub stale: bool,
    pub waiter: Waiter,
    pub releases: u8,
    /// Whether every dependency had ended when the waiter was released.
    pub released_after_all: bool,
    pub faults: u8,
}

/// One step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    Claim {
        daemon: u8,
        dep: u8,
    },
    /// settle.lua of a held claim (applied or stale).
    Settle {
        daemon: u8,
        dep: u8,
        tag: u8,
    },
    /// One settle call of every claim the daemon holds (it holds two or more): each applied or stale.
    SettleAll {
        daemon: u8,
    },
    /// The same settle sent again after its reply was lost: the stored answer.
    Resend {
        dep: u8,
    },
    /// A monitor recovers a held dependency.
    Recover {
        dep: u8,
    },
    Kill {
        daemon: u8,
    },
    /// A mover reads the outbox's notes.
    Read {
        mover: u8,
    },
    /// A mover applies its next note.
    Apply {
        mover: u8,
    },
    /// A mover pops what it read and applied.
    Remove {
        mover: u8,
    },
    KillMover {
        mover: u8,
    },
    /// `kmqd dead requeue` of a dead dependency.
    Requeue {
        dep: u8,
    },
}

pub struct Flows {
    pub setup: Flowed,
}

impl Flows {
    pub fn new(setup: Flowed) -> Flows {
        Flows { setup }
    }

    fn need(&self) -> u8 {
        self.setup.dead.len() as u8
    }

    /// flow_apply.lua for `note`: each of its outcomes in turn, as a note of its own.
    fn apply(&self, state: &mut FlowState, note: Note) {
        for dep in 0..DEPS as u8 {
            if note.deps & (1 << dep) != 0 {
                self.apply_one(state, dep, note.run, note.kind);
            }
        }
    }

    /// flow_apply.lua for the outcome (or withdrawal) of `dep`'s run `run`.
    fn apply_one(&self, state: &mut FlowState, dep: u8, run: u8, kind: NoteKind) {
        let note = Note {
            deps: 1 << dep,
            run,
            kind,
        };
        let (dep, bit) = (dep as usize, 1u8 << dep);
        let mutation = self.setup.mutation;
        let dead = match note.kind {
            NoteKind::Withdraw => {
                let waiting = state.waiter == Waiter::Waiting;
                match mutation {
                    Some(FlowMutation::IgnoreRuns) => {}
                    Some(FlowMutation::ForgetRuns) if waiting => state.recorded &= !bit,
                    _ if waiting && note.run > state.heard[dep] => {
                        state.heard[dep] = note.run;
                        state.recorded &= !bit;
                    }
                    _ => {}
                }
                if waiting {
                    state.withdrawn[dep] = state.withdrawn[dep].max(note.run);
                }
                return;
            }
            NoteKind::Outcome { dead } => dead & bit != 0,
        };
        let ignores_runs = matches!(
            mutation,
            Some(FlowMutation::IgnoreRuns | FlowMutation::ForgetRuns)
        );
        if mutation == Some(FlowMutation::CountNotes) {
            state.count += 1;
        } else if ignores_runs || note.run == state.heard[dep] {
            // HSETNX: a duplicate delivery changes nothing.
            if state.recorded & bit != 0 {
                return;
            }
            state.recorded |= bit;
            state.recorded_run[dep] = note.run;
        } else if note.run > state.heard[dep] {
            // A newer run than any heard of: its outcome replaces the recorded one.
            state.heard[dep] = note.run;
            state.recorded |= bit;
            state.recorded_run[dep] = note.run;
        } else {
            // An older run's note: stale.
            return;
        }
        if state.waiter != Waiter::Waiting {
            return;
        }
        if dead && !self.setup.continues {
            state.waiter = Waiter::Failed;
            state.stale |= note.run < state.withdrawn[dep];
            return;
        }
        let ended = match self.setup.mutation {
            Some(FlowMutation::CountNotes) => state.count,
            _ => state.recorded.count_ones() as u8,
        };
        if ended >= self.need() {
            state.waiter = Waiter::Released;
            state.releases += 1;
            state.released_after_all = state.ended_once.count_ones() as usize == state.deps.len();
            state.stale |= (0..state.deps.len()).any(|d| {
                state.recorded & (1 << d) != 0 && state.recorded_run[d] < state.withdrawn[d]
            });
        }
    }

    /// Whether run `run` of `dep` dies.
    fn dies(&self, dep: u8, run: u8) -> bool {
        self.setup.dead[dep as usize] && run < self.setup.dead_runs
    }

    /// settle.lua's step for the claim `tag` of `dep`: whether it applied (the dependency was still held under
    /// it: it ends), and whether it ended dead.
    fn settle(&self, state: &mut FlowState, dep: u8, tag: u8) -> Option<bool> {
        if state.deps[dep as usize] != (Dep::Held { tag }) {
            return None;
        }
        let dead = self.dies(dep, state.run[dep as usize]);
        state.deps[dep as usize] = Dep::Ended { dead };
        state.ended_once |= 1 << dep;
        Some(dead)
    }

    /// Whether a daemon still holds the claim `tag` of `dep` (it may settle it).
    fn held(state: &FlowState, dep: u8, tag: u8) -> bool {
        state.held.iter().any(|held| held.contains(&(dep, tag)))
    }

    /// flow_outbox.lua: pops each note the mover read while it is the head.
    fn remove(state: &mut FlowState, mover: usize) {
        let read = std::mem::take(&mut state.movers[mover]);
        for note in read.read {
            if state.outbox.first() != Some(&note) {
                break;
            }
            state.outbox.remove(0);
        }
    }
}

impl Model for Flows {
    type State = FlowState;
    type Action = Step;

    fn init_states(&self) -> Vec<FlowState> {
        vec![FlowState {
            deps: self.setup.dead.iter().map(|_| Dep::Ready).collect(),
            held: Default::default(),
            tag: 0,
            run: self.setup.dead.iter().map(|_| 0).collect(),
            requeues: 0,
            outbox: ArrayVec::new(),
            movers: Default::default(),
            recorded: 0,
            recorded_run: [0; DEPS],
            heard: [0; DEPS],
            count: 0,
            ended_once: 0,
            withdrawn: [0; DEPS],
            stale: false,
            waiter: Waiter::Waiting,
            releases: 0,
            released_after_all: false,
            faults: 0,
        }]
    }

    fn actions(&self, state: &FlowState, actions: &mut Vec<Step>) {
        let fault = state.faults < self.setup.faults;
        for (dep, at) in state.deps.iter().enumerate() {
            let dep = dep as u8;
            match at {
                Dep::Ready => {
                    for daemon in 0..DAEMONS as u8 {
                        actions.push(Step::Claim { daemon, dep });
                    }
                }
                // A claim nobody holds (its daemon was killed) is always recovered once its lease runs out; a
                // live daemon's only after a stall, a fault.
                Dep::Held { tag } if fault || !Flows::held(state, dep, *tag) => {
                    actions.push(Step::Recover { dep })
                }
                Dep::Ended { dead } => {
                    if fault {
                        actions.push(Step::Resend { dep });
                    }
                    if *dead && state.requeues < self.setup.requeues {
                        actions.push(Step::Requeue { dep });
                    }
                }
                _ => {}
            }
        }
        for (daemon, held) in state.held.iter().enumerate() {
            for &(dep, tag) in held {
                actions.push(Step::Settle {
                    daemon: daemon as u8,
                    dep,
                    tag,
                });
            }
            if held.len() > 1 {
                actions.push(Step::SettleAll {
                    daemon: daemon as u8,
                });
            }
            if fault && !held.is_empty() {
                actions.push(Step::Kill {
                    daemon: daemon as u8,
                });
            }
        }
        for (at, mover) in state.movers.iter().enumerate() {
            let mover_at = at as u8;
            if mover.read.is_empty() {
                if !state.outbox.is_empty() {
                    actions.push(Step::Read { mover: mover_at });
                }
                continue;
            }
            if (mover.applied as usize) < mover.read.len() {
                actions.push(Step::Apply { mover: mover_at });
            } else {
                actions.push(Step::Remove { mover: mover_at });
            }
            if fault {
                actions.push(Step::KillMover { mover: mover_at });
            }
        }
    }

    fn next_state(&self, last: &FlowState, step: Step) -> Option<FlowState> {
        let mut state = last.clone();
        match step {
            Step::Claim { daemon, dep } => {
                state.deps[dep as usize] = Dep::Held { tag: state.tag };
                state.held[daemon as usize].push((dep, state.tag));
                state.tag += 1;
            }
            Step::Settle { daemon, dep, tag } => {
                let held = &mut state.held[daemon as usize];
                held.retain(|claim| *claim != (dep, tag));
                if let Some(dead) = self.settle(&mut state, dep, tag) {
                    state.outbox.push(Note {
                        deps: 1 << dep,
                        run: state.run[dep as usize],
                        kind: NoteKind::Outcome {
                            dead: u8::from(dead) << dep,
                        },
                    });
                }
            }
            Step::SettleAll { daemon } => {
                // after.lua: the outcomes of the claims that applied, one note a run, in the order first seen.
                let mut notes: ArrayVec<Note, DEPS> = ArrayVec::new();
                for (dep, tag) in std::mem::take(&mut state.held[daemon as usize]) {
                    let Some(dead) = self.settle(&mut state, dep, tag) else {
                        continue;
                    };
                    let run = state.run[dep as usize];
                    let at = match notes.iter().position(|note| note.run == run) {
                        Some(at) => at,
                        None => {
                            notes.push(Note {
                                deps: 0,
                                run,
                                kind: NoteKind::Outcome { dead: 0 },
                            });
                            notes.len() - 1
                        }
                    };
                    let note = &mut notes[at];
                    note.deps |= 1 << dep;
                    if let NoteKind::Outcome { dead: dead_ones } = &mut note.kind {
                        *dead_ones |= u8::from(dead) << dep;
                    }
                }
                state.outbox.extend(notes);
            }
            Step::Resend { .. } => {
                // The stored answer: nothing is written. Counted as a fault so that it is bounded.
                state.faults += 1;
            }
            Step::Recover { dep } => {
                if let Dep::Held { tag } = last.deps[dep as usize]
                    && Flows::held(last, dep, tag)
                {
                    state.faults += 1;
                }
                state.deps[dep as usize] = Dep::Ready;
            }
            Step::Kill { daemon } => {
                state.held[daemon as usize].clear();
                state.faults += 1;
            }
            Step::Read { mover } => {
                let mover = &mut state.movers[mover as usize];
                mover.read = last.outbox.clone();
                mover.applied = 0;
                if self.setup.mutation == Some(FlowMutation::RemoveFirst) {
                    state.outbox.clear();
                }
            }
            Step::Apply { mover } => {
                let m = &mut state.movers[mover as usize];
                let note = m.read[m.applied as usize];
                m.applied += 1;
                self.apply(&mut state, note);
            }
            Step::Remove { mover } => {
                if self.setup.mutation == Some(FlowMutation::RemoveFirst) {
                    state.movers[mover as usize] = Mover::default();
                } else {
                    Flows::remove(&mut state, mover as usize);
                }
            }
            Step::KillMover { mover } => {
                state.movers[mover as usize] = Mover::default();
                state.faults += 1;
            }
            Step::Requeue { dep } => {
                state.deps[dep as usize] = Dep::Ready;
                state.run[dep as usize] += 1;
                state.requeues += 1;
                state.outbox.insert(
                    0,
                    Note {
                        deps: 1 << dep,
                        run: state.run[dep as usize],
                        kind: NoteKind::Withdraw,
                    },
                );
            }
        }
        // Tags only tell claims apart: they stay few within the bounds (a claim a dependency, and one a fault).
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONCE, |_, s: &FlowState| s.releases <= 1),
            Property::always(AFTER_ALL, |_, s: &FlowState| {
                s.releases == 0 || s.released_after_all
            }),
            Property::always(FAILED_NEVER_RUNS, |_, s: &FlowState| {
                s.waiter != Waiter::Failed || s.releases == 0
            }),
            Property::always(NO_LOST_NOTE, |model: &Flows, s: &FlowState| {
                let counted = model.setup.mutation == Some(FlowMutation::CountNotes);
                s.deps.iter().enumerate().all(|(dep, at)| {
                    let run = s.run[dep];
                    !matches!(at, Dep::Ended { .. })
                        || (!counted && s.recorded & (1 << dep) != 0 && s.recorded_run[dep] == run)
                        || (counted && s.count > 0)
                        || s.outbox.iter().any(|note| {
                            note.deps & (1 << dep) != 0
                                && note.run == run
                                && note.kind != NoteKind::Withdraw
                        })
                })
            }),
            Property::always(NOT_WITHDRAWN, |_, s: &FlowState| !s.stale),
            Property::eventually(DECIDED, |_, s: &FlowState| s.waiter != Waiter::Waiting),
            Property::sometimes("the waiting task is released", |_, s: &FlowState| {
                s.waiter == Waiter::Released
            }),
            Property::sometimes(
                "a settle call notes several dependencies in one note",
                |_, s: &FlowState| s.outbox.iter().any(|note| note.deps.count_ones() > 1),
            ),
            Property::sometimes("a note is applied twice", |_, s: &FlowState| {
                s.movers.iter().all(|m| m.applied > 0)
            }),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::check_model;

    /// Every scenario holds every property, and each experiment breaks the property it names. A debug build (the
    /// workspace's `cargo test`) checks one fault a run; the release build (the CI check) two.
    #[test]
    fn flows_release_each_waiting_task_exactly_once_after_all_its_dependencies() {
        let bounded = |setup: Flowed| match cfg!(debug_assertions) {
            true => Flowed {
                faults: setup.faults.min(1),
                ..setup
            },
            false => setup,
        };
        for setup in scenarios().into_iter().map(bounded) {
            let name = setup.name;
            let sometimes_released = !setup.dead.contains(&true) || setup.continues;
            let report = check_model(name, Flows::new(setup), 2, None, false);
            let violated: Vec<&str> = report.violated.iter().map(|(name, _)| *name).collect();
            assert!(violated.is_empty(), "{name}: {violated:?}");
            let never: Vec<&str> = report
                .never
                .iter()
                .copied()
                .filter(|p| sometimes_released || *p != "the waiting task is released")
                .collect();
            assert!(never.is_empty(), "{name}: never {never:?}");
        }
        for (setup, property) in experiments() {
            let setup = bounded(setup);
            let name = setup.name;
            let report = check_model(name, Flows::new(setup), 2, None, false);
            assert!(
                report.counterexample(property).is_some(),
                "{name} with {:?}: {property} holds",
                report.violated.iter().map(|(n, _)| *n).collect::<Vec<_>>()
            );
        }
    }
}
