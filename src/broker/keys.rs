//! Every Redis key name kmqd uses is built here (docs/PROTOCOL.md, "Key layout").
//!
//! All keys of a queue carry the queue name as a hash tag, `PREFIX:{QUEUE}:...`, so every script touches one
//! Redis Cluster slot.

use crate::config::QueueConfig;

/// The group sizes of the quarantine, most suspect first: a task recovered from an expired lease for the second
/// time runs in a group of 64 (and nothing else), the third time in a group of 8, from then on alone, and only a
/// crash while it runs alone is charged to it.
pub const QUARANTINE_GROUPS: [usize; 3] = [1, 8, 64];

/// The stage (index into [`QUARANTINE_GROUPS`]) of a task recovered `recovered` times, uncharged; `None` for the
/// first recovery, which goes back to the front of the ready list.
pub fn quarantine_stage(recovered: u32) -> Option<usize> {
    match recovered {
        0 | 1 => None,
        2 => Some(2),
        3 => Some(1),
        _ => Some(0),
    }
}

/// A name as it is written inside a key or a scope: `%`, `:`, `{`, `}`, bytes up to the space and DEL
/// percent-encoded, so that it cannot end a key's part early, change its hash tag or split a scopes line.
pub fn encode_name(name: &str) -> String {
    let mut bytes = Vec::with_capacity(name.len());
    for byte in name.bytes() {
        if matches!(byte, b'%' | b':' | b'{' | b'}' | 0..=0x20 | 0x7f) {
            bytes.extend_from_slice(format!("%{byte:02X}").as_bytes());
        } else {
            bytes.push(byte);
        }
    }
    // Only ASCII bytes were replaced, by ASCII: the rest is the name's own UTF-8, byte for byte.
    String::from_utf8(bytes).expect("ASCII escapes keep UTF-8 valid")
}

/// The inverse of [`encode_name`] (a reader's view of a flow); `None` for a text no encoding made.
pub fn decode_name(text: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&byte, tail)) = rest.split_first() {
        if byte == b'%' {
            let hex = std::str::from_utf8(tail.get(..2)?).ok()?;
            bytes.push(u8::from_str_radix(hex, 16).ok()?);
            rest = &tail[2..];
        } else {
            bytes.push(byte);
            rest = tail;
        }
    }
    String::from_utf8(bytes).ok()
}

/// The running scope of a limited task type: `t:TYPE`, encoded ([`encode_name`]).
pub fn type_scope(kind: &str) -> String {
    format!("t:{}", encode_name(kind))
}

/// A flow's member in its ring, and the end of its list's key: `GROUP:TYPE`, each encoded; a flow of a type has
/// no group (tasks without one), so `:TYPE`.
pub fn flow_member(kind: &str) -> String {
    format!(":{}", encode_name(kind))
}

/// The limited type of a ring member: `:TYPE` ([`flow_member`]) or, beside groups, `GROUP:TYPE`; `None` for a
/// group's flow of the unlimited types (`GROUP:`) or a member this version does not make.
pub fn member_type(member: &str) -> Option<String> {
    let (_, kind) = member.split_once(':')?;
    decode_name(kind).filter(|kind| !kind.is_empty())
}

/// The running scope of a group: `g:GROUP`, encoded ([`encode_name`]); groups.lua builds the same.
pub fn group_scope(group: &str) -> String {
    format!("g:{}", encode_name(group))
}

/// A group's flow member in its ring: `GROUP:` (no type), encoded; tasks without a group: `:`.
pub fn group_member(group: &str) -> String {
    format!("{}:", encode_name(group))
}

/// The group of a ring member ([`group_member`], or `GROUP:TYPE` for its tasks of a limited type beside type
/// limits), or `None` for a member of a type's flow without groups (`:TYPE`) or one this version does not make.
pub fn member_group(member: &str) -> Option<String> {
    let (group, kind) = member.split_once(':')?;
    if group.is_empty() && !kind.is_empty() {
        return None;
    }
    decode_name(group)
}

/// A group flow's score bands in its ring (groups.lua): below `TIMED` a pass, from `TIMED` the ms a throttled or
/// rate-limited group may go on (plus `TIMED`), from `PARKED` a paused or full group's (plus the ms it parked).
pub const GROUP_TIMED: f64 = 1e15;
pub const GROUP_PARKED: f64 = 2e15;

