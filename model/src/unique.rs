//! Unique for a time (issue 37, `unique_for=MS`), checked in a model of its own.
//!
//! One unique id in a default-mode queue (where every path that frees or takes an id again exists), on Redis's
//! clock in ticks: the id's field in the unique hash (`NOW:MS`, or a plain `NOW`), the unique-popped hash's entry
//! (the owner that popped its task), the hold `unique:held:ID` (`END:MS`, which exists until its expiry), the dead
//! list's records (each with the window it carries, `"unique_for": MS`), and each task of the id. Step by step as
//! the scripts do it:
//!
//! - a push (push.lua): refused while the hold exists or the field does; otherwise the field `NOW:MS` and a task
//!   in the ready list;
//! - a pop (pop.lua) under a daemon's live owner: the task leaves Redis, the popped entry names the owner;
//! - a start (the worker's lease check): only while the task's owner is live; one that was lost hands it back;
//! - a settle (settle.lua) of a popped task by its daemon: an acknowledgement, a dead-lettering (the record carries
//!   the window), a retry, a hand-back. While the popped entry names the task's owner, the task holds the id: the
//!   end frees it (unique_hold.lua's `free_unique_id`, leaving the hold for the window from now), a retry or a
//!   hand-back keeps it. Otherwise (a monitor released it) an end changes nothing, and a task queued again takes
//!   the id again if it is free, with the window its release's hold names (`take_unique_id`), or is dropped (a
//!   newer task holds the id, or a newer task's end left the hold: that one ran instead);
//! - a daemon's owner running out of lease, found by a monitor (release_unique.lua): the id its popped task held is
//!   freed with its hold (marked as a release's), in that step; the daemon pops under a new owner and still holds
//!   the task;
//! - `kmqd dead requeue` of a record (dead_requeue.lua): refused while the hold or the field exists; otherwise the
//!   id taken with the record's window, and the task (a new run of the id) in the ready list;
//! - a cancel of a waiting task (remove.lua): it ends, and frees the id with its hold;
//! - Redis's clock moving on by one tick (the holds expire by themselves).
//!
//! The properties: a task of the id starts its first run only a whole window after every earlier end of another
//! task of the id ("one run per window"; an end is the step that freed the id, on Redis's clock: for a task lost
//! with its owner, the monitor's release, as the lease says); and once no task holds the id and every end is a
//! window old, the id is free (no hold outlives its window).
//!
//! Not here: safe mode (its claims keep the field as it is and its settles free it as default mode's do, under the
//! claim's bit instead of the popped entry), several ids (each id's keys are its own), a daemon that dies with its
//! task (the same release, and the task never comes back), lost replies.
//!
//! An open gap, `late_return`: a task of an owner a monitor released that comes back (handed back, retried, dead)
//! after the release's hold expired finds no window to take the id with, and takes it plain: its next end leaves
//! no hold (`unique-late` shows the trace). The main scenarios keep such returns within the hold.

use stateright::{Model, Property};

/// The daemons.
const DAEMONS: usize = 2;

/// No two tasks of the id start their first runs within the window after the earlier one ended.
pub const ONE_RUN_PER_WINDOW: &str =
    "no task of the id starts within the window after another ended";
/// Once no task holds the id and every end is a window old, a push of the id is accepted.
pub const FREE_AFTER: &str = "the id is free once no task holds it and its window passed";

/// The deliberate mutations: each is a step of the scripts as it was before the fix of issue 37's second session,
/// or a hold dropped early.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UniqueMutation {
    /// `free_unique_id` sets the hold to expire a tick before the window ends.
    HoldShort,
    /// settle.lua takes the id again for a task queued again after its owner lost it as a plain `NOW`, whatever
    /// hold is there.
    RetakePlain,
    /// dead_requeue.lua takes the id as a plain `NOW`, without looking at the hold.
    RequeuePlain,
    /// remove.lua deletes the field of a cancelled task without a hold.
    CancelFrees,
}

/// One bounded check of unique for a time.
#[derive(Clone, Debug)]
pub struct UniqueFor {
    pub name: &'static str,
    /// The window, in ticks of Redis's clock.
    pub window: u8,
    /// The last tick.
    pub horizon: u8,
    /// How many pushes of the id are tried.
    pub pushes: u8,
    /// How many of each may happen in a run: an owner lost, a retry, a requeue, a cancel.
    pub losses: u8,
    pub retries: u8,
    pub requeues: u8,
    pub cancels: u8,
    /// A lost owner's task may come back after the hold its release left expired (the open gap).
    pub late_return: bool,
    pub mutation: Option<UniqueMutation>,
}

