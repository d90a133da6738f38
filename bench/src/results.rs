//! The `results` scenario: a no-op safe drain by one daemon, each handler returning a small result (`{"result":
//! 1}`), with `keep_results = "1h"` (every settle keeps each task's result: a field of the queue's bucket hash of
//! the time, beside its bit in its claim's bitmap) against the same drain without it (the result dropped). Issue
//! 36's target: at least 0.7x. The two are run in turns, so a change of the machine's load falls on both.

use super::{Bench, Drains, Figure, Shape, drain_once};

pub(super) fn results(bench: &Bench) -> Result<Vec<Figure>, String> {
    let o = &bench.options;
    let mut configs = Vec::new();
    for (what, extra) in [
        ("without keep_results", ""),
        ("keep_results 1h", "keep_results = \"1h\"\n"),
    ] {
        let shape = Shape {
            extra,
            ..bench.shape()
        };
        let name = format!("results-{}", what.replace(' ', "-"));
        let config = bench.config_on(&bench.own().section, &name, "safe", None, shape)?;
        configs.push((what, config, Vec::new()));
    }
    for _ in 0..o.runs {
        for (_, config, runs) in &mut configs {
            let data = r#"{"result":1}"#;
            runs.push(drain_once(
                bench,
                &bench.own(),
                config,
                1,
                (o.tasks, data),
                None,
            )?);
        }
    }
    Ok(configs
        .iter()
        .map(|(what, _, runs)| {
            let name = format!(
                "no-op safe drain returning a result, {what}, {} tasks",
                o.tasks
            );
            Drains::of(runs).figure("results", name, false)
        })
        .collect())
}
