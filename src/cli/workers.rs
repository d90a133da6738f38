//! `kmqd workers`: the daemons alive on each configured queue, from their owners' leases and registrations.

use std::io::Write;
use std::time::Duration;

use crate::broker::access::Action;
use crate::broker::admin::Worker;
use crate::config::Config;

use super::Failure;

pub(super) fn run_workers(config: &Config, json: bool) -> Result<(), Failure> {
    let client = super::client_for_every_queue(config, Action::Workers)?;
    let mut all: Vec<Worker> = Vec::new();
    for queue in &config.queues {
        all.extend(client.workers(&queue.name)?);
    }
    let mut out = std::io::stdout().lock();
    if json {
        let _ = writeln!(out, "{}", serde_json::json!({ "workers": all }));
        return Ok(());
    }
    let _ = writeln!(
        out,
        "{:<16} {:<24} {:>8} {:<8} {:>9} {:>6} {:>5} {:<20} {:<8} OWNER",
        "QUEUE", "HOST", "PID", "VERSION", "LEASE", "HELD", "STUCK", "STARTED", "STATE"
    );
    for w in &all {
        let lease = humantime::format_duration(Duration::from_millis(
            (w.lease_left_ms.max(0) as u64 / 100) * 100,
        ))
        .to_string();
        let held = w.held.map_or("-".to_string(), |n| n.to_string());
        let stuck = w.stuck.map_or("-".to_string(), |n| n.to_string());
        let started = started_at(w.started_at_ms);
        // Draining wins: a stopping daemon takes nothing whether or not the queue is paused.
        let state = if w.draining {
            "draining"
        } else if w.paused {
            "paused"
        } else {
            "serving"
        };
        let _ = writeln!(
            out,
            "{:<16} {:<24} {:>8} {:<8} {:>9} {:>6} {:>5} {:<20} {:<8} {}",
            w.queue, w.host, w.pid, w.version, lease, held, stuck, started, state, w.owner
        );
    }
    Ok(())
}

/// A start time as RFC 3339 UTC to the second (`-` when unknown).
fn started_at(ms: i64) -> String {
    if ms <= 0 {
        return "-".to_string();
    }
    let at = std::time::UNIX_EPOCH + Duration::from_millis(ms as u64);
    humantime::format_rfc3339_seconds(at).to_string()
}
