//! `exec`: runs a configured command for tasks, so handlers can be written in any language and run isolated in
//! processes of their own. Two modes (the config's `mode`):
//! - `"per_task"` (the default): one process per task, the task's `data` on its standard input, its exit status
//!   the outcome ([`per_task`]);
//! - `"persistent"`: long-lived handler processes that tasks are streamed to, one JSON line each, and that answer
//!   with one JSON line per task ([`persistent`]; the line protocol is docs/HANDLERS.md).
//!
//! Either way a handler process runs in a process group of its own that it leads, so one kill reaches everything
//! it started, and its environment is clean, so the daemon's (Redis password variables, for one) never leaks into
//! a handler: `PATH=/usr/local/bin:/usr/bin:/bin`, then the config's `env`, then what the mode adds.
//!
//! Config (`[plugins.NAME] config`):
//! - `command` (required): the absolute path of an executable file;
//! - `args` (default none): its arguments;
//! - `types` (required): the task types to claim;
//! - `env` (default none): a table of extra environment variables;
//! - `mode` (default `"per_task"`): `"per_task"` or `"persistent"`;
//! - `timeout` (required per task, optional when persistent): the longest a run may take, as kmqd writes
//!   durations (`"30s"`, `"5m"`, `"250ms"`);
//! - persistent mode only: `processes`, `concurrency`, `max_tasks_per_process`, `max_rss`, `start_timeout`,
//!   `kill_grace` (docs/HANDLERS.md, "Configuration").
#![deny(unsafe_code)]
// Its lines go through `kmq_plugin::log_line`, whole: `eprintln!` splits a line into one write per piece.
#![deny(clippy::print_stderr)]

mod config;
mod per_task;
mod persistent;
mod process;
mod tail;

use kmq_plugin::{Completion, Handler, Outcome, Task};

use config::{Config, RawConfig, Run};

/// One configured instance: a `[plugins.NAME]` section's command, in its mode.
struct Exec {
    types: Vec<String>,
    runner: Runner,
}

enum Runner {
    PerTask(per_task::PerTask),
    Persistent(persistent::Pool),
}

impl Handler for Exec {
    const NAME: &'static str = "exec";
    type Config = RawConfig;

    fn init(config: RawConfig) -> Result<Exec, String> {
        let Config {
            program,
            types,
            run,
        } = Config::from_raw(config)?;
        let runner = match run {
            Run::PerTask { timeout } => Runner::PerTask(per_task::PerTask { program, timeout }),
            Run::Persistent(settings) => {
                Runner::Persistent(persistent::Pool::start(program, settings)?)
            }
        };
        Ok(Exec { types, runner })
    }

    fn types(&self) -> Vec<String> {
        self.types.clone()
    }

    fn handle(&self, task: &Task<'_>) -> Outcome {
        match &self.runner {
            Runner::PerTask(per_task) => per_task.run(task),
            Runner::Persistent(pool) => pool.run(task),
        }
    }

    /// Persistent children take tasks without a daemon thread waiting for each; a process per task is run in
    /// place (`handle`).
    const STARTS: bool = true;

    fn start(&self, task: &Task<'_>, done: Completion) -> Result<(), Completion> {
        match &self.runner {
            Runner::PerTask(_) => Err(done),
            Runner::Persistent(pool) => {
                pool.start_task(task, done);
                Ok(())
            }
        }
    }

    fn shutdown(&self) {
        if let Runner::Persistent(pool) = &self.runner {
            pool.shutdown();
        }
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
    fn a_command_gets_its_task_s_trace_context_as_traceparent_and_tracestate() {
        let dir = tempfile::tempdir().unwrap();
        let body = "printf '%s|%s' \"${TRACEPARENT-unset}\" \"${TRACESTATE-unset}\"";
        let harness = harness(dir.path(), &script(dir.path(), body), "10s");
        let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut task = TestTask::new("exec.test", "{}");
        task.traceparent = Some(traceparent.to_string());
        task.tracestate = Some("congo=t61rcWkgMzE".to_string());
        let result = harness.run(task);
        assert_eq!(
            (result.status, result.message),
            (Status::Done, format!("{traceparent}|congo=t61rcWkgMzE"))
        );
        // Without one, neither variable is set, whatever the daemon's own environment holds.
        let result = harness.run(TestTask::new("exec.test", "{}"));
        assert_eq!(result.message, "unset|unset");
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
            (
                serde_json::json!({ "command": good, "timeout": "1s", "types": ["t"], "processes": 2 })
                    .to_string(),
                "exec: processes applies to long-lived handler processes only; add mode = \"persistent\" or remove it",
            ),
            (
                serde_json::json!({ "command": good, "types": ["t"], "mode": "forever" }).to_string(),
                "unknown variant `forever`, expected `per_task` or `persistent`",
            ),
            (
                serde_json::json!({ "command": good, "types": ["t"], "mode": "persistent", "processes": 0 })
                    .to_string(),
                "exec: processes is 0",
            ),
            (
                serde_json::json!({ "command": good, "types": ["t"], "mode": "persistent", "concurrency": 0 })
                    .to_string(),
                "exec: concurrency is 0",
            ),
            (
                serde_json::json!({ "command": good, "types": ["t"], "mode": "persistent", "max_rss": "lots" })
                    .to_string(),
                "exec: max_rss \"lots\" is not a size; write one like \"512MiB\" or \"1GB\"",
            ),
            (
                serde_json::json!({ "command": good, "types": ["t"], "mode": "persistent", "kill_grace": "0s" })
                    .to_string(),
                "exec: kill_grace is 0",
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
        let persistent = serde_json::json!({
            "command": good, "types": ["p"], "mode": "persistent", "processes": 1, "concurrency": 4,
            "max_tasks_per_process": 100, "max_rss": "512MiB", "timeout": "1m", "start_timeout": "5s",
            "kill_grace": "1s",
        });
        let accepted = Harness::new(crate::kmq_plugin_v1, &persistent.to_string()).unwrap();
        assert_eq!(accepted.types(), ["p"], "every key of the persistent mode");
    }
}
