//! Runs the model's checks by hand: `cargo run -p kmq-model --release -- [ci | large | break | SCENARIO...]`.
//!
//! - `ci` (the default): the scenarios the test runs (the turns' `weights` and `weights-change`, the type
//!   limits' `typed` and `typed-more`, the groups' and the wake-up's included);
//! - `large`: larger bounds (three tasks, more faults), minutes rather than seconds;
//! - `break`: the "break it on purpose" experiments, each printing its counterexample;
//! - a scenario name (see `setup.rs`: `pill`, `stall`, `lost-replies`, `rolling`, `mixed-modes`, `recovered`,
//!   `zombie`, `limit`, `throttle`, `popped`, `popped-stall`, the finding `orphan`, the turns' `weights` and
//!   `weights-change`, the type limits' `typed` and `typed-more`, the groups' `grouped` and `grouped-more`, the
//!   wake-up's `wake`, `wake-handover`, the finding `wake-rolling` and its fix `wake-rolling-high`, and the larger `lost-replies-large`,
//!   `weights-change`, the type limits' `typed` and `typed-more`, groups beside type limits' `grouped-typed`,
//!   `grouped-typed-more` and `grouped-typed-wide`, and the larger `lost-replies-large`,
//!   `rolling-large`, `pill-large`, `zombie-large`), optionally with `--mutation NAME` (`no-floor-check`, `no-adopt`, `no-idempotent-settle`,
//!   `monitor-own-levels`, `group-beside-others`, `no-lease-check`, `renew-expired`, `pop-ready-only`,
//!   `register-retry-keeps-lease`, and the running limit's `subtract-uncounted`, `subtract-count`,
//!   `limit-after-taking`, `monitor-subtracts-nothing`, default mode's `release-forgets-share`,
//!   `settle-after-release`, `keep-owner-after-lost-pop`, `pop-without-lease-check`, and the turns'
//!   `empty-level-accrues`, `no-clamp`), `--progress` to print the checker's progress, `--trace` to print every
//!   counterexample in full, or `--find PROPERTY` to search for the shortest counterexample of one property
//!   (breadth first, one thread, daemons keep their names).
//!
//! `KMQ_CRASHES`, `KMQ_STALLS`, `KMQ_LOST`, `KMQ_SHUTDOWNS`, `KMQ_RETRY_TIMES`, `KMQ_SLOTS` and `KMQ_RECOVERED`
//! override a scenario's bounds for one run (`KMQ_MOST` and `KMQ_EXACT_AFTER` a turns scenario's);
//! `KMQ_MODEL_CAP` stops after about that many states (for sizing only).

use std::fmt::Debug;
use std::hash::Hash;

use stateright::Model;

