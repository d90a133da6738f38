//! The SDK for kmqd handler plugins written in Rust.
//!
//! A plugin is a `cdylib` crate that implements [`Handler`] and exports it with [`export!`]:
//!
//! ```
//! use kmq_plugin::{Handler, Outcome, Task};
//!
//! struct Mail;
//!
//! impl Handler for Mail {
//!     const NAME: &'static str = "mail";
//!     const TYPES: &'static [&'static str] = &["mail.send"];
//!     type Config = kmq_plugin::NoConfig;
//!     fn init(_config: Self::Config) -> Result<Self, String> { Ok(Mail) }
//!     fn handle(&self, task: &Task<'_>) -> Outcome { Outcome::Done }
//! }
//!
//! kmq_plugin::export!(Mail);
//! ```
//!
//! The macro generates every `extern "C"` function of the ABI (`plugins/include/kmq_plugin.h`) and wraps each in
//! `catch_unwind`: a panic never crosses the boundary (it would abort the daemon). A panic in `handle` becomes a
//! failed attempt (`KMQ_RETRY`, message `panic: MESSAGE at FILE:LINE`, not printed by the panic hook), which the queue's `on_handler_error` then decides about.
//!
//! [`testing::Harness`] drives a plugin through its exported symbol, as kmqd does, for the plugin's own tests.

// Unsafe code lives only in the ABI glue, each module of it opted in below, so that new unsafe needs a visible
// opt-in (ARCHITECTURE.md, the unsafe invariant).
#![deny(unsafe_code)]
// Every unsafe block says why it is sound (STYLE.md); the lint keeps it so.
#![deny(clippy::undocumented_unsafe_blocks)]
// A plugin's lines go through `log_line`, whole: `eprintln!` splits a line into one write per piece.
#![deny(clippy::print_stderr)]

#[expect(
    unsafe_code,
    reason = "the ABI's strings and buffers: reading and writing the memory they point to"
)]
pub mod abi;
#[expect(
    unsafe_code,
    reason = "the host's completion callback and a task's cancel flag"
)]
mod completion;
#[doc(hidden)]
#[expect(
    unsafe_code,
    reason = "the exported `extern \"C\"` functions, reading the host's pointers"
)]
pub mod export;
#[expect(
    unsafe_code,
    reason = "loading a plugin's descriptor and calling its `init`"
)]
pub mod host;
#[expect(
    unsafe_code,
    reason = "the harness calls the plugin's exported functions as the host does"
)]
pub mod testing;

use std::io::Write;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;

pub use completion::Completion;
pub use serde_json;

