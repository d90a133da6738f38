//! The JSON API against a real Redis and a real daemon: what the overview and a queue's page read, the actions
//! and what they change in Redis, the checks in front of them (CSRF token, Origin, Host, `--read-only`), and the
//! audit log.

use std::path::Path;
use std::time::Duration;

use serde_json::Value as Json;

use super::{Dashboard, status};
use crate::support::*;

/// `jobs`: two levels, retries (a `fail` outcome is dead at once, a `retry` waits out its backoff); `mail`:
/// default mode.
const QUEUES: &str = "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\npriorities = [\"high\", \"low\"]\n\
    workers = 2\nretry_times = 5\nlease_timeout = \"2s\"\n\n\
    [[queues]]\nname = \"mail\"\nmode = \"default\"\n";

const FAIL: &str = r#"{"outcome":"fail"}"#;

fn push(config: &Path, queue: &str, task: kmqd::NewTask) {
    assert!(client(config).push(queue, task).unwrap().is_accepted());
}

fn task(id: &str, data: &str) -> kmqd::NewTask {
    kmqd::NewTask::new("test", data).unwrap().id(id)
}

/// The overview's row of `queue`, once `ready` holds.
fn row_when(dashboard: &Dashboard, queue: &str, what: &str, ready: impl Fn(&Json) -> bool) -> Json {
    eventually(Duration::from_secs(10), what, || {
        let overview = dashboard.json("/api/overview");
        let row = overview["queues"]
            .as_array()
            .unwrap()
            .iter()
            .find(|row| row["name"] == queue)
            .cloned()
            .unwrap_or(Json::Null);
        (ready(&row), row)
    })
}

