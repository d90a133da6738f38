//! Byte budgets (review M8): what a daemon reads and sends at once is bounded by bytes as well as counts, and a
//! settle call Redis refuses as sent (out of memory with its arguments counted) is split until only what Redis
//! refuses alone is left, held and counted, never resent in a loop that holds up everything behind it.
//!
//! The tests make Redis short of memory with `maxmemory`: a call's arguments count in Redis's `used_memory`
//! while it runs, so a call is refused (`OOM`) when they would take it over. A call of k large arguments costs
//! k + 1 of them: Redis reads each into a buffer of its size, which becomes the argument, and sets aside a
//! buffer as large for the next one (networking.c: "if we saw a fat argument we'll see another one likely").
//! Claims of one task (`batch = 1`) keep each task in a claim list of its own, which its settle deletes: a
//! settle call then frees what the tasks it retries take again, and only the call's arguments are the margin.

use std::path::Path;
use std::time::Duration;

use crate::support::*;

/// 3.5 MiB: with its envelope, one allocation of 4 MiB in Redis (jemalloc's size classes), as a claim list's
/// element, a call's argument, a retry set's member.
const LARGE: usize = 3584 << 10;

/// A task for the testkit whose `data` is `pad` bytes of padding, that waits for `gate` to exist, then answers
/// `outcome` (a retry waits ten minutes: it stays in the retry set for the test's length).
fn task(id: &str, pad: usize, gate: &Path, outcome: &str) -> kmqd::NewTask {
    let data = serde_json::json!({
        "pad": "x".repeat(pad),
        "wait_for_file": gate,
        "outcome": outcome,
        "retry_after_ms": 600_000,
    });
    kmqd::NewTask::new("test", &data.to_string())
        .unwrap()
        .id(id.to_string())
}

/// Sets `maxmemory` to what Redis uses now plus `headroom` bytes, once its clients' buffers are back to their
/// usual size: a buffer of a large argument just read (a push's, a claim's reply) is freed or trimmed within
/// about a second (clientsCron), and counted in the measure it would widen the headroom by as much.
fn limit_memory(redis: &RedisServer, headroom: u64) {
    eventually(
        Duration::from_secs(20),
        "Redis's client buffers trimmed",
        || {
            let clients = redis.info_number("memory", "mem_clients_normal");
            (clients < 1 << 20, clients)
        },
    );
    let limit = (redis.info_number("memory", "used_memory") + headroom).to_string();
    let _: String = redis.cmd(&["CONFIG", "SET", "maxmemory", &limit]);
}

/// `jobs`'s stats, or `None` while Redis refuses the read: a transaction is refused whole while Redis is over
/// `maxmemory`, and it is, for a moment, while a call it refuses is read in.
fn stats_now(config: &Path) -> Option<kmqd::broker::QueueStats> {
    client(config).stats("jobs").ok()
}

/// Waits until `jobs`'s stats satisfy `done` (a description for the failure: `what`).
fn wait_stats(
    config: &Path,
    within: Duration,
    what: &str,
    done: impl Fn(&kmqd::broker::QueueStats) -> bool,
) -> kmqd::broker::QueueStats {
    eventually(within, what, || match stats_now(config) {
        Some(s) => (done(&s), Some(s)),
        None => (false, None),
    })
    .expect("stats read")
}

/// Waits until `jobs` has `count` tasks claimed (safe mode).
fn wait_claimed(config: &Path, count: u64) {
    wait_stats(
        config,
        Duration::from_secs(60),
        &format!("{count} tasks claimed"),
        |s| s.processing == count,
    );
}

/// Waits until the testkit recorded `count` runs that `what` ("started", "ended"): the records' `starts` or
/// `ends`.
fn wait_runs(dir: &TestDir, count: usize, what: &str) {
    eventually(
        Duration::from_secs(60),
        &format!("{count} runs {what}"),
        || {
            let records = dir.records();
            let runs = match what {
                "started" => records.starts.len(),
                _ => records.ends.len(),
            };
            (runs >= count, records.lines)
        },
    );
}