/// A task handler. One value is created by `init` per `[plugins.NAME]` section naming the file (an instance) and
/// shared by every worker thread of the daemon.
pub trait Handler: Send + Sync + Sized + 'static {
    /// The plugin's name, as the config and the logs show it.
    const NAME: &'static str;
    /// The task types this plugin handles, unless [`Handler::types`] is overridden to read them from the config.
    const TYPES: &'static [&'static str] = &[];
    /// The plugin's `[plugins.NAME] config` table, deserialized from JSON. Use [`NoConfig`] when there is none.
    type Config: DeserializeOwned;

    /// Builds the handler from its config; an `Err` refuses the plugin at start with that message.
    fn init(config: Self::Config) -> Result<Self, String>;

    /// The task types this plugin handles; read once, right after `init`.
    fn types(&self) -> Vec<String> {
        Self::TYPES.iter().map(|t| t.to_string()).collect()
    }

    /// Runs one attempt of a task. Called from many threads at once.
    fn handle(&self, task: &Task<'_>) -> Outcome;

    /// Whether the plugin exports [`Handler::start`]: set it to `true` in a handler that runs its tasks
    /// elsewhere (other processes, an event loop), so that the daemon does not keep a thread waiting per task in
    /// flight. With `false` (the default) every task goes through [`Handler::handle`].
    const STARTS: bool = false;

    /// Starts one attempt of a task and returns without waiting for it: the outcome goes to `done` later, from
    /// any thread ([`Completion::complete`]; dropping it completes the task as a retry). `Err(done)` declines
    /// the task: the daemon then runs it through [`Handler::handle`], on the thread that called this. Called
    /// only when [`Handler::STARTS`] is true; may block while the plugin has no room for the task, but should
    /// not run it. The task's text is borrowed for this call only; `done` tells whether it was cancelled.
    fn start(&self, _task: &Task<'_>, done: Completion) -> Result<(), Completion> {
        Err(done)
    }

    /// A task of one of this plugin's types was dead-lettered (after it is safely in the dead-letter list).
    fn on_dead(&self, _task: &Task<'_>, _reason: &str) {}

    /// Called once, after the last `handle` (and `on_dead`) returned: when the daemon stops, or when a reload
    /// replaced this instance by a new version of the file and its last task finished; from any thread.
    fn shutdown(&self) {}
}

/// The config of a plugin that takes none: any key in its table is an error.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoConfig {}

/// What one attempt of a task came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The task is finished.
    Done,
    /// The task is finished, and the handler has something to show for it (a command's output, a summary): the
    /// daemon logs it with the task's `task done` debug event. At most 1024 bytes reach the daemon.
    DoneWithOutput { output: String },
    /// The task is finished, with a result: JSON the daemon keeps with the task when its queue has
    /// `keep_results` (`kmqd task result QUEUE ID` prints it; docs/HANDLERS.md, "Results"), and otherwise drops. At
    /// most 1 MiB of JSON text is kept (a larger result is replaced by a record saying so; the task is still
    /// done). A host older than this variant (it never gave the plugin a `kmq_host`) sees a plain done, and the
    /// SDK says once on stderr that the result was dropped.
    DoneWithResult { result: serde_json::Value },
    /// This attempt failed; the queue's `on_handler_error` decides (by default: retry after `after`, or after the
    /// queue's backoff when `None`, until `retry_times` is used up).
    Retry {
        after: Option<Duration>,
        reason: String,
    },
    /// The task can never succeed: dead-letter it now.
    Fail { reason: String },
    /// Back-pressure: the upstream said "too many requests" (an HTTP 429, a quota). The task goes back to the head
    /// of its queue, its attempt not charged (never dead-lettered for it), and no daemon takes a task of the queue
    /// for `after` (at least 1 ms, at most an hour). A host older than this variant reads it as a retry with the
    /// queue's backoff.
    Throttle { after: Duration, reason: String },
}

impl Outcome {
    /// The task is finished, with `output` to log (see [`Outcome::DoneWithOutput`]); empty is [`Outcome::Done`].
    pub fn done_with_output(output: impl Into<String>) -> Outcome {
        let output = output.into();
        if output.is_empty() {
            Outcome::Done
        } else {
            Outcome::DoneWithOutput { output }
        }
    }

    /// The task is finished, with `result` to keep (see [`Outcome::DoneWithResult`]).
    pub fn done_with_result(result: impl Into<serde_json::Value>) -> Outcome {
        Outcome::DoneWithResult {
            result: result.into(),
        }
    }

    /// A failed attempt, retried after the queue's backoff.
    pub fn retry(reason: impl Into<String>) -> Outcome {
        Outcome::Retry {
            after: None,
            reason: reason.into(),
        }
    }

    /// A failed attempt, retried after `after`.
    pub fn retry_after(after: Duration, reason: impl Into<String>) -> Outcome {
        Outcome::Retry {
            after: Some(after),
            reason: reason.into(),
        }
    }

    /// Back-pressure: the queue takes no task for `after`, and this one goes back uncharged (see
    /// [`Outcome::Throttle`]).
    pub fn throttle(after: Duration) -> Outcome {
        Outcome::Throttle {
            after,
            reason: String::new(),
        }
    }

