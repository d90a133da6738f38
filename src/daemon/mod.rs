//! The supervisor: starts every thread of the daemon, watches them, and runs the shutdown sequence.
//! Its parts are modules beside it: the registry of its threads (`threads`), the wait for Redis at start
//! (`startup`), applying a reload ([`reload`]) and its owners' last steps in Redis (`owners`).
//!
//! Per queue a [`lane`] (fetcher, `workers` workers, acker), a delay poller and, with `source_lists`, a
//! [`sources`] mover; per daemon the [`heartbeat`], the [`monitor`], the [`timeouts`] thread, the delay listener,
//! the [`scheduler`] (when there are schedules), the [`metrics`] endpoint and the queue [`report`]er (when
//! configured) and, under systemd, [`notify`] (status lines and the [`watchdog`]). Each thread is named after its module (`kmqd-worker-mail-3`) and reports its end
//! on the event channel, so the supervisor's loop is one `select!` over a closed set of events.
//!
//! Shutdown (docs/OPERATIONS.md, "Stopping"), stage by stage, each wait bounded:
//! 1. *claiming* fires: fetchers stop (what a claim in flight still brings is handed back at once); workers hand
//!    back the jobs they have not started;
//! 2. running handlers get `shutdown_grace` to finish;
//! 3. whatever is still unresolved is taken: handed back (in default mode, a task still running is reported lost);
//!    the supervisor waits for the fetchers (a claim in flight is handed back by its fetcher);
//! 4. the ackers settle what they hold and stop once their lane is drained (at most [`SETTLE_DEADLINE`]);
//! 5. owners are released, by the `kmqd-owners` thread (a Redis that does not answer holds up that thread, not the
//!    supervisor: `owners`); *background* fires: heartbeat, monitor, timeouts, delay threads, the owners thread and the
//!    rest stop, waited for at most [`BACKGROUND_DEADLINE`];
//! 6. plugins' `shutdown` runs, only if no thread that may call into a plugin is still alive.
//!
//! Reload (SIGHUP; docs/OPERATIONS.md, "Reloading"; what may change live is [`reload`]'s): the new config and its
//! plugins are checked whole first, and a refusal changes nothing. Then the new plugin snapshot is swapped in
//! ([`Plugins`]: tasks starting from then on use it), and a queue whose settings changed gets a new lane at once,
//! while its old lane runs stages 1 and 4 of the shutdown on its own (no deadline, so no task is handed back
//! running, none lost): it claims nothing more, hands back at once what it has not started (and what a claim whose
//! reply was lost took, once adopted: `lane::fetcher`), lets its running tasks finish, settles, retrying through
//! any Redis fault, and once its fetcher and acker ended its owner is released (on the owners thread, while the
//! supervisor goes on) and it leaves the [`LaneSet`] the per-daemon threads read. The threads holding the set of queues (monitor, delay listener, scheduler) start again
//! on the new set. Every thread is known by a serial number and a [`Group`], so a queue's old and new lanes may
//! run side by side under the same thread names, and the end of a group a reload stopped is expected.

pub(crate) mod delay;
pub(crate) mod heartbeat;
pub(crate) mod lane;
pub(crate) mod log_filter;
pub(crate) mod metrics;
pub mod monitor;
pub(crate) mod notify;
mod owners;
pub(crate) mod reload;
pub(crate) mod report;
pub(crate) mod scheduler;
pub(crate) mod signals;
pub(crate) mod sources;
mod startup;
mod threads;
pub(crate) mod timeouts;
pub(crate) mod watchdog;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, select};

use crate::broker::{self, BrokerError, Connector, Session};
use crate::config::{Config, QueueConfig};
use crate::otel::Exporter;
use crate::plugin::{Plugins, Reader, Registry};
use crate::pulse::Pulse;
use crate::queue::QueueContext;
use crate::settler::Settler;
use crate::shutdown::Trigger;
use delay::{DelayListener, DelayPoller};
use heartbeat::Heartbeat;
use lane::acker::Acker;
use lane::fetcher::Fetcher;
use lane::worker::Worker;
use lane::{Lane, LaneSet};
use metrics::Metrics;
use monitor::{Monitor, Watched};
use scheduler::Scheduler;
use sources::SourceMover;
use startup::wait_for_redis;
use threads::{Event, Group, Role, Threads};
use timeouts::Timeouts;

