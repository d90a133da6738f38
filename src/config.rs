//! The TOML config: parsed into `Raw*` structs, then validated into [`Config`].
//!
//! Parsing and validating are separate steps (ripgrep's LowArgs -> HiArgs, sccache's raw config): serde checks
//! shapes and rejects unknown keys, then [`RawConfig::validate`] checks meaning. Every raw struct is destructured
//! there, so a new key cannot be forgotten. Every error names the file, line, column and key, and says what would
//! be valid. Relative paths are resolved against the config file's directory, not the working directory, so a
//! config means the same thing whoever starts the daemon.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

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
    pub key_prefix: String,
    pub connect_timeout: Duration,
    /// How long a reply may take before the call is given up for lost (then retried, or resolved when it may
    /// have run). Blocking calls wait this much beyond their own timeout.
    pub io_timeout: Duration,
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
            .field("key_prefix", &self.key_prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("io_timeout", &self.io_timeout)
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
    /// The most tasks one claim takes.
    pub batch: usize,
    /// How many claimed tasks may wait for a worker, beyond one per idle worker.
    pub prefetch: usize,
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

    /// Redis connections the daemon holds at once: per queue a fetcher, an acker and a delay poller; per daemon
    /// the monitor, the heartbeat, the scheduler, the metrics endpoint and, when it runs, the queue reporter.
    pub fn connections_needed(&self) -> u32 {
        3 * self.queues.len() as u32 + 4 + u32::from(self.reports())
    }

    /// Whether the daemon runs its queue reporter: `[daemon] report_interval` is set or a queue has `lag_warn`.
    pub fn reports(&self) -> bool {
        self.daemon.report_interval.is_some() || self.queues.iter().any(|q| q.lag_warn.is_some())
    }
}

/// The config key a shape error is at, from serde_path_to_error's path: without the segments `toml::Spanned`
/// adds, and with a plugin's name (a map key that is itself spanned, so the path only has `?` for it) read from
/// the nearest `[plugins.NAME]` header before the error.
fn key_path(path: &str, before: &str) -> String {
    let path = path.replace(".$__serde_spanned_private_value", "");
    if !path.starts_with("plugins.?") {
        return path;
    }
    let name = before.lines().rev().find_map(|line| {
        let header = line.trim().strip_prefix("[plugins.")?;
        Some(header.split(']').next()?.trim().to_string())
    });
    match name {
        Some(name) => path.replacen('?', &name, 1),
        None => path.replacen(".?", "", 1),
    }
}

/// A serde shape error in words an operator reads: the key path first ("queues[0].workers: ..."), Rust's type
/// names as TOML's ("an integer", not "i64"), and for a misspelled key the valid one it most resembles.
fn shape_message(key: &str, message: &str) -> String {
    let (key, message) = match message.strip_prefix("unknown field `") {
        // The path ends with the unknown key itself: name the table that holds it.
        Some(rest) => (
            key.rsplit_once('.').map_or("", |(table, _)| table),
            unknown_key(rest).unwrap_or_else(|| message.to_string()),
        ),
        None if is_duration_key(key) && message.ends_with("expected a string") => (
            key,
            format!(
                "{}; a duration is a string with a unit, such as \"30s\", \"5m\" or \"250ms\"",
                toml_words(message)
            ),
        ),
        None => (key, toml_words(message)),
    };
    match key {
        "" | "." => message,
        key => format!("{key}: {message}"),
    }
}

/// Whether the key at `path` holds a duration ("30s"), for the hint on a number given instead.
fn is_duration_key(path: &str) -> bool {
    const DURATIONS: [&str; 14] = [
        "connect_timeout",
        "io_timeout",
        "wait_timeout",
        "shutdown_grace",
        "report_interval",
        "lease_timeout",
        "execution_timeout",
        "alive_timeout",
        "backoff",
        "backoff_max",
        "idle_poll",
        "lag_warn",
        "every",
        "misfire_grace",
    ];
    let key = path.rsplit('.').next().unwrap_or(path);
    DURATIONS.contains(&key)
}

/// "unknown field `worker`, expected one of `name`, `workers`, ..." (the text after "unknown field `") as
/// "unknown key `worker`; did you mean `workers`? (valid keys: ...)".
fn unknown_key(rest: &str) -> Option<String> {
    let (unknown, rest) = rest.split_once('`')?;
    let valid: Vec<&str> = rest
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|name| !name.is_empty())
        .collect();
    let listed = valid
        .iter()
        .map(|name| format!("`{name}`"))
        .collect::<Vec<_>>()
        .join(", ");
    Some(match did_you_mean(unknown, &valid) {
        Some(near) => {
            format!("unknown key `{unknown}`; did you mean `{near}`? (valid keys: {listed})")
        }
        None => format!("unknown key `{unknown}` (valid keys: {listed})"),
    })
}

/// The candidate closest to `word`, when it is close enough to be a typo of it: a few edits apart for its
/// length, whatever the case (`Workers`, `retries_times`, `wokrers`).
fn did_you_mean<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let word = word.to_ascii_lowercase();
    candidates
        .iter()
        .map(|candidate| (strsim::damerau_levenshtein(&word, candidate), *candidate))
        .filter(|(distance, candidate)| *distance <= (candidate.len().max(word.len()) / 3).max(1))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate)
}

/// Rust's names for what serde expected, as a TOML user would say them.
fn toml_words(message: &str) -> String {
    const WORDS: [(&str, &str); 12] = [
        ("expected i64", "expected an integer"),
        ("expected u64", "expected an integer"),
        ("expected u32", "expected an integer"),
        ("expected u16", "expected an integer"),
        ("expected usize", "expected an integer"),
        ("expected a sequence", "expected an array"),
        ("expected a map", "expected a table"),
        ("expected struct", "expected a table, for"),
        ("invalid type: sequence", "invalid type: array"),
        ("invalid type: map", "invalid type: table"),
        ("expected a boolean", "expected true or false"),
        ("invalid type: floating point", "invalid type: float"),
    ];
    let mut message = message.to_string();
    for (rust, toml) in WORDS {
        message = message.replace(rust, toml);
    }
    message
}

/// The config text and its file, to turn byte spans into "file:line:column".
struct Source<'a> {
    path: &'a Path,
    text: &'a str,
}