use kmq_model::group_types::{self, GroupTyped, GroupTypes};
use kmq_model::groups::{self, Grouped, Groups};
use kmq_model::run::{self, Report, Search};
use kmq_model::setup::{self, Mutation, Setup};
use kmq_model::turns::{self, Turns, TurnsMutation, Weighted};
use kmq_model::types::{self, Limited, Types};
use kmq_model::wake::{self, Wake, Woken};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let trace = args.iter().any(|a| a == "--trace");
    let cap = std::env::var("KMQ_MODEL_CAP")
        .ok()
        .and_then(|cap| cap.parse().ok());
    let mutation = args
        .iter()
        .position(|a| a == "--mutation")
        .and_then(|at| args.get(at + 1))
        .filter(|name| parse_turns_mutation(name).is_none())
        .map(|name| parse_mutation(name));
    let find = args
        .iter()
        .position(|a| a == "--find")
        .and_then(|at| args.get(at + 1))
        .cloned();
    let words: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| {
            !a.starts_with("--")
                && parse_mutation_opt(a).is_none()
                && parse_turns_mutation(a).is_none()
                && Some(*a) != find.as_deref()
        })
        .collect();
    let turns_mutation = args
        .iter()
        .position(|a| a == "--mutation")
        .and_then(|at| args.get(at + 1))
        .and_then(|name| parse_turns_mutation(name));
    let mut setups: Vec<Setup> = Vec::new();
    let mut weighted: Vec<Weighted> = Vec::new();
    let mut typed: Vec<Limited> = Vec::new();
    let mut grouped: Vec<Grouped> = Vec::new();
    let mut woken: Vec<Woken> = Vec::new();
    let mut group_typed: Vec<GroupTyped> = Vec::new();
    let mut experiments = false;
    for word in if words.is_empty() { vec!["ci"] } else { words } {
        match word {
            "ci" => {
                setups.extend(setup::ci());
                weighted.extend(turns::scenarios());
                typed.extend(types::scenarios());
                grouped.extend(groups::scenarios());
                woken.extend(wake::scenarios());
                group_typed.extend(group_types::scenarios());
            }
            name if group_types::scenarios().iter().any(|g| g.name == name) => group_typed.extend(
                group_types::scenarios()
                    .into_iter()
                    .filter(|g| g.name == name),
            ),
            "large" => setups.extend(setup::large()),
            "break" => experiments = true,
            "wake-rolling" => woken.push(wake::wake_rolling()),
            "wake-rolling-high" => woken.push(wake::wake_rolling_high()),
            name if wake::scenarios().iter().any(|w| w.name == name) => {
                woken.extend(wake::scenarios().into_iter().filter(|w| w.name == name))
            }
            name if groups::scenarios().iter().any(|g| g.name == name) => {
                grouped.extend(groups::scenarios().into_iter().filter(|g| g.name == name))
            }
            name if types::scenarios().iter().any(|l| l.name == name) => {
                typed.extend(types::scenarios().into_iter().filter(|l| l.name == name))
            }
            name if turns::scenarios().iter().any(|w| w.name == name) => {
                weighted.extend(turns::scenarios().into_iter().filter(|w| w.name == name))
            }
            name => setups.push(
                setup::ci()
                    .into_iter()
                    .chain(setup::large())
                    .chain([setup::orphan()])
                    .find(|s| s.name == name)
                    .unwrap_or_else(|| panic!("no scenario {name:?}")),
            ),
        }
    }
    if experiments {
        for (setup, property) in setup::experiments()
            .into_iter()
            .chain(setup::limit_experiments())
            .chain(setup::throttle_experiments())
        {
            let (name, mutation) = (setup.name, setup.mutation);
            print_experiment(name, mutation, property, run::shortest(setup, property));
        }
        for (setup, property) in turns::experiments() {
            let (name, mutation) = (setup.name, setup.mutation);
            let search = run::shortest_in(&Turns::new(setup), property);
            print_experiment(name, mutation, property, search);
        }
        for (setup, property) in types::experiments() {
            let (name, mutation) = (setup.name, setup.mutation);
            let search = run::shortest_in(&Types::new(setup), property);
            print_experiment(name, mutation, property, search);
        }
        for (setup, property) in groups::experiments() {
            let (name, mutation) = (setup.name, setup.mutation);
            let search = run::shortest_in(&Groups::new(setup), property);
            print_experiment(name, mutation, property, search);
        }
        for (setup, property) in wake::experiments()
            .into_iter()
            .chain(wake::handover_experiments())
        {
            let (name, mutation) = (setup.name, setup.mutation);
            let search = run::shortest_in(&Wake::new(setup), property);
            print_experiment(name, mutation, property, search);
        }
    }
    for setup in woken {
        let name = setup.name;
        find_or_check(name, Wake::new(setup), find.as_deref(), threads, cap, trace);
        for (setup, property) in group_types::experiments() {
            let (name, mutation) = (setup.name, setup.mutation);
            let search = run::shortest_in(&GroupTypes::new(setup), property);
            print_experiment(name, mutation, property, search);
        }
    }
    for mut setup in group_typed {
        if let Some(faults) = std::env::var("KMQ_FAULTS")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            setup.faults = faults;
        }
        let name = setup.name;
        find_or_check(
            name,
            GroupTypes::new(setup),
            find.as_deref(),
            threads,
            cap,
            trace,
        );
    }
    for setup in grouped {
        let name = setup.name;
        find_or_check(
            name,
            Groups::new(setup),
            find.as_deref(),
            threads,
            cap,
            trace,
        );
    }
    for setup in typed {
        let name = setup.name;
        find_or_check(
            name,
            Types::new(setup),
            find.as_deref(),
            threads,
            cap,
            trace,
        );
    }
    for mut setup in weighted {
        if let Some(mutation) = turns_mutation {
            setup.mutation = Some(mutation);
        }
        for (key, field) in [("KMQ_MOST", &mut setup.most)] {
            if let Some(value) = std::env::var(key).ok().and_then(|v| v.parse().ok()) {
                *field = value;
            }
        }
        if let Some(value) = std::env::var("KMQ_EXACT_AFTER")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            setup.exact_after = value;
        }
        let name = setup.name;
        find_or_check(
            name,
            Turns::new(setup),
            find.as_deref(),
            threads,
            cap,
            trace,
        );
    }
    for mut setup in setups {
        if let Some(mutation) = mutation {
            setup.mutation = Some(mutation);
        }
        for (key, field) in [
            ("KMQ_CRASHES", &mut setup.crashes),
            ("KMQ_STALLS", &mut setup.stalls),
            ("KMQ_LOST", &mut setup.lost_replies),
            ("KMQ_SHUTDOWNS", &mut setup.shutdowns),
            ("KMQ_RETRY_TIMES", &mut setup.retry_times),
            ("KMQ_SLOTS", &mut setup.slots),
            ("KMQ_RECOVERED", &mut setup.recovered),
        ] {
            if let Some(value) = std::env::var(key).ok().and_then(|v| v.parse().ok()) {
                *field = value;
            }
        }
        if let Some(property) = &find {
            let name = setup.name;
            let (path, visited, elapsed) = run::shortest(setup, property);
            println!("{name}: {visited} states searched in {elapsed:.1?}");
            print_path(property, path.as_deref());
            continue;
        }
        let progress = args.iter().any(|a| a == "--progress");
        let report = run::check_with(setup, threads, cap, progress);
        print_report(&report, trace);
    }
}

