//! `source_lists` (docs/CONFIG.md): producers that RPUSH their own payloads to their own list (Redis in Action's
//! `queue:email`) work unchanged: the daemon moves what they push into the queue, each task once, whatever
//! fails, however many daemons move.
//!
//! The producers here are plain Redis commands on a connection of their own, never kmqd's client.

use std::ops::Range;
use std::time::Duration;

use base64::Engine;
use kmqd::broker::sources;
use kmqd_harness::cluster::{Cluster, ClusterOptions};
use kmqd_harness::sentinel::{SentinelOptions, SentinelSetup};

use crate::support::proxy::{AfterDrop, Fault, FaultProxy, Matcher};
use crate::support::*;

const SOURCE: &str = "queue:email";

/// The queue `email` in `mode`, fed from [`SOURCE`] by producers whose payloads name their handler in
/// `callback`, with `extra` keys.
fn queue(mode: &str, source: &str, extra: &str) -> String {
    format!(
        "[[queues]]\nname = \"email\"\nmode = \"{mode}\"\nforeign_type_field = \"callback\"\n\
         source_lists = [\"{source}\"]\nretry_times = 0\n{extra}\n"
    )
}

/// What a Redis in Action producer pushes: its own JSON, `ria-I` its id, the testkit plugin its handler.
fn payloads(ids: Range<usize>) -> Vec<String> {
    ids.map(|i| format!(r#"{{"callback": "test", "args": [{i}], "id": "ria-{i}"}}"#))
        .collect()
}

/// RPUSHes the payloads of `ids` to `list`, 100 per command, as a producer that knows nothing of kmqd does.
fn produce(redis: &RedisServer, list: &str, ids: Range<usize>) {
    let mut connection = redis.connection();
    for chunk in payloads(ids).chunks(100) {
        let _: i64 = redis::cmd("RPUSH")
            .arg(list)
            .arg(chunk)
            .query(&mut connection)
            .unwrap();
    }
}

/// Whether a client is blocked in BLMOVE (a mover waiting on a source, or a default-mode fetcher of a one-level
/// queue waiting on its ready list), and the client list. An idle pooled connection keeps its last command in
/// the list, unblocked: the flags tell.
fn blocked_in_blmove(redis: &RedisServer) -> (bool, String) {
    let clients: String = redis.cmd(&["CLIENT", "LIST"]);
    let blocked = clients.lines().any(|client| {
        let flags = client
            .split(' ')
            .find_map(|field| field.strip_prefix("flags="));
        client.contains("cmd=blmove") && flags.is_some_and(|flags| flags.contains('b'))
    });
    (blocked, clients)
}

/// Every task of `ids` ran exactly once, and nothing else ran.
fn assert_each_ran_once(dir: &TestDir, ids: Range<usize>) {
    assert_each_ran_once_among(dir, ids, 0);
}

/// Every task of `ids` ran exactly once, beside `others` runs of other tasks (each once).
fn assert_each_ran_once_among(dir: &TestDir, ids: Range<usize>, others: usize) {
    let records = dir.records();
    let mut seen: Vec<&str> = records.starts.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(seen.len(), ids.len() + others, "runs");
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), ids.len() + others, "a task ran twice");
    for i in ids {
        assert_eq!(records.runs_of(&format!("ria-{i}")), 1, "ria-{i}");
    }
}

