//! Test fixtures: a private redis-server per test, real plugins built from this workspace, daemons run in-process
//! or as the real binary, and `eventually` to poll a condition with a deadline instead of sleeping.

pub mod proxy;

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kmqd::Config;
use kmqd::broker::QueueStats;
use kmqd::daemon::DaemonError;
use kmqd::plugin::Registry;

/// Polls `condition` every 5 ms until it holds; panics with `what` (and the last observed value) after `within`.
pub fn eventually<T: std::fmt::Debug>(
    within: Duration,
    what: &str,
    mut condition: impl FnMut() -> (bool, T),
) -> T {
    let deadline = Instant::now() + within;
    loop {
        let (ok, observed) = condition();
        if ok {
            return observed;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {within:?} waiting for {what}; last observed: {observed:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub use kmqd_harness::{Fsync, Options as RedisOptions, Signal};

/// A redis-server of the test's own (`kmqd_harness`): unix socket in a temp dir, no persistence (unless
/// started with [`RedisServer::start_with`]), killed on drop. The tests fail loudly, never skip, when
/// redis-server is missing.
pub struct RedisServer {
    server: kmqd_harness::RedisServer,
    pub socket: PathBuf,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        RedisServer::start_with(RedisOptions::default())
    }

    /// A server with other options (the append-only file, DEBUG); always on a unix socket, which the proxy
    /// and `socket` rely on.
    pub fn start_with(options: RedisOptions) -> RedisServer {
        assert_eq!(
            options.listen,
            kmqd_harness::Listen::UnixSocket,
            "the tests' redis-servers listen on a unix socket"
        );
        let server = kmqd_harness::RedisServer::start_with(options)
            .unwrap_or_else(|error| panic!("{error} (scripts/test installs redis-server)"));
        let socket = server.dir().join("redis.sock");
        RedisServer { server, socket }
    }

    /// As [`RedisServer::start_with`], with the append-only file on.
    pub fn with_aof(fsync: Fsync) -> RedisServer {
        RedisServer::start_with(RedisOptions {
            appendonly: Some(fsync),
            ..RedisOptions::default()
        })
    }

    /// A server whose wall clock the test steps while it runs ([`RedisServer::set_clock_offset`]): Redis's
    /// `TIME` jumps, as after an NTP step, and nothing else moves.
    pub fn with_clock_shift() -> RedisServer {
        RedisServer::start_with(RedisOptions {
            clock_shift: true,
            ..RedisOptions::default()
        })
    }

    /// Steps the server's wall clock to `offset_ms` from the real one (negative: behind); needs
    /// [`RedisServer::with_clock_shift`].
    pub fn set_clock_offset(&self, offset_ms: i64) {
        self.server
            .set_clock_offset(offset_ms)
            .unwrap_or_else(|error| panic!("step redis-server's clock: {error}"));
    }

    /// Ends redis-server with SIGTERM (a clean shutdown) or SIGKILL (a crash) and waits for it to exit.
    pub fn stop(&mut self, signal: Signal) {
        self.server
            .stop(signal)
            .unwrap_or_else(|error| panic!("stop redis-server: {error}"));
    }

    /// A new redis-server process on the same dir, socket and persistence settings (a running one is first
    /// stopped with SIGTERM), once it answers PING: the data survives with the append-only file on, and is gone
    /// without it.
    pub fn restart(&mut self) {
        self.server
            .restart()
            .unwrap_or_else(|error| panic!("restart redis-server: {error}"));
    }

    /// SIGSTOP: Redis stalls (clients connect and send, replies do not come) until [`RedisServer::resume`].
    pub fn pause(&self) {
        self.server
            .pause()
            .unwrap_or_else(|error| panic!("pause redis-server: {error}"));
    }

    /// SIGCONT: a paused Redis answers what it was sent meanwhile.
    pub fn resume(&self) {
        self.server
            .resume()
            .unwrap_or_else(|error| panic!("resume redis-server: {error}"));
    }

    /// The pid of the redis-server process (the last one, once stopped).
    pub fn pid(&self) -> u32 {
        self.server.pid()
    }

    /// The server's private directory: its unix socket `redis.sock`, its log `redis.log` and, with the
    /// append-only file on, `appendonlydir` (delete that between [`RedisServer::stop`] and
    /// [`RedisServer::restart`] for a Redis that comes back empty).
    pub fn dir(&self) -> &Path {
        self.server.dir()
    }

    /// What redis-server logged (for a failing test's message).
    pub fn log_text(&self) -> String {
        self.server.log_text()
    }

    /// What the server says when a failing test drops it (see `kmqd_harness::RedisServer::panic_report`).
    pub fn panic_report(&self) -> Option<String> {
        self.server.panic_report()
    }

    /// Where the append-only file ends now (a server started with it on, and with automatic rewrites off:
    /// `--auto-aof-rewrite-percentage 0`): what [`RedisServer::crash_back_to`] cuts it back to. Take it after a
    /// write was acknowledged on `appendfsync always` to be sure the file holds that write.
    pub fn aof_mark(&self) -> AofMark {
        let file = last_incr_file(&self.dir().join("appendonlydir"))
            .expect("an append-only file (start the server with RedisServer::with_aof)");
        let length = fs::metadata(&file)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
            .len();
        AofMark { file, length }
    }

    /// Redis on `appendfsync everysec` dies with its host: what it appended since `mark` was in the host's page
    /// cache only, and is gone. SIGKILL, the file cut back to `mark`, and a restart on the rest, which Redis reads
    /// as an older state consistent in itself (each script, each transaction, one unit in the file). Returns how
    /// many bytes were cut off.
    pub fn crash_back_to(&mut self, mark: AofMark) -> u64 {
        self.stop(Signal::Kill);
        let dir = self.dir().join("appendonlydir");
        assert_eq!(
            last_incr_file(&dir).as_ref(),
            Some(&mark.file),
            "the file Redis appends to changed since the mark (a rewrite?)"
        );
        let written = fs::metadata(&mark.file).map_or(0, |m| m.len());
        fs::OpenOptions::new()
            .write(true)
            .open(&mark.file)
            .and_then(|open| open.set_len(mark.length))
            .unwrap_or_else(|e| panic!("truncate {}: {e}", mark.file.display()));
        self.restart();
        written.saturating_sub(mark.length)
    }

    pub fn url(&self) -> String {
        self.server.url().to_string()
    }

    pub fn connection(&self) -> kmqd::broker::Conn {
        self.server
            .connection()
            .expect("connect to the test's redis-server")
            .into()
    }

    /// Runs one command.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut command = redis::cmd(args[0]);
        for arg in &args[1..] {
            command.arg(*arg);
        }
        command
            .query(&mut self.connection())
            .unwrap_or_else(|error| panic!("{args:?}: {error}"))
    }

    /// The result kept for task `id` of `queue` (`keep_results`), as the settle wrote it: looked up as
    /// docs/PROTOCOL.md, "Results" tells any client to (the buckets in the index, newest first, then the id in
    /// each). `None` when there is none.
    pub fn kept_result(&self, queue: &str, id: &str) -> Option<serde_json::Value> {
        let starts: Vec<String> = self.cmd(&[
            "ZRANGE",
            &format!("kmq:{{{queue}}}:results"),
            "0",
            "-1",
            "REV",
        ]);
        starts.iter().find_map(|start| {
            let bucket = format!("kmq:{{{queue}}}:results:{start}");
            let text: Option<String> = self.cmd(&["HGET", &bucket, id]);
            text.map(|text| serde_json::from_str(&text).expect("a kept result is JSON"))
        })
    }
}

/// A point in a server's append-only file ([`RedisServer::aof_mark`]).
#[derive(Debug)]
pub struct AofMark {
    file: PathBuf,
    length: u64,
}

/// The incremental file of a multi-part append-only file (Redis 7: `appendonlydir/`), the one Redis appends to:
/// the last `type i` entry of its manifest.
pub fn last_incr_file(dir: &Path) -> Option<PathBuf> {
    let manifest = fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| path.extension().is_some_and(|ext| ext == "manifest"))?;
    let text = fs::read_to_string(manifest).ok()?;
    let name = text
        .lines()
        .filter(|line| line.ends_with("type i"))
        .filter_map(|line| line.strip_prefix("file ")?.split(' ').next())
        .next_back()?;
    Some(dir.join(name))
}

/// The directory cargo put this test binary's profile in (target/debug or target/release).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/it-<hash>
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_owned()
}

