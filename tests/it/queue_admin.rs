//! What an operator does without redis-cli: pause and resume a queue on every daemon (`kmqd queue`), and see
//! who serves it (`kmqd workers`, `CLIENT LIST`). docs/OPERATIONS.md, "Pausing a queue" and "Who is serving".

use std::path::Path;
use std::time::{Duration, Instant};

use kmqd::NewTask;

use crate::support::*;

/// `idle_poll` of these tests' queues: short, so that "nothing was taken for many idle_poll periods" is quick
/// to watch.
const IDLE_POLL_MS: u64 = 100;

fn queue(mode: &str, extra: &str) -> String {
    format!(
        "[[queues]]\nname = \"jobs\"\nmode = \"{mode}\"\nworkers = 2\nidle_poll = \"{IDLE_POLL_MS}ms\"\n{extra}\n"
    )
}

fn cli(config: &Path, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["-c", config.to_str().unwrap()];
    all.extend_from_slice(args);
    kmqd(&all, None)
}

fn stats_json(config: &Path) -> serde_json::Value {
    let (code, out, err) = cli(config, &["stats", "--json"]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str::<serde_json::Value>(&out).unwrap()["queues"]["jobs"].clone()
}

fn commands_processed(redis: &RedisServer) -> u64 {
    redis.info_number("stats", "total_commands_processed")
}

/// Two daemons serve the queue; a slow task runs when the queue is paused. It finishes and is settled; the
/// tasks pushed while paused, and a delayed task that became due meanwhile, wait in the ready list, untaken
/// for many `idle_poll` periods, while the fetchers look only once per `idle_poll` (no spinning); the resume
/// runs them all, once each.
fn pause_holds_new_tasks_and_lets_running_ones_finish(mode: &str) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let port = free_port();
    let config = dir.config_with(
        &redis,
        &format!("shutdown_grace = \"5s\"\nmetrics_addr = \"127.0.0.1:{port}\""),
        &queue(mode, ""),
    );
    let second = dir.config_named(
        "second.toml",
        &format!("url = \"{}\"", redis.url()),
        "shutdown_grace = \"5s\"",
        &queue(mode, ""),
        &dir.record_file(),
    );
    let a = TestDaemon::start(&config);
    let b = TestDaemon::start(&second);
    eventually(Duration::from_secs(10), "both daemons registered", || {
        let owners: u64 = redis.cmd(&["ZCARD", "kmq:{jobs}:owners"]);
        (owners == 2, owners)
    });

    push_many(&config, "slow", 1, r#"{"sleep_ms": 1500}"#);
    eventually(Duration::from_secs(10), "the slow task to start", || {
        let runs = dir.records().runs_of("slow0");
        (runs == 1, runs)
    });
    let (code, out, err) = cli(&config, &["queue", "pause", "jobs"]);
    assert_eq!((code, out.as_str()), (0, "paused jobs\n"), "{err}");
    let (code, out, _) = cli(&config, &["queue", "pause", "jobs"]);
    assert_eq!((code, out.as_str()), (0, "jobs was paused already\n"));

    // Pushes are accepted while paused; a delayed task still becomes ready.
    push_many(&config, "held", 20, "{}");
    client(&config)
        .push(
            "jobs",
            NewTask::new("test", "{}")
                .unwrap()
                .id("later")
                .delay(Duration::from_millis(300)),
        )
        .unwrap();
    // The task running at pause time finishes and is settled normally.
    wait_done(&config, 1, Duration::from_secs(10));
    eventually(
        Duration::from_secs(10),
        "the delayed task to become ready",
        || {
            let s = stats(&config, "jobs");
            (s.ready == 21 && s.delayed == 0, s)
        },
    );
    // Nothing is taken for ten idle_poll periods, and the fetchers do not spin meanwhile: two idle fetchers look
    // once per idle_poll each (a spinning one sends thousands of commands a second); a safe-mode claim is a
    // transaction of four commands or more (MULTI, the script, a read of each claim list, EXEC).
    let before = commands_processed(&redis);
    std::thread::sleep(Duration::from_millis(10 * IDLE_POLL_MS));
    let sent = commands_processed(&redis) - before;
    assert!(sent < 600, "{sent} commands in 10 idle_poll periods");
    let s = stats(&config, "jobs");
    assert_eq!((s.ready, s.processing, s.done), (21, 0, 1), "{s:?}");
    let starts = dir.records().starts;
    assert_eq!(starts, [("slow0".to_string(), 0)], "nothing else started");

    // Shown by stats (table and JSON) and by the metrics.
    let json = stats_json(&config);
    assert_eq!(json["paused"], true, "{json}");
    let (_, table, _) = cli(&config, &["stats"]);
    println!("kmqd stats:\n{table}kmqd stats --json: {json}");
    let row = table.lines().nth(1).unwrap();
    assert!(row.split_whitespace().nth(2) == Some("paused"), "{table}");
    eventually(Duration::from_secs(10), "the paused gauge", || {
        let page = scrape(port).body;
        (page.contains("kmqd_queue_paused{queue=\"jobs\"} 1"), page)
    });

    // Resumed: everything runs promptly, once.
    let resumed_at = Instant::now();
    let (code, out, _) = cli(&config, &["queue", "resume", "jobs"]);
    assert_eq!((code, out.as_str()), (0, "resumed jobs\n"));
    let (_, out, _) = cli(&config, &["queue", "resume", "jobs"]);
    assert_eq!(out, "jobs was not paused\n");
    wait_done(&config, 22, Duration::from_secs(10));
    assert!(
        resumed_at.elapsed() < Duration::from_secs(5),
        "{:?}",
        resumed_at.elapsed()
    );
    let records = dir.records();
    for id in (0..20).map(|i| format!("held{i}")).chain(["later".into()]) {
        assert_eq!(records.runs_of(&id), 1, "{id}");
    }
    assert_eq!(stats_json(&config)["paused"], false);
    eventually(Duration::from_secs(10), "the gauge back to 0", || {
        let page = scrape(port).body;
        (page.contains("kmqd_queue_paused{queue=\"jobs\"} 0"), page)
    });
    a.stop();
    b.stop();
}

#[test]
fn pause_in_safe_mode_holds_new_tasks_and_lets_running_ones_finish() {
    pause_holds_new_tasks_and_lets_running_ones_finish("safe");
}

#[test]
fn pause_in_default_mode_holds_new_tasks_and_lets_running_ones_finish() {
    pause_holds_new_tasks_and_lets_running_ones_finish("default");
}

/// Default mode's plain pops (LMPOP in a transaction, used after a big batch) honour the pause too: a backlog
/// drained by plain pops stops being taken once the queue is paused.
#[test]
fn pause_stops_default_mode_plain_pops_of_a_backlog() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    // Pops of 100 (prefetch 200), so that after the first big one they are plain.
    let config = dir.config(&redis, &queue("default", "batch = 100\nprefetch = 200"));
    push_many(&config, "fast", 2000, r#"{"sleep_ms": 2}"#);
    let daemon = TestDaemon::start(&config);
    eventually(Duration::from_secs(10), "some tasks done", || {
        let s = stats(&config, "jobs");
        (s.done >= 200, s)
    });
    let (code, _, _) = cli(&config, &["queue", "pause", "jobs"]);
    assert_eq!(code, 0);
    // Within one fetch: what a pop in flight took still runs; then nothing leaves the ready list.
    let ready = eventually(
        Duration::from_secs(5),
        "the ready list to hold still",
        || {
            let first = stats(&config, "jobs").ready;
            std::thread::sleep(Duration::from_millis(3 * IDLE_POLL_MS));
            let then = stats(&config, "jobs").ready;
            (first == then, then)
        },
    );
    assert!(
        ready > 0,
        "the backlog was drained: before the pause, or by pops after it"
    );
    // The pops were plain ones (LMPOP in MULTI/EXEC), the path this test is about.
    let commandstats: String = redis.cmd(&["INFO", "commandstats"]);
    assert!(
        commandstats.contains("cmdstat_exec:"),
        "no plain pop ran:\n{commandstats}"
    );
    std::thread::sleep(Duration::from_millis(5 * IDLE_POLL_MS));
    assert_eq!(stats(&config, "jobs").ready, ready);
    assert_eq!(cli(&config, &["queue", "resume", "jobs"]).0, 0);
    wait_done(&config, 2000, Duration::from_secs(30));
    daemon.stop();
}

#[test]
fn pausing_an_unknown_queue_is_a_usage_error() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue("safe", ""));
    let (code, _, err) = cli(&config, &["queue", "pause", "nope"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("nope"), "{err}");
    let exists: i64 = redis.cmd(&["EXISTS", "kmq:{nope}:paused"]);
    assert_eq!(exists, 0);
}

