//! A private `redis-server` for benchmarks and tests (kmqd's integration tests, whose dev-dependency this crate
//! is, and `kmqd-bench`; never part of the daemon): its own port or unix socket, its own temp dir, killed when
//! dropped. Never the user's Redis.
//!
//! By default it keeps nothing on disk (`--save "" --appendonly no`): a restart starts empty. The tests of what
//! survives a Redis crash start it with the append-only file on ([`Options::appendonly`]), and drive its life
//! with [`RedisServer::stop`] (SIGTERM: a clean shutdown; SIGKILL: a crash), [`RedisServer::restart`] (a new
//! process on the same directory, socket or port and settings, as systemd would start it again) and
//! [`RedisServer::pause`] / [`RedisServer::resume`] (SIGSTOP / SIGCONT: a Redis that stalls, for example in a
//! long fork or a swapped-out page, while its sockets stay open). Signals go through `kill(1)`, as in the
//! integration tests, so this crate needs no unsafe code.
//!
//! Beyond one plain server, for the work on TLS, Redis Cluster and Sentinel:
//! - [`tls`] makes the certificates, and [`Options::tls`] starts a server that speaks only TLS (its
//!   [`RedisServer::url`] is then `rediss://localhost:PORT`, the name its certificate is for);
//! - [`cluster`] starts a Redis Cluster of such servers, kills and restarts its nodes and migrates a slot;
//! - [`sentinel`] starts a master, its replica and three sentinels, and fails the master over;
//! - [`Options::clock_shift`] starts a server whose wall clock a test steps ([`RedisServer::set_clock_offset`]).
//!
//! The harness's own commands go through [`RedisServer::query`]: redis-rs for a plain server, `redis-cli` for a
//! TLS one, so that the harness never depends on the TLS client it is there to test (redis-cli's is OpenSSL's).
//! Every wait is a poll with a deadline whose error carries the tail of the logs of the servers concerned, and a
//! server dropped by a failing test prints the tail of its log ([`RedisServer::panic_report`]).
#![deny(unsafe_code)]

pub mod cluster;
pub mod sentinel;
pub mod tls;

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub use tls::{AuthClients, ServerCert, ServerTls, TlsFiles};

/// How long a start, a restart, a clean stop, a pause or a resume may take before it counts as failed.
const PATIENCE: Duration = Duration::from_secs(10);

/// How long one command of the harness's own ([`RedisServer::query`]) may take: long enough for a `MIGRATE`
/// of a batch of keys, short enough that a paused server fails a poll rather than hanging it.
const QUERY_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the server listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A unix socket in the server's temp dir (port 0: no TCP at all).
    UnixSocket,
    /// A free TCP port on 127.0.0.1 (as the peers' benchmark does).
    Loopback,
    /// This TCP port on 127.0.0.1: for a caller that needs more than "a free port", such as a cluster node,
    /// whose bus port (the port + 10000) must be free too.
    Port(u16),
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
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    pub listen: Listen,
    /// `None`: no persistence at all (the default; a restart starts empty). `Some(fsync)`: `appendonly yes`
    /// with that `appendfsync`, so a restart replays what was written.
    pub appendonly: Option<Fsync>,
    /// `enable-debug-command local`: lets clients on the unix socket or loopback run `DEBUG` (for example
    /// `DEBUG PROTOCOL` to produce every RESP3 type, or `DEBUG SLEEP` to block the server). Off by default, as
    /// in Redis 7.
    pub debug_command: bool,
    /// `Some`: the server speaks TLS only (`--port 0 --tls-port PORT`), which needs a TCP [`Listen`]; its
    /// [`RedisServer::url`] is `rediss://localhost:PORT`. Replication and the cluster bus use TLS too.
    pub tls: Option<ServerTls>,
    /// Its wall clock can be stepped while it runs ([`RedisServer::set_clock_offset`]): `redis-server` runs with
    /// a preloaded library of the harness's (`clock_shift.c`, built with the system's C compiler) that adds an
    /// offset, read from a file of the server's dir, to every wall-clock reading (`TIME`, scripts' `TIME`),
    /// leaving the monotonic clocks alone: an NTP step (`chronyc makestep`, a VM resumed, a failover to a host
    /// whose clock runs ahead), as Redis sees it. Off by default.
    pub clock_shift: bool,
    /// More arguments for `redis-server`, after all of the harness's own (so they win), for example
    /// `["--replicaof", "127.0.0.1", "7001"]`. A restart passes them again.
    pub extra_args: Vec<String>,
}