/// The keys (and the one pub/sub channel) of one queue.
#[derive(Clone, Debug)]
pub struct QueueKeys {
    /// `PREFIX:{QUEUE}`, the start of every key.
    base: String,
    /// The priority levels, highest first (level keys are named after them).
    pub levels: Vec<String>,
    /// Ready lists, one per priority level, highest first.
    pub ready: Vec<String>,
    /// Delayed tasks per level: zset task id -> due ms; they go to the back of the ready list when due.
    pub delayed: Vec<String>,
    /// The envelopes of delayed tasks: hash task id -> envelope. Keyed by id so that the delay-queue operations
    /// (exists, cancel, remaining delay) cost O(log n), not a scan.
    pub delayed_tasks: String,
    /// Retries waiting out their backoff per level: zset envelope -> due ms; they go to the front when due.
    pub retry: Vec<String>,
    /// Tasks recovered more than once from an expired lease, waiting to run in isolation: one list per group size
    /// of [`QUARANTINE_GROUPS`] and level (`quarantine_list`), stage-major. A claim takes one group from the most
    /// suspect non-empty list and nothing else, and its owner claims nothing more until the group is settled
    /// (`claim.lua`): a crash meanwhile is the group's, and its tasks come back in smaller groups, until a task
    /// that crashes its daemon running alone is charged for it. How a poison pill is found without taking the
    /// tasks claimed alongside it down with it.
    pub quarantine: Vec<String>,
    /// Safe mode: zset owner -> lease deadline ms. An owner is one daemon's claim identity on this queue; the
    /// tasks it claimed live in its claim lists, listed in its [`QueueKeys::processing`] sets, and stay its own while its lease is renewed.
    pub owners: String,
    /// Dead-letter list of JSON records, newest first, bounded by `dead_max`.
    pub dead: String,
    /// Hash unique id -> ms it was taken, for unique tasks that are delayed, ready or processing.
    pub unique: String,
    /// Default mode: hash unique id -> the owner that popped the task, for unique tasks taken from Redis and not yet
    /// settled (a monitor releases the ids of an owner that died with them).
    pub unique_popped: String,
    /// Default mode: the list a plain pop takes its tasks into and reads back, in one transaction (take.lua):
    /// empty outside it.
    pub taking: String,
    /// Hash of counters: pushed, done, retried, recovered, failed, dead_lettered, cancelled, requeued,
    /// purged.
    pub stats: String,
    /// Wake-up markers for idle fetchers (at most one element).
    pub wake: String,
    /// Hash scope -> how many of the queue's tasks were taken under that scope's running limit and are not yet
    /// settled (`q`: the queue's `max_running`): claim.lua adds what it takes, settle.lua subtracts what it
    /// settles, each in the step that moves the tasks (see [`QueueKeys::claim_scopes`]).
    pub running: String,
    /// String whose existence pauses the queue (`kmqd queue pause`): claims and pops take nothing while it
    /// exists (claim.lua, pop.lua and the plain pop check it in the same atomic step as the take), pushes and
    /// promotions go on. Its value (the ms it was paused, by the pauser's clock) is only informational.
    pub paused: String,
    /// Hash of the priority levels' turns (`priority_weights`): `cur:N` is level N's credit in turns.lua's
    /// smooth weighted round-robin, shared by every daemon's claims and pops.
    pub sched: String,
    /// String whose existence throttles the queue: a handler answered back-pressure (`Outcome::Throttle`, a
    /// 429 upstream), and settle.lua set it to the ms it ends (Redis's clock), expiring then (`PX`). Claims and
    /// pops take nothing while it exists (checked in the take's atomic step, as the paused key), and sleep until
    /// its end.
    pub throttle: String,
    /// Periodic tasks: hash schedule name -> the last slot fired (ms).
    pub schedules: String,
    /// Hash with the protocol version of the queue's keys.
    pub meta: String,
    /// The dashboard's charts: zset minute -> a sample of the counters and depths (JSON), the last hour's
    /// (history.rs).
    pub history: String,
    /// Pub/sub channel that tells delay pollers a task became due sooner than they planned.
    pub delay_channel: String,
    /// The queue's `source_lists`: lists under the producers' own names, not kmqd's (no prefix, no hash tag of
    /// kmqd's making; on a cluster the config checked they are in the queue's slot), whose tasks the source
    /// mover moves into the queue. Empty for keys made without a queue's config.
    pub sources: Vec<String>,
    /// For each of [`QueueKeys::sources`], the index of the level its tasks join.
    pub source_levels: Vec<usize>,
    /// The queue has `[queues.groups]`: its settles name its rings and sched hash, through which settle.lua moves
    /// a group's parked flows back when it frees one of the group's slots (groups.lua). Other queues' settles do
    /// not: a settle's keys are what Redis holds its arguments with, and the lighter the better under memory
    /// pressure (`budgets::a_recovery_redis_refuses_is_left_for_a_later_pass_and_the_others_go`).
    pub grouped: bool,
}

