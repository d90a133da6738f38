//! The Redis ACL rules kmqd needs, and the check at start that the user it logs in as has them.
//!
//! Operators run Redis with ACL users (docs/OPERATIONS.md, "ACL rules"). A user that lacks one rule would
//! otherwise fail later and far from the cause: the first delayed task (a PUBLISH inside push.lua), the first
//! retry, the first lease recovery. So each kmqd process asks Redis once, at start, whether its user may send
//! every (command, key or channel) pair it is about to send, with `redis.acl_check_cmd` (Redis 7.0+) inside
//! `scripts/access.lua`: nothing is run, only the rules are consulted, with the queue's real key names. The
//! first refusal is reported with the rule to add.
//!
//! The rules are written here once: [`setuser_line`] renders the `ACL SETUSER` lines that docs/OPERATIONS.md
//! quotes (a unit test keeps the two equal), and the tests create their users from the same lines.

use redis::{ConnectionLike, Value};

use super::{BrokerError, QueueKeys, Result, SCRIPTS, sources};

/// A user of docs/OPERATIONS.md, "ACL rules": the rules one kind of kmqd process needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The daemon (`kmqd --config FILE`): claims, settles, leases, delays, schedules, metrics.
    Daemon,
    /// `kmqd push`, `Client::push`, and producers in other languages that run the enqueue script.
    Producer,
    /// `kmqd stats`, `kmqd task show`, `kmqd dead list`, `kmqd dead show` and `kmqd workers` (`Client::stats`,
    /// `Client::find`, `Client::dead_list`, `Client::dead_show`, `Client::workers`): they read and write nothing.
    Reader,
    /// An operator's tools: everything a reader does, `kmqd task cancel` (which removes waiting tasks),
    /// `kmqd dead requeue` and `kmqd dead purge` (which move dead tasks back to the queue, or remove them), and
    /// `kmqd queue pause`/`resume`.
    Operator,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Daemon, Role::Producer, Role::Reader, Role::Operator];

    /// The user name docs/OPERATIONS.md gives this role's user.
    pub fn user(self) -> &'static str {
        match self {
            Role::Daemon => "kmqd",
            Role::Producer => "kmqd-producer",
            Role::Reader => "kmqd-reader",
            Role::Operator => "kmqd-operator",
        }
    }

    /// Whose rules these are, in a message: "the producers' rules".
    fn whose(self) -> &'static str {
        match self {
            Role::Daemon => "the daemons'",
            Role::Producer => "the producers'",
            Role::Reader => "the read-only tools'",
            Role::Operator => "the operators'",
        }
    }

    /// What a user with this role's rules may do: every action whose rules these are.
    fn actions(self) -> &'static [Action] {
        match self {
            Role::Daemon => &[Action::Serve],
            Role::Producer => &[Action::Push, Action::FlowPush],
            Role::Reader => &[
                Action::Stats,
                Action::Show,
                Action::DeadRead,
                Action::Workers,
                Action::History,
            ],
            Role::Operator => &[
                Action::Stats,
                Action::Show,
                Action::Workers,
                Action::History,
                Action::Cancel,
                Action::DeadRead,
                Action::DeadRequeue,
                Action::DeadPurge,
                Action::Pause,
                Action::Resume,
            ],
        }
    }

    /// The (command, what it touches) pairs of all this role's actions.
    fn needs(self) -> impl Iterator<Item = &'static (&'static str, On)> {
        self.actions().iter().flat_map(|action| action.needs())
    }

    /// The key patterns of this role's rules: (`~` read and write, or `%R~` read only; the pattern after
    /// `PREFIX:`).
    fn key_patterns(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Role::Daemon => &[("~", "*")],
            Role::Producer => &[
                ("~", "{*}:ready:*"),
                ("~", "{*}:delayed:*"),
                ("~", "{*}:delayed-tasks"),
                ("~", "{*}:wake"),
                ("~", "{*}:unique"),
                ("~", "{*}:stats"),
                ("~", "{*}:routes"),
                ("~", "{*}:flow:*"),
                ("~", "{*}:ring:*"),
                ("~", "{*}:sched"),
                // `kmqd flow push` (flow_push.lua): the waiting tasks' hashes, the queue's waiting hash and
                // outbox, and the dead list, where a waiter pushed again after its dependency ended dead goes.
                ("~", "{*}:deps:*"),
                ("~", "{*}:deps-ended:*"),
                ("~", "{*}:deps-waiting"),
                ("~", "{*}:deps-outbox"),
                ("~", "{*}:dead"),
                // The queue's shape, which the clients of other languages read once per queue with HGET
                // (docs/PROTOCOL.md, "The queue's shape"); unchecked, like push.lua's HGETs, so that a producer of
                // older rules keeps pushing.
                ("%R~", "{*}:meta"),
                // The holds of ended `unique_for` tasks, which push.lua reads with EXISTS before it takes a unique
                // id (docs/PROTOCOL.md, "Debounce, and unique for a time"); unchecked, as above.
                ("%R~", "{*}:unique:held:*"),
            ],
            Role::Reader => &[("%R~", "*")],
            Role::Operator => &[
                ("%R~", "*"),
                ("~", "{*}:ready:*"),
                ("~", "{*}:delayed:*"),
                ("~", "{*}:retry:*"),
                ("~", "{*}:delayed-tasks"),
                ("~", "{*}:unique"),
                // A cancelled `unique_for` task's hold (remove.lua, unique_hold.lua).
                ("~", "{*}:unique:held:*"),
                ("~", "{*}:stats"),
                ("~", "{*}:dead"),
                ("~", "{*}:wake"),
                ("~", "{*}:paused"),
                ("~", "{*}:hold:*"),
                ("~", "{*}:ring:*"),
                ("~", "{*}:sched"),
                ("~", "{*}:park:*"),
                ("~", "{*}:deps-outbox"),
            ],
        }
    }

    /// The channel patterns of this role's rules (after `PREFIX:`).
    fn channel_patterns(self) -> &'static [&'static str] {
        match self {
            Role::Daemon => &["*"],
            Role::Producer => &["{*}:delay-wake"],
            Role::Reader | Role::Operator => &[],
        }
    }
}

/// What a kmqd process is about to do with a queue: what the check at start asks for. Each is covered by one
/// role's rules ([`Action::role`]), and each asks only for what it sends, so that a user with more rules (the
/// daemon's user, running `kmqd stats` with the daemon's config) passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Run the daemon.
    Serve,
    /// `kmqd push`, `Client::push`.
    Push,
    /// `kmqd flow push`, `Client::push_flow`: flow_push.lua for the waiting tasks (its tasks that wait for
    /// nothing are pushed as [`Action::Push`] pushes them, which is checked too).
    FlowPush,
    /// `kmqd stats`, `Client::stats`.
    Stats,
    /// `kmqd task show`, `Client::find`; `kmqd task result`, `Client::result` (a kept result, and where the task
    /// is while it has none).
    Show,
    /// `kmqd task cancel`, `Client::cancel`.
    Cancel,
    /// `kmqd dead list` and `kmqd dead show`, `Client::dead_list` and `Client::dead_show`.
    DeadRead,
    /// `kmqd dead requeue`, `Client::dead_requeue`.
    DeadRequeue,
    /// `kmqd dead purge`, `Client::dead_purge`.
    DeadPurge,
    /// `kmqd queue pause`, `Client::pause`.
    Pause,
    /// `kmqd queue resume`, `Client::resume`.
    Resume,
    /// `kmqd workers`, `Client::workers`.
    Workers,
    /// The dashboard's charts, `Client::history`.
    History,
}

impl Action {
    /// The role whose rules docs/OPERATIONS.md gives for this action.
    pub fn role(self) -> Role {
        match self {
            Action::Serve => Role::Daemon,
            Action::Push | Action::FlowPush => Role::Producer,
            Action::Stats | Action::Show | Action::DeadRead | Action::Workers | Action::History => {
                Role::Reader
            }
            Action::Cancel
            | Action::DeadRequeue
            | Action::DeadPurge
            | Action::Pause
            | Action::Resume => Role::Operator,
        }
    }

    /// The (command, what it touches) pairs this action sends.
    fn needs(self) -> &'static [(&'static str, On)] {
        match self {
            Action::Serve => DAEMON,
            Action::Push => PRODUCER,
            Action::FlowPush => FLOW_PUSH,
            Action::Stats => STATS,
            Action::Show => SHOW,
            Action::Cancel => CANCEL,
            Action::DeadRead => DEAD_READ,
            Action::DeadRequeue => DEAD_REQUEUE,
            Action::DeadPurge => DEAD_PURGE,
            Action::Pause => PAUSE,
            Action::Resume => RESUME,
            Action::Workers => WORKERS,
            Action::History => HISTORY,
        }
    }

    /// Whether the check passes a key of the queue (so that a cluster routes it to the queue's node). Not for
    /// the read-only actions: Redis refuses EVALSHA on a key the user may not write, and a reader's keys are
    /// read-only (`%R~`); EVALSHA_RO would take one, but a user with more rules (the daemon's) has no reason to
    /// be allowed it. Without a key, the check runs on any node, whose ACL rules are the same.
    fn keyed(self) -> bool {
        !matches!(
            self,
            Action::Stats | Action::Show | Action::DeadRead | Action::Workers | Action::History
        )
    }
}

/// One command of the rules: its ACL name (`script|load` for a subcommand), and why kmqd sends it. Which roles'
/// rules give it is not written here but read off the action tables below ([`Command::given_to`]): a role's rules
/// give exactly the commands its actions' checks ask for (review D7: written once, they cannot disagree), and the
/// few commands a role needs though no check asks for them, each with its reason beside it.
#[derive(Debug)]
pub struct Command {
    pub name: &'static str,
    /// The roles that need this command though no check at start asks for it.
    pub unchecked: &'static [Role],
    pub why: &'static str,
}

