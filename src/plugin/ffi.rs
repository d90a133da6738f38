//! Loading a plugin and calling it through the C ABI of `plugins/include/kmq_plugin.h`.
//!
//! This is the only unsafe code of the daemon. The rules it relies on are the header's: the descriptor lives as
//! long as the library, `handle` is thread-safe, buffers are host-owned, and nothing unwinds across the boundary.
//! A library is never unloaded (its threads or thread-locals may outlive a call), so every pointer into it stays
//! valid until the process exits.
//!
//! A library is opened through a file descriptor that is never closed (`/proc/self/fd/N`): the dynamic loader
//! hands back an already-loaded library when the *name* matches, so loading a replaced file (a new inode at the
//! same path, `install` or `mv`) by its path would silently return the old code. A descriptor number that is never
//! closed is never reused, so each load has a name of its own; the descriptor also pins the inode that was
//! checked, so the library loaded is the file whose identity the registry recorded.
#![expect(
    unsafe_code,
    reason = "the daemon's one opt-in: loading plugins and calling them through the C ABI"
)]
// Every unsafe block says why it is sound; the lint keeps it so.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::ffi::{c_char, c_void};
use std::mem::ManuallyDrop;
use std::os::fd::IntoRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use kmq_plugin::abi::{
    self, EntryFn, HandleFn, KMQ_ABI_VERSION, KmqBuf, KmqStatus, KmqStr, KmqTask, MIN_STRUCT_SIZE,
    OnDeadFn, PLUGIN_SYMBOL, ShutdownFn, StartFn,
};
use kmq_plugin::host::{self, HOST, ProgressSink, Refusal, RunSlot};

use super::PluginError;
use crate::task::Envelope;

/// How many bytes of message a plugin may return; longer messages are cut.
pub(crate) const MESSAGE_CAPACITY: usize = abi::MESSAGE_CAPACITY;

/// A loaded library and its checked descriptor: loaded once per file (by identity), whatever the number of
/// `[plugins.NAME]` sections that name it; each section is an instance of its own ([`Library::init`]).
pub struct Library {
    /// The name the plugin gives itself.
    pub(crate) name: String,
    /// The device and inode of the file that was loaded: a file replaced at the same path is another library.
    pub(crate) identity: (u64, u64),
    descriptor: host::Descriptor,
    /// Never dropped: unloading a library that may still have threads or thread-locals alive is undefined.
    _library: ManuallyDrop<libloading::Library>,
}

// SAFETY: the descriptor points into the library, which is never unloaded; the host calls `init` from one thread
// at a time (the registry loads plugins from one thread), and the other entry points are documented as callable
// from any thread.
unsafe impl Send for Library {}
// SAFETY: as above.
unsafe impl Sync for Library {}

/// A loaded, initialised plugin: one `init` of a library, for one `[plugins.NAME]` section (or a drop-in).
pub struct LoadedPlugin {
    /// The name the plugin gives itself.
    pub(crate) name: String,
    /// The canonical path of its file, as its section reaches it.
    pub(crate) path: PathBuf,
    /// The `[plugins.NAME]` section it was initialised for (a drop-in's: its file name's stem).
    pub section: String,
    /// The task types it handles.
    pub types: Vec<String>,
    /// The device and inode of the file that was loaded: a file replaced at the same path is another plugin.
    pub(crate) identity: (u64, u64),
    /// The `config` table its `init` was given, as JSON text.
    pub(crate) config_json: String,
    /// The library it is an instance of (shared with the file's other sections).
    pub library: Arc<Library>,
    handle: HandleFn,
    on_dead: Option<OnDeadFn>,
    shutdown: Option<ShutdownFn>,
    start: Option<StartFn>,
    /// Whatever `init` returned; only ever passed back to the plugin.
    state: *mut c_void,
    /// Whether `shutdown` has run: it runs once, from [`LoadedPlugin::shutdown`] or when the last reference goes.
    shut_down: AtomicBool,
}

