//! The supervisor: starts every thread of the daemon, watches them, and runs the shutdown sequence.
//!
//! Per queue a [`lane`] (fetcher, `workers` workers, acker) and a delay poller; per daemon the [`heartbeat`],
//! the [`monitor`], the [`timeouts`] thread, the delay listener, the [`scheduler`] (when there are schedules),
//! the [`metrics`] endpoint and the queue [`report`]er (when configured) and, under systemd, [`notify`] (status
//! lines and the [`watchdog`]). Each thread is named after its module (`kmqd-worker-mail-3`) and reports its end
//! on the event channel, so the supervisor's loop is one `select!` over a closed set of events.
//!
//! Shutdown (docs/OPERATIONS.md, "Stopping"), stage by stage, each wait bounded:
//! 1. *claiming* fires: fetchers stop (what a claim in flight still brings is handed back at once); workers hand
//!    back the jobs they have not started;
//! 2. running handlers get `shutdown_grace` to finish;
//! 3. whatever is still unresolved is taken: handed back (in default mode, a task still running is reported lost);
//!    the supervisor waits for the fetchers (a claim in flight is handed back by its fetcher);
//! 4. the ackers settle what they hold and stop once their lane is drained (at most [`SETTLE_DEADLINE`]);
//! 5. owners are released; *background* fires: heartbeat, monitor, timeouts, delay threads and the rest stop;
//! 6. plugins' `shutdown` runs, only if no thread that may call into a plugin is still alive.

pub mod delay;
pub mod heartbeat;
pub mod lane;
pub mod metrics;
pub mod monitor;
pub mod notify;
pub mod report;
pub mod scheduler;
pub mod settler;
pub mod signals;
pub mod timeouts;
pub mod watchdog;

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, select};

use crate::broker::{self, BrokerError, Connector, Session, access};
use crate::config::Config;
use crate::plugin::Registry;
use crate::queue::QueueContext;
use crate::shutdown::{Listener, Trigger};
use delay::{DelayListener, DelayPoller};
use heartbeat::Heartbeat;
use lane::Lane;
use lane::acker::Acker;
use lane::fetcher::Fetcher;
use lane::worker::Worker;
use metrics::Metrics;
use monitor::{Monitor, Watched};
use scheduler::Scheduler;
use settler::Settler;
use timeouts::Timeouts;

/// How long the ackers get to apply what they hold once every task is resolved.
pub const SETTLE_DEADLINE: Duration = Duration::from_secs(10);
/// How long the background threads get to notice the last phase (their blocking calls time out within ~1 s, or
/// within the heartbeat's read timeout).
pub const BACKGROUND_DEADLINE: Duration = Duration::from_secs(15);
/// How long a fetcher gets, beyond `idle_poll`, to come back from Redis once claiming stopped.
pub const FETCHER_DEADLINE: Duration = Duration::from_secs(11);

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
    #[error(
        "redis refused kmqd's credentials: {0}; check the user and password in [redis] url, password_env or \
         password_file, and that user's ACL rules"
    )]
    Auth(redis::RedisError),
    #[error("{0}")]
    Tls(String),
}

impl DaemonError {
    /// Whether the failure is the config's (wrong credentials, missing ACL rules, keys of another protocol
    /// version): retrying cannot help, so `kmqd` exits 2 rather than 1.
    pub fn is_config_error(&self) -> bool {
        match self {
            DaemonError::Auth(_) | DaemonError::Tls(_) => true,
            DaemonError::Broker(error) => error.is_config_error(),
            _ => false,
        }
    }
}

