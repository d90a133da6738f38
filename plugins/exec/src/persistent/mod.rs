//! Long-lived handler processes (`mode = "persistent"`): a pool of children per configured command, each reading
//! task lines on its standard input and answering on its standard output (the protocol: docs/HANDLERS.md).
//!
//! A worker thread takes a free slot of a ready child (one that said hello and holds fewer than `concurrency`
//! tasks), hands it the task line and waits for the answer, polling its cancel flag, the plugin's `timeout` and
//! whether the child is still alive, as the per-task mode polls its command. A child that exits fails only the
//! tasks it held (retry), with its exit status and the tail of its standard error; one a task times out on, or is
//! cancelled on, is killed (SIGTERM, then SIGKILL) and the other tasks it held are retried.
//!
//! One `kmq-exec-pool` thread per instance keeps the children: from the first task on, it starts `processes` of
//! them (or, without `processes`, as many as the tasks running at once need), restarts those that end, with a backoff while they
//! fail at start or crash in a row without answering, kills the ones that say no hello within `start_timeout`, stops the ones recycled (after
//! `max_tasks_per_process` tasks, or past `max_rss`) once idle, and stops all at shutdown. A command that fails
//! at start [`BROKEN_AFTER`] times in a row is reported once on standard error, and its tasks are retried at once
//! (not dead-lettered) until a child starts again.

mod child;
mod protocol;

use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak, mpsc};
use std::time::{Duration, Instant, SystemTime};

use kmq_plugin::{Outcome, Task};

use crate::config::{Persistent, Program};
use crate::per_task::MAX_POLL;
use child::{Cause, Child, Event, with_tail};

/// Failures at start in a row after which the command counts as broken: its tasks are retried at once.
pub const BROKEN_AFTER: u32 = 3;

/// The first pause before restarting a child that failed at start; it doubles with each failure in a row.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// The longest pause before restarting a child that keeps failing at start.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// The longest the pool thread sleeps when nothing wakes it.
const IDLE_WAKE: Duration = Duration::from_millis(200);

