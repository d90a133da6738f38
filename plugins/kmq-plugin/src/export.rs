//! What [`crate::export!`] expands to: the `extern "C"` side of a Rust plugin.
//!
//! Every function here catches panics before they reach the boundary: unwinding out of an `extern "C"` function
//! aborts the process, and the host cannot catch it. This module is the only unsafe code of the SDK.

use std::any::Any;
use std::cell::{Cell, RefCell, UnsafeCell};
use std::ffi::{CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use crate::abi::{
    self, CompleteFn, KMQ_ABI_VERSION, KmqBuf, KmqHost, KmqPlugin, KmqStatus, KmqStr, KmqTask,
    ResultFn, StartFn,
};
use crate::completion::{Completion, abi_parts};
use crate::{Handler, Task};

/// The plugin's descriptor. `init` fills in `types` before it returns; the host reads the descriptor only from the
/// thread that called `init`, after it returned, so there is no data race. A file named by several
/// `[plugins.NAME]` sections gets one `init` per section, one after another: each rewrites `types` with its
/// instance's, which the host reads before the next `init` (kmq_plugin.h). Everything else of an instance is in
/// the `Box` its `init` returns, so instances share nothing.
pub struct Descriptor(UnsafeCell<KmqPlugin>);

// SAFETY: see the type's doc: each write (in an `init`) happens-before the host's reads that follow it.
unsafe impl Sync for Descriptor {}
// SAFETY: the pointers inside point at leaked, immutable strings, valid from any thread.
unsafe impl Send for Descriptor {}

/// Exactly one handler is exported per library, so one descriptor per library suffices.
static DESCRIPTOR: std::sync::OnceLock<Descriptor> = std::sync::OnceLock::new();

/// Returns the descriptor for `H`, building it on the first call.
pub fn descriptor<H: Handler>() -> *const KmqPlugin {
    let descriptor = DESCRIPTOR.get_or_init(|| {
        Descriptor(UnsafeCell::new(KmqPlugin {
            abi_version: KMQ_ABI_VERSION,
            struct_size: size_of::<KmqPlugin>() as u32,
            name: leak_c_string(H::NAME),
            types: leak_type_list(H::TYPES.iter().copied()),
            init: Some(init::<H>),
            handle: Some(handle::<H>),
            on_dead: Some(on_dead::<H>),
            shutdown: Some(shutdown::<H>),
            start: H::STARTS.then_some(start::<H> as StartFn),
            host: Some(host),
        }))
    });
    descriptor.0.get()
}

/// What the host offers a running task (`kmq_host`), once it gave it (before the first `init`): null until then,
/// and for good with a host older than results, whose tasks have no `run` handle.
static HOST: AtomicPtr<KmqHost> = AtomicPtr::new(std::ptr::null_mut());

/// The descriptor's `host`: keeps the host's offer, which lives as long as the process.
unsafe extern "C" fn host(offer: *const KmqHost) {
    HOST.store(offer.cast_mut(), Ordering::Release);
}

/// A function of the host's offer, when the host offered one and its `struct_size` covers the field, which
/// ends `end` bytes into the offer (fields are appended within v1: an older host's offer ends before them).
fn offered<F: Copy>(end: usize, field: impl FnOnce(&KmqHost) -> Option<F>) -> Option<F> {
    let offer = HOST.load(Ordering::Acquire);
    if offer.is_null() {
        return None;
    }
    // SAFETY: a host's offer lives as long as the process (kmq_plugin.h), and its first field is its size.
    let offer = unsafe { &*offer };
    if (offer.struct_size as usize) < end {
        return None;
    }
    field(offer)
}

/// The host's `result` function, when the host offered one.
fn result_fn() -> Option<ResultFn> {
    let end = std::mem::offset_of!(KmqHost, result) + size_of::<Option<ResultFn>>();
    offered(end, |offer| offer.result)
}

/// The host's `dependencies` function, when the host offered one (a host newer than flows).
pub(crate) fn dependencies_fn() -> Option<crate::abi::DependenciesFn> {
    let end = std::mem::offset_of!(KmqHost, dependencies)
        + size_of::<Option<crate::abi::DependenciesFn>>();
    offered(end, |offer| offer.dependencies)
}

/// The host's `traceparent` and `tracestate` functions, when the host offered them (a host newer than tracing).
pub(crate) fn trace_fns() -> Option<(crate::abi::TraceFn, crate::abi::TraceFn)> {
    let end = std::mem::offset_of!(KmqHost, tracestate) + size_of::<Option<crate::abi::TraceFn>>();
    offered(end, |offer| offer.traceparent.zip(offer.tracestate))
}

/// The host's `progress` function, when the host offered one (a host newer than progress).
pub(crate) fn progress_fn() -> Option<crate::abi::ProgressFn> {
    let end = std::mem::offset_of!(KmqHost, progress) + size_of::<Option<crate::abi::ProgressFn>>();
    offered(end, |offer| offer.progress)
}

/// A task's `run` handle, when the host offers results: only such a host's tasks have the field.
///
/// # Safety
/// `task` must be a task the host passed to the current call.
pub(crate) unsafe fn run_of(task: *const KmqTask) -> *mut c_void {
    if HOST.load(Ordering::Acquire).is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: a host that gave its offer passes tasks with `run` (kmq_plugin.h), valid during the call.
    unsafe { (*task).run }
}

/// Hands a done outcome's result to the host, for the run `run` (null: a host that offers no results, which is
/// told once on stderr, so that a result lost to an old daemon is not a silent mystery).
///
/// # Safety
/// `run` must be null or a live run handle of the host (before `handle` returned or `complete` was called).
pub(crate) unsafe fn hand_result(run: *mut c_void, outcome: &crate::Outcome) {
    let crate::Outcome::DoneWithResult { result } = outcome else {
        return;
    };
    let give = result_fn().filter(|_| !run.is_null());
    let Some(give) = give else {
        static TOLD: AtomicBool = AtomicBool::new(false);
        if !TOLD.swap(true, Ordering::Relaxed) {
            crate::log_line(
                "kmq plugin: this kmqd keeps no results (it is older than kmq_host); a task's result was dropped",
            );
        }
        return;
    };
    let json = result.to_string();
    // SAFETY: the run is live (the caller's contract) and the host copies the text during the call.
    unsafe { give(run, KmqStr::borrow(&json)) };
}

/// The plugin lives until the process exits (hosts never unload it), so its strings may too.
fn leak_c_string(text: &str) -> *const c_char {
    let text = text.replace('\0', "");
    // The NULs are removed above, so CString::new cannot fail.
    CString::new(text).expect("no interior NUL").into_raw()
}

fn leak_type_list<'a>(types: impl Iterator<Item = &'a str>) -> *const *const c_char {
    let mut list: Vec<*const c_char> = types.map(leak_c_string).collect();
    list.push(std::ptr::null());
    Box::leak(list.into_boxed_slice()).as_ptr()
}

