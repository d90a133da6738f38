//! The TOML config: parsed into `Raw*` structs ([`raw`]), then validated into [`Config`] ([`validate`]).
//!
//! Parsing and validating are separate steps (ripgrep's LowArgs -> HiArgs, sccache's raw config): serde checks
//! shapes and rejects unknown keys, then `RawConfig::validate` checks meaning. Every raw struct is destructured
//! there, so a new key cannot be forgotten. [`errors`] locates and words what is wrong. Every error names the file, line, column and key, and says what would
//! be valid. Relative paths are resolved against the config file's directory, not the working directory, so a
//! config means the same thing whoever starts the daemon.

mod errors;
pub(crate) mod rate;
mod raw;
mod validate;

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use errors::{Source, key_path, shape_message};
use raw::RawConfig;

/// The validated config of one daemon (or of one `kmqd push`/`stats` invocation).
#[derive(Clone, Debug)]
pub struct Config {
    /// The file the config was read from.
    pub path: PathBuf,
    pub redis: RedisConfig,
    pub daemon: DaemonConfig,
    pub queues: Vec<QueueConfig>,
    pub plugins: Vec<PluginConfig>,
    pub schedules: Vec<ScheduleConfig>,
    pub dashboard: DashboardConfig,
}

/// `[dashboard]`: how `kmqd dashboard` authenticates (docs/DASHBOARD.md, "Authentication"). Only the
/// dashboard reads the files and the variable, when it starts: a daemon sharing the config needs neither.
#[derive(Clone, Debug, Default)]
pub struct DashboardConfig {
    /// Lines `NAME:ARGON2_PHC_HASH` (`kmqd dashboard hash-password NAME`): HTTP Basic users.
    pub users_file: Option<Located<PathBuf>>,
    /// A bearer token, from this environment variable...
    pub token_env: Option<Located<String>>,
    /// ... or from this file (one line).
    pub token_file: Option<Located<PathBuf>>,
}

impl DashboardConfig {
    /// Whether any way to authenticate is configured.
    pub fn has_authentication(&self) -> bool {
        self.users_file.is_some() || self.token_env.is_some() || self.token_file.is_some()
    }
}

/// A config value with where it was written (`FILE:LINE:COLUMN: KEY`), for errors found after loading, such as a
/// file it names that cannot be read when the dashboard starts.
#[derive(Clone, Debug)]
pub struct Located<T> {
    pub value: T,
    /// `/etc/kmqd/kmqd.toml:31:14: dashboard.token_env`.
    pub at: String,
}

impl<T> Located<T> {
    /// An error about this value: `FILE:LINE:COLUMN: KEY: WHY`.
    pub fn error(&self, why: impl fmt::Display) -> String {
        format!("{}: {why}", self.at)
    }
}

/// Reads a small regular file's text (a password or token file is a line; a users file a few): reading a
/// device (`/dev/zero`) or a FIFO would never end.
pub fn read_small_file(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    const LIMIT: u64 = 64 * 1024;
    let file = std::fs::File::open(path)?;
    let metadata = file.metadata()?;
    if !metadata.is_file() || metadata.len() > LIMIT {
        return Err(std::io::Error::other(format!(
            "not a regular file of at most {LIMIT} bytes"
        )));
    }
    let mut text = String::new();
    file.take(LIMIT).read_to_string(&mut text)?;
    Ok(text)
}

#[derive(Clone)]
pub struct RedisConfig {
    /// `redis://`, `rediss://` or `unix://` URL of a single Redis, without the password when it came from
    /// `password_env`/`_file`; with `cluster` or `sentinel` set, unused.
    pub url: String,
    /// Which Redis deployment the URL or seeds name.
    pub deployment: Deployment,
    /// The ACL user, when not in the URL.
    pub username: Option<String>,
    /// Kept out of `url` (and out of `Debug`) so it is never logged.
    pub password: Option<String>,
    /// The CAs and client certificate of `rediss://` connections, read at start.
    pub tls: TlsFiles,
    /// How many replicas must have each state change of a task before kmqd counts it done (`WAIT`); 0: none.
    pub wait_replicas: u32,
    /// How long a `WAIT` may take before the change counts as not replicated (an error the caller retries).
    pub wait_timeout: Duration,
    pub pool_size: u32,
    /// Whether the file gives `pool_size`, rather than leaving it to be sized from the queues: a reload reports a
    /// given size that changed as needing a restart, but not a default that moved with the queues.
    pub pool_size_given: bool,
    pub key_prefix: String,
    pub connect_timeout: Duration,
    /// How long a reply may take before the call is given up for lost (then retried, or resolved when it may
    /// have run). Blocking calls wait this much beyond their own timeout.
    pub io_timeout: Duration,
    /// Run on a Redis whose `maxmemory-policy` may evict kmqd's keys (anything but `noeviction`), with a warning,
    /// instead of refusing to (docs/OPERATIONS.md, "maxmemory-policy").
    pub allow_eviction: bool,
}