/// One configured command's children.
pub struct Pool {
    shared: Arc<Shared>,
    keeper: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct Shared {
    program: Program,
    settings: Persistent,
    state: Mutex<State>,
    /// Signalled on every change a waiting worker or the pool thread may act on.
    changed: Condvar,
}

#[derive(Default)]
struct State {
    members: Vec<Member>,
    /// Workers waiting for a free slot.
    waiting: usize,
    /// A first task came: the pool thread starts children from then on. Not at `init`, which `kmqd check-config`
    /// runs too, and which must not start a handler's imports and connections for nothing.
    active: bool,
    /// Children that failed at start (ended before their hello, or could not be started) in a row.
    start_failures: u32,
    /// Ready children that ended unasked (a crash) in a row, with no answer from any child since: from the second,
    /// restarts back off too, so a command that dies right after its hello does not spin.
    crashes: u32,
    /// When the next child may be started (the backoff after a failure at start).
    next_start: Option<Instant>,
    /// Why the command counts as broken (see [`BROKEN_AFTER`]), while it does.
    broken: Option<String>,
    stopping: bool,
}

struct Member {
    child: Arc<Child>,
    started: Instant,
    ready: bool,
    /// Tasks handed to it and not yet settled.
    held: usize,
    /// Tasks ever handed to it.
    served: u64,
    /// Takes no more tasks; stopped once idle.
    retiring: bool,
    /// Its stop (or kill) has begun.
    ending: bool,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Pool {
    /// Starts the pool thread, which starts the children once the first task comes (see [`State::active`]); no
    /// task waits for a hello longer than its own cancel allows (a command that fails at start is reported then,
    /// and its tasks retried).
    pub fn start(program: Program, settings: Persistent) -> Result<Pool, String> {
        let shared = Arc::new(Shared {
            program,
            settings,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let keeper = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("kmq-exec-pool".into())
                .spawn(move || keep(&shared))
                .map_err(|error| format!("exec: cannot start the pool thread: {error}"))?
        };
        Ok(Pool {
            shared,
            keeper: Mutex::new(Some(keeper)),
        })
    }

    /// Runs one attempt of `task` on a child.
    pub fn run(&self, task: &Task<'_>) -> Outcome {
        let shared = &self.shared;
        let started = Instant::now();
        let timeout = shared.settings.timeout;
        let deadline = timeout.map(|timeout| started + timeout);
        loop {
            let child = match shared.take_slot(task, deadline) {
                Ok(child) => child,
                Err(outcome) => return outcome,
            };
            let outcome = shared.exchange(&child, task, deadline);
            shared.settle(&child);
            // A child that ended between the pick and the hand-over never saw the task: another slot takes it.
            if let Some(outcome) = outcome {
                return outcome;
            }
        }
    }

    /// Stops every child (input closed, then SIGTERM, then SIGKILL, `kill_grace` apart) and the pool thread.
    pub fn shutdown(&self) {
        lock(&self.shared.state).stopping = true;
        self.shared.changed.notify_all();
        let keeper = self
            .keeper
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(keeper) = keeper {
            let _ = keeper.join();
        }
    }
}

/// A pool dropped without its shutdown still stops its children: no handler process outlives its instance.
impl Drop for Pool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Shared {
    /// Waits for a free slot of a ready child and takes it; an outcome instead when the task cannot run now.
    fn take_slot(&self, task: &Task<'_>, deadline: Option<Instant>) -> Result<Arc<Child>, Outcome> {
        let mut state = lock(&self.state);
        state.active = true;
        // The common case, a free slot: no one else to wake.
        if !state.stopping {
            if let Some(child) = self.pick(&mut state, task.id()) {
                return Ok(child);
            }
        }
        // The pool thread may start a child for it (without `processes`, one per running task).
        state.waiting += 1;
        self.changed.notify_all();
        let result = loop {
            if state.stopping {
                break Err(Outcome::retry("exec: the plugin is stopping"));
            }
            if let Some(child) = self.pick(&mut state, task.id()) {
                break Ok(child);
            }
            if let Some(reason) = &state.broken {
                break Err(Outcome::retry(reason.clone()));
            }
            if task.is_cancelled() {
                break Err(Outcome::retry(
                    "exec: cancelled by the daemon while waiting for a free handler process",
                ));
            }
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                break Err(Outcome::retry(format!(
                    "exec: timed out after {} waiting for a free handler process",
                    self.timeout_text()
                )));
            }
            state = self
                .changed
                .wait_timeout(state, MAX_POLL)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        };
        state.waiting -= 1;
        result
    }

    /// The ready child with the fewest tasks and a free slot, counted as holding one more.
    fn pick(&self, state: &mut State, id: &str) -> Option<Arc<Child>> {
        let concurrency = self.settings.concurrency;
        let member = state
            .members
            .iter_mut()
            .filter(|m| m.ready && !m.retiring && !m.ending && m.held < concurrency)
            .filter(|m| m.child.can_take(id))
            .min_by_key(|m| m.held)?;
        member.held += 1;
        member.served += 1;
        if self
            .settings
            .max_tasks_per_process
            .is_some_and(|max| member.served >= max)
        {
            member.retiring = true;
        }
        Some(Arc::clone(&member.child))
    }

    /// Hands the task to `child` and waits for its answer, the task's cancel, the timeout or the child's end;
    /// `None` when the child had ended before the task reached it.
    fn exchange(
        &self,
        child: &Arc<Child>,
        task: &Task<'_>,
        deadline: Option<Instant>,
    ) -> Option<Outcome> {
        let wall_deadline = {
            let local = self.settings.timeout.map(|t| SystemTime::now() + t);
            match (task.deadline(), local) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        };
        let line = protocol::task_line(task, wall_deadline);
        let answer = child.submit(task.id(), line)?;
        loop {
            // The answer wakes the worker at once; the pause only bounds how late the cancel flag, the timeout and
            // the child's exit are seen. A fixed MAX_POLL, not one growing from 1 ms as the per-task mode's: a
            // round trip through a busy child takes a few ms, and each early wake-up was a context switch more
            // per task (docs/PERFORMANCE.md, "Handlers in other languages").
            let pause = deadline.map_or(MAX_POLL, |deadline| {
                deadline
                    .saturating_duration_since(Instant::now())
                    .clamp(Duration::from_millis(1), MAX_POLL)
            });
            match answer.recv_timeout(pause) {
                Ok(outcome) => return Some(outcome),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Some(Outcome::retry(
                        "exec: the handler process's answer was lost",
                    ));
                }
            }
            if task.is_cancelled() {
                let what = "cancelled by the daemon".to_string();
                return Some(self.abandon(child, task.id(), what, &answer));
            }
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                let what = format!("timed out after {}", self.timeout_text());
                return Some(self.abandon(child, task.id(), what, &answer));
            }
            if child.has_exited() {
                // Its output may stay open (a process it started holds it): end it from here. The answer, or
                // the end's reason, comes on `answer`.
                child.end(Cause::Exited);
            }
        }
    }

