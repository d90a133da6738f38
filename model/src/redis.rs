//! What Redis holds for one queue, and the scripts of `src/broker/scripts/` as functions on it.
//!
//! Each function below is one script, applied atomically as Redis applies it; each names the script and follows
//! its steps in order, so that a reader can hold the two side by side. Payloads are reduced to what a decision
//! reads ([`Env`]: the task id, `attempt`, `recovered`); everything a script does that no decision reads (the
//! wake-up list, counters other than `done`, unique ids, `created_at`, the dead record's text) is left out.

use arrayvec::ArrayVec;

use crate::setup::{Levels, Mutation};

/// A short list kept inline, so that copying a state (the checker's main work) allocates nothing. Six is more
/// than any list needs with three tasks, even when a mutation duplicates tasks.
pub type List<T> = ArrayVec<T, 6>;

/// Owners pile up: every crash or restart registers a new one, and the old ones stay until a monitor releases
/// them (a pill alone crashes its daemons up to five times with `retry_times = 1`).
pub type Owners = ArrayVec<Owner, 10>;

/// A task's envelope as far as any decision reads it. Ordered so that collections of them have one canonical
/// form (states that differ only in the order of a set are the same state).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Env {
    pub task: u8,
    /// Runs charged to the task (handler retries, crashes while it ran alone).
    pub attempt: u8,
    /// How often it came back uncharged from an expired lease. Only `recovered >= 1` is ever read (policy.rs:
    /// `Recover { isolated: recoveries >= 1 }`), so it saturates at 2 to keep the state space small.
    pub recovered: u8,
}

impl Env {
    pub fn new(task: u8) -> Env {
        Env {
            task,
            attempt: 0,
            recovered: 0,
        }
    }
}

/// An owner id, made by the daemon (instance id and generation: `lane::Ownership::new_id`), never by Redis.
/// `run` stands for the instance id: a restarted daemon is a new instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerId {
    pub daemon: u8,
    pub run: u8,
    pub generation: u8,
}

/// A lease deadline, reduced to whether it is in the future. Renewal of a live lease changes nothing here, so it
/// is not an action; a lease runs out through [`crate::Action::Expire`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lease {
    Live,
    Expired,
}

/// An entry of the `owners` zset together with the owner's info hash (`P:{Q}:owner:ID`): register.lua writes
/// both, release.lua deletes both, so they exist together.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner {
    pub id: OwnerId,
    pub lease: Lease,
    /// `levels`: the levels it registered with (its daemon's config); the monitors recover these.
    pub levels: Levels,
    /// `floor`: the lowest first token a claim may carry (raised by adopt.lua).
    pub floor: Option<u8>,
    /// `isolated`: the quarantined task it runs alone, as (level, token).
    pub isolated: Option<(u8, u8)>,
    /// Ghost (not in Redis): the one task its processing hashes held when its lease ran out, if they held exactly
    /// one. A charge for a crash is fair only to that task.
    pub alone_at_expiry: Option<u8>,
}

/// One field of a processing hash `P:{Q}:processing:OWNER:LEVEL`: token -> envelope.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Processing {
    pub owner: OwnerId,
    pub level: u8,
    pub token: u8,
    pub env: Env,
}

/// A settling party (an acker or a monitor of one daemon run): its identity names its `settled:` key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Settler {
    pub daemon: u8,
    pub run: u8,
    pub monitor: bool,
}

/// The keys of one queue.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Redis {
    /// `ready:L`, head (left, the next claimed) first.
    pub ready: [List<Env>; 2],
    /// `quarantine:L`, head first.
    pub quarantine: [List<Env>; 2],
    /// `retry:L`, a sorted set whose scores (due times) are abstracted away: kept sorted by envelope, any member
    /// may be the next one due.
    pub retry: [List<Env>; 2],
    /// `owners` and each owner's info hash, sorted by id.
    pub owners: Owners,
    /// Every processing hash of every owner, sorted. Kept apart from `owners`: a processing hash can outlive its
    /// owner's registration (that is what "stranded" means).
    pub processing: List<Processing>,
    /// `dead`: the dead records, reduced to the task and its attempt, sorted (their order is never read).
    pub dead: List<Env>,
    /// `stats.done`, split by task (the script adds the number of applied acknowledgements; the split is what
    /// lets the properties see which task was counted).
    pub done: [u8; 3],
    /// `settled:SETTLER`: the last call's number of each settling party. The stored result is left out: the
    /// daemon's reaction to a reply does not depend on it in this model. Records of a daemon run that ended are
    /// dropped: that party never calls again, and the key only expires (a day later) in Redis.
    pub settled: List<(Settler, u8)>,
}

