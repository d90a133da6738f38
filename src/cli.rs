//! The `kmqd` command line: `kmqd --config FILE [run|check-config|push|stats|task]`.
//!
//! Exit codes, everywhere: 0 success, 1 runtime error (Redis unreachable, a thread died), 2 usage or config
//! error (including a refused plugin, wrong credentials and missing ACL rules), 3 a push refused because its unique id is live, 4 a task id not found
//! where `task show` or `task cancel` needs it.

use std::fmt;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use crate::broker::access::Action;
use crate::broker::{Due, Found, QueueStats};
use crate::client::{Client, ClientError, NewTask, PUSH_CHUNK, Pushed};
use crate::config::Config;
use crate::plugin::Registry;
use crate::task;

#[derive(Parser, Debug)]
#[command(
    name = "kmqd",
    version,
    about = "A task-queue worker daemon: Redis queues, handlers in plugins"
)]
pub struct Args {
    /// The TOML config file.
    #[arg(long, short = 'c', env = "KMQD_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the daemon in the foreground (the default).
    Run,
    /// Validate the config and load the plugins without consuming anything.
    CheckConfig,
    /// Enqueue a task (or, with --stdin, one task per input line).
    Push(PushArgs),
    /// Show each queue's depth and counters.
    Stats {
        /// Print JSON: {"queues": {"NAME": {"ready": 0, ...}}}.
        #[arg(long)]
        json: bool,
    },
    /// Find or cancel tasks by id.
    #[command(subcommand)]
    Task(TaskCommand),
    /// Measure kmqd against a private redis-server (needs no config): push rates, drain rates in both modes with
    /// 1, 2 and 4 daemons, idle wake-up latency, delayed-task lateness, memory. See docs/PERFORMANCE.md.
    Bench(BenchArgs),
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Tasks per drain run.
    #[arg(long, default_value_t = 200_000)]
    pub tasks: usize,
    /// Runs per figure; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Daemon process counts for the drain runs.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub daemons: Vec<usize>,
    /// Only these scenarios.
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(crate::bench::SCENARIOS))]
    pub only: Vec<String>,
    /// Handler threads per daemon.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Claim batch.
    #[arg(long, default_value_t = 1000)]
    pub batch: usize,
    /// Claimed tasks that may wait for a worker, per daemon (a deep prefetch keeps a no-op drain busy; see
    /// docs/PERFORMANCE.md).
    #[arg(long, default_value_t = 4000)]
    pub prefetch: usize,
    /// Where libkmq_testkit.so is (default: next to the kmqd binary).
    #[arg(long)]
    pub plugins_dir: Option<PathBuf>,
    /// The backlog whose drain the peak-RSS figure measures.
    #[arg(long, default_value_t = 1_000_000)]
    pub backlog: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Compare with the peers: a results directory of ../shared/bench/peers/run.sh from this session (see
    /// scripts/bench-peers).
    #[arg(long, value_name = "RESULTS_DIR")]
    pub peers: Option<PathBuf>,
    /// Run this kmqd binary as the daemon (default: this one): two builds measured in one session.
    #[arg(long, value_name = "KMQD")]
    pub daemon: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum TaskCommand {
    /// Show where a task is: delayed (and when it is due), retrying, ready (and its place in line), processing, or
    /// dead (and why). Exit 4 when it is nowhere (done tasks are not kept).
    Show {
        queue: String,
        id: String,
        /// Print JSON: a list of {"state": ..., ...}.
        #[arg(long)]
        json: bool,
    },
    /// Cancel waiting tasks (delayed, retrying or ready); a running task cannot be cancelled. Exit 4 when an id
    /// was not waiting.
    Cancel {
        queue: String,
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

#[derive(clap::Args, Debug)]
pub struct PushArgs {
    /// The queue, as named in the config.
    pub queue: String,
    /// The task type, which selects the handler.
    #[arg(value_name = "TYPE")]
    pub kind: String,
    /// The task's data as JSON (default: null).
    #[arg(value_name = "DATA_JSON", conflicts_with = "stdin")]
    pub data: Option<String>,
    /// The task id (default: a random UUID).
    #[arg(long, conflicts_with = "stdin")]
    pub id: Option<String>,
    /// Read one task per line from standard input, each line the task's data as JSON; pushed in batches.
    #[arg(long)]
    pub stdin: bool,
    /// A priority level of the queue (default: the queue's default_priority).
    #[arg(long)]
    pub priority: Option<String>,
    /// Refuse the push (exit 3) while a task with this --id is delayed, ready or processing.
    #[arg(long, requires = "id")]
    pub unique: bool,
    /// Make the task ready after this long, on Redis's clock ("30s", "5m").
    #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "at")]
    pub delay: Option<Duration>,
    /// Make the task ready at this time (RFC 3339, e.g. 2026-12-01T08:00:00Z).
    #[arg(long, value_parser = parse_time)]
    pub at: Option<i64>,
}

fn parse_time(text: &str) -> Result<i64, String> {
    let time = humantime::parse_rfc3339_weak(text)
        .map_err(|error| format!("{error}; write e.g. 2026-12-01T08:00:00Z"))?;
    let since_epoch = time
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| "time before 1970".to_string())?;
    Ok(since_epoch.as_millis() as i64)
}

/// A command that did not succeed, with the exit code it maps to.
#[derive(Debug)]
pub enum Failure {
    /// Bad usage or config: exit 2.
    Usage(String),
    /// Redis, threads, I/O: exit 1.
    Runtime(String),
    /// A unique push refused: exit 3.
    Refused(String),
    /// A task id that is not where the command needs it: exit 4.
    NotFound(String),
}

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Runtime(_) => 1,
            Failure::Usage(_) => 2,
            Failure::Refused(_) => 3,
            Failure::NotFound(_) => 4,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Usage(message)
            | Failure::Runtime(message)
            | Failure::Refused(message)
            | Failure::NotFound(message) => f.write_str(message),
        }
    }
}

