//! A private `redis-server` for benchmarks and tests: its own port or unix socket, its own temp dir, no
//! persistence, killed when dropped. Never the user's Redis.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the server listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A unix socket in the server's temp dir (port 0: no TCP at all).
    UnixSocket,
    /// A free TCP port on 127.0.0.1 (as the peers' benchmark does).
    Loopback,
}

/// A running redis-server of our own.
pub struct RedisServer {
    child: Child,
    dir: tempfile::TempDir,
    url: String,
}

/// Finds `redis-server` on the PATH (or in /usr/bin, /usr/sbin).
pub fn binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("redis-server"))
        .find(|candidate| candidate.is_file())
}

impl RedisServer {
    /// Starts a server and waits (at most 10 s) until it answers PING.
    pub fn start(listen: Listen) -> Result<RedisServer, String> {
        let binary =
            binary().ok_or("redis-server not found: install it (apt-get install redis-server)")?;
        let dir = tempfile::Builder::new()
            .prefix("kmqd-redis-")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        let log = dir.path().join("redis.log");
        let mut command = Command::new(binary);
        command
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .arg("--logfile")
            .arg(&log);
        let url = match listen {
            Listen::UnixSocket => {
                let socket = dir.path().join("redis.sock");
                command
                    .args(["--port", "0", "--unixsocketperm", "700"])
                    .arg("--unixsocket")
                    .arg(&socket);
                format!("unix://{}", socket.display())
            }
            Listen::Loopback => {
                let port = std::net::TcpListener::bind("127.0.0.1:0")
                    .and_then(|listener| listener.local_addr())
                    .map_err(|e| format!("no free port: {e}"))?
                    .port();
                command.args(["--bind", "127.0.0.1", "--port", &port.to_string()]);
                format!("redis://127.0.0.1:{port}/0")
            }
        };
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("start redis-server: {e}"))?;
        let server = RedisServer { child, dir, url };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pong = redis::Client::open(server.url.as_str())
                .and_then(|client| client.get_connection_with_timeout(Duration::from_secs(1)))
                .and_then(|mut connection| redis::cmd("PING").query::<String>(&mut connection));
            if pong.is_ok() {
                return Ok(server);
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!(
                    "redis-server did not answer PING within 10 s; its log:\n{log}"
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The URL to put in a config's `[redis] url`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server's process id (to read its CPU time from /proc).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The server's private directory (its unix socket is `redis.sock` there).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A new connection.
    pub fn connection(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(self.url.as_str())?.get_connection()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
