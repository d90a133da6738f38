//! Flow control: a queue's `max_running` and `rate_limit` across daemons, and its count in Redis under the faults that would leak
//! it or count it twice (docs/RELIABILITY.md, "Running limits").

use std::path::Path;
use std::time::Duration;

use kmqd::broker::sources;

use crate::support::proxy::{AfterDrop, Fault, FaultProxy, Matcher};
use crate::support::*;

/// The queue's count of tasks taken under its `max_running` and not yet settled (0 when the field is absent).
fn running(redis: &RedisServer) -> u64 {
    let count: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:running", "q"]);
    count.unwrap_or(0)
}

/// A stats counter of the queue (0 when absent).
pub(crate) fn counter(redis: &RedisServer, field: &str) -> u64 {
    let count: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:stats", field]);
    count.unwrap_or(0)
}

/// The most runs that started within any `window` of each other (for tasks whose runs last at least `window`:
/// how many ran at once).
pub(crate) fn most_started_within(dir: &TestDir, window: Duration) -> usize {
    let mut starts: Vec<u64> = dir
        .records()
        .start_times
        .iter()
        .map(|(_, micros)| *micros)
        .collect();
    starts.sort_unstable();
    let window = window.as_micros() as u64;
    let mut most = 0;
    let mut first = 0;
    for (last, at) in starts.iter().enumerate() {
        while starts[first] + window <= *at {
            first += 1;
        }
        most = most.max(last + 1 - first);
    }
    most
}

/// Waits until the queue is drained and its count is back to 0, then checks no count went below 0.
pub(crate) fn assert_drained_to_zero(config: &Path, redis: &RedisServer, done: u64) {
    let s = eventually(Duration::from_secs(60), "the queue drained", || {
        let s = stats(config, "jobs");
        (s.done >= done && s.processing == 0 && s.ready == 0, s)
    });
    assert_eq!(s.done, done, "{s:?}");
    eventually(
        Duration::from_secs(10),
        "the running count back to 0",
        || (running(redis) == 0, running(redis)),
    );
    assert_eq!(
        counter(redis, "running_underflow"),
        0,
        "no count went below 0"
    );
}

#[test]
fn max_running_holds_across_daemons_and_every_task_runs_once() {
    three_at_once_across_two_daemons(&safe_queue(
        "workers = 4\nmax_running = 3\nidle_poll = \"100ms\"",
    ));
}

/// Default mode keeps a pop's slots under the owner that popped it until its settles give them back.
#[test]
fn a_default_mode_max_running_holds_across_daemons_and_every_task_runs_once() {
    three_at_once_across_two_daemons(&default_queue(
        "workers = 4\nmax_running = 3\nidle_poll = \"100ms\"",
    ));
}

/// `queue`, limited to 3 running, drains 30 tasks of 50 ms on two daemons: Redis's count never above 3, never
/// more than 3 runs at once, at least 2 at once (the limit is reached), each task once, the count back to 0.
fn three_at_once_across_two_daemons(queue: &str) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, queue);
    let (a, b) = (TestDaemon::start(&config), TestDaemon::start(&config));
    // Every run sleeps at least 50 ms: starts closer than that overlapped.
    push_many(&config, "t", 30, r#"{"sleep_ms":50}"#);
    // Redis's count, sampled through the drain.
    let mut most_counted = 0;
    eventually(Duration::from_secs(60), "30 tasks done", || {
        most_counted = most_counted.max(running(&redis));
        let s = stats(&config, "jobs");
        (s.done >= 30, s)
    });
    assert!(most_counted <= 3, "the count reached {most_counted}");
    assert_drained_to_zero(&config, &redis, 30);
    assert_ran_once(&dir, "t", 30);
    let most = most_started_within(&dir, Duration::from_millis(50));
    assert!(
        most <= 3,
        "{most} runs started within 50 ms of each other: {:?}",
        dir.records().start_times
    );
    assert!(
        most >= 2,
        "eight idle workers ran only {most} at once: the limit was not reached"
    );
    a.stop();
    b.stop();
}

