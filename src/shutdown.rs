//! One-way broadcasts for the shutdown sequence: a [`Trigger`] fires once; every [`Listener`] sees it at once,
//! whether it polls ([`Listener::is_triggered`]), sleeps ([`Listener::wait`]) or blocks in `select!`
//! ([`Listener::receiver`]). Firing is dropping the only sender of a channel nothing is ever sent on: a
//! disconnected crossbeam channel wakes every receiver (mini-redis's shutdown idiom). A poll reads a flag set
//! just before: workers poll once per task, and a zero-capacity channel's `try_recv` takes a lock that every
//! worker of the daemon shares (1 % of a no-op drain's daemon CPU).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::poison::lock;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

/// Fires a shutdown phase.
#[derive(Debug)]
pub struct Trigger {
    sender: Mutex<Option<Sender<()>>>,
    receiver: Receiver<()>,
    fired: Arc<AtomicBool>,
}

/// Observes a shutdown phase.
#[derive(Clone, Debug)]
pub struct Listener {
    receiver: Receiver<()>,
    /// Set before the channel disconnects, so a listener that saw it disconnected sees it set too.
    fired: Arc<AtomicBool>,
}

impl Trigger {
    pub fn new() -> Trigger {
        let (sender, receiver) = crossbeam_channel::bounded(0);
        Trigger {
            sender: Mutex::new(Some(sender)),
            receiver,
            fired: Arc::default(),
        }
    }

    /// A listener for this trigger.
    pub fn listener(&self) -> Listener {
        Listener {
            receiver: self.receiver.clone(),
            fired: Arc::clone(&self.fired),
        }
    }

    /// Fires; later calls do nothing.
    pub fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        // Dropping the sender is the broadcast; a poisoned lock still holds the Option.
        lock(&self.sender).take();
    }
}

impl Drop for Trigger {
    /// A dropped trigger has fired, as its channel says to those who wait on it.
    fn drop(&mut self) {
        self.fire();
    }
}

impl Default for Trigger {
    fn default() -> Trigger {
        Trigger::new()
    }
}

impl Listener {
    /// Whether the trigger has fired.
    pub(crate) fn is_triggered(&self) -> bool {
        self.fired.load(Ordering::Acquire)
    }

    /// Sleeps up to `timeout`, returning early (with `true`) when the trigger fires.
    pub(crate) fn wait(&self, timeout: Duration) -> bool {
        matches!(
            self.receiver.recv_timeout(timeout),
            Err(RecvTimeoutError::Disconnected)
        )
    }

    /// The channel to `select!` on: its arm fires (with `Err`) once the trigger has fired.
    pub(crate) fn receiver(&self) -> &Receiver<()> {
        &self.receiver
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn firing_wakes_every_listener() {
        let trigger = Trigger::new();
        let (a, b) = (trigger.listener(), trigger.listener());
        assert!(!a.is_triggered());
        assert!(!a.wait(Duration::from_millis(1)));
        let waiter = std::thread::spawn(move || b.wait(Duration::from_secs(60)));
        trigger.fire();
        assert!(
            waiter.join().unwrap(),
            "the sleeping listener woke up on the trigger, not its timeout"
        );
        assert!(a.is_triggered());
        trigger.fire();
    }

    #[test]
    fn a_dropped_trigger_has_fired_for_pollers_and_sleepers_alike() {
        let trigger = Trigger::new();
        let listener = trigger.listener();
        drop(trigger);
        assert!(listener.is_triggered());
        assert!(listener.wait(Duration::from_secs(60)));
    }
}
