//! The progress running tasks report (docs/PROTOCOL.md, "Progress"): writing the latest reports of a lane's tasks
//! in one fenced call (progress.lua), and reading a task's back for `kmqd task show` and the dashboard.
//!
//! A report lives in a hash beside its task's claim (`processing:OWNER:LEVEL:CLAIM:progress`, position -> JSON),
//! which settle.lua deletes with the claim list: a report is never read for a task that is not running, since a
//! reader looks it up only for a task it found in a claim list, unsettled.

use std::time::Duration;

use redis::ConnectionLike;
use serde::{Deserialize, Serialize};

use super::{QueueKeys, Result, SCRIPTS};

/// The most bytes of a report's message that are kept: a progress line is a short status, not a log.
pub const MESSAGE_BYTES: usize = 1024;

/// How long a claim's progress hash lasts after its last write, were its claim ever deleted by anything but the
/// settle that deletes the hash with it: a day, far longer than any report is read for.
pub const KEPT: Duration = Duration::from_secs(24 * 3600);

/// One task's latest report, on its way to Redis: where its task is held (a position of one of `owner`'s claim
/// lists) and what it said.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    pub level: usize,
    pub claim: u64,
    pub position: u32,
    /// Between 0 and 1 (the daemon clamps it: [`fraction`]).
    pub fraction: f32,
    /// At most [`MESSAGE_BYTES`] (the daemon cuts it: [`message`]).
    pub message: String,
}

/// A task's progress as read back: what its handler last reported, and when (ms on Redis's clock).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub fraction: f64,
    pub message: String,
    /// When the report was written, ms since the epoch on Redis's clock (at most a flush interval after the
    /// handler made it).
    #[serde(rename = "at")]
    pub at_ms: i64,
    /// How old the report was when it was read (ms, Redis's clock): set by [`Progress::aged`].
    #[serde(default)]
    pub age_ms: i64,
}

// A fraction is never NaN (NaN reports are dropped before they are written; one that does not parse is no
// report), so equality is an equivalence, as `Found`'s derived `Eq` needs.
impl Eq for Progress {}

impl Progress {
    /// The report as read at `now` (ms, Redis's clock).
    pub fn aged(self, now: i64) -> Progress {
        Progress {
            age_ms: (now - self.at_ms).max(0),
            ..self
        }
    }
}

/// A handler's fraction as kept: `None` for NaN (a report of nothing, dropped), else clamped to 0..=1, so that a
/// handler counting past its estimate (1.02) or below zero still reports something that reads as progress.
pub fn fraction(given: f32) -> Option<f32> {
    (!given.is_nan()).then(|| given.clamp(0.0, 1.0))
}

/// A handler's message as kept: its first [`MESSAGE_BYTES`] bytes, cut at a character's boundary.
pub fn message(given: &str) -> &str {
    if given.len() <= MESSAGE_BYTES {
        return given;
    }
    let mut end = MESSAGE_BYTES;
    while !given.is_char_boundary(end) {
        end -= 1;
    }
    &given[..end]
}

/// Writes `reports`, the latest of each task of `owner`'s: one progress.lua call, which writes nothing unless the
/// owner's lease holds, and drops each report whose task is settled or whose claim is gone. Returns how many
/// were written.
pub fn report(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    owner: &str,
    reports: &[Report],
) -> Result<u64> {
    let mut invocation = SCRIPTS.progress.prepare_invoke();
    invocation.key(&keys.owners);
    invocation.arg(owner).arg(KEPT.as_millis() as u64);
    for report in reports {
        invocation
            .key(keys.claim_list(owner, report.level, report.claim))
            .key(keys.claim_settled(owner, report.level, report.claim))
            .key(keys.claim_progress(owner, report.level, report.claim));
        // To six places: the f32's widening would write 0.4 as 0.4000000059604645.
        let fraction = (f64::from(report.fraction) * 1e6).round() / 1e6;
        let json = serde_json::json!({"fraction": fraction, "message": report.message});
        invocation.arg(report.position).arg(json.to_string());
    }
    Ok(invocation.invoke(conn)?)
}

/// The latest report of the task at `position` of `owner`'s claim `claim` at `level`, if its handler made one.
pub fn read(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    owner: &str,
    level: usize,
    claim: u64,
    position: u32,
) -> Result<Option<Progress>> {
    let json: Option<String> = redis::cmd("HGET")
        .arg(keys.claim_progress(owner, level, claim))
        .arg(position)
        .query(conn)?;
    // A report that does not parse (written by hand) reads as none rather than failing the whole `task show`.
    Ok(json.and_then(|json| serde_json::from_str(&json).ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fraction_is_clamped_and_nan_is_dropped() {
        for (given, kept) in [
            (0.4, Some(0.4)),
            (0.0, Some(0.0)),
            (1.0, Some(1.0)),
            (1.5, Some(1.0)),
            (-0.2, Some(0.0)),
            (f32::INFINITY, Some(1.0)),
            (f32::NEG_INFINITY, Some(0.0)),
            (f32::NAN, None),
        ] {
            assert_eq!(fraction(given), kept, "{given}");
        }
    }

    #[test]
    fn a_long_message_is_cut_at_a_character_boundary() {
        assert_eq!(message("short"), "short");
        let long = "é".repeat(MESSAGE_BYTES);
        let cut = message(&long);
        assert!(cut.len() <= MESSAGE_BYTES && cut.len() >= MESSAGE_BYTES - 1);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