/// A backlog pushed before any daemon runs, and tasks pushed while two daemons serve the queue (each moving
/// from the same list): every task runs once, in safe mode and in default mode, and the counters say they were
/// moved. Catches a move that loses or duplicates tasks (two movers racing, a batch pushed twice), a mover that
/// does not wake on a push, and moved tasks that do not wake an idle fetcher.
#[test]
fn tasks_producers_push_to_their_own_list_run_exactly_once() {
    for mode in ["safe", "default"] {
        let redis = RedisServer::start();
        let dir = TestDir::new();
        let config = dir.config(&redis, &queue(mode, SOURCE, "workers = 4"));
        produce(&redis, SOURCE, 0..1500);
        let daemons = [TestDaemon::start(&config), TestDaemon::start(&config)];
        eventually(Duration::from_secs(60), "the backlog done", || {
            let s = stats(&config, "email");
            (s.done == 1500, s)
        });
        // Idle now: the movers wait on the source, and a push wakes one of them.
        eventually(Duration::from_secs(10), "a mover waiting", || {
            blocked_in_blmove(&redis)
        });
        produce(&redis, SOURCE, 1500..1600);
        let s = eventually(Duration::from_secs(30), "every task done", || {
            let s = stats(&config, "email");
            (s.done >= 1600, s)
        });
        for daemon in daemons {
            daemon.stop();
        }
        assert_eq!(
            (s.done, s.moved, s.pushed, s.dead_lettered),
            (1600, 1600, 1600, 0),
            "{mode}: {s:?}"
        );
        let left: i64 = redis.cmd(&["LLEN", SOURCE]);
        assert_eq!(left, 0, "{mode}");
        assert_each_ran_once(&dir, 0..1600);
    }
}

/// Payloads that cannot be decoded (not JSON, JSON without the type field, not UTF-8) are moved as they are
/// and dead-lettered with the producer's exact bytes; the good one beside them runs. Catches a move that alters
/// the payload (a stamp, a re-encoding) and a malformed payload that stops the mover.
#[test]
fn a_payload_that_cannot_be_decoded_is_dead_lettered_with_the_producer_s_bytes() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &queue("safe", SOURCE, ""));
    let daemon = TestDaemon::start(&config);
    let bad: [&[u8]; 3] = [
        br#"{"callback": "test", "args": [1,"#,
        br#"{"args": [2], "id": "no-callback"}"#,
        b"\xff\xfe not UTF-8",
    ];
    let mut connection = redis.connection();
    for payload in bad
        .iter()
        .copied()
        .chain([&br#"{"callback": "test", "id": "good"}"#[..]])
    {
        let _: i64 = redis::cmd("RPUSH")
            .arg(SOURCE)
            .arg(payload)
            .query(&mut connection)
            .unwrap();
    }
    let s = eventually(Duration::from_secs(20), "all four settled", || {
        let s = stats(&config, "email");
        (s.done + s.dead_lettered == 4, s)
    });
    daemon.stop();
    assert_eq!((s.done, s.dead_lettered, s.moved), (1, 3, 4), "{s:?}");
    let records = client(&config).dead_list("email", 10).unwrap();
    let kept: Vec<Vec<u8>> = records
        .iter()
        .map(|record| match record.task() {
            Some(text) => text.as_bytes().to_vec(),
            None => base64::engine::general_purpose::STANDARD
                .decode(record.text("task_base64").expect("the bytes, as base64"))
                .unwrap(),
        })
        .collect();
    for payload in bad {
        assert!(
            kept.iter().any(|k| k == payload),
            "{:?} kept byte for byte in {records:?}",
            String::from_utf8_lossy(payload)
        );
    }
    assert_eq!(dir.records().runs_of("good"), 1);
}

/// Moving is not taking: a paused queue's tasks are moved into its ready lists, each source's to its level
/// (the default one, or the one its table names), where `stats` counts them, and run only once the queue is
/// resumed. Catches a mover that stops on a pause (tasks stuck out of sight in the source), a pause that moved
/// tasks slip through, and a source's tasks joining the wrong level.
#[test]
fn a_paused_queue_keeps_moving_each_source_to_its_level_and_runs_nothing_until_resumed() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queue = "[[queues]]\nname = \"email\"\nmode = \"default\"\nforeign_type_field = \"callback\"\n\
                 priorities = [\"high\", \"normal\", \"low\"]\n\
                 source_lists = [\"queue:email\", { list = \"queue:urgent\", priority = \"high\" }]\n";
    let config = dir.config(&redis, queue);
    assert!(client(&config).pause("email").unwrap());
    let daemon = TestDaemon::start(&config);
    produce(&redis, SOURCE, 0..50);
    produce(&redis, "queue:urgent", 50..60);
    let s = eventually(
        Duration::from_secs(20),
        "the tasks moved while paused",
        || {
            let s = stats(&config, "email");
            (s.ready == 60 && s.moved == 60, s)
        },
    );
    assert_eq!(
        s.levels_text(),
        "high:10,normal:50,low:0",
        "each source's tasks at its level"
    );
    assert!(dir.records().starts.is_empty(), "nothing ran while paused");
    assert!(client(&config).resume("email").unwrap());
    eventually(
        Duration::from_secs(20),
        "the tasks done once resumed",
        || {
            let s = stats(&config, "email");
            (s.done >= 60, s)
        },
    );
    daemon.stop();
    assert_each_ran_once(&dir, 0..60);
}

