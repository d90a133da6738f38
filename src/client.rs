//! The producer API: push tasks to the queues a config names; and an operator's: stats, find and cancel tasks,
//! pause and resume queues, list the daemons serving them.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let config = kmqd::Config::load("queues.toml".as_ref())?;
//! let client = kmqd::Client::new(&config)?;
//! let pushed = client.push("mail", kmqd::NewTask::new("mail.send", r#"{"to": "a@example.com"}"#)?)?;
//! println!("queued {}", pushed.id());
//! # Ok(()) }
//! ```

use std::borrow::Cow;
use std::collections::HashMap;
use std::time::Duration;

use serde_json::value::RawValue;

use crate::broker::dead::{self, DeadRecord, Fate, RequeueItem};
use crate::broker::workflow::{self, WaitingTask};
use crate::broker::{
    self, BrokerError, Due, Found, Pool, PushItem, QueueKeys, QueueStats, Scope, access, eviction,
    lookup,
};
use crate::config::Config;
use crate::task::{self, Envelope};

/// The most tasks sent in one enqueue script call. Bounded so that one call never holds Redis for long.
pub(crate) const PUSH_CHUNK: usize = 1000;

/// The longest `unique_for` push.lua takes: 12 digits of ms (about 31 years).
pub const MAX_UNIQUE_FOR_MS: u64 = 999_999_999_999;

/// A task of [`Client::push_batch`] ready to send: (level, due, (unique, debounce, unique for ms), envelope, id).
type Prepared = (usize, Due, (bool, bool, u64), String, String);

/// A task to enqueue.
#[derive(Clone, Debug)]
pub struct NewTask {
    pub kind: String,
    pub data: Box<RawValue>,
    /// The task id; a random UUID when `None`.
    pub id: Option<String>,
    /// A priority level of the queue; the queue's default level when `None`.
    pub priority: Option<String>,
    /// Refuse the push while a task with this id is delayed, ready or processing (needs an explicit id).
    pub unique: bool,
    pub due: Due,
    /// The task's group (`[queues.groups]`: groups take turns, each within its own limits); `None`: the group of
    /// tasks without one. 1 to 64 bytes.
    pub group: Option<String>,
    /// A W3C trace context (`traceparent`, and `tracestate` when present), written into the envelope's fields of
    /// those names so that a trace follows the task from its producer to its handler (docs/CLIENTS.md, "Tracing").
    pub trace: Option<(String, Option<String>)>,
    /// When a task not started by then is dead-lettered unrun (docs/PROTOCOL.md, "Expiry"); `None`: never.
    pub expires: Option<Expiry>,
    /// Replace the delayed task of this id, if one waits, and start `due` after this push (needs an id and a
    /// delay, not `unique`; docs/PROTOCOL.md, "Debounce, and unique for a time").
    pub debounce: bool,
    /// With `unique`: the id stays held this long after the task ended, so that one task of the id runs per such
    /// window (docs/PROTOCOL.md, "Debounce, and unique for a time"); `None`: freed as the task ends.
    pub unique_for: Option<Duration>,
}

/// A task's expiry, on Redis's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// At this time, ms since the epoch.
    At(i64),
    /// This long after the push: Redis's `TIME`, read once per batch that has such a task, plus the length.
    After(Duration),
}

impl NewTask {
    /// A task of type `kind` whose data is the JSON text `data`.
    pub fn new(kind: impl Into<String>, data: &str) -> Result<NewTask, ClientError> {
        Ok(NewTask::with_data(
            kind,
            task::data_from_str(data).map_err(ClientError::Data)?,
        ))
    }

    /// A task of type `kind` with already-parsed data.
    pub fn with_data(kind: impl Into<String>, data: Box<RawValue>) -> NewTask {
        NewTask {
            kind: kind.into(),
            data,
            id: None,
            priority: None,
            unique: false,
            due: Due::Now,
            group: None,
            trace: None,
            expires: None,
            debounce: false,
            unique_for: None,
        }
    }

    pub fn id(mut self, id: impl Into<String>) -> NewTask {
        self.id = Some(id.into());
        self
    }

    pub fn priority(mut self, level: impl Into<String>) -> NewTask {
        self.priority = Some(level.into());
        self
    }

    pub fn unique(mut self) -> NewTask {
        self.unique = true;
        self
    }

    /// Unique, and its id stays held `hold` after the task ended (at least 1 ms): a throttle of one run per
    /// window. Needs an id.
    pub fn unique_for(mut self, hold: Duration) -> NewTask {
        self.unique = true;
        self.unique_for = Some(hold);
        self
    }

    /// In group `group` (`[queues.groups]`).
    pub fn group(mut self, group: impl Into<String>) -> NewTask {
        self.group = Some(group.into());
        self
    }

    /// Carries the W3C trace context `traceparent` (and `tracestate`) in its envelope.
    pub fn trace(mut self, traceparent: impl Into<String>, tracestate: Option<String>) -> NewTask {
        self.trace = Some((traceparent.into(), tracestate));
        self
    }

    /// Ready `delay` after the push, on Redis's clock.
    pub fn delay(mut self, delay: Duration) -> NewTask {
        self.due = Due::After(delay);
        self
    }

