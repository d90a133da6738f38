//! The supervisor: spawns every thread of the daemon, watches them, and runs the shutdown sequence.
//!
//! Threads, per queue: a fetcher, `workers` workers, an acker and a delay poller; per daemon: the heartbeat, the
//! monitor (when a queue is in safe mode), the delay listener and the metrics endpoint (when configured). Each is
//! named after its module (`kmqd-worker-mail-3`) and reports its end on the event channel, so the supervisor's
//! loop is one `select!` over a closed set of events.
//!
//! Shutdown (docs/OPERATIONS.md, "Stopping"), in phases so that no outcome is lost between threads:
//! 1. *claiming* fires: fetchers stop; jobs still queued for workers are handed back without running;
//! 2. running handlers get `shutdown_grace` to finish; then their cancel flags are raised and, in safe mode,
//!    their tasks are handed back to the front of their queue (default mode: reported as lost);
//! 3. *settling* fires: ackers apply what they hold and stop (waited for up to [`SETTLE_DEADLINE`]);
//! 4. *background* fires: heartbeat, monitor and delay threads stop; plugins' `shutdown` runs if every handler
//!    returned.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, select};

use crate::acker::Acker;
use crate::broker::{self, BrokerError, Connector, QueueKeys, Session};
use crate::config::{Config, Mode, QueueConfig};
use crate::delay::{DelayListener, DelayPoller};
use crate::fetcher::Fetcher;
use crate::heartbeat::Heartbeat;
use crate::inflight::{InFlight, JobId, JobState, Ownership, Slots};
use crate::metrics::Metrics;
use crate::monitor::Monitor;
use crate::plugin::Registry;
use crate::policy::{Policy, Verdict};
use crate::schedule::Scheduler;

use crate::settlement::{self, Outcome};
use crate::shutdown::Trigger;
use crate::task::{Envelope, EnvelopeError, new_id};

use crate::worker::Worker;

/// How long the ackers get to apply what they hold once the handlers are done.
pub const SETTLE_DEADLINE: Duration = Duration::from_secs(10);
/// How long the background threads get to notice the last phase (their blocking calls time out within ~1 s).
pub const BACKGROUND_DEADLINE: Duration = Duration::from_secs(15);

/// Everything the threads of one queue share.
pub struct QueueContext {
    pub config: QueueConfig,
    pub keys: QueueKeys,
    pub policy: Policy,
    pub inflight: InFlight,
    pub slots: Slots,
    /// Safe mode: this daemon's owner on the queue.
    pub ownership: Ownership,
}

impl QueueContext {
    /// Decodes a payload of this queue: an envelope, or a foreign payload when the queue accepts them. A task
    /// without an id gets a fresh one, which retries and dead letters then carry.
    pub fn decode<'a>(&self, payload: &'a str) -> Result<Envelope<'a>, EnvelopeError> {
        let mut envelope = match &self.config.foreign_type_field {
            Some(field) => Envelope::decode_foreign(payload, field)?,
            None => Envelope::decode(payload)?,
        };
        envelope.ensure_id(new_id);
        Ok(envelope)
    }

    /// The verdict on a held task: `verdict_of` judges one that decodes; one that does not is unrunnable (and
    /// so dead-lettered with the decode error as its reason). Returns the envelope too, for the settlement.
    pub fn judge<'a>(
        &self,
        payload: &'a str,
        verdict_of: impl FnOnce(&Envelope<'a>) -> Verdict,
    ) -> (Verdict, Option<Envelope<'a>>) {
        match self.decode(payload) {
            Ok(envelope) => (verdict_of(&envelope), Some(envelope)),
            Err(error) => (
                Verdict::Unrunnable {
                    reason: error.to_string(),
                },
                None,
            ),
        }
    }
}

