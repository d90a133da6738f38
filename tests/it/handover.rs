//! The slot handed over in the settle (issue 33; handover.lua, docs/design/flow-control.md, "The slot handed over
//! in the settle"): the owner's settle that frees a `max_running` slot claims the next task for it in the same
//! script step. Driven through the broker, as an acker would send it.

use std::sync::Arc;
use std::time::Duration;

use kmqd::broker::{self, SettleOp, Settlement};
use kmqd::queue::QueueContext;
use kmqd::{Config, NewTask};

use crate::safe_mode::{context, dead_daemon_claims, monitor, safe, settlement_of};
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

/// A queue `jobs` with `extra` config, `n` tasks `t0`, `t1`, ... pushed, and `OWNER` registered with a lease of
/// `lease`, having claimed up to `max` tasks, or what the limit lets it (claim numbers from 0 to 99). The wake
/// list is emptied after (the pushes left a marker), so that a test sees the settle's.
fn claimed(
    redis: &RedisServer,
    dir: &TestDir,
    extra: &str,
    (n, max): (usize, usize),
    lease: Duration,
) -> (Config, Arc<QueueContext>, broker::Batch) {
    let path = dir.config(redis, &safe(extra));
    let config = Config::load(&path).unwrap();
    let queue = context(&config);
    let tasks: Vec<NewTask> = (0..n)
        .map(|i| NewTask::new("test", "{}").unwrap().id(format!("t{i}")))
        .collect();
    client(&path).push_batch("jobs", tasks).unwrap();
    let batch = dead_daemon_claims(&mut redis.connection(), &queue, OWNER, 0, max, lease);
    redis.cmd::<()>(&["DEL", "kmq:{jobs}:wake"]);
    (config, queue, batch)
}

/// Call `number` of the acker `handover-acker`: `settlements`, handing the freed slots over to claim `claim` of up
/// to `max` tasks.
fn settle_handing_over(
    connection: &mut broker::Conn,
    queue: &QueueContext,
    number: u64,
    settlements: &[Settlement],
    claim: u64,
    max: usize,
) -> broker::Result<(broker::Settled, Option<broker::Batch>)> {
    let limits = broker::ClaimLimits {
        daemon: "test:0",
        ..queue.claim_limits()
    };
    let call = broker::Call {
        settler: "handover-acker",
        number,
    };
    broker::settle_handing_over(
        connection,
        &queue.keys,
        &call,
        queue.config.dead_max,
        &Arc::from(OWNER),
        settlements,
        &broker::Handover {
            claim,
            max,
            limits: &limits,
        },
    )
}

#[test]
fn a_settle_at_max_running_claims_the_next_task_for_the_slot_it_frees_with_no_marker() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let (_, queue, batch) = claimed(
        &redis,
        &dir,
        "max_running = 2",
        (5, 100),
        Duration::from_secs(60),
    );
    assert_eq!(ids(&batch), ["t0", "t1"]);
    assert_eq!(running(&redis), 2);
    let mut connection = redis.connection();
    let (settled, handed) = settle_handing_over(
        &mut connection,
        &queue,
        1,
        &[settlement_of(&batch, 0, SettleOp::Ack)],
        100,
        4,
    )
    .unwrap();
    assert_eq!(settled.stale_acks, 0);
    let handed = handed.expect("the freed slot's task");
    // One slot freed, one task claimed for it though the daemon had workers for four: the limit holds.
    assert_eq!(ids(&handed), ["t2"]);
    assert_eq!(running(&redis), 2, "the slot passed from t0 to t2");
    assert_eq!(redis.ids_in("kmq:{jobs}:ready:normal"), ["t3", "t4"]);
    let markers: u64 = redis.cmd(&["LLEN", "kmq:{jobs}:wake"]);
    assert_eq!(markers, 0, "no wake-up marker for a slot the settle filled");
    let done: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:stats", "done"]);
    assert_eq!(done, Some(1));
}

/// Without the stored claim in the settle's result, the call sent again after a lost reply would claim again: a
/// second task taken for one slot, stranded under the owner (its daemon never hears of it) and counted.
#[test]
fn a_handover_settle_sent_again_after_a_lost_reply_answers_the_same_task_and_claims_nothing_more() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let (_, queue, batch) = claimed(
        &redis,
        &dir,
        "max_running = 2",
        (5, 100),
        Duration::from_secs(60),
    );
    let mut connection = redis.connection();
    let acks = [settlement_of(&batch, 0, SettleOp::Ack)];
    let (_, first) = settle_handing_over(&mut connection, &queue, 1, &acks, 100, 4).unwrap();
    let (again, second) = settle_handing_over(&mut connection, &queue, 1, &acks, 100, 4).unwrap();
    assert!(!again.superseded);
    assert_eq!(ids(&first.unwrap()), ["t2"]);
    assert_eq!(ids(&second.unwrap()), ["t2"], "the same claim, read again");
    assert_eq!(running(&redis), 2);
    assert_eq!(redis.ids_in("kmq:{jobs}:ready:normal"), ["t3", "t4"]);
    let done: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:stats", "done"]);
    assert_eq!(done, Some(1), "applied once");
}