/// Runs `big` (their runs wait for `gate`) in a daemon whose acker gets every outcome of `big` in one take: a
/// blocker task goes first, is dead-lettered, and its final-failure hook holds the acker for 5 s (the testkit's
/// `dead_sleep_ms`), while the others end and gather behind it. `headroom`: what Redis may take beyond its
/// memory once every task runs. Returns the daemon, for its log.
fn settle_together(
    redis: &RedisServer,
    dir: &TestDir,
    config: &Path,
    big: Vec<kmqd::NewTask>,
    headroom: u64,
) -> Process {
    let (blocker_gate, gate) = (dir.path("blocker-gate"), dir.path("gate"));
    let count = big.len();
    let blocker = serde_json::json!({
        "wait_for_file": blocker_gate,
        "outcome": "fail",
        "dead_sleep_ms": 5000,
    });
    let mut tasks = vec![
        kmqd::NewTask::new("test", &blocker.to_string())
            .unwrap()
            .id("blocker".to_string()),
    ];
    tasks.extend(big);
    client(config).push_batch("jobs", tasks).unwrap();
    let daemon = Process::start(config, dir.path("daemon.log"));
    wait_runs(dir, count + 1, "started");
    limit_memory(redis, headroom);
    std::fs::write(&blocker_gate, "").unwrap();
    // Settled: the acker is in the blocker's hook.
    wait_stats(config, Duration::from_secs(60), "the blocker dead", |s| {
        s.dead_lettered == 1
    });
    std::fs::write(&gate, "").unwrap();
    wait_runs(dir, count + 1, "ended");
    assert!(
        dir.records().deads.is_empty(),
        "the runs ended while the acker was in the blocker's hook (a slow machine? dead_sleep_ms is 5 s)"
    );
    daemon
}

/// A queue whose claims take one task each, with a worker for each of `tasks` and one for the blocker of
/// [`settle_together`].
fn one_task_claims(tasks: usize) -> String {
    let workers = tasks + 1;
    safe_queue(&format!("workers = {workers}\nbatch = 1\nprefetch = 0"))
}

/// Runs `count` tasks of `pad` bytes that each ask for a retry, their outcomes settled together
/// ([`settle_together`]) with `headroom` bytes left in Redis; returns the daemon's log once every retry is
/// settled.
fn retries_settled_together(count: usize, pad: usize, headroom: u64) -> String {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &one_task_claims(count));
    let gate = dir.path("gate");
    let big = (0..count)
        .map(|i| task(&format!("big-{i}"), pad, &gate, "retry"))
        .collect();
    let daemon = settle_together(&redis, &dir, &config, big, headroom);
    let s = wait_stats(
        &config,
        Duration::from_secs(120),
        "the retries settled",
        |s| (s.dead_lettered, s.retried) == (1, count as u64),
    );
    assert_eq!((s.processing, s.delayed), (0, count as u64), "{s:?}");
    daemon.log_text()
}

#[test]
fn a_settle_call_redis_refuses_whole_is_settled_in_halves_that_fit() {
    // Three retries' arguments (16 MiB as read) are over the 14 MiB left; one or two (8, 12 MiB) are not.
    let log = retries_settled_together(3, LARGE, 14 << 20);
    assert!(
        log.contains("Redis refused a settle call; settling its halves apart"),
        "the whole call was refused once: {log}"
    );
    assert!(
        !log.contains("Redis refuses the outcome of one task"),
        "each task fits alone: {log}"
    );
}

#[test]
fn a_settle_batch_larger_than_a_call_goes_in_calls_redis_takes() {
    // Six retries of 15 MiB (16 MiB each in Redis): 112 MiB as one call is read, over the 96 MiB left; four,
    // the most a call of 64 MiB carries (80 MiB as read), are not.
    let log = retries_settled_together(6, (15 << 20) - 1024, 96 << 20);
    assert!(
        !log.contains("Redis refused a settle call"),
        "no call over the budget was sent: {log}"
    );
}

