//! The host side of the ABI: reading a plugin's descriptor, calling its `init` and reading its types, and what a
//! host offers a running task (`kmq_host`: a result, kept in the run's [`RunSlot`]). kmqd's
//! loader and the test [`crate::testing::Harness`] both use it, so a plugin the harness accepts is a plugin kmqd
//! accepts, and the reasons for refusing one are the same.

use std::ffi::{CStr, c_char, c_void};
use std::mem::offset_of;
use std::sync::Mutex;

use crate::abi::{
    HandleFn, HostFn, InitFn, KMQ_ABI_VERSION, KmqBuf, KmqHost, KmqPlugin, KmqStr,
    MESSAGE_CAPACITY, MIN_STRUCT_SIZE, OnDeadFn, ShutdownFn, StartFn,
};

/// What a host offers a running task (`kmq_host`): kmqd's and the test harness's, handed to a plugin's `host`
/// before its first `init`. A static, so it lives as long as the process, as the ABI promises.
pub static HOST: KmqHost = KmqHost {
    struct_size: size_of::<KmqHost>() as u32,
    result: Some(result_given),
    dependencies: Some(dependencies_given),
    traceparent: Some(traceparent_given),
    tracestate: Some(tracestate_given),
    progress: Some(progress_given),
};

/// Where a run's progress reports go: kmqd's lane (which writes the latest of each task to Redis a few times a
/// second), or a test's. `run` is the number the host gave the run's slot ([`RunSlot::new`]).
pub trait ProgressSink: Send + Sync {
    fn progress(&self, run: u64, fraction: f32, message: &str);
}

impl std::fmt::Debug for dyn ProgressSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProgressSink")
    }
}

/// One run's slot for what the plugin hands on besides its status: the task's `run` handle
/// ([`RunSlot::handle`]) points at it while the run is live (until `handle` returns, or until `complete` is
/// called for a task taken in `start`), so it must not move meanwhile.
#[derive(Debug, Default)]
pub struct RunSlot {
    result: Mutex<Option<String>>,
    /// What the run is handed besides its task, when it is handed anything: boxed, so that the slot of a run
    /// handed nothing (most: no flow, no trace context) is small and is built and dropped with one word for it.
    context: Option<Box<RunContext>>,
    /// Where the run's progress reports go, and the run's number there; `None`: they are dropped. A pointer, not
    /// an `Arc`: a count shared by every worker of a lane, bumped per run, would be a cache line they all write
    /// (the one check a run of a queue whose handlers never report may cost). [`RunSlot::new`]'s caller
    /// keeps the sink alive as long as the run.
    progress: Option<(*const dyn ProgressSink, u64)>,
}

/// The texts a run's handler may ask the host for ([`RunSlot`]'s `context`), each `None` when the run has none.
#[derive(Debug)]
struct RunContext {
    /// The outcomes of the tasks the run's task waited for (its envelope's `after`: docs/design/flows.md), as
    /// the JSON list the host passes on.
    after: Option<String>,
    /// The run's W3C trace context (`kmq_host.traceparent`, `kmq_host.tracestate`).
    traceparent: Option<String>,
    tracestate: Option<String>,
}

// SAFETY: the sink is `Send + Sync` and outlives the slot ([`RunSlot::new`]'s contract); the other fields
// are `Send + Sync` themselves.
unsafe impl Send for RunSlot {}
// SAFETY: as above.
unsafe impl Sync for RunSlot {}

impl RunSlot {
    /// The slot of one run, every field set at once: the outcomes of the tasks its task waited for (`after`, a
    /// JSON list), the W3C trace context it is handed (`traceparent`, `tracestate`), and where its progress
    /// reports go (`progress`: the sink and the run's number there; `None`: dropped). One constructor, every field
    /// written once where the slot is kept: the three builder steps it replaced each moved the whole slot (a call
    /// of `memcpy`) for every task, whatever the task carried (docs/PERFORMANCE.md, "The hot path after tracing,
    /// expiry and progress (2026-12-07)").
    ///
    /// # Safety
    /// The sink, if any, must outlive the run: until `handle` returned, or until `complete` was called for a
    /// task taken in `start` (kmqd's lane, whose sink this is, outlives every run of its tasks).
    pub unsafe fn new(
        after: Option<&str>,
        traceparent: Option<&str>,
        tracestate: Option<&str>,
        progress: Option<(*const dyn ProgressSink, u64)>,
    ) -> RunSlot {
        let handed = after.is_some() || traceparent.is_some() || tracestate.is_some();
        RunSlot {
            result: Mutex::new(None),
            context: handed.then(|| {
                Box::new(RunContext {
                    after: after.map(str::to_string),
                    traceparent: traceparent.map(str::to_string),
                    tracestate: tracestate.map(str::to_string),
                })
            }),
            progress,
        }
    }

    /// What the run is handed besides its task, if anything.
    fn context(&self) -> Option<&RunContext> {
        self.context.as_deref()
    }

    /// The run's handle, `kmq_task.run`.
    pub fn handle(&self) -> *mut c_void {
        std::ptr::from_ref(self).cast_mut().cast::<c_void>()
    }

