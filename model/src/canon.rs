//! Canonical forms: states that no script or daemon step can tell apart are explored once.
//!
//! Three renamings, each exact (a bijection on the values in use that keeps every comparison the protocol
//! makes):
//!
//! - **runs** of a daemon are only compared for equality (owner ids, settler identities), and a restart makes
//!   `run + 1`: renumbered densely in order, the current run stays the largest, so `run + 1` stays fresh;
//! - **generations** of one run likewise (owner ids), with the daemon's counter kept the largest;
//! - **tokens** of one run are compared for equality (processing hashes), order (`floor`) and ranges (a claim's
//!   or adoption's `first .. first + max`): shifted together by their minimum, which keeps all three.
//!
//! Without them, a state reached after three pill crashes and the same state after four would differ only in
//! their numbers. Then the **symmetry** of the two daemons: see [`canonical`].
//!
//! Dead data is dropped first: an owner's `group` while it holds nothing (see `Owner::group`), and the claim
//! numbers of processing entries, held tasks and records, which nothing reads but
//! [`Mutation::SubtractCount`] (kmqd's settle.lua counts per position, through each entry's `counted`).

use crate::model::{Daemon, State};
use crate::redis::OwnerId;
use crate::setup::Mutation;

/// The canonical form of `state` (under `mutation`): renumbered, then the smaller of it and its daemon-swapped
/// twin.
pub fn canonical(mut state: State, mutation: Option<Mutation>) -> State {
    forget_idle_groups(&mut state);
    let claims = mutation == Some(Mutation::SubtractCount);
    if !claims {
        forget_claims(&mut state);
    }
    let state = renumber(state, claims);
    // Most pairs are told apart by what each daemon holds and does, which names no daemon: only when those
    // are alike is the swapped twin built and compared. (Renumbering is per daemon, so the twin of a
    // renumbered state is renumbered too.)
    let order = label_free(&state.daemons[0]).cmp(&label_free(&state.daemons[1]));
    match order {
        std::cmp::Ordering::Less => state,
        std::cmp::Ordering::Greater => swap_daemons(&state),
        std::cmp::Ordering::Equal => {
            let swapped = swap_daemons(&state);
            if swapped < state { swapped } else { state }
        }
    }
}

/// claim.lua deletes an owner's `group` before it reads it when the owner holds nothing, and the monitor reads
/// it only for tasks the owner holds; only a claim adds to what an owner holds. So while its processing hashes
/// are empty, `group` set and unset are the same state.
fn forget_idle_groups(state: &mut State) {
    let redis = &mut state.redis;
    for owner in redis.owners.iter_mut() {
        if owner.group.is_some() && !redis.processing.iter().any(|p| p.owner == owner.id) {
            owner.group = None;
        }
    }
}

/// Claim numbers are read only by [`Mutation::SubtractCount`]: without it, every one is 0 (and not renumbered).
fn forget_claims(state: &mut State) {
    for p in state.redis.processing.iter_mut() {
        p.claim = 0;
    }
    for d in state.daemons.iter_mut() {
        for held in d.held.iter_mut() {
            held.claim = 0;
        }
        if let Some((_, records)) = &mut d.monitor_call {
            for record in records.iter_mut() {
                record.claim = 0;
            }
        }
    }
}

/// A summary of a daemon that a swap leaves alone (no owner id, whose `daemon` field a swap changes).
fn label_free(d: &Daemon) -> impl Ord {
    let held: arrayvec::ArrayVec<_, 6> = d
        .held
        .iter()
        .map(|h| {
            (
                h.token,
                h.claim,
                h.level,
                h.env,
                h.phase,
                h.owner.map(|o| (o.run, o.generation)),
                h.popped_by.map(|o| (o.run, o.generation)),
            )
        })
        .collect();
    (
        (
            (d.config, d.run, d.generation, d.next_token),
            (d.stopping, d.outliving, d.orphan),
        ),
        (
            d.owner.map(|o| (o.run, o.generation)),
            d.registering.is_some(),
        ),
        (d.lost_claim.map(|c| (c.first, c.max)), d.acker, d.monitor),
        held,
    )
}

