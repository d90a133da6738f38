//! Periodic tasks (`[[schedules]]`): every daemon runs a scheduler thread, and each slot is fired exactly once
//! across all of them, with no leader: `fire.lua` queues a slot's task only if the schedule's last fired slot is
//! older, and moves it forward in the same step. The task id is `NAME@SLOT` (RFC 3339), the same on every daemon.
//!
//! A slot that is later than `misfire_grace` when a daemon gets to it (no daemon ran at that time) is *missed*:
//! with `missed = "skip"` it is not fired; with `missed = "catch_up"` it is, oldest first, at most `catch_up_max`
//! of them. A schedule that never fired starts from now.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use serde_json::value::RawValue;

use crate::broker::{self, Fired, Session, local_now_ms};
use crate::config::{Missed, RedisConfig, ScheduleConfig};
use crate::pulse::Pulse;
use crate::queue::QueueContext;
use crate::retry::Trouble;
use crate::shutdown::Listener;
use crate::task::Envelope;

/// The longest the scheduler sleeps without looking (also its reaction time to shutdown).
const MAX_SLEEP: Duration = Duration::from_secs(1);
/// How long the scheduler may go without a beat before the watchdog counts it as wedged: its longest sleep (also
/// what it waits after a failure), then one Redis call (reading a schedule's state, or firing a slot) and its
/// redirect. With the defaults: 26.1 s.
pub fn stall_bound(redis: &RedisConfig) -> Duration {
    MAX_SLEEP + redis.call_bound(2)
}

/// How many slots a catch-up looks through before giving up on counting (a schedule every second, down for a year).
const MAX_SCAN: usize = 1_000_000;

/// A schedule and what the scheduler knows of it.
struct Entry {
    config: ScheduleConfig,
    queue: Arc<QueueContext>,
    /// Slots to fire next, oldest first; empty until the schedule's state was read from Redis.
    due: VecDeque<i64>,
}

pub struct Scheduler {
    entries: Vec<Entry>,
    session: Session,
    /// Beaten every turn and before every Redis call, for the watchdog.
    pulse: Pulse,
    background: Listener,
    /// Redis's clock minus the local clock, ms, as last measured.
    offset_ms: i64,
}

/// The id of a slot's task: the schedule name and the slot time.
pub fn slot_id(name: &str, slot_ms: i64) -> String {
    let time = UNIX_EPOCH + Duration::from_millis(slot_ms.max(0) as u64);
    format!("{name}@{}", humantime::format_rfc3339_seconds(time))
}

impl Scheduler {
    pub fn new(
        schedules: Vec<(ScheduleConfig, Arc<QueueContext>)>,
        session: Session,
        pulse: Pulse,
        background: Listener,
    ) -> Scheduler {
        let entries = schedules
            .into_iter()
            .map(|(config, queue)| Entry {
                config,
                queue,
                due: VecDeque::new(),
            })
            .collect();
        Scheduler {
            entries,
            session,
            pulse,
            background,
            offset_ms: 0,
        }
    }

    pub fn run(mut self) {
        let mut trouble = Trouble::new("firing schedules", None);
        loop {
            self.pulse.beat();
            let sleep = match self.tick() {
                Ok(sleep) => {
                    trouble.recovered();
                    sleep
                }
                Err(error) => {
                    trouble.failed(&error);
                    self.session.reset();
                    MAX_SLEEP
                }
            };
            if self.background.wait(sleep) {
                break;
            }
        }
        tracing::debug!("scheduler stopped");
    }

    /// Fires what is due; returns how long to sleep.
    fn tick(&mut self) -> broker::Result<Duration> {
        let mut sleep = MAX_SLEEP;
        for index in 0..self.entries.len() {
            if self.entries[index].due.is_empty() {
                self.plan(index)?;
            }
            while let Some(&slot) = self.entries[index].due.front() {
                let wait = slot - (local_now_ms() + self.offset_ms);
                if wait > 0 {
                    sleep = sleep.min(Duration::from_millis(wait as u64));
                    break;
                }
                if !self.fire(index, slot)? {
                    // Not due on Redis's clock yet: the offset was just corrected, look again soon.
                    sleep = Duration::from_millis(1);
                    break;
                }
                let entry = &mut self.entries[index];
                entry.due.pop_front();
                if entry.due.is_empty() {
                    if let Some(next) = entry.config.when.next_after(slot) {
                        entry.due.push_back(next);
                    }
                }
            }
        }
        Ok(sleep)
    }

    /// Fires one slot; false when it is not due yet on Redis's clock.
    fn fire(&mut self, index: usize, slot: i64) -> broker::Result<bool> {
        self.pulse.beat();
        let entry = &self.entries[index];
        let id = slot_id(&entry.config.name, slot);
        // The config's data is JSON it produced itself.
        let data =
            RawValue::from_string(entry.config.data_json.clone()).expect("schedule data is JSON");
        let mut envelope = Envelope::new(id.clone(), entry.config.kind.clone(), data);
        envelope.priority = Some(
            entry.queue.config.priorities[entry.config.level]
                .clone()
                .into(),
        );
        let connection = self.session.get()?;
        let (fired, redis_now) = broker::fire(
            connection,
            &entry.queue.keys,
            entry.config.level,
            &entry.config.name,
            slot,
            &envelope.encode(),
        )?;
        self.offset_ms = redis_now - local_now_ms();
        match fired {
            Fired::Now => {
                tracing::info!(schedule = %entry.config.name, task = %id, "periodic task queued")
            }
            Fired::Already => {
                tracing::debug!(schedule = %entry.config.name, task = %id, "slot fired by another daemon")
            }
            Fired::NotYet => return Ok(false),
        }
        Ok(true)
    }

