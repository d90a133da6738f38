//! ACL users (docs/OPERATIONS.md, "ACL rules"): the documented rules are enough for every kmqd process, and a
//! user that lacks one is refused at start, exit 2, with the command it lacks named.
//!
//! The users are made from the very lines the docs quote (`access::setuser_line`, checked against the docs by a
//! unit test), and every test ends by reading Redis's `ACL LOG`: a refusal anywhere (inside a script, at a
//! retry, at shutdown) is recorded there even when kmqd copes with it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kmqd::broker::access::{self, Role};

use crate::support::*;

const PASSWORD: &str = "acl-test-password";

/// Creates (or resets) the documented user of `role`, keeping only the rules `keep` accepts.
fn create_user(redis: &RedisServer, role: Role, keep: impl Fn(&str) -> bool) {
    let line = access::setuser_line(role, "kmq").replace(">PASSWORD", &format!(">{PASSWORD}"));
    let args: Vec<&str> = line.split(' ').filter(|rule| keep(rule)).collect();
    let _: String = redis.cmd(&args);
}

/// Every documented user, as documented.
fn create_users(redis: &RedisServer) {
    for role in Role::ALL {
        create_user(redis, role, |_| true);
    }
}

/// A config `as-USER.toml` that logs in as `user`, with its password in a file (`TestDir::config` writes
/// `kmqd.toml`, the default user's).
fn config_as(
    dir: &TestDir,
    redis: &RedisServer,
    user: &str,
    daemon: &str,
    queues: &str,
) -> PathBuf {
    let password = dir.path("redis.password");
    std::fs::write(&password, format!("{PASSWORD}\n")).unwrap();
    let redis_keys = format!(
        "url = \"{}\"\nusername = \"{user}\"\npassword_file = \"{}\"",
        redis.url(),
        password.display()
    );
    dir.config_named(
        &format!("as-{user}.toml"),
        &redis_keys,
        daemon,
        queues,
        &dir.record_file(),
    )
}

/// What Redis refused since it started (`ACL LOG`), for the end of a test: nothing.
fn acl_log(redis: &RedisServer) -> Vec<String> {
    let entries: Vec<redis::Value> = redis.cmd(&["ACL", "LOG"]);
    entries.iter().map(|entry| format!("{entry:?}")).collect()
}

/// `kmqd -c CONFIG ARGS...`, asserting the exit code; returns (stdout, stderr).
fn run(config: &Path, args: &[&str], stdin: Option<&str>, code: i32) -> (String, String) {
    let mut all = vec!["-c", config.to_str().unwrap()];
    all.extend_from_slice(args);
    let (exit, out, err) = kmqd(&all, stdin);
    assert_eq!(exit, code, "kmqd {args:?}: {out}{err}");
    (out, err)
}

const QUEUES: &str = "[[queues]]\nname = \"mail\"\nmode = \"safe\"\npriorities = [\"high\", \"low\"]\n\
    workers = 2\nbackoff = \"10ms\"\nretry_times = 1\nlease_timeout = \"1s\"\n\n\
    [[queues]]\nname = \"jobs\"\nmode = \"default\"\nworkers = 2\nprefetch = 200\nbatch = 100\n\
    backoff = \"10ms\"\nretry_times = 1\nlease_timeout = \"1s\"\n";

