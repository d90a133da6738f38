//! Fair groups (`[queues.groups]`: [`groups.lua`](../../src/broker/scripts/groups.lua), claim.lua's grouped
//! path, settle.lua's unparking of `g:` scopes, group_resume.lua), checked in a model of their own.
//!
//! A safe-mode grouped queue with two groups `A` and `B` under one `max_running` (kmqd's groups share it: each
//! group counts under its own scope `g:GROUP`), on one level, each with a weight: the ready list, each group's
//! flow (`flow:1:GROUP:`), the level's ring with each flow's band (a pass, TIMED, PARKED, or out of the ring),
//! the level's virtual time, each group's pause (`hold:g:GROUP`), throttle (`throttle:g:GROUP`) and count, the
//! claim lists with their settled bits and scopes strings (a line `N g:GROUP` per run), and `done`. The protocol's
//! model ([`crate::model`]) covers what is the same for every task; this one covers what the groups add, step by
//! step as the scripts do it:
//!
//! - a claim (claim.lua with groups.lua's block): the TIMED flows whose throttle ran out come back at the virtual
//!   time (`groups_due`), the ready list goes to the flows (`groups_intake`: a task that came back to its flow's
//!   head, the others to its tail; a flow entering the ring at the virtual time), the candidates are the lowest
//!   passes (`groups_candidates`), a refused group's flow leaves the lowest band (PARKED for a pause or a full
//!   count, TIMED for a throttle) and the others take turns by pass, each turn up to its weight and its room
//!   (`groups_take`), and what each group took is added to its count (`groups_spend`); the claim list holds a run
//!   per group, in the order first met;
//! - a settle (settle.lua): any subset of a claim's positions, by its owner (late, after its lease ran out, too) or
//!   by a monitor recovering an expired owner (every position not settled yet, to the ready list's head as a
//!   recovery); an acknowledgement, a hand-back (to the ready list's head) or a throttle (to its flow's head, the
//!   flow TIMED and the group's throttle set); each run's scope loses the bits the call set anew in its range, and
//!   a group whose count it freed has its PARKED flow moved back to the virtual time; a lost reply, sent again
//!   later (stale);
//! - `kmqd group pause` (the hold key set) and `kmqd group resume` (group_resume.lua: the hold deleted, a PARKED
//!   flow moved back to the virtual time); a throttle running out;
//! - a daemon's lease running out (it stalls and may settle late), its `kill -9` (it forgets what it held), and its
//!   next claim under a new owner.
//!
//! Not here: several levels (each level's take is the same function), the rate limits of a group (their logs are
//! time: a full window is TIMED like a throttle), the quarantine's admitted prefix, a lost claim reply, oversized
//! payloads, groups' flows of a config without groups, and more than two groups (the candidates' reading is the
//! same for any number: `max` of them, here 1 or 2).

use arrayvec::ArrayVec;
use stateright::{Model, Property};

/// A task, what a settle does with it, a settle call to send again and a daemon are the type limits' model's.
pub use crate::types::{Call, Op, Task, Worker};

/// The most tasks a scenario has.
pub const TASKS: usize = 4;
/// The most tasks one claim takes.
const TAKE: usize = 2;
/// The most daemons.
const WORKERS: usize = 2;
/// The groups.
const GROUPS: usize = 2;

/// Each group's `g:GROUP` equals the positions not yet settled of the runs whose line names it.
pub const COUNT_EXACT: &str = "each group's count is its counted runs' unsettled positions";
/// No group has more tasks taken and unsettled than `max_running`, and its count never says more.
pub const COUNT_BOUND: &str = "each group's count stays within its limit";
/// settle.lua never finds a group's count below what it subtracts (`running_underflow`).
pub const NO_UNDERFLOW: &str = "a group's count never goes below 0";
/// With no claim list left, every group's count is 0 (absent).
pub const AT_REST: &str = "every group's count is 0 at rest";
/// Every task is in exactly one of: the ready list, a flow, a claim list (a position not settled yet), `done`.
pub const ONE_PLACE: &str = "every task is in exactly one place";
/// A group whose flow holds tasks is in the lowest band, or PARKED while its count is above 0 or it is paused
/// (a settle or a resume brings it back), or TIMED (its throttle's end brings it back).
pub const NOT_STRANDED: &str = "no group with waiting tasks is stranded";
/// A claim made while a group that nothing holds back (not paused, not throttled, below its limit) has waiting
/// tasks takes one.
pub const NOT_BLOCKED: &str = "a claim takes a task while an unheld group has some";

