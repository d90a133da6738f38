//! A flow file (`kmqd flow push`, docs/design/flows.md): its JSON parsed, then checked whole into a [`Plan`] of
//! what to write to each queue, before anything is written. Pure: the queues it may name come in as a lookup.
//!
//! A node is `{"queue", "type", "id"?, "data"?, "priority"?, "if_failed"?, "after"?: [NODE, ...]}`: the task, and
//! the tasks it waits for. A node with only `queue` and `id` refers to a task defined elsewhere in the file, so
//! that two tasks can wait for one (a graph, not only a tree); a cycle through such references is refused.

use std::collections::{HashMap, HashSet};

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::broker::workflow::{Waiter, waiters_json};
use crate::task::Envelope;

/// A node of the file, as it is written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    queue: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    id: Option<String>,
    data: Option<Box<RawValue>>,
    priority: Option<String>,
    if_failed: Option<String>,
    #[serde(default)]
    after: Vec<RawNode>,
}

/// What a flow may know of a queue of the config.
pub struct QueueShape {
    /// Its priority levels, highest first.
    pub levels: Vec<String>,
    /// The index of its default level.
    pub default_level: usize,
}

/// A task of the flow that waits for nothing: pushed as any task is, once every waiting task is written.
#[derive(Debug, Clone)]
pub struct Leaf {
    pub id: String,
    pub level: usize,
    pub envelope: String,
}

/// Every task of a flow, checked: per queue, its waiting tasks and its leaves.
#[derive(Debug, Default)]
pub struct Plan {
    /// Queue -> its waiting tasks, in the file's order.
    pub waiters: Vec<(String, Vec<Waiter>)>,
    /// Queue -> its tasks that wait for nothing.
    pub leaves: Vec<(String, Vec<Leaf>)>,
    /// Every task, the root first, in the file's order: (queue, id, its path in the file when its id was
    /// generated).
    pub tasks: Vec<(String, String, Option<String>)>,
}

/// A defined node, once read.
struct Node {
    queue: String,
    kind: String,
    id: String,
    data: Box<RawValue>,
    level: usize,
    continue_if_failed: bool,
    priority: Option<String>,
    deps: Vec<(String, String)>,
    path: String,
    generated: bool,
}

