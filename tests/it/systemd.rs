//! Under systemd: the notify protocol as the real binary speaks it to a `NOTIFY_SOCKET` of the test's own (what
//! systemd would read), and the unit file as `systemd-analyze` judges it.

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::proxy::FaultProxy;
use crate::support::*;

/// The lines the daemon sent to the test's notify socket, each with when it arrived.
struct NotifySocket {
    socket: UnixDatagram,
    lines: Vec<(Instant, String)>,
}

impl NotifySocket {
    fn bind(path: &Path) -> NotifySocket {
        let socket = UnixDatagram::bind(path).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        NotifySocket {
            socket,
            lines: Vec::new(),
        }
    }

    /// Reads what arrived (waiting at most 20 ms); returns the new lines.
    fn poll(&mut self) -> Vec<String> {
        let mut buf = [0u8; 4096];
        let mut new = Vec::new();
        while let Ok(n) = self.socket.recv(&mut buf) {
            let at = Instant::now();
            for line in String::from_utf8_lossy(&buf[..n]).lines() {
                self.lines.push((at, line.to_string()));
                new.push(line.to_string());
            }
            self.socket
                .set_read_timeout(Some(Duration::from_millis(1)))
                .unwrap();
        }
        self.socket
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        new
    }

    /// Reads until a line satisfies `wanted` (returns it) or `within` passes (panics, with every line seen).
    fn wait_for(&mut self, within: Duration, what: &str, wanted: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(line) = self.poll().into_iter().find(|line| wanted(line)) {
                return line;
            }
        }
        panic!("no {what} within {within:?}; seen: {:?}", self.texts());
    }

    /// Reads for `window`; returns the lines that arrived meanwhile.
    fn read_for(&mut self, window: Duration) -> Vec<String> {
        let until = Instant::now() + window;
        let mut lines = Vec::new();
        while Instant::now() < until {
            lines.extend(self.poll());
        }
        lines
    }

    fn texts(&self) -> Vec<&str> {
        self.lines.iter().map(|(_, line)| line.as_str()).collect()
    }
}

fn pings(lines: &[String]) -> usize {
    lines.iter().filter(|line| *line == "WATCHDOG=1").count()
}

/// Starts kmqd on `config` as systemd would with `WatchdogSec` (400 ms: a ping every 200 ms), its notify
/// messages going to a socket of the test's own.
fn under_a_watchdog(dir: &TestDir, config: &Path) -> (NotifySocket, Process) {
    let socket_path = dir.path("notify.sock");
    let notify = NotifySocket::bind(&socket_path);
    let daemon = Process::start_with_env(
        config,
        dir.path("kmqd.log"),
        &[
            ("NOTIFY_SOCKET", socket_path.to_str().unwrap()),
            ("WATCHDOG_USEC", "400000"),
        ],
    );
    (notify, daemon)
}

