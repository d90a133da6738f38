//! `kmqd groups` and `kmqd group pause|resume`: a grouped queue's busiest groups, and one group stopped or
//! restarted on every daemon (`[queues.groups]`).

use std::io::Write;

use clap::Subcommand;

use crate::broker::access::Action;
use crate::client::Client;
use crate::config::Config;

use super::Failure;

#[derive(Subcommand, Debug)]
pub enum GroupCommand {
    /// Pause one group of a queue on every daemon: its tasks are still accepted, and its running tasks finish,
    /// but no daemon takes another of its tasks until it is resumed; the other groups go on.
    Pause { queue: String, group: String },
    /// Resume a paused group: its tasks take turns again at the next claim.
    Resume { queue: String, group: String },
}

/// The queue's configured groups, or a usage error naming the key to add.
fn grouped(config: &Config, queue: &str) -> Result<(), Failure> {
    match config.queue(queue) {
        Some(found) if found.groups.is_none() => Err(Failure::Usage(format!(
            "queue {queue:?} has no [queues.groups] in {}: its tasks do not take turns by group",
            config.path.display()
        ))),
        _ => Ok(()),
    }
}

pub(super) fn run_group(config: &Config, command: GroupCommand) -> Result<(), Failure> {
    let client = Client::new(config)?;
    let mut out = std::io::stdout().lock();
    match command {
        GroupCommand::Pause { queue, group } => {
            grouped(config, &queue)?;
            client.check_access(&[&queue], Action::Pause)?;
            if client.pause_group(&queue, &group)? {
                let _ = writeln!(out, "paused group {group:?} of {queue}");
            } else {
                let _ = writeln!(out, "group {group:?} of {queue} was paused already");
            }
        }
        GroupCommand::Resume { queue, group } => {
            grouped(config, &queue)?;
            client.check_access(&[&queue], Action::Resume)?;
            if client.resume_group(&queue, &group)? {
                let _ = writeln!(out, "resumed group {group:?} of {queue}");
            } else {
                let _ = writeln!(out, "group {group:?} of {queue} was not paused");
            }
        }
    }
    Ok(())
}

/// `kmqd groups QUEUE`: one line a group, busiest first, or `{"groups": [...]}`.
pub(super) fn run_groups(
    config: &Config,
    queue: &str,
    json: bool,
    limit: usize,
) -> Result<(), Failure> {
    grouped(config, queue)?;
    let client = Client::new(config)?;
    client.check_access(&[queue], Action::Stats)?;
    let groups = client.groups(queue, limit)?;
    let mut out = std::io::stdout().lock();
    if json {
        let _ = writeln!(out, "{}", serde_json::json!({ "groups": groups }));
        return Ok(());
    }
    let _ = writeln!(
        out,
        "{:<32} {:>9} {:>8}  STATE",
        "GROUP", "WAITING", "RUNNING"
    );
    for group in &groups {
        let mut state = Vec::new();
        if group.paused {
            state.push("paused".to_string());
        }
        if let Some(ms) = group.throttled_ms {
            state.push(format!(
                "throttled {}",
                humantime::format_duration(std::time::Duration::from_millis(ms))
            ));
        }
        if group.held_back && state.is_empty() {
            state.push("held back".to_string());
        }
        let name = if group.name.is_empty() {
            "(no group)".to_string()
        } else {
            format!("{:?}", group.name)
        };
        let _ = writeln!(
            out,
            "{name:<32} {:>9} {:>8}  {}",
            group.waiting,
            group.running,
            if state.is_empty() {
                "-".to_string()
            } else {
                state.join(", ")
            }
        );
    }
    Ok(())
}
