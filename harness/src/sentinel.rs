//! A private Redis Sentinel deployment for tests and benchmarks: a master, its replicas, and sentinels that
//! watch it, each a [`RedisServer`] in its own temp dir on a free loopback port, all killed when the
//! [`SentinelSetup`] is dropped.
//!
//! A client of a Sentinel deployment asks a sentinel where the master is, and must ask again when the master
//! fails over; testing that needs sentinels that really fail a master over. [`SentinelSetup::start`] returns
//! once every sentinel sees the master, its replicas and the other sentinels; [`SentinelSetup::kill_master`]
//! and [`SentinelSetup::wait_failover`] replace the master by a replica. The servers stay reachable
//! ([`SentinelSetup::server`], [`SentinelSetup::server_mut`]) to pause, kill or query.
//!
//! There is no `redis-sentinel` binary to rely on: a sentinel is `redis-server sentinel.conf --sentinel`. Its
//! config file sits in its own directory, because a sentinel rewrites it (with what it learned) as it goes.

use std::collections::HashMap;
use std::time::Duration;

use super::{Fsync, Listen, Options, RedisServer, ServerTls, Signal, wait_until};

/// How long the sentinels may take to agree, beyond the timeouts of `options` they wait out: a sentinel finds
/// the others through hello messages it publishes every 2 s.
const PATIENCE: Duration = Duration::from_secs(15);

/// How to start a Sentinel deployment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SentinelOptions {
    /// The name the sentinels monitor the master under (`sentinel monitor NAME ...`), which clients ask for.
    pub master_name: String,
    /// At least 1, or no failover is possible.
    pub replicas: usize,
    pub sentinels: usize,
    /// How many sentinels must agree that the master is down before one of them fails it over.
    pub quorum: usize,
    /// `sentinel down-after-milliseconds`: how long the master is unreachable before a sentinel counts it
    /// down.
    pub down_after_ms: u64,
    /// `sentinel failover-timeout`: how long a failover may take before another sentinel tries again (and
    /// twice this, before the same one does).
    pub failover_timeout_ms: u64,
    /// As [`Options::appendonly`], for the master and the replicas.
    pub appendonly: Option<Fsync>,
    /// `Some`: the master, the replicas and the sentinels all speak TLS only; replication and the sentinels'
    /// links too (`tls-replication yes`).
    pub tls: Option<ServerTls>,
}

impl Default for SentinelOptions {
    /// A master named `kmqd`, one replica, three sentinels with a quorum of 2, down after 1 s.
    fn default() -> SentinelOptions {
        SentinelOptions {
            master_name: "kmqd".to_string(),
            replicas: 1,
            sentinels: 3,
            quorum: 2,
            down_after_ms: 1000,
            failover_timeout_ms: 5000,
            appendonly: None,
            tls: None,
        }
    }
}

/// A running Sentinel deployment of our own. Dropping it kills every process.
pub struct SentinelSetup {
    /// The master and the replicas, in the order they were started (the first master first). Roles change
    /// with failovers; addresses do not.
    servers: Vec<RedisServer>,
    sentinels: Vec<RedisServer>,
    options: SentinelOptions,
    /// The address of the master [`SentinelSetup::kill_master`] killed last: what
    /// [`SentinelSetup::wait_failover`] waits for a replacement of.
    killed: Option<String>,
}

