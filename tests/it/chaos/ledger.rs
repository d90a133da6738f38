//! The ledger and the recorder: what the producers pushed (each task's queue, work and possible duplicate
//! pushes, the pushes acknowledged per epoch), and what the daemons ran, read from the testkit's record file of
//! each daemon process (every start with its attempt and process, every handler's end, every final-failure hook),
//! and from the dead lists.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::MutexGuard;

use crate::support::RedisServer;

use super::workload::{QUEUES, Queue, Work};
use super::world::{World, lock};

/// A task id the producer pushed.
pub(super) struct Pushed {
    pub(super) queue: Queue,
    /// Its task type (the envelope's `type`).
    pub(super) kind: &'static str,
    /// Its group (the envelope's `group`), on the grouped queue.
    pub(super) group: Option<&'static str>,
    pub(super) work: Work,
    pub(super) level: usize,
    pub(super) data: String,
    /// How long its handler sleeps (ms): a run lasts at least that long.
    pub(super) sleep_ms: u64,
    /// Push attempts that failed in a way that may still have queued the task (a lost reply): each may be one
    /// more copy of it in the queue, with its own run budget.
    pub(super) maybe_copies: u32,
    /// When a push of it was first acknowledged (µs).
    pub(super) acked_us: Option<u64>,
}

#[derive(Default)]
pub(super) struct Ledger {
    pub(super) tasks: HashMap<String, Pushed>,
    pub(super) order: Vec<String>,
    pub(super) next: u64,
    /// Push calls that failed (and were retried), and the tasks in them.
    pub(super) failed_calls: u64,
    pub(super) failed_tasks: u64,
    /// What was pushed in each epoch of Redis's data: one from the start, one more each time Redis came back empty
    /// or rewound.
    pub(super) epochs: Vec<Epoch>,
    /// Tasks pushed again after Redis lost its data.
    pub(super) repushed: u64,
}

/// The pushes of one epoch of Redis's data, per queue ([`Queue::index`]).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Epoch {
    /// The queue's `pushed` counter when the epoch began: 0 from the start and after a loss of everything, what
    /// Redis kept after a rewind.
    pub(super) base: [u64; QUEUES],
    /// Tasks whose push was acknowledged in it.
    pub(super) acked: [u64; QUEUES],
    /// Tasks of push calls that failed in a way that may have applied them anyway.
    pub(super) maybe: [u64; QUEUES],
}

/// A run of a task, as the testkit recorded it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Run {
    pub(super) start_us: u64,
    pub(super) attempt: u32,
    pub(super) instance: usize,
}

/// What the testkit record files say so far.
#[derive(Default)]
pub(super) struct Facts {
    pub(super) runs: HashMap<String, Vec<Run>>,
    pub(super) starts: u64,
    /// Ids with a run whose handler returned done (which kmqd may have ignored: after an execution timeout, or
    /// from a zombie whose lease was gone).
    pub(super) done: HashSet<String>,
    /// id -> reason, from `on_dead` (the final-failure hook).
    pub(super) dead_hooks: HashMap<String, String>,
    /// (id, attempt, process) -> runs that answered throttle there: each explains one more run at that attempt
    /// after a run of that process.
    pub(super) throttles: HashMap<(String, u32, usize), usize>,
    /// id -> the `after` line of each of its runs (a flow's waiting task): its dependencies' outcomes, JSON.
    pub(super) after: HashMap<String, Vec<String>>,
    /// id -> each handler's end that returned done: (attempt, process, µs). The testkit writes the time
    /// (`end_times`) so that the unique_for check ([`super::unique`]) knows when each run ended.
    pub(super) ends: HashMap<String, Vec<(u32, usize, u64)>>,
}

/// Reads the new complete lines of one record file.
pub(super) struct Tail {
    pub(super) path: PathBuf,
    pub(super) instance: usize,
    pub(super) offset: u64,
    pub(super) partial: String,
}

