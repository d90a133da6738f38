//! `kmqd-bench`: measures kmqd against a private redis-server it starts itself, with the real binary as daemon
//! processes and the `testkit` plugin as a no-op handler (in the `handlers` scenario, one that sleeps or spins),
//! the way `../shared/bench/peers` measures the peers (enqueue first, then drain; drain rate = tasks left at the
//! first poll that saw progress / time to empty).
//!
//! Every figure is the median of `--runs` runs in this one session; docs/PERFORMANCE.md says how to read them.
//! This module is a measuring tool: it reports, it never asserts a speed.

mod defaults;
mod groups;
mod handlers;
mod languages;
mod latency;
mod limits;
pub mod peers;
mod redis_cost;
mod results;

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

pub const SCENARIOS: [&str; 17] = [
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
    "results",
];

/// How often the `kill` scenario disconnects every client of Redis (`CLIENT KILL TYPE normal`).
const KILL_EVERY: Duration = Duration::from_millis(100);

/// One reported figure.
#[derive(Clone, Debug, Serialize)]
pub struct Figure {
    pub scenario: String,
    pub name: String,
    pub unit: String,
    pub median: f64,
    pub runs: Vec<f64>,
    /// Extra figures measured in the same runs (medians), e.g. CPU per task.
    pub extra: Vec<(String, f64)>,
}

/// Everything one `kmqd-bench` measured.
#[derive(Debug, Serialize)]
pub struct Report {
    pub redis_version: String,
    pub host: String,
    pub tasks: usize,
    pub runs: usize,
    pub workers: usize,
    pub batch: usize,
    pub prefetch: usize,
    pub figures: Vec<Figure>,
    /// The peers' figures from the same session, when given.
    pub peers: Vec<peers::PeerRow>,
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The `p`-th percentile (0..=100) of `values`, nearest rank.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// CPU time (user + system) of a process and of every process under it (live, or ended and reaped), µs: a
/// daemon's includes the handler processes its exec plugin runs.
fn tree_cpu_us(pid: u32) -> u64 {
    let children: Vec<u32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| stat_field(*child, 1) == Some(u64::from(pid)))
        .collect();
    // Fields 13 and 14 after the name: the CPU of the children it reaped.
    let reaped = (stat_field(pid, 13).unwrap_or(0) + stat_field(pid, 14).unwrap_or(0)) * 10_000;
    cpu_us(pid) + reaped + children.into_iter().map(tree_cpu_us).sum::<u64>()
}

/// Field `index` of /proc/PID/stat, counted from the one after the command name (0: the state).
fn stat_field(pid: u32, index: usize) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name, which is in parentheses and may contain spaces.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(index)?.parse().ok()
}

/// CPU time (user + system) of a process, µs.
fn cpu_us(pid: u32) -> u64 {
    // Linux reports 100 ticks per second (USER_HZ) on every platform kmqd runs on.
    (stat_field(pid, 11).unwrap_or(0) + stat_field(pid, 12).unwrap_or(0)) * 10_000
}

