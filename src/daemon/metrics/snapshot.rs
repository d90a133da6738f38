//! The Redis-derived part of the metrics page: every queue's depths and counters and its live daemons, read by
//! the `kmqd-metrics-redis` thread when a scrape asks, so that a Redis that is down or stalled never holds a
//! scrape longer than [`REDIS_WAIT`].
//!
//! A scrape takes a ticket and wakes the refresher; the refresher reads every queue (its own session, bounded by
//! the Redis timeouts) and publishes the snapshot with the last ticket it served. A scrape whose ticket is
//! answered in time gets the snapshot; otherwise it gets nothing and the page says `kmqd_redis_up 0` with what
//! the daemon knows itself. Only a snapshot taken for this scrape is served: an old one would show depths that
//! may no longer hold as if they were current.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, select};

use crate::broker::{self, QueueStats, Session};
use crate::daemon::lane::LaneSet;
use crate::observed::redis_error;
use crate::poison::{lock, recover};
use crate::shutdown::Listener;

/// How long a scrape waits for Redis before it is answered without the Redis-derived part.
pub const REDIS_WAIT: Duration = Duration::from_millis(500);

/// One queue as Redis shows it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueSnapshot {
    pub stats: QueueStats,
    /// Daemons whose owner's lease on the queue has not run out (what `kmqd workers` lists).
    pub daemons: usize,
    /// What each of the queue's `[[queues.limits]]` entries counts, by type, in the config's order.
    pub types: Vec<(String, broker::TypeUsage)>,
    /// How many of a grouped queue's groups have tasks waiting (`None`: no `[queues.groups]`): a ZCARD per level,
    /// whatever the number of groups.
    pub groups_waiting: Option<u64>,
}

/// Every queue of the daemon, in its config's order.
pub type Snapshot = Vec<QueueSnapshot>;

#[derive(Debug, Default)]
struct Tickets {
    /// The last ticket handed to a scrape.
    asked: u64,
    /// The last ticket a refresh served, and what it read (`None`: it failed).
    answered: u64,
    latest: Option<Arc<Snapshot>>,
}

#[derive(Debug, Default)]
struct Shared {
    tickets: Mutex<Tickets>,
    changed: Condvar,
}

/// The scrape's side: asks for a snapshot and waits a bounded time for it.
#[derive(Debug)]
pub struct RedisView {
    shared: Arc<Shared>,
    wake: Sender<()>,
}

impl RedisView {
    /// A snapshot taken after this call, if Redis answered within `within`.
    pub fn fresh(&self, within: Duration) -> Option<Arc<Snapshot>> {
        let deadline = Instant::now() + within;
        let mut tickets = lock(&self.shared.tickets);
        tickets.asked += 1;
        let ticket = tickets.asked;
        // Full: a wake-up is already pending, and the refresher reads `asked` when it takes it.
        let _ = self.wake.try_send(());
        while tickets.answered < ticket {
            let left = deadline.checked_duration_since(Instant::now())?;
            tickets = recover(self.shared.changed.wait_timeout(tickets, left)).0;
        }
        tickets.latest.clone()
    }
}

/// The `kmqd-metrics-redis` thread.
pub struct Refresher {
    /// The queues are the lanes' (one per queue, the newest), read at every refresh: a reload adds or removes some.
    lanes: Arc<LaneSet>,
    session: Session,
    background: Listener,
    shared: Arc<Shared>,
    wake: Receiver<()>,
}

/// A refresher for the queues of `lanes` and the view that asks it.
pub fn refresher(
    lanes: Arc<LaneSet>,
    session: Session,
    background: Listener,
) -> (RedisView, Refresher) {
    let shared = Arc::new(Shared::default());
    let (wake_tx, wake) = crossbeam_channel::bounded(1);
    let view = RedisView {
        shared: Arc::clone(&shared),
        wake: wake_tx,
    };
    let refresher = Refresher {
        lanes,
        session,
        background,
        shared,
        wake,
    };
    (view, refresher)
}

impl Refresher {
    pub fn run(mut self) {
        loop {
            select! {
                recv(self.wake) -> _ => {}
                recv(self.background.receiver()) -> _ => break,
            }
            let ticket = lock(&self.shared.tickets).asked;
            let read = match self.read() {
                Ok(snapshot) => Some(Arc::new(snapshot)),
                Err(error) => {
                    tracing::debug!(%error, "metrics: cannot read the queues from Redis");
                    redis_error("reading queues for the metrics");
                    self.session.reset();
                    None
                }
            };
            let mut tickets = lock(&self.shared.tickets);
            tickets.answered = ticket;
            tickets.latest = read;
            self.shared.changed.notify_all();
        }
        tracing::debug!("metrics refresher stopped");
    }

    fn read(&mut self) -> broker::Result<Snapshot> {
        let lanes = self.lanes.newest();
        let mut snapshot = Vec::with_capacity(lanes.len());
        for queue in lanes.iter().map(|lane| &lane.queue) {
            let keys = &queue.keys;
            let connection = self.session.get()?;
            let stats = broker::stats(connection, keys)?;
            let (now_ms, leases) = broker::owners(connection, keys)?;
            let daemons = leases
                .iter()
                .filter(|(_, deadline)| *deadline > now_ms)
                .count();
            let limits = &queue.config.type_limits;
            let types = broker::type_usage(connection, keys, limits)?;
            let types = limits
                .iter()
                .map(|limit| limit.kind.clone())
                .zip(types)
                .collect();
            let groups_waiting = match queue.config.groups {
                Some(_) => Some(broker::groups::waiting(connection, keys)?),
                None => None,
            };
            snapshot.push(QueueSnapshot {
                stats,
                daemons,
                types,
                groups_waiting,
            });
        }
        Ok(snapshot)
    }
}
