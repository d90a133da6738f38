//! Flows under chaos (issue 36, Build item 1; section 3 of docs/design/flows.md, its invariants): a producer
//! pushes flows with [`Client::push_flow`] into two safe queues of their own, [`FLOW_A`] and [`FLOW_B`], while
//! the faults run: one
//! fan-in of [`FAN_IN`] parts into one waiting task, chains of 3 to 5 tasks across both queues, and small fan-ins
//! with one part that fails (the testkit's `"outcome": "fail"`, dead-lettered) under `if_failed = "fail"` and
//! `"continue"`. Their ids start with `f`, so the ledger's checks pass them over; the testkit's records (`start`,
//! and the `after` line with the outcomes the host handed on) are what this module judges.
//!
//! At the end, for every waiting task of every flow (a chain's links as well as its root):
//! - it ran at most once: a run after its first, at any attempt, is a violation unless a fault that takes a task
//!   from its daemon explains it ([`Event::explains`] in safe mode: a released task is an ordinary safe task); two
//!   releases would put two copies in the ready list;
//! - every run's `after` (the outcomes the host handed its handler) names each of its dependencies with the
//!   outcome it was to end with, and its first start comes after each dependency's first start: it never ran
//!   before the last of them ended (a part pushed twice, after a lost reply, may run again later: its first
//!   start is what the order can pin);
//! - when every dependency ended done, or it is under `continue`, it ended done (it ran); when a dependency died
//!   under `fail`, it never ran and is in its queue's dead list with a reason naming that dependency
//!   (`QUEUE/ID`).
//!
//! Redis emptied or rewound loses what it held (docs/RELIABILITY.md, "The chaos suite"): a flow alive while either
//! happened is exempt and counted as such. A loss lasts from its fault's start to Redis's restart: a rewind loses
//! everything written after the point its append-only file is cut back to, which is the fault's start, so a flow
//! pushed in the rewind's last second, and even run in part, is gone too (seed 648350833: a chain pushed 30 ms
//! before the kill ran three of its five links, then Redis forgot it). A Redis restarted on its append-only file
//! (`appendfsync always`) loses nothing, so no other fault exempts a flow.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kmqd::{Client, ClientError};

use super::faults::Kind;
use super::ledger::Facts;
use super::workload::{Mode, Rng, TEST};
use super::world::{What, World, lock, now_us};

/// The flows' two queues: a chain alternates between them; a fan-in's parts are in A, its waiting task in B.
pub(super) const FLOW_A: &str = "flowa";
pub(super) const FLOW_B: &str = "flowb";
/// The parts of the one large fan-in pushed at the start of the faults: a few thousand, as issue 36 asks.
pub(super) const FAN_IN: usize = 2000;

/// The flows' two queues' sections (safe, as the suite's other safe queues, under `common`).
pub(super) fn queues(workers: u32, common: &str) -> String {
    [FLOW_A, FLOW_B]
        .iter()
        .map(|name| {
            format!(
                "[[queues]]\nname = \"{name}\"\nmode = \"safe\"\nworkers = {workers}\n{common}\n"
            )
        })
        .collect()
}

/// What a flow is, for the summary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Shape {
    FanIn,
    Chain,
    FailingFail,
    FailingContinue,
}

/// A task of a flow: its queue, its id, and whether its handler fails (a part meant to die).
#[derive(Clone, Debug)]
pub(super) struct Node {
    queue: &'static str,
    id: String,
    fails: bool,
}

impl Node {
    /// `QUEUE/ID`, as a waiting task's dead reason names a dependency.
    fn name(&self) -> String {
        format!("{}/{}", self.queue, self.id)
    }
}

/// A task of a flow that waits for others.
#[derive(Clone, Debug)]
pub(super) struct Waiter {
    node: Node,
    after: Vec<Node>,
    continues: bool,
}

