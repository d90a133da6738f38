//! What the threads share ([`World`]): the daemons and their supervisor, the events that may explain a task run
//! again, the counters, the violations and the timeline.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::support::*;

use super::check::LimitWatch;
use super::faults::Kind;
use super::groups::GroupWatch;
use super::ledger::{Facts, Ledger, Tail};
use super::slowloris::metrics_addr;
use super::types::TypedWatch;
use super::workload::{DAEMON_SERVING, DAEMONS, Mode, Queue, Shape, TYPES};

/// Slack when comparing the test's clock readings with the testkit's (the same clock, read by two processes).
pub(super) const SLACK_US: u64 = 100_000;

/// `us` as seconds since `t0_us`, as the timeline prints times.
pub(super) fn rel(t0_us: u64, us: u64) -> String {
    format!("+{:.2}s", us.saturating_sub(t0_us) as f64 / 1e6)
}

pub(super) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_micros() as u64
}

/// Sends `signal` (a name: STOP, CONT, TERM) to `pid` through kill(1); false when it failed (the process is gone).
pub(super) fn send_signal(pid: u32, signal: &str) -> bool {
    Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|status| status.success())
}

/// Something that may make a task run again at the same attempt number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum What {
    /// A fault the test injected.
    Fault(Kind),
    /// A daemon process exited by itself (a poison pill aborted it).
    Crashed,
    /// A daemon logged that its lease ran out or was lost (a zombie waking up, or a lease lost to Redis's data
    /// loss, a stall or a step of its clock; also a daemon starved of CPU longer than its lease on a loaded
    /// machine), or that it gave its owner up because Redis lost writes it had acknowledged (a rewind).
    LeaseLost,
    /// A daemon was stopped with SIGTERM (the end of the run): tasks still running after `shutdown_grace` are
    /// handed back.
    Stopped,
}

#[derive(Clone, Debug)]
pub(super) struct Event {
    pub(super) what: What,
    /// The daemon process it hit; `None` for Redis-wide events.
    pub(super) instance: Option<usize>,
    pub(super) from_us: u64,
    pub(super) to_us: u64,
    pub(super) note: String,
}

impl Event {
    pub(super) fn label(&self) -> &'static str {
        match self.what {
            What::Fault(kind) => kind.label(),
            What::Crashed => "crash (pill)",
            What::LeaseLost => "lease lost (logged)",
            What::Stopped => "graceful stop",
        }
    }

    /// Whether this event can explain that a run of a task of a queue in `mode` on `instance` that started at
    /// `first_us` was run again at the same attempt number at `again_us`.
    ///
    /// In safe mode kmqd hands a task back uncharged only when the daemon holding it lost it (killed, crashed,
    /// paused past its lease, stopped past its grace, its lease lost to Redis: a restart, a stall, a rewind, a loss
    /// of everything, a forward step of Redis's clock). In default mode a popped task is only in its daemon's
    /// memory, and runs at most once whatever happens to that daemon: only Redis losing its writes brings it back,
    /// rewound (at most once holds only while Redis keeps its writes), or pushed again by the outbox after Redis
    /// came back empty.
    pub(super) fn explains(
        &self,
        mode: Mode,
        instance: usize,
        first_us: u64,
        again_us: u64,
    ) -> bool {
        let overlaps = self.from_us <= again_us + SLACK_US && self.to_us + SLACK_US >= first_us;
        let lost_writes = matches!(self.what, What::Fault(Kind::RedisEmpty | Kind::RedisRewind));
        let redis_wide = matches!(self.what, What::Fault(kind) if kind.is_redis_wide());
        let this_daemon = self.instance == Some(instance)
            && matches!(
                self.what,
                What::Fault(Kind::Kill9 | Kind::Zombie | Kind::RollingConfig)
                    | What::Crashed
                    | What::LeaseLost
                    | What::Stopped
            );
        overlaps
            && match mode {
                Mode::Safe => redis_wide || this_daemon,
                Mode::Default => lost_writes,
            }
    }
}

/// One daemon position: systemd's unit, as it were. Its process changes with every restart.
pub(super) struct Slot {
    pub(super) shape: Shape,
    pub(super) process: Option<Process>,
    /// The current (or last) process's index in `Daemons::instances`.
    pub(super) instance: usize,
    /// The fault loop is handling this slot (a zombie, a config change): the supervisor leaves it alone.
    pub(super) held: bool,
    /// When the supervisor is to start it again (after a kill or a crash).
    pub(super) restart_at: Option<Instant>,
}

/// One daemon process.
pub(super) struct Instance {
    pub(super) slot: usize,
    pub(super) shape: Shape,
    pub(super) log: PathBuf,
}