#[test]
fn an_outcome_redis_refuses_alone_is_held_and_counted_while_the_others_settle() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config_with(
        &redis,
        "shutdown_grace = \"5s\"\nmetrics_addr = \"127.0.0.1:0\"",
        &safe_queue("workers = 6\nbatch = 1\nprefetch = 0"),
    );
    let gate = dir.path("gate");
    let mut tasks: Vec<kmqd::NewTask> = (0..5)
        .map(|i| task(&format!("small-{i}"), 16, &gate, "retry"))
        .collect();
    tasks.push(task("big", (15 << 20) - 1024, &gate, "retry"));
    client(&config).push_batch("jobs", tasks).unwrap();
    let daemon = Process::start(&config, dir.path("daemon.log"));
    let addr = daemon.metrics_addr();
    wait_claimed(&config, 6);
    // The large retry's argument (32 MiB as read) is over the 20 MiB left, alone or not; the small ones are not
    // (one sent right after the large one may be, while Redis still keeps a buffer as large for the acker's
    // connection: it goes through when tried again, alone).
    limit_memory(&redis, 20 << 20);
    std::fs::write(&gate, "").unwrap();
    wait_refused(&config, addr, (5, 1), 1);
    let log = daemon.log_text();
    // Each refusal says what was refused and its size; the large retry's is among them.
    let refusals: Vec<(&str, usize)> = log
        .lines()
        .filter(|line| line.contains("Redis refuses the outcome of one task"))
        .map(|line| {
            let bytes = line
                .split("bytes=")
                .nth(1)
                .and_then(|rest| rest.split(' ').next())
                .and_then(|bytes| bytes.parse().ok())
                .unwrap_or_else(|| panic!("with its size: {line}"));
            (line, bytes)
        })
        .collect();
    assert!(
        refusals
            .iter()
            .any(|(line, bytes)| line.contains("op=\"retry\"")
                && (15 << 20) - 1024 < *bytes
                && *bytes < 15 << 20),
        "the large retry's refusal, with its op and size: {refusals:?}"
    );
    // Redis has room again: the held outcome is tried again, and settles.
    let _: String = redis.cmd(&["CONFIG", "SET", "maxmemory", "0"]);
    wait_refused(&config, addr, (6, 0), 0);
}

/// Waits until `jobs` counts `retried` retries with `processing` tasks still claimed, and the daemon whose
/// metrics are at `addr` counts `refused` outcomes Redis refused.
fn wait_refused(
    config: &Path,
    addr: std::net::SocketAddr,
    (retried, processing): (u64, u64),
    refused: usize,
) {
    let gauge = format!("kmqd_daemon_refused_outcomes{{queue=\"jobs\"}} {refused}");
    eventually(
        Duration::from_secs(120),
        &format!("{retried} retried, {processing} claimed, {refused} refused"),
        || {
            let s = stats_now(config);
            let page = scrape_with(addr, None, Duration::from_secs(5)).body;
            let settled = s
                .as_ref()
                .is_some_and(|s| (s.retried, s.processing) == (retried, processing));
            (settled && page.contains(&gauge), (s, page))
        },
    );
}

/// Pushes `tasks` to `jobs` and has a daemon of its own claim them all in one claim (one worker each), then
/// kills it (`kill -9`) with them: an owner whose lease (2 s) runs out holding that claim. Returns the claim list.
fn crashed_owner(redis: &RedisServer, dir: &TestDir, tasks: Vec<kmqd::NewTask>) -> String {
    let count = tasks.len();
    let first = dir.config_named(
        "first.toml",
        &format!("url = \"{}\"", redis.url()),
        "shutdown_grace = \"5s\"",
        &safe_queue(&format!(
            "workers = {count}\nprefetch = 0\nlease_timeout = \"2s\""
        )),
        &dir.path("first-runs.log"),
    );
    client(&first).push_batch("jobs", tasks).unwrap();
    let mut crashed = Process::start(&first, dir.path("first.log"));
    wait_claimed(&first, count as u64);
    crashed.kill9();
    let claims: Vec<String> = redis.cmd(&["KEYS", "kmq:{jobs}:processing:*:normal:*"]);
    let claim = claims
        .iter()
        .find(|key| !key.ends_with(":settled") && !key.ends_with(":scopes"))
        .unwrap_or_else(|| panic!("one claim list: {claims:?}"))
        .clone();
    let length: u64 = redis.cmd(&["LLEN", &claim]);
    assert_eq!(length, count as u64, "one claim of them all: {claims:?}");
    claim
}