/// Every place that holds an owner id, a run, a generation or a token, visited with the original owner (or
/// daemon and run) each token belongs to, so that one traversal serves both collecting and rewriting.
trait Visit {
    fn owner(&mut self, id: &mut OwnerId);
    fn run(&mut self, daemon: u8, run: &mut u8);
    fn generation(&mut self, daemon: u8, run: u8, generation: &mut u8);
    fn token(&mut self, daemon: u8, run: u8, token: &mut u8);
}

/// `claims`: claim numbers are tokens too (else they are all 0, and left alone).
fn visit(state: &mut State, v: &mut impl Visit, claims: bool) {
    let redis = &mut state.redis;
    for owner in redis.owners.iter_mut() {
        let id = owner.id;
        if let Some(floor) = &mut owner.floor {
            v.token(id.daemon, id.run, floor);
        }
        v.owner(&mut owner.id);
    }
    for p in redis.processing.iter_mut() {
        v.token(p.owner.daemon, p.owner.run, &mut p.token);
        if claims {
            v.token(p.owner.daemon, p.owner.run, &mut p.claim);
        }
        v.owner(&mut p.owner);
    }
    for (owner, _) in redis.popped_running.iter_mut() {
        v.owner(owner);
    }
    for (settler, _) in redis.settled.iter_mut() {
        v.run(settler.daemon, &mut settler.run);
    }
    for call in state.in_flight.iter_mut() {
        v.token(call.owner.daemon, call.owner.run, &mut call.first);
        v.owner(&mut call.owner);
    }
    for owner in state
        .pops_in_flight
        .iter_mut()
        .filter_map(|call| call.owner.as_mut())
    {
        v.owner(owner);
    }
    for (index, d) in state.daemons.iter_mut().enumerate() {
        visit_daemon(index as u8, d, v, claims);
    }
}

fn visit_daemon(index: u8, d: &mut Daemon, v: &mut impl Visit, claims: bool) {
    let run = d.run;
    v.token(index, run, &mut d.next_token);
    v.generation(index, run, &mut d.generation);
    for id in [&mut d.owner, &mut d.registering].into_iter().flatten() {
        v.owner(id);
    }
    for held in d.held.iter_mut() {
        if let Some(popper) = &mut held.popped_by {
            v.owner(popper);
        }
        if let (Some(owner), Some(token)) = (&mut held.owner, &mut held.token) {
            v.token(owner.daemon, owner.run, token);
            if claims {
                v.token(owner.daemon, owner.run, &mut held.claim);
            }
            v.owner(owner);
        }
    }
    if let Some(claim) = &mut d.lost_claim {
        v.token(claim.owner.daemon, claim.owner.run, &mut claim.first);
        v.owner(&mut claim.owner);
    }
    if let Some((owner, records)) = &mut d.monitor_call {
        for record in records.iter_mut() {
            if let Some(token) = &mut record.token {
                v.token(owner.daemon, owner.run, token);
                if claims {
                    v.token(owner.daemon, owner.run, &mut record.claim);
                }
            }
        }
        v.owner(owner);
    }
    // Last: the daemon's own run, after everything keyed by it.
    v.run(index, &mut d.run);
}

/// The values in use, per daemon and run.
#[derive(Default)]
struct Collect {
    /// (daemon, run)
    runs: ArrayList<(u8, u8)>,
    /// (daemon, run, generation)
    generations: ArrayList<(u8, u8, u8)>,
    /// (daemon, run, smallest token)
    tokens: ArrayList<(u8, u8, u8)>,
}

type ArrayList<T> = arrayvec::ArrayVec<T, 24>;

fn insert<T: PartialEq, const N: usize>(list: &mut arrayvec::ArrayVec<T, N>, value: T) {
    if !list.contains(&value) {
        list.push(value);
    }
}