/// The mover's calls lose their replies (the connection closed, or gone silent past `io_timeout`), its
/// blocking wait is cut, and Redis stalls, all while producers push: nothing is lost, nothing runs twice, and
/// the counters are exact. Catches a mover that gives up, spins, or resends a move it believes failed in a
/// way that pushes a batch twice.
#[test]
fn lost_replies_cut_waits_and_a_stalled_redis_while_moving_lose_and_duplicate_nothing() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(&redis);
    let dir = TestDir::new();
    let config = dir.config_raw(
        &format!("url = \"{}\"\nio_timeout = \"500ms\"", proxy.url()),
        "shutdown_grace = \"5s\"",
        &queue("safe", SOURCE, "workers = 4\nlease_timeout = \"10s\""),
    );
    let daemon = TestDaemon::start(&config);
    let faults = [
        Fault::DropReply {
            matching: Matcher::script(sources::MOVE),
            nth: 1,
            then: AfterDrop::Close,
        },
        Fault::DropReply {
            matching: Matcher::script(sources::MOVE),
            nth: 1,
            then: AfterDrop::Hang,
        },
        Fault::DropReply {
            matching: Matcher::command("BLMOVE"),
            nth: 1,
            then: AfterDrop::Close,
        },
        Fault::Stall {
            duration: Duration::from_millis(1500),
        },
    ];
    let per_round = 300;
    for (round, fault) in faults.into_iter().enumerate() {
        let rule = proxy.add(fault);
        produce(&redis, SOURCE, round * per_round..(round + 1) * per_round);
        eventually(Duration::from_secs(20), "the fault to strike", || {
            (rule.fired() > 0, ())
        });
    }
    let total = 4 * per_round;
    let s = eventually(Duration::from_secs(60), "every task done", || {
        let s = stats(&config, "email");
        (s.done as usize >= total && s.processing == 0, s)
    });
    daemon.stop();
    assert_eq!(
        (s.done as usize, s.moved as usize, s.dead_lettered, s.ready),
        (total, total, 0, 0),
        "{s:?}"
    );
    let left: i64 = redis.cmd(&["LLEN", SOURCE]);
    assert_eq!(left, 0);
    assert_each_ran_once(&dir, 0..total);
}

