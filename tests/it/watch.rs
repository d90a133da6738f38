//! `kmqd stats --watch` (docs/OPERATIONS.md, "Watching the queues"): the plain `key=value` lines without a
//! terminal, with rates measured from the Redis counters and failures retried, and the full-screen view under a
//! real pty (script(1)), which must leave the terminal as it found it.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;

/// A child process whose standard output and error are collected as they come.
struct Running {
    child: Child,
    stdin: Option<ChildStdin>,
    out: Arc<Mutex<String>>,
    err: Arc<Mutex<String>>,
}

impl Running {
    fn start(command: &mut Command) -> Running {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the command");
        let collect = |mut from: Box<dyn Read + Send>| {
            let text = Arc::new(Mutex::new(String::new()));
            let into = Arc::clone(&text);
            std::thread::spawn(move || {
                let mut buffer = [0u8; 4096];
                while let Ok(n @ 1..) = from.read(&mut buffer) {
                    into.lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&buffer[..n]));
                }
            });
            text
        };
        let out = collect(Box::new(child.stdout.take().unwrap()));
        let err = collect(Box::new(child.stderr.take().unwrap()));
        let stdin = child.stdin.take();
        Running {
            child,
            stdin,
            out,
            err,
        }
    }

    fn out(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    fn err(&self) -> String {
        self.err.lock().unwrap().clone()
    }

    /// The lines printed for `queue` so far.
    fn lines_of(&self, queue: &str) -> Vec<String> {
        let word = format!(" queue={queue} ");
        self.out()
            .lines()
            .filter(|line| line.contains(&word))
            .map(str::to_string)
            .collect()
    }

    fn wait_within(&mut self, within: Duration) -> Option<i32> {
        eventually(within, "the command to exit", || {
            match self.child.try_wait().unwrap() {
                Some(status) => (true, status.code()),
                None => (false, None),
            }
        })
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `key=value` word `key` of a plain line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let prefix = format!("{key}=");
    line.split(' ')
        .find_map(|word| word.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

fn watch_lines(config: &Path, env: &[(&str, &str)]) -> Running {
    Running::start(
        Command::new(env!("CARGO_BIN_EXE_kmqd"))
            .arg("-c")
            .arg(config)
            .args(["stats", "--watch", "--interval", "200ms"])
            .envs(env.iter().copied()),
    )
}

/// Two queues: `jobs` drains a backlog under a daemon, `held` is paused with 7 tasks. The lines show done/s > 0
/// for `jobs` while it drains, the daemon alive on each, `held` paused with its 7 tasks ready at the level they
/// went to; no escape code goes into the pipe (colour on a terminal only); a pause shows at the next poll.
#[test]
fn plain_lines_show_rates_while_draining_and_paused_queues() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 2\n\n\
         [[queues]]\nname = \"held\"\nmode = \"safe\"\npriorities = [\"high\", \"low\"]\n",
    );
    let (code, _, err) = kmqd(
        &["-c", config.to_str().unwrap(), "queue", "pause", "held"],
        None,
    );
    assert_eq!(code, 0, "{err}");
    let tasks = (0..7).map(|i| {
        kmqd::NewTask::new("test", "{}")
            .unwrap()
            .id(format!("h{i}"))
            .priority("low")
    });
    client(&config).push_batch("held", tasks).unwrap();
    push_many(&config, "t", 300, r#"{"sleep_ms": 10}"#);
    let daemon = TestDaemon::start(&config);

    let watch = watch_lines(&config, &[]);
    let draining = eventually(Duration::from_secs(30), "done/s > 0 for jobs", || {
        let lines = watch.lines_of("jobs");
        let found = lines.iter().find(|line| {
            field(line, "done/s")
                .parse::<f64>()
                .is_ok_and(|rate| rate > 0.0)
        });
        (found.is_some(), found.cloned().or(lines.last().cloned()))
    });
    let draining = draining.unwrap();
    println!("{draining}");
    assert_eq!(field(&draining, "mode"), "safe");
    assert_eq!(field(&draining, "paused"), "no");
    assert_eq!(field(&draining, "daemons"), "1");
    assert_eq!(field(&draining, "failed/s"), "0.0");
    // A sample's lines come one queue after another: `held`'s line of the sample that showed `jobs` draining may
    // not be read yet, and its first sample has no rate ("-").
    let held = eventually(Duration::from_secs(10), "a rate for held", || {
        let last = watch.lines_of("held").last().cloned();
        (
            last.as_ref()
                .is_some_and(|line| field(line, "done/s") != "-"),
            last,
        )
    })
    .unwrap();
    assert_eq!(
        [
            field(&held, "paused"),
            field(&held, "ready"),
            field(&held, "ready_by_level"),
            field(&held, "done/s")
        ],
        ["yes", "7", "high:0,low:7", "0.0"],
        "{held}"
    );
    assert_ne!(field(&held, "lag_ms"), "-", "{held}");

    let (code, _, err) = kmqd(
        &["-c", config.to_str().unwrap(), "queue", "pause", "jobs"],
        None,
    );
    assert_eq!(code, 0, "{err}");
    eventually(Duration::from_secs(10), "jobs shown paused", || {
        let last = watch.lines_of("jobs").last().cloned().unwrap_or_default();
        (field(&last, "paused") == "yes", last)
    });
    assert!(!watch.out().contains('\x1b'), "{:?}", watch.out());
    assert_eq!(watch.err(), "");
    daemon.stop();
}

/// A Redis that goes away is reported on standard error and waited for; the lines come back with it.
#[test]
fn plain_lines_wait_out_a_redis_that_is_down() {
    let mut redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue(""));
    push_many(&config, "t", 3, "{}");
    let watch = watch_lines(&config, &[]);
    eventually(Duration::from_secs(10), "a first line", || {
        (watch.lines_of("jobs").len() == 1, watch.out())
    });
    redis.stop(Signal::Kill);
    eventually(Duration::from_secs(30), "the failure reported", || {
        (watch.err().contains("(retrying)"), watch.err())
    });
    redis.restart();
    let before = watch.lines_of("jobs").len();
    eventually(Duration::from_secs(30), "lines again", || {
        (watch.lines_of("jobs").len() > before, watch.out())
    });
    println!("{}", watch.err());
    assert!(watch.err().starts_with("kmqd: "), "{}", watch.err());
}

/// The full-screen view under a real pty: it takes the alternate screen and draws the table (in colour: the
/// header in reverse video); q quits with 0 and the terminal is back in cooked mode with echo (stty -a run in
/// the same pty after it), on the main screen with its cursor. With NO_COLOR set, the same view has no colour.
#[test]
fn screen_quits_on_q_and_restores_the_terminal() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue(""));
    push_many(&config, "t", 3, "{}");
    for no_color in ["", "1"] {
        let script = format!(
            "stty rows 24 cols 80; {} -c {} stats --watch --interval 200ms; echo exit=$?; stty -a",
            env!("CARGO_BIN_EXE_kmqd"),
            config.display()
        );
        let mut view = Running::start(
            Command::new("script")
                .args(["-qfec", &script, "/dev/null"])
                .env("NO_COLOR", no_color),
        );
        eventually(Duration::from_secs(20), "the table drawn", || {
            let out = view.out();
            (out.contains("\x1b[?1049h") && out.contains("jobs "), out)
        });
        view.stdin.as_mut().unwrap().write_all(b"q").unwrap();
        assert_eq!(view.wait_within(Duration::from_secs(20)), Some(0));
        let out = view.out();
        let (screen, after) = out.split_once("exit=").expect("the view exited");
        println!("{screen:?}");
        assert!(after.starts_with('0'), "{after}");
        assert!(
            screen.ends_with("\x1b[?25h\x1b[?1049l"),
            "cursor shown, main screen: {screen:?}"
        );
        let modes: Vec<&str> = after.split_whitespace().collect();
        for mode in ["icanon", "echo", "isig", "opost"] {
            assert!(modes.contains(&mode), "{mode} restored: {after}");
        }
        assert!(screen.contains("QUEUE      MODE    STATE"), "{screen:?}");
        assert_eq!(
            screen.contains("\x1b[7mQUEUE"),
            no_color.is_empty(),
            "colour unless NO_COLOR is set: {screen:?}"
        );
    }
}