    /// As [`Outcome::throttle`], with a reason for the log (what the upstream said).
    pub fn throttle_because(after: Duration, reason: impl Into<String>) -> Outcome {
        Outcome::Throttle {
            after,
            reason: reason.into(),
        }
    }

    /// A final failure: the task goes to the dead-letter list.
    pub fn fail(reason: impl Into<String>) -> Outcome {
        Outcome::Fail {
            reason: reason.into(),
        }
    }
}

/// One run of a task, borrowed from the host for the duration of a call.
pub struct Task<'a> {
    raw: &'a abi::KmqTask,
}

#[expect(unsafe_code, reason = "a task's accessors read the host's ABI struct")]
impl<'a> Task<'a> {
    /// Wraps the host's task.
    ///
    /// # Safety
    /// Every pointer in `raw` must be valid for `'a`, as the ABI guarantees during a call.
    pub unsafe fn from_raw(raw: &'a abi::KmqTask) -> Task<'a> {
        Task { raw }
    }

    fn text(s: &abi::KmqStr) -> &'a str {
        // SAFETY: `from_raw`'s contract: the host keeps the bytes alive for the call.
        let bytes = unsafe { s.as_bytes() };
        // The host only passes text it decoded as UTF-8; a lossy fallback would allocate, so an invalid string
        // (a foreign host's bug) reads as empty rather than as garbage.
        std::str::from_utf8(bytes).unwrap_or("")
    }

    /// The task id, stable across retries.
    pub fn id(&self) -> &'a str {
        Self::text(&self.raw.id)
    }

    /// The queue the task came from.
    pub fn queue(&self) -> &'a str {
        Self::text(&self.raw.queue)
    }

    /// The task type (the envelope's `type`).
    pub fn kind(&self) -> &'a str {
        Self::text(&self.raw.type_)
    }

    /// The task's `data` as JSON text.
    pub fn data_json(&self) -> &'a str {
        Self::text(&self.raw.data)
    }

    /// The task's `data`, deserialized.
    pub fn data<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(self.data_json())
    }

    /// The outcomes of the tasks this task waited for, when it is a task of a flow that waited for others
    /// (docs/HANDLERS.md, "Flows"): a JSON list of `{"queue", "id", "state": "done" | "dead", "result" |
    /// "reason"}`, one per task, in no set order. `None` when it waited for none, or under a host older than
    /// flows.
    pub fn dependencies(&self) -> Option<&'a str> {
        self.host_text(crate::export::dependencies_fn()?)
    }

    /// The W3C trace context of this run (docs/HANDLERS.md, "Tracing"): the run span's own when kmqd traces
    /// (`[daemon] otlp_endpoint`: make it the parent of the handler's spans, and they nest under the run), the
    /// producer's as it pushed it otherwise. `None` when the task has none, or under a host older than tracing.
    pub fn traceparent(&self) -> Option<&'a str> {
        self.host_text(crate::export::trace_fns()?.0)
    }

    /// The producer's W3C `tracestate`, which goes with [`Task::traceparent`]; `None` when it has none.
    pub fn tracestate(&self) -> Option<&'a str> {
        self.host_text(crate::export::trace_fns()?.1)
    }

    /// The text one of the host's functions gives for this run; `None` when it is empty or the run has no handle.
    fn host_text(&self, given: abi::TraceFn) -> Option<&'a str> {
        // SAFETY: `raw` is the task of the current call (`from_raw`'s contract).
        let run = unsafe { crate::export::run_of(self.raw) };
        if run.is_null() {
            return None;
        }
        // SAFETY: the run is live during the call, and the host's text lives as long as the run.
        let text = Self::text(&unsafe { given(run) });
        (!text.is_empty()).then_some(text)
    }

    /// Reports how far the run is (docs/HANDLERS.md, "Progress"): `fraction` from 0 to 1 (NaN is ignored, anything
    /// else clamped to 0..=1) and a short message (its first KiB is kept). `kmqd task show` and the dashboard show
    /// the latest report while the task runs. Cheap enough to call per item: the daemon keeps the latest report
    /// of each task and writes it to Redis a few times a second, only while it holds the task's lease. Does
    /// nothing under a host older than progress.
    pub fn progress(&self, fraction: f32, message: &str) {
        let Some(report) = crate::export::progress_fn() else {
            return;
        };
        // SAFETY: `raw` is the task of the current call (`from_raw`'s contract).
        let run = unsafe { crate::export::run_of(self.raw) };
        if run.is_null() {
            return;
        }
        // SAFETY: the run is live during the call; the host copies the message during the call.
        unsafe { report(run, fraction, abi::KmqStr::borrow(message)) };
    }

    /// 0 on the first run, 1 on the first retry, and so on.
    pub fn attempt(&self) -> u32 {
        self.raw.attempt
    }

    /// When the task was enqueued (Redis's clock), if known.
    pub fn created_at(&self) -> Option<SystemTime> {
        millis_to_time(self.raw.created_at_ms)
    }

    /// When the queue's execution timeout ends for this run, if it has one. Past it, the run counts as failed.
    pub fn deadline(&self) -> Option<SystemTime> {
        millis_to_time(self.raw.deadline_ms)
    }

    /// True once the host wants this run to stop early (execution timeout or shutdown). Long handlers should
    /// check it between steps and return [`Outcome::retry`].
    pub fn is_cancelled(&self) -> bool {
        if self.raw.cancel.is_null() {
            return false;
        }
        // The host writes the flag from another thread while this one reads it, so the read must be atomic: a
        // plain (or volatile) read racing with a write is undefined behaviour in Rust. C declares the flag
        // `const volatile uint32_t *`; an `AtomicU32` has the size and alignment of a `uint32_t`.
        // SAFETY: the host keeps the flag alive and aligned during the call, and only ever writes it atomically
        // (kmqd's is an `AtomicU32`); this side only loads it.
        let flag = unsafe { AtomicU32::from_ptr(self.raw.cancel.cast_mut()) };
        flag.load(Ordering::Relaxed) != 0
    }
}