/// A producer in another language pauses with plain Redis, as docs/PROTOCOL.md says.
#[test]
fn a_plain_set_of_the_paused_key_pauses_the_queue() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue("safe", ""));
    let _: () = redis.cmd(&["SET", "kmq:{jobs}:paused", "1"]);
    let daemon = TestDaemon::start(&config);
    push_many(&config, "t", 3, "{}");
    std::thread::sleep(Duration::from_millis(5 * IDLE_POLL_MS));
    let s = stats(&config, "jobs");
    assert_eq!((s.ready, s.done, s.paused), (3, 0, true), "{s:?}");
    let _: i64 = redis.cmd(&["DEL", "kmq:{jobs}:paused"]);
    wait_done(&config, 3, Duration::from_secs(10));
    daemon.stop();
}

fn workers_json(config: &Path) -> Vec<serde_json::Value> {
    let (code, out, err) = cli(config, &["workers", "--json"]);
    assert_eq!(code, 0, "{err}");
    let value: serde_json::Value = serde_json::from_str(&out).unwrap();
    value["workers"].as_array().unwrap().clone()
}

/// `kmqd workers` lists both daemons (real processes: two pids) with what each holds; one that stops gracefully
/// shows as draining while its last task finishes, then is gone, its registration removed. Every connection of
/// a daemon is named `kmqd:HOST:PID:ROLE` in `CLIENT LIST`.
#[test]
fn workers_lists_the_live_daemons_and_drops_one_after_its_graceful_stop() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 1\nprefetch = 0\nidle_poll = \"100ms\"\n\
         lease_timeout = \"3s\"\n",
    );
    let mut one = Process::start(&config, dir.path("one.log"));
    let two = Process::start(&config, dir.path("two.log"));
    let pids = [one.child.id(), two.child.id()];
    let host = kmqd::broker::hostname();
    eventually(Duration::from_secs(20), "two workers", || {
        let workers = workers_json(&config);
        (workers.len() == 2, workers)
    });
    // Every connection of both daemons carries its name.
    // (The ackers connect at their first settlement, and the heartbeat at its first renewal; a daemon holds one
    // task at a time, so each takes one of the two.)
    push_many(&config, "quick", 2, r#"{"sleep_ms": 300}"#);
    wait_done(&config, 2, Duration::from_secs(10));
    eventually(Duration::from_secs(10), "every connection named", || {
        let clients: String = redis.cmd(&["CLIENT", "LIST"]);
        let mut missing = Vec::new();
        for pid in pids {
            for role in [
                "fetcher-jobs",
                "acker-jobs",
                "delay-jobs",
                "heartbeat",
                "monitor",
                "delay-listener",
            ] {
                let name = format!("name=kmqd:{host}:{pid}:{role} ");
                if !clients.contains(&name) {
                    missing.push(name);
                }
            }
        }
        (missing.is_empty(), (missing, clients))
    });

    // One slow task each: with one worker and no prefetch, a daemon holds at most one.
    push_many(&config, "slow", 2, r#"{"sleep_ms": 2000}"#);
    let workers = eventually(Duration::from_secs(10), "each daemon to hold one", || {
        let workers = workers_json(&config);
        let held: Vec<_> = workers.iter().map(|w| w["held"].clone()).collect();
        (held == [1, 1], workers)
    });
    let mut listed: Vec<u64> = workers.iter().map(|w| w["pid"].as_u64().unwrap()).collect();
    listed.sort_unstable();
    let mut expected: Vec<u64> = pids.iter().map(|&p| u64::from(p)).collect();
    expected.sort_unstable();
    assert_eq!(listed, expected);
    for w in &workers {
        assert_eq!(w["host"], host.as_str(), "{w}");
        assert_eq!(w["queue"], "jobs");
        assert_eq!(w["mode"], "safe");
        assert_eq!(w["version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(
            (w["draining"].clone(), w["paused"].clone()),
            (false.into(), false.into())
        );
        assert!(w["lease_left_ms"].as_i64().unwrap() > 0, "{w}");
        assert!(w["started_at_ms"].as_i64().unwrap() > 0, "{w}");
    }
    let (code, table, _) = cli(&config, &["workers"]);
    println!("kmqd workers:\n{table}");
    assert_eq!(code, 0);
    assert_eq!(table.lines().count(), 3, "{table}");
    assert!(
        table.contains(&format!(" {} ", pids[0])) && table.contains("serving"),
        "{table}"
    );

    // A graceful stop: draining while its task finishes, then gone, its registration with it.
    let owner = workers.iter().find(|w| w["pid"] == pids[0]).unwrap()["owner"]
        .as_str()
        .unwrap()
        .to_string();
    one.signal(15);
    eventually(
        Duration::from_secs(10),
        "the stopping daemon to show as draining",
        || {
            let workers = workers_json(&config);
            let draining = workers
                .iter()
                .any(|w| w["pid"] == pids[0] && w["draining"] == true);
            (draining, workers)
        },
    );
    let (_, table, _) = cli(&config, &["workers"]);
    println!("kmqd workers, one stopping:\n{table}");
    assert!(table.contains("draining"), "{table}");
    assert_eq!(
        one.wait_within(Duration::from_secs(20)),
        Some(0),
        "{}",
        one.log_text()
    );
    let workers = workers_json(&config);
    assert_eq!(workers.len(), 1, "{workers:?}");
    assert_eq!(workers[0]["pid"], pids[1]);
    let registration: i64 = redis.cmd(&["EXISTS", &format!("kmq:{{jobs}}:owner:{owner}")]);
    assert_eq!(registration, 0, "the registration is removed");
    wait_done(&config, 4, Duration::from_secs(10));
    drop(two);
}
