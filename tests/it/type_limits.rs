//! Flow control per task type (`[[queues.limits]]`): a type's `max_running` and `rate_limit` across daemons,
//! while the queue's other types run past the tasks they hold back, and the type's count in Redis under the
//! faults that would leak it or count it twice (docs/RELIABILITY.md, "Limits per task type").

use std::path::Path;
use std::time::Duration;

use kmqd::broker::sources;

use crate::support::proxy::AfterDrop;
use crate::support::*;

/// The running count of the type `kind` (0 when the field is absent).
fn running(redis: &RedisServer, kind: &str) -> u64 {
    let count: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:running", &format!("t:{kind}")]);
    count.unwrap_or(0)
}

/// The start times (µs) of the runs whose id starts with `prefix`, sorted.
fn starts_of(dir: &TestDir, prefix: &str) -> Vec<u64> {
    let mut starts: Vec<u64> = dir
        .records()
        .start_times
        .iter()
        .filter(|(id, _)| id.starts_with(prefix))
        .map(|(_, micros)| *micros)
        .collect();
    starts.sort_unstable();
    starts
}

/// The most of `starts` (sorted, µs) within any `window`.
fn most_within(starts: &[u64], window: Duration) -> usize {
    let window = window.as_micros() as u64;
    let (mut most, mut first) = (0, 0);
    for (last, at) in starts.iter().enumerate() {
        while starts[first] + window <= *at {
            first += 1;
        }
        most = most.max(last + 1 - first);
    }
    most
}

/// How many runs of ids starting with `prefix` returned.
fn ended(dir: &TestDir, prefix: &str) -> usize {
    dir.records()
        .ends
        .iter()
        .filter(|(id, ..)| id.starts_with(prefix))
        .count()
}

/// Waits until `done` tasks are done and nothing waits or runs, then checks that the type's count is back to 0,
/// that no count went below 0, and that no flow is left.
fn assert_drained(config: &Path, redis: &RedisServer, done: u64, kind: &str) {
    let s = eventually(Duration::from_secs(60), "the queue drained", || {
        let s = stats(config, "jobs");
        (s.done >= done && s.processing == 0 && s.ready == 0, s)
    });
    assert_eq!(s.done, done, "{s:?}");
    eventually(
        Duration::from_secs(10),
        "the type's count back to 0",
        || (running(redis, kind) == 0, running(redis, kind)),
    );
    let underflow: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:stats", "running_underflow"]);
    assert_eq!(underflow.unwrap_or(0), 0, "no count went below 0");
    let flow: u64 = redis.cmd(&["LLEN", &format!("kmq:{{jobs}}:flow:normal::{kind}")]);
    assert_eq!(flow, 0, "the flow is empty");
}

const SLOW_LIMITED: &str = "workers = 4\nidle_poll = \"100ms\"\n\
                            [[queues.limits]]\ntype = \"slow\"\nmax_running = 2\n";

/// The `popped-running` hashes of the queue's default-mode owners (their shares of the running counts).
fn shares(redis: &RedisServer) -> Vec<String> {
    redis.cmd(&["KEYS", "kmq:{jobs}:popped-running:*"])
}

