//! The C ABI of `plugins/include/kmq_plugin.h`, version 1, as Rust types.
//!
//! The header is the source of truth; these declarations mirror it field for field (a test compiles the header
//! and compares sizes and offsets). Both the host (`kmqd`) and Rust plugins use these types, so the two sides
//! cannot drift apart.

use std::ffi::{c_char, c_void};

/// The only ABI version this crate speaks.
pub const KMQ_ABI_VERSION: u32 = 1;

/// The exported symbol every plugin provides, with its trailing NUL as `libloading` wants it.
pub const PLUGIN_SYMBOL: &[u8] = b"kmq_plugin_v1\0";

/// The smallest descriptor a host accepts: the v1 fields up to and including `handle`, the last one it needs.
/// `on_dead` and `shutdown` may lie beyond a plugin's `struct_size`; the host then treats them as NULL.
pub const MIN_STRUCT_SIZE: usize =
    std::mem::offset_of!(KmqPlugin, handle) + size_of::<Option<HandleFn>>();

/// How many bytes the message buffers of kmqd (and of [`crate::testing::Harness`]) hold. Not part of the ABI: a
/// plugin must honour the `cap` it is given; longer messages are cut.
pub const MESSAGE_CAPACITY: usize = 1024;

/// `kmq_str`: UTF-8 text that is not NUL-terminated, valid only during the call it is passed to.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KmqStr {
    pub ptr: *const u8,
    pub len: usize,
}

impl KmqStr {
    /// Borrows `s` for the duration of a call.
    pub fn borrow(s: &str) -> KmqStr {
        KmqStr {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }

    /// Reads the text back.
    ///
    /// # Safety
    /// `ptr` must point at `len` readable bytes that stay valid for `'a` (the ABI guarantees this for the
    /// duration of a call).
    pub unsafe fn as_bytes<'a>(&self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the caller guarantees ptr/len describe live memory.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// `kmq_task`: one run of a task.
#[repr(C)]
#[derive(Debug)]
pub struct KmqTask {
    pub id: KmqStr,
    pub queue: KmqStr,
    pub type_: KmqStr,
    pub data: KmqStr,
    pub attempt: u32,
    pub created_at_ms: i64,
    pub deadline_ms: i64,
    /// `const volatile uint32_t *`: the host's cancel flag. `AtomicU32` has the layout of `u32`.
    pub cancel: *const u32,
    /// Out-parameter for `KMQ_RETRY`: ms before the next attempt; -1 means the queue's backoff. For `KMQ_THROTTLE`:
    /// ms during which the queue takes no task.
    pub retry_after_ms: *mut i64,
    /// Appended within v1: the host's handle for this run, for [`KmqHost`]'s calls; present only in a task of a
    /// host that called the plugin's `host` (read it only then).
    pub run: *mut c_void,
}

/// `kmq_host`: what a host offers a running task (appended within v1; handed to the plugin's `host`).
#[repr(C)]
#[derive(Debug)]
pub struct KmqHost {
    pub struct_size: u32,
    pub result: Option<ResultFn>,
    /// Appended within v1: beyond an older host's `struct_size`, read as NULL (its tasks waited for nothing).
    pub dependencies: Option<DependenciesFn>,
    /// Appended within v1: beyond an older host's `struct_size`, read as NULL (no trace context).
    pub traceparent: Option<TraceFn>,
    /// Appended with `traceparent`.
    pub tracestate: Option<TraceFn>,
    /// Appended within v1: beyond an older host's `struct_size`, read as NULL (its tasks report no progress).
    pub progress: Option<ProgressFn>,
}

/// `kmq_host.traceparent` and `kmq_host.tracestate`: the run's W3C trace context fields; empty text when the task
/// has none. Valid while the run is.
pub type TraceFn = unsafe extern "C" fn(run: *mut c_void) -> KmqStr;

/// `kmq_host.progress`: reports how far a run is, a fraction from 0 to 1 (NaN ignored, others clamped) and a short
/// message (copied during the call; at most 1 KiB kept).
pub type ProgressFn = unsafe extern "C" fn(run: *mut c_void, fraction: f32, message: KmqStr);

/// `kmq_host.dependencies`: the outcomes of the tasks a run's task waited for (a flow's `after`), a JSON list;
/// empty text when it waited for none. Valid while the run is.
pub type DependenciesFn = unsafe extern "C" fn(run: *mut c_void) -> KmqStr;
/// `kmq_host.result`: attaches a JSON result to a run.
pub type ResultFn = unsafe extern "C" fn(run: *mut c_void, json: KmqStr);
/// The descriptor's `host`: hands the plugin what the host offers.
pub type HostFn = unsafe extern "C" fn(host: *const KmqHost);

/// `kmq_status`: a C enum, which is `int`-sized on every platform kmqd supports.
pub type KmqStatus = i32;
pub const KMQ_DONE: KmqStatus = 0;
pub const KMQ_RETRY: KmqStatus = 1;
pub const KMQ_FAIL: KmqStatus = 2;
/// Added within v1 (an older host reads it as a status outside the ABI: a retry with the queue's backoff).
pub const KMQ_THROTTLE: KmqStatus = 3;

/// `kmq_buf`: a host-owned output buffer the plugin writes at most `cap` bytes into.
#[repr(C)]
#[derive(Debug)]
pub struct KmqBuf {
    pub ptr: *mut c_char,
    pub cap: usize,
    pub len: usize,
}

impl KmqBuf {
    /// Copies as much of `text` as fits, cut at a UTF-8 character boundary, and sets `len`.
    ///
    /// # Safety
    /// `ptr` must point at `cap` writable bytes.
    pub unsafe fn write(&mut self, text: &str) {
        let mut n = text.len().min(self.cap);
        while !text.is_char_boundary(n) {
            n -= 1;
        }
        if n > 0 {
            // SAFETY: n <= cap and the caller guarantees ptr has cap writable bytes; the regions cannot overlap
            // because the buffer is host-owned and `text` is the plugin's.
            unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), self.ptr.cast::<u8>(), n) };
        }
        self.len = n;
    }
}