/// Parses and checks a flow file. `queues` names the config's queues. The error names the node (its path in the
/// file, such as `after[1].after[0]`) and what is wrong with it.
pub fn plan(text: &str, queues: &HashMap<String, QueueShape>) -> Result<Plan, String> {
    let root: RawNode = serde_json::from_str(text)
        .map_err(|error| format!("the flow is not a flow's JSON: {error}"))?;
    let mut nodes: Vec<Node> = Vec::new();
    let mut references: Vec<(String, (String, String))> = Vec::new();
    let root_key = read(&root, "the root", queues, &mut nodes, &mut references)?;
    if root_key.is_none() {
        return Err(
            "the root: a flow's root is a task (queue and type), not a reference".to_string(),
        );
    }
    // Defined once each; every reference names a defined task.
    let mut defined: HashMap<(String, String), usize> = HashMap::new();
    for (at, node) in nodes.iter().enumerate() {
        if let Some(first) = defined.insert((node.queue.clone(), node.id.clone()), at) {
            return Err(format!(
                "{}: task {}/{} is defined twice (first at {}); to wait for one task twice, refer to it with \
                 {{\"queue\": ..., \"id\": ...}} only",
                node.path, node.queue, node.id, nodes[first].path
            ));
        }
    }
    for (path, key) in &references {
        if !defined.contains_key(key) {
            return Err(format!(
                "{path}: refers to task {}/{}, which the flow does not define",
                key.0, key.1
            ));
        }
    }
    // No cycle: a depth-first walk from every node (white, grey, black).
    let mut state = vec![0u8; nodes.len()];
    for start in 0..nodes.len() {
        let mut stack = vec![(start, 0usize)];
        while let Some((at, next)) = stack.pop() {
            if next == 0 {
                if state[at] == 2 {
                    continue;
                }
                state[at] = 1;
            }
            match nodes[at].deps.get(next) {
                Some(dep) => {
                    stack.push((at, next + 1));
                    let dep = defined[dep];
                    match state[dep] {
                        1 => {
                            return Err(format!(
                                "{}: task {}/{} waits for itself through {}/{} (a cycle); a flow must end",
                                nodes[dep].path,
                                nodes[dep].queue,
                                nodes[dep].id,
                                nodes[at].queue,
                                nodes[at].id
                            ));
                        }
                        0 => stack.push((dep, 0)),
                        _ => {}
                    }
                }
                None => state[at] = 2,
            }
        }
    }
    // Who waits for whom. A task waiting for one twice is found among its own dependencies (a set a node), not
    // among the dependency's waiters: a scan of those would be O(n²) for a task that n tasks wait for.
    let mut up: HashMap<(String, String), Vec<(String, String)>> = HashMap::new();
    for node in &nodes {
        let mut seen: HashSet<&(String, String)> = HashSet::with_capacity(node.deps.len());
        for dep in &node.deps {
            if !seen.insert(dep) {
                return Err(format!(
                    "{}: task {}/{} waits for {}/{} twice",
                    node.path, node.queue, node.id, dep.0, dep.1
                ));
            }
            let waiter = (node.queue.clone(), node.id.clone());
            up.entry(dep.clone()).or_default().push(waiter);
        }
    }
    let mut plan = Plan::default();
    let mut waiters: HashMap<String, Vec<Waiter>> = HashMap::new();
    let mut leaves: HashMap<String, Vec<Leaf>> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    for node in nodes {
        let key = (node.queue.clone(), node.id.clone());
        let its_up = up.remove(&key).unwrap_or_default();
        let mut envelope = Envelope::new(node.id.clone(), node.kind.clone(), node.data);
        envelope.priority = node.priority.map(std::borrow::Cow::Owned);
        if !its_up.is_empty() {
            let list = RawValue::from_string(waiters_json(&its_up)).expect("a JSON list");
            envelope.extra.push((
                std::borrow::Cow::Borrowed("waiters"),
                std::borrow::Cow::Owned(list),
            ));
        }
        let envelope = envelope.encode();
        if !order.contains(&node.queue) {
            order.push(node.queue.clone());
        }
        plan.tasks.push((
            node.queue.clone(),
            node.id.clone(),
            node.generated.then_some(node.path),
        ));
        if node.deps.is_empty() {
            leaves.entry(node.queue).or_default().push(Leaf {
                id: node.id,
                level: node.level,
                envelope,
            });
        } else {
            waiters.entry(node.queue).or_default().push(Waiter {
                id: node.id,
                kind: node.kind,
                envelope,
                level: node.level,
                continue_if_failed: node.continue_if_failed,
                deps: node.deps,
                up: its_up,
            });
        }
    }
    for queue in order {
        if let Some(list) = waiters.remove(&queue) {
            plan.waiters.push((queue.clone(), list));
        }
        if let Some(list) = leaves.remove(&queue) {
            plan.leaves.push((queue, list));
        }
    }
    Ok(plan)
}

