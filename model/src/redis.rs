//! What Redis holds for one queue, and the scripts of `src/broker/scripts/` as functions on it.
//!
//! Each function below is one script, applied atomically as Redis applies it; each names the script and follows
//! its steps in order, so that a reader can hold the two side by side. Payloads are reduced to what a decision
//! reads ([`Env`]: the task id, `attempt`, `recovered`); everything a script does that no decision reads (the
//! wake-up list, counters other than `done`, unique ids, `created_at`, `crashes`, the dead record's text) is left
//! out.

use arrayvec::ArrayVec;

use crate::setup::{Levels, Mutation};

/// A short list kept inline, so that copying a state (the checker's main work) allocates nothing. Six is more
/// than any list needs with three tasks, even when a mutation duplicates tasks.
pub type List<T> = ArrayVec<T, 6>;

/// Owners pile up: every crash or restart registers a new one, and the old ones stay until a monitor releases
/// them (a pill crashes its daemons up to six times with `retry_times = 1`: four times uncharged, in company and
/// in the groups of 64 and 8, then twice alone).
pub type Owners = ArrayVec<Owner, 16>;

/// The quarantine's group sizes, most suspect first (`keys.rs`, `QUARANTINE_GROUPS`; claim.lua's `GROUPS`). A
/// claim takes `min(G, max)` tasks of a group, and `max` is at most the daemon's slots (three here), so a group of
/// 8 and one of 64 are both "every task the claim asks for" in this model, exactly as they would be in kmqd with
/// so few slots; they still are two lists, claimed in this order, and a task passes through both.
pub const GROUPS: [u8; 3] = [1, 8, 64];

/// `keys::quarantine_stage`: the quarantine stage (index into [`GROUPS`]) of a task recovered `recovered` times,
/// uncharged (the count after this recovery); `None`: the first recovery, to the front of the ready list.
pub fn quarantine_stage(recovered: u8) -> Option<u8> {
    match recovered {
        0 | 1 => None,
        2 => Some(2),
        3 => Some(1),
        _ => Some(0),
    }
}

/// `recovered` saturates here: [`quarantine_stage`] of `recovered + 1` is its only reader, and tells 0, 1, 2 and
/// "3 or more" apart.
pub const RECOVERED_MAX: u8 = 3;

/// A task's envelope as far as any decision reads it. Ordered so that collections of them have one canonical
/// form (states that differ only in the order of a set are the same state).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Env {
    pub task: u8,
    /// Runs charged to the task (handler retries, crashes while it ran alone).
    pub attempt: u8,
    /// How often it came back uncharged from an expired lease. Only `quarantine_stage(recovered + 1)` reads it
    /// (policy.rs, `LeaseExpired { ran_alone: false }`), so it saturates at [`RECOVERED_MAX`].
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
    /// `group`: the size of the quarantined group it runs with nothing else (claim.lua), one of [`GROUPS`]. Dead
    /// data while the owner holds nothing (the next claim deletes it before anything reads it, and the monitor
    /// reads it only for the tasks it finds held): [`crate::canon`] drops it then.
    pub group: Option<u8>,
    /// Ghost (not in Redis): the one task its processing hashes held when its lease ran out, if they held exactly
    /// one and its daemon was not crashed by an orphaned handler. A charge for a crash is fair only to that task.
    pub alone_at_expiry: Option<u8>,
    /// Ghost: its daemon was crashed by an orphaned handler (a task this owner did not hold) while it was current.
    pub crashed_by_orphan: bool,
}

/// One unsettled position of a claim list `P:{Q}:processing:OWNER:LEVEL:CLAIM`, as a field of the owner's
/// processing area: token -> envelope (a settled bit is the entry's removal; a list whose every position is
/// settled goes, with its scopes string, when its last entry goes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Processing {
    pub owner: OwnerId,
    pub level: u8,
    pub token: u8,
    pub env: Env,
    /// The claim that made the list (`ARGV[7]`, the call's first token): the list is (owner, level, claim).
    /// Only [`Mutation::SubtractCount`] reads it; [`crate::canon`] forgets it otherwise.
    pub claim: u8,
    /// The list's scopes string `N q` exists: the claim was made under a running limit, and its tasks count in
    /// `running`'s `q` until their bits are set. Written by the claim with the list, deleted with it.
    pub counted: bool,
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
    /// `quarantine:G:L`, head first, by stage (index into [`GROUPS`]: groups of 1, 8, 64), then level.
    pub quarantine: [[List<Env>; 2]; 3],
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
    /// The running hash's `q` (absent: 0): tasks of counted claim lists whose settled bit is not set.
    pub running: u8,
    /// `stats.running_underflow`: what settle.lua would have taken `q` below 0 by (it stops at 0).
    pub running_underflow: u8,
    /// Each `popped-running:OWNER` hash's `q`, sorted by owner (absent: 0): default mode's share of `running`
    /// that an owner's pops took under a limit and its settles have not given back (pop.lua adds, settle.lua and
    /// release.lua subtract). Kept apart from `owners`: a share can outlive its owner's registration, and then
    /// nothing would ever give it back (what "every share comes back" checks).
    pub popped_running: List<(OwnerId, u8)>,
    /// The queue's throttle key (`P:{Q}:throttle`, a string with an expiry): a handler's back-pressure, set by
    /// settle.lua's op "throttle"; while it exists claim.lua (state 6) and the pops take nothing. Its expiry is
    /// [`Redis::throttle_ends`] (time: how long it lasts is not modelled, only that it ends).
    pub throttle: bool,
    /// `settled:SETTLER`: the last call's number of each settling party. The stored result is left out: the
    /// daemon's reaction to a reply does not depend on it in this model. Records of a daemon run that ended are
    /// dropped: that party never calls again, and the key only expires (a day later) in Redis.
    pub settled: List<(Settler, u8)>,
}

