//! What a task's views show beyond where it waits: its kept result (`keep_results`) and its flow (the tasks it
//! waits for, docs/design/flows.md), for `kmqd task show` and the dashboard's task page. One module for both, so
//! that the two say the same states in the same words.
//!
//! A flow's graph may be a fan-in of 100,000 tasks: [`graph`] never reads or returns more than its [`Bounds`]
//! say. Each node of it says how many tasks it waits for, how many of them ended done or dead, and lists a page
//! of them; the rest is a count (`more`), and a node's own view pages through its dependencies.

use std::collections::{BTreeMap, HashSet};

use serde::Serialize;
use serde_json::{Value as Json, json};

use crate::broker::lookup::Budget;

use crate::broker::results::Ended;
use crate::broker::workflow::{WaitingTask, dependency_field};
use crate::client::{Client, ClientError};

/// A kept result as JSON: `{"state": "done", "result", "result_error"?, "ended_at"}` or `{"state": "dead",
/// "reason", "ended_at"}` (as `kmqd task result --json` prints it).
pub fn ended_json(ended: &Ended) -> Json {
    match ended {
        Ended::Done {
            result,
            result_error,
            ended_at_ms,
        } => {
            let mut json = json!({"state": "done", "result": result, "ended_at": ended_at_ms});
            if let Some(error) = result_error {
                json["result_error"] = json!(error);
            }
            json
        }
        Ended::Dead {
            reason,
            ended_at_ms,
        } => json!({"state": "dead", "reason": reason, "ended_at": ended_at_ms}),
    }
}

/// A task of a flow that waits (or waited) for others, in short: its flow state and its dependencies' counts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FlowState {
    /// `waiting` (for its dependencies), `released` (they all ended: it went to its ready list, and runs or ran
    /// as any task) or `dead` (dead-lettered unrun: a dependency ended dead under `if_failed = "fail"`).
    pub flow: String,
    /// Why it was failed, naming the dependency (`dead` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// `fail` or `continue`: what a dead dependency does to it.
    pub if_failed: String,
    /// How many tasks it waits for, and of them how many ended done and dead.
    pub dependencies: usize,
    pub done: usize,
    pub dead: usize,
}

impl FlowState {
    pub fn of(task: &WaitingTask) -> FlowState {
        let dead = task
            .ended
            .values()
            .filter(|outcome| outcome.get("state").and_then(Json::as_str) == Some("dead"))
            .count();
        FlowState {
            flow: task.state.clone(),
            reason: task.reason.clone(),
            if_failed: task.if_failed.clone(),
            dependencies: task.deps.len(),
            done: task.ended.len() - dead,
            dead,
        }
    }

    /// Its dependencies that ended, done or dead.
    pub fn ended(&self) -> usize {
        self.done + self.dead
    }

    /// In words, as `kmqd task show` prints it: `waiting for 2 of its 3 dependencies (1 done)`, `released: its 3
    /// dependencies ended (1 dead)`, `failed unrun: dependency a/bad ended dead: ...`.
    pub fn words(&self) -> String {
        let counts = match (self.done, self.dead) {
            (0, 0) => String::new(),
            (done, 0) => format!(" ({done} done)"),
            (0, dead) => format!(" ({dead} dead)"),
            (done, dead) => format!(" ({done} done, {dead} dead)"),
        };
        match self.flow.as_str() {
            "waiting" => format!(
                "waiting for {} of its {} dependencies{counts}",
                self.dependencies - self.ended().min(self.dependencies),
                self.dependencies
            ),
            "released" => format!(
                "released: its {} dependencies ended{counts}",
                self.dependencies
            ),
            "dead" => format!(
                "failed unrun by its flow: {}",
                self.reason.as_deref().unwrap_or("a dependency ended dead")
            ),
            other => format!("flow state {other:?}"),
        }
    }
}