/// A daemon killed right after a settle that handed a task over: the task is under its owner's lease like any
/// claim's, recovered by the monitors when the lease runs out, and its slot comes back.
#[test]
fn a_task_handed_over_to_a_daemon_that_dies_is_recovered_and_its_slot_comes_back() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    // Long enough for the settle's claim to find the lease live on a loaded host; the test then waits it out.
    let lease = Duration::from_secs(3);
    let (config, queue, batch) = claimed(&redis, &dir, "max_running = 2", (5, 100), lease);
    let mut connection = redis.connection();
    let acks = [settlement_of(&batch, 0, SettleOp::Ack)];
    let (_, handed) = settle_handing_over(&mut connection, &queue, 1, &acks, 100, 4).unwrap();
    assert_eq!(ids(&handed.unwrap()), ["t2"]);
    eventually(Duration::from_secs(30), "the lease to run out", || {
        let (now, owners) = broker::owners(&mut connection, &queue.keys).unwrap();
        (owners.iter().all(|(_, deadline)| *deadline <= now), owners)
    });
    let recovered = monitor(&config, &queue, "handover").recover_now();
    assert_eq!(recovered, 2, "t1 and the handed-over t2");
    assert_eq!(running(&redis), 0, "both slots back");
    let mut ready = redis.ids_in("kmq:{jobs}:ready:normal");
    ready.sort();
    assert_eq!(ready, ["t1", "t2", "t3", "t4"]);
}

#[test]
fn a_settle_of_a_queue_without_max_running_claims_nothing_for_its_slots() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let (_, queue, batch) = claimed(&redis, &dir, "", (5, 3), Duration::from_secs(60));
    assert_eq!(batch.tasks.len(), 3);
    let mut connection = redis.connection();
    let acks = [settlement_of(&batch, 0, SettleOp::Ack)];
    let (settled, handed) = settle_handing_over(&mut connection, &queue, 1, &acks, 100, 4).unwrap();
    assert_eq!(settled.stale_acks, 0);
    assert!(handed.is_none(), "no slot of a limit freed");
    assert_eq!(redis.ids_in("kmq:{jobs}:ready:normal"), ["t3", "t4"]);
}

/// The claim's checks run before the settle's first write: a claim key of the wrong type fails the call whole.
#[test]
fn a_handover_settle_whose_claim_list_key_is_no_list_applies_nothing() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let (_, queue, batch) = claimed(
        &redis,
        &dir,
        "max_running = 2",
        (5, 100),
        Duration::from_secs(60),
    );
    let list = queue.keys.claim_lists(OWNER, 100)[0].clone();
    redis.cmd::<()>(&["SET", &list, "x"]);
    let mut connection = redis.connection();
    let acks = [settlement_of(&batch, 0, SettleOp::Ack)];
    let Err(error) = settle_handing_over(&mut connection, &queue, 1, &acks, 100, 4) else {
        panic!("the call applied though a claim key has the wrong type");
    };
    let error = error.to_string();
    assert!(
        error.contains("WRONGTYPE")
            && error.contains("claim.lua: ")
            && error.contains("is a string, not a list"),
        "{error}"
    );
    assert_eq!(running(&redis), 2);
    let done: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:stats", "done"]);
    assert_eq!(done, None, "nothing applied");
    // Once the key is fixed, the same call applies and hands over.
    redis.cmd::<()>(&["DEL", &list]);
    let (_, handed) = settle_handing_over(&mut connection, &queue, 1, &acks, 100, 4).unwrap();
    assert_eq!(ids(&handed.unwrap()), ["t2"]);
}

/// An owner whose lease ran out: its settle applies, and the claim takes nothing (LEASELOST inside).
#[test]
fn a_handover_settle_of_an_owner_whose_lease_ran_out_applies_and_claims_nothing() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let (_, queue, batch) = claimed(
        &redis,
        &dir,
        "max_running = 2",
        (5, 100),
        Duration::from_secs(60),
    );
    redis.cmd::<()>(&["ZADD", "kmq:{jobs}:owners", "0", OWNER]);
    let mut connection = redis.connection();
    let acks = [settlement_of(&batch, 0, SettleOp::Ack)];
    let (settled, handed) = settle_handing_over(&mut connection, &queue, 1, &acks, 100, 4).unwrap();
    assert_eq!(settled.stale_acks, 0);
    assert!(handed.is_none());
    assert_eq!(running(&redis), 1);
    assert_eq!(redis.ids_in("kmq:{jobs}:ready:normal"), ["t2", "t3", "t4"]);
    let markers: u64 = redis.cmd(&["LLEN", "kmq:{jobs}:wake"]);
    assert_eq!(markers, 1, "the marker, as without a handover");
}