/// The Redis deployment a config names (docs/OPERATIONS.md, "Deployments").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Deployment {
    /// One Redis at `url`.
    Single,
    /// A Redis Cluster found through these seed nodes (`redis://` or `rediss://`, all alike).
    Cluster { seeds: Vec<String> },
    /// A master that these Sentinels watch under `master`; `rediss://` seeds mean TLS to the Sentinels and
    /// to the master.
    Sentinel { seeds: Vec<String>, master: String },
}

/// PEM files of `tls_ca_file`, `tls_cert_file` and `tls_key_file`, read when the config is.
#[derive(Clone, Default)]
pub struct TlsFiles {
    /// Trust these CAs instead of the system's.
    pub ca: Option<Vec<u8>>,
    /// A client certificate and its key, for mutual TLS.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl RedisConfig {
    /// Whether connections use TLS (`rediss://` URL or seeds).
    pub fn uses_tls(&self) -> bool {
        match &self.deployment {
            Deployment::Single => self.url.starts_with("rediss://"),
            Deployment::Cluster { seeds } | Deployment::Sentinel { seeds, .. } => {
                seeds.iter().any(|seed| seed.starts_with("rediss://"))
            }
        }
    }

    /// Where Redis is, for logs: the URL, or the seeds, without passwords.
    pub fn describe(&self) -> String {
        let list = |seeds: &[String]| {
            seeds
                .iter()
                .map(|seed| redact_url(seed))
                .collect::<Vec<_>>()
                .join(", ")
        };
        match &self.deployment {
            Deployment::Single => redact_url(&self.url),
            Deployment::Cluster { seeds } => format!("cluster {}", list(seeds)),
            Deployment::Sentinel { seeds, master } => {
                format!("master {master:?} of sentinels {}", list(seeds))
            }
        }
    }

    /// The longest `calls` Redis calls on one connection may take, each bounded by these timeouts: a pooled
    /// connection within `connect_timeout`, a reply within `io_timeout`, a `WAIT` for replicas within
    /// `wait_timeout`. The watchdog's stall bounds add these up (`daemon::watchdog`). With the defaults, one call:
    /// 15.1 s.
    pub fn call_bound(&self, calls: u32) -> Duration {
        self.connect_timeout + self.wait_timeout + self.io_timeout * calls
    }
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("redis", &self.describe())
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("tls_ca", &self.tls.ca.is_some())
            .field("tls_client_cert", &self.tls.client.is_some())
            .field("wait_replicas", &self.wait_replicas)
            .field("wait_timeout", &self.wait_timeout)
            .field("pool_size", &self.pool_size)
            .field("pool_size_given", &self.pool_size_given)
            .field("key_prefix", &self.key_prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("io_timeout", &self.io_timeout)
            .field("allow_eviction", &self.allow_eviction)
            .finish()
    }
}

/// Replaces the password of a `scheme://user:password@host` URL with `***`, for logs and error messages.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => match rest[..at].find(':') {
            Some(colon) => format!(
                "{}{}:***{}",
                &url[..scheme_end],
                &rest[..colon],
                &rest[at..]
            ),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

#[derive(Clone, Debug)]
pub struct DaemonConfig {
    pub plugins_dir: PathBuf,
    pub shutdown_grace: Duration,
    pub metrics_addr: Option<SocketAddr>,
    /// `metrics_addr` came from the command line (`--metrics-addr`), not the file: a reload keeps it without
    /// calling the file's value a change.
    pub metrics_addr_overridden: bool,
    /// The OTLP/HTTP collector spans are exported to (`src/otel.rs`); `None`: no tracing.
    pub otlp_endpoint: Option<String>,
    /// A tracing filter such as `info` or `kmqd=debug`; `RUST_LOG` takes precedence.
    pub log_level: String,
    /// How log events are written to standard error.
    pub log_format: LogFormat,
    /// How often the daemon logs one `queue report` event per queue (`src/daemon/report.rs`); `None`: never.
    pub report_interval: Option<Duration>,
}

