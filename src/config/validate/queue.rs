//! A `[[queues]]` table: its levels, capacity, timing and retry settings, its rate limits and its source lists.
//! Its own module because a queue has the most keys and the most rules between them (prefetch against
//! `max_running` and `rate_limit`, `max_held` against workers and prefetch, source lists against the cluster's
//! slots).

use std::collections::HashSet;
use std::ops::Range;
use std::time::Duration;

use redis::cluster_routing::Slot;
use toml::Spanned;

use super::{at_least, check_name, duration_or, one_of, parse_duration, ranged};
use crate::config::errors::Source;
use crate::config::raw::RawQueue;
use crate::config::*;

impl RawQueue {
    pub(super) fn validate(
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
            keep_results,
            source_lists,
            limits,
            groups,
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

        let Levels {
            priorities,
            priority_weights,
            default_priority,
        } = levels(source, &key, priorities, priority_weights, default_priority)?;
        let raw_prefetch = prefetch.clone();
        let Capacity {
            workers,
            batch,
            prefetch,
            max_held,
            max_running,
            rate_limit,
        } = capacity(
            source,
            &key,
            workers,
            batch,
            prefetch,
            max_held,
            (
                max_running,
                rate_limit,
                limits.is_some() || groups.is_some(),
            ),
        )?;
        let groups = match groups {
            Some(groups) => Some(super::groups::groups(
                source,
                &key,
                mode,
                raw_prefetch.as_ref(),
                groups,
            )?),
            None => None,
        };
        let type_limits = match limits {
            Some(limits) => {
                super::limits::type_limits(source, &key, raw_prefetch.as_ref(), limits)?
            }
            None => Vec::new(),
        };
        let Timing {
            lease_timeout,
            execution_timeout,
            alive_timeout,
        } = timing(
            source,
            &key,
            &span,
            lease_timeout,
            execution_timeout,
            alive_timeout,
        )?;
        let Retry {
            retry_times,
            on_handler_error,
            backoff,
            backoff_max,
            dead_max,
        } = retry(
            source,
            &key,
            &span,
            retry_times,
            on_handler_error,
            (backoff, backoff_max),
            dead_max,
        )?;
        let idle_poll_span = idle_poll.as_ref().map_or(span.clone(), Spanned::span);
        let idle_poll = duration_or(source, &key("idle_poll"), &idle_poll, defaults::IDLE_POLL)?;
        if idle_poll < Duration::from_millis(10) || idle_poll > Duration::from_secs(5) {
            return Err(source.error(idle_poll_span, format!("{}: must be between 10ms and 5s (it also bounds how long a stopping daemon waits for its fetchers)", key("idle_poll"))));
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
            Some(b) => ranged(source, &key("delay_batch"), b, 1..MAX_TAKE as i64 + 1)? as usize,
            None => MAX_TAKE,
        };
        // Niceness is 0 to 19 on Linux; added to the daemon's, it is capped there.
        let worker_nice = match &worker_nice {
            Some(n) => ranged(
                source,
                &key("worker_nice"),
                n,
                0..MAX_WORKER_NICE as i64 + 1,
            )? as i32,
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

        let keep_results = match &keep_results {
            Some(value) => Some(kept_for(source, &key("keep_results"), value)?),
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
            type_limits,
            groups,
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
            keep_results,
            source_lists,
        })
    }
}

/// The shortest and longest `keep_results`: a result kept under a second is gone before a waiting reader polls
/// it, and one kept past 30 days is a store, not a result (a key per task for that long).
const KEEP_RESULTS: std::ops::RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(30 * 24 * 3600);

/// A queue's `keep_results`: a duration within [`KEEP_RESULTS`], whole milliseconds (its keys' expiry).
fn kept_for(
    source: &Source<'_>,
    key: &str,
    value: &Spanned<String>,
) -> Result<Duration, ConfigError> {
    let kept = at_least(source, key, value, *KEEP_RESULTS.start())?;
    if kept > *KEEP_RESULTS.end() {
        return Err(source.error(
            value.span(),
            format!(
                "{key}: {:?} is too long; use at most {} (results are kept in Redis that long)",
                value.get_ref(),
                humantime::format_duration(*KEEP_RESULTS.end())
            ),
        ));
    }
    Ok(kept)
}