impl Command {
    /// Whether `role`'s rules give this command: one of its actions sends it (so the check at start asks for it),
    /// or it is one of the role's unchecked commands.
    pub fn given_to(&self, role: Role) -> bool {
        self.unchecked.contains(&role) || role.needs().any(|(name, _)| *name == self.name)
    }
}

use Role::{Daemon as D, Operator as O, Producer as P};

/// Every command of the rules, in the order the `ACL SETUSER` lines list them.
pub const COMMANDS: &[Command] = &[
    Command {
        name: "evalsha",
        unchecked: &[],
        why: "runs kmqd's scripts (src/broker/scripts/*.lua), each an atomic step; Redis checks each command a \
              script runs against the same rules, hence the commands below. A script has its caller's rights: \
              the read-only tools run only the check at start (access.lua), and cannot write through it",
    },
    Command {
        name: "eval",
        // Producers in other languages send it; kmqd itself, and so its check at start, sends EVALSHA.
        unchecked: &[P],
        why: "producers in other languages run the enqueue script push.lua (docs/PROTOCOL.md); kmqd itself sends \
              EVALSHA",
    },
    Command {
        name: "script|load",
        unchecked: &[],
        why: "loads a script into Redis's cache when EVALSHA answers NOSCRIPT (the first time, after a restart or \
              a SCRIPT FLUSH)",
    },
    Command {
        name: "time",
        unchecked: &[],
        why: "Redis's clock decides leases, due times and task ages",
    },
    Command {
        name: "info",
        // Asked for by no check: without it the policy goes unread, with a warning (`eviction::read`), and a
        // user of rules older than the policy check keeps working.
        unchecked: &[D, P, O],
        why: "reads `maxmemory_policy` (`INFO memory`) at start: the daemon and the commands that write refuse or \
              warn about a Redis that may evict kmqd's keys (\"maxmemory-policy\" below). Not checked at start: \
              without it the policy goes unread, with a warning",
    },
    Command {
        name: "client|setname",
        unchecked: &[],
        why: "names each of the daemon's connections `kmqd:HOST:PID:ROLE`, for `CLIENT LIST`",
    },
    Command {
        name: "wait",
        unchecked: &[],
        why: "with `[redis] wait_replicas`, each change of a task waits for the replicas to have it",
    },
    Command {
        name: "blmove",
        unchecked: &[],
        why: "an idle default-mode fetcher of a one-level queue waits on its ready list (moved onto itself, \
              unchanged), so that a plain RPUSH wakes it at once; the source mover waits on a source list the \
              same way",
    },
    Command {
        name: "blpop",
        unchecked: &[],
        why: "an idle fetcher (safe mode, or several levels) waits for a wake-up marker",
    },
    Command {
        name: "lmpop",
        unchecked: &[],
        why: "default mode pops tasks from the first non-empty list (pop.lua; the plain pop, in take.lua's \
              transaction, from that list or from the list take.lua filled)",
    },
    Command {
        name: "lpop",
        unchecked: &[],
        why: "safe mode claims tasks from the ready and quarantine lists (claim.lua); the source mover takes \
              tasks from the source lists (move.lua)",
    },
    Command {
        name: "rpush",
        unchecked: &[],
        why: "a new task joins the back of its ready list (push.lua, fire.lua; due delayed tasks: promote.lua; a \
              requeued dead task: dead_requeue.lua; a task from a source list: move.lua)",
    },
    Command {
        name: "lpush",
        unchecked: &[],
        why: "wake-up markers; retried, recovered and handed-back tasks go to the front of their list; dead \
              letters",
    },
    Command {
        name: "ltrim",
        unchecked: &[],
        why: "keeps the wake list at one marker and the dead-letter list at `dead_max`",
    },
    Command {
        name: "lset",
        unchecked: &[],
        why: "a claim of a queue with `rate_limit` adds its starts to the newest entry of each window's log",
    },
    Command {
        name: "pexpire",
        unchecked: &[],
        why: "a rate limit's log expires a second after its newest start's window; kept results' buckets and their index expire `keep_results` after their last result; a finished waiting task's hashes expire (flow_push.lua, flow_apply.lua); a claim's progress hash a day after its last report (progress.lua)",
    },
    Command {
        name: "pttl",
        unchecked: &[],
        why: "default mode's plain pop and `kmqd stats` learn how long a handler's throttle holds the queue back; settle.lua only ever pushes back a results bucket's expiry",
    },
    Command {
        name: "llen",
        unchecked: &[],
        why: "claims look for quarantined tasks; stats count ready and dead tasks; `dead` commands measure the \
              dead-letter list",
    },
    Command {
        name: "lindex",
        unchecked: &[],
        why: "stats read the oldest ready task, for the lag",
    },
    Command {
        name: "lrange",
        unchecked: &[],
        why: "a claim reads its tasks back from its lists, and the monitor an expired owner's in windows; `task show` and `task cancel` read the ready lists (and `task \
              show` the claim lists, and the `dead` commands the dead letters) in chunks",
    },
    Command {
        name: "lrem",
        unchecked: &[],
        why: "`task cancel` removes a ready task (remove.lua); `dead requeue` and `dead purge` remove a dead letter \
              (dead_requeue.lua, dead_purge.lua)",
    },
    Command {
        name: "hget",
        unchecked: &[],
        why: "owners' registrations, schedules' last slots, the protocol version; `task cancel` rereads a delayed task; `task result` reads a kept result; `task show` a running task's progress report; every script that increments a counter first checks that it is an integer",
    },
    Command {
        name: "hmget",
        unchecked: &[],
        why: "claims read an owner's registration, adopt.lua its tasks; promote.lua and `task show` read delayed \
              tasks by id; `flow push` reads the numbers of a waiting task it writes",
    },
    Command {
        name: "hset",
        unchecked: &[],
        why: "owners' registrations, schedules' last slots, the queue's shape in its meta hash (at start and reload); \
              settle.lua keeps a task's result in its bucket (`keep_results`); push.lua replaces a debounced task's \
              envelope; `flow push` writes a waiting task (flow_push.lua); progress.lua a running task's progress \
              report",
    },
    Command {
        name: "hsetnx",
        unchecked: &[],
        why: "records the protocol version; push.lua stores a delayed task and takes a unique id (and \
              dead_requeue.lua takes it again, as settle.lua does for a task queued again after its owner lost \
              it); pop.lua records the owner that popped a unique task",
    },
    Command {
        name: "hdel",
        unchecked: &[],
        why: "settling a claimed task, releasing a unique id, moving or cancelling a delayed task",
    },
    Command {
        name: "hexists",
        unchecked: &[],
        why: "a pop checks whether a task's unique id is held",
    },
    Command {
        name: "hlen",
        unchecked: &[],
        why: "claims and pops check what is held; stats count processing tasks and tasks waiting for their \
              dependencies; `flow push` and the flows' movers compare a waiting task's ended dependencies with how \
              many it needs",
    },
    Command {
        name: "hincrby",
        unchecked: &[],
        why: "the queue's counters (pushed, done, retried, dead_lettered, cancelled...)",
    },
    Command {
        name: "hgetall",
        unchecked: &[],
        why: "owners' registrations; the counters, for stats and metrics; a flow's waiting task, for task show; \
              `flow push` and the flows' movers read a waiting task's ended dependencies",
    },
    Command {
        name: "hscan",
        unchecked: &[],
        why: "the monitor reads the tasks and unique ids of an owner whose lease ran out; `task show` reads \
              processing tasks",
    },
    Command {
        name: "zadd",
        unchecked: &[],
        why: "leases (the owners sorted set), owners' claim sets, delayed tasks, retries, a grouped queue's rings (a push, a claim, `kmqd group resume`), the index of kept results' buckets",
    },
    Command {
        name: "zrem",
        unchecked: &[],
        why: "releasing an owner, forgetting a settled claim, moving due tasks, forgetting an expired results bucket; `task cancel` removes delayed and retrying tasks",
    },
    Command {
        name: "zrange",
        unchecked: &[],
        why: "the owners and their leases, due tasks, the next due time; `task result` finds the buckets of kept results",
    },
    Command {
        name: "zscore",
        // Only a debounced push runs it, and push.lua refuses one for a user without it, naming it: a producer
        // made from an older kmqd's rules is not refused at start for lacking it.
        unchecked: &[P],
        why: "an owner's lease; `task show` reads a delayed task's due time; push.lua finds the delayed task a \
              debounced push replaces",
    },
    Command {
        name: "zcard",
        unchecked: &[],
        why: "stats count delayed and retrying tasks, and a grouped queue's groups waiting",
    },
    Command {
        name: "scan",
        // Asked for by no check: without it the daemon cannot look for the keys of levels its config dropped,
        // and says so (`broker::levels`).
        unchecked: &[D],
        why: "at start and after a reload that drops a priority level, the daemon looks for the keys of levels its \
              config does not name that still hold tasks, to warn of them (without this rule it warns that it \
              cannot look)",
    },
    Command {
        name: "zscan",
        unchecked: &[],
        why: "`task show` and `task cancel` look for retrying tasks",
    },
    Command {
        name: "get",
        unchecked: &[],
        why: "settle.lua answers a call sent again after a lost reply with the first call's result, and merges a claim's settled positions; the monitor and `task show` read them",
    },
    Command {
        name: "set",
        unchecked: &[],
        why: "settle.lua stores each call's result (for a day) and sets a handler's throttle; a plain pop guards the list take.lua fills (take.lua); `queue pause` sets the queue's paused key",
    },
    Command {
        name: "del",
        unchecked: &[],
        why: "forgets a released owner's registration; a plain pop removes its guard (take.lua); `queue resume` \
              deletes the paused key",
    },
    Command {
        name: "exists",
        unchecked: &[],
        why: "registering, renewing and releasing an owner check its registration and tasks; claims, pops, stats \
              and `workers` check whether the queue is paused; `flow push` leaves a waiting task that exists as it is; \
              a unique push checks whether its id is still held after a `unique_for` task ended",
    },
    Command {
        name: "type",
        unchecked: &[],
        why: "every script checks the type of each key it writes before it writes, so that it applies all or \
              nothing; the monitor, stats, `workers` and `task show` tell an owner's claim sets \
              from a kmqd 0.1 owner's processing hashes",
    },
    Command {
        name: "sort",
        unchecked: &[],
        why: "a claim copies the head of a ready list onto its claim list natively (`SORT ... BY nosort LIMIT 0 N \
              STORE`, no payload through Lua), then trims it off; a plain pop (take.lua) likewise",
    },
    Command {
        name: "memory|usage",
        unchecked: &[],
        why: "a claim bounds its tasks' size by max_task_bytes at once; a plain pop (take.lua) weighs a list's \
              head and stops at its bytes; the monitor reads a large claim list in windows",
    },
    Command {
        name: "bitcount",
        unchecked: &[],
        why: "settle.lua counts a claim's settled positions",
    },
    Command {
        name: "bitop",
        unchecked: &[],
        why: "settle.lua ORs a call's settled positions into a claim's bitmap",
    },
    Command {
        name: "getbit",
        unchecked: &[],
        why: "settle.lua checks a task's settled bit, so that a task is settled once",
    },
    Command {
        name: "setbit",
        unchecked: &[],
        why: "settle.lua sets a task's settled bit",
    },
    Command {
        name: "watch",
        unchecked: &[],
        why: "default mode's plain pop runs only while no unique id is held and the queue is neither paused nor \
              throttled",
    },
    Command {
        name: "unwatch",
        unchecked: &[],
        why: "ends that watch when a unique id is held",
    },
    Command {
        name: "multi",
        unchecked: &[],
        why: "the transactions: default mode's plain pop (take.lua and the list it filled), safe mode's claim \
              (the script and its lists), and `kmqd stats`'s snapshot (every depth and counter of a queue read at \
              one instant)",
    },
    Command {
        name: "exec",
        unchecked: &[],
        why: "runs those transactions",
    },
    Command {
        name: "publish",
        unchecked: &[],
        why: "tells the delay pollers that a task became due sooner than they planned (push.lua, settle.lua)",
    },
    Command {
        name: "subscribe",
        unchecked: &[],
        why: "each daemon listens for those",
    },
    Command {
        name: "unsubscribe",
        unchecked: &[],
        why: "the Redis client library sends it when that listener stops or reconnects (refused, it would only \
              fill `ACL LOG`)",
    },
    Command {
        name: "punsubscribe",
        unchecked: &[],
        why: "the same",
    },
];

