//! claim_plain.lua, the claim made for a plain safe-mode queue (src/broker/plain_claim.rs), against claim.lua:
//! from the same database, the same claim sent each way writes the same keys and answers the same batch (Redis's
//! clock and the lease's time left aside). The cases it leaves to claim.lua write nothing before they do, and the
//! claim's answer and writes are claim.lua's.

use std::sync::Arc;
use std::time::Duration;

use kmqd::broker;
use kmqd::queue::QueueContext;

use crate::plain_handover::{dump, keys, queue_with_tasks, restore};
use crate::support::*;

const OWNER: &str = "plain.1";

/// A queue `jobs` (`extra` its config) of its own Redis, with tasks `t0`... pushed (`high`: how many of them at
/// the level `high`, first, the others at the default level) and `OWNER` registered.
struct Case {
    redis: RedisServer,
    _dir: TestDir,
    queue: Arc<QueueContext>,
}

impl Case {
    fn new(extra: &str, (n, high): (usize, usize)) -> Case {
        let (redis, dir, _, queue) = queue_with_tasks(extra, (n, high));
        let info = broker::OwnerInfo {
            mode: "safe".into(),
            levels: queue.config.priorities.clone(),
            ..broker::OwnerInfo::default()
        };
        let registered = broker::register(
            &mut redis.connection(),
            &queue.keys,
            OWNER,
            Duration::from_secs(60),
            &info,
        );
        assert!(registered.unwrap().is_some());
        Case {
            redis,
            _dir: dir,
            queue,
        }
    }

    /// Claim `number` of up to `max` tasks, by claim.lua alone when `generic`.
    fn claim(&self, number: u64, max: usize, generic: bool) -> broker::Result<broker::Batch> {
        let limits = broker::ClaimLimits {
            daemon: "test:0",
            ..self.queue.claim_limits()
        };
        let claim = match generic {
            true => broker::claim_generic,
            false => broker::claim,
        };
        claim(
            &mut self.redis.connection(),
            &self.queue.keys,
            &Arc::from(OWNER),
            number,
            max,
            &limits,
        )
    }
}

fn info_key(case: &Case) -> String {
    case.queue.keys.owner_info(OWNER)
}

/// What a claim answered, as the daemon reads it (its batch, Redis's clock and the lease's time left aside, which
/// the two claims read at two times), with each task's payload; or its error.
fn answer(batch: &broker::Result<broker::Batch>) -> String {
    match batch {
        Ok(batch) => {
            let times = regex::Regex::new(r"(now_ms|lease_left_ms): (Some\()?[0-9]+").unwrap();
            let payloads: Vec<String> = (0..batch.tasks.len())
                .map(|i| String::from_utf8_lossy(batch.payloads.get(i)).into_owned())
                .collect();
            format!(
                "{payloads:?} {}",
                times.replace_all(&format!("{batch:?}"), "$1: _")
            )
        }
        Err(error) => format!("error {error}"),
    }
}

/// Sends claim `number` of up to `max` both ways from the database as it is, and compares the keys each leaves
/// and the answers. `lean`: whether claim_plain.lua makes the claim itself (else it leaves it to claim.lua).
/// Returns the answer, and leaves the database as the claim left it.
fn compare(case: &Case, what: &str, (number, max): (u64, usize), lean: bool) -> String {
    let before = dump(&case.redis);
    case.redis.cmd::<String>(&["CONFIG", "RESETSTAT"]);
    let chosen = case.claim(number, max, false);
    assert_eq!(
        crate::protocol::command_calls(&case.redis, "evalsha"),
        if lean { 1 } else { 2 },
        "{what}: the scripts the claim ran (claim_plain.lua alone, or then claim.lua)"
    );
    let chosen_keys = keys(&case.redis);
    restore(&case.redis, &before);
    let generic = case.claim(number, max, true);
    assert_eq!(answer(&chosen), answer(&generic), "{what}: the answers");
    assert_eq!(chosen_keys, keys(&case.redis), "{what}: the keys written");
    answer(&chosen)
}

