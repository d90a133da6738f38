//! A task's result and its flow on the dashboard (docs/DASHBOARD.md, "Results and flows"): the JSON API's
//! graph, each node's state, result and reason, paged so that a fan-in of hundreds is never sent whole; and the
//! task page's tree in a real headless Chromium (tests/it/dashboard/flows.py), each node clickable to its own
//! page, a result that holds `<script>` shown as text and never run.

use std::process::Command;
use std::time::Duration;

use serde_json::Value as Json;

use super::browser::{PYTHON, chromium_is_here};
use super::{Dashboard, status};
use crate::support::*;

/// `a` and `b` served and keeping results; `c` paused for the length of the test, so that its tasks never end.
const QUEUES: &str = "\
[[queues]]\nname = \"a\"\nmode = \"safe\"\nretry_times = 0\nkeep_results = \"1h\"\n\n\
[[queues]]\nname = \"b\"\nmode = \"safe\"\nretry_times = 0\nkeep_results = \"1h\"\n\n\
[[queues]]\nname = \"c\"\nmode = \"safe\"\nretry_times = 0\nkeep_results = \"1h\"\n";

/// What part-1's handler returns: markup a page must show as text.
const HOSTILE: &str =
    "<script>window.__pwned = 1</script><img src=x onerror=\"window.__pwned = 2\">";

/// A flow run part way: `report` (a) waits, under `if_failed = "continue"`, for part-1 (done, with a result),
/// part-2 (dead), part-3 (in the paused `c`: pending), part-4 (running until the daemon stops) and `step` (a),
/// which waits for `fetch` (`c`: pending).
fn a_flow_run_part_way() -> (
    RedisServer,
    TestDir,
    std::path::PathBuf,
    TestDaemon,
    Dashboard,
) {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUES);
    let client = client(&config);
    client.pause("c").unwrap();
    let flow = serde_json::json!({
        "queue": "a", "type": "test", "id": "report", "if_failed": "continue",
        "after": [
            {"queue": "b", "type": "test", "id": "part-1", "data": {"result": {"rows": 1, "html": HOSTILE}}},
            {"queue": "b", "type": "test", "id": "part-2", "data": {"outcome": "fail"}},
            {"queue": "c", "type": "test", "id": "part-3"},
            {"queue": "b", "type": "test", "id": "part-4", "data": {"until_cancelled": true}},
            {"queue": "a", "type": "test", "id": "step",
             "after": [{"queue": "c", "type": "test", "id": "fetch"}]},
        ],
    });
    client.push_flow(&flow.to_string()).unwrap();
    let daemon = TestDaemon::start(&config);
    let dashboard = Dashboard::start(&config, &dir, &[]);
    eventually(Duration::from_secs(30), "part-1 done, part-2 dead", || {
        let answer = dashboard.json("/api/queues/a/tasks/report/flow");
        let states: Vec<String> = answer["flow"]["after"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|node| node["state"].as_str().unwrap_or("").to_string())
            .collect();
        (
            states == ["done", "dead", "pending", "running", "waiting"],
            answer,
        )
    });
    (redis, dir, config, daemon, dashboard)
}

/// The graph under a waiting task: each node's state, result and reason, the counts of what it waits for, a
/// dependency's own page with its kept result; `?offset=` and `?limit=` page the root's dependencies, bounded;
/// the routes answer only to the dashboard's own Host, as every other does.
#[test]
fn a_tasks_flow_shows_each_nodes_state_result_and_reason_paged() {
    let (_redis, _dir, _config, daemon, dashboard) = a_flow_run_part_way();
    let task = dashboard.json("/api/queues/a/tasks/report");
    assert_eq!(task["result"], Json::Null, "report has not ended");
    let root = &task["flow"];
    assert_eq!(root["state"], "waiting");
    assert_eq!(
        root["flow"],
        serde_json::json!({"flow": "waiting", "if_failed": "continue", "dependencies": 5, "done": 1, "dead": 1})
    );
    let after = root["after"].as_array().unwrap();
    assert_eq!(after[0]["id"], "part-1");
    assert_eq!(after[0]["result"]["html"], HOSTILE);
    assert_eq!(after[1]["id"], "part-2");
    assert_eq!(after[1]["state"], "dead");
    assert!(
        !after[1]["reason"].as_str().unwrap_or("").is_empty(),
        "{}",
        after[1]
    );
    assert_eq!(
        (&after[2]["queue"], &after[2]["state"]),
        (&"c".into(), &"pending".into())
    );
    assert_eq!(
        (&after[3]["id"], &after[3]["state"]),
        (&"part-4".into(), &"running".into())
    );
    assert_eq!(after[4]["id"], "step");
    assert_eq!(after[4]["flow"]["dependencies"], 1);
    assert_eq!(after[4]["after"][0]["id"], "fetch");
    assert_eq!(after[4]["after"][0]["state"], "pending");
    assert_eq!(root["more"], 0);

    // A dependency's own page: where it is (nowhere: it ended) and its kept result.
    let part = dashboard.json("/api/queues/b/tasks/part-1");
    assert_eq!(part["result"]["state"], "done");
    assert_eq!(part["result"]["result"]["rows"], 1);
    assert_eq!(part["flow"], Json::Null, "part-1 waits for nothing");
    let dead = dashboard.json("/api/queues/b/tasks/part-2/flow");
    assert_eq!(dead["result"]["state"], "dead");

    // Paged: the second of the root's dependencies alone, then past the end.
    let page = dashboard.json("/api/queues/a/tasks/report/flow?offset=1&limit=1");
    let after = page["flow"]["after"].as_array().unwrap();
    assert_eq!(after.len(), 1);
    assert_eq!(after[0]["id"], "part-2");
    assert_eq!(
        (&page["flow"]["offset"], &page["flow"]["more"]),
        (&1.into(), &3.into())
    );
    let past = dashboard.json("/api/queues/a/tasks/report/flow?offset=9");
    assert_eq!(past["flow"]["after"], serde_json::json!([]));
    assert_eq!(past["flow"]["more"], 0);

    let bad = dashboard.get("/api/queues/a/tasks/report/flow?limit=many");
    assert_eq!(status(&bad), 400, "{bad:?}");
    let unknown = dashboard.get("/api/queues/nope/tasks/report/flow");
    assert_eq!(status(&unknown), 404, "{unknown:?}");
    let rebound = dashboard.request(
        "GET",
        "/api/queues/a/tasks/report/flow",
        &[("Host", "evil.example:80")],
        "",
    );
    assert_eq!(status(&rebound), 421, "{rebound:?}");
    daemon.stop();
}