/// The kinds of keys of a queue (see [`QueueKeys`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Ready,
    Quarantine,
    Delayed,
    DelayedTasks,
    Retry,
    Owners,
    OwnerInfo,
    Processing,
    /// A claim's list of tasks (`processing:OWNER:LEVEL:CLAIM`).
    ClaimList,
    /// A claim's settled bitmap.
    ClaimSettled,
    /// A settling party's scratch string in settle.lua.
    SettleScratch,
    Settled,
    /// A queue's running counts (`max_running`).
    Running,
    /// A claim list's running scopes string.
    ClaimScopes,
    /// A default-mode owner's share of the running counts.
    PoppedRunning,
    /// A rate limit's log of starts, and its sum.
    RateLog,
    RateSum,
    Dead,
    Unique,
    /// A `unique_for` id's hold after its task ended (`unique:held:ID`, unique_hold.lua).
    UniqueHeld,
    UniquePopped,
    /// Default mode's plain pop's list (take.lua), empty outside its transaction.
    Taking,
    Stats,
    Wake,
    Schedules,
    Meta,
    Paused,
    /// The queue's throttle (a handler's back-pressure).
    Throttle,
    /// The queue's `source_lists`: named by its producers, outside kmqd's prefix.
    Source,
    History,
    /// A grouped queue's routes hash, its flows, its rings and its sched hash (push.lua, "Groups").
    Routes,
    Flow,
    Ring,
    Sched,
    /// A group's pause (`kmqd group pause`).
    Hold,
    /// A park index beside type limits on a grouped queue (`park:g:GROUP`, `park:t:TYPE`; groups.lua).
    Park,
    /// A queue's kept results (`keep_results`: results.lua, in settle.lua): the index of its buckets and a bucket.
    Result,
    /// A queue's flow outbox (`deps-outbox`: notes to the tasks waiting for its tasks; docs/design/flows.md).
    DepsOutbox,
    /// A waiting task's hash and its ended hash (`deps:ID`, `deps-ended:ID`; its run hash, `deps-run:ID`, is
    /// only the daemon's, whose pattern is every key).
    DepsTask,
    /// A queue's waiting hash (`deps-waiting`).
    DepsWaiting,
}

/// What a command touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum On {
    /// No key, no channel (TIME, EXEC).
    Nothing,
    /// Every key of this kind (every level's).
    Key(Kind),
    /// The queue's pub/sub channel, `PREFIX:{QUEUE}:delay-wake`.
    Channel,
}

const NOTHING: On = On::Nothing;
const CHANNEL: On = On::Channel;

const fn key(kind: Kind) -> On {
    On::Key(kind)
}

use Kind as K;