/// Every list of a queue, as the overview counts it and the queue's page lists it: ready tasks per level in
/// the order they will run, delayed tasks with their due time, a retry with its last error, a dead task with
/// its reason, the daemons, and a task found by id.
#[test]
fn overview_and_queue_show_every_list_with_its_tasks() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUES);
    let daemon = TestDaemon::start(&config);
    push(&config, "jobs", task("doomed", FAIL));
    push(
        &config,
        "jobs",
        task("later", r#"{"outcome":"retry","retry_after_ms":3600000}"#),
    );
    eventually(
        Duration::from_secs(30),
        "a dead and a retrying task",
        || {
            let stats = stats(&config, "jobs");
            (stats.dead == 1 && stats.retrying == 1, stats)
        },
    );
    let client = client(&config);
    client.pause("jobs").unwrap();
    client.pause("mail").unwrap();
    for id in ["r1", "r2"] {
        push(&config, "jobs", task(id, "{}").priority("low"));
    }
    push(
        &config,
        "jobs",
        task("d1", "{}").delay(Duration::from_secs(3600)),
    );
    push(&config, "mail", task("m1", "{}"));

    let dashboard = Dashboard::start(&config, &dir, &[]);
    let jobs = row_when(&dashboard, "jobs", "the jobs row", |row| row["ready"] == 2);
    assert_eq!(jobs["mode"], "safe");
    assert_eq!(jobs["paused"], true);
    assert_eq!(
        jobs["ready_by_level"],
        serde_json::json!([["high", 0], ["low", 2]])
    );
    assert_eq!(jobs["delayed"], 2, "d1 and the retry: {jobs}");
    assert_eq!(jobs["dead"], 1);
    assert_eq!(jobs["daemons"], 1);
    let mail = row_when(&dashboard, "mail", "the mail row", |row| row["ready"] == 1);
    assert_eq!(mail["mode"], "default");

    let page = dashboard.json("/api/queues/jobs");
    let ready: Vec<&Json> = page["ready"].as_array().unwrap().iter().collect();
    assert_eq!(ready[0]["level"], "high");
    assert_eq!(ready[0]["tasks"], serde_json::json!([]));
    let low: Vec<&str> = ready[1]["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|task| task["id"].as_str().unwrap())
        .collect();
    assert_eq!(low, ["r1", "r2"], "head first: {page}");
    let delayed = &page["delayed"][0];
    assert_eq!(delayed["task"]["id"], "d1", "{page}");
    assert!(
        delayed["due_in_ms"].as_i64().unwrap() > 3_500_000,
        "{delayed}"
    );
    let retrying = &page["retrying"][0];
    assert_eq!(retrying["task"]["id"], "later", "{page}");
    assert_eq!(retrying["task"]["attempt"], 1);
    assert!(
        retrying["task"]["last_error"]
            .as_str()
            .unwrap()
            .contains("asked to retry"),
        "{retrying}"
    );
    let dead = &page["dead"][0];
    assert_eq!(dead["id"], "doomed", "{page}");
    assert!(
        dead["reason"].as_str().unwrap().contains("asked to fail"),
        "{dead}"
    );
    assert_eq!(dead["type"], "test");
    assert_eq!(
        dead.get("parsed_task"),
        None,
        "no parsed tree in a list: {dead}"
    );
    assert_eq!(page["daemons"].as_array().unwrap().len(), 1);
    assert_eq!(page["stats"]["paused"], true);
    // ?limit= bounds every list.
    let one = dashboard.json("/api/queues/jobs?limit=1");
    assert_eq!(
        one["ready"][1]["tasks"].as_array().unwrap().len(),
        1,
        "{one}"
    );

    let found = dashboard.json("/api/queues/jobs/tasks/r2");
    assert_eq!(found["found"][0]["state"], "ready", "{found}");
    assert_eq!(found["found"][0]["position"], 1);
    let daemons = dashboard.json("/api/daemons");
    let daemons = daemons["daemons"].as_array().unwrap();
    assert_eq!(daemons.len(), 2, "one registration per queue: {daemons:?}");
    assert!(
        daemons
            .iter()
            .all(|d| d["host"] == kmqd::broker::hostname())
    );

    let unknown = dashboard.get("/api/queues/nope");
    assert_eq!(status(&unknown), 404, "{unknown:?}");
    assert!(
        unknown.body.contains("configured queues: jobs, mail"),
        "{unknown:?}"
    );
    let html = dashboard.get("/queues/jobs");
    assert_eq!(status(&html), 200);
    assert!(html.content_type.starts_with("text/html"), "{html:?}");
    assert!(
        html.body
            .contains(r#"<meta name="kmqd-read-only" content="false">"#)
    );
    let script = dashboard.get("/assets/app.js");
    assert!(
        script.content_type.starts_with("text/javascript"),
        "{script:?}"
    );
    daemon.stop();
}

/// Each action does what its CLI command does, in Redis: pause and resume, cancel a waiting task (and a 404 for
/// one that is not waiting), requeue a dead task (which runs again) and purge all; every one is logged with who
/// asked and from where.
#[test]
fn actions_change_redis_and_are_logged_with_who_asked() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUES);
    let daemon = TestDaemon::start(&config);
    push(&config, "jobs", task("doomed", FAIL));
    eventually(Duration::from_secs(30), "a dead task", || {
        (stats(&config, "jobs").dead == 1, ())
    });
    let dashboard = Dashboard::start(&config, &dir, &[]);

    let (code, answer) = dashboard.act("/api/queues/jobs/pause", "");
    assert_eq!((code, &answer), (200, &serde_json::json!({"paused": true})));
    assert_eq!(redis.cmd::<i64>(&["EXISTS", "kmq:{jobs}:paused"]), 1);
    push(&config, "jobs", task("waiting", "{}"));
    let (code, answer) = dashboard.act("/api/queues/jobs/tasks/waiting/cancel", "");
    assert_eq!((code, &answer), (200, &serde_json::json!({"cancelled": 1})));
    assert_eq!(stats(&config, "jobs").cancelled, 1);
    let (code, answer) = dashboard.act("/api/queues/jobs/tasks/waiting/cancel", "");
    assert_eq!(code, 404, "{answer}");
    let (code, _) = dashboard.act("/api/queues/jobs/resume", "");
    assert_eq!(code, 200);
    assert_eq!(redis.cmd::<i64>(&["EXISTS", "kmq:{jobs}:paused"]), 0);

    let (code, answer) = dashboard.act("/api/queues/jobs/dead/requeue", r#"{"ids": ["doomed"]}"#);
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["requeued"], serde_json::json!(["doomed"]));
    // It runs again, and (failing again) is dead again.
    eventually(Duration::from_secs(30), "doomed to run again", || {
        let runs = dir.records().runs_of("doomed");
        (runs == 2 && stats(&config, "jobs").dead == 1, runs)
    });
    let (code, answer) = dashboard.act("/api/queues/jobs/dead/purge", r#"{"all": true}"#);
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["purged"], serde_json::json!(["doomed"]));
    assert_eq!(stats(&config, "jobs").dead, 0);
    // A body that names nothing is refused, never read as "all".
    let (code, answer) = dashboard.act("/api/queues/jobs/dead/purge", r#"{"id": "x"}"#);
    assert_eq!(code, 400, "{answer}");

    let log = dashboard.log();
    for action in [
        "pause",
        "task cancel",
        "resume",
        "dead requeue",
        "dead purge",
    ] {
        let line = log
            .lines()
            .find(|line| {
                line.contains("dashboard action") && line.contains(&format!("action=\"{action}\""))
            })
            .unwrap_or_else(|| panic!("no log line of {action}:\n{log}"));
        assert!(
            line.contains("user=\"local\"") && line.contains("from=127.0.0.1:"),
            "{line}"
        );
        assert!(line.contains("queue=\"jobs\""), "{line}");
    }
    assert!(
        log.contains("dashboard action failed"),
        "the second cancel:\n{log}"
    );
    daemon.stop();
}

/// A page elsewhere cannot act through the visitor's browser: an action without this process's token, or with
/// another site's Origin, is refused and changes nothing; a request for another host name (DNS rebinding) is
/// refused whatever it asks.
#[test]
fn actions_need_the_token_and_a_same_origin() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUES);
    let dashboard = Dashboard::start(&config, &dir, &[]);
    let token = dashboard.csrf();
    let origin = format!("http://{}", dashboard.addr);
    let tries: [&[(&str, &str)]; 4] = [
        &[],
        &[("X-Kmqd-Csrf", "0123456789abcdef")],
        &[("X-Kmqd-Csrf", &token), ("Origin", "http://evil.example")],
        &[
            ("X-Kmqd-Csrf", &token),
            ("Origin", &origin),
            ("Host", "evil.example"),
        ],
    ];
    for headers in tries {
        let answer = dashboard.request("POST", "/api/queues/jobs/pause", headers, "");
        assert!(
            matches!(status(&answer), 403 | 421),
            "{headers:?}: {answer:?}"
        );
        assert_eq!(
            redis.cmd::<i64>(&["EXISTS", "kmq:{jobs}:paused"]),
            0,
            "{headers:?}"
        );
    }
    let rebound = dashboard.request("GET", "/api/overview", &[("Host", "evil.example:80")], "");
    assert_eq!(status(&rebound), 421, "{rebound:?}");
    // The same request from the page itself passes.
    let answer = dashboard.request(
        "POST",
        "/api/queues/jobs/pause",
        &[("X-Kmqd-Csrf", &token), ("Origin", &origin)],
        "",
    );
    assert_eq!(status(&answer), 200, "{answer:?}");
    assert_eq!(redis.cmd::<i64>(&["EXISTS", "kmq:{jobs}:paused"]), 1);
}

