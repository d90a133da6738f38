//! The model's checks: the bounded exhaustive check CI runs, the "break it on purpose" experiments, and the
//! finding about the quarantine. `scripts/test` runs them in release (`cargo test -p kmq-model --release`): the
//! exhaustive check visits millions of states, which a debug build does about ten times slower.

use std::time::Instant;

use kmq_model::run::{self, Report};
use kmq_model::setup::{self, Setup, UNFAIR_CHARGE, UNFAIR_DEAD};

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
    for (setup, property) in setup::experiments() {
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

/// What the checker found in kmqd as it is: claim.lua takes a quarantined task together with ready tasks, so
/// when one of those crashes the daemon, the monitor charges the crash to the quarantined task ("ran alone").
/// With `retry_times = 0` the same trace dead-letters a task that never crashed anything. (The exhaustive check
/// asserts that the proposed claim.lua, `Setup::alone`, restores both properties.)
#[test]
fn kmqd_charges_a_quarantined_task_for_a_neighbours_crash() {
    let (path, visited, _) = run::shortest(setup::pill(), UNFAIR_CHARGE);
    let path = path.expect("the unfair charge is found");
    println!(
        "\"{UNFAIR_CHARGE}\" violated in {} steps ({visited} states)\n{}",
        path.len(),
        run::describe(&path)
    );
    let no_retries = Setup {
        retry_times: 0,
        ..setup::pill()
    };
    let (path, visited, _) = run::shortest(no_retries, UNFAIR_DEAD);
    let path = path.expect("the unfair dead letter is found");
    println!(
        "\"{UNFAIR_DEAD}\" violated in {} steps ({visited} states)\n{}",
        path.len(),
        run::describe(&path)
    );
}

/// Larger bounds, by hand: `cargo test -p kmq-model --release -- --ignored --nocapture` (minutes).
#[test]
#[ignore = "minutes: run by hand"]
fn the_protocol_holds_within_larger_bounds() {
    check_all(setup::large());
}