/// `[daemon] log_format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (the journal's usual fare).
    Text,
    /// One JSON object per event, per line: a multi-line message is one escaped field, never split.
    Json,
}

/// Checks a tracing filter (`log_level`, `RUST_LOG`): comma-separated directives, each a level or
/// `TARGET=LEVEL`. tracing's own parser takes a bare word that is no level for a target, so `"warning"` would
/// silently enable nothing of kmqd's: here it is an error, with the level meant.
pub fn check_log_filter(filter: &str) -> Result<(), String> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    for directive in filter.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let level = directive
            .rsplit_once('=')
            .map_or(directive, |(_, level)| level);
        if !LEVELS.contains(&level.to_ascii_lowercase().as_str()) {
            let meant = match level.to_ascii_lowercase().as_str() {
                "warning" => Some("warn"),
                "err" | "fatal" | "critical" => Some("error"),
                "verbose" | "all" => Some("trace"),
                "none" | "quiet" => Some("off"),
                _ => None,
            };
            let hint = meant.map_or(String::new(), |m| format!(" (did you mean \"{m}\"?)"));
            return Err(format!(
                "{level:?} in {directive:?} is not a level{hint}; write one of off, error, warn, info, debug, trace, \
                 or TARGET=LEVEL (\"kmqd=debug,warn\")"
            ));
        }
    }
    tracing_subscriber::EnvFilter::try_new(filter)
        .map(drop)
        .map_err(|error| format!("{filter:?} is not a log filter: {error}"))
}

/// A queue's delivery guarantee; see docs/PROTOCOL.md, "Guarantees".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Plain pop: fast; a task whose daemon dies while holding it is lost.
    Default,
    /// At-least-once: claimed tasks stay in the processing area under a lease until acknowledged.
    Safe,
}

impl Mode {
    /// The name in the config (and in an owner's registration).
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Default => "default",
            Mode::Safe => "safe",
        }
    }
}

/// What a handler error (`KMQ_RETRY`, a panic, an execution timeout) does to a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnHandlerError {
    /// Retry with exponential backoff until `retry_times` is used up, then dead-letter.
    Retry,
    /// Count the task as done (KMQueue's rule): it is acknowledged and not run again.
    Finish,
    /// Dead-letter at once.
    Dead,
}