/// `--read-only`: the page says so (its script draws no buttons) and every action is refused, token or not.
#[test]
fn read_only_refuses_every_action() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUES);
    push(&config, "jobs", task("waiting", "{}"));
    let dashboard = Dashboard::start(&config, &dir, &["--read-only"]);
    assert_eq!(dashboard.json("/api/session")["read_only"], true);
    assert!(
        dashboard
            .get("/")
            .body
            .contains(r#"<meta name="kmqd-read-only" content="true">"#)
    );
    for path in [
        "pause",
        "resume",
        "dead/requeue",
        "dead/purge",
        "tasks/waiting/cancel",
    ] {
        let (code, answer) = dashboard.act(&format!("/api/queues/jobs/{path}"), r#"{"all": true}"#);
        assert_eq!(code, 403, "{path}: {answer}");
        assert!(
            answer["error"].as_str().unwrap().contains("read-only"),
            "{answer}"
        );
    }
    assert_eq!(redis.cmd::<i64>(&["EXISTS", "kmq:{jobs}:paused"]), 0);
    assert_eq!(
        stats(&config, "jobs").ready,
        1,
        "the task was not cancelled"
    );
}

/// Without authentication the dashboard listens on loopback only, and says how to reach it from elsewhere.
#[test]
fn listening_beyond_loopback_needs_authentication() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUES);
    let (code, _, err) = kmqd(
        &[
            "-c",
            config.to_str().unwrap(),
            "dashboard",
            "--listen",
            "0.0.0.0:0",
        ],
        None,
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("beyond loopback")
            && err.contains("[dashboard] users_file")
            && err.contains("ssh -L"),
        "{err}"
    );
}