impl QueueKeys {
    /// The keys of `queue` under `prefix`.
    pub fn new(prefix: &str, queue: &str, levels: &[String]) -> QueueKeys {
        let base = format!("{prefix}:{{{queue}}}");
        let per_level = |kind: &str| {
            levels
                .iter()
                .map(|level| format!("{base}:{kind}:{level}"))
                .collect()
        };
        QueueKeys {
            levels: levels.to_vec(),
            ready: per_level("ready"),
            delayed: per_level("delayed"),
            delayed_tasks: format!("{base}:delayed-tasks"),
            retry: per_level("retry"),
            quarantine: QUARANTINE_GROUPS
                .iter()
                .flat_map(|size| {
                    let base = &base;
                    levels
                        .iter()
                        .map(move |level| format!("{base}:quarantine:{size}:{level}"))
                })
                .collect(),
            owners: format!("{base}:owners"),
            dead: format!("{base}:dead"),
            unique: format!("{base}:unique"),
            unique_popped: format!("{base}:unique-popped"),
            taking: format!("{base}:taking"),
            stats: format!("{base}:stats"),
            wake: format!("{base}:wake"),
            running: format!("{base}:running"),
            paused: format!("{base}:paused"),
            throttle: format!("{base}:throttle:q"),
            sched: format!("{base}:sched"),
            schedules: format!("{base}:schedules"),
            meta: format!("{base}:meta"),
            history: format!("{base}:history"),
            delay_channel: format!("{base}:delay-wake"),
            sources: Vec::new(),
            source_levels: Vec::new(),
            grouped: false,
            base,
        }
    }

    /// The same queue's keys for other priority levels (an owner registered with levels this daemon does not
    /// serve: a rolling config change).
    pub fn with_levels(&self, levels: &[String]) -> QueueKeys {
        let (prefix, queue) = self.prefix_and_queue();
        QueueKeys {
            grouped: self.grouped,
            ..QueueKeys::new(prefix, queue, levels)
        }
    }

    /// The prefix and queue name `base` was made of.
    fn prefix_and_queue(&self) -> (&str, &str) {
        // `base` is `PREFIX:{QUEUE}`; neither part contains a brace (config validation).
        let open = self.base.find(":{").expect("base has a hash tag");
        (
            &self.base[..open],
            &self.base[open + 2..self.base.len() - 1],
        )
    }

    /// The index of a queue's result buckets (`keep_results`): a sorted set of each bucket's START, scored by
    /// when the bucket expires (ms on Redis's clock), so that a reader finds the few buckets there are without
    /// knowing the queue's config (results.lua; docs/PROTOCOL.md, "Results").
    pub fn results_index(&self) -> String {
        format!("{}:results", self.base)
    }

    /// A bucket of a queue's kept results: a hash of task id -> the JSON object the settle that ended the task
    /// wrote, for the tasks that ended in one stretch of time from `start` (ms since the epoch, on the settling
    /// daemon's clock; results.lua). The ids are fields, so any id is fine, and the key is in the queue's slot.
    pub fn results_bucket(&self, start: u64) -> String {
        format!("{}:results:{start}", self.base)
    }

    /// Another queue's keys under the same prefix, without levels: a waiting task of a flow in a queue this
    /// process may not serve (the mover of an outbox names its waiters' keys so: docs/design/flows.md).
    pub fn other_queue(&self, queue: &str) -> QueueKeys {
        QueueKeys::new(self.prefix_and_queue().0, queue, &[])
    }

    /// A waiting task of a flow (docs/design/flows.md, "1. Keys"): a hash, its envelope and state, until it is
    /// released or failed, then what `flow show` reads, with an expiry. The id is written as it is, as a result's
    /// field in [`QueueKeys::results_bucket`] is.
    pub fn deps(&self, id: &str) -> String {
        format!("{}:deps:{id}", self.base)
    }