impl SentinelSetup {
    /// Starts the master, then its replicas (once each is in sync), then the sentinels, and waits until every
    /// sentinel reports the master, `options.replicas` replicas and the other `options.sentinels - 1`
    /// sentinels.
    pub fn start(options: SentinelOptions) -> Result<SentinelSetup, String> {
        if options.sentinels == 0 || options.quorum == 0 || options.quorum > options.sentinels {
            return Err(format!(
                "a quorum of {} among {} sentinels cannot work",
                options.quorum, options.sentinels
            ));
        }
        let (appendonly, tls) = (options.appendonly, options.tls.clone());
        let data_node = |extra: &[String]| {
            let mut extra_args: Vec<String> = [
                // Redis 7 makes a new replica's first sync wait 5 s for more replicas to share it.
                "--repl-diskless-sync-delay",
                "0",
                // A master shutting down waits this long (default 10 s) for its replicas to catch up: less
                // than RedisServer's patience for a stop, so a stop with a replica down still succeeds.
                "--shutdown-timeout",
                "2",
            ]
            .map(String::from)
            .to_vec();
            extra_args.extend_from_slice(extra);
            RedisServer::start_with(Options {
                listen: Listen::Loopback,
                appendonly,
                debug_command: false,
                tls: tls.clone(),
                clock_shift: false,
                extra_args,
            })
        };
        let master = data_node(&[])?;
        let master_port = master.port().expect("listens on TCP").to_string();
        let mut setup = SentinelSetup {
            servers: vec![master],
            sentinels: Vec::new(),
            options,
            killed: None,
        };
        for _ in 0..setup.options.replicas {
            let replica = data_node(&[
                "--replicaof".to_string(),
                "127.0.0.1".to_string(),
                master_port.clone(),
            ])?;
            setup.servers.push(replica);
        }
        // A sentinel learns of the replicas from the master's INFO, which it reads at once and then every 10 s:
        // replicas not yet attached when it first asks would be missing for 10 s.
        setup.wait("the replicas to be in sync", |setup| {
            for replica in &setup.servers[1..] {
                in_sync(replica)?;
            }
            Ok(())
        })?;
        let name = &setup.options.master_name;
        let config = format!(
            "sentinel monitor {name} 127.0.0.1 {master_port} {quorum}\n\
             sentinel down-after-milliseconds {name} {down_after}\n\
             sentinel failover-timeout {name} {failover_timeout}\n\
             sentinel parallel-syncs {name} 1\n",
            quorum = setup.options.quorum,
            down_after = setup.options.down_after_ms,
            failover_timeout = setup.options.failover_timeout_ms,
        );
        for _ in 0..setup.options.sentinels {
            let sentinel = RedisServer::start_configured(
                Options {
                    listen: Listen::Loopback,
                    appendonly: None,
                    debug_command: false,
                    tls: setup.options.tls.clone(),
                    clock_shift: false,
                    extra_args: vec!["--sentinel".to_string()],
                },
                Some(&config),
            )?;
            setup.sentinels.push(sentinel);
        }
        setup.wait_healthy()?;
        Ok(setup)
    }

    /// Waits until every running sentinel reports the same master, which answers `ROLE` as a master and is
    /// not flagged down, with every running replica in sync with it, and knows every other running sentinel.
    pub fn wait_healthy(&self) -> Result<(), String> {
        self.wait("the sentinels to agree on a healthy master", |setup| {
            let master = setup.agreed_master()?;
            let running_replicas = setup
                .servers
                .iter()
                .filter(|server| server.is_running() && server.addr().as_ref() != Some(&master))
                .collect::<Vec<_>>();
            let running_sentinels = setup.sentinels.iter().filter(|s| s.is_running()).count();
            for sentinel in setup.sentinels.iter().filter(|s| s.is_running()) {
                let state = setup.master_state(sentinel)?;
                let field = |name: &str| state.get(name).map(String::as_str).unwrap_or("");
                for (name, wanted) in [
                    ("flags", "master".to_string()),
                    ("num-other-sentinels", (running_sentinels - 1).to_string()),
                ] {
                    if field(name) != wanted {
                        return Err(format!(
                            "sentinel {} reports {name} {:?}, not {wanted:?}",
                            name_of(sentinel),
                            field(name)
                        ));
                    }
                }
                // Every running replica known and not flagged down (the list also holds replicas that are
                // gone, an old master among them: a sentinel forgets nobody).
                let replicas: Vec<Vec<String>> =
                    sentinel.query_as(&["SENTINEL", "REPLICAS", &setup.options.master_name])?;
                for replica in &running_replicas {
                    let replica = name_of(replica);
                    let seen = replicas.iter().any(|fields| {
                        let map = pairs(fields);
                        map.get("name") == Some(&replica)
                            && map.get("flags").map(String::as_str) == Some("slave")
                    });
                    if !seen {
                        return Err(format!(
                            "sentinel {} does not list {replica} as a healthy replica: {replicas:?}",
                            name_of(sentinel)
                        ));
                    }
                }
            }
            for replica in running_replicas {
                in_sync(replica)?;
                let replication = replica.query_as::<String>(&["INFO", "replication"])?;
                let (host, port) = master.rsplit_once(':').expect("addresses are HOST:PORT");
                for wanted in [format!("master_host:{host}"), format!("master_port:{port}")] {
                    if !replication.lines().any(|line| line.trim() == wanted) {
                        return Err(format!("replica {} does not report {wanted}", name_of(replica)));
                    }
                }
            }
            Ok(())
        })
    }