impl From<ClientError> for Failure {
    fn from(error: ClientError) -> Failure {
        match error {
            // Wrong credentials, missing ACL rules: the setup's to fix, as a config error is.
            ClientError::Broker(error) if error.is_config_error() => {
                Failure::Usage(error.to_string())
            }
            ClientError::Broker(error) => match crate::broker::tls_refusal(&error) {
                // The certificates' or the config's to fix: retrying would not help.
                Some(refusal) => Failure::Usage(refusal),
                None => Failure::Runtime(error.to_string()),
            },
            other => Failure::Usage(other.to_string()),
        }
    }
}

/// Runs a parsed command line.
pub fn run(args: Args) -> Result<(), Failure> {
    if let Some(Command::Bench(bench)) = args.command {
        return run_bench(bench);
    }
    let path = args.config.ok_or_else(|| {
        Failure::Usage(
            "no config file: pass --config FILE (or set KMQD_CONFIG); see config/ for examples"
                .to_string(),
        )
    })?;
    let config = Config::load(&path).map_err(|error| Failure::Usage(error.to_string()))?;
    match args.command.unwrap_or(Command::Run) {
        Command::Run => {
            init_logging(&config.daemon.log_level);
            run_daemon(&config)
        }
        Command::CheckConfig => {
            init_logging("warn");
            check_config(&config)
        }
        Command::Push(push) => {
            init_logging("warn");
            run_push(&config, push)
        }
        Command::Stats { json } => {
            init_logging("warn");
            run_stats(&config, json)
        }
        Command::Task(task) => {
            init_logging("warn");
            run_task(&config, task)
        }
        Command::Bench(_) => unreachable!("handled before the config is read"),
    }
}

/// Human-readable logs on standard error (the journal under systemd); `RUST_LOG` overrides the config's level.
fn init_logging(default_level: &str) {
    let from_env = std::env::var("RUST_LOG")
        .ok()
        .filter(|value| !value.trim().is_empty());
    let filter = from_env
        .and_then(|value| EnvFilter::try_new(value).ok())
        .unwrap_or_else(|| EnvFilter::new(default_level));
    // Fails only when a subscriber is already set (tests calling `run` twice); the first one stays.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        // A closed standard error (`kmqd 2>&1 | head`) must not stop the daemon: by default the subscriber
        // reports a failed write with eprintln!, which panics when standard error is gone.
        .log_internal_errors(false)
        .try_init();
}

fn load_plugins(config: &Config) -> Result<Registry, Failure> {
    Registry::load(config)
        .map_err(|error| Failure::Usage(format!("{}: {error}", config.path.display())))
}

fn run_daemon(config: &Config) -> Result<(), Failure> {
    // Before the plugins load (their init may take a while): a SIGTERM meanwhile is a graceful stop, not death
    // by the default action.
    let (stop_tx, stop_rx) = crossbeam_channel::bounded(1);
    crate::daemon::signals::forward(stop_tx)
        .map_err(|error| Failure::Runtime(format!("cannot install signal handlers: {error}")))?;
    let registry = Arc::new(load_plugins(config)?);
    crate::daemon::run(config, registry, stop_rx).map_err(|error| {
        if error.is_config_error() {
            Failure::Usage(error.to_string())
        } else {
            Failure::Runtime(error.to_string())
        }
    })
}