    /// The outcomes of a waiting task's dependencies that ended: a hash, `QUEUE\nID` -> the outcome object.
    pub fn deps_ended(&self, id: &str) -> String {
        format!("{}:deps-ended:{id}", self.base)
    }

    /// The run of each dependency a waiting task has heard of: a hash, `QUEUE\nID` -> the highest run number
    /// (a dependency's run rises with each `dead requeue`), so that a note of an older run is told from a newer
    /// one after the older's record was withdrawn. Written only once a dependency was requeued.
    pub fn deps_run(&self, id: &str) -> String {
        format!("{}:deps-run:{id}", self.base)
    }

    /// The queue's waiting tasks: a hash, id -> ms written (`kmqd stats`' WAITING is its length). Named with a
    /// dash, as the outbox is, so that no task's id names it (`deps:ID` is a task's).
    pub fn deps_waiting(&self) -> String {
        format!("{}:deps-waiting", self.base)
    }

    /// The hold of a `unique_for` id after its task ended: a string `END:MS` expiring MS after END. The scripts
    /// build it from the unique hash's name (unique_hold.lua); here for the ACL checks and the tests' readers.
    pub fn unique_held(&self, id: &str) -> String {
        format!("{}:held:{id}", self.unique)
    }

    /// The queue's outbox: a list of notes to waiting tasks (any queue's), oldest first.
    pub fn deps_outbox(&self) -> String {
        format!("{}:deps-outbox", self.base)
    }

    /// The queue's name, as its keys carry it.
    pub fn queue_name(&self) -> &str {
        self.prefix_and_queue().1
    }

    /// `PREFIX:{QUEUE}`, the start of every key of the queue.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The keys of a configured queue.
    pub fn for_queue(prefix: &str, queue: &QueueConfig) -> QueueKeys {
        QueueKeys {
            sources: queue.source_lists.iter().map(|s| s.key.clone()).collect(),
            source_levels: queue.source_lists.iter().map(|s| s.level).collect(),
            grouped: queue.groups.is_some(),
            ..QueueKeys::new(prefix, &queue.name, &queue.priorities)
        }
    }

    /// The quarantine list of group size `QUARANTINE_GROUPS[stage]` at `level`.
    pub fn quarantine_list(&self, stage: usize, level: usize) -> &str {
        &self.quarantine[stage * self.levels() + level]
    }

    /// Number of priority levels.
    pub fn levels(&self) -> usize {
        self.ready.len()
    }

    /// Safe mode: the claims `owner` holds tasks of at one level, a zset claim -> how many of its tasks are not
    /// yet settled (claim.lua, settle.lua); a hash token -> envelope for an owner registered by kmqd 0.1.
    pub fn processing(&self, owner: &str, level: usize) -> String {
        format!("{}:processing:{owner}:{}", self.base, self.levels[level])
    }

    /// Safe mode: the tasks one claim of `owner` took from one level, in the order they were taken (a task's
    /// token is its position here).
    pub fn claim_list(&self, owner: &str, level: usize, claim: u64) -> String {
        format!("{}:{claim}", self.processing(owner, level))
    }

    /// Safe mode: the lists of one claim of `owner`, one per level, in level order.
    pub fn claim_lists(&self, owner: &str, claim: u64) -> Vec<String> {
        (0..self.levels())
            .map(|level| self.claim_list(owner, level, claim))
            .collect()
    }

    /// Safe mode: the bitmap of the settled positions of a claim list (bit p, in `GETBIT`'s order).
    pub fn claim_settled(&self, owner: &str, level: usize, claim: u64) -> String {
        format!("{}:{claim}:settled", self.processing(owner, level))
    }

    /// Safe mode: the progress its running tasks reported (a hash: position -> `{"at", "fraction", "message"}`,
    /// progress.lua), deleted with the claim list by the settle that ends its last task (docs/PROTOCOL.md,
    /// "Progress"). settle.lua builds this name from the list's (`LIST:progress`), as here.
    pub fn claim_progress(&self, owner: &str, level: usize, claim: u64) -> String {
        format!("{}:{claim}:progress", self.processing(owner, level))
    }

    /// The log of the starts of the queue's rate limit over windows of `window_ms` (a list of `MS COUNT` entries,
    /// oldest first: claim.lua), and its sum (a string); both expire a second after their newest start's window.
    pub fn rate_log(&self, window_ms: u64) -> (String, String) {
        let log = format!("{}:rate:q:{window_ms}", self.base);
        let sum = format!("{log}:sum");
        (log, sum)
    }

