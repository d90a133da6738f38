//! Groups beside type limits (a queue with both `[queues.groups]` and `[[queues.limits]]`: groups.lua's
//! `member_type_flow`, `flow_refused`, `flow_hold`, `group_sort_turn`, `groups_take`, `groups_due`'s type unpark;
//! settle.lua's freed-scope loop that empties `park:g:GROUP`; group_resume.lua), checked in a model of their own.
//!
//! A safe-mode grouped queue with two groups `A` and `B` (each under the groups' `max_running`) and one limited
//! type `T` (its own `max_running`), on one level: the ready list, each group's two flows (`GROUP:` for its tasks
//! as they come, `GROUP:T` for its `T` tasks that `T`'s limit held back), each flow's band in the level's ring (a
//! pass, PARKED, or out of the ring) and the order in which the PARKED ones were parked, the level's virtual time,
//! each group's pause and count `g:GROUP`, `T`'s count `t:T`, the park indexes (`park:g:GROUP` and `park:t:T`,
//! which here can only name a group's `GROUP:T`: a set of the groups whose `GROUP:T` they name), the claim lists
//! with their settled bits and runs (a run per (group, typed) pair, in the order first met, counted in `g:GROUP`
//! and, for `T` tasks, in `t:T`), and `done`. Step by step as the scripts do it:
//!
//! - a claim: `groups_due` (each level's longest-parked flow looked at, its group's count and pause and, for a
//!   `GROUP:T`, `T`'s room read: moved back to the virtual time when nothing holds it, to the back of the parked
//!   when something does; then, when `T` has room, every entry of `park:t:T` removed and its flow, if PARKED, moved
//!   back), `groups_intake` (every ready task to its group's `GROUP:`, a recovered one to its head), the candidates
//!   (the lowest passes, ties by member, read past refused flows until `max` are admitted), `groups_take` (refused
//!   flows PARKED, a `GROUP:T` refused by its group named in `park:g:GROUP`, by `T` in `park:t:T`; turns by pass;
//!   a turn of `GROUP:` sorts: a `T` task `T` refuses now goes to `GROUP:T`, which joins the ring PARKED and
//!   named in `park:t:T`), and the counts;
//! - a settle of any positions by their owner (late too) or a monitor's recovery, an acknowledgement or a
//!   hand-back; each run's scopes lose the bits set anew in its range; a freed group moves its PARKED `GROUP:` and
//!   every flow its park index names back to the virtual time and deletes the index; a lost reply sent again;
//! - `kmqd group pause` and `kmqd group resume` (the pause deleted, `GROUP:` and the index's flows moved back,
//!   the index deleted); a lease running out and a `kill -9`.
//!
//! Not here: throttles and rate windows (TIMED, the groups' model has them), the SCAN bound of a claim's sorting
//! (a claim here looks at four tasks at most), several levels and types.

use arrayvec::ArrayVec;
use stateright::{Model, Property};

use crate::groups::Band;
pub use crate::types::{Call, Op, Task, Worker};

/// The most tasks a scenario has.
pub const TASKS: usize = 4;
/// The most tasks one claim takes.
const TAKE: usize = 2;
const WORKERS: usize = 2;
const GROUPS: usize = 2;
/// `A:`, `A:T`, `B:`, `B:T`: flow `2 * group + typed`, which is also the members' order in the ring.
const FLOWS: usize = 4;