    /// Ready at `at_ms` (ms since the epoch).
    pub fn at(mut self, at_ms: i64) -> NewTask {
        self.due = Due::At(at_ms);
        self
    }

    /// Debounced: ready `quiet` after this push, replacing the task of its id that still waits for its own
    /// (its data and due time): only the last push of a burst less than `quiet` apart runs. Needs an id.
    pub fn debounce(mut self, quiet: Duration) -> NewTask {
        self.due = Due::After(quiet);
        self.debounce = true;
        self
    }

    /// Dead-lettered unrun, reason `expired`, when not started by `at_ms` (ms since the epoch, Redis's clock).
    pub fn expires_at(mut self, at_ms: i64) -> NewTask {
        self.expires = Some(Expiry::At(at_ms));
        self
    }

    /// Dead-lettered unrun, reason `expired`, when not started within `expiry` of the push (Redis's clock).
    pub fn expires_in(mut self, expiry: Duration) -> NewTask {
        self.expires = Some(Expiry::After(expiry));
        self
    }
}

/// What [`Client::result`] found.
#[derive(Clone, Debug, PartialEq)]
pub enum TaskResult {
    /// The task ended, and the settle that ended it kept this.
    Ended(broker::results::Ended),
    /// No result kept, but the task is in the dead-letter list: its record (with its reason).
    DeadLettered(String),
    /// Still waiting (delayed, retrying, ready) or running when the wait ended.
    Pending,
    /// Neither a result nor the task: never pushed, done without `keep_results`, or its result expired.
    /// `keeps_results`: whether the queue has `keep_results`, for the words of the answer.
    Unknown { keeps_results: bool },
}

/// What [`Client::push_flow`] pushed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushedFlow {
    /// Every task, root first: (queue, id, its path in the file when its id was generated).
    pub tasks: Vec<(String, String, Option<String>)>,
    /// The waiting tasks that were not written anew: (queue, id, "exists", or "released" / "failed" when their
    /// dependencies had already ended).
    pub kept: Vec<(String, String, String)>,
}

/// What became of a push.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pushed {
    /// Queued under this id.
    Accepted(String),
    /// Refused: a unique task with this id is live, or this exact envelope is already delayed.
    Duplicate(String),
}

impl Pushed {
    pub fn id(&self) -> &str {
        match self {
            Pushed::Accepted(id) | Pushed::Duplicate(id) => id,
        }
    }

    pub fn is_accepted(&self) -> bool {
        matches!(self, Pushed::Accepted(_))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("queue {queue:?} is not in the config; configured queues: {known}")]
    UnknownQueue { queue: String, known: String },
    #[error("queue {queue:?} has no priority {priority:?}; its levels are {levels:?}")]
    UnknownPriority {
        queue: String,
        priority: String,
        levels: Vec<String>,
    },
    #[error("a unique task needs an id (--id): uniqueness is per id")]
    UniqueWithoutId,
    #[error("{0}")]
    Data(String),
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

struct QueueInfo {
    keys: QueueKeys,
    /// `dead_max`: a flow's waiting task failed by a dead dependency is dead-lettered in the queue's list, so
    /// bounded.
    dead_max: usize,
    /// `keep_results`: whether the settle keeps the queue's results, for [`Client::result`]'s words.
    keep_results: Option<Duration>,
    /// Safe mode: a running task stays in Redis (its claim), so one found nowhere has ended; in default mode a
    /// running task has left Redis, and only its result tells that it ended.
    safe: bool,
    default_priority: usize,
    /// How the daemons read the queue's payloads, so that a requeue reads a dead task the same way.
    foreign_type_field: Option<String>,
}

/// A producer (and inspector) for the queues of one config. Cheap to share: it holds a connection pool.
pub struct Client {
    pool: Pool,
    queues: HashMap<String, QueueInfo>,
    /// For [`Client::check_access`], which connects outside the pool: a refusal at connection time (wrong
    /// credentials, a cluster client's own command refused) comes back as itself, not as the pool's timeout.
    connector: broker::Connector,
    /// `[redis] allow_eviction`, for [`Client::eviction`].
    allow_eviction: bool,
}

impl Client {
    pub fn new(config: &Config) -> Result<Client, ClientError> {
        let queues = config
            .queues
            .iter()
            .map(|queue| {
                let info = QueueInfo {
                    keys: QueueKeys::for_queue(&config.redis.key_prefix, queue),
                    dead_max: queue.dead_max,
                    keep_results: queue.keep_results,
                    safe: queue.mode == crate::config::Mode::Safe,
                    default_priority: queue.default_priority,
                    foreign_type_field: queue.foreign_type_field.clone(),
                };
                (queue.name.clone(), info)
            })
            .collect();
        Ok(Client {
            pool: broker::pool(&config.redis)?,
            queues,
            connector: broker::Connector::new(&config.redis)?,
            allow_eviction: config.redis.allow_eviction,
        })
    }

    fn queue(&self, queue: &str) -> Result<&QueueInfo, ClientError> {
        self.queues.get(queue).ok_or_else(|| {
            let mut known: Vec<&str> = self.queues.keys().map(String::as_str).collect();
            known.sort_unstable();
            ClientError::UnknownQueue {
                queue: queue.to_string(),
                known: known.join(", "),
            }
        })
    }

