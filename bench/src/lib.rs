//! `kmqd-bench`: measures kmqd against a private redis-server it starts itself, with the real binary as daemon
//! processes and the `testkit` plugin as a no-op handler (in the `handlers` scenario, one that sleeps or spins),
//! the way `../shared/bench/peers` measures the peers (enqueue first, then drain; drain rate = tasks left at the
//! first poll that saw progress / time to empty).
//!
//! Every figure is the median of `--runs` runs in this one session; docs/PERFORMANCE.md says how to read them.
//! This module is a measuring tool: it reports, it never asserts a speed.
//!
//! One concern a file: this one the options, the scenarios' names and `run`, which runs them in order;
//! `workspace.rs` the bench's Redis, plugins and daemons; `drain.rs` the drain every throughput figure rests on;
//! `report.rs` the figures and their table; `procfs.rs` what a process spent; one file per scenario family
//! (`pushes.rs`, `wakeup.rs`, `memory.rs`, `deployments.rs`, `handlers.rs`, `limits.rs`, `groups.rs`, `latency.rs`,
//! `results.rs`, `fanin.rs`, `defaults.rs`, `languages.rs`, `redis_cost.rs`) and `peers.rs`, the side-by-side with the peers.

mod defaults;
mod deployments;
mod drain;
mod fanin;
mod groups;
mod handlers;
mod languages;
mod latency;
mod limits;
mod memory;
pub mod peers;
mod procfs;
mod pushes;
mod redis_cost;
mod report;
mod results;
mod wakeup;
mod workspace;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use kmqd::broker;
use kmqd::client::{Client, NewTask};
use kmqd::config::Config;
use kmqd_harness::{Listen, RedisServer};

use deployments::*;
use drain::*;
use memory::*;
use procfs::*;
use pushes::*;
use report::*;
pub use report::{Figure, Report, percentile, render};
use wakeup::*;
pub use workspace::default_daemon;
use workspace::*;

/// What to measure and how.
#[derive(Clone, Debug)]
pub struct Options {
    /// Tasks per drain run.
    pub tasks: usize,
    /// Runs per figure (the median is reported).
    pub runs: usize,
    /// Daemon process counts for the drain runs.
    pub daemons: Vec<usize>,
    /// Scenarios (all when empty): see [`SCENARIOS`].
    pub only: Vec<String>,
    /// Handler threads per daemon.
    pub workers: usize,
    /// Claim batch.
    pub batch: usize,
    /// Prefetch per daemon.
    pub prefetch: usize,
    /// Where libkmq_testkit.so is (default: next to the kmqd binary).
    pub plugins_dir: Option<PathBuf>,
    /// The backlog for the memory-under-load figure.
    pub backlog: usize,
    /// A results directory of `../shared/bench/peers/run.sh` (its summary.csv) to compare with.
    pub peers: Option<PathBuf>,
    /// The kmqd binary to run as the daemon (default: the `kmqd` next to this executable, see
    /// [`default_daemon`]), to compare two builds in one session.
    pub daemon: Option<PathBuf>,
}

pub const SCENARIOS: [&str; 19] = [
    "push",
    "drain",
    "defaults",
    "kill",
    "wakeup",
    "latency",
    "lateness",
    "memory",
    "deployments",
    "handlers",
    "redis-cost",
    "languages",
    "limits",
    "groups",
    "groups-scale",
    "groups-limit",
    "groups-rate",
    "results",
    "fanin",
];

/// How often the `kill` scenario disconnects every client of Redis (`CLIENT KILL TYPE normal`).
const KILL_EVERY: Duration = Duration::from_millis(100);

