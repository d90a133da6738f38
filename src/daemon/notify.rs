//! systemd's notify protocol (sd_notify(3), `Type=notify` in systemd/kmqd.service), through the `sd-notify`
//! crate: `READY=1` once the daemon serves (plugins loaded, Redis answered, the ACL and protocol checks passed,
//! every lane started), `STATUS=` lines for `systemctl status`, `RELOADING=1` (with `MONOTONIC_USEC=`) and
//! `READY=1` around a reload, `STOPPING=1` when the graceful shutdown begins,
//! and, when systemd asks for it (`WatchdogSec=`, which sets `WATCHDOG_USEC`), `WATCHDOG=1` at half that interval
//! for as long as [`super::watchdog`] finds nothing wedged.
//!
//! Without `NOTIFY_SOCKET` (not under systemd, or `Type=exec`) every function here is a no-op and no thread is
//! started. A message that cannot be sent is reported once: the daemon runs on, and systemd's own timeouts (a
//! start that never got `READY=1`, a watchdog that got no ping) then say what went wrong.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sd_notify::NotifyState;

use super::lane::{self, Lane, LaneSet};
use super::watchdog::{Bounds, Sample, ThreadPulses, ThreadSample, Watchdog, Wedge};
use super::{delay, heartbeat, sources};
use crate::config::{QueueConfig, RedisConfig};
use crate::pulse::Pulse;
use crate::shutdown::Listener;

/// How often `STATUS=` is refreshed while the daemon serves (at once when something becomes wedged or recovers).
pub const STATUS_EVERY: Duration = Duration::from_secs(5);

/// The longest the notify thread sleeps between two looks: a look later than [`super::watchdog::PAUSE_GAP`]
/// must mean the process was paused, not that this thread dawdled.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// Whether a service manager listens: without a `NOTIFY_SOCKET` nothing is sent and the notify thread is not
/// started.
pub fn enabled() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

fn send(states: &[NotifyState<'_>]) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if let Err(error) = sd_notify::notify(states) {
        if !WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                %error,
                "cannot send to systemd's NOTIFY_SOCKET; under Type=notify systemd then thinks kmqd never got ready"
            );
        }
    }
}

/// `STATUS=text`: what `systemctl status kmqd` shows.
pub fn status(text: &str) {
    send(&[NotifyState::Status(text)]);
}

/// `READY=1`, with a status line.
pub fn ready(text: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(text)]);
}

/// `STOPPING=1`, with a status line: systemd shows the unit as deactivating from here on.
pub fn stopping(text: &str) {
    send(&[NotifyState::Stopping, NotifyState::Status(text)]);
}

/// `RELOADING=1` with `MONOTONIC_USEC=` (sd_notify(3): systemd matches the reload's end, `READY=1`, to it), and a
/// status line.
pub fn reloading(text: &str) {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send(&[NotifyState::Reloading, now, NotifyState::Status(text)]),
        Err(_) => send(&[NotifyState::Reloading, NotifyState::Status(text)]),
    }
}

/// "serving 3 queues, 12 tasks held" (", 1 worker stuck in handlers" when some are, ", 1 outcome refused by
/// Redis" when Redis refuses some).
pub fn summary(lanes: &[Arc<Lane>]) -> String {
    // The table of held tasks, not `Capacity::held`, which also counts what an idle fetcher reserved for the
    // claim it waits in.
    let held: usize = lanes.iter().map(|lane| lane.held.len()).sum();
    let stuck: usize = lanes.iter().map(|lane| lane.capacity.stuck_workers()).sum();
    let refused: usize = lanes
        .iter()
        .map(|lane| lane.refused_outcomes.load(Ordering::Acquire))
        .sum();
    let plural =
        |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    // A queue whose lane a reload replaced has two for a moment: it is still one queue.
    let mut queues: Vec<&str> = lanes.iter().map(|lane| lane.name()).collect();
    queues.sort_unstable();
    queues.dedup();
    let mut text = format!(
        "serving {}, {} held",
        plural(queues.len(), "queue", "queues"),
        plural(held, "task", "tasks")
    );
    if stuck > 0 {
        text.push_str(&format!(
            ", {} stuck in handlers",
            plural(stuck, "worker", "workers")
        ));
    }
    if refused > 0 {
        text.push_str(&format!(
            ", {} refused by Redis",
            plural(refused, "outcome", "outcomes")
        ));
    }
    text
}