impl Tail {
    pub(super) fn read(&mut self, facts: &mut Facts) {
        let Ok(mut file) = std::fs::File::open(&self.path) else {
            return;
        };
        if file.seek(SeekFrom::Start(self.offset)).is_err() {
            return;
        }
        let mut text = String::new();
        let Ok(read) = file.read_to_string(&mut text) else {
            return;
        };
        self.offset += read as u64;
        self.partial.push_str(&text);
        let Some(end) = self.partial.rfind('\n') else {
            return;
        };
        let complete: String = self.partial.drain(..=end).collect();
        for line in complete.lines() {
            // `after <id> <JSON>`: the outcomes a flow's waiting task was handed (its JSON may hold spaces).
            if let Some((id, after)) = line.strip_prefix("after ").and_then(|l| l.split_once(' ')) {
                facts
                    .after
                    .entry(id.to_string())
                    .or_default()
                    .push(after.to_string());
                continue;
            }
            let mut parts = line.splitn(4, ' ');
            let (Some(kind), Some(id), Some(attempt)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let rest = parts.next().unwrap_or("");
            let attempt: u32 = attempt.parse().unwrap_or(u32::MAX);
            // An `end` line is `end ID ATTEMPT OUTCOME µs` (the testkit's `end_times`): the outcome is its first word.
            let (outcome, end_us) = match rest.split_once(' ') {
                Some((outcome, time)) => (outcome, time.parse::<u64>().ok()),
                None => (rest, None),
            };
            match kind {
                "start" => {
                    let start_us = rest
                        .split(' ')
                        .nth(1)
                        .and_then(|t| t.parse().ok())
                        .unwrap_or(0);
                    facts.starts += 1;
                    facts.runs.entry(id.to_string()).or_default().push(Run {
                        start_us,
                        attempt,
                        instance: self.instance,
                    });
                }
                "end" if outcome == "done" => {
                    facts.done.insert(id.to_string());
                    if let Some(end_us) = end_us {
                        facts.ends.entry(id.to_string()).or_default().push((
                            attempt,
                            self.instance,
                            end_us,
                        ));
                    }
                }
                "end" if outcome == "throttle" => {
                    *facts
                        .throttles
                        .entry((id.to_string(), attempt, self.instance))
                        .or_default() += 1;
                }
                "dead" => {
                    facts.dead_hooks.insert(id.to_string(), rest.to_string());
                }
                _ => {}
            }
        }
    }
}

/// How a task ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Final {
    Done,
    Dead(String),
}

impl World<'_> {
    /// Reads what the record files gained and returns the facts (locked).
    pub(super) fn facts(&self) -> MutexGuard<'_, (Vec<Tail>, Facts)> {
        let mut guard = lock(&self.tails);
        let (tails, facts) = &mut *guard;
        for tail in tails.iter_mut() {
            tail.read(facts);
        }
        guard
    }

    /// How the task ended so far, as an outbox would know it: dead-lettered (the dead list or the hook), or its
    /// handler ran to done. A deaf handler returns done after its run was timed out, so for those only the dead
    /// list counts, unless `drained` (the queue is empty: a deaf task not dead-lettered was acknowledged).
    pub(super) fn final_state(
        &self,
        id: &str,
        work: Work,
        facts: &Facts,
        drained: bool,
    ) -> Option<Final> {
        if let Some(reason) = lock(&self.dead_seen).get(id) {
            return Some(Final::Dead(reason.clone()));
        }
        if let Some(reason) = facts.dead_hooks.get(id) {
            return Some(Final::Dead(reason.clone()));
        }
        if facts.done.contains(id) && (work != Work::Deaf || drained) {
            return Some(Final::Done);
        }
        None
    }

    /// The tasks without a final state yet ([`World::final_state`]), in the order they were pushed.
    pub(super) fn unfinished(&self, drained: bool) -> Vec<(Queue, String)> {
        let guard = self.facts();
        let ledger = lock(&self.ledger);
        ledger
            .order
            .iter()
            .filter(|id| {
                self.final_state(id, ledger.tasks[*id].work, &guard.1, drained)
                    .is_none()
            })
            .map(|id| (ledger.tasks[id].queue, id.clone()))
            .collect()
    }

    /// Records the dead lists' ids and reasons (the flows' queues' too).
    pub(super) fn read_dead_list(&self, redis: &RedisServer) -> usize {
        let mut records: Vec<String> = Vec::new();
        // The flows' queues too: an emptied Redis loses their dead records, which the flows' check reads.
        let flows =
            [super::flows::FLOW_A, super::flows::FLOW_B].map(|name| format!("kmq:{{{name}}}"));
        for base in Queue::ALL.iter().map(|queue| queue.base()).chain(flows) {
            let dead: Vec<String> = redis.cmd(&["LRANGE", &format!("{base}:dead"), "0", "-1"]);
            records.extend(dead);
        }
        let mut seen = lock(&self.dead_seen);
        for record in &records {
            let value: serde_json::Value = match serde_json::from_str(record) {
                Ok(value) => value,
                Err(error) => {
                    drop(seen);
                    self.violation(format!("a dead record is not JSON ({error}): {record}"));
                    seen = lock(&self.dead_seen);
                    continue;
                }
            };
            let id = value["id"].as_str().unwrap_or("").to_string();
            let reason = value["reason"].as_str().unwrap_or("").to_string();
            seen.insert(id, reason);
        }
        records.len()
    }
}
