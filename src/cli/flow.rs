//! `kmqd flow push FILE|-` and `kmqd flow show QUEUE ID`: a flow of tasks that wait for each other
//! (docs/design/flows.md), pushed whole from its JSON, and the graph under one of its tasks with each task's state.

use std::io::{Read, Write};

use clap::Subcommand;
use serde_json::json;

use crate::broker::access::Action;
use crate::broker::workflow::dependency_field;
use crate::client::Client;
use crate::config::Config;

use super::Failure;

/// The most tasks `flow show` reads: a fan-in of 100,000 is summed up past them.
const SHOWN: usize = 1000;

#[derive(Subcommand, Debug)]
pub enum FlowCommand {
    /// Push a flow from its JSON file (`-`: standard input): every task, each ready only once every task it waits
    /// for ("after") has ended. Prints the ids it generated.
    Push {
        /// The flow's JSON file, or `-` for standard input.
        file: String,
    },
    /// Show the graph under a waiting task of a flow: each task's state, result and reason.
    Show {
        /// The queue, as named in the config.
        queue: String,
        /// The task's id.
        id: String,
        /// Print JSON: {"queue", "id", "state", "after": [...]}.
        #[arg(long)]
        json: bool,
    },
}

pub(super) fn run_flow(config: &Config, command: FlowCommand) -> Result<(), Failure> {
    let client = Client::new(config)?;
    match command {
        FlowCommand::Push { file } => {
            // A flow may name any queue of the config: the producer's rules are checked on each, for the
            // waiting tasks (flow_push.lua) and for the tasks that wait for nothing (push.lua).
            let names: Vec<&str> = config
                .queues
                .iter()
                .map(|queue| queue.name.as_str())
                .collect();
            client.check_access(&names, Action::FlowPush)?;
            client.check_access(&names, Action::Push)?;
            push(&client, &file)
        }
        FlowCommand::Show { queue, id, json } => show(&client, &queue, &id, json),
    }
}

fn push(client: &Client, file: &str) -> Result<(), Failure> {
    let text = if file == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|error| Failure::Usage(format!("standard input: {error}")))?;
        text
    } else {
        std::fs::read_to_string(file).map_err(|error| Failure::Usage(format!("{file}: {error}")))?
    };
    super::check_eviction(client, super::OnEviction::Refuse)?;
    let pushed = client.push_flow(&text).map_err(|error| {
        super::change_failed(
            error,
            "the flow",
            "see `kmqd flow show QUEUE ID` of its root",
        )
    })?;
    let mut out = std::io::stdout().lock();
    for (queue, id, path) in &pushed.tasks {
        if let Some(path) = path {
            let _ = writeln!(out, "{queue} {id} ({path}: id generated)");
        }
    }
    for (queue, id, said) in &pushed.kept {
        let _ = writeln!(
            out,
            "{queue} {id}: was pushed before ({said}); left as it is"
        );
    }
    let (queue, id, _) = &pushed.tasks[0];
    let _ = writeln!(
        out,
        "pushed a flow of {} tasks; its root is {queue} {id}",
        pushed.tasks.len()
    );
    Ok(())
}

/// The graph under `queue`/`id`, as JSON: each node `{"queue", "id", "state", "result" | "reason", "after"}`.
fn graph(
    client: &Client,
    queue: &str,
    id: &str,
    state: Option<&serde_json::Value>,
    budget: &mut usize,
) -> Result<serde_json::Value, Failure> {
    *budget = budget.saturating_sub(1);
    let mut node = json!({"queue": queue, "id": id});
    if let Some(outcome) = state {
        for field in ["state", "result", "reason"] {
            if let Some(value) = outcome.get(field) {
                node[field] = value.clone();
            }
        }
    }
    let Some(waiting) = client.flow_task(queue, id)? else {
        if state.is_none() {
            node["state"] = json!("pending");
        }
        return Ok(node);
    };
    if state.is_none() {
        node["state"] = json!(waiting.state);
        if let Some(reason) = &waiting.reason {
            node["reason"] = json!(reason);
        }
    }
    node["if_failed"] = json!(waiting.if_failed);
    let mut after = Vec::new();
    for (n, (dep_queue, dep_id)) in waiting.deps.iter().enumerate() {
        if *budget == 0 {
            after.push(json!({"more": waiting.deps.len() - n}));
            break;
        }
        let outcome = waiting.ended.get(&dependency_field(dep_queue, dep_id));
        after.push(graph(client, dep_queue, dep_id, outcome, budget)?);
    }
    node["after"] = json!(after);
    Ok(node)
}

fn show(client: &Client, queue: &str, id: &str, json: bool) -> Result<(), Failure> {
    if client.flow_task(queue, id)?.is_none() {
        return Err(Failure::NotFound(format!(
            "{queue} {id} is not a waiting task of a flow (never one, or finished longer ago than its queue keeps \
             results: `kmqd task show {queue} {id}`)"
        )));
    }
    let mut budget = SHOWN;
    let graph = graph(client, queue, id, None, &mut budget)?;
    let mut out = std::io::stdout().lock();
    if json {
        let _ = writeln!(out, "{graph}");
    } else {
        draw(&mut out, &graph, 0);
    }
    Ok(())
}

/// One line a task, indented by its depth: `QUEUE ID STATE`, then its result or reason.
fn draw(out: &mut impl Write, node: &serde_json::Value, depth: usize) {
    let indent = "  ".repeat(depth);
    if let Some(more) = node.get("more") {
        let _ = writeln!(out, "{indent}... {more} more");
        return;
    }
    let text = |field: &str| {
        node.get(field)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string()
    };
    let mut line = format!("{indent}{} {} {}", text("queue"), text("id"), text("state"));
    if let Some(result) = node.get("result").filter(|result| !result.is_null()) {
        line.push_str(&format!(" result={result}"));
    }
    if let Some(reason) = node.get("reason").and_then(|reason| reason.as_str()) {
        line.push_str(&format!(" reason={reason:?}"));
    }
    let _ = writeln!(out, "{line}");
    for dep in node
        .get("after")
        .and_then(|after| after.as_array())
        .into_iter()
        .flatten()
    {
        draw(out, dep, depth + 1);
    }
}
