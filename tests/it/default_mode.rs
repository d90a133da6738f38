//! Default mode: plain pops, no processing area; tasks still run, retry and dead-letter by the same policy.

use std::time::Duration;

use kmqd::NewTask;

use crate::support::*;

const QUEUE: &str = "[[queues]]\nname = \"fast\"\nmode = \"default\"\nworkers = 4\nbackoff = \"10ms\"\nretry_times = 1\n";

#[test]
fn tasks_run_retry_and_dead_letter() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let daemon = TestDaemon::start(&config);
    let client = client(&config);
    let tasks: Vec<NewTask> = (0..200)
        .map(|i| {
            let data = match i % 4 {
                0 => r#"{"fail_attempts":1}"#,
                1 => r#"{"outcome":"fail"}"#,
                _ => "7",
            };
            NewTask::new("test", data).unwrap().id(format!("d{i}"))
        })
        .collect();
    client.push_batch("fast", tasks).unwrap();
    let s = eventually(Duration::from_secs(30), "the queue to drain", || {
        let s = stats(&config, "fast");
        (
            s.ready + s.delayed == 0 && s.done + s.dead_lettered == 200,
            s,
        )
    });
    assert_eq!(
        (s.done, s.dead_lettered, s.retried, s.processing),
        (150, 50, 50, 0),
        "{s:?}"
    );
    let records = dir.records();
    assert_eq!(records.runs_of("d0"), 2, "failed once, retried once");
    daemon.stop();
}

#[test]
fn any_producer_wakes_an_idle_default_queue_at_once() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(
        &redis,
        &QUEUE.replace("workers = 4", "workers = 1\nidle_poll = \"1s\""),
    );
    let daemon = TestDaemon::start(&config);
    redis.wait_blocked_in("blmove");
    // A plain RPUSH, no marker: the idle fetcher, blocked on the ready list itself, sees it at once.
    let _: i64 = redis.cmd(&[
        "RPUSH",
        "kmq:{fast}:ready:normal",
        r#"{"id":"bare","type":"test"}"#,
    ]);
    eventually(Duration::from_secs(5), "the task to run", || {
        (dir.records().runs_of("bare") == 1, ())
    });
    daemon.stop();
}

/// A default-mode pop takes at most `batch` tasks, however many the lane could hold (`max_held` up to 200,000):
/// one call of pop.lua, or of take.lua (the plain pop), is bounded like a claim, and so is the time it holds Redis
/// and the payloads pop.lua decodes (review L7). The bound is the lane's: it reserves at most `batch` slots a
/// fetch. Seen on the wire, through the proxy: every pop's most tasks (ARGV[1] of take.lua, ARGV[2] of pop.lua),
/// with a backlog far larger than a batch, unique tasks among it (pop.lua) and plain ones after (the plain pop).
#[test]
fn a_pop_takes_at_most_batch_tasks_however_many_the_lane_may_hold() {
    use crate::support::proxy::{FaultProxy, Matcher};
    use kmqd::broker::sources;
    use std::sync::{Arc, Mutex};

    let redis = RedisServer::start();
    let dir = TestDir::new();
    // A batch above the 32 tasks after which pops go plain (`PLAIN_POP_AFTER`).
    let queue = QUEUE.replace("workers = 4", "workers = 2\nbatch = 40\nprefetch = 5000");
    let config = dir.config(&redis, &queue);
    // Unique tasks first, alone: pop.lua takes them (full batches of a backlog of 100); the plain backlog comes
    // once they are settled, so that the pops then go plain whatever the machine's load (with both pushed at once,
    // a loaded machine settled the unique ones after the last pop, and every pop was pop.lua).
    let unique = (0..100).map(|i| {
        NewTask::new("test", "7")
            .unwrap()
            .id(format!("p{i}"))
            .unique()
    });
    client(&config).push_batch("fast", unique).unwrap();

    let proxy = FaultProxy::start(&redis);
    let counts: Arc<Mutex<Vec<(&str, usize)>>> = Arc::default();
    let (pop, take) = (
        Matcher::script(sources::POP),
        Matcher::script(sources::TAKE),
    );
    let seen = Arc::clone(&counts);
    proxy.observe(move |args| {
        let count = |arg: &Vec<u8>| String::from_utf8_lossy(arg).parse::<usize>().unwrap();
        let mut seen = seen.lock().unwrap();
        // The script's ARGV[n]: after the script, the key count and the keys.
        let argv = |n: usize| count(&args[3 + count(&args[2]) + n - 1]);
        if pop.matches(args) {
            seen.push(("pop.lua", argv(2)));
        } else if take.matches(args) {
            seen.push(("take.lua", argv(1)));
        }
    });
    let through = dir.config_named(
        "through.toml",
        &format!("url = \"{}\"", proxy.url()),
        "",
        &queue,
        &dir.record_file(),
    );
    let daemon = TestDaemon::start(&through);
    eventually(Duration::from_secs(30), "the unique tasks done", || {
        let s = stats(&config, "fast");
        (s.done == 100, s)
    });
    let plain = (100..1000).map(|i| NewTask::new("test", "7").unwrap().id(format!("p{i}")));
    client(&config).push_batch("fast", plain).unwrap();
    eventually(Duration::from_secs(30), "the backlog to drain", || {
        let s = stats(&config, "fast");
        (s.done == 1000, s)
    });
    daemon.stop();
    let counts = counts.lock().unwrap();
    assert!(
        counts.iter().all(|(_, count)| *count <= 40),
        "no pop asks for more than batch: {counts:?}"
    );
    for kind in ["pop.lua", "take.lua"] {
        assert!(
            counts.contains(&(kind, 40)),
            "a full batch by {kind}, with the backlog: {counts:?}"
        );
    }
}