/// The `kmqd-notify` thread: refreshes `STATUS=` and, when systemd set a watchdog interval, pings it while the
/// daemon makes progress or is idle. It stops when the daemon stops claiming: `STOPPING=1` has been sent then,
/// and systemd's watchdog no longer applies to a stopping unit.
pub struct Notifier {
    pub lanes: Arc<LaneSet>,
    /// The heartbeat's pulse: a hung heartbeat is a wedge too (its leases would run out).
    pub heartbeat: Pulse,
    /// The monitor's, the delay listener's and the scheduler's, as the last reload (re)started them.
    pub helpers: Arc<ThreadPulses>,
    /// For each lane's bounds ([`lane_bounds`]) and the heartbeat's; `[redis]` does not change while the daemon
    /// runs.
    pub redis: RedisConfig,
    pub stop: Listener,
}

impl Notifier {
    pub fn run(self) {
        // WATCHDOG_USEC, set by systemd for WatchdogSec= (and WATCHDOG_PID, which must be ours).
        let interval = sd_notify::watchdog_enabled();
        let start = Instant::now();
        let watch = |lanes: &[Arc<Lane>], now: Instant| {
            interval.map(|_| {
                Watchdog::new(
                    lanes.iter().map(|lane| {
                        let bounds = lane_bounds(&self.redis, &lane.queue.config);
                        (lane.name().to_string(), bounds)
                    }),
                    now,
                )
            })
        };
        let mut lanes = self.lanes.snapshot();
        let mut watchdog = watch(&lanes, start);
        let ping_every = interval.map(|interval| interval / 2);
        if let Some(interval) = interval {
            tracing::info!(
                ?interval,
                "systemd watchdog: pinging while the daemon makes progress"
            );
        }
        let look_every = ping_every.map_or(LOOK_EVERY, |every| every.min(LOOK_EVERY));
        let mut last_ping: Option<Instant> = None;
        let mut last_status = start;
        let mut wedged: Vec<Wedge> = Vec::new();
        loop {
            let now = Instant::now();
            let current = self.lanes.snapshot();
            if !Arc::ptr_eq(&current, &lanes) {
                // A reload replaced lanes: watch the new set from now on.
                lanes = current;
                watchdog = watch(&lanes, now);
            }
            let mut changed = false;
            if let (Some(watchdog), Some(ping_every)) = (watchdog.as_mut(), ping_every) {
                let samples: Vec<Sample> = lanes.iter().map(|lane| sample(lane)).collect();
                let heartbeat = ThreadSample {
                    thread: "heartbeat",
                    count: self.heartbeat.count(),
                    bound: heartbeat::stall_bound(&self.redis, lanes.len()),
                };
                let mut threads = vec![heartbeat];
                threads.extend(self.helpers.samples());
                let wedges = watchdog.look(now, &samples, &threads);
                changed = wedges.is_empty() != wedged.is_empty();
                if changed {
                    report(&wedges);
                }
                wedged = wedges;
                if wedged.is_empty() && last_ping.is_none_or(|at| now >= at + ping_every) {
                    send(&[NotifyState::Watchdog]);
                    last_ping = Some(now);
                }
            }
            if changed || now >= last_status + STATUS_EVERY {
                last_status = now;
                match wedged.first() {
                    None => status(&summary(&lanes)),
                    Some(wedge) => status(&format!("wedged, not pinging the watchdog: {wedge}")),
                }
            }
            if self.stop.wait(look_every) {
                break;
            }
        }
        tracing::debug!("notify stopped");
    }
}

