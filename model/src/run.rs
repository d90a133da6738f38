//! Running one bounded check and reading its results: what the test and the binary share.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::fmt::{Debug, Write as _};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use stateright::report::WriteReporter;
use stateright::{Checker, Expectation, Model, Path};

use crate::model::{Action, Protocol, State};
use crate::setup::Setup;

/// What one exhaustive check found (of the protocol's model unless said otherwise).
pub struct Report<S = State, A = Action> {
    pub name: &'static str,
    /// Unique states explored.
    pub states: usize,
    /// The deepest path explored.
    pub depth: usize,
    pub elapsed: Duration,
    /// `always` properties with a counterexample: the name and the path to the violating state.
    pub violated: Vec<(&'static str, Path<S, A>)>,
    /// `sometimes` properties with no example anywhere in the state space.
    pub never: Vec<&'static str>,
    /// Every property's name and whether it is an `always` (else a `sometimes`).
    pub properties: Vec<(&'static str, bool)>,
}

impl<S: Clone + Debug, A: Clone + Debug> Report<S, A> {
    /// The counterexample of `property`, if it was violated.
    pub fn counterexample(&self, property: &str) -> Option<&Path<S, A>> {
        self.violated
            .iter()
            .find(|(name, _)| *name == property)
            .map(|(_, path)| path)
    }

    pub fn summary(&self) -> String {
        format!(
            "{}: {} states, depth {}, {:.1?}; {} properties, {} violated, {} never seen",
            self.name,
            self.states,
            self.depth,
            self.elapsed,
            self.properties.len(),
            self.violated.len(),
            self.never.len()
        )
    }

    /// What is wrong, given the `always` properties `known` to fail: each other one violated (with its path),
    /// each known one that holds, each `sometimes` never seen.
    pub fn failures(&self, known: &[&str]) -> Vec<String> {
        let mut failures = Vec::new();
        for (name, path) in &self.violated {
            if !known.contains(name) {
                let steps: Vec<String> = path
                    .clone()
                    .into_actions()
                    .iter()
                    .map(|action| format!("{action:?}"))
                    .collect();
                failures.push(format!(
                    "{}: \"{name}\" violated after {} steps:\n  {}\n  final state: {:#?}",
                    self.name,
                    steps.len(),
                    steps.join("\n  "),
                    path.last_state()
                ));
            }
        }
        for name in known {
            if self.counterexample(name).is_none() {
                failures.push(format!(
                    "{}: \"{name}\" is a known failure of kmqd as it is, and now holds: update the \
                     scenario's `known` and the README",
                    self.name
                ));
            }
        }
        for name in &self.never {
            failures.push(format!(
                "{}: \"{name}\" never happened: the model is vacuous there",
                self.name
            ));
        }
        failures
    }
}

/// Explores every state of `setup` and checks every property: the checker goes on until every property has a
/// discovery (a counterexample of an `always`, an example of a `sometimes`) or every state is visited.
/// Counterexamples found this way are not the shortest: [`shortest`] finds those.
pub fn check(setup: Setup, threads: usize) -> Report {
    check_at_most(setup, threads, None)
}

/// As [`check`], stopping after about `cap` states (a search that stops early proves nothing; for sizing).
pub fn check_at_most(setup: Setup, threads: usize, cap: Option<usize>) -> Report {
    check_with(setup, threads, cap, false)
}

/// As [`check_at_most`]; `progress` prints the checker's progress to stderr every few seconds.
pub fn check_with(setup: Setup, threads: usize, cap: Option<usize>, progress: bool) -> Report {
    let name = setup.name;
    check_model(name, Protocol::new(setup), threads, cap, progress)
}

/// Explores every state of `model` (of any of this crate's models), as [`check_with`] says.
pub fn check_model<M>(
    name: &'static str,
    model: M,
    threads: usize,
    cap: Option<usize>,
    progress: bool,
) -> Report<M::State, M::Action>
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + Debug + Hash + PartialEq + Send + Sync + 'static,
    M::Action: Clone + Debug + PartialEq + Send + Sync + 'static,
{
    let properties: Vec<(&'static str, bool)> = model
        .properties()
        .iter()
        .map(|p| (p.name, p.expectation != Expectation::Sometimes))
        .collect();
    let started = Instant::now();
    let mut builder = model.checker().threads(threads);
    if let Some(cap) = cap {
        builder = builder.target_state_count(cap);
    }
    // Depth first: its memory is the set of fingerprints and one path, where breadth first keeps a whole
    // frontier of states (with their paths); every state is visited either way.
    let checker = builder.spawn_dfs();
    let checker = if progress {
        let mut stderr = std::io::stderr();
        checker.join_and_report(&mut WriteReporter::new(&mut stderr))
    } else {
        checker.join()
    };
    let elapsed = started.elapsed();
    let mut violated = Vec::new();
    let mut never = Vec::new();
    for &(property, always) in &properties {
        match (checker.discovery(property), always) {
            (Some(path), true) => violated.push((property, path)),
            (None, false) => never.push(property),
            _ => {}
        }
    }
    Report {
        name,
        states: checker.unique_state_count(),
        depth: checker.max_depth(),
        elapsed,
        violated,
        never,
        properties,
    }
}

/// What a search for a counterexample found: its steps (each action and the state it led to), if any; how many
/// states it visited; how long it took.
pub type Search<A, S> = (Option<Vec<(A, S)>>, usize, Duration);

/// The shortest path to a state that violates the `always` property `property` of `setup`, if there is one:
/// a plain breadth-first search on one thread (stateright's keeps the last discovery of a block of states, not
/// the first, so its paths are short but not always the shortest). Without the reductions of [`crate::canon`],
/// so that the trace reads as it happened. Also returns how many states it visited, and how long it took.
pub fn shortest(setup: Setup, property: &str) -> Search<Action, State> {
    let mut model = Protocol::new(setup);
    model.reduce = false;
    shortest_in(&model, property)
}

/// The shortest path to a state of `model` that violates the `always` property `property`, as [`shortest`]
/// says, in any of this crate's models.
pub fn shortest_in<M>(model: &M, property: &str) -> Search<M::Action, M::State>
where
    M: Model,
    M::State: Clone + Hash,
    M::Action: Clone,
{
    let condition = model
        .properties()
        .into_iter()
        .find(|p| p.name == property)
        .unwrap_or_else(|| panic!("no property {property:?}"))
        .condition;
    let started = Instant::now();
    let init = model.init_states().remove(0);
    // Each state once, by fingerprint: the parent's fingerprint and the action that led here. The states
    // themselves are kept only in the frontier; the path is replayed from the initial state at the end.
    let mut seen: HashMap<u64, Option<(u64, M::Action)>> = HashMap::new();
    let mut frontier = VecDeque::new();
    seen.insert(fingerprint(&init), None);
    frontier.push_back(init.clone());
    let mut actions = Vec::new();
    while let Some(state) = frontier.pop_front() {
        if !condition(model, &state) {
            let mut steps = Vec::new();
            let mut at = fingerprint(&state);
            while let Some(Some((parent, action))) = seen.get(&at) {
                steps.push(action.clone());
                at = *parent;
            }
            steps.reverse();
            let mut path = Vec::with_capacity(steps.len());
            let mut current = init;
            for action in steps {
                current = model
                    .next_state(&current, action.clone())
                    .expect("a recorded step replays");
                path.push((action, current.clone()));
            }
            return (Some(path), seen.len(), started.elapsed());
        }
        let here = fingerprint(&state);
        model.actions(&state, &mut actions);
        for action in actions.drain(..) {
            if let Some(next) = model.next_state(&state, action.clone()) {
                if let Entry::Vacant(entry) = seen.entry(fingerprint(&next)) {
                    entry.insert(Some((here, action)));
                    frontier.push_back(next);
                }
            }
        }
    }
    (None, seen.len(), started.elapsed())
}

fn fingerprint(state: &impl Hash) -> u64 {
    let mut hasher = DefaultHasher::new();
    state.hash(&mut hasher);
    hasher.finish()
}

/// A counterexample as numbered steps, then the state it ends in.
pub fn describe<A: Debug, S: Debug>(path: &[(A, S)]) -> String {
    let mut out = String::new();
    for (step, (action, _)) in path.iter().enumerate() {
        let _ = writeln!(out, "  {:>2}. {action:?}", step + 1);
    }
    if let Some((_, last)) = path.last() {
        let _ = writeln!(out, "  final state: {last:#?}");
    }
    out
}
