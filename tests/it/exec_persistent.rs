//! The exec plugin's persistent mode (docs/HANDLERS.md) through the real daemon: long-lived Python children fed
//! one JSON line per task, their outcomes, and what a crash, a hang, a broken start, recycling and the shutdown
//! cost (docs/RELIABILITY.md, "Handler processes").

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kmq_plugin::testing::process_is_alive;
use kmqd::NewTask;

use crate::support::*;

/// The test handler: a protocol-v1 child in plain Python. `argv[1]` picks how it starts, `argv[2]` is the test's
/// directory: every start appends `PID MODE` to `starts`, every task `ID PID` to `runs`. A task's data picks what
/// it does.
const HANDLER: &str = r#"#!/usr/bin/env python3
import fcntl, json, os, signal, struct, sys, termios, time

start, directory = sys.argv[1], sys.argv[2]
def note(name, text):
    with open(os.path.join(directory, name), "a") as f:
        f.write(text + "\n")
note("starts", f"{os.getpid()} {start}")
if start == "crash" and not os.path.exists(os.path.join(directory, "fixed")):
    print("ImportError: no module named handlers", file=sys.stderr, flush=True)
    sys.exit(3)
if start == "silent":
    time.sleep(3600)
if start == "banner":
    print("handlers v2.3 starting", flush=True)
if start == "ignore_term":
    signal.signal(signal.SIGTERM, lambda signum, frame: note("terms", str(os.getpid())))

def send(answer):
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()

send({"hello": 1})
if start == "hello_then_exit":
    sys.exit(1)
def unread():
    return struct.unpack("i", fcntl.ioctl(0, termios.FIONREAD, b"\0\0\0\0"))[0]
if start == "deaf":
    note("deaf", str(os.getpid()))
    while True:
        time.sleep(3600)
if start == "full_first":
    # Reads nothing until its input pipe is full (64 KiB): the daemon queues the lines it did not take.
    while unread() < 60000:
        time.sleep(0.01)
    note("full", str(os.getpid()))