/// How long the ackers get to apply what they hold once every task is resolved.
pub(crate) const SETTLE_DEADLINE: Duration = Duration::from_secs(10);
/// How long the background threads get to notice the last phase (their blocking calls time out within ~1 s, or
/// within the heartbeat's read timeout).
pub(crate) const BACKGROUND_DEADLINE: Duration = Duration::from_secs(15);
/// How long a fetcher gets, beyond `idle_poll`, to come back from Redis once claiming stopped.
pub(crate) const FETCHER_DEADLINE: Duration = Duration::from_secs(11);

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
    #[error(transparent)]
    Otel(#[from] crate::otel::ExporterError),
}

impl DaemonError {
    /// Whether the failure is the config's (wrong credentials, missing ACL rules, keys of another protocol
    /// version): retrying cannot help, so `kmqd` exits 2 rather than 1.
    pub(crate) fn is_config_error(&self) -> bool {
        match self {
            DaemonError::Auth(_) | DaemonError::Tls(_) | DaemonError::Otel(_) => true,
            DaemonError::Broker(error) => error.is_config_error(),
            _ => false,
        }
    }
}

/// `host:pid`, written into dead-letter records so an operator knows where a task died.
pub(crate) fn daemon_id() -> String {
    format!("{}:{}", crate::broker::hostname(), std::process::id())
}

/// Runs the daemon until `stop` receives a message (or is disconnected), then shuts down gracefully; without
/// reloads (the tests' and the benchmarks' entry point).
pub fn run(
    config: &Config,
    registry: Arc<Registry>,
    stop: Receiver<()>,
) -> Result<(), DaemonError> {
    serve(
        config,
        Plugins::new(registry),
        stop,
        crossbeam_channel::never(),
    )
}

/// Runs the daemon until `stop` receives a message (or is disconnected), then shuts down gracefully; each
/// message on `reload` re-reads the config file ([`reload`], docs/OPERATIONS.md "Reloading").
///
/// The caller owns signal handling: `main` forwards the first SIGTERM/SIGINT to `stop` and SIGHUP to `reload`.
pub(crate) fn serve(
    config: &Config,
    plugins: Arc<Plugins>,
    stop: Receiver<()>,
    reload: Receiver<()>,
) -> Result<(), DaemonError> {
    // Every connection is named `kmqd:HOST:PID:ROLE` (`CLIENT LIST` tells whose it is).
    let client_name = format!("kmqd:{}:{}", broker::hostname(), std::process::id());
    let connector = Arc::new(Connector::new(&config.redis)?.with_client_name(&client_name));
    let pool = broker::named_pool(&config.redis, &client_name)?;
    if !wait_for_redis(config, &connector, &stop)? {
        tracing::info!("stopped before Redis answered");
        return Ok(());
    }
    for queue in &config.queues {
        startup::warn_of_stranded_levels(&connector, &config.redis.key_prefix, queue);
    }
    // Started once for the daemon run (a reload keeps it: docs/CONFIG.md), before the lanes whose runs it traces.
    let otel = match &config.daemon.otlp_endpoint {
        Some(endpoint) => {
            let exporter = Arc::new(Exporter::start(endpoint)?);
            tracing::info!(endpoint = %endpoint, "exporting a span per run over OTLP");
            Some(exporter)
        }
        None => None,
    };
    let (events_tx, events) = crossbeam_channel::unbounded();
    let mut supervisor = Supervisor {
        config: config.clone(),
        threads: Threads {
            events: events_tx,
            live: HashMap::new(),
            next_id: 0,
        },
        parts: Parts {
            pool,
            plugins,
            instance: broker::instance_id(),
            epoch: Instant::now(),
            claiming: Trigger::new(),
            background: Trigger::new(),
            client_name,
            daemon_id: daemon_id(),
            otel: otel.clone(),
        },
        connector,
        lanes: LaneSet::new(Vec::new()),
        serving: Vec::new(),
        helpers: None,
        thread_pulses: Arc::default(),
        stopping: HashSet::new(),
        next_group: 0,
        owners: None,
    };
    let result = supervisor.run(&stop, &reload, &events);
    supervisor.shut_down(&events);
    // Every lane has settled: the last spans are queued, and go out now (bounded by the exporter's own wait).
    if let Some(otel) = otel {
        otel.shut_down();
    }
    result.map_or(Ok(()), Err)
}