/// A type limited to 2 running, pushed first, holds back only its own tasks (`queue`, in either mode): across two
/// daemons its count never passes 2 and never more than 2 of its runs overlap, while the queue's other type,
/// pushed behind it, drains first; each task runs once and every count (and default mode's every share) comes
/// back to 0.
fn types_max_running_across_two_daemons(queue: &str) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_for_types(&redis, queue, &["slow", "fast"]);
    let (a, b) = (TestDaemon::start(&config), TestDaemon::start(&config));
    push_typed(&config, "slow", "s", 12, r#"{"sleep_ms":150}"#);
    push_typed(&config, "fast", "f", 40, r#"{"sleep_ms":1}"#);
    let mut most_counted = 0;
    eventually(Duration::from_secs(60), "every fast task done", || {
        most_counted = most_counted.max(running(&redis, "slow"));
        let fast = ended(&dir, "f");
        (fast >= 40, fast)
    });
    // 12 slow tasks of 150 ms, 2 at a time, take 900 ms at the least: the fast ones finished before them.
    let slow_done = ended(&dir, "s");
    assert!(
        slow_done < 12,
        "the fast tasks waited behind the slow ones ({slow_done} slow ran first)"
    );
    eventually(Duration::from_secs(60), "every slow task done", || {
        most_counted = most_counted.max(running(&redis, "slow"));
        let slow = ended(&dir, "s");
        (slow >= 12, slow)
    });
    assert!(most_counted <= 2, "the type's count reached {most_counted}");
    assert_drained(&config, &redis, 52, "slow");
    assert_ran_once(&dir, "s", 12);
    assert_ran_once(&dir, "f", 40);
    let most = most_within(&starts_of(&dir, "s"), Duration::from_millis(150));
    assert!(
        most <= 2,
        "{most} slow runs started within 150 ms of each other"
    );
    assert_eq!(most, 2, "the limit was reached");
    // Default mode: every owner's share of the count given back by the settles.
    eventually(Duration::from_secs(10), "every share given back", || {
        (shares(&redis).is_empty(), shares(&redis))
    });
    a.stop();
    b.stop();
}

#[test]
fn a_types_max_running_holds_across_daemons_and_the_other_types_run_past_it() {
    types_max_running_across_two_daemons(&safe_queue(SLOW_LIMITED));
}

/// Default mode: pop.lua sorts the tasks by type as claim.lua does, and counts the type's under each popping owner.
#[test]
fn a_default_mode_types_max_running_holds_across_daemons_and_the_other_types_run_past_it() {
    types_max_running_across_two_daemons(&default_queue(SLOW_LIMITED));
}

/// A type limited to 5 starts a second, across two daemons: in no second do more than 5 of its tasks start,
/// while the other type's tasks run at once.
#[test]
fn a_types_rate_limit_holds_in_every_window_and_the_other_types_run_past_it() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queue = safe_queue(
        "workers = 4\nidle_poll = \"100ms\"\n[[queues.limits]]\ntype = \"api\"\nrate_limit = \"5/s\"\n",
    );
    let config = dir.config_for_types(&redis, &queue, &["api", "other"]);
    let (a, b) = (TestDaemon::start(&config), TestDaemon::start(&config));
    // 20 starts at 5 a second take 3 s at the least: the other type's 30 no-op tasks, pushed behind them, end
    // well before, however loaded the machine.
    push_typed(&config, "api", "a", 20, "{}");
    push_typed(&config, "other", "o", 30, "{}");
    eventually(Duration::from_secs(30), "every other task done", || {
        let other = ended(&dir, "o");
        (other >= 30, other)
    });
    let api_done = ended(&dir, "a");
    assert!(
        api_done < 20,
        "the other tasks waited behind the rate-limited ones"
    );
    assert_drained(&config, &redis, 50, "api");
    assert_ran_once(&dir, "a", 20);
    let starts = starts_of(&dir, "a");
    // The limit counts claims, on Redis's clock; starts are stamped by the handlers, each up to a dispatch after
    // its claim, and a loaded machine delays one window's dispatch more than the next one's. Half a window keeps
    // the check honest (without the limit, all 20 start within a few milliseconds) while allowing 500 ms of skew.
    let most = most_within(&starts, Duration::from_millis(500));
    assert!(most <= 5, "{most} starts within half a second: {starts:?}");
    a.stop();
    b.stop();
}

