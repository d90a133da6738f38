//! `testkit`: a plugin whose behaviour each task chooses through its `data`. Used by kmqd's tests and benchmarks.
//!
//! `data` is any JSON; when it is an object these keys are read (all optional):
//! - `sleep_ms`: sleep this long first, in steps of at most 20 ms (the last one only as long as what is left, so
//!   that a 1 ms sleep takes 1 ms), stopping early when the host cancels the run;
//! - `sleep_us`: as `sleep_ms`, in microseconds (added to it): benchmarks of I/O-bound handlers;
//! - `spin_us`: then keep the CPU busy this long (a CPU-bound handler), stopping early when cancelled;
//! - `wait_for_file`: block until this path exists, or until the run is cancelled;
//! - `until_cancelled`: block until the host cancels the run (execution timeout, shutdown);
//! - `ignore_cancel`: make the blocking behaviours above ignore the cancel flag (a misbehaving handler);
//! - `outcome`: `"done"` (default), `"retry"`, `"fail"`, `"throttle"` (for `throttle_ms`, default 1000),
//!   `"panic"`, or `"abort"` (the whole daemon process aborts: a poison pill);
//! - `throttle_once`: a path; a run that finds it absent creates it and throttles for `throttle_ms` (a 429 from
//!   an upstream that recovers), and later runs go on to `outcome`;
//! - `fail_attempts`: answer `retry` while `attempt < fail_attempts`, then `outcome`;
//! - `retry_after_ms`: the delay a `retry` asks for;
//! - `dead_sleep_ms`: `on_dead` sleeps this long before it records the dead letter (a slow final-failure hook);
//! - `output`: a `"done"` outcome comes with this output (`Outcome::DoneWithOutput`);
//! - `result`: a `"done"` outcome comes with this JSON as its result (`Outcome::DoneWithResult`);
//! - `progress_flood`: first of all, report progress this many times (`item N`, fraction N / the count), each
//!   followed by a sleep of `progress_pause_us` (default none): a handler that reports per item;
//! - `progress`: then report this `[fraction, "message"]` (`Task::progress`), before the sleeps and waits above.
//!
//! Config: `record` (a file path): every run appends `start <id> <attempt> <type> <unix µs>` when it begins and
//! `end <id> <attempt> <outcome>` when it returns (and, for a task of a flow that waited for others,
//! `after <id> <its dependencies' outcomes, the JSON list>` right after its `start`), `dead <id> <attempt> <reason>` from `on_dead`, and `shutdown`
//! from the plugin's shutdown, one `write` per line so concurrent lines never interleave.
//! `end_times` (default false): the `end` lines of handled runs carry the time too, `end <id> <attempt>
//! <outcome> <unix µs>`, so that a benchmark can split a cycle into the handler's run and the rest (tests that
//! read the outcome as the line's last word leave it off).
//! `types` (default `["test"]`): the task types to claim.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use kmq_plugin::{Handler, Outcome, Task};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default)]
    record: Option<String>,
    #[serde(default)]
    types: Vec<String>,
    #[serde(default)]
    end_times: bool,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Behaviour {
    sleep_ms: u64,
    sleep_us: u64,
    spin_us: u64,
    wait_for_file: Option<String>,
    until_cancelled: bool,
    ignore_cancel: bool,
    outcome: Option<String>,
    fail_attempts: u32,
    retry_after_ms: Option<u64>,
    throttle_ms: Option<u64>,
    throttle_once: Option<String>,
    dead_sleep_ms: u64,
    output: Option<String>,
    result: Option<kmq_plugin::serde_json::Value>,
    progress_flood: u32,
    progress_pause_us: u64,
    progress: Option<(f32, String)>,
}

struct Testkit {
    record: Option<File>,
    types: Vec<String>,
    /// `end` lines carry the time (config `end_times`).
    end_times: bool,
}

/// The wall clock in µs since the Unix epoch: the records' times, comparable across daemons of one host.
fn unix_us() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_micros())
}

/// How often blocking behaviours look at the cancel flag.
const POLL: Duration = Duration::from_millis(2);

