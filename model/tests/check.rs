//! The model's checks: the bounded exhaustive check CI runs, the "break it on purpose" experiments, and the two
//! findings (a retried registration, fixed; an orphaned handler's crash, open). `scripts/test` runs them in
//! release (`cargo test -p kmq-model --release`): the exhaustive check visits millions of states, which a debug
//! build does about ten times slower.

use std::time::Instant;

use kmq_model::run::{self, Report};
use kmq_model::setup::{
    self, Mutation, NO_LEAK, NO_UNDERFLOW, RUNNING_BOUND, RUNNING_EXACT, Setup, UNFAIR_CHARGE,
    UNFAIR_DEAD, ZOMBIE_START,
};

/// Checks `setups` exhaustively: every `always` property holds except each scenario's known failures (which
/// must fail), and every `sometimes` property is seen. Returns the reports.
fn check_all(setups: Vec<Setup>) -> Vec<Report> {
    let started = Instant::now();
    let mut failures = Vec::new();
    let mut reports = Vec::new();
    for setup in setups {
        let known = setup.known;
        let report = run::check(setup, 2);
        println!("{}", report.summary());
        for (name, path) in &report.violated {
            if !known.contains(name) {
                let steps: Vec<String> = path
                    .clone()
                    .into_actions()
                    .iter()
                    .map(|action| format!("{action:?}"))
                    .collect();
                failures.push(format!(
                    "{}: \"{name}\" violated after {} steps:\n  {}\n  final state: {:#?}",
                    report.name,
                    steps.len(),
                    steps.join("\n  "),
                    path.last_state()
                ));
            }
        }
        for name in known {
            if report.counterexample(name).is_none() {
                failures.push(format!(
                    "{}: \"{name}\" is a known failure of kmqd as it is, and now holds: update `known` in \
                     setup.rs and the README",
                    report.name
                ));
            }
        }
        for name in &report.never {
            failures.push(format!(
                "{}: \"{name}\" never happened: the model is vacuous there",
                report.name
            ));
        }
        reports.push(report);
    }
    let states: usize = reports.iter().map(|r| r.states).sum();
    println!("{states} states in {:.1?}", started.elapsed());
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    reports
}

/// The CI check: every scenario of `setup::ci`, every reachable state.
#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "millions of states: scripts/test runs it in release"
)]
fn the_protocol_holds_in_every_state_within_the_ci_bounds() {
    check_all(setup::ci());
}

/// A small bound, exhaustively, so that a debug build (`cargo test --workspace`) checks the whole pipeline
/// too: the pill scenario without the `kill -9`.
#[test]
fn a_small_bound_holds_in_every_state() {
    let small = Setup {
        name: "pill-small",
        crashes: 0,
        known: &[],
        ..setup::pill()
    };
    let reports = check_all(vec![small]);
    assert!(reports[0].states > 10_000, "{}", reports[0].summary());
}

/// Each safeguard, removed, lets the checker find the failure it prevents.
#[test]
fn removing_a_safeguard_breaks_the_property_it_keeps() {
    each_breaks_its_property(setup::experiments());
}