/// One claim call: the owner, the first of its tokens, how many (`ARGV[2]`), and the levels of its KEYS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimCall {
    pub owner: OwnerId,
    pub first: u8,
    pub max: u8,
    pub levels: Levels,
}

/// What claim.lua answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claimed {
    /// `LEASELOST`: the owner has no live lease.
    LeaseLost,
    /// `FENCED`: the first token is below the owner's floor; nothing was taken.
    Fenced,
    /// What it took: (level, token, envelope), the isolated task (if any) first.
    Took(List<(u8, u8, Env)>),
}

/// A settle.lua record (or a plain acknowledgement: the model does not tell the two apart, the script applies
/// both the same way under the owner fence).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Record {
    pub op: Op,
    /// `None`: a default-mode record, which has no token and is never stale.
    pub token: Option<u8>,
    pub level: u8,
    /// The payload: the envelope to queue (retry / recover / back), or the dead record's task and attempt.
    pub payload: Env,
    /// Ghost: a monitor's charge (retry_isolated or dead of the owner's isolated task), for the fairness
    /// property.
    pub charged: bool,
}

/// settle.lua's ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Ack,
    /// A handler retry: to the retry zset (the policy's backoff is never zero).
    Retry,
    RetryIsolated,
    Recover,
    RecoverIsolated,
    Back,
    Dead,
}

/// settle.lua's fence (`ARGV[1]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    Owner,
    Expired,
}

/// What one settle call did, for the model's bookkeeping.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SettleReply {
    /// The call was answered from the settler's stored last call, applying nothing.
    pub answered_from_record: bool,
    /// Per record: applied (false: stale).
    pub applied: Vec<bool>,
    /// Ghost: the tasks a monitor charged for a crash their owner did not hold them alone for.
    pub unfair: u8,
}

impl Redis {
    pub fn owner(&self, id: OwnerId) -> Option<&Owner> {
        self.owners.iter().find(|owner| owner.id == id)
    }

    fn owner_mut(&mut self, id: OwnerId) -> Option<&mut Owner> {
        self.owners.iter_mut().find(|owner| owner.id == id)
    }

    pub fn is_live(&self, id: OwnerId) -> bool {
        self.owner(id)
            .is_some_and(|owner| owner.lease == Lease::Live)
    }

    pub fn is_expired(&self, id: OwnerId) -> bool {
        self.owner(id)
            .is_some_and(|owner| owner.lease == Lease::Expired)
    }

    /// The processing entries of `owner` at `level`, in token order.
    pub fn held_by(&self, owner: OwnerId, level: u8) -> impl Iterator<Item = &Processing> {
        self.processing
            .iter()
            .filter(move |p| p.owner == owner && p.level == level)
    }

    fn hexists(&self, owner: OwnerId, level: u8, token: u8) -> bool {
        self.processing
            .iter()
            .any(|p| p.owner == owner && p.level == level && p.token == token)
    }

    /// HDEL of one token: true when it was there.
    fn hdel(&mut self, owner: OwnerId, level: u8, token: u8) -> bool {
        let before = self.processing.len();
        self.processing
            .retain(|p| !(p.owner == owner && p.level == level && p.token == token));
        self.processing.len() < before
    }

    fn hset(&mut self, owner: OwnerId, level: u8, token: u8, env: Env) {
        self.processing.push(Processing {
            owner,
            level,
            token,
            env,
        });
        self.processing.sort();
    }

    /// Not a script: `settler` starts a new call, and its stored record of the previous one can never match
    /// again (see [`crate::model::Calls`]).
    pub fn new_call(&mut self, settler: Settler) {
        self.settled.retain(|(who, _)| *who != settler);
    }

    /// push.lua, for one task that is not delayed and not unique: RPUSH to its level's ready list.
    pub fn push(&mut self, level: u8, env: Env) {
        self.ready[level as usize].push(env);
    }