/// The longest step of a sleep between two looks at the cancel flag. A sleep models an I/O-bound handler, which
/// wakes once when its I/O completes: with 2 ms steps a 10 ms task woke five times, and 512 such workers spent
/// more CPU on those wake-ups than the daemon on their tasks (docs/PERFORMANCE.md, "Real handlers"). A
/// cancelled sleep still ends within one step.
const SLEEP_STEP: Duration = Duration::from_millis(20);

impl Testkit {
    /// Appends a line to the record file, if there is one; `line` is only formatted then, so that a testkit
    /// without a record file costs a handler call and nothing more (benchmarks measure kmqd, not the testkit).
    fn record(&self, line: impl FnOnce() -> String) {
        if let Some(mut file) = self.record.as_ref() {
            // A failed record write must not pass for a handled task: the test reading the file would be misled.
            file.write_all(line().as_bytes())
                .expect("testkit: cannot append to the record file");
        }
    }

    fn block_until(&self, task: &Task<'_>, behaviour: &Behaviour, mut done: impl FnMut() -> bool) {
        while !done() && (behaviour.ignore_cancel || !task.is_cancelled()) {
            std::thread::sleep(POLL);
        }
    }

    fn run(&self, task: &Task<'_>) -> Outcome {
        // No-op tasks (benchmarks push plain numbers) skip JSON work entirely.
        if !task.data_json().starts_with('{') {
            return Outcome::Done;
        }
        let behaviour: Behaviour = match task.data() {
            Ok(behaviour) => behaviour,
            Err(error) => return Outcome::fail(format!("testkit: bad data: {error}")),
        };
        for n in 0..behaviour.progress_flood {
            task.progress(
                n as f32 / behaviour.progress_flood as f32,
                &format!("item {n}"),
            );
            if behaviour.progress_pause_us > 0 {
                std::thread::sleep(Duration::from_micros(behaviour.progress_pause_us));
            }
        }
        if let Some((fraction, message)) = &behaviour.progress {
            task.progress(*fraction, message);
        }
        let sleep =
            Duration::from_millis(behaviour.sleep_ms) + Duration::from_micros(behaviour.sleep_us);
        if !sleep.is_zero() {
            sleep_until(task, &behaviour, Instant::now() + sleep);
        }
        if behaviour.spin_us > 0 {
            let until = Instant::now() + Duration::from_micros(behaviour.spin_us);
            while Instant::now() < until && (behaviour.ignore_cancel || !task.is_cancelled()) {
                std::hint::spin_loop();
            }
        }
        if let Some(path) = &behaviour.wait_for_file {
            self.block_until(task, &behaviour, || Path::new(path).exists());
        }
        if behaviour.until_cancelled {
            self.block_until(task, &behaviour, || false);
        }
        if let Some(path) = &behaviour.throttle_once {
            // `create_new`: of two runs that race, one throttles.
            if File::options()
                .write(true)
                .create_new(true)
                .open(path)
                .is_ok()
            {
                return throttle(&behaviour);
            }
        }
        if task.attempt() < behaviour.fail_attempts {
            return retry(
                &behaviour,
                format!("testkit: failing attempt {}", task.attempt()),
            );
        }
        match behaviour.outcome.as_deref().unwrap_or("done") {
            "done" => match behaviour.result.clone() {
                Some(result) => Outcome::done_with_result(result),
                None => Outcome::done_with_output(behaviour.output.clone().unwrap_or_default()),
            },
            "retry" => retry(&behaviour, "testkit: asked to retry".to_string()),
            "fail" => Outcome::fail("testkit: asked to fail"),
            "throttle" => throttle(&behaviour),
            "panic" => panic!("testkit: asked to panic (task {})", task.id()),
            "abort" => {
                self.record(|| format!("end {} {} abort\n", task.id(), task.attempt()));
                std::process::abort()
            }
            other => Outcome::fail(format!("testkit: unknown outcome {other:?}")),
        }
    }
}

/// Sleeps until `until` in steps of at most [`SLEEP_STEP`], looking at the cancel flag between steps; the last step
/// sleeps only what is left, so a sleep shorter than a step is as precise as the OS's timer.
fn sleep_until(task: &Task<'_>, behaviour: &Behaviour, until: Instant) {
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || (!behaviour.ignore_cancel && task.is_cancelled()) {
            return;
        }
        std::thread::sleep(left.min(SLEEP_STEP));
    }
}

