//! A queue's history for the dashboard's charts: one sample a minute of its `done` and `failed` counters and
//! its ready, delayed and dead depths, in `PREFIX:{Q}:history` (docs/PROTOCOL.md, "History"), at most
//! [`MINUTES`] of them. Every daemon's monitor offers a sample every [`SAMPLE_EVERY`] for each of its queues
//! (history.lua writes the first one of each minute on Redis's clock and drops the old ones), so the history
//! is kept while any daemon runs and survives a dashboard's restart; nothing on a task's path writes it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Conn, QueueKeys, Result, SCRIPTS};

/// Minutes of samples kept: the charts show the last hour.
pub const MINUTES: u32 = 60;

/// How often a monitor offers each queue's sample; a minute gets its sample within this of its start.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(15);

/// One sample, as history.lua writes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sample {
    /// When it was taken, ms since the epoch on Redis's clock.
    pub at: i64,
    /// The queue's counters then (`kmqd stats`' `done` and `failed`).
    pub done: u64,
    pub failed: u64,
    /// Its depths then: ready (quarantined included), delayed (retries included), dead.
    pub ready: u64,
    pub delayed: u64,
    pub dead: u64,
}

/// Takes this minute's sample of the queue of `keys` unless one was taken; returns whether this call did.
pub fn record(conn: &mut Conn, keys: &QueueKeys) -> Result<bool> {
    let mut call = SCRIPTS.history.prepare_invoke();
    call.key(&keys.history).key(&keys.stats).key(&keys.dead);
    for list in keys.ready.iter().chain(&keys.quarantine) {
        call.key(list);
    }
    for zset in keys.delayed.iter().chain(&keys.retry) {
        call.key(zset);
    }
    let written: i64 = call
        .arg(keys.ready.len() + keys.quarantine.len())
        .arg(MINUTES)
        .invoke(conn)?;
    Ok(written == 1)
}

/// The samples kept, oldest first. A member that does not parse (written by something else) is left out.
pub fn read(conn: &mut Conn, keys: &QueueKeys) -> Result<Vec<Sample>> {
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg(&keys.history)
        .arg(0)
        .arg(-1)
        .query(conn)?;
    Ok(members
        .iter()
        .filter_map(|member| serde_json::from_str(member).ok())
        .collect())
}
