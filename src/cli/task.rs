//! `kmqd task show`, `kmqd task cancel` and `kmqd task result`: a task by id.

use std::io::Write;
use std::time::Duration;

use clap::Subcommand;

use crate::broker::Found;
use crate::broker::access::Action;
use crate::broker::results::Ended;
use crate::client::{Client, TaskResult};
use crate::config::Config;
use crate::task_view::{self, FlowState};

use super::Failure;

#[derive(Subcommand, Debug)]
pub enum TaskCommand {
    /// Show where a task is: delayed (and when it is due), retrying, ready (and its place in line), processing, or
    /// dead (and why); its kept result (`keep_results`), and, for a task of a flow, what it waits for (waiting for
    /// N of M, released, failed and why). Exit 4 when it is nowhere (done tasks leave only a kept result).
    Show {
        queue: String,
        id: String,
        /// Print JSON: a list of {"state": ..., ...}: each place, then {"state": "ended", ...} for a kept result and
        /// {"state": "flow", ...} for a flow's task.
        #[arg(long)]
        json: bool,
    },
    /// Print a task's result (docs/PROTOCOL.md, "Results"; the queue needs `keep_results`): the JSON its handler
    /// returned (`null` for none), exit 0. A task that ended dead: its reason, exit 6. Still waiting or running
    /// when the wait ends: exit 5. Unknown, or its result expired: exit 4.
    Result {
        queue: String,
        id: String,
        /// Wait this long for the task to end (`30s`, `2m`); without it, answer at once.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
        wait: Duration,
        /// Print the whole kept record as JSON (`state`, `result` or `reason`, `ended_at`).
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
            let kept = client.kept_result(&queue, &id)?;
            let flow = client
                .flow_task(&queue, &id)?
                .map(|task| FlowState::of(&task));
            if found.is_empty() && kept.is_none() && flow.is_none() {
                return Err(Failure::NotFound(format!(
                    "no task {id} in queue {queue}: it is not delayed, ready, processing or dead, waits in no flow, \
                     and has no kept result (a done task leaves one only with keep_results)"
                )));
            }
            let mut out = std::io::stdout().lock();
            if json {
                let mut list = serde_json::to_value(&found).expect("found serializes");
                let entries = list.as_array_mut().expect("a list serializes as an array");
                entries.extend(kept.as_ref().map(ended_entry));
                entries.extend(flow.as_ref().map(flow_entry));
                let _ = writeln!(out, "{list}");
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
                        progress,
                    } => {
                        let mut state = format!(
                            "processing (owner {owner}, token {token}), lease ends in {}",
                            ms(*lease_left_ms)
                        );
                        if let Some(progress) = progress {
                            state.push_str(&format!(
                                "\n  progress {:.0}% ({}), reported {} ago",
                                progress.fraction * 100.0,
                                progress.message,
                                ms(progress.age_ms)
                            ));
                        }
                        (state, envelope)
                    }
                    Found::Dead { record } => ("dead".to_string(), record),
                };
                let _ = writeln!(out, "{id} in {queue}: {state}\n  {payload}");
            }
            if let Some(ended) = &kept {
                let (how, shown) = match ended {
                    Ended::Done { result, .. } => ("done", result.to_string()),
                    Ended::Dead { reason, .. } => ("dead", reason.clone()),
                };
                let _ = writeln!(out, "{id} in {queue}: ended {how} (kept result)\n  {shown}");
            }
            if let Some(flow) = &flow {
                let _ = writeln!(
                    out,
                    "{id} in {queue}: in a flow, {} (the graph: kmqd flow show {queue} {id})",
                    flow.words()
                );
            }
            Ok(())
        }
        TaskCommand::Result {
            queue,
            id,
            wait,
            json,
        } => {
            client.check_access(&[&queue], Action::Show)?;
            result(&client.result(&queue, &id, wait)?, &queue, &id, json)
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

/// A kept result as an entry of `task show --json`'s list: `{"state": "ended", "outcome": "done", "result",
/// "ended_at"}` or `{"state": "ended", "outcome": "dead", "reason", "ended_at"}`.
fn ended_entry(ended: &Ended) -> serde_json::Value {
    let mut entry = task_view::ended_json(ended);
    entry["outcome"] = entry["state"].take();
    entry["state"] = "ended".into();
    entry
}

/// A flow's task as an entry of `task show --json`'s list: `{"state": "flow", "flow": "waiting", "if_failed",
/// "dependencies", "done", "dead", "reason"?}`.
fn flow_entry(flow: &FlowState) -> serde_json::Value {
    let mut entry = serde_json::to_value(flow).expect("a flow state serializes");
    entry["state"] = "flow".into();
    entry
}

/// Prints what `task result` found, and maps it to its exit code (see [`TaskCommand::Result`]).
fn result(found: &TaskResult, queue: &str, id: &str, json: bool) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    match found {
        TaskResult::Ended(Ended::Done {
            result,
            result_error,
            ended_at_ms,
        }) => {
            if json {
                let record = serde_json::json!({
                    "state": "done", "result": result, "result_error": result_error, "ended_at": ended_at_ms,
                });
                let _ = writeln!(out, "{record}");
            } else {
                let _ = writeln!(out, "{result}");
            }
            if let Some(error) = result_error {
                // The task is done; its result was not kept, and the reader is told why.
                tracing::warn!(queue, id, "{error}");
            }
            Ok(())
        }
        TaskResult::Ended(Ended::Dead {
            reason,
            ended_at_ms,
        }) => {
            if json {
                let record =
                    serde_json::json!({"state": "dead", "reason": reason, "ended_at": ended_at_ms});
                let _ = writeln!(out, "{record}");
            } else {
                let _ = writeln!(out, "{reason}");
            }
            Err(Failure::Dead(format!(
                "task {id} in queue {queue} ended dead"
            )))
        }
        TaskResult::DeadLettered(record) => {
            let reason = serde_json::from_str::<serde_json::Value>(record)
                .ok()
                .and_then(|record| record.get("reason")?.as_str().map(str::to_string))
                .unwrap_or_default();
            if json {
                let _ = writeln!(out, "{record}");
            } else {
                let _ = writeln!(out, "{reason}");
            }
            Err(Failure::Dead(format!(
                "task {id} in queue {queue} is in the dead-letter list"
            )))
        }
        TaskResult::Pending => Err(Failure::Pending(format!(
            "task {id} in queue {queue} is still waiting or running"
        ))),
        TaskResult::Unknown { keeps_results } => Err(Failure::NotFound(if *keeps_results {
            format!(
                "no task {id} in queue {queue}, and no result kept for it: never pushed, or its result expired \
                 (keep_results)"
            )
        } else {
            format!(
                "no task {id} in queue {queue}: queue {queue} keeps no results (set keep_results, \
                 docs/CONFIG.md), so a done task leaves nothing"
            )
        })),
    }
}