/// What a panic on this thread is for, so that the panic hook knows whether to print it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// Not inside an SDK entry point (a thread the plugin spawned, say): std's own report, or the plugin's hook.
    Outside,
    /// Inside `init` or `handle`: the panic becomes the call's result (the host logs it with the task, as one
    /// event), so the hook prints nothing and keeps where it happened for that result.
    Result,
    /// Inside `on_dead` or `shutdown`, which have no result: one line on stderr, never several (a host logging
    /// JSON lines would have them split).
    Report,
}

thread_local! {
    static SCOPE: Cell<Scope> = const { Cell::new(Scope::Outside) };
    /// Where the last panic in a [`Scope::Result`] happened: `file:line`.
    static LOCATION: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Installs, once per library, a panic hook that reports panics in the SDK's entry points as described by
/// [`Scope`] and hands every other panic to the hook that was there before (std's, or the plugin's own). The hook
/// is the library's: a cdylib has its own copy of std, so the host's hook and other plugins' are not touched.
fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let location = info
                .location()
                .map(|l| format!("{}:{}", l.file(), l.line()));
            match SCOPE.with(Cell::get) {
                Scope::Outside => previous(info),
                Scope::Result => LOCATION.with(|last| *last.borrow_mut() = location),
                Scope::Report => {
                    let message = panic_message(info.payload()).replace('\n', "\\n");
                    let at = location.unwrap_or_default();
                    crate::log_line(&format!("kmq plugin: panicked at {at}: {message}"));
                }
            }
        }));
    });
}

