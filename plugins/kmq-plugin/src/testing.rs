//! Drives a plugin through its real exported symbol, the way kmqd does, for a plugin's own tests.
//!
//! ```
//! use kmq_plugin::testing::{Harness, Status, TestTask};
//! use kmq_plugin::{Handler, Outcome, Task};
//!
//! struct Mail;
//!
//! impl Handler for Mail {
//!     const NAME: &'static str = "mail";
//!     const TYPES: &'static [&'static str] = &["mail.send"];
//!     type Config = kmq_plugin::NoConfig;
//!
//!     fn init(_config: Self::Config) -> Result<Mail, String> {
//!         Ok(Mail)
//!     }
//!
//!     fn handle(&self, task: &Task<'_>) -> Outcome {
//!         match task.data::<String>() {
//!             Ok(_address) => Outcome::Done,
//!             Err(error) => Outcome::fail(format!("bad data: {error}")),
//!         }
//!     }
//! }
//!
//! kmq_plugin::export!(Mail);
//!
//! // In the plugin's own tests, the entry point is `crate::kmq_plugin_v1`.
//! let harness = Harness::new(kmq_plugin_v1, "{}").unwrap();
//! assert_eq!(harness.types(), ["mail.send"]);
//! assert_eq!(harness.run(TestTask::new("mail.send", r#""ada@example.com""#)).status, Status::Done);
//! let result = harness.run(TestTask::new("mail.send", "[]"));
//! assert_eq!(result.status, Status::Fail);
//! assert!(result.message.starts_with("bad data: invalid type"), "{}", result.message);
//! ```
//!
//! Everything goes through the C ABI: the entry point, the version and size checks, `init` with the config as
//! JSON, `handle` with host-owned buffers and a cancel flag, `on_dead`, and `shutdown` (on drop at the latest). So a
//! test also covers what `export!` generates, for example that a panic comes back as `KMQ_RETRY` with `panic: ...`.
//!
//! The harness is stricter than kmqd where kmqd would quietly cope: a plugin that sets a message length beyond
//! the buffer's capacity, or returns a NULL descriptor, fails the test with a message saying so.

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use crate::abi::{
    self, EntryFn, HandleFn, KMQ_ABI_VERSION, KmqBuf, KmqStr, KmqTask, MESSAGE_CAPACITY,
    MIN_STRUCT_SIZE, OnDeadFn, ShutdownFn, StartFn,
};
use crate::host::{self, HOST, Refusal, RunSlot};

/// Serialises `Harness::new`. A Rust plugin's `init` fills in its descriptor's `types`, and the harness reads them
/// right after; in a test binary several tests may build harnesses of the same plugin at once. kmqd loads plugins
/// from one thread, so it needs no such lock.
static LOADING: Mutex<()> = Mutex::new(());

/// A raised-or-not cancel flag, shared between a test and the run it may cancel (from another thread).
#[derive(Clone, Debug, Default)]
pub struct CancelFlag(Arc<AtomicU32>);

impl CancelFlag {
    /// Asks the run to stop early, as kmqd does at the execution timeout or at the end of the shutdown grace.
    pub fn cancel(&self) {
        self.0.store(1, Ordering::Relaxed);
    }

    /// Whether [`CancelFlag::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed) != 0
    }
}

/// One run of a task as a test describes it; [`TestTask::new`] fills in the rest.
#[derive(Clone, Debug)]
pub struct TestTask {
    pub id: String,
    pub queue: String,
    pub kind: String,
    /// The task's `data` as JSON text.
    pub data: String,
    pub attempt: u32,
    pub created_at_ms: i64,
    /// When the execution timeout ends, in ms since the epoch (0: none).
    pub deadline_ms: i64,
    pub cancel: CancelFlag,
    /// The W3C trace context the run is handed ([`crate::Task::traceparent`], [`crate::Task::tracestate`]).
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

impl TestTask {
    /// A first run (attempt 0) of a task of type `kind` with `data` (JSON text), id `"test-task"`, queue `"test"`.
    pub fn new(kind: &str, data: &str) -> TestTask {
        TestTask {
            id: "test-task".to_string(),
            queue: "test".to_string(),
            kind: kind.to_string(),
            data: data.to_string(),
            attempt: 0,
            created_at_ms: 0,
            deadline_ms: 0,
            cancel: CancelFlag::default(),
            traceparent: None,
            tracestate: None,
        }
    }
}

/// What `handle` returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Done,
    Retry,
    Fail,
    Throttle,
    /// A value outside `kmq_status`; kmqd treats it as a handler error.
    Other(i32),
}