    /// The JSON text the run handed on as its result, if any, once the run is over and its slot is the
    /// caller's alone (`&mut`): no lock taken, and the slot is not moved (a move copies the whole slot: the
    /// drain's memcpy grew by 30-50 instructions a task when this took `self`).
    pub fn ended_result(&mut self) -> Option<String> {
        // A poisoned lock only means a thread panicked while it set the text: what it holds is still a value.
        self.result
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
    }

    /// The JSON text the run handed on as its result, if any.
    pub fn take_result(&self) -> Option<String> {
        // A poisoned lock only means a thread panicked while it set the text: what it holds is still a value.
        self.result
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
    }
}

/// A text of the run's slot, or empty text. Borrowed from the slot, which outlives the run.
///
/// # Safety
/// `run` is null or the handle of a live run (the ABI's rule).
unsafe fn slot_text(run: *mut c_void, text: impl FnOnce(&RunSlot) -> Option<&str>) -> KmqStr {
    if run.is_null() {
        return KmqStr::borrow("");
    }
    // SAFETY: `run` is the handle of a live run (the caller's contract): a `RunSlot` that outlives the run.
    let slot = unsafe { &*run.cast::<RunSlot>() };
    KmqStr::borrow(text(slot).unwrap_or(""))
}

/// `kmq_host.dependencies`: the run's `after` list, or empty text.
unsafe extern "C" fn dependencies_given(run: *mut c_void) -> KmqStr {
    // SAFETY: the ABI's rule: `run` is the handle of a live run.
    unsafe { slot_text(run, |slot| slot.context()?.after.as_deref()) }
}

/// `kmq_host.traceparent`: the run's trace context, or empty text.
unsafe extern "C" fn traceparent_given(run: *mut c_void) -> KmqStr {
    // SAFETY: the ABI's rule: `run` is the handle of a live run.
    unsafe { slot_text(run, |slot| slot.context()?.traceparent.as_deref()) }
}

/// `kmq_host.tracestate`: the producer's trace state, or empty text.
unsafe extern "C" fn tracestate_given(run: *mut c_void) -> KmqStr {
    // SAFETY: the ABI's rule: `run` is the handle of a live run.
    unsafe { slot_text(run, |slot| slot.context()?.tracestate.as_deref()) }
}

/// `kmq_host.result`: keeps the run's JSON text (the last call wins). The whole text is copied: kmqd bounds what
/// it keeps, and says so in the kept record (docs/PROTOCOL.md, "Results").
unsafe extern "C" fn result_given(run: *mut c_void, json: KmqStr) {
    if run.is_null() {
        return;
    }
    // SAFETY: the text is valid for the call (the ABI's rule); it is copied here.
    let text = String::from_utf8_lossy(unsafe { json.as_bytes() }).into_owned();
    // SAFETY: `run` is the handle of a live run (the ABI's rule): a `RunSlot` that outlives the run.
    let slot = unsafe { &*run.cast::<RunSlot>() };
    // Nothing may unwind into the plugin; a poisoned lock still holds a value.
    *slot
        .result
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(text);
}

/// `kmq_host.progress`: hands the report to the run's sink, if it has one (the sink validates it).
unsafe extern "C" fn progress_given(run: *mut c_void, fraction: f32, message: KmqStr) {
    if run.is_null() {
        return;
    }
    // SAFETY: `run` is the handle of a live run (the ABI's rule): a `RunSlot` that outlives the run.
    let slot = unsafe { &*run.cast::<RunSlot>() };
    let Some((sink, number)) = slot.progress else {
        return;
    };
    // SAFETY: the sink outlives the run (`RunSlot::new`'s contract), which is live (the ABI's rule).
    let sink = unsafe { &*sink };
    // SAFETY: the text is valid for the call (the ABI's rule); the sink copies what it keeps.
    let text = String::from_utf8_lossy(unsafe { message.as_bytes() });
    // Nothing may unwind into the plugin: a sink that panicked is a report lost, not a process aborted.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        sink.progress(number, fraction, &text)
    }));
}

/// Why a descriptor is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `kmq_plugin_v1()` returned NULL.
    Null,
    /// An ABI version other than [`KMQ_ABI_VERSION`].
    Version { found: u32 },
    /// A `struct_size` smaller than [`MIN_STRUCT_SIZE`].
    TooSmall { found: usize },
    /// A NULL `handle`.
    NoHandle,
}

/// The fields of a plugin's descriptor, read as far as its `struct_size` covers them.
#[derive(Debug)]
pub struct Descriptor {
    raw: *const KmqPlugin,
    /// The name the plugin gives itself, if any.
    pub name: Option<String>,
    init: Option<InitFn>,
    pub handle: HandleFn,
    pub on_dead: Option<OnDeadFn>,
    pub shutdown: Option<ShutdownFn>,
    pub start: Option<StartFn>,
    /// The plugin's `host` (appended within v1): `None` for a plugin built before it, which is never given one.
    pub host: Option<HostFn>,
}