// SAFETY: the ABI requires `handle` to be thread-safe, and the host passes `state` back untouched; the other
// fields are plain data. `on_dead` and `shutdown` are documented as callable from any thread.
unsafe impl Send for LoadedPlugin {}
// SAFETY: as above.
unsafe impl Sync for LoadedPlugin {}

/// The inputs of one run, borrowed for the call. Small, so that a run moves without a call of `memcpy` (LLVM copies
/// up to 128 bytes inline): the task's own fields are read from its envelope where the plugin's view of the task
/// is made ([`task_view`]), and the fields its handler may ask the host for ([`Run::context`]) where its slot is.
pub(crate) struct Run<'a> {
    /// The task, decoded.
    pub(crate) envelope: &'a Envelope<'a>,
    pub(crate) queue: &'a str,
    pub(crate) deadline_ms: i64,
    pub(crate) cancel: &'a AtomicU32,
    /// The run span's W3C trace context when the run is traced (`kmq_host.traceparent`); `None`: the handler is
    /// handed the producer's, if any ([`Run::context`]).
    pub(crate) traceparent: Option<&'a str>,
    /// Where its progress reports go (its lane) and its number there; `None`: dropped (`on_dead`, tests).
    pub(crate) progress: Option<(&'a Arc<dyn ProgressSink>, u64)>,
}

impl Run<'_> {
    /// The run's slot for what its plugin hands on: its dependencies and trace context in, its result and
    /// progress out.
    fn slot(&self) -> RunSlot {
        let (after, traceparent, tracestate) = self.context();
        let sink = self.progress.map(|(sink, run)| (Arc::as_ptr(sink), run));
        // SAFETY: the sink is the lane's, which outlives every run of its tasks: a worker's `handle` borrows the
        // lane, and a task taken in `start` holds it until its completion (`lane::started`).
        unsafe { RunSlot::new(after, traceparent, tracestate, sink) }
    }
}

/// What `handle` returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    /// `output`: what the handler put in the message buffer (empty when nothing), for the log; `result`: the
    /// JSON text it handed on through `kmq_host.result`, if any (kept with a queue's `keep_results`).
    Done {
        output: String,
        result: Option<String>,
    },
    Retry {
        after: Option<Duration>,
        message: String,
    },
    Fail {
        message: String,
    },
    /// `KMQ_THROTTLE`: back-pressure for `after` (`None`: the handler left `retry_after_ms` at -1).
    Throttle {
        after: Option<Duration>,
        message: String,
    },
    /// A status outside the ABI: treated as a handler error by the caller.
    Unknown(i32),
}

/// The highest ABI version a refusal message names when a plugin exports no `kmq_plugin_v1`.
const NEWEST_VERSION_PROBED: u32 = 16;