/// The daemon's commands: sent from Rust (the broker, the listener) and run inside its scripts.
const DAEMON: &[(&str, On)] = &[
    // Sent from Rust: start, owners, stats (metrics), default mode's plain pop and waits, the monitor, the
    // delay listener.
    ("hsetnx", key(K::Meta)),
    ("hget", key(K::Meta)),
    ("hset", key(K::Meta)),
    ("time", NOTHING),
    ("wait", NOTHING),
    ("zrange", key(K::Owners)),
    ("hget", key(K::Schedules)),
    ("hgetall", key(K::OwnerInfo)),
    ("hget", key(K::OwnerInfo)),
    ("llen", key(K::Ready)),
    ("llen", key(K::Quarantine)),
    ("llen", key(K::Dead)),
    ("lindex", key(K::Ready)),
    ("zcard", key(K::Delayed)),
    ("zcard", key(K::Retry)),
    ("zcard", key(K::Ring)),
    ("type", key(K::Processing)),
    ("hlen", key(K::Processing)),
    ("zrange", key(K::Processing)),
    ("hgetall", key(K::Stats)),
    ("watch", key(K::Unique)),
    ("watch", key(K::Paused)),
    ("exists", key(K::Paused)),
    ("watch", key(K::Throttle)),
    ("pttl", key(K::Throttle)),
    ("hlen", key(K::Unique)),
    ("unwatch", NOTHING),
    ("multi", NOTHING),
    ("lmpop", key(K::Quarantine)),
    ("lmpop", key(K::Ready)),
    // The plain pop's transaction guards the taking list, then pops what take.lua weighed: from its list, or from
    // what it copied (below); the guard goes after.
    ("set", key(K::Taking)),
    ("lmpop", key(K::Taking)),
    ("del", key(K::Taking)),
    ("exec", NOTHING),
    ("blmove", key(K::Ready)),
    ("blpop", key(K::Wake)),
    ("hscan", key(K::UniquePopped)),
    ("hscan", key(K::Processing)),
    ("lrange", key(K::ClaimList)),
    ("get", key(K::ClaimSettled)),
    ("subscribe", CHANNEL),
    ("unsubscribe", NOTHING),
    ("punsubscribe", NOTHING),
    ("client|setname", NOTHING),
    // The scripts, with every kind of key they are given in KEYS (EVALSHA needs read and write on each).
    ("script|load", NOTHING),
    ("evalsha", key(K::Ready)),
    ("evalsha", key(K::Quarantine)),
    ("evalsha", key(K::Delayed)),
    ("evalsha", key(K::DelayedTasks)),
    ("evalsha", key(K::Retry)),
    ("evalsha", key(K::Owners)),
    ("evalsha", key(K::OwnerInfo)),
    ("evalsha", key(K::Processing)),
    ("evalsha", key(K::ClaimList)),
    ("evalsha", key(K::ClaimSettled)),
    ("evalsha", key(K::SettleScratch)),
    ("evalsha", key(K::Settled)),
    ("evalsha", key(K::Dead)),
    ("evalsha", key(K::Unique)),
    ("evalsha", key(K::UniquePopped)),
    ("evalsha", key(K::Stats)),
    ("evalsha", key(K::Wake)),
    ("evalsha", key(K::Schedules)),
    ("evalsha", key(K::Paused)),
    ("evalsha", key(K::Throttle)),
    ("evalsha", key(K::Running)),
    ("evalsha", key(K::PoppedRunning)),
    ("evalsha", key(K::Taking)),
    // Built inside claim.lua's and settle.lua's groups code, beside type limits (groups.lua's park indexes).
    ("type", key(K::Park)),
    ("zadd", key(K::Park)),
    ("zrange", key(K::Park)),
    ("zrem", key(K::Park)),
    ("del", key(K::Park)),
    ("evalsha", key(K::Result)),
    // Inside claim.lua and adopt.lua (and pop.lua's check of the paused key, above); the claim's transaction
    // reads its lists back (LRANGE, above).
    ("zscore", key(K::Owners)),
    ("hmget", key(K::OwnerInfo)),
    ("hget", key(K::OwnerInfo)),
    ("hset", key(K::OwnerInfo)),
    ("hdel", key(K::OwnerInfo)),
    ("type", key(K::Ready)),
    ("type", key(K::Quarantine)),
    ("type", key(K::ClaimList)),
    ("exists", key(K::ClaimList)),
    ("llen", key(K::Ready)),
    ("llen", key(K::Quarantine)),
    ("sort", key(K::Ready)),
    ("sort", key(K::ClaimList)),
    ("ltrim", key(K::Ready)),
    ("memory|usage", key(K::ClaimList)),
    // Inside take.lua: a list's head weighed, or its native copy, weighed and cut to the pop's bytes.
    ("memory|usage", key(K::Ready)),
    ("memory|usage", key(K::Quarantine)),
    ("type", key(K::Taking)),
    ("sort", key(K::Quarantine)),
    ("sort", key(K::Taking)),
    ("memory|usage", key(K::Taking)),
    ("ltrim", key(K::Quarantine)),
    ("ltrim", key(K::Taking)),
    ("lpop", key(K::Quarantine)),
    ("lpop", key(K::ClaimList)),
    ("rpush", key(K::ClaimList)),
    ("del", key(K::ClaimList)),
    ("zadd", key(K::Processing)),
    ("lpush", key(K::Dead)),
    ("ltrim", key(K::Dead)),
    ("hincrby", key(K::Stats)),
    ("lpush", key(K::Wake)),
    ("ltrim", key(K::Wake)),
    // A default-mode owner's share of the running counts: pop.lua adds, settle.lua subtracts, release.lua gives
    // back the rest.
    ("type", key(K::PoppedRunning)),
    ("hget", key(K::PoppedRunning)),
    ("hincrby", key(K::PoppedRunning)),
    ("hset", key(K::PoppedRunning)),
    ("hdel", key(K::PoppedRunning)),
    ("hgetall", key(K::PoppedRunning)),
    ("del", key(K::PoppedRunning)),
    ("hmget", key(K::Running)),
    ("hgetall", key(K::Running)),
    // A handler's throttle: set by settle.lua, checked by claim.lua and pop.lua.
    ("type", key(K::Throttle)),
    ("exists", key(K::Throttle)),
    ("get", key(K::Throttle)),
    ("set", key(K::Throttle)),
    // Running and rate limits, in claim.lua and settle.lua.
    ("type", key(K::Running)),
    ("hget", key(K::Running)),
    ("hincrby", key(K::Running)),
    ("hset", key(K::Running)),
    ("hdel", key(K::Running)),
    ("hset", key(K::Routes)),
    ("hdel", key(K::Routes)),
    ("type", key(K::ClaimScopes)),
    ("set", key(K::ClaimScopes)),
    ("get", key(K::ClaimScopes)),
    ("del", key(K::ClaimScopes)),
    ("type", key(K::RateLog)),
    ("lindex", key(K::RateLog)),
    ("ltrim", key(K::RateLog)),
    ("lset", key(K::RateLog)),
    ("rpush", key(K::RateLog)),
    ("pexpire", key(K::RateLog)),
    ("type", key(K::RateSum)),
    ("get", key(K::RateSum)),
    ("set", key(K::RateSum)),
    ("del", key(K::RateSum)),
    // The owner's journal, in claim.lua, adopt.lua, renew.lua and settle.lua.
    ("hincrby", key(K::OwnerInfo)),
    ("type", key(K::OwnerInfo)),
    // pop.lua (its lease check is claim.lua's ZSCORE, above).
    ("hlen", key(K::Unique)),
    ("hexists", key(K::Unique)),
    ("hsetnx", key(K::UniquePopped)),
    // settle.lua.
    ("get", key(K::Settled)),
    ("set", key(K::Settled)),
    ("type", key(K::Owners)),
    ("type", key(K::Stats)),
    ("type", key(K::Dead)),
    ("type", key(K::Unique)),
    ("type", key(K::Wake)),
    ("type", key(K::Settled)),
    ("type", key(K::UniquePopped)),
    ("type", key(K::Retry)),
    ("type", key(K::ClaimSettled)),
    ("llen", key(K::ClaimList)),
    ("set", key(K::ClaimSettled)),
    ("bitcount", key(K::ClaimSettled)),
    ("getbit", key(K::ClaimSettled)),
    ("setbit", key(K::ClaimSettled)),
    ("bitop", key(K::ClaimSettled)),
    ("bitop", key(K::SettleScratch)),
    ("type", key(K::SettleScratch)),
    ("set", key(K::SettleScratch)),
    ("del", key(K::SettleScratch)),
    ("del", key(K::ClaimSettled)),
    // results.lua, in settle.lua: a kept result.
    ("type", key(K::Result)),
    ("hset", key(K::Result)),
    ("pttl", key(K::Result)),
    ("pexpire", key(K::Result)),
    ("zadd", key(K::Result)),
    ("zrange", key(K::Result)),
    ("zrem", key(K::Result)),
    ("zrem", key(K::Processing)),
    ("hdel", key(K::Processing)),
    ("hdel", key(K::UniquePopped)),
    ("hget", key(K::UniquePopped)), // and release_unique.lua
    ("hdel", key(K::Unique)),
    ("hsetnx", key(K::Unique)),
    // unique_hold.lua, in settle.lua and release_unique.lua: a `unique_for` id's hold, left and read.
    ("set", key(K::UniqueHeld)),
    ("get", key(K::UniqueHeld)),
    ("lpush", key(K::Ready)),
    ("lpush", key(K::Quarantine)),
    ("zadd", key(K::Retry)),
    ("zrange", key(K::Retry)),
    ("publish", CHANNEL),
    // register.lua, renew.lua, release.lua.
    ("zadd", key(K::Owners)),
    ("zrem", key(K::Owners)),
    ("exists", key(K::OwnerInfo)),
    ("exists", key(K::Processing)),
    ("del", key(K::OwnerInfo)),
    // promote.lua.
    ("zrange", key(K::Delayed)),
    ("zrem", key(K::Delayed)),
    ("zrem", key(K::Retry)),
    ("hmget", key(K::DelayedTasks)),
    ("hdel", key(K::DelayedTasks)),
    ("rpush", key(K::Ready)),
    // fire.lua.
    ("hset", key(K::Schedules)),
    // The source mover: its wait (sent from Rust) and move.lua.
    ("blmove", key(K::Source)),
    ("evalsha", key(K::Source)),
    ("type", key(K::Source)),
    ("lpop", key(K::Source)),
    // history.lua (the monitor's sample a minute for the dashboard's charts).
    ("evalsha", key(K::History)),
    ("zrange", key(K::History)),
    ("zadd", key(K::History)),
    ("zrem", key(K::History)),
    ("hmget", key(K::Stats)),
    // Flows (docs/design/flows.md): after.lua's notes (in settle.lua), the outbox's mover (LRANGE, then
    // flow_apply.lua in the waiter's slot, then flow_outbox.lua) and deps.lua's step of a waiting task.
    ("rpush", key(K::DepsOutbox)),
    ("lrange", key(K::DepsOutbox)),
    ("evalsha", key(K::DepsOutbox)),
    ("lindex", key(K::DepsOutbox)),
    ("lpop", key(K::DepsOutbox)),
    ("evalsha", key(K::DepsTask)),
    ("hget", key(K::DepsTask)),
    ("hmget", key(K::DepsTask)),
    ("hset", key(K::DepsTask)),
    ("hsetnx", key(K::DepsTask)),
    ("hdel", key(K::DepsTask)),
    ("hlen", key(K::DepsTask)),
    ("hgetall", key(K::DepsTask)),
    ("pexpire", key(K::DepsTask)),
    ("hdel", key(K::DepsWaiting)),
    ("type", key(K::DepsTask)),
    ("type", key(K::DepsWaiting)),
    ("type", key(K::DepsOutbox)),
    // Every script checks the types of its keys and its counters before it writes.
    ("type", key(K::Delayed)),
    ("type", key(K::DelayedTasks)),
    ("type", key(K::Schedules)),
    ("type", key(K::History)),
    ("hget", key(K::Stats)),
];

/// `kmqd push`: the enqueue script, push.lua.
const PRODUCER: &[(&str, On)] = &[
    ("wait", NOTHING),
    ("script|load", NOTHING),
    ("evalsha", key(K::Ready)),
    ("evalsha", key(K::Delayed)),
    ("evalsha", key(K::DelayedTasks)),
    ("evalsha", key(K::Wake)),
    ("evalsha", key(K::Unique)),
    ("evalsha", key(K::Stats)),
    ("evalsha", key(K::Routes)),
    ("time", NOTHING),
    ("zrange", key(K::Delayed)),
    // A grouped queue's routing (push.lua, "Groups"; its HGET of the routes and sched hashes, like its checks,
    // only for a user that may run HGET).
    ("rpush", key(K::Flow)),
    ("zadd", key(K::Ring)),
    ("hsetnx", key(K::Unique)),
    ("hsetnx", key(K::DelayedTasks)),
    ("zadd", key(K::Delayed)),
    ("hdel", key(K::Unique)),
    ("rpush", key(K::Ready)),
    ("lpush", key(K::Wake)),
    ("ltrim", key(K::Wake)),
    ("publish", CHANNEL),
    ("hincrby", key(K::Stats)),
];

/// `kmqd flow push`: flow_push.lua (with deps.lua's step of a waiting task whose dependencies ended before it was
/// written), per queue with waiting tasks; its leaves are pushed with push.lua, [`PRODUCER`]'s.
const FLOW_PUSH: &[(&str, On)] = &[
    ("wait", NOTHING),
    ("script|load", NOTHING),
    ("time", NOTHING),
    ("evalsha", key(K::DepsWaiting)),
    ("evalsha", key(K::Wake)),
    ("evalsha", key(K::Dead)),
    ("evalsha", key(K::Stats)),
    ("evalsha", key(K::DepsOutbox)),
    ("evalsha", key(K::DepsTask)),
    ("evalsha", key(K::Ready)),
    // It checks its keys' types and counters, and the numbers of a waiting task's hash, before it writes.
    ("type", key(K::DepsTask)),
    ("type", key(K::DepsWaiting)),
    ("type", key(K::Ready)),
    ("type", key(K::Wake)),
    ("type", key(K::Dead)),
    ("type", key(K::Stats)),
    ("type", key(K::DepsOutbox)),
    ("hget", key(K::Stats)),
    ("hmget", key(K::DepsTask)),
    // A waiting task written (or left as it is when it exists).
    ("exists", key(K::DepsTask)),
    ("hset", key(K::DepsTask)),
    ("hset", key(K::DepsWaiting)),
    ("hgetall", key(K::DepsTask)),
    ("hlen", key(K::DepsTask)),
    // A waiter whose dependencies had ended already (a flow pushed again): released, or failed up the graph.
    ("rpush", key(K::Ready)),
    ("lpush", key(K::Wake)),
    ("ltrim", key(K::Wake)),
    ("lpush", key(K::Dead)),
    ("ltrim", key(K::Dead)),
    ("hincrby", key(K::Stats)),
    ("rpush", key(K::DepsOutbox)),
    ("hdel", key(K::DepsTask)),
    ("hdel", key(K::DepsWaiting)),
    ("pexpire", key(K::DepsTask)),
];