#[test]
fn a_claim_of_large_tasks_is_recovered_in_windows_by_another_daemons_monitor() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    // Ten tasks of 3.5 MiB in one claim: 35 MiB.
    let gate = dir.path("gate");
    let tasks = (0..10)
        .map(|i| task(&format!("big-{i}"), LARGE, &gate, "done"))
        .collect();
    crashed_owner(&redis, &dir, tasks);
    // Redis drops a client whose replies wait past 20 MiB: a monitor reading the claim whole (35 MiB) never
    // gets it. Its windows of 16 MiB (four tasks of at most 4 MiB, the queue's max_task_bytes) it does.
    let _: String = redis.cmd(&[
        "CONFIG",
        "SET",
        "client-output-buffer-limit",
        "normal 20mb 0 0",
    ]);
    let second = dir.config(
        &redis,
        &safe_queue("workers = 1\nprefetch = 0\nmax_task_bytes = 4194304"),
    );
    std::fs::write(&gate, "").unwrap();
    let daemon = TestDaemon::start(&second);
    let s = wait_stats(
        &second,
        Duration::from_secs(120),
        "the claim recovered and run",
        |s| (s.recovered, s.done) == (10, 10),
    );
    daemon.stop();
    assert_eq!(s.processing, 0, "{s:?}");
}

/// A monitor whose recovery of one task Redis refuses (its record, out of memory) leaves that task in its claim,
/// recovers the tasks after it, and recovers it on a later pass once Redis has room: before, it sent the same
/// call again for ever, and recovered nothing of any queue.
#[test]
fn a_recovery_redis_refuses_is_left_for_a_later_pass_and_the_others_go() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let gate = dir.path("gate");
    // The large one first in the claim: the monitor meets it before the others.
    let mut tasks = vec![task("big", (15 << 20) - 1024, &gate, "done")];
    tasks.extend((0..4).map(|i| task(&format!("small-{i}"), 16, &gate, "done")));
    crashed_owner(&redis, &dir, tasks);
    // The large task's record (32 MiB as read) is over the 20 MiB left; the small ones are not.
    limit_memory(&redis, 20 << 20);
    std::fs::write(&gate, "").unwrap();
    let second = dir.config(&redis, &safe_queue("workers = 1\nprefetch = 0"));
    let daemon = TestDaemon::start(&second);
    wait_stats(
        &second,
        Duration::from_secs(60),
        "the small tasks recovered and run, the large one left in its claim",
        |s| (s.recovered, s.done, s.processing) == (4, 4, 1),
    );
    // settle.lua (over 32 KiB), loaded when the call with the large record met NOSCRIPT, is cached at its own
    // size: loaded on that call's connection, Redis kept it in the record's 15 MiB buffer, over maxmemory, and
    // refused every recovery and claim after it (broker::load_settle).
    let cached = redis.info_number("memory", "used_memory_scripts_eval");
    assert!(cached < 1 << 20, "the script cache holds {cached} bytes");
    let _: String = redis.cmd(&["CONFIG", "SET", "maxmemory", "0"]);
    let s = wait_stats(
        &second,
        Duration::from_secs(60),
        "the large one recovered on a later pass",
        |s| (s.recovered, s.done) == (5, 5),
    );
    daemon.stop();
    assert_eq!(s.processing, 0, "{s:?}");
}

/// Pushes `count` tasks of 1 MiB each to `level` of `jobs`, ids `{prefix}{i}`, ten at a time.
fn push_mib_tasks(config: &Path, level: &str, prefix: &str, count: usize) {
    let data = serde_json::json!({ "pad": "x".repeat(1 << 20) }).to_string();
    for chunk in 0..count.div_ceil(10) {
        let tasks: Vec<kmqd::NewTask> = (chunk * 10..count.min(chunk * 10 + 10))
            .map(|i| {
                kmqd::NewTask::new("test", &data)
                    .unwrap()
                    .id(format!("{prefix}{i}"))
                    .priority(level)
            })
            .collect();
        client(config).push_batch("jobs", tasks).unwrap();
    }
}