impl Source<'_> {
    fn location(&self, span: &Range<usize>) -> String {
        let start = span.start.min(self.text.len());
        let before = &self.text[..start];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        format!("{}:{line}:{column}", self.path.display())
    }

    fn error(&self, span: Range<usize>, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            location: self.location(&span),
            message: message.into(),
        }
    }

    fn base_dir(&self) -> PathBuf {
        match self.path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
            _ => PathBuf::from("."),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    redis: RawRedis,
    #[serde(default)]
    daemon: RawDaemon,
    #[serde(default)]
    queues: Vec<Spanned<RawQueue>>,
    #[serde(default)]
    plugins: BTreeMap<Spanned<String>, Spanned<RawPlugin>>,
    #[serde(default)]
    schedules: Vec<Spanned<RawSchedule>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSchedule {
    name: Option<Spanned<String>>,
    queue: Option<Spanned<String>>,
    #[serde(rename = "type")]
    kind: Option<Spanned<String>>,
    data: Option<toml::Value>,
    cron: Option<Spanned<String>>,
    every: Option<Spanned<String>>,
    priority: Option<Spanned<String>>,
    missed: Option<Spanned<String>>,
    misfire_grace: Option<Spanned<String>>,
    catch_up_max: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawRedis {
    url: Option<Spanned<String>>,
    cluster: Option<Spanned<Vec<Spanned<String>>>>,
    sentinel: Option<Spanned<Vec<Spanned<String>>>>,
    sentinel_master: Option<Spanned<String>>,
    username: Option<Spanned<String>>,
    tls_ca_file: Option<Spanned<String>>,
    tls_cert_file: Option<Spanned<String>>,
    tls_key_file: Option<Spanned<String>>,
    wait_replicas: Option<Spanned<u32>>,
    wait_timeout: Option<Spanned<String>>,
    password_env: Option<Spanned<String>>,
    password_file: Option<Spanned<String>>,
    pool_size: Option<Spanned<u32>>,
    key_prefix: Option<Spanned<String>>,
    connect_timeout: Option<Spanned<String>>,
    io_timeout: Option<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDaemon {
    plugins_dir: Option<Spanned<String>>,
    shutdown_grace: Option<Spanned<String>>,
    metrics_addr: Option<Spanned<String>>,
    log_level: Option<Spanned<String>>,
    log_format: Option<Spanned<String>>,
    report_interval: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQueue {
    name: Option<Spanned<String>>,
    mode: Option<Spanned<String>>,
    priorities: Option<Spanned<Vec<String>>>,
    default_priority: Option<Spanned<String>>,
    workers: Option<Spanned<i64>>,
    batch: Option<Spanned<i64>>,
    prefetch: Option<Spanned<i64>>,
    lease_timeout: Option<Spanned<String>>,
    execution_timeout: Option<Spanned<String>>,
    alive_timeout: Option<Spanned<String>>,
    retry_times: Option<Spanned<i64>>,
    on_handler_error: Option<Spanned<String>>,
    backoff: Option<Spanned<String>>,
    backoff_max: Option<Spanned<String>>,
    dead_max: Option<Spanned<i64>>,
    idle_poll: Option<Spanned<String>>,
    foreign_type_field: Option<Spanned<String>>,
    delay_batch: Option<Spanned<i64>>,
    max_task_bytes: Option<Spanned<i64>>,
    lag_warn: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlugin {
    file: Option<Spanned<String>>,
    config: Option<toml::Table>,
}

/// Default values, in one place so docs/CONFIG.md can be checked against them.
pub mod defaults {
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
    pub const BATCH: usize = 100;
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

/// The largest claim batch: Lua's `unpack` fails past ~8,000 values and a claim passes two per task.
pub const MAX_BATCH: usize = 1000;

fn parse_duration(
    source: &Source<'_>,
    key: &str,
    value: &Spanned<String>,
) -> Result<Duration, ConfigError> {
    let duration = humantime::parse_duration(value.get_ref()).map_err(|error| {
        source.error(
            value.span(),
            format!("{key}: {:?} is not a duration ({error}); write it like \"250ms\", \"30s\", \"5m\" or \"1h\"", value.get_ref()),
        )
    })?;
    // Every duration ends up added to a clock or turned into milliseconds: bound it far beyond any use, well
    // within what that arithmetic holds.
    if duration > MAX_DURATION {
        return Err(source.error(
            value.span(),
            format!(
                "{key}: {:?} is too long; durations are at most 10 years (\"3650days\")",
                value.get_ref(),
            ),
        ));
    }
    Ok(duration)
}

/// A duration of at least `min` (a period the daemon polls Redis at: a zero or tiny one would spin).
fn at_least(
    source: &Source<'_>,
    key: &str,
    value: &Spanned<String>,
    min: Duration,
) -> Result<Duration, ConfigError> {
    let duration = parse_duration(source, key, value)?;
    if duration < min {
        return Err(source.error(
            value.span(),
            format!(
                "{key}: {:?} is too short; use at least {}",
                value.get_ref(),
                humantime::format_duration(min)
            ),
        ));
    }
    Ok(duration)
}

/// The shortest `report_interval` and `lag_warn`: each costs a stats read of every queue per period.
pub const MIN_WATCH_INTERVAL: Duration = Duration::from_millis(100);

/// The longest duration a config may hold: ten years.
const MAX_DURATION: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// A small regular file's text: a password file is a line, and reading a device (`/dev/zero`) or a FIFO would
/// never end.
fn read_small_file(path: &Path) -> std::io::Result<String> {
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

fn duration_or(
    source: &Source<'_>,
    key: &str,
    value: &Option<Spanned<String>>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match value {
        Some(value) => parse_duration(source, key, value),
        None => Ok(default),
    }
}

fn ranged(
    source: &Source<'_>,
    key: &str,
    value: &Spanned<i64>,
    range: Range<i64>,
) -> Result<i64, ConfigError> {
    let n = *value.get_ref();
    if range.contains(&n) {
        Ok(n)
    } else {
        Err(source.error(
            value.span(),
            format!(
                "{key}: {n} is out of range; it must be between {} and {}",
                range.start,
                range.end - 1
            ),
        ))
    }
}

/// Names that end up inside Redis keys (queues, priority levels) are kept to a safe alphabet.
fn check_name(
    source: &Source<'_>,
    key: &str,
    value: &Spanned<String>,
    what: &str,
) -> Result<(), ConfigError> {
    let name = value.get_ref();
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if valid {
        Ok(())
    } else {
        Err(source.error(
            value.span(),
            format!("{key}: {name:?} is not a valid {what}; use 1 to 64 characters from a-z, A-Z, 0-9, '_', '-', '.'"),
        ))
    }
}

fn one_of<T: Copy>(
    source: &Source<'_>,
    key: &str,
    value: &Spanned<String>,
    choices: &[(&str, T)],
) -> Result<T, ConfigError> {
    choices
        .iter()
        .find(|(name, _)| name == value.get_ref())
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            let names: Vec<String> = choices
                .iter()
                .map(|(name, _)| format!("{name:?}"))
                .collect();
            let valid: Vec<&str> = choices.iter().map(|(name, _)| *name).collect();
            let hint = did_you_mean(value.get_ref(), &valid)
                .map_or(String::new(), |near| format!("; did you mean {near:?}?"));
            source.error(
                value.span(),
                format!(
                    "{key}: {:?} is not one of {}{hint}",
                    value.get_ref(),
                    names.join(", ")
                ),
            )
        })
}

impl RawConfig {
    fn validate(self, source: &Source<'_>) -> Result<Config, ConfigError> {
        let RawConfig {
            redis,
            daemon,
            queues,
            plugins,
            schedules,
        } = self;

        let base = source.base_dir();
        let pool_size_span = redis.pool_size.as_ref().map_or(0..0, Spanned::span);
        let redis = redis.validate(source, &base)?;
        let daemon = daemon.validate(source, &base)?;

        let mut seen = HashSet::new();
        let mut validated_queues = Vec::with_capacity(queues.len());
        for (index, queue) in queues.into_iter().enumerate() {
            let span = queue.span();
            let name_span = queue
                .get_ref()
                .name
                .as_ref()
                .map_or(span.clone(), Spanned::span);
            let queue = queue.into_inner().validate(source, index, span)?;
            if !seen.insert(queue.name.clone()) {
                return Err(source.error(
                    name_span,
                    format!(
                        "queues[{index}].name: queue {:?} is defined twice; give each [[queues]] its own name",
                        queue.name
                    ),
                ));
            }
            validated_queues.push(queue);
        }

        let mut validated_plugins = Vec::with_capacity(plugins.len());
        for (name, plugin) in plugins {
            check_name(source, "plugins", &name, "plugin name")?;
            validated_plugins.push(plugin.get_ref().validate(
                source,
                name.get_ref(),
                plugin.span(),
                &daemon.plugins_dir,
            )?);
        }

        let mut seen_schedules = HashSet::new();
        let mut validated_schedules = Vec::with_capacity(schedules.len());
        for (index, schedule) in schedules.into_iter().enumerate() {
            let span = schedule.span();
            let schedule =
                schedule
                    .into_inner()
                    .validate(source, index, span.clone(), &validated_queues)?;
            if !seen_schedules.insert(schedule.name.clone()) {
                return Err(source.error(
                    span,
                    format!(
                        "schedules[{index}].name: schedule {:?} is defined twice",
                        schedule.name
                    ),
                ));
            }
            validated_schedules.push(schedule);
        }

        let mut config = Config {
            path: source.path.to_owned(),
            redis,
            daemon,
            queues: validated_queues,
            plugins: validated_plugins,
            schedules: validated_schedules,
        };
        if config.redis.pool_size == 0 {
            // Two more than the daemon holds, for `stats` and short-lived commands.
            config.redis.pool_size = config.connections_needed() + 2;
        } else if config.redis.pool_size < config.connections_needed() {
            return Err(source.error(
                pool_size_span,
                format!(
                    "redis.pool_size: {} is too small for {} queue(s): the daemon holds 3 connections per queue and 4 \
                     more, so set pool_size to at least {}",
                    config.redis.pool_size,
                    config.queues.len(),
                    config.connections_needed()
                ),
            ));
        }
        Ok(config)
    }
}

impl RawRedis {
    fn validate(self, source: &Source<'_>, base: &Path) -> Result<RedisConfig, ConfigError> {
        let RawRedis {
            url,
            cluster,
            sentinel,
            sentinel_master,
            username,
            tls_ca_file,
            tls_cert_file,
            tls_key_file,
            wait_replicas,
            wait_timeout,
            password_env,
            password_file,
            pool_size,
            key_prefix,
            connect_timeout,
            io_timeout,
        } = self;
        let url_text = url
            .as_ref()
            .map_or(defaults::REDIS_URL.to_string(), |u| u.get_ref().clone());
        if let Some(url) = &url {
            let scheme_ok = ["redis://", "rediss://", "unix://", "redis+unix://"]
                .iter()
                .any(|s| url.get_ref().starts_with(s));
            if !scheme_ok {
                return Err(source.error(
                    url.span(),
                    format!(
                        "redis.url: {:?} is not a Redis URL; write redis://HOST:PORT/DB, rediss://HOST:PORT/DB (TLS) \
                         or unix:///path/to/redis.sock",
                        redact_url(url.get_ref())
                    ),
                ));
            }
        }
        let deployment = deployment(source, &url, cluster, sentinel, sentinel_master)?;
        let username = match username {
            Some(name) if name.get_ref().is_empty() => {
                return Err(source.error(
                    name.span(),
                    "redis.username: is empty; leave it out for the default user",
                ));
            }
            other => other.map(Spanned::into_inner),
        };
        let tls = tls_files(source, base, tls_ca_file, tls_cert_file, tls_key_file)?;
        let wait_timeout_value = duration_or(
            source,
            "redis.wait_timeout",
            &wait_timeout,
            defaults::WAIT_TIMEOUT,
        )?;
        if let Some(value) = &wait_timeout
            && (wait_timeout_value.is_zero() || wait_timeout_value > Duration::from_secs(60))
        {
            // WAIT's 0 means forever: a replica that is down would stop every claim and settle.
            return Err(source.error(
                value.span(),
                "redis.wait_timeout: must be between 1ms and 1m; a change that no replica has by then counts \
                 as not replicated, and is retried",
            ));
        }
        let wait_replicas = wait_replicas.map_or(0, Spanned::into_inner);
        let password = match (&password_env, &password_file) {
            (Some(_), Some(file)) => {
                return Err(source.error(
                    file.span(),
                    "redis.password_file: set password_env or password_file, not both",
                ));
            }
            (Some(var), None) => Some(std::env::var(var.get_ref()).map_err(|_| {
                source.error(
                    var.span(),
                    format!(
                        "redis.password_env: environment variable {} is not set",
                        var.get_ref()
                    ),
                )
            })?),
            (None, Some(file)) => {
                let path = base.join(file.get_ref());
                let text = read_small_file(&path).map_err(|error| {
                    source.error(
                        file.span(),
                        format!(
                            "redis.password_file: cannot read {}: {error}",
                            path.display()
                        ),
                    )
                })?;
                Some(text.trim_end_matches(['\r', '\n']).to_string())
            }
            (None, None) => None,
        };
        let pool_size = match &pool_size {
            Some(size) if *size.get_ref() == 0 => {
                return Err(source.error(size.span(), "redis.pool_size: must be at least 1; leave it out to size the pool from the queues"));
            }
            Some(size) => *size.get_ref(),
            // Filled in once the number of queues is known.
            None => 0,
        };
        let key_prefix = match key_prefix {
            Some(prefix) => {
                check_name(source, "redis.key_prefix", &prefix, "key prefix")?;
                prefix.into_inner()
            }
            None => defaults::KEY_PREFIX.to_string(),
        };
        let connect_timeout = duration_or(
            source,
            "redis.connect_timeout",
            &connect_timeout,
            defaults::CONNECT_TIMEOUT,
        )?;
        let io_timeout_value = duration_or(
            source,
            "redis.io_timeout",
            &io_timeout,
            defaults::IO_TIMEOUT,
        )?;
        if let Some(value) = &io_timeout {
            if io_timeout_value < Duration::from_millis(100)
                || io_timeout_value > Duration::from_secs(300)
            {
                return Err(source.error(
                    value.span(),
                    "redis.io_timeout: must be between 100ms and 5m; it should outlast the slowest command your \
                     Redis runs, and bounds how long a stalled Redis holds a call",
                ));
            }
        }
        let tls_span = tls.1;
        let config = RedisConfig {
            url: url_text,
            deployment,
            username,
            tls: tls.0,
            wait_replicas,
            wait_timeout: wait_timeout_value,
            password,
            pool_size,
            key_prefix,
            connect_timeout,
            io_timeout: io_timeout_value,
        };
        if let Some(span) = tls_span
            && !config.uses_tls()
        {
            return Err(source.error(
                span,
                "redis: TLS files are set but no URL is rediss://; write rediss://HOST:PORT to reach Redis over TLS",
            ));
        }
        Ok(config)
    }
}

/// Which deployment `url`, `cluster` and `sentinel` name: at most one of them, with `sentinel_master` exactly
/// when `sentinel`.
fn deployment(
    source: &Source<'_>,
    url: &Option<Spanned<String>>,
    cluster: Option<Spanned<Vec<Spanned<String>>>>,
    sentinel: Option<Spanned<Vec<Spanned<String>>>>,
    sentinel_master: Option<Spanned<String>>,
) -> Result<Deployment, ConfigError> {
    if let (Some(_), Some(cluster)) = (url, &cluster) {
        return Err(source.error(
            cluster.span(),
            "redis.cluster: set url (one Redis) or cluster (seed nodes of a Redis Cluster), not both",
        ));
    }
    if let (Some(_), Some(sentinel)) = (url, &sentinel) {
        return Err(source.error(
            sentinel.span(),
            "redis.sentinel: set url (one Redis) or sentinel (the Sentinels of a master), not both",
        ));
    }
    if let (Some(_), Some(sentinel)) = (&cluster, &sentinel) {
        return Err(source.error(
            sentinel.span(),
            "redis.sentinel: set cluster or sentinel, not both (a Redis Cluster fails over by itself)",
        ));
    }
    if let (None, Some(master)) = (&sentinel, &sentinel_master) {
        return Err(source.error(
            master.span(),
            "redis.sentinel_master: only with sentinel = [\"redis://HOST:26379\", ...], the Sentinels to ask",
        ));
    }
    let seeds = |key: &str,
                 list: Spanned<Vec<Spanned<String>>>|
     -> Result<Vec<String>, ConfigError> {
        if list.get_ref().is_empty() {
            return Err(source.error(
                list.span(),
                format!("redis.{key}: lists no node; write [\"redis://HOST:PORT\", ...]"),
            ));
        }
        let tls = list.get_ref()[0].get_ref().starts_with("rediss://");
        for seed in list.get_ref() {
            let text = seed.get_ref();
            let scheme = if text.starts_with("rediss://") {
                Some(true)
            } else if text.starts_with("redis://") {
                Some(false)
            } else {
                None
            };
            match scheme {
                None => {
                    return Err(source.error(
                        seed.span(),
                        format!(
                            "redis.{key}: {:?} is not a node URL; write redis://HOST:PORT or rediss://HOST:PORT (TLS)",
                            redact_url(text)
                        ),
                    ));
                }
                Some(seed_tls) if seed_tls != tls => {
                    return Err(source.error(
                        seed.span(),
                        format!("redis.{key}: mixes redis:// and rediss:// seeds; TLS is for every node or none"),
                    ));
                }
                Some(_) => {}
            }
            let db = text
                .split_once("://")
                .and_then(|(_, rest)| rest.split_once('/'))
                .map(|(_, db)| db);
            if key == "cluster" && db.is_some_and(|db| !db.is_empty() && db != "0") {
                return Err(source.error(
                    seed.span(),
                    "redis.cluster: a Redis Cluster has database 0 only; drop the /DB of the URL",
                ));
            }
        }
        Ok(list
            .into_inner()
            .into_iter()
            .map(Spanned::into_inner)
            .collect())
    };
    match (cluster, sentinel) {
        (Some(cluster), _) => Ok(Deployment::Cluster {
            seeds: seeds("cluster", cluster)?,
        }),
        (None, Some(sentinel)) => {
            let span = sentinel.span();
            let seeds = seeds("sentinel", sentinel)?;
            match sentinel_master {
                Some(master) if !master.get_ref().is_empty() => Ok(Deployment::Sentinel {
                    seeds,
                    master: master.into_inner(),
                }),
                _ => Err(source.error(
                    span,
                    "redis.sentinel: needs sentinel_master = \"NAME\", the master's name in the Sentinels' config",
                )),
            }
        }
        (None, None) => Ok(Deployment::Single),
    }
}

/// Reads the TLS files (PEM, relative to the config's directory); also returns where the first of them was set,
/// for the error of TLS files without a `rediss://` URL.
fn tls_files(
    source: &Source<'_>,
    base: &Path,
    ca_file: Option<Spanned<String>>,
    cert_file: Option<Spanned<String>>,
    key_file: Option<Spanned<String>>,
) -> Result<(TlsFiles, Option<std::ops::Range<usize>>), ConfigError> {
    let first = [&ca_file, &cert_file, &key_file]
        .into_iter()
        .flatten()
        .map(Spanned::span)
        .next();
    let read = |key: &str, file: &Spanned<String>, marker: &str| -> Result<Vec<u8>, ConfigError> {
        let path = base.join(file.get_ref());
        let text = read_small_file(&path).map_err(|error| {
            source.error(
                file.span(),
                format!("redis.{key}: cannot read {}: {error}", path.display()),
            )
        })?;
        if !text.contains("-----BEGIN ") || !text.contains(marker) {
            return Err(source.error(
                file.span(),
                format!(
                    "redis.{key}: {} holds no PEM {}; give the PEM file (-----BEGIN ...-----)",
                    path.display(),
                    marker.trim_end_matches('-')
                ),
            ));
        }
        Ok(text.into_bytes())
    };
    let ca = ca_file
        .as_ref()
        .map(|file| read("tls_ca_file", file, "CERTIFICATE-"))
        .transpose()?;
    let client = match (&cert_file, &key_file) {
        (Some(cert), Some(key)) => Some((
            read("tls_cert_file", cert, "CERTIFICATE-")?,
            read("tls_key_file", key, "PRIVATE KEY-")?,
        )),
        (Some(cert), None) => {
            return Err(source.error(
                cert.span(),
                "redis.tls_cert_file: needs tls_key_file too (a client certificate and its key, both or neither)",
            ));
        }
        (None, Some(key)) => {
            return Err(source.error(
                key.span(),
                "redis.tls_key_file: needs tls_cert_file too (a client certificate and its key, both or neither)",
            ));
        }
        (None, None) => None,
    };
    Ok((TlsFiles { ca, client }, first))
}

impl RawDaemon {
    fn validate(self, source: &Source<'_>, base: &Path) -> Result<DaemonConfig, ConfigError> {
        let RawDaemon {
            plugins_dir,
            shutdown_grace,
            metrics_addr,
            log_level,
            log_format,
            report_interval,
        } = self;
        let plugins_dir =
            base.join(plugins_dir.map_or(defaults::PLUGINS_DIR.to_string(), Spanned::into_inner));
        let shutdown_grace = duration_or(
            source,
            "daemon.shutdown_grace",
            &shutdown_grace,
            defaults::SHUTDOWN_GRACE,
        )?;
        let metrics_addr = match metrics_addr {
            Some(addr) => Some(addr.get_ref().parse::<SocketAddr>().map_err(|_| {
                source.error(
                    addr.span(),
                    format!("daemon.metrics_addr: {:?} is not an address; write it like \"127.0.0.1:9464\"", addr.get_ref()),
                )
            })?),
            None => None,
        };
        let log_level = match log_level {
            Some(level) => {
                check_log_filter(level.get_ref()).map_err(|why| {
                    source.error(level.span(), format!("daemon.log_level: {why}"))
                })?;
                level.into_inner()
            }
            None => defaults::LOG_LEVEL.to_string(),
        };
        let log_format = match log_format.as_ref().map(|f| (f, f.get_ref().as_str())) {
            None | Some((_, "text")) => LogFormat::Text,
            Some((_, "json")) => LogFormat::Json,
            Some((format, other)) => {
                return Err(source.error(
                    format.span(),
                    format!(
                        "daemon.log_format: {other:?} is not a format; write \"text\" or \"json\""
                    ),
                ));
            }
        };
        let report_interval = match &report_interval {
            Some(value) => Some(at_least(
                source,
                "daemon.report_interval",
                value,
                MIN_WATCH_INTERVAL,
            )?),
            None => None,
        };
        Ok(DaemonConfig {
            plugins_dir,
            shutdown_grace,
            metrics_addr,
            log_level,
            log_format,
            report_interval,
        })
    }
}

impl RawQueue {
    fn validate(
        self,
        source: &Source<'_>,
        index: usize,
        span: Range<usize>,
    ) -> Result<QueueConfig, ConfigError> {
        let RawQueue {
            name,
            mode,
            priorities,
            default_priority,
            workers,
            batch,
            prefetch,
            lease_timeout,
            execution_timeout,
            alive_timeout,
            retry_times,
            on_handler_error,
            backoff,
            backoff_max,
            dead_max,
            idle_poll,
            foreign_type_field,
            delay_batch,
            max_task_bytes,
            lag_warn,
        } = self;

        let key = |field: &str| format!("queues[{index}].{field}");

        let name = name.ok_or_else(|| {
            source.error(
                span.clone(),
                format!("{}: every queue needs a name", key("name")),
            )
        })?;
        check_name(source, &key("name"), &name, "queue name")?;
        let mode = mode.ok_or_else(|| {
            source.error(
                span.clone(),
                format!(
                    "{}: queue {:?} has no mode; write mode = \"safe\" (at-least-once) or mode = \"default\" (fast; a \
                     task whose daemon dies is lost)",
                    key("mode"),
                    name.get_ref()
                ),
            )
        })?;
        let mode = one_of(
            source,
            &key("mode"),
            &mode,
            &[("default", Mode::Default), ("safe", Mode::Safe)],
        )?;

        let priorities = match priorities {
            Some(list) => {
                let levels = list.get_ref();
                if levels.is_empty() {
                    return Err(source.error(
                        list.span(),
                        format!("{}: list at least one level", key("priorities")),
                    ));
                }
                let mut seen = HashSet::new();
                for level in levels {
                    let spanned = Spanned::new(list.span(), level.clone());
                    check_name(source, &key("priorities"), &spanned, "priority level")?;
                    if !seen.insert(level) {
                        return Err(source.error(
                            list.span(),
                            format!("{}: level {level:?} is listed twice", key("priorities")),
                        ));
                    }
                }
                levels.clone()
            }
            None => vec![defaults::PRIORITY.to_string()],
        };
        // The middle level for an odd count, the first of the two middle ones otherwise: "normal" for
        // ["high", "normal", "low"], "high" for ["high", "low"].
        let default_priority = match default_priority {
            Some(level) => priorities
                .iter()
                .position(|p| p == level.get_ref())
                .ok_or_else(|| {
                    source.error(
                        level.span(),
                        format!(
                            "{}: {:?} is not one of the queue's priorities {priorities:?}",
                            key("default_priority"),
                            level.get_ref()
                        ),
                    )
                })?,
            None => (priorities.len() - 1) / 2,
        };

        let workers = match &workers {
            Some(w) => ranged(source, &key("workers"), w, 1..1025)? as usize,
            None => defaults::WORKERS,
        };
        let batch = match &batch {
            Some(b) => ranged(source, &key("batch"), b, 1..MAX_BATCH as i64 + 1)? as usize,
            None => defaults::BATCH,
        };
        let prefetch = match &prefetch {
            Some(p) => ranged(source, &key("prefetch"), p, 0..100_001)? as usize,
            None => workers,
        };
        let lease_timeout = duration_or(
            source,
            &key("lease_timeout"),
            &lease_timeout,
            defaults::LEASE_TIMEOUT,
        )?;
        if lease_timeout < Duration::from_millis(300) {
            return Err(source.error(
                span.clone(),
                format!("{}: {lease_timeout:?} is too short; the heartbeat renews every third of it, use at least 300ms", key("lease_timeout")),
            ));
        }
        let execution_timeout = Some(duration_or(
            source,
            &key("execution_timeout"),
            &execution_timeout,
            defaults::EXECUTION_TIMEOUT,
        )?)
        .filter(|d| !d.is_zero());
        let alive_timeout = match &alive_timeout {
            Some(value) => {
                Some(parse_duration(source, &key("alive_timeout"), value)?).filter(|d| !d.is_zero())
            }
            None => None,
        };
        let retry_times = match &retry_times {
            Some(r) => ranged(source, &key("retry_times"), r, 0..1001)? as u32,
            None => defaults::RETRY_TIMES,
        };
        let on_handler_error = match &on_handler_error {
            Some(value) => one_of(
                source,
                &key("on_handler_error"),
                value,
                &[
                    ("retry", OnHandlerError::Retry),
                    ("finish", OnHandlerError::Finish),
                    ("dead", OnHandlerError::Dead),
                ],
            )?,
            None => OnHandlerError::Retry,
        };
        let backoff_value = duration_or(source, &key("backoff"), &backoff, defaults::BACKOFF)?;
        let backoff_max = duration_or(
            source,
            &key("backoff_max"),
            &backoff_max,
            defaults::BACKOFF_MAX,
        )?;
        if backoff_max < backoff_value {
            return Err(source.error(
                span.clone(),
                format!(
                    "{}: must not be shorter than backoff ({backoff_value:?})",
                    key("backoff_max")
                ),
            ));
        }
        let dead_max = match &dead_max {
            Some(d) => ranged(source, &key("dead_max"), d, 1..100_000_001)? as usize,
            None => defaults::DEAD_MAX,
        };
        let idle_poll = duration_or(source, &key("idle_poll"), &idle_poll, defaults::IDLE_POLL)?;
        if idle_poll < Duration::from_millis(10) || idle_poll > Duration::from_secs(5) {
            return Err(source.error(span, format!("{}: must be between 10ms and 5s (it also bounds how long a stopping daemon waits for its fetchers)", key("idle_poll"))));
        }
        let foreign_type_field = match foreign_type_field {
            Some(field) if field.get_ref().is_empty() || field.get_ref() == "type" => {
                return Err(source.error(
                    field.span(),
                    format!(
                        "{}: name the field of a foreign payload that holds its task type, e.g. \"callback\" (not \
                         \"type\", which makes it an envelope)",
                        key("foreign_type_field")
                    ),
                ));
            }
            other => other.map(Spanned::into_inner),
        };
        let delay_batch = match &delay_batch {
            Some(b) => ranged(source, &key("delay_batch"), b, 1..MAX_BATCH as i64 + 1)? as usize,
            None => MAX_BATCH,
        };

        let max_task_bytes = match &max_task_bytes {
            Some(b) => ranged(
                source,
                &key("max_task_bytes"),
                b,
                1024..defaults::MAX_TASK_BYTES_LIMIT as i64 + 1,
            )? as usize,
            None => defaults::MAX_TASK_BYTES,
        };
        let lag_warn = match &lag_warn {
            Some(value) => Some(at_least(
                source,
                &key("lag_warn"),
                value,
                MIN_WATCH_INTERVAL,
            )?),
            None => None,
        };

        Ok(QueueConfig {
            name: name.into_inner(),

            mode,
            priorities,
            default_priority,
            workers,
            batch,
            prefetch,
            lease_timeout,
            execution_timeout,
            alive_timeout,
            retry_times,
            on_handler_error,
            backoff: backoff_value,
            backoff_max,
            dead_max,
            idle_poll,
            foreign_type_field,
            delay_batch,
            max_task_bytes,
            lag_warn,
        })
    }
}

impl RawSchedule {
    fn validate(
        self,
        source: &Source<'_>,
        index: usize,
        span: Range<usize>,
        queues: &[QueueConfig],
    ) -> Result<ScheduleConfig, ConfigError> {
        let RawSchedule {
            name,
            queue,
            kind,
            data,
            cron,
            every,
            priority,
            missed,
            misfire_grace,
            catch_up_max,
        } = self;
        let key = |field: &str| format!("schedules[{index}].{field}");
        let required = |value: Option<Spanned<String>>, field: &str, example: &str| {
            value.ok_or_else(|| {
                source.error(
                    span.clone(),
                    format!("{}: missing; e.g. {field} = {example}", key(field)),
                )
            })
        };
        let name = required(name, "name", "\"nightly-report\"")?;
        check_name(source, &key("name"), &name, "schedule name")?;
        let queue_name = required(queue, "queue", "\"reports\"")?;
        let queue = queues
            .iter()
            .find(|q| q.name == *queue_name.get_ref())
            .ok_or_else(|| {
                let known: Vec<&str> = queues.iter().map(|q| q.name.as_str()).collect();
                source.error(
                    queue_name.span(),
                    format!(
                        "{}: no queue {:?}; configured queues: {}",
                        key("queue"),
                        queue_name.get_ref(),
                        known.join(", ")
                    ),
                )
            })?;
        let kind = required(kind, "type", "\"report.build\"")?;
        if kind.get_ref().is_empty() {
            return Err(source.error(kind.span(), format!("{}: must not be empty", key("type"))));
        }
        let when = match (cron, every) {
            (Some(cron), None) => When::Cron(cron.get_ref().parse().map_err(|error: String| {
                source.error(cron.span(), format!("{}: {error}", key("cron")))
            })?),
            (None, Some(every)) => {
                let period = parse_duration(source, &key("every"), &every)?;
                if period < Duration::from_secs(1) || period.subsec_nanos() != 0 {
                    return Err(source.error(
                        every.span(),
                        format!("{}: use whole seconds, at least \"1s\"", key("every")),
                    ));
                }
                When::Every(period)
            }
            _ => {
                return Err(source.error(
                    span,
                    format!(
                        "{}: give exactly one of cron = \"0 3 * * *\" (UTC) or every = \"5m\"",
                        key("cron")
                    ),
                ));
            }
        };
        let level = match &priority {
            Some(level) => queue
                .priorities
                .iter()
                .position(|p| p == level.get_ref())
                .ok_or_else(|| {
                    source.error(
                        level.span(),
                        format!(
                            "{}: {:?} is not one of {:?} of queue {}",
                            key("priority"),
                            level.get_ref(),
                            queue.priorities,
                            queue.name
                        ),
                    )
                })?,
            None => queue.default_priority,
        };
        let missed = match &missed {
            Some(value) => one_of(
                source,
                &key("missed"),
                value,
                &[("skip", Missed::Skip), ("catch_up", Missed::CatchUp)],
            )?,
            None => Missed::Skip,
        };
        let misfire_grace = duration_or(
            source,
            &key("misfire_grace"),
            &misfire_grace,
            Duration::from_secs(60),
        )?;
        let catch_up_max = match &catch_up_max {
            Some(n) => ranged(source, &key("catch_up_max"), n, 1..100_001)? as usize,
            None => 100,
        };
        let data_json = match &data {
            Some(value) => {
                serde_json::to_string(&toml_to_json(value)).expect("a JSON value always serializes")
            }
            None => "null".to_string(),
        };
        Ok(ScheduleConfig {
            name: name.into_inner(),
            queue: queue.name.clone(),
            kind: kind.into_inner(),
            data_json,
            when,
            level,
            missed,
            misfire_grace,
            catch_up_max,
        })
    }
}

impl RawPlugin {
    fn validate(
        &self,
        source: &Source<'_>,
        name: &str,
        span: Range<usize>,
        plugins_dir: &Path,
    ) -> Result<PluginConfig, ConfigError> {
        let RawPlugin { file, config } = self;
        let file = file.as_ref().ok_or_else(|| {
            source.error(
                span.clone(),
                format!("plugins.{name}.file: missing; name the plugin's .so file, e.g. file = \"libkmq_{name}.so\""),
            )
        })?;
        let config_json = match config {
            Some(table) => serde_json::to_string(&toml_to_json(&toml::Value::Table(table.clone())))
                .expect("a JSON value always serializes"),
            None => "{}".to_string(),
        };
        Ok(PluginConfig {
            name: name.to_string(),
            file: plugins_dir.join(file.get_ref()),
            config_json,
            location: source.location(&span),
        })
    }
}

/// TOML is a superset of JSON's types but for datetimes, which become RFC 3339 strings.
fn toml_to_json(value: &toml::Value) -> serde_json::Value {
    use serde_json::Value as J;
    match value {
        toml::Value::String(s) => J::String(s.clone()),
        toml::Value::Integer(i) => J::from(*i),
        toml::Value::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
        toml::Value::Boolean(b) => J::Bool(*b),
        toml::Value::Datetime(d) => J::String(d.to_string()),
        toml::Value::Array(items) => J::Array(items.iter().map(toml_to_json).collect()),
        toml::Value::Table(table) => J::Object(
            table
                .iter()
                .map(|(k, v)| (k.clone(), toml_to_json(v)))
                .collect(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse(Path::new("/etc/kmqd/queues.toml"), text).map_err(|e| e.to_string())
    }

    const MINIMAL: &str = "[[queues]]\nname = \"mail\"\nmode = \"safe\"\n";

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let config = parse(MINIMAL).unwrap();
        let queue = &config.queues[0];
        assert_eq!(queue.priorities, ["normal"]);
        assert_eq!(queue.workers, defaults::WORKERS);
        assert_eq!(queue.prefetch, queue.workers);
        assert_eq!(queue.lease_timeout, defaults::LEASE_TIMEOUT);
        assert_eq!(queue.execution_timeout, Some(defaults::EXECUTION_TIMEOUT));
        assert_eq!(queue.alive_timeout, None);
        assert_eq!(queue.lag_warn, None);
        assert_eq!(config.daemon.report_interval, None);
        assert!(!config.reports(), "no reporter unless asked for");
        assert_eq!(config.redis.key_prefix, "kmq");
        assert_eq!(
            config.redis.pool_size,
            config.connections_needed() + 2,
            "sized from the queues when not set"
        );
        assert_eq!(
            config.daemon.plugins_dir,
            PathBuf::from("/usr/lib/kmqd/plugins")
        );
    }

    #[test]
    fn relative_paths_are_resolved_against_the_config_file() {
        let config = parse(
            "[daemon]\nplugins_dir = \"plugins\"\n[plugins.echo]\nfile = \"libkmq_echo.so\"\n",
        )
        .unwrap();
        assert_eq!(
            config.daemon.plugins_dir,
            PathBuf::from("/etc/kmqd/plugins")
        );
        assert_eq!(
            config.plugins[0].file,
            PathBuf::from("/etc/kmqd/plugins/libkmq_echo.so")
        );
        assert_eq!(config.plugins[0].config_json, "{}");
    }

    #[test]
    fn default_priority_is_the_middle_or_first_level() {
        for (levels, expected) in [
            ("[\"a\"]", 0),
            ("[\"a\", \"b\"]", 0),
            ("[\"a\", \"b\", \"c\"]", 1),
            ("[\"a\", \"b\", \"c\", \"d\"]", 1),
        ] {
            let config = parse(&format!("{MINIMAL}priorities = {levels}\n")).unwrap();
            assert_eq!(config.queues[0].default_priority, expected, "for {levels}");
        }
    }

    #[test]
    fn plugin_config_table_becomes_json() {
        let config = parse("[plugins.mail]\nfile = \"/opt/libmail.so\"\nconfig = { smtp = \"127.0.0.1:25\", tries = 2, when = 1979-05-27T07:32:00Z }\n").unwrap();
        let json: serde_json::Value = serde_json::from_str(&config.plugins[0].config_json).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"smtp": "127.0.0.1:25", "tries": 2, "when": "1979-05-27T07:32:00Z"})
        );
    }

    /// Each bad config, and the location and words its error must contain.
    #[test]
    fn bad_configs_name_file_line_key_and_fix() {
        let cases: &[(&str, &str, &[&str])] = &[
            (
                "[redis]\nurl = \"http://x\"\n",
                "queues.toml:2:7",
                &["redis.url", "redis://"],
            ),
            (
                "[redis]\nurl = \"redis://a:1\"\ncluster = [\"redis://b:2\"]\n",
                "queues.toml:3:11",
                &["redis.cluster", "not both"],
            ),
            (
                "[redis]\nsentinel = [\"redis://s:26379\"]\n",
                "queues.toml:2:12",
                &["redis.sentinel", "sentinel_master"],
            ),
            (
                "[redis]\nsentinel_master = \"main\"\n",
                "queues.toml:2:19",
                &["redis.sentinel_master", "only with sentinel"],
            ),
            (
                "[redis]\ncluster = [\"redis://a:1\", \"rediss://b:2\"]\n",
                "queues.toml:2:27",
                &["redis.cluster", "mixes redis:// and rediss://"],
            ),
            (
                "[redis]\ncluster = [\"redis://a:1/3\"]\n",
                "queues.toml:2:12",
                &["redis.cluster", "database 0 only"],
            ),
            (
                "[redis]\ncluster = []\n",
                "queues.toml:2:11",
                &["redis.cluster", "lists no node"],
            ),
            (
                "[redis]\nurl = \"rediss://cache:6380\"\ntls_cert_file = \"/etc/client.pem\"\n",
                "queues.toml:3:17",
                &["redis.tls_cert_file", "tls_key_file too"],
            ),
            (
                "[redis]\nurl = \"rediss://cache:6380\"\ntls_ca_file = \"/nonexistent/ca.pem\"\n",
                "queues.toml:3:15",
                &["redis.tls_ca_file", "cannot read /nonexistent/ca.pem"],
            ),
            (
                "[daemon]\nlog_level = \"warning\"\n",
                "queues.toml:2:13",
                &["daemon.log_level", "did you mean \"warn\""],
            ),
            (
                "[daemon]\nlog_level = \"kmqd=verbose,info\"\n",
                "queues.toml:2:13",
                &["daemon.log_level", "\"verbose\"", "TARGET=LEVEL"],
            ),
            (
                "[daemon]\nreport_interval = \"often\"\n",
                "queues.toml:2:19",
                &["daemon.report_interval", "not a duration", "\"30s\""],
            ),
            (
                "[daemon]\nreport_interval = \"10ms\"\n",
                "queues.toml:2:19",
                &["daemon.report_interval", "too short", "100ms"],
            ),
            (
                "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nlag_warn = \"0s\"\n",
                "queues.toml:4:12",
                &["queues[0].lag_warn", "too short", "100ms"],
            ),
            (
                "[daemon]\nlog_format = \"yaml\"\n",
                "queues.toml:2:14",
                &["daemon.log_format", "\"json\""],
            ),
            (
                "[redis]\nwait_timeout = \"0s\"\n",
                "queues.toml:2:16",
                &["redis.wait_timeout", "between 1ms and 1m"],
            ),
            (
                "[daemon]\nshutdown_grace = \"30 parsecs\"\n",
                "queues.toml:2:18",
                &["daemon.shutdown_grace", "\"30s\""],
            ),
            (
                "[daemon]\nshutdown_grace = \"300000000000y\"\n",
                "queues.toml:2:18",
                &["daemon.shutdown_grace", "too long", "at most 10 years"],
            ),
            (
                "[redis]\nio_timeout = \"50ms\"\n",
                "queues.toml:2:14",
                &["redis.io_timeout", "between 100ms and 5m"],
            ),
            (
                "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nmax_task_bytes = 10\n",
                "queues.toml:4:18",
                &["queues[0].max_task_bytes", "between 1024 and 536870912"],
            ),
            (
                "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nworkers = 0\n",
                "queues.toml:4:11",
                &["queues[0].workers", "between 1 and 1024"],
            ),
            (
                "[[queues]]\nname = \"mail\"\nmode = \"fast\"\n",
                "queues.toml:3:8",
                &["queues[0].mode", "\"default\", \"safe\""],
            ),
            (
                "[[queues]]\nname = \"mail\"\n",
                "queues.toml:1:1",
                &["queues[0].mode", "mode = \"safe\""],
            ),
            (
                "[[queues]]\nname = \"ma il\"\nmode = \"safe\"\n",
                "queues.toml:2:8",
                &["queues[0].name", "a-z"],
            ),
            (
                "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nwrkers = 3\n",
                "queues.toml:4:1",
                &["queues[0]: unknown key `wrkers`; did you mean `workers`?"],
            ),
            (
                "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nworkers = \"4\"\n",
                "queues.toml:4:11",
                &["queues[0].workers: invalid type: string \"4\", expected an integer"],
            ),
            (
                "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nbackoff = 5\n",
                "queues.toml:4:11",
                &[
                    "queues[0].backoff: invalid type: integer `5`",
                    "such as \"30s\"",
                ],
            ),
            (
                "[[queues]]\nname = \"mail\"\nmode = \"safe\"\npriorities = [\"high\", 1]\n",
                "queues.toml:4:23",
                &["queues[0].priorities[1]: invalid type: integer `1`, expected a string"],
            ),
            (
                "[[queues]]\nname = \"mail\"\nmode = \"sfe\"\n",
                "queues.toml:3:8",
                &["queues[0].mode", "did you mean \"safe\"?"],
            ),
            (
                "[deamon]\nplugins_dir = \"/x\"\n",
                "queues.toml:1:2",
                &["unknown key `deamon`; did you mean `daemon`?"],
            ),
            (
                "[plugins.mail]\nfile = \"a.so\"\nconfig = 5\n",
                "queues.toml:3:10",
                &["plugins.mail.config: invalid type: integer `5`, expected a table"],
            ),
            (
                "[plugins.mail]\nfiles = \"a.so\"\n",
                "queues.toml:2:1",
                &["plugins.mail: unknown key `files`; did you mean `file`?"],
            ),
            (
                "[[queues]]\nname = \"a\"\nmode = \"safe\"\n[[queues]]\nname = \"a\"\nmode = \"safe\"\n",
                "queues.toml:5:8",
                &["queues[1].name: queue \"a\" is defined twice"],
            ),
            (
                "[redis]\npool_size = 2\n[[queues]]\nname = \"a\"\nmode = \"safe\"\n",
                "queues.toml:2:13",
                &["redis.pool_size: 2 is too small"],
            ),
            (
                "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nworkers = \"many\"\n",
                "queues.toml:4:11",
                &["invalid type"],
            ),
            (
                "[[queues]]\nname = \"m\"\nmode = \"safe\"\nbatch = 5000\n",
                "queues.toml:4:9",
                &["queues[0].batch", "between 1 and 1000"],
            ),
            (
                "[[queues]]\nname = \"m\"\nmode = \"safe\"\non_handler_error = \"ignore\"\n",
                "queues.toml:4:20",
                &["on_handler_error", "\"finish\""],
            ),
            (
                "[[queues]]\nname = \"m\"\nmode = \"safe\"\npriorities = [\"hi\", \"hi\"]\n",
                "queues.toml:4:14",
                &["listed twice"],
            ),
            (
                "[[queues]]\nname = \"m\"\nmode = \"safe\"\ndefault_priority = \"x\"\n",
                "queues.toml:4:20",
                &["not one of the queue's priorities"],
            ),
            (
                "[[queues]]\nname = \"m\"\nmode = \"safe\"\n[[queues]]\nname = \"m\"\nmode = \"safe\"\n",
                "queues.toml",
                &["defined twice"],
            ),
            (
                "[redis]\npool_size = 2\n[[queues]]\nname = \"m\"\nmode = \"safe\"\n",
                "queues.toml",
                &["redis.pool_size", "at least 7"],
            ),
            (
                "[plugins.mail]\nconfig = {}\n",
                "queues.toml:1:1",
                &["plugins.mail.file", "libkmq_mail.so"],
            ),
            (
                "[redis]\npassword_env = \"KMQD_TEST_SURELY_UNSET_VARIABLE\"\n",
                "queues.toml:2:16",
                &["is not set"],
            ),
            (
                "[daemon]\nmetrics_addr = \"localhost\"\n",
                "queues.toml:2:16",
                &["daemon.metrics_addr", "127.0.0.1:9464"],
            ),
            (
                "[[queues]]\nname = \"m\"\nmode = \"safe\"\nforeign_type_field = \"type\"\n",
                "queues.toml:4:22",
                &["queues[0].foreign_type_field", "\"callback\""],
            ),
            (
                "[[schedules]]\nname = \"s\"\nqueue = \"nope\"\ntype = \"t\"\nevery = \"1m\"\n",
                "queues.toml:3:9",
                &["schedules[0].queue", "no queue \"nope\""],
            ),
            (
                "[[queues]]\nname = \"m\"\nmode = \"safe\"\n[[schedules]]\nname = \"s\"\nqueue = \"m\"\ntype = \"t\"\ncron = \"0 25 * * *\"\n",
                "queues.toml:8:8",
                &["schedules[0].cron", "hour: 25 is outside 0-23"],
            ),
            (
                "[[queues]]\nname = \"m\"\nmode = \"safe\"\n[[schedules]]\nname = \"s\"\nqueue = \"m\"\ntype = \"t\"\ncron = \"* * * * *\"\nevery = \"1m\"\n",
                "queues.toml:4:1",
                &["exactly one of cron"],
            ),
            (
                "[[queues]]\nname = \"m\"\nmode = \"safe\"\n[[schedules]]\nname = \"s\"\nqueue = \"m\"\ntype = \"t\"\nevery = \"1500ms\"\n",
                "queues.toml:8:9",
                &["schedules[0].every", "whole seconds"],
            ),
        ];

        for (text, location, words) in cases {
            let error = parse(text).expect_err(text);
            assert!(
                error.starts_with(&format!("/etc/kmqd/{location}")),
                "{text:?}\n gave: {error}"
            );
            for word in *words {
                assert!(
                    error.contains(word),
                    "{text:?}\n gave: {error}\n missing: {word}"
                );
            }
        }
    }

    #[test]
    fn every_longer_than_the_clock_holds_has_no_next_slot() {
        // Found by fuzz/fuzz_targets/config_values.rs: these validate (whole seconds, at least 1s), but their
        // length in ms does not fit an i64, and the next slot came out before `after_ms` (negative), or the
        // division by the truncated period panicked (2^61 s is 0 ms once truncated to 64 bits).
        // The config now refuses durations past ten years; the arithmetic stays safe on its own.
        for every in [
            "9223372036854776s",
            "2305843009213693952s",
            "18446744073709551615s",
        ] {
            let text = format!(
                "{MINIMAL}[[schedules]]\nname = \"s\"\nqueue = \"mail\"\ntype = \"t\"\nevery = \"{every}\"\n"
            );
            let error = parse(&text).unwrap_err();
            assert!(error.contains("is too long"), "{every}: {error}");
            let when = When::Every(humantime::parse_duration(every).unwrap());
            for after in [0, 1_795_997_223_121, i64::MAX - 1] {
                assert_eq!(when.next_after(after), None, "{every} after {after}");
            }
        }
        let longest = When::Every(Duration::from_millis(i64::MAX as u64));
        assert_eq!(longest.next_after(0), Some(i64::MAX));
        assert_eq!(
            longest.next_after(i64::MAX),
            None,
            "the slot after it overflows"
        );
        let hourly = When::Every(Duration::from_secs(3600));
        assert_eq!(hourly.next_after(3_600_000), Some(7_200_000));
        assert_eq!(hourly.next_after(-1), Some(0));
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("redis://user:secret@host:6379/0"),
            "redis://user:***@host:6379/0"
        );
        assert_eq!(redact_url("redis://:secret@host/0"), "redis://:***@host/0");
        assert_eq!(redact_url("redis://host:6379/0"), "redis://host:6379/0");
        assert_eq!(
            redact_url("unix:///run/redis.sock"),
            "unix:///run/redis.sock"
        );
    }
}