    /// The master's address every running sentinel gives (`SENTINEL GET-MASTER-ADDR-BY-NAME`), once that
    /// server answers `ROLE` as a master.
    fn agreed_master(&self) -> Result<String, String> {
        let mut agreed: Option<String> = None;
        for sentinel in self.sentinels.iter().filter(|s| s.is_running()) {
            let addr = self.master_addr_from(sentinel)?;
            match &agreed {
                Some(first) if first != &addr => {
                    return Err(format!(
                        "sentinels disagree on the master: {first} and {addr} ({})",
                        name_of(sentinel)
                    ));
                }
                _ => agreed = Some(addr),
            }
        }
        let addr = agreed.ok_or("no sentinel is running")?;
        let server = self
            .server(&addr)
            .ok_or_else(|| format!("the sentinels name {addr}, none of our servers"))?;
        let role = role(server)?;
        if role != "master" {
            return Err(format!("the sentinels name {addr}, whose ROLE is {role}"));
        }
        Ok(addr)
    }

    fn master_addr_from(&self, sentinel: &RedisServer) -> Result<String, String> {
        let reply: Option<(String, String)> = sentinel.query_as(&[
            "SENTINEL",
            "GET-MASTER-ADDR-BY-NAME",
            &self.options.master_name,
        ])?;
        let (host, port) = reply.ok_or_else(|| {
            format!(
                "sentinel {} does not know {}",
                name_of(sentinel),
                self.options.master_name
            )
        })?;
        Ok(format!("{host}:{port}"))
    }

    /// `SENTINEL MASTER NAME` as `sentinel` answers it: field to value.
    fn master_state(&self, sentinel: &RedisServer) -> Result<HashMap<String, String>, String> {
        let fields: Vec<String> =
            sentinel.query_as(&["SENTINEL", "MASTER", &self.options.master_name])?;
        Ok(pairs(&fields))
    }

    /// Polls `check` with the deployment's patience; a timeout's error ends with the tail of every log.
    fn wait(
        &self,
        what: &str,
        mut check: impl FnMut(&SentinelSetup) -> Result<(), String>,
    ) -> Result<(), String> {
        let within = PATIENCE
            + Duration::from_millis(
                self.options.down_after_ms + 2 * self.options.failover_timeout_ms,
            );
        wait_until(within, what, || check(self)).map_err(|error| self.with_logs(error))
    }

    /// `error` followed by the last lines of every process's log.
    fn with_logs(&self, error: String) -> String {
        let mut text = error;
        let all = self
            .servers
            .iter()
            .map(|s| ("redis-server", s))
            .chain(self.sentinels.iter().map(|s| ("sentinel", s)));
        for (kind, server) in all {
            text.push_str(&format!(
                "\n--- log of {kind} {} (pid {}, {}):\n{}",
                name_of(server),
                server.pid(),
                if server.is_running() {
                    "running"
                } else {
                    "stopped"
                },
                server.log_tail(15)
            ));
        }
        text
    }

    /// The name the sentinels know the master by.
    pub fn master_name(&self) -> &str {
        &self.options.master_name
    }

