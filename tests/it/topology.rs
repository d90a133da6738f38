//! The harness for deployments beyond one server (`kmqd_harness::{cluster, sentinel, tls}`), tested
//! against the real thing: what the tests of kmqd's cluster, sentinel and TLS support will stand on.

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::eventually;

use kmqd_harness::cluster::{Cluster, ClusterOptions, Role, key_slot};
use kmqd_harness::sentinel::{SentinelOptions, SentinelSetup};
use kmqd_harness::{
    AuthClients, Listen, Options as RedisOptions, RedisServer, ServerCert, ServerTls, Signal,
    TlsFiles,
};

/// Runs redis-cli with `args`. Panics when it cannot run.
fn redis_cli(args: &[&str]) -> std::process::Output {
    Command::new(kmqd_harness::cli_binary().expect("redis-cli is installed"))
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
    // It learns it was replaced from the cluster bus: a moment after it answers (a master without slots first).
    let back = eventually(
        Duration::from_secs(20),
        "the old master to rejoin as a replica",
        || {
            let back = cluster
                .nodes()
                .unwrap()
                .into_iter()
                .find(|n| n.addr == master.addr)
                .unwrap();
            (back.role == Role::Replica, back)
        },
    );
    assert_eq!(back.master_id.as_deref(), Some(promoted.id.as_str()));
}

/// Sets its flag when dropped.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
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
                .and_then(|client| client.get_connection_with_timeout(Duration::from_secs(5)))
                .unwrap_or_else(|error| panic!("connect to {addr}: {error}"));
            connection
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
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
        // Stops the writer however this closure ends: the scope joins it before a panic goes on.
        let _stop_writer = SetOnDrop(&stop);
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
            .spawn_scoped(scope, || cluster.reshard_slot(slot, &target.addr))
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

/// Certificates in a temp dir that lives as long as the returned guard.
fn tls_files() -> (tempfile::TempDir, TlsFiles) {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let files = TlsFiles::generate(dir.path()).unwrap_or_else(|error| panic!("{error}"));
    eprintln!("certificates in {:?}", started.elapsed());
    (dir, files)
}

fn openssl(args: &[&str]) -> std::process::Output {
    Command::new("openssl")
        .args(args)
        .output()
        .expect("run openssl")
}

fn path(p: &std::path::Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn tls_files_are_what_their_names_say() {
    let (_dir, files) = tls_files();
    let ca = path(&files.ca_cert);
    let verify = |ca: &str, cert: &std::path::Path, extra: &[&str]| {
        let mut args = vec!["verify", "-CAfile", ca];
        args.extend_from_slice(extra);
        args.push(path(cert));
        let output = openssl(&args);
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).to_string()
                + &String::from_utf8_lossy(&output.stderr),
        )
    };
    let localhost = ["-purpose", "sslserver", "-verify_hostname", "localhost"];
    let ip = ["-purpose", "sslserver", "-verify_ip", "127.0.0.1"];
    assert!(verify(ca, &files.server_cert, &localhost).0);
    assert!(verify(ca, &files.server_cert, &ip).0);
    assert!(
        verify(ca, &files.server_cert, &["-purpose", "sslclient"]).0,
        "peers present it too"
    );
    assert!(verify(ca, &files.client_cert, &["-purpose", "sslclient"]).0);
    let (ok, why) = verify(ca, &files.other_server_cert, &localhost);
    assert!(!ok && why.contains("unable to get local issuer"), "{why}");
    assert!(
        verify(
            path(&files.other_ca_cert),
            &files.other_server_cert,
            &localhost
        )
        .0
    );
    let (ok, why) = verify(ca, &files.wrong_host_cert, &localhost);
    assert!(!ok && why.contains("hostname mismatch"), "{why}");
    assert!(
        verify(
            ca,
            &files.wrong_host_cert,
            &["-verify_hostname", "wrong.example"]
        )
        .0
    );
    let (ok, why) = verify(ca, &files.expired_cert, &localhost);
    assert!(!ok && why.contains("expired"), "{why}");
    for key in [&files.server_key, &files.client_key, &files.ca_key] {
        let text = std::fs::read_to_string(key).unwrap();
        assert!(
            text.starts_with("-----BEGIN PRIVATE KEY-----"),
            "PKCS#8: {text}"
        );
    }
}

