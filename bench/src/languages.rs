//! The `languages` scenario: no-op handlers written in Python and in Node with the SDKs of `sdk/`, run by the
//! exec plugin's persistent mode (docs/HANDLERS.md), against the same drain with the native testkit plugin: the
//! price of a handler in another language, per task, and the ratios the issue asks for (at least 4× Dramatiq's
//! drain for Python, 4× bee-queue's for Node) when `--peers` gives the peers' figures of the same session.
//!
//! One daemon in safe mode, [`WORKERS`] workers; the handlers run in [`PROCESSES`] children (one per core of
//! this machine's kind), each holding `WORKERS / PROCESSES` tasks at once (`concurrency`), with async no-op
//! handlers so that one child can hold many. The SDK files are copied into the bench's directory, as a user
//! copies them next to their handlers. The daemon's CPU includes its children's (`tree_cpu_us`).

use std::path::{Path, PathBuf};

use super::{Bench, Figure, Shape, drain_once, figure, median, peers::PeerRow};

/// Workers of the daemon, and handler processes they share.
const WORKERS: usize = 64;
const PROCESSES: usize = 2;
/// Tasks per drain: a few seconds at the rates these reach.
const TASKS: usize = 100_000;

const PYTHON_SDK: &str = include_str!("../../sdk/python/kmq_handler.py");
const NODE_SDK: &str = include_str!("../../sdk/node/kmq-handler.js");
const PYTHON_HANDLER: &str = "from kmq_handler import handler, run\n\n\
                              @handler(\"test\")\n\
                              async def noop(task):\n    return None\n\n\
                              if __name__ == \"__main__\":\n    run()\n";
const NODE_HANDLER: &str = "const { handle, run } = require('./kmq-handler');\n\
                            handle('test', async () => {});\n\
                            run();\n";

/// One handler language: how to run it, and the peer the issue compares it with.
struct Language {
    name: &'static str,
    interpreter: &'static str,
    script: &'static str,
    files: [(&'static str, &'static str); 2],
    /// The peer (`peer` column of summary.csv) whose best drain is the yardstick.
    peer: &'static str,
}

const LANGUAGES: [Language; 2] = [
    Language {
        name: "Python",
        interpreter: "python3",
        script: "noop_handler.py",
        files: [
            ("kmq_handler.py", PYTHON_SDK),
            ("noop_handler.py", PYTHON_HANDLER),
        ],
        peer: "dramatiq",
    },
    Language {
        name: "Node",
        interpreter: "node",
        script: "noop-handler.js",
        files: [
            ("kmq-handler.js", NODE_SDK),
            ("noop-handler.js", NODE_HANDLER),
        ],
        peer: "bee-queue",
    },
];

pub(super) fn languages(bench: &Bench, peers: &[PeerRow]) -> Result<Vec<Figure>, String> {
    let own = bench.own();
    let native = bench.config_on(
        &own.section,
        "languages-native",
        "safe",
        None,
        Shape::out_of_the_box(WORKERS),
    )?;
    let mut native_rates = Vec::new();
    let mut native_cpu = Vec::new();
    let mut configs = Vec::new();
    for language in &LANGUAGES {
        configs.push(exec_config(bench, language)?);
    }
    let mut runs: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); LANGUAGES.len()];
    // Native and each language alternate run by run, so that a noisy neighbour weighs on all alike.
    for _ in 0..bench.options.runs {
        let run = drain_once(bench, &own, &native, 1, (TASKS, "{}"), None)?;
        native_rates.push(run.rate);
        native_cpu.push(run.daemon_cpu);
        for (config, (rates, cpu)) in configs.iter().zip(&mut runs) {
            let run = drain_once(bench, &own, config, 1, (TASKS, "{}"), None)?;
            rates.push(run.rate);
            cpu.push(run.daemon_cpu);
        }
    }
    let native_cpu_median = median(&native_cpu);
    let mut figures = vec![figure(
        "languages",
        format!("native plugin (testkit), {WORKERS} workers, safe mode"),
        "tasks/s",
        native_rates,
        vec![("daemon CPU µs/task".into(), native_cpu)],
    )];
    for (language, (rates, cpu)) in LANGUAGES.iter().zip(runs) {
        let mut extra = vec![
            ("daemon + handlers CPU µs/task".into(), vec![median(&cpu)]),
            (
                "CPU µs/task beyond native".into(),
                vec![median(&cpu) - native_cpu_median],
            ),
        ];
        if let Some(best) = best_drain(peers, language.peer) {
            extra.push((
                format!("÷ {} (best)", language.peer),
                vec![median(&rates) / best],
            ));
        }
        figures.push(figure(
            "languages",
            format!(
                "{} SDK no-op (async), exec persistent: {PROCESSES} processes × concurrency {}, {WORKERS} workers, safe mode",
                language.name,
                WORKERS / PROCESSES
            ),
            "tasks/s",
            rates,
            extra,
        ));
    }
    Ok(figures)
}

/// The fastest drain of `peer` among the peers' configurations, if it ran.
fn best_drain(peers: &[PeerRow], peer: &str) -> Option<f64> {
    peers
        .iter()
        .filter(|row| row.peer == peer)
        .filter_map(|row| row.drain)
        .max_by(f64::total_cmp)
}

/// A config whose only plugin is the exec plugin running `language`'s no-op handler in persistent children.
fn exec_config(bench: &Bench, language: &Language) -> Result<PathBuf, String> {
    let dir = bench.dir.path().join(format!("handlers-{}", language.name));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    for (name, text) in language.files {
        std::fs::write(dir.join(name), text).map_err(|e| format!("{name}: {e}"))?;
    }
    let interpreter = which(language.interpreter).ok_or_else(|| {
        format!(
            "{} not found on PATH: the languages scenario runs a {} handler",
            language.interpreter, language.name
        )
    })?;
    // A plugins dir of its own: the testkit beside it would be loaded too (a drop-in) and claim the same type.
    let plugins = bench.dir.path().join("exec-plugins");
    bench.copy_plugin("libkmq_exec.so", &plugins)?;
    let text = format!(
        "[redis]\n{redis}\n\n[daemon]\nplugins_dir = \"{plugins}\"\nshutdown_grace = \"5s\"\nlog_level = \"warn\"\n\n\
         [[queues]]\nname = \"q\"\nmode = \"safe\"\nworkers = {WORKERS}\nlease_timeout = \"30s\"\n\n\
         [plugins.{lower}]\nfile = \"libkmq_exec.so\"\nconfig = {{ command = \"{interpreter}\", args = [\"{script}\"], \
         types = [\"test\"], mode = \"persistent\", processes = {PROCESSES}, concurrency = {concurrency} }}\n",
        redis = bench.own().section,
        plugins = plugins.display(),
        lower = language.name.to_lowercase(),
        interpreter = interpreter.display(),
        script = dir.join(language.script).display(),
        concurrency = WORKERS / PROCESSES,
    );
    let path = bench
        .dir
        .path()
        .join(format!("languages-{}.toml", language.name));
    std::fs::write(&path, text).map_err(|e| e.to_string())?;
    Ok(path)
}

/// The absolute path of `program` on PATH (the exec plugin wants an absolute command).
fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|path| is_executable(path))
    })
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