/// A daemon as the documented daemon user drains a safe queue (two levels, a schedule) and a default queue
/// (the plain pop's transaction included) through delays, retries, unique ids and dead letters, while the
/// producer user pushes with `kmqd push`, the reader user reads with `kmqd stats` and `task show`, and the
/// operator user cancels a delayed task; the metrics are served. Redis refuses nothing to any of them.
#[test]
fn the_documented_users_run_a_daemon_producers_and_readers_side_by_side() {
    let redis = RedisServer::start();
    create_users(&redis);
    let dir = TestDir::new();
    let port = free_port();
    let schedule =
        "\n[[schedules]]\nname = \"tick\"\nqueue = \"mail\"\ntype = \"test\"\nevery = \"1s\"\n";
    let queues = format!("{QUEUES}{schedule}");
    let daemon_keys = format!("shutdown_grace = \"5s\"\nmetrics_addr = \"127.0.0.1:{port}\"");
    let daemon_config = config_as(&dir, &redis, "kmqd", &daemon_keys, &queues);
    let producer = config_as(&dir, &redis, "kmqd-producer", "", &queues);
    let reader = config_as(&dir, &redis, "kmqd-reader", "", &queues);
    let operator = config_as(&dir, &redis, "kmqd-operator", "", &queues);
    let admin = dir.config(&redis, &queues);

    let mut daemon = Process::start(&daemon_config, dir.path("daemon.log"));
    eventually(Duration::from_secs(20), "the daemon to start", || {
        let log = daemon.log_text();
        (log.contains("kmqd started"), log)
    });
    // Many at once first, so that default mode's next pop is the plain one (WATCH, MULTI, LMPOP, EXEC).
    let lines = "{}\n".repeat(150);
    run(
        &producer,
        &["push", "jobs", "test", "--stdin"],
        Some(&lines),
        0,
    );
    for queue in ["mail", "jobs"] {
        run(
            &producer,
            &["push", queue, "test", "{\"fail_attempts\":1}"],
            None,
            0,
        );
        let dead_id = format!("dead-{queue}");
        run(
            &producer,
            &[
                "push",
                queue,
                "test",
                "{\"outcome\":\"fail\"}",
                "--id",
                &dead_id,
            ],
            None,
            0,
        );
        run(
            &producer,
            &["push", queue, "test", "{}", "--delay", "1s"],
            None,
            0,
        );
        let unique_id = format!("u-{queue}");
        run(
            &producer,
            &["push", queue, "test", "{}", "--unique", "--id", &unique_id],
            None,
            0,
        );
    }
    run(
        &producer,
        &["push", "mail", "test", "{}", "--priority", "high"],
        None,
        0,
    );
    run(
        &producer,
        &[
            "push",
            "mail",
            "test",
            "{}",
            "--delay",
            "1h",
            "--id",
            "cancel-me",
        ],
        None,
        0,
    );

    let (shown, _) = run(&operator, &["task", "show", "mail", "cancel-me"], None, 0);
    assert!(shown.contains("delayed"), "{shown}");
    let (cancelled, _) = run(&operator, &["task", "cancel", "mail", "cancel-me"], None, 0);
    assert!(cancelled.contains("cancelled cancel-me"), "{cancelled}");
    let (table, _) = run(&reader, &["stats"], None, 0);
    assert!(table.contains("mail") && table.contains("jobs"), "{table}");

    let mail = eventually(Duration::from_secs(30), "mail to drain", || {
        let s = stats(&admin, "mail");
        let ticked = dir
            .records()
            .starts
            .iter()
            .any(|(id, _)| id.starts_with("tick@"));
        let drained = s.ready + s.processing + s.delayed == 0;
        (
            drained && s.done >= 5 && s.dead == 1 && s.retried == 1 && ticked,
            s,
        )
    });
    assert_eq!(mail.cancelled, 1, "{mail:?}");
    let jobs = eventually(Duration::from_secs(30), "jobs to drain", || {
        let s = stats(&admin, "jobs");
        (s.done == 153 && s.dead == 1 && s.delayed == 0, s)
    });
    assert_eq!(jobs.retried, 1, "{jobs:?}");
    let (dead, _) = run(&reader, &["task", "show", "jobs", "dead-jobs"], None, 0);
    assert!(dead.contains("dead"), "{dead}");
    let page = eventually(Duration::from_secs(10), "the metrics", || {
        let page = scrape(port);
        (
            page.body
                .contains("kmqd_tasks_done_total{queue=\"jobs\"} 153"),
            page,
        )
    });
    assert!(page.status.ends_with("200 OK"), "{page:?}");

    daemon.signal(15);
    assert_eq!(
        daemon.wait_within(Duration::from_secs(30)),
        Some(0),
        "{}",
        daemon.log_text()
    );
    assert_eq!(
        acl_log(&redis),
        Vec::<String>::new(),
        "{}",
        daemon.log_text()
    );
}

/// The daemon user's rules also cover what only a crash needs: the monitor of another daemon takes back a safe
/// task and frees the unique id of a default-mode task that its killed daemon held.
#[test]
fn the_documented_daemon_user_recovers_what_a_killed_daemon_held() {
    let redis = RedisServer::start();
    create_users(&redis);
    let dir = TestDir::new();
    let daemon_config = config_as(&dir, &redis, "kmqd", "shutdown_grace = \"5s\"", QUEUES);
    let producer = config_as(&dir, &redis, "kmqd-producer", "", QUEUES);
    let admin = dir.config(&redis, QUEUES);
    let gate = dir.path("gate");
    let data = format!("{{\"wait_for_file\":\"{}\"}}", gate.display());
    run(
        &producer,
        &["push", "mail", "test", &data, "--id", "held-mail"],
        None,
        0,
    );
    run(
        &producer,
        &[
            "push", "jobs", "test", &data, "--unique", "--id", "held-job",
        ],
        None,
        0,
    );

    let mut first = Process::start(&daemon_config, dir.path("first.log"));
    eventually(Duration::from_secs(20), "both tasks to start", || {
        let starts = dir.records().starts;
        (starts.len() == 2, starts)
    });
    first.kill9();
    std::fs::write(&gate, "").unwrap();
    let mut second = Process::start(&daemon_config, dir.path("second.log"));
    let mail = eventually(
        Duration::from_secs(30),
        "the safe task to run again",
        || {
            let s = stats(&admin, "mail");
            (s.done == 1, s)
        },
    );
    assert_eq!(mail.recovered, 1, "{mail:?}");
    // Lost with its daemon (default mode), but its unique id is free again once the lease runs out.
    eventually(Duration::from_secs(30), "the unique id to be freed", || {
        let held: i64 = redis.cmd(&["HEXISTS", "kmq:{jobs}:unique", "held-job"]);
        (held == 0, held)
    });
    run(
        &producer,
        &["push", "jobs", "test", "{}", "--unique", "--id", "held-job"],
        None,
        0,
    );
    eventually(Duration::from_secs(30), "the new push to run", || {
        let s = stats(&admin, "jobs");
        (s.done == 1, s)
    });
    second.signal(15);
    assert_eq!(
        second.wait_within(Duration::from_secs(30)),
        Some(0),
        "{}",
        second.log_text()
    );
    assert_eq!(
        acl_log(&redis),
        Vec::<String>::new(),
        "{}",
        second.log_text()
    );
}

