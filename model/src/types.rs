//! Limits per task type (`[[queues.limits]]`: [`types.lua`](../../src/broker/scripts/types.lua), claim.lua's flow
//! path, settle.lua's runs), checked in a model of their own.
//!
//! A safe-mode queue with one limited type `A` (`max_running`, e.g. 1, under the running scope `t:A`) and one
//! unlimited type `B`, on one level, with no limit of the queue's own: the ready list, `A`'s flow
//! (`flow:1::A`), its throttle (`throttle:t:A`), the running hash's `t:A`, the claim lists with their settled
//! bits and scopes strings (a line `N SCOPE...` per run), and `done`. The protocol's model ([`crate::model`])
//! covers what is the same for every task (owners, leases, floors, adoption, the quarantine, the queue's own
//! limits); this one covers what the type limits add, step by step as the scripts do it:
//!
//! - a claim (claim.lua's `take_flowing`): from `A`'s flow first, as far as its count (and its throttle) admits,
//!   then from the ready list, where an `A` its limit holds back moves to the flow (a retry or recovery to its
//!   head, any other to its tail) and a `B` is taken; its claim list then holds runs in the order first met, and
//!   the `A` run adds to `t:A`; nothing taken though tasks wait is state 7;
//! - a settle (settle.lua): any subset of a claim's positions, by its owner (whose lease may have run out: the
//!   owner's fence applies it all the same) or by a monitor recovering an expired owner (every position not
//!   settled yet, back to the ready list's head as a recovery); each run's scopes lose the bits the call set anew
//!   in its range; an acknowledgement, a hand-back (to the ready list's head, as taken) or a throttle of an `A`
//!   (to the flow's head; the type's own throttle is set, which a later step lets run out); a lost reply, sent
//!   again later (every bit already set: stale);
//! - a daemon's lease running out (it stalls and may settle late), its crash (it forgets what it held), and its
//!   next claim under a new owner.
//!
//! Not here: several levels and the turns (each level's take is the same function), the rate limits of a type
//! (their logs are time), the quarantine's admitted prefix, a lost claim reply, oversized payloads, orphan flows
//! (a config without the limit draining them) and a type with several limits.

use std::fmt;

use arrayvec::ArrayVec;
use stateright::{Model, Property};

/// The most tasks a scenario has.
pub const TASKS: usize = 4;
/// The most tasks one claim takes.
pub const TAKE: usize = 3;
/// The most daemons.
const WORKERS: usize = 2;

/// `t:A` equals the positions not yet settled of the runs whose line names it, in every claim list.
pub const COUNT_EXACT: &str = "the type's count is its counted runs' unsettled positions";
/// No more `A` tasks are taken and unsettled than its `max_running`, and `t:A` never says more.
pub const COUNT_BOUND: &str = "the type's count stays within its limit";
/// settle.lua never finds `t:A` below what it subtracts (`running_underflow`).
pub const NO_UNDERFLOW: &str = "the type's count never goes below 0";
/// With no claim list left, `t:A` is 0 (absent).
pub const AT_REST: &str = "the type's count is 0 at rest";
/// Every task is in exactly one of: the ready list, the flow, a claim list (a position not settled yet), `done`.
pub const ONE_PLACE: &str = "every task is in exactly one place";
/// A claim made while a `B` waits in the ready list takes a task: a held-back `A` never blocks a `B`.
pub const NOT_BLOCKED: &str = "a held-back type never blocks the unlimited one";

/// The deliberate mutations of the type limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TypesMutation {
    /// settle.lua subtracts every bit a call sets in a claim list from every run's scopes (the list's whole
    /// count, as a list of one run does), not each run's own.
    SettleWholeClaim,
    /// claim.lua admits an `A` whatever `t:A` says (its throttle still holds it back).
    ClaimIgnoresCount,
    /// take_flowing drops the tasks it moves to the flow's tail instead of pushing them there.
    FlowLosesMoved,
}

