//! `exec`: runs a configured command for each task, so handlers can be written in any language and run isolated
//! in their own process.
//!
//! The command gets the task's `data` (JSON text) on standard input. Its exit status is the outcome:
//! - `0`: done;
//! - `75` (`EX_TEMPFAIL` of sysexits.h): this attempt failed, retry (the queue's `on_handler_error` decides);
//! - anything else, or death by a signal: the task can never succeed, dead-letter it.
//!
//! The reason of a retry or a failure is the tail of the command's standard error (of its standard output when
//! it wrote nothing to standard error). A run that passes `timeout`, or that the daemon cancels (the queue's
//! `execution_timeout`, the end of the shutdown grace), is killed and counts as a failed attempt (retry).
//!
//! The command runs in a process group of its own. When it ends, for whatever reason, everything left in that
//! group (background processes it started) is killed with SIGKILL and the command is reaped: a task leaves no
//! zombies and no orphans behind. A process that leaves the group on purpose (`setsid`) is beyond this reach.
//!
//! The environment is clean, so the daemon's (Redis password variables, for one) never leaks into a handler:
//! `PATH=/usr/local/bin:/usr/bin:/bin`, then the config's `env`, then `KMQ_TASK_ID`, `KMQ_TASK_TYPE`,
//! `KMQ_QUEUE` and `KMQ_ATTEMPT` (0 on the first run).
//!
//! Config (`[plugins.NAME] config`):
//! - `command` (required): the absolute path of an executable file;
//! - `args` (default none): its arguments;
//! - `timeout` (required): the longest a run may take, as kmqd writes durations (`"30s"`, `"5m"`, `"250ms"`);
//! - `types` (required): the task types to claim;
//! - `env` (default none): a table of extra environment variables.
//!
//! Standard input, output and error are pipes, served by three short-lived threads per run (`kmq-exec-stdin`,
//! `kmq-exec-stdout`, `kmq-exec-stderr`), so a command that writes a lot before it reads, or never reads, cannot
//! deadlock with the plugin.
#![deny(unsafe_code)]

mod process;

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kmq_plugin::{Handler, Outcome, Task};
use serde::Deserialize;

/// The exit status that asks for a retry: `EX_TEMPFAIL` of sysexits.h.
const EXIT_RETRY: i32 = 75;

/// The `PATH` a command gets unless the config's `env` sets one.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// How many bytes of standard error (or output) a reason quotes: the end, where the error usually is. Shorter than
/// kmqd's 1024-byte message buffer, so the head of the reason and the tail both fit.
const TAIL_BYTES: usize = 768;

/// How long the plugin waits for the command's pipes to close once its process group is dead. Only a process that
/// escaped the group (setsid) can keep them open; its pipe threads are then left to end when it closes them.
const DRAIN_BOUND: Duration = Duration::from_secs(1);

/// The longest pause between two looks at the command, the cancel flag and the timeout.
const MAX_POLL: Duration = Duration::from_millis(10);

/// The `[plugins.NAME] config` table, as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    command: String,
    #[serde(default)]
    args: Vec<String>,
    timeout: String,
    types: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
}

/// The validated config: the plugin's state, shared by every worker thread.
struct Exec {
    command: PathBuf,
    args: Vec<String>,
    timeout: Duration,
    types: Vec<String>,
    env: BTreeMap<String, String>,
}

impl Exec {
    fn from_raw(raw: RawConfig) -> Result<Exec, String> {
        let RawConfig {
            command,
            args,
            timeout,
            types,
            env,
        } = raw;
        let command = PathBuf::from(command);
        if !command.is_absolute() {
            return Err(format!(
                "exec: command {:?} is not an absolute path; write the full path of the executable",
                command.display().to_string()
            ));
        }
        let metadata = std::fs::metadata(&command)
            .map_err(|error| format!("exec: command {}: {error}", command.display()))?;
        if !metadata.is_file() || metadata.permissions().mode() & 0o111 == 0 {
            return Err(format!(
                "exec: command {} is not an executable file; chmod +x it or name another",
                command.display()
            ));
        }
        let timeout = humantime::parse_duration(&timeout).map_err(|error| {
            format!("exec: timeout {timeout:?}: {error}; write a duration like \"30s\" or \"5m\"")
        })?;
        if timeout.is_zero() {
            return Err("exec: timeout is 0; give the command some time, e.g. \"30s\"".to_string());
        }
        if types.is_empty() || types.iter().any(String::is_empty) {
            return Err(
                "exec: types must list the task types to run the command for, e.g. types = [\"report.build\"]"
                    .to_string(),
            );
        }
        if let Some(key) = env
            .keys()
            .find(|key| key.is_empty() || key.contains('=') || key.contains('\0'))
        {
            return Err(format!(
                "exec: env key {key:?} is not a variable name; it must be non-empty, without '=' or NUL"
            ));
        }
        if let Some((key, _)) = env.iter().find(|(_, value)| value.contains('\0')) {
            return Err(format!("exec: env value of {key} contains a NUL byte"));
        }
        Ok(Exec {
            command,
            args,
            timeout,
            types,
            env,
        })
    }