#[derive(Clone, Debug)]
pub struct QueueConfig {
    pub name: String,
    pub mode: Mode,
    /// Priority levels, highest first. A queue without `priorities` has one level, `normal`.
    pub priorities: Vec<String>,
    /// Index into `priorities` of the level a push without `--priority` goes to.
    pub default_priority: usize,
    pub workers: usize,
    /// How much lower than the daemon's other threads the workers run (niceness added, 0 to 19): the lane's one
    /// fetcher and one acker then get a core when its hundreds of workers want one (docs/CONFIG.md).
    pub worker_nice: i32,
    /// The most tasks one claim takes.
    pub batch: usize,
    /// How many claimed tasks may wait for a worker, beyond one per idle worker.
    pub prefetch: Prefetch,
    /// The most tasks the lane holds at once (running, waiting for a worker, or waiting for their settlement):
    /// `workers + prefetch` never exceeds it, so the daemon's memory stays bounded.
    pub max_held: usize,
    /// The most of the queue's tasks taken and not yet settled at once, across every daemon (docs/CONFIG.md):
    /// claim.lua takes no more, counting in Redis; `None`: no limit.
    pub max_running: Option<usize>,
    /// At most so many task starts in any window of each of these lengths, across every daemon (docs/CONFIG.md):
    /// claim.lua takes no more, on Redis's clock; empty: no limit.
    pub rate_limit: Vec<rate::RateLimit>,
    /// `[[queues.limits]]`: limits of single task types, each across every daemon as the queue's are, taken
    /// together with them (docs/CONFIG.md); empty: none. A type listed here waits in a list of its own while its
    /// limits hold it back, so that it never blocks the queue's other tasks (claim.lua, "Type limits").
    pub type_limits: Vec<TypeLimit>,
    /// `[queues.groups]`: the queue's tasks take turns by their envelope's `group`, each group within its own
    /// limits (docs/CONFIG.md; claim.lua, groups.lua); `None`: no groups.
    pub groups: Option<Groups>,
    /// Turns between the levels that have tasks, by these weights (smooth weighted round-robin, one per level in
    /// `priorities`' order: docs/CONFIG.md); empty: strict order, the highest level first.
    pub priority_weights: Vec<u32>,
    pub lease_timeout: Duration,
    pub execution_timeout: Option<Duration>,
    pub alive_timeout: Option<Duration>,
    pub retry_times: u32,
    pub on_handler_error: OnHandlerError,
    pub backoff: Duration,
    pub backoff_max: Duration,
    pub dead_max: usize,
    /// Accept plain JSON objects that are not envelopes, taking the task type from this field.
    pub foreign_type_field: Option<String>,
    /// The most due tasks one call of the delay poller moves.
    pub delay_batch: usize,
    /// A task payload longer than this is dead-lettered without being run (safe mode: without leaving Redis).
    pub max_task_bytes: usize,
    /// The longest an idle fetcher waits before looking at the ready lists on its own, and so the bound on how
    /// late a task pushed without a wake-up marker (a plain RPUSH) is picked up.
    pub idle_poll: Duration,
    /// A lag (age of the oldest ready task) above this logs a warning, and its return below it one line more
    /// (`src/daemon/report.rs`); `None`: not watched.
    pub lag_warn: Option<Duration>,
    /// How long the settle that ends a task keeps its result (or a dead task's reason) in Redis, as the key's
    /// expiry (docs/PROTOCOL.md, "Results"); `None`: nothing is kept, and the settle writes nothing more.
    pub keep_results: Option<Duration>,
    /// Lists that producers push tasks to with their own key names (`RPUSH queue:email ...`): the daemon moves
    /// what they hold into the queue, byte for byte (`src/daemon/sources.rs`).
    pub source_lists: Vec<SourceList>,
}

/// One of a queue's `source_lists`.
#[derive(Clone, PartialEq, Eq)]
pub struct SourceList {
    /// The list's key, as its producers name it.
    pub key: String,
    /// Index into the queue's priorities of the level its tasks join: `default_priority` unless the config
    /// gives one (`{ list = "queue:email", priority = "high" }`).
    pub level: usize,
    /// That level's name, for logs.
    pub priority: String,
}

impl std::fmt::Debug for SourceList {
    /// `"queue:email" (high)`, as the reload's change list prints it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} ({})", self.key, self.priority)
    }
}

/// How many claimed tasks may wait for a worker beyond one per worker.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Prefetch {
    /// Set in the config: that many, always.
    Fixed(usize),
    /// Not set: the lane adapts it to what it measures, between 1 and `max_held - workers`
    /// (`src/daemon/lane/depth.rs`).
    Auto,
}

impl Prefetch {
    /// The least a queue with `workers` may hold with this prefetch (an adaptive one may come down to 0).
    pub fn least_held(self, workers: usize) -> usize {
        match self {
            Prefetch::Fixed(prefetch) => workers + prefetch,
            Prefetch::Auto => workers,
        }
    }
}

impl std::fmt::Debug for Prefetch {
    /// As the config spells it (the reload's change list prints it): `auto` or the number.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Prefetch::Fixed(prefetch) => write!(f, "{prefetch}"),
            Prefetch::Auto => f.write_str("auto"),
        }
    }
}

impl QueueConfig {
    /// The prefetch a lane starts with: the configured one, or for an adaptive one `workers` (the old fixed
    /// default), within what `max_held` leaves.
    pub fn initial_prefetch(&self) -> usize {
        match self.prefetch {
            Prefetch::Fixed(prefetch) => prefetch,
            Prefetch::Auto => self.workers.min(self.max_held - self.workers),
        }
    }
}

/// A periodic task: queued once per slot across every daemon.
#[derive(Clone, Debug)]
pub struct ScheduleConfig {
    pub name: String,
    /// The queue, as named in `[[queues]]`.
    pub queue: String,
    /// The task type.
    pub kind: String,
    /// The task's `data` as JSON text.
    pub data_json: String,
    pub when: When,
    /// Index into the queue's priorities.
    pub level: usize,
    pub missed: Missed,
    /// A slot later than this when a daemon gets to it counts as missed.
    pub misfire_grace: Duration,
    /// With `missed = "catch_up"`, the most missed slots fired (the newest ones).
    pub catch_up_max: usize,
}