/// A daemon whose user lacks one rule (a command; the channel pattern) stops at start, exit 2, naming the
/// command, its key or channel, and the rule to add; it takes nothing meanwhile.
#[test]
fn a_daemon_whose_user_lacks_a_rule_exits_2_at_start_naming_it() {
    let queue = "[[queues]]\nname = \"jobs\"\nmode = \"default\"\n";
    let cases = [
        (
            "+blmove",
            "Redis user \"kmqd\" may not run BLMOVE on key kmq:{jobs}:ready:normal",
            "add \"+blmove ~kmq:*\"",
        ),
        (
            "&kmq:*",
            "Redis user \"kmqd\" may not run SUBSCRIBE on channel kmq:{jobs}:delay-wake",
            "&kmq:*\" to its ACL rules",
        ),
    ];
    for (missing, named, hint) in cases {
        let redis = RedisServer::start();
        create_user(&redis, Role::Daemon, |rule| rule != missing);
        let dir = TestDir::new();
        let config = config_as(&dir, &redis, "kmqd", "", queue);
        push_many(&dir.config(&redis, queue), "t", 3, "{}");
        let mut daemon = Process::start(&config, dir.path("daemon.log"));
        let code = daemon.wait_within(Duration::from_secs(20));
        let log = daemon.log_text();
        assert_eq!(code, Some(2), "without {missing}: {log}");
        assert!(
            log.contains(named) && log.contains(hint),
            "without {missing}: {log}"
        );
        assert!(!log.contains("kmqd started"), "{log}");
        let ready: i64 = redis.cmd(&["LLEN", "kmq:{jobs}:ready:normal"]);
        assert_eq!(ready, 3, "nothing taken");
    }
}

/// `kmqd push` as the read-only user is refused before it pushes anything, exit 2, naming the command and key.
#[test]
fn kmqd_push_as_the_reader_exits_2_naming_the_command() {
    let redis = RedisServer::start();
    create_users(&redis);
    let dir = TestDir::new();
    let reader = config_as(&dir, &redis, "kmqd-reader", "", QUEUES);
    let (out, err) = run(&reader, &["push", "jobs", "test", "{}"], None, 2);
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains(
            "Redis user \"kmqd-reader\" may not run EVALSHA on key kmq:{jobs}:ready:normal: add \
             \"+evalsha ~kmq:{*}:ready:*\" to its ACL rules (the producers' rules"
        ),
        "{err}"
    );
    let ready: i64 = redis.cmd(&["LLEN", "kmq:{jobs}:ready:normal"]);
    assert_eq!(ready, 0);
}