/// What every lane's threads are made with.
struct Parts {
    pool: broker::Pool,
    plugins: Arc<Plugins>,
    /// This daemon run's instance id: owners and settling parties are named after it.
    instance: String,
    epoch: Instant,
    /// Fires when the shutdown begins (every lane's own claiming trigger fires with it).
    claiming: Trigger,
    /// Fires last, for the per-daemon threads (and each group's own trigger with it).
    background: Trigger,
    /// `kmqd:HOST:PID`, the start of every connection's name.
    client_name: String,
    daemon_id: String,
    /// The span exporter (`[daemon] otlp_endpoint`), handed to every queue's context; shut down after the lanes.
    otel: Option<Arc<Exporter>>,
}

impl Parts {
    /// A session whose connections are named `kmqd:HOST:PID:role`.
    fn session(&self, role: &str) -> Session {
        Session::named(self.pool.clone(), format!("{}:{role}", self.client_name))
    }
}

/// One lane as the supervisor runs it.
struct Serving {
    lane: Arc<Lane>,
    group: Group,
    /// Stops the lane's fetcher and workers (a reload that replaces or removes it, or the shutdown).
    claiming: Trigger,
    /// Stops its delay poller.
    stop: Trigger,
    /// The delay poller's nudges, for the delay listener.
    nudges: Sender<()>,
    /// A reload stopped it: it finishes its running tasks, settles, and goes.
    retiring: bool,
}

/// The per-daemon threads that hold the set of queues, started again by a reload that changes it: the monitor,
/// the delay listener, the scheduler, the queue reporter. Two of each may run side by side for a moment, which is safe: two monitors
/// never both recover a task, a schedule's slot fires once (fire.lua), and a nudge is only a nudge.
struct Helpers {
    group: Group,
    stop: Trigger,
}

struct Supervisor {
    /// The config the daemon runs on (a reload's, with what cannot change live kept from the start).
    config: Config,
    threads: Threads,
    parts: Parts,
    connector: Arc<Connector>,
    lanes: Arc<LaneSet>,
    serving: Vec<Serving>,
    helpers: Option<Helpers>,
    /// What the watchdog watches of the helpers now running.
    thread_pulses: Arc<watchdog::ThreadPulses>,
    /// Groups a reload stopped: their threads' ends are expected.
    stopping: HashSet<Group>,
    next_group: Group,
    /// The `kmqd-owners` thread's requests (`owners`: the owners' Redis bookkeeping, off the supervisor's thread).
    /// Set once `start` spawned it; dropped by the shutdown after its last request, which ends the thread.
    owners: Option<Sender<owners::Request>>,
}

impl Supervisor {
    /// Starts everything, then serves until `stop` (returns `None`) or a thread's unexpected end (its error).
    fn run(
        &mut self,
        stop: &Receiver<()>,
        reload: &Receiver<()>,
        events: &Receiver<Event>,
    ) -> Option<DaemonError> {
        if let Err(error) = self.start() {
            return Some(error);
        }
        tracing::info!(
            redis = %self.config.redis.describe(),
            queues = ?self.config.queues.iter().map(|q| q.name.as_str()).collect::<Vec<_>>(),
            daemon = %self.parts.daemon_id,
            "kmqd started"
        );
        // Every lane runs, Redis answered and let this user do all the daemon does: ready (Type=notify).
        notify::ready(&notify::summary(&self.lanes.snapshot()));
        // Run until told to stop, or until a thread ends on its own (a bug: stop rather than run crippled).
        loop {
            select! {
                recv(stop) -> _ => return None,
                recv(reload) -> message => {
                    if message.is_ok() {
                        self.reload();
                    }
                }
                recv(events) -> event => {
                    // `threads` holds a sender, so the channel cannot disconnect here.
                    let Ok(Event::Exited { id, panicked }) = event else { continue };
                    if let Some(error) = self.exited(id, panicked) {
                        return Some(error);
                    }
                }
            }
        }
    }