/// Runs `jobs` (already pushed, `count` tasks) in a daemon of `queue` whose connection goes through a proxy,
/// with Redis dropping a client whose replies wait past 70 MiB; returns the proxy, to see what was sent.
fn run_with_replies_bounded(
    redis: &RedisServer,
    dir: &TestDir,
    queue: &str,
    count: u64,
) -> crate::support::proxy::FaultProxy {
    let _: String = redis.cmd(&[
        "CONFIG",
        "SET",
        "client-output-buffer-limit",
        "normal 70mb 0 0",
    ]);
    let proxy = crate::support::proxy::FaultProxy::start(redis);
    let through = dir.config_named(
        "through.toml",
        &format!("url = \"{}\"", proxy.url()),
        "shutdown_grace = \"5s\"",
        queue,
        &dir.record_file(),
    );
    let daemon = TestDaemon::start(&through);
    let s = wait_stats(&through, Duration::from_secs(600), "the backlog run", |s| {
        s.done == count
    });
    daemon.stop();
    assert_eq!((s.ready, s.dead), (0, 0), "{s:?}");
    proxy
}

/// A default-mode pop hands the daemon at most 64 MiB of tasks (one more if the first is larger), through pop.lua
/// (which puts back what it popped past that) and through the plain pop (take.lua, which copies no more than that
/// out of the list): Redis drops a client whose replies wait past 70 MiB, so a pop of the whole backlog (150 MiB)
/// is lost with its tasks. Both ways are seen on the wire.
#[test]
fn a_pop_takes_no_more_bytes_than_its_budget_either_way() {
    use kmqd::broker::sources;

    // Loaded, as a daemon that ran before would have left it: the first plain pop then runs it at once (not
    // pop.lua in its place), with 86 MiB left after pop.lua's first 64.
    let seen = drain_150_mib_with_replies_bounded(
        &default_queue("workers = 2\nprefetch = 200"),
        |redis| {
            let _: String = redis.cmd(&["SCRIPT", "LOAD", sources::TAKE]);
        },
        &[sources::POP, sources::TAKE],
    );
    assert!(
        seen.iter().all(|&calls| calls > 0),
        "both ways of popping were used: {seen:?}"
    );
}

/// Pushes 150 tasks of 1 MiB to `jobs` of `queue` (room for the whole backlog: what bounds a take is its bytes),
/// calls `before` with the Redis, and has them run as in [`run_with_replies_bounded`]; returns how many calls of
/// each script's source were seen on the wire.
fn drain_150_mib_with_replies_bounded(
    queue: &str,
    before: impl FnOnce(&RedisServer),
    scripts: &[&str],
) -> Vec<usize> {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    push_mib_tasks(&dir.config(&redis, queue), "normal", "big-", 150);
    before(&redis);
    let proxy = run_with_replies_bounded(&redis, &dir, queue, 150);
    scripts
        .iter()
        .map(|script| proxy.seen(&crate::support::proxy::Matcher::script(script)))
        .collect()
}

/// A safe-mode claim takes at most 64 MiB of ready tasks (claim.lua, "Bytes"): Redis drops a client whose replies
/// wait past 70 MiB, so a claim of more of the backlog (150 MiB) is lost with its reply, and so is every adoption
/// that reads it back: before, the claims doubled to 128 tasks and the queue never drained.
#[test]
fn a_claim_takes_no_more_bytes_than_its_budget() {
    let queue = safe_queue("workers = 2\nprefetch = 200");
    // claim_plain.lua first (the queue has no limit); each claim of more than its budget goes to claim.lua, which
    // cuts it.
    let scripts = [
        kmqd::broker::sources::CLAIM_PLAIN,
        kmqd::broker::sources::CLAIM,
    ];
    let seen = drain_150_mib_with_replies_bounded(&queue, |_| {}, &scripts);
    assert!(seen.iter().all(|&calls| calls > 0), "claimed: {seen:?}");
}

/// A ready task larger than a claim's byte budget (64 MiB) but within `max_task_bytes` is claimed alone, and the
/// tasks behind it by the next claims: the budget never leaves a task that no claim takes.
#[test]
fn a_task_larger_than_a_claims_budget_is_claimed_alone() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &safe_queue("workers = 2\nprefetch = 20\nmax_task_bytes = 100663296"),
    );
    let huge = serde_json::json!({ "pad": "x".repeat(66 << 20) }).to_string();
    let task = kmqd::NewTask::new("test", &huge).unwrap().id("huge");
    client(&config).push("jobs", task).unwrap();
    push_mib_tasks(&config, "normal", "big-", 10);
    let daemon = TestDaemon::start(&config);
    let s = wait_stats(&config, Duration::from_secs(60), "the backlog run", |s| {
        s.done == 11
    });
    daemon.stop();
    assert_eq!((s.ready, s.processing, s.dead), (0, 0, 0), "{s:?}");
    assert_ran_once(&dir, "big-", 10);
    assert_eq!(dir.records().runs_of("huge"), 1);
}