/// Each command-line tool asks only for what it sends: the daemon's user runs `push` and `stats` (the README
/// runs them with the daemon's config), while a producer may not read the stats, and a reader may not cancel.
#[test]
fn each_command_line_tool_checks_the_rules_of_what_it_does() {
    let redis = RedisServer::start();
    create_users(&redis);
    let dir = TestDir::new();
    let daemon = config_as(&dir, &redis, "kmqd", "", QUEUES);
    let producer = config_as(&dir, &redis, "kmqd-producer", "", QUEUES);
    let reader = config_as(&dir, &redis, "kmqd-reader", "", QUEUES);
    run(
        &daemon,
        &["push", "mail", "test", "{}", "--id", "t1"],
        None,
        0,
    );
    run(&daemon, &["stats", "--json"], None, 0);
    let (_, err) = run(&daemon, &["task", "show", "mail", "t1"], None, 2);
    assert!(err.contains("add \"+zscan %R~kmq:*\""), "{err}");

    let (_, err) = run(&producer, &["stats"], None, 2);
    assert!(
        err.contains("Redis user \"kmqd-producer\" may not run ZRANGE on key kmq:{mail}:owners"),
        "{err}"
    );
    let (_, err) = run(&reader, &["task", "cancel", "mail", "t1"], None, 2);
    assert!(
        err.contains("Redis user \"kmqd-reader\" may not run EVALSHA on key kmq:{mail}:ready:high"),
        "{err}"
    );
    let (shown, _) = run(&reader, &["task", "show", "mail", "t1"], None, 0);
    assert!(shown.contains("ready"), "{shown}");
    // What Redis refused was the checks' own calls (the checks inside them refuse nothing, they ask), never
    // a command a tool went on to send.
    let log = acl_log(&redis);
    assert!(
        log.iter().all(|entry| entry.contains("cmd=evalsha ")),
        "{log:#?}"
    );
}

/// Every documented user on `server` (a node of a cluster, a master or replica), its line's rules that `keep`
/// accepts and `extra` added.
fn create_users_on(
    server: &kmqd_harness::RedisServer,
    extra: &[&str],
    keep: impl Fn(&str) -> bool,
) {
    for role in Role::ALL {
        let line = access::setuser_line(role, "kmq").replace(">PASSWORD", &format!(">{PASSWORD}"));
        let mut args: Vec<&str> = line.split(' ').filter(|rule| keep(rule)).collect();
        args.extend(extra);
        let _: String = server.query_as(&args).unwrap();
    }
}

/// A daemon, a producer and a reader, as the documented users, on the `[redis]` keys `deployment` (cluster or
/// sentinel seeds): a safe and a default queue with a retry after a delay and a dead letter each.
fn drain_as_the_documented_users(dir: &TestDir, deployment: &str) -> String {
    let password = dir.path("redis.password");
    std::fs::write(&password, PASSWORD).unwrap();
    let queues = "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nbackoff = \"10ms\"\nretry_times = 1\n\n\
        [[queues]]\nname = \"jobs\"\nmode = \"default\"\nbackoff = \"10ms\"\nretry_times = 1\n";
    let config_for = |user: &str| {
        let redis = format!(
            "{deployment}\nusername = \"{user}\"\npassword_file = \"{}\"",
            password.display()
        );
        dir.config_named(
            &format!("as-{user}.toml"),
            &redis,
            "shutdown_grace = \"5s\"",
            queues,
            &dir.record_file(),
        )
    };
    let (daemon_config, producer, reader) = (
        config_for("kmqd"),
        config_for("kmqd-producer"),
        config_for("kmqd-reader"),
    );
    let mut daemon = Process::start(&daemon_config, dir.path("daemon.log"));
    eventually(Duration::from_secs(20), "the daemon to start", || {
        let log = daemon.log_text();
        (log.contains("kmqd started"), log)
    });
    for queue in ["mail", "jobs"] {
        run(&producer, &["push", queue, "test", "{}"], None, 0);
        let retried = [
            "push",
            queue,
            "test",
            "{\"fail_attempts\":1}",
            "--delay",
            "1s",
        ];
        run(&producer, &retried, None, 0);
        run(
            &producer,
            &["push", queue, "test", "{\"outcome\":\"fail\"}"],
            None,
            0,
        );
    }
    eventually(Duration::from_secs(30), "both queues to drain", || {
        let (out, _) = run(&reader, &["stats", "--json"], None, 0);
        let json: serde_json::Value = serde_json::from_str(&out).unwrap();
        let drained = |queue: &str| {
            let counts = &json["queues"][queue];
            counts["done"].as_u64() == Some(2) && counts["dead"].as_u64() == Some(1)
        };
        (drained("mail") && drained("jobs"), out)
    });
    daemon.signal(15);
    assert_eq!(
        daemon.wait_within(Duration::from_secs(30)),
        Some(0),
        "{}",
        daemon.log_text()
    );
    daemon.log_text()
}