/// A task handed from the fetcher to a worker.
#[derive(Debug)]
pub struct Job {
    pub id: JobId,
    /// Shared with the in-flight table.
    pub state: Arc<JobState>,
    /// Redis's clock when the task was taken, ms.
    pub claimed_at_ms: i64,
    /// The local clock at the same moment, to advance `claimed_at_ms` without asking Redis.
    pub claimed_at: Instant,
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error("cannot listen on metrics_addr {addr}: {source}")]
    Metrics {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start thread {name}: {source}")]
    Spawn {
        name: String,
        source: std::io::Error,
    },
    #[error("thread {name} {how}; the daemon stopped so that it does not run with a part missing")]
    ThreadDied { name: String, how: &'static str },
}

/// What the supervisor reacts to.
enum Event {
    /// A thread ended (its closure returned or panicked).
    Exited { name: String, panicked: bool },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    Worker,
    Acker,
    Other,
}

/// Sends `Event::Exited` when the thread ends, however it ends.
struct ExitGuard {
    name: String,
    events: Sender<Event>,
}

impl Drop for ExitGuard {
    fn drop(&mut self) {
        let name = std::mem::take(&mut self.name);
        // The supervisor may have stopped listening at the very end; nothing is left to tell then.
        let _ = self.events.send(Event::Exited {
            name,
            panicked: std::thread::panicking(),
        });
    }
}

/// The threads the supervisor started and has not seen end.
struct Threads {
    events: Sender<Event>,
    live: HashMap<String, (Role, JoinHandle<()>)>,
}

impl Threads {
    fn spawn(
        &mut self,
        name: String,
        role: Role,
        body: impl FnOnce() + Send + 'static,
    ) -> Result<(), DaemonError> {
        let guard = ExitGuard {
            name: name.clone(),
            events: self.events.clone(),
        };
        let handle = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let _guard = guard;
                body();
            })
            .map_err(|source| DaemonError::Spawn {
                name: name.clone(),
                source,
            })?;
        self.live.insert(name, (role, handle));
        Ok(())
    }

    /// Joins a thread that reported its end.
    fn exited(&mut self, name: &str) -> Option<Role> {
        let (role, handle) = self.live.remove(name)?;
        // The thread has already ended, so this does not block; a panic was reported through the event.
        let _ = handle.join();
        Some(role)
    }

    fn count(&self, role: Role) -> usize {
        self.live.values().filter(|(r, _)| *r == role).count()
    }

    /// Handles exit events until no thread of `role` is left or `deadline` passes. Returns whether none is left.
    fn wait_for(&mut self, events: &Receiver<Event>, role: Role, deadline: Instant) -> bool {
        while self.count(role) > 0 {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            match events.recv_timeout(left) {
                Ok(Event::Exited { name, panicked }) => {
                    if panicked {
                        tracing::error!(thread = %name, "thread panicked during shutdown");
                    }
                    self.exited(&name);
                }
                Err(_) => return false,
            }
        }
        true
    }
}

/// How many free slots make the fetcher claim (unless the workers run dry first): a full batch, or half of all
/// the slots when that is smaller, so that claims stay large and workers never wait on a round trip.
pub fn fetch_threshold(queue: &QueueConfig) -> usize {
    queue.batch.min((queue.workers + queue.prefetch) / 2).max(1)
}

/// `host:pid`, written into dead-letter records so an operator knows where a task died.
fn daemon_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let host = if host.is_empty() {
        "unknown".to_string()
    } else {
        host
    };
    format!("{host}:{}", std::process::id())
}