/// Reads a NUL-terminated string owned by the plugin.
///
/// # Safety
/// `ptr` must be null or point at a NUL-terminated string that outlives the call.
pub unsafe fn c_string(ptr: *const c_char) -> Option<String> {
    (!ptr.is_null()).then(|| {
        // SAFETY: not null, and the caller guarantees a NUL-terminated string that outlives the call.
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    })
}

/// Checks and reads the descriptor `kmq_plugin_v1()` returned: the version first (the only field every version
/// has at the same place), then the size, then the fields the size covers.
///
/// # Safety
/// `raw` must be null or point at a descriptor that lives as long as the library, as the ABI prescribes.
pub unsafe fn read(raw: *const KmqPlugin) -> Result<Descriptor, Refusal> {
    if raw.is_null() {
        return Err(Refusal::Null);
    }
    // SAFETY: `abi_version` is the first field of every version of the descriptor, so reading it alone is valid
    // whatever the plugin's version.
    let abi_version = unsafe { std::ptr::read(raw.cast::<u32>()) };
    if abi_version != KMQ_ABI_VERSION {
        return Err(Refusal::Version { found: abi_version });
    }
    // SAFETY: version 1 guarantees `struct_size` as the second u32.
    let struct_size = unsafe { std::ptr::read(raw.cast::<u32>().add(1)) } as usize;
    if struct_size < MIN_STRUCT_SIZE {
        return Err(Refusal::TooSmall { found: struct_size });
    }
    // SAFETY: the descriptor is at least MIN_STRUCT_SIZE bytes, which covers every field up to `handle`.
    let (name, init, handle) = unsafe { ((*raw).name, (*raw).init, (*raw).handle) };
    let covers = |offset: usize, size: usize| offset + size <= struct_size;
    let on_dead = if covers(
        offset_of!(KmqPlugin, on_dead),
        size_of::<Option<OnDeadFn>>(),
    ) {
        // SAFETY: struct_size covers the field.
        unsafe { (*raw).on_dead }
    } else {
        None
    };
    let shutdown = if covers(
        offset_of!(KmqPlugin, shutdown),
        size_of::<Option<ShutdownFn>>(),
    ) {
        // SAFETY: struct_size covers the field.
        unsafe { (*raw).shutdown }
    } else {
        None
    };
    let start = if covers(offset_of!(KmqPlugin, start), size_of::<Option<StartFn>>()) {
        // SAFETY: struct_size covers the field.
        unsafe { (*raw).start }
    } else {
        None
    };
    let host = if covers(offset_of!(KmqPlugin, host), size_of::<Option<HostFn>>()) {
        // SAFETY: struct_size covers the field.
        unsafe { (*raw).host }
    } else {
        None
    };
    // SAFETY: the ABI makes `name` a NUL-terminated string that lives as long as the library.
    let name = unsafe { c_string(name) };
    let handle = handle.ok_or(Refusal::NoHandle)?;
    Ok(Descriptor {
        raw,
        name,
        init,
        handle,
        on_dead,
        shutdown,
        start,
        host,
    })
}

/// What an `init` that returned NULL wrote into its error buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitFailure {
    /// The message, cut at the buffer's capacity.
    pub message: String,
    /// The length the plugin claimed, when larger than the buffer (a plugin bug the harness reports).
    pub claimed_len: Option<usize>,
}

impl Descriptor {
    /// Runs `init` with `config_json` (NULL `init`: the state is NULL).
    ///
    /// # Safety
    /// The descriptor's library must still be loaded, and `init` must not have been called before.
    pub unsafe fn init(&self, config_json: &str) -> Result<*mut c_void, InitFailure> {
        let Some(init) = self.init else {
            return Ok(std::ptr::null_mut());
        };
        let mut message = vec![0u8; MESSAGE_CAPACITY];
        let mut err = KmqBuf {
            ptr: message.as_mut_ptr().cast::<c_char>(),
            cap: message.len(),
            len: 0,
        };
        // SAFETY: init gets a borrowed config string and a host-owned buffer, both valid for the call.
        let state = unsafe { init(KmqStr::borrow(config_json), &mut err) };
        if !state.is_null() {
            return Ok(state);
        }
        let len = err.len.min(message.len());
        Err(InitFailure {
            message: String::from_utf8_lossy(&message[..len]).into_owned(),
            claimed_len: (err.len > message.len()).then_some(err.len),
        })
    }

    /// The task types the plugin lists; read after `init`, which may fill them from its config.
    ///
    /// # Safety
    /// The descriptor's library must still be loaded.
    pub unsafe fn types(&self) -> Vec<String> {
        let mut types = Vec::new();
        // SAFETY: within struct_size (checked by `read`); a NULL-terminated list that lives as long as the library.
        let mut cursor = unsafe { (*self.raw).types };
        if !cursor.is_null() {
            // SAFETY: as above; the loop stops at the terminating NULL.
            while let Some(kind) = unsafe { c_string(*cursor) } {
                types.push(kind);
                // SAFETY: not past the terminator yet.
                cursor = unsafe { cursor.add(1) };
            }
        }
        types
    }
}