/// On a Redis Cluster, with the users on every node and the cluster's additions: a user without one of them
/// is refused at start, exit 2, naming the command (not taken for a cluster that is down); with them, everything
/// runs and no node refused anything.
#[test]
fn the_documented_users_run_on_a_redis_cluster_with_its_additions() {
    use kmqd_harness::cluster::{Cluster, ClusterOptions};
    let cluster = Cluster::start(ClusterOptions::default()).expect("start a Redis Cluster");
    let seeds: Vec<String> = cluster
        .seeds()
        .unwrap()
        .iter()
        .map(|seed| format!("\"{seed}\""))
        .collect();
    let deployment = format!("cluster = [{}]", seeds.join(", "));
    let dir = TestDir::new();

    let without_slots: Vec<&str> = access::CLUSTER_RULES
        .iter()
        .copied()
        .filter(|rule| *rule != "+cluster|slots")
        .collect();
    for server in cluster.servers() {
        create_users_on(server, &without_slots, |_| true);
    }
    let password = dir.path("redis.password");
    std::fs::write(&password, PASSWORD).unwrap();
    let redis = format!(
        "{deployment}\nusername = \"kmqd\"\npassword_file = \"{}\"",
        password.display()
    );
    let refused = dir.config_named(
        "refused.toml",
        &redis,
        "",
        &safe_queue(""),
        &dir.record_file(),
    );
    let mut daemon = Process::start(&refused, dir.path("refused.log"));
    let code = daemon.wait_within(Duration::from_secs(20));
    let log = daemon.log_text();
    assert_eq!(code, Some(2), "{log}");
    assert!(log.contains("'cluster|slots'"), "{log}");

    for server in cluster.servers() {
        let _: String = server.query_as(&["ACL", "LOG", "RESET"]).unwrap();
        create_users_on(server, access::CLUSTER_RULES, |_| true);
    }
    let log = drain_as_the_documented_users(&dir, &deployment);
    for server in cluster.servers() {
        let refused: Vec<redis::Value> = server.query_as(&["ACL", "LOG"]).unwrap();
        assert!(refused.is_empty(), "{refused:?}\n{log}");
    }
}

/// With Sentinel (and `wait_replicas`): the documented users on the master and replica with the additions, and
/// on the sentinels the sentinels' lines: everything runs and no server refused anything.
#[test]
fn the_documented_users_run_behind_sentinels_with_their_additions() {
    use kmqd_harness::sentinel::{SentinelOptions, SentinelSetup};
    let setup = SentinelSetup::start(SentinelOptions::default()).expect("start sentinels");
    for server in setup.servers() {
        create_users_on(server, access::SENTINEL_MASTER_RULES, |_| true);
    }
    for sentinel in setup.sentinels() {
        for role in Role::ALL {
            let line =
                access::sentinel_setuser_line(role).replace(">PASSWORD", &format!(">{PASSWORD}"));
            let args: Vec<&str> = line.split(' ').collect();
            let _: String = sentinel.query_as(&args).unwrap();
        }
    }
    let seeds: Vec<String> = setup
        .sentinel_urls()
        .iter()
        .map(|url| format!("\"{url}\""))
        .collect();
    let deployment = format!(
        "sentinel = [{}]\nsentinel_master = \"{}\"\nwait_replicas = 1",
        seeds.join(", "),
        setup.master_name()
    );
    let dir = TestDir::new();
    let log = drain_as_the_documented_users(&dir, &deployment);
    for server in setup.servers().iter().chain(setup.sentinels()) {
        let refused: Vec<redis::Value> = server.query_as(&["ACL", "LOG"]).unwrap();
        assert!(refused.is_empty(), "{refused:?}\n{log}");
    }
}

/// `kmqd queue pause` and `resume` as the documented operator user, `kmqd workers` as the reader, against a
/// daemon as the documented daemon user (whose connections are named: `+client|setname`): Redis refuses none of
/// them, and a reader that tries to pause is told the rule it lacks.
#[test]
fn the_documented_users_pause_resume_and_list_workers() {
    let redis = RedisServer::start();
    create_users(&redis);
    let dir = TestDir::new();
    let queues = "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nidle_poll = \"100ms\"\n\
        [queues.groups]\n\n\
        [[queues]]\nname = \"jobs\"\nmode = \"default\"\nidle_poll = \"100ms\"\n";
    let daemon_config = config_as(&dir, &redis, "kmqd", "shutdown_grace = \"5s\"", queues);
    let operator = config_as(&dir, &redis, "kmqd-operator", "", queues);
    let reader = config_as(&dir, &redis, "kmqd-reader", "", queues);
    let daemon = TestDaemon::start(&daemon_config);
    let workers = eventually(Duration::from_secs(10), "both queues served", || {
        let (out, _) = run(&reader, &["workers", "--json"], None, 0);
        let value: serde_json::Value = serde_json::from_str(&out).unwrap();
        let count = value["workers"].as_array().unwrap().len();
        (count == 2, out)
    });
    assert!(workers.contains("\"queue\":\"mail\""), "{workers}");
    let (_, err) = run(&reader, &["queue", "pause", "mail"], None, 2);
    assert!(
        err.contains("Redis user \"kmqd-reader\" may not run"),
        "{err}"
    );
    for queue in ["mail", "jobs"] {
        let (out, _) = run(&operator, &["queue", "pause", queue], None, 0);
        assert_eq!(out, format!("paused {queue}\n"));
    }
    let (table, _) = run(&reader, &["workers"], None, 0);
    assert_eq!(table.matches(" paused ").count(), 2, "{table}");
    for queue in ["mail", "jobs"] {
        let (out, _) = run(&operator, &["queue", "resume", queue], None, 0);
        assert_eq!(out, format!("resumed {queue}\n"));
    }
    // A group's pause and resume (group_resume.lua moves its parked flows back, its park index included).
    for verb in ["pause", "resume"] {
        run(&operator, &["group", verb, "mail", "acme"], None, 0);
    }
    let clients: String = redis.cmd(&["CLIENT", "LIST"]);
    let name = format!(
        "name=kmqd:{}:{}:fetcher-mail ",
        kmqd::broker::hostname(),
        std::process::id()
    );
    assert!(clients.contains(&name), "{clients}");
    daemon.stop();
    // The reader's refused pause was its check's own call; nothing else was refused.
    let log = acl_log(&redis);
    assert!(
        log.iter().all(|entry| entry.contains("cmd=evalsha ")),
        "{log:#?}"
    );
}

