//! Delayed tasks and retries in backoff: per queue a poller thread moves due tasks into the ready lists, in
//! batches, with the lock-free promote script; per daemon a listener thread tells pollers when a task became due
//! sooner than they planned.
//!
//! The poller is also the mover of its queue's flow outbox (docs/design/flows.md): each turn, after the promote,
//! it applies the notes the queue's settles wrote to the tasks that wait for theirs
//! ([`broker::workflow::move_outbox`]); a settle that writes one publishes on the delay channel, so a waiting
//! task is released at once, and at most [`MAX_WAIT`] late when the message is missed.
//!
//! A poller sleeps (on the local clock, which is precise, unlike Redis's blocking timeouts that round up to its
//! 100 ms tick) until the earliest due time that the script reported, at most [`MAX_WAIT`]. Producers that add a
//! task earlier than every other publish on the queue's delay channel, and the listener wakes the poller.
//! [`MAX_WAIT`] bounds how late a task added by a producer that does not publish (a plain ZADD) can be.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, select};

use crate::broker::workflow::MOVE_BATCH;
use crate::broker::{self, Connector, Session};
use crate::config::RedisConfig;
use crate::pulse::Pulse;
use crate::queue::QueueContext;
use crate::retry::{Backoff, Trouble};
use crate::shutdown::Listener;

/// The longest a poller sleeps without looking.
const MAX_WAIT: Duration = Duration::from_secs(1);

/// How long a queue's delay poller may go without a beat before the watchdog counts it as wedged: its longest
/// sleep, one promote (and a redirect), or the outbox's read and one waiter's apply (two calls, each with a
/// redirect: the mover beats before each), then the backoff after a failure. With the defaults: 51.1 s.
pub fn poller_stall_bound(redis: &RedisConfig) -> Duration {
    MAX_WAIT + redis.call_bound(4) + Backoff::MAX
}

pub struct DelayPoller {
    pub queue: Arc<QueueContext>,
    pub session: Session,
    /// Wake-ups from the listener.
    pub nudges: Receiver<()>,
    /// Beaten every turn, for the watchdog (a stage of the queue's lane: [`poller_stall_bound`]).
    pub pulse: Pulse,
    pub background: Listener,
}

impl DelayPoller {
    pub fn run(mut self) {
        let mut backoff = Backoff::new();
        let mut trouble = Trouble::new("moving due tasks", Some(&self.queue.config.name));
        loop {
            self.pulse.beat();
            let queue = &self.queue;
            let batch = queue.config.delay_batch;
            let pulse = &self.pulse;
            let result = self.session.get().and_then(|connection| {
                let promoted = broker::promote(connection, &queue.keys, batch)?;
                let notes =
                    broker::workflow::move_outbox(connection, &queue.keys, &|| pulse.beat())?;
                Ok((promoted, notes))
            });
            if result.is_ok() {
                backoff.reset();
                trouble.recovered();
            }
            let wait = match result {
                Ok(((moved, _), notes)) if moved == batch || notes == MOVE_BATCH => continue,
                Ok(((_, next_due), _)) => next_due.unwrap_or(MAX_WAIT).min(MAX_WAIT),
                Err(error) => {
                    trouble.failed(&error);
                    self.session.reset();
                    if backoff.wait_unless_first(&self.background) {
                        break;
                    }
                    continue;
                }
            };
            if wait.is_zero() {
                continue;
            }
            select! {
                recv(self.nudges) -> _ => {}
                recv(self.background.receiver()) -> _ => break,
                default(wait) => {}
            }
        }
        tracing::debug!(queue = %self.queue.config.name, "delay poller stopped");
    }
}

/// Subscribes to every queue's delay channel and nudges that queue's poller.
pub struct DelayListener {
    pub connector: Arc<Connector>,
    /// Channel name -> the poller's nudge sender (capacity 1: one pending nudge is enough).
    pub pollers: HashMap<String, Sender<()>>,
    /// Beaten every read (at least every [`READ_TIMEOUT`]), subscription and attempt, for the watchdog.
    pub pulse: Pulse,
    pub background: Listener,
}

/// How long the listener waits for a message before it looks at the shutdown flag again.
const READ_TIMEOUT: Duration = Duration::from_millis(500);

/// How long the delay listener may go without a beat: a read, or a connection and one subscription, then the
/// backoff after a failure. With the defaults: 20.6 s.
pub fn listener_stall_bound(redis: &RedisConfig) -> Duration {
    READ_TIMEOUT + redis.call_bound(1) + Backoff::MAX
}

impl DelayListener {
    pub fn run(self) {
        let mut backoff = Backoff::new();
        let mut trouble = Trouble::new("listening for delayed tasks", None);
        while !self.background.is_triggered() {
            self.pulse.beat();
            if let Err(error) = self.listen(&mut trouble) {
                trouble.failed(&error);
                if backoff.wait_unless_first(&self.background) {
                    break;
                }
            } else {
                backoff.reset();
            }
        }
        tracing::debug!("delay listener stopped");
    }

    fn nudge_all(&self) {
        for poller in self.pollers.values() {
            let _ = poller.try_send(());
        }
    }

    /// Listens until shutdown (Ok) or a connection error (Err).
    fn listen(&self, trouble: &mut Trouble) -> broker::Result<()> {
        let mut connection = self.connector.subscriber()?;
        let mut pubsub = connection.as_pubsub();
        for channel in self.pollers.keys() {
            self.pulse.beat();
            pubsub.subscribe(channel)?;
        }
        pubsub.set_read_timeout(Some(READ_TIMEOUT))?;
        trouble.recovered();
        // Whatever was published while we were not subscribed is lost: let every poller look once.
        self.nudge_all();
        while !self.background.is_triggered() {
            self.pulse.beat();
            match pubsub.get_message() {
                Ok(message) => {
                    if let Some(poller) = self.pollers.get(message.get_channel_name()) {
                        // Full means a nudge is already pending: nothing is lost.
                        let _ = poller.try_send(());
                    }
                }
                Err(error) if error.is_timeout() => {}
                Err(error) => return Err(error.into()),
            }
        }
        Ok(())
    }
}
