//! `kmqd queue pause` and `kmqd queue resume`: stop and restart every daemon's taking of a queue's tasks.

use std::io::Write;

use clap::Subcommand;

use crate::broker::access::Action;
use crate::client::Client;
use crate::config::Config;

use super::Failure;

#[derive(Subcommand, Debug)]
pub enum QueueCommand {
    /// Pause a queue on every daemon: pushes are still accepted and delayed tasks still become ready, but no
    /// daemon takes a task until it is resumed (within one fetch; running tasks finish).
    Pause { queue: String },
    /// Resume a paused queue: the daemons take its tasks again within their idle_poll.
    Resume { queue: String },
}

pub(super) fn run_queue(config: &Config, command: QueueCommand) -> Result<(), Failure> {
    let client = Client::new(config)?;
    let mut out = std::io::stdout().lock();
    match command {
        QueueCommand::Pause { queue } => {
            client.check_access(&[&queue], Action::Pause)?;
            super::check_eviction(&client, super::OnEviction::Warn)?;
            if client.pause(&queue)? {
                let _ = writeln!(out, "paused {queue}");
            } else {
                let _ = writeln!(out, "{queue} was paused already");
            }
        }
        QueueCommand::Resume { queue } => {
            client.check_access(&[&queue], Action::Resume)?;
            super::check_eviction(&client, super::OnEviction::Warn)?;
            if client.resume(&queue)? {
                let _ = writeln!(out, "resumed {queue}");
            } else {
                let _ = writeln!(out, "{queue} was not paused");
            }
        }
    }
    Ok(())
}
