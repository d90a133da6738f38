//! Redis's `maxmemory-policy` (docs/OPERATIONS.md, "maxmemory-policy"): a Redis that may evict kmqd's keys is
//! refused at start, exit 2, naming the policy and the fix, unless `[redis] allow_eviction` accepts it knowingly;
//! `push` and `dead requeue` refuse it too, the commands that only remove or flag warn and go on.

use std::path::Path;
use std::time::Duration;

use crate::support::*;

const QUEUE: &str = "[[queues]]\nname = \"jobs\"\nmode = \"safe\"\nworkers = 2\n";

/// A test server started with `maxmemory-policy POLICY` (in its arguments, as redis.conf would have it).
fn redis_with_policy(policy: &str) -> RedisServer {
    RedisServer::start_with(RedisOptions {
        extra_args: vec!["--maxmemory-policy".into(), policy.into()],
        ..RedisOptions::default()
    })
}

/// A config for `redis`, with `allow_eviction = true` when `allowed`.
fn config(dir: &TestDir, redis: &RedisServer, allowed: bool) -> std::path::PathBuf {
    let keys = format!(
        "url = \"{}\"{}",
        redis.url(),
        if allowed {
            "\nallow_eviction = true"
        } else {
            ""
        }
    );
    dir.config_raw(&keys, "shutdown_grace = \"5s\"", QUEUE)
}

/// `kmqd -c CONFIG ARGS...`: (exit code, stdout, stderr).
fn run(config: &Path, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["-c", config.to_str().unwrap()];
    all.extend_from_slice(args);
    kmqd(&all, None)
}

/// The refusal's words: the policy, the fix in Redis, and the key that accepts it.
fn assert_names_the_policy_and_the_fix(text: &str, policy: &str) {
    for words in [
        &format!("Redis runs with maxmemory-policy {policy}") as &str,
        "CONFIG SET maxmemory-policy noeviction",
        "maxmemory-policy noeviction` in redis.conf",
        "[redis] allow_eviction = true",
        "docs/OPERATIONS.md, \"maxmemory-policy\"",
    ] {
        assert!(text.contains(words), "{words:?} missing from:\n{text}");
    }
}

/// Under `allkeys-lru` (Redis may evict a ready list, a claim list) and `volatile-lru` (the settle records),
/// the daemon exits 2 at start naming the policy and the fix, and takes nothing; `check-config` (which systemd
/// runs first) refuses it the same way.
#[test]
fn a_redis_that_may_evict_keys_is_refused_at_start_with_the_fix_named() {
    for policy in ["allkeys-lru", "volatile-lru"] {
        let redis = redis_with_policy(policy);
        let dir = TestDir::new();
        let config = config(&dir, &redis, false);
        push_many(&config, "t", 3, "{}");
        let mut daemon = Process::start(&config, dir.path("daemon.log"));
        let code = daemon.wait_within(Duration::from_secs(20));
        let log = daemon.log_text();
        assert_eq!(code, Some(2), "{policy}: {log}");
        assert_names_the_policy_and_the_fix(&log, policy);
        assert!(!log.contains("kmqd started"), "{log}");
        let ready: i64 = redis.cmd(&["LLEN", "kmq:{jobs}:ready:normal"]);
        assert_eq!(ready, 3, "{policy}: nothing taken");
        if policy.starts_with("volatile-") {
            assert!(log.contains("applied twice"), "{log}");
        }

        let (code, out, err) = run(&config, &["check-config"]);
        assert_eq!(code, 2, "{policy}: {out}{err}");
        assert_names_the_policy_and_the_fix(&err, policy);
    }
}