    /// Starts every lane and the per-daemon threads.
    fn start(&mut self) -> Result<(), DaemonError> {
        let (requests_tx, requests) = crossbeam_channel::unbounded();
        let session = self.parts.session("owners");
        self.threads
            .spawn("kmqd-owners".to_string(), Role::Other, 0, move || {
                owners::serve(&requests, session)
            })?;
        self.owners = Some(requests_tx);
        for queue in self.config.queues.clone() {
            self.start_lane(&queue)?;
        }
        let heartbeat_pulse = Pulse::default();
        let heartbeat = Heartbeat {
            lanes: Arc::clone(&self.lanes),
            connector: Arc::clone(&self.connector),
            pulse: heartbeat_pulse.clone(),
            background: self.parts.background.listener(),
        };
        self.threads
            .spawn("kmqd-heartbeat".to_string(), Role::Other, 0, move || {
                heartbeat.run()
            })?;
        let timeouts = Timeouts {
            lanes: Arc::clone(&self.lanes),
            stop: self.parts.background.listener(),
        };
        self.threads
            .spawn("kmqd-timeouts".to_string(), Role::Other, 0, move || {
                timeouts.run()
            })?;
        self.start_helpers()?;
        if let Some(addr) = self.config.daemon.metrics_addr {
            let (listener, bound) =
                metrics::bind(addr).map_err(|source| DaemonError::Metrics { addr, source })?;
            let (view, refresher) = metrics::snapshot::refresher(
                Arc::clone(&self.lanes),
                self.parts.session("metrics"),
                self.parts.background.listener(),
            );
            let metrics = Metrics::new(
                listener,
                Arc::clone(&self.lanes),
                view,
                self.parts.background.listener(),
            )
            .map_err(|source| DaemonError::Metrics { addr, source })?;
            // The bound address, not the configured one: with port 0 this line is how to find the endpoint.
            tracing::info!(addr = %bound, "metrics on http://{bound}/metrics");
            self.threads.spawn(
                "kmqd-metrics-redis".to_string(),
                Role::Other,
                0,
                move || refresher.run(),
            )?;
            self.threads
                .spawn("kmqd-metrics".to_string(), Role::Other, 0, move || {
                    metrics.run()
                })?;
        }
        if notify::enabled() {
            let notifier = notify::Notifier {
                lanes: Arc::clone(&self.lanes),
                heartbeat: heartbeat_pulse,
                helpers: Arc::clone(&self.thread_pulses),
                redis: self.config.redis.clone(),
                stop: self.parts.claiming.listener(),
            };
            self.threads
                .spawn("kmqd-notify".to_string(), Role::Other, 0, move || {
                    notifier.run()
                })?;
        }
        Ok(())
    }

    fn new_group(&mut self) -> Group {
        self.next_group += 1;
        self.next_group
    }

