//! One process per task (`mode = "per_task"`, the default): the command gets the task's `data` (JSON text) on
//! standard input, and its exit status is the outcome:
//! - `0`: done;
//! - `75` (`EX_TEMPFAIL` of sysexits.h): this attempt failed, retry (the queue's `on_handler_error` decides);
//! - anything else, or death by a signal: the task can never succeed, dead-letter it.
//!
//! No status throttles the queue (`Outcome::Throttle`): a throttle needs its time, which an exit status cannot
//! carry, and a code that meant "throttle for a default time" would pass a crash's status for back-pressure. The
//! persistent mode's answers carry it (docs/HANDLERS.md, "Back-pressure").
//!
//! The reason of a retry or a failure is the tail of the command's standard error (of its standard output when
//! it wrote nothing to standard error). A run that passes `timeout`, or that the daemon cancels (the queue's
//! `execution_timeout`, the end of the shutdown grace), is killed and counts as a failed attempt (retry).
//!
//! When the command ends, for whatever reason, everything left in its process group (background processes it
//! started) is killed with SIGKILL and the command is reaped: a task leaves no zombies and no orphans behind. A
//! process that leaves the group on purpose (`setsid`) is beyond this reach. If kmqd itself dies (SIGKILL, the
//! OOM killer), the command gets SIGKILL from the kernel (the parent-death signal, `process::die_with_parent`),
//! so it does not run on beside the re-run another daemon recovers; what it started in the background is not
//! reached then (the signal is not inherited), and is left to systemd, which kills the unit's cgroup.
//!
//! Besides the config's environment the command gets `KMQ_TASK_ID`, `KMQ_TASK_TYPE`, `KMQ_QUEUE` and
//! `KMQ_ATTEMPT` (0 on the first run), and, for a task with a trace context, `TRACEPARENT` and `TRACESTATE`
//! (the OpenTelemetry convention for a context handed to a process: docs/HANDLERS.md, "Tracing").
//!
//! Standard input, output and error are pipes, served by three short-lived threads per run (`kmq-exec-stdin`,
//! `kmq-exec-stdout`, `kmq-exec-stderr`), so a command that writes a lot before it reads, or never reads, cannot
//! deadlock with the plugin.