fn check_config(config: &Config) -> Result<(), Failure> {
    let registry = load_plugins(config)?;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}: ok", config.path.display());
    for queue in &config.queues {
        let mode = match queue.mode {
            crate::config::Mode::Default => "default",
            crate::config::Mode::Safe => "safe",
        };
        let _ = writeln!(
            out,
            "  queue {}: {mode} mode, {} workers, priorities {:?}",
            queue.name, queue.workers, queue.priorities
        );
    }
    for plugin in registry.plugins() {
        let _ = writeln!(
            out,
            "  plugin {} ({}): types {:?}",
            plugin.name,
            plugin.path.display(),
            plugin.types
        );
    }
    Ok(())
}

fn run_push(config: &Config, args: PushArgs) -> Result<(), Failure> {
    let client = Client::new(config)?;
    client.check_access(&[&args.queue], Action::Push)?;
    let due = match (args.delay, args.at) {
        (Some(delay), _) => Due::After(delay),
        (None, Some(at)) => Due::At(at),
        (None, None) => Due::Now,
    };
    let prepare = |data: Box<serde_json::value::RawValue>| {
        let mut task = NewTask::with_data(&args.kind, data);
        task.priority = args.priority.clone();
        task.due = due;
        task
    };
    if args.stdin {
        return push_lines(&client, &args.queue, std::io::stdin().lock(), prepare);
    }
    let data =
        task::data_from_str(args.data.as_deref().unwrap_or("null")).map_err(Failure::Usage)?;
    let mut task = prepare(data);
    task.id = args.id;
    task.unique = args.unique;
    match client.push(&args.queue, task)? {
        Pushed::Accepted(id) => {
            println!("{id}");
            Ok(())
        }
        Pushed::Duplicate(id) if due != Due::Now && !args.unique => Err(Failure::Refused(format!(
            "a delayed task {id} is already waiting; to reschedule it, cancel it first (kmqd task cancel {} {id})",
            args.queue
        ))),
        Pushed::Duplicate(id) => Err(Failure::Refused(format!(
            "task {id} is already queued (delayed, ready or processing){}",
            if args.unique {
                "; a unique id is accepted again once that task is done or dead"
            } else {
                ""
            }
        ))),
    }
}

