//! The harness for deployments beyond one server (`kmqd::redis_server::{cluster, sentinel, tls}`), tested
//! against the real thing: what the tests of kmqd's cluster, sentinel and TLS support will stand on.

use std::process::Command;
use std::time::Instant;

use kmqd::redis_server::cluster::{Cluster, ClusterOptions, Role, key_slot};

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