/// A queue's priority levels, as [`levels`] checks them.
struct Levels {
    priorities: Vec<String>,
    priority_weights: Vec<u32>,
    default_priority: usize,
}

/// A queue's `priorities`, `priority_weights` and `default_priority`: checked together, as the weights and the
/// default name the levels.
fn levels(
    source: &Source<'_>,
    key: &impl Fn(&str) -> String,
    priorities: Option<Spanned<Vec<String>>>,
    priority_weights: Option<Spanned<Vec<i64>>>,
    default_priority: Option<Spanned<String>>,
) -> Result<Levels, ConfigError> {
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
    Ok(Levels {
        priorities,
        priority_weights,
        default_priority,
    })
}

/// How much a queue runs and holds at once, as [`capacity`] checks it.
struct Capacity {
    workers: usize,
    batch: usize,
    prefetch: Prefetch,
    max_held: usize,
    max_running: Option<usize>,
    rate_limit: Vec<rate::RateLimit>,
}

/// A queue's `workers`, `batch`, `prefetch` and `max_held`, and the limits `max_running` and `rate_limit`:
/// checked together, as each bounds the next (a limit rules out prefetch, and `max_held` must hold the workers
/// and what they prefetch).
fn capacity(
    source: &Source<'_>,
    key: &impl Fn(&str) -> String,
    workers: Option<Spanned<i64>>,
    batch: Option<Spanned<i64>>,
    prefetch: Option<Spanned<i64>>,
    max_held: Option<Spanned<i64>>,
    (max_running, rate_limit, limited_types): (
        Option<Spanned<i64>>,
        Option<Spanned<toml::Value>>,
        bool,
    ),
) -> Result<Capacity, ConfigError> {
    let workers = match &workers {
        Some(w) => ranged(source, &key("workers"), w, 1..MAX_WORKERS as i64 + 1)? as usize,
        None => defaults::WORKERS,
    };
    let batch = match &batch {
        Some(b) => ranged(source, &key("batch"), b, 1..MAX_TAKE as i64 + 1)? as usize,
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
            limited_claims(source, (key, "max_running"), prefetch.as_ref())?;
            Some(max_running)
        }
        None => None,
    };
    let rate_limit = match &rate_limit {
        Some(value) => {
            let rates = rate_limits(source, &key("rate_limit"), value)?;
            // Either mode: a pop counts its starts as a claim does.
            limited_claims(source, (key, "rate_limit"), prefetch.as_ref())?;
            rates
        }
        None => Vec::new(),
    };
    let prefetch = match &prefetch {
        Some(p) => Prefetch::Fixed(
            ranged(source, &key("prefetch"), p, 0..MAX_PREFETCH as i64 + 1)? as usize,
        ),
        // A task claimed ahead would hold a running slot, or a start of the rate, that another daemon's idle
        // worker could use.
        None if max_running.is_some() || !rate_limit.is_empty() || limited_types => {
            Prefetch::Fixed(0)
        }
        None => Prefetch::Auto,
    };
    let max_held = match (&max_held, prefetch) {
        (Some(m), prefetch) => {
            let least = prefetch.least_held(workers);
            let max_held =
                ranged(source, &key("max_held"), m, 1..MAX_HELD_LIMIT as i64 + 1)? as usize;
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
    Ok(Capacity {
        workers,
        batch,
        prefetch,
        max_held,
        max_running,
        rate_limit,
    })
}

/// How long a queue's task may run, as [`timing`] checks it.
struct Timing {
    lease_timeout: Duration,
    execution_timeout: Option<Duration>,
    alive_timeout: Option<Duration>,
}

/// A queue's `lease_timeout`, `execution_timeout` and `alive_timeout`; `span` is the queue's table, where an
/// error points when the value it is about was left out.
fn timing(
    source: &Source<'_>,
    key: &impl Fn(&str) -> String,
    span: &Range<usize>,
    lease_timeout: Option<Spanned<String>>,
    execution_timeout: Option<Spanned<String>>,
    alive_timeout: Option<Spanned<String>>,
) -> Result<Timing, ConfigError> {
    let lease_span = lease_timeout.as_ref().map_or(span.clone(), Spanned::span);
    let lease_timeout = duration_or(
        source,
        &key("lease_timeout"),
        &lease_timeout,
        defaults::LEASE_TIMEOUT,
    )?;
    if lease_timeout < Duration::from_millis(300) {
        return Err(source.error(
            lease_span,
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
    Ok(Timing {
        lease_timeout,
        execution_timeout,
        alive_timeout,
    })
}

/// What a queue does with a failed task, as [`retry`] checks it.
struct Retry {
    retry_times: u32,
    on_handler_error: OnHandlerError,
    backoff: Duration,
    backoff_max: Duration,
    dead_max: usize,
}

/// A queue's `retry_times`, `on_handler_error`, `backoff`, `backoff_max` and `dead_max`; `span` is the queue's
/// table. A `backoff_max` shorter than `backoff` is an error at `backoff_max`, or at `backoff` when
/// `backoff_max` was left out (a `backoff` longer than its default).
fn retry(
    source: &Source<'_>,
    key: &impl Fn(&str) -> String,
    span: &Range<usize>,
    retry_times: Option<Spanned<i64>>,
    on_handler_error: Option<Spanned<String>>,
    (backoff, backoff_max): (Option<Spanned<String>>, Option<Spanned<String>>),
    dead_max: Option<Spanned<i64>>,
) -> Result<Retry, ConfigError> {
    let retry_times = match &retry_times {
        Some(r) => ranged(
            source,
            &key("retry_times"),
            r,
            0..MAX_RETRY_TIMES as i64 + 1,
        )? as u32,
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
    let backoff_span = backoff_max
        .as_ref()
        .or(backoff.as_ref())
        .map_or(span.clone(), Spanned::span);
    let backoff_value = duration_or(source, &key("backoff"), &backoff, defaults::BACKOFF)?;
    let backoff_max = duration_or(
        source,
        &key("backoff_max"),
        &backoff_max,
        defaults::BACKOFF_MAX,
    )?;
    if backoff_max < backoff_value {
        return Err(source.error(
            backoff_span,
            format!(
                "{}: must not be shorter than backoff ({backoff_value:?})",
                key("backoff_max")
            ),
        ));
    }
    let dead_max = match &dead_max {
        Some(d) => ranged(source, &key("dead_max"), d, 1..DEAD_MAX_LIMIT as i64 + 1)? as usize,
        None => defaults::DEAD_MAX,
    };
    Ok(Retry {
        retry_times,
        on_handler_error,
        backoff: backoff_value,
        backoff_max,
        dead_max,
    })
}

/// The largest `priority_weights` entry: weights are ratios, and a bigger one only makes Redis's sums larger.
const MAX_PRIORITY_WEIGHT: u32 = 1000;

/// What a queue's `max_running` or `rate_limit` (`name`, whose key path `key` makes) asks of the rest of its
/// config: no prefetch (a task claimed ahead holds a slot or a start that another daemon's idle worker could use).
pub(super) fn limited_claims(
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
pub(super) fn rate_limits(
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
pub(in crate::config) fn tagged(name: &str, queue: &str) -> String {
    let untagged: String = name.chars().filter(|c| !matches!(c, '{' | '}')).collect();
    match untagged.strip_suffix(queue) {
        Some(start) if !start.is_empty() => format!("{start}{{{queue}}}"),
        _ => format!("{untagged}:{{{queue}}}"),
    }
}
