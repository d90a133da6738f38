//! kmqd over TLS (rustls): a redis-server that speaks TLS only, with the harness's test CA; mutual TLS; and every
//! refused certificate stopping the daemon and the CLI at start with exit 2 and what to fix.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kmqd_harness::{AuthClients, Listen, Options, RedisServer, ServerCert, TlsFiles};

use crate::support::{Process, TestDir, client, kmqd, safe_queue, wait_done};

fn tls_server(files: &TlsFiles, cert: ServerCert, auth: AuthClients) -> RedisServer {
    let mut options = Options::new(Listen::Loopback);
    options.tls = Some(files.server_with(cert, auth));
    RedisServer::start_with(options).expect("start a TLS redis-server")
}

fn certificates(dir: &TestDir) -> TlsFiles {
    let path = dir.path("tls");
    std::fs::create_dir(&path).unwrap();
    TlsFiles::generate(&path).expect("make the test certificates")
}

/// The `[redis]` keys for `server`: its `rediss://` URL, the CA to trust, and `extra`.
fn redis_section(server: &RedisServer, ca: &Path, extra: &str) -> String {
    format!(
        "url = \"{}\"\ntls_ca_file = \"{}\"\n{extra}",
        server.url(),
        ca.display()
    )
}

fn client_cert(files: &TlsFiles) -> String {
    format!(
        "tls_cert_file = \"{}\"\ntls_key_file = \"{}\"",
        files.client_cert.display(),
        files.client_key.display()
    )
}

#[test]
fn a_daemon_drains_a_queue_over_mutual_tls() {
    let dir = TestDir::new();
    let files = certificates(&dir);
    let server = tls_server(&files, ServerCert::Valid, AuthClients::Yes);
    assert!(server.url().starts_with("rediss://localhost:"));
    let config = dir.config_raw(
        &redis_section(&server, &files.ca_cert, &client_cert(&files)),
        "shutdown_grace = \"5s\"",
        &safe_queue("workers = 2"),
    );
    let c = config.to_str().unwrap();
    let (code, _, err) = kmqd(&["-c", c, "push", "jobs", "test", "--id", "cli"], None);
    assert_eq!(code, 0, "{err}");
    crate::support::push_many(&config, "t", 50, "{}");
    let mut daemon = Process::start(&config, dir.path("daemon.log"));
    wait_done(&config, 51, Duration::from_secs(20));
    let (code, out, err) = kmqd(&["-c", c, "stats"], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("jobs"), "{out}");
    daemon.signal(signal_hook::consts::SIGTERM);
    assert_eq!(daemon.wait_within(Duration::from_secs(10)), Some(0));
    assert_eq!(dir.records().runs_of("cli"), 1);
}

/// What `kmqd stats` and the daemon say with `redis` as their `[redis]` keys: both must exit 2, naming `words`.
fn refused(dir: &TestDir, name: &str, redis: &str, words: &[&str]) {
    let config: PathBuf = dir.config_named(
        &format!("{name}.toml"),
        redis,
        "shutdown_grace = \"5s\"",
        &safe_queue(""),
        &dir.record_file(),
    );
    let c = config.to_str().unwrap();
    let (code, _, err) = kmqd(&["-c", c, "stats"], None);
    assert_eq!(code, 2, "{name}: kmqd stats: {err}");
    for word in words {
        assert!(
            err.contains(word),
            "{name}: kmqd stats said {err:?}, not {word:?}"
        );
    }
    let mut daemon = Process::start(&config, dir.path(&format!("{name}.log")));
    assert_eq!(
        daemon.wait_within(Duration::from_secs(20)),
        Some(2),
        "{name}: the daemon exits 2 at start: {}",
        daemon.log_text()
    );
    let log = daemon.log_text();
    for word in words {
        assert!(
            log.contains(word),
            "{name}: the daemon said {log:?}, not {word:?}"
        );
    }
}