/// The type's tasks held back wait in its flow, and `kmqd stats` counts them as ready; a daemon whose config no
/// longer limits the type (a reload, a rolling change) drains the flow as unlimited.
#[test]
fn a_flow_left_by_a_config_that_no_longer_limits_its_type_is_drained() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let limited = dir.config_for_types(&redis, &safe_queue(SLOW_LIMITED), &["slow"]);
    let daemon = TestDaemon::start(&limited);
    let data = serde_json::json!({ "wait_for_file": gate }).to_string();
    push_typed(&limited, "slow", "s", 10, &data);
    // Two run (and wait for the gate); the daemon's next claims move the other eight to the type's flow.
    eventually(Duration::from_secs(15), "eight tasks in the flow", || {
        let flow: u64 = redis.cmd(&["LLEN", "kmq:{jobs}:flow:normal::slow"]);
        (flow == 8, flow)
    });
    let s = stats(&limited, "jobs");
    assert_eq!(s.ready, 8, "the flow's tasks are counted as ready: {s:?}");
    // `kmqd stats` says what holds the type back.
    let out = kmqd_ok(&limited, &["stats"]);
    assert!(
        out.contains("jobs: type \"slow\": running 2/2, held back, 8 waiting"),
        "{out}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&kmqd_ok(&limited, &["stats", "--json"])).unwrap();
    let slow = &json["queues"]["jobs"]["limits"]["types"][0];
    assert_eq!(
        (
            &slow["type"],
            &slow["waiting"],
            &slow["max_running"]["held_back"]
        ),
        (
            &serde_json::json!("slow"),
            &serde_json::json!(8),
            &serde_json::json!(true)
        ),
        "{json}"
    );
    // `kmqd task show` finds a task there, and `cancel` removes it.
    let found = client(&limited).find("jobs", "s9").unwrap();
    assert!(
        matches!(&found[..], [kmqd::broker::Found::Ready { flow: Some(kind), .. }] if kind == "slow"),
        "{found:?}"
    );
    assert_eq!(
        client(&limited).cancel("jobs", "s9").unwrap(),
        1,
        "cancelled"
    );
    std::fs::write(&gate, "").unwrap();
    daemon.stop();
    // Stopped while two ran: they settled; a daemon without the limit takes the other seven from the flow.
    let unlimited = dir.config_for_types(&redis, &safe_queue("workers = 8"), &["slow"]);
    let daemon = TestDaemon::start(&unlimited);
    assert_drained(&unlimited, &redis, 9, "slow");
    assert_ran_once(&dir, "s", 9);
    assert_eq!(
        dir.records().runs_of("s9"),
        0,
        "the cancelled task never ran"
    );
    let ring: u64 = redis.cmd(&["ZCARD", "kmq:{jobs}:ring:normal"]);
    assert_eq!(ring, 0, "the drained flow left its ring");
    daemon.stop();
}

/// A daemon killed with SIGKILL while it runs tasks of a limited type: its slots come back when the monitors
/// recover its tasks, and the type drains on the other daemon.
#[test]
fn a_daemon_killed_while_it_runs_a_limited_type_gives_its_slots_back() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let queue = safe_queue(
        "workers = 2\nlease_timeout = \"1s\"\n[[queues.limits]]\ntype = \"slow\"\nmax_running = 2\n",
    );
    let config = dir.config_for_types(&redis, &queue, &["slow"]);
    let mut first = Process::start(&config, dir.path("first.log"));
    let data = serde_json::json!({ "wait_for_file": gate }).to_string();
    push_typed(&config, "slow", "s", 6, &data);
    eventually(
        Duration::from_secs(15),
        "both of the type's slots taken",
        || (running(&redis, "slow") == 2, running(&redis, "slow")),
    );
    first.kill9();
    std::fs::write(&gate, "").unwrap();
    let second = TestDaemon::start(&config);
    assert_drained(&config, &redis, 6, "slow");
    let recovered: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:stats", "recovered"]);
    assert_eq!(recovered, Some(2));
    second.stop();
}