/// Runs `f` with panics caught and reported as `scope` says; a caught panic comes back as its message, with where
/// it happened for a [`Scope::Result`] (`boom at src/lib.rs:12`).
fn caught<R>(scope: Scope, f: impl FnOnce() -> R) -> Result<R, String> {
    install_panic_hook();
    let before = SCOPE.with(|current| current.replace(scope));
    let result = catch_unwind(AssertUnwindSafe(f));
    SCOPE.with(|current| current.set(before));
    result.map_err(|panic| {
        let message = panic_message(&*panic);
        match LOCATION.with(|last| last.borrow_mut().take()) {
            Some(location) if scope == Scope::Result => format!("{message} at {location}"),
            _ => message,
        }
    })
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Writes `text` into the host's buffer, if it passed one.
///
/// # Safety
/// `buf` must be null or point at a host-owned `kmq_buf` whose `ptr` has `cap` writable bytes.
unsafe fn write_buf(buf: *mut KmqBuf, text: &str) {
    // SAFETY: the caller's contract: null (then nothing is written) or a valid, exclusive buffer for the call.
    if let Some(buf) = unsafe { buf.as_mut() } {
        // SAFETY: the host hands a buffer with `cap` writable bytes.
        unsafe { buf.write(text) };
    }
}

unsafe extern "C" fn init<H: Handler>(config: KmqStr, err: *mut KmqBuf) -> *mut c_void {
    let result = caught(Scope::Result, || {
        // SAFETY: the host passes valid bytes for the duration of the call.
        let json = unsafe { config.as_bytes() };
        let config: H::Config = serde_json::from_slice(json)
            .map_err(|error| format!("invalid config for plugin {}: {error}", H::NAME))?;
        let handler = H::init(config)?;
        let types = handler.types();
        if let Some(descriptor) = DESCRIPTOR.get() {
            // SAFETY: see `Descriptor`: the host reads `types` only after this call returns.
            unsafe {
                (*descriptor.0.get()).types = leak_type_list(types.iter().map(String::as_str))
            };
        }
        Ok::<_, String>(Box::into_raw(Box::new(handler)).cast::<c_void>())
    });
    let message = match result {
        Ok(Ok(state)) => return state,
        Ok(Err(message)) => message,
        Err(panic) => format!("init panicked: {panic}"),
    };
    // SAFETY: host-owned buffer with `cap` bytes.
    unsafe { write_buf(err, &message) };
    std::ptr::null_mut()
}

unsafe extern "C" fn handle<H: Handler>(
    state: *mut c_void,
    task: *const KmqTask,
    msg: *mut KmqBuf,
) -> KmqStatus {
    let result = caught(Scope::Result, || {
        // SAFETY: `state` came from `init::<H>` and lives until `shutdown`; `task` is valid for the call.
        let (handler, task) = unsafe { (&*state.cast::<H>(), &*task) };
        // SAFETY: as above.
        let view = unsafe { Task::from_raw(task) };
        (handler.handle(&view), task.retry_after_ms)
    });
    match result {
        Ok((outcome, retry_after_ms)) => {
            // SAFETY: `task` is this call's, so its run is live until this returns.
            unsafe { hand_result(run_of(task), &outcome) };
            let (status, message, after) = abi_parts(&outcome);
            let delayed = status == abi::KMQ_RETRY || status == abi::KMQ_THROTTLE;
            if delayed && after >= 0 && !retry_after_ms.is_null() {
                // SAFETY: the host passes a valid out-pointer (checked non-null) for the call.
                unsafe { *retry_after_ms = after };
            }
            // SAFETY: host-owned buffer.
            unsafe { write_buf(msg, message) };
            status
        }
        Err(panic) => {
            // SAFETY: host-owned buffer.
            unsafe { write_buf(msg, &format!("panic: {panic}")) };
            abi::KMQ_RETRY
        }
    }
}

unsafe extern "C" fn start<H: Handler>(
    state: *mut c_void,
    task: *const KmqTask,
    complete: CompleteFn,
    ticket: *mut c_void,
) -> i32 {
    // SAFETY: the host's arguments of one `start` call; the task (and so its cancel pointer) is valid for it.
    let done = unsafe { Completion::from_raw(complete, ticket, (*task).cancel) };
    // SAFETY: as above; the run stays valid until the completion is called.
    let done = done.with_run(unsafe { run_of(task) });
    let result = caught(Scope::Result, || {
        // SAFETY: as in `handle`.
        let (handler, task) = unsafe { (&*state.cast::<H>(), &*task) };
        // SAFETY: as in `handle`.
        let view = unsafe { Task::from_raw(task) };
        handler.start(&view, done)
    });
    match result {
        Ok(Ok(())) => 0,
        Ok(Err(declined)) => {
            declined.decline();
            1
        }
        // The completion was dropped while unwinding, which completed the task (as a retry saying so): taken.
        Err(_) => 0,
    }
}

unsafe extern "C" fn on_dead<H: Handler>(state: *mut c_void, task: *const KmqTask, reason: KmqStr) {
    // A panicking final-failure hook has nobody to report to but stderr: one line there (`Scope::Report`).
    let _ = caught(Scope::Report, || {
        // SAFETY: as in `handle`.
        let (handler, task) = unsafe { (&*state.cast::<H>(), &*task) };
        // SAFETY: valid for the call.
        let view = unsafe { Task::from_raw(task) };
        // SAFETY: valid for the call.
        let reason = String::from_utf8_lossy(unsafe { reason.as_bytes() });
        handler.on_dead(&view, &reason);
    });
}

unsafe extern "C" fn shutdown<H: Handler>(state: *mut c_void) {
    let _ = caught(Scope::Report, || {
        // SAFETY: `state` came from `init::<H>`; the host calls shutdown once, after the last handle returned,
        // so taking the box back (and dropping the handler) is sound.
        let handler = unsafe { Box::from_raw(state.cast::<H>()) };
        handler.shutdown();
    });
}

/// Exports a [`Handler`] as the plugin's `kmq_plugin_v1` symbol.
#[macro_export]
macro_rules! export {
    ($handler:ty) => {
        /// The plugin's entry point (ABI v1); see `kmq_plugin.h`.
        #[unsafe(no_mangle)]
        pub extern "C" fn kmq_plugin_v1() -> *const $crate::abi::KmqPlugin {
            $crate::export::descriptor::<$handler>()
        }
    };
}