fn millis_to_time(ms: i64) -> Option<SystemTime> {
    (ms > 0).then(|| UNIX_EPOCH + Duration::from_millis(ms as u64))
}

/// Writes `line` and a newline to standard error (the daemon's log) in one `write`, so that no other line lands
/// inside it. A plugin has its own copy of Rust's standard library, so its `eprintln!` does not take the daemon's
/// lock on standard error, and `eprintln!` writes each piece of its format (`"kmq-exec: "`, the argument, the
/// newline) with a `write` of its own: another thread's line could then split it.
pub fn log_line(line: &str) {
    write_line(&mut std::io::stderr(), line);
}

fn write_line(out: &mut impl Write, line: &str) {
    let mut whole = String::with_capacity(line.len() + 1);
    whole.push_str(line);
    whole.push('\n');
    // Standard error has nowhere to report its own failure.
    let _ = out.write_all(whole.as_bytes());
}

#[cfg(test)]
mod log_tests {
    use std::io::Write;

    /// Records each `write` it is given.
    #[derive(Default)]
    struct Writes(Vec<Vec<u8>>);

    impl Write for Writes {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.push(bytes.to_vec());
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_log_line_reaches_standard_error_in_one_write() {
        let mut writes = Writes::default();
        let name = "py";
        super::write_line(
            &mut writes,
            &format!("kmq-exec: {name}[42]: fails at start"),
        );
        assert_eq!(
            writes.0,
            vec![b"kmq-exec: py[42]: fails at start\n".to_vec()]
        );
        // What it replaces: a formatted line written piece by piece, each a `write` another thread can come between.
        let mut pieces = Writes::default();
        writeln!(pieces, "kmq-exec: {name}[42]: fails at start").unwrap();
        assert!(pieces.0.len() > 1, "{:?}", pieces.0);
    }
}