/// Waits until Redis answers, its ACL user may do all the daemon does on every queue (one check per queue,
/// `broker::access`) and every queue's keys are of this protocol version, however long Redis is down (one log
/// line, then a summary every 30 s); a stop request ends the wait (returns false). Wrong credentials, missing ACL
/// rules and keys of another protocol version end it too, as errors: waiting would not fix them.
fn wait_for_redis(
    config: &Config,
    connector: &Connector,
    stop: &Receiver<()>,
) -> Result<bool, DaemonError> {
    let redis = config.redis.describe();
    crate::retry::name_server(redis.clone());
    let mut trouble = crate::retry::Trouble::new("connecting to Redis at start", None);
    let mut delay = Duration::from_millis(100);
    notify::status(&format!("connecting to Redis at {redis}"));
    // What the status line last said went wrong, so that it is sent again only when that changes.
    let mut shown = String::new();
    loop {
        let checked = connector.connect().and_then(|mut connection| {
            for queue in &config.queues {
                let keys = broker::QueueKeys::for_queue(&config.redis.key_prefix, queue);
                // First, so that a missing ACL rule is reported by name, not as the NOPERM of whatever
                // command happens to come first (or of a script, at the first task that needs it).
                access::check(&mut connection, &keys, access::Action::Serve)?;
                broker::check_protocol(&mut connection, &keys, &queue.name)?;
            }
            Ok(())
        });
        match checked {
            Ok(()) => {
                trouble.recovered();
                return Ok(true);
            }
            Err(BrokerError::Redis(error)) if broker::is_auth_error(&error) => {
                return Err(DaemonError::Auth(error));
            }
            Err(error) if error.is_config_error() => {
                return Err(error.for_user(connector.username()).into());
            }
            Err(error) => {
                if let Some(refusal) = broker::tls_refusal(&error) {
                    return Err(DaemonError::Tls(refusal));
                }
                if let Some(refused) = connector.refusal() {
                    return Err(DaemonError::Auth(refused));
                }
                trouble.failed(&error);
                let text = error.to_string();
                if text != shown {
                    notify::status(&format!("waiting for Redis at {redis}: {text}"));
                    shown = text;
                }
            }
        }
        match stop.recv_timeout(delay) {
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            _ => {
                notify::stopping("stopping before Redis answered");
                return Ok(false);
            }
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// What the supervisor reacts to.
enum Event {
    /// A thread ended (its closure returned or panicked).
    Exited { name: String, panicked: bool },
}

/// What a thread is to the shutdown sequence, which waits for each role in turn.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    Fetcher,
    Worker,
    Acker,
    /// The monitor: it calls plugins' `on_dead`, so plugins are not shut down while it lives.
    Monitor,
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

    fn count(&self, roles: &[Role]) -> usize {
        self.live
            .values()
            .filter(|(role, _)| roles.contains(role))
            .count()
    }

    /// Handles exit events until no thread of `roles` is left or `deadline` passes. Returns whether none is left.
    fn wait_for(&mut self, events: &Receiver<Event>, roles: &[Role], deadline: Instant) -> bool {
        while self.count(roles) > 0 {
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

/// `host:pid`, written into dead-letter records so an operator knows where a task died.
pub fn daemon_id() -> String {
    format!("{}:{}", crate::broker::hostname(), std::process::id())
}

/// Runs the daemon until `stop` receives a message (or is disconnected), then shuts down gracefully.
///
/// The caller owns signal handling: `main` forwards the first SIGTERM/SIGINT here; tests send directly.
pub fn run(
    config: &Config,
    registry: Arc<Registry>,
    stop: Receiver<()>,
) -> Result<(), DaemonError> {
    // Every connection is named `kmqd:HOST:PID:ROLE` (`CLIENT LIST` tells whose it is).
    let client_name = format!("kmqd:{}:{}", broker::hostname(), std::process::id());
    let connector = Arc::new(Connector::new(&config.redis)?.with_client_name(&client_name));
    let pool = broker::named_pool(&config.redis, &client_name)?;
    let named = |role: &str| Session::named(pool.clone(), format!("{client_name}:{role}"));
    if !wait_for_redis(config, &connector, &stop)? {
        tracing::info!("stopped before Redis answered");
        return Ok(());
    }
    let daemon_id = daemon_id();
    let instance = broker::instance_id();
    let (claiming, background) = (Trigger::new(), Trigger::new());
    let (events_tx, events) = crossbeam_channel::unbounded();
    let mut threads = Threads {
        events: events_tx,
        live: HashMap::new(),
    };
    let epoch = Instant::now();

    let contexts: Vec<Arc<QueueContext>> = config
        .queues
        .iter()
        .map(|queue| Arc::new(QueueContext::new(config, queue, &daemon_id)))
        .collect();
    let mut lanes: Vec<Arc<Lane>> = Vec::with_capacity(contexts.len());
    let mut delay_channels = HashMap::new();
    let parts = Parts {
        pool: pool.clone(),
        registry: Arc::clone(&registry),
        instance: instance.clone(),
        epoch,
        claiming: claiming.listener(),
        background: background.listener(),
        client_name: client_name.clone(),
    };
    for queue in &contexts {
        let (lane, nudges) = start_lane(&mut threads, queue, &parts)?;
        delay_channels.insert(queue.keys.delay_channel.clone(), nudges);
        lanes.push(lane);
    }

    let heartbeat = Heartbeat {
        lanes: lanes.clone(),
        connector: Arc::clone(&connector),
        background: background.listener(),
    };
    threads.spawn("kmqd-heartbeat".to_string(), Role::Other, move || {
        heartbeat.run()
    })?;
    let timeouts = Timeouts {
        lanes: lanes.clone(),
        stop: background.listener(),
    };
    threads.spawn("kmqd-timeouts".to_string(), Role::Other, move || {
        timeouts.run()
    })?;
    let monitor = Monitor {
        queues: contexts
            .iter()
            .map(|queue| {
                Watched::new(
                    Arc::clone(queue),
                    Settler::new(format!("{instance}:monitor")),
                )
            })
            .collect(),
        connection: named("monitor"),
        registry: Arc::clone(&registry),
        background: background.listener(),
    };
    threads.spawn("kmqd-monitor".to_string(), Role::Monitor, move || {
        monitor.run()
    })?;
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
                let queue = contexts
                    .iter()
                    .find(|q| q.config.name == schedule.queue)
                    .expect("schedule's queue exists");
                (schedule.clone(), Arc::clone(queue))
            })
            .collect();
        let scheduler = Scheduler::new(schedules, named("scheduler"), background.listener());
        threads.spawn("kmqd-scheduler".to_string(), Role::Other, move || {
            scheduler.run()
        })?;
    }
    if let Some(addr) = config.daemon.metrics_addr {
        let (listener, bound) =
            metrics::bind(addr).map_err(|source| DaemonError::Metrics { addr, source })?;
        let (view, refresher) = metrics::snapshot::refresher(
            contexts.iter().map(|queue| queue.keys.clone()).collect(),
            named("metrics"),
            background.listener(),
        );
        let metrics = Metrics::new(listener, lanes.clone(), view, background.listener())
            .map_err(|source| DaemonError::Metrics { addr, source })?;
        // The bound address, not the configured one: with port 0 this line is how to find the endpoint.
        tracing::info!(addr = %bound, "metrics on http://{bound}/metrics");
        threads.spawn("kmqd-metrics-redis".to_string(), Role::Other, move || {
            refresher.run()
        })?;
        threads.spawn("kmqd-metrics".to_string(), Role::Other, move || {
            metrics.run()
        })?;
    }
    if config.reports() {
        let reporter = report::Reporter::new(
            contexts.clone(),
            named("report"),
            config.daemon.report_interval,
            background.listener(),
        );
        threads.spawn("kmqd-report".to_string(), Role::Other, move || {
            reporter.run()
        })?;
    }

    tracing::info!(
        redis = %config.redis.describe(),
        queues = ?config.queues.iter().map(|q| q.name.as_str()).collect::<Vec<_>>(),
        daemon = %daemon_id,
        "kmqd started"
    );
    // Every lane runs, Redis answered and let this user do all the daemon does: ready (Type=notify).
    notify::ready(&notify::summary(&lanes));
    if notify::enabled() {
        let notifier = notify::Notifier {
            bounds: lanes
                .iter()
                .map(|lane| lane::stall_bounds(&config.redis, &lane.queue.config))
                .collect(),
            lanes: lanes.clone(),
            stop: claiming.listener(),
        };
        threads.spawn("kmqd-notify".to_string(), Role::Other, move || {
            notifier.run()
        })?;
    }

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
    notify::stopping(&format!(
        "stopping: no new tasks are taken; running ones get shutdown_grace ({})",
        humantime::format_duration(config.daemon.shutdown_grace)
    ));
    claiming.fire();
    let stopping_at = Instant::now();
    // After `stopping_at`: a Redis that is slow to answer must not stretch the handlers' grace.
    mark_draining(&lanes, &pool);
    let workers_done = threads.wait_for(
        &events,
        &[Role::Worker],
        stopping_at + config.daemon.shutdown_grace,
    );
    if !workers_done {
        for lane in &lanes {
            lane.hand_back_unresolved();
        }
    }
    // A fetcher still in Redis (a blocked pop, a claim) hands back what it brings itself; the ackers wait for it
    // (a lane is drained only once its fetcher stopped), so nothing it takes is lost.
    let longest_poll = config.queues.iter().map(|q| q.idle_poll).max();
    let fetchers_deadline = stopping_at + longest_poll.unwrap_or_default() + FETCHER_DEADLINE;
    if !threads.wait_for(&events, &[Role::Fetcher], fetchers_deadline) {
        tracing::error!(
            "a fetcher is still waiting for Redis; what it claims returns through its lease"
        );
    }
    if !threads.wait_for(&events, &[Role::Acker], Instant::now() + SETTLE_DEADLINE) {
        tracing::error!(
            "outcomes still unsettled after {SETTLE_DEADLINE:?}; safe-mode tasks run again once their leases expire"
        );
    }
    release_owners(&lanes, &pool);
    background.fire();
    let background_deadline = Instant::now() + BACKGROUND_DEADLINE;
    threads.wait_for(
        &events,
        &[Role::Acker, Role::Monitor, Role::Other],
        background_deadline,
    );
    let handlers = threads.count(&[Role::Worker]);
    let hooks = threads.count(&[Role::Acker, Role::Monitor]);
    if handlers > 0 {
        tracing::warn!(
            handlers,
            "handlers still running after shutdown_grace ignored their cancel flag; plugin shutdown skipped"
        );
    } else if hooks > 0 {
        tracing::warn!(
            threads = hooks,
            "an acker or the monitor is still in a final-failure hook or waiting for Redis; plugin shutdown skipped"
        );
    } else {
        registry.shutdown();
    }
    tracing::info!("kmqd stopped");
    failure.map_or(Ok(()), Err)
}

/// What every lane's threads are made with.
struct Parts {
    pool: broker::Pool,
    registry: Arc<Registry>,
    /// This daemon run's instance id: owners and settling parties are named after it.
    instance: String,
    epoch: Instant,
    claiming: Listener,
    background: Listener,
    /// `kmqd:HOST:PID`, the start of every connection's name.
    client_name: String,
}

impl Parts {
    /// A session whose connections are named `kmqd:HOST:PID:role`.
    fn session(&self, role: &str) -> Session {
        Session::named(self.pool.clone(), format!("{}:{role}", self.client_name))
    }
}

/// Starts one queue's lane (acker, workers, fetcher) and its delay poller; returns the lane and the poller's
/// nudge sender, for the delay listener.
fn start_lane(
    threads: &mut Threads,
    queue: &Arc<QueueContext>,
    parts: &Parts,
) -> Result<(Arc<Lane>, Sender<()>), DaemonError> {
    let name = &queue.config.name;
    let (lane, outcomes) = Lane::new(Arc::clone(queue), &parts.instance, parts.epoch);
    let lane = Arc::new(lane);
    let acker = Acker {
        lane: Arc::clone(&lane),
        registry: Arc::clone(&parts.registry),
        connection: parts.session(&format!("acker-{name}")),
        outcomes,
        settler: Settler::new(format!("{}:acker", parts.instance))
            .with_pulse(lane.acker_pulse.clone()),
        background: parts.background.clone(),
    };
    threads.spawn(format!("kmqd-acker-{name}"), Role::Acker, move || {
        acker.run()
    })?;
    // As many jobs as the lane may hold tasks: a send to a worker never waits for room.
    let (jobs_tx, jobs_rx) =
        crossbeam_channel::bounded(queue.config.workers + queue.config.prefetch);
    for index in 0..queue.config.workers {
        let worker = Worker {
            lane: Arc::clone(&lane),
            registry: Arc::clone(&parts.registry),
            claiming: parts.claiming.clone(),
            jobs: jobs_rx.clone(),
            outcomes: lane.outcome_sender(),
        };
        threads.spawn(
            format!("kmqd-worker-{name}-{index}"),
            Role::Worker,
            move || worker.run(),
        )?;
    }
    let fetcher = Fetcher::new(
        Arc::clone(&lane),
        parts.session(&format!("fetcher-{name}")),
        parts.claiming.clone(),
        jobs_tx,
    );
    threads.spawn(format!("kmqd-fetcher-{name}"), Role::Fetcher, move || {
        fetcher.run()
    })?;
    let (nudge_tx, nudge_rx) = crossbeam_channel::bounded(1);
    let poller = DelayPoller {
        queue: Arc::clone(queue),
        connection: parts.session(&format!("delay-{name}")),
        nudges: nudge_rx,
        background: parts.background.clone(),
    };
    threads.spawn(format!("kmqd-delay-{name}"), Role::Other, move || {
        poller.run()
    })?;
    Ok((lane, nudge_tx))
}

/// Marks this daemon's owners as draining (`kmqd workers` shows it) as its graceful stop begins. Best effort,
/// one try each: a daemon that cannot reach Redis is stopping all the same, and its registration goes when its
/// owner is released.
fn mark_draining(lanes: &[Arc<Lane>], pool: &broker::Pool) {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as i64);
    for lane in lanes {
        let Some(owner) = lane.ownership.current() else {
            continue;
        };
        let marked = pool
            .get()
            .map_err(BrokerError::from)
            .and_then(|mut connection| {
                let result = broker::admin::mark_draining(
                    &mut **connection,
                    &lane.queue.keys,
                    &owner,
                    now_ms,
                );
                if result.is_err() {
                    connection.mark_broken();
                }
                result
            });
        if let Err(error) = marked {
            tracing::debug!(queue = %lane.name(), %owner, %error, "cannot mark the owner draining");
        }
    }
}

/// Forgets this daemon's owners, now that every outcome is settled. An owner that still holds tasks (Redis
/// failed while settling) is kept: its lease runs out and the monitors return its tasks to the queue.
fn release_owners(lanes: &[Arc<Lane>], pool: &broker::Pool) {
    /// A pooled connection may have died in the meantime (a `CLIENT KILL`, an idle timeout): try a fresh one.
    const ATTEMPTS: usize = 3;
    for lane in lanes {
        let Some(owner) = lane.ownership.current() else {
            continue;
        };
        // Forgotten here first, so that the heartbeat neither renews it again nor takes its disappearance for a
        // lost lease.
        lane.ownership.lose(&owner);
        let mut released = Err(BrokerError::Reply {
            what: "release",
            detail: "not tried".to_string(),
        });
        for _ in 0..ATTEMPTS {
            released = pool
                .get()
                .map_err(BrokerError::from)
                .and_then(|mut connection| {
                    let result =
                        broker::release_unique(&mut **connection, &lane.queue.keys, &owner)
                            .and_then(|_| {
                                broker::release(&mut **connection, &lane.queue.keys, &owner, false)
                            });
                    if result.is_err() {
                        connection.mark_broken();
                    }
                    result
                });
            if released.is_ok() {
                break;
            }
        }
        match released {
            Ok(true) => tracing::debug!(queue = %lane.name(), %owner, "owner released"),
            Ok(false) => tracing::warn!(
                queue = %lane.name(),
                %owner,
                "still holds tasks; they return to the queue when its lease runs out"
            ),
            Err(error) => {
                tracing::error!(queue = %lane.name(), %owner, %error, "cannot release the owner; its lease runs out")
            }
        }
    }
}
