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

use crate::broker::{
    self, BrokerError, Due, Found, Pool, PushItem, QueueKeys, QueueStats, Scope, access, lookup,
};
use crate::config::Config;
use crate::task::{self, Envelope};

/// The most tasks sent in one enqueue script call. Bounded so that one call never holds Redis for long.
pub const PUSH_CHUNK: usize = 1000;

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
    default_priority: usize,
}

/// A producer (and inspector) for the queues of one config. Cheap to share: it holds a connection pool.
pub struct Client {
    pool: Pool,
    queues: HashMap<String, QueueInfo>,
    /// For [`Client::check_access`], which connects outside the pool: a refusal at connection time (wrong
    /// credentials, a cluster client's own command refused) comes back as itself, not as the pool's timeout.
    connector: broker::Connector,
}

impl Client {
    pub fn new(config: &Config) -> Result<Client, ClientError> {
        let queues = config
            .queues
            .iter()
            .map(|queue| {
                let info = QueueInfo {
                    keys: QueueKeys::for_queue(&config.redis.key_prefix, queue),
                    default_priority: queue.default_priority,
                };
                (queue.name.clone(), info)
            })
            .collect();
        Ok(Client {
            pool: broker::pool(&config.redis)?,
            queues,
            connector: broker::Connector::new(&config.redis)?,
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
        // (level, due, unique, envelope, id)
        let mut prepared: Vec<(usize, Due, bool, String, String)> = Vec::new();
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
            if task.unique && task.id.is_none() {
                return Err(ClientError::UniqueWithoutId);
            }
            let id = task.id.unwrap_or_else(task::new_id);
            let mut envelope = Envelope::new(id.clone(), task.kind, task.data);
            envelope.priority = task.priority.map(Cow::Owned);
            envelope.unique = task.unique;
            prepared.push((level, task.due, task.unique, envelope.encode(), id));
        }
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        let mut results = Vec::with_capacity(prepared.len());
        // Consecutive tasks with the same level and due time share script calls.
        for group in prepared.chunk_by(|a, b| a.0 == b.0 && a.1 == b.1) {
            for chunk in group.chunks(PUSH_CHUNK) {
                let items: Vec<PushItem<'_>> = chunk
                    .iter()
                    .map(|(_, _, unique, envelope, id)| PushItem {
                        id,
                        unique: *unique,
                        envelope,
                    })
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

    /// Every place the task `id` is in: delayed, retrying, ready, processing or dead (a non-unique id may be in
    /// several). Finding a delayed task costs O(log n); the other places are scanned.
    pub fn find(&self, queue: &str, id: &str) -> Result<Vec<Found>, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        let found = lookup::locate(&mut connection, &info.keys, &[id], Scope::Everywhere)?;
        Ok(found.into_iter().map(|(_, found)| found).collect())
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
    /// was not waiting: unknown, already running, done or dead). A unique id is released.
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

    /// Pauses `queue` for every daemon: it still accepts pushes and delayed tasks still become ready, but no
    /// daemon takes a task from it until [`Client::resume`] (running tasks finish and are settled). Every claim
    /// and pop checks the pause in the same atomic step as its take, so a daemon takes nothing once the pause
    /// is in Redis: only a fetch that Redis ran before it may still bring tasks. Returns false when the queue
    /// was paused already.
    pub fn pause(&self, queue: &str) -> Result<bool, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        // The pauser's clock: the value is only for people looking at the key.
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_millis() as i64);
        Ok(broker::admin::pause(&mut **connection, &info.keys, now_ms)?)
    }

    /// Resumes a paused `queue`; the daemons take its tasks again within their `idle_poll`. Returns false when
    /// it was not paused.
    pub fn resume(&self, queue: &str) -> Result<bool, ClientError> {
        let info = self.queue(queue)?;
        let mut connection = self.pool.get().map_err(BrokerError::from)?;
        Ok(broker::admin::resume(&mut **connection, &info.keys)?)
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