    /// The sentinels' URLs: `redis://127.0.0.1:PORT`, or `rediss://localhost:PORT` with TLS (no database: a
    /// sentinel has none to SELECT).
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|sentinel| {
                let port = sentinel.port().expect("sentinels listen on TCP");
                if sentinel.tls().is_some() {
                    format!("rediss://localhost:{port}")
                } else {
                    format!("redis://127.0.0.1:{port}")
                }
            })
            .collect()
    }

    /// The master's address (`127.0.0.1:PORT`) as the first running sentinel that answers gives it.
    pub fn master_addr(&self) -> Result<String, String> {
        let mut last = "no sentinel is running".to_string();
        for sentinel in self.sentinels.iter().filter(|s| s.is_running()) {
            match self.master_addr_from(sentinel) {
                Ok(addr) => return Ok(addr),
                Err(error) => last = error,
            }
        }
        Err(last)
    }

    /// The master's server (see [`SentinelSetup::master_addr`]).
    pub fn master(&self) -> Result<&RedisServer, String> {
        let addr = self.master_addr()?;
        self.server(&addr)
            .ok_or_else(|| format!("the sentinels name {addr}, none of our servers"))
    }

    /// Our master or replica at `addr` (`127.0.0.1:PORT`).
    pub fn server(&self, addr: &str) -> Option<&RedisServer> {
        self.servers
            .iter()
            .find(|server| server.addr().as_deref() == Some(addr))
    }

    /// As [`SentinelSetup::server`], to stop or restart it yourself. A replica restarted keeps its
    /// `--replicaof` of the first master; an old master restarted comes back as a master until the sentinels
    /// convert it (Redis waits 8 s before it does).
    pub fn server_mut(&mut self, addr: &str) -> Option<&mut RedisServer> {
        self.servers
            .iter_mut()
            .find(|server| server.addr().as_deref() == Some(addr))
    }

    /// The master and the replicas, in the order they were started (the first master first).
    pub fn servers(&self) -> &[RedisServer] {
        &self.servers
    }

    /// The sentinels.
    pub fn sentinels(&self) -> &[RedisServer] {
        &self.sentinels
    }

    /// The sentinels, to stop or pause some.
    pub fn sentinels_mut(&mut self) -> &mut [RedisServer] {
        &mut self.sentinels
    }

    /// Ends the current master with `signal` (see [`RedisServer::stop`]) and returns its address, remembered
    /// for [`SentinelSetup::wait_failover`].
    pub fn kill_master(&mut self, signal: Signal) -> Result<String, String> {
        let addr = self.master_addr()?;
        self.server_mut(&addr)
            .ok_or_else(|| format!("the sentinels name {addr}, none of our servers"))?
            .stop(signal)?;
        self.killed = Some(addr.clone());
        Ok(addr)
    }

    /// Waits until every running sentinel names a new master in place of the one
    /// [`SentinelSetup::kill_master`] killed last, and that server answers `ROLE` as a master; returns its
    /// address.
    pub fn wait_failover(&self) -> Result<String, String> {
        let killed = self
            .killed
            .as_ref()
            .ok_or("wait_failover without kill_master")?;
        let mut promoted = None;
        self.wait(&format!("the sentinels to replace {killed}"), |setup| {
            let addr = setup.agreed_master()?;
            if &addr == killed {
                return Err(format!("the sentinels still name {killed}"));
            }
            promoted = Some(addr);
            Ok(())
        })?;
        Ok(promoted.expect("set when the wait succeeded"))
    }
}

/// A sentinel's flat `[name, value, name, value, ...]` reply as a map.
fn pairs(fields: &[String]) -> HashMap<String, String> {
    fields
        .chunks(2)
        .filter_map(|pair| match pair {
            [name, value] => Some((name.clone(), value.clone())),
            _ => None,
        })
        .collect()
}

/// The first field of `ROLE`: `master`, `slave` or `sentinel`.
fn role(server: &RedisServer) -> Result<String, String> {
    match server.query(&["ROLE"])? {
        redis::Value::Array(fields) if !fields.is_empty() => {
            redis::from_redis_value_ref::<String>(&fields[0])
                .map_err(|e| format!("{}: ROLE: {e}", name_of(server)))
        }
        other => Err(format!("{}: ROLE answered {other:?}", name_of(server))),
    }
}

/// `Ok` once `replica` reports its link to its master up and no sync in progress.
fn in_sync(replica: &RedisServer) -> Result<(), String> {
    let replication = replica.query_as::<String>(&["INFO", "replication"])?;
    for wanted in ["master_link_status:up", "master_sync_in_progress:0"] {
        if !replication.lines().any(|line| line.trim() == wanted) {
            return Err(format!(
                "replica {} does not report {wanted}",
                name_of(replica)
            ));
        }
    }
    Ok(())
}

fn name_of(server: &RedisServer) -> String {
    server.addr().expect("every server here listens on TCP")
}

impl Drop for SentinelSetup {
    fn drop(&mut self) {
        // The sentinels first, so that none of them starts a failover while the servers go.
        for server in self.sentinels.iter_mut().chain(self.servers.iter_mut()) {
            let _ = server.stop(Signal::Kill);
        }
    }
}