/// When a schedule's slots are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum When {
    /// A five-field cron expression, in UTC.
    Cron(crate::cron::Cron),
    /// Every multiple of this duration since the epoch (so "5m" fires at :00, :05, ...).
    Every(Duration),
}

impl When {
    /// The first slot strictly after `after_ms`; `None` when there is none the clock (i64 ms) can hold.
    pub fn next_after(&self, after_ms: i64) -> Option<i64> {
        match self {
            When::Cron(cron) => cron.next_after(after_ms),
            When::Every(every) => {
                let every = i64::try_from(every.as_millis()).ok()?;
                (after_ms.div_euclid(every).checked_add(1)?).checked_mul(every)
            }
        }
    }
}

/// What to do with slots that passed while no daemon ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Missed {
    /// Do not fire them; go on with the next slot.
    Skip,
    /// Fire them, oldest first (at most `catch_up_max`).
    CatchUp,
}

#[derive(Clone, Debug)]
pub struct PluginConfig {
    pub name: String,
    /// Absolute path (resolved against `plugins_dir`); canonicalised by the loader.
    pub file: PathBuf,
    /// The `config` table as JSON text, handed to the plugin's `init`.
    pub config_json: String,
    /// Where `[plugins.NAME]` stands in the config, for error messages.
    pub location: String,
}

/// A config that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{location}: {message}")]
    Invalid { location: String, message: String },
}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::parse(path, &text)
    }

    /// Parses and validates config text; `path` names it in errors and anchors relative paths.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let source = Source { path, text };
        let syntax = |error: toml::de::Error| {
            let message = error.message().trim_end().to_string();
            source.error(error.span().unwrap_or(0..0), message)
        };
        let deserializer = toml::Deserializer::parse(text).map_err(syntax)?;
        let raw: RawConfig = serde_path_to_error::deserialize(deserializer).map_err(|error| {
            let path = error.path().to_string();
            let error = error.into_inner();
            let span = error.span().unwrap_or(0..0);
            let key = key_path(&path, &source.text[..span.start.min(source.text.len())]);
            source.error(span, shape_message(&key, error.message().trim_end()))
        })?;
        raw.validate(&source)
    }

    /// The queue named `name`.
    pub fn queue(&self, name: &str) -> Option<&QueueConfig> {
        self.queues.iter().find(|queue| queue.name == name)
    }

    /// Redis connections the daemon takes from its pool at once: per queue a fetcher, an acker, a delay poller
    /// and, with `source_lists`, a source mover; per daemon the monitor, the scheduler, the metrics endpoint, the
    /// owners thread (the owners marked draining and released, at a stop or a reload) and, when it runs, the queue
    /// reporter. The heartbeat is not counted: it has a connection of its own, outside the pool, so that nothing
    /// waiting for the pool delays a renewal.
    pub fn connections_needed(&self) -> u32 {
        let movers = self
            .queues
            .iter()
            .filter(|q| !q.source_lists.is_empty())
            .count();
        3 * self.queues.len() as u32 + movers as u32 + 4 + u32::from(self.reports())
    }

    /// Whether the daemon runs its queue reporter: `[daemon] report_interval` is set or a queue has `lag_warn`.
    pub fn reports(&self) -> bool {
        self.daemon.report_interval.is_some() || self.queues.iter().any(|q| q.lag_warn.is_some())
    }
}

/// Default values, in one place. docs/CONFIG.md gives them again, and the tidy test
/// `the_defaults_in_config_md_are_the_configs` (src/tidy/docs_in_sync.rs) checks that each default it gives as a
/// value is what a config that leaves the key out gets.
pub(crate) mod defaults {
    use std::time::Duration;