fn throttle(behaviour: &Behaviour) -> Outcome {
    let after = Duration::from_millis(behaviour.throttle_ms.unwrap_or(1000));
    Outcome::throttle_because(after, "testkit: asked to throttle")
}

fn retry(behaviour: &Behaviour, reason: String) -> Outcome {
    match behaviour.retry_after_ms {
        Some(ms) => Outcome::retry_after(Duration::from_millis(ms), reason),
        None => Outcome::retry(reason),
    }
}

impl Handler for Testkit {
    const NAME: &'static str = "testkit";
    type Config = Config;

    fn init(config: Config) -> Result<Testkit, String> {
        let record = match &config.record {
            Some(path) => Some(
                File::options()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|error| format!("cannot open record file {path}: {error}"))?,
            ),
            None => None,
        };
        let types = if config.types.is_empty() {
            vec!["test".to_string()]
        } else {
            config.types
        };
        Ok(Testkit {
            record,
            types,
            end_times: config.end_times,
        })
    }

    fn types(&self) -> Vec<String> {
        self.types.clone()
    }

    fn handle(&self, task: &Task<'_>) -> Outcome {
        self.record(|| {
            format!(
                "start {} {} {} {}\n",
                task.id(),
                task.attempt(),
                task.kind(),
                unix_us()
            )
        });
        // A task of a flow: what it waited for, as the host hands it on (`Task::dependencies`), on one line.
        if let Some(after) = task.dependencies() {
            self.record(|| format!("after {} {}\n", task.id(), after.replace(['\n', '\r'], " ")));
        }
        let outcome =
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run(task))) {
                Ok(outcome) => outcome,
                Err(panic) => {
                    self.record(|| format!("end {} {} panic\n", task.id(), task.attempt()));
                    // Re-raise: the SDK's own catch_unwind is what is under test.
                    std::panic::resume_unwind(panic)
                }
            };
        let label = match &outcome {
            Outcome::Done | Outcome::DoneWithOutput { .. } | Outcome::DoneWithResult { .. } => {
                "done"
            }
            Outcome::Retry { .. } => "retry",
            Outcome::Fail { .. } => "fail",
            Outcome::Throttle { .. } => "throttle",
        };
        self.record(|| {
            let (id, attempt) = (task.id(), task.attempt());
            if self.end_times {
                format!("end {id} {attempt} {label} {}\n", unix_us())
            } else {
                format!("end {id} {attempt} {label}\n")
            }
        });
        outcome
    }

    fn on_dead(&self, task: &Task<'_>, reason: &str) {
        if task.data_json().starts_with('{') {
            if let Ok(behaviour) = task.data::<Behaviour>() {
                std::thread::sleep(Duration::from_millis(behaviour.dead_sleep_ms));
            }
        }
        self.record(|| {
            format!(
                "dead {} {} {}\n",
                task.id(),
                task.attempt(),
                reason.replace('\n', " ")
            )
        });
    }

    fn shutdown(&self) {
        self.record(|| "shutdown\n".to_string());
    }
}