pub type InitFn = unsafe extern "C" fn(config: KmqStr, err: *mut KmqBuf) -> *mut c_void;
pub type HandleFn =
    unsafe extern "C" fn(state: *mut c_void, task: *const KmqTask, msg: *mut KmqBuf) -> KmqStatus;
pub type OnDeadFn = unsafe extern "C" fn(state: *mut c_void, task: *const KmqTask, reason: KmqStr);
pub type ShutdownFn = unsafe extern "C" fn(state: *mut c_void);
/// `kmq_complete_fn`: the host's callback for a task a plugin took in `start`.
pub type CompleteFn =
    unsafe extern "C" fn(ticket: *mut c_void, status: KmqStatus, msg: KmqStr, retry_after_ms: i64);
/// `start`: 0 when the plugin took the task (it calls `complete` once), non-zero when it declines.
pub type StartFn = unsafe extern "C" fn(
    state: *mut c_void,
    task: *const KmqTask,
    complete: CompleteFn,
    ticket: *mut c_void,
) -> i32;

/// `kmq_plugin`: the descriptor `kmq_plugin_v1()` returns.
#[repr(C)]
#[derive(Debug)]
pub struct KmqPlugin {
    pub abi_version: u32,
    pub struct_size: u32,
    pub name: *const c_char,
    pub types: *const *const c_char,
    pub init: Option<InitFn>,
    pub handle: Option<HandleFn>,
    pub on_dead: Option<OnDeadFn>,
    pub shutdown: Option<ShutdownFn>,
    /// Appended within v1: beyond an older plugin's `struct_size`, read as NULL.
    pub start: Option<StartFn>,
    /// Appended within v1: beyond an older plugin's `struct_size`, read as NULL (and never called).
    pub host: Option<HostFn>,
}

/// The signature of the exported `kmq_plugin_v1` symbol.
pub type EntryFn = unsafe extern "C" fn() -> *const KmqPlugin;
