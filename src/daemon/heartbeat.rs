//! The heartbeat: one thread per daemon that renews the daemon's lease on each queue (one lease covers every
//! task the daemon holds there), every third of the queue's `lease_timeout`, and at once when a claim found
//! Redis's clock stepped under a lease: the lane starts no task until a renewal confirms it
//! (`lane::Ownership`).
//!
//! It has its own thread and its own connection, outside the pool, so busy or stuck handlers, a slow acker or a
//! fetcher blocked in Redis never starve lease renewal (the cause of BullMQ's "could not renew lock"). That
//! connection's read timeout is a quarter of the shortest lease (at most `[redis] io_timeout`, at least
//! [`MIN_TIMEOUT`]): one slow reply costs a retry, not the lease. When a lease is lost anyway (the daemon was
//! paused, or Redis lost its data), the tasks it covered are forgotten and their running handlers asked to stop:
//! the monitors return those tasks to the queue, and the fetcher claims under a new owner.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::broker::Conn;

use super::lane::ownership::Exchange;
use super::lane::{Lane, LaneSet};
use crate::broker::{self, Connector, Renewal};
use crate::config::RedisConfig;
use crate::pulse::Pulse;
use crate::retry::Trouble;
use crate::shutdown::Listener;

/// How soon a failed renewal is tried again.
const RETRY: Duration = Duration::from_millis(100);
/// The shortest read timeout: below this a loaded but healthy Redis would look dead.
pub const MIN_TIMEOUT: Duration = Duration::from_millis(50);

pub struct Heartbeat {
    pub lanes: Arc<LaneSet>,
    pub connector: Arc<Connector>,
    /// Beaten every turn: the watchdog's sign that the heartbeat is not hung (`daemon::watchdog`).
    pub pulse: Pulse,
    /// Fires last: stop renewing.
    pub background: Listener,
}

/// The most the heartbeat sleeps between two looks.
const MAX_SLEEP: Duration = Duration::from_secs(1);

/// How long the heartbeat may go without a beat before the watchdog counts it as wedged: a turn's sleep (at most
/// a second), then a renewal per lane, each a connection (`connect_timeout`), the script and its `WAIT`
/// (`io_timeout` each, the read timeout being at most that, and `wait_timeout`). With the defaults and one queue:
/// 26.1 s.
pub fn stall_bound(redis: &RedisConfig, lanes: usize) -> Duration {
    MAX_SLEEP + redis.call_bound(2) * lanes.max(1) as u32
}

/// The heartbeat connection's read timeout for these lanes: a quarter of the shortest lease, at most the
/// configured `io_timeout`.
pub fn read_timeout(lanes: &[Arc<Lane>]) -> Duration {
    let io_timeout = lanes
        .first()
        .map_or(MIN_TIMEOUT, |lane| lane.queue.io_timeout);
    let shortest = lanes
        .iter()
        .map(|lane| lane.queue.config.lease_timeout)
        .min()
        .unwrap_or(io_timeout * 4);
    (shortest / 4).clamp(MIN_TIMEOUT, io_timeout.max(MIN_TIMEOUT))
}

impl Heartbeat {
    pub fn run(self) {
        let mut timeout = read_timeout(&self.lanes.snapshot());
        let mut connection: Option<Conn> = None;
        // Per lane (a reload adds and removes lanes): when to renew next, and its troubles.
        let mut renewals: PerLane<Lane, (Instant, Trouble)> = PerLane::default();
        loop {
            self.pulse.beat();
            let lanes = self.lanes.snapshot();
            let wanted = read_timeout(&lanes);
            if wanted != timeout {
                // A reload brought a shorter (or longer) lease: reconnect with the matching read timeout.
                timeout = wanted;
                connection = None;
            }
            renewals.keep_only(&lanes);
            let mut wait = MAX_SLEEP;
            for lane in lanes.iter() {
                let (next, trouble) = renewals.entry(lane, || {
                    (
                        Instant::now(),
                        Trouble::new("renewing the lease", Some(lane.name())),
                    )
                });
                if Instant::now() >= *next || lane.ownership.in_doubt() {
                    *next = Instant::now()
                        + renew(lane, &self.connector, &mut connection, timeout, trouble);
                }
                wait = wait.min(next.saturating_duration_since(Instant::now()));
            }
            if self.wait(&lanes, wait.max(Duration::from_millis(1))) {
                break;
            }
        }
        tracing::debug!("heartbeat stopped");
    }

    /// Sleeps up to `timeout`, returning early when a lane's lease is put in doubt (a claim found Redis's clock
    /// stepped under it: [`super::lane::Ownership::renewal_wanted`]), which the next turn renews at once, or when
    /// the daemon stops (true).
    fn wait(&self, lanes: &[Arc<Lane>], timeout: Duration) -> bool {
        let mut select = crossbeam_channel::Select::new();
        select.recv(self.background.receiver());
        for lane in lanes {
            select.recv(lane.ownership.renewal_wanted());
        }
        let Ok(ready) = select.select_timeout(timeout) else {
            return false;
        };
        match ready.index() {
            // Nothing is ever sent on the background channel: it is ready once it is disconnected, fired.
            0 => {
                let _ = ready.recv(self.background.receiver());
                self.background.is_triggered()
            }
            index => {
                let _ = ready.recv(lanes[index - 1].ownership.renewal_wanted());
                false
            }
        }
    }
}