pub const COUNT_EXACT: &str = "each count is its counted runs' unsettled positions";
pub const COUNT_BOUND: &str = "each group's and the type's count stays within its limit";
pub const NO_UNDERFLOW: &str = "no count goes below 0";
pub const AT_REST: &str = "every count is 0 at rest";
pub const ONE_PLACE: &str = "every task is in exactly one place";
/// A flow with tasks is in the lowest band, or PARKED and sure to come back: a `GROUP:` while its group's count
/// is above 0 or it is paused (the settle that frees a slot, or the resume, moves it back); a `GROUP:T` named in
/// `park:g:GROUP` while its group's count is above 0 or it is paused (the same, through the index), or named in
/// `park:t:T` (while `T` is full, its settles come; once it has room, the next claim's `groups_due` moves back
/// up to its room + 8 entries, here all of them: [`NOT_BLOCKED`] checks that the claims do). It does not count
/// `groups_due`'s look at the longest-parked flow, which brings back one flow a claim whatever stranded it.
pub const NOT_STRANDED: &str = "no flow with tasks is stranded";
/// A claim made while a waiting task's group and type both admit it (the group not paused, both counts below
/// their limits; the task in the ready list or in any flow, in any band) takes a task.
pub const NOT_BLOCKED: &str = "a claim takes a task while a waiting task's group and type admit it";

/// The deliberate mutations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GroupTypesMutation {
    /// settle.lua frees a group's slot and moves its `GROUP:` back, but leaves `park:g:GROUP` (and its flows).
    SettleKeepsGroupIndex,
    /// claim.lua's `groups_due` does not move back the flows `park:t:T` names when `T` has room.
    ClaimKeepsTypeIndex,
    /// A turn of `GROUP:` takes a `T` task whatever `T`'s count says.
    SortIgnoresType,
    /// groups_candidates counts every admitted `GROUP:` towards `max`, even one whose tasks its turn would only
    /// move to `GROUP:T` (claim.lua before this model's finding: such a claim took nothing though another
    /// group's task could run).
    CandidatesCountSorting,
}

/// One bounded check.
#[derive(Clone, Debug)]
pub struct GroupTyped {
    pub name: &'static str,
    /// The tasks, in the ready list's order: (group, of type `T`).
    pub tasks: &'static [(u8, bool)],
    /// The groups' `max_running`.
    pub group_max: u8,
    /// `T`'s `max_running`.
    pub type_max: u8,
    pub weights: [u8; GROUPS],
    pub workers: u8,
    pub most: u8,
    /// How many of these may happen in a run: a lost reply, a lease running out, a crash, a hand-back, a pause.
    pub faults: u8,
    pub mutation: Option<GroupTypesMutation>,
}

impl GroupTyped {
    pub fn with_mutation(mut self, mutation: GroupTypesMutation) -> GroupTyped {
        self.mutation = Some(mutation);
        self
    }
}

/// `A`'s `T` task, `B`'s `T` task, `A`'s other task; both groups and `T` under `max_running = 1`, `A` of weight 2;
/// two daemons taking up to two tasks a claim; two faults.
pub fn grouped_typed() -> GroupTyped {
    GroupTyped {
        name: "grouped-typed",
        tasks: &[(0, true), (1, true), (0, false)],
        group_max: 1,
        type_max: 1,
        weights: [2, 1],
        workers: 2,
        most: 2,
        faults: 2,
        mutation: None,
    }
}

/// The shape of the model's seventh finding (model/README.md): groups under `max_running = 2`, two `T` tasks of
/// `A`, two other tasks of `B`, weights 1, two faults.
pub fn grouped_typed_wide() -> GroupTyped {
    GroupTyped {
        name: "grouped-typed-wide",
        tasks: &[(0, true), (1, false), (0, true), (1, false)],
        group_max: 2,
        weights: [1, 1],
        ..grouped_typed()
    }
}

/// Both groups with a `T` task and another task, three faults: a pause with a stall, a crash or a lost reply.
pub fn grouped_typed_more() -> GroupTyped {
    GroupTyped {
        name: "grouped-typed-more",
        tasks: &[(0, true), (1, true), (0, false), (1, false)],
        faults: 3,
        ..grouped_typed()
    }
}

/// The scenarios the CI check runs (every property holds).
pub fn scenarios() -> Vec<GroupTyped> {
    vec![grouped_typed(), grouped_typed_more(), grouped_typed_wide()]
}