/// `kmqd stats` (and the daemon's metrics): plain reads, the snapshot in one transaction.
const STATS: &[(&str, On)] = &[
    ("evalsha", NOTHING),
    ("script|load", NOTHING),
    ("zrange", key(K::Owners)),
    ("hget", key(K::OwnerInfo)),
    ("multi", NOTHING),
    ("exec", NOTHING),
    ("time", NOTHING),
    ("llen", key(K::Ready)),
    ("llen", key(K::Quarantine)),
    ("llen", key(K::Dead)),
    ("lindex", key(K::Ready)),
    ("zcard", key(K::Delayed)),
    ("zcard", key(K::Retry)),
    ("type", key(K::Processing)),
    ("hlen", key(K::Processing)),
    ("zrange", key(K::Processing)),
    ("hgetall", key(K::Stats)),
    ("exists", key(K::Paused)),
    ("pttl", key(K::Throttle)),
    ("hget", key(K::Running)),
    // A flow's tasks waiting for their dependencies (WAITING).
    ("hlen", key(K::DepsWaiting)),
    ("lrange", key(K::RateLog)),
    // The flows (type limits, groups) and `kmqd groups`.
    ("zrange", key(K::Ring)),
    ("llen", key(K::Flow)),
    ("hscan", key(K::Running)),
    ("exists", key(K::Hold)),
    ("zcard", key(K::Ring)),
];

/// `kmqd workers`: the owners, their registrations and what they hold.
const WORKERS: &[(&str, On)] = &[
    ("evalsha", NOTHING),
    ("script|load", NOTHING),
    ("zrange", key(K::Owners)),
    ("time", NOTHING),
    ("exists", key(K::Paused)),
    ("hgetall", key(K::OwnerInfo)),
    ("type", key(K::Processing)),
    ("hlen", key(K::Processing)),
    ("zrange", key(K::Processing)),
];

/// The dashboard's charts: the history zset, read whole.
const HISTORY: &[(&str, On)] = &[
    ("evalsha", NOTHING),
    ("script|load", NOTHING),
    ("zrange", key(K::History)),
];

/// `kmqd queue pause`: one SET of the paused key.
const PAUSE: &[(&str, On)] = &[
    ("evalsha", NOTHING),
    ("script|load", NOTHING),
    ("set", key(K::Paused)),
    // `kmqd group pause`: one SET of the group's pause.
    ("set", key(K::Hold)),
];

/// `kmqd queue resume`: one DEL of the paused key.
const RESUME: &[(&str, On)] = &[
    ("evalsha", NOTHING),
    ("script|load", NOTHING),
    ("del", key(K::Paused)),
    // `kmqd group resume`: group_resume.lua, which names each of these in its KEYS (EVALSHA needs read and write
    // on each), and empties the group's park index.
    ("evalsha", key(K::Hold)),
    ("evalsha", key(K::Sched)),
    ("evalsha", key(K::Wake)),
    ("evalsha", key(K::Ring)),
    ("evalsha", key(K::Park)),
    ("type", key(K::Ring)),
    ("type", key(K::Sched)),
    ("type", key(K::Wake)),
    ("type", key(K::Park)),
    ("hget", key(K::Sched)),
    ("zrange", key(K::Park)),
    ("del", key(K::Hold)),
    ("del", key(K::Park)),
    ("zscore", key(K::Ring)),
    ("zadd", key(K::Ring)),
    ("lpush", key(K::Wake)),
    ("ltrim", key(K::Wake)),
];

/// `kmqd task show`: plain reads, everywhere a task can be.
const SHOW: &[(&str, On)] = &[
    ("evalsha", NOTHING),
    ("script|load", NOTHING),
    ("time", NOTHING),
    ("hmget", key(K::DelayedTasks)),
    ("zscore", key(K::Delayed)),
    ("zscan", key(K::Retry)),
    ("lrange", key(K::Ready)),
    ("zrange", key(K::Owners)),
    ("type", key(K::Processing)),
    ("hscan", key(K::Processing)),
    ("zrange", key(K::Processing)),
    ("lrange", key(K::ClaimList)),
    ("get", key(K::ClaimSettled)),
    // A running task's progress report, in its claim's progress hash (a key of the claim, as its bitmap).
    ("hget", key(K::ClaimSettled)),
    ("lrange", key(K::Dead)),
    // `task result`: the buckets in the index, then the task's id in each.
    ("zrange", key(K::Result)),
    ("hget", key(K::Result)),
    // A flow's waiting task: its hash and its dependencies' outcomes.
    ("hgetall", key(K::DepsTask)),
];

/// `kmqd task cancel`: finding the waiting copies (as `task show` does), then remove.lua.
const CANCEL: &[(&str, On)] = &[
    ("time", NOTHING),
    ("hmget", key(K::DelayedTasks)),
    ("zscore", key(K::Delayed)),
    ("zscan", key(K::Retry)),
    ("lrange", key(K::Ready)),
    ("script|load", NOTHING),
    ("evalsha", key(K::Ready)),
    ("evalsha", key(K::Retry)),
    ("evalsha", key(K::Delayed)),
    ("evalsha", key(K::DelayedTasks)),
    ("evalsha", key(K::Unique)),
    ("evalsha", key(K::Stats)),
    ("lrem", key(K::Ready)),
    ("zrem", key(K::Retry)),
    ("zrem", key(K::Delayed)),
    ("hget", key(K::DelayedTasks)),
    ("hdel", key(K::DelayedTasks)),
    ("hdel", key(K::Unique)),
    ("hincrby", key(K::Stats)),
    // A cancelled `unique_for` task's id stays held for its window (unique_hold.lua).
    ("hget", key(K::Unique)),
    ("set", key(K::UniqueHeld)),
    // remove.lua checks its keys' types and its counter before it writes.
    ("type", key(K::Ready)),
    ("type", key(K::Retry)),
    ("type", key(K::Delayed)),
    ("type", key(K::DelayedTasks)),
    ("type", key(K::Unique)),
    ("type", key(K::Stats)),
    ("hget", key(K::Stats)),
];

/// `kmqd dead list` and `kmqd dead show`: plain reads of the dead-letter list (and the clock, for the ages).
const DEAD_READ: &[(&str, On)] = &[
    ("evalsha", NOTHING),
    ("script|load", NOTHING),
    ("time", NOTHING),
    ("llen", key(K::Dead)),
    ("lrange", key(K::Dead)),
];

/// `kmqd dead requeue`: reading the dead list, then dead_requeue.lua.
const DEAD_REQUEUE: &[(&str, On)] = &[
    ("llen", key(K::Dead)),
    ("lrange", key(K::Dead)),
    ("script|load", NOTHING),
    ("evalsha", key(K::Dead)),
    ("evalsha", key(K::Unique)),
    ("evalsha", key(K::Wake)),
    ("evalsha", key(K::Stats)),
    ("evalsha", key(K::Ready)),
    ("time", NOTHING),
    ("hsetnx", key(K::Unique)),
    // A requeued unique task's id stays dead while a `unique_for` task's hold is there (unique_hold.lua).
    ("exists", key(K::UniqueHeld)),
    ("lrem", key(K::Dead)),
    ("hdel", key(K::Unique)),
    ("rpush", key(K::Ready)),
    ("hincrby", key(K::Stats)),
    ("lpush", key(K::Wake)),
    ("ltrim", key(K::Wake)),
    // A requeued task of a flow withdraws its dead run from its waiters: a note at the head of its queue's
    // outbox (docs/design/flows.md, "A requeued dependency").
    ("evalsha", key(K::DepsOutbox)),
    ("lpush", key(K::DepsOutbox)),
    ("type", key(K::DepsOutbox)),
    // dead_requeue.lua checks its keys' types and its counter before it writes.
    ("type", key(K::Dead)),
    ("type", key(K::Unique)),
    ("type", key(K::Wake)),
    ("type", key(K::Stats)),
    ("type", key(K::Ready)),
    ("hget", key(K::Stats)),
];

/// `kmqd dead purge`: reading the dead list, then dead_purge.lua.
const DEAD_PURGE: &[(&str, On)] = &[
    ("llen", key(K::Dead)),
    ("lrange", key(K::Dead)),
    ("script|load", NOTHING),
    ("evalsha", key(K::Dead)),
    ("evalsha", key(K::Stats)),
    ("lrem", key(K::Dead)),
    ("hincrby", key(K::Stats)),
    // dead_purge.lua checks its keys' types and its counter before it writes.
    ("type", key(K::Dead)),
    ("type", key(K::Stats)),
    ("hget", key(K::Stats)),
];

/// The rules of `role` for keys under `prefix`: `+command`s, then key patterns, then channel patterns.
pub fn rules(role: Role, prefix: &str) -> Vec<String> {
    let commands = COMMANDS
        .iter()
        .filter(|command| command.given_to(role))
        .map(|command| format!("+{}", command.name));
    let keys = role
        .key_patterns()
        .iter()
        .map(|(access, pattern)| format!("{access}{prefix}:{pattern}"));
    let channels = role
        .channel_patterns()
        .iter()
        .map(|pattern| format!("&{prefix}:{pattern}"));
    commands.chain(keys).chain(channels).collect()
}