#[test]
fn a_limited_queue_claims_no_more_than_its_limit_while_the_rest_wait_in_redis() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let config = dir.config(&redis, &safe_queue("workers = 4\nmax_running = 3"));
    let (a, b) = (TestDaemon::start(&config), TestDaemon::start(&config));
    let data = serde_json::json!({ "wait_for_file": gate }).to_string();
    push_many(&config, "t", 10, &data);
    eventually(Duration::from_secs(15), "three runs started", || {
        let started = dir.records().starts.len();
        (started == 3, started)
    });
    // Both fetchers idle in Redis, held back: nothing more is claimed until a settle frees a slot.
    eventually(Duration::from_secs(15), "both fetchers waiting", || {
        let list: String = redis.cmd(&["CLIENT", "LIST"]);
        let blocked = list.matches("cmd=blpop").count();
        (blocked == 2, list)
    });
    let s = stats(&config, "jobs");
    assert_eq!((s.processing, s.ready, running(&redis)), (3, 7, 3), "{s:?}");
    assert_eq!(s.running, 3, "stats show the count");
    assert_eq!(dir.records().starts.len(), 3);
    std::fs::write(&gate, "").unwrap();
    assert_drained_to_zero(&config, &redis, 10);
    assert_ran_once(&dir, "t", 10);
    a.stop();
    b.stop();
}

/// A limited queue's daemon through a fault proxy that drops the `nth` reply of `script` (by `then`): its 12
/// tasks drain, each runs once, the fault fired once, and the count comes back to 0 without going below it.
/// `queue`: the queue's `[[queues]]` entry.
fn drains_to_zero_with_a_reply_lost(script: &str, nth: usize, then: AfterDrop, queue: &str) {
    let drain = |config: &Path, redis: &RedisServer, dir: &TestDir| {
        push_many(config, "t", 12, r#"{"sleep_ms":5}"#);
        assert_drained_to_zero(config, redis, 12);
        assert_ran_once(dir, "t", 12);
    };
    drain_with_a_reply_lost(script, (nth, then), queue, |_, _| {}, drain);
}

/// The settles of a plain queue at its limit go to handover_plain.lua (src/broker/plain_handover.rs), those of a queue
/// with a rate limit beside it to settle.lua with its claim block: each script's lost reply.
#[test]
fn a_settle_whose_reply_is_lost_frees_its_running_slots_once() {
    let scripts = [
        (sources::HANDOVER_PLAIN, "workers = 2\nmax_running = 2"),
        (
            sources::SETTLE,
            "workers = 2\nmax_running = 2\nrate_limit = \"1000/s\"",
        ),
    ];
    for (script, queue) in scripts {
        for then in [AfterDrop::Close, AfterDrop::Hang] {
            drains_to_zero_with_a_reply_lost(script, 2, then, &safe_queue(queue));
        }
    }
}

/// Default mode: a settle sent again after its reply was lost subtracts from the popping owner's share once.
#[test]
fn a_default_mode_settle_whose_reply_is_lost_frees_its_running_slots_once() {
    for then in [AfterDrop::Close, AfterDrop::Hang] {
        drains_to_zero_with_a_reply_lost(
            sources::SETTLE,
            2,
            then,
            &default_queue("workers = 2\nmax_running = 2"),
        );
    }
}

#[test]
fn a_claim_whose_reply_is_lost_is_adopted_with_its_slots_counted_once() {
    drains_to_zero_with_a_reply_lost(
        sources::CLAIM,
        1,
        AfterDrop::Close,
        &safe_queue("workers = 3\nmax_running = 3\nlease_timeout = \"60s\""),
    );
}

#[test]
fn a_daemon_killed_while_it_runs_gives_its_running_slots_back_through_the_monitors() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let config = dir.config(
        &redis,
        &safe_queue("workers = 2\nmax_running = 2\nlease_timeout = \"1s\""),
    );
    let mut first = Process::start(&config, dir.path("first.log"));
    let data = serde_json::json!({ "wait_for_file": gate }).to_string();
    push_many(&config, "t", 6, &data);
    eventually(Duration::from_secs(15), "both slots taken", || {
        (running(&redis) == 2, running(&redis))
    });
    first.kill9();
    std::fs::write(&gate, "").unwrap();
    // The killed daemon's two tasks come back when its lease runs out, and its slots with them.
    let second = TestDaemon::start(&config);
    assert_drained_to_zero(&config, &redis, 6);
    assert_eq!(counter(&redis, "recovered"), 2);
    second.stop();
}