/// Pushes one task per line of `input` in batches of [`PUSH_CHUNK`]. A line that is not JSON stops the push
/// with its line number; the batches before it are already queued, and the message says how many tasks that is.
fn push_lines(
    client: &Client,
    queue: &str,
    input: impl BufRead,
    prepare: impl Fn(Box<serde_json::value::RawValue>) -> NewTask,
) -> Result<(), Failure> {
    let mut pushed = 0usize;
    let mut batch = Vec::with_capacity(PUSH_CHUNK);
    let flush = |batch: &mut Vec<NewTask>, pushed: &mut usize| -> Result<(), Failure> {
        let results = client.push_batch(queue, batch.drain(..))?;
        *pushed += results.iter().filter(|r| r.is_accepted()).count();
        Ok(())
    };
    for (index, line) in input.lines().enumerate() {
        let line =
            line.map_err(|error| Failure::Runtime(format!("reading standard input: {error}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let data = match task::data_from_str(&line) {
            Ok(data) => data,
            Err(error) => {
                flush(&mut batch, &mut pushed)?;
                return Err(Failure::Usage(format!(
                    "line {}: {error}; the {pushed} tasks before it were pushed, none after",
                    index + 1
                )));
            }
        };
        batch.push(prepare(data));
        if batch.len() == PUSH_CHUNK {
            flush(&mut batch, &mut pushed)?;
        }
    }
    flush(&mut batch, &mut pushed)?;
    println!("pushed {pushed} tasks to {queue}");
    Ok(())
}

fn run_stats(config: &Config, json: bool) -> Result<(), Failure> {
    let client = Client::new(config)?;
    let names: Vec<&str> = config
        .queues
        .iter()
        .map(|queue| queue.name.as_str())
        .collect();
    client.check_access(&names, Action::Stats)?;
    let mut all: Vec<(&str, &'static str, QueueStats)> = Vec::new();
    for queue in &config.queues {
        let mode = match queue.mode {
            crate::config::Mode::Default => "default",
            crate::config::Mode::Safe => "safe",
        };
        all.push((&queue.name, mode, client.stats(&queue.name)?));
    }
    let mut out = std::io::stdout().lock();
    if json {
        let queues: serde_json::Map<String, serde_json::Value> = all
            .iter()
            .map(|(name, mode, stats)| {
                let mut value = serde_json::to_value(stats).expect("stats serialize");
                value["mode"] = serde_json::Value::from(*mode);
                (name.to_string(), value)
            })
            .collect();
        let _ = writeln!(out, "{}", serde_json::json!({ "queues": queues }));
        return Ok(());
    }
    let _ = writeln!(
        out,
        "{:<16} {:<7} {:>9} {:>10} {:>9} {:>7} {:>11} {:>9} {:>9} {:>13} {:>9}",
        "QUEUE",
        "MODE",
        "READY",
        "PROCESSING",
        "DELAYED",
        "DEAD",
        "DONE",
        "RETRIED",
        "FAILED",
        "DEAD_LETTERED",
        "LAG"
    );
    for (name, mode, s) in &all {
        let lag = s.lag_ms.map_or("-".to_string(), |ms| {
            humantime::format_duration(Duration::from_millis(ms as u64)).to_string()
        });
        let _ = writeln!(
            out,
            "{name:<16} {mode:<7} {:>9} {:>10} {:>9} {:>7} {:>11} {:>9} {:>9} {:>13} {:>9}",
            s.ready,
            s.processing,
            s.delayed,
            s.dead,
            s.done,
            s.retried,
            s.failed,
            s.dead_lettered,
            lag
        );
    }
    Ok(())
}

fn run_task(config: &Config, command: TaskCommand) -> Result<(), Failure> {
    let client = Client::new(config)?;
    match command {
        TaskCommand::Show { queue, id, json } => {
            client.check_access(&[&queue], Action::Show)?;
            let found = client.find(&queue, &id)?;
            if found.is_empty() {
                return Err(Failure::NotFound(format!(
                    "no task {id} in queue {queue}: it is not delayed, ready, processing or dead (done tasks are not kept)"
                )));
            }
            let mut out = std::io::stdout().lock();
            if json {
                let _ = writeln!(
                    out,
                    "{}",
                    serde_json::to_string(&found).expect("found serializes")
                );
                return Ok(());
            }
            let ms = |ms: i64| {
                humantime::format_duration(Duration::from_millis(ms.max(0) as u64)).to_string()
            };
            for place in &found {
                let (state, payload) = match place {
                    Found::Delayed {
                        level,
                        due_in_ms,
                        envelope,
                    } => (
                        format!("delayed, level {level}, due in {}", ms(*due_in_ms)),
                        envelope,
                    ),
                    Found::Retrying {
                        level,
                        due_in_ms,
                        envelope,
                    } => (
                        format!("waiting to retry, level {level}, due in {}", ms(*due_in_ms)),
                        envelope,
                    ),
                    Found::Ready {
                        level,
                        position,
                        envelope,
                    } => (
                        format!("ready, level {level}, {position} ahead of it"),
                        envelope,
                    ),
                    Found::Processing {
                        owner,
                        token,
                        lease_left_ms,
                        envelope,
                    } => (
                        format!(
                            "processing (owner {owner}, token {token}), lease ends in {}",
                            ms(*lease_left_ms)
                        ),
                        envelope,
                    ),
                    Found::Dead { record } => ("dead".to_string(), record),
                };
                let _ = writeln!(out, "{id} in {queue}: {state}\n  {payload}");
            }
            Ok(())
        }
        TaskCommand::Cancel { queue, ids } => {
            client.check_access(&[&queue], Action::Cancel)?;
            let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
            let removed = client.cancel_batch(&queue, &refs)?;
            let mut missing = Vec::new();
            for id in &ids {
                match removed.get(id).copied().unwrap_or(0) {
                    0 => missing.push(id.as_str()),
                    n => println!(
                        "cancelled {id}{}",
                        if n > 1 {
                            format!(" ({n} copies)")
                        } else {
                            String::new()
                        }
                    ),
                }
            }
            if missing.is_empty() {
                Ok(())
            } else {
                Err(Failure::NotFound(format!(
                    "not waiting in queue {queue}, so not cancelled: {} (unknown, running, done or dead; see `kmqd task show`)",
                    missing.join(", ")
                )))
            }
        }
    }
}

fn run_bench(args: BenchArgs) -> Result<(), Failure> {
    init_logging("warn");
    let options = crate::bench::Options {
        tasks: args.tasks,
        runs: args.runs.max(1),
        daemons: args.daemons,
        only: args.only,
        workers: args.workers,
        batch: args.batch,
        prefetch: args.prefetch,
        plugins_dir: args.plugins_dir,
        backlog: args.backlog,
        peers: args.peers,
        daemon: args.daemon,
    };
    let report = crate::bench::run(options, &mut std::io::stderr()).map_err(Failure::Runtime)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("report serializes")
        );
    } else {
        print!("{}", crate::bench::render(&report));
    }
    Ok(())
}