/// Reads `raw` (at `path`) and what it waits for into `nodes`, depth first; a reference goes to `references`.
/// Returns the task it names: `None` never but for the root's check (a reference names its task too).
fn read(
    raw: &RawNode,
    path: &str,
    queues: &HashMap<String, QueueShape>,
    nodes: &mut Vec<Node>,
    references: &mut Vec<(String, (String, String))>,
) -> Result<Option<(String, String)>, String> {
    let queue = raw
        .queue
        .clone()
        .ok_or_else(|| format!("{path}: no \"queue\""))?;
    let shape = queues.get(&queue).ok_or_else(|| {
        let mut known: Vec<&str> = queues.keys().map(String::as_str).collect();
        known.sort_unstable();
        format!(
            "{path}: queue {queue:?} is not in the config; configured queues: {}",
            known.join(", ")
        )
    })?;
    let Some(kind) = raw.kind.clone() else {
        // A reference: a queue and an id, nothing else.
        let id = raw.id.clone().ok_or_else(|| {
            format!("{path}: no \"type\" (a task needs one; a reference to a task defined elsewhere needs an \"id\")")
        })?;
        if raw.data.is_some()
            || raw.priority.is_some()
            || raw.if_failed.is_some()
            || !raw.after.is_empty()
        {
            return Err(format!(
                "{path}: no \"type\", so this refers to task {queue}/{id}: a reference has only \"queue\" and \
                 \"id\""
            ));
        }
        references.push((path.to_string(), (queue.clone(), id.clone())));
        return if path == "the root" {
            Ok(None)
        } else {
            Ok(Some((queue, id)))
        };
    };
    if kind.is_empty() {
        return Err(format!("{path}: \"type\" is empty"));
    }
    let continue_if_failed = match raw.if_failed.as_deref() {
        None | Some("fail") => false,
        Some("continue") => true,
        Some(other) => {
            return Err(format!(
                "{path}: if_failed {other:?} is neither \"fail\" (the default) nor \"continue\""
            ));
        }
    };
    let level = match &raw.priority {
        None => shape.default_level,
        Some(priority) => shape
            .levels
            .iter()
            .position(|level| level == priority)
            .ok_or_else(|| {
                format!(
                    "{path}: queue {queue:?} has no priority {priority:?}; its levels are {:?}",
                    shape.levels
                )
            })?,
    };
    if raw.id.as_deref() == Some("") {
        return Err(format!("{path}: \"id\" is empty"));
    }
    let generated = raw.id.is_none();
    let id = raw.id.clone().unwrap_or_else(crate::task::new_id);
    let at = nodes.len();
    nodes.push(Node {
        queue: queue.clone(),
        kind,
        id: id.clone(),
        data: raw
            .data
            .clone()
            .unwrap_or_else(|| RawValue::from_string("null".to_string()).expect("null is JSON")),
        level,
        continue_if_failed,
        priority: raw.priority.clone(),
        deps: Vec::new(),
        path: path.to_string(),
        generated,
    });
    for (n, dep) in raw.after.iter().enumerate() {
        let dep_path = if path == "the root" {
            format!("after[{n}]")
        } else {
            format!("{path}.after[{n}]")
        };
        let dep = read(dep, &dep_path, queues, nodes, references)?
            .expect("only the root may be a reference");
        nodes[at].deps.push(dep);
    }
    Ok(Some((queue, id)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queues() -> HashMap<String, QueueShape> {
        ["reports", "parts", "fetch"]
            .into_iter()
            .map(|name| {
                let shape = QueueShape {
                    levels: vec!["high".to_string(), "normal".to_string()],
                    default_level: 1,
                };
                (name.to_string(), shape)
            })
            .collect()
    }

    /// The issue's example: a report after two parts, one of which waits for a fetch.
    const EXAMPLE: &str = r#"{"queue": "reports", "type": "report.merge", "id": "report-7", "data": {"month": "2026-11"},
        "if_failed": "fail",
        "after": [
          {"queue": "parts", "type": "part.build", "id": "part-1", "data": {"n": 1}},
          {"queue": "parts", "type": "part.build", "id": "part-2", "data": {"n": 2},
           "after": [{"queue": "fetch", "type": "fetch.csv", "id": "csv-2", "data": {}}]}
        ]}"#;

    #[test]
    fn the_issue_s_example_plans_two_waiters_and_two_leaves() {
        let plan = plan(EXAMPLE, &queues()).unwrap();
        let waiters: Vec<(&str, Vec<&str>)> = plan
            .waiters
            .iter()
            .map(|(queue, list)| (queue.as_str(), list.iter().map(|w| w.id.as_str()).collect()))
            .collect();
        assert_eq!(
            waiters,
            [("reports", vec!["report-7"]), ("parts", vec!["part-2"])]
        );
        let leaves: Vec<(&str, Vec<&str>)> = plan
            .leaves
            .iter()
            .map(|(queue, list)| (queue.as_str(), list.iter().map(|l| l.id.as_str()).collect()))
            .collect();
        assert_eq!(
            leaves,
            [("parts", vec!["part-1"]), ("fetch", vec!["csv-2"])]
        );
        let part_2 = &plan.waiters[1].1[0];
        assert_eq!(part_2.deps, [("fetch".to_string(), "csv-2".to_string())]);
        assert_eq!(part_2.up, [("reports".to_string(), "report-7".to_string())]);
        assert!(
            part_2
                .envelope
                .contains(r#""waiters":[{"queue":"reports","id":"report-7"}]"#),
            "{}",
            part_2.envelope
        );
        assert!(
            !plan.waiters[0].1[0].envelope.contains("waiters"),
            "the root waits for nothing to wait for it"
        );
        assert!(plan.tasks.iter().all(|(.., generated)| generated.is_none()));
    }

    #[test]
    fn omitted_ids_are_generated_and_named_by_their_path() {
        let plan = plan(
            r#"{"queue": "reports", "type": "r", "after": [{"queue": "parts", "type": "p"}]}"#,
            &queues(),
        )
        .unwrap();
        let paths: Vec<Option<&str>> = plan
            .tasks
            .iter()
            .map(|(.., path)| path.as_deref())
            .collect();
        assert_eq!(paths, [Some("the root"), Some("after[0]")]);
    }

    #[test]
    fn a_reference_lets_two_tasks_wait_for_one() {
        let plan = plan(
            r#"{"queue": "reports", "type": "r", "id": "r", "after": [
                 {"queue": "parts", "type": "p", "id": "a", "after": [{"queue": "fetch", "type": "f", "id": "f"}]},
                 {"queue": "parts", "type": "p", "id": "b", "after": [{"queue": "fetch", "id": "f"}]}]}"#,
            &queues(),
        )
        .unwrap();
        let fetch = &plan.leaves[0].1[0];
        assert!(
            fetch.envelope.contains(r#""queue":"parts","id":"a"}"#),
            "{}",
            fetch.envelope
        );
        assert!(
            fetch.envelope.contains(r#""queue":"parts","id":"b"}"#),
            "{}",
            fetch.envelope
        );
    }

    /// Every refusal names the node and what is wrong; nothing is planned.
    #[test]
    fn bad_flows_are_refused_with_the_node_and_the_reason() {
        let cases = [
            ("[1]", "the flow is not a flow's JSON"),
            (
                r#"{"queue": "nope", "type": "t"}"#,
                "the root: queue \"nope\" is not in the config; configured queues: fetch, parts, reports",
            ),
            (r#"{"queue": "parts"}"#, "the root: no \"type\""),
            (
                r#"{"queue": "parts", "id": "x"}"#,
                "the root: a flow's root is a task",
            ),
            (
                r#"{"queue": "parts", "type": "t", "colour": 1}"#,
                "unknown field `colour`",
            ),
            (
                r#"{"queue": "parts", "type": "t", "if_failed": "ignore"}"#,
                "the root: if_failed \"ignore\" is neither",
            ),
            (
                r#"{"queue": "parts", "type": "t", "priority": "urgent"}"#,
                "the root: queue \"parts\" has no priority \"urgent\"",
            ),
            (
                r#"{"queue": "parts", "type": "t", "id": "a", "after": [{"queue": "parts", "type": "t", "id": "a"}]}"#,
                "after[0]: task parts/a is defined twice (first at the root)",
            ),
            (
                r#"{"queue": "parts", "type": "t", "id": "a", "after": [{"queue": "fetch", "id": "zz"}]}"#,
                "after[0]: refers to task fetch/zz, which the flow does not define",
            ),
            (
                r#"{"queue": "parts", "type": "t", "id": "a", "after": [{"queue": "parts", "id": "a"}]}"#,
                "task parts/a waits for itself through parts/a (a cycle)",
            ),
            (
                r#"{"queue": "parts", "type": "t", "id": "a", "after": [
                    {"queue": "fetch", "type": "t", "id": "b", "after": [{"queue": "fetch", "type": "t", "id": "c",
                      "after": [{"queue": "fetch", "id": "b"}]}]}]}"#,
                "waits for itself through",
            ),
            (
                r#"{"queue": "parts", "type": "t", "id": "a", "after": [{"queue": "fetch", "type": "t", "id": "b"},
                    {"queue": "fetch", "id": "b"}]}"#,
                "the root: task parts/a waits for fetch/b twice",
            ),
            (
                r#"{"queue": "parts", "type": "t", "after": [{"queue": "fetch", "id": "b", "data": 1}]}"#,
                "after[0]: no \"type\", so this refers to task fetch/b",
            ),
        ];
        for (text, expected) in cases {
            let error = plan(text, &queues()).unwrap_err();
            assert!(error.contains(expected), "{text}: {error}");
        }
    }
}