/// One claim call: the owner, the first of its tokens (the claim's number, `ARGV[7]`), how many (`ARGV[2]`), the
/// levels of its KEYS, and the queue's `max_running` in the caller's config (`ARGV[8]`, 0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimCall {
    pub owner: OwnerId,
    pub first: u8,
    pub max: u8,
    pub levels: Levels,
    pub max_running: u8,
}

/// One pop.lua call under a running limit: the owner whose share counts it (`ARGV[1]`, `KEYS[6]`), how many
/// (`ARGV[2]`), the levels of its lists, and the caller's `max_running` (`ARGV[3]`). A default-mode daemon without
/// a limit pops with no owner in this model (kmqd registers one all the same, which holds nothing the model keeps:
/// unique ids are not modelled).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PopCall {
    pub owner: Option<OwnerId>,
    pub max: u8,
    pub levels: Levels,
    pub max_running: u8,
}

/// What pop.lua answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Popped {
    /// `LEASELOST`: the owner has no live lease (checked under a running limit, before anything is counted under
    /// it; see [`Mutation::PopWithoutLeaseCheck`]).
    LeaseLost,
    /// State 4: nothing, because `max_running` tasks are counted in `running`.
    Limited,
    /// State 2: nothing, because a handler throttled the queue.
    Throttled,
    /// State 0: the tasks it took (level, envelope), possibly none.
    Took(List<(u8, Env)>),
}

impl Popped {
    /// The tasks it took, if any.
    pub fn tasks(&self) -> &[(u8, Env)] {
        match self {
            Popped::Took(took) => took,
            _ => &[],
        }
    }
}

/// Whose tasks one settle call settles (`broker::Holder`): which keys the call names, and so what it may
/// subtract from `running`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Holder {
    /// Default mode without a running limit: nobody holds them in Redis.
    Nobody,
    /// Safe mode: the owner whose claim lists hold them (`ARGV[5]`, its processing keys).
    Claimed(OwnerId),
    /// Default mode under a running limit: the owner that popped them, whose share of `running` they are (the
    /// running hash and `popped-running:OWNER` in the call's KEYS).
    Popped(OwnerId),
}

impl Holder {
    /// The owner of claimed tasks (the fence's and the processing keys' owner).
    pub fn claimed(self) -> Option<OwnerId> {
        match self {
            Holder::Claimed(owner) => Some(owner),
            _ => None,
        }
    }
}

/// What claim.lua answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claimed {
    /// `LEASELOST`: the owner has no live lease.
    LeaseLost,
    /// `FENCED`: the first token is below the owner's floor; nothing was taken.
    Fenced,
    /// State 2: nothing, because quarantined tasks wait (or the owner runs a group) and the owner still holds
    /// tasks: it settles them first.
    Waiting,
    /// State 4: nothing, because `max_running` tasks are counted in `running` (the fetcher waits for a wake-up
    /// marker, which a settle that frees some pushes).
    Limited,
    /// State 6: nothing, because a handler throttled the queue (its throttle key exists): the fetcher claims
    /// again when the key's time to live is out.
    Throttled,
    /// State 1: one quarantined group, with nothing else: its size (one of [`GROUPS`]), and (level, token,
    /// envelope) of each of its tasks.
    Group(u8, List<(u8, u8, Env)>),
    /// State 0: ready tasks (level, token, envelope), highest level first; possibly none. (With
    /// [`Mutation::GroupBesideOthers`], a group first and ready tasks beside it.)
    Took(List<(u8, u8, Env)>),
}

impl Claimed {
    /// The tasks it took, if any.
    pub fn tasks(&self) -> &[(u8, u8, Env)] {
        match self {
            Claimed::Group(_, took) | Claimed::Took(took) => took,
            _ => &[],
        }
    }
}

/// A settle.lua record (or a plain acknowledgement: the model does not tell the two apart, the script applies
/// both the same way under the owner fence).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Record {
    pub op: Op,
    /// `None`: a default-mode record, which has no token and is never stale.
    pub token: Option<u8>,
    /// The claim whose list holds the token (the record's claim index names it; 0 in default mode). Only
    /// [`Mutation::SubtractCount`] reads it.
    pub claim: u8,
    pub level: u8,
    /// The payload: the envelope to queue (retry / recover / back), or the dead record's task and attempt.
    pub payload: Env,
    /// Ghost: a monitor's charge (retry_isolated or dead of a task its owner ran in a group of 1), for the
    /// fairness property.
    pub charged: bool,
}

