//! Periodic tasks: each slot fires once across any number of daemons, with no leader; missed slots are caught up
//! or skipped as configured.

use std::collections::HashSet;
use std::time::Duration;

use crate::support::*;

fn config_with_schedule(dir: &TestDir, redis: &RedisServer, schedule: &str) -> std::path::PathBuf {
    let queues = format!(
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\n\n[[schedules]]\nname = \"tick\"\nqueue = \"jobs\"\ntype = \"test\"\n{schedule}\n"
    );
    dir.config(redis, &queues)
}

fn tick_ids(dir: &TestDir) -> Vec<String> {
    dir.records()
        .starts
        .into_iter()
        .map(|(id, _)| id)
        .filter(|id| id.starts_with("tick@"))
        .collect()
}

#[test]
fn a_schedule_fires_once_per_slot_across_three_daemons() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = config_with_schedule(&dir, &redis, "every = \"1s\"\ndata = { n = 1 }");
    let daemons: Vec<TestDaemon> = (0..3).map(|_| TestDaemon::start(&config)).collect();
    eventually(Duration::from_secs(20), "four slots to fire", || {
        let ids = tick_ids(&dir);
        (ids.len() >= 4, ids)
    });
    for daemon in daemons {
        daemon.stop();
    }
    let ids = tick_ids(&dir);
    let distinct: HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "a slot fired twice: {ids:?}");
    let s = stats(&config, "jobs");
    // Each fired slot ran once, or was handed back at the stop.
    assert_eq!(
        (s.done as usize, s.pushed),
        (ids.len(), s.done + s.ready),
        "{s:?}"
    );

    // Consecutive slots, one second apart: none skipped while daemons ran.
    let mut slots: Vec<&str> = ids.iter().map(|id| &id["tick@".len()..]).collect();
    slots.sort();
    let seconds: Vec<u64> = slots
        .iter()
        .map(|t| {
            humantime::parse_rfc3339(t)
                .unwrap()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
        })
        .collect();
    assert!(seconds.windows(2).all(|w| w[1] == w[0] + 1), "{slots:?}");
}

/// Runs a daemon whose schedule last fired ten seconds ago, until `runs` slots ran; returns them and the time.
fn missed_slots(missed: &str, runs: usize) -> (Vec<u64>, u64) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = config_with_schedule(
        &dir,
        &redis,
        &format!(
            "every = \"1s\"\nmissed = \"{missed}\"\ncatch_up_max = 3\nmisfire_grace = \"500ms\""
        ),
    );
    let (now, _): (i64, i64) = redis.cmd(&["TIME"]);
    // The schedule last fired ten seconds ago, and no daemon ran since.
    let last_ms = (now - 10) * 1000;
    let _: i64 = redis.cmd(&["HSET", "kmq:{jobs}:schedules", "tick", &last_ms.to_string()]);
    let daemon = TestDaemon::start(&config);
    let slots = || -> Vec<u64> {
        let mut fired: Vec<u64> = tick_ids(&dir)
            .iter()
            .map(|id| {
                humantime::parse_rfc3339(&id["tick@".len()..])
                    .unwrap()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs()
            })
            .collect();
        fired.sort();
        fired
    };
    eventually(Duration::from_secs(10), "slots to run", || {
        let fired = slots();
        (fired.len() >= runs, fired)
    });
    daemon.stop();
    (slots(), now as u64)
}

#[test]
fn missed_slots_are_caught_up_up_to_catch_up_max() {
    let (fired, now) = missed_slots("catch_up", 4);
    // At least nine slots were missed; the newest three are fired, then the on-time ones follow without a gap.
    // (Which slot is the first on time depends on when the daemon got there: `now` or a second later.)
    assert!(fired.len() >= 4, "{fired:?}");
    assert!(
        fired.windows(2).all(|w| w[1] == w[0] + 1),
        "a run of consecutive slots: {fired:?}"
    );
    assert!(
        (now - 3..=now - 2).contains(&fired[0]),
        "the three newest missed slots, no older: {fired:?} (now {now})"
    );
}

#[test]
fn missed_slots_are_skipped_by_default() {
    let (fired, now) = missed_slots("skip", 1);
    assert!(
        fired.iter().all(|s| *s >= now),
        "no missed slot fired: {fired:?} (now {now})"
    );
    assert!(!fired.is_empty());
}