pub(super) struct Daemons {
    pub(super) slots: Vec<Slot>,
    pub(super) instances: Vec<Instance>,
}

/// Everything the threads share.
pub(super) struct World<'a> {
    pub(super) dir: &'a TestDir,
    pub(super) t0: Instant,
    pub(super) t0_us: u64,
    /// The `[redis]` section of the daemons and the producer: through the proxy.
    pub(super) redis_section: String,
    pub(super) daemons: Mutex<Daemons>,
    pub(super) events: Mutex<Vec<Event>>,
    pub(super) ledger: Mutex<Ledger>,
    /// Pushes hold it shared; a Redis emptied under the producer holds it exclusively, so that no push straddles
    /// the loss (a real outbox would know which pushes were lost; this one knows there were none in flight).
    pub(super) gate: RwLock<()>,
    pub(super) epoch: AtomicU32,
    pub(super) producing: AtomicBool,
    pub(super) running: AtomicBool,
    pub(super) violations: Mutex<Vec<String>>,
    /// When Redis's `done` counter was seen to grow (µs), sampled every 20 ms on a direct connection.
    pub(super) completions: Mutex<Vec<u64>>,
    /// What the samples and snapshots of the limited queue's count saw.
    pub(super) watch: Mutex<LimitWatch>,
    /// What the samples and snapshots of the typed queue's limits per type saw.
    pub(super) typed: Mutex<TypedWatch>,
    /// What the samples and snapshots of the grouped queue's groups saw.
    pub(super) grouped: Mutex<GroupWatch>,
    /// Counts by name: each fault kind's label, and what the faults and checks count besides.
    pub(super) counters: Mutex<BTreeMap<String, u64>>,
    pub(super) tails: Mutex<(Vec<Tail>, Facts)>,
    /// Dead-lettered ids and their reasons, from every dead list read (before each loss of Redis's data, and at
    /// the end).
    pub(super) dead_seen: Mutex<HashMap<String, String>>,
    /// The flows pushed ([`super::flows`]).
    pub(super) flows: Mutex<super::flows::FlowBook>,
    pub(super) timeline: Mutex<Vec<String>>,
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A thread that panicked already failed the test; what it guarded is still worth reporting.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl World<'_> {
    pub(super) fn at(&self) -> String {
        format!("+{:7.2}s", self.t0.elapsed().as_secs_f64())
    }

    pub(super) fn rel(&self, us: u64) -> String {
        rel(self.t0_us, us)
    }

    pub(super) fn say(&self, message: &str) {
        let line = format!("chaos {}: {message}", self.at());
        eprintln!("{line}");
        lock(&self.timeline).push(line);
    }

    /// A line for the timeline file only.
    pub(super) fn note(&self, message: String) {
        lock(&self.timeline).push(message);
    }

    pub(super) fn violation(&self, message: String) {
        self.say(&format!("VIOLATION: {message}"));
        lock(&self.violations).push(message);
    }

    /// The violations one end-of-run check found, each prefixed with `check`: the first `shown` one by one, the
    /// rest as one line counting them ("{check}: N more {rest}"), so that a broken invariant does not bury the
    /// timeline.
    pub(super) fn violations(&self, check: &str, messages: Vec<String>, shown: usize, rest: &str) {
        let total = messages.len();
        for message in messages.into_iter().take(shown) {
            self.violation(format!("{check}: {message}"));
        }
        if total > shown {
            self.violation(format!("{check}: {} more {rest}", total - shown));
        }
    }

    pub(super) fn count(&self, name: &str) {
        self.add(name, 1);
    }

    pub(super) fn add(&self, name: &str, n: u64) {
        *lock(&self.counters).entry(name.to_string()).or_default() += n;
    }

    pub(super) fn counter(&self, name: &str) -> u64 {
        lock(&self.counters).get(name).copied().unwrap_or(0)
    }

    /// Records an event from `from_us` to now.
    pub(super) fn event(&self, what: What, instance: Option<usize>, from_us: u64, note: String) {
        self.event_until(what, instance, (from_us, now_us()), note);
    }

    /// Records an event whose effects last from `from_us` to `to_us`.
    pub(super) fn event_until(
        &self,
        what: What,
        instance: Option<usize>,
        (from_us, to_us): (u64, u64),
        note: String,
    ) {
        lock(&self.events).push(Event {
            what,
            instance,
            from_us,
            to_us,
            note,
        });
    }

    /// Starts the slot's daemon on its shape: a new process, config file, record file and log.
    pub(super) fn start_daemon(&self, daemons: &mut Daemons, slot: usize, why: &str) {
        let n = daemons.instances.len();
        let shape = daemons.slots[slot].shape;
        let record = self.dir.path(&format!("runs-{n}.log"));
        let log = self.dir.path(&format!("kmqd-{n}-d{slot}-{shape:?}.log"));
        let config = self.dir.config_named(
            &format!("kmqd-{n}-{shape:?}.toml"),
            &self.redis_section,
            DAEMON_SERVING,
            &shape.queue(),
            &record,
        );
        self.dir.testkit_types_recording(&config, &record, &TYPES);
        // Each `end` line with its time: the unique_for check needs when each run ended.
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(
            &config,
            text.replace("types = [", "end_times = true, types = ["),
        )
        .unwrap();
        let process = Process::start_with_env(&config, log.clone(), &[("RUST_BACKTRACE", "0")]);
        lock(&self.tails).0.push(Tail {
            path: record,
            instance: n,
            offset: 0,
            partial: String::new(),
        });
        daemons.instances.push(Instance { slot, shape, log });
        let s = &mut daemons.slots[slot];
        s.process = Some(process);
        s.instance = n;
        s.restart_at = None;
        self.say(&format!(
            "daemon {slot} started as process #{n} on config {shape:?} ({why})"
        ));
    }
}