#[test]
fn a_pop_under_an_owner_whose_lease_ran_out_takes_nothing_and_records_no_unique_id() {
    // Review M4: a daemon woken from a pause popped under its old owner before it learnt the lease was gone,
    // recording the unique ids it took as held by an owner the monitors had released and forgotten: had it died
    // then, nobody would ever free them. pop.lua now refuses, as claim.lua does, having written nothing.
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, QUEUE);
    let keys = kmqd::broker::QueueKeys::new("kmq", "fast", &["normal".to_string()]);
    let mut task = NewTask::new("test", "{}").unwrap().id("u");
    task.unique = true;
    assert!(client(&config).push("fast", task).unwrap().is_accepted());
    let mut connection = redis.connection();
    let info = kmqd::broker::OwnerInfo::default();
    let lease = Duration::from_secs(30);
    assert!(
        kmqd::broker::register(&mut connection, &keys, "o.1", lease, &info)
            .unwrap()
            .is_some()
    );
    let owner: std::sync::Arc<str> = std::sync::Arc::from("o.1");
    let mut popper = kmqd::broker::Popper::default();
    let limits = kmqd::broker::PopLimits::default();
    // Its lease ran out (a monitor may have released its ids already), and the owner that was never registered.
    let _: i64 = redis.cmd(&["ZADD", "kmq:{fast}:owners", "1", "o.1"]);
    for owner in [owner, std::sync::Arc::from("o.2")] {
        let refused = popper.pop(&mut connection, &keys, &owner, 10, limits, None);
        assert!(
            matches!(&refused, Err(kmqd::broker::BrokerError::LeaseLost { .. })),
            "{refused:?}"
        );
        let popped: Option<String> = redis.cmd(&["HGET", "kmq:{fast}:unique-popped", "u"]);
        assert_eq!(popped, None, "no id recorded");
        assert_eq!(stats(&config, "fast").ready, 1, "nothing taken");
    }
    // Live again (a fresh registration): the pop takes the task and records its id.
    assert!(
        kmqd::broker::register(&mut connection, &keys, "o.3", lease, &info)
            .unwrap()
            .is_some()
    );
    let live: std::sync::Arc<str> = std::sync::Arc::from("o.3");
    let batch = popper
        .pop(&mut connection, &keys, &live, 10, limits, None)
        .unwrap();
    assert_eq!(batch.tasks.len(), 1);
    assert!(batch.tasks[0].holds_unique);
    let popped: Option<String> = redis.cmd(&["HGET", "kmq:{fast}:unique-popped", "u"]);
    assert_eq!(popped.as_deref(), Some("o.3"));
}