#[test]
fn a_claim_made_without_a_limit_is_never_subtracted_from_one() {
    // A rolling change that adds max_running: the old daemon's claims were not counted, and the new daemon's
    // monitor that recovers them must not take them off the new daemons' count.
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let unlimited = dir.config(&redis, &safe_queue("workers = 3\nlease_timeout = \"1s\""));
    let unlimited = {
        let kept = unlimited.with_file_name("unlimited.toml");
        std::fs::rename(&unlimited, &kept).unwrap();
        kept
    };
    let limited = dir.config(
        &redis,
        &safe_queue("workers = 3\nmax_running = 1\nlease_timeout = \"1s\""),
    );
    let mut old = Process::start(&unlimited, dir.path("old.log"));
    let data = serde_json::json!({ "wait_for_file": gate }).to_string();
    push_many(&unlimited, "t", 3, &data);
    eventually(Duration::from_secs(15), "three runs started", || {
        let started = dir.records().starts.len();
        (started == 3, started)
    });
    assert_eq!(running(&redis), 0, "claimed without a limit: not counted");
    old.kill9();
    push_many(&limited, "u", 3, r#"{"sleep_ms":5}"#);
    let new = TestDaemon::start(&limited);
    std::fs::write(&gate, "").unwrap();
    assert_drained_to_zero(&limited, &redis, 6);
    assert_ran_once(&dir, "u", 3);
    new.stop();
}

#[test]
fn a_rate_limit_holds_in_every_window_across_daemons_and_every_task_runs_once() {
    ten_a_second_across_two_daemons(&safe_queue("workers = 4\nrate_limit = \"10/s\""));
}

/// Default mode counts its pops in the same logs (pop.lua; a rate-limited queue never pops plainly, however big
/// the backlog), and a run starts within a dispatch of its pop.
#[test]
fn a_default_mode_rate_limit_holds_across_daemons_and_every_task_runs_once() {
    ten_a_second_across_two_daemons(&default_queue(
        "workers = 40\nrate_limit = \"10/s\"\nidle_poll = \"100ms\"",
    ));
}

/// `queue`, limited to 10 starts a second, drains 35 tasks on two daemons, each task once, with no more than 10
/// starts in any 700 ms.
fn ten_a_second_across_two_daemons(queue: &str) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, queue);
    let (a, b) = (TestDaemon::start(&config), TestDaemon::start(&config));
    push_many(&config, "t", 35, r#"{"sleep_ms":1}"#);
    assert_drained_to_zero(&config, &redis, 35);
    assert_ran_once(&dir, "t", 35);
    // The limit is on claims (or pops), by Redis's clock; a run starts within a dispatch of its claim. Allowing
    // 300 ms of that, no 700 ms may hold more than 10 starts (without the limit, all 35 start within a few).
    let most = most_started_within(&dir, Duration::from_millis(700));
    assert!(
        most <= 10,
        "{most} runs started within 700 ms: {:?}",
        dir.records().start_times
    );
    a.stop();
    b.stop();
}

#[test]
fn several_windows_of_a_rate_limit_hold_together() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &safe_queue("workers = 8\nrate_limit = [\"3/200ms\", \"8/s\"]"),
    );
    let daemon = TestDaemon::start(&config);
    push_many(&config, "t", 17, "{}");
    assert_drained_to_zero(&config, &redis, 17);
    assert_ran_once(&dir, "t", 17);
    for (window, limit) in [(100, 3), (700, 8)] {
        let most = most_started_within(&dir, Duration::from_millis(window));
        assert!(
            most <= limit,
            "{most} runs started within {window} ms: {:?}",
            dir.records().start_times
        );
    }
    daemon.stop();
}