    fn command(&self, task: &Task<'_>) -> Command {
        let mut command = Command::new(&self.command);
        command
            .args(&self.args)
            .env_clear()
            .env("PATH", DEFAULT_PATH)
            .envs(&self.env)
            .env("KMQ_TASK_ID", task.id())
            .env("KMQ_TASK_TYPE", task.kind())
            .env("KMQ_QUEUE", task.queue())
            .env("KMQ_ATTEMPT", task.attempt().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // A group of its own, led by the command: one kill reaches everything it started.
            .process_group(0);
        command
    }

    fn run(&self, task: &Task<'_>) -> Outcome {
        let child = match self.command(task).spawn() {
            Ok(child) => child,
            Err(error) => {
                return Outcome::retry(format!(
                    "exec: cannot start {}: {error}",
                    self.command.display()
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

/// The end of a stream: its last [`TAIL_BYTES`] bytes.
#[derive(Default)]
struct Tail {
    bytes: Vec<u8>,
    cut: bool,
}

impl Tail {
    fn push(&mut self, chunk: &[u8]) {
        self.bytes.extend_from_slice(chunk);
        if self.bytes.len() > TAIL_BYTES {
            let excess = self.bytes.len() - TAIL_BYTES;
            self.bytes.drain(..excess);
            self.cut = true;
        }
    }

    fn text(&self) -> String {
        // A cut may fall inside a UTF-8 character: skip its continuation bytes.
        let start = if self.cut {
            self.bytes
                .iter()
                .position(|byte| byte & 0b1100_0000 != 0b1000_0000)
                .unwrap_or(self.bytes.len())
        } else {
            0
        };
        let text = String::from_utf8_lossy(&self.bytes[start..]);
        let text = text.trim();
        if self.cut && !text.is_empty() {
            format!("...{text}")
        } else {
            text.to_string()
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
        // The pipes were requested in `Exec::command`, so they are there.
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

impl Handler for Exec {
    const NAME: &'static str = "exec";
    type Config = RawConfig;

    fn init(config: RawConfig) -> Result<Exec, String> {
        Exec::from_raw(config)
    }

    fn types(&self) -> Vec<String> {
        self.types.clone()
    }

    fn handle(&self, task: &Task<'_>) -> Outcome {
        self.run(task)
    }
}

kmq_plugin::export!(Exec);

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt;
    use std::path::{Path, PathBuf};
    use std::time::{Duration, Instant};

    use kmq_plugin::testing::{Harness, RunResult, Status, TestTask, process_is_alive};

    /// Writes an executable shell script.
    fn script(dir: &Path, body: &str) -> PathBuf {
        let path = dir.join("handler.sh");
        fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// The exec plugin, through its exported symbol, running `command` with the temp dir as its one argument.
    fn harness(dir: &Path, command: &Path, timeout: &str) -> Harness {
        let config = serde_json::json!({
            "command": command,
            "args": [dir],
            "timeout": timeout,
            "types": ["exec.test"],
            "env": { "GREETING": "hi there" },
        });
        Harness::new(crate::kmq_plugin_v1, &config.to_string()).expect("exec loads")
    }

    fn run(dir: &Path, body: &str, data: &str) -> RunResult {
        let harness = harness(dir, &script(dir, body), "10s");
        harness.run(TestTask::new("exec.test", data))
    }

    /// Polls until `pid` is no longer alive; panics after 10 s. SIGKILL takes effect asynchronously: a killed
    /// process closes its files (which ends the run's pipes) a moment before it turns into a zombie.
    fn wait_until_dead(pid: u32, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while process_is_alive(pid) {
            assert!(
                Instant::now() < deadline,
                "{what} ({pid}) is still alive after 10 s"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Whether `pid` is gone entirely: reaped, so not even a zombie.
    fn is_reaped(pid: u32) -> bool {
        !Path::new(&format!("/proc/{pid}")).exists()
    }

    fn read_pid(path: &Path) -> u32 {
        fs::read_to_string(path)
            .unwrap_or_else(|error| panic!("{}: {error}", path.display()))
            .trim()
            .parse()
            .unwrap()
    }

    /// Polls until `path` exists (the script wrote it); panics after 10 s.
    fn wait_for_file(path: &Path) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !path.exists() {
            assert!(
                Instant::now() < deadline,
                "{} never appeared",
                path.display()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn exit_0_is_done_with_what_the_command_printed_as_its_output() {
        let dir = tempfile::tempdir().unwrap();
        let result = run(
            dir.path(),
            "echo 'processed 3 rows'; echo 'slow disk' >&2",
            "{}",
        );
        assert_eq!(
            (result.status, result.message.as_str()),
            (Status::Done, "processed 3 rows\nstderr: slow disk")
        );
    }

    #[test]
    fn exit_0_is_done_and_the_command_reads_the_data_on_stdin() {
        let dir = tempfile::tempdir().unwrap();
        let result = run(
            dir.path(),
            r#"data=$(cat); [ "$data" = '{"n":1}' ] || { echo "stdin was: $data" >&2; exit 3; }"#,
            r#"{"n":1}"#,
        );
        assert_eq!((result.status, result.message.as_str()), (Status::Done, ""));
    }

    #[test]
    fn exit_75_asks_for_a_retry_with_the_tail_of_stderr() {
        let dir = tempfile::tempdir().unwrap();
        let result = run(dir.path(), "echo 'database is locked' >&2\nexit 75", "{}");
        assert_eq!(result.status, Status::Retry);
        assert_eq!(result.message, "exit status 75 (retry): database is locked");
        assert_eq!(result.retry_after, None, "the queue's backoff applies");
    }

    #[test]
    fn any_other_exit_status_fails_the_task_with_the_tail_of_stderr() {
        let dir = tempfile::tempdir().unwrap();
        let result = run(
            dir.path(),
            "head -c 5000 /dev/zero | tr '\\0' x >&2\necho >&2\necho 'error: no such customer' >&2\nexit 2",
            "{}",
        );
        assert_eq!(result.status, Status::Fail);
        assert!(
            result.message.starts_with("exit status 2: ...xxx"),
            "{}",
            result.message
        );
        assert!(
            result.message.ends_with("xxx\nerror: no such customer"),
            "{}",
            result.message
        );
        assert!(
            result.message.len() < 1024,
            "the tail fits kmqd's message buffer"
        );
    }

    #[test]
    fn stdout_is_the_reason_when_stderr_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let result = run(dir.path(), "echo 'only on stdout'\nexit 1", "{}");
        assert_eq!(
            (result.status, result.message.as_str()),
            (Status::Fail, "exit status 1: only on stdout")
        );
    }

    #[test]
    fn death_by_a_signal_fails_the_task() {
        let dir = tempfile::tempdir().unwrap();
        let result = run(dir.path(), "echo dying >&2\nkill -TERM $$", "{}");
        assert_eq!(
            (result.status, result.message.as_str()),
            (Status::Fail, "killed by signal 15: dying")
        );
    }

    #[test]
    fn the_timeout_kills_the_command_and_everything_it_started() {
        let dir = tempfile::tempdir().unwrap();
        let body = "sleep 600 &\necho $! > \"$1/background.pid\"\necho $$ > \"$1/command.pid\"\necho working >&2\nwait";
        let harness = harness(dir.path(), &script(dir.path(), body), "300ms");
        let result = harness.run(TestTask::new("exec.test", "{}"));
        assert_eq!(result.status, Status::Retry);
        assert_eq!(
            result.message,
            "exec: timed out after 300ms; killed: working"
        );
        let command = read_pid(&dir.path().join("command.pid"));
        let background = read_pid(&dir.path().join("background.pid"));
        assert!(
            is_reaped(command),
            "the command {command} was killed and reaped: no zombie"
        );
        wait_until_dead(background, "its background process: an orphan");
    }

    #[test]
    fn a_cancelled_run_kills_the_command() {
        let dir = tempfile::tempdir().unwrap();
        let body = "echo $$ > \"$1/command.pid\"\nexec sleep 600";
        let harness = harness(dir.path(), &script(dir.path(), body), "1h");
        let task = TestTask::new("exec.test", "{}");
        let cancel = task.cancel.clone();
        let result = std::thread::scope(|scope| {
            let running = scope.spawn(|| harness.run(task));
            wait_for_file(&dir.path().join("command.pid"));
            assert!(!running.is_finished(), "runs until cancelled");
            cancel.cancel();
            running.join().unwrap()
        });
        assert_eq!(
            (result.status, result.message.as_str()),
            (Status::Retry, "exec: cancelled by the daemon; killed")
        );
        let command = read_pid(&dir.path().join("command.pid"));
        assert!(
            is_reaped(command),
            "the command {command} was killed and reaped"
        );
    }

    #[test]
    fn background_processes_are_killed_when_the_command_exits() {
        let dir = tempfile::tempdir().unwrap();
        // The first keeps the command's stdout and stderr open: the run must not wait for it.
        let body = "sleep 600 &\necho $! > \"$1/holding.pid\"\nsleep 600 >/dev/null 2>&1 &\necho $! > \"$1/quiet.pid\"\nexit 0";
        let result = run(dir.path(), body, "{}");
        assert_eq!((result.status, result.message.as_str()), (Status::Done, ""));
        for name in ["holding.pid", "quiet.pid"] {
            let pid = read_pid(&dir.path().join(name));
            wait_until_dead(pid, name);
        }
    }

    #[test]
    fn a_command_that_writes_a_lot_and_never_reads_does_not_deadlock() {
        let dir = tempfile::tempdir().unwrap();
        let data = serde_json::to_string(&"d".repeat(4 << 20)).unwrap();
        let body = "head -c 4194304 /dev/zero\nhead -c 4194304 /dev/zero >&2\nexit 0";
        let result = run(dir.path(), body, &data);
        assert_eq!(result.status, Status::Done);
    }

    #[test]
    fn the_environment_is_clean_but_for_path_the_config_and_the_task() {
        let dir = tempfile::tempdir().unwrap();
        let harness = harness(dir.path(), &script(dir.path(), "env > \"$1/env\""), "10s");
        let mut task = TestTask::new("exec.test", "{}");
        task.id = "t-9".to_string();
        task.attempt = 2;
        assert_eq!(harness.run(task).status, Status::Done);
        let env = fs::read_to_string(dir.path().join("env")).unwrap();
        let mut lines: Vec<&str> = env
            .lines()
            // The shell exports its working directory itself.
            .filter(|line| !line.starts_with("PWD="))
            .collect();
        lines.sort();
        assert_eq!(
            lines,
            [
                "GREETING=hi there",
                "KMQ_ATTEMPT=2",
                "KMQ_QUEUE=test",
                "KMQ_TASK_ID=t-9",
                "KMQ_TASK_TYPE=exec.test",
                "PATH=/usr/local/bin:/usr/bin:/bin",
            ]
        );
    }

    #[test]
    fn init_refuses_a_bad_config_saying_what_to_fix() {
        let dir = tempfile::tempdir().unwrap();
        let good = script(dir.path(), "exit 0");
        let not_executable = dir.path().join("data.txt");
        fs::write(&not_executable, "").unwrap();
        let config = |command: &Path, timeout: &str, types: &[&str]| {
            serde_json::json!({ "command": command, "timeout": timeout, "types": types })
                .to_string()
        };
        let cases = [
            (
                config(Path::new("handler.sh"), "1s", &["t"]),
                "exec: command \"handler.sh\" is not an absolute path; write the full path of the executable",
            ),
            (
                config(&dir.path().join("missing.sh"), "1s", &["t"]),
                "No such file or directory",
            ),
            (
                config(&not_executable, "1s", &["t"]),
                "is not an executable file; chmod +x it or name another",
            ),
            (config(&good, "soon", &["t"]), "exec: timeout \"soon\": "),
            (config(&good, "0s", &["t"]), "exec: timeout is 0"),
            (config(&good, "1s", &[]), "exec: types must list the task types"),
            (
                serde_json::json!({ "command": good, "timeout": "1s", "types": ["t"], "env": { "A=B": "c" } })
                    .to_string(),
                "exec: env key \"A=B\" is not a variable name",
            ),
            (
                serde_json::json!({ "command": good, "timeout": "1s", "types": ["t"], "argv": [] }).to_string(),
                "unknown field `argv`",
            ),
            (
                serde_json::json!({ "command": good, "types": ["t"] }).to_string(),
                "missing field `timeout`",
            ),
        ];
        for (config, expected) in cases {
            let error = Harness::new(crate::kmq_plugin_v1, &config)
                .err()
                .unwrap_or_else(|| panic!("accepted {config}"));
            assert!(
                error.contains(expected),
                "{config}: expected {expected:?} in {error:?}"
            );
        }
        let accepted =
            Harness::new(crate::kmq_plugin_v1, &config(&good, "1s", &["a", "b"])).unwrap();
        assert_eq!(
            (accepted.name(), accepted.types()),
            ("exec", &["a".to_string(), "b".to_string()][..])
        );
    }
}
