//! The source mover: per queue with `source_lists`, a thread that moves what producers push to their own lists
//! (Redis in Action's `RPUSH queue:email ...`) into the queue's ready lists, so that they work unchanged.
//!
//! Each move is one call of move.lua, which pops up to [`BATCH`] tasks from the heads of the sources and pushes
//! them onto the back of their levels' ready lists (the queue's default level unless the source names another)
//! in the same atomic step, with a wake-up marker: a task is at every instant in its source or in a ready list,
//! whatever fails, however many daemons move the same sources. When the sources are empty the mover blocks in Redis on one of them (`BLMOVE` of the
//! list onto itself, which takes nothing and returns as soon as a producer pushes), for at most the queue's
//! `idle_poll`, then moves; with several sources it blocks on each in turn, so a push to another source waits at
//! most `idle_poll`. The wait takes nothing (rather than `BLMOVE source ready`, which would move one task by
//! itself): every move then goes through move.lua, so each is counted and wakes a fetcher, and a wait whose reply
//! is lost leaves nothing to account for. A full batch is followed at once by the next, so a backlog drains at script speed and the
//! mover's memory stays one batch, in Redis.
//!
//! Moving is not taking: a paused queue (`kmqd queue pause`) keeps its mover, and its tasks gather in the ready
//! lists, where `kmqd stats` counts them. The mover stops with its lane's claiming (a reload that replaces the
//! lane, the shutdown's first stage): what is pushed after that waits in the source for the next mover.

use std::sync::Arc;
use std::time::Duration;

use crate::broker::{self, Session};
use crate::config::{QueueConfig, RedisConfig};
use crate::pulse::Pulse;
use crate::queue::QueueContext;
use crate::retry::{Backoff, Trouble};
use crate::shutdown::Listener;

/// The most tasks one call of move.lua moves: Lua's `unpack` takes them all at once.
pub const BATCH: usize = crate::config::MAX_TAKE;

/// How long the mover of `queue` (one with `source_lists`) may go without a beat before the watchdog counts it as
/// wedged: a move, then the wait on a source (`idle_poll` beyond its read timeout), each with a redirect, then the
/// backoff after a failure. With the defaults: 51.1 s.
pub fn stall_bound(redis: &RedisConfig, queue: &QueueConfig) -> Duration {
    queue.idle_poll + redis.call_bound(4) + Backoff::MAX
}

pub struct SourceMover {
    pub queue: Arc<QueueContext>,
    pub session: Session,
    /// Beaten every turn, for the watchdog (a stage of the queue's lane: [`stall_bound`]).
    pub pulse: Pulse,
    pub stop: Listener,
}

impl SourceMover {
    pub fn run(mut self) {
        let queue = Arc::clone(&self.queue);
        let keys = &queue.keys;
        tracing::info!(
            queue = %queue.config.name,
            sources = ?queue.config.source_lists,
            "moving what producers push to the source lists into the queue (each to its level)"
        );
        let mut backoff = Backoff::new();
        let mut moving = Trouble::new("moving tasks from source lists", Some(&queue.config.name));
        let mut waiting = Trouble::new("waiting on source lists", Some(&queue.config.name));
        // The source the next call starts with, and the next wait blocks on.
        let mut turn = 0usize;
        while !self.stop.is_triggered() {
            self.pulse.beat();
            let moved = self
                .session
                .get()
                .and_then(|connection| broker::move_sources(connection, keys, BATCH, turn));
            turn = turn.wrapping_add(1);
            match moved {
                Ok(moved) => {
                    moving.recovered();
                    if moved > 0 {
                        tracing::debug!(queue = %queue.config.name, moved, "moved tasks from source lists");
                    }
                    if moved == BATCH {
                        backoff.reset();
                        continue;
                    }
                }
                Err(error) => {
                    moving.failed(&error);
                    self.session.reset();
                    if backoff.wait_unless_first(&self.stop) {
                        break;
                    }
                    continue;
                }
            }
            let source = &keys.sources[turn % keys.sources.len()];
            let waited = self.session.get().and_then(|connection| {
                broker::wait_list(connection, source, queue.config.idle_poll, queue.io_timeout)
            });
            match waited {
                // The backoff is reset only by a whole round, so that a wait that keeps failing after moves
                // that work still backs off.
                Ok(_) => {
                    waiting.recovered();
                    backoff.reset();
                }
                Err(error) => {
                    waiting.failed(&error);
                    self.session.reset();
                    if backoff.wait_unless_first(&self.stop) {
                        break;
                    }
                }
            }
        }
        tracing::debug!(queue = %queue.config.name, "source mover stopped");
    }
}
