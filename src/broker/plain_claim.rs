//! The claim of a plain queue: claim_plain.lua (docs/PERFORMANCE.md, "A claim made for the plain queue"). Every
//! task pushed to an idle safe-mode queue waits, on its way to a handler, for Redis to run push.lua and the claim
//! sent behind the fetcher's wait (issue 38); claim.lua, made for every case (limits, rates, weights, type limits,
//! groups, quarantine, dead-lettering), spends a third of its run on that generality. claim_plain.lua takes the same
//! keys and arguments, writes and answers what claim.lua does on the plain path, and leaves every other case to
//! claim.lua, having written nothing ("GENERIC"): the call then goes there, with the same claim number.

use super::tasks::ClaimLimits;
use super::{QueueKeys, SCRIPTS};

/// Whether claim_plain.lua is made for this queue's claims: no `max_running`, rate limit, priority weights, type
/// limits, drained flows or groups. (What else it leaves to claim.lua, it finds in Redis: a throttle, a
/// quarantine.)
fn made_for(keys: &QueueKeys, limits: &ClaimLimits<'_>) -> bool {
    limits.max_running.is_none_or(|max| max == 0) && limits.none_but_max_running(keys)
}

/// claim_plain.lua, with its source (for a server that lost its script cache), when it is made for this queue's
/// claims: the script to send a claim to first.
pub(super) fn first(
    keys: &QueueKeys,
    limits: &ClaimLimits<'_>,
) -> Option<(&'static redis::Script, &'static str)> {
    made_for(keys, limits).then(|| (&SCRIPTS.claim_plain, super::sources::CLAIM_PLAIN))
}