    /// Starts one queue's lane (acker, workers, fetcher) and its delay poller. The lanes started with the daemon
    /// have the names a daemon without reloads always had; a reload's lanes add their group to their owner and
    /// settler identities, which must never be used twice in this daemon run (a queue's old lane may still
    /// finish beside its new one, and a queue removed and added again must not reuse an owner id).
    fn start_lane(&mut self, queue: &QueueConfig) -> Result<(), DaemonError> {
        let group = self.new_group();
        let parts = &self.parts;
        let context = Arc::new(
            QueueContext::new(&self.config, queue, &parts.daemon_id).traced(parts.otel.clone()),
        );
        // The helpers start after the first lanes: none yet means the daemon is starting.
        let at_start = self.helpers.is_none();
        let instance = if at_start {
            parts.instance.clone()
        } else {
            format!("{}-r{group}", parts.instance)
        };
        let name = &queue.name;
        let lane = Arc::new(Lane::new(Arc::clone(&context), &instance, parts.epoch));
        let (claiming, stop) = (Trigger::new(), Trigger::new());
        let (jobs_tx, mut jobs_rx) = lane::jobs::queue(queue.workers);
        let acker = Acker::new(
            Arc::clone(&lane),
            Arc::clone(&parts.plugins),
            parts.session(&format!("acker-{name}")),
            Settler::new(format!("{instance}:acker")).with_pulse(lane.acker_pulse.clone()),
            parts.background.listener(),
            claiming.listener(),
            jobs_tx.also(),
        );
        self.threads.spawn(
            format!("kmqd-acker-{name}"),
            Role::Acker,
            group,
            move || acker.run(),
        )?;
        for index in 0..queue.workers {
            let worker = Worker {
                lane: Arc::clone(&lane),
                plugins: Reader::new(Arc::clone(&parts.plugins)),
                claiming: claiming.listener(),
                jobs: jobs_rx.pop().expect("a receiver per worker"),
            };
            self.threads.spawn(
                format!("kmqd-worker-{name}-{index}"),
                Role::Worker,
                group,
                move || worker.run(),
            )?;
        }
        let fetcher = Fetcher::new(
            Arc::clone(&lane),
            parts.session(&format!("fetcher-{name}")),
            claiming.listener(),
            parts.claiming.listener(),
            jobs_tx,
        );
        self.threads.spawn(
            format!("kmqd-fetcher-{name}"),
            Role::Fetcher,
            group,
            move || fetcher.run(),
        )?;
        if !queue.source_lists.is_empty() {
            let mover = SourceMover {
                queue: Arc::clone(&context),
                session: parts.session(&format!("sources-{name}")),
                pulse: lane.sources_pulse.clone(),
                // Moving is not taking: a pause goes on moving; a reload that replaces the lane, and the
                // shutdown, stop it with the lane's claiming.
                stop: claiming.listener(),
            };
            self.threads.spawn(
                format!("kmqd-sources-{name}"),
                Role::Other,
                group,
                move || mover.run(),
            )?;
        }
        let (nudges, nudge_rx) = crossbeam_channel::bounded(1);
        let poller = DelayPoller {
            queue: context,
            session: parts.session(&format!("delay-{name}")),
            nudges: nudge_rx,
            pulse: lane.delay_pulse.clone(),
            background: stop.listener(),
        };
        self.threads.spawn(
            format!("kmqd-delay-{name}"),
            Role::Other,
            group,
            move || poller.run(),
        )?;
        self.lanes.add(Arc::clone(&lane));
        self.serving.push(Serving {
            lane,
            group,
            claiming,
            stop,
            nudges,
            retiring: false,
        });
        Ok(())
    }

