//! The harness for deployments beyond one server (`kmqd::redis_server::{cluster, sentinel, tls}`), tested
//! against the real thing: what the tests of kmqd's cluster, sentinel and TLS support will stand on.

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::eventually;

use kmqd::redis_server::Signal;
use kmqd::redis_server::cluster::{Cluster, ClusterOptions, Role, key_slot};
use kmqd::redis_server::sentinel::{SentinelOptions, SentinelSetup};

/// Runs redis-cli with `args`; its stdout, trimmed. Panics when it cannot run.
fn redis_cli(args: &[&str]) -> std::process::Output {
    Command::new(kmqd::redis_server::cli_binary().expect("redis-cli is installed"))
        .args(args)
        .output()
        .expect("run redis-cli")
}

fn stdout(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

fn start_cluster(options: ClusterOptions) -> Cluster {
    let started = Instant::now();
    let cluster = Cluster::start(options).unwrap_or_else(|error| panic!("{error}"));
    eprintln!("cluster up in {:?}", started.elapsed());
    cluster
}

#[test]
fn cluster_comes_up_and_redis_cli_follows_its_redirections() {
    let cluster = start_cluster(ClusterOptions::default());
    let nodes = cluster.nodes().unwrap();
    assert_eq!(nodes.len(), 6, "{nodes:?}");
    let masters = cluster.masters().unwrap();
    assert_eq!(masters.len(), 3, "{masters:?}");
    for master in &masters {
        let replicas = cluster.replicas_of(&master.id).unwrap();
        assert_eq!(replicas.len(), 1, "replicas of {master:?}: {replicas:?}");
        assert!(master.pid.is_some());
    }
    assert_eq!(cluster.seeds().unwrap().len(), 3);

    // Our slot computation agrees with the server's, hash tags included.
    let some_master = cluster.server(&masters[0].addr).unwrap();
    for key in [
        "foo",
        "{foo}bar",
        "kmq:{jobs}:ready:0",
        "a{}b",
        "{}x{y}",
        "{{x}}",
        "q-17",
    ] {
        let theirs: i64 = some_master.query_as(&["CLUSTER", "KEYSLOT", key]).unwrap();
        assert_eq!(
            i64::from(key_slot(key.as_bytes())),
            theirs,
            "slot of {key:?}"
        );
    }

    // Written on the master that serves it, read through another one by a client that follows MOVED.
    let key = "kmq:{jobs}:probe";
    let owner = cluster.master_for_key(key).unwrap();
    let other = masters.iter().find(|m| m.id != owner.id).unwrap();
    let mut connection = cluster.server(&owner.addr).unwrap().connection().unwrap();
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg("here")
        .query(&mut connection)
        .unwrap();
    let port = other.addr.rsplit_once(':').unwrap().1;
    let read = redis_cli(&["-c", "-p", port, "GET", key]);
    assert_eq!(stdout(&read), "here", "{read:?}");
    let direct = redis_cli(&["-p", port, "GET", key]);
    assert!(stdout(&direct).starts_with("MOVED"), "{direct:?}");
    assert!(nodes.iter().any(|n| n.role == Role::Replica));
}

#[test]
fn queue_names_land_on_distinct_masters() {
    let cluster = start_cluster(ClusterOptions::default());
    let placed = cluster.queue_names_on_distinct_masters(2).unwrap();
    assert_eq!(placed.len(), 3);
    let mut seen = std::collections::HashSet::new();
    for (master, queues) in &placed {
        assert_eq!(queues.len(), 2, "{queues:?}");
        let mut connection = cluster.server(&master.addr).unwrap().connection().unwrap();
        for queue in queues {
            assert!(seen.insert(queue.clone()), "{queue} twice");
            // A key of the queue is written on that master without a redirection.
            let key = format!("kmq:{{{queue}}}:ready");
            let written: redis::RedisResult<()> =
                redis::cmd("SET").arg(&key).arg("1").query(&mut connection);
            assert!(written.is_ok(), "{key} on {}: {written:?}", master.addr);
        }
    }
}

#[test]
fn killed_master_is_replaced_by_its_replica_which_kept_the_acknowledged_write() {
    let mut cluster = start_cluster(ClusterOptions::default());
    let key = "kmq:{jobs}:survivor";
    let master = cluster.master_for_key(key).unwrap();
    let replica = cluster.replicas_of(&master.id).unwrap().remove(0);
    let mut connection = cluster.server(&master.addr).unwrap().connection().unwrap();
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg("kept")
        .query(&mut connection)
        .unwrap();
    let acknowledged: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(5000)
        .query(&mut connection)
        .unwrap();
    assert_eq!(acknowledged, 1, "the replica acknowledged the write");

    let started = Instant::now();
    cluster.kill_master(&master.addr, Signal::Kill).unwrap();
    let promoted = cluster
        .wait_failover()
        .unwrap_or_else(|error| panic!("{error}"));
    eprintln!("failover in {:?}", started.elapsed());
    assert_eq!(promoted.addr, replica.addr);
    assert_eq!(cluster.master_for_key(key).unwrap().addr, replica.addr);
    let value: String = cluster
        .server(&promoted.addr)
        .unwrap()
        .query_as(&["GET", key])
        .unwrap();
    assert_eq!(value, "kept");

    // The old master comes back as the replica of its replacement.
    let started = Instant::now();
    cluster
        .restart_node(&master.addr)
        .unwrap_or_else(|error| panic!("{error}"));
    eprintln!("rejoined in {:?}", started.elapsed());
    let back = cluster
        .nodes()
        .unwrap()
        .into_iter()
        .find(|n| n.addr == master.addr)
        .unwrap();
    assert_eq!(back.role, Role::Replica, "{back:?}");
    assert_eq!(back.master_id.as_deref(), Some(promoted.id.as_str()));
}

/// RPUSHes `value` to `key` as a cluster client does, following MOVED and ASK; returns how many redirections
/// it followed. `at` is the node it believes serves the key, updated on MOVED.
fn push_following_redirections(
    connections: &mut HashMap<String, redis::Connection>,
    at: &mut String,
    key: &str,
    value: usize,
) -> usize {
    let mut redirections = 0;
    let mut asking: Option<String> = None;
    loop {
        assert!(redirections < 10, "{key}: redirected 10 times");
        let addr = asking.clone().unwrap_or_else(|| at.clone());
        if !connections.contains_key(&addr) {
            let connection = redis::Client::open(format!("redis://{addr}/"))
                .and_then(|client| client.get_connection())
                .unwrap_or_else(|error| panic!("connect to {addr}: {error}"));
            connections.insert(addr.clone(), connection);
        }
        let connection = connections.get_mut(&addr).unwrap();
        let result: redis::RedisResult<()> = if asking.is_some() {
            redis::pipe()
                .cmd("ASKING")
                .ignore()
                .cmd("RPUSH")
                .arg(key)
                .arg(value)
                .ignore()
                .query(connection)
        } else {
            redis::cmd("RPUSH").arg(key).arg(value).query(connection)
        };
        match result {
            Ok(()) => return redirections,
            Err(error) => {
                let (target, _slot) = error
                    .redirect_node()
                    .unwrap_or_else(|| panic!("RPUSH {key} {value} on {addr}: {error}"));
                redirections += 1;
                if error.code() == Some("ASK") {
                    asking = Some(target.to_string());
                } else {
                    asking = None;
                    *at = target.to_string();
                }
            }
        }
    }
}

#[test]
fn slot_migrates_while_a_writer_keeps_pushing_and_loses_nothing() {
    let cluster = start_cluster(ClusterOptions::default());
    let key = "kmq:{busy}:ready:0";
    let slot = key_slot(key.as_bytes());
    let source = cluster.master_for_slot(slot).unwrap();
    let target = cluster
        .masters()
        .unwrap()
        .into_iter()
        .find(|master| master.id != source.id)
        .unwrap();
    // More keys in the slot than one MIGRATE batch moves.
    let source_server = cluster.server(&source.addr).unwrap();
    for i in 0..250 {
        let other = format!("kmq:{{busy}}:task:{i}");
        source_server.query(&["SET", &other, "x"]).unwrap();
    }

    let pushed = AtomicUsize::new(0);
    let redirections = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let (moved, migration_took) = std::thread::scope(|scope| {
        let writer = std::thread::Builder::new()
            .name("test-writer".into())
            .spawn_scoped(scope, || {
                let mut connections = HashMap::new();
                let mut at = source.addr.clone();
                let mut value = 0;
                while !stop.load(Ordering::SeqCst) {
                    let followed =
                        push_following_redirections(&mut connections, &mut at, key, value);
                    redirections.fetch_add(followed, Ordering::SeqCst);
                    value += 1;
                    pushed.store(value, Ordering::SeqCst);
                }
            })
            .unwrap();
        eventually(
            Duration::from_secs(10),
            "the writer to push 100 elements",
            || (pushed.load(Ordering::SeqCst) >= 100, ()),
        );
        let started = Instant::now();
        let moved = std::thread::Builder::new()
            .name("test-migration".into())
            .spawn_scoped(scope, || cluster.migrate_slot(slot, &target.addr))
            .unwrap()
            .join()
            .expect("the migration does not panic")
            .unwrap_or_else(|error| panic!("{error}"));
        let took = started.elapsed();
        // Some more on the new owner, then stop.
        let after = pushed.load(Ordering::SeqCst);
        eventually(
            Duration::from_secs(10),
            "the writer to push 100 more",
            || (pushed.load(Ordering::SeqCst) >= after + 100, ()),
        );
        stop.store(true, Ordering::SeqCst);
        writer.join().expect("the writer does not panic");
        (moved, took)
    });
    eprintln!("migration of {moved} keys in {migration_took:?}");
    assert_eq!(moved, 251, "the list and the 250 other keys");
    assert_eq!(cluster.master_for_slot(slot).unwrap().id, target.id);
    assert!(
        redirections.load(Ordering::SeqCst) >= 1,
        "the writer was redirected at least once"
    );

    let owner = cluster.server(&target.addr).unwrap();
    let elements: Vec<String> = owner.query_as(&["LRANGE", key, "0", "-1"]).unwrap();
    let expected: Vec<String> = (0..pushed.load(Ordering::SeqCst))
        .map(|i| i.to_string())
        .collect();
    assert_eq!(
        elements.len(),
        expected.len(),
        "every pushed element is on the new owner"
    );
    assert_eq!(elements, expected);
    let left: i64 = source_server
        .query_as(&["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()])
        .unwrap();
    assert_eq!(left, 0, "nothing stayed behind on the old owner");
}

#[test]
fn sentinel_failover_gives_a_new_master_address() {
    let started = Instant::now();
    let mut setup =
        SentinelSetup::start(SentinelOptions::default()).unwrap_or_else(|error| panic!("{error}"));
    eprintln!("sentinels up in {:?}", started.elapsed());
    assert_eq!(setup.sentinel_urls().len(), 3);
    let old = setup.master_addr().unwrap();
    let master = setup.master().unwrap();
    master
        .query(&["SET", "kmq:{jobs}:survivor", "kept"])
        .unwrap();
    let acknowledged: i64 = master.query_as(&["WAIT", "1", "5000"]).unwrap();
    assert_eq!(acknowledged, 1, "the replica acknowledged the write");

    let started = Instant::now();
    assert_eq!(setup.kill_master(Signal::Kill).unwrap(), old);
    let new = setup
        .wait_failover()
        .unwrap_or_else(|error| panic!("{error}"));
    eprintln!("sentinel failover in {:?}", started.elapsed());
    assert_ne!(new, old);
    for sentinel in setup.sentinels() {
        let (host, port): (String, String) = sentinel
            .query_as(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", setup.master_name()])
            .unwrap();
        assert_eq!(format!("{host}:{port}"), new);
    }
    let promoted = setup.server(&new).unwrap();
    let value: String = promoted.query_as(&["GET", "kmq:{jobs}:survivor"]).unwrap();
    assert_eq!(value, "kept");
}