/// Builds the workspace's example plugins once per test run and returns the directory holding the .so files.
pub fn built_plugins() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = profile_dir();
        let mut command = Command::new(env!("CARGO"));
        command.current_dir(env!("CARGO_MANIFEST_DIR")).args([
            "build",
            "--quiet",
            "-p",
            "kmq-testkit",
            "-p",
            "kmq-echo",
        ]);
        if dir.ends_with("release") {
            command.arg("--release");
        }
        let status = command.status().expect("run cargo build for the plugins");
        assert!(status.success(), "building the test plugins failed");
        dir
    })
}

/// A test's private directory: its plugins (copied, so every test loads its own instance), config and records.
pub struct TestDir {
    pub dir: tempfile::TempDir,
}

impl TestDir {
    pub fn new() -> TestDir {
        let dir = tempfile::tempdir().expect("temp dir");
        let plugins = dir.path().join("plugins");
        fs::create_dir(&plugins).unwrap();
        fs::set_permissions(&plugins, fs::Permissions::from_mode(0o755)).unwrap();
        for name in ["libkmq_testkit.so", "libkmq_echo.so"] {
            let target = plugins.join(name);
            fs::copy(built_plugins().join(name), &target)
                .unwrap_or_else(|e| panic!("copy {name}: {e}"));
            fs::set_permissions(&target, fs::Permissions::from_mode(0o755)).unwrap();
        }
        TestDir { dir }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn plugins_dir(&self) -> PathBuf {
        self.path("plugins")
    }

    /// The file the testkit plugin records runs in.
    pub fn record_file(&self) -> PathBuf {
        self.path("runs.log")
    }

    /// Writes a config: `[redis]` and `[daemon]` pointing at `redis` and this dir, the testkit plugin recording
    /// to [`TestDir::record_file`], then `queues` (TOML `[[queues]]` entries).
    pub fn config(&self, redis: &RedisServer, queues: &str) -> PathBuf {
        self.config_with(redis, "shutdown_grace = \"5s\"", queues)
    }

    /// As [`TestDir::config`], with extra `[daemon]` keys.
    pub fn config_with(&self, redis: &RedisServer, daemon: &str, queues: &str) -> PathBuf {
        self.config_for_url(&redis.url(), daemon, queues)
    }

    /// As [`TestDir::config`], reaching Redis through `proxy`, with a read timeout of 500 ms, so that a lost
    /// reply is noticed soon.
    pub fn config_through(&self, proxy: &proxy::FaultProxy, queues: &str) -> PathBuf {
        self.config_raw(
            &format!("url = \"{}\"\nio_timeout = \"500ms\"", proxy.url()),
            "shutdown_grace = \"5s\"",
            queues,
        )
    }

    /// As [`TestDir::config_with`], with any Redis URL (a `proxy::FaultProxy`'s, for example).
    pub fn config_for_url(&self, url: &str, daemon: &str, queues: &str) -> PathBuf {
        self.config_raw(&format!("url = \"{url}\""), daemon, queues)
    }

    /// As [`TestDir::config_for_url`], with the whole `[redis]` section's keys given (`io_timeout`, ...).
    pub fn config_raw(&self, redis: &str, daemon: &str, queues: &str) -> PathBuf {
        self.config_named("kmqd.toml", redis, daemon, queues, &self.record_file())
    }

    /// As [`TestDir::config_raw`], written to the file `name` of this dir (so that several configs live side
    /// by side) with the testkit plugin recording to `record` (one record file per daemon process, for
    /// example). Returns the config's path.
    pub fn config_named(
        &self,
        name: &str,
        redis: &str,
        daemon: &str,
        queues: &str,
        record: &Path,
    ) -> PathBuf {
        let text = format!(
            "[redis]\n{redis}\n\n[daemon]\nplugins_dir = \"{plugins}\"\n{daemon}\n\n{queues}\n\n\
             [plugins.testkit]\nfile = \"libkmq_testkit.so\"\nconfig = {{ record = \"{record}\" }}\n",
            plugins = self.plugins_dir().display(),
            record = record.display(),
        );
        let path = self.path(name);
        fs::write(&path, text).unwrap();
        path
    }

    /// As [`TestDir::config`], with the testkit plugin handling `types` (rather than its one type, `test`).
    pub fn config_for_types(&self, redis: &RedisServer, queues: &str, types: &[&str]) -> PathBuf {
        let path = self.config(redis, queues);
        self.testkit_types(&path, types);
        path
    }

    /// Rewrites the config at `path`, written by this dir, so that its testkit plugin handles `types`.
    pub fn testkit_types(&self, path: &Path, types: &[&str]) {
        self.testkit_types_recording(path, &self.record_file(), types);
    }

    /// As [`TestDir::testkit_types`], for a config whose testkit plugin records to `record` (one written by
    /// [`TestDir::config_named`]).
    pub fn testkit_types_recording(&self, path: &Path, record: &Path, types: &[&str]) {
        let text = fs::read_to_string(path).unwrap();
        let record = record.display();
        let types = types
            .iter()
            .map(|kind| format!("{kind:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        let with_types = format!("config = {{ record = \"{record}\", types = [{types}] }}");
        let record = format!("config = {{ record = \"{record}\" }}");
        assert!(text.contains(&record), "the testkit section: {text}");
        fs::write(path, text.replace(&record, &with_types)).unwrap();
    }

    /// The runs the testkit plugin recorded.
    pub fn records(&self) -> Records {
        Records::parse(&fs::read_to_string(self.record_file()).unwrap_or_default())
    }
}

/// The lines of the testkit record file.
#[derive(Debug, Default)]
pub struct Records {
    /// (id, attempt) of every run that started.
    pub starts: Vec<(String, u32)>,
    /// (id, µs since the epoch) of every run that started, in the same order as `starts`.
    pub start_times: Vec<(String, u64)>,
    /// (id, attempt, outcome) of every run that returned.
    pub ends: Vec<(String, u32, String)>,
    /// (id, attempt, reason) of every on_dead call.
    pub deads: Vec<(String, u32, String)>,
    /// Every line, in the order written (`shutdown` is the plugin's shutdown).
    pub lines: Vec<String>,
}

impl Records {
    fn parse(text: &str) -> Records {
        let mut records = Records::default();
        for line in text.lines() {
            records.lines.push(line.to_string());
            let mut parts = line.splitn(4, ' ');
            let (kind, id, attempt, rest) = (
                parts.next(),
                parts.next(),
                parts.next(),
                parts.next().unwrap_or(""),
            );
            let (Some(kind), Some(id), Some(attempt)) = (kind, id, attempt) else {
                continue;
            };
            let attempt: u32 = attempt.parse().unwrap_or(u32::MAX);
            match kind {
                "start" => {
                    records.starts.push((id.to_string(), attempt));
                    let micros = rest
                        .split(' ')
                        .nth(1)
                        .and_then(|t| t.parse().ok())
                        .unwrap_or(0);
                    records.start_times.push((id.to_string(), micros));
                }

                "end" => records
                    .ends
                    .push((id.to_string(), attempt, rest.to_string())),
                "dead" => records
                    .deads
                    .push((id.to_string(), attempt, rest.to_string())),
                _ => {}
            }
        }
        records
    }

    /// How many runs of `id` started.
    pub fn runs_of(&self, id: &str) -> usize {
        self.starts.iter().filter(|(i, _)| i == id).count()
    }
}

impl RedisServer {
    /// A number of `INFO section` (`INFO memory`'s `used_memory`).
    pub fn info_number(&self, section: &str, field: &str) -> u64 {
        let info: String = self.cmd(&["INFO", section]);
        info.lines()
            .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("INFO {section} has no number {field}"))
    }

    /// Waits until a client of this server is blocked in `command` (`blpop`: an idle safe-mode fetcher waiting
    /// for a wake-up marker; `blmpop`: an idle default-mode fetcher waiting on its ready lists).
    pub fn wait_blocked_in(&self, command: &str) {
        let wanted = format!("cmd={command}");
        eventually(
            Duration::from_secs(10),
            &format!("a client blocked in {command}"),
            || {
                let clients: String = self.cmd(&["CLIENT", "LIST"]);
                (clients.contains(&wanted), clients)
            },
        );
    }

    /// Ends the wait of the client blocked in `command` as if it timed out (`CLIENT UNBLOCK`). An idle fetcher's
    /// claim or pop is already in Redis, behind its wait (docs/PERFORMANCE.md, "Push to start on an idle queue"): a
    /// request fault meant for its next one is added first, then this, so that the take it sends behind its next
    /// wait is the one the fault meets.
    pub fn end_blocking_wait(&self, command: &str) {
        let ids = self.client_fields(command, "id");
        let id = ids
            .first()
            .unwrap_or_else(|| panic!("no client blocked in {command}"));
        let unblocked: i64 = self.cmd(&["CLIENT", "UNBLOCK", id]);
        assert_eq!(unblocked, 1, "client {id} was not blocked in {command}");
    }

    /// `field` (`id`, `qbuf`) of each client whose last command was `command`, as `CLIENT LIST` shows them.
    pub fn client_fields(&self, command: &str, field: &str) -> Vec<String> {
        let (wanted, prefix) = (format!("cmd={command}"), format!("{field}="));
        let clients: String = self.cmd(&["CLIENT", "LIST"]);
        clients
            .lines()
            .filter(|client| client.contains(&wanted))
            .filter_map(|client| {
                client
                    .split(' ')
                    .find_map(|f| f.strip_prefix(prefix.as_str()))
            })
            .map(str::to_string)
            .collect()
    }

    /// The ids of the envelopes in a list, head first.
    pub fn ids_in(&self, list: &str) -> Vec<String> {
        let payloads: Vec<String> = self.cmd(&["LRANGE", list, "0", "-1"]);
        payloads
            .iter()
            .map(|p| {
                kmqd::task::Envelope::decode(p)
                    .unwrap()
                    .id
                    .unwrap()
                    .into_owned()
            })
            .collect()
    }
}

/// A daemon running in this process (the library entry point, as `main` uses it).
pub struct TestDaemon {
    stop: crossbeam_channel::Sender<()>,
    handle: Option<JoinHandle<Result<(), DaemonError>>>,
}

impl TestDaemon {
    pub fn start(config_path: &Path) -> TestDaemon {
        let config = Config::load(config_path).expect("test config is valid");
        let registry = Arc::new(Registry::load(&config).expect("test plugins load"));
        let (stop, stop_rx) = crossbeam_channel::bounded(1);
        let handle = std::thread::Builder::new()
            .name("test-daemon".into())
            .spawn(move || kmqd::daemon::run(&config, registry, stop_rx))
            .unwrap();
        TestDaemon {
            stop,
            handle: Some(handle),
        }
    }

    /// Asks for a graceful stop and waits for it (at most `within`).
    pub fn stop_within(mut self, within: Duration) -> Result<(), DaemonError> {
        let _ = self.stop.send(());
        let handle = self.handle.take().expect("running");
        eventually(within, "the daemon to stop", || (handle.is_finished(), ()));
        handle.join().expect("daemon thread did not panic")
    }

    pub fn stop(self) {
        self.stop_within(Duration::from_secs(30))
            .expect("daemon stopped cleanly");
    }
}

impl Drop for TestDaemon {
    fn drop(&mut self) {
        // A test that panicked before stopping its daemon: stop it, but do not wait (the test already failed).
        let _ = self.stop.send(());
    }
}

/// An HTTP answer (a scrape of a metrics endpoint, a dashboard's page or API call).
#[derive(Debug, Default)]
pub struct Scrape {
    /// The status line, `HTTP/1.1 200 OK`; empty when nothing answered.
    pub status: String,
    pub content_type: String,
    pub body: String,
}

/// A loopback port the OS just handed out, released before the caller's daemon binds it.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET /metrics` of the endpoint on 127.0.0.1:`port`, as a plain scraper asks (no `Accept`), waiting up to 10 s.
pub fn scrape(port: u16) -> Scrape {
    scrape_with(
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        None,
        Duration::from_secs(10),
    )
}

/// `GET /metrics` with an `Accept` header (or none), waiting up to `timeout` for the whole answer.
pub fn scrape_with(addr: std::net::SocketAddr, accept: Option<&str>, timeout: Duration) -> Scrape {
    let headers: Vec<(&str, &str)> = accept
        .map(|accept| ("Accept", accept))
        .into_iter()
        .collect();
    http(addr, "GET", "/metrics", &headers, "", timeout)
}

/// One HTTP/1.1 request (`Host: ADDR` and `Connection: close` added, and `Content-Length` when there is a
/// body), waiting up to `timeout` for the whole answer; an empty status when nothing answered.
pub fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
    timeout: Duration,
) -> Scrape {
    use std::io::Read;
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, timeout) else {
        return Scrape::default();
    };
    stream.set_read_timeout(Some(timeout)).unwrap();
    let mut request = format!("{method} {path} HTTP/1.1\r\n");
    if !headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("host"))
    {
        request.push_str(&format!("Host: {addr}\r\n"));
    }
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    if !body.is_empty() {
        request.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    request.push_str("Connection: close\r\n\r\n");
    request.push_str(body);
    if stream.write_all(request.as_bytes()).is_err() {
        return Scrape::default();
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let mut lines = head.lines();
    let status = lines.next().unwrap_or("").to_string();
    let content_type = lines
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.eq_ignore_ascii_case("content-type"))
        .map_or(String::new(), |(_, value)| value.trim().to_string());
    Scrape {
        status,
        content_type,
        body: body.to_string(),
    }
}

/// The real `kmqd` binary as a child process, with its output in a log file.
pub struct Process {
    pub child: Child,
    pub log: PathBuf,
}

impl Process {
    pub fn start(config_path: &Path, log: PathBuf) -> Process {
        Process::spawn(config_path, log, &[], &[])
    }