    /// Starts the monitor, the delay listener and the scheduler on the lanes now served, and stops the ones a
    /// previous call started.
    fn start_helpers(&mut self) -> Result<(), DaemonError> {
        let first = self.helpers.is_none();
        if let Some(old) = self.helpers.take() {
            old.stop.fire();
            self.stopping.insert(old.group);
        }
        let group = self.new_group();
        let stop = Trigger::new();
        let serving: Vec<&Serving> = self.serving.iter().filter(|s| !s.retiring).collect();
        let contexts: Vec<Arc<QueueContext>> =
            serving.iter().map(|s| Arc::clone(&s.lane.queue)).collect();
        let instance = &self.parts.instance;
        // The first monitor's settling identity is the one a daemon without reloads always had.
        let settler = if first {
            format!("{instance}:monitor")
        } else {
            format!("{instance}:monitor-r{group}")
        };
        // Fresh pulses for the threads started here, watched from now on in place of the previous set.
        let redis = &self.config.redis;
        let monitor_pulse = Pulse::default();
        let listener_pulse = Pulse::default();
        let scheduler_pulse = Pulse::default();
        let monitor = Monitor {
            queues: contexts
                .iter()
                .map(|queue| {
                    let settler = Settler::new(settler.clone()).with_pulse(monitor_pulse.clone());
                    Watched::new(Arc::clone(queue), settler)
                })
                .collect(),
            session: self.parts.session("monitor"),
            pulse: monitor_pulse.clone(),
            plugins: Arc::clone(&self.parts.plugins),
            background: stop.listener(),
        };
        let mut watched = vec![
            (
                "monitor",
                monitor_pulse,
                monitor::stall_bound(redis, Monitor::interval(&monitor.queues)),
            ),
            (
                "delay listener",
                listener_pulse.clone(),
                delay::listener_stall_bound(redis),
            ),
        ];
        self.threads.spawn(
            "kmqd-monitor".to_string(),
            Role::Monitor,
            group,
            move || monitor.run(),
        )?;
        let listener = DelayListener {
            connector: Arc::clone(&self.connector),
            pollers: serving
                .iter()
                .map(|s| (s.lane.queue.keys.delay_channel.clone(), s.nudges.clone()))
                .collect(),
            pulse: listener_pulse,
            background: stop.listener(),
        };
        self.threads.spawn(
            "kmqd-delay-listener".to_string(),
            Role::Other,
            group,
            move || listener.run(),
        )?;
        if !self.config.schedules.is_empty() {
            let schedules = self
                .config
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
            watched.push((
                "scheduler",
                scheduler_pulse.clone(),
                scheduler::stall_bound(redis),
            ));
            let scheduler = Scheduler::new(
                schedules,
                self.parts.session("scheduler"),
                scheduler_pulse,
                stop.listener(),
            );
            self.threads.spawn(
                "kmqd-scheduler".to_string(),
                Role::Other,
                group,
                move || scheduler.run(),
            )?;
        }
        if self.config.reports() {
            let reporter = report::Reporter::new(
                contexts.clone(),
                self.parts.session("report"),
                self.config.daemon.report_interval,
                stop.listener(),
            );
            self.threads
                .spawn("kmqd-report".to_string(), Role::Other, group, move || {
                    reporter.run()
                })?;
        }
        self.thread_pulses.replace(watched);
        self.helpers = Some(Helpers { group, stop });
        Ok(())
    }

    /// A thread ended while the daemon serves: expected when a reload stopped its group (a replaced lane that
    /// has settled everything then releases its owner), an error otherwise.
    fn exited(&mut self, id: u64, panicked: bool) -> Option<DaemonError> {
        let (name, group) = self.threads.exited(id)?;
        if !self.stopping.contains(&group) {
            let how = if panicked {
                "panicked"
            } else {
                "ended unexpectedly"
            };
            tracing::error!(thread = %name, "{how}; shutting down");
            return Some(DaemonError::ThreadDied { name, how });
        }
        if panicked {
            tracing::error!(thread = %name, "panicked while a reload stopped it");
        }
        let Some(index) = self.serving.iter().position(|s| s.group == group) else {
            // Every thread of the group, a replaced lane's workers too: one stuck in a handler may return, and
            // end, long after its lane went.
            if !self.threads.any_in(group) {
                self.stopping.remove(&group);
            }
            return None;
        };
        // A lane is done once its fetcher stopped and its acker settled all it held (workers stuck in a handler
        // may live on: they hold nothing).
        if self.threads.count_in(group, &[Role::Fetcher, Role::Acker]) == 0 {
            let serving = self.serving.remove(index);
            // A reload that dropped one of its levels: whatever the old lane handed back or queued for retry
            // there is in Redis now, with what was waiting there before.
            let stranded = self
                .config
                .queue(serving.lane.name())
                .filter(|queue| {
                    let old = &serving.lane.queue.config.priorities;
                    old.iter().any(|level| !queue.priorities.contains(level))
                })
                .cloned();
            let (lanes, connector) = (Arc::clone(&self.lanes), Arc::clone(&self.connector));
            let prefix = self.config.redis.key_prefix.clone();
            // Its delay poller stops now: it does not wait for the release, which Redis may hold up.
            serving.stop.fire();
            let lane = serving.lane;
            // After the release, on the owners thread: the lane leaves the set the per-daemon threads read.
            let then = {
                let lane = Arc::clone(&lane);
                move || {
                    lanes.remove(&lane);
                    tracing::info!(queue = %lane.name(), "the replaced lane settled everything and stopped");
                    if let Some(queue) = stranded {
                        startup::warn_of_stranded_levels(&connector, &prefix, &queue);
                    }
                }
            };
            self.ask_owners(owners::Request::Release {
                lanes: vec![lane],
                then: Box::new(then),
            });
        }
        None
    }