#[test]
fn notify_says_ready_only_once_redis_answers_pings_while_healthy_and_stops_when_every_worker_is_stuck()
 {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    proxy.refuse(true);
    let dir = TestDir::new();
    let config = dir.config_for_url(
        &proxy.url(),
        "shutdown_grace = \"1s\"",
        &safe_queue(
            "workers = 1\nexecution_timeout = \"300ms\"\nretry_times = 0\nlease_timeout = \"5s\"",
        ),
    );
    let (mut notify, mut daemon) = under_a_watchdog(&dir, &config);

    // Redis down: the daemon says what it waits for, and is not ready.
    let waiting = notify.wait_for(Duration::from_secs(10), "waiting status", |line| {
        line.starts_with("STATUS=waiting for Redis at ")
    });
    assert!(waiting.contains(&proxy.url()), "{waiting}");
    let meanwhile = notify.read_for(Duration::from_secs(1));
    assert!(
        !notify.texts().contains(&"READY=1"),
        "ready while Redis refuses every connection: {:?}; log: {}",
        notify.texts(),
        daemon.log_text()
    );
    assert_eq!(pings(&meanwhile), 0, "no watchdog before it is ready");

    proxy.refuse(false);
    let redis_up = Instant::now();
    notify.wait_for(Duration::from_secs(15), "READY=1", |line| line == "READY=1");
    // READY=1 comes with the first serving status, in the same message.
    notify.poll();
    let ready_at = notify
        .lines
        .iter()
        .position(|(at, line)| line == "READY=1" && *at >= redis_up)
        .expect("READY=1 after Redis came up");
    let status = &notify.lines[ready_at + 1].1;
    assert_eq!(status, "STATUS=serving 1 queue, 0 tasks held");

    // Idle and healthy: a ping every 200 ms.
    let healthy = notify.read_for(Duration::from_secs(2));
    assert!(pings(&healthy) >= 5, "pings while idle: {healthy:?}");

    // A handler that ignores its cancel flag: past execution_timeout (and a second more) its worker is stuck, and
    // with one worker the queue is wedged.
    push_many(
        &config,
        "stuck",
        1,
        r#"{"until_cancelled":true,"ignore_cancel":true}"#,
    );
    let wedged = notify.wait_for(Duration::from_secs(10), "wedged status", |line| {
        line.starts_with("STATUS=wedged")
    });
    assert!(
        wedged.contains("every worker (1) is stuck in a handler"),
        "{wedged}"
    );
    let after = notify.read_for(Duration::from_secs(2));
    assert_eq!(
        pings(&after),
        0,
        "pings while every worker is stuck: {after:?}"
    );
    let log = daemon.log_text();
    assert_eq!(
        log.matches("watchdog: the daemon is wedged").count(),
        1,
        "said once: {log}"
    );

    daemon.signal(15);
    let stopping = notify.wait_for(Duration::from_secs(10), "STOPPING=1", |line| {
        line == "STOPPING=1"
    });
    assert_eq!(stopping, "STOPPING=1");
    assert_eq!(daemon.wait_within(Duration::from_secs(30)), Some(0));
    notify.poll();
    eprintln!("notify messages seen: {:?}", dedup_pings(&notify.texts()));
}

#[test]
fn the_watchdog_keeps_pinging_through_a_redis_outage_longer_than_every_bound() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    // Short timeouts, so that the outage below outlasts both bounds (fetcher 11.3 s, acker 8.15 s: see
    // `notify::lane_bounds`): waiting for Redis must never count as wedged, or systemd would restart a daemon
    // that is right to wait.
    let config = dir.config_raw(
        &format!(
            "url = \"{}\"\nio_timeout = \"1s\"\nconnect_timeout = \"1s\"",
            proxy.url()
        ),
        "shutdown_grace = \"5s\"",
        &safe_queue("workers = 1\nlease_timeout = \"60s\""),
    );
    let (mut notify, mut daemon) = under_a_watchdog(&dir, &config);
    notify.wait_for(Duration::from_secs(15), "READY=1", |line| line == "READY=1");
    // A run that ends during the outage: its outcome waits for Redis in the acker, which retries.
    push_many(&config, "t", 1, r#"{"sleep_ms":1000}"#);
    eventually(Duration::from_secs(10), "the run to start", || {
        (dir.records().starts.len() == 1, ())
    });
    proxy.refuse(true);
    let outage = Duration::from_secs(14);
    let started = Instant::now();
    let mut last_ping = Instant::now();
    let mut longest_gap = Duration::ZERO;
    while started.elapsed() < outage {
        if notify.poll().iter().any(|line| line == "WATCHDOG=1") {
            longest_gap = longest_gap.max(last_ping.elapsed());
            last_ping = Instant::now();
        }
    }
    longest_gap = longest_gap.max(last_ping.elapsed());
    let log = daemon.log_text();
    assert!(
        log.contains("cannot settle outcomes") && log.contains("fetching tasks: Redis not reached"),
        "both the acker and the fetcher met the outage: {log}"
    );
    assert!(!log.contains("wedged"), "{log}");
    assert!(
        longest_gap < Duration::from_secs(2),
        "pings stopped for {longest_gap:?} while Redis was down"
    );
    proxy.refuse(false);
    wait_done(&config, 1, Duration::from_secs(20));
    daemon.signal(15);
    assert_eq!(daemon.wait_within(Duration::from_secs(30)), Some(0));
}