/// The result of one run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunResult {
    pub status: Status,
    /// What the plugin wrote into the message buffer (empty for none).
    pub message: String,
    /// The delay a `KMQ_RETRY` (or `KMQ_THROTTLE`) asked for through `retry_after_ms`; `None` means the queue's
    /// backoff.
    pub retry_after: Option<Duration>,
    /// The JSON text the run handed on as its result (`kmq_host.result`; `Outcome::done_with_result`), if any.
    pub result: Option<String>,
}

/// A plugin loaded through its entry point and initialised, ready to run tasks; shut down on drop.
pub struct Harness {
    name: String,
    types: Vec<String>,
    handle: HandleFn,
    on_dead: Option<OnDeadFn>,
    shutdown: Option<ShutdownFn>,
    start: Option<StartFn>,
    /// What `init` returned, passed back to every call; invalid once `shutdown` ran.
    state: *mut c_void,
    shut_down: bool,
}

// SAFETY: the ABI requires `handle` to be callable from many threads at once with the same state, and `on_dead`
// and `shutdown` from any thread; the harness only passes `state` back, never touches what it points at.
unsafe impl Send for Harness {}
// SAFETY: as above.
unsafe impl Sync for Harness {}

/// Reads what a plugin wrote into a host buffer; panics when it claims more than the capacity.
fn written(buf: &KmqBuf, bytes: &[u8], call: &str) -> String {
    assert!(
        buf.len <= buf.cap,
        "the plugin's {call} set the message length to {}, beyond the buffer's capacity of {}; write at most cap bytes",
        buf.len,
        buf.cap
    );
    String::from_utf8_lossy(&bytes[..buf.len]).into_owned()
}

impl Harness {
    /// Calls `entry` (a plugin's `kmq_plugin_v1`, e.g. `crate::kmq_plugin_v1` in the plugin's own tests), checks
    /// the descriptor as kmqd does (ABI version, `struct_size`, a `handle` function) and runs `init` with
    /// `config_json`, the `[plugins.NAME] config` table as kmqd would hand it over. An `Err` says why kmqd would
    /// refuse the plugin.
    ///
    /// `entry` is trusted the way kmqd trusts a plugin file: it must implement the ABI of `kmq_plugin.h`.
    pub fn new(entry: EntryFn, config_json: &str) -> Result<Harness, String> {
        // A test that panicked while holding the lock poisoned it; the data it guards is `()`, so go on.
        let _loading = LOADING
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // SAFETY: the entry point takes no arguments and returns null or a pointer to a descriptor that lives as
        // long as the library (this trust is `new`'s documented contract).
        let descriptor = unsafe { host::read(entry()) }.map_err(|refusal| match refusal {
            Refusal::Null => "kmq_plugin_v1() returned NULL; it must return its descriptor".to_string(),
            Refusal::Version { found } => {
                format!("ABI version {found}, but this harness speaks version {KMQ_ABI_VERSION}")
            }
            Refusal::TooSmall { found } => {
                format!("its descriptor is {found} bytes, smaller than the {MIN_STRUCT_SIZE} bytes of ABI v1")
            }
            Refusal::NoHandle => "its descriptor has no handle function".to_string(),
        })?;
        if let Some(offer) = descriptor.host {
            // SAFETY: the ABI's call, before init; `HOST` is a static, so it lives as long as the process.
            unsafe { offer(&HOST) };
        }
        // SAFETY: the library is linked into the test (or loaded) and stays so; `LOADING` serialises calls of
        // `new`, so init runs once at a time.
        let state = unsafe { descriptor.init(config_json) }.map_err(|failure| match failure.claimed_len {
            Some(len) => format!(
                "the plugin's init set the message length to {len}, beyond the buffer's capacity of {MESSAGE_CAPACITY}; \
                 write at most cap bytes"
            ),
            None => format!("init failed: {}", failure.message),
        })?;
        // SAFETY: as above; read after init, as the ABI says.
        let types = unsafe { descriptor.types() };
        let name = descriptor.name.clone().unwrap_or_default();
        let (handle, on_dead, shutdown, start) = (
            descriptor.handle,
            descriptor.on_dead,
            descriptor.shutdown,
            descriptor.start,
        );
        Ok(Harness {
            name,
            types,
            handle,
            on_dead,
            shutdown,
            start,
            state,
            shut_down: false,
        })
    }

