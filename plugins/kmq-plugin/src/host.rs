//! The host side of the ABI: reading a plugin's descriptor, calling its `init` and reading its types. kmqd's
//! loader and the test [`crate::testing::Harness`] both use it, so a plugin the harness accepts is a plugin kmqd
//! accepts, and the reasons for refusing one are the same.

use std::ffi::{CStr, c_char, c_void};
use std::mem::offset_of;

use crate::abi::{
    HandleFn, InitFn, KMQ_ABI_VERSION, KmqBuf, KmqPlugin, KmqStr, MESSAGE_CAPACITY,
    MIN_STRUCT_SIZE, OnDeadFn, ShutdownFn, StartFn,
};

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