/// The experiments: a mutated setup and a property it must break.
pub fn experiments() -> Vec<(GroupTyped, &'static str)> {
    vec![
        (
            grouped_typed().with_mutation(GroupTypesMutation::SettleKeepsGroupIndex),
            NOT_STRANDED,
        ),
        (
            grouped_typed().with_mutation(GroupTypesMutation::ClaimKeepsTypeIndex),
            NOT_BLOCKED,
        ),
        (
            grouped_typed().with_mutation(GroupTypesMutation::SortIgnoresType),
            COUNT_BOUND,
        ),
        (
            grouped_typed_wide().with_mutation(GroupTypesMutation::CandidatesCountSorting),
            NOT_BLOCKED,
        ),
    ]
}

/// One run of a claim list: its size, group, and whether it is of `T` (its line names `t:T`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Run {
    pub size: u8,
    pub group: u8,
    pub typed: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct List {
    pub worker: u8,
    pub epoch: u8,
    pub tasks: ArrayVec<Task, TAKE>,
    pub settled: ArrayVec<bool, TAKE>,
    pub runs: ArrayVec<Run, TAKE>,
}

/// What Redis holds of the queue.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Store {
    pub ready: ArrayVec<Task, TASKS>,
    pub flows: [ArrayVec<Task, TASKS>; FLOWS],
    /// Each flow's band; absent: out of the ring.
    pub bands: [Option<Band>; FLOWS],
    /// The PARKED flows, longest parked first.
    pub parked: ArrayVec<u8, FLOWS>,
    pub vt: u8,
    pub paused: [bool; GROUPS],
    pub running: [u8; GROUPS],
    pub running_t: u8,
    /// `park:g:GROUP` names `GROUP:T`.
    pub park_g: [bool; GROUPS],
    /// `park:t:T` names `GROUP:T`.
    pub park_t: [bool; GROUPS],
    pub lists: ArrayVec<List, TASKS>,
    pub done: ArrayVec<u8, TASKS>,
    pub underflow: bool,
}

impl Store {
    fn band(&self, f: usize) -> Band {
        self.bands[f].unwrap_or(Band::Out)
    }

    /// ZADD XX (or NX into an absent flow) of a band: a PARKED score is `PARKED + now`, so it goes to the back.
    fn set_band(&mut self, f: usize, band: Option<Band>) {
        self.parked.retain(|p| *p as usize != f);
        if band == Some(Band::Parked) {
            self.parked.push(f as u8);
        }
        self.bands[f] = band;
    }

