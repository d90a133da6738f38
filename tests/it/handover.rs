//! The slot handed over in the settle (issue 33; handover.lua, docs/design/flow-control.md, "The slot handed over
//! in the settle"): the owner's settle that frees a `max_running` slot claims the next task for it in the same
//! script step. Driven through the broker, as an acker would send it.

use std::sync::Arc;
use std::time::Duration;

use kmqd::broker::{self, SettleOp};
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
        let redis = RedisServer::start();
        let dir = TestDir::new();
        let path = dir.config(&redis, &safe(extra));
        let config = Config::load(&path).unwrap();
        let queue = context(&config);
        let tasks: Vec<NewTask> = (0..n)
            .map(|i| NewTask::new("test", "{}").unwrap().id(format!("t{i}")))
            .collect();
        client(&path).push_batch("jobs", tasks).unwrap();
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
        let limits = broker::ClaimLimits {
            daemon: "test:0",
            ..self.queue.claim_limits()
        };
        let call = broker::Call {
            settler: "handover-acker",
            number: 1,
        };
        broker::settle_handing_over(
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
