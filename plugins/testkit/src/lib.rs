//! `testkit`: a plugin whose behaviour each task chooses through its `data`. Used by kmqd's tests and benchmarks.
//!
//! `data` is any JSON; when it is an object these keys are read (all optional):
//! - `sleep_ms`: sleep this long first (in steps, stopping early when the host cancels the run);
//! - `wait_for_file`: block until this path exists, or until the run is cancelled;
//! - `until_cancelled`: block until the host cancels the run (execution timeout, shutdown);
//! - `ignore_cancel`: make the blocking behaviours above ignore the cancel flag (a misbehaving handler);
//! - `outcome`: `"done"` (default), `"retry"`, `"fail"` or `"panic"`;
//! - `fail_attempts`: answer `retry` while `attempt < fail_attempts`, then `outcome`;
//! - `retry_after_ms`: the delay a `retry` asks for.
//!
//! Config: `record` (a file path): every run appends `start <id> <attempt> <type> <unix µs>` when it begins and
//! `end <id> <attempt> <outcome>` when it returns, one `write` per line so concurrent lines never interleave.
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
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Behaviour {
    sleep_ms: u64,
    wait_for_file: Option<String>,
    until_cancelled: bool,
    ignore_cancel: bool,
    outcome: Option<String>,
    fail_attempts: u32,
    retry_after_ms: Option<u64>,
}

struct Testkit {
    record: Option<File>,
    types: Vec<String>,
}

/// How often blocking behaviours look at the cancel flag.
const POLL: Duration = Duration::from_millis(2);

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
        if behaviour.sleep_ms > 0 {
            let until = Instant::now() + Duration::from_millis(behaviour.sleep_ms);
            self.block_until(task, &behaviour, || Instant::now() >= until);
        }
        if let Some(path) = &behaviour.wait_for_file {
            self.block_until(task, &behaviour, || Path::new(path).exists());
        }
        if behaviour.until_cancelled {
            self.block_until(task, &behaviour, || false);
        }
        if task.attempt() < behaviour.fail_attempts {
            return retry(
                &behaviour,
                format!("testkit: failing attempt {}", task.attempt()),
            );
        }
        match behaviour.outcome.as_deref().unwrap_or("done") {
            "done" => Outcome::Done,
            "retry" => retry(&behaviour, "testkit: asked to retry".to_string()),
            "fail" => Outcome::fail("testkit: asked to fail"),
            "panic" => panic!("testkit: asked to panic (task {})", task.id()),
            other => Outcome::fail(format!("testkit: unknown outcome {other:?}")),
        }
    }
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
        Ok(Testkit { record, types })
    }

    fn types(&self) -> Vec<String> {
        self.types.clone()
    }

    fn handle(&self, task: &Task<'_>) -> Outcome {
        self.record(|| {
            let started_us = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |since| since.as_micros());
            format!(
                "start {} {} {} {started_us}\n",
                task.id(),
                task.attempt(),
                task.kind()
            )
        });
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
            Outcome::Done => "done",
            Outcome::Retry { .. } => "retry",
            Outcome::Fail { .. } => "fail",
        };
        self.record(|| format!("end {} {} {label}\n", task.id(), task.attempt()));
        outcome
    }

    fn on_dead(&self, task: &Task<'_>, reason: &str) {
        self.record(|| {
            format!(
                "dead {} {} {}\n",
                task.id(),
                task.attempt(),
                reason.replace('\n', " ")
            )
        });
    }
}

kmq_plugin::export!(Testkit);