    /// register.lua. Returns 1 (registered, or already registered with a live lease: a retry after a lost reply)
    /// or 0 (the id is known and its lease ran out).
    pub fn register(&mut self, id: OwnerId, levels: Levels) -> bool {
        // local lease = ZSCORE owners id; live -> 1, past -> 0
        if let Some(owner) = self.owner(id) {
            return owner.lease == Lease::Live;
        }
        // (EXISTS info -> 0: the info hash never outlives the zset entry here, release.lua deletes both.)
        self.owners.push(Owner {
            id,
            lease: Lease::Live,
            levels,
            floor: None,
            isolated: None,
            alone_at_expiry: None,
        });
        self.owners.sort_by_key(|owner| owner.id);
        true
    }

    /// claim.lua. `alone`: the proposed fix of the quarantine (not kmqd's script; see `Setup::alone`).
    pub fn claim(&mut self, call: &ClaimCall, mutation: Option<Mutation>, alone: bool) -> Claimed {
        let ClaimCall {
            owner: id,
            first,
            max,
            levels,
        } = *call;
        // if not lease or lease <= now: LEASELOST
        let Some(owner) = self.owner(id) else {
            return Claimed::LeaseLost;
        };
        if owner.lease != Lease::Live {
            return Claimed::LeaseLost;
        }
        // if info.floor and ARGV[7] < floor: FENCED
        if mutation != Some(Mutation::NoFloorCheck)
            && owner.floor.is_some_and(|floor| first < floor)
        {
            return Claimed::Fenced;
        }
        let tokens = first..first + max;
        let mut took = List::new();
        if max > 0 {
            // busy: the isolated token is still in its processing hash (and its level is one of these KEYS)
            let mut busy = owner.isolated.is_some_and(|(level, token)| {
                levels.contains(level) && self.hexists(id, level, token)
            });
            if alone {
                // The fix: an owner running its quarantined task takes nothing else, and takes one only when it
                // holds nothing at all.
                if busy {
                    return Claimed::Took(took);
                }
                busy = self.processing.iter().any(|p| p.owner == id);
            }
            // One quarantined task, from the highest level that has one, under ARGV[7].
            for level in levels.iter() {
                if busy {
                    break;
                }
                if !self.quarantine[level as usize].is_empty() {
                    let env = self.quarantine[level as usize].remove(0);
                    self.hset(id, level, first, env);
                    if let Some(owner) = self.owner_mut(id) {
                        owner.isolated = Some((level, first));
                    }
                    took.push((level, first, env));
                    busy = true;
                }
            }
        }
        if alone && !took.is_empty() {
            return Claimed::Took(took);
        }
        // Then ready tasks, highest level first, LPOP up to max - taken, under the next tokens in order.
        let mut next = tokens.start + took.len() as u8;
        for level in levels.iter() {
            while next < tokens.end && !self.ready[level as usize].is_empty() {
                let env = self.ready[level as usize].remove(0);
                self.hset(id, level, next, env);
                took.push((level, next, env));
                next += 1;
            }
        }
        Claimed::Took(took)
    }

    /// adopt.lua: raises the owner's floor past the lost claim's tokens and returns what they hold (at the levels
    /// of `levels`, the caller's KEYS). `None`: LEASELOST.
    pub fn adopt(
        &mut self,
        id: OwnerId,
        first: u8,
        count: u8,
        levels: Levels,
    ) -> Option<List<(u8, u8, Env)>> {
        let owner = self.owner_mut(id)?;
        if owner.lease != Lease::Live {
            return None;
        }
        // past = last token + 1; floor = max(floor, past)
        let past = first + count;
        if owner.floor.is_none_or(|floor| past > floor) {
            owner.floor = Some(past);
        }
        // HMGET of every token in every processing hash
        Some(
            self.processing
                .iter()
                .filter(|p| {
                    p.owner == id && levels.contains(p.level) && (first..past).contains(&p.token)
                })
                .map(|p| (p.level, p.token, p.env))
                .collect(),
        )
    }