/// The monitor runs the final-failure hooks of the tasks it dead-letters. One that never returns leaves it still,
/// and then no lease that runs out is recovered by this daemon: the watchdog sees it (the monitor's bound), and
/// stops pinging while the queue's own stages go on.
#[test]
fn a_final_failure_hook_that_never_returns_wedges_the_monitor_and_the_watchdog_sees_it() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    // Short timeouts and lease, so that the monitor's bound is short: a pass every 250 ms (a quarter of the
    // lease), four calls of 1 s + 100 ms, and the 5 s backoff: 9.35 s.
    let config = dir.config_raw(
        &format!(
            "url = \"{}\"\nio_timeout = \"1s\"\nconnect_timeout = \"1s\"",
            redis.url()
        ),
        "shutdown_grace = \"2s\"",
        &safe_queue("workers = 1\nlease_timeout = \"1s\"\nalive_timeout = \"1m\""),
    );
    let (mut notify, mut daemon) = under_a_watchdog(&dir, &config);
    notify.wait_for(Duration::from_secs(15), "READY=1", |line| line == "READY=1");
    let healthy = notify.read_for(Duration::from_secs(1));
    assert!(pings(&healthy) >= 3, "pings while idle: {healthy:?}");
    // What a daemon that died would leave: an owner whose lease ran out, holding a task older than
    // alive_timeout, which the monitor dead-letters; its final-failure hook then sleeps for ten minutes.
    let envelope = r#"{"id":"old","type":"test","data":{"dead_sleep_ms":600000},"attempt":0,"created_at":1000}"#;
    let _: i64 = redis.cmd(&["HSET", "kmq:{jobs}:processing:ghost:normal", "1", envelope]);
    let _: i64 = redis.cmd(&["ZADD", "kmq:{jobs}:owners", "1", "ghost"]);
    let wedged = notify.wait_for(Duration::from_secs(30), "wedged status", |line| {
        line.starts_with("STATUS=wedged")
    });
    assert!(wedged.contains("the monitor has not moved for"), "{wedged}");
    let after = notify.read_for(Duration::from_secs(1));
    assert_eq!(pings(&after), 0, "pings while the monitor hangs: {after:?}");
    let log = daemon.log_text();
    assert_eq!(
        log.matches("watchdog: the daemon is wedged").count(),
        1,
        "said once: {log}"
    );
    assert!(log.contains("the monitor has not moved"), "{log}");
    // The hook would hold a graceful shutdown for its ten minutes (plugins are shut down after their last
    // hook): what systemd does after WatchdogSec, a kill.
    daemon.kill9();
}

/// Runs a program under the kernel's refusal of writable-and-executable memory (`prctl(PR_SET_MDWE,
/// PR_MDWE_REFUSE_EXEC_GAIN)`, Linux 6.3+: what `MemoryDenyWriteExecute=yes` applies, and which a child inherits
/// across fork and exec), without a running systemd. python3 does the prctl, so the tests stay free of unsafe code.
const MDWE_WRAPPER: &str = r#"
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_MDWE) refused: errno %d" % ctypes.get_errno())
os.execv(sys.argv[1], sys.argv[1:])
"#;

/// An exec handler: "plain" succeeds; "wx" asks for a writable and executable page, as a JIT does.
const WX_HANDLER: &str = r#"
import json, mmap, sys
if json.load(sys.stdin) == "wx":
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
"#;