    /// Gives up on a task: kills the child that holds it (the other tasks it held are retried), unless its
    /// outcome is already on the way.
    fn abandon(
        &self,
        child: &Arc<Child>,
        id: &str,
        what: String,
        answer: &mpsc::Receiver<Outcome>,
    ) -> Outcome {
        if !child.withdraw(id) {
            let bound = crate::per_task::DRAIN_BOUND + self.settings.kill_grace * 2;
            return answer
                .recv_timeout(bound)
                .unwrap_or_else(|_| Outcome::retry(format!("exec: {what}")));
        }
        let pid = child.pid;
        let reason = with_tail(
            format!("exec: {what}; handler process {pid} killed"),
            &child.stderr_tail(),
        );
        // No task goes to it any more, even before its end begins on the other thread.
        if let Some(member) = lock(&self.state)
            .members
            .iter_mut()
            .find(|m| m.child.pid == pid)
        {
            member.ending = true;
        }
        // The SIGTERM, the wait for it to exit (up to kill_grace), the SIGKILL and the reap, on a thread of their
        // own: the worker returns at once, as a cancelled handler should. The pool's shutdown waits for them
        // (`Child::end` runs once; a second call waits for the first).
        let why = format!("task {id} {what}");
        let ending = Arc::clone(child);
        let why_there = why.clone();
        let spawned = std::thread::Builder::new()
            .name("kmq-exec-stop".into())
            .spawn(move || ending.end(Cause::Killed(why_there)));
        if spawned.is_err() {
            child.end(Cause::Killed(why));
        }
        Outcome::retry(reason)
    }

    /// The task on `child` is over: its slot is free, and the child retires if it is past `max_rss`.
    fn settle(&self, child: &Child) {
        let over_rss = self
            .settings
            .max_rss
            .is_some_and(|max| child.rss().is_some_and(|rss| rss > max));
        let mut state = lock(&self.state);
        if child.has_answered() {
            state.crashes = 0;
        }
        let mut wake = state.waiting > 0;
        if let Some(member) = state.members.iter_mut().find(|m| m.child.pid == child.pid) {
            member.held = member.held.saturating_sub(1);
            member.retiring |= over_rss;
            // A retiring child that is now idle is the pool thread's to stop.
            wake |= member.retiring && member.held == 0;
        }
        drop(state);
        if wake {
            self.changed.notify_all();
        }
    }

    fn timeout_text(&self) -> String {
        self.settings
            .timeout
            .map(|t| humantime::format_duration(t).to_string())
            .unwrap_or_default()
    }

