//! Groups beside limits per task type (`[queues.groups]` and `[[queues.limits]]` on one queue): a task starts only
//! when its group's and its type's limits both allow it; a group's tasks of a type its limits hold back wait in a
//! flow of their own without blocking the group's other tasks or another group's; and both counts hold under the
//! faults that would leak them (docs/RELIABILITY.md, "Groups beside type limits").

use std::path::{Path, PathBuf};
use std::time::Duration;

use kmqd::broker::sources;

use crate::support::proxy::AfterDrop;
use crate::support::*;

/// The running count of `scope` (`g:GROUP`, `t:TYPE`; 0 when the field is absent).
fn running(redis: &RedisServer, scope: &str) -> u64 {
    let count: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:running", scope]);
    count.unwrap_or(0)
}

/// Pushes `count` tasks of type `kind` in `group` (ids `prefix0..`) with `data`.
fn push(config: &Path, group: &str, kind: &str, prefix: &str, count: usize, data: &str) {
    let tasks: Vec<kmqd::NewTask> = (0..count)
        .map(|i| {
            kmqd::NewTask::new(kind, data)
                .unwrap()
                .id(format!("{prefix}{i}"))
                .group(group)
        })
        .collect();
    client(config).push_batch("jobs", tasks).unwrap();
}

/// How many runs of ids starting with `prefix` returned.
fn ended(dir: &TestDir, prefix: &str) -> usize {
    dir.records()
        .ends
        .iter()
        .filter(|(id, ..)| id.starts_with(prefix))
        .count()
}

/// The members of a park index (`g:GROUP` or `t:TYPE`).
fn parked(redis: &RedisServer, scope: &str) -> Vec<String> {
    redis.cmd(&["ZRANGE", &format!("kmq:{{jobs}}:park:{scope}"), "0", "-1"])
}

/// A daemon of a grouped queue with `slow` limited to 1 running (`extra`: the queue's other keys), once a task of
/// group `holder` holds `slow`'s one slot until the returned gate file is written.
struct SlowHeld {
    redis: RedisServer,
    dir: TestDir,
    config: PathBuf,
    daemon: TestDaemon,
    gate: PathBuf,
}

fn slow_held(extra: &str, holder: &str) -> SlowHeld {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let queue = safe_queue(&format!(
        "{extra}[queues.groups]\n[[queues.limits]]\ntype = \"slow\"\nmax_running = 1\n"
    ));
    let config = dir.config_for_types(&redis, &queue, &["slow", "fast"]);
    let daemon = TestDaemon::start(&config);
    let wait = serde_json::json!({ "wait_for_file": gate }).to_string();
    push(&config, holder, "slow", holder, 1, &wait);
    eventually(
        Duration::from_secs(15),
        "a slow task holds the type",
        || (running(&redis, "t:slow") == 1, running(&redis, "t:slow")),
    );
    SlowHeld {
        redis,
        dir,
        config,
        daemon,
        gate,
    }
}