#[test]
fn refused_certificates_stop_the_daemon_and_the_cli_at_start_saying_what_to_fix() {
    let dir = TestDir::new();
    let files = certificates(&dir);
    let unknown_ca = tls_server(&files, ServerCert::OtherCa, AuthClients::No);
    refused(
        &dir,
        "unknown-ca",
        &redis_section(&unknown_ca, &files.ca_cert, ""),
        &["UnknownIssuer", "tls_ca_file"],
    );
    let wrong_host = tls_server(&files, ServerCert::WrongHost, AuthClients::No);
    refused(
        &dir,
        "wrong-host",
        &redis_section(&wrong_host, &files.ca_cert, ""),
        &["not valid for name", "subjectAltName"],
    );
    let expired = tls_server(&files, ServerCert::Expired, AuthClients::No);
    refused(
        &dir,
        "expired",
        &redis_section(&expired, &files.ca_cert, ""),
        &["expired", "renew"],
    );
    let mutual = tls_server(&files, ServerCert::Valid, AuthClients::Yes);
    refused(
        &dir,
        "no-client-cert",
        &redis_section(&mutual, &files.ca_cert, ""),
        &["tls_cert_file"],
    );
    // The system's CAs do not include the test CA: without tls_ca_file the server is unknown.
    refused(
        &dir,
        "system-roots",
        &format!("url = \"{}\"", mutual.url()),
        &["UnknownIssuer"],
    );
    // And the same server with everything right answers.
    let config = dir.config_raw(
        &redis_section(&mutual, &files.ca_cert, &client_cert(&files)),
        "",
        &safe_queue(""),
    );
    assert_eq!(client(&config).stats("jobs").unwrap().done, 0);
}

/// A drain through `seeds` (rediss://) with the test CA: pushes from the CLI, a daemon runs them.
fn drains_through(dir: &TestDir, files: &TlsFiles, redis: &str) {
    let config = dir.config_raw(
        &format!("{redis}\ntls_ca_file = \"{}\"", files.ca_cert.display()),
        "shutdown_grace = \"5s\"",
        &safe_queue("workers = 2"),
    );
    let c = config.to_str().unwrap();
    let (code, _, err) = kmqd(&["-c", c, "push", "jobs", "test", "--id", "over-tls"], None);
    assert_eq!(code, 0, "{err}");
    crate::support::push_many(&config, "t", 20, "{}");
    let mut daemon = Process::start(&config, dir.path("daemon.log"));
    wait_done(&config, 21, Duration::from_secs(30));
    daemon.signal(signal_hook::consts::SIGTERM);
    assert_eq!(daemon.wait_within(Duration::from_secs(10)), Some(0));
    assert_eq!(dir.records().runs_of("over-tls"), 1);
}

fn seed_list(urls: &[String]) -> String {
    let quoted: Vec<String> = urls.iter().map(|url| format!("\"{url}\"")).collect();
    format!("[{}]", quoted.join(", "))
}

#[test]
fn rediss_cluster_seeds_mean_tls_to_every_node() {
    use kmqd_harness::cluster::{Cluster, ClusterOptions};
    let dir = TestDir::new();
    let files = certificates(&dir);
    let cluster = Cluster::start(ClusterOptions {
        replicas_per_master: 0,
        tls: Some(files.server(AuthClients::No)),
        ..ClusterOptions::default()
    })
    .expect("start a TLS cluster");
    let seeds = cluster.seeds().unwrap();
    assert!(seeds.iter().all(|seed| seed.starts_with("rediss://")));
    drains_through(&dir, &files, &format!("cluster = {}", seed_list(&seeds)));
}

#[test]
fn rediss_sentinel_seeds_mean_tls_to_the_sentinels_and_the_master() {
    use kmqd_harness::sentinel::{SentinelOptions, SentinelSetup};
    let dir = TestDir::new();
    let files = certificates(&dir);
    let setup = SentinelSetup::start(SentinelOptions {
        tls: Some(files.server(AuthClients::No)),
        ..SentinelOptions::default()
    })
    .expect("start TLS sentinels");
    let seeds = setup.sentinel_urls();
    assert!(seeds.iter().all(|seed| seed.starts_with("rediss://")));
    drains_through(
        &dir,
        &files,
        &format!(
            "sentinel = {}\nsentinel_master = \"{}\"",
            seed_list(&seeds),
            setup.master_name()
        ),
    );
}