/// One bounded check of the type limits.
#[derive(Clone, Debug)]
pub struct Limited {
    pub name: &'static str,
    /// Tasks of the limited type `A` (ids `0..limited`), then of the unlimited `B`.
    pub limited: u8,
    pub unlimited: u8,
    /// `A`'s `max_running`.
    pub max_running: u8,
    pub workers: u8,
    /// The largest claim (the batch).
    pub most: u8,
    /// How many of these may happen in a run: a lost reply, a lease running out, a crash, a hand-back, a
    /// throttle.
    pub faults: u8,
    pub mutation: Option<TypesMutation>,
}

impl Limited {
    pub fn with_mutation(mut self, mutation: TypesMutation) -> Limited {
        self.mutation = Some(mutation);
        self
    }
}

/// Two `A` under `max_running = 1` and one `B`, two daemons taking up to two tasks a claim, two faults.
pub fn typed() -> Limited {
    Limited {
        name: "typed",
        limited: 2,
        unlimited: 1,
        max_running: 1,
        workers: 2,
        most: 2,
        faults: 2,
        mutation: None,
    }
}

/// Two `A` and two `B`, claims of up to three tasks, three faults: a claim list of two runs of two tasks, a
/// settle that splits a run, and faults enough for a lost reply, a stall and a throttle in one run.
pub fn typed_more() -> Limited {
    Limited {
        name: "typed-more",
        unlimited: 2,
        most: 3,
        faults: 3,
        ..typed()
    }
}

/// The scenarios of the type limits.
pub fn scenarios() -> Vec<Limited> {
    vec![typed(), typed_more()]
}

/// The type limits' "break it on purpose" experiments: a mutated setup and a property it must break.
pub fn experiments() -> Vec<(Limited, &'static str)> {
    vec![
        (
            typed().with_mutation(TypesMutation::SettleWholeClaim),
            COUNT_EXACT,
        ),
        (
            typed().with_mutation(TypesMutation::ClaimIgnoresCount),
            COUNT_BOUND,
        ),
        (
            typed().with_mutation(TypesMutation::FlowLosesMoved),
            ONE_PLACE,
        ),
    ]
}

/// A task: its id (its type follows: below the scenario's `limited`, `A`) and whether its envelope says it came
/// back (`attempt` or `recovered` above 0: types.lua's `types_again`, which sends it to the flow's head).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Task {
    pub id: u8,
    pub again: bool,
}

impl fmt::Debug for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}{}", self.id, if self.again { "'" } else { "" })
    }
}

/// One run of a claim list: its line `N SCOPE...` (`counted`: it names `t:A`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Run {
    pub size: u8,
    pub counted: bool,
}

/// A claim list (`processing:OWNER:1:CLAIM`), its settled bits and its scopes string. The owner is the daemon
/// and its registration (`epoch`); a daemon holds one claim at a time, so that names the claim.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct List {
    pub worker: u8,
    pub epoch: u8,
    pub tasks: ArrayVec<Task, TAKE>,
    pub settled: ArrayVec<bool, TAKE>,
    pub runs: ArrayVec<Run, 2>,
}

/// What Redis holds of the queue.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Store {
    pub ready: ArrayVec<Task, TASKS>,
    pub flow: ArrayVec<Task, TASKS>,
    /// `throttle:t:A` exists.
    pub throttled: bool,
    /// The running hash's `t:A` (absent: 0).
    pub running: u8,
    pub lists: ArrayVec<List, TASKS>,
    pub done: ArrayVec<u8, TASKS>,
    /// `stats.running_underflow` grew.
    pub underflow: bool,
}

/// What a settle does with a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Ack,
    /// A hand-back: to the ready list's head, as it was taken.
    Back,
    /// A handler's throttle: to its flow's head, its type's (its group's) throttle set.
    Throttle,
    /// A monitor's recovery: to the ready list's head, `recovered` + 1.
    Recover,
}

/// A settle call the daemon sent and must send again (its reply was lost).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Call {
    pub epoch: u8,
    pub positions: ArrayVec<u8, TAKE>,
    pub op: Op,
}

/// A daemon: its owner's registration and lease, the positions of its claim it has not settled yet, a call to
/// send again.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Worker {
    pub expired: bool,
    pub epoch: u8,
    pub held: ArrayVec<u8, TAKE>,
    pub resend: Option<Call>,
}

/// The daemon's side of the steps, the same for the type limits' model and the groups' ([`crate::groups`]).
impl Worker {
    /// Before a claim: LEASELOST when its lease ran out, and the daemon registers a new owner.
    pub fn claims(&mut self) {
        if self.expired {
            self.expired = false;
            self.epoch += 1;
        }
    }