/// Loads the library open as `file`, at `path` (canonical: for messages), through that descriptor, which the
/// caller opened and checked for trust (`open_trusted`), and checks its descriptor; its instances come from
/// [`Library::init`].
pub(crate) fn load(path: &Path, file: std::fs::File) -> Result<Library, PluginError> {
    let open = |message: String| PluginError::Open {
        path: path.to_owned(),
        message,
    };
    let bad_descriptor = |problem: &str| PluginError::Descriptor {
        path: path.to_owned(),
        problem: problem.to_string(),
    };
    let metadata = file.metadata().map_err(|error| open(error.to_string()))?;
    let identity = (metadata.dev(), metadata.ino());
    let by_descriptor = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file));
    // SAFETY: loading a library runs its initialisers. That is the point of a plugin; the caller made sure only
    // root or the daemon's own user could have put this file there, checking this very descriptor.
    let library = unsafe { libloading::Library::new(&by_descriptor) }.map_err(|error| {
        open(format!(
            "{error}; it must be a shared library (.so) built for this machine"
        ))
    })?;
    // Loaded under the descriptor's name: it stays open for the life of the process (see the module's doc), one
    // descriptor per library ever loaded.
    let _ = file.into_raw_fd();
    // Never unloaded, not even when refused below: its initialisers ran, and may have started threads or
    // registered thread-locals whose code must stay mapped.
    let library = ManuallyDrop::new(library);
    // SAFETY: the symbol's type is fixed by the ABI (`const kmq_plugin *kmq_plugin_v1(void)`).
    let entry: EntryFn = match unsafe { library.get::<EntryFn>(PLUGIN_SYMBOL) } {
        Ok(symbol) => *symbol,
        Err(_) => return Err(missing_symbol(path, &library)),
    };
    // SAFETY: calling the entry point is what the ABI prescribes; it returns null or a pointer to a descriptor
    // that lives as long as the library, which is never unloaded.
    let descriptor = unsafe { host::read(entry()) }.map_err(|refusal| match refusal {
        Refusal::Null => bad_descriptor(
            "kmq_plugin_v1() returned NULL; it must return a pointer to its kmq_plugin descriptor",
        ),
        Refusal::Version { found } => PluginError::AbiVersion {
            path: path.to_owned(),
            found,
            expected: KMQ_ABI_VERSION,
        },
        Refusal::TooSmall { found } => PluginError::StructSize {
            path: path.to_owned(),
            found,
            minimum: MIN_STRUCT_SIZE,
        },
        Refusal::NoHandle => bad_descriptor(
            "its handle is NULL; set it to the function that runs a task (kmq_plugin.h, `handle`)",
        ),
    })?;
    if let Some(offer) = descriptor.host {
        // SAFETY: the ABI's call, once per library and before its first init; `HOST` is a static (the SDK's
        // host side, shared with its test harness).
        unsafe { offer(&HOST) };
    }
    let name = descriptor
        .name
        .clone()
        .unwrap_or_else(|| path.display().to_string());
    Ok(Library {
        name,
        identity,
        descriptor,
        _library: library,
    })
}

impl Library {
    /// Runs `init` with `config_json`, the table of `[plugins.SECTION] config`: one instance, with its own state
    /// and types. Called once per section that names the file, one after another. `path`: the file as the section
    /// reaches it (canonical; a hard link is another path to the same library).
    pub(crate) fn init(
        self: &Arc<Library>,
        path: &Path,
        section: &str,
        config_json: &str,
    ) -> Result<LoadedPlugin, PluginError> {
        let descriptor = &self.descriptor;
        // SAFETY: the library is loaded (and stays so); the registry calls init from one thread, once per
        // section, and reads the types it filled in before the next call (kmq_plugin.h).
        let state =
            unsafe { descriptor.init(config_json) }.map_err(|failure| PluginError::InitFailed {
                path: path.to_owned(),
                name: self.name.clone(),
                section: section.to_string(),
                message: if failure.message.is_empty() {
                    "init returned NULL without a message".to_string()
                } else {
                    failure.message
                },
            })?;
        // SAFETY: the library is loaded; read after this init, as the ABI says.
        let types = unsafe { descriptor.types() };
        Ok(LoadedPlugin {
            name: self.name.clone(),
            path: path.to_owned(),
            section: section.to_string(),
            types,
            identity: self.identity,
            config_json: config_json.to_string(),
            library: Arc::clone(self),
            handle: descriptor.handle,
            on_dead: descriptor.on_dead,
            shutdown: descriptor.shutdown,
            start: descriptor.start,
            state,
            shut_down: AtomicBool::new(false),
        })
    }
}

/// What runs when a task a plugin took in `start` completes: on the plugin's thread, once.
pub(crate) type Completion = Box<dyn FnOnce(Status) + Send>;

/// A started task's ticket: its completion, and its run's slot, which lives until the completion (the run's
/// handle points at it).
struct Ticket {
    completion: Completion,
    slot: RunSlot,
}