/// A queue's `source_lists` are named by its producers, outside `kmq:`: the documented daemon line does not
/// cover them, and the daemon stops at start naming the list and the rule to add (it moves nothing meanwhile);
/// with `~queue:email` added it runs, and Redis refuses it nothing.
#[test]
fn a_daemon_user_without_its_source_list_is_refused_at_start_naming_the_key() {
    let redis = RedisServer::start();
    create_users(&redis);
    let dir = TestDir::new();
    let queue = "[[queues]]\nname = \"email\"\nmode = \"safe\"\nforeign_type_field = \"callback\"\n\
                 source_lists = [\"queue:email\"]\n";
    let config = config_as(&dir, &redis, "kmqd", "", queue);
    let _: i64 = redis.cmd(&[
        "RPUSH",
        "queue:email",
        r#"{"callback": "test", "id": "ria-1"}"#,
    ]);
    let mut daemon = Process::start(&config, dir.path("refused.log"));
    let code = daemon.wait_within(Duration::from_secs(20));
    let log = daemon.log_text();
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains("Redis user \"kmqd\" may not run BLMOVE on key queue:email")
            && log.contains("~queue:email\" to its ACL rules"),
        "{log}"
    );
    let left: i64 = redis.cmd(&["LLEN", "queue:email"]);
    assert_eq!(left, 1, "nothing moved");

    let _: String = redis.cmd(&["ACL", "SETUSER", "kmqd", "~queue:email"]);
    let _: String = redis.cmd(&["ACL", "LOG", "RESET"]);
    let mut daemon = Process::start(&config, dir.path("daemon.log"));
    eventually(Duration::from_secs(20), "the moved task done", || {
        let s = stats(&dir.config(&redis, queue), "email");
        (s.done == 1, s)
    });
    daemon.signal(15);
    assert_eq!(daemon.wait_within(Duration::from_secs(20)), Some(0));
    assert!(acl_log(&redis).is_empty(), "{:?}", acl_log(&redis));
}

/// A reload that adds a source list the daemon's user may not use is refused, naming the key, and the daemon
/// serves on with the sources it had. Catches a reload that starts a mover bound to fail at every call.
#[test]
fn a_reload_adding_a_source_list_the_user_lacks_is_refused_naming_the_key() {
    let redis = RedisServer::start();
    create_users(&redis);
    let _: String = redis.cmd(&["ACL", "SETUSER", "kmqd", "~queue:email"]);
    let dir = TestDir::new();
    let queue = |lists: &str| {
        format!(
            "[[queues]]\nname = \"email\"\nmode = \"safe\"\nforeign_type_field = \"callback\"\n\
             source_lists = {lists}\n"
        )
    };
    let config = config_as(&dir, &redis, "kmqd", "", &queue("[\"queue:email\"]"));
    let daemon = crate::reload::start(&dir, &config);
    config_as(
        &dir,
        &redis,
        "kmqd",
        "",
        &queue("[\"queue:email\", \"queue:other\"]"),
    );
    let log = crate::reload::reload(&daemon, 1);
    assert!(
        log.contains("reload refused")
            && log.contains("may not run BLMOVE on key queue:other")
            && log.contains("~queue:other"),
        "{log}"
    );
    let _: i64 = redis.cmd(&[
        "RPUSH",
        "queue:email",
        r#"{"callback": "test", "id": "ria-1"}"#,
    ]);
    eventually(Duration::from_secs(20), "the task moved and done", || {
        let s = stats(&dir.config(&redis, &queue("[\"queue:email\"]")), "email");
        (s.done == 1, s)
    });
    crate::reload::stop(daemon);
    assert!(acl_log(&redis).is_empty(), "{:?}", acl_log(&redis));
}