/// `kmqd stats` says what holds a limited queue back: its running count against `max_running` and each window's
/// starts against its rate, from what Redis counts now.
#[test]
fn stats_show_a_full_rate_window_and_the_running_count_against_their_limits() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &safe_queue("workers = 4\nmax_running = 4\nrate_limit = [\"3/1m\", \"100/1h\"]"),
    );
    let daemon = TestDaemon::start(&config);
    push_many(&config, "t", 5, "7");
    wait_done(&config, 3, Duration::from_secs(30));
    // The minute's three starts are spent: the other two wait in Redis for the window to move on.
    let out = kmqd_ok(&config, &["stats"]);
    assert!(
        out.contains("jobs: running 0/4 · rate 3/3 per 1m, held back · rate 3/100 per 1h"),
        "{out}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&kmqd_ok(&config, &["stats", "--json"])).unwrap();
    let limits = &json["queues"]["jobs"]["limits"];
    assert_eq!(
        (
            &limits["rate_limit"][0]["used"],
            &limits["rate_limit"][0]["held_back"],
            &limits["max_running"]["limit"]
        ),
        (
            &serde_json::json!(3),
            &serde_json::json!(true),
            &serde_json::json!(4)
        ),
        "{json}"
    );
    assert_eq!(stats(&config, "jobs").ready, 2);
    daemon.stop();
}

/// The `popped-running` hashes of the queue's default-mode owners (their shares of the running count).
fn shares(redis: &RedisServer) -> Vec<String> {
    redis.cmd(&["KEYS", "kmq:{jobs}:popped-running:*"])
}

/// The field `scope` of the running hash (0 when absent): `q`, or a type's `t:TYPE`.
fn count_of(redis: &RedisServer, scope: &str) -> u64 {
    let count: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:running", scope]);
    count.unwrap_or(0)
}

/// The config of `queue` (the queue `jobs`) with the testkit handling `kind` too.
fn config_handling(
    dir: &TestDir,
    redis_section: &str,
    queue: &str,
    kind: &str,
) -> std::path::PathBuf {
    let config = dir.config_raw(redis_section, "", queue);
    if kind != "test" {
        dir.testkit_types(&config, &[kind]);
    }
    config
}

/// A default-mode daemon killed with tasks running (of type `kind`, counted in `scope` of the running hash, which
/// `queue` limits to 2 with a lease of 1 s): they are lost (at most once), and their slots, kept under its owner's
/// share, come back when a monitor finds its lease run out (release.lua gives back every scope of the share), so
/// the queue drains.
pub(crate) fn killed_default_mode_daemon_gives_its_slots_back(
    queue: &str,
    kind: &str,
    scope: &str,
) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let config = config_handling(&dir, &format!("url = \"{}\"", redis.url()), queue, kind);
    let mut first = Process::start(&config, dir.path("first.log"));
    let data = serde_json::json!({ "wait_for_file": gate }).to_string();
    push_typed(&config, kind, "t", 6, &data);
    eventually(Duration::from_secs(15), "both slots taken", || {
        (count_of(&redis, scope) == 2, count_of(&redis, scope))
    });
    assert_eq!(shares(&redis).len(), 1, "counted under the popping owner");
    first.kill9();
    std::fs::write(&gate, "").unwrap();
    let second = TestDaemon::start(&config);
    // The two tasks the killed daemon ran are gone with it; the four others run.
    let s = eventually(Duration::from_secs(60), "the queue drained", || {
        let s = stats(&config, "jobs");
        (s.done >= 4 && s.processing == 0 && s.ready == 0, s)
    });
    assert_eq!(s.done, 4, "{s:?}");
    eventually(Duration::from_secs(10), "the count back to 0", || {
        (count_of(&redis, scope) == 0, count_of(&redis, scope))
    });
    assert_eq!(counter(&redis, "running_underflow"), 0);
    assert_eq!(
        shares(&redis),
        Vec::<String>::new(),
        "the dead owner's share was given back"
    );
    second.stop();
}

#[test]
fn a_default_mode_daemon_killed_gives_its_running_slots_back_when_its_lease_runs_out() {
    killed_default_mode_daemon_gives_its_slots_back(
        &default_queue("workers = 2\nmax_running = 2\nlease_timeout = \"1s\""),
        "test",
        "q",
    );
}