/// The host's `kmq_complete_fn`: the ticket is a boxed [`Ticket`].
unsafe extern "C" fn completed(
    ticket: *mut c_void,
    status: KmqStatus,
    msg: KmqStr,
    retry_after_ms: i64,
) {
    // SAFETY: `ticket` is the box `LoadedPlugin::start` leaked for this task, and the ABI has the plugin call this
    // once per task it took, so the box is taken back once.
    let ticket = unsafe { Box::from_raw(ticket.cast::<Ticket>()) };
    let Ticket {
        completion,
        mut slot,
    } = *ticket;
    // SAFETY: the message is valid for the call; it is copied here.
    let bytes = unsafe { msg.as_bytes() };
    let text = || String::from_utf8_lossy(&bytes[..bytes.len().min(MESSAGE_CAPACITY)]).into_owned();
    let status = with_result(status_of(status, text, retry_after_ms), &mut slot);
    // Nothing may unwind into the plugin: a panic here is the daemon's bug, logged, and the task stays held until
    // the daemon stops (its lease keeps it safe in Redis).
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || completion(status))).is_err() {
        tracing::error!("a started task's completion panicked; the task stays held");
    }
}

/// A done status with the result its run handed on, if any (a result of a run that did not finish is dropped).
/// The run is over: its slot is ended here, its result taken without a lock.
fn with_result(status: Status, slot: &mut RunSlot) -> Status {
    match status {
        Status::Done { output, .. } => Status::Done {
            output,
            result: slot.ended_result(),
        },
        other => other,
    }
}

/// A `kmq_status` (with its message and retry delay) as the daemon reads it.
fn status_of(status: KmqStatus, text: impl FnOnce() -> String, retry_after_ms: i64) -> Status {
    match status {
        abi::KMQ_DONE => Status::Done {
            output: text(),
            result: None,
        },
        abi::KMQ_RETRY => Status::Retry {
            after: (retry_after_ms >= 0).then(|| Duration::from_millis(retry_after_ms as u64)),
            message: text(),
        },
        abi::KMQ_FAIL => Status::Fail { message: text() },
        abi::KMQ_THROTTLE => Status::Throttle {
            after: (retry_after_ms >= 0).then(|| Duration::from_millis(retry_after_ms as u64)),
            message: text(),
        },
        other => Status::Unknown(other),
    }
}

/// The refusal for a library without `kmq_plugin_v1`: when it exports the entry point of another ABI version, the
/// message says which, so "built for another kmqd" is told apart from "not a kmqd plugin".
fn missing_symbol(path: &Path, library: &libloading::Library) -> PluginError {
    let other = (0..=NEWEST_VERSION_PROBED)
        .filter(|&version| version != KMQ_ABI_VERSION)
        .find(|version| {
            let symbol = format!("kmq_plugin_v{version}\0");
            // SAFETY: only looked up, never called: the type does not matter.
            unsafe { library.get::<*const c_void>(symbol.as_bytes()) }.is_ok()
        });
    match other {
        Some(found) => PluginError::AbiVersion {
            path: path.to_owned(),
            found,
            expected: KMQ_ABI_VERSION,
        },
        None => PluginError::MissingSymbol {
            path: path.to_owned(),
        },
    }
}

/// The task as the ABI passes it; `slot`: its run's handle (null where no run is live: `on_dead`).
fn task_view<'a>(run: &'a Run<'a>, retry_after_ms: &'a mut i64, slot: *mut c_void) -> KmqTask {
    KmqTask {
        id: KmqStr::borrow(run.envelope.id_str()),
        queue: KmqStr::borrow(run.queue),
        type_: KmqStr::borrow(&run.envelope.kind),
        data: KmqStr::borrow(run.envelope.data.get()),
        attempt: run.envelope.attempt,
        created_at_ms: run.envelope.created_at.unwrap_or(0),
        deadline_ms: run.deadline_ms,
        cancel: run.cancel.as_ptr().cast_const(),
        retry_after_ms,
        run: slot,
    }
}