fn start_tls(tls: ServerTls) -> RedisServer {
    let started = Instant::now();
    let server = RedisServer::start_with(RedisOptions {
        listen: Listen::Loopback,
        tls: Some(tls),
        ..RedisOptions::default()
    })
    .unwrap_or_else(|error| panic!("{error}"));
    eprintln!("TLS server up in {:?}", started.elapsed());
    server
}

/// `redis-cli --tls -h localhost -p PORT` with `args` before `PING`: "PONG", or what it said instead.
fn tls_ping(server: &RedisServer, args: &[&str]) -> String {
    let port = server.port().unwrap().to_string();
    let mut all = vec!["--tls", "-h", "localhost", "-p", &port];
    all.extend_from_slice(args);
    all.push("PING");
    let output = redis_cli(&all);
    stdout(&output) + &String::from_utf8_lossy(&output.stderr)
}

#[test]
fn tls_server_answers_a_client_trusting_its_ca_and_no_other() {
    let (_dir, files) = tls_files();
    let server = start_tls(files.server(AuthClients::No));
    let port = server.port().unwrap();
    assert_eq!(server.url(), format!("rediss://localhost:{port}"));
    assert_eq!(
        tls_ping(&server, &["--cacert", path(&files.ca_cert)]),
        "PONG"
    );
    let refused = tls_ping(&server, &["--cacert", path(&files.other_ca_cert)]);
    assert!(refused.contains("certificate verify failed"), "{refused}");
    // Without --cacert: the system's CAs, which do not include ours.
    let refused = tls_ping(&server, &[]);
    assert!(refused.contains("certificate verify failed"), "{refused}");
    // Plain TCP gets nowhere.
    let plain = redis_cli(&["-p", &port.to_string(), "PING"]);
    assert_ne!(stdout(&plain), "PONG");

    // A server presenting the expired certificate starts (the harness does not check it) and is refused.
    let expired = start_tls(files.server_with(ServerCert::Expired, AuthClients::No));
    let refused = tls_ping(&expired, &["--cacert", path(&files.ca_cert)]);
    assert!(refused.contains("certificate verify failed"), "{refused}");
    // The wrong-host one is refused by a client that checks the name (redis-cli does not: openssl s_client).
    let wrong = start_tls(files.server_with(ServerCert::WrongHost, AuthClients::No));
    for (server, accepted) in [(&server, true), (&wrong, false)] {
        let connect = format!("127.0.0.1:{}", server.port().unwrap());
        let output = Command::new("openssl")
            .args([
                "s_client",
                "-connect",
                &connect,
                "-CAfile",
                path(&files.ca_cert),
            ])
            .args([
                "-verify_hostname",
                "localhost",
                "-verify_return_error",
                "-brief",
            ])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert_eq!(output.status.success(), accepted, "{output:?}");
    }
}

#[test]
fn mutual_tls_server_refuses_a_client_without_a_certificate() {
    let (_dir, files) = tls_files();
    let server = start_tls(files.server(AuthClients::Yes));
    let ca = path(&files.ca_cert);
    let refused = tls_ping(&server, &["--cacert", ca]);
    assert_ne!(refused, "PONG");
    let (cert, key) = (path(&files.client_cert), path(&files.client_key));
    assert_eq!(
        tls_ping(&server, &["--cacert", ca, "--cert", cert, "--key", key]),
        "PONG"
    );
    // A certificate of another CA is no better than none.
    let other_cert = path(&files.other_server_cert);
    let other_key = path(&files.other_server_key);
    let refused = tls_ping(
        &server,
        &["--cacert", ca, "--cert", other_cert, "--key", other_key],
    );
    assert_ne!(refused, "PONG");
    eprintln!("refused: {refused}");
}