held = {}  # task id -> the id of the task whose arrival answers it
for line in sys.stdin:
    task = json.loads(line)
    tid, data = task["id"], task["data"]
    note("runs", f"{tid} {os.getpid()}")
    do = data["do"]
    if do == "done":
        send({"id": tid, "outcome": "done"})
    elif do == "retry":
        send({"id": tid, "outcome": "retry", "message": "database is locked", "retry_after_ms": 10})
    elif do == "fail":
        send({"id": tid, "outcome": "fail", "message": "no such customer"})
    elif do == "hold":
        held[data["until"]] = tid
    elif do == "progress":
        # A malformed progress line first (logged, not fatal), then a report; answered once `until` arrives.
        send({"id": tid, "progress": "half"})
        send({"id": tid, "progress": data["fraction"], "message": data["message"]})
        held[data["until"]] = tid
    elif do == "exit":
        print(f"dying on {tid}", file=sys.stderr, flush=True)
        os._exit(7)
    elif do == "kill":
        print(f"killing myself on {tid}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    elif do == "hang":
        print(f"hanging on {tid}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    elif do == "garbage":
        print("debug: printed to stdout by mistake", flush=True)
    elif do == "bad":
        send({"id": tid, "outcome": "finished"})
    elif do == "throttle_without_after":
        send({"id": tid, "outcome": "throttle", "message": "429"})
    elif do == "grow":
        ballast = bytearray(64 << 20)
        for i in range(0, len(ballast), 4096):
            ballast[i] = 1
        globals()["ballast"] = ballast
        send({"id": tid, "outcome": "done"})
    if tid in held:
        send({"id": held.pop(tid), "outcome": "done", "message": f"answered after {tid}"})
"#;

struct Rig {
    redis: RedisServer,
    dir: TestDir,
    config: PathBuf,
}

/// A daemon config with the queue `jobs` (`queue` keys) and one `[plugins.NAME]` per `(name, type, start mode,
/// extra config)`, each running [`HANDLER`] persistently: sections of one file, the exec plugin, each an instance
/// with a pool of its own.
fn rig(queue: &str, daemon: &str, sections: &[(&str, &str, &str, &str)]) -> Rig {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let handler = dir.path("handler.py");
    fs::write(&handler, HANDLER).unwrap();
    fs::set_permissions(&handler, fs::Permissions::from_mode(0o755)).unwrap();
    dir.install_plugin(&built_plugin("kmq-exec"), "libkmq_exec.so");
    let mut plugins = String::new();
    for (name, kind, start, extra) in sections {
        plugins.push_str(&format!(
            "[plugins.{name}]\nfile = \"libkmq_exec.so\"\nconfig = {{ command = \"{python}\", args = [\"{handler}\", \"{start}\", \"{dir}\"], types = [\"{kind}\"], mode = \"persistent\"{extra} }}\n\n",
            python = python3().display(),
            handler = handler.display(),
            dir = dir.path("").display(),
        ));
    }
    let config = dir.config_with(&redis, daemon, &format!("{}\n{plugins}", safe_queue(queue)));
    Rig { redis, dir, config }
}

/// The python3 the handlers run with (scripts/test installs it where missing).
fn python3() -> PathBuf {
    ["/usr/bin/python3", "/usr/local/bin/python3"]
        .iter()
        .map(PathBuf::from)
        .find(|path| path.exists())
        .expect("python3 is installed (scripts/test: ensure_python3)")
}

impl Rig {
    fn push(&self, kind: &str, id: &str, data: &str) {
        let pushed = client(&self.config)
            .push("jobs", NewTask::new(kind, data).unwrap().id(id))
            .unwrap();
        assert!(pushed.is_accepted(), "{id}");
    }

    /// Waits until `done` tasks are done and `dead` dead-lettered.
    fn wait_ended(&self, done: u64, dead: u64) {
        eventually(
            Duration::from_secs(30),
            &format!("{done} done and {dead} dead"),
            || {
                let s = stats(&self.config, "jobs");
                (s.done == done && s.dead == dead, s)
            },
        );
    }

    /// The dead-letter reasons by task id.
    fn dead_reasons(&self) -> BTreeMap<String, String> {
        dead_reasons(&self.redis, "jobs")
    }

    /// The `(task id, pid)` of every task line a child read, in order.
    fn runs(&self) -> Vec<(String, u32)> {
        read_lines(&self.dir.path("runs"))
            .iter()
            .map(|line| {
                let (id, pid) = line.split_once(' ').unwrap();
                (id.to_string(), pid.parse().unwrap())
            })
            .collect()
    }

    /// The pid of the child that ran `id` (its first run).
    fn pid_of(&self, id: &str) -> u32 {
        let runs = self.runs();
        runs.iter()
            .find(|(run, _)| run == id)
            .unwrap_or_else(|| panic!("{id} never reached a child: {runs:?}"))
            .1
    }

    /// The pids of the children started so far.
    fn starts(&self) -> Vec<u32> {
        read_lines(&self.dir.path("starts"))
            .iter()
            .map(|line| line.split(' ').next().unwrap().parse().unwrap())
            .collect()
    }

    /// How many children of the start mode `mode` started so far.
    fn starts_of(&self, mode: &str) -> usize {
        read_lines(&self.dir.path("starts"))
            .iter()
            .filter(|line| line.ends_with(&format!(" {mode}")))
            .count()
    }
}

fn read_lines(path: &Path) -> Vec<String> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn wait_dead(pid: u32, what: &str) {
    eventually(Duration::from_secs(10), what, || {
        (!process_is_alive(pid), pid)
    });
}

#[test]
fn done_retry_and_fail_answers_settle_their_tasks_and_one_child_serves_them_all() {
    let rig = rig(
        "workers = 4\nretry_times = 1\nbackoff = \"10ms\"",
        "shutdown_grace = \"5s\"",
        &[("py", "py", "ok", ", processes = 1, concurrency = 4")],
    );
    let daemon = TestDaemon::start(&rig.config);
    rig.push("py", "ok-1", r#"{"do": "done"}"#);
    rig.push("py", "flaky", r#"{"do": "retry"}"#);
    rig.push("py", "broken", r#"{"do": "fail"}"#);
    // Held until `second` arrives, then answered after it: two tasks at once on one child, answers out of order.
    // `second` is pushed once `first` is on the child, so that it arrives after it.
    rig.push("py", "first", r#"{"do": "hold", "until": "second"}"#);
    eventually(Duration::from_secs(10), "first on the child", || {
        let runs = rig.runs();
        (runs.iter().any(|(id, _)| id == "first"), runs)
    });
    rig.push("py", "second", r#"{"do": "done"}"#);
    // Pretty-printed data: its line breaks must not cut the task's line.
    rig.push("py", "pretty", "{\n  \"do\": \"done\"\n}");
    rig.wait_ended(4, 2);
    let dead = rig.dead_reasons();
    assert_eq!(
        dead["flaky"],
        "database is locked; no retries left after 2 runs"
    );
    assert_eq!(dead["broken"], "no such customer");
    let pids: Vec<u32> = rig.runs().iter().map(|(_, pid)| *pid).collect();
    assert_eq!(pids.len(), 7, "every run reached a child: {:?}", rig.runs());
    assert!(
        pids.iter().all(|pid| *pid == pids[0]),
        "one long-lived child ran every task: {:?}",
        rig.runs()
    );
    assert_eq!(rig.starts(), [pids[0]]);
    daemon.stop();
    wait_dead(pids[0], "the child, stopped with the daemon");
}

#[test]
fn a_child_that_dies_or_breaks_the_protocol_costs_only_its_task_and_is_restarted() {
    let rig = rig(
        "workers = 1\nretry_times = 0",
        "shutdown_grace = \"5s\"",
        &[("py", "py", "ok", ", processes = 1")],
    );
    let daemon = TestDaemon::start(&rig.config);
    // One worker: the tasks run one after another, in this order.
    let tasks = [
        ("before", "done"),
        ("exits", "exit"),
        ("after-exit", "done"),
        ("killed", "kill"),
        ("after-kill", "done"),
        ("garbage", "garbage"),
        ("after-garbage", "done"),
        ("bad", "bad"),
        ("after-bad", "done"),
        ("bad-throttle", "throttle_without_after"),
        ("after-bad-throttle", "done"),
    ];
    for (id, what) in tasks {
        rig.push("py", id, &format!(r#"{{"do": "{what}"}}"#));
    }
    rig.wait_ended(6, 5);
    let dead = rig.dead_reasons();
    let pid = |id| rig.pid_of(id);
    assert_eq!(
        dead["exits"],
        format!(
            "exec: handler process {} exited (exit status 7): dying on exits; no retries left after 1 runs",
            pid("exits")
        )
    );
    assert_eq!(
        dead["killed"],
        format!(
            "exec: handler process {} exited (killed by signal 9): killing myself on killed; no retries left after 1 runs",
            pid("killed")
        )
    );
    assert!(
        dead["garbage"].starts_with(&format!(
            "exec: handler process {} wrote a line that is not an answer (not a JSON object: \"debug: printed to stdout by mistake\"); restarted",
            pid("garbage")
        )),
        "{}",
        dead["garbage"]
    );
    assert_eq!(
        dead["bad"],
        "exec: the handler's answer is malformed: \"outcome\" must be \"done\", \"retry\", \"fail\" or \"throttle\": \"{\\\"id\\\": \\\"bad\\\", \\\"outcome\\\": \\\"finished\\\"}\""
    );
    // A throttle without its delay is malformed like any other answer: dead-lettered, not a throttle of 1 s.
    assert_eq!(
        dead["bad-throttle"],
        "exec: the handler's answer is malformed: a \"throttle\" answer needs \"after_ms\", a whole number of milliseconds"
    );
    assert_eq!(stats(&rig.config, "jobs").throttled, 0);
    // A new child after each death and after the garbage; the malformed answer kept its child.
    assert_eq!(pid("before"), pid("exits"));
    assert_ne!(pid("exits"), pid("after-exit"));
    assert_ne!(pid("killed"), pid("after-kill"));
    assert_ne!(pid("garbage"), pid("after-garbage"));
    assert_eq!(pid("bad"), pid("after-bad"));
    assert_eq!(pid("bad"), pid("after-bad-throttle"));
    assert_eq!(rig.starts().len(), 4, "{:?}", rig.starts());
    daemon.stop();
}

#[test]
fn a_task_past_its_timeout_kills_its_child_and_the_next_task_gets_a_new_one() {
    let rig = rig(
        "workers = 3\nretry_times = 0\nexecution_timeout = \"2s\"",
        "shutdown_grace = \"5s\"",
        &[
            ("py", "py", "ok", ", processes = 1, kill_grace = \"200ms\""),
            (
                "own",
                "py.own",
                "ok",
                ", processes = 1, concurrency = 2, timeout = \"1s\", kill_grace = \"200ms\"",
            ),
        ],
    );
    let daemon = TestDaemon::start(&rig.config);
    rig.push("py", "hung", r#"{"do": "hang"}"#);
    rig.push("py.own", "hung-own", r#"{"do": "hang"}"#);
    // Handed to the same child (a second slot) while it hangs: it never reads it, and the kill costs it too.
    eventually(Duration::from_secs(60), "hung-own on its child", || {
        let runs = rig.runs();
        (runs.iter().any(|(id, _)| id == "hung-own"), runs)
    });
    rig.push("py.own", "bystander", r#"{"do": "done"}"#);
    rig.wait_ended(0, 3);
    let dead = rig.dead_reasons();
    assert!(
        dead["hung"].starts_with("execution timeout: still running after 2s"),
        "{}",
        dead["hung"]
    );
    let own = rig.pid_of("hung-own");
    assert_eq!(
        dead["hung-own"],
        format!(
            "exec: timed out after 1s; handler process {own} killed: hanging on hung-own; no retries left after 1 runs"
        )
    );
    assert_eq!(
        dead["bystander"],
        format!(
            "exec: handler process {own} was killed: task hung-own timed out after 1s: hanging on hung-own; no retries left after 1 runs"
        )
    );
    for id in ["hung", "hung-own"] {
        wait_dead(rig.pid_of(id), "the hung child, killed");
    }
    rig.push("py", "next", r#"{"do": "done"}"#);
    rig.push("py.own", "next-own", r#"{"do": "done"}"#);
    rig.wait_ended(2, 3);
    assert_ne!(rig.pid_of("next"), rig.pid_of("hung"));
    assert_ne!(rig.pid_of("next-own"), own);
    daemon.stop();
}

#[test]
fn lines_a_full_input_pipe_does_not_take_wait_whole_and_hold_up_no_worker() {
    // 8 tasks of 30 kB lines: 240 kB, past the 64 KiB a pipe holds. The workers write what the pipe takes and
    // queue the rest (plugins/exec/src/persistent/child.rs): a child that reads late gets every line whole; one
    // that never reads times its tasks out, each worker free to see its timeout.
    let rig = rig(
        "workers = 16\nretry_times = 0",
        "shutdown_grace = \"5s\"",
        &[
            (
                "late",
                "py.late",
                "full_first",
                ", processes = 1, concurrency = 8",
            ),
            (
                "deaf",
                "py.deaf",
                "deaf",
                ", processes = 1, concurrency = 8, timeout = \"1s\", kill_grace = \"200ms\"",
            ),
        ],
    );
    let daemon = TestDaemon::start(&rig.config);
    let pad = "x".repeat(30_000);
    for i in 0..8 {
        rig.push(
            "py.late",
            &format!("late-{i}"),
            &format!(r#"{{"do": "done", "pad": "{pad}"}}"#),
        );
    }
    rig.wait_ended(8, 0);
    assert_eq!(
        read_lines(&rig.dir.path("full")).len(),
        1,
        "its input was full before it read"
    );
    let runs: Vec<String> = rig.runs().into_iter().map(|(id, _)| id).collect();
    assert_eq!(runs.len(), 8, "{runs:?}");
    for i in 0..8 {
        rig.push(
            "py.deaf",
            &format!("deaf-{i}"),
            &format!(r#"{{"do": "done", "pad": "{pad}"}}"#),
        );
    }
    rig.wait_ended(8, 8);
    let deaf: u32 = read_lines(&rig.dir.path("deaf"))[0].parse().unwrap();
    for (id, reason) in rig.dead_reasons() {
        assert!(
            reason.starts_with("exec: timed out after 1s; handler process")
                || reason.starts_with(&format!(
                    "exec: handler process {deaf} was killed: task deaf-"
                )),
            "{id}: {reason}"
        );
    }
    wait_dead(deaf, "the deaf child, killed");
    daemon.stop();
}

#[test]
fn a_command_that_fails_at_start_is_reported_once_and_its_tasks_retry_until_it_starts() {
    let rig = rig(
        "workers = 3\nretry_times = 1000\nbackoff = \"20ms\"",
        "shutdown_grace = \"5s\"",
        &[
            ("crashing", "py.crash", "crash", ", processes = 1"),
            (
                "silent",
                "py.silent",
                "silent",
                ", processes = 1, start_timeout = \"200ms\"",
            ),
            ("banner", "py.banner", "banner", ", processes = 1"),
        ],
    );
    let mut daemon = Process::start(&rig.config, rig.dir.path("kmqd.log"));
    rig.push("py.crash", "waits-for-crashing", r#"{"do": "done"}"#);
    rig.push("py.silent", "waits-for-silent", r#"{"do": "done"}"#);
    rig.push("py.banner", "waits-for-banner", r#"{"do": "done"}"#);
    // Three failures make the report; by six (the backoff doubles from 100 ms), a second report would be there.
    eventually(
        Duration::from_secs(120),
        "six starts of each command",
        || {
            let starts = ["crash", "silent", "banner"].map(|mode| rig.starts_of(mode));
            (starts.iter().all(|n| *n >= 6), starts)
        },
    );
    let log = daemon.log_text();
    for (kind, why) in [
        ("crashing", "exit status 3"),
        ("silent", "wrote no hello line within 200ms; killed"),
        (
            "banner",
            "is not ready: its first line is not the hello {\"hello\": 1} but \"handlers v2.3 starting\"; killed",
        ),
    ] {
        let reports: Vec<&str> = log
            .lines()
            .filter(|line| {
                line.starts_with("kmq-exec: ")
                    && line.contains("fails at start")
                    && line.contains(why)
            })
            .collect();
        assert_eq!(reports.len(), 1, "{kind}: reported once:\n{log}");
    }
    assert!(
        log.contains("ImportError: no module named handlers"),
        "the child's stderr is in the log:\n{log}"
    );
    let s = stats(&rig.config, "jobs");
    assert_eq!((s.done, s.dead), (0, 0), "{s:?}");
    assert!(s.retried >= 3, "the tasks are retried: {s:?}");
    // The crashing command is fixed: its next start serves the task that waited, and that is logged once.
    fs::write(rig.dir.path("fixed"), "").unwrap();
    rig.wait_ended(1, 0);
    let log = daemon.log_text();
    assert_eq!(
        log.lines()
            .filter(|line| line.starts_with("kmq-exec: ")
                && line.ends_with("started again; its tasks run again"))
            .count(),
        1,
        "{log}"
    );
    daemon.signal(15);
    assert_eq!(daemon.wait_within(Duration::from_secs(30)), Some(0));
    for pid in rig.starts() {
        wait_dead(pid, "every child, at the daemon's exit");
    }
}

#[test]
fn children_are_recycled_after_max_tasks_per_process_and_past_max_rss() {
    let rig = rig(
        "workers = 1",
        "shutdown_grace = \"5s\"",
        &[
            (
                "counted",
                "py",
                "ok",
                ", processes = 1, max_tasks_per_process = 2",
            ),
            (
                "rss",
                "py.rss",
                "ok",
                ", processes = 1, max_rss = \"48MiB\"",
            ),
        ],
    );
    let daemon = TestDaemon::start(&rig.config);
    for i in 0..6 {
        rig.push("py", &format!("t{i}"), r#"{"do": "done"}"#);
    }
    rig.wait_ended(6, 0);
    let pids: Vec<u32> = (0..6).map(|i| rig.pid_of(&format!("t{i}"))).collect();
    assert_eq!(pids[0], pids[1]);
    assert_eq!(pids[2], pids[3]);
    assert_eq!(pids[4], pids[5]);
    assert!(
        pids[0] != pids[2] && pids[2] != pids[4] && pids[0] != pids[4],
        "{pids:?}"
    );
    wait_dead(pids[0], "the first recycled child");
    rig.push("py.rss", "small", r#"{"do": "done"}"#);
    rig.push("py.rss", "grows", r#"{"do": "grow"}"#);
    rig.push("py.rss", "after", r#"{"do": "done"}"#);
    rig.wait_ended(9, 0);
    assert_eq!(rig.pid_of("small"), rig.pid_of("grows"));
    assert_ne!(rig.pid_of("grows"), rig.pid_of("after"));
    wait_dead(rig.pid_of("grows"), "the child past max_rss");
    daemon.stop();
}

#[test]
fn at_shutdown_a_busy_child_gets_the_grace_then_sigterm_then_sigkill() {
    let rig = rig(
        "workers = 2",
        "shutdown_grace = \"300ms\"",
        &[(
            "py",
            "py",
            "ignore_term",
            ", processes = 2, kill_grace = \"1s\"",
        )],
    );
    let mut daemon = Process::start(&rig.config, rig.dir.path("kmqd.log"));
    rig.push("py", "hung", r#"{"do": "hang"}"#);
    let busy = eventually(Duration::from_secs(30), "the task on a child", || {
        let runs = rig.runs();
        (!runs.is_empty(), runs)
    })[0]
        .1;
    let starts = eventually(Duration::from_secs(30), "both children", || {
        let starts = rig.starts();
        (starts.len() == 2, starts)
    });
    let idle = *starts.iter().find(|pid| **pid != busy).unwrap();
    daemon.signal(15);
    assert_eq!(daemon.wait_within(Duration::from_secs(30)), Some(0));
    let log = daemon.log_text();
    assert!(
        !log.contains("plugin shutdown skipped"),
        "the cancelled handler returned at once, and the plugin's shutdown ran:\n{log}"
    );
    let terms = read_lines(&rig.dir.path("terms"));
    assert_eq!(
        terms,
        [busy.to_string()],
        "the busy child got SIGTERM; the idle one exited when its input closed"
    );
    wait_dead(busy, "the busy child, killed after ignoring SIGTERM");
    wait_dead(idle, "the idle child");
    let s = stats(&rig.config, "jobs");
    assert_eq!(
        (s.done, s.dead),
        (0, 0),
        "the task waits for another run: {s:?}"
    );
}

#[test]
fn a_child_that_dies_right_after_its_hello_is_restarted_with_a_growing_backoff() {
    let rig = rig(
        "workers = 1",
        "shutdown_grace = \"5s\"",
        &[("py", "py", "hello_then_exit", ", processes = 1")],
    );
    let daemon = TestDaemon::start(&rig.config);
    // Its children start with the first task.
    rig.push("py", "starter", r#"{"do": "done"}"#);
    let first = eventually(Duration::from_secs(30), "a first start", || {
        (!rig.starts().is_empty(), std::time::Instant::now())
    });
    eventually(Duration::from_secs(30), "six starts", || {
        let starts = rig.starts().len();
        (starts >= 6, starts)
    });
    // The second start follows the first crash at once; then 100 ms, 200 ms, 400 ms, 800 ms: a lower bound.
    let elapsed = first.elapsed();
    assert!(
        elapsed >= Duration::from_millis(1500),
        "six starts in {elapsed:?}: no backoff"
    );
    daemon.stop();
}

#[test]
fn check_config_starts_no_handler_process_and_the_first_task_starts_them_all() {
    let rig = rig(
        "workers = 2",
        "shutdown_grace = \"5s\"",
        &[
            ("py", "py", "ok", ", processes = 2"),
            // Its child runs, answers and writes its start while a pool started at init would have had longer.
            ("witness", "py.witness", "witness", ", processes = 1"),
        ],
    );
    let (code, out, err) = kmqd(
        &["--config", rig.config.to_str().unwrap(), "check-config"],
        None,
    );
    assert_eq!(code, 0, "{out}\n{err}");
    let daemon = TestDaemon::start(&rig.config);
    rig.push("py.witness", "witnessed", r#"{"do": "done"}"#);
    rig.wait_ended(1, 0);
    assert_eq!(
        (rig.starts_of("witness"), rig.starts_of("ok")),
        (1, 0),
        "neither check-config nor the daemon's start started py's children"
    );
    rig.push("py", "first", r#"{"do": "done"}"#);
    rig.wait_ended(2, 0);
    eventually(Duration::from_secs(10), "both of py's children", || {
        let starts = rig.starts_of("ok");
        (starts == 2, starts)
    });
    daemon.stop();
}

#[test]
fn a_daemon_killed_with_sigkill_leaves_no_handler_process_behind() {
    let rig = rig(
        "workers = 2",
        "shutdown_grace = \"5s\"",
        &[("py", "py", "ok", ", processes = 2")],
    );
    let mut daemon = Process::start(&rig.config, rig.dir.path("kmqd.log"));
    rig.push("py", "hung", r#"{"do": "hang"}"#);
    let children = eventually(Duration::from_secs(30), "both children", || {
        let starts = rig.starts();
        (starts.len() == 2 && !rig.runs().is_empty(), starts)
    });
    daemon.kill9();
    for pid in children {
        wait_dead(pid, "a child of the killed daemon (parent-death signal)");
    }
}

#[test]
fn a_plugin_that_starts_tasks_runs_no_more_at_once_than_the_queues_workers() {
    // The exec plugin takes tasks through `start` (kmq_plugin.h): no worker thread waits per task, so the
    // lane's slots alone keep it to `workers` at once. Its child could hold 20.
    let rig = rig(
        "workers = 3",
        "shutdown_grace = \"1s\"",
        &[("py", "py", "ok", ", processes = 1, concurrency = 20")],
    );
    let daemon = TestDaemon::start(&rig.config);
    // None is ever answered (each is held until a task that is never pushed): with three slots, three reach the
    // child; a fourth slot would bring a fourth. (Held until the task three places after it, as this test had
    // it, let the first answer come when the workers took the jobs out of order, as jobs taken ahead may be.)
    for i in 1..=6 {
        rig.push(
            "py",
            &format!("h{i}"),
            r#"{"do": "hold", "until": "never"}"#,
        );
    }
    eventually(Duration::from_secs(10), "three tasks on the child", || {
        let runs = rig.runs();
        (runs.len() >= 3, runs)
    });
    std::thread::sleep(Duration::from_millis(500));
    let runs = rig.runs();
    assert_eq!(
        runs.len(),
        3,
        "no more than `workers` tasks reach the child: {runs:?}"
    );
    assert_eq!(stats(&rig.config, "jobs").done, 0);
    daemon.stop();
}

/// A progress line for a task the child holds reaches `kmqd task show` while the task runs; a malformed one is
/// logged, and neither the task nor the child suffers for it (docs/HANDLERS.md, "Progress").
#[test]
fn a_progress_line_is_shown_by_task_show_and_a_malformed_one_is_only_logged() {
    let rig = rig(
        "workers = 2",
        "",
        &[("py", "py", "ok", ", processes = 1, concurrency = 2")],
    );
    let daemon = TestDaemon::start(&rig.config);
    rig.push(
        "py",
        "report-7",
        r#"{"do": "progress", "fraction": 0.25, "message": "a quarter", "until": "release"}"#,
    );
    eventually(
        Duration::from_secs(30),
        "task show to print the progress",
        || {
            let out = kmqd_ok(&rig.config, &["task", "show", "jobs", "report-7"]);
            (out.contains("progress 25% (a quarter), reported "), out)
        },
    );
    rig.push("py", "release", r#"{"do": "done"}"#);
    rig.wait_ended(2, 0);
    assert_eq!(rig.starts().len(), 1, "the child was not restarted");
    daemon.stop();
}