/// On a Redis Cluster a source list must be in the queue's slot (a task moves atomically only within one):
/// `check-config` and the daemon refuse one that is not, naming it and the name to give it; with the queue's
/// hash tag it works. Catches a cluster config accepted only to fail with CROSSSLOT at the first move.
#[test]
fn on_a_redis_cluster_a_source_list_must_share_the_queue_s_slot() {
    let cluster = Cluster::start(ClusterOptions::default()).expect("start a Redis Cluster");
    let dir = TestDir::new();
    let redis = crate::cluster::redis_section(&cluster, "");
    let refused = dir.config_raw(&redis, "", &queue("safe", SOURCE, ""));
    let (code, _, err) = kmqd(
        &["--config", refused.to_str().unwrap(), "check-config"],
        None,
    );
    assert_eq!(code, 2, "{err}");
    for words in [
        "queues[0].source_lists[0]: \"queue:email\" is in another Redis Cluster slot",
        "\"queue:{email}\"",
    ] {
        assert!(err.contains(words), "{words:?} in {err}");
    }
    let mut daemon = Process::start(&refused, dir.path("refused.log"));
    assert_eq!(daemon.wait_within(Duration::from_secs(20)), Some(2));
    assert!(daemon.log_text().contains("another Redis Cluster slot"));

    let tagged = "queue:{email}";
    let config = dir.config_raw(&redis, "", &queue("safe", tagged, ""));
    let (code, out, err) = kmqd(
        &["--config", config.to_str().unwrap(), "check-config"],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("    source list \"queue:{email}\": its tasks join level \"normal\""),
        "{out}"
    );
    let daemon = TestDaemon::start(&config);
    let node = cluster.master_for_key(tagged).unwrap();
    let server = cluster.server(&node.addr).unwrap();
    for payload in payloads(0..100) {
        let _: i64 = server.query_as(&["RPUSH", tagged, &payload]).unwrap();
    }
    let s = eventually(Duration::from_secs(30), "every task done", || {
        let s = stats(&config, "email");
        (s.done == 100, s)
    });
    daemon.stop();
    assert_eq!(s.moved, 100, "{s:?}");
    assert_each_ran_once(&dir, 0..100);
}

/// `source_lists` changes live: a reload that adds a source starts moving it (the queue's lane is replaced, as
/// for any queue setting), and one that removes it stops the mover, leaving what is pushed after in the source.
/// Catches a change that needs a restart to take effect, and a mover that outlives its lane.
#[test]
fn a_reload_starts_and_stops_moving_a_source_list() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let without =
        "[[queues]]\nname = \"email\"\nmode = \"safe\"\nforeign_type_field = \"callback\"\n";
    let config = dir.config(&redis, without);
    let daemon = crate::reload::start(&dir, &config);
    produce(&redis, SOURCE, 0..20);
    dir.config(&redis, &queue("safe", SOURCE, ""));
    let log = crate::reload::reload(&daemon, 1);
    assert!(
        log.contains("queues.email.source_lists [] → [\"queue:email\" (normal)]"),
        "{log}"
    );
    assert!(!log.contains("needs a restart"), "{log}");
    eventually(Duration::from_secs(20), "the source's tasks done", || {
        let s = stats(&config, "email");
        (s.done >= 20, s)
    });

    dir.config(&redis, without);
    crate::reload::reload(&daemon, 2);
    // The replaced lane's mover is gone once no client is blocked in BLMOVE (the fetcher of a safe queue waits
    // on its wake list, with BLPOP; an idle pooled connection keeps its last command in the list, unblocked).
    eventually(Duration::from_secs(20), "the mover to stop", || {
        let (waiting, clients) = blocked_in_blmove(&redis);
        (!waiting, clients)
    });
    produce(&redis, SOURCE, 20..30);
    // A task the queue runs after that push: by then, a live mover would have had its turn.
    client(&config)
        .push(
            "email",
            kmqd::NewTask::new("test", "{}").unwrap().id("after"),
        )
        .unwrap();
    eventually(Duration::from_secs(20), "the pushed task done", || {
        (dir.records().runs_of("after") == 1, ())
    });
    let left: i64 = redis.cmd(&["LLEN", SOURCE]);
    assert_eq!(left, 10, "nothing moved once the source was removed");
    crate::reload::stop(daemon);
    assert_each_ran_once_among(&dir, 0..20, 1);
}