    /// settle.lua: applies `records` once per call (`call` of `settler`), fenced by each record's token.
    pub fn settle(
        &mut self,
        settler: Settler,
        call: u8,
        fence: Fence,
        owner: Option<OwnerId>,
        records: &[Record],
        mutation: Option<Mutation>,
    ) -> SettleReply {
        // local prior = GET last_call; the same call again: return its stored result, apply nothing
        let prior = self
            .settled
            .iter()
            .find(|(who, _)| *who == settler)
            .map(|(_, number)| *number);
        if mutation != Some(Mutation::NoIdempotentSettle) && prior == Some(call) {
            return SettleReply {
                answered_from_record: true,
                ..SettleReply::default()
            };
        }
        // fence "expired": nothing applies unless the owner is there and its lease has run out
        let live = match (fence, owner) {
            (Fence::Owner, _) => true,
            (Fence::Expired, Some(owner)) => self.is_expired(owner),
            (Fence::Expired, None) => false,
        };
        let mut applied = Vec::with_capacity(records.len());
        let mut unfair = 0;
        for record in records {
            let ok = match (record.token, owner) {
                (None, _) => true,
                (Some(token), Some(owner)) => live && self.hdel(owner, record.level, token),
                (Some(_), None) => false,
            };
            if ok {
                unfair |= self.apply(record, owner);
            }
            applied.push(ok);
        }
        // SET last_call (call .. '|' .. result) PX one day
        self.settled.retain(|(who, _)| *who != settler);
        self.settled.push((settler, call));
        self.settled.sort();
        SettleReply {
            answered_from_record: false,
            applied,
            unfair,
        }
    }

    /// One applied settle.lua record. Returns the ghost bit of a task charged unfairly.
    fn apply(&mut self, record: &Record, owner: Option<OwnerId>) -> u8 {
        let level = record.level as usize;
        let payload = record.payload;
        let mut unfair = 0;
        if record.charged {
            let alone = owner
                .and_then(|owner| self.owner(owner))
                .and_then(|owner| owner.alone_at_expiry);
            if alone != Some(payload.task) {
                unfair = 1 << payload.task;
            }
        }
        match record.op {
            Op::Ack => self.done[payload.task as usize] += 1,
            // A delay > 0: ZADD to the retry zset (a delay of 0 would LPUSH to the ready list; the policy's
            // backoff is never 0 and the handlers here never ask for one).
            Op::Retry => {
                self.retry[level].push(payload);
                self.retry[level].sort();
            }
            Op::RetryIsolated | Op::RecoverIsolated => self.quarantine[level].insert(0, payload),
            Op::Recover | Op::Back => self.ready[level].insert(0, payload),
            Op::Dead => {
                self.dead.push(payload);
                self.dead.sort();
            }
        }
        unfair
    }

    /// release.lua: forgets `id` if its processing hashes at `levels` (the KEYS the caller passed) are empty
    /// and, for a monitor (`expired`), its lease has run out. Returns whether it was released.
    pub fn release(&mut self, id: OwnerId, levels: Levels, expired: bool) -> bool {
        if self
            .processing
            .iter()
            .any(|p| p.owner == id && levels.contains(p.level))
        {
            return false;
        }
        if expired && self.is_live(id) {
            return false;
        }
        let before = self.owners.len();
        self.owners.retain(|owner| owner.id != id);
        self.owners.len() < before
    }

    /// promote.lua, for one due retry: ZREM it and LPUSH it to the front of its ready list.
    pub fn promote(&mut self, level: u8, index: usize) {
        let env = self.retry[level as usize].remove(index);
        self.ready[level as usize].insert(0, env);
    }

    /// The default mode's LMPOP over each level's quarantine then ready list: up to `max` from the first
    /// non-empty list (fetcher.rs `broker::pop`).
    pub fn pop(&mut self, levels: Levels, max: u8) -> List<(u8, Env)> {
        for level in levels.iter() {
            for list in [&mut self.quarantine, &mut self.ready] {
                let list = &mut list[level as usize];
                if !list.is_empty() {
                    let n = list.len().min(max as usize);
                    return list.drain(..n).map(|env| (level, env)).collect();
                }
            }
        }
        List::new()
    }