    /// The log of the starts of a task type's rate limit (`[[queues.limits]]`) over windows of `window_ms`, and
    /// its sum: as [`QueueKeys::rate_log`], for the type's scope ([`type_scope`]).
    pub fn type_rate_log(&self, kind: &str, window_ms: u64) -> (String, String) {
        let log = format!("{}:rate:{}:{window_ms}", self.base, type_scope(kind));
        let sum = format!("{log}:sum");
        (log, sum)
    }

    /// The throttle of a task type with its own limits: as [`QueueKeys::throttle`], for that type only (a
    /// handler's throttle of one of its tasks, settle.lua; claim.lua takes none of its tasks while it lives).
    pub fn type_throttle(&self, kind: &str) -> String {
        format!("{}:throttle:{}", self.base, type_scope(kind))
    }

    /// A group's throttle: as [`QueueKeys::throttle`], for that group only (groups.lua builds the same name).
    pub fn group_throttle(&self, group: &str) -> String {
        format!("{}:throttle:{}", self.base, group_scope(group))
    }

    /// A group's pause (`kmqd group pause`): claims take none of its tasks while it exists.
    pub fn group_hold(&self, group: &str) -> String {
        format!("{}:hold:{}", self.base, group_scope(group))
    }

    /// The park index of a running scope (`g:GROUP` or `t:TYPE`, [`group_scope`], [`type_scope`]) beside type limits
    /// on a grouped queue: a zset of the (GROUP, TYPE) flows a claim parked because that scope refused them
    /// (`LEVEL|MEMBER` -> ms parked; groups.lua builds the same names). A settle that frees the group's slot and
    /// `kmqd group resume` move a group's back; a claim moves a type's back as its slots free.
    pub fn park(&self, scope: &str) -> String {
        format!("{}:park:{scope}", self.base)
    }

    /// A group's rate log and its sum for one window (groups.lua builds the same names).
    pub fn group_rate_log(&self, group: &str, window_ms: u64) -> (String, String) {
        let log = format!("{}:rate:{}:{window_ms}", self.base, group_scope(group));
        let sum = format!("{log}:sum");
        (log, sum)
    }

    /// `routes`: a hash whose `groups` field is 1 while the queue's daemons take turns between groups, so that
    /// push.lua, given it, puts each task in its group's flow (docs/PROTOCOL.md, "Groups").
    pub fn routes(&self) -> String {
        format!("{}:routes", self.base)
    }

    /// The ring of one level: zset flow member ([`flow_member`], [`group_member`]) -> score, naming the flows of
    /// the level that may hold tasks, for the claims and for the readers; a type's flow scores 0 (types.lua), a
    /// group's its pass or its band ([`GROUP_TIMED`], [`GROUP_PARKED`]; groups.lua).
    pub fn ring(&self, level: usize) -> String {
        format!("{}:ring:{}", self.base, self.levels[level])
    }

    /// The rings, one per level.
    pub fn rings(&self) -> Vec<String> {
        (0..self.levels()).map(|level| self.ring(level)).collect()
    }

    /// The flow of `member` ([`flow_member`]) at one level: a list of the tasks of a limited type that its limits
    /// held back when a claim met them, oldest first (claim.lua, "Type limits").
    pub fn flow(&self, level: usize, member: &str) -> String {
        format!("{}:flow:{}:{member}", self.base, self.levels[level])
    }

    /// Safe mode: the running limits a claim list was counted under (`N q`: its N tasks count in [`QueueKeys::running`]'s
    /// `q`), written by the claim that made the list when the queue has `max_running`, and deleted with the list:
    /// settle.lua subtracts what it settles of a list from the scopes its string names, so a claim made without a
    /// limit is never subtracted from one, whatever the settling daemon's config.
    pub fn claim_scopes(&self, owner: &str, level: usize, claim: u64) -> String {
        format!("{}:{claim}:scopes", self.processing(owner, level))
    }

    /// Safe mode: [`QueueKeys::claim_scopes`] of one claim of `owner`, one per level, in level order.
    pub fn claim_scopes_all(&self, owner: &str, claim: u64) -> Vec<String> {
        (0..self.levels())
            .map(|level| self.claim_scopes(owner, level, claim))
            .collect()
    }