/// A flow pushed, with when its push began (a loss of Redis's data after that may have taken it).
pub(super) struct Flow {
    shape: Shape,
    /// Its waiting tasks, each after the ones it waits for (a chain's links in order, its root last).
    waiters: Vec<Waiter>,
    pushed_from_us: u64,
    /// Whether a push of it was acknowledged (a flow whose push never was is not judged).
    acked: bool,
}

/// The flows pushed so far.
#[derive(Default)]
pub(super) struct FlowBook {
    flows: Vec<Flow>,
    next: u64,
    /// push_flow calls that failed (and were sent again).
    failed_pushes: u64,
}

/// How a task of a flow ends, as the flow's rules decide it: done, or dead (a part that fails, or a waiting task
/// under `fail` after a dead dependency).
fn expected_dead(node: &Node, waiters: &[Waiter]) -> bool {
    match waiters.iter().find(|w| w.node.id == node.id) {
        None => node.fails,
        Some(w) => !w.continues && w.after.iter().any(|dep| expected_dead(dep, waiters)),
    }
}

/// The flow's JSON for `flow push` (docs/design/flows.md): `node` with what it waits for, nested.
fn json(node: &Node, waiters: &[Waiter], rng: &mut Rng) -> serde_json::Value {
    let data = if node.fails {
        serde_json::json!({"outcome": "fail"})
    } else {
        serde_json::json!({"sleep_ms": 1 + rng.below(10)})
    };
    let mut value =
        serde_json::json!({"queue": node.queue, "type": TEST, "id": node.id, "data": data});
    if let Some(w) = waiters.iter().find(|w| w.node.id == node.id) {
        value["if_failed"] = if w.continues { "continue" } else { "fail" }.into();
        value["after"] = w.after.iter().map(|dep| json(dep, waiters, rng)).collect();
    }
    value
}