/// The deliberate mutations of the groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GroupsMutation {
    /// settle.lua frees a group's slots without moving its PARKED flow back.
    SettleKeepsParked,
    /// group_resume.lua deletes the pause without moving the PARKED flow back.
    ResumeKeepsParked,
    /// claim.lua admits a group whatever its count says (its pause and throttle still hold it back).
    ClaimIgnoresCount,
    /// groups_candidates reads the `max` lowest passes only, refused ones included (claim.lua before this
    /// model's finding: a claim that parked them took nothing though the next flow's group could run).
    CandidatesOnlyMax,
}

/// One bounded check of the groups.
#[derive(Clone, Debug)]
pub struct Grouped {
    pub name: &'static str,
    /// Tasks of group `A` (ids `0..a`), then of `B`.
    pub a: u8,
    pub b: u8,
    /// Every group's `max_running`.
    pub max_running: u8,
    /// The groups' weights (`[queues.groups] weights`).
    pub weights: [u8; GROUPS],
    pub workers: u8,
    /// The largest claim (the batch).
    pub most: u8,
    /// How many of these may happen in a run: a lost reply, a lease running out, a crash, a hand-back, a
    /// throttle, a pause.
    pub faults: u8,
    pub mutation: Option<GroupsMutation>,
}

impl Grouped {
    pub fn with_mutation(mut self, mutation: GroupsMutation) -> Grouped {
        self.mutation = Some(mutation);
        self
    }
}

/// Two tasks of `A` and one of `B`, both groups under `max_running = 1`, `A` of weight 2, two daemons taking up
/// to two tasks a claim, two faults.
pub fn grouped() -> Grouped {
    Grouped {
        name: "grouped",
        a: 2,
        b: 1,
        max_running: 1,
        weights: [2, 1],
        workers: 2,
        most: 2,
        faults: 2,
        mutation: None,
    }
}

/// Two tasks in each group, three faults: a pause and a throttle in one run, with a stall or a lost reply.
pub fn grouped_more() -> Grouped {
    Grouped {
        name: "grouped-more",
        b: 2,
        faults: 3,
        ..grouped()
    }
}

/// The scenarios of the groups.
pub fn scenarios() -> Vec<Grouped> {
    vec![grouped(), grouped_more()]
}

/// The groups' "break it on purpose" experiments: a mutated setup and a property it must break.
pub fn experiments() -> Vec<(Grouped, &'static str)> {
    vec![
        (
            grouped().with_mutation(GroupsMutation::SettleKeepsParked),
            NOT_STRANDED,
        ),
        (
            grouped().with_mutation(GroupsMutation::ResumeKeepsParked),
            NOT_STRANDED,
        ),
        (
            grouped().with_mutation(GroupsMutation::ClaimIgnoresCount),
            COUNT_BOUND,
        ),
        (
            grouped().with_mutation(GroupsMutation::CandidatesOnlyMax),
            NOT_BLOCKED,
        ),
    ]
}

/// Where a flow stands in the level's ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Band {
    /// In the lowest band: its pass, in halves of a task (the weights are 1 and 2).
    Pass(u8),
    /// TIMED: until its throttle ends.
    Timed,
    /// PARKED: paused or full, until a settle or a resume.
    Parked,
    /// Not in the ring.
    Out,
}

/// One run of a claim list: its group and whether its line `N g:GROUP` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Run {
    pub size: u8,
    pub group: u8,
    pub counted: bool,
}

/// A claim list of (`worker`, `epoch`), its settled bits and its scopes string.
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
    pub flows: [ArrayVec<Task, TASKS>; GROUPS],
    pub bands: [Option<Band>; GROUPS],
    /// The level's virtual time (`vt:1`), in halves.
    pub vt: u8,
    pub paused: [bool; GROUPS],
    pub throttled: [bool; GROUPS],
    pub running: [u8; GROUPS],
    pub lists: ArrayVec<List, TASKS>,
    pub done: ArrayVec<u8, TASKS>,
    pub underflow: bool,
}