impl UniqueFor {
    pub fn with_mutation(mut self, mutation: UniqueMutation) -> UniqueFor {
        self.mutation = Some(mutation);
        self
    }
}

/// The scenario the CI check runs.
pub fn unique_for() -> UniqueFor {
    UniqueFor {
        name: "unique-for",
        window: 2,
        horizon: 4,
        pushes: 3,
        losses: 1,
        retries: 1,
        requeues: 1,
        cancels: 1,
        late_return: false,
        mutation: None,
    }
}

/// The open gap: a lost owner's task may come back after its release's hold expired.
pub fn unique_late() -> UniqueFor {
    UniqueFor {
        name: "unique-late",
        requeues: 0,
        cancels: 0,
        retries: 0,
        late_return: true,
        ..unique_for()
    }
}

/// The mutations, each with the property it breaks.
pub fn experiments() -> Vec<(UniqueFor, &'static str)> {
    [
        UniqueMutation::HoldShort,
        UniqueMutation::RetakePlain,
        UniqueMutation::RequeuePlain,
        UniqueMutation::CancelFrees,
    ]
    .into_iter()
    .map(|mutation| (unique_for().with_mutation(mutation), ONE_RUN_PER_WINDOW))
    .collect()
}

/// The id's field in the unique hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Field {
    /// `NOW`: a plain unique id.
    Plain,
    /// `NOW:MS`: held for the window after its task ended.
    For(u8),
}