impl World<'_> {
    fn flow_node(&self, queue: &'static str, fails: bool) -> Node {
        let mut book = lock(&self.flows);
        book.next += 1;
        Node {
            queue,
            id: format!("f{}", book.next),
            fails,
        }
    }

    /// A new flow of `shape`: its waiting tasks (root last) and its root.
    fn new_flow(&self, rng: &mut Rng, shape: Shape) -> (Vec<Waiter>, Node) {
        match shape {
            Shape::FanIn | Shape::FailingFail | Shape::FailingContinue => {
                let parts = if shape == Shape::FanIn {
                    FAN_IN
                } else {
                    3 + rng.below(4) as usize
                };
                let failing = rng.below(parts as u64) as usize;
                let after: Vec<Node> = (0..parts)
                    .map(|n| self.flow_node(FLOW_A, shape != Shape::FanIn && n == failing))
                    .collect();
                let root = self.flow_node(FLOW_B, false);
                let waiter = Waiter {
                    node: root.clone(),
                    after,
                    continues: shape == Shape::FailingContinue,
                };
                (vec![waiter], root)
            }
            Shape::Chain => {
                let length = 3 + rng.below(3) as usize;
                let mut previous = self.flow_node(FLOW_A, false);
                let mut waiters = Vec::new();
                for n in 1..length {
                    let node = self.flow_node(if n % 2 == 0 { FLOW_A } else { FLOW_B }, false);
                    waiters.push(Waiter {
                        node: node.clone(),
                        after: vec![previous],
                        continues: false,
                    });
                    previous = node;
                }
                (waiters, previous)
            }
        }
    }

    /// Pushes a flow until Redis takes it (a push sent again after a lost reply may queue its parts twice: a
    /// duplicate delivery of their notes, which the waiting task must count once).
    fn push_flow(&self, client: &Client, rng: &mut Rng, shape: Shape) {
        let (waiters, root) = self.new_flow(rng, shape);
        let text = json(&root, &waiters, rng).to_string();
        let index = {
            let mut book = lock(&self.flows);
            book.flows.push(Flow {
                shape,
                waiters,
                pushed_from_us: now_us(),
                acked: false,
            });
            book.flows.len() - 1
        };
        let started = Instant::now();
        loop {
            let result = {
                let _gate = self.gate.read().unwrap();
                client.push_flow(&text)
            };
            match result {
                Ok(_) => {
                    lock(&self.flows).flows[index].acked = true;
                    return;
                }
                Err(ClientError::Data(error)) => {
                    self.violation(format!("a flow was refused as data: {error}"));
                    return;
                }
                Err(error) => {
                    lock(&self.flows).failed_pushes += 1;
                    if started.elapsed() > Duration::from_secs(60) {
                        self.violation(format!(
                            "a flow's push failed for 60 s; last error: {error}"
                        ));
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}

/// The flows' producer: the large fan-in first, then every 200 ms a chain (half of the flows) or a small fan-in
/// with a failing part under `fail` or under `continue` (a quarter each).
pub(super) fn produce_flows(world: &World<'_>, client: &Client, mut rng: Rng) {
    world.push_flow(client, &mut rng, Shape::FanIn);
    while world.producing.load(Ordering::SeqCst) {
        let shape = match rng.below(4) {
            0 | 1 => Shape::Chain,
            2 => Shape::FailingFail,
            _ => Shape::FailingContinue,
        };
        world.push_flow(client, &mut rng, shape);
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What the end check found, for the summary.
#[derive(Default)]
pub(super) struct FlowCheck {
    pub(super) flows: HashMap<Shape, u64>,
    pub(super) judged: u64,
    pub(super) exempt: u64,
    pub(super) unacked: u64,
    pub(super) waiters: u64,
    pub(super) released: u64,
    pub(super) failed: u64,
    pub(super) failed_pushes: u64,
}

impl World<'_> {
    /// The flows' dead records: id -> reason, those in the dead lists now and those read before Redis lost its
    /// data ([`World::read_dead_list`] before each loss).
    fn flow_dead(&self, redis: &crate::support::RedisServer) -> HashMap<String, String> {
        let mut dead = lock(&self.dead_seen).clone();
        for queue in [FLOW_A, FLOW_B] {
            let records: Vec<String> =
                redis.cmd(&["LRANGE", &format!("kmq:{{{queue}}}:dead"), "0", "-1"]);
            for record in records {
                if let Ok(value) = serde_json::from_str::<serde_json::Value>(&record) {
                    let id = value["id"].as_str().unwrap_or("").to_string();
                    dead.insert(id, value["reason"].as_str().unwrap_or("").to_string());
                }
            }
        }
        dead
    }

    /// The waiting tasks of judged flows without a final state yet (their expected one: a start for one that runs,
    /// a dead record for one that fails).
    pub(super) fn flows_unfinished(&self, redis: &crate::support::RedisServer) -> Vec<String> {
        let dead = self.flow_dead(redis);
        let guard = self.facts();
        let facts = &guard.1;
        let losses = self.losses();
        let book = lock(&self.flows);
        book.flows
            .iter()
            .filter(|flow| flow.acked && !exempt(flow, facts, &dead, &losses))
            .flat_map(|flow| {
                flow.waiters.iter().filter(|w| {
                    if expected_dead(&w.node, &flow.waiters) {
                        !dead.contains_key(&w.node.id)
                    } else {
                        !facts.done.contains(&w.node.id)
                    }
                })
            })
            .map(|w| w.node.name())
            .collect()
    }

    /// When Redis lost data (emptied, rewound): each fault's span, from its start (a rewind's cut) to Redis's restart.
    fn losses(&self) -> Vec<(u64, u64)> {
        lock(&self.events)
            .iter()
            .filter(|e| matches!(e.what, What::Fault(Kind::RedisEmpty | Kind::RedisRewind)))
            .map(|e| (e.from_us, e.to_us))
            .collect()
    }

    /// Waits until every judged flow's waiting tasks have their final state (after the suite's drain, the daemons
    /// still serving); a violation when that takes more than 60 s.
    pub(super) fn drain_flows(&self, redis: &crate::support::RedisServer) {
        let started = Instant::now();
        loop {
            let left = self.flows_unfinished(redis);
            if left.is_empty() {
                return;
            }
            if started.elapsed() > Duration::from_secs(60) {
                self.violation(format!(
                    "{} waiting tasks of flows have no final state 60 s after the drain, e.g. {:?}",
                    left.len(),
                    &left[..left.len().min(10)]
                ));
                return;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The flows' invariant (see the module's doc), checked at the end; returns what it saw.
    pub(super) fn check_flows(&self, redis: &crate::support::RedisServer) -> FlowCheck {
        let dead = self.flow_dead(redis);
        let guard = self.facts();
        let facts = &guard.1;
        let losses = self.losses();
        let events = lock(&self.events).clone();
        let book = lock(&self.flows);
        let mut check = FlowCheck {
            failed_pushes: book.failed_pushes,
            ..FlowCheck::default()
        };
        let mut violations = Vec::new();
        for flow in &book.flows {
            *check.flows.entry(flow.shape).or_default() += 1;
            if !flow.acked {
                check.unacked += 1;
                continue;
            }
            if exempt(flow, facts, &dead, &losses) {
                check.exempt += 1;
                continue;
            }
            check.judged += 1;
            for w in &flow.waiters {
                check.waiters += 1;
                let id = &w.node.id;
                let mut runs = facts.runs.get(id).cloned().unwrap_or_default();
                runs.sort_by_key(|run| run.start_us);
                if expected_dead(&w.node, &flow.waiters) {
                    check.failed += 1;
                    if !runs.is_empty() {
                        violations.push(format!(
                            "{} ran {} times though a dependency died under fail",
                            w.node.name(),
                            runs.len()
                        ));
                    }
                    let named = w
                        .after
                        .iter()
                        .filter(|dep| expected_dead(dep, &flow.waiters))
                        .any(|dep| {
                            dead.get(id)
                                .is_some_and(|reason| reason.contains(&dep.name()))
                        });
                    if !named {
                        violations.push(format!(
                            "{} is not dead-lettered with a reason naming its dead dependency: {:?}",
                            w.node.name(),
                            dead.get(id)
                        ));
                    }
                    continue;
                }
                check.released += 1;
                if !facts.done.contains(id) {
                    violations.push(format!(
                        "{} never ended done ({} runs)",
                        w.node.name(),
                        runs.len()
                    ));
                }
                for pair in runs.windows(2) {
                    let explained = events.iter().any(|event| {
                        event.explains(
                            Mode::Safe,
                            pair[0].instance,
                            pair[0].start_us,
                            pair[1].start_us,
                        )
                    });
                    if !explained {
                        violations.push(format!(
                            "{} ran again at {} (attempt {}) after its run at {} (attempt {}), no fault to explain \
                             it: released twice?",
                            w.node.name(),
                            pair[1].start_us,
                            pair[1].attempt,
                            pair[0].start_us,
                            pair[0].attempt
                        ));
                    }
                }
                if let Some(first) = runs.first() {
                    let mut early = Vec::new();
                    for dep in &w.after {
                        // Its first: a part pushed twice (a push sent again after a lost reply) may run
                        // again after the waiting task was released by the other copy's note.
                        let earliest = facts
                            .runs
                            .get(&dep.id)
                            .and_then(|r| r.iter().map(|run| run.start_us).min());
                        if earliest.is_none_or(|earliest| earliest > first.start_us) {
                            early.push(format!("{} ({earliest:?})", dep.name()));
                        }
                    }
                    // One line per waiting task: a fan-in released early would otherwise fill the report.
                    if !early.is_empty() {
                        violations.push(format!(
                            "{} started at {} before {} of its {} dependencies first started, e.g. {}",
                            w.node.name(),
                            first.start_us,
                            early.len(),
                            w.after.len(),
                            early[..early.len().min(3)].join(", ")
                        ));
                    }
                }
                for after in facts.after.get(id).into_iter().flatten() {
                    let outcomes: HashMap<String, String> =
                        serde_json::from_str::<serde_json::Value>(after)
                            .ok()
                            .and_then(|v| v.as_array().cloned())
                            .unwrap_or_default()
                            .iter()
                            .map(|o| {
                                (
                                    o["id"].as_str().unwrap_or("").to_string(),
                                    o["state"].as_str().unwrap_or("").to_string(),
                                )
                            })
                            .collect();
                    let wrong: Vec<String> = w
                        .after
                        .iter()
                        .filter_map(|dep| {
                            let want = if expected_dead(dep, &flow.waiters) {
                                "dead"
                            } else {
                                "done"
                            };
                            let got = outcomes.get(&dep.id).map(String::as_str);
                            (got != Some(want))
                                .then(|| format!("{} {got:?} ({want} expected)", dep.name()))
                        })
                        .collect();
                    if !wrong.is_empty() {
                        violations.push(format!(
                            "{} ran handed {} of its {} dependencies without the outcome they ended with \
                             (released before they ended?), e.g. {}",
                            w.node.name(),
                            wrong.len(),
                            w.after.len(),
                            wrong[..wrong.len().min(3)].join(", ")
                        ));
                    }
                }
            }
        }
        drop(book);
        drop(guard);
        self.violations(
            "flows",
            violations,
            50,
            "violations of the flows' invariant",
        );
        check
    }
}

/// How long after a dead part's start its waiter surely learnt of it: the run, its settle and the note's apply
/// by a delay poller, with room for a loaded machine.
const NOTE_SLACK_US: u64 = 5_000_000;

/// Whether a loss of Redis's data (emptied, rewound; each a span, see [`World::losses`]) overlapped the flow's
/// life: from its push's start to its root's last start, or its dead-lettering ([`NOTE_SLACK_US`] after its dead
/// part's last start), or to the end if neither happened.
fn exempt(
    flow: &Flow,
    facts: &Facts,
    dead: &HashMap<String, String>,
    losses: &[(u64, u64)],
) -> bool {
    let root = &flow.waiters.last().expect("a flow has a waiting task").node;
    let end = facts
        .runs
        .get(&root.id)
        .and_then(|runs| runs.iter().map(|run| run.start_us).max())
        .or_else(|| {
            // A root failed unrun: when its dead part last started (the test's clock), and the time its note
            // takes to be applied; its own dead record's `dead_at` is on Redis's clock, which the faults step.
            dead.contains_key(&root.id).then_some(())?;
            let waiter = flow.waiters.last()?;
            waiter
                .after
                .iter()
                .filter(|dep| expected_dead(dep, &flow.waiters))
                .filter_map(|dep| facts.runs.get(&dep.id))
                .flatten()
                .map(|run| run.start_us + NOTE_SLACK_US)
                .max()
        })
        .unwrap_or(u64::MAX);
    losses
        .iter()
        .any(|&(from, to)| to + super::world::SLACK_US >= flow.pushed_from_us && from <= end)
}

/// Seed 648350833's case: a chain pushed inside a rewind's span (after the point Redis's append-only file was cut
/// back to, before the kill) is exempt, though its push began after the fault did; one pushed after the restart
/// is judged.
#[test]
fn a_flow_pushed_while_a_rewind_was_under_way_is_exempt() {
    let node = |id: &str| Node {
        queue: FLOW_A,
        id: id.to_string(),
        fails: false,
    };
    let flow = |pushed_from_us| Flow {
        shape: Shape::Chain,
        waiters: vec![Waiter {
            node: node("f2"),
            after: vec![node("f1")],
            continues: false,
        }],
        pushed_from_us,
        acked: true,
    };
    let rewind = [(46_340_000, 47_500_000)];
    let facts = Facts::default();
    let dead = HashMap::new();
    assert!(exempt(&flow(47_170_000), &facts, &dead, &rewind));
    assert!(exempt(&flow(46_000_000), &facts, &dead, &rewind));
    assert!(!exempt(&flow(47_700_000), &facts, &dead, &rewind));
}
