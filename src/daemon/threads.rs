//! The thread registry of the supervisor: every thread it starts, by a serial number, with its role in the
//! shutdown and its group (a lane incarnation, or the per-daemon threads a reload starts again), and the one event
//! each sends when it ends, however it ends. Its own module because it is the supervisor's bookkeeping, not its
//! decisions: spawning, joining and waiting by role, whatever the threads do.

use std::collections::HashMap;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::DaemonError;

/// What the supervisor reacts to.
pub(super) enum Event {
    /// A thread ended (its closure returned or panicked).
    Exited { id: u64, panicked: bool },
}

/// What a thread is to the shutdown sequence, which waits for each role in turn.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Role {
    Fetcher,
    Worker,
    Acker,
    /// The monitor: it calls plugins' `on_dead`, so plugins are not shut down while it lives.
    Monitor,
    Other,
}

/// Sends `Event::Exited` when the thread ends, however it ends.
struct ExitGuard {
    id: u64,
    pub(super) events: Sender<Event>,
}

impl Drop for ExitGuard {
    fn drop(&mut self) {
        // The supervisor may have stopped listening at the very end; nothing is left to tell then.
        let _ = self.events.send(Event::Exited {
            id: self.id,
            panicked: std::thread::panicking(),
        });
    }
}

/// A thread the supervisor started.
pub(super) struct Thread {
    name: String,
    role: Role,
    /// What it was started as part of: a lane incarnation, or a per-daemon thread a reload starts again
    /// ([`Group`]); a reload that stops a group expects its threads to end.
    group: Group,
    handle: JoinHandle<()>,
}

/// Threads started together and stopped together: 0 is the daemon's own (heartbeat, timeouts, notify,
/// metrics), which only the shutdown stops.
pub(super) type Group = u64;

/// The threads the supervisor started and has not seen end, by a serial number (a reload starts threads under
/// names already in use: a queue's new lane while its old one finishes).
pub(super) struct Threads {
    pub(super) events: Sender<Event>,
    pub(super) live: HashMap<u64, Thread>,
    pub(super) next_id: u64,
}

impl Threads {
    pub(super) fn spawn(
        &mut self,
        name: String,
        role: Role,
        group: Group,
        body: impl FnOnce() + Send + 'static,
    ) -> Result<(), DaemonError> {
        self.next_id += 1;
        let id = self.next_id;
        let guard = ExitGuard {
            id,
            events: self.events.clone(),
        };
        let handle = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let _guard = guard;
                body();
            })
            .map_err(|source| DaemonError::Spawn {
                name: name.clone(),
                source,
            })?;
        self.live.insert(
            id,
            Thread {
                name,
                role,
                group,
                handle,
            },
        );
        Ok(())
    }

    /// Joins a thread that reported its end; returns its name and group.
    pub(super) fn exited(&mut self, id: u64) -> Option<(String, Group)> {
        let thread = self.live.remove(&id)?;
        // The thread has already ended, so this does not block; a panic was reported through the event.
        let _ = thread.handle.join();
        Some((thread.name, thread.group))
    }

    pub(super) fn count(&self, roles: &[Role]) -> usize {
        self.live
            .values()
            .filter(|thread| roles.contains(&thread.role))
            .count()
    }

    pub(super) fn count_in(&self, group: Group, roles: &[Role]) -> usize {
        self.live
            .values()
            .filter(|thread| thread.group == group && roles.contains(&thread.role))
            .count()
    }

    /// Whether a thread of `group` is still alive.
    pub(super) fn any_in(&self, group: Group) -> bool {
        self.live.values().any(|thread| thread.group == group)
    }

    /// Handles exit events until no thread of `roles` is left or `deadline` passes. Returns whether none is left.
    pub(super) fn wait_for(
        &mut self,
        events: &Receiver<Event>,
        roles: &[Role],
        deadline: Instant,
    ) -> bool {
        while self.count(roles) > 0 {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            match events.recv_timeout(left) {
                Ok(Event::Exited { id, panicked }) => {
                    if let Some((name, _)) = self.exited(id) {
                        if panicked {
                            tracing::error!(thread = %name, "thread panicked during shutdown");
                        }
                    }
                }
                Err(_) => return false,
            }
        }
        true
    }
}