/// Runs the daemon until `stop` receives a message (or is disconnected), then shuts down gracefully.
///
/// The caller owns signal handling: `main` forwards the first SIGTERM/SIGINT here; tests send directly.
pub fn run(
    config: &Config,
    registry: Arc<Registry>,
    stop: Receiver<()>,
) -> Result<(), DaemonError> {
    let connector = Arc::new(Connector::new(&config.redis)?);
    let pool = broker::pool(&config.redis)?;
    {
        // Fail fast on an unreachable Redis or keys of another protocol version: systemd restarts us.
        let mut connection = pool.get().map_err(BrokerError::from)?;
        for queue in &config.queues {
            broker::check_protocol(
                &mut **connection,
                &QueueKeys::for_queue(&config.redis.key_prefix, queue),
                &queue.name,
            )?;
        }
    }
    let daemon_id: Arc<str> = Arc::from(daemon_id());
    let (claiming, settling, background) = (Trigger::new(), Trigger::new(), Trigger::new());
    let (events_tx, events) = crossbeam_channel::unbounded();
    let mut threads = Threads {
        events: events_tx,
        live: HashMap::new(),
    };

    let queues: Vec<Arc<QueueContext>> = config
        .queues
        .iter()
        .map(|queue| {
            Arc::new(QueueContext {
                config: queue.clone(),
                keys: QueueKeys::for_queue(&config.redis.key_prefix, queue),
                policy: Policy::for_queue(queue),
                inflight: InFlight::default(),
                slots: Slots::new(queue.workers + queue.prefetch, fetch_threshold(queue)),
                ownership: Ownership::default(),
            })
        })
        .collect();

    let mut acker_senders: Vec<Sender<Outcome>> = Vec::new();
    let mut delay_channels = HashMap::new();
    for queue in &queues {
        let name = &queue.config.name;
        // One outcome per held task at most: the acker frees a task's slot only once its outcome is settled.
        let (outcomes_tx, outcomes_rx) =
            crossbeam_channel::bounded(queue.config.workers + queue.config.prefetch);
        let (jobs_tx, jobs_rx) =
            crossbeam_channel::bounded(queue.config.workers + queue.config.prefetch);
        let acker = Acker {
            queue: Arc::clone(queue),
            registry: Arc::clone(&registry),
            connection: Session::new(pool.clone()),
            outcomes: outcomes_rx,
            settling: settling.listener(),
            background: background.listener(),
        };
        threads.spawn(format!("kmqd-acker-{name}"), Role::Acker, move || {
            acker.run()
        })?;
        for index in 0..queue.config.workers {
            let worker = Worker {
                queue: Arc::clone(queue),
                registry: Arc::clone(&registry),
                daemon_id: Arc::clone(&daemon_id),
                claiming: claiming.listener(),
                jobs: jobs_rx.clone(),
                outcomes: outcomes_tx.clone(),
            };
            threads.spawn(
                format!("kmqd-worker-{name}-{index}"),
                Role::Worker,
                move || worker.run(),
            )?;
        }
        let fetcher = Fetcher {
            queue: Arc::clone(queue),
            connection: Session::new(pool.clone()),
            claiming: claiming.listener(),
            jobs: jobs_tx,
            claim_size: queue.config.batch,
        };
        threads.spawn(format!("kmqd-fetcher-{name}"), Role::Other, move || {
            fetcher.run()
        })?;
        let (nudge_tx, nudge_rx) = crossbeam_channel::bounded(1);
        delay_channels.insert(queue.keys.delay_channel.clone(), nudge_tx);
        let poller = DelayPoller {
            queue: Arc::clone(queue),
            connection: Session::new(pool.clone()),
            nudges: nudge_rx,
            background: background.listener(),
        };
        threads.spawn(format!("kmqd-delay-{name}"), Role::Other, move || {
            poller.run()
        })?;
        acker_senders.push(outcomes_tx);
    }

    let heartbeat = Heartbeat {
        queues: queues
            .iter()
            .cloned()
            .zip(acker_senders.iter().cloned())
            .collect(),
        connection: Session::new(pool.clone()),
        daemon_id: Arc::clone(&daemon_id),
        settling: settling.listener(),
        background: background.listener(),
    };
    threads.spawn("kmqd-heartbeat".to_string(), Role::Other, move || {
        heartbeat.run()
    })?;
    let safe_queues: Vec<_> = queues
        .iter()
        .filter(|q| q.config.mode == Mode::Safe)
        .cloned()
        .collect();
    if !safe_queues.is_empty() {
        let monitor = Monitor {
            queues: safe_queues,
            connection: Session::new(pool.clone()),
            registry: Arc::clone(&registry),
            daemon_id: Arc::clone(&daemon_id),
            background: background.listener(),
        };
        threads.spawn("kmqd-monitor".to_string(), Role::Other, move || {
            monitor.run()
        })?;
    }
    let listener = DelayListener {
        connector,
        pollers: delay_channels,
        background: background.listener(),
    };
    threads.spawn("kmqd-delay-listener".to_string(), Role::Other, move || {
        listener.run()
    })?;
    if !config.schedules.is_empty() {
        let schedules = config
            .schedules
            .iter()
            .map(|schedule| {
                // Validation made sure every schedule names a configured queue.
                let queue = queues
                    .iter()
                    .find(|q| q.config.name == schedule.queue)
                    .expect("schedule's queue exists");
                (schedule.clone(), Arc::clone(queue))
            })
            .collect();
        let scheduler =
            Scheduler::new(schedules, Session::new(pool.clone()), background.listener());
        threads.spawn("kmqd-scheduler".to_string(), Role::Other, move || {
            scheduler.run()
        })?;
    }
    if let Some(addr) = config.daemon.metrics_addr {
        let listener = std::net::TcpListener::bind(addr)
            .map_err(|source| DaemonError::Metrics { addr, source })?;
        let metrics = Metrics {
            listener,
            queues: queues.clone(),
            connection: Session::new(pool.clone()),
            background: background.listener(),
        };
        tracing::info!("metrics on http://{addr}/metrics");
        threads.spawn("kmqd-metrics".to_string(), Role::Other, move || {
            metrics.run()
        })?;
    }

    tracing::info!(
        redis = %redact(config),
        queues = ?config.queues.iter().map(|q| q.name.as_str()).collect::<Vec<_>>(),
        daemon = %daemon_id,
        "kmqd started"
    );

    // Run until told to stop, or until a thread ends on its own (a bug: stop rather than run crippled).
    let failure = select! {
        recv(stop) -> _ => None,
        recv(events) -> event => match event {
            Ok(Event::Exited { name, panicked }) => {
                threads.exited(&name);
                let how = if panicked { "panicked" } else { "ended unexpectedly" };
                tracing::error!(thread = %name, "{how}; shutting down");
                Some(DaemonError::ThreadDied { name, how })
            }
            // `threads` holds a sender, so the channel cannot disconnect here.
            Err(_) => None,
        },
    };

    tracing::info!(grace = ?config.daemon.shutdown_grace, "stopping: no new tasks are taken");
    claiming.fire();
    let grace_end = Instant::now() + config.daemon.shutdown_grace;
    let workers_done = threads.wait_for(&events, Role::Worker, grace_end);
    if !workers_done {
        hand_back_running(&queues, &acker_senders);
    }
    drop(acker_senders);
    settling.fire();
    if !threads.wait_for(&events, Role::Acker, Instant::now() + SETTLE_DEADLINE) {
        tracing::error!(
            "outcomes still unsettled after {SETTLE_DEADLINE:?}; safe-mode tasks run again once their leases expire"
        );
    }
    release_owners(&queues, &pool);
    background.fire();
    let background_deadline = Instant::now() + BACKGROUND_DEADLINE;
    threads.wait_for(&events, Role::Other, background_deadline);
    if threads.count(Role::Worker) == 0 {
        registry.shutdown();
    } else {
        tracing::warn!(
            handlers = threads.count(Role::Worker),
            "handlers still running after shutdown_grace ignored their cancel flag; plugin shutdown skipped"
        );
    }
    tracing::info!("kmqd stopped");
    failure.map_or(Ok(()), Err)
}