/// The claims of a plain queue's fetcher, each compared with claim.lua's from the same database: an idle queue's
/// claim of the task just pushed, a claim of part of a backlog (it passes a wake-up marker on), of all of it, of
/// nothing, a busy owner's (it holds a claim, a marker waits), two priority levels, a claim after an earlier one, a
/// paused queue's.
#[test]
fn a_plain_claim_writes_and_answers_what_claim_lua_does() {
    let case = Case::new("", (1, 0));
    let idle = compare(&case, "an idle queue's task", (1, 4), true);
    assert!(idle.contains(r#"\"id\":\"t0\""#), "{idle}");

    // (Each push left a wake-up marker for idle fetchers: taken away, as a fetcher's wait takes it.)
    let case = Case::new("", (10, 0));
    case.redis.cmd::<()>(&["DEL", "kmq:{jobs}:wake"]);
    let part = compare(&case, "part of a backlog", (1, 4), true);
    assert!(
        part.contains(r#"\"id\":\"t3\""#) && !part.contains("t4"),
        "{part}"
    );
    assert_eq!(
        case.redis.cmd::<u64>(&["LLEN", "kmq:{jobs}:wake"]),
        1,
        "a marker passed on"
    );
    let next = compare(&case, "a busy owner's next claim", (2, 4), true);
    assert!(next.contains(r#"\"id\":\"t7\""#), "{next}");
    let rest = compare(&case, "the rest of it", (3, 4), true);
    assert!(rest.contains(r#"\"id\":\"t9\""#), "{rest}");
    let none = compare(&case, "nothing left", (4, 4), true);
    assert!(none.starts_with("[] "), "{none}");

    // A paused queue's claim (state 3) writes nothing: answered by claim_plain.lua, so that the idle polls of a
    // paused queue cost one script run each.
    let case = Case::new("", (3, 0));
    case.redis.cmd::<()>(&["SET", "kmq:{jobs}:paused", "1"]);
    let paused = compare(&case, "a paused queue", (1, 4), true);
    assert!(
        paused.contains("paused: true") && paused.starts_with("[] "),
        "{paused}"
    );

    let case = Case::new("", (4, 0));
    case.redis.cmd::<()>(&["DEL", "kmq:{jobs}:wake"]);
    compare(&case, "all of it, exactly", (1, 4), true);
    assert_eq!(
        case.redis.cmd::<u64>(&["EXISTS", "kmq:{jobs}:wake"]),
        0,
        "no marker: nothing left"
    );

    let two_levels = "priorities = [\"high\", \"normal\"]\ndefault_priority = \"normal\"";
    let case = Case::new(two_levels, (5, 2));
    let levels = compare(&case, "two levels", (1, 4), true);
    assert!(
        levels.contains("level: 0")
            && levels.contains("level: 1")
            && levels.contains(r#"\"id\":\"t3\""#),
        "the high level's two, then the normal's first two: {levels}"
    );
}

/// The cases claim_plain.lua leaves to claim.lua: it writes nothing before it does, and the claim's answer and
/// writes are claim.lua's (a paused queue that also holds a quarantined task, an owner whose lease ran out, a fenced claim, an owner that ran a
/// quarantined group, a quarantined task, a
/// payload past max_task_bytes, a ready list of another type), and a queue it is not made for goes to claim.lua
/// alone.
#[test]
fn a_claim_claim_plain_lua_is_not_made_for_is_claim_lua_s() {
    let case = Case::new("", (3, 0));
    case.redis.cmd::<()>(&["SET", "kmq:{jobs}:paused", "1"]);
    let quarantine = &case.queue.keys.quarantine[0];
    case.redis
        .cmd::<()>(&["LPUSH", quarantine, r#"{"id":"q","type":"test","data":{}}"#]);
    let paused = compare(
        &case,
        "a paused queue with a quarantined task",
        (1, 4),
        false,
    );
    assert!(paused.contains("paused: true"), "{paused}");

    let case = Case::new("", (3, 0));
    case.redis
        .cmd::<()>(&["ZADD", "kmq:{jobs}:owners", "1", OWNER]);
    let lost = compare(&case, "a lease run out", (1, 4), false);
    assert!(lost.contains("lease ran out"), "{lost}");

    let case = Case::new("", (3, 0));
    case.redis
        .cmd::<()>(&["HSET", &info_key(&case), "floor", "5"]);
    let fenced = compare(&case, "a claim below the floor", (1, 4), false);
    assert!(fenced.contains("fenced off"), "{fenced}");

    let case = Case::new("", (3, 0));
    case.redis
        .cmd::<()>(&["HSET", &info_key(&case), "group", "8"]);
    let after_group = compare(
        &case,
        "an owner that ran a quarantined group",
        (1, 4),
        false,
    );
    assert!(after_group.contains(r#"\"id\":\"t0\""#), "{after_group}");
    assert_eq!(
        case.redis
            .cmd::<u64>(&["HEXISTS", &info_key(&case), "group"]),
        0,
        "the group's mark cleared by claim.lua"
    );

    let case = Case::new("", (3, 0));
    let quarantine = &case.queue.keys.quarantine[0];
    case.redis
        .cmd::<()>(&["LPUSH", quarantine, r#"{"id":"q","type":"test","data":{}}"#]);
    let group = compare(&case, "a quarantined task", (1, 4), false);
    assert!(
        group.contains(r#"\"id\":\"q\""#) && group.contains("Group"),
        "{group}"
    );

    let case = Case::new("max_task_bytes = 1024", (0, 0));
    let ready = &case.queue.keys.ready[0];
    let large = format!(
        r#"{{"id":"large","type":"test","data":"{}"}}"#,
        "x".repeat(2000)
    );
    case.redis.cmd::<()>(&["RPUSH", ready, &large]);
    case.redis
        .cmd::<()>(&["RPUSH", ready, r#"{"id":"small","type":"test","data":{}}"#]);
    let dead = compare(&case, "a payload past max_task_bytes", (1, 4), false);
    assert!(
        dead.contains(r#"\"id\":\"small\""#) && !dead.contains(r#"\"id\":\"large\""#),
        "{dead}"
    );
    assert_eq!(case.redis.cmd::<u64>(&["LLEN", "kmq:{jobs}:dead"]), 1);

    let case = Case::new("", (0, 0));
    case.redis
        .cmd::<()>(&["SET", &case.queue.keys.ready[0], "not a list"]);
    let wrong = compare(&case, "a ready list of another type", (1, 4), false);
    assert!(wrong.contains("WRONGTYPE"), "{wrong}");

    let case = Case::new("max_running = 5", (3, 0));
    case.redis.cmd::<String>(&["CONFIG", "RESETSTAT"]);
    let limited = case.claim(1, 4, false).unwrap();
    assert_eq!(limited.tasks.len(), 3);
    assert_eq!(
        case.redis
            .cmd::<String>(&["HGET", "kmq:{jobs}:running", "q"]),
        "3",
        "counted by claim.lua"
    );
    assert_eq!(
        crate::protocol::command_calls(&case.redis, "evalsha"),
        1,
        "a queue with max_running: claim.lua alone"
    );
}