/// A default-mode pop whose reply is lost (its tasks of type `kind`, counted in `scope`, which `queue` limits to 2
/// with a lease of 2 s): its tasks are lost (at most once) and their slots were counted under the owner, so the
/// daemon gives that owner up; its lease runs out, a monitor gives its share back, and the queue drains under a
/// new owner, never above the limit meanwhile. Without it the count would stay full for the daemon's life.
pub(crate) fn lost_pop_reply_gives_its_owner_and_slots_up(queue: &str, kind: &str, scope: &str) {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let redis_section = format!("url = \"{}\"\nio_timeout = \"1s\"", proxy.url());
    let config = config_handling(&dir, &redis_section, queue, kind);
    let (daemon, rule) = default_daemon_losing_its_next_pop_reply(&config, &redis, &proxy);
    push_typed(&config, kind, "t", 10, r#"{"sleep_ms":5}"#);
    let mut most = 0;
    eventually(Duration::from_secs(60), "the rest drained", || {
        most = most.max(count_of(&redis, scope));
        let s = stats(&config, "jobs");
        (
            s.ready == 0 && count_of(&redis, scope) == 0 && s.done >= 1,
            s,
        )
    });
    assert_eq!(rule.fired(), 1);
    assert!(most <= 2, "the count reached {most}");
    // The count can reach 0 while the daemon still holds tasks of the given-up owner's earlier pops (its share went
    // back with it): a graceful stop finishes or hands back every task it holds, so only the lost ones are
    // neither done nor ready after it.
    daemon.stop();
    let s = stats(&config, "jobs");
    let lost = 10 - s.done - s.ready;
    assert!(
        (1..=2).contains(&lost),
        "the lost pop took 1 or 2 tasks (its slots' worth): {s:?}"
    );
    assert_eq!(
        dir.records().starts.len() as u64,
        s.done,
        "the lost ones never ran"
    );
    assert_eq!(counter(&redis, "running_underflow"), 0);
    eventually(Duration::from_secs(10), "every share given back", || {
        (shares(&redis).is_empty(), shares(&redis))
    });
}

#[test]
fn a_default_mode_pop_whose_reply_is_lost_gives_its_owner_and_slots_up() {
    lost_pop_reply_gives_its_owner_and_slots_up(
        &default_queue("workers = 2\nmax_running = 2\nlease_timeout = \"2s\""),
        "test",
        "q",
    );
}

/// A default-mode pop that reaches Redis only after its owner was forgotten: its reply was late, so the daemon
/// gave the owner up and popped on under a new one; the old owner's lease ran out and a monitor released it (its
/// share, empty then, given back); then the late pop landed. pop.lua refuses it (LEASELOST: no live lease), so it
/// takes nothing and counts nothing. Before badf3e8, it took a task (lost, at most once) and counted its slot in a
/// share of an owner no monitor would ever look at again: the count never came back to 0, and a queue at its
/// limit would never have drained again. The model's third finding (model/README.md, "What the checker found").
#[test]
fn a_default_mode_pop_that_lands_after_its_owner_was_released_takes_and_counts_nothing() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let redis_section = format!("url = \"{}\"\nio_timeout = \"1s\"", proxy.url());
    // One slot (`max_held` is `workers` under a limit), so that the daemon holds the gated task while the others
    // wait in the ready list for the late pop to find them; a limit it never reaches.
    let config = dir.config_raw(
        &redis_section,
        "",
        &default_queue("workers = 1\nmax_running = 3\nlease_timeout = \"1s\""),
    );
    let daemon = TestDaemon::start(&config);
    redis.wait_blocked_in("blmove");
    let owners: Vec<String> = redis.cmd(&["ZRANGE", "kmq:{jobs}:owners", "0", "-1"]);
    let [first] = owners.as_slice() else {
        panic!("one owner: {owners:?}");
    };
    let (late, pop) = (first.clone().into_bytes(), Matcher::script(sources::POP));
    let late_pop = Matcher::new(move |args| pop.matches(args) && args.contains(&late));
    // Its idle pops so far; its next one is held 8 s, well past io_timeout (the daemon gives the owner up), the
    // owner's lease and the monitor's look (a quarter of the lease) after it; then it reaches Redis all the same.
    let before = proxy.seen(&late_pop);
    let rule = proxy.add(Fault::DelayRequest {
        matching: Matcher::script(sources::POP),
        nth: 1,
        delay: Duration::from_secs(8),
        survive_close: true,
    });
    // The idle fetcher's pop is in Redis already, behind its wait: the one it sends behind its next wait is held.
    redis.end_blocking_wait("blmove");
    let gated = serde_json::json!({ "wait_for_file": gate }).to_string();
    push_many(&config, "g", 1, &gated);
    eventually(
        Duration::from_secs(10),
        "the gated task runs under a new owner",
        || {
            let starts = dir.records().starts.len();
            (starts == 1, starts)
        },
    );
    push_many(&config, "t", 3, "{}");
    let owner = first.clone();
    eventually(Duration::from_secs(6), "the first owner released", || {
        let owners: Vec<String> = redis.cmd(&["ZRANGE", "kmq:{jobs}:owners", "0", "-1"]);
        (!owners.contains(&owner), owners)
    });
    eventually(
        Duration::from_secs(15),
        "the late pop reached Redis",
        || {
            let seen = proxy.seen(&late_pop);
            (seen > before, seen)
        },
    );
    assert_eq!(rule.fired(), 1);
    std::fs::write(&gate, "").unwrap();
    // All four done (a task the late pop took would be lost: three at most) and every slot given back. Read the
    // counts before the stats: read after, they could show the last task's slot given back while the stats
    // still showed it running (a CI failure of 2026-12-07 asserted on such a snapshot).
    eventually(
        Duration::from_secs(30),
        "the late pop took nothing: all four done, every slot given back",
        || {
            let (count, held) = (running(&redis), shares(&redis));
            let s = stats(&config, "jobs");
            (
                s.done == 4 && count == 0 && held.is_empty(),
                (s, count, held),
            )
        },
    );
    assert_eq!(counter(&redis, "running_underflow"), 0);
    daemon.stop();
}