use std::io::{self, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kmq_plugin::{Outcome, Task};

use crate::config::Program;
use crate::process;
use crate::tail::Tail;

/// The exit status that asks for a retry: `EX_TEMPFAIL` of sysexits.h.
const EXIT_RETRY: i32 = 75;

/// How long the plugin waits for the command's pipes to close once its process group is dead. Only a process that
/// escaped the group (setsid) can keep them open; its pipe threads are then left to end when it closes them.
pub const DRAIN_BOUND: Duration = Duration::from_secs(1);

/// The longest pause between two looks at the command, the cancel flag and the timeout.
pub const MAX_POLL: Duration = Duration::from_millis(10);

/// A command run once per task.
pub struct PerTask {
    pub program: Program,
    pub timeout: Duration,
}

impl PerTask {
    pub fn run(&self, task: &Task<'_>) -> Outcome {
        let mut command = self.program.command();
        command
            .env("KMQ_TASK_ID", task.id())
            .env("KMQ_TASK_TYPE", task.kind())
            .env("KMQ_QUEUE", task.queue())
            .env("KMQ_ATTEMPT", task.attempt().to_string());
        // Removed when the task has none, so that the daemon's own environment never passes for the task's.
        for (name, value) in [
            ("TRACEPARENT", task.traceparent()),
            ("TRACESTATE", task.tracestate()),
        ] {
            match value {
                Some(value) => command.env(name, value),
                None => command.env_remove(name),
            };
        }
        let child = match command.spawn() {
            Ok(child) => child,
            Err(error) => {
                return Outcome::retry(format!(
                    "exec: cannot start {}: {error}",
                    self.program.command.display()
                ));
            }
        };
        let mut running = Running::new(child);
        let output = match Output::serve(&mut running.child, task.data_json().as_bytes()) {
            Ok(output) => output,
            // Dropping `running` kills and reaps the command.
            Err(error) => {
                return Outcome::retry(format!("exec: cannot start a pipe thread: {error}"));
            }
        };
        let end = match running.wait(task, Instant::now() + self.timeout) {
            Ok(end) => end,
            Err(error) => {
                // Someone else reaped the command (a host that ignores SIGCHLD does that): its process id may
                // belong to another process by now, so nothing may be killed through it.
                running.abandon();
                let output = output.collect(DRAIN_BOUND);
                return Outcome::retry(
                    output.reason(format!("exec: lost track of the command: {error}")),
                );
            }
        };
        let status = running.finish();
        let output = output.collect(DRAIN_BOUND);
        let head = match (end, status) {
            (End::TimedOut, _) => format!(
                "exec: timed out after {}; killed",
                humantime::format_duration(self.timeout)
            ),
            (End::Cancelled, _) => "exec: cancelled by the daemon; killed".to_string(),
            (End::Exited, Err(error)) => format!("exec: cannot wait for the command: {error}"),
            (End::Exited, Ok(status)) => match (status.code(), status.signal()) {
                (Some(0), _) => return Outcome::done_with_output(output.output()),
                (Some(EXIT_RETRY), _) => format!("exit status {EXIT_RETRY} (retry)"),
                (Some(code), _) => {
                    return Outcome::fail(output.reason(format!("exit status {code}")));
                }
                (None, Some(signal)) => {
                    return Outcome::fail(output.reason(format!("killed by signal {signal}")));
                }
                (None, None) => format!("exec: unknown exit status {status:?}"),
            },
        };
        Outcome::retry(output.reason(head))
    }
}

/// How the wait for the command ended.
#[derive(Clone, Copy, Debug)]
enum End {
    Exited,
    TimedOut,
    Cancelled,
}

/// A started command. Dropping it without `finish` (an early return, a panic) still kills and reaps it.
struct Running {
    child: Child,
    /// The command's process id, which is also its process group's id.
    group: u32,
    reaped: bool,
}

impl Running {
    fn new(child: Child) -> Running {
        let group = child.id();
        Running {
            child,
            group,
            reaped: false,
        }
    }

    /// Waits until the command exits, the task is cancelled or `deadline` passes. Polls: the cancel flag is a
    /// plain word the daemon writes, with nothing to block on. The pause grows from 1 ms to [`MAX_POLL`], so short
    /// commands are noticed at once and long ones cost little.
    /// An error means the command cannot be waited for: it is not (or no longer) a child of this process.
    fn wait(&mut self, task: &Task<'_>, deadline: Instant) -> io::Result<End> {
        let mut pause = Duration::from_millis(1);
        loop {
            if process::has_exited(self.group)? {
                return Ok(End::Exited);
            }
            if task.is_cancelled() {
                return Ok(End::Cancelled);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(End::TimedOut);
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(MAX_POLL);
        }
    }

    /// Gives up on the command without killing or waiting: see the caller.
    fn abandon(&mut self) {
        self.reaped = true;
    }

    /// Kills what is left of the process group (everything, when the command is still running), then reaps the
    /// command. The group id stays reserved until the reap, so the kill cannot reach another process.
    fn finish(&mut self) -> io::Result<ExitStatus> {
        process::kill_group(self.group);
        self.reaped = true;
        self.child.wait()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.reaped {
            let _ = self.finish();
        }
    }
}

enum Stream {
    Stdin,
    Stdout(Tail),
    Stderr(Tail),
}

/// The three threads that serve a command's pipes, and the channel they report on when their pipe is done.
struct Output {
    done: mpsc::Receiver<Stream>,
    threads: Vec<JoinHandle<()>>,
}

/// What the pipes carried.
#[derive(Default)]
struct Collected {
    stdout: Tail,
    stderr: Tail,
    /// A pipe was still open [`DRAIN_BOUND`] after the command's group died.
    still_open: bool,
}

impl Output {
    fn serve(child: &mut Child, data: &[u8]) -> io::Result<Output> {
        // The pipes were requested in `Program::command`, so they are there.
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        let (sender, done) = mpsc::channel();
        let mut threads = Vec::with_capacity(3);
        let data = data.to_vec();
        let report = sender.clone();
        threads.push(
            std::thread::Builder::new()
                .name("kmq-exec-stdin".into())
                .spawn(move || {
                    // A command that exits without reading its input makes this fail (EPIPE): not an error of
                    // the task, which its exit status decides. (EPIPE rather than death by SIGPIPE, because Rust
                    // programs such as kmqd ignore SIGPIPE.)
                    let _ = stdin.write_all(&data);
                    drop(stdin);
                    let _ = report.send(Stream::Stdin);
                })?,
        );
        let report = sender.clone();
        threads.push(
            std::thread::Builder::new()
                .name("kmq-exec-stdout".into())
                .spawn(move || {
                    let _ = report.send(Stream::Stdout(drain(stdout)));
                })?,
        );
        threads.push(
            std::thread::Builder::new()
                .name("kmq-exec-stderr".into())
                .spawn(move || {
                    let _ = sender.send(Stream::Stderr(drain(stderr)));
                })?,
        );
        Ok(Output { done, threads })
    }

    /// Gathers the tails once the command is dead, waiting at most `within` for its pipes to close. Threads
    /// whose pipe closed are joined; a thread whose pipe an escaped process still holds is left to end with it.
    fn collect(self, within: Duration) -> Collected {
        let deadline = Instant::now() + within;
        let mut collected = Collected::default();
        let mut pending = self.threads.len();
        while pending > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.done.recv_timeout(left) {
                Ok(Stream::Stdin) => {}
                Ok(Stream::Stdout(tail)) => collected.stdout = tail,
                Ok(Stream::Stderr(tail)) => collected.stderr = tail,
                Err(_) => {
                    collected.still_open = true;
                    break;
                }
            }
            pending -= 1;
        }
        if !collected.still_open {
            for thread in self.threads {
                // Each thread reported, which is the last thing it does; a panic in one has nothing left to spoil.
                let _ = thread.join();
            }
        }
        collected
    }
}

impl Collected {
    /// What a command that succeeded printed, for the daemon's `task done` event: the tail of standard output,
    /// then of standard error.
    fn output(&self) -> String {
        let (stdout, stderr) = (self.stdout.text(), self.stderr.text());
        match (stdout.is_empty(), stderr.is_empty()) {
            (_, true) => stdout,
            (true, false) => format!("stderr: {stderr}"),
            (false, false) => format!("{stdout}\nstderr: {stderr}"),
        }
    }

    /// `head`, then the tail of standard error (or of standard output when standard error is empty).
    fn reason(&self, head: String) -> String {
        let tail = match self.stderr.text() {
            text if text.is_empty() => self.stdout.text(),
            text => text,
        };
        let mut reason = head;
        if !tail.is_empty() {
            reason.push_str(": ");
            reason.push_str(&tail);
        }
        if self.still_open {
            reason.push_str(" (a process that left the command's group kept its output open)");
        }
        reason
    }
}

/// Reads a pipe to its end, keeping the tail.
fn drain<R: Read>(mut pipe: R) -> Tail {
    let mut tail = Tail::default();
    let mut chunk = [0u8; 8192];
    loop {
        match pipe.read(&mut chunk) {
            Ok(0) => return tail,
            Ok(n) => tail.push(&chunk[..n]),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return tail,
        }
    }
}