    /// Checks that the Redis user may do what `action` does on each of `queues` (one call per queue, on one
    /// connection; see docs/OPERATIONS.md, "ACL rules"), so that a missing rule is reported by name before
    /// anything is done: [`BrokerError::Permission`] names the refused command and the rule to add. A Redis
    /// older than 7.0 cannot tell and passes. The other methods do not check: call this once, before them.
    pub fn check_access(&self, queues: &[&str], action: access::Action) -> Result<(), ClientError> {
        let keys: Vec<&QueueKeys> = queues
            .iter()
            .map(|queue| self.queue(queue).map(|info| &info.keys))
            .collect::<Result<_, _>>()?;
        let checked = self.connector.connect().and_then(|mut connection| {
            keys.into_iter()
                .try_for_each(|keys| access::check(&mut connection, keys, action))
        });
        match checked {
            Ok(()) => Ok(()),
            Err(error) if error.is_config_error() => {
                Err(error.for_user(self.connector.username()).into())
            }
            // A cluster client's own commands refused read as a cluster that is down: ask its seeds.
            Err(error) => Err(self
                .connector
                .refusal()
                .map_or(error, BrokerError::from)
                .into()),
        }
    }

    /// Reads every master's `maxmemory-policy` (docs/OPERATIONS.md, "maxmemory-policy"), on a connection of its
    /// own as [`Client::check_access`]: what it may evict, held against `[redis] allow_eviction`
    /// ([`eviction::Finding::refusal`], [`eviction::Finding::warnings`]). Nothing refuses here: the command line
    /// decides which commands refuse and which warn; the library leaves it to its caller.
    pub fn eviction(&self) -> Result<eviction::Finding, ClientError> {
        let mut connection = self.connector.connect()?;
        Ok(eviction::Finding {
            readings: eviction::read(&mut connection)?,
            allowed: self.allow_eviction,
        })
    }

    /// Enqueues one task.
    pub fn push(&self, queue: &str, task: NewTask) -> Result<Pushed, ClientError> {
        let mut pushed = self.push_batch(queue, [task])?;
        // push_batch returns one result per task.
        Ok(pushed.remove(0))
    }

    /// Enqueues many tasks with few round trips (one enqueue script call per [`PUSH_CHUNK`] tasks of the same
    /// level and due time). Returns one result per task, in order.
    pub fn push_batch(
        &self,
        queue: &str,
        tasks: impl IntoIterator<Item = NewTask>,
    ) -> Result<Vec<Pushed>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        // Redis's clock, read at the first task whose expiry is a length: a batch without one sends no TIME.
        let mut now_ms = None;
        let mut prepared: Vec<Prepared> = Vec::new();
        for task in tasks {
            let level = match &task.priority {
                Some(priority) => info
                    .keys
                    .levels
                    .iter()
                    .position(|p| p == priority)
                    .ok_or_else(|| ClientError::UnknownPriority {
                        queue: queue.to_string(),
                        priority: priority.clone(),
                        levels: info.keys.levels.clone(),
                    })?,
                None => info.default_priority,
            };
            if task.kind.is_empty() {
                // The type selects the handler: refused here rather than dead-lettered by every daemon.
                return Err(ClientError::Data(
                    "a task needs a type (a non-empty string): it selects the handler".to_string(),
                ));
            }
            if task.unique && task.id.is_none() {
                return Err(ClientError::UniqueWithoutId);
            }
            if task.debounce && (task.id.is_none() || task.unique || task.due == Due::Now) {
                // push.lua refuses the same, for the whole call: refused here, before anything is sent.
                return Err(ClientError::Data(
                    "a debounced task needs an id and a delay, and is not unique: it replaces the waiting task \
                     of its id"
                        .to_string(),
                ));
            }
            if let Some(group) = &task.group
                && (group.is_empty() || group.len() > crate::config::MAX_GROUP_BYTES)
            {
                return Err(ClientError::Data(format!(
                    "group {group:?} is not a group name: use 1 to {} bytes",
                    crate::config::MAX_GROUP_BYTES
                )));
            }
            let id = task.id.unwrap_or_else(task::new_id);
            let mut envelope = Envelope::new(id.clone(), task.kind, task.data);
            envelope.priority = task.priority.map(Cow::Owned);
            envelope.unique = task.unique;
            if let Some(group) = task.group {
                let group = serde_json::value::to_raw_value(&group)
                    .map_err(|error| ClientError::Data(error.to_string()))?;
                envelope
                    .extra
                    .push((Cow::Borrowed("group"), Cow::Owned(group)));
            }
            if let Some((traceparent, tracestate)) = task.trace {
                let fields = [
                    ("traceparent", Some(traceparent)),
                    ("tracestate", tracestate),
                ];
                for (name, value) in fields {
                    if let Some(value) = value {
                        let value = serde_json::value::to_raw_value(&value)
                            .map_err(|error| ClientError::Data(error.to_string()))?;
                        envelope
                            .extra
                            .push((Cow::Borrowed(name), Cow::Owned(value)));
                    }
                }
            }
            if let Some(expires) = task.expires {
                let at_ms = match expires {
                    Expiry::At(at_ms) => at_ms,
                    Expiry::After(expiry) => {
                        let now_ms = match now_ms {
                            Some(now_ms) => now_ms,
                            None => *now_ms.insert(broker::redis_now(&mut **connection)?),
                        };
                        now_ms.saturating_add(i64::try_from(expiry.as_millis()).unwrap_or(i64::MAX))
                    }
                };
                envelope.extra.push((
                    Cow::Borrowed("expires_at"),
                    // An integer always serializes.
                    Cow::Owned(serde_json::value::to_raw_value(&at_ms).expect("an integer")),
                ));
            }
            let unique_for_ms = task.unique_for.map_or(0, |hold| {
                u64::try_from(hold.as_millis()).unwrap_or(u64::MAX)
            });
            if task.unique_for.is_some() && !(1..=MAX_UNIQUE_FOR_MS).contains(&unique_for_ms) {
                return Err(ClientError::Data(format!(
                    "unique_for must be 1 ms to {MAX_UNIQUE_FOR_MS} ms, not {unique_for_ms} ms"
                )));
            }
            let options = (task.unique, task.debounce, unique_for_ms);
            prepared.push((level, task.due, options, envelope.encode(), id));
        }
        let mut results = Vec::with_capacity(prepared.len());
        // Consecutive tasks with the same level and due time share script calls.
        for group in prepared.chunk_by(|a, b| a.0 == b.0 && a.1 == b.1) {
            for chunk in group.chunks(PUSH_CHUNK) {
                let items: Vec<PushItem<'_>> = chunk
                    .iter()
                    .map(
                        |(_, _, (unique, debounce, unique_for_ms), envelope, id)| PushItem {
                            id,
                            unique: *unique,
                            debounce: *debounce,
                            unique_for_ms: *unique_for_ms,
                            envelope,
                        },
                    )
                    .collect();
                let (level, due) = (chunk[0].0, chunk[0].1);
                let accepted = broker::push(&mut connection, &info.keys, level, due, &items)?;
                for ((.., id), ok) in chunk.iter().zip(accepted) {
                    results.push(if ok {
                        Pushed::Accepted(id.clone())
                    } else {
                        Pushed::Duplicate(id.clone())
                    });
                }
            }
        }
        Ok(results)
    }

