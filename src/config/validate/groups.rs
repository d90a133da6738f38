//! A queue's `[queues.groups]`: fair turns between the groups its tasks name, and the limits of each group. Its
//! own module because the table has rules of its own (weights by group name) and against the queue (its mode, its
//! prefetch, its `[[queues.limits]]`).

use toml::Spanned;

use super::queue::limited_claims;
use crate::config::errors::Source;
use crate::config::raw::RawGroups;
use crate::config::*;

/// The most groups `weights` may name: they go with every claim of the queue.
const MAX_WEIGHTS: usize = 256;

/// Checks the queue's `[queues.groups]` (`key` names the queue's keys).
pub(super) fn groups(
    source: &Source<'_>,
    key: &impl Fn(&str) -> String,
    mode: Mode,
    prefetch: Option<&Spanned<i64>>,
    groups: Spanned<RawGroups>,
) -> Result<Groups, ConfigError> {
    let span = groups.span();
    let RawGroups {
        max_running,
        rate_limit,
        weights,
    } = groups.into_inner();
    let queue_key = key;
    let key = |field: &str| queue_key(&format!("groups.{field}"));
    let table = key("").trim_end_matches('.').to_string();
    if mode == Mode::Default {
        return Err(source.error(
            span,
            format!(
                "{table}: groups need mode = \"safe\" in this version (a default-mode pop does not take turns \
                 between groups yet); use mode = \"safe\""
            ),
        ));
    }
    let (max_running, rate_limit) =
        super::limits::scope_limits(source, &key, &max_running, &rate_limit)?;
    if max_running.is_some() || !rate_limit.is_empty() {
        // A task claimed ahead would hold its group's slot, or a start of its rate, that another daemon's idle
        // worker could use.
        limited_claims(source, (queue_key, "group limits"), prefetch)?;
    }
    let mut out = Vec::new();
    if let Some(weights) = weights {
        let span = weights.span();
        let weights = weights.into_inner();
        if weights.len() > MAX_WEIGHTS {
            return Err(source.error(
                span,
                format!(
                    "{}: {} groups; at most {MAX_WEIGHTS} may have a weight of their own (every other has 1)",
                    key("weights"),
                    weights.len()
                ),
            ));
        }
        for (name, value) in weights {
            let what = key(&format!("weights.{name:?}"));
            if name.is_empty() || name.len() > MAX_GROUP_BYTES {
                return Err(source.error(
                    span.clone(),
                    format!(
                        "{what}: a group's name is 1 to {MAX_GROUP_BYTES} bytes, as in a task's \"group\" field"
                    ),
                ));
            }
            let weight = value
                .as_integer()
                .filter(|weight| (1..=i64::from(MAX_GROUP_WEIGHT)).contains(weight))
                .ok_or_else(|| {
                    source.error(
                        span.clone(),
                        format!(
                            "{what}: {value} is not a weight; write a whole number from 1 to \
                             {MAX_GROUP_WEIGHT} (the group's share of turns; every other group has 1)"
                        ),
                    )
                })?;
            out.push((name, weight as u32));
        }
    }
    Ok(Groups {
        max_running,
        rate_limit,
        weights: out,
    })
}
