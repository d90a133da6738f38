//! A task a plugin took in [`Handler::start`](crate::Handler::start) and finishes later, from any thread.
//!
//! The host hands `start` a callback and a ticket; a [`Completion`] owns the two and calls the callback exactly
//! once: through [`Completion::complete`], or, when it is dropped without that (a plugin that lost the task, or
//! panicked), with a retry that says so, so that a task taken is never stranded in the daemon.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::Outcome;
use crate::abi::{self, CompleteFn, KmqStatus, KmqStr};

/// The right to report one started task's outcome; see the module's doc.
pub struct Completion {
    /// `None` once called (or handed back to the host by a declining `start`).
    complete: Option<CompleteFn>,
    ticket: *mut c_void,
    /// The host's cancel flag for the task: valid until `complete` is called (kmq_plugin.h, `start`).
    cancel: *const u32,
    /// The host's run handle for the task (`kmq_task.run`), for its result: valid until `complete` is called;
    /// null with a host that offers no results.
    run: *mut c_void,
}

// SAFETY: the ABI lets `complete` be called from any thread, and the cancel flag is only ever read atomically;
// the ticket is the host's, passed back untouched.
unsafe impl Send for Completion {}

impl Completion {
    /// Wraps what the host passed to `start`.
    ///
    /// # Safety
    /// `complete` and `ticket` must be what a host passed to one `start` call, and `cancel` that call's task's flag
    /// (or null); the completion must be either completed (or dropped) once, or given back with
    /// [`Completion::decline`] when `start` declines.
    pub unsafe fn from_raw(
        complete: CompleteFn,
        ticket: *mut c_void,
        cancel: *const u32,
    ) -> Completion {
        Completion {
            complete: Some(complete),
            ticket,
            cancel,
            run: std::ptr::null_mut(),
        }
    }

    /// The task's run handle (`kmq_task.run`, null when the host offers none), through which a done outcome's
    /// result reaches the host before the completion.
    pub(crate) fn with_run(mut self, run: *mut c_void) -> Completion {
        self.run = run;
        self
    }

    /// True once the host wants this run to stop early (execution timeout or shutdown): complete it soon, with
    /// a retry.
    pub fn is_cancelled(&self) -> bool {
        if self.cancel.is_null() {
            return false;
        }
        // SAFETY: the host keeps the flag alive until `complete` is called, which has not happened while `self`
        // exists, and writes it only atomically (see `Task::is_cancelled`).
        let flag = unsafe { AtomicU32::from_ptr(self.cancel.cast_mut()) };
        flag.load(Ordering::Relaxed) != 0
    }

    /// Reports how far the task is (as [`crate::Task::progress`]: NaN ignored, anything else clamped to 0..=1 by
    /// the host), any number of times before the completion; nothing under a host older than progress.
    pub fn progress(&self, fraction: f32, message: &str) {
        let Some(report) = crate::export::progress_fn() else {
            return;
        };
        if self.run.is_null() {
            return;
        }
        // SAFETY: the run handle is live until `complete` is called, which has not happened while `self` exists;
        // the host copies the message during the call.
        unsafe { report(self.run, fraction, crate::abi::KmqStr::borrow(message)) };
    }

    /// Reports the attempt's outcome to the host.
    pub fn complete(mut self, outcome: Outcome) {
        self.call(&outcome);
    }

    /// Gives the task back without an outcome, for a `start` that declines it (the host runs it through
    /// `handle` then). Only the SDK's `start` calls this.
    pub(crate) fn decline(mut self) {
        self.complete = None;
    }

    fn call(&mut self, outcome: &Outcome) {
        let Some(complete) = self.complete.take() else {
            return;
        };
        // SAFETY: the run handle is live until `complete` is called, which is below.
        unsafe { crate::export::hand_result(self.run, outcome) };
        let (status, message, retry_after_ms) = abi_parts(outcome);
        // SAFETY: `complete` and `ticket` came from one `start` call (`from_raw`'s contract), and `take` above
        // makes this the only call; the message is borrowed for the call, which copies it.
        unsafe { complete(self.ticket, status, KmqStr::borrow(message), retry_after_ms) };
    }
}

/// A completion never called still completes its task: as a retry, so that the daemon does not hold it until it
/// stops, with the reason.
impl Drop for Completion {
    fn drop(&mut self) {
        let reason = if std::thread::panicking() {
            "the plugin panicked before it completed the task"
        } else {
            "the plugin dropped the task without completing it"
        };
        self.call(&Outcome::retry(reason));
    }
}

/// An outcome as the ABI carries it: status, message (output for a done task) and the retry or throttle delay
/// in ms (-1: the queue's backoff).
pub(crate) fn abi_parts(outcome: &Outcome) -> (KmqStatus, &str, i64) {
    match outcome {
        Outcome::Done => (abi::KMQ_DONE, "", -1),
        Outcome::DoneWithOutput { output } => (abi::KMQ_DONE, output, -1),
        // The result went to the host before (`hand_result`).
        Outcome::DoneWithResult { .. } => (abi::KMQ_DONE, "", -1),
        Outcome::Retry { after, reason } => (
            abi::KMQ_RETRY,
            reason,
            after.map_or(-1, |after| {
                i64::try_from(after.as_millis()).unwrap_or(i64::MAX)
            }),
        ),
        Outcome::Fail { reason } => (abi::KMQ_FAIL, reason, -1),
        Outcome::Throttle { after, reason } => (
            abi::KMQ_THROTTLE,
            reason,
            i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
        ),
    }
}