    /// Back to the virtual time if PARKED (settle.lua, group_resume.lua, groups_due's unpark).
    fn unpark(&mut self, f: usize) {
        if self.band(f) == Band::Parked {
            let vt = self.vt;
            self.set_band(f, Some(Band::Pass(vt)));
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GroupTypesState {
    pub redis: Store,
    pub workers: ArrayVec<Worker, WORKERS>,
    pub faults: u8,
    /// A claim took nothing while a waiting task's group and type admitted it.
    pub blocked: bool,
    /// For the `sometimes`: a task moved to `GROUP:T`, a run counted in both scopes.
    pub moved: bool,
    pub both: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    Claim {
        worker: u8,
        max: u8,
    },
    Settle {
        worker: u8,
        mask: u8,
        op: Op,
        lost: bool,
    },
    Resend {
        worker: u8,
    },
    Expire {
        worker: u8,
    },
    Crash {
        worker: u8,
    },
    Recover {
        list: u8,
    },
    Pause {
        group: u8,
    },
    Resume {
        group: u8,
    },
}

pub struct GroupTypes {
    pub setup: GroupTyped,
}

/// A candidate flow of a claim.
struct Candidate {
    flow: usize,
    pass: u8,
    served: bool,
    looked: bool,
    empty: bool,
}

/// A group's and `T`'s rooms as the claim read them (group_state, types.lua), spent by its turns.
struct Rooms {
    group: [u8; GROUPS],
    t: u8,
}

impl GroupTypes {
    pub fn new(setup: GroupTyped) -> GroupTypes {
        GroupTypes { setup }
    }

    fn group(&self, task: Task) -> usize {
        self.setup.tasks[task.id as usize].0 as usize
    }

    fn typed(&self, task: Task) -> bool {
        self.setup.tasks[task.id as usize].1
    }

    fn is(&self, m: GroupTypesMutation) -> bool {
        self.setup.mutation == Some(m)
    }

    /// flow_refused: the band a refused flow goes to, and whether `park:g:` (false) or `park:t:T` (true) names
    /// it; None when admitted.
    fn refused(&self, redis: &Store, rooms: &Rooms, f: usize) -> Option<Option<bool>> {
        let g = f / 2;
        if redis.paused[g] || rooms.group[g] == 0 {
            return Some((f % 2 == 1).then_some(false));
        }
        if f % 2 == 1 && rooms.t == 0 {
            return Some(Some(true));
        }
        None
    }

    /// Names a PARKED `GROUP:T` in its refuser's index (ZADD NX).
    fn name_in(redis: &mut Store, f: usize, index: Option<bool>) {
        match index {
            Some(false) => redis.park_g[f / 2] = true,
            Some(true) => redis.park_t[f / 2] = true,
            None => {}
        }
    }

    /// Whether some waiting task's group and type both admit it.
    fn admitted_waiting(&self, redis: &Store) -> bool {
        let s = &self.setup;
        redis
            .ready
            .iter()
            .chain(redis.flows.iter().flatten())
            .any(|&t| {
                let g = self.group(t);
                !redis.paused[g]
                    && redis.running[g] < s.group_max
                    && (!self.typed(t) || redis.running_t < s.type_max)
            })
    }

    /// claim.lua with groups.lua's block beside types.lua's.
    fn claim(&self, state: &mut GroupTypesState, worker: u8, max: u8) {
        let must_take = self.admitted_waiting(&state.redis);
        let s = &self.setup;
        let redis = &mut state.redis;
        let mut rooms = Rooms {
            group: [0, 1].map(|g| s.group_max.saturating_sub(redis.running[g])),
            t: s.type_max.saturating_sub(redis.running_t),
        };
        // groups_due: the longest-parked flow, read first; then T's park index when T has room.
        if let Some(&head) = redis.parked.first() {
            let head = head as usize;
            let g = head / 2;
            let held = rooms.group[g] == 0 || (head % 2 == 1 && rooms.t == 0) || redis.paused[g];
            if held {
                redis.set_band(head, Some(Band::Parked));
            } else {
                redis.unpark(head);
            }
        }
        if rooms.t > 0 && !self.is(GroupTypesMutation::ClaimKeepsTypeIndex) {
            for g in 0..GROUPS {
                if redis.park_t[g] {
                    redis.park_t[g] = false;
                    redis.unpark(2 * g + 1);
                }
            }
        }
        // groups_intake: by group only, to `GROUP:`; a recovered task to its head.
        let items: ArrayVec<Task, TASKS> = redis.ready.drain(..).collect();
        let mut heads: [ArrayVec<Task, TASKS>; GROUPS] = Default::default();
        for task in items {
            let f = 2 * self.group(task);
            if task.again {
                heads[f / 2].push(task);
            } else {
                redis.flows[f].push(task);
            }
            if redis.bands[f].is_none() {
                redis.bands[f] = Some(Band::Pass(redis.vt));
            }
        }
        for (g, head) in heads.into_iter().enumerate() {
            for (k, task) in head.into_iter().enumerate() {
                redis.flows[2 * g].insert(k, task);
            }
        }
        // groups_candidates: the lowest passes, ties by member, until `max` are admitted.
        let mut lowest: ArrayVec<(u8, usize), FLOWS> = (0..FLOWS)
            .filter_map(|f| match redis.band(f) {
                Band::Pass(p) => Some((p, f)),
                _ => None,
            })
            .collect();
        lowest.sort();
        let mut cands: ArrayVec<Candidate, FLOWS> = ArrayVec::new();
        let mut admitted = 0;
        for (pass, f) in lowest {
            if admitted >= max as usize {
                break;
            }
            // A `GROUP:` counts only if one of its first tasks (8 in groups.lua: all of them here) would be taken
            // (the fix of this model's finding).
            let takes = f % 2 == 1
                || self.is(GroupTypesMutation::CandidatesCountSorting)
                || redis.flows[f]
                    .iter()
                    .any(|t| !self.typed(*t) || rooms.t > 0);
            if self.refused(redis, &rooms, f).is_none() && takes {
                admitted += 1;
            }
            cands.push(Candidate {
                flow: f,
                pass,
                served: false,
                looked: false,
                empty: false,
            });
        }
        // groups_take: refused flows parked and named; turns by pass.
        let mut active: ArrayVec<usize, FLOWS> = ArrayVec::new();
        for (k, c) in cands.iter().enumerate() {
            if let Some(index) = self.refused(redis, &rooms, c.flow) {
                redis.set_band(c.flow, Some(Band::Parked));
                Self::name_in(redis, c.flow, index);
            } else {
                active.push(k);
            }
        }
        // Runs per (group, typed), in the order first met.
        let mut runs: ArrayVec<(Run, ArrayVec<Task, TAKE>), TAKE> = ArrayVec::new();
        let mut add = |task: Task, typed: bool, g: usize| {
            if let Some(run) = runs
                .iter_mut()
                .find(|(r, _)| r.group as usize == g && r.typed == typed)
            {
                run.0.size += 1;
                run.1.push(task);
            } else {
                let mut tasks = ArrayVec::new();
                tasks.push(task);
                runs.push((
                    Run {
                        size: 1,
                        group: g as u8,
                        typed,
                    },
                    tasks,
                ));
            }
        };
        let mut got = 0u8;
        while got < max && !active.is_empty() {
            let mut still = ArrayVec::<usize, FLOWS>::new();
            for &k in &active {
                let c = &mut cands[k];
                if got >= max {
                    still.push(k);
                    continue;
                }
                let g = c.flow / 2;
                let weight = s.weights[g].max(1);
                let mut m = weight.min(max - got).min(rooms.group[g]);
                if c.flow % 2 == 1 {
                    m = m.min(rooms.t);
                }
                if m == 0 {
                    continue;
                }
                let (n, looked) = if c.flow % 2 == 0 {
                    // group_sort_turn.
                    let len = (m as usize).min(redis.flows[c.flow].len());
                    let items: ArrayVec<Task, TASKS> = redis.flows[c.flow].drain(..len).collect();
                    let mut moved: ArrayVec<Task, TASKS> = ArrayVec::new();
                    let mut took = 0u8;
                    for task in items {
                        let typed = self.typed(task);
                        if typed && rooms.t == 0 && !self.is(GroupTypesMutation::SortIgnoresType) {
                            moved.push(task);
                        } else {
                            if typed {
                                rooms.t = rooms.t.saturating_sub(1);
                            }
                            add(task, typed, g);
                            took += 1;
                        }
                    }
                    if !moved.is_empty() {
                        state.moved = true;
                        let to = c.flow + 1;
                        let mut k = 0;
                        for task in &moved {
                            if task.again {
                                redis.flows[to].insert(k, *task);
                                k += 1;
                            } else {
                                redis.flows[to].push(*task);
                            }
                        }
                        // flow_refused with the group's room as the turn began, then ZADD NX.
                        let index = self.refused(redis, &rooms, to).unwrap_or(None);
                        if redis.bands[to].is_none() {
                            redis.set_band(to, Some(Band::Parked));
                        }
                        Self::name_in(redis, to, index);
                    }
                    (took, len as u8)
                } else {
                    let len = (m as usize).min(redis.flows[c.flow].len());
                    let items: ArrayVec<Task, TASKS> = redis.flows[c.flow].drain(..len).collect();
                    for task in items {
                        add(task, true, g);
                    }
                    rooms.t -= len as u8;
                    (len as u8, len as u8)
                };
                got += n;
                rooms.group[g] -= n;
                if n > 0 {
                    if c.pass > redis.vt {
                        redis.vt = c.pass;
                    }
                    c.pass += (2 * n) / weight;
                    c.served = true;
                }
                if looked > 0 {
                    c.looked = true;
                }
                if looked < m {
                    c.empty = true;
                } else {
                    still.push(k);
                }
            }
            active = still;
        }
        for c in &cands {
            if c.empty || ((c.served || c.looked) && redis.flows[c.flow].is_empty()) {
                redis.set_band(c.flow, None);
            } else if c.served {
                redis.set_band(c.flow, Some(Band::Pass(c.pass)));
            }
        }
        // push_runs and the counts.
        if got > 0 {
            let mut list = List {
                worker,
                epoch: state.workers[worker as usize].epoch,
                tasks: ArrayVec::new(),
                settled: ArrayVec::new(),
                runs: ArrayVec::new(),
            };
            for (run, tasks) in runs {
                if s.group_max > 0 {
                    redis.running[run.group as usize] += run.size;
                }
                if run.typed && s.type_max > 0 {
                    redis.running_t += run.size;
                    state.both = true;
                }
                list.runs.push(run);
                for task in tasks {
                    list.tasks.push(task);
                    list.settled.push(false);
                }
            }
            state.workers[worker as usize].held = (0..got).collect();
            redis.lists.push(list);
        } else {
            state.blocked |= must_take;
        }
    }

    /// settle.lua on the claim list of (`worker`, `epoch`), for `positions`, all with `op`.
    fn settle(&self, redis: &mut Store, worker: u8, epoch: u8, positions: &[u8], op: Op) {
        let s = &self.setup;
        let Some(at) = redis
            .lists
            .iter()
            .position(|l| l.worker == worker && l.epoch == epoch)
        else {
            return;
        };
        let list = &mut redis.lists[at];
        let before = list.settled.clone();
        for &p in positions {
            if list.settled[p as usize] {
                continue;
            }
            list.settled[p as usize] = true;
            let task = list.tasks[p as usize];
            match op {
                Op::Ack => redis.done.push(task.id),
                Op::Back | Op::Throttle => redis.ready.insert(0, task),
                Op::Recover => redis.ready.insert(
                    0,
                    Task {
                        id: task.id,
                        again: true,
                    },
                ),
            }
        }
        let mut freed = [0u8; GROUPS];
        let mut freed_t = 0u8;
        let mut from = 0;
        for run in &list.runs {
            let to = from + run.size as usize;
            let n = (from..to)
                .filter(|&p| list.settled[p] && !before[p])
                .count() as u8;
            if s.group_max > 0 {
                freed[run.group as usize] += n;
            }
            if run.typed && s.type_max > 0 {
                freed_t += n;
            }
            from = to;
        }
        if list.settled.iter().all(|s| *s) {
            redis.lists.remove(at);
        }
        if freed_t > 0 {
            if freed_t > redis.running_t {
                redis.underflow = true;
                redis.running_t = 0;
            } else {
                redis.running_t -= freed_t;
            }
        }
        for (g, &n) in freed.iter().enumerate() {
            if n == 0 {
                continue;
            }
            if n > redis.running[g] {
                redis.underflow = true;
                redis.running[g] = 0;
            } else {
                redis.running[g] -= n;
            }
            // `GROUP:`, and the flows park:g:GROUP names (the index deleted).
            redis.unpark(2 * g);
            if !self.is(GroupTypesMutation::SettleKeepsGroupIndex) && redis.park_g[g] {
                redis.park_g[g] = false;
                redis.unpark(2 * g + 1);
            }
        }
    }

    fn expired(state: &GroupTypesState, list: &List) -> bool {
        let worker = &state.workers[list.worker as usize];
        worker.expired || worker.epoch != list.epoch
    }

    /// The passes and the virtual time less the lowest of them.
    fn normalize(redis: &mut Store) {
        let base = redis
            .bands
            .iter()
            .filter_map(|b| match b {
                Some(Band::Pass(p)) => Some(*p),
                _ => None,
            })
            .fold(redis.vt, u8::min);
        redis.vt -= base;
        for band in redis.bands.iter_mut() {
            if let Some(Band::Pass(p)) = band {
                *p -= base;
            }
        }
    }
}

impl Model for GroupTypes {
    type State = GroupTypesState;
    type Action = Step;

    fn init_states(&self) -> Vec<GroupTypesState> {
        let mut redis = Store::default();
        for id in 0..self.setup.tasks.len() as u8 {
            redis.ready.push(Task { id, again: false });
        }
        vec![GroupTypesState {
            redis,
            workers: (0..self.setup.workers).map(|_| Worker::default()).collect(),
            faults: self.setup.faults,
            blocked: false,
            moved: false,
            both: false,
        }]
    }

    fn actions(&self, state: &GroupTypesState, actions: &mut Vec<Step>) {
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
                for mask in 1..(1u8 << worker.held.len()) {
                    actions.push(Step::Settle {
                        worker: w,
                        mask,
                        op: Op::Ack,
                        lost: false,
                    });
                    if fault {
                        for (op, lost) in [(Op::Ack, true), (Op::Back, false)] {
                            actions.push(Step::Settle {
                                worker: w,
                                mask,
                                op,
                                lost,
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
        for g in 0..GROUPS as u8 {
            if state.redis.paused[g as usize] {
                actions.push(Step::Resume { group: g });
            } else if fault {
                actions.push(Step::Pause { group: g });
            }
        }
    }

    fn next_state(&self, last: &GroupTypesState, step: Step) -> Option<GroupTypesState> {
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
            Step::Pause { group } => {
                state.redis.paused[group as usize] = true;
                state.faults -= 1;
            }
            Step::Resume { group } => {
                // group_resume.lua: the pause deleted; `GROUP:` and the index's flows back; the index deleted.
                let (g, redis) = (group as usize, &mut state.redis);
                redis.paused[g] = false;
                redis.unpark(2 * g);
                if redis.park_g[g] {
                    redis.park_g[g] = false;
                    redis.unpark(2 * g + 1);
                }
            }
        }
        Self::normalize(&mut state.redis);
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(COUNT_EXACT, |m: &GroupTypes, s: &GroupTypesState| {
                let mut counted = [0u8; GROUPS];
                let mut counted_t = 0u8;
                for list in &s.redis.lists {
                    let mut from = 0;
                    for run in &list.runs {
                        let to = from + run.size as usize;
                        let n = list.settled[from..to].iter().filter(|s| !**s).count() as u8;
                        if m.setup.group_max > 0 {
                            counted[run.group as usize] += n;
                        }
                        if run.typed && m.setup.type_max > 0 {
                            counted_t += n;
                        }
                        from = to;
                    }
                }
                s.redis.running == counted && s.redis.running_t == counted_t
            }),
            Property::always(COUNT_BOUND, |m: &GroupTypes, s: &GroupTypesState| {
                let taken: Vec<Task> = s
                    .redis
                    .lists
                    .iter()
                    .flat_map(|l| l.tasks.iter().zip(&l.settled))
                    .filter(|(_, settled)| !**settled)
                    .map(|(t, _)| *t)
                    .collect();
                let (gm, tm) = (m.setup.group_max, m.setup.type_max);
                (0..GROUPS).all(|g| {
                    taken.iter().filter(|t| m.group(**t) == g).count() <= gm as usize
                        && s.redis.running[g] <= gm
                }) && taken.iter().filter(|t| m.typed(**t)).count() <= tm as usize
                    && s.redis.running_t <= tm
            }),
            Property::always(NO_UNDERFLOW, |_, s: &GroupTypesState| !s.redis.underflow),
            Property::always(AT_REST, |_, s: &GroupTypesState| {
                !s.redis.lists.is_empty()
                    || (s.redis.running == [0; GROUPS] && s.redis.running_t == 0)
            }),
            Property::always(ONE_PLACE, |m: &GroupTypes, s: &GroupTypesState| {
                let r = &s.redis;
                (0..m.setup.tasks.len() as u8).all(|id| {
                    let places = r.ready.iter().filter(|t| t.id == id).count()
                        + r.flows.iter().flatten().filter(|t| t.id == id).count()
                        + r.done.iter().filter(|d| **d == id).count()
                        + r.lists
                            .iter()
                            .flat_map(|l| l.tasks.iter().zip(&l.settled))
                            .filter(|(t, settled)| !**settled && t.id == id)
                            .count();
                    places == 1
                })
            }),
            Property::always(NOT_STRANDED, |m: &GroupTypes, s: &GroupTypesState| {
                let r = &s.redis;
                (0..FLOWS).all(|f| {
                    let g = f / 2;
                    let group_held = r.running[g] > 0 || r.paused[g];
                    // A flow's tasks are all of its kind: `GROUP:T` holds only `T` tasks.
                    let kinds = r.flows[f]
                        .iter()
                        .all(|t| m.group(*t) == g && (f % 2 == 0 || m.typed(*t)));
                    kinds
                        && (r.flows[f].is_empty()
                            || match r.band(f) {
                                Band::Pass(_) | Band::Timed => true,
                                Band::Parked if f % 2 == 0 => group_held,
                                Band::Parked => (r.park_g[g] && group_held) || r.park_t[g],
                                Band::Out => false,
                            })
                })
            }),
            Property::always(NOT_BLOCKED, |_, s: &GroupTypesState| !s.blocked),
            Property::sometimes(
                "every task is done",
                |m: &GroupTypes, s: &GroupTypesState| s.redis.done.len() == m.setup.tasks.len(),
            ),
            Property::sometimes(
                "a T task moved to its group's T flow",
                |_, s: &GroupTypesState| s.moved,
            ),
            Property::sometimes("a run counted in both scopes", |_, s: &GroupTypesState| {
                s.both
            }),
            Property::sometimes("park:g:GROUP names a flow", |_, s: &GroupTypesState| {
                s.redis.park_g.iter().any(|p| *p)
            }),
            Property::sometimes("park:t:T names a flow", |_, s: &GroupTypesState| {
                s.redis.park_t.iter().any(|p| *p)
            }),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A claim that serves `A:` while `T` is full moves `A`'s `T` task to `A:T`, PARKED and named in
    /// `park:t:T`, and the next claim after `T`'s settle moves it back and takes it.
    #[test]
    fn a_refused_t_task_moves_to_its_group_flow_and_comes_back() {
        let model = GroupTypes::new(grouped_typed());
        let mut state = model.init_states().remove(0);
        // B's T task first: A paused for the claim.
        state.redis.paused[0] = true;
        model.claim(&mut state, 0, 1);
        assert_eq!(state.redis.running_t, 1);
        state.redis.paused[0] = false;
        state.redis.unpark(0);
        model.claim(&mut state, 1, 1);
        assert_eq!(state.redis.band(1), Band::Parked, "A:T");
        assert!(state.redis.park_t[0]);
        assert_eq!(state.redis.lists[1].tasks[0].id, 2, "A's other task");
        model.settle(&mut state.redis, 0, 0, &[0], Op::Ack);
        model.settle(&mut state.redis, 1, 0, &[0], Op::Ack);
        model.claim(&mut state, 0, 1);
        assert_eq!(state.redis.lists[0].tasks[0].id, 0, "A's T task");
        assert_eq!((state.redis.running, state.redis.running_t), ([1, 0], 1));
    }
}