/// A source that is not a list (a producer's typo, a key reused) makes every move refuse before it writes,
/// loudly, naming the key, and retried with backoff; once the key is fixed the tasks waiting in the other
/// source move. Catches a move that pops from one source and then fails on the next (tasks half-moved, or lost
/// in between), and a refusal that goes unsaid.
#[test]
fn a_source_that_is_not_a_list_stops_the_moves_whole_and_says_so() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let queue = "[[queues]]\nname = \"email\"\nmode = \"safe\"\nforeign_type_field = \"callback\"\n\
                 source_lists = [\"queue:email\", \"queue:broken\"]\n";
    let config = dir.config(&redis, queue);
    let _: String = redis.cmd(&["SET", "queue:broken", "not a list"]);
    produce(&redis, SOURCE, 0..30);
    let daemon = crate::reload::start(&dir, &config);
    crate::reload::wait_logged(&daemon, "queue:broken holds a string, not a list", 1);
    let left: i64 = redis.cmd(&["LLEN", SOURCE]);
    assert_eq!(left, 30, "a refused move writes nothing");
    let _: i64 = redis.cmd(&["DEL", "queue:broken"]);
    eventually(Duration::from_secs(20), "the tasks moved and done", || {
        let s = stats(&config, "email");
        (s.done >= 30, s)
    });
    crate::reload::stop(daemon);
    assert_eq!(stats(&config, "email").moved, 30);
    assert_each_ran_once(&dir, 0..30);
}

/// Behind Sentinel a source list may have any name (one master holds every key): the daemon finds the master
/// through the sentinels and moves what the producers push there.
#[test]
fn behind_sentinel_a_source_list_of_any_name_is_moved() {
    let setup = SentinelSetup::start(SentinelOptions::default()).expect("start sentinels");
    let seeds: Vec<String> = setup
        .sentinel_urls()
        .iter()
        .map(|url| format!("\"{url}\""))
        .collect();
    let dir = TestDir::new();
    let redis = format!(
        "sentinel = [{}]\nsentinel_master = \"{}\"",
        seeds.join(", "),
        setup.master_name()
    );
    let config = dir.config_raw(&redis, "", &queue("safe", SOURCE, ""));
    let daemon = TestDaemon::start(&config);
    let master = setup.master().unwrap();
    for payload in payloads(0..100) {
        let _: i64 = master.query_as(&["RPUSH", SOURCE, &payload]).unwrap();
    }
    let s = eventually(Duration::from_secs(30), "every task done", || {
        let s = stats(&config, "email");
        (s.done >= 100, s)
    });
    daemon.stop();
    assert_eq!((s.done, s.moved), (100, 100), "{s:?}");
    assert_each_ran_once(&dir, 0..100);
}

/// Redis killed and restarted (from its append-only file) under a moving daemon: the mover reconnects, loads
/// its script again (the restarted Redis has none cached), and moves what producers push afterwards; nothing
/// moved before is lost or moved twice. Catches a mover that gives up on a restart, or stays on a dead
/// connection.
#[test]
fn a_redis_restarted_under_the_mover_loses_and_duplicates_nothing() {
    let mut redis = RedisServer::with_aof(Fsync::Always);
    let dir = TestDir::new();
    let config = dir.config_raw(
        &format!("url = \"{}\"\nio_timeout = \"1s\"", redis.url()),
        "shutdown_grace = \"5s\"",
        &queue("safe", SOURCE, "workers = 4\nlease_timeout = \"2s\""),
    );
    let daemon = TestDaemon::start(&config);
    produce(&redis, SOURCE, 0..500);
    eventually(Duration::from_secs(20), "the first tasks moved", || {
        let s = stats(&config, "email");
        (s.moved >= 500, s)
    });
    redis.stop(Signal::Kill);
    redis.restart();
    produce(&redis, SOURCE, 500..1000);
    let s = eventually(Duration::from_secs(60), "every task done", || {
        let s = stats(&config, "email");
        (s.done >= 1000 && s.processing == 0, s)
    });
    daemon.stop();
    assert_eq!(
        (s.done, s.moved, s.dead, s.ready),
        (1000, 1000, 0, 0),
        "{s:?}"
    );
    assert_each_ran_once(&dir, 0..1000);
}
