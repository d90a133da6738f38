//! The slot handed over in the settle (issue 33; handover.lua, docs/design/flow-control.md, "The slot handed over
//! in the settle"): the owner's settle that frees a `max_running` slot claims the next task for it in the same
//! script step. Driven through the broker, as an acker would send it, then through a daemon, whose acker sends
//! it (src/daemon/lane/acker.rs), behind a fault proxy.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kmqd::Config;
use kmqd::broker::{self, SettleOp, sources};
use kmqd::queue::QueueContext;

use crate::limits::{assert_drained_to_zero, counter, most_started_within};
use crate::safe_mode::{dead_daemon_claims, monitor, settlement_of};
use crate::support::proxy::{AfterDrop, Fault, FaultProxy, Matcher};
use crate::support::*;

const OWNER: &str = "handover.1";

/// The running count of the queue `jobs` (0 when absent).
fn running(redis: &RedisServer) -> u64 {
    let count: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:running", "q"]);
    count.unwrap_or(0)
}

/// The ids of a batch's tasks, in order.
fn ids(batch: &broker::Batch) -> Vec<String> {
    (0..batch.tasks.len())
        .map(|i| {
            let payload = std::str::from_utf8(batch.payloads.get(i)).unwrap();
            kmqd::task::Envelope::decode(payload)
                .unwrap()
                .id
                .unwrap()
                .to_string()
        })
        .collect()
}

/// A queue `jobs` of its own Redis, with `n` tasks `t0`, `t1`, ... pushed, and `OWNER` registered, having claimed
/// up to `max` tasks or what the limit lets it (claim numbers from 0 to 99). The wake list is emptied after (the
/// pushes left a marker), so that a test sees the settle's.
struct Claimed {
    redis: RedisServer,
    _dir: TestDir,
    config: Config,
    queue: Arc<QueueContext>,
    batch: broker::Batch,
}

impl Claimed {
    fn new(extra: &str, (n, max): (usize, usize), lease: Duration) -> Claimed {
        let (redis, dir, config, queue) = crate::plain_handover::queue_with_tasks(extra, (n, 0));
        let batch = dead_daemon_claims(&mut redis.connection(), &queue, OWNER, 0, max, lease);
        redis.cmd::<()>(&["DEL", "kmq:{jobs}:wake"]);
        Claimed {
            redis,
            _dir: dir,
            config,
            queue,
            batch,
        }
    }

    /// Five tasks under `max_running = 2`, two of them claimed, under a lease of a minute.
    fn at_the_limit() -> Claimed {
        Claimed::new("max_running = 2", (5, 100), Duration::from_secs(60))
    }

    /// Call 1 of the acker `handover-acker`: the acknowledgement of the first task claimed, handing the slots it
    /// frees over to claim 100 of up to 4 tasks (the daemon's idle workers).
    fn ack_first(&self) -> broker::Result<(broker::Settled, Option<broker::Batch>)> {
        self.ack_first_by(false)
    }

    /// [`Claimed::ack_first`], by settle.lua alone when `generic` (`broker::settle_handing_over_generic`).
    fn ack_first_by(
        &self,
        generic: bool,
    ) -> broker::Result<(broker::Settled, Option<broker::Batch>)> {
        let limits = broker::ClaimLimits {
            daemon: "test:0",
            ..self.queue.claim_limits()
        };
        let call = broker::Call {
            settler: "handover-acker",
            number: 1,
        };
        let settle = match generic {
            true => broker::settle_handing_over_generic,
            false => broker::settle_handing_over,
        };
        settle(
            &mut self.redis.connection(),
            &self.queue.keys,
            &call,
            self.queue.config.dead_max,
            &Arc::from(OWNER),
            &[settlement_of(&self.batch, 0, SettleOp::Ack)],
            &broker::Handover {
                claim: 100,
                max: 4,
                limits: &limits,
            },
        )
    }

    fn ready(&self) -> Vec<String> {
        self.redis.ids_in("kmq:{jobs}:ready:normal")
    }

    fn done(&self) -> Option<u64> {
        self.redis.cmd(&["HGET", "kmq:{jobs}:stats", "done"])
    }

    fn markers(&self) -> u64 {
        self.redis.cmd(&["LLEN", "kmq:{jobs}:wake"])
    }
}