impl World<'_> {
    /// How many tasks of `queue` the running daemons hold (claimed or popped, running or being settled), from each
    /// one's metrics endpoint (`kmqd_daemon_held_tasks`); `None` when one of them did not answer.
    pub(super) fn held_by_daemons(&self, queue: Queue) -> Option<u64> {
        let logs: Vec<PathBuf> = {
            let daemons = lock(&self.daemons);
            daemons
                .slots
                .iter()
                .filter(|slot| slot.process.is_some())
                .map(|slot| daemons.instances[slot.instance].log.clone())
                .collect()
        };
        let gauge = format!("kmqd_daemon_held_tasks{{queue=\"{}\"}} ", queue.name());
        let mut held = 0;
        for log in logs {
            let addr = metrics_addr(&std::fs::read_to_string(log).unwrap_or_default())?;
            let page = scrape_with(addr, None, Duration::from_secs(2));
            held += page
                .body
                .lines()
                .find_map(|line| line.strip_prefix(&gauge)?.trim().parse::<u64>().ok())?;
        }
        Some(held)
    }
}

/// Sets every stop flag when dropped, so that a panicking fault loop does not leave the scoped threads running.
pub(super) struct StopOnDrop<'a, 'b>(pub(super) &'a World<'b>);

impl Drop for StopOnDrop<'_, '_> {
    fn drop(&mut self) {
        self.0.producing.store(false, Ordering::SeqCst);
        self.0.running.store(false, Ordering::SeqCst);
    }
}

/// Starts again every daemon process that exited, as systemd would (`Restart=always`), and logs it.
pub(super) fn supervise(world: &World<'_>) {
    while world.running.load(Ordering::SeqCst) {
        {
            let mut daemons = lock(&world.daemons);
            for slot in 0..DAEMONS {
                if daemons.slots[slot].held {
                    continue;
                }
                let instance = daemons.slots[slot].instance;
                let exited = daemons.slots[slot]
                    .process
                    .as_mut()
                    .and_then(|process| process.child.try_wait().ok().flatten());
                if let Some(status) = exited {
                    let log = daemons.slots[slot].process.take().unwrap().log_text();
                    world.event(What::Crashed, Some(instance), now_us(), format!("{status}"));
                    world.count("crashes");
                    if status.signal() == Some(6) {
                        world.say(&format!(
                            "daemon {slot} (process #{instance}) aborted (SIGABRT: a poison pill)"
                        ));
                    } else {
                        let tail: Vec<&str> = log.lines().rev().take(20).collect();
                        world.violation(format!(
                            "daemon {slot} (process #{instance}) exited by itself with {status}; its log ends:\n{}",
                            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                        ));
                    }
                    daemons.slots[slot].restart_at = Some(Instant::now());
                }
                let due = daemons.slots[slot]
                    .restart_at
                    .is_some_and(|at| Instant::now() >= at);
                if daemons.slots[slot].process.is_none() && due {
                    world.count("restarts");
                    world.start_daemon(&mut daemons, slot, "supervisor restart");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Waits at most `within` for `process` to exit: its status, or `None` if it still runs.
pub(super) fn wait_exit(process: &mut Process, within: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(Some(status)) = process.child.try_wait() {
            return Some(status);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The last `lines` lines of `text`.
pub(super) fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