/// Grace is over: cancels every task still held and, in safe mode, hands it back to the front of its queue.
fn hand_back_running(queues: &[Arc<QueueContext>], ackers: &[Sender<Outcome>]) {
    for (queue, acker) in queues.iter().zip(ackers) {
        for task in queue.inflight.take_unresolved() {
            if queue.config.mode == Mode::Default && task.started {
                tracing::warn!(
                    queue = %queue.config.name,
                    payload = %task.state.payload,
                    "handler still running after shutdown_grace; default mode cannot hand it back, the task is lost"
                );
                // Nothing to settle in Redis: the task left it when it was popped.
                queue.inflight.remove([task.id]);
                continue;
            }
            let state = &task.state;
            let settlement = settlement::handback(state.token.clone(), state.level, &state.payload);
            // try_send: the channel has room for every held task, and shutdown must not wait on a stuck acker.
            if acker
                .try_send(Outcome {
                    job: task.id,
                    settlement,
                    dead_hook: None,
                })
                .is_err()
            {
                tracing::error!(queue = %queue.config.name, "cannot hand a task back; it returns when the lease runs out");
            }
        }
    }
}

/// Forgets this daemon's owners, now that every outcome is settled. An owner that still holds tasks (Redis
/// failed while settling) is kept: its lease runs out and the monitors return its tasks to the queue.
fn release_owners(queues: &[Arc<QueueContext>], pool: &broker::Pool) {
    for queue in queues {
        let Some(owner) = queue.ownership.current() else {
            continue;
        };
        let released = pool
            .get()
            .map_err(BrokerError::from)
            .and_then(|mut connection| {
                broker::release(&mut **connection, &queue.keys, &owner, false)
            });
        match released {
            Ok(true) => tracing::debug!(queue = %queue.config.name, %owner, "owner released"),
            Ok(false) => tracing::warn!(
                queue = %queue.config.name,
                %owner,
                "still holds tasks; they return to the queue when its lease runs out"
            ),
            Err(error) => {
                tracing::error!(queue = %queue.config.name, %owner, %error, "cannot release the owner")
            }
        }
    }
}

fn redact(config: &Config) -> String {
    crate::config::redact_url(&config.redis.url)
}
