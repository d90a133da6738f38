//! The `kmqd` command line: `kmqd --config FILE [run|check-config|push|stats|task|dead|queue|workers|dashboard]`, one
//! module per command. (The benchmark is a binary of its own, `kmqd-bench`, in bench/.)
//!
//! Exit codes, everywhere: 0 success, 1 runtime error (Redis unreachable, a thread died), 2 usage or config
//! error (including a refused plugin, wrong credentials and missing ACL rules), 3 a push refused because its
//! unique id is live, 4 a task id not found where `task show`, `task cancel`, `task result` or a `dead` command
//! needs it, 5 a task still waiting or running when `task result --wait` ended, 6 a task `task result` found
//! dead.

use std::fmt;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use crate::client::ClientError;
use crate::config::{Config, LogFormat};

mod colour;
mod daemon;
mod dashboard;
mod dead;
mod flow;
mod groups;
mod push;
mod queue;
mod stats;
mod task;
mod watch;
mod workers;

pub use dashboard::{DashboardArgs, DashboardCommand};
pub use dead::DeadCommand;
pub use flow::FlowCommand;
pub use groups::GroupCommand;
pub use push::PushArgs;
pub use queue::QueueCommand;
pub use task::TaskCommand;

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
    /// Serve the metrics on ADDR, overriding the config's `daemon.metrics_addr` (one config file for several
    /// daemons on a host: give each its own port, or port 0 for a free one, logged at start).
    #[arg(long, value_name = "ADDR", global = true)]
    pub metrics_addr: Option<std::net::SocketAddr>,
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
        #[arg(long, conflicts_with = "watch")]
        json: bool,
        /// Poll every --interval: a full-screen view on a terminal (q quits), else one `key=value` line per
        /// queue per poll (docs/OPERATIONS.md, "Watching the queues").
        #[arg(long)]
        watch: bool,
        /// How often --watch polls (at least 100ms).
        #[arg(long, default_value = "1s", value_parser = parse_interval, requires = "watch")]
        interval: std::time::Duration,
    },
    /// Push a flow of tasks that wait for each other, or show the graph under one of its tasks.
    #[command(subcommand)]
    Flow(FlowCommand),
    /// Find or cancel tasks by id.
    #[command(subcommand)]
    Task(TaskCommand),
    /// List, show, requeue or purge dead-letter records.
    #[command(subcommand)]
    Dead(DeadCommand),
    /// Pause or resume a queue on every daemon.
    #[command(subcommand)]
    Queue(QueueCommand),
    /// List a grouped queue's groups ([queues.groups]), busiest first: waiting, running, throttled, paused.
    Groups {
        /// The queue, as named in the config.
        queue: String,
        /// Print JSON: {"groups": [{"name": ..., "waiting": ..., ...}]}.
        #[arg(long)]
        json: bool,
        /// Show at most this many groups.
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Pause or resume one group of a grouped queue on every daemon.
    #[command(subcommand)]
    Group(GroupCommand),
    /// List the daemons alive on each queue: host, pid, version, lease left, tasks held, state.
    Workers {
        /// Print JSON: {"workers": [{"queue": ..., "host": ..., ...}]}.
        #[arg(long)]
        json: bool,
    },
    /// Serve the web dashboard and its JSON API (docs/DASHBOARD.md): every queue, its tasks, its dead letters,
    /// the daemons; pause, resume, requeue, purge and cancel from the page.
    Dashboard(DashboardArgs),
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
    /// A task still waiting or running when `task result --wait` ended: exit 5.
    Pending(String),
    /// A task that ended dead, for `task result` (which printed its reason): exit 6.
    Dead(String),
}

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Runtime(_) => 1,
            Failure::Usage(_) => 2,
            Failure::Refused(_) => 3,
            Failure::NotFound(_) => 4,
            Failure::Pending(_) => 5,
            Failure::Dead(_) => 6,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Usage(message)
            | Failure::Runtime(message)
            | Failure::Refused(message)
            | Failure::NotFound(message)
            | Failure::Pending(message)
            | Failure::Dead(message) => f.write_str(message),
        }
    }
}