    /// Pushes a flow (docs/design/flows.md): `text` is the flow's JSON, checked whole before anything is
    /// written ([`crate::flow::plan`]). Its waiting tasks are written first, a queue at a time (each call all or
    /// nothing, [`workflow::PUSH_BATCH`] tasks a call), then the tasks that wait for nothing are pushed: so no
    /// task can end before the tasks waiting for it exist. Returns the plan's tasks, root first, with the path
    /// of each whose id was generated, and what became of the waiting tasks already there (pushed before:
    /// `(queue, id, what flow_push.lua said)` for each not written anew).
    pub fn push_flow(&self, text: &str) -> Result<PushedFlow, ClientError> {
        let shapes: HashMap<String, crate::flow::QueueShape> = self
            .queues
            .iter()
            .map(|(name, info)| {
                let shape = crate::flow::QueueShape {
                    levels: info.keys.levels.clone(),
                    default_level: info.default_priority,
                };
                (name.clone(), shape)
            })
            .collect();
        let plan = crate::flow::plan(text, &shapes).map_err(ClientError::Data)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        let mut kept = Vec::new();
        for (queue, waiters) in &plan.waiters {
            let info = self.queue(queue)?;
            // Without keep_results, a finished waiting task's hash is kept ten minutes, for `flow show`.
            let keep = info.keep_results.unwrap_or(Duration::from_secs(600));
            let said =
                workflow::push_waiters(&mut connection, &info.keys, info.dead_max, keep, waiters)?;
            for (waiter, said) in waiters.iter().zip(said) {
                if said != "waiting" {
                    kept.push((queue.clone(), waiter.id.clone(), said));
                }
            }
        }
        for (queue, leaves) in &plan.leaves {
            let info = self.queue(queue)?;
            let mut sorted: Vec<&crate::flow::Leaf> = leaves.iter().collect();
            sorted.sort_by_key(|leaf| leaf.level);
            for group in sorted.chunk_by(|a, b| a.level == b.level) {
                for chunk in group.chunks(PUSH_CHUNK) {
                    let items: Vec<PushItem<'_>> = chunk
                        .iter()
                        .map(|leaf| PushItem {
                            debounce: false,
                            id: &leaf.id,
                            unique: false,
                            unique_for_ms: 0,
                            envelope: &leaf.envelope,
                        })
                        .collect();
                    broker::push(
                        &mut connection,
                        &info.keys,
                        chunk[0].level,
                        Due::Now,
                        &items,
                    )?;
                }
            }
        }
        Ok(PushedFlow {
            tasks: plan.tasks,
            kept,
        })
    }