/// `[dashboard]` with a users file (made by `kmqd dashboard hash-password`) and a token file: the dashboard
/// listens beyond loopback, every request needs a user's password or the token (a browser is asked for a
/// password), any host name is answered, and an action is logged with the user's name.
#[test]
fn users_and_the_token_get_in_and_nobody_else() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let (code, line, err) = kmqd(
        &["dashboard", "hash-password", "ada"],
        Some("correct horse\n"),
    );
    assert_eq!(code, 0, "{err}");
    assert!(line.starts_with("ada:$argon2id$"), "{line}");
    std::fs::write(dir.path("users"), format!("# dashboard users\n{line}")).unwrap();
    let token = "3f6c1d0e9b8a7f6e5d4c3b2a1f0e9d8c";
    std::fs::write(dir.path("token"), format!("{token}\n")).unwrap();
    let config = dir.config(
        &redis,
        &format!("{QUEUES}\n[dashboard]\nusers_file = \"users\"\ntoken_file = \"token\"\n"),
    );
    let dashboard = Dashboard::start_on(&config, &dir, "dashboard.log", "0.0.0.0:0", &[]);
    let basic = |user: &str, password: &str| {
        use base64::Engine;
        let pair = format!("{user}:{password}");
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(pair)
        )
    };
    let ask = |headers: &[(&str, &str)]| dashboard.request("GET", "/api/session", headers, "");

    let refused = ask(&[]);
    assert_eq!(status(&refused), 401, "{refused:?}");
    assert!(
        refused.body.contains("authentication required"),
        "{refused:?}"
    );
    for wrong in [
        basic("ada", "wrong"),
        basic("bob", "correct horse"),
        format!("Bearer {token}x"),
    ] {
        assert_eq!(status(&ask(&[("Authorization", &wrong)])), 401, "{wrong}");
    }
    let page = dashboard.request("GET", "/", &[], "");
    assert_eq!(status(&page), 401, "the pages too: {page:?}");

    let ada = basic("ada", "correct horse");
    let host = "kmqd.example:8080";
    let session = ask(&[("Authorization", &ada), ("Host", host)]);
    assert_eq!(
        status(&session),
        200,
        "any host name, with a password: {session:?}"
    );
    let session: serde_json::Value = serde_json::from_str(&session.body).unwrap();
    assert_eq!(session["user"], "ada");
    let bearer = format!("Bearer {token}");
    let by_token: serde_json::Value =
        serde_json::from_str(&ask(&[("Authorization", &bearer)]).body).unwrap();
    assert_eq!(by_token["user"], "token");

    let csrf = session["csrf"].as_str().unwrap();
    let origin = format!("http://{host}");
    let paused = dashboard.request(
        "POST",
        "/api/queues/jobs/pause",
        &[
            ("Authorization", &ada),
            ("Host", host),
            ("Origin", &origin),
            ("X-Kmqd-Csrf", csrf),
        ],
        "",
    );
    assert_eq!(status(&paused), 200, "{paused:?}");
    assert_eq!(redis.cmd::<i64>(&["EXISTS", "kmq:{jobs}:paused"]), 1);
    let log = dashboard.log();
    assert!(
        log.lines()
            .any(|line| line.contains("dashboard action") && line.contains("user=\"ada\"")),
        "{log}"
    );
}

/// The dashboard reads `[dashboard]`'s secrets when it starts: one that is missing stops it with the file, line
/// and key to fix, while the other commands, which never read them, run with the same config.
#[test]
fn a_missing_secret_names_its_file_line_and_key() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &format!("{QUEUES}\n[dashboard]\ntoken_env = \"KMQD_TEST_NO_SUCH_TOKEN\"\n"),
    );
    let path = config.to_str().unwrap();
    let (code, _, err) = kmqd(&["-c", path, "dashboard"], None);
    assert_eq!(code, 2, "{err}");
    let line = std::fs::read_to_string(&config)
        .unwrap()
        .lines()
        .position(|line| line.starts_with("token_env"))
        .unwrap()
        + 1;
    assert!(
        err.contains(&format!(
            "{path}:{line}:13: dashboard.token_env: environment variable KMQD_TEST_NO_SUCH_TOKEN is not set"
        )),
        "{err}"
    );
    let (code, _, err) = kmqd(&["-c", path, "stats"], None);
    assert_eq!(code, 0, "stats does not need the dashboard's token: {err}");
}