/// Each mutated setup of `experiments` breaks its property; prints the shortest counterexample.
fn each_breaks_its_property(experiments: Vec<(Setup, &'static str)>) {
    for (setup, property) in experiments {
        let (name, mutation) = (setup.name, setup.mutation);
        let (path, visited, elapsed) = run::shortest(setup, property);
        let path = path.unwrap_or_else(|| {
            panic!("{name} with {mutation:?}: \"{property}\" still holds ({visited} states)")
        });
        println!(
            "{name} with {mutation:?}: \"{property}\" violated in {} steps ({visited} states, {elapsed:.1?})\n{}",
            path.len(),
            run::describe(&path)
        );
    }
}

/// The running limit's experiment of `mutation`: each of its properties in `setup::limit_experiments` is
/// violated (in release; the first one in a debug build), and the shortest counterexample is printed. Returns
/// the lengths.
fn limit_experiment(mutation: Mutation) -> Vec<usize> {
    let mut lengths = Vec::new();
    for (setup, property) in setup::limit_experiments() {
        // A debug build (`cargo test --workspace`) searches for the first property of each mutation only: the
        // second of SubtractCount's takes it about 6 s there (0.8 s in release).
        if setup.mutation != Some(mutation) || (cfg!(debug_assertions) && !lengths.is_empty()) {
            continue;
        }
        let name = setup.name;
        let (path, visited, elapsed) = run::shortest(setup, property);
        let path = path.unwrap_or_else(|| {
            panic!("{name} with {mutation:?}: \"{property}\" still holds ({visited} states)")
        });
        println!(
            "{name} with {mutation:?}: \"{property}\" violated in {} steps ({visited} states, {elapsed:.1?})\n{}",
            path.len(),
            run::describe(&path)
        );
        lengths.push(path.len());
    }
    assert!(!lengths.is_empty(), "no experiment of {mutation:?}");
    lengths
}

/// settle.lua subtracting without looking at the scopes string takes a task claimed without the limit off the
/// count: the count falls below what counted lists hold, then below 0.
#[test]
fn a_settle_that_subtracts_an_uncounted_claim_is_caught() {
    limit_experiment(Mutation::SubtractUncounted);
}

/// settle.lua subtracting the positions a call names, not the bits it newly sets: a monitor's call that finds
/// one of its tasks settled by the late owner subtracts it a second time.
#[test]
fn a_settle_that_subtracts_its_count_rather_than_its_new_bits_is_caught() {
    limit_experiment(Mutation::SubtractCount);
}

/// claim.lua comparing with the limit only after it took: a claim takes more than the limit leaves.
#[test]
fn a_claim_that_checks_the_limit_after_taking_is_caught() {
    limit_experiment(Mutation::LimitAfterTaking);
}

/// A monitor's recovery that subtracts nothing: a crashed daemon's slots leak.
#[test]
fn a_monitor_that_subtracts_nothing_is_caught() {
    limit_experiment(Mutation::MonitorSubtractsNothing);
}

/// The throttle's experiments: settle.lua charging a throttle (re-queued with `attempt + 1`), and claim.lua
/// without its throttle check (state 6), each caught by its property, with the shortest counterexample printed.
#[test]
fn a_charged_throttle_and_a_claim_that_ignores_the_throttle_are_caught() {
    each_breaks_its_property(setup::throttle_experiments());
}

/// The throttle scenario without its stall (a few thousand states), so that a debug build checks the throttle's
/// properties exhaustively too; release checks the whole scenario in the CI check.
#[test]
fn a_throttle_is_uncharged_and_holds_every_claim_and_pop_back_in_a_small_bound() {
    let small = Setup {
        name: "throttle-small",
        stalls: 0,
        ..setup::throttle()
    };
    check_all(vec![small]);
}

/// Every property of the running limit has an experiment that breaks it.
#[test]
fn every_property_of_the_running_limit_is_broken_by_an_experiment() {
    for property in [RUNNING_EXACT, RUNNING_BOUND, NO_UNDERFLOW, NO_LEAK] {
        assert!(
            setup::limit_experiments()
                .iter()
                .any(|(_, broken)| *broken == property),
            "{property}"
        );
    }
}

/// The first finding, fixed: a registration sent again after a lost reply made the fetcher believe the lease good
/// for longer than Redis kept it (register.lua answered 1 to a retry for a live owner without extending its
/// lease, while `Ownership::set` counts from the retry's send time), so a daemon whose lease ran out in that
/// window started a task a monitor had already recovered. register.lua now renews a live lease on a retry, from
/// when it runs: the exhaustive check of `zombie` (in release) finds every property holding, and the experiment
/// `RegisterRetryKeepsLease` (the old register.lua) still breaks it. Here, a small bound of `zombie` for debug
/// builds too, and the old register.lua's shortest counterexample.
#[test]
fn a_registration_sent_again_renews_the_lease_so_no_zombie_starts_a_task_it_lost() {
    let small = Setup {
        name: "zombie-small",
        tasks: setup::zombie().tasks[..1].to_vec(),
        ..setup::zombie()
    };
    check_all(vec![small]);
    let old = setup::zombie().with_mutation(Mutation::RegisterRetryKeepsLease);
    let (path, visited, _) = run::shortest(old, ZOMBIE_START);
    let path = path.expect("the old register.lua lets a zombie start a task it lost");
    println!(
        "with the old register.lua, \"{ZOMBIE_START}\" violated in {} steps ({visited} states)\n{}",
        path.len(),
        run::describe(&path)
    );
}

/// What the checker found in kmqd as it is, once a pill's handler may outlive its task (`Setup::orphans`): claim.lua
/// gives an owner a group of 1 when the owner's processing hashes are empty, but its daemon may still be running
/// an orphaned handler (a task forgotten with a lost lease); when that one crashes the daemon, the monitor charges
/// the task that ran alone. With `retry_times = 0` it is dead-lettered "crashed the daemon 1 times while it ran
/// alone". In release the scenario is checked exhaustively too: that is the only property that fails.
#[test]
fn an_orphaned_handler_s_crash_is_charged_to_the_task_that_runs_alone_after_it() {
    let (path, visited, _) = run::shortest(setup::orphan(), UNFAIR_CHARGE);
    let path = path.expect("the unfair charge is found");
    println!(
        "\"{UNFAIR_CHARGE}\" violated in {} steps ({visited} states)\n{}",
        path.len(),
        run::describe(&path)
    );
    let no_retries = Setup {
        retry_times: 0,
        ..setup::orphan()
    };
    let (path, visited, _) = run::shortest(no_retries, UNFAIR_DEAD);
    let path = path.expect("the unfair dead letter is found");
    println!(
        "\"{UNFAIR_DEAD}\" violated in {} steps ({visited} states)",
        path.len()
    );
    // Every other property holds there (a few seconds in release; a debug build skips it).
    if !cfg!(debug_assertions) {
        check_all(vec![setup::orphan()]);
    }
}

/// Larger bounds, by hand: `cargo test -p kmq-model --release -- --ignored --nocapture` (minutes).
#[test]
#[ignore = "minutes: run by hand"]
fn the_protocol_holds_within_larger_bounds() {
    check_all(setup::large());
}
