//! `kmqd stats`: each queue's depth and counters, as a table or JSON.

use std::io::Write;
use std::time::Duration;

use crate::broker::QueueStats;
use crate::broker::access::Action;
use crate::config::Config;
use crate::overview::{self, Limits};

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
    let mut limits: Vec<(&str, Limits)> = Vec::new();
    for ((name, _, stats), queue) in all.iter().zip(&config.queues) {
        if let Some(read) = overview::read_limits(&client, queue, stats)? {
            limits.push((name, read));
        }
    }
    let mut out = std::io::stdout().lock();
    if json {
        let queues: serde_json::Map<String, serde_json::Value> = all
            .iter()
            .map(|(name, mode, stats)| {
                let mut value = serde_json::to_value(stats).expect("stats serialize");
                value["mode"] = serde_json::Value::from(*mode);
                if let Some((_, read)) = limits.iter().find(|(queue, _)| queue == name) {
                    value["limits"] = serde_json::Value::Object(read.detail.clone());
                }
                (name.to_string(), value)
            })
            .collect();
        let _ = writeln!(out, "{}", serde_json::json!({ "queues": queues }));
        return Ok(());
    }
    let _ = writeln!(
        out,
        "{:<16} {:<7} {:<7} {:>9} {:>10} {:>7} {:>9} {:>9} {:>7} {:>11} {:>9} {:>9} {:>13} {:>8} {:>7} {:>9}",
        "QUEUE",
        "MODE",
        "STATE",
        "READY",
        "PROCESSING",
        "RUNNING",
        "DELAYED",
        "WAITING",
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
            "{name:<16} {mode:<7} {:<7} {:>9} {:>10} {:>7} {:>9} {:>9} {:>7} {:>11} {:>9} {:>9} {:>13} {:>8} {:>7} {:>9}",
            s.state(),
            s.ready,
            s.processing,
            running,
            s.delayed,
            s.waiting,
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
    for (name, read) in &limits {
        let _ = writeln!(out, "{name}: {}", read.line);
    }
    Ok(())
}