    /// A child's news.
    fn on_event(&self, pid: u32, event: Event) {
        let mut state = lock(&self.state);
        match event {
            Event::Ready => {
                if let Some(member) = state.members.iter_mut().find(|m| m.child.pid == pid) {
                    member.ready = true;
                }
                state.start_failures = 0;
                state.next_start = None;
                if state.broken.take().is_some() {
                    eprintln!(
                        "kmq-exec: {}[{pid}]: started again; its tasks run again",
                        self.program.name()
                    );
                }
            }
            Event::Ended {
                ready,
                planned,
                reason,
            } => {
                state.members.retain(|m| m.child.pid != pid);
                if !planned && !state.stopping {
                    if ready {
                        state.crashes += 1;
                        if state.crashes > 1 {
                            state.next_start = Some(Instant::now() + backoff(state.crashes - 1));
                        }
                    } else {
                        self.failed_at_start(&mut state, reason);
                    }
                }
            }
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Counts a failure at start: backs off, and reports the command broken (once) after [`BROKEN_AFTER`].
    fn failed_at_start(&self, state: &mut State, reason: String) {
        state.start_failures += 1;
        state.next_start = Some(Instant::now() + backoff(state.start_failures));
        if state.start_failures >= BROKEN_AFTER && state.broken.is_none() {
            let report = format!(
                "{} fails at start ({} times in a row; the last: {reason}); its tasks are retried until it starts",
                self.program.command.display(),
                state.start_failures
            );
            eprintln!("kmq-exec: {report}");
            state.broken = Some(format!("exec: {report}"));
        }
    }
}

/// The pause before the next start after `failures` (1 or more) in a row: [`FIRST_BACKOFF`], doubling, at most
/// [`MAX_BACKOFF`].
fn backoff(failures: u32) -> Duration {
    FIRST_BACKOFF
        .saturating_mul(1 << (failures.clamp(1, 16) - 1))
        .min(MAX_BACKOFF)
}

/// What the pool thread does outside the lock.
enum Action {
    Kill(Arc<Child>, Duration),
    Stop(Arc<Child>),
}

/// The `kmq-exec-pool` thread: see the module's doc.
fn keep(shared: &Arc<Shared>) {
    let settings = &shared.settings;
    let mut state = lock(&shared.state);
    while !state.stopping {
        let now = Instant::now();
        let mut actions = Vec::new();
        for member in state.members.iter_mut().filter(|m| !m.ending) {
            if !member.ready && now >= member.started + settings.start_timeout {
                member.ending = true;
                actions.push(Action::Kill(
                    Arc::clone(&member.child),
                    settings.start_timeout,
                ));
            } else if member.retiring && member.held == 0 {
                member.ending = true;
                actions.push(Action::Stop(Arc::clone(&member.child)));
            }
        }
        if !actions.is_empty() {
            drop(state);
            for action in actions {
                match action {
                    Action::Kill(child, within) => {
                        child.end(Cause::NoHello(within));
                    }
                    Action::Stop(child) => {
                        // Up to twice kill_grace: not on this thread, which keeps the others (unless no thread
                        // can be started).
                        let stopping = Arc::clone(&child);
                        let spawned = std::thread::Builder::new()
                            .name("kmq-exec-stop".into())
                            .spawn(move || stopping.end(Cause::Stop));
                        if spawned.is_err() {
                            child.end(Cause::Stop);
                        }
                    }
                }
            }
            state = lock(&shared.state);
            continue;
        }
        let live: Vec<&Member> = state
            .members
            .iter()
            .filter(|m| !m.retiring && !m.ending)
            .collect();
        let wanted = match settings.processes {
            _ if !state.active => 0,
            Some(processes) => processes,
            None => {
                let busy = live.iter().map(|m| m.held).sum::<usize>() + state.waiting;
                busy.div_ceil(settings.concurrency)
            }
        };
        let may_start = state.next_start.is_none_or(|at| now >= at);
        if live.len() < wanted && may_start {
            let weak = Arc::downgrade(shared);
            let events = Box::new(move |pid, event| {
                if let Some(shared) = Weak::upgrade(&weak) {
                    shared.on_event(pid, event);
                }
            });
            match Child::spawn(
                &shared.program,
                settings.concurrency,
                settings.kill_grace,
                events,
            ) {
                Ok(child) => state.members.push(Member {
                    child,
                    started: now,
                    ready: false,
                    held: 0,
                    served: 0,
                    retiring: false,
                    ending: false,
                }),
                Err(error) => {
                    let reason = format!(
                        "exec: cannot start {}: {error}",
                        shared.program.command.display()
                    );
                    shared.failed_at_start(&mut state, reason);
                }
            }
            shared.changed.notify_all();
            continue;
        }
        let mut wake = now + IDLE_WAKE;
        if live.len() < wanted {
            wake = wake.min(state.next_start.unwrap_or(now));
        }
        for member in state.members.iter().filter(|m| !m.ready && !m.ending) {
            wake = wake.min(member.started + settings.start_timeout);
        }
        let pause = wake
            .saturating_duration_since(now)
            .max(Duration::from_millis(1));
        state = shared
            .changed
            .wait_timeout(state, pause)
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .0;
    }
    // Stopping: every child at once, each with its own grace.
    let children: Vec<Arc<Child>> = state.members.iter().map(|m| Arc::clone(&m.child)).collect();
    drop(state);
    std::thread::scope(|scope| {
        for child in &children {
            scope.spawn(move || child.end(Cause::Stop));
        }
    });
}