/// Searches `model` for the shortest counterexample of `find`, or, without one, checks every state of it and
/// prints the report (a model of its own: the turns', the type limits').
fn find_or_check<M>(
    name: &'static str,
    model: M,
    find: Option<&str>,
    threads: usize,
    cap: Option<usize>,
    trace: bool,
) where
    M: Model + Send + Sync + 'static,
    M::State: Clone + Debug + Hash + PartialEq + Send + Sync + 'static,
    M::Action: Clone + Debug + PartialEq + Send + Sync + 'static,
{
    if let Some(property) = find {
        let (path, visited, elapsed) = run::shortest_in(&model, property);
        println!("{name}: {visited} states searched in {elapsed:.1?}");
        print_path(property, path.as_deref());
        return;
    }
    let report = run::check_model(name, model, threads, cap, false);
    print_report(&report, trace);
}

/// One "break it on purpose" experiment: what the search for its counterexample found.
fn print_experiment<A: Debug, S: Debug>(
    name: &str,
    mutation: impl Debug,
    property: &str,
    (path, visited, elapsed): Search<A, S>,
) {
    println!("{name} with {mutation:?}: {visited} states searched in {elapsed:.1?}");
    print_path(property, path.as_deref());
}

fn print_path<A: Debug, S: Debug>(property: &str, path: Option<&[(A, S)]>) {
    match path {
        Some(path) => {
            println!("  \"{property}\" violated in {} steps:", path.len());
            print!("{}", run::describe(path));
        }
        None => println!("  \"{property}\" holds"),
    }
}

fn print_report<S: Clone + Debug, A: Clone + Debug>(report: &Report<S, A>, trace: bool) {
    println!("{}", report.summary());
    for (name, path) in &report.violated {
        println!(
            "  VIOLATED \"{name}\" in {} steps",
            path.clone().into_actions().len()
        );
        if trace {
            for (step, action) in path.clone().into_actions().iter().enumerate() {
                println!("  {:>2}. {action:?}", step + 1);
            }
            println!("  final state: {:#?}", path.last_state());
        }
    }
    for name in &report.never {
        println!("  never seen: \"{name}\"");
    }
}

fn parse_mutation_opt(name: &str) -> Option<Mutation> {
    match name {
        "no-floor-check" => Some(Mutation::NoFloorCheck),
        "no-adopt" => Some(Mutation::NoAdopt),
        "no-idempotent-settle" => Some(Mutation::NoIdempotentSettle),
        "monitor-own-levels" => Some(Mutation::MonitorOwnLevels),
        "group-beside-others" => Some(Mutation::GroupBesideOthers),
        "no-lease-check" => Some(Mutation::NoLeaseCheck),
        "renew-expired" => Some(Mutation::RenewExpired),
        "pop-ready-only" => Some(Mutation::PopReadyOnly),
        "register-retry-keeps-lease" => Some(Mutation::RegisterRetryKeepsLease),
        "subtract-uncounted" => Some(Mutation::SubtractUncounted),
        "subtract-count" => Some(Mutation::SubtractCount),
        "limit-after-taking" => Some(Mutation::LimitAfterTaking),
        "monitor-subtracts-nothing" => Some(Mutation::MonitorSubtractsNothing),
        "throttle-charges" => Some(Mutation::ThrottleCharges),
        "claim-ignores-throttle" => Some(Mutation::ClaimIgnoresThrottle),
        "release-forgets-share" => Some(Mutation::ReleaseForgetsShare),
        "settle-after-release" => Some(Mutation::SettleAfterRelease),
        "keep-owner-after-lost-pop" => Some(Mutation::KeepOwnerAfterLostPop),
        "pop-without-lease-check" => Some(Mutation::PopWithoutLeaseCheck),
        _ => None,
    }
}

fn parse_turns_mutation(name: &str) -> Option<TurnsMutation> {
    match name {
        "empty-level-accrues" => Some(TurnsMutation::EmptyLevelAccrues),
        "no-clamp" => Some(TurnsMutation::NoClamp),
        _ => None,
    }
}

fn parse_mutation(name: &str) -> Mutation {
    parse_mutation_opt(name).unwrap_or_else(|| panic!("no mutation {name:?}"))
}