/// settle.lua's ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Ack,
    /// A handler retry: to the retry zset (the policy's backoff is never zero).
    Retry,
    /// A crash while the task ran alone, charged: to the front of the level's `quarantine:1` (stage 1 in
    /// settle.lua's counting, index 0 here).
    RetryIsolated,
    /// An uncharged recovery, to the front of the ready list.
    Recover,
    /// An uncharged recovery, to the front of the quarantine list of this stage (index into [`GROUPS`]).
    RecoverIsolated(u8),
    Back,
    /// A handler's back-pressure: the envelope as it was taken to the front of its ready list (uncharged), and
    /// the queue's throttle key set. Only the owner's acker (or default mode's) sends it: a monitor never does.
    Throttle,
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

    /// HEXISTS of one token in `owner`'s processing hash at `level`.
    pub fn hexists(&self, owner: OwnerId, level: u8, token: u8) -> bool {
        self.processing
            .iter()
            .any(|p| p.owner == owner && p.level == level && p.token == token)
    }

    /// HDEL of one token (settle.lua's GETBIT = 0, then SETBIT): the entry, when it was there.
    fn hdel(&mut self, owner: OwnerId, level: u8, token: u8) -> Option<Processing> {
        let at = self
            .processing
            .iter()
            .position(|p| p.owner == owner && p.level == level && p.token == token)?;
        Some(self.processing.remove(at))
    }

    /// One position of the claim list (owner, level, claim), counted or not.
    fn hset(&mut self, owner: OwnerId, level: u8, token: u8, env: Env, claim: u8, counted: bool) {
        self.processing.push(Processing {
            owner,
            level,
            token,
            env,
            claim,
            counted,
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
    /// or 0 (the id is known and its lease ran out), and whether it wrote the lease now: true whenever it answers
    /// 1, since a retry for a live owner renews the lease from now, as renew.lua does (the fetcher counts its
    /// lease from when it sent the retry, which is before the retry ran). [`Mutation::RegisterRetryKeepsLease`]
    /// answers 1 to a retry and leaves the first call's deadline as it is (register.lua before that fix).
    pub fn register(
        &mut self,
        id: OwnerId,
        levels: Levels,
        mutation: Option<Mutation>,
    ) -> (bool, bool) {
        // local lease = ZSCORE owners id
        if let Some(owner) = self.owner_mut(id) {
            // if lease > now: ZADD owners now + lease id; return 1 (else: return 0)
            let live = owner.lease == Lease::Live;
            return (
                live,
                live && mutation != Some(Mutation::RegisterRetryKeepsLease),
            );
        }
        // (EXISTS info -> 0: the info hash never outlives the zset entry here, release.lua deletes both.)
        // ZADD owners now + lease id; HSET info ...
        self.owners.push(Owner {
            id,
            lease: Lease::Live,
            levels,
            floor: None,
            group: None,
            alone_at_expiry: None,
            crashed_by_orphan: false,
        });
        self.owners.sort_by_key(|owner| owner.id);
        (true, true)
    }

    /// claim.lua. With [`Mutation::GroupBesideOthers`], the quarantine rule before kmqd's bisecting one: a
    /// group is taken while the owner holds other tasks (unless it runs a group already), and ready tasks fill
    /// the rest of the claim beside it. Under a running limit (`max_running > 0`) it takes at most what
    /// `running` leaves (nothing, state 4, when that is none), adds what it took to `running`, and marks its
    /// lists counted (their scopes strings); [`Mutation::LimitAfterTaking`] takes up to `max` whatever the count
    /// and compares only afterwards, which decides nothing the model keeps (the answer's state).
    pub fn claim(&mut self, call: &ClaimCall, mutation: Option<Mutation>) -> Claimed {
        let claimed = self.take(call, mutation);
        // finish(): HINCRBY running q counted (the sum of record()'s n: one per task in the claim's lists)
        if call.max_running > 0 {
            self.running += claimed.tasks().len() as u8;
        }
        claimed
    }

    /// claim.lua up to its `finish`: the checks, and the tasks it moves into the claim's lists (each list's
    /// scopes string written with it, in `record`, when the call has a limit).
    fn take(&mut self, call: &ClaimCall, mutation: Option<Mutation>) -> Claimed {
        let ClaimCall {
            owner: id,
            first,
            mut max,
            levels,
            max_running,
        } = *call;
        let counted = max_running > 0;
        let old_rule = mutation == Some(Mutation::GroupBesideOthers);
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
        // (EXISTS of this claim's lists: FENCED "already made". A claim runs once here: never.)
        // EXISTS paused, throttle: paused -> state 3 (pausing is not modelled); throttle -> state 6.
        if self.throttle && mutation != Some(Mutation::ClaimIgnoresThrottle) {
            return Claimed::Throttled;
        }
        // if max_running > 0: running >= max_running -> state 4; max = min(max, max_running - running)
        if counted && mutation != Some(Mutation::LimitAfterTaking) {
            if self.running >= max_running {
                return Claimed::Limited;
            }
            max = max.min(max_running - self.running);
        }
        // holds: one of the owner's processing hashes (at these KEYS' levels) is not empty
        let holds = self
            .processing
            .iter()
            .any(|p| p.owner == id && levels.contains(p.level));
        // if info.group: holding -> state 2; else HDEL group
        let mut runs_group = false;
        if owner.group.is_some() {
            if holds {
                if !old_rule {
                    return Claimed::Waiting;
                }
                runs_group = true;
            } else if let Some(owner) = self.owner_mut(id) {
                owner.group = None;
            }
        }
        let mut took = List::new();
        // for stage = 1, 3 (groups of 1, 8, 64): for each level, the first non-empty quarantine list
        'stages: for (stage, &size) in GROUPS.iter().enumerate() {
            if runs_group {
                break;
            }
            for level in levels.iter() {
                let list = &mut self.quarantine[stage][level as usize];
                if list.is_empty() {
                    continue;
                }
                if holds && !old_rule {
                    return Claimed::Waiting;
                }
                // LPOP list min(GROUPS[stage], max); stored under the first tokens; HSET info group GROUPS[stage]
                let count = size.min(max) as usize;
                if count == 0 {
                    return Claimed::Took(took);
                }
                let count = count.min(list.len());
                let got: List<Env> = list.drain(..count).collect();
                for (k, env) in got.into_iter().enumerate() {
                    let token = first + k as u8;
                    self.hset(id, level, token, env, first, counted);
                    took.push((level, token, env));
                }
                if let Some(owner) = self.owner_mut(id) {
                    owner.group = Some(size);
                }
                if !old_rule {
                    return Claimed::Group(size, took);
                }
                break 'stages;
            }
        }
        // Then ready tasks, highest level first, LPOP up to max - taken, under the next tokens in order.
        let end = first + max;
        let mut next = first + took.len() as u8;
        for level in levels.iter() {
            while next < end && !self.ready[level as usize].is_empty() {
                let env = self.ready[level as usize].remove(0);
                self.hset(id, level, next, env, first, counted);
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

    /// settle.lua: applies `records` once per call (`call` of `settler`), fenced by each record's token. In
    /// default mode under a running limit (`Holder::Popped`), each task the call ends leaves the popping owner's
    /// share and `running`, never more than the share holds ([`Mutation::SettleAfterRelease`]: whatever it holds).
    pub fn settle(
        &mut self,
        settler: Settler,
        call: u8,
        fence: Fence,
        holder: Holder,
        records: &[Record],
        mutation: Option<Mutation>,
    ) -> SettleReply {
        let owner = holder.claimed();
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
        // GET of each touched claim's scopes string (before anything is written). Only
        // SubtractCount reads it here: it subtracts, per claim with one, the positions the call names for it.
        let mut freed = 0u8;
        if let (Some(Mutation::SubtractCount), Some(owner)) = (mutation, owner) {
            for (k, record) in records.iter().enumerate() {
                let Some(_) = record.token else { continue };
                let list = (record.level, record.claim);
                let first = records[..k]
                    .iter()
                    .all(|r| r.token.is_none() || (r.level, r.claim) != list);
                let scopes = self
                    .processing
                    .iter()
                    .any(|p| p.owner == owner && (p.level, p.claim) == list && p.counted);
                if first && scopes {
                    freed += records
                        .iter()
                        .filter(|r| r.token.is_some() && (r.level, r.claim) == list)
                        .count() as u8;
                }
            }
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
                (Some(token), Some(owner)) if live => match self.hdel(owner, record.level, token) {
                    // A bit this call newly sets: its task leaves `running` if its list has a scopes string.
                    Some(p) => {
                        let subtracts = match mutation {
                            Some(Mutation::SubtractUncounted) => true,
                            Some(Mutation::SubtractCount) => false,
                            _ => p.counted,
                        };
                        freed += u8::from(subtracts);
                        true
                    }
                    None => false,
                },
                (Some(_), _) => false,
            };
            if ok {
                unfair |= self.apply(record, owner, mutation);
            }
            applied.push(ok);
        }
        // Default mode: shared = HGET popped-running:OWNER q; ended = the plain acknowledgements and every
        // record (all apply: no token); if shared > 0 and ended > 0: n = min(ended, shared) leaves the share (HDEL
        // at 0) and is freed from q.
        if let Holder::Popped(popper) = holder {
            let ended = applied.iter().filter(|ok| **ok).count() as u8;
            let shared = self.share(popper);
            let n = if mutation == Some(Mutation::SettleAfterRelease) {
                ended
            } else {
                ended.min(shared)
            };
            self.set_share(popper, shared.saturating_sub(n));
            freed += n;
        }
        // for scope, n in pairs(freed): left = running[scope] - n, never below 0 (the rest counted in
        // running_underflow); HDEL at 0, else HSET
        if fence == Fence::Expired && mutation == Some(Mutation::MonitorSubtractsNothing) {
            freed = 0;
        }
        if freed > self.running {
            self.running_underflow = self.running_underflow.saturating_add(freed - self.running);
        }
        self.running = self.running.saturating_sub(freed);
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
    fn apply(&mut self, record: &Record, owner: Option<OwnerId>, mutation: Option<Mutation>) -> u8 {
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
            // retry_isolated: LPUSH to the quarantine list of stage "delay" (1: groups of 1); recover_isolated: of
            // the stage the policy chose.
            Op::RetryIsolated => self.quarantine[0][level].insert(0, payload),
            Op::RecoverIsolated(stage) => self.quarantine[stage as usize][level].insert(0, payload),
            Op::Recover | Op::Back => self.ready[level].insert(0, payload),
            // LPUSH to the ready list as it was taken; SET throttle PX delay (unless it lasts longer already: the
            // key's duration is not modelled). ThrottleCharges re-queues it charged.
            Op::Throttle => {
                let payload = if mutation == Some(Mutation::ThrottleCharges) {
                    Env {
                        attempt: payload.attempt + 1,
                        ..payload
                    }
                } else {
                    payload
                };
                self.ready[level].insert(0, payload);
                self.throttle = true;
            }
            Op::Dead => {
                self.dead.push(payload);
                self.dead.sort();
            }
        }
        unfair
    }

    /// renew.lua: pushes a live lease's deadline forward; an expired one is never renewed ("once an owner's lease
    /// has run out it never comes back"). Returns 1 (true) or 0. [`Mutation::RenewExpired`] renews it anyway.
    pub fn renew(&mut self, id: OwnerId, mutation: Option<Mutation>) -> bool {
        // local lease = ZSCORE owners owner; (none: put back as expired if registered; a registration never
        // outlives its lease entry here)
        let Some(owner) = self.owner_mut(id) else {
            return false;
        };
        // if lease <= now: return 0
        if owner.lease != Lease::Live && mutation != Some(Mutation::RenewExpired) {
            return false;
        }
        // ZADD owners now + lease owner
        owner.lease = Lease::Live;
        true
    }

    /// release.lua: forgets `id` if its processing hashes at `levels` (the KEYS the caller passed) are empty
    /// and, for a monitor (`expired`), its lease has run out, and gives its share of `running` back (default
    /// mode) in the same step, registered or not. Returns whether it was released (ZREM's answer), and the share
    /// it gave back. [`Mutation::ReleaseForgetsShare`] deletes the share without giving it back.
    pub fn release(
        &mut self,
        id: OwnerId,
        levels: Levels,
        expired: bool,
        mutation: Option<Mutation>,
    ) -> (bool, u8) {
        // for each claim set: EXISTS -> 0
        if self
            .processing
            .iter()
            .any(|p| p.owner == id && levels.contains(p.level))
        {
            return (false, 0);
        }
        // "expired": lease = ZSCORE owners id; lease > now -> 0 (no entry: on, as for a forgotten owner)
        if expired && self.is_live(id) {
            return (false, 0);
        }
        // HGETALL popped-running; per scope: running = max(0, running - mine), HDEL at 0; DEL info, popped-running
        let mine = self.share(id);
        if mutation != Some(Mutation::ReleaseForgetsShare) {
            self.running = self.running.saturating_sub(mine);
        }
        self.set_share(id, 0);
        // ZREM owners id
        let before = self.owners.len();
        self.owners.retain(|owner| owner.id != id);
        (self.owners.len() < before, mine)
    }

    /// HGET popped-running:OWNER q (absent: 0).
    pub fn share(&self, owner: OwnerId) -> u8 {
        self.popped_running
            .iter()
            .find(|(who, _)| *who == owner)
            .map_or(0, |(_, n)| *n)
    }

    /// HSET popped-running:OWNER q n (HDEL at 0: the hash goes).
    fn set_share(&mut self, owner: OwnerId, n: u8) {
        self.popped_running.retain(|(who, _)| *who != owner);
        if n > 0 {
            self.popped_running.push((owner, n));
            self.popped_running.sort();
        }
    }

    /// promote.lua, for one due retry: ZREM it and LPUSH it to the front of its ready list.
    pub fn promote(&mut self, level: u8, index: usize) {
        let env = self.retry[level as usize].remove(index);
        self.ready[level as usize].insert(0, env);
    }

    /// pop.lua (default mode): LMPOP over, per level (highest first), the quarantine lists (groups of 1, 8, 64)
    /// then the ready list, in the order `broker::Popper` passes them (`pop_lists`): up to `max` from the first
    /// non-empty list. Groups mean nothing here: a pop takes up to `max` of a quarantine list, like any other.
    /// Nothing while the queue's throttle key exists (pop.lua and `Popper`'s plain pop check it first).
    /// While the queue holds no unique id and has no limit, `Popper` pops the same lists with a plain LMPOP in
    /// MULTI after WATCH of the unique hash instead; without unique ids (not modelled) the two are the same step.
    /// [`Mutation::PopReadyOnly`] passes the ready lists alone.
    ///
    /// It refuses an owner without a live lease (LEASELOST, before it writes anything; not with
    /// [`Mutation::PopWithoutLeaseCheck`]): kmqd's pop.lua for any owner, the model's only under a running limit,
    /// the only pops with an owner here. Under a running limit (`max_running > 0`) it takes at most what `running`
    /// leaves (nothing, state 4, when that is none; [`Mutation::LimitAfterTaking`] takes up to `max` whatever the
    /// count), and adds what it took to `running` and to the owner's share (`popped-running:OWNER`).
    pub fn pop(&mut self, call: &PopCall, mutation: Option<Mutation>) -> Popped {
        let PopCall {
            owner,
            mut max,
            levels,
            max_running,
        } = *call;
        let counted = max_running > 0;
        // Under a limit: local lease = ZSCORE owners owner; not lease or lease <= now: LEASELOST
        let checked = counted && mutation != Some(Mutation::PopWithoutLeaseCheck);
        if owner.is_some_and(|owner| checked && !self.is_live(owner)) {
            return Popped::LeaseLost;
        }
        // EXISTS paused, throttle (pop.lua; Popper checks the same before its plain LMPOP): nothing.
        if self.throttle {
            return Popped::Throttled;
        }
        // if max_running > 0: running >= max_running -> state 4; max = min(max, max_running - running)
        if counted && mutation != Some(Mutation::LimitAfterTaking) {
            if self.running >= max_running {
                return Popped::Limited;
            }
            max = max.min(max_running - self.running);
        }
        let quarantine = mutation != Some(Mutation::PopReadyOnly);
        let mut took = List::new();
        'levels: for level in levels.iter() {
            let l = level as usize;
            let [q1, q8, q64] = &mut self.quarantine;
            let lists: [&mut List<Env>; 4] =
                [&mut q1[l], &mut q8[l], &mut q64[l], &mut self.ready[l]];
            for (index, list) in lists.into_iter().enumerate() {
                if index < 3 && !quarantine {
                    continue;
                }
                if !list.is_empty() {
                    let n = list.len().min(max as usize);
                    took = list.drain(..n).map(|env| (level, env)).collect();
                    break 'levels;
                }
            }
        }
        // HINCRBY running q #items; HINCRBY popped-running:OWNER q #items
        if let Some(owner) = owner.filter(|_| counted && !took.is_empty()) {
            let n = took.len() as u8;
            self.running += n;
            let share = self.share(owner);
            self.set_share(owner, share + n);
        }
        Popped::Took(took)
    }

    /// The throttle key expires (time passes): claims and pops take tasks again.
    pub fn throttle_ends(&mut self) {
        self.throttle = false;
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
            owner.alone_at_expiry = alone.filter(|_| !owner.crashed_by_orphan);
        }
    }

    /// Ghost: `id`'s daemon was crashed by a handler of a task `id` does not hold.
    pub fn crashed_by_orphan(&mut self, id: OwnerId) {
        if let Some(owner) = self.owner_mut(id) {
            owner.crashed_by_orphan = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Daemon 0's acker, in its first run.
    const OWNER_SETTLER: Settler = Settler {
        daemon: 0,
        run: 0,
        monitor: false,
    };

    const OWNER: OwnerId = OwnerId {
        daemon: 0,
        run: 0,
        generation: 1,
    };

    fn registered() -> Redis {
        let mut redis = Redis::default();
        assert_eq!(redis.register(OWNER, Levels::BOTH, None), (true, true));
        // A retry after a lost reply: registered, and the lease renewed from now.
        assert_eq!(redis.register(OWNER, Levels::BOTH, None), (true, true));
        redis
    }

    fn call(first: u8, max: u8) -> ClaimCall {
        ClaimCall {
            owner: OWNER,
            first,
            max,
            levels: Levels::BOTH,
            max_running: 0,
        }
    }

    /// A pop without a limit, as a daemon whose config has none makes it.
    fn plain(max: u8) -> PopCall {
        PopCall {
            owner: None,
            max,
            levels: Levels::BOTH,
            max_running: 0,
        }
    }

    fn order(claimed: &Claimed) -> Vec<(u8, u8, u8)> {
        claimed
            .tasks()
            .iter()
            .map(|(l, t, e)| (*l, *t, e.task))
            .collect()
    }

    #[test]
    fn a_registration_sent_again_renews_a_live_lease_and_is_refused_once_it_ran_out() {
        let mut redis = registered();
        let keeps = Some(Mutation::RegisterRetryKeepsLease);
        // register.lua before the fix: 1, the first call's deadline left as it is.
        assert_eq!(redis.register(OWNER, Levels::BOTH, keeps), (true, false));
        redis.expire(OWNER);
        assert_eq!(redis.register(OWNER, Levels::BOTH, None), (false, false));
        assert_eq!(redis.owner(OWNER).unwrap().lease, Lease::Expired);
    }

    #[test]
    fn a_claim_takes_a_quarantined_group_alone_and_nothing_more_until_it_is_settled() {
        let mut redis = registered();
        redis.push(1, Env::new(0));
        redis.push(0, Env::new(1));
        // A group of 8 at the low level, and one of 64 at the high level: the smaller group first.
        redis.quarantine[1][1].push(Env::new(2));
        redis.quarantine[2][0].push(Env::new(3));
        let claimed = redis.claim(&call(0, 3), None);
        assert!(matches!(claimed, Claimed::Group(8, _)), "{claimed:?}");
        assert_eq!(order(&claimed), [(1, 0, 2)]);
        assert_eq!(redis.owner(OWNER).unwrap().group, Some(8));
        // While it holds the group, it claims nothing, not even from the ready lists.
        assert_eq!(redis.claim(&call(3, 3), None), Claimed::Waiting);
        // Settled: the next claim takes the next group (min(64, max) tasks), again alone.
        let settler = OWNER_SETTLER;
        let ack = Record {
            op: Op::Ack,
            token: Some(0),
            claim: 0,
            level: 1,
            payload: Env::new(2),
            charged: false,
        };
        redis.settle(
            settler,
            1,
            Fence::Owner,
            Holder::Claimed(OWNER),
            &[ack],
            None,
        );
        redis.quarantine[2][0].push(Env::new(4));
        let claimed = redis.claim(&call(6, 1), None);
        assert_eq!(order(&claimed), [(0, 6, 3)]);
        assert_eq!(redis.owner(OWNER).unwrap().group, Some(64));
        // Holding tasks while quarantined ones wait: nothing.
        assert_eq!(redis.claim(&call(7, 3), None), Claimed::Waiting);
    }

    #[test]
    fn a_claim_takes_ready_tasks_highest_level_first_when_nothing_is_quarantined() {
        let mut redis = registered();
        redis.push(1, Env::new(0));
        redis.push(0, Env::new(1));
        let claimed = redis.claim(&call(0, 3), None);
        assert_eq!(order(&claimed), [(0, 0, 1), (1, 1, 0)]);
        assert_eq!(redis.owner(OWNER).unwrap().group, None);
        // A claim while it holds them, with a task quarantined meanwhile: it must settle first.
        redis.quarantine[0][0].push(Env::new(2));
        assert_eq!(redis.claim(&call(3, 3), None), Claimed::Waiting);
    }

    #[test]
    fn the_old_rule_claims_a_group_beside_ready_tasks_and_beside_what_the_owner_holds() {
        let old = Some(Mutation::GroupBesideOthers);
        let mut redis = registered();
        redis.push(0, Env::new(0));
        let claimed = redis.claim(&call(0, 1), old);
        assert_eq!(order(&claimed), [(0, 0, 0)]);
        redis.quarantine[0][0].push(Env::new(1));
        redis.quarantine[0][0].push(Env::new(2));
        redis.push(0, Env::new(3));
        let claimed = redis.claim(&call(1, 3), old);
        assert_eq!(order(&claimed), [(0, 1, 1), (0, 2, 3)]);
        assert_eq!(redis.owner(OWNER).unwrap().group, Some(1));
        // Running a group, it takes no other group, but ready tasks still.
        redis.push(0, Env::new(4));
        let claimed = redis.claim(&call(4, 3), old);
        assert_eq!(order(&claimed), [(0, 4, 4)]);
    }

    #[test]
    fn a_limited_claim_takes_what_running_leaves_and_a_settle_subtracts_only_counted_lists() {
        let mut redis = registered();
        for task in 0..3 {
            redis.push(0, Env::new(task));
        }
        let limited = |first, max| ClaimCall {
            max_running: 1,
            ..call(first, max)
        };
        // max_running = 1: one of the two asked for, counted; then state 4.
        let claimed = redis.claim(&limited(0, 2), None);
        assert_eq!(order(&claimed), [(0, 0, 0)]);
        assert_eq!(redis.running, 1);
        assert_eq!(redis.claim(&limited(2, 2), None), Claimed::Limited);
        // Without a limit (a daemon whose config has none): taken, not counted.
        let claimed = redis.claim(&call(4, 1), None);
        assert_eq!(order(&claimed), [(0, 4, 1)]);
        assert_eq!(redis.running, 1);
        // The limit checked only after taking: over it.
        let mut over = redis.clone();
        over.claim(&limited(6, 2), Some(Mutation::LimitAfterTaking));
        assert_eq!(over.running, 2);
        let (settler, holder) = (OWNER_SETTLER, Holder::Claimed(OWNER));
        let ack = |token, claim, task| Record {
            op: Op::Ack,
            token: Some(token),
            claim,
            level: 0,
            payload: Env::new(task),
            charged: false,
        };
        // The uncounted list's ack subtracts nothing (with SubtractUncounted, it does).
        let mut wrong = redis.clone();
        redis.settle(settler, 1, Fence::Owner, holder, &[ack(4, 4, 1)], None);
        assert_eq!(redis.running, 1);
        let mutation = Some(Mutation::SubtractUncounted);
        wrong.settle(settler, 1, Fence::Owner, holder, &[ack(4, 4, 1)], mutation);
        assert_eq!(wrong.running, 0);
        // The counted one's does, once: sent again as a new call, its bit is set already.
        redis.settle(settler, 2, Fence::Owner, holder, &[ack(0, 0, 0)], None);
        assert_eq!((redis.running, redis.running_underflow), (0, 0));
        redis.settle(settler, 3, Fence::Owner, holder, &[ack(0, 0, 0)], None);
        assert_eq!((redis.running, redis.running_underflow), (0, 0));
    }

    #[test]
    fn a_limited_pop_counts_under_its_owner_whose_settles_and_release_give_the_share_back_once() {
        let mut redis = registered();
        for task in 0..3 {
            redis.push(0, Env::new(task));
        }
        let pop = |max| PopCall {
            owner: Some(OWNER),
            max,
            levels: Levels::BOTH,
            max_running: 2,
        };
        // Two of the three asked for, counted in `q` and in the owner's share; then state 4.
        assert_eq!(redis.pop(&pop(3), None).tasks().len(), 2);
        assert_eq!((redis.running, redis.share(OWNER)), (2, 2));
        assert_eq!(redis.pop(&pop(1), None), Popped::Limited);
        let ack = |task| Record {
            op: Op::Ack,
            token: None,
            claim: 0,
            level: 0,
            payload: Env::new(task),
            charged: false,
        };
        // One settled: one slot back, from both.
        let holder = Holder::Popped(OWNER);
        redis.settle(OWNER_SETTLER, 1, Fence::Owner, holder, &[ack(0)], None);
        assert_eq!((redis.running, redis.share(OWNER)), (1, 1));
        // The owner's lease runs out: a monitor's release gives the rest back, and forgets the owner.
        redis.expire(OWNER);
        assert_eq!(redis.release(OWNER, Levels::BOTH, true, None), (true, 1));
        assert_eq!((redis.running, redis.popped_running.len()), (0, 0));
        // Its late settle finds no share: nothing subtracted (with SettleAfterRelease, an underflow).
        let mut twice = redis.clone();
        redis.settle(OWNER_SETTLER, 2, Fence::Owner, holder, &[ack(1)], None);
        assert_eq!((redis.running, redis.running_underflow), (0, 0));
        let mutation = Some(Mutation::SettleAfterRelease);
        twice.settle(OWNER_SETTLER, 2, Fence::Owner, holder, &[ack(1)], mutation);
        assert_eq!(twice.running_underflow, 1);
        // A pop under the forgotten owner is refused, and counts nothing (without the check: a share for ever).
        assert_eq!(redis.pop(&pop(1), None), Popped::LeaseLost);
        let unchecked = Some(Mutation::PopWithoutLeaseCheck);
        assert_eq!(redis.pop(&pop(1), unchecked).tasks().len(), 1);
        assert_eq!((redis.running, redis.share(OWNER)), (1, 1));
        assert!(redis.owner(OWNER).is_none());
    }

    #[test]
    fn a_pop_takes_the_quarantine_lists_before_the_ready_list_of_each_level() {
        let mut redis = Redis::default();
        redis.push(0, Env::new(0));
        redis.quarantine[2][0].push(Env::new(1));
        redis.quarantine[0][1].push(Env::new(2));
        redis.quarantine[0][0].push(Env::new(3));
        redis.quarantine[0][0].push(Env::new(4));
        let tasks =
            |popped: Vec<(u8, Env)>| -> Vec<u8> { popped.iter().map(|(_, e)| e.task).collect() };
        assert_eq!(tasks(redis.pop(&plain(3), None).tasks().to_vec()), [3, 4]);
        assert_eq!(tasks(redis.pop(&plain(3), None).tasks().to_vec()), [1]);
        assert_eq!(tasks(redis.pop(&plain(3), None).tasks().to_vec()), [0]);
        assert_eq!(tasks(redis.pop(&plain(3), None).tasks().to_vec()), [2]);
        assert!(redis.pop(&plain(3), None).tasks().is_empty());
    }

    #[test]
    fn a_throttle_requeues_the_task_as_taken_and_holds_claims_and_pops_until_it_ends() {
        let mut redis = registered();
        let taken = Env {
            recovered: 1,
            ..Env::new(0)
        };
        redis.push(0, taken);
        redis.push(0, Env::new(1));
        assert_eq!(order(&redis.claim(&call(0, 1), None)), [(0, 0, 0)]);
        let settler = OWNER_SETTLER;
        let throttle = Record {
            op: Op::Throttle,
            token: Some(0),
            claim: 0,
            level: 0,
            payload: taken,
            charged: false,
        };
        let mut charged = redis.clone();
        redis.settle(
            settler,
            1,
            Fence::Owner,
            Holder::Claimed(OWNER),
            &[throttle],
            None,
        );
        assert_eq!(redis.ready[0].as_slice(), [taken, Env::new(1)]);
        assert!(redis.throttle);
        // ThrottleCharges: the same settle re-queues it with attempt + 1.
        let mutation = Some(Mutation::ThrottleCharges);
        charged.settle(
            settler,
            1,
            Fence::Owner,
            Holder::Claimed(OWNER),
            &[throttle],
            mutation,
        );
        assert_eq!(charged.ready[0][0].attempt, 1);
        // State 6 after the floor check, as claim.lua; pops take nothing either.
        assert_eq!(redis.claim(&call(1, 2), None), Claimed::Throttled);
        let ignores = Some(Mutation::ClaimIgnoresThrottle);
        assert_eq!(redis.clone().claim(&call(1, 2), ignores).tasks().len(), 2);
        assert!(redis.pop(&plain(2), None).tasks().is_empty());
        redis.adopt(OWNER, 1, 2, Levels::BOTH);
        assert_eq!(redis.claim(&call(1, 2), None), Claimed::Fenced);
        redis.throttle_ends();
        assert_eq!(
            order(&redis.claim(&call(3, 2), None)),
            [(0, 3, 0), (0, 4, 1)]
        );
    }

    #[test]
    fn the_quarantine_stage_follows_keys_rs() {
        let stages: Vec<Option<u8>> = (1..=5).map(quarantine_stage).collect();
        assert_eq!(stages, [None, Some(2), Some(1), Some(0), Some(0)]);
        assert_eq!(GROUPS, [1, 8, 64]);
    }

    #[test]
    fn adopt_raises_the_floor_so_the_lost_claim_is_fenced_if_it_runs_later() {
        let mut redis = registered();
        redis.push(0, Env::new(0));
        assert_eq!(
            redis.adopt(OWNER, 0, 2, Levels::BOTH).map(|t| t.len()),
            Some(0)
        );
        assert_eq!(redis.claim(&call(0, 2), None), Claimed::Fenced);
        assert_eq!(
            redis.claim(&call(0, 2), Some(Mutation::NoFloorCheck)),
            Claimed::Took([(0, 0, Env::new(0))].into_iter().collect())
        );
        redis.expire(OWNER);
        assert_eq!(redis.claim(&call(2, 2), None), Claimed::LeaseLost);
    }

    #[test]
    fn a_settle_call_sent_again_is_answered_from_its_record() {
        let mut redis = Redis::default();
        let settler = OWNER_SETTLER;
        let ack = Record {
            op: Op::Ack,
            token: None,
            claim: 0,
            level: 0,
            payload: Env::new(0),
            charged: false,
        };
        let first = redis.settle(settler, 1, Fence::Owner, Holder::Nobody, &[ack], None);
        let again = redis.settle(settler, 1, Fence::Owner, Holder::Nobody, &[ack], None);
        assert_eq!(
            (first.applied, again.answered_from_record),
            (vec![true], true)
        );
        assert_eq!(redis.done[0], 1);
        let mutation = Some(Mutation::NoIdempotentSettle);
        redis.settle(settler, 1, Fence::Owner, Holder::Nobody, &[ack], mutation);
        assert_eq!(redis.done[0], 2, "without the record, applied twice");
    }

    #[test]
    fn a_monitor_settles_only_expired_owners_and_releases_only_empty_ones() {
        let mut redis = registered();
        redis.push(1, Env::new(0));
        redis.claim(&call(0, 1), None);
        let settler = Settler {
            daemon: 1,
            run: 0,
            monitor: true,
        };
        let holder = Holder::Claimed(OWNER);
        let recover = Record {
            op: Op::Recover,
            token: Some(0),
            claim: 0,
            level: 1,
            payload: Env::new(0),
            charged: false,
        };
        let live = redis.settle(settler, 1, Fence::Expired, holder, &[recover], None);
        assert_eq!(live.applied, [false], "the lease is live: nothing applies");
        redis.expire(OWNER);
        assert!(
            !redis.release(OWNER, Levels::BOTH, true, None).0,
            "it still holds a task"
        );
        let expired = redis.settle(settler, 2, Fence::Expired, holder, &[recover], None);
        assert_eq!(expired.applied, [true]);
        assert_eq!(redis.ready[1].as_slice(), [Env::new(0)]);
        assert!(redis.release(OWNER, Levels::BOTH, true, None).0);
    }
}
