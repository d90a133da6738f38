//! What the config means: every raw value checked and turned into [`Config`]'s types, defaults filled in,
//! relative paths resolved against the config file's directory.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use redis::cluster_routing::Slot;
use toml::Spanned;

use super::errors::{Source, did_you_mean};
use super::raw::*;
use super::*;

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

/// The longest duration a config may hold: ten years.
const MAX_DURATION: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

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
    pub(super) fn validate(self, source: &Source<'_>) -> Result<Config, ConfigError> {
        let RawConfig {
            redis,
            daemon,
            queues,
            plugins,
            schedules,
            dashboard,
        } = self;

        let base = source.base_dir();
        let dashboard = dashboard.validate(source, &base)?;
        let pool_size_span = redis.pool_size.as_ref().map_or(0..0, Spanned::span);
        let redis = redis.validate(source, &base)?;
        let daemon = daemon.validate(source, &base)?;

        let mut seen = HashSet::new();
        // Source list -> the queue it feeds.
        let mut sources = std::collections::HashMap::new();
        let mut validated_queues = Vec::with_capacity(queues.len());
        for (index, queue) in queues.into_iter().enumerate() {
            let span = queue.span();
            let name_span = queue
                .get_ref()
                .name
                .as_ref()
                .map_or(span.clone(), Spanned::span);
            let source_spans: Vec<Range<usize>> = queue
                .get_ref()
                .source_lists
                .as_ref()
                .map_or(Vec::new(), |list| {
                    list.get_ref().iter().map(Spanned::span).collect()
                });
            let queue = queue.into_inner().validate(source, index, span, &redis)?;
            for (at, (list, span)) in queue.source_lists.iter().zip(source_spans).enumerate() {
                let list = &list.key;
                if let Some(other) = sources.insert(list.clone(), queue.name.clone()) {
                    return Err(source.error(
                        span,
                        format!(
                            "queues[{index}].source_lists[{at}]: {list:?} is a source of queue {other:?} too; a list \
                             feeds one queue (two would split its tasks at random): remove it from one of them"
                        ),
                    ));
                }
            }
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
            dashboard,
        };
        if config.redis.pool_size == 0 {
            // Two more than the daemon holds, for `stats` and short-lived commands.
            config.redis.pool_size = config.connections_needed() + 2;
        } else if config.redis.pool_size < config.connections_needed() {
            return Err(source.error(
                pool_size_span,
                format!(
                    "redis.pool_size: {} is too small for {} queue(s): the daemon holds 3 connections per queue (4 with \
                     source_lists) and 4 more, so set pool_size to at least {}",
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
            allow_eviction,
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
            allow_eviction: allow_eviction.is_some_and(Spanned::into_inner),
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

impl RawDashboard {
    /// Only the shape: the files are read, and the variable looked up, when the dashboard starts.
    fn validate(self, source: &Source<'_>, base: &Path) -> Result<DashboardConfig, ConfigError> {
        let RawDashboard {
            users_file,
            token_env,
            token_file,
        } = self;
        let located = |key: &str, value: &Spanned<String>| -> Result<String, ConfigError> {
            if value.get_ref().trim().is_empty() {
                return Err(source.error(
                    value.span(),
                    format!("dashboard.{key}: is empty; leave it out or name one"),
                ));
            }
            Ok(format!(
                "{}: dashboard.{key}",
                source.location(&value.span())
            ))
        };
        if let (Some(_), Some(file)) = (&token_env, &token_file) {
            return Err(source.error(
                file.span(),
                "dashboard.token_file: set token_env or token_file, not both",
            ));
        }
        let path = |key: &str, value: Option<Spanned<String>>| -> Result<_, ConfigError> {
            value
                .map(|value| {
                    Ok(Located {
                        at: located(key, &value)?,
                        value: base.join(value.get_ref()),
                    })
                })
                .transpose()
        };
        Ok(DashboardConfig {
            users_file: path("users_file", users_file)?,
            token_env: token_env
                .map(|var| {
                    Ok::<_, ConfigError>(Located {
                        at: located("token_env", &var)?,
                        value: var.into_inner(),
                    })
                })
                .transpose()?,
            token_file: path("token_file", token_file)?,
        })
    }
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
            metrics_addr_overridden: false,
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
        redis: &RedisConfig,
    ) -> Result<QueueConfig, ConfigError> {
        let RawQueue {
            name,
            mode,
            priorities,
            priority_weights,
            default_priority,
            workers,
            worker_nice,
            batch,
            prefetch,
            max_held,
            max_running,
            rate_limit,
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
            source_lists,
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
        let priority_weights = match &priority_weights {
            Some(weights) => {
                let span = weights.span();
                let list = weights.get_ref();
                if list.len() != priorities.len() {
                    return Err(source.error(
                        span,
                        format!(
                            "{}: {} weights for {} priorities {priorities:?}; give one weight per level, in the \
                             same order",
                            key("priority_weights"),
                            list.len(),
                            priorities.len()
                        ),
                    ));
                }
                list.iter()
                    .map(|weight| {
                        u32::try_from(*weight)
                            .ok()
                            .filter(|weight| (1..=MAX_PRIORITY_WEIGHT).contains(weight))
                            .ok_or_else(|| {
                                source.error(
                                    span.clone(),
                                    format!(
                                        "{}: {weight} is out of range; each weight must be between 1 and \
                                         {MAX_PRIORITY_WEIGHT}",
                                        key("priority_weights")
                                    ),
                                )
                            })
                    })
                    .collect::<Result<Vec<u32>, ConfigError>>()?
            }
            None => Vec::new(),
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
        let max_running = match &max_running {
            Some(limit) => {
                let max_running = ranged(
                    source,
                    &key("max_running"),
                    limit,
                    1..MAX_RUNNING as i64 + 1,
                )? as usize;
                // Either mode: a pop keeps its slots under its owner (pop.lua).
                limited_claims(source, (&key, "max_running"), prefetch.as_ref())?;
                Some(max_running)
            }
            None => None,
        };
        let rate_limit = match &rate_limit {
            Some(value) => {
                let rates = rate_limits(source, &key("rate_limit"), value)?;
                // Either mode: a pop counts its starts as a claim does.
                limited_claims(source, (&key, "rate_limit"), prefetch.as_ref())?;
                rates
            }
            None => Vec::new(),
        };
        let prefetch = match &prefetch {
            Some(p) => Prefetch::Fixed(ranged(source, &key("prefetch"), p, 0..100_001)? as usize),
            // A task claimed ahead would hold a running slot, or a start of the rate, that another daemon's idle
            // worker could use.
            None if max_running.is_some() || !rate_limit.is_empty() => Prefetch::Fixed(0),
            None => Prefetch::Auto,
        };
        let max_held = match (&max_held, prefetch) {
            (Some(m), prefetch) => {
                let least = prefetch.least_held(workers);
                let max_held = ranged(source, &key("max_held"), m, 1..200_001)? as usize;
                if max_held < least {
                    let what = match prefetch {
                        Prefetch::Fixed(p) => format!("workers + prefetch ({workers} + {p})"),
                        Prefetch::Auto => format!("workers ({workers})"),
                    };
                    return Err(source.error(
                        m.span(),
                        format!(
                            "{}: {max_held} is less than {what}, which the queue may hold: raise max_held, or \
                             lower workers or prefetch",
                            key("max_held")
                        ),
                    ));
                }
                max_held
            }
            (None, Prefetch::Fixed(p)) => workers + p,
            (None, Prefetch::Auto) => workers + defaults::HELD_BEYOND_WORKERS,
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
        // Niceness is 0 to 19 on Linux; added to the daemon's, it is capped there.
        let worker_nice = match &worker_nice {
            Some(n) => ranged(source, &key("worker_nice"), n, 0..20)? as i32,
            None => 0,
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

        let source_lists = match source_lists {
            Some(lists) => check_source_lists(
                source,
                &key("source_lists"),
                name.get_ref(),
                lists,
                (&priorities, default_priority),
                redis,
            )?,
            None => Vec::new(),
        };

        Ok(QueueConfig {
            name: name.into_inner(),

            mode,
            priorities,
            priority_weights,
            default_priority,
            workers,
            worker_nice,
            batch,
            prefetch,
            max_held,
            max_running,
            rate_limit,
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
            source_lists,
        })
    }
}

/// The largest `priority_weights` entry: weights are ratios, and a bigger one only makes Redis's sums larger.
const MAX_PRIORITY_WEIGHT: u32 = 1000;

/// What a queue's `max_running` or `rate_limit` (`name`, whose key path `key` makes) asks of the rest of its
/// config: no prefetch (a task claimed ahead holds a slot or a start that another daemon's idle worker could use).
fn limited_claims(
    source: &Source<'_>,
    (key, name): (&impl Fn(&str) -> String, &str),
    prefetch: Option<&Spanned<i64>>,
) -> Result<(), ConfigError> {
    if let Some(prefetch) = prefetch.filter(|prefetch| *prefetch.get_ref() != 0) {
        return Err(source.error(
            prefetch.span(),
            format!(
                "{}: a queue with {name} claims only for its idle workers; remove prefetch or set it to 0 \
                 (a task claimed ahead holds a start that another daemon's idle worker could use)",
                key("prefetch")
            ),
        ));
    }
    Ok(())
}

/// A queue's `rate_limit`: one rate (`"200/s"`) or a list of them, each window listed once.
fn rate_limits(
    source: &Source<'_>,
    key: &str,
    value: &Spanned<toml::Value>,
) -> Result<Vec<rate::RateLimit>, ConfigError> {
    let error = |message: String| source.error(value.span(), format!("{key}: {message}"));
    let texts: Vec<&str> = match value.get_ref() {
        toml::Value::String(text) => vec![text.as_str()],
        toml::Value::Array(items) if !items.is_empty() => items
            .iter()
            .map(|item| {
                item.as_str().ok_or_else(|| {
                    error(format!(
                        "{item} is not a rate; list rates as strings, like [\"20/s\", \"1000/h\"]"
                    ))
                })
            })
            .collect::<Result<_, _>>()?,
        _ => {
            return Err(error(
                "write a rate as a string, like \"200/s\", or a list of them, like [\"20/s\", \"1000/h\"]"
                    .to_string(),
            ));
        }
    };
    let mut rates: Vec<rate::RateLimit> = Vec::with_capacity(texts.len());
    for text in texts {
        let rate = rate::parse(text).map_err(error)?;
        if rates.iter().any(|other| other.window == rate.window) {
            return Err(error(format!(
                "two rates for the window {}; keep one",
                humantime::format_duration(rate.window)
            )));
        }
        rates.push(rate);
    }
    Ok(rates)
}

/// A queue's `source_lists`: Redis keys of lists, each a name or `{ list = NAME, priority = LEVEL }`, each named
/// once, none of them kmqd's own, and on a Redis Cluster each in the queue's slot: a task moves atomically only
/// within one slot (one script, one node).
fn check_source_lists(
    source: &Source<'_>,
    key: &str,
    queue: &str,
    lists: Spanned<Vec<Spanned<toml::Value>>>,
    (priorities, default_priority): (&[String], usize),
    redis: &RedisConfig,
) -> Result<Vec<SourceList>, ConfigError> {
    let own = format!("{}:{{", redis.key_prefix);
    let queue_key = format!("{}:{{{queue}}}", redis.key_prefix);
    let shape = format!(
        "write a list's name (\"queue:{queue}\") or a table naming it and the level its tasks join \
         ({{ list = \"queue:{queue}\", priority = \"{}\" }})",
        priorities[0]
    );
    let mut seen = HashSet::new();
    let mut checked = Vec::new();
    for (index, list) in lists.get_ref().iter().enumerate() {
        let key = format!("{key}[{index}]");
        let error = |message: String| source.error(list.span(), format!("{key}: {message}"));
        let (name, priority) = match list.get_ref() {
            toml::Value::String(name) => (name.as_str(), None),
            toml::Value::Table(table) => {
                if let Some(unknown) = table
                    .keys()
                    .find(|k| !matches!(k.as_str(), "list" | "priority"))
                {
                    return Err(error(format!("unknown key {unknown:?}; {shape}")));
                }
                let text = |field: &str| match table.get(field) {
                    None => Ok(None),
                    Some(toml::Value::String(text)) => Ok(Some(text.as_str())),
                    Some(_) => Err(error(format!("{field} must be a string; {shape}"))),
                };
                let Some(name) = text("list")? else {
                    return Err(error(format!("the table has no list; {shape}")));
                };
                (name, text("priority")?)
            }
            _ => return Err(error(shape.clone())),
        };
        let level = match priority {
            None => default_priority,
            Some(priority) => priorities
                .iter()
                .position(|p| p == priority)
                .ok_or_else(|| {
                    error(format!(
                        "{priority:?} is not one of the queue's priorities {priorities:?}"
                    ))
                })?,
        };
        if name.trim().is_empty() || name.chars().any(char::is_control) {
            return Err(error(format!(
                "{name:?} is not a list name; name the Redis list your producers push to, e.g. \"queue:{queue}\""
            )));
        }
        if name.starts_with(&own) {
            return Err(error(format!(
                "{name:?} is one of kmqd's own keys (every key under \"{own}\" is); name the list your producers \
                 push to, e.g. \"queue:{queue}\" (producers that can push to kmqd's ready list need no source \
                 list: docs/PROTOCOL.md)"
            )));
        }
        if !seen.insert(name) {
            return Err(error(format!("{name:?} is listed twice")));
        }
        if matches!(redis.deployment, Deployment::Cluster { .. })
            && Slot::for_key(name) != Slot::for_key(&queue_key)
        {
            return Err(error(format!(
                "{name:?} is in another Redis Cluster slot than queue {queue:?}'s keys ({queue_key}:...), and a \
                 task moves atomically only within one slot: give the list the queue's hash tag, e.g. \"{}\", and \
                 have the producers push there",
                tagged(name, queue)
            )));
        }
        checked.push(SourceList {
            key: name.to_string(),
            level,
            priority: priorities[level].clone(),
        });
    }
    Ok(checked)
}

/// `name` with the hash tag `{queue}`, for the cluster's error: `queue:email` -> `queue:{email}` when the name
/// ends with the queue's name, else `NAME:{queue}`.
pub(super) fn tagged(name: &str, queue: &str) -> String {
    let untagged: String = name.chars().filter(|c| !matches!(c, '{' | '}')).collect();
    match untagged.strip_suffix(queue) {
        Some(start) if !start.is_empty() => format!("{start}{{{queue}}}"),
        _ => format!("{untagged}:{{{queue}}}"),
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
