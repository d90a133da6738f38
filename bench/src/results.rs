//! The `results` scenario: a no-op safe drain by one daemon, each handler returning a small result (`{"result":
//! 1}`), with `keep_results = "1h"` (every settle keeps each task's result: a field of the queue's bucket hash of
//! the time, beside its bit in its claim's bitmap) against the same drain without it (the result dropped). Issue
//! 36's target: at least 0.7x. The two are run in turns, so a change of the machine's load falls on both.
//!
//! The same pair again with a handler that sleeps 1 ms (64 workers, as the `handlers` scenario's sleeping
//! handlers): a drain where Redis is not what bounds the rate, so the ratio says what keeping results costs a
//! queue of real work, where the no-op pair says what it costs Redis.

use super::{Bench, Drains, Figure, Shape, drain_once};

/// Handler threads of the 1 ms pair: enough that the sleeping handlers, not the daemon, set the pace.
const SLEEPING_WORKERS: usize = 64;

pub(super) fn results(bench: &Bench) -> Result<Vec<Figure>, String> {
    let o = &bench.options;
    let mut configs = Vec::new();
    let handlers = [
        ("no-op", r#"{"result":1}"#, bench.shape().workers),
        ("1 ms", r#"{"result":1,"sleep_ms":1}"#, SLEEPING_WORKERS),
    ];
    for (handler, data, workers) in handlers {
        for (what, extra) in [
            ("without keep_results", ""),
            ("keep_results 1h", "keep_results = \"1h\"\n"),
        ] {
            let shape = Shape {
                extra,
                workers,
                ..bench.shape()
            };
            let name = format!("results-{handler}-{}", what.replace(' ', "-")).replace(' ', "-");
            let config = bench.config_on(&bench.own().section, &name, "safe", None, shape)?;
            configs.push((handler, data, workers, what, config, Vec::new()));
        }
    }
    for _ in 0..o.runs {
        for (_, data, _, _, config, runs) in &mut configs {
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
        .map(|(handler, _, workers, what, _, runs)| {
            let name = format!(
                "{handler} safe drain returning a result ({workers} workers), {what}, {} tasks",
                o.tasks
            );
            Drains::of(runs).figure("results", name, false)
        })
        .collect())
}