    /// The settle call for the held positions in `mask` (bit i: `held[i]`), which the daemon no longer holds; a
    /// lost reply keeps the call to send again.
    pub fn settle_call(&mut self, mask: u8, op: Op, lost: bool) -> Call {
        let mut positions = ArrayVec::new();
        let mut kept = ArrayVec::new();
        for (i, p) in self.held.iter().enumerate() {
            if mask & (1 << i) != 0 {
                positions.push(*p);
            } else {
                kept.push(*p);
            }
        }
        self.held = kept;
        let call = Call {
            epoch: self.epoch,
            positions,
            op,
        };
        if lost {
            self.resend = Some(call.clone());
        }
        call
    }

    /// `kill -9`: the daemon forgets what it held, and its owner's lease runs out.
    pub fn crash(&mut self) {
        self.expired = true;
        self.held.clear();
        self.resend = None;
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TypesState {
    pub redis: Store,
    pub workers: ArrayVec<Worker, WORKERS>,
    pub faults: u8,
    /// A claim took nothing while a `B` waited in the ready list.
    pub blocked: bool,
    /// For the `sometimes`: a claim list of two runs, a task moved to the flow, a state 7.
    pub two_runs: bool,
    pub moved: bool,
    pub held_back: bool,
}

/// One step.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// claim.lua by `worker` for up to `max` tasks (under a new owner if its lease ran out).
    Claim { worker: u8, max: u8 },
    /// settle.lua by `worker` for the held positions in `mask` (bit i: `held[i]`), its reply lost or not.
    Settle {
        worker: u8,
        mask: u8,
        op: Op,
        lost: bool,
    },
    /// The lost call sent again.
    Resend { worker: u8 },
    /// The daemon's lease runs out (it stalls; it may settle later).
    Expire { worker: u8 },
    /// The daemon crashes: it forgets what it held.
    Crash { worker: u8 },
    /// A monitor settles the claim list `list` of an expired owner: every position not settled yet, recovered.
    Recover { list: u8 },
    /// `throttle:t:A` runs out.
    ThrottleEnds,
}

/// The model of one [`Limited`].
pub struct Types {
    pub setup: Limited,
}

impl Types {
    pub fn new(setup: Limited) -> Types {
        Types { setup }
    }

    fn is_a(&self, task: Task) -> bool {
        task.id < self.setup.limited
    }

    fn tasks(&self) -> u8 {
        self.setup.limited + self.setup.unlimited
    }