impl Store {
    fn band(&self, group: usize) -> Band {
        self.bands[group].unwrap_or(Band::Out)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GroupsState {
    pub redis: Store,
    pub workers: ArrayVec<Worker, WORKERS>,
    pub faults: u8,
    /// A claim took nothing while a group nothing held back had waiting tasks.
    pub blocked: bool,
    /// For the `sometimes`: a flow parked, a claim that took nothing (state 7), a claim list of two runs.
    pub parked: bool,
    pub held_back: bool,
    pub two_runs: bool,
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
    /// `kmqd group pause`.
    Pause { group: u8 },
    /// `kmqd group resume` (group_resume.lua).
    Resume { group: u8 },
    /// `throttle:g:GROUP` runs out.
    ThrottleEnds { group: u8 },
}

/// The model of one [`Grouped`].
pub struct Groups {
    pub setup: Grouped,
}

/// A candidate flow of a claim: its group, its pass, and what groups_take keeps of it.
struct Candidate {
    group: usize,
    pass: u8,
    served: bool,
    empty: bool,
}

impl Groups {
    pub fn new(setup: Grouped) -> Groups {
        Groups { setup }
    }

    fn group(&self, task: Task) -> usize {
        usize::from(task.id >= self.setup.a)
    }

    fn tasks(&self) -> u8 {
        self.setup.a + self.setup.b
    }

    fn limited(&self) -> bool {
        self.setup.max_running > 0
    }

    /// A group's room under `max_running` (None: no bound), as group_state reads it.
    fn room(&self, redis: &Store, group: usize) -> Option<u8> {
        if !self.limited() || self.setup.mutation == Some(GroupsMutation::ClaimIgnoresCount) {
            None
        } else {
            Some(self.setup.max_running.saturating_sub(redis.running[group]))
        }
    }

    /// Where a refused group's flow goes (group_refused), None when it is admitted.
    fn refused(&self, redis: &Store, group: usize) -> Option<Band> {
        if redis.paused[group] {
            Some(Band::Parked)
        } else if redis.throttled[group] {
            Some(Band::Timed)
        } else if self.room(redis, group) == Some(0) {
            Some(Band::Parked)
        } else {
            None
        }
    }

    /// claim.lua with groups.lua's block: groups_due, groups_intake, groups_candidates, groups_take,
    /// push_runs, groups_spend.
    fn claim(&self, state: &mut GroupsState, worker: u8, max: u8) {
        let redis = &mut state.redis;
        // groups_due: a TIMED flow whose throttle ran out comes back at the virtual time.
        for g in 0..GROUPS {
            if redis.band(g) == Band::Timed && !redis.throttled[g] {
                redis.bands[g] = Some(Band::Pass(redis.vt));
            }
        }
        // groups_intake: a task that came back to its flow's head, the others to its tail.
        let items: ArrayVec<Task, TASKS> = redis.ready.drain(..).collect();
        let mut heads: [ArrayVec<Task, TASKS>; GROUPS] = Default::default();
        for task in items {
            let g = self.group(task);
            if task.again {
                heads[g].push(task);
            } else {
                redis.flows[g].push(task);
            }
            if redis.bands[g].is_none() {
                redis.bands[g] = Some(Band::Pass(redis.vt));
            }
        }
        for (g, head) in heads.into_iter().enumerate() {
            for (k, task) in head.into_iter().enumerate() {
                redis.flows[g].insert(k, task);
            }
        }
        // Which groups nothing holds back have waiting tasks: a claim now must take one.
        let unheld_waiting =
            (0..GROUPS).any(|g| !redis.flows[g].is_empty() && self.refused(redis, g).is_none());
        // groups_candidates: the lowest passes (ties in the members' order, A before B); a refused one is read
        // past, so that `max` of them may take (the fix of this model's finding).
        let mut lowest: ArrayVec<(u8, usize), GROUPS> = (0..GROUPS)
            .filter_map(|g| match redis.band(g) {
                Band::Pass(p) => Some((p, g)),
                _ => None,
            })
            .collect();
        lowest.sort();
        let mut cands: ArrayVec<Candidate, GROUPS> = ArrayVec::new();
        let mut admitted = 0;
        for (pass, g) in lowest {
            let enough = if self.setup.mutation == Some(GroupsMutation::CandidatesOnlyMax) {
                cands.len() >= max as usize
            } else {
                admitted >= max as usize
            };
            if enough {
                break;
            }
            if self.refused(redis, g).is_none() {
                admitted += 1;
            }
            cands.push(Candidate {
                group: g,
                pass,
                served: false,
                empty: false,
            });
        }
        // groups_take: refused groups' flows leave the lowest band; the others take turns by pass.
        let mut rooms: [Option<u8>; GROUPS] = [self.room(redis, 0), self.room(redis, 1)];
        let mut active: ArrayVec<usize, GROUPS> = ArrayVec::new();
        let mut held = false;
        for (k, c) in cands.iter().enumerate() {
            if let Some(band) = self.refused(redis, c.group) {
                redis.bands[c.group] = Some(band);
                state.parked |= band == Band::Parked;
                held = true;
            } else {
                active.push(k);
            }
        }
        let mut runs: ArrayVec<(usize, ArrayVec<Task, TAKE>), TAKE> = ArrayVec::new();
        let mut got = 0u8;
        while got < max && !active.is_empty() {
            let mut still = ArrayVec::<usize, GROUPS>::new();
            for &k in &active {
                let c = &mut cands[k];
                if got >= max {
                    still.push(k);
                    continue;
                }
                let weight = self.setup.weights[c.group].max(1);
                let mut m = weight.min(max - got);
                if let Some(room) = rooms[c.group] {
                    m = m.min(room);
                }
                if m == 0 {
                    continue;
                }
                let n = (m as usize).min(redis.flows[c.group].len());
                let taken: ArrayVec<Task, TASKS> = redis.flows[c.group].drain(..n).collect();
                for task in taken {
                    if let Some(run) = runs.iter_mut().find(|(g, _)| *g == c.group) {
                        run.1.push(task);
                    } else {
                        let mut tasks = ArrayVec::new();
                        tasks.push(task);
                        runs.push((c.group, tasks));
                    }
                }
                got += n as u8;
                if let Some(room) = rooms[c.group].as_mut() {
                    *room -= n as u8;
                }
                if n > 0 {
                    if c.pass > redis.vt {
                        redis.vt = c.pass;
                    }
                    // In halves: a task of weight w adds 2 / w.
                    c.pass += (2 * n as u8) / weight;
                    c.served = true;
                }
                if (n as u8) < m {
                    c.empty = true;
                } else {
                    still.push(k);
                }
            }
            active = still;
        }
        for c in &cands {
            if c.empty || (c.served && redis.flows[c.group].is_empty()) {
                redis.bands[c.group] = None;
            } else if c.served {
                redis.bands[c.group] = Some(Band::Pass(c.pass));
            }
        }
        // push_runs and groups_spend.
        if got > 0 {
            let mut list = List {
                worker,
                epoch: state.workers[worker as usize].epoch,
                tasks: ArrayVec::new(),
                settled: ArrayVec::new(),
                runs: ArrayVec::new(),
            };
            for (g, tasks) in runs {
                list.runs.push(Run {
                    size: tasks.len() as u8,
                    group: g as u8,
                    counted: self.limited(),
                });
                if self.limited() {
                    redis.running[g] += tasks.len() as u8;
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
            state.blocked |= unheld_waiting;
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
            let g = usize::from(task.id >= self.setup.a);
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
                    redis.flows[g].insert(0, task);
                    redis.bands[g] = Some(Band::Timed);
                    redis.throttled[g] = true;
                }
            }
        }
        // Each run's scope loses the bits this call set anew in its range.
        let mut freed = [0u8; GROUPS];
        let mut from = 0;
        for run in &list.runs {
            let to = from + run.size as usize;
            if run.counted {
                freed[run.group as usize] += (from..to)
                    .filter(|&p| list.settled[p] && !before[p])
                    .count() as u8;
            }
            from = to;
        }
        if list.settled.iter().all(|s| *s) {
            redis.lists.remove(at);
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
            // The group's parked flow goes back to the virtual time.
            if redis.band(g) == Band::Parked
                && self.setup.mutation != Some(GroupsMutation::SettleKeepsParked)
            {
                redis.bands[g] = Some(Band::Pass(redis.vt));
            }
        }
    }

    /// Whether the owner of `list` is expired (its lease ran out, or the daemon registered anew since).
    fn expired(state: &GroupsState, list: &List) -> bool {
        let worker = &state.workers[list.worker as usize];
        worker.expired || worker.epoch != list.epoch
    }

    /// The passes and the virtual time less the lowest of them: only their order and differences matter.
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

impl Model for Groups {
    type State = GroupsState;
    type Action = Step;

    fn init_states(&self) -> Vec<GroupsState> {
        let mut redis = Store::default();
        // Interleaved, A first.
        let (a, b) = (self.setup.a, self.setup.b);
        for k in 0..a.max(b) {
            if k < a {
                redis.ready.push(Task {
                    id: k,
                    again: false,
                });
            }
            if k < b {
                redis.ready.push(Task {
                    id: a + k,
                    again: false,
                });
            }
        }
        vec![GroupsState {
            redis,
            workers: (0..self.setup.workers).map(|_| Worker::default()).collect(),
            faults: self.setup.faults,
            blocked: false,
            parked: false,
            held_back: false,
            two_runs: false,
        }]
    }

    fn actions(&self, state: &GroupsState, actions: &mut Vec<Step>) {
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
                    for op in [Op::Ack, Op::Back, Op::Throttle] {
                        if op != Op::Ack && !fault {
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
        for g in 0..GROUPS as u8 {
            if state.redis.paused[g as usize] {
                actions.push(Step::Resume { group: g });
            } else if fault {
                actions.push(Step::Pause { group: g });
            }
            if state.redis.throttled[g as usize] {
                actions.push(Step::ThrottleEnds { group: g });
            }
        }
    }

    fn next_state(&self, last: &GroupsState, step: Step) -> Option<GroupsState> {
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
                let g = group as usize;
                state.redis.paused[g] = false;
                if state.redis.band(g) == Band::Parked
                    && self.setup.mutation != Some(GroupsMutation::ResumeKeepsParked)
                {
                    state.redis.bands[g] = Some(Band::Pass(state.redis.vt));
                }
            }
            Step::ThrottleEnds { group } => state.redis.throttled[group as usize] = false,
        }
        Self::normalize(&mut state.redis);
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(COUNT_EXACT, |_, s: &GroupsState| {
                let mut counted = [0u8; GROUPS];
                for list in &s.redis.lists {
                    let mut from = 0;
                    for run in &list.runs {
                        let to = from + run.size as usize;
                        if run.counted {
                            counted[run.group as usize] +=
                                list.settled[from..to].iter().filter(|s| !**s).count() as u8;
                        }
                        from = to;
                    }
                }
                s.redis.running == counted
            }),
            Property::always(COUNT_BOUND, |model: &Groups, s: &GroupsState| {
                (0..GROUPS).all(|g| {
                    let taken = s
                        .redis
                        .lists
                        .iter()
                        .flat_map(|l| l.tasks.iter().zip(&l.settled))
                        .filter(|(t, settled)| !**settled && model.group(**t) == g)
                        .count();
                    taken <= model.setup.max_running as usize
                        && s.redis.running[g] <= model.setup.max_running
                })
            }),
            Property::always(NO_UNDERFLOW, |_, s: &GroupsState| !s.redis.underflow),
            Property::always(AT_REST, |_, s: &GroupsState| {
                !s.redis.lists.is_empty() || s.redis.running == [0; GROUPS]
            }),
            Property::always(ONE_PLACE, |model: &Groups, s: &GroupsState| {
                let r = &s.redis;
                (0..model.tasks()).all(|id| {
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
            Property::always(NOT_STRANDED, |_, s: &GroupsState| {
                let r = &s.redis;
                (0..GROUPS).all(|g| {
                    r.flows[g].is_empty()
                        || match r.band(g) {
                            Band::Pass(_) | Band::Timed => true,
                            Band::Parked => r.running[g] > 0 || r.paused[g],
                            Band::Out => false,
                        }
                })
            }),
            Property::always(NOT_BLOCKED, |_, s: &GroupsState| !s.blocked),
            Property::sometimes("every task is done", |model: &Groups, s: &GroupsState| {
                s.redis.done.len() == model.tasks() as usize
            }),
            Property::sometimes("a flow is parked", |_, s: &GroupsState| s.parked),
            Property::sometimes("a claim is held back (state 7)", |_, s: &GroupsState| {
                s.held_back
            }),
            Property::sometimes("a claim list of two runs", |_, s: &GroupsState| s.two_runs),
            Property::sometimes("a group is throttled", |_, s: &GroupsState| {
                s.redis.throttled.iter().any(|t| *t)
            }),
            Property::sometimes("a group is paused", |_, s: &GroupsState| {
                s.redis.paused.iter().any(|p| *p)
            }),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A claim of one task whose lowest pass is a full group parks it and takes from the next group.
    #[test]
    fn a_claim_parks_a_full_group_and_takes_from_the_next() {
        let model = Groups::new(grouped());
        let mut state = model.init_states().remove(0);
        state.redis.running[0] = 1;
        model.claim(&mut state, 0, 1);
        assert_eq!(state.redis.band(0), Band::Parked);
        assert_eq!(state.redis.lists[0].tasks[0].id, 2, "B's task");
        assert_eq!(state.redis.running, [1, 1]);
        assert!(!state.blocked);
    }

    /// A settle that frees a parked group's slot moves its flow back to the virtual time.
    #[test]
    fn a_settle_unparks_the_group_it_frees() {
        let model = Groups::new(grouped());
        let mut state = model.init_states().remove(0);
        model.claim(&mut state, 0, 1);
        model.claim(&mut state, 1, 2);
        assert_eq!(state.redis.band(0), Band::Parked, "A is full");
        model.settle(&mut state.redis, 0, 0, &[0], Op::Ack);
        assert_eq!(state.redis.running, [0, 1]);
        assert!(matches!(state.redis.band(0), Band::Pass(_)));
    }
}