#[test]
fn a_settle_at_max_running_claims_the_next_task_for_the_slot_it_frees_with_no_marker() {
    let at = Claimed::at_the_limit();
    assert_eq!(ids(&at.batch), ["t0", "t1"]);
    assert_eq!(running(&at.redis), 2);
    let (settled, handed) = at.ack_first().unwrap();
    assert_eq!(settled.stale_acks, 0);
    let handed = handed.expect("the freed slot's task");
    // One slot freed, one task claimed for it though the daemon had workers for four: the limit holds.
    assert_eq!(ids(&handed), ["t2"]);
    assert_eq!(running(&at.redis), 2, "the slot passed from t0 to t2");
    assert_eq!(at.ready(), ["t3", "t4"]);
    assert_eq!(
        at.markers(),
        0,
        "no wake-up marker for a slot the settle filled"
    );
    assert_eq!(at.done(), Some(1));
}

/// A settle of acknowledgements at the limit looks at the claim's keys once, before its first write, and its claim
/// takes what the settle has read and checked already. The claim after the settle's writes uses what its own dry run
/// found (`claim_run`'s `checked`: the owner's lease and info, the keys found absent), where it looked at them all
/// again; both runs use what the settle found (`claim_run`'s `given`): the running count (before the settle's writes
/// for the checks, after them for the claim: the slot passes on under the limit), the time, the stats hash's
/// counters, the types of the wake list and the owner's claim set, and the owner's info hash (the claim's read of it
/// is the settle's type check too). The settle reads its claim's length and settled bits before its writes, as their
/// type checks. Without `checked` the call read the lease twice; without `given` and those reads, it read the running
/// hash three times, Redis's clock twice, and made ten TYPEs (docs/PERFORMANCE.md, "Where a slot's turnaround goes,
/// stage by stage", and "Slots in step, settles in parallel, and the claim after a settle").
#[test]
fn a_handover_settle_reads_the_lease_the_running_count_and_the_clock_once() {
    let at = Claimed::at_the_limit();
    at.redis.cmd::<String>(&["CONFIG", "RESETSTAT"]);
    let (_, handed) = at.ack_first_by(true).unwrap();
    assert_eq!(ids(&handed.expect("the freed slot's task")), ["t2"]);
    let calls = |command| crate::protocol::command_calls(&at.redis, command);
    assert_eq!(
        calls("zscore"),
        1,
        "the lease's ZSCOREs of one handover settle"
    );
    // The stats hash's counters, the running count, the owner's info: one HMGET each.
    assert_eq!(calls("hmget"), 3, "the HMGETs of one handover settle");
    assert_eq!(calls("time"), 1, "the TIMEs of one handover settle");
    assert_eq!(calls("type"), 5, "the TYPEs of one handover settle");
    assert_eq!(
        calls("hget"),
        0,
        "the claim's own read of the dead-letter count"
    );
    // Read last: `running` reads the hash itself.
    assert_eq!(
        running(&at.redis),
        2,
        "the slot passed from t0 to t2 under the limit"
    );
}