    /// claim.lua with types.lua's block: `types_admit`'s room, `take_flowing`, `push_runs`, `scopes_spend`.
    fn claim(&self, state: &mut TypesState, worker: u8, max: u8) {
        let mutation = self.setup.mutation;
        let waiting_b = state.redis.ready.iter().any(|t| !self.is_a(*t));
        let redis = &mut state.redis;
        // types_admit: a throttled type admits nothing; a counted one what its limit leaves.
        let mut room: Option<u8> = if redis.throttled {
            Some(0)
        } else if mutation == Some(TypesMutation::ClaimIgnoresCount) {
            None
        } else {
            Some(self.setup.max_running.saturating_sub(redis.running))
        };
        // Runs in the order first met: (is A, tasks).
        let mut runs: ArrayVec<(bool, ArrayVec<Task, TAKE>), 2> = ArrayVec::new();
        let mut add = |a: bool, task: Task| {
            if let Some(run) = runs.iter_mut().find(|(kind, _)| *kind == a) {
                run.1.push(task);
            } else {
                let mut tasks = ArrayVec::new();
                tasks.push(task);
                runs.push((a, tasks));
            }
        };
        let mut got = 0;
        let mut held = false;
        // The flow first, as far as its room admits.
        let mut m = max;
        if let Some(room) = room {
            m = m.min(room);
        }
        if m > 0 {
            let n = (m as usize).min(redis.flow.len());
            for task in redis.flow.drain(..n) {
                add(true, task);
            }
            got += n as u8;
            if let Some(room) = room.as_mut() {
                *room -= n as u8;
            }
        } else if room == Some(0) && !redis.flow.is_empty() {
            held = true;
        }
        // Then the ready list: a held-back A moves to the flow.
        let (mut heads, mut tails): (ArrayVec<Task, TASKS>, ArrayVec<Task, TASKS>) =
            (ArrayVec::new(), ArrayVec::new());
        while got < max && !redis.ready.is_empty() {
            let task = redis.ready.remove(0);
            if !self.is_a(task) {
                add(false, task);
                got += 1;
            } else if room.is_none_or(|r| r > 0) {
                if let Some(room) = room.as_mut() {
                    *room -= 1;
                }
                add(true, task);
                got += 1;
            } else {
                held = true;
                if task.again {
                    heads.push(task);
                } else {
                    tails.push(task);
                }
            }
        }
        state.moved |= !heads.is_empty() || !tails.is_empty();
        for (k, task) in heads.into_iter().enumerate() {
            redis.flow.insert(k, task);
        }
        if mutation != Some(TypesMutation::FlowLosesMoved) {
            redis.flow.extend(tails);
        }
        // push_runs and scopes_spend.
        if got > 0 {
            let mut list = List {
                worker,
                epoch: state.workers[worker as usize].epoch,
                tasks: ArrayVec::new(),
                settled: ArrayVec::new(),
                runs: ArrayVec::new(),
            };
            for (a, tasks) in runs {
                list.runs.push(Run {
                    size: tasks.len() as u8,
                    counted: a && self.setup.max_running > 0,
                });
                if a && self.setup.max_running > 0 {
                    redis.running += tasks.len() as u8;
                }
                for task in tasks {
                    list.tasks.push(task);
                    list.settled.push(false);
                }
            }
            state.two_runs |= list.runs.len() > 1;
            state.workers[worker as usize].held = (0..got).collect();
            redis.lists.push(list);
        } else {
            state.held_back |= held;
            state.blocked |= waiting_b;
        }
    }

    /// settle.lua on the claim list of (`worker`, `epoch`), for `positions`, all with `op`.
    fn settle(&self, redis: &mut Store, worker: u8, epoch: u8, positions: &[u8], op: Op) {
        let Some(at) = redis
            .lists
            .iter()
            .position(|l| l.worker == worker && l.epoch == epoch)
        else {
            return; // The claim is gone: stale.
        };
        let list = &mut redis.lists[at];
        let before = list.settled.clone();
        for &p in positions {
            if list.settled[p as usize] {
                continue; // Its bit is set: stale.
            }
            list.settled[p as usize] = true;
            let task = list.tasks[p as usize];
            match op {
                Op::Ack => redis.done.push(task.id),
                Op::Back => redis.ready.insert(0, task),
                Op::Recover => redis.ready.insert(
                    0,
                    Task {
                        id: task.id,
                        again: true,
                    },
                ),
                Op::Throttle => {
                    redis.flow.insert(0, task);
                    redis.throttled = true;
                }
            }
        }
        // Each run's scopes lose the bits this call set anew in its range.
        let fresh = |from: usize, to: usize| {
            (from..to)
                .filter(|&p| list.settled[p] && !before[p])
                .count() as u8
        };
        let whole = fresh(0, list.tasks.len());
        let mut freed = 0;
        let mut from = 0;
        for run in &list.runs {
            let to = from + run.size as usize;
            if run.counted {
                freed += if self.setup.mutation == Some(TypesMutation::SettleWholeClaim) {
                    whole
                } else {
                    fresh(from, to)
                };
            }
            from = to;
        }
        if list.settled.iter().all(|s| *s) {
            redis.lists.remove(at);
        }
        if freed > redis.running {
            redis.underflow = true;
            redis.running = 0;
        } else {
            redis.running -= freed;
        }
    }

    /// Whether the owner of `list` is expired (its lease ran out, or the daemon registered anew since).
    fn expired(state: &TypesState, list: &List) -> bool {
        let worker = &state.workers[list.worker as usize];
        worker.expired || worker.epoch != list.epoch
    }
}

impl Model for Types {
    type State = TypesState;
    type Action = Step;