    /// The name the plugin gives itself.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The task types the plugin claims, as read after `init`.
    pub fn types(&self) -> &[String] {
        &self.types
    }

    /// Runs one attempt of `task` as kmqd does: through the plugin's `start` when it has one and takes the task
    /// (waiting for its completion), else through `handle`. May be called from many threads at once.
    pub fn run(&self, task: TestTask) -> RunResult {
        // SAFETY: no progress sink, so nothing the slot points at has to outlive the run.
        let slot = unsafe {
            RunSlot::new(
                None,
                task.traceparent.as_deref(),
                task.tracestate.as_deref(),
                None,
            )
        };
        let run = slot.handle();
        let taken = || slot.take_result();
        if let Some(start) = self.start {
            let (sender, receiver) = mpsc::sync_channel(1);
            let ticket = Box::into_raw(Box::new(sender)).cast::<c_void>();
            let mut retry_after_ms: i64 = -1;
            let raw = raw_task(&task, &mut retry_after_ms, run);
            // SAFETY: as in `handle` below; `ticket` is ours until `completed` takes it back, and the task's
            // cancel flag lives in `task`, which outlives the wait below.
            let declined = unsafe { start(self.state, &raw, completed, ticket) } != 0;
            if !declined {
                let completed = receiver.recv().expect(
                    "the plugin called complete (kmq_plugin.h: exactly once per task it took)",
                );
                return RunResult {
                    result: taken(),
                    ..completed
                };
            }
            // SAFETY: a declining start never calls complete, so the ticket is still ours.
            drop(unsafe { Box::from_raw(ticket.cast::<mpsc::SyncSender<RunResult>>()) });
        }
        let mut message = vec![0u8; MESSAGE_CAPACITY];
        let mut retry_after_ms: i64 = -1;
        let raw = raw_task(&task, &mut retry_after_ms, run);
        let mut buf = KmqBuf {
            ptr: message.as_mut_ptr().cast::<c_char>(),
            cap: message.len(),
            len: 0,
        };
        // SAFETY: every pointer in `raw` and `buf` is valid until the call returns, `state` is what init
        // returned (shutdown has not run: it takes `self` or runs on drop), and `handle` is thread-safe by contract.
        let status = unsafe { (self.handle)(self.state, &raw, &mut buf) };
        let status = status_of(status);
        RunResult {
            status,
            message: written(&buf, &message, "handle"),
            retry_after: (matches!(status, Status::Retry | Status::Throttle)
                && retry_after_ms >= 0)
                .then(|| Duration::from_millis(retry_after_ms as u64)),
            result: taken(),
        }
    }

    /// Tells the plugin that `task` was dead-lettered because of `reason`, as kmqd does once the dead letter is
    /// stored. Does nothing for a plugin without `on_dead`.
    pub fn on_dead(&self, task: TestTask, reason: &str) {
        if let Some(on_dead) = self.on_dead {
            let mut retry_after_ms = -1;
            let raw = raw_task(&task, &mut retry_after_ms, std::ptr::null_mut());
            // SAFETY: as in `run`; `reason` is borrowed for the call.
            unsafe { on_dead(self.state, &raw, KmqStr::borrow(reason)) };
        }
    }

    /// Calls the plugin's `shutdown` (once; dropping the harness does it too).
    pub fn shutdown(mut self) {
        self.shut_down_once();
    }

