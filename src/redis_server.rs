//! A private `redis-server` for benchmarks and tests: its own port or unix socket, its own temp dir, killed when
//! dropped. Never the user's Redis.
//!
//! By default it keeps nothing on disk (`--save "" --appendonly no`): a restart starts empty. The tests of what
//! survives a Redis crash start it with the append-only file on ([`Options::appendonly`]), and drive its life
//! with [`RedisServer::stop`] (SIGTERM: a clean shutdown; SIGKILL: a crash), [`RedisServer::restart`] (a new
//! process on the same directory, socket or port and settings, as systemd would start it again) and
//! [`RedisServer::pause`] / [`RedisServer::resume`] (SIGSTOP / SIGCONT: a Redis that stalls, for example in a
//! long fork or a swapped-out page, while its sockets stay open). Signals go through `kill(1)`, as in the
//! integration tests, so this module needs no unsafe code.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a start, a restart, a clean stop, a pause or a resume may take before it counts as failed.
const PATIENCE: Duration = Duration::from_secs(10);

/// Where the server listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A unix socket in the server's temp dir (port 0: no TCP at all).
    UnixSocket,
    /// A free TCP port on 127.0.0.1 (as the peers' benchmark does).
    Loopback,
}

/// When the append-only file is flushed to disk (`appendfsync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fsync {
    /// Before every reply: a write the client saw acknowledged survives even a crash of the machine.
    Always,
    /// Once a second: what production setups usually run. A write the client saw acknowledged is in the OS's
    /// page cache, so it survives a SIGKILL of redis-server, except when a slow background fsync made Redis
    /// postpone the write (up to 2 s): tests that SIGKILL and must keep every write use [`Fsync::Always`].
    EverySec,
}

/// How to start a server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    pub listen: Listen,
    /// `None`: no persistence at all (the default; a restart starts empty). `Some(fsync)`: `appendonly yes`
    /// with that `appendfsync`, so a restart replays what was written.
    pub appendonly: Option<Fsync>,
    /// `enable-debug-command local`: lets clients on the unix socket or loopback run `DEBUG` (for example
    /// `DEBUG PROTOCOL` to produce every RESP3 type, or `DEBUG SLEEP` to block the server). Off by default, as
    /// in Redis 7.
    pub debug_command: bool,
}

impl Options {
    /// No persistence, no DEBUG, listening as `listen`.
    pub fn new(listen: Listen) -> Options {
        Options {
            listen,
            appendonly: None,
            debug_command: false,
        }
    }
}

impl Default for Options {
    /// What the tests use: a unix socket, no persistence.
    fn default() -> Options {
        Options::new(Listen::UnixSocket)
    }
}

/// How [`RedisServer::stop`] ends the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// SIGTERM: Redis shuts down cleanly (flushes and fsyncs the append-only file, closes its clients).
    Term,
    /// SIGKILL: a crash; only what already reached the append-only file (see [`Fsync`]) survives.
    Kill,
}

/// A running redis-server of our own.
pub struct RedisServer {
    /// `None` once stopped (until [`RedisServer::restart`]).
    child: Option<Child>,
    /// The pid of the running process, or of the last one once stopped.
    last_pid: u32,
    /// Set by [`RedisServer::pause`]: a SIGTERM must be followed by SIGCONT for the process to see it.
    paused: AtomicBool,
    binary: PathBuf,
    /// Every argument of the process, kept so that a restart runs exactly the same server.
    args: Vec<OsString>,
    log: PathBuf,
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
    /// Starts a server without persistence and waits (at most 10 s) until it answers PING.
    pub fn start(listen: Listen) -> Result<RedisServer, String> {
        RedisServer::start_with(Options::new(listen))
    }

    /// Starts a server as `options` say and waits (at most 10 s) until it answers PING.
    pub fn start_with(options: Options) -> Result<RedisServer, String> {
        let binary =
            binary().ok_or("redis-server not found: install it (apt-get install redis-server)")?;
        let dir = tempfile::Builder::new()
            .prefix("kmqd-redis-")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        let log = dir.path().join("redis.log");
        let mut args: Vec<OsString> = vec!["--save".into(), "".into()];
        match options.appendonly {
            None => args.extend(["--appendonly".into(), "no".into()]),
            Some(fsync) => args.extend([
                "--appendonly".into(),
                "yes".into(),
                "--appendfsync".into(),
                match fsync {
                    Fsync::Always => "always",
                    Fsync::EverySec => "everysec",
                }
                .into(),
            ]),
        }
        if options.debug_command {
            args.extend(["--enable-debug-command".into(), "local".into()]);
        }
        args.extend([
            "--dir".into(),
            dir.path().into(),
            "--logfile".into(),
            log.clone().into(),
        ]);
        let url = match options.listen {
            Listen::UnixSocket => {
                let socket = dir.path().join("redis.sock");
                args.extend([
                    "--port".into(),
                    "0".into(),
                    "--unixsocketperm".into(),
                    "700".into(),
                    "--unixsocket".into(),
                    socket.clone().into(),
                ]);
                format!("unix://{}", socket.display())
            }
            Listen::Loopback => {
                // The port stays the same across restarts (Redis binds with SO_REUSEADDR).
                let port = std::net::TcpListener::bind("127.0.0.1:0")
                    .and_then(|listener| listener.local_addr())
                    .map_err(|e| format!("no free port: {e}"))?
                    .port();
                args.extend([
                    "--bind".into(),
                    "127.0.0.1".into(),
                    "--port".into(),
                    port.to_string().into(),
                ]);
                format!("redis://127.0.0.1:{port}/0")
            }
        };
        let mut server = RedisServer {
            child: None,
            last_pid: 0,
            paused: AtomicBool::new(false),
            binary,
            args,
            log,
            dir,
            url,
        };
        server.spawn()?;
        Ok(server)
    }