#[test]
fn tls_cluster_comes_up_fails_over_and_migrates_a_slot() {
    let (_dir, files) = tls_files();
    let mut cluster = start_cluster(ClusterOptions {
        tls: Some(files.server(AuthClients::Yes)),
        ..ClusterOptions::default()
    });
    let seeds = cluster.seeds().unwrap();
    assert!(
        seeds
            .iter()
            .all(|seed| seed.starts_with("rediss://localhost:")),
        "{seeds:?}"
    );
    let key = "kmq:{jobs}:probe";
    let owner = cluster.master_for_key(key).unwrap();
    let server = cluster.server(&owner.addr).unwrap();
    server.query(&["RPUSH", key, "a", "b"]).unwrap();
    let target = cluster
        .masters()
        .unwrap()
        .into_iter()
        .find(|m| m.id != owner.id)
        .unwrap();
    let moved = cluster
        .reshard_slot(key_slot(key.as_bytes()), &target.addr)
        .unwrap_or_else(|error| panic!("{error}"));
    assert_eq!(moved, 1);
    let port = target.addr.rsplit_once(':').unwrap().1;
    let (ca, cert, k) = (
        path(&files.ca_cert),
        path(&files.client_cert),
        path(&files.client_key),
    );
    let tls = [
        "--tls",
        "--cacert",
        ca,
        "--cert",
        cert,
        "--key",
        k,
        "-h",
        "localhost",
        "-p",
        port,
    ];
    let read = redis_cli(&[&tls[..], &["-c", "LRANGE", key, "0", "-1"]].concat());
    assert_eq!(stdout(&read), "a\nb", "{read:?}");

    let started = Instant::now();
    cluster.kill_master(&target.addr, Signal::Kill).unwrap();
    let promoted = cluster
        .wait_failover()
        .unwrap_or_else(|error| panic!("{error}"));
    eprintln!("TLS failover in {:?}", started.elapsed());
    let value: Vec<String> = cluster
        .server(&promoted.addr)
        .unwrap()
        .query_as(&["LRANGE", key, "0", "-1"])
        .unwrap();
    assert_eq!(value, ["a", "b"]);
}

#[test]
fn tls_sentinels_fail_a_tls_master_over() {
    let (_dir, files) = tls_files();
    let started = Instant::now();
    let mut setup = SentinelSetup::start(SentinelOptions {
        tls: Some(files.server(AuthClients::Yes)),
        ..SentinelOptions::default()
    })
    .unwrap_or_else(|error| panic!("{error}"));
    eprintln!("TLS sentinels up in {:?}", started.elapsed());
    let urls = setup.sentinel_urls();
    assert!(
        urls.iter()
            .all(|url| url.starts_with("rediss://localhost:")),
        "{urls:?}"
    );
    let old = setup.kill_master(Signal::Kill).unwrap();
    let new = setup
        .wait_failover()
        .unwrap_or_else(|error| panic!("{error}"));
    assert_ne!(new, old);
    eprintln!("TLS sentinel failover in {:?}", started.elapsed());
}

#[test]
fn query_keeps_one_connection_and_reconnects_after_a_restart() {
    let mut server = RedisServer::start(Listen::UnixSocket).unwrap();
    let clients = |server: &RedisServer| {
        let list: String = server.query_as(&["CLIENT", "LIST"]).unwrap();
        list.lines().count()
    };
    assert_eq!(
        clients(&server),
        1,
        "the readiness PING's connection is closed"
    );
    assert_eq!(clients(&server), 1, "query keeps its one connection");
    let error = server.query(&["NOSUCHCOMMAND"]).unwrap_err();
    assert!(error.contains("unknown command"), "{error}");
    assert_eq!(clients(&server), 1, "an error reply keeps the connection");
    // The server closes the kept connection: the next query notices and takes a new one.
    let _ = server.query(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "no"]);
    assert_eq!(clients(&server), 1);
    server.stop(Signal::Kill).unwrap();
    assert!(server.query(&["PING"]).is_err());
    server.restart().unwrap();
    let pong: String = server.query_as(&["PING"]).unwrap();
    assert_eq!(pong, "PONG");
}
