//! The settle that hands its freed slots over, for the case that sets a limited queue's pace: handover_plain.lua
//! (docs/PERFORMANCE.md, "A settle made for the handover of a plain queue"). At `max_running`, every slot's cycle
//! waits for Redis to run the settle that frees it and the claim that fills it again; settle.lua and claim.lua, made
//! for every case (records, type limits, groups, rates, weights, quarantine), cost Redis about 620,000 instructions
//! for one task, most of it their generality, and a slot's turnaround left the queue short of its limit's rate. This
//! script asks Redis only what a plain queue's call of acknowledgements needs. It answers as settle.lua does, and
//! stores its answer as settle.lua does (a copy sent again is answered by either); whatever it is not made for it
//! leaves to settle.lua, having written nothing ("GENERIC"), and the call goes there, as it would have without it.

use std::sync::Arc;

use super::tasks::{
    Batch, Call, Handover, ScriptKeys, Settled, Settlement, Touched, script_then_lists,
    settle_answer, split_settle_reply,
};
use super::{Conn, QueueKeys, Result, SCRIPTS, TokenId};

/// Whether handover_plain.lua is made for this call: a queue whose claims count under `max_running` and nothing
/// else (no rate limit, priority weights, type limits, drained flows or groups), and acknowledgements only, each of
/// a claimed task, none keeping a result or writing a note.
fn made_for<'a>(
    keys: &QueueKeys,
    settlements: impl IntoIterator<Item = &'a Settlement>,
    handover: &Handover<'_>,
) -> bool {
    let limits = handover.limits;
    let plain = limits.max_running.is_some_and(|max| max > 0)
        && limits.none_but_max_running(keys)
        && handover.max > 0;
    let mut any = false;
    plain
        && settlements.into_iter().all(|s| {
            any = true;
            s.is_plain_ack()
                && s.kept.is_none()
                && s.note.is_none()
                && matches!(
                    s.token.as_ref().map(|token| &token.id),
                    Some(TokenId::Listed { .. })
                )
        })
        && any
}

/// Sends the call to handover_plain.lua when it is made for it: `None` when it is not, or when the script left it
/// to settle.lua (having written nothing); the caller then sends it to settle.lua.
pub(super) fn settle<'a>(
    conn: &mut Conn,
    keys: &QueueKeys,
    call: &Call<'_>,
    owner: &Arc<str>,
    settlements: impl IntoIterator<Item = &'a Settlement> + Clone,
    handover: &Handover<'_>,
) -> Result<Option<(Settled, Option<Batch>)>> {
    if !made_for(keys, settlements.clone(), handover) {
        return Ok(None);
    }
    let mut touched = Touched::default();
    for s in settlements.clone() {
        if let Some(TokenId::Listed { claim, position }) = s.token.as_ref().map(|token| &token.id) {
            touched.acknowledge(s.level, *claim, *position);
        }
    }
    let lists = keys.claim_lists(owner, handover.claim);
    let mut invocation = ScriptKeys::default();
    invocation
        .key(&keys.owners)
        .key(&keys.stats)
        .key(keys.settled(call.settler))
        .key(&keys.running)
        .key(&keys.wake)
        .key(keys.owner_info(owner))
        .key(&keys.paused)
        .key(&keys.throttle)
        .key(&keys.ready)
        .key(keys.processing_all(owner))
        .key(&keys.quarantine)
        .key(&lists)
        .key(keys.claim_scopes_all(owner, handover.claim));
    touched.keys(&mut invocation, keys, owner);
    let limits = handover.limits;
    let mut invocation = invocation.evalsha(&SCRIPTS.handover_plain);
    invocation
        .arg(&**owner)
        .arg(call.number)
        .arg(handover.claim)
        .arg(handover.max)
        .arg(limits.max_running.unwrap_or(0))
        .arg(limits.max_task_bytes)
        .arg(super::tasks::CLAIM_BYTES)
        .arg(keys.levels());
    touched.args(&mut invocation);
    let (reply, taken, collected) = match script_then_lists(
        conn,
        super::sources::HANDOVER_PLAIN,
        &invocation,
        &lists,
        None,
    ) {
        Err(error) if error.code() == Some("GENERIC") => return Ok(None),
        outcome => outcome?,
    };
    let (reply, claim_reply) = split_settle_reply(reply, 0)?;
    settle_answer(
        conn,
        keys,
        settlements,
        |_| true,
        0,
        reply,
        Some((owner, handover.claim, claim_reply, taken, collected)),
    )
    .map(Some)
}