/// A pop by turns between weighted levels (pop.lua) puts back what it took past its bytes to the level each
/// task came from, in its order: every task runs, each level's in the order pushed.
#[test]
fn a_pop_by_turns_puts_back_each_levels_tasks_past_its_bytes() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queue = default_queue(
        "workers = 1\nprefetch = 200\npriorities = [\"high\", \"low\"]\npriority_weights = [1, 1]",
    );
    let config = dir.config(&redis, &queue);
    push_mib_tasks(&config, "high", "high-", 50);
    push_mib_tasks(&config, "low", "low-", 50);
    run_with_replies_bounded(&redis, &dir, &queue, 100);
    let starts = dir.records().starts;
    for level in ["high-", "low-"] {
        let order: Vec<usize> = starts
            .iter()
            .filter_map(|(id, _)| id.strip_prefix(level)?.parse().ok())
            .collect();
        assert_eq!(order, (0..50).collect::<Vec<_>>(), "{level} in order");
    }
}

/// A plain pop whose list's head is surely within its bytes (the list's first nodes, which MEMORY USAGE weighs,
/// are) pops it natively in take.lua's transaction: nothing is copied out of the list (no `SORT ... STORE`), which
/// cost Redis about 0.15 µs a task of a default-mode drain (docs/PERFORMANCE.md, "Byte budgets").
#[test]
fn a_plain_pop_of_a_head_within_its_bytes_copies_nothing() {
    const TASKS: u64 = 2000;
    let (redis, _dir, config, daemon) = plain_popping(TASKS, "{}");
    wait_stats(&config, Duration::from_secs(60), "the backlog run", |s| {
        s.done == TASKS
    });
    daemon.stop();
    let info: String = redis.cmd(&["INFO", "commandstats"]);
    assert!(info.contains("cmdstat_lmpop:"), "plain pops ran: {info}");
    assert!(
        !info.contains("cmdstat_sort:"),
        "a plain pop copied its tasks: {info}"
    );
}

/// A plain pop whose script Redis lost (a restart, a failover, `SCRIPT FLUSH`) takes nothing: the transaction's
/// `LMPOP` runs whatever the script answered, and without the guard take.lua deletes it popped a batch nobody
/// weighed, whose tasks the daemon never saw (pop.lua took over, and they were gone: lost in default mode).
#[test]
fn a_plain_pop_whose_script_redis_lost_takes_nothing() {
    const TASKS: u64 = 2000;
    let (redis, dir, config, daemon) = plain_popping(TASKS, r#"{"sleep_ms":1}"#);
    // Plain pops under way (the first pop, through pop.lua, took 100), then the scripts gone, twice.
    for done in [300, 900] {
        wait_stats(&config, Duration::from_secs(60), "plain pops", |s| {
            s.done >= done
        });
        let _: () = redis.cmd(&["SCRIPT", "FLUSH"]);
    }
    let s = wait_stats(&config, Duration::from_secs(60), "every task run", |s| {
        s.done == TASKS && s.ready == 0
    });
    daemon.stop();
    assert_eq!(s.done, TASKS, "{s:?}");
    assert_ran_once(&dir, "t", TASKS as usize);
}

/// A default-mode daemon popping `tasks` tasks of `data` in pops of 100: after the first (pop.lua, which learns that
/// no unique id is held), plain ones (take.lua).
fn plain_popping(tasks: u64, data: &str) -> (RedisServer, TestDir, std::path::PathBuf, TestDaemon) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queue = default_queue("workers = 2\nbatch = 100\nprefetch = 200");
    let config = dir.config(&redis, &queue);
    push_many(&config, "t", tasks as usize, data);
    let daemon = TestDaemon::start(&config);
    (redis, dir, config, daemon)
}