/// How much of a flow's graph [`graph`] reads and returns.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// The root's dependencies shown: from `offset`, at most `limit`.
    pub offset: usize,
    pub limit: usize,
    /// The dependencies shown of each node below the root (its own view shows more).
    pub per_node: usize,
    /// How many levels below the root are shown.
    pub depth: usize,
    /// The most nodes in all: each costs Redis a few reads.
    pub nodes: usize,
    /// What the look for running nodes may read of each queue's processing area.
    pub running: Budget,
}

/// One task of a flow's graph as its views draw it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Node {
    pub queue: String,
    pub id: String,
    /// `done` or `dead` (it ended: `result` or `reason` says how), `waiting` (for its dependencies), `running`
    /// (a daemon holds it now: safe mode), `released` (its dependencies ended and it waits in its ready list, or
    /// ended without a kept result), or `pending` (it waits for nothing and has not ended: delayed, ready, or
    /// running in default mode; its own view says where).
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Json>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Its flow state and counts when it waits (or waited) for other tasks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flow: Option<FlowState>,
    /// The index of the first dependency in `after` among all of them.
    pub offset: usize,
    /// A page of its dependencies, in the order the flow named them.
    pub after: Vec<Node>,
    /// Its dependencies after those in `after`, not shown.
    pub more: usize,
}

/// The graph under `queue`/`id`, within `bounds`; `None` when the task waits for nothing (it is no flow's
/// waiting task, or it finished longer ago than its queue keeps results). A dependency in a queue this config
/// does not name is shown with what its waiter knows of it (its outcome once it ended).
pub fn graph(
    client: &Client,
    queue: &str,
    id: &str,
    bounds: Bounds,
) -> Result<Option<Node>, ClientError> {
    let mut budget = bounds.nodes.max(1);
    let mut root = node(
        client,
        (queue, id),
        None,
        (bounds.offset, bounds.limit),
        0,
        &bounds,
        &mut budget,
    )?;
    if root.flow.is_none() {
        return Ok(None);
    }
    mark_running(client, &mut root, bounds.running)?;
    Ok(Some(root))
}

/// Marks `running` the nodes not ended that a daemon holds now: one read of each queue's processing area for all
/// its nodes, at most `budget` of it (what the daemons hold, not the queue's backlog).
fn mark_running(client: &Client, root: &mut Node, budget: Budget) -> Result<(), ClientError> {
    fn not_ended<'a>(node: &'a Node, by_queue: &mut BTreeMap<&'a str, Vec<&'a str>>) {
        if matches!(node.state.as_str(), "pending" | "released") {
            by_queue.entry(&node.queue).or_default().push(&node.id);
        }
        for dep in &node.after {
            not_ended(dep, by_queue);
        }
    }
    fn mark(node: &mut Node, running: &BTreeMap<String, HashSet<String>>) {
        if matches!(node.state.as_str(), "pending" | "released")
            && running
                .get(&node.queue)
                .is_some_and(|ids| ids.contains(&node.id))
        {
            node.state = "running".into();
        }
        for dep in &mut node.after {
            mark(dep, running);
        }
    }
    let mut by_queue = BTreeMap::new();
    not_ended(root, &mut by_queue);
    let mut running = BTreeMap::new();
    for (queue, ids) in by_queue {
        match client.running(queue, &ids, budget) {
            Ok(ids) => {
                running.insert(queue.to_string(), ids);
            }
            // A queue of another config: its tasks stay as their waiters know them.
            Err(ClientError::UnknownQueue { .. }) => {}
            Err(error) => return Err(error),
        }
    }
    mark(root, &running);
    Ok(())
}