    /// Starts the process (again) and waits for PING.
    fn spawn(&mut self) -> Result<(), String> {
        let child = Command::new(&self.binary)
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("start redis-server: {e}"))?;
        self.last_pid = child.id();
        self.child = Some(child);
        self.paused.store(false, Ordering::SeqCst);
        let deadline = Instant::now() + PATIENCE;
        loop {
            let pong = redis::Client::open(self.url.as_str())
                .and_then(|client| client.get_connection_with_timeout(Duration::from_secs(1)))
                .and_then(|mut connection| redis::cmd("PING").query::<String>(&mut connection));
            if pong.is_ok() {
                return Ok(());
            }
            // A server that exited at once (a bad argument, a port taken) will never answer: say so now.
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Err(format!(
                    "redis-server exited with {status} before answering PING; its log:\n{}",
                    self.log_text()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "redis-server did not answer PING within {PATIENCE:?}; its log:\n{}",
                    self.log_text()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The URL to put in a config's `[redis] url`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server's process id (to read its CPU time from /proc); once stopped, the last process's.
    pub fn pid(&self) -> u32 {
        self.last_pid
    }

    /// Whether a process is running (it may be paused); false between [`RedisServer::stop`] and
    /// [`RedisServer::restart`].
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// The server's private directory (its unix socket is `redis.sock` there, its append-only files are in
    /// `appendonlydir`, its log is `redis.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// What the server logged so far (all its processes: the log is appended to across restarts).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A new connection.
    pub fn connection(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(self.url.as_str())?.get_connection()
    }

    /// Ends the process with `signal` and waits (at most 10 s) until it has exited. Stopping a stopped server
    /// does nothing. A paused server is resumed after SIGTERM, or it could never act on it.
    pub fn stop(&mut self, signal: Signal) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        match signal {
            Signal::Kill => {
                // SIGKILL ends a stopped (paused) process too.
                let _ = child.kill();
                child
                    .wait()
                    .map_err(|e| format!("wait for redis-server: {e}"))?;
            }
            Signal::Term => {
                send_signal(child.id(), "TERM")?;
                if self.paused.swap(false, Ordering::SeqCst) {
                    send_signal(child.id(), "CONT")?;
                }
                let deadline = Instant::now() + PATIENCE;
                loop {
                    match child.try_wait() {
                        Ok(Some(_)) => break,
                        Ok(None) if Instant::now() < deadline => {
                            std::thread::sleep(Duration::from_millis(5))
                        }
                        _ => {
                            let _ = child.kill();
                            let _ = child.wait();
                            return Err(format!(
                                "redis-server did not exit within {PATIENCE:?} of SIGTERM (killed it); its log:\n{}",
                                self.log_text()
                            ));
                        }
                    }
                }
            }
        }
        self.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Starts a new process on the same directory, socket or port and persistence settings, and waits for PING:
    /// with the append-only file on, it replays what the last process wrote; without, it starts empty. A running
    /// server is first stopped cleanly (SIGTERM); call [`RedisServer::stop`] with [`Signal::Kill`] first to
    /// restart after a crash.
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop(Signal::Term)?;
        self.spawn()
    }

    /// SIGSTOP: the process stops running but keeps its sockets open, so clients connect and send, and then wait
    /// for replies that do not come (until [`RedisServer::resume`]). Returns once the kernel shows it stopped.
    pub fn pause(&self) -> Result<(), String> {
        let pid = self.running_pid()?;
        send_signal(pid, "STOP")?;
        self.paused.store(true, Ordering::SeqCst);
        wait_for_state(pid, true)
    }

    /// SIGCONT: a paused server runs again and answers what it was sent meanwhile, in order.
    pub fn resume(&self) -> Result<(), String> {
        let pid = self.running_pid()?;
        send_signal(pid, "CONT")?;
        self.paused.store(false, Ordering::SeqCst);
        wait_for_state(pid, false)
    }

    fn running_pid(&self) -> Result<u32, String> {
        self.child
            .as_ref()
            .map(Child::id)
            .ok_or_else(|| "redis-server is stopped".to_string())
    }
}

/// `kill -SIGNAL pid` through kill(1): no unsafe code for libc::kill.
fn send_signal(pid: u32, signal: &str) -> Result<(), String> {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .map_err(|e| format!("run kill(1): {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill -{signal} {pid} failed: {status}"))
    }
}

/// Waits until /proc says the process is stopped (state `T`) or, with `stopped` false, no longer is: a signal is
/// delivered asynchronously, and a test that pauses Redis must not race the pause.
fn wait_for_state(pid: u32, stopped: bool) -> Result<(), String> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The state is the first field after the command name, which is in parentheses and may hold spaces.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("");
        if (state == "T") == stopped {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "redis-server {pid} did not become {} within {PATIENCE:?} (state {state:?})",
                if stopped { "stopped" } else { "running" }
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGKILL also ends a paused process.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