/// Where a task of the id is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Place {
    Ready,
    /// Popped under `owner` (the owners are numbered as made), and held by its daemon.
    Popped {
        owner: u8,
        started: bool,
    },
    Done,
    Dead,
    Cancelled,
    /// Queued again after its owner lost the id, while another task held it: dropped.
    Dropped,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Task {
    pub place: Place,
    /// The tick its first run started.
    pub first_start: Option<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct UniqueState {
    pub now: u8,
    pub field: Option<Field>,
    /// The owner the unique-popped hash names.
    pub popped: Option<u8>,
    /// The hold: its expiry (it exists while `now` is before it), the window its value names, and whether a lost
    /// owner's release left it (`END:MS:released`) rather than a task's end.
    pub hold: Option<(u8, u8, bool)>,
    /// The dead records: the task, and the window the record carries.
    pub dead: Vec<(u8, Option<u8>)>,
    pub tasks: Vec<Task>,
    /// The steps that freed the id: the task, and the tick.
    pub ends: Vec<(u8, u8)>,
    /// Each owner made so far: lost (a monitor released it).
    pub lost: Vec<bool>,
    /// Each daemon's current owner.
    pub owner: [u8; DAEMONS],
    pub pushes: u8,
    pub losses: u8,
    pub retries: u8,
    pub requeues: u8,
    pub cancels: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    Tick,
    Push,
    Pop {
        daemon: u8,
        task: u8,
    },
    Start {
        task: u8,
    },
    /// The worker finds the task's owner lost and hands it back (settle.lua "back").
    HandBack {
        task: u8,
    },
    Ack {
        task: u8,
    },
    Dead {
        task: u8,
    },
    Retry {
        task: u8,
    },
    Lose {
        daemon: u8,
    },
    Requeue {
        record: u8,
    },
    Cancel {
        task: u8,
    },
}

pub struct Unique {
    pub setup: UniqueFor,
}

impl Unique {
    pub fn new(setup: UniqueFor) -> Unique {
        Unique { setup }
    }

    fn held(state: &UniqueState) -> bool {
        state.hold.is_some_and(|(expiry, ..)| state.now < expiry)
    }

    /// unique_hold.lua's `free_unique_id`: the field deleted, and a `NOW:MS` one's hold left (`released`: by
    /// release_unique.lua). Returns the window.
    fn free(&self, state: &mut UniqueState, released: bool) -> Option<u8> {
        match state.field.take() {
            Some(Field::For(window)) => {
                let length = match self.setup.mutation {
                    Some(UniqueMutation::HoldShort) => window - 1,
                    _ => window,
                };
                state.hold = Some((state.now + length, window, released));
                Some(window)
            }
            _ => None,
        }
    }

    /// unique_hold.lua's `held_window`: the window the hold names while it exists, and whether a task's end left
    /// it (not a release).
    fn held_window(state: &UniqueState) -> (Option<u8>, bool) {
        match state.hold {
            Some((_, window, released)) if Self::held(state) => (Some(window), !released),
            _ => (None, false),
        }
    }

    fn take(state: &mut UniqueState, window: Option<u8>) -> bool {
        if state.field.is_some() {
            return false;
        }
        state.field = Some(window.map_or(Field::Plain, Field::For));
        true
    }

    /// settle.lua for a popped task: whether it holds the id (its owner is the one the popped entry names).
    fn holds(state: &UniqueState, owner: u8) -> bool {
        state.popped == Some(owner)
    }

    /// A lost owner's task comes back after its release's hold expired only with `late_return`.
    fn may_return(&self, state: &UniqueState, owner: u8) -> bool {
        !state.lost[owner as usize] || self.setup.late_return || Self::held(state)
    }
}

impl Model for Unique {
    type State = UniqueState;
    type Action = Step;

    fn init_states(&self) -> Vec<UniqueState> {
        vec![UniqueState {
            now: 0,
            field: None,
            popped: None,
            hold: None,
            dead: Vec::new(),
            tasks: Vec::new(),
            ends: Vec::new(),
            lost: vec![false, false],
            owner: [0, 1],
            pushes: self.setup.pushes,
            losses: self.setup.losses,
            retries: self.setup.retries,
            requeues: self.setup.requeues,
            cancels: self.setup.cancels,
        }]
    }

    fn actions(&self, state: &UniqueState, actions: &mut Vec<Step>) {
        if state.now < self.setup.horizon {
            actions.push(Step::Tick);
        }
        if state.pushes > 0 {
            actions.push(Step::Push);
        }
        for (k, task) in state.tasks.iter().enumerate() {
            let task_index = k as u8;
            match task.place {
                Place::Ready => {
                    for daemon in 0..DAEMONS as u8 {
                        actions.push(Step::Pop {
                            daemon,
                            task: task_index,
                        });
                    }
                    if state.cancels > 0 {
                        actions.push(Step::Cancel { task: task_index });
                    }
                }
                Place::Popped { owner, started } => {
                    if !self.may_return(state, owner) {
                        continue;
                    }
                    if !started {
                        if state.lost[owner as usize] {
                            actions.push(Step::HandBack { task: task_index });
                        } else {
                            actions.push(Step::Start { task: task_index });
                        }
                    } else {
                        actions.push(Step::Ack { task: task_index });
                        actions.push(Step::Dead { task: task_index });
                        if state.retries > 0 {
                            actions.push(Step::Retry { task: task_index });
                        }
                    }
                }
                _ => {}
            }
        }
        if state.losses > 0 {
            for daemon in 0..DAEMONS as u8 {
                actions.push(Step::Lose { daemon });
            }
        }
        if state.requeues > 0 {
            for record in 0..state.dead.len() {
                actions.push(Step::Requeue {
                    record: record as u8,
                });
            }
        }
    }

    fn next_state(&self, state: &UniqueState, action: Step) -> Option<UniqueState> {
        let mut next = state.clone();
        let now = state.now;
        match action {
            Step::Tick => next.now += 1,
            Step::Push => {
                next.pushes -= 1;
                // push.lua: EXISTS of the hold, then HSETNX of the field.
                if !Self::held(&next) && Self::take(&mut next, Some(self.setup.window)) {
                    next.tasks.push(Task {
                        place: Place::Ready,
                        first_start: None,
                    });
                }
            }
            Step::Pop { daemon, task } => {
                let owner = next.owner[daemon as usize];
                // pop.lua records the popper while the field exists and no other owner is recorded.
                if next.field.is_some() && next.popped.is_none() {
                    next.popped = Some(owner);
                }
                next.tasks[task as usize].place = Place::Popped {
                    owner,
                    started: false,
                };
            }
            Step::Start { task } => {
                let t = &mut next.tasks[task as usize];
                if let Place::Popped { owner, .. } = t.place {
                    t.place = Place::Popped {
                        owner,
                        started: true,
                    };
                    t.first_start.get_or_insert(now);
                }
            }
            Step::Ack { task }
            | Step::Dead { task }
            | Step::Retry { task }
            | Step::HandBack { task } => {
                let Place::Popped { owner, .. } = next.tasks[task as usize].place else {
                    return None;
                };
                let holds = Self::holds(&next, owner);
                if holds {
                    next.popped = None;
                }
                let place = match action {
                    Step::Ack { .. } => {
                        if holds {
                            self.free(&mut next, false);
                            next.ends.push((task, now));
                        }
                        Place::Done
                    }
                    Step::Dead { .. } => {
                        let window = if holds {
                            let window = self.free(&mut next, false);
                            next.ends.push((task, now));
                            window
                        } else {
                            Self::held_window(&next).0
                        };
                        next.dead.push((task, window));
                        Place::Dead
                    }
                    _ => {
                        if let Step::Retry { .. } = action {
                            next.retries -= 1;
                        }
                        if holds {
                            Place::Ready
                        } else {
                            // A hold another task's end left: that one ran instead, within the window.
                            let (window, ended) = match self.setup.mutation {
                                Some(UniqueMutation::RetakePlain) => (None, false),
                                _ => Self::held_window(&next),
                            };
                            if !ended && Self::take(&mut next, window) {
                                Place::Ready
                            } else {
                                Place::Dropped
                            }
                        }
                    }
                };
                next.tasks[task as usize].place = place;
            }
            Step::Lose { daemon } => {
                next.losses -= 1;
                let owner = next.owner[daemon as usize];
                next.lost[owner as usize] = true;
                // release_unique.lua, run by a monitor once the lease ran out.
                if next.popped == Some(owner) {
                    next.popped = None;
                    self.free(&mut next, true);
                    let lost_task = next.tasks.iter().position(
                        |t| matches!(t.place, Place::Popped { owner: o, .. } if o == owner),
                    );
                    if let Some(k) = lost_task {
                        next.ends.push((k as u8, now));
                    }
                }
                next.owner[daemon as usize] = next.lost.len() as u8;
                next.lost.push(false);
            }
            Step::Requeue { record } => {
                next.requeues -= 1;
                let (_, window) = next.dead[record as usize];
                let (refused, window) = match self.setup.mutation {
                    Some(UniqueMutation::RequeuePlain) => (false, None),
                    _ => (Self::held(&next), window),
                };
                if !refused && Self::take(&mut next, window) {
                    next.dead.remove(record as usize);
                    next.tasks.push(Task {
                        place: Place::Ready,
                        first_start: None,
                    });
                }
            }
            Step::Cancel { task } => {
                next.cancels -= 1;
                match self.setup.mutation {
                    Some(UniqueMutation::CancelFrees) => next.field = None,
                    _ => {
                        self.free(&mut next, false);
                    }
                }
                next.ends.push((task, now));
                next.tasks[task as usize].place = Place::Cancelled;
            }
        }
        Some(next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_RUN_PER_WINDOW, |model: &Unique, s: &UniqueState| {
                s.tasks.iter().enumerate().all(|(k, task)| {
                    let Some(start) = task.first_start else {
                        return true;
                    };
                    s.ends.iter().all(|&(ended, at)| {
                        ended as usize == k || at > start || start >= at + model.setup.window
                    })
                })
            }),
            Property::always(FREE_AFTER, |model: &Unique, s: &UniqueState| {
                let passed = s
                    .ends
                    .iter()
                    .all(|&(_, at)| s.now >= at + model.setup.window);
                s.field.is_some() || !passed || !Unique::held(s)
            }),
        ]
    }

    fn within_boundary(&self, state: &UniqueState) -> bool {
        state.now <= self.setup.horizon
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state `steps` lead to from the start of `unique_for`'s scenario.
    fn after(model: &Unique, steps: &[Step]) -> UniqueState {
        let mut state = model.init_states().remove(0);
        for &step in steps {
            state = model.next_state(&state, step).unwrap();
        }
        state
    }

    /// A done task's id is held for the window, then free.
    #[test]
    fn an_acknowledged_task_s_id_is_held_for_its_window() {
        let model = Unique::new(unique_for());
        let mut steps = vec![
            Step::Push,
            Step::Pop { daemon: 0, task: 0 },
            Step::Start { task: 0 },
            Step::Ack { task: 0 },
            Step::Push,
        ];
        assert_eq!(after(&model, &steps).tasks.len(), 1, "refused while held");
        steps.extend([Step::Tick, Step::Tick, Step::Push]);
        assert_eq!(
            after(&model, &steps).tasks.len(),
            2,
            "free once the window passed"
        );
    }

    /// A task handed back after its owner was lost takes the id again with the window the release's hold names.
    #[test]
    fn a_task_handed_back_after_its_owner_was_lost_takes_the_id_with_its_window() {
        let model = Unique::new(unique_for());
        let state = after(
            &model,
            &[
                Step::Push,
                Step::Pop { daemon: 0, task: 0 },
                Step::Lose { daemon: 0 },
                Step::HandBack { task: 0 },
            ],
        );
        assert_eq!(state.field, Some(Field::For(2)));
        assert_eq!(state.tasks[0].place, Place::Ready);
    }
}
