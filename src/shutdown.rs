//! One-way broadcasts for the shutdown sequence: a [`Trigger`] fires once; every [`Listener`] sees it at once,
//! whether it polls ([`Listener::is_triggered`]), sleeps ([`Listener::wait`]) or blocks in `select!`
//! ([`Listener::receiver`]). Firing is dropping the only sender of a channel nothing is ever sent on: a
//! disconnected crossbeam channel wakes every receiver (mini-redis's shutdown idiom).

use std::sync::Mutex;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};

/// Fires a shutdown phase.
#[derive(Debug)]
pub struct Trigger {
    sender: Mutex<Option<Sender<()>>>,
    receiver: Receiver<()>,
}

/// Observes a shutdown phase.
#[derive(Clone, Debug)]
pub struct Listener {
    receiver: Receiver<()>,
}

impl Trigger {
    pub fn new() -> Trigger {
        let (sender, receiver) = crossbeam_channel::bounded(0);
        Trigger {
            sender: Mutex::new(Some(sender)),
            receiver,
        }
    }

    /// A listener for this trigger.
    pub fn listener(&self) -> Listener {
        Listener {
            receiver: self.receiver.clone(),
        }
    }

    /// Fires; later calls do nothing.
    pub fn fire(&self) {
        // Dropping the sender is the broadcast; a poisoned lock still holds the Option.
        self.sender
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
    }
}

impl Default for Trigger {
    fn default() -> Trigger {
        Trigger::new()
    }
}

impl Listener {
    /// Whether the trigger has fired.
    pub fn is_triggered(&self) -> bool {
        matches!(self.receiver.try_recv(), Err(TryRecvError::Disconnected))
    }

    /// Sleeps up to `timeout`, returning early (with `true`) when the trigger fires.
    pub fn wait(&self, timeout: Duration) -> bool {
        matches!(
            self.receiver.recv_timeout(timeout),
            Err(RecvTimeoutError::Disconnected)
        )
    }

    /// The channel to `select!` on: its arm fires (with `Err`) once the trigger has fired.
    pub fn receiver(&self) -> &Receiver<()> {
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
}