/// The watchdog's bounds for the lane of `queue`: each stage's own stall bound (its module says what one turn of
/// its loop may wait); the source mover's only when the queue has `source_lists`, since none runs otherwise.
pub fn lane_bounds(redis: &RedisConfig, queue: &QueueConfig) -> Bounds {
    Bounds {
        fetcher: lane::fetcher_stall_bound(redis, queue),
        acker: lane::acker::stall_bound(redis),
        delay: delay::poller_stall_bound(redis),
        sources: (!queue.source_lists.is_empty()).then(|| sources::stall_bound(redis, queue)),
    }
}

fn sample(lane: &Lane) -> Sample {
    Sample {
        fetcher: lane.fetcher_pulse.count(),
        acker: lane.acker_pulse.count(),
        delay: lane.delay_pulse.count(),
        sources: lane.sources_pulse.count(),
        workers: lane.queue.config.workers,
        stuck_workers: lane.capacity.stuck_workers(),
    }
}

/// Logs a change between wedged and not, once per change.
fn report(wedges: &[Wedge]) {
    if wedges.is_empty() {
        tracing::info!("watchdog: every lane moves again; pinging systemd again");
        return;
    }
    let why: Vec<String> = wedges.iter().map(Wedge::to_string).collect();
    tracing::warn!(
        why = %why.join("; "),
        "watchdog: the daemon is wedged; no more WATCHDOG=1 to systemd, which restarts kmqd after WatchdogSec \
         unless this clears first"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_line_counts_the_outcomes_redis_refuses() {
        let config = crate::config::Config::parse(
            std::path::Path::new("kmqd.toml"),
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\n",
        )
        .unwrap();
        let context = crate::queue::QueueContext::new(&config, &config.queues[0], "daemon");
        let lane = Arc::new(Lane::new(
            Arc::new(context),
            "h-1-2-ab",
            std::time::Instant::now(),
        ));
        let lanes = [Arc::clone(&lane)];
        assert_eq!(summary(&lanes), "serving 1 queue, 0 tasks held");
        lane.refused_outcomes.store(2, Ordering::Release);
        assert_eq!(
            summary(&lanes),
            "serving 1 queue, 0 tasks held, 2 outcomes refused by Redis"
        );
    }

    #[test]
    fn the_lane_bounds_add_up_every_wait_of_a_turn() {
        let parse = |text: &str| {
            crate::config::Config::parse(std::path::Path::new("kmqd.toml"), text).unwrap()
        };
        let config = parse("[[queues]]\nname = \"mail\"\nmode = \"safe\"\n");
        let bounds = lane_bounds(&config.redis, &config.queues[0]);
        let ms = Duration::from_millis;
        assert_eq!(
            bounds,
            Bounds {
                fetcher: ms(51_300),
                acker: ms(30_160),
                delay: ms(51_100),
                sources: None,
            },
            "the defaults the stall bounds' doc comments give"
        );
        let config = parse(
            "[redis]\nio_timeout = \"1s\"\nconnect_timeout = \"1s\"\n\
             [[queues]]\nname = \"mail\"\nmode = \"safe\"\nidle_poll = \"5s\"\n",
        );
        let bounds = lane_bounds(&config.redis, &config.queues[0]);
        assert_eq!(
            bounds.fetcher,
            ms(200 + 5_000 + 1_000 + 100 + 4_000 + 5_000)
        );
        assert_eq!(bounds.acker, ms(50 + 1_000 + 100 + 2_000 + 5_000 + 10));
        assert_eq!(bounds.delay, ms(1_000 + 1_000 + 100 + 4_000 + 5_000));
        let config = parse(
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nsource_lists = [\"queue:mail\"]\n",
        );
        let bounds = lane_bounds(&config.redis, &config.queues[0]);
        assert_eq!(
            bounds.sources,
            Some(ms(1_000 + 5_000 + 100 + 40_000 + 5_000))
        );
    }
}