/// A task's envelope as a producer writes it: `kind`, a 1 ms sleep, `id`, `group`.
fn envelope(kind: &str, id: &str, group: &str) -> String {
    format!(r#"{{"type":"{kind}","data":{{"sleep_ms":1}},"id":"{id}","group":"{group}"}}"#)
}

/// Waits until `done` tasks are done and nothing waits or runs, then checks that no count is left and none went
/// below 0, and that no flow, ring entry or park index is left.
fn assert_drained(config: &Path, redis: &RedisServer, done: u64) {
    let s = eventually(Duration::from_secs(60), "the queue drained", || {
        let s = stats(config, "jobs");
        (s.done >= done && s.processing == 0 && s.ready == 0, s)
    });
    assert_eq!(s.done, done, "{s:?}");
    eventually(Duration::from_secs(10), "nothing left", || {
        let counts: Vec<String> = redis.cmd(&["HKEYS", "kmq:{jobs}:running"]);
        let counts: Vec<String> = counts
            .into_iter()
            .filter(|f| (f.starts_with("g:") || f.starts_with("t:")) && !f.ends_with(":limit"))
            .collect();
        let left: Vec<String> = redis.cmd(&["KEYS", "kmq:{jobs}:park:*"]);
        let flows: Vec<String> = redis.cmd(&["KEYS", "kmq:{jobs}:flow:*"]);
        let ring: u64 = redis.cmd(&["ZCARD", "kmq:{jobs}:ring:normal"]);
        (
            counts.is_empty() && left.is_empty() && flows.is_empty() && ring == 0,
            format!("counts {counts:?}, park indexes {left:?}, flows {flows:?}, ring {ring}"),
        )
    });
    let underflow: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:stats", "running_underflow"]);
    assert_eq!(underflow.unwrap_or(0), 0, "no count went below 0");
}

/// Two daemons; groups of at most 3 running, and a type `slow` of at most 1 running across the queue. Each group
/// pushes its slow tasks before its fast ones: the fast tasks of both groups drain while the slow ones wait their
/// turn one at a time, no count ever passes its limit, and each task runs once.
#[test]
fn a_groups_tasks_of_a_limited_type_wait_without_blocking_its_other_tasks_or_other_groups() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queue = safe_queue(
        "workers = 4\nidle_poll = \"100ms\"\n[queues.groups]\nmax_running = 3\n\
         [[queues.limits]]\ntype = \"slow\"\nmax_running = 1\n",
    );
    let config = dir.config_for_types(&redis, &queue, &["slow", "fast"]);
    let (a, b) = (TestDaemon::start(&config), TestDaemon::start(&config));
    push(&config, "a", "slow", "as", 5, r#"{"sleep_ms":100}"#);
    push(&config, "b", "slow", "bs", 3, r#"{"sleep_ms":100}"#);
    push(&config, "a", "fast", "af", 20, r#"{"sleep_ms":1}"#);
    push(&config, "b", "fast", "bf", 20, r#"{"sleep_ms":1}"#);
    let mut most = (0, 0, 0);
    let watch = |most: &mut (u64, u64, u64)| {
        most.0 = most.0.max(running(&redis, "t:slow"));
        most.1 = most.1.max(running(&redis, "g:a"));
        most.2 = most.2.max(running(&redis, "g:b"));
    };
    eventually(Duration::from_secs(60), "every fast task done", || {
        watch(&mut most);
        let fast = ended(&dir, "af") + ended(&dir, "bf");
        (fast >= 40, fast)
    });
    // 8 slow tasks of 100 ms, one at a time, take 800 ms at the least.
    let slow = ended(&dir, "as") + ended(&dir, "bs");
    assert!(
        slow < 8,
        "the fast tasks waited behind the slow ones ({slow} slow ran first)"
    );
    eventually(Duration::from_secs(60), "every slow task done", || {
        watch(&mut most);
        let slow = ended(&dir, "as") + ended(&dir, "bs");
        (slow >= 8, slow)
    });
    assert!(most.0 <= 1, "the type's count reached {}", most.0);
    assert!(
        most.1 <= 3 && most.2 <= 3,
        "a group's count passed 3: {most:?}"
    );
    assert_drained(&config, &redis, 48);
    for (prefix, count) in [("as", 5), ("bs", 3), ("af", 20), ("bf", 20)] {
        assert_ran_once(&dir, prefix, count);
    }
    a.stop();
    b.stop();
}

/// A group's tasks of a full type wait in their own flow, parked under the type (`park:t:slow`); when the type
/// frees its slot while the group is full, the flow parks under the group (`park:g:a`); when the group frees its
/// slot, the flow runs. Neither park index is left behind.
#[test]
fn a_flow_parked_by_its_type_then_by_its_group_runs_once_both_free_a_slot() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let (type_gate, group_gate) = (dir.path("type-gate"), dir.path("group-gate"));
    let queue = safe_queue(
        "workers = 4\nidle_poll = \"100ms\"\n[queues.groups]\nmax_running = 1\n\
         [[queues.limits]]\ntype = \"slow\"\nmax_running = 1\n",
    );
    let config = dir.config_for_types(&redis, &queue, &["slow", "fast"]);
    let daemon = TestDaemon::start(&config);
    let wait = |gate: &Path| serde_json::json!({ "wait_for_file": gate }).to_string();
    push(&config, "b", "slow", "bs", 1, &wait(&type_gate));
    eventually(
        Duration::from_secs(15),
        "b's slow task holds the type",
        || (running(&redis, "t:slow") == 1, running(&redis, "t:slow")),
    );
    push(&config, "a", "slow", "as", 3, r#"{"sleep_ms":1}"#);
    push(&config, "a", "fast", "af", 1, &wait(&group_gate));
    eventually(
        Duration::from_secs(15),
        "a's fast task runs past its slow ones, which park under the type",
        || {
            let by_type = parked(&redis, "t:slow");
            (
                running(&redis, "g:a") == 1 && by_type == ["1|a:slow"],
                (running(&redis, "g:a"), by_type),
            )
        },
    );
    std::fs::write(&type_gate, "").unwrap();
    eventually(
        Duration::from_secs(15),
        "the type's slot freed, the flow parks under its full group",
        || {
            let (by_type, by_group) = (parked(&redis, "t:slow"), parked(&redis, "g:a"));
            let ring: Vec<String> =
                redis.cmd(&["ZRANGE", "kmq:{jobs}:ring:normal", "0", "-1", "WITHSCORES"]);
            let counts: Vec<String> = redis.cmd(&["HGETALL", "kmq:{jobs}:running"]);
            (
                by_type.is_empty() && by_group == ["1|a:slow"] && ended(&dir, "bs") == 1,
                (
                    by_type,
                    by_group,
                    ring,
                    counts,
                    ended(&dir, "bs"),
                    ended(&dir, "as"),
                ),
            )
        },
    );
    assert_eq!(ended(&dir, "as"), 0, "a's slow tasks waited for the group");
    // `kmqd groups` counts the group's tasks in its flow of the type.
    let json: serde_json::Value =
        serde_json::from_str(&kmqd_ok(&config, &["groups", "jobs", "--json"])).unwrap();
    assert_eq!(json["groups"][0]["name"], "a", "{json}");
    assert_eq!(json["groups"][0]["waiting"], 3, "{json}");
    std::fs::write(&group_gate, "").unwrap();
    assert_drained(&config, &redis, 5);
    assert_ran_once(&dir, "as", 3);
    daemon.stop();
}

/// A daemon killed (`kill -9`) while it holds a group's and a type's every slot gives both back with its tasks
/// when a monitor recovers them.
#[test]
fn a_daemon_killed_while_it_holds_a_groups_and_a_types_slots_gives_both_back() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let queue = safe_queue(
        "workers = 2\nidle_poll = \"100ms\"\nlease_timeout = \"1s\"\n[queues.groups]\nmax_running = 2\n\
         [[queues.limits]]\ntype = \"slow\"\nmax_running = 2\n",
    );
    let config = dir.config_for_types(&redis, &queue, &["slow"]);
    let mut first = Process::start(&config, dir.path("first.log"));
    let data = serde_json::json!({ "wait_for_file": gate }).to_string();
    push(&config, "acme", "slow", "s", 6, &data);
    eventually(Duration::from_secs(15), "both slots taken", || {
        let counts = (running(&redis, "g:acme"), running(&redis, "t:slow"));
        (counts == (2, 2), counts)
    });
    first.kill9();
    std::fs::write(&gate, "").unwrap();
    let second = TestDaemon::start(&config);
    assert_drained(&config, &redis, 6);
    let recovered: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:stats", "recovered"]);
    assert_eq!(recovered, Some(2));
    second.stop();
}

/// Through a fault proxy that drops the `nth` reply of `script`: every task drains once, the fault fired, and the
/// groups' and the type's counts come back to 0 without going below it.
fn drains_with_a_reply_lost(script: &str, nth: usize, then: AfterDrop) {
    let queue = safe_queue(
        "workers = 3\nlease_timeout = \"60s\"\n[queues.groups]\nmax_running = 2\n\
         [[queues.limits]]\ntype = \"slow\"\nmax_running = 1\n",
    );
    let prepare = |dir: &TestDir, config: &Path| dir.testkit_types(config, &["slow", "fast"]);
    let drain = |config: &Path, redis: &RedisServer, dir: &TestDir| {
        push(config, "acme", "slow", "as", 3, r#"{"sleep_ms":5}"#);
        push(config, "acme", "fast", "af", 3, r#"{"sleep_ms":5}"#);
        push(config, "other", "slow", "os", 3, r#"{"sleep_ms":5}"#);
        push(config, "other", "fast", "of", 3, r#"{"sleep_ms":5}"#);
        assert_drained(config, redis, 12);
        for prefix in ["as", "af", "os", "of"] {
            assert_ran_once(dir, prefix, 3);
        }
    };
    drain_with_a_reply_lost(script, (nth, then), &queue, prepare, drain);
}

#[test]
fn a_settle_whose_reply_is_lost_frees_a_groups_and_a_types_slots_once() {
    for then in [AfterDrop::Close, AfterDrop::Hang] {
        drains_with_a_reply_lost(sources::SETTLE, 2, then);
    }
}

#[test]
fn a_claim_whose_reply_is_lost_is_adopted_with_its_group_and_type_counted_once() {
    drains_with_a_reply_lost(sources::CLAIM, 1, AfterDrop::Close);
}

/// A task of a limited type found in its group's flow of the unlimited types (pushed there by push.lua while
/// another config routed, or queued before its type was limited) is sorted out by the claim that serves the flow:
/// while its type is full it moves to the group's flow of its type, and the group's other tasks behind it run.
#[test]
fn a_limited_types_task_in_its_groups_flow_is_sorted_out_and_does_not_block_the_group() {
    let SlowHeld {
        redis,
        dir,
        config,
        daemon,
        gate,
    } = slow_held("workers = 4\nidle_poll = \"100ms\"\n", "b");
    // As push.lua routes when the routes hash says so: into the group's flow `a:`, which joins the ring.
    let _: i64 = redis.cmd(&[
        "RPUSH",
        "kmq:{jobs}:flow:normal:a:",
        &envelope("slow", "as0", "a"),
        &envelope("fast", "af0", "a"),
    ]);
    let _: i64 = redis.cmd(&["ZADD", "kmq:{jobs}:ring:normal", "NX", "0", "a:"]);
    let _: i64 = redis.cmd(&["LPUSH", "kmq:{jobs}:wake", "1"]);
    eventually(
        Duration::from_secs(15),
        "the fast task ran past the slow one, which waits under its type",
        || {
            let by_type = parked(&redis, "t:slow");
            (ended(&dir, "af") == 1 && by_type == ["1|a:slow"], by_type)
        },
    );
    assert_eq!(ended(&dir, "as"), 0, "the slow task waited for its type");
    std::fs::write(&gate, "").unwrap();
    assert_drained(&config, &redis, 3);
    assert_ran_once(&dir, "as", 1);
    daemon.stop();
}

/// A claim whose lowest flow holds nothing but a limited type's task that it must sort out (its type full) takes
/// from the next group's flow in the same step, as it sorts: the task of that group does not wait for a wake-up
/// (model/README.md, "Groups beside type limits", the seventh finding; with a single such group).
#[test]
fn a_claim_that_only_sorted_a_types_task_away_takes_from_the_next_group() {
    // Two workers, one held by the gated task: each claim asks for one task; a long idle_poll, so that only a
    // wake-up or this claim would start the next group's task soon.
    let SlowHeld {
        redis,
        dir,
        config,
        daemon,
        gate,
    } = slow_held("workers = 2\nidle_poll = \"5s\"\n", "b");
    // Group a's flow (lowest pass) holds only a slow task; group c's, behind it, a fast one: written at once.
    let put = "redis.call('RPUSH', KEYS[1], ARGV[1]) redis.call('RPUSH', KEYS[2], ARGV[2]) \
               redis.call('ZADD', KEYS[3], 0, 'a:', 1, 'c:') redis.call('LPUSH', KEYS[4], 1)";
    let (slow, fast) = (envelope("slow", "as0", "a"), envelope("fast", "cf0", "c"));
    let _: Option<i64> = redis.cmd(&[
        "EVAL",
        put,
        "4",
        "kmq:{jobs}:flow:normal:a:",
        "kmq:{jobs}:flow:normal:c:",
        "kmq:{jobs}:ring:normal",
        "kmq:{jobs}:wake",
        &slow,
        &fast,
    ]);
    eventually(Duration::from_secs(15), "a's slow task sorted away", || {
        let by_type = parked(&redis, "t:slow");
        (by_type == ["1|a:slow"], by_type)
    });
    // The claim that sorted it away is one script step: c's task left its flow in the same step.
    let left: u64 = redis.cmd(&["LLEN", "kmq:{jobs}:flow:normal:c:"]);
    assert_eq!(
        left, 0,
        "the claim that sorted a's task away took nothing of c's"
    );
    eventually(Duration::from_secs(15), "c's fast task ran", || {
        (ended(&dir, "cf") == 1, ended(&dir, "cf"))
    });
    std::fs::write(&gate, "").unwrap();
    assert_drained(&config, &redis, 3);
    assert_ran_once(&dir, "as", 1);
    daemon.stop();
}

/// A claim whose lowest passes are groups' flows holding only tasks of a full type reads past them to a group with
/// a task it may take: with six groups ahead in the ring, each holding one task of `slow` (full: another group's
/// task holds its one slot), and claims of one task, the other group's `fast` task starts at once. Before the fix
/// each claim stopped at the first of them (a group that admits a task), moved its `slow` task to the group's
/// `slow` flow and took nothing, and its fetcher waited `idle_poll` (5 s) for a wake-up: the task started after
/// six of them (the model's seventh finding, model/README.md).
#[test]
fn a_claim_reads_past_groups_whose_tasks_are_all_of_a_full_type() {
    let SlowHeld {
        redis,
        dir,
        config,
        daemon,
        gate,
    } = slow_held(
        "workers = 2\nprefetch = 0\nbatch = 1\nidle_poll = \"5s\"\n",
        "h",
    );
    // One batch (one wake-up marker): six groups' slow tasks ahead of z's fast one in the ring.
    let mut tasks: Vec<kmqd::NewTask> = (1..=6)
        .map(|k| {
            kmqd::NewTask::new("slow", "{}")
                .unwrap()
                .id(format!("a{k}-0"))
                .group(format!("a{k}"))
        })
        .collect();
    tasks.push(
        kmqd::NewTask::new("fast", "{}")
            .unwrap()
            .id("z0")
            .group("z"),
    );
    client(&config).push_batch("jobs", tasks).unwrap();
    // Within 20 s: the fix takes it in the claim after the push; before it, six idle polls of 5 s.
    eventually(Duration::from_secs(20), "z's fast task ran", || {
        let n = ended(&dir, "z");
        (n >= 1, n)
    });
    assert_eq!(ended(&dir, "a"), 0, "a slow task ran past the type's limit");
    std::fs::write(&gate, "").unwrap();
    assert_drained(&config, &redis, 8);
    for k in 1..=6 {
        assert_ran_once(&dir, &format!("a{k}-"), 1);
    }
    daemon.stop();
}