    /// A lease runs out (time passes): ZSCORE <= now from here on. Records, as a ghost, which task the owner held
    /// alone, if it held exactly one.
    pub fn expire(&mut self, id: OwnerId) {
        let mut held = self.processing.iter().filter(|p| p.owner == id);
        let alone = match (held.next(), held.next()) {
            (Some(only), None) => Some(only.env.task),
            _ => None,
        };
        if let Some(owner) = self.owner_mut(id) {
            owner.lease = Lease::Expired;
            owner.alone_at_expiry = alone;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWNER: OwnerId = OwnerId {
        daemon: 0,
        run: 0,
        generation: 1,
    };

    fn registered() -> Redis {
        let mut redis = Redis::default();
        assert!(redis.register(OWNER, Levels::BOTH));
        redis
    }

    fn call(first: u8, max: u8) -> ClaimCall {
        ClaimCall {
            owner: OWNER,
            first,
            max,
            levels: Levels::BOTH,
        }
    }

    #[test]
    fn a_claim_takes_one_quarantined_task_then_ready_ones_highest_level_first() {
        let mut redis = registered();
        redis.push(1, Env::new(0));
        redis.push(0, Env::new(1));
        redis.quarantine[1].push(Env::new(2));
        let Claimed::Took(took) = redis.claim(&call(0, 3), None, false) else {
            panic!("refused");
        };
        let order: Vec<(u8, u8, u8)> = took.iter().map(|(l, t, e)| (*l, *t, e.task)).collect();
        assert_eq!(order, [(1, 0, 2), (0, 1, 1), (1, 2, 0)]);
        assert_eq!(redis.owner(OWNER).unwrap().isolated, Some((1, 0)));
        // The proposed fix takes the quarantined task alone.
        let mut redis = registered();
        redis.push(0, Env::new(1));
        redis.quarantine[1].push(Env::new(2));
        let Claimed::Took(took) = redis.claim(&call(0, 3), None, true) else {
            panic!("refused");
        };
        assert_eq!(took.len(), 1);
    }

    #[test]
    fn adopt_raises_the_floor_so_the_lost_claim_is_fenced_if_it_runs_later() {
        let mut redis = registered();
        redis.push(0, Env::new(0));
        assert_eq!(
            redis.adopt(OWNER, 0, 2, Levels::BOTH).map(|t| t.len()),
            Some(0)
        );
        assert_eq!(redis.claim(&call(0, 2), None, false), Claimed::Fenced);
        assert_eq!(
            redis.claim(&call(0, 2), Some(Mutation::NoFloorCheck), false),
            Claimed::Took([(0, 0, Env::new(0))].into_iter().collect())
        );
        redis.expire(OWNER);
        assert_eq!(redis.claim(&call(2, 2), None, false), Claimed::LeaseLost);
    }

    #[test]
    fn a_settle_call_sent_again_is_answered_from_its_record() {
        let mut redis = Redis::default();
        let settler = Settler {
            daemon: 0,
            run: 0,
            monitor: false,
        };
        let ack = Record {
            op: Op::Ack,
            token: None,
            level: 0,
            payload: Env::new(0),
            charged: false,
        };
        let first = redis.settle(settler, 1, Fence::Owner, None, &[ack], None);
        let again = redis.settle(settler, 1, Fence::Owner, None, &[ack], None);
        assert_eq!(
            (first.applied, again.answered_from_record),
            (vec![true], true)
        );
        assert_eq!(redis.done[0], 1);
        let mutation = Some(Mutation::NoIdempotentSettle);
        redis.settle(settler, 1, Fence::Owner, None, &[ack], mutation);
        assert_eq!(redis.done[0], 2, "without the record, applied twice");
    }

    #[test]
    fn a_monitor_settles_only_expired_owners_and_releases_only_empty_ones() {
        let mut redis = registered();
        redis.push(1, Env::new(0));
        redis.claim(&call(0, 1), None, false);
        let settler = Settler {
            daemon: 1,
            run: 0,
            monitor: true,
        };
        let recover = Record {
            op: Op::Recover,
            token: Some(0),
            level: 1,
            payload: Env::new(0),
            charged: false,
        };
        let live = redis.settle(settler, 1, Fence::Expired, Some(OWNER), &[recover], None);
        assert_eq!(live.applied, [false], "the lease is live: nothing applies");
        redis.expire(OWNER);
        assert!(
            !redis.release(OWNER, Levels::BOTH, true),
            "it still holds a task"
        );
        let expired = redis.settle(settler, 2, Fence::Expired, Some(OWNER), &[recover], None);
        assert_eq!(expired.applied, [true]);
        assert_eq!(redis.ready[1].as_slice(), [Env::new(0)]);
        assert!(redis.release(OWNER, Levels::BOTH, true));
    }
}