    /// The waiting task `id` of `queue` as `kmqd flow show` reads it: its state and its dependencies' outcomes;
    /// `None` when it is not (or no longer) a waiting task of a flow.
    pub fn flow_task(&self, queue: &str, id: &str) -> Result<Option<WaitingTask>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(workflow::waiting_task(&mut connection, &info.keys, id)?)
    }

    /// Task `id`'s kept result, read at once (`keep_results`: what the settle that ended it kept); `None` when
    /// there is none: not ended, never kept, or expired. Two round trips, no scan of the queue (`kmqd task show`
    /// and the dashboard's task page read it beside where the task is).
    pub fn kept_result(
        &self,
        queue: &str,
        id: &str,
    ) -> Result<Option<broker::results::Ended>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::results::read(&mut connection, &info.keys, id)?)
    }

    /// Every place the task `id` is in: delayed, retrying, ready, processing or dead (a non-unique id may be in
    /// several). Finding a delayed task costs O(log n); the other places are scanned.
    pub fn find(&self, queue: &str, id: &str) -> Result<Vec<Found>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        let found = lookup::locate(&mut connection, &info.keys, &[id], Scope::Everywhere)?;
        Ok(found.into_iter().map(|(_, found)| found).collect())
    }

    /// Task `id`'s result, waiting up to `wait` for the task to end (docs/PROTOCOL.md, "Results"): what the settle
    /// that ended it kept (with `keep_results`), or whether it is still waiting or running, or unknown.
    ///
    /// It polls, with a backoff from 10 ms doubling to at most 500 ms, each turn reading the result and, when
    /// there is none, whether the task is still in the queue; it never blocks on a notice. A notice can be
    /// missed (sent while the reader reconnects, or before it listened), and a result can expire before a reader
    /// looks: a poll of the key itself sees both, and the wait ends by the deadline whatever happens (a turn
    /// costs one GET and, while the task waits, one lookup). A task found nowhere is read once more, since it may
    /// have ended between the two reads (the settle writes the result in the step that ends the task). In safe
    /// mode such a task is unknown (never pushed, or its result expired or was never kept); in default mode a
    /// running task has left Redis, so the wait goes on until its result appears or the wait ends.
    pub fn result(&self, queue: &str, id: &str, wait: Duration) -> Result<TaskResult, ClientError> {
        let info = self.queue(queue)?;
        let deadline = std::time::Instant::now() + wait;
        let mut pause = Duration::from_millis(10);
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        loop {
            if let Some(ended) = broker::results::read(&mut connection, &info.keys, id)? {
                return Ok(TaskResult::Ended(ended));
            }
            let found = lookup::locate(&mut connection, &info.keys, &[id], Scope::Everywhere)?;
            let waiting = found
                .iter()
                .any(|(_, found)| !matches!(found, Found::Dead { .. }));
            if !waiting {
                if let Some(ended) = broker::results::read(&mut connection, &info.keys, id)? {
                    return Ok(TaskResult::Ended(ended));
                }
                if let Some((_, Found::Dead { record })) = found.first() {
                    return Ok(TaskResult::DeadLettered(record.clone()));
                }
                if info.safe {
                    return Ok(TaskResult::Unknown {
                        keeps_results: info.keep_results.is_some(),
                    });
                }
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(match waiting {
                    true => TaskResult::Pending,
                    false => TaskResult::Unknown {
                        keeps_results: info.keep_results.is_some(),
                    },
                });
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// As [`Client::find`], reading no more than `budget` of the queue's lists (the dashboard's lookups, review
    /// M7): what it found, and whether it searched them all.
    pub fn find_within(
        &self,
        queue: &str,
        id: &str,
        budget: lookup::Budget,
    ) -> Result<lookup::Located, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(lookup::locate_within(
            &mut connection,
            &info.keys,
            &[id],
            Scope::Everywhere,
            Some(budget),
        )?)
    }

    /// Which of `ids` run now: found in `queue`'s processing area (safe mode: claimed and not yet settled; a
    /// default-mode task a daemon popped is in no list), reading no more of it than `budget`. The dashboard's
    /// flow tree tells a running task from a waiting one so, one read per queue for all its nodes.
    pub fn running(
        &self,
        queue: &str,
        ids: &[&str],
        budget: lookup::Budget,
    ) -> Result<std::collections::HashSet<String>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        let located = lookup::locate_within(
            &mut connection,
            &info.keys,
            ids,
            Scope::Processing,
            Some(budget),
        )?;
        Ok(located.found.into_iter().map(|(id, _)| id).collect())
    }

    /// Whether the task `id` is delayed, retrying, ready or processing.
    pub fn exists(&self, queue: &str, id: &str) -> Result<bool, ClientError> {
        Ok(self
            .find(queue, id)?
            .iter()
            .any(|found| !matches!(found, Found::Dead { .. })))
    }

    /// How long until the delayed (or retrying) task `id` is due; `None` when it is not waiting for a due time.
    pub fn remaining_delay(&self, queue: &str, id: &str) -> Result<Option<Duration>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        let left = lookup::remaining_delay(&mut connection, &info.keys, id)?;
        Ok(left.map(|ms| Duration::from_millis(ms as u64)))
    }

    /// Cancels the waiting (delayed, retrying or ready) task `id`; returns how many copies were removed (0: it
    /// was not waiting: unknown, already running, done or dead). A unique id is released; a `unique_for` one stays
    /// held for its window from now, as after any end (docs/PROTOCOL.md, "Debounce, and unique for a time").
    pub fn cancel(&self, queue: &str, id: &str) -> Result<usize, ClientError> {
        Ok(self.cancel_batch(queue, &[id])?.into_values().sum())
    }

    /// [`Client::cancel`] for many ids, in one pass over the queue.
    pub fn cancel_batch(
        &self,
        queue: &str,
        ids: &[&str],
    ) -> Result<HashMap<String, usize>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(lookup::cancel(&mut connection, &info.keys, ids)?)
    }

    /// A queue's depth and counters.
    pub fn stats(&self, queue: &str) -> Result<QueueStats, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::stats(&mut **connection, &info.keys)?)
    }

    /// How many starts each of the queue's rate-limit windows (`windows_ms`, each a window's length, as its
    /// `rate_limit` has them) holds now: what `kmqd stats` shows against the limit.
    pub fn rate_used(&self, queue: &str, windows_ms: &[u64]) -> Result<Vec<u64>, ClientError> {
        let info = self.queue(queue)?;
        if windows_ms.is_empty() {
            return Ok(Vec::new());
        }
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::rate_used(
            &mut **connection,
            &info.keys,
            windows_ms,
        )?)
    }

    /// What each of `limits` (the queue's `[[queues.limits]]`, from a config) counts now: running, rate windows,
    /// tasks held back ([`broker::type_usage`]).
    pub fn type_usage(
        &self,
        queue: &str,
        limits: &[crate::config::TypeLimit],
    ) -> Result<Vec<broker::TypeUsage>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::type_usage(&mut **connection, &info.keys, limits)?)
    }

    /// At most `limit` tasks from the head of each ready list, and the `limit` delayed tasks and retries due
    /// soonest: what the dashboard's queue page shows.
    pub fn peek(&self, queue: &str, limit: usize) -> Result<broker::peek::Waiting, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::peek::peek(&mut connection, &info.keys, limit)?)
    }

    /// The queue's samples a minute (counters and depths) of the last hour, oldest first: the dashboard's charts
    /// (written by the daemons' monitors, broker/history.rs).
    pub fn history(&self, queue: &str) -> Result<Vec<broker::history::Sample>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::history::read(&mut connection, &info.keys)?)
    }

    /// Redis's clock, ms since the epoch: what a dead record's `dead_at` is measured on.
    pub fn redis_now(&self, queue: &str) -> Result<i64, ClientError> {
        self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::redis_now(&mut **connection)?)
    }

    /// As [`Client::dead_list`], as a page reads it: [`broker::peek::CHUNK`] records per round trip and no more
    /// than about [`broker::peek::LIST_BYTES`] of them (fewer records when they are large).
    pub fn dead_head(&self, queue: &str, limit: usize) -> Result<Vec<DeadRecord>, ClientError> {
        self.dead_records(queue, limit, broker::peek::CHUNK, broker::peek::LIST_BYTES)
    }

    /// The newest `limit` dead-letter records of `queue`, newest first, read [`dead::PAGE`] per command (so a
    /// large limit does not hold Redis for long; records dead-lettered meanwhile may shift a page by as many).
    pub fn dead_list(&self, queue: &str, limit: usize) -> Result<Vec<DeadRecord>, ClientError> {
        self.dead_records(queue, limit, dead::PAGE, usize::MAX)
    }

    /// The newest `limit` dead records of `queue`, `page` per round trip, until about `bytes` of them are read.
    fn dead_records(
        &self,
        queue: &str,
        limit: usize,
        page: usize,
        bytes: usize,
    ) -> Result<Vec<DeadRecord>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        let (mut records, mut read) = (Vec::new(), 0);
        while records.len() < limit && read < bytes {
            let start = records.len();
            let count = page.min(limit - start);
            let got = dead::range(
                &mut connection,
                &info.keys,
                start as i64,
                (start + count) as i64 - 1,
            )?;
            let done = got.len() < count;
            read += got.iter().map(|record| record.raw.len()).sum::<usize>();
            records.extend(got);
            if done {
                break;
            }
        }
        Ok(records)
    }

    /// Every dead-letter record of the task `id` (a non-unique id may have several), newest first. Records of
    /// malformed payloads carry the payload's `id` when it had a string one, and are found by it.
    pub fn dead_show(&self, queue: &str, id: &str) -> Result<Vec<DeadRecord>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        let mut found = Vec::new();
        dead::walk(&mut connection, &info.keys, |_, page| {
            found.extend(page.into_iter().filter(|record| record.id() == id));
            Ok(Vec::new())
        })?;
        // The walk goes oldest first.
        found.reverse();
        Ok(found)
    }

    /// Moves dead tasks back to the back of their level's ready list: the records of these ids, or all of them
    /// (those present when the call began, oldest first). Each record is removed and its task pushed in one
    /// step (dead_requeue.lua), [`dead::PAGE`] records per script call, while daemons keep dead-lettering. A
    /// task goes to the level its record names, else to the level its envelope asked for (`priority`), else to
    /// the queue's default level. With `reset_attempts` its `attempt` starts again at 0 (the full retry budget).
    /// A unique task takes its id again, and stays dead while the id is held by a live task ([`Requeued::held`]);
    /// a record without a readable task (a malformed payload) cannot be requeued ([`Requeued::malformed`]).
    pub fn dead_requeue(
        &self,
        queue: &str,
        which: DeadSelection<'_>,
        reset_attempts: bool,
    ) -> Result<Requeued, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        let mut report = Requeued::default();
        let mut matched = std::collections::HashSet::new();
        dead::walk(&mut connection, &info.keys, |conn, page| {
            // (record, level, unique id, envelope, withdrawal), and each one's place in the page
            let mut items: Vec<RequeuePlan<'_>> = Vec::new();
            let mut places = Vec::new();
            for (at, record) in page.iter().enumerate() {
                if !which.wants(record.id()) {
                    continue;
                }
                matched.insert(record.id().to_string());
                match requeue_plan(info, record, reset_attempts) {
                    Some((level, unique_id, envelope, withdrawal)) => {
                        items.push((record, level, unique_id, envelope, withdrawal));
                        places.push(at);
                    }
                    None => report.malformed.push(record.id().to_string()),
                }
            }
            let calls: Vec<RequeueItem<'_>> = items
                .iter()
                .map(
                    |(record, level, unique_id, envelope, withdrawal)| RequeueItem {
                        record: &record.raw,
                        level: *level,
                        unique_id: unique_id.as_deref(),
                        envelope,
                        withdrawal: withdrawal.as_deref(),
                    },
                )
                .collect();
            let outcomes = dead::requeue(conn, &info.keys, &calls)?;
            let mut gone = Vec::new();
            for (((record, ..), at), outcome) in items.iter().zip(&places).zip(outcomes) {
                let id = record.id().to_string();
                match outcome {
                    Fate::Done => report.requeued.push(id),
                    Fate::NotFound => report.not_found.push(id),
                    Fate::Held => report.held.push(id),
                }
                // A record gone meanwhile no longer holds its place in the list either.
                if outcome != Fate::Held {
                    gone.push(*at);
                }
            }
            Ok(gone)
        })?;
        report.not_found.extend(which.unmatched(&matched));
        Ok(report)
    }

    /// Removes dead-letter records: those of these ids, or all of them (those present when the call began),
    /// each by its exact bytes (dead_purge.lua), [`dead::PAGE`] per script call, while daemons keep
    /// dead-lettering.
    pub fn dead_purge(&self, queue: &str, which: DeadSelection<'_>) -> Result<Purged, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        let mut report = Purged::default();
        let mut matched = std::collections::HashSet::new();
        dead::walk(&mut connection, &info.keys, |conn, page| {
            let chosen: Vec<(usize, &DeadRecord)> = page
                .iter()
                .enumerate()
                .filter(|(_, record)| which.wants(record.id()))
                .collect();
            matched.extend(chosen.iter().map(|(_, record)| record.id().to_string()));
            let raw: Vec<&[u8]> = chosen.iter().map(|(_, record)| &record.raw[..]).collect();
            let outcomes = dead::purge(conn, &info.keys, &raw)?;
            for ((_, record), outcome) in chosen.iter().zip(&outcomes) {
                let id = record.id().to_string();
                match outcome {
                    Fate::Done => report.purged.push(id),
                    _ => report.not_found.push(id),
                }
            }
            // Purged, or gone meanwhile: none of them is in the list.
            Ok(chosen.iter().map(|(at, _)| *at).collect())
        })?;
        report.not_found.extend(which.unmatched(&matched));
        Ok(report)
    }

    /// Pauses `queue` for every daemon: it still accepts pushes and delayed tasks still become ready, but no
    /// daemon takes a task from it until [`Client::resume`] (running tasks finish and are settled). Every claim
    /// and pop checks the pause in the same atomic step as its take, so a daemon takes nothing once the pause
    /// is in Redis: only a fetch that Redis ran before it may still bring tasks. Returns false when the queue
    /// was paused already.
    pub fn pause(&self, queue: &str) -> Result<bool, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        // The pauser's clock: the value is only for people looking at the key.
        let now_ms = broker::local_now_ms();
        Ok(broker::admin::pause(&mut **connection, &info.keys, now_ms)?)
    }

    /// Resumes a paused `queue`; the daemons take its tasks again within their `idle_poll`. Returns false when
    /// it was not paused.
    pub fn resume(&self, queue: &str) -> Result<bool, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::admin::resume(&mut **connection, &info.keys)?)
    }

    /// The groups of `queue` that have tasks waiting or running, busiest first, at most `limit` (`[queues.groups]`;
    /// read in pages, see [`broker::groups::groups`]).
    pub fn groups(
        &self,
        queue: &str,
        limit: usize,
    ) -> Result<Vec<broker::groups::Group>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::groups::groups(
            &mut **connection,
            &info.keys,
            limit,
        )?)
    }

    /// How many groups of `queue` have tasks waiting: a count per level, whatever the number of groups
    /// ([`broker::groups::waiting`]).
    pub fn groups_waiting(&self, queue: &str) -> Result<u64, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::groups::waiting(&mut **connection, &info.keys)?)
    }

    /// Pauses group `group` of `queue` on every daemon: no claim takes its tasks until [`Client::resume_group`].
    /// Returns false when it was paused already.
    pub fn pause_group(&self, queue: &str, group: &str) -> Result<bool, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        // The pauser's clock: the value is only for people looking at the key.
        let now_ms = broker::local_now_ms();
        Ok(broker::groups::pause(
            &mut **connection,
            &info.keys,
            group,
            now_ms,
        )?)
    }

    /// Resumes a paused group of `queue`: its tasks take turns again at the next claim. Returns false when it was
    /// not paused.
    pub fn resume_group(&self, queue: &str, group: &str) -> Result<bool, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::groups::resume(
            &mut **connection,
            &info.keys,
            group,
        )?)
    }

    /// The daemons alive on `queue` (owners with a live lease): host, pid, version, what they hold, whether
    /// they are draining (stopping gracefully) and whether the queue is paused.
    pub fn workers(&self, queue: &str) -> Result<Vec<broker::admin::Worker>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::admin::workers(
            &mut **connection,
            &info.keys,
            queue,
        )?)
    }
}