/// handover_plain.lua, which a plain queue's acknowledgements go to: one run of it (settle.lua is not asked), its
/// keys read once each, the reads their own type checks (no TYPE), Redis's clock read once, and 23 commands in
/// all, where settle.lua's handover makes 29 (docs/PERFORMANCE.md, "A settle made for the handover of a plain
/// queue").
#[test]
fn a_plain_handover_settle_is_one_script_run_that_reads_each_key_once() {
    let at = Claimed::at_the_limit();
    for (_, body) in sources::ALL {
        at.redis.cmd::<String>(&["SCRIPT", "LOAD", body]);
    }
    at.redis.cmd::<String>(&["CONFIG", "RESETSTAT"]);
    let (_, handed) = at.ack_first().unwrap();
    assert_eq!(ids(&handed.expect("the freed slot's task")), ["t2"]);
    let calls = |command| crate::protocol::command_calls(&at.redis, command);
    assert_eq!(calls("evalsha"), 1, "one script's run");
    assert_eq!(calls("type"), 0, "the TYPEs of a plain handover settle");
    assert_eq!(calls("time"), 1, "the TIMEs of a plain handover settle");
    assert_eq!(calls("zscore"), 1, "the lease's ZSCOREs");
    assert_eq!(
        calls("hmget"),
        2,
        "the running count's and the owner's HMGETs"
    );
    let info: String = at.redis.cmd(&["INFO", "commandstats"]);
    let commands: u64 = info
        .lines()
        // The script's own commands: not the EVALSHA, nor this test's CONFIG RESETSTAT and INFOs.
        .filter(|line| {
            !["cmdstat_evalsha:", "cmdstat_config|", "cmdstat_info:"]
                .iter()
                .any(|name| line.starts_with(name))
        })
        .filter_map(|line| {
            line.split_once(":calls=")?
                .1
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    // Its own 23 commands, and the transaction's MULTI, LRANGE and EXEC around it.
    assert!(commands <= 26, "{commands} commands: {info}");
    assert_eq!(
        running(&at.redis),
        2,
        "the slot passed from t0 to t2 under the limit"
    );
}

/// Without the stored claim in the settle's result, the call sent again after a lost reply would claim again: a
/// second task taken for one slot, stranded under the owner (its daemon never hears of it) and counted.
#[test]
fn a_handover_settle_sent_again_after_a_lost_reply_answers_the_same_task_and_claims_nothing_more() {
    // A slot free beside the one the settle frees: a claim run again would find room.
    let at = Claimed::new("max_running = 3", (5, 2), Duration::from_secs(60));
    let (_, first) = at.ack_first().unwrap();
    let (again, second) = at.ack_first().unwrap();
    assert!(!again.superseded);
    assert_eq!(ids(&first.unwrap()), ["t2"]);
    assert_eq!(ids(&second.unwrap()), ["t2"], "the same claim, read again");
    assert_eq!(running(&at.redis), 2);
    assert_eq!(at.ready(), ["t3", "t4"]);
    assert_eq!(at.done(), Some(1), "applied once");
}

/// A daemon killed right after a settle that handed a task over: the task is under its owner's lease like any
/// claim's, recovered by the monitors when the lease runs out, and its slot comes back.
#[test]
fn a_task_handed_over_to_a_daemon_that_dies_is_recovered_and_its_slot_comes_back() {
    // Long enough for the settle's claim to find the lease live on a loaded host; the test then waits it out.
    let at = Claimed::new("max_running = 2", (5, 100), Duration::from_secs(3));
    let (_, handed) = at.ack_first().unwrap();
    assert_eq!(ids(&handed.unwrap()), ["t2"]);
    let mut connection = at.redis.connection();
    eventually(Duration::from_secs(30), "the lease to run out", || {
        let (now, owners) = broker::owners(&mut connection, &at.queue.keys).unwrap();
        (owners.iter().all(|(_, deadline)| *deadline <= now), owners)
    });
    let recovered = monitor(&at.config, &at.queue, "handover").recover_now();
    assert_eq!(recovered, 2, "t1 and the handed-over t2");
    assert_eq!(running(&at.redis), 0, "both slots back");
    let mut ready = at.ready();
    ready.sort();
    assert_eq!(ready, ["t1", "t2", "t3", "t4"]);
}

#[test]
fn a_settle_of_a_queue_without_max_running_claims_nothing_for_its_slots() {
    let at = Claimed::new("", (5, 3), Duration::from_secs(60));
    assert_eq!(at.batch.tasks.len(), 3);
    let (settled, handed) = at.ack_first().unwrap();
    assert_eq!(settled.stale_acks, 0);
    assert!(handed.is_none(), "no slot of a limit freed");
    assert_eq!(at.ready(), ["t3", "t4"]);
}

/// The claim's checks run before the settle's first write: a claim key of the wrong type fails the call whole.
#[test]
fn a_handover_settle_whose_claim_list_key_is_no_list_applies_nothing() {
    let at = Claimed::at_the_limit();
    let list = at.queue.keys.claim_lists(OWNER, 100)[0].clone();
    at.redis.cmd::<()>(&["SET", &list, "x"]);
    let Err(error) = at.ack_first() else {
        panic!("the call applied though a claim key has the wrong type");
    };
    let error = error.to_string();
    assert!(
        error.contains("WRONGTYPE")
            && error.contains("settle.lua (its claim.lua): ")
            && error.contains("is a string, not a list"),
        "{error}"
    );
    assert_eq!(running(&at.redis), 2);
    assert_eq!(at.done(), None, "nothing applied");
    // Once the key is fixed, the same call applies and hands over.
    at.redis.cmd::<()>(&["DEL", &list]);
    let (_, handed) = at.ack_first().unwrap();
    assert_eq!(ids(&handed.unwrap()), ["t2"]);
}

/// An owner whose lease ran out: its settle applies, and the claim takes nothing (LEASELOST inside).
#[test]
fn a_handover_settle_of_an_owner_whose_lease_ran_out_applies_and_claims_nothing() {
    let at = Claimed::at_the_limit();
    at.redis
        .cmd::<()>(&["ZADD", "kmq:{jobs}:owners", "0", OWNER]);
    let (settled, handed) = at.ack_first().unwrap();
    assert_eq!(settled.stale_acks, 0);
    assert!(handed.is_none());
    assert_eq!(running(&at.redis), 1);
    assert_eq!(at.ready(), ["t2", "t3", "t4"]);
    assert_eq!(at.markers(), 1, "the marker, as without a handover");
}

/// The settles that hand slots over: handover_plain.lua's calls (a plain queue's, src/broker/plain_handover.rs), and
/// settle.lua's that carry a claim block (handover.lua's trailer, the last argument's name).
fn handover_settles() -> Matcher {
    let settle = Matcher::script(sources::SETTLE);
    let plain = Matcher::script(sources::HANDOVER_PLAIN);
    Matcher::new(move |args| {
        plain.matches(args)
            || (settle.matches(args)
                && args
                    .last()
                    .is_some_and(|last| last.as_slice() == b"handover"))
    })
}

/// A config of `queue` whose daemon reaches `redis` through `proxy`, with a read timeout of 1 s.
fn through(dir: &TestDir, proxy: &FaultProxy, queue: &str) -> PathBuf {
    let redis_section = format!("url = \"{}\"\nio_timeout = \"1s\"", proxy.url());
    dir.config_raw(&redis_section, "shutdown_grace = \"5s\"", queue)
}

/// Drains `count` tasks `t0`... of `sleep_ms` each while sampling Redis's running count; returns the most it read.
fn drain_sampling_running(config: &Path, redis: &RedisServer, count: usize, sleep_ms: u64) -> u64 {
    push_many(config, "t", count, &format!(r#"{{"sleep_ms":{sleep_ms}}}"#));
    let mut most = 0;
    eventually(Duration::from_secs(60), "every task done", || {
        most = most.max(running(redis));
        let s = stats(config, "jobs");
        (s.done >= count as u64, s)
    });
    assert_drained_to_zero(config, redis, count as u64);
    most
}

/// Without the daemon's half every slot's next task came from a fetcher's claim (one a task, behind the settle's
/// wake-up marker); with it the settle that frees a slot claims the next task itself, and the fetcher, waiting
/// in Redis for a marker that no settle which filled its slots pushes, claims only at the start and the end.
#[test]
fn a_daemon_at_max_running_hands_its_slots_over_in_its_settles_and_its_fetcher_rests() {
    const TASKS: usize = 24;
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let config = through(
        &dir,
        &proxy,
        &safe_queue("workers = 4\nmax_running = 2\nidle_poll = \"5s\""),
    );
    let daemon = TestDaemon::start(&config);
    redis.wait_blocked_in("blpop");
    let claims = Matcher::script(sources::CLAIM);
    let before = proxy.seen(&claims);
    let most_counted = drain_sampling_running(&config, &redis, TASKS, 20);
    let (claimed, handed_over) = (
        proxy.seen(&claims) - before,
        proxy.seen(&handover_settles()),
    );
    assert_ran_once(&dir, "t", TASKS);
    assert!(most_counted <= 2, "the count reached {most_counted}");
    let most = most_started_within(&dir, Duration::from_millis(20));
    assert!(most <= 2, "{most} runs started within 20 ms of each other");
    assert!(
        handed_over >= TASKS / 4,
        "{handed_over} settles handed slots over for {TASKS} tasks"
    );
    assert!(
        claimed <= TASKS / 2,
        "{claimed} claims by the fetcher for {TASKS} tasks: the settles did not fill the slots they freed"
    );
    daemon.stop();
}

/// A handover settle whose reply is lost (the connection cut, or gone silent) or late (past the read timeout) is
/// sent again as the same call: it answers the same claim from its stored result, so the tasks it took are
/// adopted, none is run twice or left under the live owner, and no slot leaks.
#[test]
fn a_handover_settle_whose_reply_is_lost_or_late_loses_and_repeats_no_task_and_leaks_no_slot() {
    let faults = [
        Fault::DropReply {
            matching: handover_settles(),
            nth: 2,
            then: AfterDrop::Close,
        },
        Fault::DropReply {
            matching: handover_settles(),
            nth: 2,
            then: AfterDrop::Hang,
        },
        Fault::DelayReply {
            matching: handover_settles(),
            nth: 2,
            delay: Duration::from_secs(2),
        },
    ];
    for fault in faults {
        let redis = RedisServer::start();
        let proxy = FaultProxy::start(&redis);
        let dir = TestDir::new();
        // A lease far longer than the test: a task stranded under the live owner would wait for it.
        let queue =
            safe_queue("workers = 3\nmax_running = 2\nidle_poll = \"5s\"\nlease_timeout = \"60s\"");
        let config = through(&dir, &proxy, &queue);
        let daemon = TestDaemon::start(&config);
        redis.wait_blocked_in("blpop");
        let rule = proxy.add(fault.clone());
        let most_counted = drain_sampling_running(&config, &redis, 12, 20);
        assert_eq!(rule.fired(), 1, "{fault:?}: the fault acted");
        assert!(
            most_counted <= 2,
            "{fault:?}: the count reached {most_counted}"
        );
        assert_ran_once(&dir, "t", 12);
        assert_eq!(
            counter(&redis, "recovered"),
            0,
            "{fault:?}: nothing waited for the lease"
        );
        daemon.stop();
    }
}

/// A daemon killed right after a settle that handed tasks over, before its reply came (held back by the proxy):
/// the tasks it claimed are under the dead owner's lease like any claim's; the monitors recover them once it runs
/// out, the count comes back to 0, and every task runs (at least once: safe mode).
#[test]
fn a_daemon_killed_right_after_a_handover_settle_has_its_tasks_recovered_and_its_slots_back() {
    const TASKS: usize = 10;
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let queue = safe_queue("workers = 2\nmax_running = 2\nlease_timeout = \"1s\"");
    let config = through(&dir, &proxy, &queue);
    let mut first = Process::start(&config, dir.path("first.log"));
    redis.wait_blocked_in("blpop");
    let rule = proxy.add(Fault::DelayReply {
        matching: handover_settles(),
        nth: 1,
        delay: Duration::from_secs(30),
    });
    push_many(&config, "t", TASKS, r#"{"sleep_ms":20}"#);
    eventually(Duration::from_secs(15), "a handover settle ran", || {
        (rule.fired() == 1, rule.fired())
    });
    first.kill9();
    let second = TestDaemon::start(&config);
    assert_drained_to_zero(&config, &redis, TASKS as u64);
    assert!(
        counter(&redis, "recovered") >= 1,
        "the handed-over tasks were recovered"
    );
    let records = dir.records();
    for i in 0..TASKS {
        let id = format!("t{i}");
        assert!(
            records.runs_of(&id) >= 1,
            "{id} never ran: {:?}",
            records.starts
        );
    }
    second.stop();
}

/// A queue without a running limit frees no slot a claim could take: its daemon sends plain settles, without
/// the claim block's keys and arguments.
#[test]
fn a_daemon_of_a_queue_without_limits_never_sends_the_claim_block() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let config = through(&dir, &proxy, &safe_queue("workers = 2"));
    let daemon = TestDaemon::start(&config);
    redis.wait_blocked_in("blpop");
    push_many(&config, "t", 20, r#"{"sleep_ms":5}"#);
    wait_done(&config, 20, Duration::from_secs(30));
    assert_ran_once(&dir, "t", 20);
    assert!(proxy.seen(&Matcher::script(sources::SETTLE)) > 0);
    assert_eq!(proxy.seen(&handover_settles()), 0);
    daemon.stop();
}

/// A type's `max_running` frees slots a settle hands over as the queue's does (the largest of its types'): the
/// limited type's tasks pass their slots on in the settles, each runs once, at most two at once, and the type's
/// count comes back to 0.
#[test]
fn a_daemon_at_a_types_max_running_hands_the_types_slots_over_in_its_settles() {
    const TASKS: usize = 16;
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let queue = safe_queue(
        "workers = 4\nidle_poll = \"5s\"\n[[queues.limits]]\ntype = \"slow\"\nmax_running = 2\n",
    );
    let config = through(&dir, &proxy, &queue);
    dir.testkit_types(&config, &["slow"]);
    let daemon = TestDaemon::start(&config);
    redis.wait_blocked_in("blpop");
    let type_running = || -> u64 {
        let count: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:running", "t:slow"]);
        count.unwrap_or(0)
    };
    push_typed(&config, "slow", "s", TASKS, r#"{"sleep_ms":20}"#);
    let mut most_counted = 0;
    eventually(Duration::from_secs(60), "every task done", || {
        most_counted = most_counted.max(type_running());
        let s = stats(&config, "jobs");
        (s.done >= TASKS as u64 && s.processing == 0, s)
    });
    eventually(
        Duration::from_secs(10),
        "the type's count back to 0",
        || (type_running() == 0, type_running()),
    );
    assert_eq!(counter(&redis, "running_underflow"), 0);
    assert_ran_once(&dir, "s", TASKS);
    assert!(most_counted <= 2, "the type's count reached {most_counted}");
    let handed_over = proxy.seen(&handover_settles());
    assert!(
        handed_over >= TASKS / 4,
        "{handed_over} settles handed the type's slots over for {TASKS} tasks"
    );
    daemon.stop();
}