/// A fan-in of 300 tasks is never sent whole: a page of 20 (100 at most, whatever `?limit=` asks) and the count
/// of the rest, with the counts by state of all of them. The routes need the dashboard's authentication as every
/// other does (here its bearer token).
#[test]
fn a_fan_in_is_sent_as_a_page_and_counts() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let token = "5be1c0ffee5be1c0ffee5be1c0ffee00";
    std::fs::write(dir.path("token"), format!("{token}\n")).unwrap();
    let config = dir.config(
        &redis,
        &format!("{QUEUES}\n[dashboard]\ntoken_file = \"token\"\n"),
    );
    let parts: Vec<Json> = (0..300)
        .map(|n| serde_json::json!({"queue": "c", "type": "test", "id": format!("part-{n}")}))
        .collect();
    let flow = serde_json::json!({"queue": "a", "type": "test", "id": "merge", "after": parts});
    client(&config).push_flow(&flow.to_string()).unwrap();
    let dashboard = Dashboard::start(&config, &dir, &[]);
    let bearer = format!("Bearer {token}");
    let get = |path: &str| -> Json {
        let answer = dashboard.request("GET", path, &[("Authorization", &bearer)], "");
        assert_eq!(status(&answer), 200, "GET {path}: {answer:?}");
        serde_json::from_str(&answer.body).unwrap()
    };
    for path in [
        "/api/queues/a/tasks/merge/flow",
        "/api/queues/a/tasks/merge",
    ] {
        let refused = dashboard.get(path);
        assert_eq!(status(&refused), 401, "{path}: {refused:?}");
    }
    let first = get("/api/queues/a/tasks/merge/flow");
    let root = &first["flow"];
    assert_eq!(root["after"].as_array().unwrap().len(), 20);
    assert_eq!(root["more"], 280);
    assert_eq!(root["flow"]["dependencies"], 300);
    let most = get("/api/queues/a/tasks/merge/flow?offset=250&limit=100000");
    assert_eq!(most["flow"]["after"].as_array().unwrap().len(), 50);
    assert_eq!(most["flow"]["after"][0]["id"], "part-250");
    let capped = get("/api/queues/a/tasks/merge/flow?limit=100000");
    assert_eq!(capped["flow"]["after"].as_array().unwrap().len(), 100);
    assert_eq!(capped["flow"]["more"], 200);
    let task = get("/api/queues/a/tasks/merge");
    assert_eq!(task["flow"]["after"].as_array().unwrap().len(), 20);
}

/// The task page's tree in a real browser: each node's state, the result shown as text (its `<script>` never
/// runs), a node's link opening its own page with its result; and the queue's tasks waiting for their
/// dependencies on the overview and the queue's page.
#[test]
fn a_tasks_page_draws_its_flow_as_a_tree_whose_nodes_open_their_pages() {
    chromium_is_here();
    let (_redis, dir, _config, daemon, dashboard) = a_flow_run_part_way();
    let shots = dir.path("screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let args = serde_json::json!({
        "url": format!("http://{}", dashboard.addr),
        "shots": shots,
        "hostile": HOSTILE,
    });
    let script = workspace_dir().join("tests/it/dashboard/flows.py");
    let output = Command::new(PYTHON)
        .arg(&script)
        .arg(args.to_string())
        .output()
        .expect("run flows.py");
    assert!(
        output.status.success(),
        "flows.py: {}{}\ndashboard log:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
        dashboard.log()
    );
    let shot = shots.join("dashboard-flow.png");
    assert!(std::fs::metadata(&shot).is_ok_and(|m| m.len() > 0));
    if let Some(to) = std::env::var_os("KMQD_DASHBOARD_SCREENSHOTS") {
        std::fs::copy(&shot, workspace_dir().join(to).join("dashboard-flow.png")).unwrap();
    }
    daemon.stop();
}