/// The charts' history: a daemon's monitor writes one sample a minute of each queue's counters and depths (the
/// first offer of the minute, on Redis's clock), drops the samples older than an hour, and the dashboard turns
/// the samples into rates; a dashboard started later reads the same history.
#[test]
fn daemons_keep_an_hour_of_samples_and_the_dashboard_charts_them() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUES);
    let history = "kmq:{jobs}:history";
    let (seconds, _): (String, String) = {
        let time: Vec<String> = redis.cmd(&["TIME"]);
        (time[0].clone(), time[1].clone())
    };
    let minute = seconds.parse::<i64>().unwrap() / 60;
    // 70 minutes of samples (done growing 60 a minute: 1/s), ten more than the history keeps.
    for ago in 1..=70 {
        let at = (minute - ago) * 60_000 + 5_000;
        let done = (70 - ago) * 60;
        let sample =
            format!(r#"{{"at":{at},"done":{done},"failed":0,"ready":{ago},"delayed":0,"dead":0}}"#);
        let _: i64 = redis.cmd(&["ZADD", history, &(minute - ago).to_string(), &sample]);
    }
    let client = client(&config);
    client.pause("jobs").unwrap();
    for id in ["a", "b"] {
        push(&config, "jobs", task(id, "{}"));
    }
    push(
        &config,
        "jobs",
        task("later", "{}").delay(Duration::from_secs(3600)),
    );

    let daemon = TestDaemon::start(&config);
    let samples = eventually(Duration::from_secs(30), "this minute's sample", || {
        let members: Vec<String> = redis.cmd(&["ZRANGE", history, "0", "-1"]);
        let newest: serde_json::Value = serde_json::from_str(members.last().unwrap()).unwrap();
        (newest["ready"] == 2, members)
    });
    let newest: serde_json::Value = serde_json::from_str(samples.last().unwrap()).unwrap();
    assert_eq!(
        (newest["delayed"].as_u64(), newest["dead"].as_u64()),
        (Some(1), Some(0)),
        "{newest}"
    );
    assert_eq!(newest["done"], 0);
    let scores: Vec<String> = redis.cmd(&["ZRANGE", history, "0", "-1", "WITHSCORES"]);
    let oldest: i64 = scores[1].parse().unwrap();
    assert!(
        oldest >= minute - 60,
        "an hour is kept, no more: {oldest} vs {minute}"
    );
    assert!(samples.len() <= 61, "{}", samples.len());

    let dashboard = Dashboard::start(&config, &dir, &[]);
    row_when(&dashboard, "jobs", "the first poll", |row| {
        row["ready"] == 2
    });
    let charted = dashboard.json("/api/history");
    let points = charted["queues"]["jobs"].as_array().unwrap();
    assert_eq!(
        points.len(),
        samples.len() + 1,
        "each sample, and the last poll: {charted}"
    );
    assert_eq!(
        points[0]["done"],
        serde_json::Value::Null,
        "no rate before the first sample"
    );
    let rate = points[5]["done"].as_f64().unwrap();
    assert!((rate - 1.0).abs() < 1e-9, "60 a minute: {rate}");
    let live = points.last().unwrap();
    assert_eq!(
        (live["ago_ms"].as_i64(), live["ready"].as_u64()),
        (Some(0), Some(2)),
        "{live}"
    );
    assert!(charted["queues"]["mail"].is_array());
    daemon.stop();
}

/// A worker stuck in a handler that ignores its cancel is counted by its daemon's next renewal, and shown on the
/// daemons page and by `kmqd workers`; once the handler returns, the count goes back to 0.
#[test]
fn the_daemons_say_how_many_workers_are_stuck() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 2\nexecution_timeout = \"1s\"\n\
         retry_times = 0\nlease_timeout = \"3s\"\n",
    );
    let release = dir.path("release");
    let data = format!(
        r#"{{"wait_for_file":"{}","ignore_cancel":true}}"#,
        release.display()
    );
    push(&config, "jobs", task("hangs", &data));
    let daemon = TestDaemon::start(&config);
    let dashboard = Dashboard::start(&config, &dir, &[]);
    let stuck = |want: u64| {
        eventually(Duration::from_secs(15), &format!("{want} stuck"), || {
            let daemons = dashboard.json("/api/daemons");
            (daemons["daemons"][0]["stuck"] == want, daemons)
        })
    };
    stuck(1);
    let (code, out, err) = kmqd(&["-c", config.to_str().unwrap(), "workers"], None);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    let column = lines[0].find("STUCK").expect("a STUCK column");
    assert_eq!(
        lines[1][..column + 5].trim_end().rsplit(' ').next(),
        Some("1"),
        "{out}"
    );
    std::fs::write(&release, "").unwrap();
    stuck(0);
    daemon.stop();
}

