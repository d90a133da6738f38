//! The handler SDKs (sdk/, docs/HANDLERS.md) through the real daemon: their example handlers, run by the exec
//! plugin's persistent mode, settle real tasks.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kmqd::NewTask;

use crate::support::*;

/// The first of `candidates` that exists (scripts/test installs the interpreters where missing).
fn interpreter(candidates: &[&str]) -> PathBuf {
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|path| path.exists())
        .unwrap_or_else(|| {
            panic!("none of {candidates:?} is installed; scripts/test installs them")
        })
}

/// A daemon running `script` with `interpreter` for `types`, persistently, with `extra` config keys; `queue`
/// the keys of the queue `jobs`.
fn start(
    redis: &RedisServer,
    dir: &TestDir,
    interpreter: &Path,
    script: &Path,
    types: &[&str],
    extra: &str,
) -> (PathBuf, Process) {
    dir.install_plugin(&built_plugin("kmq-exec"), "libkmq_exec.so");
    let types = types
        .iter()
        .map(|t| format!("\"{t}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let config = dir.config(
        redis,
        &format!(
            "{}\n[plugins.handlers]\nfile = \"libkmq_exec.so\"\nconfig = {{ command = \"{}\", args = [\"{}\"], types = [{types}], mode = \"persistent\"{extra} }}\n",
            safe_queue("workers = 8\nretry_times = 1\nbackoff = \"10ms\""),
            interpreter.display(),
            script.display(),
        ),
    );
    let daemon = Process::start(&config, dir.path("kmqd.log"));
    (config, daemon)
}

fn push(config: &Path, kind: &str, id: &str, data: &str) {
    let pushed = client(config)
        .push("jobs", NewTask::new(kind, data).unwrap().id(id))
        .unwrap();
    assert!(pushed.is_accepted(), "{id}");
}

fn wait_ended(config: &Path, done: u64, dead: u64) {
    eventually(
        Duration::from_secs(60),
        &format!("{done} done and {dead} dead"),
        || {
            let s = stats(config, "jobs");
            (s.done == done && s.dead == dead, s)
        },
    );
}

/// The tasks both examples are given: a build, two builds that fail (bad data, missing data), a mail sent, one
/// that retries until it runs out, one that fails.
fn push_the_examples_tasks(config: &Path) {
    push(config, "report.build", "built", r#"{"rows": 3}"#);
    push(config, "report.build", "negative", r#"{"rows": -1}"#);
    push(config, "report.build", "no-rows", "{}");
    push(
        config,
        "report.mail",
        "sent",
        r#"{"to": "ada@example.com"}"#,
    );
    push(
        config,
        "report.mail",
        "busy",
        r#"{"to": "busy@example.com"}"#,
    );
    push(config, "report.mail", "nobody", r#"{"to": "nobody"}"#);
}

/// The log line of the example's "building 3 rows" (a print, or console.log, on the handler's standard error).
fn building_line(daemon: &Process) -> String {
    eventually(
        Duration::from_secs(10),
        "the handler's log line in kmqd's log",
        || {
            let log = daemon.log_text();
            let line = log
                .lines()
                .find(|line| line.ends_with(": building 3 rows"))
                .map(str::to_string);
            (line.is_some(), line.unwrap_or(log))
        },
    )
}

#[test]
fn the_python_sdks_example_handler_settles_sync_and_async_tasks_through_the_daemon() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let python = interpreter(&["/usr/bin/python3", "/usr/local/bin/python3"]);
    let script = workspace_dir().join("sdk/python/example_handler.py");
    // No `processes`: the pool starts one per running task, as they come.
    let (config, mut daemon) = start(
        &redis,
        &dir,
        &python,
        &script,
        &["report.build", "report.mail"],
        ", concurrency = 4",
    );
    push_the_examples_tasks(&config);
    wait_ended(&config, 2, 4);
    let dead = dead_reasons(&redis, "jobs");
    assert_eq!(dead["negative"], "rows must be 0 or more, not -1");
    assert_eq!(
        dead["no-rows"],
        "KeyError: 'rows'; no retries left after 2 runs"
    );
    assert_eq!(dead["busy"], "mailbox busy; no retries left after 2 runs");
    assert_eq!(dead["nobody"], "'nobody' is not an address");
    // A print goes to standard error, which kmqd logs naming the handler process and the tasks it held then.
    let line = building_line(&daemon);
    assert!(
        line.starts_with("kmq-exec: python3[")
            && line
                .split_once(": building")
                .is_some_and(|(during, _)| during.contains("built")),
        "{line}"
    );
    daemon.signal(15);
    assert_eq!(daemon.wait_within(Duration::from_secs(30)), Some(0));
}

#[test]
fn the_sdk_free_python_handler_of_handlers_md_runs_a_task_through_the_daemon() {
    let guide = std::fs::read_to_string(workspace_dir().join("docs/HANDLERS.md")).unwrap();
    let (_, rest) = guide
        .split_once("A minimal handler needs no SDK at all. In Python:\n\n```python\n")
        .expect("docs/HANDLERS.md has a Python handler without the SDK");
    let (code, _) = rest.split_once("```").unwrap();
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let script = dir.path("minimal.py");
    std::fs::write(&script, code).unwrap();
    let python = interpreter(&["/usr/bin/python3", "/usr/local/bin/python3"]);
    let (config, mut daemon) = start(&redis, &dir, &python, &script, &["minimal"], "");
    push(&config, "minimal", "m1", "{}");
    push(&config, "minimal", "m2", "[1, 2]");
    wait_ended(&config, 2, 0);
    daemon.signal(15);
    assert_eq!(daemon.wait_within(Duration::from_secs(30)), Some(0));
}

#[test]
fn the_node_sdks_example_handler_settles_sync_and_async_tasks_through_the_daemon() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let node = interpreter(&["/usr/bin/node", "/usr/local/bin/node", "/usr/bin/nodejs"]);
    let script = workspace_dir().join("sdk/node/example-handler.js");
    let (config, mut daemon) = start(
        &redis,
        &dir,
        &node,
        &script,
        &["report.build", "report.mail"],
        ", processes = 2, concurrency = 4",
    );
    push_the_examples_tasks(&config);
    wait_ended(&config, 2, 4);
    let dead = dead_reasons(&redis, "jobs");
    assert_eq!(dead["negative"], "rows must be 0 or more, not -1");
    assert_eq!(
        dead["no-rows"],
        "TypeError: data has no rows; no retries left after 2 runs"
    );
    assert_eq!(dead["busy"], "mailbox busy; no retries left after 2 runs");
    assert_eq!(dead["nobody"], "\"nobody\" is not an address");
    let line = building_line(&daemon);
    assert!(
        line.split_once(": building")
            .is_some_and(|(during, _)| during.contains("built")),
        "{line}"
    );
    daemon.signal(15);
    assert_eq!(daemon.wait_within(Duration::from_secs(30)), Some(0));
}

/// How long the throttling handlers below hold the queue back.
const THROTTLE: Duration = Duration::from_millis(1500);

/// A Python handler of `api.call` tasks, as a user writes one with the SDK (imported through `PYTHONPATH`, as
/// sdk/python/README.md says): every run appends the testkit's `start ID ATTEMPT TYPE µs` line to
/// `$KMQ_TEST_RECORD`; a task with `throttle_once` (a path) throttles for `throttle_ms` the first time (the
/// upstream's 429), and is done once that file exists.
const PYTHON_THROTTLING: &str = r#"
import os, time
from kmq_handler import Throttle, handler, run

@handler("api.call")
def call(task):
    with open(os.environ["KMQ_TEST_RECORD"], "a") as record:
        record.write(f"start {task.id} {task.attempt} {task.type} {time.time_ns() // 1000}\n")
    once = (task.data or {}).get("throttle_once")
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        raise Throttle(task.data["throttle_ms"] / 1000, "429 Too Many Requests")

run()
"#;

/// The same handler in Node (the SDK found through `NODE_PATH`). Its clock is in ms: a start's µs are rounded
/// down to one, which keeps the ordering below sound (the throttle's end, a whole ms after the first start's
/// rounded µs, is at or before any later start's rounded µs).
const NODE_THROTTLING: &str = r#"
const fs = require('node:fs');
const { handle, run, Throttle } = require('kmq-handler');

handle('api.call', (task) => {
  fs.appendFileSync(process.env.KMQ_TEST_RECORD, `start ${task.id} ${task.attempt} ${task.type} ${Date.now() * 1000}\n`);
  const once = task.data && task.data.throttle_once;
  if (!once) return;
  try {
    fs.closeSync(fs.openSync(once, 'wx'));
  } catch (error) {
    if (error.code === 'EEXIST') return;
    throw error;
  }
  throw new Throttle(task.data.throttle_ms, '429 Too Many Requests');
});

run();
"#;

/// Runs `handler` (a script for `interpreter`, the SDK's directory in the environment variable `path_variable`):
/// a task that throttles the queue once, then, once the throttle is in Redis, six more. The throttled task runs
/// again at the same attempt, uncharged, and nothing starts before its throttle ends.
fn a_handler_throttles_once_then_succeeds(
    interpreter: &Path,
    handler: &str,
    file_name: &str,
    path_variable: &str,
    sdk: &str,
) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let script = dir.path(file_name);
    std::fs::write(&script, handler).unwrap();
    let env = format!(
        ", concurrency = 4, env = {{ {path_variable} = \"{}\", KMQ_TEST_RECORD = \"{}\" }}",
        workspace_dir().join(sdk).display(),
        dir.record_file().display(),
    );
    let (config, mut daemon) = start(&redis, &dir, interpreter, &script, &["api.call"], &env);
    let first = serde_json::json!({
        "throttle_once": dir.path("throttled-once"),
        "throttle_ms": THROTTLE.as_millis() as u64,
    });
    push(&config, "api.call", "first", &first.to_string());
    // The counter, not the key: on a slow machine the key may be gone by the time this looks.
    eventually(Duration::from_secs(30), "the throttle settled", || {
        let s = stats(&config, "jobs");
        (s.throttled == 1, s)
    });
    for n in 0..6 {
        push(&config, "api.call", &format!("then{n}"), "{}");
    }
    wait_ended(&config, 7, 0);
    let records = dir.records();
    let runs_of_first: Vec<_> = records
        .starts
        .iter()
        .filter(|(id, _)| id == "first")
        .collect();
    assert_eq!(
        runs_of_first,
        [&("first".to_string(), 0), &("first".to_string(), 0)],
        "throttled, then run again at the same attempt: {:?}",
        records.starts
    );
    // The throttle was set by the settle after the first run, so it ended after `started + THROTTLE`: nothing
    // else may start before (a slower machine only starts them later).
    let (first_id, started) = records.start_times[0].clone();
    assert_eq!(first_id, "first", "{:?}", records.starts);
    let end = started + THROTTLE.as_micros() as u64;
    let early: Vec<_> = records.start_times[1..]
        .iter()
        .filter(|(_, micros)| *micros < end)
        .collect();
    assert_eq!(early, [] as [&(String, u64); 0], "started while throttled");
    let s = stats(&config, "jobs");
    assert_eq!(
        (s.done, s.throttled, s.retried, s.failed, s.dead_lettered),
        (7, 1, 0, 0, 0),
        "{s:?}"
    );
    daemon.signal(15);
    assert_eq!(daemon.wait_within(Duration::from_secs(30)), Some(0));
}

#[test]
fn the_python_sdks_throttle_holds_the_queue_back_and_its_task_runs_again_uncharged() {
    let python = interpreter(&["/usr/bin/python3", "/usr/local/bin/python3"]);
    a_handler_throttles_once_then_succeeds(
        &python,
        PYTHON_THROTTLING,
        "throttling.py",
        "PYTHONPATH",
        "sdk/python",
    );
}

#[test]
fn the_node_sdks_throttle_holds_the_queue_back_and_its_task_runs_again_uncharged() {
    let node = interpreter(&["/usr/bin/node", "/usr/local/bin/node", "/usr/bin/nodejs"]);
    a_handler_throttles_once_then_succeeds(
        &node,
        NODE_THROTTLING,
        "throttling.js",
        "NODE_PATH",
        "sdk/node",
    );
}