    /// Hands `request` to the `kmqd-owners` thread, or does it here if that thread is not running (a start that
    /// failed before spawning it, or the shutdown's last request already sent).
    fn ask_owners(&mut self, request: owners::Request) {
        let request = match &self.owners {
            Some(owners) => match owners.send(request) {
                Ok(()) => return,
                Err(crossbeam_channel::SendError(request)) => request,
            },
            None => request,
        };
        owners::handle(request, &mut self.parts.session("owners"));
    }

    /// The staged shutdown (the module's doc), over every lane, replaced ones still finishing included.
    fn shut_down(&mut self, events: &Receiver<Event>) {
        let grace = self.config.daemon.shutdown_grace;
        tracing::info!(?grace, "stopping: no new tasks are taken");
        notify::stopping(&format!(
            "stopping: no new tasks are taken; running ones get shutdown_grace ({})",
            humantime::format_duration(grace)
        ));
        self.parts.claiming.fire();
        for serving in &self.serving {
            serving.claiming.fire();
        }
        let lanes: Vec<Arc<Lane>> = self.serving.iter().map(|s| Arc::clone(&s.lane)).collect();
        let stopping_at = Instant::now();
        // After `stopping_at`: a Redis that is slow to answer must not stretch the handlers' grace. On the owners
        // thread, which marks them while the workers finish.
        self.ask_owners(owners::Request::Drain(lanes.clone()));
        let threads = &mut self.threads;
        let workers_done = threads.wait_for(events, &[Role::Worker], stopping_at + grace);
        if !workers_done {
            for lane in &lanes {
                lane.hand_back_unresolved();
            }
        }
        // A fetcher still in Redis (a blocked pop, a claim) hands back what it brings itself; the ackers wait for
        // it (a lane is drained only once its fetcher stopped), so nothing it takes is lost.
        let longest_poll = lanes.iter().map(|l| l.queue.config.idle_poll).max();
        let fetchers_deadline = stopping_at + longest_poll.unwrap_or_default() + FETCHER_DEADLINE;
        if !threads.wait_for(events, &[Role::Fetcher], fetchers_deadline) {
            tracing::error!(
                "a fetcher is still waiting for Redis; what it claims returns through its lease"
            );
        }
        if !threads.wait_for(events, &[Role::Acker], Instant::now() + SETTLE_DEADLINE) {
            tracing::error!(
                "outcomes still unsettled after {SETTLE_DEADLINE:?}; safe-mode tasks run again once their leases expire"
            );
        }
        // The stop's last request to the owners thread, whose sender is then dropped: the thread ends once it is
        // done, which the wait for the background threads below bounds (`BACKGROUND_DEADLINE`), however many lanes
        // there are and however long Redis takes to answer.
        self.ask_owners(owners::Request::Release {
            lanes,
            then: Box::new(|| {}),
        });
        self.owners = None;
        let threads = &mut self.threads;
        self.parts.background.fire();
        for serving in &self.serving {
            serving.stop.fire();
        }
        if let Some(helpers) = &self.helpers {
            helpers.stop.fire();
        }
        let background_deadline = Instant::now() + BACKGROUND_DEADLINE;
        threads.wait_for(
            events,
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
            self.parts.plugins.current().shutdown();
        }
        tracing::info!("kmqd stopped");
    }
}