/// Which dead-letter records [`Client::dead_requeue`] and [`Client::dead_purge`] work on.
#[derive(Clone, Copy, Debug)]
pub enum DeadSelection<'a> {
    /// Every record of these task ids.
    Ids(&'a [&'a str]),
    /// Every record in the list when the call began (not those dead-lettered while it runs).
    All,
}

impl DeadSelection<'_> {
    fn wants(&self, id: &str) -> bool {
        match self {
            DeadSelection::Ids(ids) => ids.contains(&id),
            DeadSelection::All => true,
        }
    }

    /// The ids asked for that no record had.
    fn unmatched(&self, matched: &std::collections::HashSet<String>) -> Vec<String> {
        match self {
            DeadSelection::Ids(ids) => ids
                .iter()
                .filter(|id| !matched.contains(**id))
                .map(|id| id.to_string())
                .collect(),
            DeadSelection::All => Vec::new(),
        }
    }
}

/// What [`Client::dead_requeue`] did, by task id (one entry per record; "" for a record without an id).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Requeued {
    /// Records whose task is ready again.
    pub requeued: Vec<String>,
    /// Ids asked for that had no record, and records gone before their turn (requeued or purged by someone
    /// else, or trimmed by `dead_max`).
    pub not_found: Vec<String>,
    /// Unique tasks whose id a live task holds, or a `unique_for` task's window after it ended: left dead.
    pub held: Vec<String>,
    /// Records without a task to queue (the payload was not an envelope, or not UTF-8): left dead.
    pub malformed: Vec<String>,
}

