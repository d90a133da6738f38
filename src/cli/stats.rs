//! `kmqd stats`: each queue's depth and counters, as a table or JSON.

use std::io::Write;
use std::time::Duration;

use crate::broker::QueueStats;
use crate::broker::access::Action;
use crate::config::Config;

use super::Failure;

pub(super) fn run_stats(config: &Config, json: bool) -> Result<(), Failure> {
    let client = super::client_for_every_queue(config, Action::Stats)?;
    let mut all: Vec<(&str, &'static str, QueueStats)> = Vec::new();
    for queue in &config.queues {
        let mode = match queue.mode {
            crate::config::Mode::Default => "default",
            crate::config::Mode::Safe => "safe",
        };
        all.push((&queue.name, mode, client.stats(&queue.name)?));
    }
    // What holds each limited queue back: its limits against what Redis counts now.
    let mut limits: Vec<(&str, String, serde_json::Value)> = Vec::new();
    for ((name, _, stats), queue) in all.iter().zip(&config.queues) {
        let windows: Vec<u64> = queue
            .rate_limit
            .iter()
            .map(|rate| rate.window_ms())
            .collect();
        let used = client.rate_used(name, &windows)?;
        let types = client.type_usage(name, &queue.type_limits)?;
        if let Some(line) = limits_line(queue, stats, &used, &types) {
            limits.push((name, line.0, line.1));
        }
    }
    let mut out = std::io::stdout().lock();
    if json {
        let queues: serde_json::Map<String, serde_json::Value> = all
            .iter()
            .map(|(name, mode, stats)| {
                let mut value = serde_json::to_value(stats).expect("stats serialize");
                value["mode"] = serde_json::Value::from(*mode);
                if let Some((_, _, held)) = limits.iter().find(|(queue, ..)| queue == name) {
                    value["limits"] = held.clone();
                }
                (name.to_string(), value)
            })
            .collect();
        let _ = writeln!(out, "{}", serde_json::json!({ "queues": queues }));
        return Ok(());
    }
    let _ = writeln!(
        out,
        "{:<16} {:<7} {:<7} {:>9} {:>10} {:>7} {:>9} {:>7} {:>11} {:>9} {:>9} {:>13} {:>8} {:>7} {:>9}",
        "QUEUE",
        "MODE",
        "STATE",
        "READY",
        "PROCESSING",
        "RUNNING",
        "DELAYED",
        "DEAD",
        "DONE",
        "RETRIED",
        "FAILED",
        "DEAD_LETTERED",
        "REQUEUED",
        "PURGED",
        "LAG"
    );
    for (name, mode, s) in &all {
        // Only a queue with a running limit counts: "-" tells the others apart from a limited queue at 0.
        let running = config
            .queue(name)
            .and_then(|queue| queue.max_running)
            .map_or("-".to_string(), |limit| format!("{}/{limit}", s.running));
        let lag = s.lag_ms.map_or("-".to_string(), |ms| {
            humantime::format_duration(Duration::from_millis(ms as u64)).to_string()
        });
        let _ = writeln!(
            out,
            "{name:<16} {mode:<7} {:<7} {:>9} {:>10} {:>7} {:>9} {:>7} {:>11} {:>9} {:>9} {:>13} {:>8} {:>7} {:>9}",
            s.state(),
            s.ready,
            s.processing,
            running,
            s.delayed,
            s.dead,
            s.done,
            s.retried,
            s.failed,
            s.dead_lettered,
            s.requeued,
            s.purged,
            lag
        );
    }
    for (name, line, _) in &limits {
        let _ = writeln!(out, "{name}: {line}");
    }
    Ok(())
}

/// The line `kmqd stats` prints under its table for a queue with limits or a throttle (`api: running 20/20, held
/// back · rate 200/200 per 1s, held back · type "report": running 2/2, held back, 14 waiting · throttled 1.2 s
/// more`), and the same as JSON; `None` for a queue with neither. `used`: the starts each of its rate windows
/// holds now ([`crate::Client::rate_used`]); `types`: what each of its `[[queues.limits]]` counts.
fn limits_line(
    queue: &crate::config::QueueConfig,
    stats: &QueueStats,
    used: &[u64],
    types: &[crate::broker::TypeUsage],
) -> Option<(String, serde_json::Value)> {
    let mut parts = Vec::new();
    let mut json = serde_json::Map::new();
    json.extend(limit_parts(
        &mut parts,
        queue.max_running,
        stats.running,
        &queue.rate_limit,
        used,
    ));
    let mut per_type = Vec::new();
    for (limit, usage) in queue.type_limits.iter().zip(types) {
        let mut type_parts = Vec::new();
        let mut type_json = limit_parts(
            &mut type_parts,
            limit.max_running,
            usage.running,
            &limit.rate_limit,
            &usage.rate_used,
        );
        type_json.insert("type".into(), limit.kind.clone().into());
        type_json.insert("waiting".into(), usage.waiting.into());
        if let Some(ms) = usage.throttle_ms {
            type_parts.push(format!(
                "throttled {} more",
                humantime::format_duration(Duration::from_millis(ms as u64))
            ));
            type_json.insert("throttle_ms".into(), ms.into());
        }
        if usage.waiting > 0 {
            type_parts.push(format!("{} waiting", usage.waiting));
        }
        parts.push(format!("type {:?}: {}", limit.kind, type_parts.join(", ")));
        per_type.push(serde_json::Value::Object(type_json));
    }
    if !per_type.is_empty() {
        json.insert("types".into(), serde_json::Value::Array(per_type));
    }
    if let Some(ms) = stats.throttle_ms {
        parts.push(format!(
            "throttled {} more",
            humantime::format_duration(Duration::from_millis(ms as u64))
        ));
        json.insert("throttle_ms".into(), serde_json::Value::from(ms));
    }
    (!parts.is_empty()).then(|| (parts.join(" · "), serde_json::Value::Object(json)))
}

/// The words and the JSON of one scope's limits (the queue's, or a type's): its running count against its
/// `max_running`, and each rate window's starts against its limit, each "held back" when full.
fn limit_parts(
    parts: &mut Vec<String>,
    max_running: Option<usize>,
    running: u64,
    rate_limit: &[crate::config::rate::RateLimit],
    used: &[u64],
) -> serde_json::Map<String, serde_json::Value> {
    let mut json = serde_json::Map::new();
    if let Some(limit) = max_running {
        let full = running as usize >= limit;
        parts.push(format!(
            "running {running}/{limit}{}",
            if full { ", held back" } else { "" }
        ));
        json.insert(
            "max_running".into(),
            serde_json::json!({ "limit": limit, "running": running, "held_back": full }),
        );
    }
    let mut rates = Vec::new();
    for (rate, used) in rate_limit.iter().zip(used) {
        let full = *used >= rate.starts;
        parts.push(format!(
            "rate {used}/{} per {}{}",
            rate.starts,
            humantime::format_duration(Duration::from_millis(rate.window_ms())),
            if full { ", held back" } else { "" }
        ));
        rates.push(serde_json::json!({
            "window_ms": rate.window_ms(),
            "limit": rate.starts,
            "used": used,
            "held_back": full,
        }));
    }
    if !rates.is_empty() {
        json.insert("rate_limit".into(), serde_json::Value::Array(rates));
    }
    json
}
