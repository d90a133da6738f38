//! What the config means: every raw value checked and turned into [`Config`]'s types, defaults filled in,
//! relative paths resolved against the config file's directory.
//!
//! One module per section of the file, so that a section's rules read on their own: [`queue`], [`redis`],
//! [`schedule`], [`daemon`], [`dashboard`] and [`plugin`] ([`limits`]: a queue's `[[queues.limits]]`, [`groups`]: its `[queues.groups]`). This module holds what they share (durations, ranges,
//! names, choices) and `RawConfig`'s validation, which runs the sections in order and checks what spans them
//! (a queue or schedule named twice, a source list feeding two queues, the pool's size).

mod daemon;
mod dashboard;
mod groups;
mod limits;
mod plugin;
mod queue;
mod redis;
mod schedule;

use std::collections::HashSet;
use std::ops::Range;
use std::time::Duration;

use toml::Spanned;

use super::errors::{Source, did_you_mean};
use super::raw::*;
use super::*;

// config/tests.rs checks the hash tag the cluster's error suggests; nothing else outside queue.rs needs it.
#[cfg(test)]
pub(super) use queue::tagged;

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