    /// As [`Process::start`], with extra arguments after `--config FILE` (`--metrics-addr ADDR`).
    pub fn start_with_args(config_path: &Path, log: PathBuf, args: &[&str]) -> Process {
        Process::spawn(config_path, log, args, &[])
    }

    /// The address the metrics endpoint says it bound (its "metrics on http://ADDR/metrics" line), once logged.
    pub fn metrics_addr(&self) -> std::net::SocketAddr {
        eventually(
            Duration::from_secs(30),
            "the metrics address in the log",
            || {
                let log = self.log_text();
                let addr = log
                    .split("metrics on http://")
                    .nth(1)
                    .and_then(|rest| rest.split("/metrics").next())
                    .and_then(|addr| addr.parse().ok());
                (addr.is_some(), addr.ok_or(log))
            },
        )
        .unwrap()
    }

    /// As [`Process::start`], with extra environment variables for the daemon (for example `RUST_BACKTRACE=0`
    /// for a test whose plugins panic by the hundred: the panic hook's backtraces would flood the log).
    pub fn start_with_env(config_path: &Path, log: PathBuf, env: &[(&str, &str)]) -> Process {
        Process::spawn(config_path, log, &[], env)
    }

    /// `kmqd --config FILE ARGS...` at debug level (and `env`), its standard output and error in `log`.
    fn spawn(config_path: &Path, log: PathBuf, args: &[&str], env: &[(&str, &str)]) -> Process {
        let out = fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_kmqd"))
            .arg("--config")
            .arg(config_path)
            .args(args)
            .env("RUST_LOG", "kmqd=debug")
            .envs(env.iter().copied())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("start kmqd");
        Process { child, log }
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends a signal (SIGTERM, SIGINT) to the process.
    pub fn signal(&self, signal: i32) {
        // kill(1) rather than libc::kill keeps the tests free of unsafe code.
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits (at most `within`) for the process to exit; returns its exit code.
    pub fn wait_within(&mut self, within: Duration) -> Option<i32> {
        let status = eventually(within, "kmqd to exit", || {
            match self.child.try_wait().unwrap() {
                Some(status) => (true, Some(status)),
                None => (false, None),
            }
        });
        status.and_then(|s| s.code())
    }

    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `kmqd ARGS` to completion; returns (exit code, stdout, stderr).
/// Runs `kmqd --config CONFIG ARGS...`, checks it exits 0, and returns its standard output.
pub fn kmqd_ok(config: &Path, args: &[&str]) -> String {
    let mut all = vec!["--config", config.to_str().unwrap()];
    all.extend_from_slice(args);
    let (code, out, err) = kmqd(&all, None);
    assert_eq!(code, 0, "kmqd {args:?}: {err}");
    out
}

pub fn kmqd(args: &[&str], stdin: Option<&str>) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kmqd"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kmqd");
    let mut input = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).unwrap();
    }
    drop(input);
    let output = child.wait_with_output().unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A queue's stats through the library.
pub fn stats(config_path: &Path, queue: &str) -> QueueStats {
    let config = Config::load(config_path).unwrap();
    kmqd::Client::new(&config).unwrap().stats(queue).unwrap()
}

/// A producer for a config.
pub fn client(config_path: &Path) -> kmqd::Client {
    kmqd::Client::new(&Config::load(config_path).unwrap()).unwrap()
}

/// The workspace's root directory.
pub fn workspace_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Builds the workspace's plugin crate `package` (e.g. `kmq-exec`) once per test run; returns the path of its
/// library in the target directory.
pub fn built_plugin(package: &str) -> PathBuf {
    static BUILT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let dir = profile_dir();
    let mut built = BUILT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if !built.iter().any(|p| p == package) {
        let mut command = Command::new(env!("CARGO"));
        command
            .current_dir(workspace_dir())
            .args(["build", "--quiet", "-p", package]);
        if dir.ends_with("release") {
            command.arg("--release");
        }
        let status = command.status().expect("run cargo build for a plugin");
        assert!(status.success(), "building the plugin {package} failed");
        built.push(package.to_string());
    }
    dir.join(format!("lib{}.so", package.replace('-', "_")))
}

/// Compiles the C plugin `source` into the shared library `output` the way docs/PLUGINS.md tells plugin authors
/// to (`cc -shared -fPIC`, against `plugins/include/kmq_plugin.h`), with warnings as errors; `defines` become `-D`
/// flags. The library gets the mode kmqd accepts (0755). Panics with the compiler's output when it fails.
pub fn compile_c_plugin(source: &Path, defines: &[&str], output: &Path) {
    let compiled = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-std=c11", "-Wall", "-Wextra", "-Werror"])
        .arg("-I")
        .arg(workspace_dir().join("plugins/include"))
        .args(defines.iter().map(|define| format!("-D{define}")))
        .arg("-o")
        .arg(output)
        .arg(source)
        .output()
        .unwrap_or_else(|error| {
            panic!("cannot run the C compiler `cc` ({error}): the plugin tests need one; scripts/test installs gcc")
        });
    assert!(
        compiled.status.success(),
        "cc could not compile {} with {defines:?}:\n{}",
        source.display(),
        String::from_utf8_lossy(&compiled.stderr)
    );
    fs::set_permissions(output, fs::Permissions::from_mode(0o755)).unwrap();
}

impl TestDir {
    /// Copies the library `from` into this dir's plugins directory as `file_name`, with the mode kmqd accepts.
    pub fn install_plugin(&self, from: &Path, file_name: &str) -> PathBuf {
        let target = self.plugins_dir().join(file_name);
        fs::copy(from, &target).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
        fs::set_permissions(&target, fs::Permissions::from_mode(0o755)).unwrap();
        target
    }
}

/// A `[[queues]]` entry for the queue `jobs` in safe mode, with `extra` keys.
pub fn safe_queue(extra: &str) -> String {
    format!("[[queues]]\nname = \"jobs\"\nmode = \"safe\"\n{extra}\n")
}

/// A `[[queues]]` entry for the queue `jobs` in default mode, with `extra` keys.
pub fn default_queue(extra: &str) -> String {
    format!("[[queues]]\nname = \"jobs\"\nmode = \"default\"\n{extra}\n")
}

/// Starts a default-mode daemon on `config`, whose Redis it reaches through `proxy`, and once its fetcher waits idle
/// drops the reply of its next pop.lua call (the pop runs; the connection is closed): the daemon, and the rule,
/// to see that it fired.
pub fn default_daemon_losing_its_next_pop_reply(
    config: &Path,
    redis: &RedisServer,
    proxy: &proxy::FaultProxy,
) -> (TestDaemon, proxy::Rule) {
    let daemon = TestDaemon::start(config);
    redis.wait_blocked_in("blmove");
    let rule = proxy.add(proxy::Fault::DropReply {
        matching: proxy::Matcher::script(kmqd::broker::sources::POP),
        nth: 1,
        then: proxy::AfterDrop::Close,
    });
    (daemon, rule)
}

/// The code block after the `n`-th marker `<!-- tested: TEST_FILE runs this block -->` of the document `doc` (a
/// path from the workspace), its language tag left out: the docs' examples that the tests run as they are written.
pub fn documented_block(doc: &str, test_file: &str, n: usize) -> String {
    let text = fs::read_to_string(workspace_dir().join(doc)).unwrap();
    let marker = format!("<!-- tested: {test_file} runs this block -->");
    let after_marker = text
        .split(&marker)
        .nth(n + 1)
        .unwrap_or_else(|| panic!("{doc}: marker {n} of {test_file}"));
    let block = after_marker
        .split("```")
        .nth(1)
        .expect("a code block after the marker");
    block.trim_start_matches("sh").to_string()
}

/// Runs a documented block of shell and `redis-cli` commands against the test's own server.
pub fn run_documented(block: &str, redis: &RedisServer) {
    let socket = redis.socket.display().to_string();
    let script = block.replace("redis-cli ", &format!("redis-cli -s {socket} "));
    let output = Command::new("sh")
        .arg("-ec")
        .arg(&script)
        .current_dir(workspace_dir())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{script}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Pushes `count` testkit tasks with `data` to `jobs`, ids `prefix0` to `prefix{count - 1}`.
pub fn push_many(config: &Path, prefix: &str, count: usize, data: &str) {
    push_typed(config, "test", prefix, count, data);
}

/// Pushes `count` tasks of type `kind` with `data` to `jobs`, ids `prefix0` to `prefix{count - 1}`.
pub fn push_typed(config: &Path, kind: &str, prefix: &str, count: usize, data: &str) {
    let tasks: Vec<kmqd::NewTask> = (0..count)
        .map(|i| {
            kmqd::NewTask::new(kind, data)
                .unwrap()
                .id(format!("{prefix}{i}"))
        })
        .collect();
    client(config).push_batch("jobs", tasks).unwrap();
}

/// Every id `prefix0..prefix{count}` ran exactly once.
pub fn assert_ran_once(dir: &TestDir, prefix: &str, count: usize) {
    let records = dir.records();
    for i in 0..count {
        let id = format!("{prefix}{i}");
        assert_eq!(records.runs_of(&id), 1, "{id}: {:?}", records.starts);
    }
}

/// Waits until `jobs` counts at least `done` tasks done.
pub fn wait_done(config: &Path, done: u64, within: Duration) -> QueueStats {
    eventually(within, &format!("{done} tasks done"), || {
        let s = stats(config, "jobs");
        (s.done >= done, s)
    })
}

/// Whether `queue` holds nothing ready, processing or delayed while a daemon serves it (an owner with a live
/// lease): everything still in Redis ran, and nothing is stranded under a live owner. A rewind the journal check
/// missed leaves `processing` above 0 under a live lease until the daemon stops, which a count of the tasks that
/// never ran does not see (review H1): so the failover and chaos tests end on this. Returns the stats it read, or
/// why it could not.
pub fn drained_under_a_live_owner(
    watcher: &kmqd::Client,
    queue: &str,
) -> (bool, Result<QueueStats, String>) {
    let stats = watcher.stats(queue);
    let idle = stats
        .as_ref()
        .is_ok_and(|s| s.ready == 0 && s.processing == 0 && s.delayed == 0);
    let live = watcher
        .workers(queue)
        .is_ok_and(|owners| owners.iter().any(|owner| owner.lease_left_ms > 0));
    (idle && live, stats.map_err(|e| e.to_string()))
}

/// Waits until [`drained_under_a_live_owner`] holds for `queue`; panics after a minute. Returns the stats then.
pub fn wait_drained(watcher: &kmqd::Client, queue: &str) -> QueueStats {
    eventually(
        Duration::from_secs(60),
        "the queue drained under a live owner",
        || drained_under_a_live_owner(watcher, queue),
    )
    .expect("the stats of a drained queue")
}

/// The dead-letter records of `queue`, newest first, as JSON.
pub fn dead_records(redis: &RedisServer, queue: &str) -> Vec<serde_json::Value> {
    let dead: Vec<String> = redis.cmd(&["LRANGE", &format!("kmq:{{{queue}}}:dead"), "0", "-1"]);
    dead.iter()
        .map(|record| serde_json::from_str(record).unwrap())
        .collect()
}

/// The dead-letter reasons of `queue`, by task id.
pub fn dead_reasons(
    redis: &RedisServer,
    queue: &str,
) -> std::collections::BTreeMap<String, String> {
    dead_records(redis, queue)
        .iter()
        .map(|record| {
            (
                record["id"].as_str().unwrap().to_string(),
                record["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// A daemon of `queue` behind a fault proxy that drops the `nth` reply of `script` (then does
/// `then`), the way a limited queue's counts are tested against a lost reply: `prepare` finishes the config (the
/// handlers' types), `drain` pushes the tasks and checks they all drained once and what the counts came back to;
/// then the fault must have fired, once. The flow-control tests (limits, type limits, groups) share it.
pub fn drain_with_a_reply_lost(
    script: &str,
    (nth, then): (usize, proxy::AfterDrop),
    queue: &str,
    prepare: impl FnOnce(&TestDir, &Path),
    drain: impl FnOnce(&Path, &RedisServer, &TestDir),
) {
    let redis = RedisServer::start();
    let proxy = proxy::FaultProxy::start(&redis);
    let dir = TestDir::new();
    let redis_section = format!("url = \"{}\"\nio_timeout = \"1s\"", proxy.url());
    let config = dir.config_raw(&redis_section, "", queue);
    prepare(&dir, &config);
    let daemon = TestDaemon::start(&config);
    // Idle: a default-mode fetcher waits on its wake list with BLMOVE, a safe-mode one with BLPOP.
    redis.wait_blocked_in(if queue.contains("\"default\"") {
        "blmove"
    } else {
        "blpop"
    });
    let rule = proxy.add(proxy::Fault::DropReply {
        matching: proxy::Matcher::script(script),
        nth,
        then,
    });
    drain(&config, &redis, &dir);
    assert_eq!(rule.fired(), 1, "{then:?}: the reply was dropped");
    daemon.stop();
}