/// A value per lane, found by the lane's address. Each entry keeps a [`Weak`] of its lane, which keeps the lane's
/// allocation (not the lane) while the entry lives, so no lane made later can be at that address until
/// [`PerLane::keep_only`] drops the entry. Keyed by the bare address, a lane a reload made at the address of one
/// dropped since the last turn took that one's renewal schedule: with a shorter `lease_timeout` than the old
/// lane's (a reload that shortened it), its first renewal came after its lease ran out, and the tasks it held were
/// recovered and run again (the fault review's "Info", `heartbeat.rs` keyed by `*const Lane`).
struct PerLane<T, V> {
    entries: Vec<(Weak<T>, V)>,
}

impl<T, V> Default for PerLane<T, V> {
    fn default() -> Self {
        PerLane {
            entries: Vec::new(),
        }
    }
}

impl<T, V> PerLane<T, V> {
    /// Drops the entries of lanes not in `lanes` (a reload removed them).
    fn keep_only(&mut self, lanes: &[Arc<T>]) {
        self.entries.retain(|(kept, _)| {
            lanes
                .iter()
                .any(|lane| std::ptr::eq(kept.as_ptr(), Arc::as_ptr(lane)))
        });
    }

    /// The entry of `lane`, made by `new` the first time.
    fn entry(&mut self, lane: &Arc<T>, new: impl FnOnce() -> V) -> &mut V {
        let found = self
            .entries
            .iter()
            .position(|(kept, _)| std::ptr::eq(kept.as_ptr(), Arc::as_ptr(lane)));
        let index = found.unwrap_or_else(|| {
            self.entries.push((Arc::downgrade(lane), new()));
            self.entries.len() - 1
        });
        &mut self.entries[index].1
    }
}

/// Renews the lane's owner, if it has one; returns when to renew next.
fn renew(
    lane: &Lane,
    connector: &Connector,
    connection: &mut Option<Conn>,
    timeout: Duration,
    trouble: &mut Trouble,
) -> Duration {
    let Some(owner) = lane.ownership.current() else {
        return RETRY;
    };
    let lease = lane.queue.config.lease_timeout;
    let journal = lane.ownership.journal(&owner);
    let stuck = lane.capacity.stuck_workers();
    let sent = Instant::now();
    let result = match connection {
        Some(connection) => {
            broker::renew(connection, &lane.queue.keys, &owner, lease, journal, stuck)
        }
        None => connector
            .connect_as(timeout, "heartbeat")
            .and_then(|fresh| {
                broker::renew(
                    connection.insert(fresh),
                    &lane.queue.keys,
                    &owner,
                    lease,
                    journal,
                    stuck,
                )
            }),
    };
    let answered = Instant::now();
    if result.is_ok() {
        trouble.recovered();
    }
    match result {
        Ok(Renewal::Renewed(clock)) => {
            if lane
                .ownership
                .renewed(&owner, Exchange { sent, answered }, clock)
            {
                tracing::info!(
                    queue = %lane.name(),
                    %owner,
                    "the lease is renewed on Redis's stepped clock: tasks start again"
                );
            }
            lease / 3
        }
        Ok(lost) => {
            if lane.ownership.lose(&owner) {
                let forgotten = lane.forget_owner(&owner);
                let why = if lost == Renewal::WentBack {
                    "Redis lost claims or settlements it had acknowledged (a failover to a replica that lagged, or \
                     a restore?); the owner is given up"
                } else {
                    "lease ran out before renewal (was this daemon paused, or did Redis lose its data?)"
                };
                tracing::warn!(
                    queue = %lane.name(),
                    %owner,
                    forgotten,
                    journal,
                    "{why}; the monitors return the tasks it held to the queue, and the fetcher claims under a new \
                     owner"
                );
            }
            RETRY
        }
        Err(error) => {
            trouble.failed(&error);
            *connection = None;
            RETRY
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stall_bound_adds_a_renewal_per_lane_to_a_turn() {
        let config = crate::config::Config::parse(std::path::Path::new("k.toml"), "").unwrap();
        assert_eq!(stall_bound(&config.redis, 1), Duration::from_millis(26_100));
        assert_eq!(stall_bound(&config.redis, 3), Duration::from_millis(76_300));
    }

    #[test]
    fn a_lane_made_after_one_was_dropped_gets_a_renewal_schedule_of_its_own() {
        let mut renewals: PerLane<[u64; 16], &str> = PerLane::default();
        let old = Arc::new([0; 16]);
        *renewals.entry(&old, || "new") = "the dropped lane's";
        renewals.keep_only(std::slice::from_ref(&old));
        // A reload removes the lane and makes others between two turns; an allocator hands a freed block of the
        // same size out again (glibc's at once), so one of them would be at the dropped lane's address.
        drop(old);
        let made: Vec<Arc<[u64; 16]>> = (0..64).map(|n| Arc::new([n; 16])).collect();
        for lane in &made {
            assert_eq!(*renewals.entry(lane, || "new"), "new");
        }
        renewals.keep_only(&made);
        assert_eq!(renewals.entries.len(), made.len());
    }
}