/// One node: what its waiter's ended hash says of it (`outcome`), else its own flow state and kept result;
/// then a page (`offset`, `limit`) of its dependencies, while `budget` lasts and above `bounds.depth`.
fn node(
    client: &Client,
    (queue, id): (&str, &str),
    outcome: Option<&Json>,
    (offset, limit): (usize, usize),
    depth: usize,
    bounds: &Bounds,
    budget: &mut usize,
) -> Result<Node, ClientError> {
    *budget = budget.saturating_sub(1);
    let mut node = Node {
        queue: queue.to_string(),
        id: id.to_string(),
        state: "pending".to_string(),
        result: None,
        reason: None,
        flow: None,
        offset,
        after: Vec::new(),
        more: 0,
    };
    if let Some(outcome) = outcome {
        node.state = outcome
            .get("state")
            .and_then(Json::as_str)
            .unwrap_or("done")
            .to_string();
        node.result = outcome.get("result").cloned();
        node.reason = outcome
            .get("reason")
            .and_then(Json::as_str)
            .map(str::to_string);
    }
    let waiting = match client.flow_task(queue, id) {
        Ok(waiting) => waiting,
        // A queue of another config: its waiter's note is all there is to show.
        Err(ClientError::UnknownQueue { .. }) => return Ok(node),
        Err(error) => return Err(error),
    };
    if let Some(waiting) = &waiting {
        let flow = FlowState::of(waiting);
        if outcome.is_none() {
            node.state = flow.flow.clone();
            node.reason = flow.reason.clone();
        }
        node.flow = Some(flow);
    }
    if outcome.is_none() && matches!(node.state.as_str(), "pending" | "released") {
        if let Some(ended) = client.kept_result(queue, id)? {
            match ended {
                Ended::Done { result, .. } => {
                    node.state = "done".into();
                    node.result = Some(result);
                }
                Ended::Dead { reason, .. } => {
                    node.state = "dead".into();
                    node.reason = Some(reason);
                }
            }
        }
    }
    let Some(waiting) = waiting else {
        return Ok(node);
    };
    let deps = &waiting.deps;
    let offset = offset.min(deps.len());
    let mut shown = 0;
    if depth < bounds.depth {
        for (dep_queue, dep_id) in deps[offset..].iter().take(limit) {
            if *budget == 0 {
                break;
            }
            let outcome = waiting.ended.get(&dependency_field(dep_queue, dep_id));
            node.after.push(self::node(
                client,
                (dep_queue, dep_id),
                outcome,
                (0, bounds.per_node),
                depth + 1,
                bounds,
                budget,
            )?);
            shown += 1;
        }
    }
    node.offset = offset;
    node.more = deps.len() - offset - shown;
    Ok(node)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(state: &str, deps: usize, ended: &[(&str, &str)]) -> WaitingTask {
        WaitingTask {
            state: state.into(),
            if_failed: "fail".into(),
            deps: (0..deps)
                .map(|n| ("q".to_string(), format!("d{n}")))
                .collect(),
            ended: ended
                .iter()
                .map(|(field, state)| (field.to_string(), json!({ "state": state })))
                .collect(),
            ..WaitingTask::default()
        }
    }

    /// The words `kmqd task show` prints for each flow state, with the counts of what ended.
    #[test]
    fn a_flow_state_says_how_many_dependencies_it_waits_for_and_how_they_ended() {
        let cases = [
            (
                waiting("waiting", 3, &[("q\nd0", "done")]),
                "waiting for 2 of its 3 dependencies (1 done)",
            ),
            (
                waiting("waiting", 2, &[]),
                "waiting for 2 of its 2 dependencies",
            ),
            (
                waiting(
                    "released",
                    3,
                    &[("q\nd0", "done"), ("q\nd1", "dead"), ("q\nd2", "done")],
                ),
                "released: its 3 dependencies ended (2 done, 1 dead)",
            ),
            (
                WaitingTask {
                    reason: Some("dependency q/d1 ended dead: boom".into()),
                    ..waiting("dead", 2, &[("q\nd1", "dead")])
                },
                "failed unrun by its flow: dependency q/d1 ended dead: boom",
            ),
        ];
        for (task, words) in cases {
            assert_eq!(FlowState::of(&task).words(), words);
        }
    }
}
