//! A [`Pulse`]: the counter a long-lived loop bumps every turn, so that the watchdog (`daemon::watchdog`) can tell
//! a thread that loops, however idle, from one that hangs.
//!
//! A leaf: it imports nothing of the crate, so every layer that beats one (a lane's stages, the per-daemon
//! threads, the [`settler`](crate::settler) they share) can name it without importing the watchdog that reads it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A counter a loop bumps every turn, which the watchdog reads to tell a looping thread from a hung one. Cheap
/// to bump (one relaxed add) and to clone (the clones share the count).
#[derive(Debug, Clone, Default)]
pub struct Pulse(Arc<AtomicU64>);

impl Pulse {
    pub fn beat(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}