    fn shut_down_once(&mut self) {
        if std::mem::replace(&mut self.shut_down, true) {
            return;
        }
        if let Some(shutdown) = self.shutdown {
            // SAFETY: `&mut self` proves no `run` is in progress, and `shut_down` makes this the only call.
            unsafe { shutdown(self.state) };
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shut_down_once();
    }
}

fn status_of(status: abi::KmqStatus) -> Status {
    match status {
        abi::KMQ_DONE => Status::Done,
        abi::KMQ_RETRY => Status::Retry,
        abi::KMQ_FAIL => Status::Fail,
        abi::KMQ_THROTTLE => Status::Throttle,
        other => Status::Other(other),
    }
}

/// The harness's `kmq_complete_fn`: hands the outcome to the `run` waiting for it.
unsafe extern "C" fn completed(
    ticket: *mut c_void,
    status: abi::KmqStatus,
    msg: KmqStr,
    retry_after_ms: i64,
) {
    // SAFETY: `ticket` is the box `run` made for this task, taken back once (the ABI's exactly-once rule).
    let sender = unsafe { Box::from_raw(ticket.cast::<mpsc::SyncSender<RunResult>>()) };
    // SAFETY: the message is valid for the call.
    let message = String::from_utf8_lossy(unsafe { msg.as_bytes() }).into_owned();
    let status = status_of(status);
    let _ = sender.send(RunResult {
        status,
        message,
        retry_after: (matches!(status, Status::Retry | Status::Throttle) && retry_after_ms >= 0)
            .then(|| Duration::from_millis(retry_after_ms as u64)),
        // Read from the run's slot by `run`, which waits for this.
        result: None,
    });
}

/// Whether process `pid` is alive, for tests of plugins that start processes and must not leave them behind. A
/// zombie (killed, waiting for whoever inherited it to reap it) is not alive. Reads `/proc`, so Linux only.
pub fn process_is_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        // "pid (comm) STATE ...": the state follows the last parenthesis.
        Ok(stat) => {
            stat.rsplit(')')
                .next()
                .and_then(|rest| rest.split_whitespace().next())
                != Some("Z")
        }
    }
}

/// The task as the ABI passes it, with `run`, its run's handle (null where none is live: `on_dead`).
fn raw_task<'a>(task: &'a TestTask, retry_after_ms: &'a mut i64, run: *mut c_void) -> KmqTask {
    KmqTask {
        id: KmqStr::borrow(&task.id),
        queue: KmqStr::borrow(&task.queue),
        type_: KmqStr::borrow(&task.kind),
        data: KmqStr::borrow(&task.data),
        attempt: task.attempt,
        created_at_ms: task.created_at_ms,
        deadline_ms: task.deadline_ms,
        cancel: task.cancel.0.as_ptr().cast_const(),
        retry_after_ms,
        run,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::KmqPlugin;

    /// A descriptor with every field NULL but the two header fields, leaked (descriptors live forever).
    fn descriptor(abi_version: u32, struct_size: usize) -> *const KmqPlugin {
        Box::leak(Box::new(KmqPlugin {
            abi_version,
            struct_size: struct_size as u32,
            name: c"bare".as_ptr(),
            types: std::ptr::null(),
            init: None,
            handle: None,
            on_dead: None,
            shutdown: None,
            start: None,
            host: None,
        }))
    }

    extern "C" fn version_2() -> *const KmqPlugin {
        descriptor(2, size_of::<KmqPlugin>())
    }

    extern "C" fn too_small() -> *const KmqPlugin {
        descriptor(KMQ_ABI_VERSION, 8)
    }

    extern "C" fn without_handle() -> *const KmqPlugin {
        descriptor(KMQ_ABI_VERSION, size_of::<KmqPlugin>())
    }

    extern "C" fn null() -> *const KmqPlugin {
        std::ptr::null()
    }

    #[test]
    fn refuses_what_kmqd_refuses() {
        let error = |entry: EntryFn| Harness::new(entry, "{}").err().expect("refused");
        assert_eq!(
            error(version_2),
            "ABI version 2, but this harness speaks version 1"
        );
        assert_eq!(
            error(too_small),
            format!(
                "its descriptor is 8 bytes, smaller than the {MIN_STRUCT_SIZE} bytes of ABI v1"
            )
        );
        assert_eq!(
            error(without_handle),
            "its descriptor has no handle function"
        );
        assert_eq!(
            error(null),
            "kmq_plugin_v1() returned NULL; it must return its descriptor"
        );
    }

    #[test]
    fn min_struct_size_ends_after_handle() {
        // abi_version, struct_size, name, types, init, handle: two u32 and four pointers.
        assert_eq!(MIN_STRUCT_SIZE, 8 + 4 * size_of::<usize>());
    }
}