impl Visit for Collect {
    fn owner(&mut self, id: &mut OwnerId) {
        insert(&mut self.runs, (id.daemon, id.run));
        insert(&mut self.generations, (id.daemon, id.run, id.generation));
    }
    fn run(&mut self, daemon: u8, run: &mut u8) {
        insert(&mut self.runs, (daemon, *run));
    }
    fn generation(&mut self, daemon: u8, run: u8, generation: &mut u8) {
        insert(&mut self.generations, (daemon, run, *generation));
    }
    fn token(&mut self, daemon: u8, run: u8, token: &mut u8) {
        match self
            .tokens
            .iter_mut()
            .find(|(d, r, _)| (*d, *r) == (daemon, run))
        {
            Some((_, _, least)) => *least = (*least).min(*token),
            None => self.tokens.push((daemon, run, *token)),
        }
    }
}

/// Rewrites every value to its rank (runs, generations) or shifted value (tokens).
struct Rewrite<'a>(&'a Collect);

impl Rewrite<'_> {
    fn run_rank(&self, daemon: u8, run: u8) -> u8 {
        self.0
            .runs
            .iter()
            .filter(|(d, r)| *d == daemon && *r < run)
            .count() as u8
    }
    fn generation_rank(&self, daemon: u8, run: u8, generation: u8) -> u8 {
        self.0
            .generations
            .iter()
            .filter(|(d, r, g)| *d == daemon && *r == run && *g < generation)
            .count() as u8
    }
}

impl Visit for Rewrite<'_> {
    fn owner(&mut self, id: &mut OwnerId) {
        *id = OwnerId {
            daemon: id.daemon,
            run: self.run_rank(id.daemon, id.run),
            generation: self.generation_rank(id.daemon, id.run, id.generation),
        };
    }
    fn run(&mut self, daemon: u8, run: &mut u8) {
        *run = self.run_rank(daemon, *run);
    }
    fn generation(&mut self, daemon: u8, run: u8, generation: &mut u8) {
        *generation = self.generation_rank(daemon, run, *generation);
    }
    fn token(&mut self, daemon: u8, run: u8, token: &mut u8) {
        let least = self
            .0
            .tokens
            .iter()
            .find(|(d, r, _)| (*d, *r) == (daemon, run))
            .map_or(0, |(_, _, least)| *least);
        *token -= least;
    }
}

fn renumber(mut state: State, claims: bool) -> State {
    let mut collect = Collect::default();
    visit(&mut state, &mut collect, claims);
    visit(&mut state, &mut Rewrite(&collect), claims);
    resort(&mut state);
    state
}

/// Collections are kept sorted (their order is never read), so equal contents are equal states.
fn resort(s: &mut State) {
    s.redis.owners.sort_by_key(|owner| owner.id);
    s.redis.processing.sort();
    s.redis.popped_running.sort();
    s.redis.settled.sort();
    s.in_flight.sort();
    s.pops_in_flight.sort();
    for d in &mut s.daemons {
        d.held.sort();
    }
}

/// The daemons are interchangeable: the same actions, the same budgets, configs drawn from one list, and
/// properties that name neither. A state and the one with the daemons swapped have the same futures up to the
/// swap, so only the smaller of the two is explored (symmetry reduction; stateright's own is DFS-only, and this
/// way BFS gets it too).
fn swap_daemons(state: &State) -> State {
    struct Swap;
    impl Visit for Swap {
        fn owner(&mut self, id: &mut OwnerId) {
            id.daemon = 1 - id.daemon;
        }
        fn run(&mut self, _: u8, _: &mut u8) {}
        fn generation(&mut self, _: u8, _: u8, _: &mut u8) {}
        fn token(&mut self, _: u8, _: u8, _: &mut u8) {}
    }
    let mut s = state.clone();
    // (A swap renames no token: claim numbers need no visit.)
    visit(&mut s, &mut Swap, false);
    for (settler, _) in s.redis.settled.iter_mut() {
        settler.daemon = 1 - settler.daemon;
    }
    s.daemons.swap(0, 1);
    resort(&mut s);
    s
}