/// The dashboard as the documented users: the reader serves it `--read-only` (every page's reads allowed), is
/// told the rule its buttons would need without it, and the operator's rules run the buttons; a daemon as the
/// documented daemon user writes the charts' history. Redis refuses nothing but the checks' own calls.
#[test]
fn the_documented_readers_and_operators_run_the_dashboard() {
    use crate::dashboard::{Dashboard, status};
    let redis = RedisServer::start();
    create_users(&redis);
    let dir = TestDir::new();
    let daemon = TestDaemon::start(&config_as(&dir, &redis, "kmqd", "", QUEUES));
    let reader = config_as(&dir, &redis, "kmqd-reader", "", QUEUES);
    let (_, err) = run(&reader, &["dashboard", "--listen", "127.0.0.1:0"], None, 2);
    assert!(
        err.contains("Redis user \"kmqd-reader\" may not run")
            && err.contains("with --read-only they are off"),
        "{err}"
    );
    let read_only = Dashboard::start_named(&reader, &dir, "reader.log", &["--read-only"]);
    eventually(
        Duration::from_secs(30),
        "the daemon's history sample",
        || {
            let samples: i64 = redis.cmd(&["ZCARD", "kmq:{mail}:history"]);
            (samples > 0, samples)
        },
    );
    for path in [
        "/api/overview",
        "/api/queues/mail",
        "/api/daemons",
        "/api/history",
        "/api/queues/mail/tasks/x",
    ] {
        let answer = read_only.get(path);
        assert_eq!(status(&answer), 200, "{path}: {answer:?}");
    }
    let operator = config_as(&dir, &redis, "kmqd-operator", "", QUEUES);
    let dashboard = Dashboard::start_named(&operator, &dir, "operator.log", &[]);
    let (code, answer) = dashboard.act("/api/queues/mail/pause", "");
    assert_eq!(code, 200, "{answer}");
    let (code, answer) = dashboard.act("/api/queues/mail/dead/requeue", r#"{"all": true}"#);
    assert_eq!(code, 200, "{answer}");
    daemon.stop();
    let log = acl_log(&redis);
    assert!(
        log.iter().all(|entry| entry.contains("cmd=evalsha ")),
        "{log:#?}"
    );
}

/// push.lua checks its keys' types and its counter (TYPE, HGET) only for a user that may run them: a producer
/// made from the rules of a kmqd before those checks (without `+type +hget`) still pushes, every kind of task,
/// with nothing refused by Redis or by `kmqd push`'s check at start.
#[test]
fn a_producer_made_from_the_rules_before_push_lua_checked_its_keys_still_pushes() {
    let redis = RedisServer::start();
    create_user(&redis, Role::Producer, |rule| {
        rule != "+type" && rule != "+hget"
    });
    let dir = TestDir::new();
    let producer = config_as(&dir, &redis, "kmqd-producer", "", QUEUES);
    let admin = dir.config(&redis, QUEUES);
    run(&producer, &["push", "jobs", "test", "{}"], None, 0);
    run(
        &producer,
        &["push", "jobs", "test", "{}", "--unique", "--id", "u"],
        None,
        0,
    );
    run(
        &producer,
        &[
            "push", "jobs", "test", "{}", "--delay", "1h", "--id", "later",
        ],
        None,
        0,
    );
    let s = stats(&admin, "jobs");
    assert_eq!((s.ready, s.delayed, s.pushed), (2, 1, 3), "{s:?}");
    assert_eq!(acl_log(&redis), Vec::<String>::new());
}

/// A debounced push runs ZSCORE and HSET, added to the producers' rules with it: a producer made from the rules
/// before them still pushes every other kind of task, and its debounced push is refused, writing nothing, with
/// an error that names the rules to add; the documented producer debounces.
#[test]
fn a_producer_made_from_the_rules_before_debounce_pushes_and_is_told_what_a_debounce_needs() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let producer = config_as(&dir, &redis, "kmqd-producer", "", QUEUES);
    let admin = dir.config(&redis, QUEUES);
    create_user(&redis, Role::Producer, |rule| {
        rule != "+zscore" && rule != "+hset"
    });
    run(&producer, &["push", "jobs", "test", "{}"], None, 0);
    let debounce = [
        "push",
        "jobs",
        "test",
        "{}",
        "--id",
        "d",
        "--debounce",
        "1h",
    ];
    let (_, err) = run(&producer, &debounce, None, 2);
    assert!(
        err.contains("a debounced push needs the producers' rules +zscore and +hset"),
        "{err}"
    );
    let s = stats(&admin, "jobs");
    assert_eq!((s.ready, s.delayed, s.pushed), (1, 0, 1), "{s:?}");
    create_user(&redis, Role::Producer, |_| true);
    run(&producer, &debounce, None, 0);
    run(&producer, &debounce, None, 0);
    let s = stats(&admin, "jobs");
    assert_eq!((s.ready, s.delayed, s.pushed), (1, 1, 2), "{s:?}");
    assert_eq!(acl_log(&redis), Vec::<String>::new());
}