    /// Reads the schedule's last fired slot and lines up the slots to fire, applying the missed-slot rule.
    fn plan(&mut self, index: usize) -> broker::Result<()> {
        self.pulse.beat();
        let entry = &self.entries[index];
        let connection = self.session.get()?;
        let (last, now) =
            broker::schedule_state(connection, &entry.queue.keys, &entry.config.name)?;
        self.offset_ms = now - local_now_ms();
        let entry = &mut self.entries[index];
        let plan = plan_slots(&entry.config, last, now);
        if plan.missed > 0 {
            let what = match entry.config.missed {
                Missed::Skip => "missed slots skipped (missed = \"skip\")",
                Missed::CatchUp => "missed slots fired late (missed = \"catch_up\")",
            };
            tracing::warn!(schedule = %entry.config.name, missed = plan.missed, "{what}");
        }
        if plan.dropped > 0 {
            tracing::warn!(schedule = %entry.config.name, dropped = plan.dropped, "more missed slots than catch_up_max; the oldest are skipped");
        }
        entry.due = plan.due;
        Ok(())
    }
}

/// The slots a scheduler should fire, given the last fired slot and Redis's clock.
#[derive(Debug, PartialEq, Eq)]
struct Plan {
    /// Slots to fire, oldest first; the last one may be in the future.
    due: VecDeque<i64>,
    /// Slots that passed while no daemon ran (fired late or skipped, per `missed`).
    missed: usize,
    /// Missed slots beyond `catch_up_max`, never fired.
    dropped: usize,
}

/// Only the latest slot at or before `now` can be on time, and only within `misfire_grace`; the slots between
/// the last fired one and it are missed. A schedule that never fired starts from now.
fn plan_slots(config: &ScheduleConfig, last: Option<i64>, now: i64) -> Plan {
    let grace = config.misfire_grace.as_millis() as i64;
    let when = &config.when;
    // Past slots after `last` (or, for a new schedule, within the grace), newest kept.
    let mut past = VecDeque::new();
    let mut dropped = 0usize;
    let mut cursor = last.unwrap_or(now - grace - 1);
    for _ in 0..MAX_SCAN {
        match when.next_after(cursor) {
            Some(slot) if slot <= now => {
                past.push_back(slot);
                if past.len() > config.catch_up_max + 1 {
                    past.pop_front();
                    dropped += 1;
                }
                cursor = slot;
            }
            _ => break,
        }
    }
    let on_time = past.back().copied().filter(|latest| now - latest <= grace);
    if on_time.is_some() {
        past.pop_back();
    } else if past.len() > config.catch_up_max {
        past.pop_front();
        dropped += 1;
    }
    let mut due = VecDeque::new();
    let missed = if last.is_some() {
        past.len() + dropped
    } else {
        0
    };
    if last.is_some() && config.missed == Missed::CatchUp {
        due.extend(past);
    } else {
        dropped = 0;
    }
    due.extend(on_time);
    if due.is_empty() {
        due.extend(when.next_after(cursor.max(now)));
    }
    Plan {
        due,
        missed,
        dropped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every(seconds: u64, missed: Missed) -> ScheduleConfig {
        ScheduleConfig {
            name: "s".into(),
            queue: "q".into(),
            kind: "t".into(),
            data_json: "null".into(),
            when: crate::config::When::Every(Duration::from_secs(seconds)),
            level: 0,
            missed,
            misfire_grace: Duration::from_secs(60),
            catch_up_max: 3,
        }
    }

    fn plan(due: &[i64], missed: usize, dropped: usize) -> Plan {
        Plan {
            due: due.iter().copied().collect(),
            missed,
            dropped,
        }
    }

    #[test]
    fn slots_to_fire() {
        let minute = 60_000;
        let now = 100 * minute + 5_000; // 5 s after a minute slot
        let cases = [
            // A new schedule fires the current slot if it is within the grace, and never older ones.
            (
                every(60, Missed::CatchUp),
                None,
                plan(&[100 * minute], 0, 0),
            ),
            (every(1, Missed::CatchUp), None, plan(&[now], 0, 0)),
            // Up to date: the next slot.
            (
                every(60, Missed::Skip),
                Some(100 * minute),
                plan(&[101 * minute], 0, 0),
            ),
            // One slot missed, the current one on time.
            (
                every(60, Missed::Skip),
                Some(98 * minute),
                plan(&[100 * minute], 1, 0),
            ),
            (
                every(60, Missed::CatchUp),
                Some(98 * minute),
                plan(&[99 * minute, 100 * minute], 1, 0),
            ),
            // Many missed: catch-up keeps the newest catch_up_max (3).
            (
                every(60, Missed::CatchUp),
                Some(90 * minute),
                plan(&[97 * minute, 98 * minute, 99 * minute, 100 * minute], 9, 6),
            ),
            (
                every(60, Missed::Skip),
                Some(90 * minute),
                plan(&[100 * minute], 9, 0),
            ),
        ];
        for (config, last, expected) in cases {
            assert_eq!(
                plan_slots(&config, last, now),
                expected,
                "{:?} last {last:?}",
                config.when
            );
        }
        // The latest past slot is itself missed when it is older than the grace.
        let hourly = ScheduleConfig {
            when: crate::config::When::Every(Duration::from_secs(3600)),
            ..every(0, Missed::Skip)
        };
        let hour = 3_600_000;
        assert_eq!(
            plan_slots(&hourly, Some(hour), 2 * hour + 120_000),
            plan(&[3 * hour], 1, 0)
        );
    }

    #[test]
    fn slot_ids_are_readable_and_the_same_everywhere() {
        assert_eq!(
            slot_id("nightly", 1_796_007_600_000),
            "nightly@2026-11-30T03:00:00Z"
        );
    }
}
