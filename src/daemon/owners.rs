//! This daemon's owners in Redis at the end of a lane's life: marked draining as a graceful stop begins, released
//! once every outcome is settled (at the stop, or when a reload's replaced lane has settled everything). Its own
//! module because it is the supervisor's only Redis bookkeeping of its own, apart from the start-up checks, done
//! through a [`Session`] of its own (a pool connection, named, closed after a failure) on behalf of lanes whose
//! threads have stopped.
//!
//! The calls run on a thread of their own, `kmqd-owners`, not on the supervisor's (review I3): with Redis
//! unreachable, a release takes up to three `io_timeout`s a lane, and the supervisor, blocked meanwhile, would
//! act on no signal (a SIGTERM, a SIGHUP) and no thread's end. The supervisor hands each step over as a
//! [`Request`] and goes back to its loop; the thread does them in order, on one connection at a time (the one
//! `Config::connections_needed` counts for the supervisor), and ends once the supervisor drops its sender, after
//! the stop's release.

use std::sync::Arc;

use crossbeam_channel::Receiver;

use super::lane::Lane;
use crate::broker::{self, BrokerError, Session};

/// One step of the owners' bookkeeping, handed to the `kmqd-owners` thread.
pub(super) enum Request {
    /// A graceful stop begins: mark these lanes' owners draining.
    Drain(Vec<Arc<Lane>>),
    /// Every outcome of these lanes is settled: release their owners, then run `then` (a replaced lane leaves the
    /// lane set once its owner is released, as it did when the supervisor released it itself).
    Release {
        lanes: Vec<Arc<Lane>>,
        then: Box<dyn FnOnce() + Send>,
    },
}

/// The `kmqd-owners` thread: does each request in the order it came, until the supervisor drops the sender.
pub(super) fn serve(requests: &Receiver<Request>, mut session: Session) {
    for request in requests {
        handle(request, &mut session);
    }
}

/// Does one request (on the owners thread, or on the supervisor's when that thread is not running).
pub(super) fn handle(request: Request, session: &mut Session) {
    match request {
        Request::Drain(lanes) => mark_draining(&lanes, session),
        Request::Release { lanes, then } => {
            release_owners(&lanes, session);
            then();
        }
    }
}

/// Marks this daemon's owners as draining (`kmqd workers` shows it) as its graceful stop begins. Best effort,
/// one try each: a daemon that cannot reach Redis is stopping all the same, and its registration goes when its
/// owner is released.
fn mark_draining(lanes: &[Arc<Lane>], session: &mut Session) {
    let now_ms = broker::local_now_ms();
    for lane in lanes {
        let Some(owner) = lane.ownership.current() else {
            continue;
        };
        let marked = session.call(|connection| {
            broker::admin::mark_draining(connection, &lane.queue.keys, &owner, now_ms)
        });
        if let Err(error) = marked {
            tracing::debug!(queue = %lane.name(), %owner, %error, "cannot mark the owner draining");
        }
    }
}

/// Forgets this daemon's owners, now that every outcome is settled. An owner that still holds tasks (Redis
/// failed while settling) is kept: its lease runs out and the monitors return its tasks to the queue.
fn release_owners(lanes: &[Arc<Lane>], session: &mut Session) {
    /// A pooled connection may have died in the meantime (a `CLIENT KILL`, an idle timeout): try a fresh one.
    const ATTEMPTS: usize = 3;
    for lane in lanes {
        let Some(owner) = lane.ownership.current() else {
            continue;
        };
        // Forgotten here first, so that the heartbeat neither renews it again nor takes its disappearance for a
        // lost lease.
        lane.ownership.lose(&owner);
        let mut released = Err(BrokerError::Reply {
            what: "release",
            detail: "not tried".to_string(),
        });
        for _ in 0..ATTEMPTS {
            released = session.call(|connection| {
                broker::release_unique(connection, &lane.queue.keys, &owner)?;
                broker::release(connection, &lane.queue.keys, &owner, false)
            });
            if released.is_ok() {
                break;
            }
        }
        match released {
            Ok(true) => tracing::debug!(queue = %lane.name(), %owner, "owner released"),
            Ok(false) => tracing::warn!(
                queue = %lane.name(),
                %owner,
                "still holds tasks; they return to the queue when its lease runs out"
            ),
            Err(error) => {
                tracing::error!(queue = %lane.name(), %owner, %error, "cannot release the owner; its lease runs out")
            }
        }
    }
}