impl From<crate::broker::BrokerError> for Failure {
    fn from(error: crate::broker::BrokerError) -> Failure {
        ClientError::Broker(error).into()
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

/// The failure of a command that changes something (`what`), where a lost reply leaves it unknown whether the
/// change was made: the error says so, and how to see (`check`), rather than only "unexpected end of file".
pub(super) fn change_failed(error: ClientError, what: &str, check: &str) -> Failure {
    match error {
        ClientError::Broker(error) if error.may_have_run() => Failure::Runtime(format!(
            "{error}; the reply was lost, so {what} may have been applied, in part or whole: {check}"
        )),
        other => other.into(),
    }
}

/// Runs a parsed command line.
pub fn run(args: Args) -> Result<(), Failure> {
    if let Some(Command::Dashboard(DashboardArgs {
        command: Some(DashboardCommand::HashPassword { name }),
        ..
    })) = &args.command
    {
        return dashboard::hash_password(name);
    }
    let path = args.config.ok_or_else(|| {
        Failure::Usage(
            "no config file: pass --config FILE (or set KMQD_CONFIG); see config/ for examples"
                .to_string(),
        )
    })?;
    let mut config = Config::load(&path).map_err(|error| Failure::Usage(error.to_string()))?;
    if let Some(addr) = args.metrics_addr {
        config.daemon.metrics_addr = Some(addr);
        config.daemon.metrics_addr_overridden = true;
    }
    if let Some(filter) = rust_log() {
        crate::config::check_log_filter(&filter)
            .map_err(|why| Failure::Usage(format!("RUST_LOG: {why}")))?;
    }
    let format = config.daemon.log_format;
    match args.command.unwrap_or(Command::Run) {
        Command::Run => {
            init_logging_as(&config.daemon.log_level, format);
            daemon::run_daemon(&config)
        }
        Command::CheckConfig => {
            init_logging("warn");
            daemon::check_config(&config)
        }
        Command::Push(push) => {
            init_logging("warn");
            push::run_push(&config, push)
        }
        Command::Stats {
            watch: true,
            interval,
            ..
        } => {
            init_logging("warn");
            watch::run_watch(&config, interval)
        }
        Command::Stats { json, .. } => {
            init_logging("warn");
            stats::run_stats(&config, json)
        }
        Command::Flow(flow) => {
            init_logging("warn");
            flow::run_flow(&config, flow)
        }
        Command::Task(task) => {
            init_logging("warn");
            task::run_task(&config, task)
        }
        Command::Dead(dead) => {
            init_logging("warn");
            dead::run_dead(&config, dead)
        }
        Command::Queue(queue) => {
            init_logging("warn");
            queue::run_queue(&config, queue)
        }
        Command::Groups { queue, json, limit } => {
            init_logging("warn");
            groups::run_groups(&config, &queue, json, limit)
        }
        Command::Group(group) => {
            init_logging("warn");
            groups::run_group(&config, group)
        }
        Command::Workers { json } => {
            init_logging("warn");
            workers::run_workers(&config, json)
        }
        Command::Dashboard(dashboard) => {
            // At the daemon's level and format: its actions are logged, with who asked.
            init_logging_as(&config.daemon.log_level, format);
            dashboard::run_dashboard(&config, dashboard)
        }
    }
}

/// A client for the config's queues, whose Redis user was checked for `action` on every one of them (the
/// commands that report on all queues: `stats`, `workers`).
fn client_for_every_queue(
    config: &Config,
    action: crate::broker::access::Action,
) -> Result<crate::client::Client, Failure> {
    let client = crate::client::Client::new(config)?;
    let names: Vec<&str> = config
        .queues
        .iter()
        .map(|queue| queue.name.as_str())
        .collect();
    client.check_access(&names, action)?;
    Ok(client)
}

/// What a command does on a Redis whose `maxmemory-policy` may evict kmqd's keys, when `[redis] allow_eviction`
/// does not accept it (docs/OPERATIONS.md, "maxmemory-policy"). Accepted, or unreadable, every command warns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OnEviction {
    /// The commands that put tasks into Redis (`push`, `dead requeue`): exit 2, as the daemon does at start,
    /// since what they queue could be evicted without a trace.
    Refuse,
    /// The commands that only remove or flag (`dead purge`, `task cancel`, `queue pause`/`resume`): they put no
    /// task at risk, and an operator may need them most on a Redis in trouble; a warning.
    Warn,
}

/// Reads Redis's `maxmemory-policy` for a command that writes, after its ACL check: refuses or warns as `on`
/// says (the warnings go to standard error).
fn check_eviction(client: &crate::client::Client, on: OnEviction) -> Result<(), Failure> {
    let finding = client.eviction()?;
    if let Some(refusal) = finding.refusal() {
        match on {
            OnEviction::Refuse => return Err(refusal.into()),
            OnEviction::Warn => {
                tracing::warn!(
                    "{refusal}; this command goes on: it adds no task that could be evicted"
                )
            }
        }
    }
    for warning in finding.warnings() {
        tracing::warn!("{warning}");
    }
    Ok(())
}

/// `--interval`: a duration of at least [`crate::config::MIN_WATCH_INTERVAL`].
fn parse_interval(text: &str) -> Result<std::time::Duration, String> {
    let interval = humantime::parse_duration(text).map_err(|error| {
        format!("{text:?} is not a duration ({error}); write it like \"1s\" or \"500ms\"")
    })?;
    if interval < crate::config::MIN_WATCH_INTERVAL {
        return Err(format!("{text:?} is too short; use at least 100ms"));
    }
    Ok(interval)
}

/// `RUST_LOG`, when set to something.
fn rust_log() -> Option<String> {
    std::env::var("RUST_LOG")
        .ok()
        .filter(|value| !value.trim().is_empty())
}

/// Human-readable logs on standard error (the journal under systemd); `RUST_LOG` overrides the config's level.
/// Public for `kmqd-bench`, which logs as kmqd's commands do.
pub fn init_logging(default_level: &str) {
    init_logging_as(default_level, LogFormat::Text);
}

/// Logs on standard error, as text or one JSON object per line (`[daemon] log_format`); `RUST_LOG` (checked by
/// [`run`]) overrides the level.
fn init_logging_as(default_level: &str, format: LogFormat) {
    let filter = rust_log()
        .and_then(|value| EnvFilter::try_new(value).ok())
        .unwrap_or_else(|| EnvFilter::new(default_level));
    let ansi = format == LogFormat::Text && colour::Colour::stderr().enabled();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        // A closed standard error (`kmqd 2>&1 | head`) must not stop the daemon: by default the subscriber
        // reports a failed write with eprintln!, which panics when standard error is gone.
        .log_internal_errors(false);
    // Fails only when a subscriber is already set (tests calling `run` twice); the first one stays.
    // Each with the reload layer: a reload may change `log_level` (crate::daemon::log_filter).
    let _ = match format {
        LogFormat::Text => {
            let builder = builder.with_filter_reloading();
            let handle = builder.reload_handle();
            install_filter_setter(move |filter| handle.reload(filter));
            builder.try_init()
        }
        LogFormat::Json => {
            let builder = builder.json().flatten_event(true).with_filter_reloading();
            let handle = builder.reload_handle();
            install_filter_setter(move |filter| handle.reload(filter));
            builder.try_init()
        }
    };
    log_panics();
}

/// A panic of one of kmqd's threads becomes one error event (thread, location, message, and the backtrace when
/// `RUST_BACKTRACE` asks for one) instead of std's lines on standard error, which would split a JSON log. The
/// supervisor then reports the thread's end as usual. Plugins' panics never get here: see kmq-plugin's hook.
fn log_panics() {
    std::panic::set_hook(Box::new(|info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("non-string panic payload");
        let thread = std::thread::current();
        let location = info.location().map(ToString::to_string);
        let backtrace = std::backtrace::Backtrace::capture();
        let backtrace = (backtrace.status() == std::backtrace::BacktraceStatus::Captured)
            .then(|| backtrace.to_string());
        tracing::error!(
            thread = thread.name().unwrap_or("?"),
            location,
            backtrace,
            "panic: {message}"
        );
    }));
}

/// Hands the reload layer's handle to the daemon, as a function from a (checked) filter to its installation.
fn install_filter_setter(
    reload: impl Fn(EnvFilter) -> Result<(), tracing_subscriber::reload::Error> + Send + Sync + 'static,
) {
    crate::daemon::log_filter::install(move |level| {
        let filter = EnvFilter::try_new(level).map_err(|error| error.to_string())?;
        reload(filter).map_err(|error| error.to_string())
    });
}