/// Resident memory of a process, kB.
fn rss_kb(pid: u32) -> u64 {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return 0;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A queue's `workers`, `batch` and `prefetch` in the daemons' config; `None` leaves a key at the daemon's
/// default (the `handlers` scenario measures kmqd out of the box).
#[derive(Clone, Copy, Debug)]
struct Shape {
    workers: usize,
    batch: Option<usize>,
    prefetch: Option<usize>,
    /// More `[[queues]]` lines (a limit, say), as written.
    extra: &'static str,
}

impl Shape {
    /// `workers` handler threads, `batch` and `prefetch` at the daemon's defaults.
    fn out_of_the_box(workers: usize) -> Shape {
        Shape {
            workers,
            batch: None,
            prefetch: None,
            extra: "",
        }
    }

    /// The `[[queues]]` lines for these keys.
    fn keys(&self) -> String {
        let mut keys = format!("workers = {}\n", self.workers);
        if let Some(batch) = self.batch {
            let _ = writeln!(keys, "batch = {batch}");
        }
        if let Some(prefetch) = self.prefetch {
            let _ = writeln!(keys, "prefetch = {prefetch}");
        }
        // Last, so that `extra` may end with a table of the queue's (`[[queues.limits]]`).
        keys.push_str(self.extra);
        keys
    }
}

/// The bench's workspace: a redis-server, a plugins dir with testkit, configs.
struct Bench {
    options: Options,
    server: RedisServer,
    dir: tempfile::TempDir,
    /// Where the plugins were built (next to the kmqd binary, or `--plugins-dir`).
    source: PathBuf,
    kmqd: PathBuf,
}

/// A daemon process started by the bench.
struct Daemon {
    child: Child,
}

impl Daemon {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status, if the daemon has stopped.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGTERM, then wait (at most 30 s) for a graceful exit.
    fn stop(mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The daemon when `--daemon` names none: the `kmqd` binary beside this executable, where cargo builds both
/// (target/release/kmqd-bench runs target/release/kmqd). The bench is a binary of its own so that the daemon's
/// does not carry it; what it measures is always a real `kmqd` process.
pub fn default_daemon() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    let kmqd = exe.with_file_name("kmqd");
    if !kmqd.is_file() {
        return Err(format!(
            "{} not found: kmqd-bench runs the kmqd beside it; build both (cargo build --release --workspace) \
             or pass --daemon PATH",
            kmqd.display()
        ));
    }
    Ok(kmqd)
}

/// Copies plugin `name` from `source` into `into` (made if need be), with the permissions the daemon accepts (it
/// refuses plugins writable by others).
fn copy_plugin(source: &Path, name: &str, into: &Path) -> Result<(), String> {
    let from = source.join(name);
    if !from.is_file() {
        return Err(format!(
            "{} not found: build the workspace (cargo build --release --workspace) or pass --plugins-dir",
            from.display()
        ));
    }
    std::fs::create_dir_all(into).map_err(|e| format!("{}: {e}", into.display()))?;
    std::fs::copy(&from, into.join(name)).map_err(|e| format!("copy {name}: {e}"))?;
    for path in [into, &into.join(name)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

impl Bench {
    /// Copies plugin `name` from where the plugins were built into the directory `into`.
    fn copy_plugin(&self, name: &str, into: &Path) -> Result<(), String> {
        copy_plugin(&self.source, name, into)
    }

    fn new(options: Options) -> Result<Bench, String> {
        let kmqd = match &options.daemon {
            Some(path) if path.is_file() => path.clone(),
            Some(path) => return Err(format!("--daemon {}: no such file", path.display())),
            None => default_daemon()?,
        };
        let source = options
            .plugins_dir
            .clone()
            .or_else(|| kmqd.parent().map(Path::to_path_buf))
            .ok_or("cannot tell where the plugins are; pass --plugins-dir")?;
        let dir = tempfile::Builder::new()
            .prefix("kmqd-bench-")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        copy_plugin(&source, "libkmq_testkit.so", &dir.path().join("plugins"))?;
        let server = RedisServer::start(Listen::Loopback)?;
        Ok(Bench {
            options,
            server,
            dir,
            source,
            kmqd,
        })
    }

    fn redis(&self) -> Result<redis::Connection, String> {
        self.server.connection().map_err(|e| format!("redis: {e}"))
    }

    fn flush(&self) -> Result<(), String> {
        redis::cmd("FLUSHALL")
            .exec(&mut self.redis()?)
            .map_err(|e| format!("FLUSHALL: {e}"))
    }

    /// The bench's own Redis, as a drain target.
    fn own(&self) -> Target<'_> {
        Target {
            label: None,
            section: format!("url = \"{}\"", self.server.url()),
            masters: vec![&self.server],
            holder: &self.server,
        }
    }

    /// The queue shape of the bench's flags (`--workers`, `--batch`, `--prefetch`).
    fn shape(&self) -> Shape {
        Shape {
            workers: self.options.workers,
            batch: Some(self.options.batch),
            prefetch: Some(self.options.prefetch),
            extra: "",
        }
    }

    /// Writes a config for one queue `q` in `mode` on the bench's own Redis, shaped by the bench's flags;
    /// `record` makes the testkit write a line per run.
    fn config(&self, name: &str, mode: &str, record: Option<&Path>) -> Result<PathBuf, String> {
        self.config_on(&self.own().section, name, mode, record, self.shape())
    }

    /// As [`Bench::config`], with the `[redis]` keys and the queue's shape given.
    fn config_on(
        &self,
        redis: &str,
        name: &str,
        mode: &str,
        record: Option<&Path>,
        shape: Shape,
    ) -> Result<PathBuf, String> {
        let record = record.map_or(String::new(), |path| {
            format!("config = {{ record = \"{}\" }}", path.display())
        });
        self.write_config(redis, name, mode, &record, shape)
    }

    /// As [`Bench::config_on`] with a record file whose `end` lines carry the end time too (the testkit's
    /// `end_times`): only the scenarios that read the times ask for them, since a testkit built before that key
    /// refuses it (`--daemon` runs the plugins beside an older build).
    fn config_timed(
        &self,
        redis: &str,
        name: &str,
        mode: &str,
        record: &Path,
        shape: Shape,
    ) -> Result<PathBuf, String> {
        let record = format!(
            "config = {{ record = \"{}\", end_times = true }}",
            record.display()
        );
        self.write_config(redis, name, mode, &record, shape)
    }

    /// Writes the config `name`, with `record`, the testkit's config line (empty: none).
    fn write_config(
        &self,
        redis: &str,
        name: &str,
        mode: &str,
        record: &str,
        shape: Shape,
    ) -> Result<PathBuf, String> {
        let text = format!(
            "[redis]\n{redis}\n\n[daemon]\nplugins_dir = \"{plugins}\"\nshutdown_grace = \"5s\"\nlog_level = \"warn\"\n\n\
             [[queues]]\nname = \"q\"\nmode = \"{mode}\"\nlease_timeout = \"30s\"\n{shape}\
             \n[plugins.testkit]\nfile = \"libkmq_testkit.so\"\n{record}\n",
            plugins = self.dir.path().join("plugins").display(),
            shape = shape.keys(),
        );
        let path = self.dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, text).map_err(|e| e.to_string())?;
        Ok(path)
    }

    fn client(&self, config: &Path) -> Result<Client, String> {
        let config = Config::load(config).map_err(|e| e.to_string())?;
        Client::new(&config).map_err(|e| e.to_string())
    }

    /// Where the daemons' standard error goes (kept with the bench's temp dir until it ends).
    fn log(&self) -> PathBuf {
        self.dir.path().join("daemon.log")
    }

    fn daemon(&self, config: &Path) -> Result<Daemon, String> {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.log())
            .map_err(|e| e.to_string())?;
        let child = Command::new(&self.kmqd)
            .arg("--config")
            .arg(config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("start kmqd: {e}"))?;
        Ok(Daemon { child })
    }

    /// Pushes `n` no-op tasks (data `1`) with the library, in batches.
    fn fill(&self, client: &Client, n: usize) -> Result<(), String> {
        self.fill_with(client, n, "1")
    }

    /// Pushes `n` tasks with `data` (JSON: the testkit's behaviour) with the library, in batches.
    fn fill_with(&self, client: &Client, n: usize, data: &str) -> Result<(), String> {
        let data = kmqd::task::data_from_str(data).map_err(|e| format!("{data}: {e}"))?;
        let mut left = n;
        while left > 0 {
            let chunk = left.min(10_000);
            let tasks = (0..chunk).map(|_| NewTask::with_data("test", data.clone()));
            client.push_batch("q", tasks).map_err(|e| e.to_string())?;
            left -= chunk;
        }
        Ok(())
    }
}

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
    if wants("results") {
        say(format!(
            "results: a no-op safe drain returning a result, with keep_results and without, in turns; {} runs...",
            o.runs
        ));
        figures.extend(results::results(&bench)?);
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

fn figure(
    scenario: &str,
    name: impl Into<String>,
    unit: &str,
    runs: Vec<f64>,
    extra: Vec<(String, Vec<f64>)>,
) -> Figure {
    Figure {
        scenario: scenario.to_string(),
        name: name.into(),
        unit: unit.to_string(),
        median: median(&runs),
        runs,
        extra: extra
            .into_iter()
            .map(|(name, values)| (name, median(&values)))
            .collect(),
    }
}

/// What `runs` drains measured, each made by `drain`: the drain scenarios' figure (the drain, and what a config
/// costs a drain: limits, groups).
struct Drains {
    rates: Vec<f64>,
    daemon_cpu: Vec<f64>,
    redis_cpu: Vec<f64>,
    rss_mb: Vec<f64>,
}

impl Drains {
    fn run(
        runs: usize,
        mut drain: impl FnMut() -> Result<DrainRun, String>,
    ) -> Result<Drains, String> {
        let mut drains = Drains {
            rates: Vec::new(),
            daemon_cpu: Vec::new(),
            redis_cpu: Vec::new(),
            rss_mb: Vec::new(),
        };
        for _ in 0..runs {
            let run = drain()?;
            drains.rates.push(run.rate);
            drains.daemon_cpu.push(run.daemon_cpu);
            drains.redis_cpu.push(run.redis_cpu);
            drains.rss_mb.push(run.rss_mb);
        }
        Ok(drains)
    }

    /// The drains `runs` measured (run in turns with another config's, as the results scenario does).
    fn of(runs: &[DrainRun]) -> Drains {
        Drains {
            rates: runs.iter().map(|run| run.rate).collect(),
            daemon_cpu: runs.iter().map(|run| run.daemon_cpu).collect(),
            redis_cpu: runs.iter().map(|run| run.redis_cpu).collect(),
            rss_mb: runs.iter().map(|run| run.rss_mb).collect(),
        }
    }

    /// The rates, with the daemon's and Redis's CPU a task, and with `rss` the daemons' peak RSS.
    fn figure(self, scenario: &str, name: String, rss: bool) -> Figure {
        let mut extra = vec![
            ("daemon CPU µs/task".into(), self.daemon_cpu),
            ("redis CPU µs/task".into(), self.redis_cpu),
        ];
        if rss {
            extra.push(("peak daemon RSS MB".into(), self.rss_mb));
        }
        figure(scenario, name, "tasks/s", self.rates, extra)
    }
}

fn push_rates(bench: &Bench) -> Result<Vec<Figure>, String> {
    let config = bench.config("push", "safe", None)?;
    let client = bench.client(&config)?;
    let n = bench.options.tasks;
    let single_n = n.min(20_000);
    let (mut single, mut stdin, mut batch) = (Vec::new(), Vec::new(), Vec::new());
    let one = kmqd::task::data_from_str("1").expect("1 is JSON");
    for _ in 0..bench.options.runs {
        bench.flush()?;
        let start = Instant::now();
        for _ in 0..single_n {
            client
                .push("q", NewTask::with_data("test", one.clone()))
                .map_err(|e| e.to_string())?;
        }
        single.push(single_n as f64 / start.elapsed().as_secs_f64());

        bench.flush()?;
        let start = Instant::now();
        bench.fill(&client, n)?;
        batch.push(n as f64 / start.elapsed().as_secs_f64());

        bench.flush()?;
        let lines = "1\n".repeat(n);
        let start = Instant::now();
        let mut child = Command::new(&bench.kmqd)
            .arg("--config")
            .arg(&config)
            .args(["push", "q", "test", "--stdin"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(lines.as_bytes())
            .map_err(|e| e.to_string())?;
        let status = child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("kmqd push --stdin failed: {status}"));
        }
        stdin.push(n as f64 / start.elapsed().as_secs_f64());
    }
    Ok(vec![
        figure(
            "push",
            "Client::push, one task per round trip",
            "tasks/s",
            single,
            vec![],
        ),
        figure(
            "push",
            format!("kmqd push --stdin ({n} lines, process start included)"),
            "tasks/s",
            stdin,
            vec![],
        ),
        figure("push", "Client::push_batch", "tasks/s", batch, vec![]),
    ])
}

/// How often a drain looks how many tasks are left: as the peers' driver (`POLL_S` in
/// ../shared/bench/peers/driver.py).
const DRAIN_POLL: Duration = Duration::from_millis(10);

/// What a drain reads to see how many tasks are left: the queue's counters of pushed, done and dead-lettered
/// tasks, one `HMGET` on a connection of its own (made again after a failure, three tries, as the `kill`
/// scenario disconnects it). `Client::stats` (a dozen commands in three round trips) polled every 5 ms took a
/// share of the two cores from the daemon and the Redis it measured: in the spin scenario, about 2 points of its
/// limit (docs/PERFORMANCE.md, "The drain's poll").
struct Progress<'a> {
    server: &'a RedisServer,
    connection: Option<redis::Connection>,
    stats_key: String,
}

impl<'a> Progress<'a> {
    fn new(config: &Path, server: &'a RedisServer) -> Result<Progress<'a>, String> {
        let config = Config::load(config).map_err(|e| e.to_string())?;
        let queue = config
            .queues
            .iter()
            .find(|queue| queue.name == "q")
            .ok_or("the bench's queue is q")?;
        let keys = kmqd::broker::QueueKeys::for_queue(&config.redis.key_prefix, queue);
        Ok(Progress {
            server,
            connection: None,
            stats_key: keys.stats,
        })
    }

    /// Tasks pushed and not yet done or dead-lettered.
    fn left(&mut self) -> Result<u64, String> {
        let mut tries = 0;
        loop {
            tries += 1;
            match self.read() {
                Ok(left) => return Ok(left),
                Err(error) if tries == 3 => return Err(format!("redis: {error}")),
                Err(_) => self.connection = None,
            }
        }
    }

    fn read(&mut self) -> redis::RedisResult<u64> {
        let connection = match &mut self.connection {
            Some(connection) => connection,
            None => self.connection.insert(self.server.connection()?),
        };
        let (pushed, done, dead): (Option<u64>, Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(&self.stats_key)
            .arg("pushed")
            .arg("done")
            .arg("dead_lettered")
            .query(connection)?;
        let (pushed, done, dead) = (pushed.unwrap_or(0), done.unwrap_or(0), dead.unwrap_or(0));
        Ok(pushed.saturating_sub(done + dead))
    }
}

fn drain(bench: &Bench, mode: &str, daemons: usize) -> Result<Figure, String> {
    drain_with(bench, &bench.own(), mode, daemons, None)
}

/// Where a drain runs: the bench's own Redis, or a deployment the `deployments` scenario started.
struct Target<'a> {
    /// What the figure calls it (`None`: the bench's own Redis, in the `drain` and `kill` scenarios).
    label: Option<String>,
    /// The `[redis]` keys of the daemons' config.
    section: String,
    /// Every master, flushed before each run.
    masters: Vec<&'a RedisServer>,
    /// The master that holds the queue: its CPU is Redis's.
    holder: &'a RedisServer,
}

impl Target<'_> {
    fn flush(&self) -> Result<(), String> {
        for master in &self.masters {
            let mut connection = master.connection().map_err(|e| format!("redis: {e}"))?;
            redis::cmd("FLUSHALL")
                .exec(&mut connection)
                .map_err(|e| format!("FLUSHALL: {e}"))?;
        }
        Ok(())
    }
}

/// What one drain measured.
struct DrainRun {
    /// Tasks left at the first poll that saw progress ÷ the time from that poll until none was left.
    rate: f64,
    /// Daemon and Redis CPU over that window, µs per task.
    daemon_cpu: f64,
    redis_cpu: f64,
    /// Peak RSS of all the daemons, MB.
    rss_mb: f64,
}

/// One drain of `tasks.0` tasks with data `tasks.1` by `daemons` daemons started with `config`, once they are all
/// pushed; with `kill_every`, every client of Redis is disconnected that often meanwhile.
fn drain_once(
    bench: &Bench,
    target: &Target<'_>,
    config: &Path,
    daemons: usize,
    (n, data): (usize, &str),
    kill_every: Option<Duration>,
) -> Result<DrainRun, String> {
    let fill = |client: &Client| bench.fill_with(client, n, data);
    drain_filled(bench, target, config, daemons, (n, &fill), kill_every)
}

/// Pushes a drain's tasks into the bench's queue.
type Fill<'a> = &'a dyn Fn(&Client) -> Result<(), String>;

/// [`drain_once`] of the `n` tasks that `fill` pushes (after the flush, before the daemons start).
fn drain_filled(
    bench: &Bench,
    target: &Target<'_>,
    config: &Path,
    daemons: usize,
    (n, fill): (usize, Fill<'_>),
    kill_every: Option<Duration>,
) -> Result<DrainRun, String> {
    let client = bench.client(config)?;
    target.flush()?;
    fill(&client)?;
    let mut progress = Progress::new(config, target.holder)?;
    let mut processes: Vec<Daemon> = (0..daemons)
        .map(|_| bench.daemon(config))
        .collect::<Result<_, _>>()?;
    let pids: Vec<u32> = processes.iter().map(Daemon::pid).collect();
    let cpu = |pids: &[u32]| pids.iter().map(|pid| tree_cpu_us(*pid)).sum::<u64>();
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut first: Option<(Instant, u64, u64, u64)> = None;
    let mut peak_rss = 0;
    let mut killer = target
        .holder
        .connection()
        .map_err(|e| format!("redis: {e}"))?;
    let mut last_kill = Instant::now();
    let end = loop {
        if let Some(every) = kill_every {
            if last_kill.elapsed() >= every {
                last_kill = Instant::now();
                let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                    .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"][..])
                    .query(&mut killer);
            }
        }
        let left = progress.left()?;
        peak_rss = peak_rss.max(pids.iter().map(|pid| rss_kb(*pid)).sum::<u64>());
        if first.is_none() && left < n as u64 {
            first = Some((
                Instant::now(),
                left,
                cpu(&pids),
                cpu_us(target.holder.pid()),
            ));
        }
        if left == 0 {
            break (Instant::now(), cpu(&pids), cpu_us(target.holder.pid()));
        }
        if Instant::now() > deadline {
            return Err(format!("drain did not finish within 300 s ({left} left)"));
        }
        if let Some(status) = processes.iter_mut().find_map(Daemon::exited) {
            return Err(format!(
                "a daemon exited ({status}) with {left} tasks left; its log: {}",
                bench.log().display()
            ));
        }
        std::thread::sleep(DRAIN_POLL);
    };
    for daemon in processes {
        daemon.stop();
    }
    let (t0, left0, daemon0, redis0) = first.expect("progress was seen before the end");
    let seconds = end.0.duration_since(t0).as_secs_f64().max(1e-6);
    Ok(DrainRun {
        rate: left0 as f64 / seconds,
        daemon_cpu: (end.1 - daemon0) as f64 / left0 as f64,
        redis_cpu: (end.2 - redis0) as f64 / left0 as f64,
        rss_mb: peak_rss as f64 / 1024.0,
    })
}

/// A drain; with `kill_every`, every client of Redis is disconnected that often meanwhile, which a daemon must
/// take as a blip (reconnect at once), not as an outage.
fn drain_with(
    bench: &Bench,
    target: &Target<'_>,
    mode: &str,
    daemons: usize,
    kill_every: Option<Duration>,
) -> Result<Figure, String> {
    let config = bench.config_on(
        &target.section,
        &format!("drain-{mode}"),
        mode,
        None,
        bench.shape(),
    )?;
    let drains = Drains::run(bench.options.runs, || {
        drain_once(
            bench,
            target,
            &config,
            daemons,
            (bench.options.tasks, "1"),
            kill_every,
        )
    })?;
    let name = match (&target.label, kill_every) {
        (_, Some(every)) => {
            format!("{mode} mode, {daemons} daemon(s), CLIENT KILL every {every:?}")
        }
        (Some(label), None) => format!("{label}: {mode} mode, {daemons} daemon(s)"),
        (None, None) => format!("{mode} mode, {daemons} daemon(s)"),
    };
    let scenario = match (&target.label, kill_every) {
        (_, Some(_)) => "kill",
        (Some(_), None) => "deployments",
        (None, None) => "drain",
    };
    Ok(drains.figure(scenario, name, true))
}

/// Reads the testkit record file from `offset` on; returns start times (µs) by task id and the new offset.
fn read_starts(path: &Path, offset: u64, starts: &mut HashMap<String, u64>) -> Result<u64, String> {
    let Ok(mut file) = std::fs::File::open(path) else {
        return Ok(offset);
    };
    file.seek(SeekFrom::Start(offset))
        .map_err(|e| e.to_string())?;
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(|e| e.to_string())?;
    // Only whole lines: a line being written is read next time.
    let complete = text.rfind('\n').map_or(0, |i| i + 1);
    for line in text[..complete].lines() {
        let mut parts = line.split(' ');
        if parts.next() == Some("start") {
            if let (Some(id), Some(time)) = (parts.next(), parts.nth(2)) {
                starts.insert(id.to_string(), time.parse().unwrap_or(0));
            }
        }
    }
    Ok(offset + complete as u64)
}

/// Waits until a fetcher of the daemon blocks in Redis (it has gone idle).
fn wait_idle(bench: &Bench, mode: &str) -> Result<(), String> {
    // Safe mode blocks on the wake-up list; default mode on its one ready list (BLMOVE; builds before
    // 2026-12 used BLMPOP, which `--daemon` may still run).
    let commands: &[&str] = if mode == "safe" {
        &["cmd=blpop"]
    } else {
        &["cmd=blmove", "cmd=blmpop"]
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut connection = bench.redis()?;
    loop {
        let clients: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query(&mut connection)
            .map_err(|e| e.to_string())?;
        if commands.iter().any(|command| clients.contains(command)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("the daemon's fetcher never went idle".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn wake_up(bench: &Bench, mode: &str) -> Result<Figure, String> {
    let (client, daemon, mut starts) = recorded_daemon(bench, &format!("wakeup-{mode}"), mode)?;
    let (mut p50, mut p99) = (Vec::new(), Vec::new());
    for run in 0..bench.options.runs {
        let latencies = idle_samples(bench, mode, &client, &mut starts, &format!("w{run}"), 200)?;
        p50.push(percentile(&latencies, 50.0));
        p99.push(percentile(&latencies, 99.0));
    }
    daemon.stop();
    Ok(figure(
        "wakeup",
        format!("{mode} mode, idle daemon: push to handler start, p50"),
        "µs",
        p50,
        vec![("p99 µs".into(), p99)],
    ))
}

/// A daemon of `mode` for the queue `q`, on an empty Redis, whose testkit records every start (config and record
/// file named `name`): its client, the daemon, and its starts, read as they come.
fn recorded_daemon(
    bench: &Bench,
    name: &str,
    mode: &str,
) -> Result<(Client, Daemon, Starts), String> {
    let record = bench.dir.path().join(format!("{name}.log"));
    let _ = std::fs::remove_file(&record);
    let config = bench.config(name, mode, Some(&record))?;
    let client = bench.client(&config)?;
    bench.flush()?;
    let daemon = bench.daemon(&config)?;
    Ok((client, daemon, Starts::new(record)))
}

/// The start times the testkit recorded so far, read on as its record file grows.
struct Starts {
    record: PathBuf,
    offset: u64,
    by_id: HashMap<String, u64>,
}

impl Starts {
    fn new(record: PathBuf) -> Starts {
        Starts {
            record,
            offset: 0,
            by_id: HashMap::new(),
        }
    }

    /// When the task `id` started (µs since the epoch), waiting up to 10 s for it.
    fn wait_for(&mut self, id: &str) -> Result<u64, String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            self.offset = read_starts(&self.record, self.offset, &mut self.by_id)?;
            if let Some(started) = self.by_id.get(id) {
                return Ok(*started);
            }
            if Instant::now() > deadline {
                return Err(format!("task {id} did not start within 10 s"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// `count` tasks pushed one at a time to the idle daemon of `client`'s queue (each once its fetcher blocks in
/// Redis again), ids `prefix-N`: each one's time from just before its push to its handler's start, µs.
fn idle_samples(
    bench: &Bench,
    mode: &str,
    client: &Client,
    starts: &mut Starts,
    prefix: &str,
    count: usize,
) -> Result<Vec<f64>, String> {
    let mut latencies = Vec::with_capacity(count);
    for sample in 0..count {
        wait_idle(bench, mode)?;
        let id = format!("{prefix}-{sample}");
        let pushed = now_us();
        client
            .push(
                "q",
                NewTask::new("test", "{}")
                    .map_err(|e| e.to_string())?
                    .id(&id),
            )
            .map_err(|e| e.to_string())?;
        let started = starts.wait_for(&id)?;
        latencies.push(started.saturating_sub(pushed) as f64);
    }
    Ok(latencies)
}

fn lateness(bench: &Bench) -> Result<Figure, String> {
    const RATE: u64 = 10_000;
    const SECONDS: u64 = 3;
    let record = bench.dir.path().join("lateness.log");
    let (mut p50, mut p99) = (Vec::new(), Vec::new());
    for run in 0..bench.options.runs {
        let _ = std::fs::remove_file(&record);
        let config = bench.config("lateness", "safe", Some(&record))?;
        let client = bench.client(&config)?;
        bench.flush()?;
        let daemon = bench.daemon(&config)?;
        wait_idle(bench, "safe")?;
        let now_ms = broker::redis_now(&mut bench.redis()?).map_err(|e| e.to_string())?;
        // Due times start two seconds ahead, so that the push is over before the first one is due.
        let base_ms = now_ms + 2000;
        let total = RATE * SECONDS;
        let mut due_by_id = HashMap::with_capacity(total as usize);
        let tasks: Vec<NewTask> = (0..total)
            .map(|i| {
                let due = base_ms + (i * 1000 / RATE) as i64;
                let id = format!("l{run}-{i}");
                due_by_id.insert(id.clone(), due);
                NewTask::with_data("test", kmqd::task::data_from_str("{}").expect("JSON"))
                    .id(id)
                    .at(due)
            })
            .collect();
        client.push_batch("q", tasks).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while client.stats("q").map_err(|e| e.to_string())?.done < total {
            if Instant::now() > deadline {
                return Err("the delayed tasks did not all run within 60 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        daemon.stop();
        let mut starts = HashMap::new();
        read_starts(&record, 0, &mut starts)?;
        let late: Vec<f64> = starts
            .iter()
            .filter_map(|(id, started)| Some(*started as f64 / 1000.0 - *due_by_id.get(id)? as f64))
            .collect();
        p50.push(percentile(&late, 50.0));
        p99.push(percentile(&late, 99.0));
    }
    Ok(figure(
        "lateness",
        "delayed tasks, 10,000 due per second for 3 s: handler start minus due time, p50",
        "ms",
        p50,
        vec![("p99 ms".into(), p99)],
    ))
}

fn memory(bench: &Bench) -> Result<Vec<Figure>, String> {
    let config = bench.config("memory", "safe", None)?;
    let client = bench.client(&config)?;
    let mut figures = Vec::new();

    bench.flush()?;
    let daemon = bench.daemon(&config)?;
    wait_idle(bench, "safe")?;
    std::thread::sleep(Duration::from_millis(500));
    let idle = rss_kb(daemon.pid()) as f64 / 1024.0;
    daemon.stop();
    figures.push(figure(
        "memory",
        "daemon RSS, idle (one queue)",
        "MB",
        vec![idle],
        vec![],
    ));

    // Redis memory per queued task with 100 bytes of data.
    bench.flush()?;
    let used = |bench: &Bench| -> Result<f64, String> {
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query(&mut bench.redis()?)
            .map_err(|e| e.to_string())?;
        Ok(info
            .lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0))
    };
    let before = used(bench)?;
    let data = format!("{{\"payload\":\"{}\"}}", "x".repeat(100 - 14));
    let n = 100_000;
    let data = kmqd::task::data_from_str(&data).expect("JSON");
    for _ in 0..n / 10_000 {
        client
            .push_batch(
                "q",
                (0..10_000).map(|_| NewTask::with_data("test", data.clone())),
            )
            .map_err(|e| e.to_string())?;
    }
    let per_task = (used(bench)? - before) / n as f64;
    figures.push(figure(
        "memory",
        "redis memory per queued task with 100 bytes of data",
        "bytes",
        vec![per_task],
        vec![],
    ));

    // Daemon RSS while it drains a large backlog.
    bench.flush()?;
    bench.fill(&client, bench.options.backlog)?;
    let daemon = bench.daemon(&config)?;
    let mut progress = Progress::new(&config, &bench.server)?;
    let mut peak = 0;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        peak = peak.max(rss_kb(daemon.pid()));
        let left = progress.left()?;
        if left == 0 || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    daemon.stop();
    figures.push(figure(
        "memory",
        format!(
            "daemon peak RSS draining a backlog of {}",
            bench.options.backlog
        ),
        "MB",
        vec![peak as f64 / 1024.0],
        vec![],
    ));
    Ok(figures)
}

/// The report as a text table.
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "kmqd-bench: redis-server {} on 127.0.0.1, {}; {} tasks per drain run; workers {}, batch {}, prefetch {}; \
         median of {} run(s)\n",
        report.redis_version,
        report.host,
        report.tasks,
        report.workers,
        report.batch,
        report.prefetch,
        report.runs
    );
    let _ = writeln!(
        out,
        "| scenario | what | median | runs | also measured (medians) |\n|---|---|---:|---|---|"
    );
    for f in &report.figures {
        let fmt = |v: f64| {
            if v >= 100.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.2}")
            }
        };
        let runs: Vec<String> = f.runs.iter().map(|v| fmt(*v)).collect();
        let extra: Vec<String> = f
            .extra
            .iter()
            .map(|(name, v)| format!("{name}: {}", fmt(*v)))
            .collect();
        let _ = writeln!(
            out,
            "| {} | {} | **{} {}** | {} | {} |",
            f.scenario,
            f.name,
            fmt(f.median),
            f.unit,
            runs.join(" / "),
            extra.join(", ")
        );
    }
    if !report.peers.is_empty() {
        out.push_str(&peers::render(&report.figures, &report.peers));
    }
    out
}

/// The same drain (1 daemon, safe and default mode) and single pushes on the bench's own Redis, then with a
/// replica attached (`wait_replicas` 0 and 1: what replication and `WAIT` cost per task), then on a Redis Cluster
/// of three masters (what the cluster client costs), in one session.
fn deployments(bench: &Bench) -> Result<Vec<Figure>, String> {
    let mut figures = Vec::new();
    let own = bench.own();
    let labelled = |label: &str, section: String| Target {
        label: Some(label.to_string()),
        section,
        masters: vec![&bench.server],
        holder: &bench.server,
    };
    let single = labelled("one Redis", own.section.clone());
    for mode in ["safe", "default"] {
        figures.push(drain_with(bench, &single, mode, 1, None)?);
    }
    figures.push(single_pushes(bench, &single)?);

    let port = bench
        .server
        .port()
        .ok_or("the bench's Redis listens on TCP")?
        .to_string();
    let mut options = kmqd_harness::Options::new(Listen::Loopback);
    options.extra_args = ["--replicaof", "127.0.0.1", port.as_str()]
        .map(String::from)
        .to_vec();
    let replica = RedisServer::start_with(options)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !replica
        .query_as::<String>(&["INFO", "replication"])?
        .contains("master_link_status:up")
    {
        if Instant::now() > deadline {
            return Err("the replica did not sync within 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for wait in [0, 1] {
        let target = labelled(
            &format!("one Redis + 1 replica, wait_replicas = {wait}"),
            format!(
                "{}\nwait_replicas = {wait}\nwait_timeout = \"1s\"",
                own.section
            ),
        );
        for mode in ["safe", "default"] {
            figures.push(drain_with(bench, &target, mode, 1, None)?);
        }
        figures.push(single_pushes(bench, &target)?);
    }
    drop(replica);

    let cluster = kmqd_harness::cluster::Cluster::start(kmqd_harness::cluster::ClusterOptions {
        replicas_per_master: 0,
        ..Default::default()
    })?;
    let seeds: Vec<String> = cluster
        .seeds()?
        .iter()
        .map(|seed| format!("\"{seed}\""))
        .collect();
    let holder = cluster.master_for_key("{q}")?;
    let target = Target {
        label: Some("Redis Cluster, 3 masters".to_string()),
        section: format!("cluster = [{}]", seeds.join(", ")),
        masters: cluster
            .masters()?
            .iter()
            .filter_map(|node| cluster.server(&node.addr))
            .collect(),
        holder: cluster
            .server(&holder.addr)
            .ok_or("the queue's master is ours")?,
    };
    for mode in ["safe", "default"] {
        figures.push(drain_with(bench, &target, mode, 1, None)?);
    }
    figures.push(single_pushes(bench, &target)?);
    Ok(figures)
}

/// `Client::push`, one task per round trip (5,000 of them), on `target`.
fn single_pushes(bench: &Bench, target: &Target<'_>) -> Result<Figure, String> {
    let config = bench.config_on(
        &target.section,
        "single-pushes",
        "safe",
        None,
        bench.shape(),
    )?;
    let client = bench.client(&config)?;
    let one = kmqd::task::data_from_str("1").expect("1 is JSON");
    let mut rates = Vec::new();
    for _ in 0..bench.options.runs {
        target.flush()?;
        let start = Instant::now();
        for _ in 0..5_000 {
            client
                .push("q", NewTask::with_data("test", one.clone()))
                .map_err(|e| e.to_string())?;
        }
        rates.push(5_000.0 / start.elapsed().as_secs_f64());
    }
    Ok(figure(
        "deployments",
        format!(
            "{}: Client::push, one task per round trip",
            target.label.as_deref().unwrap_or("one Redis")
        ),
        "tasks/s",
        rates,
        vec![],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_leaves_unset_keys_to_the_daemon() {
        assert_eq!(Shape::out_of_the_box(64).keys(), "workers = 64\n");
        let flags = Shape {
            workers: 4,
            batch: Some(1000),
            prefetch: Some(4000),
            extra: "",
        };
        assert_eq!(flags.keys(), "workers = 4\nbatch = 1000\nprefetch = 4000\n");
    }

    #[test]
    fn percentiles_and_medians() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(
            (
                percentile(&values, 50.0),
                percentile(&values, 99.0),
                percentile(&values, 100.0)
            ),
            (50.0, 99.0, 100.0)
        );
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