#[test]
fn plugins_load_and_exec_handlers_run_under_memory_deny_write_execute() {
    let Some(python) = ["/usr/bin/python3", "/usr/local/bin/python3"]
        .into_iter()
        .find(|path| Path::new(path).exists())
    else {
        eprintln!("SKIPPED: no python3 to apply PR_SET_MDWE with");
        return;
    };
    let dir = TestDir::new();
    let wrapper = dir.path("mdwe.py");
    std::fs::write(&wrapper, MDWE_WRAPPER).unwrap();
    let probe = Command::new(python)
        .arg(&wrapper)
        .arg("/bin/true")
        .output()
        .unwrap();
    if !probe.status.success() {
        eprintln!(
            "SKIPPED: this kernel has no PR_SET_MDWE (Linux 6.3+): {}",
            String::from_utf8_lossy(&probe.stderr)
        );
        return;
    }
    let redis = RedisServer::start();
    dir.install_plugin(&built_plugin("kmq-exec"), "libkmq_exec.so");
    let handler = dir.path("handler.py");
    std::fs::write(&handler, WX_HANDLER).unwrap();
    let config = dir.config(
        &redis,
        &format!(
            "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nretry_times = 0\n\n\
             [plugins.exec]\nfile = \"libkmq_exec.so\"\n\
             config = {{ command = \"{python}\", args = [\"{}\"], timeout = \"30s\", types = [\"py\"] }}\n",
            handler.display()
        ),
    );
    // The real binary, as systemd would start it with MemoryDenyWriteExecute=yes: the testkit and exec plugins
    // load (dlopen maps no page both writable and executable), and the exec plugin's commands inherit the rule.
    let log = dir.path("kmqd.log");
    let out = std::fs::File::create(&log).unwrap();
    let child = Command::new(python)
        .arg(&wrapper)
        .arg(env!("CARGO_BIN_EXE_kmqd"))
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "kmqd=debug")
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap();
    let mut daemon = Process { child, log };
    let client = client(&config);
    for (id, kind, data) in [
        ("testkit", "test", "{}"),
        ("plain", "py", r#""plain""#),
        ("wx", "py", r#""wx""#),
    ] {
        client
            .push("jobs", kmqd::NewTask::new(kind, data).unwrap().id(id))
            .unwrap();
    }
    let s = eventually(Duration::from_secs(30), "the three tasks to end", || {
        let s = stats(&config, "jobs");
        (s.done + s.dead == 3, s)
    });
    assert_eq!(
        (s.done, s.dead),
        (2, 1),
        "only the handler that wants W+X memory fails: {s:?}\n{}",
        daemon.log_text()
    );
    let dead: Vec<String> = redis.cmd(&["LRANGE", "kmq:{jobs}:dead", "0", "-1"]);
    assert!(
        dead.len() == 1 && dead[0].contains(r#""id":"wx""#) && dead[0].contains("PermissionError"),
        "the W+X request was refused, so the rule was in force: {dead:?}"
    );
    daemon.signal(15);
    assert_eq!(daemon.wait_within(Duration::from_secs(30)), Some(0));
}

/// The lines seen, runs of WATCHDOG=1 shown as one with their count (for the test's output).
fn dedup_pings(lines: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut run = 0;
    for line in lines {
        if *line == "WATCHDOG=1" {
            run += 1;
            continue;
        }
        if run > 0 {
            out.push(format!("WATCHDOG=1 x{run}"));
            run = 0;
        }
        out.push(line.to_string());
    }
    if run > 0 {
        out.push(format!("WATCHDOG=1 x{run}"));
    }
    out
}

/// `systemd-analyze`, or why it is missing (scripts/test installs it: scripts/common.sh `ensure_systemd_analyze`).
fn systemd_analyze() -> Option<Command> {
    let found = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success());
    if found {
        return Some(Command::new("systemd-analyze"));
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "systemd-analyze is missing in CI: scripts/test installs it (Debian's systemd package)"
    );
    eprintln!(
        "SKIPPED: systemd-analyze not found; `apt-get install systemd` (scripts/test does) to check the unit"
    );
    None
}

/// "→ Overall exposure level for kmqd.service: 1.4 OK 🙂" → 1.4.
fn exposure(report: &str) -> Option<f64> {
    let line = report
        .lines()
        .find(|line| line.contains("Overall exposure level for kmqd.service:"))?;
    line.split(':')
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[test]
fn the_unit_file_verifies_and_its_exposure_is_at_most_2() {
    let Some(_) = systemd_analyze() else {
        return;
    };
    let unit = workspace_dir().join("systemd/kmqd.service");
    let text = std::fs::read_to_string(&unit).unwrap();
    for line in [
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=30s",
        "RestartPreventExitStatus=2",
        "EnvironmentFile=-/etc/default/kmqd",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing from the unit"
        );
    }

    // `verify` checks that ExecStart's binary exists and is executable: a copy of the unit that runs the
    // binary these tests built, named kmqd.service (verify takes the unit's name from the file's).
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("kmqd.service");
    std::fs::write(
        &copy,
        text.replace("/usr/bin/kmqd", env!("CARGO_BIN_EXE_kmqd")),
    )
    .unwrap();
    let verified = systemd_analyze()
        .unwrap()
        .arg("verify")
        .arg(&copy)
        .output()
        .unwrap();
    let complaints = String::from_utf8_lossy(&verified.stderr);
    assert!(
        verified.status.success() && complaints.trim().is_empty(),
        "systemd-analyze verify: {}\n{complaints}",
        verified.status
    );

    // `security --offline=true` rates the unit file itself, with no running systemd (a container).
    let rated = systemd_analyze()
        .unwrap()
        .args(["security", "--offline=true", "--no-pager"])
        .arg(&unit)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&rated.stdout);
    let score = exposure(&report).unwrap_or_else(|| {
        panic!(
            "no exposure level in: {report}{}",
            String::from_utf8_lossy(&rated.stderr)
        )
    });
    assert!(score <= 2.0, "exposure {score} above 2.0:\n{report}");
    eprintln!("systemd-analyze security --offline=true systemd/kmqd.service: {score}");
}