/// Review M7: a queue's page is sent no more than 4 KiB of each envelope and dead record (with the whole one's
/// size), no parsed tree, and no more than about 4 MiB of a list's tasks; a task's lookup stops after 10,000
/// tasks of the queue's lists and says so, rather than read a backlog whole for every look.
#[test]
fn lists_are_sent_cut_and_a_lookup_stops_at_its_budget() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUES);
    let daemon = TestDaemon::start(&config);
    let big = |id: &str, extra: &str| {
        task(
            id,
            &format!(r#"{{"pad":"{}"{extra}}}"#, "x".repeat(64 << 10)),
        )
    };
    push(&config, "jobs", big("doomed-big", r#","outcome":"fail""#));
    eventually(Duration::from_secs(30), "the big task dead", || {
        let stats = stats(&config, "jobs");
        (stats.dead == 1, stats)
    });
    client(&config).pause("jobs").unwrap();
    push(&config, "jobs", task("small", "{}").priority("high"));
    push(&config, "jobs", big("big", "").priority("high"));
    // 24 tasks of 1 MiB at the low level: the page reads about 4 MiB of them.
    let mib = format!(r#"{{"pad":"{}"}}"#, "x".repeat(1 << 20));
    let heavy: Vec<kmqd::NewTask> = (0..24)
        .map(|i| task(&format!("mib-{i}"), &mib).priority("low"))
        .collect();
    client(&config).push_batch("jobs", heavy).unwrap();

    let dashboard = Dashboard::start(&config, &dir, &[]);
    let page = dashboard.json("/api/queues/jobs?limit=24");
    let high = &page["ready"][0]["tasks"];
    assert_eq!(high[0]["id"], "small");
    assert_eq!(high[0]["envelope_truncated"], false);
    let small = high[0]["envelope"].as_str().unwrap();
    assert_eq!(high[0]["envelope_bytes"], small.len());
    assert_eq!(high[1]["id"], "big", "decoded from the whole envelope");
    assert_eq!(high[1]["envelope_truncated"], true);
    assert_eq!(high[1]["envelope"].as_str().unwrap().len(), 4096);
    assert!(high[1]["envelope_bytes"].as_u64().unwrap() > 64 << 10);
    let low = page["ready"][1]["tasks"].as_array().unwrap();
    assert_eq!(
        low.len(),
        4,
        "a list stops at the chunk that reaches 4 MiB: {:?}",
        low.iter().map(|task| &task["id"]).collect::<Vec<_>>()
    );
    let dead = &page["dead"][0];
    assert_eq!(dead["id"], "doomed-big");
    assert_eq!(dead["truncated"], true);
    assert_eq!(dead["task"].as_str().unwrap().len(), 4096);
    assert!(dead["record_bytes"].as_u64().unwrap() > 64 << 10);
    assert_eq!(dead.get("parsed_task"), None);
    assert!(
        page.to_string().len() < 100 << 10,
        "the answer is small: {} bytes",
        page.to_string().len()
    );

    // A lookup finds a task near the head of a backlog of 12,000, but not one behind the 10,000 it reads.
    let backlog: Vec<kmqd::NewTask> = (0..12_000)
        .map(|i| task(&format!("b{i}"), "{}").priority("low"))
        .collect();
    client(&config).push_batch("jobs", backlog).unwrap();
    let far = dashboard.json("/api/queues/jobs/tasks/b11999");
    assert_eq!(far["found"], serde_json::json!([]), "{far}");
    assert_eq!(far["complete"], false);
    assert!(far["searched"].as_u64().unwrap() >= 10_000, "{far}");
    let near = dashboard.json("/api/queues/jobs/tasks/b5");
    assert_eq!(near["found"][0]["state"], "ready", "{near}");
    assert_eq!(near["found"][0]["position"], 24 + 5);
    // The whole envelope on the task's page.
    let whole = dashboard.json("/api/queues/jobs/tasks/big");
    assert!(whole["found"][0]["envelope"].as_str().unwrap().len() > 64 << 10);
    // The CLI searches everything.
    let (code, out, err) = kmqd(
        &[
            "-c",
            config.to_str().unwrap(),
            "task",
            "show",
            "jobs",
            "b11999",
        ],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("ready"), "{out}");
    daemon.stop();
}

/// A queue's limits, as its page and the overview's row serve them, say what `kmqd stats` says: a queue at its
/// `max_running` with a type at its own, and what holds it back; another queue, with no limit, held back by a
/// handler's throttle alone, with the time it has left.
#[test]
fn a_queues_limits_say_what_holds_it_back_as_kmqd_stats_does() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queues = "[[queues]]\nname = \"api\"\nmode = \"safe\"\nworkers = 4\nmax_running = 2\n\
                  [[queues.limits]]\ntype = \"report\"\nmax_running = 1\n\n\
                  [[queues]]\nname = \"mail\"\nmode = \"safe\"\n";
    let config = dir.config_for_types(&redis, queues, &["test", "report"]);
    let daemon = TestDaemon::start(&config);
    // Running until the daemon's shutdown cancels them: the first report and the first test task take the
    // queue's 2 slots (a claim takes the head first), the second report waits in its type's flow.
    let forever = |kind: &str| kmqd::NewTask::new(kind, r#"{"until_cancelled": true}"#).unwrap();
    let client = client(&config);
    client
        .push_batch(
            "api",
            [forever("report"), forever("report"), forever("test")],
        )
        .unwrap();
    push(
        &config,
        "mail",
        task(
            "slow-down",
            r#"{"outcome":"throttle","throttle_ms":600000}"#,
        ),
    );
    let dashboard = Dashboard::start(&config, &dir, &[]);

    let held = serde_json::json!(["running 2/2", "type \"report\": running 1/1"]);
    let api = row_when(&dashboard, "api", "api held back on the overview", |row| {
        row["limits"]["held_back"] == held
    });
    assert_eq!(api["processing"], 2, "{api}");
    let page = eventually(Duration::from_secs(10), "api's page held back", || {
        let page = dashboard.json("/api/queues/api");
        (page["limits"]["held_back"] == held, page)
    });
    let limits = &page["limits"];
    assert_eq!(
        limits["max_running"],
        serde_json::json!({"limit": 2, "running": 2, "held_back": true}),
        "{limits}"
    );
    assert_eq!(
        limits["types"],
        serde_json::json!([{"type": "report", "waiting": 1,
                            "max_running": {"limit": 1, "running": 1, "held_back": true}}]),
        "{limits}"
    );
    // The same words and numbers as `kmqd stats` (nothing runs to an end meanwhile: they run until cancelled).
    let out = kmqd_ok(&config, &["stats"]);
    let line = limits["line"].as_str().unwrap();
    assert!(
        out.contains(&format!("api: {line}\n")),
        "{line:?} in\n{out}"
    );
    let json: Json = serde_json::from_str(&kmqd_ok(&config, &["stats", "--json"])).unwrap();
    let mut detail = limits.clone();
    for served_beside in ["line", "held_back"] {
        detail.as_object_mut().unwrap().remove(served_beside);
    }
    assert_eq!(json["queues"]["api"]["limits"], detail);

    // A queue with no limit has none until a handler throttles it: then the throttle alone holds it back.
    let mail = row_when(
        &dashboard,
        "mail",
        "mail throttled on the overview",
        |row| row["throttled"] == true,
    );
    let throttled = &mail["limits"];
    assert!(
        throttled["throttle_ms"].as_i64().unwrap() > 500_000,
        "{mail}"
    );
    let words = throttled["held_back"][0].as_str().unwrap();
    assert!(
        words.starts_with("throttled ") && words.ends_with(" more"),
        "{mail}"
    );
    assert_eq!(throttled["max_running"], Json::Null, "{mail}");
    daemon.stop();
}

/// A grouped queue's page serves its busiest groups as `kmqd groups` lists them, with the groups' max_running,
/// from a read at most `GROUPS_EVERY` (5 s) old however often it is asked (the read scans every group); a group's
/// Pause holds back its tasks while another group runs, Resume lets them run, each logged; a group's action on a
/// queue without groups, or with a name no task can have, is refused.
#[test]
fn a_grouped_queues_page_serves_its_busiest_groups_and_pauses_and_resumes_one() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queues = "[[queues]]\nname = \"tenants\"\nmode = \"safe\"\nworkers = 2\nidle_poll = \"100ms\"\n\
                  [queues.groups]\nmax_running = 1\n\n\
                  [[queues]]\nname = \"mail\"\nmode = \"safe\"\n";
    let config = dir.config(&redis, queues);
    let daemon = TestDaemon::start(&config);
    let dashboard = Dashboard::start(&config, &dir, &[]);
    let (code, answer) = dashboard.act("/api/queues/tenants/groups/acme/pause", "");
    assert_eq!(
        (code, &answer),
        (200, &serde_json::json!({"group": "acme", "paused": true}))
    );
    assert_eq!(
        redis.cmd::<i64>(&["EXISTS", "kmq:{tenants}:hold:g:acme"]),
        1
    );
    // busy: one running until the daemon's shutdown cancels it (its max_running 1), two waiting behind it.
    let tasks = (0..3)
        .map(|n| {
            kmqd::NewTask::new("test", r#"{"until_cancelled": true}"#)
                .unwrap()
                .id(format!("busy{n}"))
                .group("busy")
        })
        .chain((0..3).map(|n| task(&format!("acme{n}"), "{}").group("acme")));
    client(&config).push_batch("tenants", tasks).unwrap();

    let expected = serde_json::json!([
        {"name": "acme", "waiting": 3, "running": 0, "paused": true},
        {"name": "busy", "waiting": 2, "running": 1, "paused": false},
    ]);
    // A list of groups without their throttles and held_back flags (which depend on the claims' timing).
    let shown = |list: &Json| {
        let list = list.as_array().cloned().unwrap_or_default();
        let list: Vec<Json> = list
            .iter()
            .map(|g| {
                serde_json::json!({"name": g["name"], "waiting": g["waiting"],
                                        "running": g["running"], "paused": g["paused"]})
            })
            .collect();
        Json::Array(list)
    };
    let page = eventually(
        Duration::from_secs(30),
        "the two groups on the page",
        || {
            let page = dashboard.json("/api/queues/tenants");
            (shown(&page["groups"]["list"]) == expected, page)
        },
    );
    let groups = &page["groups"];
    assert_eq!(
        (
            &groups["max_running"],
            &groups["limit"],
            &groups["every_ms"]
        ),
        (
            &serde_json::json!(1),
            &serde_json::json!(20),
            &serde_json::json!(5000)
        ),
        "{groups}"
    );
    assert_eq!(
        page["limits"]["groups"],
        serde_json::json!({"waiting": 2}),
        "{page}"
    );
    assert_eq!(page["limits"]["held_back"], serde_json::json!([]), "{page}");
    assert_eq!(
        dir.records().runs_of("acme0"),
        0,
        "a paused group's task ran"
    );
    // The same groups, and the same line, as the CLI.
    let listed: Json =
        serde_json::from_str(&kmqd_ok(&config, &["groups", "tenants", "--json"])).unwrap();
    assert_eq!(shown(&listed["groups"]), expected);
    let line = page["limits"]["line"].as_str().unwrap();
    assert_eq!(line, "groups waiting 2");
    assert!(kmqd_ok(&config, &["stats"]).contains(&format!("tenants: {line}\n")));

    // Asked again and again, the groups are read at most once per 5 s: as many reads as 5 s periods began.
    let started = std::time::Instant::now();
    let reads: std::collections::BTreeSet<u64> = (0..20)
        .map(|_| {
            dashboard.json("/api/queues/tenants")["groups"]["read_at_ms"]
                .as_u64()
                .unwrap()
        })
        .collect();
    let periods = started.elapsed().as_secs() / 5 + 2;
    assert!(
        reads.len() as u64 <= periods,
        "{} reads of the groups in {:?}",
        reads.len(),
        started.elapsed()
    );

    let (code, answer) = dashboard.act("/api/queues/tenants/groups/acme/resume", "");
    assert_eq!(
        (code, &answer),
        (200, &serde_json::json!({"group": "acme", "resumed": true}))
    );
    eventually(Duration::from_secs(30), "acme's tasks to run", || {
        let runs: Vec<usize> = (0..3)
            .map(|n| dir.records().runs_of(&format!("acme{n}")))
            .collect();
        (runs == [1, 1, 1], runs)
    });
    // The action forgot the read: the page shows acme gone at once, not 5 s later.
    let page = eventually(Duration::from_secs(10), "acme gone from the page", || {
        let page = dashboard.json("/api/queues/tenants");
        let names: Vec<Json> = page["groups"]["list"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["name"].clone())
            .collect();
        (names == [serde_json::json!("busy")], page)
    });
    assert_eq!(page["groups"]["list"][0]["running"], 1, "{page}");
    let (code, answer) = dashboard.act("/api/queues/tenants/groups/acme/resume", "");
    assert_eq!((code, &answer["resumed"]), (200, &Json::Bool(false)));

    let (code, answer) = dashboard.act("/api/queues/mail/groups/acme/pause", "");
    assert_eq!(code, 400, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .contains("has no [queues.groups]"),
        "{answer}"
    );
    let long = "g".repeat(65);
    let (code, answer) = dashboard.act(&format!("/api/queues/tenants/groups/{long}/pause"), "");
    assert_eq!(code, 400, "{answer}");
    assert_eq!(
        redis.cmd::<i64>(&["EXISTS", &format!("kmq:{{tenants}}:hold:g:{long}")]),
        0
    );
    assert_eq!(
        dashboard.json("/api/queues/mail")["groups"],
        Json::Null,
        "a queue without groups"
    );
    let log = dashboard.log();
    for action in ["group pause", "group resume"] {
        let line = log
            .lines()
            .find(|line| line.contains(&format!("action=\"{action}\"")))
            .unwrap_or_else(|| panic!("no log line of {action}:\n{log}"));
        assert!(
            line.contains("queue=\"tenants\"") && line.contains("target=\"acme\""),
            "{line}"
        );
    }
    daemon.stop();
}

/// A running task's lookup carries its handler's latest progress report, which the task page draws
/// (docs/PROTOCOL.md, "Progress").
#[test]
fn a_running_tasks_lookup_carries_its_progress() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 1\n",
    );
    let release = dir.path("release");
    let data = serde_json::json!({"progress": [0.6, "six of ten"], "wait_for_file": release});
    push(&config, "jobs", task("long", &data.to_string()));
    let daemon = TestDaemon::start(&config);
    let dashboard = Dashboard::start(&config, &dir, &[]);
    let found = eventually(
        Duration::from_secs(15),
        "the progress in the lookup",
        || {
            let found = dashboard.json("/api/queues/jobs/tasks/long");
            (
                found["found"][0]["progress"]["message"] == "six of ten",
                found,
            )
        },
    );
    assert_eq!(found["found"][0]["state"], "processing", "{found}");
    assert_eq!(found["found"][0]["progress"]["fraction"], 0.6, "{found}");
    std::fs::write(&release, "").unwrap();
    daemon.stop();
}