    pub const REDIS_URL: &str = "redis://127.0.0.1:6379/0";
    pub const KEY_PREFIX: &str = "kmq";
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
    pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
    pub const WAIT_TIMEOUT: Duration = Duration::from_millis(100);
    pub const PLUGINS_DIR: &str = "/usr/lib/kmqd/plugins";
    pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
    pub const LOG_LEVEL: &str = "info";
    pub const PRIORITY: &str = "normal";
    pub const WORKERS: usize = 8;
    /// The most a claim takes when `batch` is not set: the largest claim (claims start at 16 tasks and double
    /// while the backlog lasts, and never take more than the free slots, so only a deep backlog sees it).
    pub const BATCH: usize = super::MAX_TAKE;
    /// How many tasks beyond one per worker a queue with neither `prefetch` nor `max_held` may hold: enough for
    /// no-op tasks to drain at full speed (docs/PERFORMANCE.md, "Defaults that find the speed").
    pub const HELD_BEYOND_WORKERS: usize = 4096;
    pub const LEASE_TIMEOUT: Duration = Duration::from_secs(30);
    pub const EXECUTION_TIMEOUT: Duration = Duration::from_secs(30 * 60);
    pub const RETRY_TIMES: u32 = 3;
    pub const BACKOFF: Duration = Duration::from_secs(1);
    pub const BACKOFF_MAX: Duration = Duration::from_secs(10 * 60);
    pub const DEAD_MAX: usize = 10_000;
    pub const IDLE_POLL: Duration = Duration::from_secs(1);
    pub const MAX_TASK_BYTES: usize = 16 << 20;
    /// Redis's own limit for a string.
    pub const MAX_TASK_BYTES_LIMIT: usize = 512 << 20;
}

/// The most tasks one script call takes from a list or a set (a claim's or a pop's `batch`, a promotion's
/// `delay_batch`, a move from source lists): Lua's `unpack` fails past ~8,000 values and a claim passes two per
/// task. Not the acker's `MAX_SETTLE`, the most resolutions one settle call applies.
pub const MAX_TAKE: usize = 1000;

/// One `[[queues.limits]]` entry: the limits of the queue's tasks of one type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypeLimit {
    /// The task type (the envelope's `type`, or a foreign payload's `foreign_type_field`), as the handlers see it.
    pub kind: String,
    /// At most so many tasks of the type taken and not yet settled at once, across every daemon.
    pub max_running: Option<usize>,
    /// At most so many starts of the type in any window of each of these lengths, across every daemon.
    pub rate_limit: Vec<rate::RateLimit>,
}

/// `[queues.groups]`: fair groups. A task's group is its envelope's `group` (1 to [`MAX_GROUP_BYTES`] bytes);
/// tasks without one form the group with the empty name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Groups {
    /// At most so many tasks of one group taken and not yet settled at once, across every daemon.
    pub max_running: Option<usize>,
    /// At most so many starts of one group in any window of each of these lengths, across every daemon.
    pub rate_limit: Vec<rate::RateLimit>,
    /// A group's share of turns (absent: 1), by group name, in the config's order.
    pub weights: Vec<(String, u32)>,
}

/// The longest group name, in bytes (Temporal's bound for its fairness keys): a longer one, or an empty one, makes
/// the envelope malformed.
pub const MAX_GROUP_BYTES: usize = 64;

/// The largest weight of a group: a turn takes up to its weight in tasks at once.
pub const MAX_GROUP_WEIGHT: u32 = 1000;

/// The most `[[queues.limits]]` entries of one queue: each adds keys to every claim of the queue.
pub const MAX_TYPE_LIMITS: usize = 64;

/// The largest `max_running`.
pub const MAX_RUNNING: usize = 1_000_000;

/// The largest `workers`: each is a thread of the daemon's.
pub const MAX_WORKERS: usize = 1024;

/// The largest fixed `prefetch`: claimed tasks waiting for a worker, each held in the daemon's memory.
pub const MAX_PREFETCH: usize = 100_000;

/// The largest `max_held`, the bound on a lane's tasks in memory.
pub const MAX_HELD_LIMIT: usize = 200_000;

/// The largest `retry_times`.
pub const MAX_RETRY_TIMES: u32 = 1000;

/// The largest `dead_max`, a dead-letter list's length.
pub const DEAD_MAX_LIMIT: usize = 100_000_000;

/// The largest `worker_nice`: Linux's niceness runs from 0 to 19 above the daemon's.
pub const MAX_WORKER_NICE: i32 = 19;

/// The largest `catch_up_max` of a schedule: the missed firings one catch-up fires.
pub const MAX_CATCH_UP: usize = 100_000;

/// The shortest `report_interval` and `lag_warn`: each costs a stats read of every queue per period.
pub const MIN_WATCH_INTERVAL: Duration = Duration::from_millis(100);

#[cfg(test)]
mod tests;