impl LoadedPlugin {
    /// Runs one attempt. `message` is the caller's scratch buffer, reused across calls.
    pub(crate) fn handle(&self, run: &Run<'_>, message: &mut Vec<u8>) -> Status {
        // Zeroed once, then reused as is: the plugin overwrites what it reports, and stale bytes past `len` are
        // never read.
        if message.len() != MESSAGE_CAPACITY {
            message.resize(MESSAGE_CAPACITY, 0);
        }
        let mut retry_after_ms: i64 = -1;
        let mut slot = run.slot();
        let task = task_view(run, &mut retry_after_ms, slot.handle());
        let mut buf = KmqBuf {
            ptr: message.as_mut_ptr().cast::<c_char>(),
            cap: message.len(),
            len: 0,
        };
        // SAFETY: the ABI call: every pointer in `task` and `buf` is valid until it returns, `state` is what init
        // returned, and `handle` is thread-safe by contract.
        let status = unsafe { (self.handle)(self.state, &task, &mut buf) };
        let len = buf.len.min(MESSAGE_CAPACITY);
        let status = status_of(
            status,
            || String::from_utf8_lossy(&message[..len]).into_owned(),
            retry_after_ms,
        );
        with_result(status, &mut slot)
    }

    /// Whether the plugin may take tasks without a thread waiting for each (`start`).
    pub(crate) fn starts(&self) -> bool {
        self.start.is_some()
    }

    /// Starts one attempt without waiting for it: `Ok` when the plugin took it (`completion` then runs once, on
    /// whichever thread the plugin completes it from, possibly before this returns), `Err(completion)` when the
    /// plugin has no `start` or declined (run it through [`LoadedPlugin::handle`]). `run.cancel` must stay valid
    /// until `completion` runs.
    pub(crate) fn start(&self, run: &Run<'_>, completion: Completion) -> Result<(), Completion> {
        let Some(start) = self.start else {
            return Err(completion);
        };
        let mut retry_after_ms: i64 = -1;
        let ticket = Box::into_raw(Box::new(Ticket {
            completion,
            slot: run.slot(),
        }));
        // SAFETY: the box was just made; its slot stays where it is until `completed` takes the box back.
        let slot = unsafe { (*ticket).slot.handle() };
        let task = task_view(run, &mut retry_after_ms, slot);
        // SAFETY: the ABI call: `task`'s strings are valid until it returns and its cancel flag until the
        // completion runs (the caller's contract); `ticket` is passed back to `completed` once if the plugin
        // takes the task, never if it declines; `start` is thread-safe by contract.
        let declined = unsafe { start(self.state, &task, completed, ticket.cast::<c_void>()) } != 0;
        if declined {
            // SAFETY: a declining start never calls complete: the box is still ours.
            return Err(unsafe { Box::from_raw(ticket) }.completion);
        }
        Ok(())
    }

    /// Tells the plugin a task of its types was dead-lettered.
    pub(crate) fn on_dead(&self, run: &Run<'_>, reason: &str) {
        if let Some(on_dead) = self.on_dead {
            let mut retry_after_ms = -1;
            let task = task_view(run, &mut retry_after_ms, std::ptr::null_mut());
            // SAFETY: as in `handle`; `reason` is borrowed for the call.
            unsafe { on_dead(self.state, &task, KmqStr::borrow(reason)) };
        }
    }

    /// Calls the plugin's shutdown, once. The caller guarantees no `handle` is running or will run.
    pub(crate) fn shutdown(&self) {
        if self.shut_down.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(shutdown) = self.shutdown {
            // SAFETY: called once (the flag above), after the last handle returned (the daemon's shutdown
            // sequence, or the last reference going: see `Drop`).
            unsafe { shutdown(self.state) };
        }
    }
}

/// The last reference to a plugin went: nothing can call into it any more (every caller, a worker's task, an
/// acker's or the monitor's hook, holds a reference for the call), so its `shutdown` runs now, if it has not. This
/// is how a plugin replaced by a reload is shut down once its last task finished; the library stays mapped.
impl Drop for LoadedPlugin {
    fn drop(&mut self) {
        self.shutdown();
    }
}