/// Drains 12 tasks of 20 ms through a queue at `max_running = 1` (`queue`, two workers, an `idle_poll` longer than
/// the drain) whose daemon reaches Redis through a proxy, which counts the fetches (`script`'s calls) from when
/// the daemon waits idle (in `blocked_in`). Returns the tasks and the fetches.
fn fetches_at_max_running_one(
    queue: &str,
    script: &'static str,
    blocked_in: &str,
) -> (usize, usize) {
    const TASKS: usize = 12;
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let redis_section = format!("url = \"{}\"", proxy.url());
    let config = dir.config_raw(&redis_section, "", queue);
    let daemon = TestDaemon::start(&config);
    redis.wait_blocked_in(blocked_in);
    let fetches = Matcher::script(script);
    let before = proxy.seen(&fetches);
    push_many(&config, "t", TASKS, r#"{"sleep_ms":20}"#);
    assert_drained_to_zero(&config, &redis, TASKS as u64);
    let fetched = proxy.seen(&fetches) - before;
    assert_ran_once(&dir, "t", TASKS);
    daemon.stop();
    (TASKS, fetched)
}

/// A queue at its `max_running` claims again only once a settle frees a slot: the claim that fills the count is
/// followed by one that waits in Redis for the settle's wake-up marker (sent behind a `BLPOP`), not by one that
/// finds the count full, which cost a round trip and a script's run for nothing per task at the limit
/// (docs/PERFORMANCE.md, "Limits: `max_running` and `rate_limit`"). Claims counted on the wire.
#[test]
fn a_queue_at_max_running_claims_again_only_once_a_settle_frees_a_slot() {
    let queue = safe_queue("workers = 2\nmax_running = 1\nidle_poll = \"5s\"");
    let (tasks, claimed) = fetches_at_max_running_one(&queue, sources::CLAIM, "blpop");
    // One claim a task and the one that found the queue empty (a few more if the push's markers came while
    // the count was full); two a task when each claim that filled the count was followed by one that found it so.
    assert!(
        claimed <= tasks + 3,
        "{claimed} claims for {tasks} tasks at max_running 1"
    );
}

/// Default mode: a queue at its `max_running` pops again only once a settle frees a slot. A pop that finds the
/// count full waits for the settle's wake-up marker; before, the fetcher popped again at once, and spun on pop.lua
/// (a round trip and a script's run each) for as long as the count stayed full. Pops counted on the wire.
#[test]
fn a_default_mode_queue_at_max_running_pops_again_only_once_a_settle_frees_a_slot() {
    let queue = default_queue("workers = 2\nmax_running = 1\nidle_poll = \"5s\"");
    let (tasks, popped) = fetches_at_max_running_one(&queue, sources::POP, "blmove");
    // Per task, the pop that takes it and the one that finds the count full, then waits (a few more if the push's
    // markers came while the count was full); hundreds when each full count was popped at again and again.
    assert!(
        popped <= 2 * tasks + 4,
        "{popped} pops for {tasks} tasks at max_running 1"
    );
}

/// How many clients of `redis` are blocked in `BLPOP` (a safe-mode fetcher waiting for a wake-up marker).
fn blocked_in_blpop(redis: &RedisServer) -> usize {
    let list: String = redis.cmd(&["CLIENT", "LIST"]);
    list.matches("cmd=blpop").count()
}

/// Model finding 6 (model/README.md): in a rolling change of `max_running`, the fetcher of the daemon at the lower
/// limit took the wake-up marker that the daemon at the higher limit needed, its claim found the count at its own
/// limit (state 4) and passed nothing on, and the daemon at the higher limit, with a slot free under its limit and
/// a task ready, waited for its `idle_poll` (5 s here, the most a config takes). The lower daemon's fetcher waits at
/// its limit first, so its `BLPOP` is served first; the push's marker must reach the other daemon within 4 s of the
/// push, which the higher daemon's wait, begun just before the push, outlasts without the fix.
#[test]
fn in_a_rolling_change_of_max_running_the_daemon_at_the_higher_limit_claims_without_waiting_for_idle_poll()
 {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let gate = dir.path("gate");
    let data = serde_json::json!({ "wait_for_file": gate }).to_string();
    // Each daemon with a worker more than its limit: a fetcher at the limit waits in Redis, not for a worker.
    let named = |name: &str, limit: u32| {
        let queue = safe_queue(&format!(
            "workers = {}\nmax_running = {limit}\nidle_poll = \"5s\"",
            limit + 1
        ));
        let redis_section = format!("url = \"{}\"", redis.url());
        dir.config_named(
            name,
            &redis_section,
            "shutdown_grace = \"5s\"",
            &queue,
            &dir.record_file(),
        )
    };
    let (lower, higher) = (named("lower.toml", 2), named("higher.toml", 3));
    let at_two = TestDaemon::start(&lower);
    push_many(&lower, "t", 2, &data);
    // Its count at its limit of 2, its fetcher waiting for a settle's marker.
    eventually(
        Duration::from_secs(15),
        "two runs on the daemon at 2",
        || {
            let state = (
                dir.records().starts.len(),
                running(&redis),
                blocked_in_blpop(&redis),
            );
            (state == (2, 2, 1), state)
        },
    );
    // The daemon at 3 claims at once as it starts (taking nothing, noting its limit), then waits idle behind it.
    let at_three = TestDaemon::start(&higher);
    eventually(Duration::from_secs(15), "both fetchers waiting", || {
        let limit: Option<u64> = redis.cmd(&["HGET", "kmq:{jobs}:running", "q:limit"]);
        let state = (limit, blocked_in_blpop(&redis));
        (state == (Some(3), 2), state)
    });
    push_many(&lower, "u", 1, &data);
    // Under the 5 s idle_poll: the daemon at 2 takes the push's marker first and must pass it on.
    eventually(Duration::from_secs(4), "the third task started", || {
        let started = dir.records().starts.len();
        (started == 3, dir.records().starts)
    });
    assert_eq!(running(&redis), 3);
    std::fs::write(&gate, "").unwrap();
    assert_drained_to_zero(&lower, &redis, 3);
    assert_ran_once(&dir, "t", 2);
    assert_ran_once(&dir, "u", 1);
    at_three.stop();
    at_two.stop();
}
