//! The `results` scenario: a no-op safe drain by one daemon, each handler returning a small result (`{"result":
//! 1}`), with `keep_results = "1h"` (every settle keeps each task's result: a record and a key per task, not a
//! bitmap bit) against the same drain without it (the result dropped, the plain acknowledgements' path). Issue
//! 36's target: at least 0.7x. The two are run in turns, so a change of the machine's load falls on both.

use super::{Bench, Figure, Shape, drain_once, figure};

pub(super) fn results(bench: &Bench) -> Result<Vec<Figure>, String> {
    let o = &bench.options;
    let configs = [
        ("without keep_results", ""),
        ("keep_results 1h", "keep_results = \"1h\"\n"),
    ]
    .map(|(what, extra)| {
        let shape = Shape {
            extra,
            ..bench.shape()
        };
        let name = format!("results-{}", what.replace(' ', "-"));
        bench
            .config_on(&bench.own().section, &name, "safe", None, shape)
            .map(|config| (what, config))
    });
    let mut runs: [(Vec<f64>, Vec<f64>, Vec<f64>); 2] = Default::default();
    for _ in 0..o.runs {
        for (at, config) in configs.iter().enumerate() {
            let (_, config) = config.as_ref().map_err(String::clone)?;
            let run = drain_once(
                bench,
                &bench.own(),
                config,
                1,
                (o.tasks, r#"{"result":1}"#),
                None,
            )?;
            runs[at].0.push(run.rate);
            runs[at].1.push(run.daemon_cpu);
            runs[at].2.push(run.redis_cpu);
        }
    }
    let mut figures = Vec::new();
    for ((what, _), (rates, daemon_cpu, redis_cpu)) in configs.iter().flatten().zip(runs) {
        figures.push(figure(
            "results",
            format!(
                "no-op safe drain returning a result, {what}, {} tasks",
                o.tasks
            ),
            "tasks/s",
            rates,
            vec![
                ("daemon CPU µs/task".into(), daemon_cpu),
                ("redis CPU µs/task".into(), redis_cpu),
            ],
        ));
    }
    Ok(figures)
}