impl Options {
    /// No persistence, no DEBUG, listening as `listen`.
    pub fn new(listen: Listen) -> Options {
        Options {
            listen,
            appendonly: None,
            debug_command: false,
            tls: None,
            clock_shift: false,
            extra_args: Vec::new(),
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
    /// Environment variables of the process (the clock shift's preload), likewise kept for a restart.
    env: Vec<(OsString, OsString)>,
    /// The file the clock shift reads its offset from ([`Options::clock_shift`]), if it is on.
    clock_offset: Option<PathBuf>,
    log: PathBuf,
    dir: tempfile::TempDir,
    url: String,
    /// The TCP port (the TLS port of a TLS server); `None` on a unix socket.
    port: Option<u16>,
    /// A TLS server's settings: the harness reaches it with `redis-cli --tls` instead of redis-rs.
    tls: Option<ServerTls>,
    /// The connection [`RedisServer::query`] keeps to a plain server: the harness polls several servers every
    /// few milliseconds, and a connection per poll would fill the port range with TIME_WAIT sockets. Dropped
    /// when the server stops; shared (one command at a time) by the threads that query the server.
    control: Mutex<Option<redis::Connection>>,
}

/// Finds `redis-server` on the PATH (or in /usr/bin, /usr/sbin).
pub fn binary() -> Option<PathBuf> {
    find_binary("redis-server")
}

/// Finds `redis-cli` on the PATH (or in /usr/bin, /usr/sbin): the harness's client for TLS servers, and the
/// tests' cluster-aware client (`redis-cli -c`).
pub fn cli_binary() -> Option<PathBuf> {
    find_binary("redis-cli")
}

fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

impl RedisServer {
    /// Starts a server without persistence and waits (at most 10 s) until it answers PING.
    pub fn start(listen: Listen) -> Result<RedisServer, String> {
        RedisServer::start_with(Options::new(listen))
    }

    /// Starts a server as `options` say and waits (at most 10 s) until it answers PING.
    pub fn start_with(options: Options) -> Result<RedisServer, String> {
        RedisServer::start_configured(options, None)
    }

    /// As [`RedisServer::start_with`], with `config` written to `redis.conf` in the server's directory and given
    /// as the first argument: a sentinel needs a config file it can rewrite.
    pub(crate) fn start_configured(
        options: Options,
        config: Option<&str>,
    ) -> Result<RedisServer, String> {
        let binary =
            binary().ok_or("redis-server not found: install it (apt-get install redis-server)")?;
        let dir = tempfile::Builder::new()
            .prefix("kmqd-redis-")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        let log = dir.path().join("redis.log");
        let mut args: Vec<OsString> = Vec::new();
        if let Some(config) = config {
            let file = dir.path().join("redis.conf");
            std::fs::write(&file, config).map_err(|e| format!("write {}: {e}", file.display()))?;
            args.push(file.into());
        }
        args.extend(["--save".into(), "".into()]);
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
        let port = match options.listen {
            Listen::UnixSocket => None,
            // The port stays the same across restarts (Redis binds with SO_REUSEADDR).
            Listen::Loopback => Some(free_port()?),
            Listen::Port(port) => Some(port),
        };
        let url = match (port, &options.tls) {
            (None, Some(_)) => {
                return Err(
                    "a TLS redis-server needs a TCP port (Listen::Loopback or Listen::Port), \
                     not a unix socket"
                        .to_string(),
                );
            }
            (None, None) => {
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
            (Some(port), None) => {
                args.extend([
                    "--bind".into(),
                    "127.0.0.1".into(),
                    "--port".into(),
                    port.to_string().into(),
                ]);
                format!("redis://127.0.0.1:{port}/0")
            }
            (Some(port), Some(tls)) => {
                args.extend([
                    "--bind".into(),
                    "127.0.0.1".into(),
                    "--port".into(),
                    "0".into(),
                    "--tls-port".into(),
                    port.to_string().into(),
                    "--tls-cert-file".into(),
                    tls.cert_file.clone().into(),
                    "--tls-key-file".into(),
                    tls.key_file.clone().into(),
                    "--tls-ca-cert-file".into(),
                    tls.ca_cert_file.clone().into(),
                    "--tls-auth-clients".into(),
                    tls.auth_clients.as_redis_value().into(),
                    // A replica reaches its master, and a node its peers, over TLS too: nothing in a TLS
                    // deployment speaks plain TCP.
                    "--tls-replication".into(),
                    "yes".into(),
                    "--tls-cluster".into(),
                    "yes".into(),
                ]);
                // `localhost`, not 127.0.0.1: the name the test certificate is for, which a client checks.
                format!("rediss://localhost:{port}")
            }
        };
        args.extend(options.extra_args.iter().map(OsString::from));
        let mut env = Vec::new();
        let mut clock_offset = None;
        if options.clock_shift {
            let library = build_clock_shift(dir.path())?;
            let file = dir.path().join("clock-offset");
            std::fs::write(&file, 0i64.to_ne_bytes())
                .map_err(|e| format!("write {}: {e}", file.display()))?;
            env.push(("LD_PRELOAD".into(), library.into()));
            env.push(("KMQD_CLOCK_SHIFT_FILE".into(), file.clone().into()));
            clock_offset = Some(file);
        }
        let mut server = RedisServer {
            child: None,
            last_pid: 0,
            paused: AtomicBool::new(false),
            binary,
            args,
            env,
            clock_offset,
            log,
            dir,
            url,
            port,
            tls: options.tls,
            control: Mutex::new(None),
        };
        server.spawn()?;
        Ok(server)
    }

    /// Starts the process (again) and waits for PING.
    fn spawn(&mut self) -> Result<(), String> {
        let child = Command::new(&self.binary)
            .args(&self.args)
            .envs(self.env.iter().map(|(name, value)| (name, value)))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("start redis-server: {e}"))?;
        self.last_pid = child.id();
        self.child = Some(child);
        self.paused.store(false, Ordering::SeqCst);
        let deadline = Instant::now() + PATIENCE;
        loop {
            if self.ping().is_ok() {
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

    /// One PING: `Ok` once the server answers PONG. Over a connection of its own, closed at once: a test that
    /// counts a server's clients counts only its own.
    fn ping(&self) -> Result<(), String> {
        let reply = match &self.tls {
            None => redis::Client::open(self.url.as_str())
                .and_then(|client| client.get_connection_with_timeout(Duration::from_secs(1)))
                .and_then(|mut connection| {
                    connection.set_read_timeout(Some(QUERY_TIMEOUT))?;
                    redis::cmd("PING").query(&mut connection)
                })
                .map_err(|error| format!("{}: PING: {error}", self.name()))?,
            Some(_) => self.query(&["PING"])?,
        };
        match redis::from_redis_value_ref::<String>(&reply) {
            Ok(pong) if pong == "PONG" => Ok(()),
            _ => Err(format!("PING answered {reply:?}")),
        }
    }

    /// Runs one command on this server, for the harness and for tests that need a server's own view (`ROLE`,
    /// `CLUSTER NODES`, `INFO replication`): over redis-rs for a plain server, over `redis-cli --tls` for a
    /// TLS one (see [`tls::ServerTls::client_cert_file`]). Gives up after 5 s, so a paused server fails the
    /// call rather than hanging it. A redis-cli reply is rebuilt from its `--json` output (strings, integers,
    /// arrays, nil); the few commands redis-cli prints raw even then (`INFO`, `CLUSTER NODES`, `CLUSTER INFO`,
    /// `CLIENT LIST`) come back as one bulk string, as over redis-rs. To a plain server, it keeps one
    /// connection open for the next call (which `CLIENT LIST` shows); a TLS server sees a redis-cli per call.
    pub fn query(&self, args: &[&str]) -> Result<redis::Value, String> {
        if args.is_empty() {
            return Err(format!("{}: an empty command", self.name()));
        }
        let what = || format!("{} `{}`", self.name(), args.join(" "));
        let Some(tls) = &self.tls else {
            return self
                .plain_query(args)
                .map_err(|error| format!("{}: {error}", what()));
        };
        let port = self
            .port
            .expect("a TLS server has a TCP port (start_configured)");
        cli_query(port, tls, args).map_err(|error| format!("{}: {error}", what()))
    }

    /// As [`RedisServer::query`], converted with redis-rs's `FromRedisValue` (`String`, `i64`, `Vec<String>`).
    pub fn query_as<T: redis::FromRedisValue>(&self, args: &[&str]) -> Result<T, String> {
        let reply = self.query(args)?;
        redis::from_redis_value::<T>(reply).map_err(|error| {
            format!(
                "{} `{}`: unexpected reply: {error}",
                self.name(),
                args.join(" ")
            )
        })
    }

    /// A command over the kept connection ([`RedisServer::control`]), or over a new one when there is none or
    /// the kept one turns out broken (the server restarted since, say).
    fn plain_query(&self, args: &[&str]) -> redis::RedisResult<redis::Value> {
        let mut command = redis::cmd(args[0]);
        for arg in &args[1..] {
            command.arg(*arg);
        }
        // An error reply leaves the connection as good as before; anything else (a timeout, a reset) may leave
        // a reply in flight or nothing to talk to.
        let reusable = |result: &redis::RedisResult<redis::Value>| match result {
            Ok(_) => true,
            Err(error) => matches!(
                error.kind(),
                redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
            ),
        };
        let mut control = self
            .control
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(mut connection) = control.take() {
            let result = command.query(&mut connection);
            match &result {
                _ if reusable(&result) => {
                    *control = Some(connection);
                    return result;
                }
                // A timeout: the command may have run, so it is not sent again.
                Err(error) if error.is_timeout() => return result,
                // The server closed the kept connection (it restarted, or timed the client out) before it read
                // the command: once more on a new connection.
                _ => {}
            }
        }
        let mut connection = redis::Client::open(self.url.as_str())?
            .get_connection_with_timeout(Duration::from_secs(1))?;
        connection.set_read_timeout(Some(QUERY_TIMEOUT))?;
        connection.set_write_timeout(Some(QUERY_TIMEOUT))?;
        let result = command.query(&mut connection);
        if reusable(&result) {
            *control = Some(connection);
        }
        result
    }

    /// How errors name this server: its address, or its directory for a unix socket.
    fn name(&self) -> String {
        match self.addr() {
            Some(addr) => format!("redis-server {addr}"),
            None => format!("redis-server in {}", self.dir().display()),
        }
    }

    /// `127.0.0.1:PORT`, the address a TCP server listens on (its TLS port for a TLS server): how Redis
    /// Cluster and Sentinel name it. `None` on a unix socket.
    pub fn addr(&self) -> Option<String> {
        self.port.map(|port| format!("127.0.0.1:{port}"))
    }

    /// The TCP port (the TLS port of a TLS server); `None` on a unix socket.
    pub fn port(&self) -> Option<u16> {
        self.port
    }

    /// The TLS settings the server was started with.
    pub fn tls(&self) -> Option<&ServerTls> {
        self.tls.as_ref()
    }

    /// The last `lines` lines of the server's log, for an error message.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// What this server reports when it is dropped while its thread panics (a test failing): the tail of its log,
    /// where a refused command, an OOM or a crash shows Redis's side of the failure; `None` while nothing
    /// panics. Only a failed start carried the log before, so a failed assertion said nothing of Redis.
    pub fn panic_report(&self) -> Option<String> {
        /// Enough for the last restart and its complaints, short enough to leave the panic message in view.
        const LINES: usize = 40;
        std::thread::panicking().then(|| {
            format!(
                "redis-server {} was dropped by a failing test; the last {LINES} lines of its log ({}):\n{}",
                self.url,
                self.log.display(),
                self.log_tail(LINES)
            )
        })
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

    /// A new redis-rs connection to a plain server. For a TLS server use [`RedisServer::query`], or the client
    /// under test: this URL's `localhost` certificate is signed by the test CA, which redis-rs does not trust.
    pub fn connection(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(self.url.as_str())?.get_connection()
    }

    /// Ends the process with `signal` and waits (at most 10 s) until it has exited. Stopping a stopped server
    /// does nothing. A paused server is resumed after SIGTERM, or it could never act on it.
    pub fn stop(&mut self, signal: Signal) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        *self
            .control
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
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

    /// Steps the server's wall clock to `offset_ms` away from the real one (negative: behind), at once: the next
    /// `TIME` sees it, and the monotonic clocks do not move. Needs [`Options::clock_shift`].
    pub fn set_clock_offset(&self, offset_ms: i64) -> Result<(), String> {
        use std::os::unix::fs::FileExt;
        let file = self
            .clock_offset
            .as_ref()
            .ok_or("the server was started without Options::clock_shift")?;
        // In place, 8 bytes at once: the server reads the file through a mapping, which a truncation would
        // leave pointing past its end.
        let offset_us = offset_ms.saturating_mul(1000);
        std::fs::OpenOptions::new()
            .write(true)
            .open(file)
            .and_then(|f| f.write_all_at(&offset_us.to_ne_bytes(), 0))
            .map_err(|e| format!("write {}: {e}", file.display()))
    }

    fn running_pid(&self) -> Result<u32, String> {
        self.child
            .as_ref()
            .map(Child::id)
            .ok_or_else(|| "redis-server is stopped".to_string())
    }
}

/// Builds the clock shift's preload library (`clock_shift.c`) into `dir` with the system's C compiler (`cc`,
/// which building kmqd needs anyway); returns its path.
fn build_clock_shift(dir: &Path) -> Result<PathBuf, String> {
    let source = dir.join("clock_shift.c");
    let library = dir.join("libclock_shift.so");
    std::fs::write(&source, include_str!("clock_shift.c"))
        .map_err(|e| format!("write {}: {e}", source.display()))?;
    let output = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o"])
        .arg(&library)
        .arg(&source)
        .output()
        .map_err(|e| format!("run cc for the clock shift (scripts/test installs gcc): {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "cc failed to build the clock shift: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(library)
}

/// A TCP port on 127.0.0.1 that nobody listens on now (the kernel's pick; someone may take it before the
/// server binds it, which then fails to start and says so).
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// One command to a TLS server on 127.0.0.1:`port` through `redis-cli --tls`, presenting the harness's client
/// certificate and not checking the server's (see [`ServerTls::client_cert_file`]).
fn cli_query(port: u16, tls: &ServerTls, args: &[&str]) -> Result<redis::Value, String> {
    let cli =
        cli_binary().ok_or("redis-cli not found: install it (apt-get install redis-tools)")?;
    let mut command = Command::new(cli);
    // `-2`: RESP2 replies, as redis-rs gets them; `-e`: an error reply is a failure exit.
    command
        .args(["-2", "--json", "-e", "--tls", "--insecure", "--cert"])
        .arg(&tls.client_cert_file)
        .arg("--key")
        .arg(&tls.client_key_file)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args);
    let output = run_with_timeout(command, QUERY_TIMEOUT)?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let message = if stderr.trim().is_empty() {
            stdout.trim()
        } else {
            stderr.trim()
        };
        return Err(message.to_string());
    }
    Ok(
        match serde_json::from_str::<serde_json::Value>(stdout.trim_end()) {
            Ok(json) => json_to_value(json),
            // What redis-cli prints raw whatever the output format (INFO, CLUSTER NODES, ...).
            Err(_) => redis::Value::BulkString(output.stdout),
        },
    )
}

/// A reply as redis-cli's `--json` printed it, back as redis-rs would have read it.
fn json_to_value(json: serde_json::Value) -> redis::Value {
    use serde_json::Value as Json;
    match json {
        Json::Null => redis::Value::Nil,
        Json::Bool(b) => redis::Value::Int(i64::from(b)),
        Json::Number(n) => match n.as_i64() {
            Some(i) => redis::Value::Int(i),
            None => redis::Value::BulkString(n.to_string().into_bytes()),
        },
        Json::String(s) => redis::Value::BulkString(s.into_bytes()),
        Json::Array(items) => redis::Value::Array(items.into_iter().map(json_to_value).collect()),
        Json::Object(map) => redis::Value::Array(
            map.into_iter()
                .flat_map(|(k, v)| [redis::Value::BulkString(k.into_bytes()), json_to_value(v)])
                .collect(),
        ),
    }
}

/// Runs `command` to the end with its output captured, killing it after `timeout`: a redis-cli talking to a
/// paused server would otherwise wait forever.
fn run_with_timeout(
    mut command: Command,
    timeout: Duration,
) -> Result<std::process::Output, String> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command
        .spawn()
        .map_err(|e| format!("run {:?}: {e}", command.get_program()))?;
    // Both pipes are read while the child runs: a child that fills a pipe's buffer would block forever.
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let mut stderr = child.stderr.take().expect("stderr is piped");
    std::thread::scope(|scope| {
        let out = std::thread::Builder::new()
            .name("kmqd-redis-cli-out".into())
            .spawn_scoped(scope, move || {
                let mut bytes = Vec::new();
                let _ = stdout.read_to_end(&mut bytes);
                bytes
            })
            .map_err(|e| format!("spawn a thread: {e}"))?;
        let err = std::thread::Builder::new()
            .name("kmqd-redis-cli-err".into())
            .spawn_scoped(scope, move || {
                let mut bytes = Vec::new();
                let _ = stderr.read_to_end(&mut bytes);
                bytes
            })
            .map_err(|e| format!("spawn a thread: {e}"))?;
        let deadline = Instant::now() + timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Ok(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Ok(None) => break Err(format!("no answer within {timeout:?}")),
                Err(e) => break Err(format!("wait for {:?}: {e}", command.get_program())),
            }
        };
        if status.is_err() {
            // Killing it closes its pipes, which ends the readers.
            let _ = child.kill();
            let _ = child.wait();
        }
        // The readers only read; a panic there would be a bug in std.
        let stdout = out.join().expect("the stdout reader does not panic");
        let stderr = err.join().expect("the stderr reader does not panic");
        Ok(std::process::Output {
            status: status?,
            stdout,
            stderr,
        })
    })
}

/// Calls `attempt` every 10 ms until it returns `Ok`, for at most `within`; then fails with `what` and the
/// last error. Every wait of the harness is one of these.
pub(crate) fn wait_until<T>(
    within: Duration,
    what: &str,
    mut attempt: impl FnMut() -> Result<T, String>,
) -> Result<T, String> {
    let deadline = Instant::now() + within;
    loop {
        match attempt() {
            Ok(value) => return Ok(value),
            Err(last) if Instant::now() >= deadline => {
                return Err(format!("{what}: not within {within:?}; last: {last}"));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
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
        // A failing test (an assertion, an `eventually` that timed out) unwinds through its servers: each says
        // what it logged, into the test's captured output beside the panic message, as redis-rs's fixture does.
        if let Some(report) = self.panic_report() {
            eprintln!("{report}");
        }
        if let Some(mut child) = self.child.take() {
            // SIGKILL also ends a paused process.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
