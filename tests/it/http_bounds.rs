//! The bounds of the HTTP server in front of `/metrics` and the dashboard (src/http.rs, review H3), each met by a
//! real daemon or dashboard process: a client sending an endless header, a crowd of idle connections, and a
//! daemon out of file descriptors must cost it bounded memory, threads and time, and it serves on.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::dashboard::{Dashboard, status};
use crate::support::*;

/// Generous: the endpoint answers within about a second, but the machine may be busy.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(30);

/// What an endless header line may send before the server must have cut it off: far beyond its 16 KiB cap and
/// whatever the two sockets' buffers hold, far below what would hurt the machine running the test.
const ENDLESS: usize = 64 << 20;

/// A field of `/proc/PID/status` (`VmRSS`, `Threads`), as its number (kB for sizes).
fn proc_status(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{field}:")))
        .and_then(|value| value.split_whitespace().next())
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status:\n{status}"))
}

/// The file descriptors `pid` has open.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// A daemon with `metrics_addr` on a free port, once its page shows Redis up; and that address.
fn daemon_with_metrics(redis: &RedisServer, dir: &TestDir) -> (Process, SocketAddr, PathBuf) {
    let config = dir.config_with(
        redis,
        "shutdown_grace = \"5s\"\nmetrics_addr = \"127.0.0.1:0\"",
        &safe_queue(""),
    );
    let daemon = Process::start(&config, dir.path("kmqd.log"));
    let addr = daemon.metrics_addr();
    eventually(SCRAPE_TIMEOUT, "the first scrape", || {
        let scrape = scrape_with(addr, None, SCRAPE_TIMEOUT);
        (scrape.body.contains("kmqd_redis_up 1"), scrape)
    });
    (daemon, addr, config)
}

/// Sends a request whose one header line never ends, until the server cuts it off or [`ENDLESS`] bytes went;
/// returns how many went, and what came back (empty when the connection was reset before it could be read).
fn send_endless_header(addr: SocketAddr) -> (usize, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_write_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream.write_all(b"GET /metrics HTTP/1.1\r\nX: ").unwrap();
    let chunk = vec![b'a'; 64 * 1024];
    let mut sent = 0;
    while sent < ENDLESS {
        match stream.write(&chunk) {
            Ok(written) => sent += written,
            Err(_) => break,
        }
    }
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    (sent, String::from_utf8_lossy(&answer).into_owned())
}

/// Sends process `pid`, listening on `addr`, a request whose one header line never ends: the server cuts it off
/// (431, or the connection reset before the answer could be read) long before [`ENDLESS`], and its memory grows
/// by far less than what was sent.
fn endless_header_is_cut_off(addr: SocketAddr, pid: u32) {
    let rss_before = proc_status(pid, "VmRSS");
    let (sent, answer) = send_endless_header(addr);
    assert!(
        sent < ENDLESS,
        "the server took all {sent} bytes of one header line"
    );
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 431 "),
        "{answer}"
    );
    let grown_kb = proc_status(pid, "VmRSS").saturating_sub(rss_before);
    assert!(
        grown_kb < 32 * 1024,
        "the server grew by {grown_kb} kB for one endless header"
    );
}

/// The daemon on `addr` answers a scrape (within a minute: the connections it held may have to time out first)
/// and settles the tasks pushed after.
fn serves_and_settles_on(addr: SocketAddr, config: &Path) {
    let scrape = eventually(Duration::from_secs(60), "a scrape answered", || {
        let scrape = scrape_with(addr, None, Duration::from_secs(5));
        (scrape.status.ends_with("200 OK"), scrape)
    });
    assert!(scrape.body.contains("kmqd_redis_up 1"), "{scrape:?}");
    push_many(config, "after", 3, "{}");
    wait_done(config, 3, Duration::from_secs(30));
}

/// Before the fix, tiny_http pushed the bytes of a header line into a buffer until a line break: one client
/// could grow the worker daemon until the OOM killer took it. Now the head is cut off at 16 KiB (431), and the
/// daemon scrapes and settles on.
#[test]
fn an_endless_header_line_is_cut_off_and_the_daemon_scrapes_and_settles_on() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let (daemon, addr, config) = daemon_with_metrics(&redis, &dir);
    endless_header_is_cut_off(addr, daemon.child.id());
    serves_and_settles_on(addr, &config);
}

/// Before the fix, tiny_http started a thread for every connection it had no idle thread for: 200 idle
/// clients made 200 threads in the daemon (and at the cgroup's TasksMax, no thread, so no handler process,
/// could start). Now they cost no thread: the pool was started with the server, 64 connections are held (until
/// their head's timeout) and the others are refused at once; a scraper gets through once the idle ones are gone.
#[test]
fn idle_connections_add_no_threads_and_a_scrape_gets_through_once_they_time_out() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let (daemon, addr, config) = daemon_with_metrics(&redis, &dir);
    let pid = daemon.child.id();
    let threads_before = proc_status(pid, "Threads");
    let fds_before = open_fds(pid);

    let idle: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    // Accepted: the daemon holds a descriptor for each connection it reads (64 at most, now).
    eventually(SCRAPE_TIMEOUT, "the idle connections accepted", || {
        let fds = open_fds(pid);
        (fds >= fds_before + 64, fds)
    });
    let threads = proc_status(pid, "Threads");
    assert!(
        threads <= threads_before + 2,
        "{threads_before} threads before 200 idle connections, {threads} with them"
    );

    serves_and_settles_on(addr, &config);
    drop(idle);
}

/// Before the fix, tiny_http's accept loop ended for good at its first failed accept: once the daemon ran out of
/// file descriptors (EMFILE), `/metrics` never answered again. Now the loop waits and accepts again once
/// descriptors are free.
#[test]
fn the_accept_loop_survives_running_out_of_file_descriptors() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let (daemon, addr, config) = daemon_with_metrics(&redis, &dir);
    let pid = daemon.child.id();
    // Room for a few connections only (prlimit(1): the running daemon's soft limit).
    let limit = open_fds(pid) + 4;
    let set = Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &format!("--nofile={limit}:")])
        .status()
        .unwrap();
    assert!(set.success(), "prlimit --nofile={limit}:");

    // A connect may be refused: before the fix, the accept loop ended at its first failure, closing the listener.
    let crowd: Vec<TcpStream> = (0..20)
        .filter_map(|_| TcpStream::connect(addr).ok())
        .collect();
    eventually(
        SCRAPE_TIMEOUT,
        "the endpoint to say an accept failed",
        || {
            let log = daemon.log_text();
            (log.contains("cannot accept connections"), log)
        },
    );
    drop(crowd);

    serves_and_settles_on(addr, &config);
}

/// The dashboard, before any authentication, had the same unbounded header line: it too cuts it off and serves
/// on.
#[test]
fn the_dashboard_cuts_off_an_endless_header_line_and_serves_on() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let config = dir.config(&redis, &safe_queue(""));
    let dashboard = Dashboard::start(&config, &dir, &[]);
    endless_header_is_cut_off(dashboard.addr, dashboard.pid());
    let session = dashboard.get("/api/session");
    assert_eq!(status(&session), 200, "{session:?}");
}
