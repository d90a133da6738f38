//! Long-lived handler processes (`mode = "persistent"`): a pool of children per configured command, each reading
//! task lines on its standard input and answering on its standard output (the protocol: docs/HANDLERS.md).
//!
//! The daemon starts a task (kmq_plugin.h, `start`): its worker thread takes a free slot of a ready child (one
//! that said hello and holds fewer than `concurrency` tasks), hands it the task line and goes on; the child's
//! output thread completes the task with its answer. The pool thread watches what the children hold every
//! [`MAX_POLL`]: the daemon's cancel flags, the plugin's `timeout`, and whether each child is still alive. (A host
//! without `start` calls `handle`, which does the same and waits for the answer, watching the cancel flag
//! itself.) A child that exits fails only the
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

use kmq_plugin::{Completion, Outcome, Task};

use crate::config::{Persistent, Program};
use crate::per_task::MAX_POLL;
use child::{Answer, Cause, Child, Due, Event, Reply, with_tail};

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

    /// Starts one attempt of `task` on a child: the answer (or the reason it has none) completes `done`.
    pub fn start_task(&self, task: &Task<'_>, done: Completion) {
        if let Err((outcome, Reply::Started(done))) =
            self.shared.hand_over(task, Reply::Started(done))
        {
            done.complete(outcome);
        }
    }

    /// Runs one attempt of `task` on a child and waits for its outcome, for a host that has no `start`.
    pub fn run(&self, task: &Task<'_>) -> Outcome {
        let (sender, answer) = mpsc::sync_channel(1);
        let child = match self.shared.hand_over(task, Reply::Worker(sender)) {
            Ok(child) => child,
            Err((outcome, _)) => return outcome,
        };
        let mut abandoned = false;
        loop {
            // The answer wakes the worker at once; the pause only bounds how late the cancel flag is seen. The
            // timeout and the child's end are the pool thread's to watch, and come here as an answer.
            match answer.recv_timeout(MAX_POLL) {
                Ok(outcome) => return outcome,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Outcome::retry("exec: the handler process's answer was lost");
                }
            }
            if task.is_cancelled() && !abandoned {
                abandoned = true;
                self.shared
                    .abandon(&child, task.id(), "cancelled by the daemon".to_string());
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

    /// Hands the task to a child: the child it went to, or an outcome instead (with the reply back) when it
    /// cannot run now.
    fn hand_over(&self, task: &Task<'_>, reply: Reply) -> Result<Arc<Child>, (Outcome, Reply)> {
        let timeout = self.settings.timeout;
        let deadline = timeout.map(|timeout| Instant::now() + timeout);
        let wall_deadline = {
            let local = timeout.map(|t| SystemTime::now() + t);
            match (task.deadline(), local) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        };
        let mut answer = Answer { reply, deadline };
        loop {
            let child = match self.take_slot(task, deadline) {
                Ok(child) => child,
                Err(outcome) => return Err((outcome, answer.reply)),
            };
            let line = protocol::task_line(task, wall_deadline);
            match child.submit(task.id(), line, answer) {
                Ok(()) => return Ok(child),
                // The child ended between the pick and the hand-over and never saw the task: another slot
                // takes it.
                Err(back) => {
                    self.settle(&child);
                    answer = back;
                }
            }
        }
    }

    /// Gives up on a task: kills the child that holds it (the other tasks it held are retried) and replies with
    /// why, unless its outcome is already on the way.
    fn abandon(&self, child: &Arc<Child>, id: &str, what: String) {
        let Some(answer) = child.withdraw(id) else {
            return;
        };
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
        // own: the caller goes on at once, as a cancelled handler should. The pool's shutdown waits for them
        // (`Child::end` runs once; a second call waits for the first).
        end_elsewhere(child, Cause::Killed(format!("task {id} {what}")));
        child.reply(answer, Outcome::retry(reason));
    }

    /// The pool thread's watch over what the children hold (see the module's doc).
    fn watch(&self, children: Vec<Arc<Child>>) {
        let now = Instant::now();
        for child in children {
            if child.has_exited() {
                // Its output may stay open (a process it started holds it): end it from here. Its tasks are
                // retried with the end's reason.
                let ending = lock(&self.state)
                    .members
                    .iter_mut()
                    .find(|m| m.child.pid == child.pid)
                    .is_some_and(|m| !std::mem::replace(&mut m.ending, true));
                if ending {
                    end_elsewhere(&child, Cause::Exited);
                }
                continue;
            }
            for (id, due) in child.due(now) {
                let what = match due {
                    Due::TimedOut => format!("timed out after {}", self.timeout_text()),
                    Due::Cancelled => "cancelled by the daemon".to_string(),
                };
                self.abandon(&child, &id, what);
            }
        }
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
        if let Event::Settled = event {
            let child = lock(&self.state)
                .members
                .iter()
                .find(|m| m.child.pid == pid)
                .map(|m| Arc::clone(&m.child));
            if let Some(child) = child {
                self.settle(&child);
            }
            return;
        }
        let mut state = lock(&self.state);
        match event {
            Event::Settled => {}
            Event::Ready => {
                if let Some(member) = state.members.iter_mut().find(|m| m.child.pid == pid) {
                    member.ready = true;
                }
                state.start_failures = 0;
                state.next_start = None;
                if state.broken.take().is_some() {
                    kmq_plugin::log_line(&format!(
                        "kmq-exec: {}[{pid}]: started again; its tasks run again",
                        self.program.name()
                    ));
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
            kmq_plugin::log_line(&format!("kmq-exec: {report}"));
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

/// Ends `child` on a thread of its own (up to twice `kill_grace`), or on this one if no thread can be started.
fn end_elsewhere(child: &Arc<Child>, cause: Cause) {
    let ending = Arc::clone(child);
    let (cause, fallback) = match cause {
        Cause::Killed(why) => (Cause::Killed(why.clone()), Cause::Killed(why)),
        Cause::Exited => (Cause::Exited, Cause::Exited),
        Cause::Stop => (Cause::Stop, Cause::Stop),
        other => {
            child.end(other);
            return;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("kmq-exec-stop".into())
        .spawn(move || ending.end(cause));
    if spawned.is_err() {
        child.end(fallback);
    }
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
    let mut watched = Instant::now();
    while !state.stopping {
        let mut now = Instant::now();
        if now >= watched + MAX_POLL {
            let holding: Vec<Arc<Child>> = state
                .members
                .iter()
                .filter(|m| m.held > 0 && !m.ending)
                .map(|m| Arc::clone(&m.child))
                .collect();
            if !holding.is_empty() {
                drop(state);
                shared.watch(holding);
                state = lock(&shared.state);
                now = Instant::now();
            }
            watched = now;
        }
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
                    // Not on this thread, which keeps the others.
                    Action::Stop(child) => end_elsewhere(&child, Cause::Stop),
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
        if state.members.iter().any(|m| m.held > 0) {
            wake = wake.min(watched + MAX_POLL);
        }
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
