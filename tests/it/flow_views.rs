//! What the read-only tools say of a flow (docs/OPERATIONS.md, "Monitoring"): `kmqd stats`' WAITING, the tasks
//! waiting for their dependencies, and `kmqd task show`'s kept result and flow state.

use std::path::Path;
use std::time::Duration;

use serde_json::Value as Json;

use crate::support::*;

/// `a` and `b`, keeping results; `c`, whose tasks never run while it is paused.
const QUEUES: &str = "\
[[queues]]\nname = \"a\"\nmode = \"safe\"\nretry_times = 0\nkeep_results = \"1h\"\n\n\
[[queues]]\nname = \"b\"\nmode = \"safe\"\nretry_times = 0\nkeep_results = \"1h\"\n\n\
[[queues]]\nname = \"c\"\nmode = \"safe\"\nretry_times = 0\n";

fn stats_json(config: &Path) -> Json {
    serde_json::from_str(&kmqd_ok(config, &["stats", "--json"])).unwrap()
}

/// A task of a flow waits in no list, so without WAITING it would be in no column until released: `stats`
/// counts it (table, JSON) until its dependencies end and it is released.
#[test]
fn stats_count_a_flows_waiting_tasks_until_they_are_released() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUES);
    let flow = r#"{"queue": "a", "type": "test", "id": "merge",
                   "after": [{"queue": "b", "type": "test", "id": "part-1"},
                             {"queue": "b", "type": "test", "id": "part-2",
                              "after": [{"queue": "b", "type": "test", "id": "fetch"}]}]}"#;
    client(&config).push_flow(flow).unwrap();
    let before = stats_json(&config);
    assert_eq!(before["queues"]["a"]["waiting"], 1, "{before}");
    assert_eq!(before["queues"]["b"]["waiting"], 1, "{before}");
    assert_eq!(before["queues"]["b"]["ready"], 2, "{before}");
    let table = kmqd_ok(&config, &["stats"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    let column = header
        .iter()
        .position(|title| *title == "WAITING")
        .expect("a WAITING column");
    let row: Vec<&str> = table
        .lines()
        .find(|line| line.starts_with("a "))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(row[column], "1", "{table}");

    let daemon = TestDaemon::start(&config);
    eventually(Duration::from_secs(30), "merge released and run", || {
        let now = stats_json(&config);
        let a = &now["queues"]["a"];
        (a["waiting"] == 0 && a["done"] == 1, now)
    });
    assert_eq!(stats_json(&config)["queues"]["b"]["waiting"], 0);
    daemon.stop();
}

/// `task show` prints what it knows beyond where a task waits: a kept result (done, or dead with its reason),
/// and a flow's state (waiting for N of M, released); `--json` adds them to its list.
#[test]
fn task_show_prints_a_kept_result_and_the_flow_state() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUES);
    let client = client(&config);
    client.pause("c").unwrap();
    let flow = r#"{"queue": "a", "type": "test", "id": "merge", "if_failed": "continue",
                   "after": [{"queue": "b", "type": "test", "id": "good", "data": {"result": {"rows": 2}}},
                             {"queue": "b", "type": "test", "id": "bad", "data": {"outcome": "fail"}},
                             {"queue": "c", "type": "test", "id": "slow"}]}"#;
    client.push_flow(flow).unwrap();
    // Before any of it ran: merge waits in no list, yet task show knows it.
    let waiting = kmqd_ok(&config, &["task", "show", "a", "merge"]);
    assert!(
        waiting.contains("merge in a: in a flow, waiting for 3 of its 3 dependencies"),
        "{waiting}"
    );
    let daemon = TestDaemon::start(&config);
    eventually(Duration::from_secs(30), "good done, bad dead", || {
        let out = kmqd_ok(&config, &["task", "show", "a", "merge"]);
        (
            out.contains("waiting for 1 of its 3 dependencies (1 done, 1 dead)"),
            out,
        )
    });
    let good = kmqd_ok(&config, &["task", "show", "b", "good"]);
    assert!(
        good.contains("good in b: ended done (kept result)\n  {\"rows\":2}"),
        "{good}"
    );
    let listed: Json =
        serde_json::from_str(&kmqd_ok(&config, &["task", "show", "b", "good", "--json"])).unwrap();
    assert_eq!(listed[0]["state"], "ended");
    assert_eq!(listed[0]["outcome"], "done");
    assert_eq!(listed[0]["result"], serde_json::json!({"rows": 2}));
    // bad is in the dead-letter list and its kept result says why.
    let bad: Json =
        serde_json::from_str(&kmqd_ok(&config, &["task", "show", "b", "bad", "--json"])).unwrap();
    let states: Vec<&str> = bad
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["dead", "ended"], "{bad}");
    assert_eq!(bad[1]["outcome"], "dead");

    client.resume("c").unwrap();
    eventually(Duration::from_secs(30), "merge released and done", || {
        let out = kmqd_ok(&config, &["task", "show", "a", "merge"]);
        (out.contains("ended done (kept result)"), out)
    });
    let merge: Json =
        serde_json::from_str(&kmqd_ok(&config, &["task", "show", "a", "merge", "--json"])).unwrap();
    let flow = merge
        .as_array()
        .unwrap()
        .iter()
        .find(|entry| entry["state"] == "flow")
        .unwrap_or_else(|| panic!("no flow entry in {merge}"));
    assert_eq!(
        *flow,
        serde_json::json!({"state": "flow", "flow": "released", "if_failed": "continue", "dependencies": 3,
                           "done": 2, "dead": 1})
    );
    let (code, _, err) = kmqd(
        &[
            "--config",
            config.to_str().unwrap(),
            "task",
            "show",
            "a",
            "nobody",
        ],
        None,
    );
    assert_eq!(code, 4, "{err}");
    daemon.stop();
}