    fn init_states(&self) -> Vec<TypesState> {
        let mut redis = Store::default();
        // Interleaved, the A first: a claim meets an A it must hold back before the B behind it.
        let mut ids: Vec<u8> = Vec::new();
        let (a, b) = (self.setup.limited, self.setup.unlimited);
        for k in 0..a.max(b) {
            if k < a {
                ids.push(k);
            }
            if k < b {
                ids.push(a + k);
            }
        }
        for id in ids {
            redis.ready.push(Task { id, again: false });
        }
        vec![TypesState {
            redis,
            workers: (0..self.setup.workers).map(|_| Worker::default()).collect(),
            faults: self.setup.faults,
            blocked: false,
            two_runs: false,
            moved: false,
            held_back: false,
        }]
    }

    fn actions(&self, state: &TypesState, actions: &mut Vec<Step>) {
        let fault = state.faults > 0;
        for (w, worker) in state.workers.iter().enumerate() {
            let w = w as u8;
            if worker.held.is_empty() && worker.resend.is_none() {
                for max in 1..=self.setup.most {
                    actions.push(Step::Claim { worker: w, max });
                }
            }
            if worker.resend.is_some() {
                actions.push(Step::Resend { worker: w });
            } else if !worker.held.is_empty() {
                let list = state
                    .redis
                    .lists
                    .iter()
                    .find(|l| l.worker == w && l.epoch == worker.epoch);
                for mask in 1..(1u8 << worker.held.len()) {
                    // The daemon knows its tasks' types (a throttle names an A's scope).
                    let all_a = list.is_some_and(|l| {
                        worker
                            .held
                            .iter()
                            .enumerate()
                            .filter(|(i, _)| mask & (1 << i) != 0)
                            .all(|(_, p)| self.is_a(l.tasks[*p as usize]))
                    });
                    for op in [Op::Ack, Op::Back, Op::Throttle] {
                        if op != Op::Ack && !fault || op == Op::Throttle && !all_a {
                            continue;
                        }
                        actions.push(Step::Settle {
                            worker: w,
                            mask,
                            op,
                            lost: false,
                        });
                        if fault && op == Op::Ack {
                            actions.push(Step::Settle {
                                worker: w,
                                mask,
                                op,
                                lost: true,
                            });
                        }
                    }
                }
            }
            if fault && !worker.expired {
                actions.push(Step::Expire { worker: w });
            }
            if fault && (!worker.held.is_empty() || worker.resend.is_some()) {
                actions.push(Step::Crash { worker: w });
            }
        }
        for (k, list) in state.redis.lists.iter().enumerate() {
            if Self::expired(state, list) {
                actions.push(Step::Recover { list: k as u8 });
            }
        }
        if state.redis.throttled {
            actions.push(Step::ThrottleEnds);
        }
    }