/// Unique for a time, issue 37: a cancel leaves a `unique_for` task's hold, which the operators' rules gained
/// (`~kmq:{*}:unique:held:*`). An operator made from the rules before is refused at start, naming what to add, and
/// nothing is cancelled; with the documented rules the cancel leaves the hold.
#[test]
fn an_operator_made_from_the_rules_before_unique_for_is_told_what_a_cancel_needs() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let operator = config_as(&dir, &redis, "kmqd-operator", "", QUEUES);
    let admin = dir.config(&redis, QUEUES);
    create_user(&redis, Role::Operator, |rule| {
        rule != "~kmq:{*}:unique:held:*"
    });
    let task = kmqd::NewTask::new("test", "{}")
        .unwrap()
        .id("t")
        .delay(Duration::from_secs(3600))
        .unique_for(Duration::from_secs(600));
    assert!(client(&admin).push("mail", task).unwrap().is_accepted());
    let (_, err) = run(&operator, &["task", "cancel", "mail", "t"], None, 2);
    assert!(err.contains("unique:held"), "{err}");
    assert_eq!(stats(&admin, "mail").delayed, 1);
    create_user(&redis, Role::Operator, |_| true);
    run(&operator, &["task", "cancel", "mail", "t"], None, 0);
    assert_eq!(stats(&admin, "mail").delayed, 0);
    let ttl: i64 = redis.cmd(&["PTTL", "kmq:{mail}:unique:held:t"]);
    assert!(ttl > 0, "{ttl}");
    assert_eq!(acl_log(&redis), Vec::<String>::new());
}

/// `kmqd flow push` as the documented producer user (flow_push.lua's waiting tasks, push.lua's leaves), the flow
/// run by the daemon user (notes in settles, the outboxes' movers, releases across two queues, a dead
/// dependency under `continue`), `flow show` as the reader, and `dead requeue` of the dead dependency as the
/// operator (its withdrawal pushed onto its queue's outbox, which the daemon then moves): Redis refuses nothing to
/// any of them.
#[test]
fn the_documented_users_push_run_show_and_requeue_a_flow() {
    let redis = RedisServer::start();
    create_users(&redis);
    let dir = TestDir::new();
    let queues = "[[queues]]\nname = \"parts\"\nmode = \"safe\"\nretry_times = 0\n\n\
        [[queues]]\nname = \"reports\"\nmode = \"safe\"\nretry_times = 0\n";
    let daemon_config = config_as(&dir, &redis, "kmqd", "shutdown_grace = \"5s\"", queues);
    let producer = config_as(&dir, &redis, "kmqd-producer", "", queues);
    let reader = config_as(&dir, &redis, "kmqd-reader", "", queues);
    let operator = config_as(&dir, &redis, "kmqd-operator", "", queues);
    let daemon = TestDaemon::start(&daemon_config);
    let flow = r#"{"queue": "reports", "type": "test", "id": "report", "if_failed": "continue",
        "after": [{"queue": "parts", "type": "test", "id": "p1"},
                  {"queue": "parts", "type": "test", "id": "p2", "data": {"outcome": "fail"}},
                  {"queue": "reports", "type": "test", "id": "mid",
                   "after": [{"queue": "parts", "type": "test", "id": "p3"}]}]}"#;
    run(&producer, &["flow", "push", "-"], Some(flow), 0);
    eventually(Duration::from_secs(30), "the report to end", || {
        let records = dir.records();
        (
            records.ends.iter().any(|(id, ..)| id == "report"),
            records.lines,
        )
    });
    let (out, _) = run(
        &reader,
        &["flow", "show", "reports", "report", "--json"],
        None,
        0,
    );
    let shown: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(shown["state"], "released", "{shown}");
    run(&operator, &["dead", "requeue", "parts", "p2"], None, 0);
    eventually(
        Duration::from_secs(30),
        "p2 run again and its notes moved",
        || {
            let runs = dir.records().runs_of("p2");
            let outbox: i64 = redis.cmd(&["LLEN", "kmq:{parts}:deps-outbox"]);
            (runs == 2 && outbox == 0, (runs, outbox))
        },
    );
    daemon.stop();
    assert_eq!(dir.records().runs_of("report"), 1);
    let log = acl_log(&redis);
    assert!(log.is_empty(), "{log:#?}");
}