kmq_plugin::export!(Testkit);

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use kmq_plugin::testing::{Harness, RunResult, Status, TestTask};

    /// A harness around this crate's exported symbol, recording into a file of `dir`.
    fn harness(dir: &tempfile::TempDir) -> Harness {
        let config = serde_json::json!({ "record": dir.path().join("runs.log") }).to_string();
        Harness::new(crate::kmq_plugin_v1, &config).expect("testkit loads")
    }

    fn records(dir: &tempfile::TempDir) -> String {
        std::fs::read_to_string(dir.path().join("runs.log")).unwrap_or_default()
    }

    /// Polls the record file until `condition` holds; panics after 10 s with what it last read.
    fn wait_for_records(dir: &tempfile::TempDir, what: &str, condition: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = records(dir);
            if condition(&text) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; records:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn run(harness: &Harness, data: &str) -> RunResult {
        harness.run(TestTask::new("test", data))
    }

    #[test]
    fn types_default_to_test_and_come_from_the_config() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(harness(&dir).types(), ["test"]);
        let custom = Harness::new(crate::kmq_plugin_v1, r#"{"types": ["a.b", "c"]}"#).unwrap();
        assert_eq!(
            (custom.name(), custom.types()),
            ("testkit", &["a.b".to_string(), "c".to_string()][..])
        );
    }

    #[test]
    fn end_times_add_the_end_time_to_an_end_line_after_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("runs.log");
        let config = serde_json::json!({ "record": log, "end_times": true }).to_string();
        let timed = Harness::new(crate::kmq_plugin_v1, &config).expect("testkit loads");
        run(&timed, r#"{"sleep_ms":2}"#);
        let text = records(&dir);
        let time = |kind: &str, at: usize| -> u128 {
            let line = text.lines().find(|l| l.starts_with(kind)).expect(kind);
            line.split(' ').nth(at).unwrap().parse().expect(line)
        };
        let (start, end) = (time("start ", 4), time("end ", 4));
        assert!(end >= start + 2_000, "{text}");
        // Without the key the outcome stays the line's last word, as the tests read it.
        let plain = tempfile::tempdir().unwrap();
        run(&harness(&plain), "1");
        assert!(
            records(&plain).contains("end test-task 0 done\n"),
            "{}",
            records(&plain)
        );
    }

    #[test]
    fn an_unknown_config_key_fails_init_with_the_plugin_name() {
        let error = Harness::new(crate::kmq_plugin_v1, r#"{"recrod": "/tmp/x"}"#)
            .err()
            .expect("refused");
        assert!(
            error.starts_with(
                "init failed: invalid config for plugin testkit: unknown field `recrod`"
            ),
            "{error}"
        );
    }

    #[test]
    fn each_outcome_crosses_the_abi_with_its_message() {
        let dir = tempfile::tempdir().unwrap();
        let harness = harness(&dir);
        let check = |data: &str, status: Status, message: &str, retry_after: Option<u64>| {
            let result = run(&harness, data);
            assert_eq!(
                result,
                RunResult {
                    status,
                    message: message.to_string(),
                    retry_after: retry_after.map(Duration::from_millis),
                    result: None,
                },
                "data {data}"
            );
        };
        check("{}", Status::Done, "", None);
        check("42", Status::Done, "", None);
        check(
            r#"{"outcome":"retry"}"#,
            Status::Retry,
            "testkit: asked to retry",
            None,
        );
        check(
            r#"{"outcome":"retry","retry_after_ms":250}"#,
            Status::Retry,
            "testkit: asked to retry",
            Some(250),
        );
        check(
            r#"{"outcome":"fail"}"#,
            Status::Fail,
            "testkit: asked to fail",
            None,
        );
        check(
            r#"{"outcome":"sideways"}"#,
            Status::Fail,
            "testkit: unknown outcome \"sideways\"",
            None,
        );
    }

    #[test]
    fn a_result_crosses_the_abi_through_the_hosts_offer() {
        let dir = tempfile::tempdir().unwrap();
        let harness = harness(&dir);
        let result = run(&harness, r#"{"result":{"rows":3,"file":"a.csv"}}"#);
        assert_eq!(result.status, Status::Done);
        assert_eq!(
            result.result.as_deref(),
            Some(r#"{"file":"a.csv","rows":3}"#)
        );
        assert_eq!(
            run(&harness, "{}").result,
            None,
            "no result unless one is given"
        );
    }

    #[test]
    fn a_panic_comes_back_as_a_retry_with_the_panic_message() {
        let dir = tempfile::tempdir().unwrap();
        let harness = harness(&dir);
        let mut task = TestTask::new("test", r#"{"outcome":"panic"}"#);
        task.id = "p1".to_string();
        let result = harness.run(task);
        assert_eq!(result.status, Status::Retry);
        // The message, and where the panic happened (the SDK's panic hook keeps it instead of printing it).
        assert!(
            result.message.starts_with(
                "panic: testkit: asked to panic (task p1) at plugins/testkit/src/lib.rs:"
            ),
            "{}",
            result.message
        );
        // The plugin is still usable after a panic.
        assert_eq!(run(&harness, "{}").status, Status::Done);
        assert!(records(&dir).contains("end p1 0 panic\n"));
    }

    #[test]
    fn fail_attempts_retries_until_that_attempt() {
        let dir = tempfile::tempdir().unwrap();
        let harness = harness(&dir);
        let statuses: Vec<Status> = (0..3)
            .map(|attempt| {
                let mut task = TestTask::new("test", r#"{"fail_attempts":2}"#);
                task.attempt = attempt;
                harness.run(task).status
            })
            .collect();
        assert_eq!(statuses, [Status::Retry, Status::Retry, Status::Done]);
    }

    #[test]
    fn a_blocked_run_returns_once_cancelled() {
        let dir = tempfile::tempdir().unwrap();
        let harness = harness(&dir);
        let mut task = TestTask::new("test", r#"{"until_cancelled":true}"#);
        task.id = "stuck".to_string();
        let cancel = task.cancel.clone();
        std::thread::scope(|scope| {
            let running = scope.spawn(|| harness.run(task));
            wait_for_records(&dir, "the run to start", |text| {
                text.contains("start stuck 0 test")
            });
            assert!(!running.is_finished(), "blocks until cancelled");
            cancel.cancel();
            assert_eq!(running.join().unwrap().status, Status::Done);
        });
    }

    #[test]
    fn sleep_us_and_spin_us_take_at_least_their_time() {
        let dir = tempfile::tempdir().unwrap();
        let harness = harness(&dir);
        for (data, at_least) in [
            (r#"{"sleep_us":3500}"#, Duration::from_micros(3500)),
            (
                r#"{"sleep_ms":1,"sleep_us":500}"#,
                Duration::from_micros(1500),
            ),
            (r#"{"spin_us":2500}"#, Duration::from_micros(2500)),
        ] {
            let start = Instant::now();
            assert_eq!(run(&harness, data).status, Status::Done, "{data}");
            assert!(start.elapsed() >= at_least, "{data}: {:?}", start.elapsed());
        }
    }

    #[test]
    fn a_long_sleep_or_spin_returns_once_cancelled() {
        let dir = tempfile::tempdir().unwrap();
        let harness = harness(&dir);
        for (i, data) in [r#"{"sleep_us":600000000}"#, r#"{"spin_us":600000000}"#]
            .into_iter()
            .enumerate()
        {
            let mut task = TestTask::new("test", data);
            task.id = format!("long{i}");
            let cancel = task.cancel.clone();
            std::thread::scope(|scope| {
                let running = scope.spawn(|| harness.run(task));
                wait_for_records(&dir, "the run to start", |text| {
                    text.contains(&format!("start long{i} 0 test"))
                });
                cancel.cancel();
                assert_eq!(running.join().unwrap().status, Status::Done, "{data}");
            });
        }
    }

    #[test]
    fn handle_runs_on_many_threads_at_once() {
        const RUNS: usize = 8;
        let dir = tempfile::tempdir().unwrap();
        let harness = harness(&dir);
        let gate = dir.path().join("gate");
        let data = serde_json::json!({ "wait_for_file": gate }).to_string();
        std::thread::scope(|scope| {
            let runs: Vec<_> = (0..RUNS)
                .map(|i| {
                    let mut task = TestTask::new("test", &data);
                    task.id = format!("t{i}");
                    let harness = &harness;
                    scope.spawn(move || harness.run(task))
                })
                .collect();
            // Every run is inside `handle` at the same time: none can return before the gate exists.
            wait_for_records(&dir, "every run to start", |text| {
                text.matches("start ").count() == RUNS
            });
            assert!(
                !records(&dir).contains("end "),
                "none returned before the gate opened"
            );
            std::fs::write(&gate, "").unwrap();
            for run in runs {
                assert_eq!(run.join().unwrap().status, Status::Done);
            }
        });
    }

    #[test]
    fn on_dead_records_the_task_and_its_reason() {
        let dir = tempfile::tempdir().unwrap();
        let harness = harness(&dir);
        let mut task = TestTask::new("test", "{}");
        task.id = "gone".to_string();
        task.attempt = 3;
        harness.on_dead(task, "retries\nexhausted");
        assert_eq!(records(&dir), "dead gone 3 retries exhausted\n");
    }
}