/// A type-limited queue's daemon through a fault proxy that drops the `nth` reply of `script`: every task
/// drains once, the fault fired, and the type's count and the queue's come back to 0 without going below it
/// (a settle sent again subtracts once; a lost claim is adopted with its counts).
fn drains_with_a_reply_lost(script: &str, nth: usize, then: AfterDrop) {
    let queue = safe_queue(
        "workers = 3\nmax_running = 3\nlease_timeout = \"60s\"\n\
         [[queues.limits]]\ntype = \"slow\"\nmax_running = 1\n",
    );
    let prepare = |dir: &TestDir, config: &Path| dir.testkit_types(config, &["slow", "test"]);
    let drain = |config: &Path, redis: &RedisServer, dir: &TestDir| {
        push_typed(config, "slow", "s", 6, r#"{"sleep_ms":5}"#);
        push_many(config, "t", 6, r#"{"sleep_ms":5}"#);
        assert_drained(config, redis, 12, "slow");
        let queue_count: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:running", "q"]);
        assert_eq!(queue_count.unwrap_or(0), 0, "the queue's count back to 0");
        assert_ran_once(dir, "s", 6);
        assert_ran_once(dir, "t", 6);
    };
    drain_with_a_reply_lost(script, (nth, then), &queue, prepare, drain);
}

#[test]
fn a_settle_whose_reply_is_lost_frees_a_types_slots_once() {
    for then in [AfterDrop::Close, AfterDrop::Hang] {
        drains_with_a_reply_lost(sources::SETTLE, 2, then);
    }
}

#[test]
fn a_claim_whose_reply_is_lost_is_adopted_with_its_types_counted_once() {
    drains_with_a_reply_lost(sources::CLAIM, 1, AfterDrop::Close);
}

const API_LIMITED: &str =
    "workers = 4\nidle_poll = \"100ms\"\n[[queues.limits]]\ntype = \"api\"\nmax_running = 4\n";

/// A handler's throttle of a task of a type with its own limits holds back that type only, on every daemon: its
/// other tasks start after the throttle ends, the task itself again at the same attempt, uncharged, while the
/// queue's other type runs through the throttle.
#[test]
fn a_throttle_of_a_limited_type_holds_back_that_type_and_no_other() {
    throttle_of_a_limited_type(&safe_queue(API_LIMITED));
}

/// The same in default mode: the settle of a popped task sets its type's throttle and puts it at the head of its
/// type's flow, as in safe mode (not the queue's throttle, which would hold every type back).
#[test]
fn a_default_mode_throttle_of_a_limited_type_holds_back_that_type_and_no_other() {
    throttle_of_a_limited_type(&default_queue(API_LIMITED));
}

/// A throttle of a task of the type `api` (limited in `queue`, in either mode) over two daemons, as the tests
/// above say.
fn throttle_of_a_limited_type(queue: &str) {
    let throttle = Duration::from_millis(1500);
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_for_types(&redis, queue, &["api", "other"]);
    let (a, b) = (TestDaemon::start(&config), TestDaemon::start(&config));
    let marker = dir.path("throttled-once");
    let first =
        serde_json::json!({ "throttle_once": marker, "throttle_ms": throttle.as_millis() as u64 });
    push_typed(&config, "api", "first", 1, &first.to_string());
    eventually(Duration::from_secs(30), "the throttle settled", || {
        let s = stats(&config, "jobs");
        (s.throttled == 1, s)
    });
    let ttl: i64 = redis.cmd(&["PTTL", "kmq:{jobs}:throttle:t:api"]);
    let queue_ttl: i64 = redis.cmd(&["PTTL", "kmq:{jobs}:throttle:q"]);
    assert_eq!(queue_ttl, -2, "the queue itself is not throttled");
    push_typed(&config, "api", "a", 4, "7");
    push_typed(&config, "other", "o", 4, "7");
    eventually(Duration::from_secs(30), "every task done", || {
        let s = stats(&config, "jobs");
        (s.done >= 9, s)
    });
    let records = dir.records();
    let (_, started) = records.start_times[0].clone();
    assert_eq!(records.start_times[0].0, "first0", "{:?}", records.starts);
    // The throttle was set by the settle after the run: it ends after `started + throttle`.
    let end = started + throttle.as_micros() as u64;
    let during: Vec<&(String, u64)> = records.start_times[1..]
        .iter()
        .filter(|(_, at)| *at < end)
        .collect();
    assert!(
        during.iter().all(|(id, _)| id.starts_with('o')),
        "an api task started while its type was throttled: {during:?}"
    );
    assert!(
        ttl < 0 || during.iter().any(|(id, _)| id.starts_with('o')),
        "the other type ran through the throttle: {:?}",
        records.start_times
    );
    assert_eq!(
        records
            .starts
            .iter()
            .filter(|(id, _)| id == "first0")
            .collect::<Vec<_>>(),
        [&("first0".to_string(), 0), &("first0".to_string(), 0)],
        "throttled, then run again at the same attempt"
    );
    let s = stats(&config, "jobs");
    assert_eq!(
        (s.done, s.throttled, s.retried, s.failed),
        (9, 1, 0, 0),
        "{s:?}"
    );
    assert_drained(&config, &redis, 9, "api");
    a.stop();
    b.stop();
}

/// A reload that adds a type's `max_running` applies it at the next claims: the type's tasks pushed after it
/// never run more than its limit at once; the reload's log line names the change.
#[test]
fn a_reload_that_adds_a_type_limit_applies_it_at_the_next_claims() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_for_types(
        &redis,
        &safe_queue("workers = 4\nidle_poll = \"100ms\""),
        &["slow"],
    );
    let text = std::fs::read_to_string(&config).unwrap();
    let daemon = crate::reload::start(&dir, &config);
    let limited = text.replace(
        "idle_poll = \"100ms\"\n",
        "idle_poll = \"100ms\"\n[[queues.limits]]\ntype = \"slow\"\nmax_running = 1\n",
    );
    assert_ne!(limited, text, "the limit went into the config");
    std::fs::write(&config, limited).unwrap();
    let log = crate::reload::reload(&daemon, 1);
    assert!(log.contains("queues.jobs.type_limits"), "{log}");
    push_typed(&config, "slow", "s", 6, r#"{"sleep_ms":100}"#);
    let mut most_counted = 0;
    eventually(Duration::from_secs(60), "every slow task done", || {
        most_counted = most_counted.max(running(&redis, "slow"));
        (ended(&dir, "s") >= 6, ended(&dir, "s"))
    });
    assert!(most_counted <= 1, "the type's count reached {most_counted}");
    let most = most_within(&starts_of(&dir, "s"), Duration::from_millis(100));
    assert_eq!(most, 1, "one run at a time after the reload");
    assert_ran_once(&dir, "s", 6);
    crate::reload::stop(daemon);
}

/// With `priority_weights`, a claim whose turn falls on a level holding only tasks their type holds back takes a
/// task of another level that no limit holds back, at once, rather than moving them aside and answering "held
/// back" until the next wake-up (idle_poll here: 5 s). A producer that pushes with plain commands (docs/PROTOCOL.md)
/// fills both levels before the claim it wakes.
#[test]
fn a_weighted_turn_on_held_back_tasks_takes_an_unlimited_task_of_another_level_at_once() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let queue = "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\npriorities = [\"high\", \"low\"]\n\
                 priority_weights = [1000, 1]\nworkers = 2\nidle_poll = \"5s\"\n\
                 [[queues.limits]]\ntype = \"slow\"\nmax_running = 1\n";
    let config = dir.config_for_types(&redis, queue, &["slow", "fast"]);
    let daemon = TestDaemon::start(&config);
    let blocked = serde_json::json!({ "wait_for_file": gate }).to_string();
    client(&config)
        .push(
            "jobs",
            kmqd::NewTask::new("slow", &blocked)
                .unwrap()
                .id("s0")
                .priority("high"),
        )
        .unwrap();
    eventually(Duration::from_secs(15), "the type's one slot taken", || {
        (running(&redis, "slow") == 1, running(&redis, "slow"))
    });
    redis.wait_blocked_in("blpop");
    // High's turn (weight 1000) falls on slow tasks, which their type holds back; low holds a fast one.
    let mut pipe = redis::pipe();
    pipe.atomic();
    for i in 1..6 {
        pipe.cmd("RPUSH")
            .arg("kmq:{jobs}:ready:high")
            .arg(format!(r#"{{"id":"s{i}","type":"slow","data":{{}}}}"#));
    }
    pipe.cmd("RPUSH")
        .arg("kmq:{jobs}:ready:low")
        .arg(r#"{"id":"f0","type":"fast","data":{}}"#);
    pipe.cmd("LPUSH").arg("kmq:{jobs}:wake").arg(1);
    let pushed = std::time::Instant::now();
    let () = pipe.query(&mut redis.connection()).unwrap();
    eventually(Duration::from_secs(15), "the fast task done", || {
        (ended(&dir, "f") == 1, ended(&dir, "f"))
    });
    assert!(
        pushed.elapsed() < Duration::from_millis(2500),
        "the fast task waited {:?} for the next wake-up",
        pushed.elapsed()
    );
    std::fs::write(&gate, "").unwrap();
    assert_drained(&config, &redis, 7, "slow");
    daemon.stop();
}

/// Default mode: while a limited type's one slot is taken (its task waits for a gate), its other tasks wait in its
/// flow, out of the ready list, and the other type's tasks pushed behind them run at once; `kmqd stats` counts the
/// held-back ones as ready. Once the gate opens the type drains, one at a time.
#[test]
fn a_default_mode_held_back_type_waits_in_its_flow_and_blocks_no_other_type() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let queue = default_queue(
        "workers = 3\nidle_poll = \"100ms\"\n[[queues.limits]]\ntype = \"slow\"\nmax_running = 1\n",
    );
    let config = dir.config_for_types(&redis, &queue, &["slow", "fast"]);
    let daemon = TestDaemon::start(&config);
    let blocked = serde_json::json!({ "wait_for_file": gate }).to_string();
    push_typed(&config, "slow", "s", 5, &blocked);
    push_typed(&config, "fast", "f", 10, "{}");
    eventually(Duration::from_secs(30), "every fast task done", || {
        (ended(&dir, "f") == 10, ended(&dir, "f"))
    });
    assert_eq!(dir.records().runs_of("s0"), 1, "the first slow task runs");
    let flow: u64 = redis.cmd(&["LLEN", "kmq:{jobs}:flow:normal::slow"]);
    assert_eq!(flow, 4, "the held-back slow tasks wait in their flow");
    assert_eq!(stats(&config, "jobs").ready, 4, "counted as ready");
    assert_eq!(running(&redis, "slow"), 1);
    std::fs::write(&gate, "").unwrap();
    assert_drained(&config, &redis, 15, "slow");
    assert_ran_once(&dir, "s", 5);
    daemon.stop();
}

/// Default mode: a daemon killed with SIGKILL while it runs tasks of a limited type. The tasks it popped are lost
/// with it (at most once); their slots, kept under its owner's share (`t:slow`), come back when a monitor finds its
/// lease run out, and the type drains on the other daemon.
#[test]
fn a_default_mode_daemon_killed_while_it_runs_a_limited_type_gives_its_slots_back() {
    crate::limits::killed_default_mode_daemon_gives_its_slots_back(
        &default_queue(
            "workers = 2\nlease_timeout = \"1s\"\n[[queues.limits]]\ntype = \"slow\"\nmax_running = 2\n",
        ),
        "slow",
        "t:slow",
    );
}

/// Default mode: a pop whose reply is lost. Its tasks are lost (at most once), and their slots of the type's count
/// were counted under the owner, so the daemon gives that owner up at once (it renews it no more) and pops on
/// under a new one; the old owner's lease runs out, a monitor gives its share back (release.lua), and the type
/// drains. Until then the type runs below its limit, never above it.
#[test]
fn a_default_mode_pop_whose_reply_is_lost_gives_its_owner_and_its_types_slots_up() {
    crate::limits::lost_pop_reply_gives_its_owner_and_slots_up(
        &default_queue(
            "workers = 2\nlease_timeout = \"2s\"\n[[queues.limits]]\ntype = \"slow\"\nmax_running = 2\n",
        ),
        "slow",
        "t:slow",
    );
}
