//! `kmqd task show` and `kmqd task cancel`: a task by id.

use std::io::Write;
use std::time::Duration;

use clap::Subcommand;

use crate::broker::Found;
use crate::broker::access::Action;
use crate::client::Client;
use crate::config::Config;

use super::Failure;

#[derive(Subcommand, Debug)]
pub enum TaskCommand {
    /// Show where a task is: delayed (and when it is due), retrying, ready (and its place in line), processing, or
    /// dead (and why). Exit 4 when it is nowhere (done tasks are not kept).
    Show {
        queue: String,
        id: String,
        /// Print JSON: a list of {"state": ..., ...}.
        #[arg(long)]
        json: bool,
    },
    /// Cancel waiting tasks (delayed, retrying or ready); a running task cannot be cancelled. Exit 4 when an id
    /// was not waiting.
    Cancel {
        queue: String,
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

pub(super) fn run_task(config: &Config, command: TaskCommand) -> Result<(), Failure> {
    let client = Client::new(config)?;
    match command {
        TaskCommand::Show { queue, id, json } => {
            client.check_access(&[&queue], Action::Show)?;
            let found = client.find(&queue, &id)?;
            if found.is_empty() {
                return Err(Failure::NotFound(format!(
                    "no task {id} in queue {queue}: it is not delayed, ready, processing or dead (done tasks are not kept)"
                )));
            }
            let mut out = std::io::stdout().lock();
            if json {
                let _ = writeln!(
                    out,
                    "{}",
                    serde_json::to_string(&found).expect("found serializes")
                );
                return Ok(());
            }
            let ms = |ms: i64| {
                humantime::format_duration(Duration::from_millis(ms.max(0) as u64)).to_string()
            };
            for place in &found {
                let (state, payload) = match place {
                    Found::Delayed {
                        level,
                        due_in_ms,
                        envelope,
                    } => (
                        format!("delayed, level {level}, due in {}", ms(*due_in_ms)),
                        envelope,
                    ),
                    Found::Retrying {
                        level,
                        due_in_ms,
                        envelope,
                    } => (
                        format!("waiting to retry, level {level}, due in {}", ms(*due_in_ms)),
                        envelope,
                    ),
                    Found::Ready {
                        level,
                        position,
                        flow: None,
                        group: None,
                        envelope,
                    } => (
                        format!("ready, level {level}, {position} ahead of it"),
                        envelope,
                    ),
                    Found::Ready {
                        level,
                        position,
                        flow: None,
                        group: Some(group),
                        envelope,
                    } => (
                        format!(
                            "ready, level {level}, in group {group:?}, {position} of its group ahead of it                              (the groups take turns)"
                        ),
                        envelope,
                    ),
                    Found::Ready {
                        level,
                        position,
                        flow: Some(kind),
                        envelope,
                        ..
                    } => (
                        format!(
                            "ready, level {level}, held back by the limits of type {kind:?} \
                             ([[queues.limits]]), {position} of its type ahead of it"
                        ),
                        envelope,
                    ),
                    Found::Processing {
                        owner,
                        token,
                        lease_left_ms,
                        envelope,
                    } => (
                        format!(
                            "processing (owner {owner}, token {token}), lease ends in {}",
                            ms(*lease_left_ms)
                        ),
                        envelope,
                    ),
                    Found::Dead { record } => ("dead".to_string(), record),
                };
                let _ = writeln!(out, "{id} in {queue}: {state}\n  {payload}");
            }
            Ok(())
        }
        TaskCommand::Cancel { queue, ids } => {
            client.check_access(&[&queue], Action::Cancel)?;
            super::check_eviction(&client, super::OnEviction::Warn)?;
            let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
            let removed = client.cancel_batch(&queue, &refs).map_err(|error| {
                super::change_failed(
                    error,
                    "the cancel",
                    &format!("see `kmqd task show {queue} ID`; running it again is safe"),
                )
            })?;
            let mut missing = Vec::new();
            for id in &ids {
                match removed.get(id).copied().unwrap_or(0) {
                    0 => missing.push(id.as_str()),
                    n => println!(
                        "cancelled {id}{}",
                        if n > 1 {
                            format!(" ({n} copies)")
                        } else {
                            String::new()
                        }
                    ),
                }
            }
            if missing.is_empty() {
                Ok(())
            } else {
                Err(Failure::NotFound(format!(
                    "not waiting in queue {queue}, so not cancelled: {} (unknown, running, done or dead; see `kmqd task show`)",
                    missing.join(", ")
                )))
            }
        }
    }
}
