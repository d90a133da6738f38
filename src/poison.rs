//! The daemon's locks, taken whether or not a panic poisoned them: the one place that decides so (review D4).
//!
//! Why poisoning is tolerated: a panic caught where it happens must not take the daemon down with it. Two places
//! catch one and go on: a started task's completion, run on the plugin's thread (src/plugin/ffi.rs: the task stays
//! held), and an HTTP request's handler (src/http.rs: a 500, the dashboard serves on). Either may hold a lock of
//! the lane's or the dashboard's when it unwinds; `lock().unwrap()` would then turn that one panic into a panic of
//! every thread that next takes the lock.
//!
//! Why the data is still good: every critical section these guard leaves its data consistent at any point where it
//! could unwind, for one of four reasons (each site was checked; a new lock must fit one, or say what it does):
//! - it guards no data, only a wait or a turn: the lane's slots and capacity, the dashboard's password verifications
//!   and lookups;
//! - its value is replaced whole, by one assignment computed before it, or taken (`Option::take`,
//!   `mem::take`): the lanes and the plugin registry (an `Arc` swapped), the watchdog's thread list, the shutdown's
//!   sender, the dashboard's overview (each field assigned whole: a poll cut short leaves the last one's rows,
//!   whose rates are still rates over the time they name), a lane's owner (`Ownership`: every field of the new
//!   value is computed before the first is written; `while_current`'s closure runs under the lock but cannot touch
//!   it);
//! - it is a std collection changed by single calls (push, pop, insert, remove, drain, swap, retain), which do not
//!   unwind midway (running out of memory aborts): the lane's held table, jobs, outcomes, orphans, progress
//!   reports, kept plugins and unhandled types, the dashboard's password cache and groups reads;
//! - it is counts, at worst one event short: the outage report's, the OTLP export failures, the metrics scrape's
//!   tickets, a lane's per-type counts (`Started::complete` holds them across the task's resolution; a panic there
//!   leaves that task's outcome uncounted, and the counts flushed so far true).
//!
//! One does not fit: the Redis Sentinel client (`broker::connection`) is redis-rs's, whose state a panic inside it
//! could leave anything; it is a cache of the sentinels' answers, and a broken one gives connection errors, which
//! every caller already retries with backoff: no worse than the panics `unwrap` would spread.

use std::sync::{
    LockResult, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
};

/// `mutex`'s guard, poisoned or not.
pub(crate) fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    recover(mutex.lock())
}

/// `lock`'s read guard, poisoned or not.
pub(crate) fn read<T: ?Sized>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    recover(lock.read())
}

/// `lock`'s write guard, poisoned or not.
pub(crate) fn write<T: ?Sized>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    recover(lock.write())
}

/// What a lock call or a `Condvar` wait returns, poisoned or not: a wait gives its guard back poisoned if another
/// thread panicked while holding the lock meanwhile.
pub(crate) fn recover<G>(result: LockResult<G>) -> G {
    result.unwrap_or_else(PoisonError::into_inner)
}