/// Runs the benchmark and returns its report.
pub fn run(options: Options, progress: &mut dyn Write) -> Result<Report, String> {
    // Read the peers' results first: a wrong path should fail before minutes of measuring.
    let peer_rows = match &options.peers {
        Some(dir) => peers::load(dir)?,
        None => Vec::new(),
    };
    let bench = Bench::new(options)?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query(&mut bench.redis()?)
        .map_err(|e| e.to_string())?;
    let redis_version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_string();
    let host = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|cpu| {
            cpu.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut figures = Vec::new();
    let o = bench.options.clone();
    let wants = |scenario: &str| o.only.is_empty() || o.only.iter().any(|s| s == scenario);
    let mut say = |line: String| {
        let _ = writeln!(progress, "{line}");
    };
    if wants("push") {
        say("push rates...".into());
        figures.extend(push_rates(&bench)?);
    }
    if wants("drain") {
        for mode in ["safe", "default"] {
            for &daemons in &o.daemons {
                say(format!(
                    "drain: {mode} mode, {daemons} daemon(s), {} runs of {} tasks...",
                    o.runs, o.tasks
                ));
                figures.push(drain(&bench, mode, daemons)?);
            }
        }
    }
    if wants("defaults") {
        say(format!(
            "defaults: workers = 16 and nothing else against the tuned shape, both modes, {} runs of {} tasks...",
            o.runs, o.tasks
        ));
        figures.extend(defaults::defaults(&bench)?);
    }
    if wants("kill") {
        say(format!(
            "drain under CLIENT KILL every {KILL_EVERY:?}: safe mode, 1 daemon, {} runs of {} tasks...",
            o.runs, o.tasks
        ));
        figures.push(drain_with(
            &bench,
            &bench.own(),
            "safe",
            1,
            Some(KILL_EVERY),
        )?);
    }
    if wants("wakeup") {
        for mode in ["safe", "default"] {
            say(format!("idle wake-up latency: {mode} mode..."));
            figures.push(wake_up(&bench, mode)?);
        }
    }
    if wants("latency") {
        say(format!(
            "push to start, p50/p99/p999: an idle queue ({} samples a run) and one at half its drain rate, both \
             modes, {} runs...",
            latency::IDLE_SAMPLES,
            o.runs
        ));
        figures.extend(latency::latency(&bench)?);
    }
    if wants("lateness") {
        say("delayed-task lateness at 10k due tasks per second...".into());
        figures.push(lateness(&bench)?);
    }
    if wants("memory") {
        say("memory...".into());
        figures.extend(memory(&bench)?);
    }
    if wants("deployments") {
        say(format!(
            "deployments: one Redis, with a replica (wait_replicas 0 and 1), a 3-master cluster; {} runs of {} tasks...",
            o.runs, o.tasks
        ));
        figures.extend(deployments(&bench)?);
    }
    if wants("handlers") {
        say(format!(
            "real handlers: sleeping (1, 10, 100 ms; 64 and 512 workers), spinning (50 µs; {cores} workers), \
             a mix of fast and slow; both modes, {} runs...",
            o.runs
        ));
        figures.extend(handlers::handlers(&bench, cores)?);
    }
    if wants("languages") {
        say(format!(
            "languages: no-op handlers in Python and Node (the SDKs, exec persistent) against the native plugin, {} runs...",
            o.runs
        ));
        figures.extend(languages::languages(&bench, &peer_rows)?);
    }
    if wants("limits") {
        say(format!(
            "limits: max_running 8 (3 daemons x 16 workers, 10 ms handlers), rate_limit 1000/s (3 daemons), and \
             what each costs a no-op drain; {} runs...",
            o.runs
        ));
        figures.extend(limits::limits(&bench)?);
    }
    if wants("groups") {
        say(format!(
            "groups: a no-op drain spread over {} groups against the same drain without groups; {} runs...",
            groups::GROUPS,
            o.runs
        ));
        figures.extend(groups::groups(&bench)?);
    }
    if wants("groups-scale") {
        say(format!(
            "groups-scale: a no-op drain over no groups, {} and {} groups, every group waiting; {} runs...",
            groups::GROUPS,
            groups::MANY_GROUPS,
            o.runs
        ));
        figures.extend(groups::scale(&bench)?);
    }
    if wants("groups-limit") {
        say(format!(
            "groups-limit: [queues.groups] max_running = 2 over 1000 groups, 3 daemons; {} runs...",
            o.runs
        ));
        figures.push(groups::limit(&bench)?);
    }
    if wants("groups-rate") {
        say(format!(
            "groups-rate: [queues.groups] rate_limit = \"5/s\" over 1000 groups and no limit, 3 daemons; {} runs...",
            o.runs
        ));
        figures.extend(groups::rate(&bench)?);
    }
    if wants("results") {
        say(format!(
            "results: a no-op safe drain returning a result, with keep_results and without, in turns; {} runs...",
            o.runs
        ));
        figures.extend(results::results(&bench)?);
    }
    if wants("fanin") {
        say(format!(
            "fanin: a flow of {} no-op tasks into one waiting task, pushed, then drained, against a plain drain, in \
             turns; {} runs...",
            o.tasks, o.runs
        ));
        figures.extend(fanin::fanin(&bench)?);
    }
    if wants("redis-cost") {
        say(format!(
            "redis-cost: Redis CPU per task of a claim and its settle, today's scripts and the candidates, {} runs...",
            o.runs
        ));
        figures.extend(redis_cost::redis_cost(&bench)?);
    }
    Ok(Report {
        redis_version,
        host: format!("{host} ({cores} cores)"),
        tasks: o.tasks,
        runs: o.runs,
        workers: o.workers,
        batch: o.batch,
        prefetch: o.prefetch,
        figures,
        peers: peer_rows,
    })
}
