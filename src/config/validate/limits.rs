//! A queue's `[[queues.limits]]`: the running and rate limits of single task types. Its own module because each
//! entry is a small table of its own, with rules between entries (a type listed once) and against the queue (its
//! prefetch). Both modes take them: a safe-mode claim and a default-mode pop sort tasks by type alike (types.lua).

use toml::Spanned;

use super::queue::{limited_claims, rate_limits};
use super::ranged;
use crate::config::errors::Source;
use crate::config::raw::RawTypeLimit;
use crate::config::*;

/// The longest type a limit may name, in bytes: its name is part of Redis keys and of each claim's scopes string.
const MAX_TYPE_BYTES: usize = 200;

/// Checks each entry of `limits` (the queue's `[[queues.limits]]`; `key` names the queue's keys).
pub(super) fn type_limits(
    source: &Source<'_>,
    key: &impl Fn(&str) -> String,
    prefetch: Option<&Spanned<i64>>,
    limits: Vec<Spanned<RawTypeLimit>>,
) -> Result<Vec<TypeLimit>, ConfigError> {
    if limits.len() > MAX_TYPE_LIMITS {
        return Err(source.error(
            limits[MAX_TYPE_LIMITS].span(),
            format!(
                "{}: {} entries; a queue takes at most {MAX_TYPE_LIMITS} (each adds keys to every claim)",
                key("limits"),
                limits.len()
            ),
        ));
    }
    // The claims of a queue with type limits take only for idle workers, as with its own limits.
    limited_claims(source, (key, "[[queues.limits]]"), prefetch)?;
    let mut out: Vec<TypeLimit> = Vec::with_capacity(limits.len());
    for (index, entry) in limits.into_iter().enumerate() {
        let span = entry.span();
        let RawTypeLimit {
            kind,
            max_running,
            rate_limit,
        } = entry.into_inner();
        let key = |field: &str| key(&format!("limits[{index}].{field}"));
        let kind = kind.ok_or_else(|| {
            source.error(
                span.clone(),
                format!(
                    "{}: every [[queues.limits]] entry names its task type",
                    key("type")
                ),
            )
        })?;
        let name = kind.get_ref();
        if name.is_empty() || name.len() > MAX_TYPE_BYTES || name.chars().any(char::is_control) {
            return Err(source.error(
                kind.span(),
                format!(
                    "{}: {name:?} is not a task type a limit can name; use 1 to {MAX_TYPE_BYTES} bytes without \
                     control characters",
                    key("type")
                ),
            ));
        }
        if out.iter().any(|limit| &limit.kind == name) {
            return Err(source.error(
                kind.span(),
                format!(
                    "{}: type {name:?} has two [[queues.limits]] entries; keep one, with all of its limits",
                    key("type")
                ),
            ));
        }
        let (max_running, rate_limit) = scope_limits(source, &key, &max_running, &rate_limit)?;
        if max_running.is_none() && rate_limit.is_empty() {
            return Err(source.error(
                span,
                format!(
                    "{}: the entry for type {name:?} sets no limit; give it max_running, rate_limit or both",
                    key("type").trim_end_matches(".type")
                ),
            ));
        }
        out.push(TypeLimit {
            kind: kind.into_inner(),
            max_running,
            rate_limit,
        });
    }
    Ok(out)
}

/// A scope's `max_running` and `rate_limit` (a type's entry, the groups' table), as the queue's own are checked
/// (`key` names the scope's keys).
pub(super) fn scope_limits(
    source: &Source<'_>,
    key: &impl Fn(&str) -> String,
    max_running: &Option<Spanned<i64>>,
    rate_limit: &Option<Spanned<toml::Value>>,
) -> Result<(Option<usize>, Vec<crate::config::rate::RateLimit>), ConfigError> {
    let max_running = match max_running {
        Some(limit) => Some(ranged(
            source,
            &key("max_running"),
            limit,
            1..MAX_RUNNING as i64 + 1,
        )? as usize),
        None => None,
    };
    let rate_limit = match rate_limit {
        Some(value) => rate_limits(source, &key("rate_limit"), value)?,
        None => Vec::new(),
    };
    Ok((max_running, rate_limit))
}