/// What [`Client::dead_purge`] did, by task id (one entry per record).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Purged {
    pub purged: Vec<String>,
    /// Ids asked for that had no record, and records gone before their turn.
    pub not_found: Vec<String>,
}

/// Where and what a dead record's task is queued as: (level, unique id to take again, envelope); `None` when the
/// record holds no task that decodes, as the daemons read the queue's payloads.
/// A dead record to requeue: the record, its level, its unique id, the envelope to queue, and the withdrawal
/// note for its waiters (a task of a flow).
type RequeuePlan<'a> = (
    &'a DeadRecord,
    usize,
    Option<String>,
    Vec<u8>,
    Option<Vec<u8>>,
);

/// What [`requeue_plan`] decides for a record: its level, its unique id, the envelope to queue, and the withdrawal
/// note for its waiters.
type Planned = (usize, Option<String>, Vec<u8>, Option<Vec<u8>>);

fn requeue_plan(info: &QueueInfo, record: &DeadRecord, reset_attempts: bool) -> Option<Planned> {
    let text = record.task()?;
    let mut envelope = match &info.foreign_type_field {
        Some(field) => Envelope::decode_foreign(text, field),
        None => Envelope::decode(text),
    }
    .ok()?;
    if envelope.kind.is_empty() {
        return None;
    }
    let level_named = |name: &str| info.keys.levels.iter().position(|level| level == name);
    let level = record
        .text("level")
        .and_then(level_named)
        .or_else(|| envelope.priority.as_deref().and_then(level_named))
        .unwrap_or(info.default_priority);
    let unique_id = envelope
        .unique
        .then(|| envelope.id.as_deref().map(str::to_string))
        .flatten();
    // A task others wait for (a flow's) goes back as its next run, and its waiters are told to forget the dead
    // one (docs/design/flows.md, "A requeued dependency").
    let waiters = envelope
        .extra
        .iter()
        .find(|(name, _)| name == "waiters")
        .map(|(_, waiters)| waiters.clone().into_owned());
    let withdrawal = waiters.map(|waiters| {
        let run = workflow::run_of(&envelope) + 1;
        workflow::set_run(&mut envelope, run);
        workflow::withdrawal(info.keys.queue_name(), envelope.id_str(), &waiters, run)
    });
    // Unchanged, the payload goes back byte for byte (a foreign payload stays foreign).
    let payload = if withdrawal.is_some() || (reset_attempts && envelope.attempt != 0) {
        if reset_attempts {
            envelope.attempt = 0;
        }
        envelope.encode().into_bytes()
    } else {
        text.as_bytes().to_vec()
    };
    Some((level, unique_id, payload, withdrawal))
}