    /// An owner's registration: hash of its mode, levels, host, pid, start time, kmqd version, the lowest claim
    /// token it may still use (`floor`) and the size of the quarantined group it runs alone (`group`).
    pub fn owner_info(&self, owner: &str) -> String {
        format!("{}:owner:{owner}", self.base)
    }

    /// The result of the last settle call of one settling party (an acker or a monitor of one daemon's run), so
    /// that a call sent again after a lost reply is answered instead of applied twice.
    pub fn settled(&self, settler: &str) -> String {
        format!("{}:settled:{settler}", self.base)
    }

    /// Default mode: hash scope -> how many of the `running` hash's tasks `owner` popped and has not settled yet
    /// (pop.lua adds, settle.lua subtracts, release.lua gives the rest back when the owner goes: its daemon
    /// stopped, or died and a monitor found its lease expired).
    pub fn popped_running(&self, owner: &str) -> String {
        format!("{}:popped-running:{owner}", self.base)
    }

    /// A settling party's scratch string inside settle.lua (a claim's new settled bits, merged with BITOP);
    /// never left behind.
    pub fn settle_scratch(&self, settler: &str) -> String {
        format!("{}:bits", self.settled(settler))
    }

    /// The claim sets of `owner`, one per level.
    pub fn processing_all(&self, owner: &str) -> Vec<String> {
        (0..self.levels())
            .map(|level| self.processing(owner, level))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_one_hash_tag() {
        let keys = QueueKeys::new("kmq", "mail", &["high".into(), "low".into()]);
        assert_eq!(
            keys.ready,
            ["kmq:{mail}:ready:high", "kmq:{mail}:ready:low"]
        );
        assert_eq!(keys.retry[1], "kmq:{mail}:retry:low");
        assert_eq!(keys.processing("o7", 1), "kmq:{mail}:processing:o7:low");
        assert_eq!(
            keys.claim_list("o7", 1, 40),
            "kmq:{mail}:processing:o7:low:40"
        );
        assert_eq!(
            keys.claim_settled("o7", 1, 40),
            "kmq:{mail}:processing:o7:low:40:settled"
        );
        assert_eq!(
            keys.claim_progress("o7", 1, 40),
            format!("{}:progress", keys.claim_list("o7", 1, 40))
        );
        assert_eq!(keys.owner_info("o7"), "kmq:{mail}:owner:o7");
        assert_eq!(keys.paused, "kmq:{mail}:paused");
        let other = keys.with_levels(&["urgent".into()]);
        assert_eq!(other.ready, ["kmq:{mail}:ready:urgent"]);
        assert_eq!(
            other.quarantine,
            [
                "kmq:{mail}:quarantine:1:urgent",
                "kmq:{mail}:quarantine:8:urgent",
                "kmq:{mail}:quarantine:64:urgent"
            ]
        );
        assert_eq!(keys.quarantine_list(1, 1), "kmq:{mail}:quarantine:8:low");
        assert_eq!(
            (2..6).map(quarantine_stage).collect::<Vec<_>>(),
            [Some(2), Some(1), Some(0), Some(0)]
        );
        let all = [
            &keys.ready[0],
            &keys.delayed[0],
            &keys.owners,
            &keys.dead,
            &keys.unique,
            &keys.stats,
            &keys.wake,
            &keys.paused,
            &keys.throttle,
        ];
        assert!(all.iter().all(|key| key.starts_with("kmq:{mail}:")));
    }

    #[test]
    fn a_limited_types_keys_stay_in_the_queues_slot_whatever_its_name() {
        let keys = QueueKeys::new("kmq", "mail", &["high".into()]);
        let kind = "report:{x} 5%é";
        assert_eq!(type_scope(kind), "t:report%3A%7Bx%7D%205%25é");
        assert_eq!(
            keys.flow(0, &flow_member(kind)),
            "kmq:{mail}:flow:high::report%3A%7Bx%7D%205%25é"
        );
        assert_eq!(keys.ring(0), "kmq:{mail}:ring:high");
        assert_eq!(
            keys.type_rate_log(kind, 1000).0,
            "kmq:{mail}:rate:t:report%3A%7Bx%7D%205%25é:1000"
        );
        assert_eq!(member_type(&flow_member(kind)).as_deref(), Some(kind));
        assert_eq!(member_type("nocolon"), None);
        assert_eq!(decode_name("%zz"), None);
    }
}