/// The harness's servers run with Redis's default, `noeviction`: the daemon starts, serves and says nothing
/// about the policy at warn; `check-config` prints it, and passes with a note when Redis is down (the daemon
/// waits for it; systemd runs `check-config` before it).
#[test]
fn a_redis_with_noeviction_is_served_without_a_warning() {
    let mut redis = RedisServer::start();
    let policy: Vec<String> = redis.cmd(&["CONFIG", "GET", "maxmemory-policy"]);
    assert_eq!(policy, ["maxmemory-policy", "noeviction"]);
    let dir = TestDir::new();
    let config = config(&dir, &redis, false);
    let (code, out, err) = run(&config, &["check-config"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("maxmemory-policy noeviction"), "{out}");
    assert!(!out.contains("warning:"), "{out}");

    push_many(&config, "t", 5, "{}");
    let mut daemon = Process::start(&config, dir.path("daemon.log"));
    wait_done(&config, 5, Duration::from_secs(30));
    let log = daemon.log_text();
    assert!(log.contains("kmqd started"), "{log}");
    assert!(
        !log.lines()
            .any(|line| line.contains("WARN") && line.contains("maxmemory")),
        "{log}"
    );
    daemon.signal(15);
    assert_eq!(
        daemon.wait_within(Duration::from_secs(30)),
        Some(0),
        "{log}"
    );

    redis.stop(Signal::Term);
    let (code, out, err) = run(&config, &["check-config"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("maxmemory-policy not read ("), "{out}");
}

/// `[redis] allow_eviction = true` accepts a policy that may evict knowingly: the daemon starts and serves, and
/// logs at warn, once, the policy and what it may lose.
#[test]
fn a_redis_that_may_evict_keys_is_served_with_a_warning_when_accepted_knowingly() {
    let redis = redis_with_policy("allkeys-lru");
    let dir = TestDir::new();
    let config = config(&dir, &redis, true);
    push_many(&config, "t", 5, "{}");
    let mut daemon = Process::start(&config, dir.path("daemon.log"));
    wait_done(&config, 5, Duration::from_secs(30));
    let log = daemon.log_text();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("WARN") && line.contains("maxmemory-policy allkeys-lru"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    assert!(
        warnings[0].contains("accepted by [redis] allow_eviction = true")
            && warnings[0].contains("a ready list"),
        "{log}"
    );
    daemon.signal(15);
    assert_eq!(
        daemon.wait_within(Duration::from_secs(30)),
        Some(0),
        "{log}"
    );

    let (code, out, err) = run(&config, &["check-config"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("maxmemory-policy allkeys-lru")
            && out.contains("warning: Redis runs with maxmemory-policy allkeys-lru"),
        "{out}"
    );
}

/// The commands that put tasks into Redis (`push`, `dead requeue`) refuse a Redis that may evict them, exit 2,
/// before they write anything; the ones that only remove or flag (`dead purge`, `task cancel`, `queue pause`
/// and `resume`) warn and go on. Accepted knowingly, `push` warns and pushes.
#[test]
fn the_commands_that_add_tasks_refuse_a_redis_that_may_evict_them_and_the_others_warn() {
    let redis = redis_with_policy("allkeys-lfu");
    let dir = TestDir::new();
    let config = config(&dir, &redis, false);

    let (code, out, err) = run(&config, &["push", "jobs", "test", "{}"]);
    assert_eq!(code, 2, "{out}{err}");
    assert_names_the_policy_and_the_fix(&err, "allkeys-lfu");
    let ready: i64 = redis.cmd(&["LLEN", "kmq:{jobs}:ready:normal"]);
    assert_eq!(ready, 0, "nothing pushed");

    let (code, out, err) = run(&config, &["dead", "requeue", "jobs", "--all"]);
    assert_eq!(code, 2, "{out}{err}");
    assert_names_the_policy_and_the_fix(&err, "allkeys-lfu");

    for args in [
        &["queue", "pause", "jobs"] as &[&str],
        &["queue", "resume", "jobs"],
        &["dead", "purge", "jobs", "--all"],
        &["task", "cancel", "jobs", "nothing-here"],
    ] {
        let (code, out, err) = run(&config, args);
        assert!(code == 0 || code == 4, "{args:?}: {out}{err}");
        assert!(
            err.contains("WARN")
                && err.contains("Redis runs with maxmemory-policy allkeys-lfu")
                && err.contains("this command goes on"),
            "{args:?}: {err}"
        );
    }
    let (code, out, _) = run(&config, &["queue", "pause", "jobs"]);
    assert_eq!((code, out.trim()), (0, "paused jobs"));

    // The dashboard with its buttons (a requeue among them) warns once, at start; read-only, it says nothing.
    for (args, warns) in [
        (&["--listen", "127.0.0.1:0"] as &[&str], true),
        (&["--listen", "127.0.0.1:0", "--read-only"], false),
    ] {
        let mut all = vec!["dashboard"];
        all.extend_from_slice(args);
        let log = dir.path(&format!("dashboard-{warns}.log"));
        let dashboard = Process::start_with_args(&config, log, &all);
        let log = eventually(Duration::from_secs(30), "the dashboard's address", || {
            let log = dashboard.log_text();
            (log.contains("dashboard on http://"), log)
        });
        assert_eq!(
            log.contains("WARN") && log.contains("maxmemory-policy allkeys-lfu"),
            warns,
            "{args:?}: {log}"
        );
    }

    let accepted = dir.config_raw(
        &format!("url = \"{}\"\nallow_eviction = true", redis.url()),
        "",
        QUEUE,
    );
    let (code, out, err) = run(&accepted, &["push", "jobs", "test", "{}", "--id", "a"]);
    assert_eq!((code, out.trim()), (0, "a"), "{err}");
    assert!(
        err.contains("WARN") && err.contains("accepted by [redis] allow_eviction = true"),
        "{err}"
    );
}

/// In a Redis Cluster every master is asked (a queue's keys live on one, but a resharding moves them): one master
/// under `allkeys-lru`, not the queue's, is enough for the daemon and `push` to refuse, naming that node; the
/// policy is read with CONFIG GET where INFO is refused (an ACL rule, a managed service).
#[test]
fn in_a_cluster_every_master_s_policy_is_checked() {
    use kmqd_harness::cluster::{Cluster, ClusterOptions};
    let cluster = Cluster::start(ClusterOptions {
        replicas_per_master: 0,
        ..ClusterOptions::default()
    })
    .expect("start a Redis Cluster");
    let queue_master = cluster.master_for_key("kmq:{jobs}:ready:normal").unwrap();
    let masters = cluster.masters().unwrap();
    let other = masters
        .iter()
        .find(|master| master.addr != queue_master.addr)
        .expect("another master");
    let server = cluster.server(&other.addr).unwrap();
    server
        .query(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"])
        .unwrap();
    let dir = TestDir::new();
    let config = dir.config_raw(
        &crate::cluster::redis_section(&cluster, ""),
        "shutdown_grace = \"5s\"",
        QUEUE,
    );

    let (code, out, err) = run(&config, &["push", "jobs", "test", "{}"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains(&format!(
            "Redis (node {}) runs with maxmemory-policy allkeys-lru",
            other.addr
        )),
        "{err}"
    );
    let mut daemon = Process::start(&config, dir.path("daemon.log"));
    assert_eq!(
        daemon.wait_within(Duration::from_secs(30)),
        Some(2),
        "{}",
        daemon.log_text()
    );

    // INFO refused on every node (renamed away, as some managed services do with CONFIG instead): read with
    // CONFIG GET, still on every master.
    for master in &masters {
        let server = cluster.server(&master.addr).unwrap();
        server
            .query(&["ACL", "SETUSER", "default", "-info"])
            .unwrap();
    }
    let (code, out, err) = run(&config, &["check-config"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains(&other.addr), "{err}");
    server
        .query(&["CONFIG", "SET", "maxmemory-policy", "noeviction"])
        .unwrap();
    let (code, out, err) = run(&config, &["check-config"]);
    assert_eq!(code, 0, "{out}{err}");
    for master in &masters {
        assert!(
            out.contains(&format!("{} noeviction", master.addr)),
            "{out}"
        );
    }
}

/// A user without `+info` (ACL rules written before kmqd read the policy) is not refused: the daemon warns that
/// it cannot read the policy, and serves.
#[test]
fn a_policy_that_cannot_be_read_is_warned_about_and_the_daemon_serves() {
    use kmqd::broker::access::{Role, setuser_line};
    let redis = RedisServer::start();
    let line = setuser_line(Role::Daemon, "kmq").replace(">PASSWORD", ">secret");
    let rules: Vec<&str> = line.split(' ').filter(|rule| *rule != "+info").collect();
    let _: String = redis.cmd(&rules);
    let dir = TestDir::new();
    let keys = format!(
        "url = \"{}\"\nusername = \"kmqd\"\npassword_env = \"KMQD_TEST_PASSWORD\"",
        redis.url()
    );
    let config = dir.config_named(
        "as-kmqd.toml",
        &keys,
        "shutdown_grace = \"5s\"",
        QUEUE,
        &dir.record_file(),
    );
    let as_default = dir.config(&redis, QUEUE);
    push_many(&as_default, "t", 3, "{}");
    let daemon = Process::start_with_env(
        &config,
        dir.path("daemon.log"),
        &[("KMQD_TEST_PASSWORD", "secret")],
    );
    wait_done(&as_default, 3, Duration::from_secs(30));
    let log = daemon.log_text();
    drop(daemon);
    assert!(
        log.lines().any(|line| line.contains("WARN")
            && line.contains("cannot read Redis's maxmemory-policy")
            && line.contains("no permissions to run the 'info' command")),
        "{log}"
    );
}

/// Behind Sentinel the master's policy is read (the replicas' do not matter until one is promoted, and a
/// daemon started after that reads the new master's).
#[test]
fn behind_sentinel_the_master_s_policy_is_checked() {
    use kmqd_harness::sentinel::{SentinelOptions, SentinelSetup};
    let setup = SentinelSetup::start(SentinelOptions::default()).expect("start sentinels");
    let master = setup.master().unwrap();
    let replication: String = match master.query(&["INFO", "replication"]).unwrap() {
        redis::Value::BulkString(bytes) => String::from_utf8(bytes).unwrap(),
        redis::Value::VerbatimString { text, .. } => text,
        other => panic!("INFO replication: {other:?}"),
    };
    let port = replication
        .lines()
        .find_map(|line| line.strip_prefix("slave0:"))
        .and_then(|fields| fields.split(',').find_map(|f| f.strip_prefix("port=")))
        .unwrap_or_else(|| panic!("a replica: {replication}"));
    let replica = setup
        .server(&format!("127.0.0.1:{port}"))
        .expect("our replica");
    let seeds: Vec<String> = setup
        .sentinel_urls()
        .iter()
        .map(|url| format!("\"{url}\""))
        .collect();
    let dir = TestDir::new();
    let config = dir.config_raw(
        &format!(
            "sentinel = [{}]\nsentinel_master = \"{}\"",
            seeds.join(", "),
            setup.master_name()
        ),
        "",
        QUEUE,
    );

    replica
        .query(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"])
        .unwrap();
    let (code, out, err) = run(&config, &["push", "jobs", "test", "{}", "--id", "a"]);
    assert_eq!((code, out.trim()), (0, "a"), "a replica's policy: {err}");

    master
        .query(&["CONFIG", "SET", "maxmemory-policy", "volatile-ttl"])
        .unwrap();
    let (code, out, err) = run(&config, &["push", "jobs", "test", "{}", "--id", "b"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("Redis runs with maxmemory-policy volatile-ttl"),
        "{err}"
    );
}