    fn next_state(&self, last: &TypesState, step: Step) -> Option<TypesState> {
        let mut state = last.clone();
        match step {
            Step::Claim { worker, max } => {
                state.workers[worker as usize].claims();
                self.claim(&mut state, worker, max);
            }
            Step::Settle {
                worker,
                mask,
                op,
                lost,
            } => {
                let call = state.workers[worker as usize].settle_call(mask, op, lost);
                if op != Op::Ack || lost {
                    state.faults -= 1;
                }
                self.settle(&mut state.redis, worker, call.epoch, &call.positions, op);
            }
            Step::Resend { worker } => {
                let call = state.workers[worker as usize].resend.take()?;
                self.settle(
                    &mut state.redis,
                    worker,
                    call.epoch,
                    &call.positions,
                    call.op,
                );
            }
            Step::Expire { worker } => {
                state.workers[worker as usize].expired = true;
                state.faults -= 1;
            }
            Step::Crash { worker } => {
                state.workers[worker as usize].crash();
                state.faults -= 1;
            }
            Step::Recover { list } => {
                let l = &state.redis.lists[list as usize];
                let (worker, epoch) = (l.worker, l.epoch);
                let positions: ArrayVec<u8, TAKE> = (0..l.tasks.len() as u8)
                    .filter(|p| !l.settled[*p as usize])
                    .collect();
                self.settle(&mut state.redis, worker, epoch, &positions, Op::Recover);
            }
            Step::ThrottleEnds => state.redis.throttled = false,
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(COUNT_EXACT, |_, s: &TypesState| {
                let mut counted = 0;
                for list in &s.redis.lists {
                    let mut from = 0;
                    for run in &list.runs {
                        let to = from + run.size as usize;
                        if run.counted {
                            counted += list.settled[from..to].iter().filter(|s| !**s).count();
                        }
                        from = to;
                    }
                }
                s.redis.running as usize == counted
            }),
            Property::always(COUNT_BOUND, |model: &Types, s: &TypesState| {
                let taken = s
                    .redis
                    .lists
                    .iter()
                    .flat_map(|l| l.tasks.iter().zip(&l.settled))
                    .filter(|(t, settled)| !**settled && model.is_a(**t))
                    .count();
                taken <= model.setup.max_running as usize
                    && s.redis.running <= model.setup.max_running
            }),
            Property::always(NO_UNDERFLOW, |_, s: &TypesState| !s.redis.underflow),
            Property::always(AT_REST, |_, s: &TypesState| {
                !s.redis.lists.is_empty() || s.redis.running == 0
            }),
            Property::always(ONE_PLACE, |model: &Types, s: &TypesState| {
                let r = &s.redis;
                (0..model.tasks()).all(|id| {
                    let places = r.ready.iter().filter(|t| t.id == id).count()
                        + r.flow.iter().filter(|t| t.id == id).count()
                        + r.done.iter().filter(|d| **d == id).count()
                        + r.lists
                            .iter()
                            .flat_map(|l| l.tasks.iter().zip(&l.settled))
                            .filter(|(t, settled)| !**settled && t.id == id)
                            .count();
                    places == 1
                })
            }),
            Property::always(NOT_BLOCKED, |_, s: &TypesState| !s.blocked),
            Property::sometimes("every task is done", |model: &Types, s: &TypesState| {
                s.redis.done.len() == model.tasks() as usize
            }),
            Property::sometimes("a claim list of two runs", |_, s: &TypesState| s.two_runs),
            Property::sometimes("a held-back task moves to the flow", |_, s: &TypesState| {
                s.moved
            }),
            Property::sometimes("a claim is held back (state 7)", |_, s: &TypesState| {
                s.held_back
            }),
            Property::sometimes("the type is throttled", |_, s: &TypesState| {
                s.redis.throttled
            }),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: u8) -> Task {
        Task { id, again: false }
    }

    /// With `A`'s slot taken, a claim moves the held-back `A` to the flow's tail (a recovered one to its head)
    /// and takes the `B` behind it, in a run of its own that the type's count does not name.
    #[test]
    fn a_claim_moves_a_held_back_task_to_the_flow_and_takes_the_one_behind_it() {
        let model = Types::new(typed());
        let mut state = model.init_states().remove(0);
        state.redis.running = 1;
        state.redis.flow.push(task(0));
        state.redis.ready.clear();
        state.redis.ready.push(Task { id: 1, again: true });
        state.redis.ready.push(task(2));
        model.claim(&mut state, 0, 2);
        let flow: Vec<u8> = state.redis.flow.iter().map(|t| t.id).collect();
        assert_eq!(flow, [1, 0], "the recovered A goes to the flow's head");
        assert!(state.redis.ready.is_empty());
        let list = &state.redis.lists[0];
        assert_eq!(list.tasks.as_slice(), [task(2)]);
        assert_eq!(
            list.runs.as_slice(),
            [Run {
                size: 1,
                counted: false
            }]
        );
        assert_eq!(state.redis.running, 1);
    }

    /// A settle of the `B` of a claim list of two runs frees nothing of `A`'s count; the `A`'s frees its slot.
    #[test]
    fn a_settle_frees_only_the_runs_whose_bits_it_sets() {
        let model = Types::new(typed());
        let mut state = model.init_states().remove(0);
        model.claim(&mut state, 0, 2);
        assert_eq!(state.redis.running, 1);
        assert_eq!(state.redis.lists[0].runs.len(), 2, "A's run, then B's");
        model.settle(&mut state.redis, 0, 0, &[1], Op::Ack);
        assert_eq!(state.redis.running, 1);
        model.settle(&mut state.redis, 0, 0, &[0], Op::Ack);
        assert_eq!(state.redis.running, 0);
        assert!(state.redis.lists.is_empty());
    }
}