/// The `ACL SETUSER` line of docs/OPERATIONS.md for `role`, with the password left as `>PASSWORD`. `reset`
/// first, so that the line gives the user exactly these rules whatever it had before.
pub fn setuser_line(role: Role, prefix: &str) -> String {
    format!(
        "ACL SETUSER {} reset on >PASSWORD {}",
        role.user(),
        rules(role, prefix).join(" ")
    )
}

/// What every line needs more in a Redis Cluster, on every node (its ACL users are per node): the cluster
/// client's own commands. It PINGs each node and reads the slot map (CLUSTER SLOTS) when it connects and after
/// a MOVED redirection, and follows an ASK redirection while a slot migrates.
pub const CLUSTER_RULES: &[&str] = &["+ping", "+cluster|slots", "+asking"];

/// What every line needs more behind Sentinel, on the master and its replicas: the client asks the server it
/// was sent to for its ROLE, to be sure it reached the master.
pub const SENTINEL_MASTER_RULES: &[&str] = &["+role"];

/// The line for each user on each sentinel, which kmqd logs in to with the same user and password: it asks
/// the sentinels for the masters (SENTINEL MASTERS) and checks each is one (ROLE). No key, no channel.
pub fn sentinel_setuser_line(role: Role) -> String {
    format!(
        "ACL SETUSER {} reset on >PASSWORD +role +sentinel|masters",
        role.user()
    )
}

/// One (command, key or channel) pair a user may not use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// As Redis names it in messages: `BLMOVE`, `SCRIPT LOAD`.
    pub command: String,
    /// `key NAME` or `channel NAME`, when the command has one.
    pub target: Option<String>,
}

/// The message of [`BrokerError::Permission`].
pub(super) fn describe(user: Option<&str>, role: Role, refused: &[Refusal], hint: &str) -> String {
    let who = match user {
        Some(user) => format!("Redis user {user:?}"),
        None => "the Redis user".to_string(),
    };
    let whose = role.whose();
    let Some(first) = refused.first() else {
        return format!(
            "{who} lacks ACL rules: add \"{hint}\" ({whose} rules: docs/OPERATIONS.md, \"ACL rules\")"
        );
    };
    let on = first
        .target
        .as_deref()
        .map_or(String::new(), |target| format!(" on {target}"));
    let mut others: Vec<&str> = Vec::new();
    for refusal in &refused[1..] {
        if refusal.command != first.command && !others.contains(&refusal.command.as_str()) {
            others.push(&refusal.command);
        }
    }
    let also = match others.len() {
        0 => String::new(),
        1..=8 => format!(" (also refused: {})", others.join(", ")),
        n => format!(
            " (also refused: {} and {} more)",
            others[..8].join(", "),
            n - 8
        ),
    };
    format!(
        "{who} may not run {}{on}{also}: add \"{hint}\" to its ACL rules ({whose} rules: docs/OPERATIONS.md, \
         \"ACL rules\")",
        first.command
    )
}

/// One check the script makes: the command as it would be sent, and what a refusal is reported as.
struct Check {
    /// The ACL name of the command (`script|load`).
    acl: &'static str,
    argv: Vec<String>,
    on: Target,
}

/// A check's key or channel, by name.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    Nothing,
    Key(String),
    Channel(String),
}

/// The owner id and settling party named in the checks' keys: any id matches the rules' patterns, as kmqd's own
/// ids (`host-pid-time-random.N`) do.
const SOME_OWNER: &str = "access-check";

/// The names of the keys of `kind`.
fn names(keys: &QueueKeys, kind: Kind) -> Vec<String> {
    let levels = 0..keys.levels();
    match kind {
        Kind::Ready => keys.ready.clone(),
        Kind::Quarantine => keys.quarantine.clone(),
        Kind::Delayed => keys.delayed.clone(),
        Kind::DelayedTasks => vec![keys.delayed_tasks.clone()],
        Kind::Retry => keys.retry.clone(),
        Kind::Owners => vec![keys.owners.clone()],
        Kind::OwnerInfo => vec![keys.owner_info(SOME_OWNER)],
        Kind::Processing => levels
            .map(|level| keys.processing(SOME_OWNER, level))
            .collect(),
        Kind::ClaimList => keys.claim_lists(SOME_OWNER, 0),
        Kind::ClaimSettled => levels
            .map(|level| keys.claim_settled(SOME_OWNER, level, 0))
            .collect(),
        Kind::Settled => vec![keys.settled(SOME_OWNER)],
        Kind::Running => vec![keys.running.clone()],
        Kind::PoppedRunning => vec![keys.popped_running(SOME_OWNER)],
        Kind::ClaimScopes => keys.claim_scopes_all(SOME_OWNER, 0),
        Kind::RateLog => vec![keys.rate_log(1000).0],
        Kind::RateSum => vec![keys.rate_log(1000).1],
        Kind::SettleScratch => vec![keys.settle_scratch(SOME_OWNER)],
        Kind::Dead => vec![keys.dead.clone()],
        Kind::Unique => vec![keys.unique.clone()],
        Kind::UniqueHeld => vec![keys.unique_held(SOME_OWNER)],
        Kind::UniquePopped => vec![keys.unique_popped.clone()],
        Kind::Taking => vec![keys.taking.clone()],
        Kind::Stats => vec![keys.stats.clone()],
        Kind::Wake => vec![keys.wake.clone()],
        Kind::Schedules => vec![keys.schedules.clone()],
        Kind::Meta => vec![keys.meta.clone()],
        Kind::Paused => vec![keys.paused.clone()],
        Kind::Throttle => vec![keys.throttle.clone()],
        Kind::Source => keys.sources.clone(),
        Kind::History => vec![keys.history.clone()],
        Kind::Routes => vec![keys.routes()],
        Kind::Flow => vec![keys.flow(0, &super::keys::group_member("acme"))],
        Kind::Ring => keys.rings(),
        Kind::Sched => vec![keys.sched.clone()],
        Kind::Hold => vec![keys.group_hold("acme")],
        Kind::Park => vec![keys.park("g:acme"), keys.park("t:slow")],
        Kind::Result => vec![keys.results_index(), keys.results_bucket(0)],
        Kind::DepsOutbox => vec![keys.deps_outbox()],
        Kind::DepsTask => vec![keys.deps(SOME_OWNER), keys.deps_ended(SOME_OWNER)],
        Kind::DepsWaiting => vec![keys.deps_waiting()],
    }
}

/// `command` as kmqd sends it, on `target` (a key or a channel), with realistic other arguments: Redis finds
/// the keys and channels among the arguments by the command's key specs, so their places must be right.
fn argv(command: &str, target: Option<&str>) -> Vec<String> {
    let t = || target.expect("a command on a key or channel").to_string();
    let name = command.to_ascii_uppercase();
    match command {
        "time" | "multi" | "exec" | "unwatch" | "unsubscribe" | "punsubscribe" => vec![name],
        "wait" => vec![name, "1".into(), "1000".into()],
        "script|load" => vec!["SCRIPT".into(), "LOAD".into(), "return 1".into()],
        "client|setname" => vec!["CLIENT".into(), "SETNAME".into(), "kmqd".into()],
        // A check with no key is EVALSHA without one (the read-only tools' check itself).
        "evalsha" => match target {
            Some(key) => vec![name, "0".repeat(40), "1".into(), key.to_string()],
            None => vec![name, "0".repeat(40), "0".into()],
        },
        "eval" => vec![name, "return 1".into(), "1".into(), t()],
        "zcard" | "hlen" | "hgetall" | "llen" | "lpop" | "type" | "exists" | "del" | "get"
        | "watch" | "subscribe" | "bitcount" | "pttl" => vec![name, t()],
        "getbit" => vec![name, t(), "0".into()],
        "bitop" => vec![name, "OR".into(), t(), t(), t()],
        "setbit" => vec![name, t(), "0".into(), "1".into()],
        // The key as the source and as the destination: the check asks for both reading and writing it.
        "sort" => vec![name, t(), "BY".into(), "nosort".into(), "STORE".into(), t()],
        "memory|usage" => vec!["MEMORY".into(), "USAGE".into(), t()],
        "zscore" | "zrem" | "hget" | "hdel" | "hmget" | "hexists" | "lpush" | "rpush" | "set"
        | "lindex" | "pexpire" => vec![name, t(), "1".into()],
        "lset" => vec![name, t(), "-1".into(), "1".into()],
        "zscan" | "hscan" => vec![name, t(), "0".into()],
        "publish" => vec![name, t(), "1".into()],
        "zadd" | "hset" | "hsetnx" | "hincrby" | "zrange" | "ltrim" | "lrange" | "lrem" => {
            vec![name, t(), "0".into(), "1".into()]
        }
        "lmpop" => vec![name, "1".into(), t(), "LEFT".into()],
        "blmove" => vec![name, t(), t(), "LEFT".into(), "LEFT".into(), "1".into()],
        "blpop" => vec![name, t(), "1".into()],
        other => unreachable!("no arguments known for {other}: add them to access::argv"),
    }
}