#[test]
fn the_exposure_line_parses() {
    assert_eq!(
        exposure("  x\n→ Overall exposure level for kmqd.service: 1.4 OK 🙂\n"),
        Some(1.4)
    );
    assert_eq!(
        exposure("→ Overall exposure level for kmqd.service: 8.0 EXPOSED 🙁"),
        Some(8.0)
    );
    assert_eq!(exposure("nothing"), None);
}

#[test]
fn a_reload_says_reloading_with_its_monotonic_time_then_ready() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue("workers = 1"));
    let socket_path = dir.path("notify.sock");
    let mut notify = NotifySocket::bind(&socket_path);
    let mut daemon = Process::start_with_env(
        &config,
        dir.path("kmqd.log"),
        &[("NOTIFY_SOCKET", socket_path.to_str().unwrap())],
    );
    notify.wait_for(Duration::from_secs(15), "READY=1", |line| line == "READY=1");
    assert!(!notify.texts().contains(&"RELOADING=1"));
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("workers = 1", "workers = 2")).unwrap();
    daemon.signal(1);
    eventually(Duration::from_secs(15), "RELOADING=1, then READY=1", || {
        notify.poll();
        let lines = notify.texts();
        let reloading = lines.iter().position(|l| *l == "RELOADING=1");
        let ready_after = reloading.is_some_and(|at| lines[at..].contains(&"READY=1"));
        (ready_after, format!("{lines:?}"))
    });
    notify.read_for(Duration::from_millis(100));
    let lines = notify.texts();
    let reloading = lines.iter().position(|l| *l == "RELOADING=1").unwrap();
    // Sent with RELOADING=1, in the same message (sd_notify(3)): the clock systemd compares it with.
    let usec = lines[reloading + 1]
        .strip_prefix("MONOTONIC_USEC=")
        .unwrap_or_else(|| panic!("MONOTONIC_USEC= follows RELOADING=1: {lines:?}"));
    assert!(usec.parse::<u64>().unwrap() > 0);
    assert!(
        lines[reloading..].contains(&"STATUS=serving 1 queue, 0 tasks held"),
        "the old lane finishing is not another queue: {lines:?}"
    );
    assert!(!lines.iter().any(|l| l.contains("2 queues")), "{lines:?}");
    assert!(daemon.log_text().contains("queues.jobs.workers 1 → 2"));
    daemon.signal(15);
    assert_eq!(daemon.wait_within(Duration::from_secs(30)), Some(0));
}
