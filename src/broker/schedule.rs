//! Periodic tasks: firing one slot, at most once across all daemons (see `fire.lua`).

use redis::ConnectionLike;

use super::{Conn, QueueKeys, Result, SCRIPTS, time_ms};

/// What became of an attempt to fire a periodic task's slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fired {
    /// This call queued the task.
    Now,
    /// The slot (or a later one) was fired already, by this daemon or another.
    Already,
    /// The slot is still in the future on Redis's clock.
    NotYet,
}

/// Fires `slot` of the schedule `name`: queues `envelope` on `level` unless the slot was fired already.
/// Returns what happened and Redis's clock.
pub fn fire(
    conn: &mut Conn,
    keys: &QueueKeys,
    level: usize,
    name: &str,
    slot_ms: i64,
    envelope: &str,
) -> Result<(Fired, i64)> {
    let (result, now_ms): (i64, i64) = SCRIPTS
        .fire
        .key(&keys.schedules)
        .key(&keys.ready[level])
        .key(&keys.wake)
        .key(&keys.stats)
        .arg(name)
        .arg(slot_ms)
        .arg(envelope)
        .invoke(conn)?;
    conn.replicated(&keys.stats)?;
    let fired = match result {
        1 => Fired::Now,
        0 => Fired::Already,
        _ => Fired::NotYet,
    };
    Ok((fired, now_ms))
}

/// The last slot fired for the schedule `name` (if any) and Redis's clock.
pub fn schedule_state(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    name: &str,
) -> Result<(Option<i64>, i64)> {
    let (last, time): (Option<i64>, (i64, i64)) = redis::pipe()
        .cmd("HGET")
        .arg(&keys.schedules)
        .arg(name)
        .cmd("TIME")
        .query(conn)?;
    Ok((last, time_ms(time)))
}