/// Every check of `needs` on the queue of `keys`, each pair once.
fn checks(keys: &QueueKeys, needs: &[(&'static str, On)]) -> Vec<Check> {
    let mut checks: Vec<Check> = Vec::new();
    for &(command, on) in needs {
        let targets = match on {
            On::Nothing => vec![Target::Nothing],
            On::Key(kind) => names(keys, kind).into_iter().map(Target::Key).collect(),
            On::Channel => vec![Target::Channel(keys.delay_channel.clone())],
        };
        for target in targets {
            if checks.iter().any(|c| c.acl == command && c.on == target) {
                continue;
            }
            let argv = argv(
                command,
                match &target {
                    Target::Nothing => None,
                    Target::Key(name) | Target::Channel(name) => Some(name),
                },
            );
            checks.push(Check {
                acl: command,
                argv,
                on: target,
            });
        }
    }
    checks
}

/// Whether `text` matches the glob `pattern`, whose only special character is `*` (the rules' patterns).
fn glob_matches(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, rest) = parts.split_first().expect("split yields one part at least");
    let Some(mut text) = text.strip_prefix(first) else {
        return false;
    };
    let Some((last, middle)) = rest.split_last() else {
        return text.is_empty();
    };
    for part in middle {
        match text.find(part) {
            Some(at) => text = &text[at + part.len()..],
            None => return false,
        }
    }
    text.len() >= last.len() && text.ends_with(last)
}

/// The rule to add for a refused command on `target`: `+command`, and the pattern of the role's rules that
/// covers the key or channel (the most specific one).
fn rule_for(role: Role, prefix: &str, acl: &str, target: &Target) -> Vec<String> {
    let mut rule = vec![format!("+{acl}")];
    let pattern = match target {
        Target::Nothing => None,
        Target::Key(name) => role
            .key_patterns()
            .iter()
            .map(|(access, pattern)| (format!("{access}{prefix}:{pattern}"), pattern))
            .filter(|(_, pattern)| glob_matches(&format!("{prefix}:{pattern}"), name))
            .max_by_key(|(_, pattern)| pattern.len())
            .map(|(rule, _)| rule),
        Target::Channel(name) => role
            .channel_patterns()
            .iter()
            .filter(|pattern| glob_matches(&format!("{prefix}:{pattern}"), name))
            .max_by_key(|pattern| pattern.len())
            .map(|pattern| format!("&{prefix}:{pattern}")),
    };
    // A key outside kmqd's prefix (a source list, named by its producers) has no pattern of the roles': the rule
    // names the key itself.
    let outside = match target {
        Target::Key(name) if !name.starts_with(&format!("{prefix}:")) => Some(format!("~{name}")),
        _ => None,
    };
    rule.extend(pattern.or(outside));
    rule
}

/// How Redis names a command in messages: `SCRIPT LOAD` for `script|load`.
fn display_name(acl: &str) -> String {
    acl.replace('|', " ").to_ascii_uppercase()
}

fn refusal(check_acl: &str, target: &Target) -> Refusal {
    Refusal {
        command: display_name(check_acl),
        target: match target {
            Target::Nothing => None,
            Target::Key(name) => Some(format!("key {name}")),
            Target::Channel(name) => Some(format!("channel {name}")),
        },
    }
}

/// The prefix the keys were made with (`kmq` of `kmq:{mail}:ready:normal`).
fn prefix_of(keys: &QueueKeys) -> &str {
    let ready = &keys.ready[0];
    &ready[..ready.find(":{").unwrap_or(0)]
}

/// Checks that the connection's user may send everything `action` sends for the queue of `keys`: one call to
/// access.lua (EVALSHA, and SCRIPT LOAD the first time). A refusal is [`BrokerError::Permission`] naming the
/// first refused command, its key or channel, and the rules to add (its `user` is unset: see
/// [`BrokerError::for_user`]); a Redis older than 7.0, which cannot tell, passes with a debug log.
pub fn check(conn: &mut impl ConnectionLike, keys: &QueueKeys, action: Action) -> Result<()> {
    let role = action.role();
    let checks = checks(keys, action.needs());
    let counts: Vec<String> = checks.iter().map(|c| c.argv.len().to_string()).collect();
    let mut args: Vec<&str> = Vec::new();
    for (check, count) in checks.iter().zip(&counts) {
        args.push(count);
        args.extend(check.argv.iter().map(String::as_str));
    }
    // A key of the queue, for a cluster's routing; one every role that writes may write.
    let routing = action.keyed().then_some(keys.ready[0].as_str());
    let mut call = redis::cmd("EVALSHA");
    call.arg(SCRIPTS.access.get_hash());
    match routing {
        Some(key) => call.arg(1).arg(key),
        None => call.arg(0),
    };
    call.arg(&args);
    let mut reply = call.query::<Value>(conn);
    if matches!(&reply, Err(error) if error.code() == Some("NOSCRIPT")) {
        reply = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(sources::ACCESS)
            .query::<String>(conn)
            .and_then(|_| call.query::<Value>(conn));
    }
    let prefix = prefix_of(keys);
    let refused: Vec<i64> = match reply {
        Err(error) if error.code() == Some("NOPERM") => {
            return Err(refused_check(&error, role, prefix, routing));
        }
        // A client that has not logged in gets a protocol error, not NOAUTH, for a command of more than 10
        // arguments (Redis 6.2.6+), and is disconnected: it is the missing password all the same.
        Err(error) if error.to_string().contains("unauthenticated") => {
            return Err(redis::RedisError::from((
                redis::ErrorKind::AuthenticationFailed,
                "NOAUTH",
                format!("authentication required ({error})"),
            ))
            .into());
        }
        Err(error) => return Err(error.into()),
        Ok(Value::Int(-1)) => {
            tracing::debug!(
                "this Redis has no redis.acl_check_cmd (older than 7.0): the ACL check at start is skipped"
            );
            return Ok(());
        }
        Ok(Value::Array(items)) => items
            .iter()
            .map(|item| super::int(item, "access"))
            .collect::<Result<_>>()?,
        Ok(other) => {
            return Err(super::reply_error(
                "access",
                format!("expected a list, got {other:?}"),
            ));
        }
    };
    let check_at = |number: i64| {
        checks
            .get((number.unsigned_abs() as usize).wrapping_sub(1))
            .ok_or_else(|| super::reply_error("access", format!("no check {number}")))
    };
    if let Some(&unknown) = refused.iter().find(|number| **number < 0) {
        return Err(BrokerError::UnknownCommand {
            command: display_name(check_at(unknown)?.acl),
        });
    }
    if refused.is_empty() {
        return Ok(());
    }
    let mut hint: Vec<String> = Vec::new();
    let mut refusals = Vec::new();
    for number in refused {
        let check = check_at(number)?;
        for rule in rule_for(role, prefix, check.acl, &check.on) {
            if !hint.contains(&rule) {
                hint.push(rule);
            }
        }
        refusals.push(refusal(check.acl, &check.on));
    }
    // Commands first, then patterns, as the rules are written.
    hint.sort_by_key(|rule| !rule.starts_with('+'));
    Err(BrokerError::Permission {
        user: None,
        role,
        refused: refusals,
        hint: hint.join(" "),
    })
}

/// A NOPERM reply to the check itself: the user may not run EVALSHA or SCRIPT LOAD, or not on the queue's key
/// it was sent with. Redis 7.0 says "this user has no permissions to run the 'evalsha' command" or "... to
/// access one of the keys used as arguments"; 7.2 "User U has no permissions to run the 'evalsha' command" or
/// "No permissions to access a key".
fn refused_check(
    error: &redis::RedisError,
    role: Role,
    prefix: &str,
    routing: Option<&str>,
) -> BrokerError {
    let detail = error.detail().unwrap_or_default();
    let quoted = detail.split('\'').nth(1).filter(|_| detail.contains("run"));
    let (acl, target) = match (quoted, routing) {
        (Some(command), _) if command.eq_ignore_ascii_case("script|load") => {
            ("script|load", Target::Nothing)
        }
        (None, Some(key)) if detail.contains("key") => ("evalsha", Target::Key(key.to_string())),
        _ => ("evalsha", Target::Nothing),
    };
    BrokerError::Permission {
        user: None,
        role,
        refused: vec![refusal(acl, &target)],
        hint: rule_for(role, prefix, acl, &target).join(" "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> QueueKeys {
        QueueKeys::new("kmq", "mail", &["high".into(), "low".into()])
    }

    #[test]
    fn the_rules_render_as_one_setuser_line_per_role() {
        let line = setuser_line(Role::Producer, "kmq");
        assert!(
            line.starts_with("ACL SETUSER kmqd-producer reset on >PASSWORD +evalsha +eval "),
            "{line}"
        );
        assert!(
            line.ends_with(
                "~kmq:{*}:dead %R~kmq:{*}:meta %R~kmq:{*}:unique:held:* &kmq:{*}:delay-wake"
            ),
            "{line}"
        );
        assert!(setuser_line(Role::Reader, "jobs").ends_with(" %R~jobs:*"));
        assert!(setuser_line(Role::Daemon, "kmq").ends_with(" ~kmq:* &kmq:*"));
    }

    #[test]
    fn each_action_is_one_of_its_role_s() {
        for action in [
            Action::Serve,
            Action::Push,
            Action::FlowPush,
            Action::Stats,
            Action::Show,
            Action::Cancel,
            Action::DeadRead,
            Action::DeadRequeue,
            Action::DeadPurge,
            Action::Pause,
            Action::Resume,
            Action::Workers,
            Action::History,
        ] {
            assert!(action.role().actions().contains(&action), "{action:?}");
        }
    }

    /// Every command a check asks for has a row of the rules: a role's line gives the commands of its checks that
    /// have one ([`Command::given_to`]), so a command without one would be checked and never given. And no role is
    /// listed as needing a command unchecked that a check of its asks for (the list would say something false).
    #[test]
    fn every_checked_command_has_a_row_and_none_is_listed_unchecked_for_a_role_checked_for_it() {
        for role in Role::ALL {
            for (name, _) in role.needs() {
                assert!(
                    COMMANDS.iter().any(|command| command.name == *name),
                    "{role:?} is checked for {name}, which has no row in COMMANDS"
                );
            }
        }
        for command in COMMANDS {
            for role in command.unchecked {
                assert!(
                    !role.needs().any(|(name, _)| *name == command.name),
                    "{} is listed unchecked for {role:?}, whose checks ask for it",
                    command.name
                );
            }
        }
    }

    /// Every key and channel a role is checked on is covered by its own patterns, so the documented rules pass
    /// the check (the integration tests prove it on a real Redis).
    #[test]
    fn every_checked_key_and_channel_is_covered_by_the_role_s_patterns() {
        let keys = queue();
        for role in Role::ALL {
            for check in checks(&keys, &role.needs().copied().collect::<Vec<_>>()) {
                let rule = rule_for(role, "kmq", check.acl, &check.on);
                let wanted = if check.on == Target::Nothing { 1 } else { 2 };
                assert_eq!(
                    rule.len(),
                    wanted,
                    "{role:?}: {:?} on {:?}",
                    check.acl,
                    check.on
                );
            }
        }
        assert_eq!(
            rule_for(
                Role::Operator,
                "kmq",
                "lrem",
                &Target::Key(keys.ready[1].clone())
            ),
            ["+lrem", "~kmq:{*}:ready:*"],
            "the most specific pattern"
        );
        assert_eq!(
            rule_for(
                Role::Producer,
                "kmq",
                "hincrby",
                &Target::Key(keys.owners.clone())
            ),
            ["+hincrby"],
            "a producer has no pattern for the owners"
        );
    }

    #[test]
    fn globs_match_as_redis_does_for_stars() {
        assert!(glob_matches("kmq:*", "kmq:{a}:ready:x"));
        assert!(glob_matches("kmq:{*}:ready:*", "kmq:{a}:ready:normal"));
        assert!(!glob_matches(
            "kmq:{*}:ready:*",
            "kmq:{a}:processing:o:ready"
        ));
        assert!(glob_matches("kmq:{*}:wake", "kmq:{a}:wake"));
        assert!(!glob_matches("kmq:{*}:wake", "kmq:{a}:wake:x"));
        assert!(!glob_matches("kmq:{*}:delayed:*", "kmq:{a}:delayed-tasks"));
        assert!(glob_matches("a*a", "aa") && !glob_matches("a*a", "a"));
    }

    /// The commands each script runs, from its source.
    fn script_commands(source: &str) -> Vec<String> {
        let mut found: Vec<String> = source
            .replace("redis.pcall('", "redis.call('")
            .split("redis.call('")
            .skip(1)
            .map(|rest| {
                let name = rest[..rest.find('\'').expect("a quoted name")].to_ascii_lowercase();
                // A container command's rule names its subcommand, as ACL does: `memory|usage`.
                match rest[name.len()..].strip_prefix("', '") {
                    Some(sub) if name == "memory" => {
                        let sub = &sub[..sub.find('\'').expect("a quoted subcommand")];
                        format!("{name}|{}", sub.to_ascii_lowercase())
                    }
                    _ => name,
                }
            })
            .collect();
        found.sort_unstable();
        found.dedup();
        found
    }

    /// A command added to a script without a rule would fail only when that script runs: caught here.
    #[test]
    fn every_command_a_role_s_scripts_run_is_checked() {
        let daemon = [
            sources::CLAIM,
            sources::ADOPT,
            sources::POP,
            sources::TAKE,
            sources::RELEASE_UNIQUE,
            sources::SETTLE,
            sources::RENEW,
            sources::REGISTER,
            sources::RELEASE,
            sources::PROMOTE,
            sources::FIRE,
            sources::DRAIN,
            sources::MOVE,
            sources::FLOW_APPLY,
            sources::FLOW_OUTBOX,
        ];
        let cases: [(Role, &[&str]); 3] = [
            (Role::Daemon, &daemon),
            (
                Role::Producer,
                &[super::super::PUSH_SCRIPT, sources::FLOW_PUSH],
            ),
            (
                Role::Operator,
                &[sources::REMOVE, sources::DEAD_REQUEUE, sources::DEAD_PURGE],
            ),
        ];
        for (role, scripts) in cases {
            let needs: Vec<_> = role.needs().copied().collect();
            for script in scripts {
                for command in script_commands(script) {
                    if role == Role::Producer
                        && *script == super::super::PUSH_SCRIPT
                        && matches!(
                            command.as_str(),
                            "type" | "hget" | "hset" | "zscore" | "exists"
                        )
                    {
                        assert!(
                            script.contains(&format!(
                                "redis.acl_check_cmd('{}'",
                                command.to_uppercase()
                            )),
                            "push.lua runs {command} only when the user may"
                        );
                        continue;
                    }
                    assert!(
                        needs.iter().any(|(name, _)| *name == command),
                        "{role:?} runs {command} in a script but is not checked for it"
                    );
                }
            }
        }
    }

    /// The same for the commands sent from Rust: each has a rule of the roles', or of a Redis Cluster's
    /// additions (PING and CLUSTER SLOTS ask the seeds why a cluster client could not connect; the pool's PING
    /// never runs, `test_on_check_out(false)`), but CONFIG: `eviction::read` sends CONFIG GET only where INFO
    /// was refused, and the rules leave it out (it reads every setting, `masterauth` included).
    #[test]
    fn every_command_sent_from_rust_has_a_rule() {
        let sources = [
            include_str!("tasks.rs"),
            include_str!("owners.rs"),
            include_str!("levels.rs"),
            include_str!("stats.rs"),
            include_str!("lookup.rs"),
            include_str!("dead.rs"),
            include_str!("schedule.rs"),
            include_str!("mod.rs"),
            include_str!("connection.rs"),
            include_str!("admin.rs"),
            include_str!("eviction.rs"),
            include_str!("workflow.rs"),
        ];
        for source in sources {
            for rest in source.split("cmd(\"").skip(1) {
                let command = rest[..rest.find('"').expect("a quoted name")].to_ascii_lowercase();
                if command == "config" {
                    continue;
                }
                let in_cluster_rules = CLUSTER_RULES
                    .iter()
                    .any(|rule| rule[1..].split('|').next() == Some(command.as_str()));
                assert!(
                    COMMANDS
                        .iter()
                        .any(|c| c.name.split('|').next() == Some(command.as_str()))
                        || in_cluster_rules,
                    "{command} is sent from Rust but has no rule"
                );
            }
        }
    }

    #[test]
    fn every_check_has_its_arguments() {
        let keys = queue();
        for role in Role::ALL {
            let checks = checks(&keys, &role.needs().copied().collect::<Vec<_>>());
            assert!(checks.iter().all(|c| !c.argv.is_empty()));
        }
        let daemon = checks(&keys, Action::Serve.needs());
        let blmove = daemon.iter().find(|c| c.acl == "blmove").unwrap();
        assert_eq!(
            blmove.argv,
            [
                "BLMOVE",
                "kmq:{mail}:ready:high",
                "kmq:{mail}:ready:high",
                "LEFT",
                "LEFT",
                "1"
            ]
        );
        assert_eq!(prefix_of(&keys), "kmq");
    }

    /// A daemon's user needs its source lists too, which its documented line (`~kmq:*`) does not cover: the
    /// check asks for every command the mover sends on each of them, and the rule to add names the key.
    #[test]
    fn source_lists_are_checked_and_their_rule_names_the_key() {
        let mut keys = queue();
        keys.sources = vec!["queue:email".into()];
        let on_source: Vec<&str> = checks(&keys, Action::Serve.needs())
            .into_iter()
            .filter(|check| check.on == Target::Key("queue:email".into()))
            .map(|check| check.acl)
            .collect();
        assert_eq!(on_source, ["blmove", "evalsha", "type", "lpop"]);
        assert_eq!(
            rule_for(
                Role::Daemon,
                "kmq",
                "lpop",
                &Target::Key("queue:email".into())
            ),
            ["+lpop", "~queue:email"]
        );
        assert!(
            checks(&queue(), Action::Serve.needs())
                .iter()
                .all(|check| check.on != Target::Key("queue:email".into())),
            "no source, no check"
        );
    }

    #[test]
    fn a_refusal_names_the_command_its_key_and_what_to_add() {
        let message = describe(
            Some("kmqd"),
            Role::Daemon,
            &[
                refusal("blmove", &Target::Key("kmq:{emails}:ready:normal".into())),
                refusal("lmpop", &Target::Key("kmq:{emails}:ready:normal".into())),
                refusal("script|load", &Target::Nothing),
            ],
            "+blmove +lmpop +script|load ~kmq:*",
        );
        assert_eq!(
            message,
            "Redis user \"kmqd\" may not run BLMOVE on key kmq:{emails}:ready:normal (also refused: LMPOP, \
             SCRIPT LOAD): add \"+blmove +lmpop +script|load ~kmq:*\" to its ACL rules (the daemons' rules: \
             docs/OPERATIONS.md, \"ACL rules\")"
        );
    }

    /// docs/OPERATIONS.md quotes the rules: each role's line and each command's row, word for word.
    #[test]
    fn the_docs_quote_the_rules() {
        let docs = include_str!("../../docs/OPERATIONS.md");
        for role in Role::ALL {
            let line = setuser_line(role, "kmq");
            assert!(
                docs.lines().any(|l| l == line),
                "docs/OPERATIONS.md, \"ACL rules\", must have the line\n{line}"
            );
        }
        for role in Role::ALL {
            let line = sentinel_setuser_line(role);
            assert!(
                docs.lines().any(|l| l == line),
                "docs/OPERATIONS.md, \"ACL rules\", must have the line\n{line}"
            );
        }
        for additions in [CLUSTER_RULES, SENTINEL_MASTER_RULES] {
            let quoted = format!("`{}`", additions.join(" "));
            assert!(
                docs.contains(&quoted),
                "docs/OPERATIONS.md, \"ACL rules\", must quote {quoted}"
            );
        }
        for row in doc_rows() {
            assert!(
                docs.lines().any(|l| l == row),
                "docs/OPERATIONS.md, \"ACL rules\", must have the row\n{row}"
            );
        }
    }

    /// The rows of the docs' table of commands: `| command | roles | why |`.
    fn doc_rows() -> Vec<String> {
        COMMANDS
            .iter()
            .map(|command| {
                let roles: Vec<&str> = Role::ALL
                    .iter()
                    .filter(|role| command.given_to(**role))
                    .map(|role| role.user())
                    .collect();
                // A `|` inside a code span still ends a table cell unless escaped.
                format!(
                    "| `{}` | {} | {} |",
                    command.name.replace('|', "\\|"),
                    roles.join(", "),
                    command.why.split_whitespace().collect::<Vec<_>>().join(" ")
                )
            })
            .collect()
    }
}
