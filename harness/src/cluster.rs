//! A private Redis Cluster for tests and benchmarks: a [`RedisServer`] per node, each in its own temp dir on
//! a free loopback port, all killed when the [`Cluster`] is dropped.
//!
//! kmqd keeps every key of a queue under one hash tag (`PREFIX:{QUEUE}:...`) so that each queue lives on one
//! master; what has to be tested against a real cluster is what happens around that: queues spread over
//! several masters, a master that dies and is replaced by its replica, a queue's slot that migrates while the
//! queue is busy. [`Cluster::start`] forms a cluster (masters, each with its replicas) and returns once every
//! node agrees on it; [`Cluster::kill_master`] and [`Cluster::wait_failover`] fail a master over;
//! [`Cluster::restart_node`] brings a node back; [`Cluster::reshard_slot`] moves one chosen slot, keys and
//! all, and can run in a thread while clients keep writing to that slot (it is a `&self` method; put the
//! cluster in [`std::thread::scope`]). [`queue_names_on_distinct_masters`](Cluster::queue_names_on_distinct_masters)
//! and [`key_slot`] say where a queue lands.
//!
//! The cluster is formed by hand (`CLUSTER ADDSLOTSRANGE`, `SET-CONFIG-EPOCH`, `MEET`, `REPLICATE`) rather
//! than with `redis-cli --cluster create`, which sleeps a whole second between its checks: every step here is
//! a poll with a deadline, and the cluster of 3 masters and 3 replicas is up in about two seconds. Those two
//! seconds are Redis's own: a master does not report `cluster_state:ok` until 2 s after it started
//! (`CLUSTER_WRITABLE_DELAY`, so that a restarted master gets a chance to learn it was replaced). With TLS it
//! takes a few seconds more, every check of the harness being a `redis-cli` process and a TLS handshake.
//!
//! Each node's bus port is its port + 10000 (Redis's default): the nodes' ports are picked below the kernel's
//! ephemeral range by 10000 or more, so that neither the port nor the bus port is a port the kernel may hand
//! to an outgoing connection or to another test's `Listen::Loopback` server.

use std::collections::{BTreeMap, HashSet};
use std::hash::BuildHasher;
use std::ops::RangeInclusive;
use std::sync::Mutex;
use std::time::Duration;

use super::{Fsync, Listen, Options, RedisServer, ServerTls, Signal, wait_until};

/// The number of hash slots of a Redis Cluster.
pub const SLOTS: u16 = 16384;

/// How long forming the cluster, or agreeing again after a change, may take beyond the node timeouts the
/// cluster itself waits out (a failure is only noticed after a node timeout; a replica waits up to a second
/// more before it asks for votes).
const PATIENCE: Duration = Duration::from_secs(15);

/// How many keys one `MIGRATE` of [`Cluster::reshard_slot`] moves.
const MIGRATE_BATCH: usize = 100;

/// Who serves which slots, as one node sees it: the first slot of each range, to its last slot and the
/// address of its master.
type SlotMap = BTreeMap<u16, (u16, String)>;

/// What one node says of the cluster, as [`Cluster::wait_healthy`] compares the nodes' views: its address, the
/// slot map, and each running node's address with whether it is a master.
type NodeView = (String, SlotMap, Vec<(String, bool)>);

/// How to start a cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterOptions {
    /// At least 1; a failover needs a majority of masters alive, so tests that kill one start 3.
    pub masters: usize,
    /// Replicas of each master (0 for a cluster without failover).
    pub replicas_per_master: usize,
    /// `cluster-node-timeout`: how long a node is unreachable before it counts as failed. Small values make
    /// failovers fast; below a few hundred milliseconds a busy test machine makes them spurious.
    pub node_timeout_ms: u64,
    /// As [`Options::appendonly`], for every node.
    pub appendonly: Option<Fsync>,
    /// `Some`: every node speaks TLS only, the cluster bus and replication included; [`Cluster::seeds`] are
    /// then `rediss://localhost:PORT`.
    pub tls: Option<ServerTls>,
}

impl Default for ClusterOptions {
    /// Three masters with a replica each, a one-second node timeout, no persistence, no TLS.
    fn default() -> ClusterOptions {
        ClusterOptions {
            masters: 3,
            replicas_per_master: 1,
            node_timeout_ms: 1000,
            appendonly: None,
            tls: None,
        }
    }
}

/// Whether a node serves slots or copies a master.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Master,
    Replica,
}

/// One node as a node of the cluster sees it (a line of `CLUSTER NODES`), with its process if it is ours and
/// running.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterNode {
    /// The node id (40 hex digits), stable across restarts (it is in the node's `nodes.conf`).
    pub id: String,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// `redis://127.0.0.1:PORT`, or `rediss://localhost:PORT` with TLS.
    pub url: String,
    pub role: Role,
    /// A replica's master.
    pub master_id: Option<String>,
    /// The slots a master serves, as ranges.
    pub slots: Vec<RangeInclusive<u16>>,
    /// The node is flagged `fail` (the cluster agreed it is down) or `fail?` (this viewer thinks so).
    pub failing: bool,
    /// All its flags: `myself`, `master`, `slave`, `fail?`, `fail`, `handshake`, `noaddr`, `nofailover`, ...
    pub flags: Vec<String>,
    /// The viewer's link to it is up (the `link-state` field: `connected`).
    pub connected: bool,
    /// The pid of our redis-server at that address, `None` if it is not running.
    pub pid: Option<u32>,
}

impl ClusterNode {
    /// Whether this node serves `slot`.
    pub fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|range| range.contains(&slot))
    }
}

/// A running cluster of our own. Dropping it kills every node.
pub struct Cluster {
    /// One server per node, in the order they were started: the masters first, then the replicas (master 0's,
    /// master 1's, ...). Roles change with failovers; addresses do not.
    servers: Vec<RedisServer>,
    options: ClusterOptions,
    /// The master [`Cluster::kill_master`] killed last, as the cluster saw it then: what
    /// [`Cluster::wait_failover`] waits for a replacement of.
    killed: Option<ClusterNode>,
}

impl Cluster {
    /// Starts `options.masters * (1 + options.replicas_per_master)` nodes, forms the cluster, and waits until
    /// every node reports `cluster_state:ok` with all 16384 slots served, every node sees every other, and
    /// every replica is in sync with its master.
    pub fn start(options: ClusterOptions) -> Result<Cluster, String> {
        if options.masters == 0 || options.masters > usize::from(SLOTS) {
            return Err(format!(
                "a cluster needs 1 to {SLOTS} masters, not {}",
                options.masters
            ));
        }
        let count = options.masters * (1 + options.replicas_per_master);
        let mut servers = Vec::with_capacity(count);
        for _ in 0..count {
            servers.push(start_node(&options)?);
        }
        let mut cluster = Cluster {
            servers,
            options,
            killed: None,
        };
        cluster.form()?;
        Ok(cluster)
    }

    fn form(&mut self) -> Result<(), String> {
        let masters = self.options.masters;
        let ids = self
            .servers
            .iter()
            .map(|server| server.query_as::<String>(&["CLUSTER", "MYID"]))
            .collect::<Result<Vec<String>, String>>()?;
        // Distinct config epochs from the start: otherwise the masters resolve their collision one bump at a
        // time, which delays agreement.
        for (epoch, server) in self.servers.iter().enumerate() {
            server.query(&["CLUSTER", "SET-CONFIG-EPOCH", &(epoch + 1).to_string()])?;
        }
        for (index, server) in self.servers[..masters].iter().enumerate() {
            let range = slot_range(index, masters);
            server.query(&[
                "CLUSTER",
                "ADDSLOTSRANGE",
                &range.start().to_string(),
                &range.end().to_string(),
            ])?;
        }
        let first = &self.servers[0];
        for server in &self.servers[1..] {
            let port = server
                .port()
                .expect("cluster nodes listen on TCP")
                .to_string();
            first.query(&["CLUSTER", "MEET", "127.0.0.1", &port])?;
        }
        self.wait_all("every node to know every other", |cluster| {
            for server in cluster.running() {
                let nodes = cluster.view(server)?;
                let joined = nodes
                    .iter()
                    .filter(|node| {
                        node.connected
                            && !node.flags.iter().any(|f| f == "handshake" || f == "noaddr")
                    })
                    .count();
                if joined != cluster.servers.len() {
                    return Err(format!(
                        "{} knows {joined} of {} nodes",
                        addr(server),
                        cluster.servers.len()
                    ));
                }
            }
            Ok(())
        })?;
        for (offset, server) in self.servers[masters..].iter().enumerate() {
            let master = &ids[offset / self.options.replicas_per_master.max(1)];
            server.query(&["CLUSTER", "REPLICATE", master])?;
        }
        self.wait_healthy()
    }

    /// Waits (the node timeout a few times over, plus 15 s) until the cluster is healthy from every running
    /// node's point of view: `cluster_state:ok`; all slots served, by running masters that every node agrees
    /// on and none flags as failing; every running node known to every other and not flagged as failing; every
    /// running replica attached to a running master and in sync with it.
    pub fn wait_healthy(&self) -> Result<(), String> {
        self.wait_all("the cluster to be healthy", |cluster| {
            cluster.healthy().map(|_| ())
        })
    }

    /// One check of [`Cluster::wait_healthy`]; the agreed slot map when it holds.
    fn healthy(&self) -> Result<SlotMap, String> {
        let mut agreed: Option<NodeView> = None;
        let running_addrs: HashSet<String> = self.running().map(addr).collect();
        for server in self.running() {
            let me = addr(server);
            let info = server.query_as::<String>(&["CLUSTER", "INFO"])?;
            for wanted in ["cluster_state:ok", "cluster_slots_ok:16384"] {
                if !info.lines().any(|line| line.trim() == wanted) {
                    let state: Vec<&str> = info
                        .lines()
                        .map(str::trim)
                        .filter(|line| {
                            line.starts_with("cluster_state:") || line.starts_with("cluster_slots_")
                        })
                        .collect();
                    return Err(format!("{me} reports {}", state.join(", ")));
                }
            }
            let nodes = self.view(server)?;
            for node in &nodes {
                if running_addrs.contains(&node.addr) && node.failing {
                    return Err(format!("{me} flags {} as failing", node.addr));
                }
            }
            for addr in &running_addrs {
                if !nodes.iter().any(|node| &node.addr == addr) {
                    return Err(format!("{me} does not know {addr}"));
                }
            }
            let mut slots = BTreeMap::new();
            for node in nodes.iter().filter(|node| !node.slots.is_empty()) {
                if node.role != Role::Master || node.failing || node.pid.is_none() {
                    return Err(format!(
                        "{me} sees slots {:?} on {} (role {:?}, failing: {}, running: {})",
                        node.slots,
                        node.addr,
                        node.role,
                        node.failing,
                        node.pid.is_some()
                    ));
                }
                for range in &node.slots {
                    slots.insert(*range.start(), (*range.end(), node.addr.clone()));
                }
            }
            // Roles too: a view that still has a fresh replica as a master (gossip not yet round) would send
            // it a master's command (a reshard's `SETSLOT NODE`, refused "only with masters").
            let mut roles: Vec<(String, bool)> = nodes
                .iter()
                .filter(|node| running_addrs.contains(&node.addr))
                .map(|node| (node.addr.clone(), node.role == Role::Master))
                .collect();
            roles.sort();
            match &agreed {
                None => agreed = Some((me.clone(), slots, roles)),
                Some((first, theirs, _)) if theirs != &slots => {
                    return Err(format!(
                        "{me} and {first} disagree on the slots: {slots:?} against {theirs:?}"
                    ));
                }
                Some((first, _, their_roles)) if their_roles != &roles => {
                    return Err(format!(
                        "{me} and {first} disagree on who is a master: {roles:?} against {their_roles:?}"
                    ));
                }
                Some(_) => {}
            }
            let own = nodes
                .iter()
                .find(|node| node.addr == me)
                .ok_or_else(|| format!("{me} is not in its own CLUSTER NODES"))?;
            if own.role == Role::Replica {
                let replication = server.query_as::<String>(&["INFO", "replication"])?;
                for wanted in ["master_link_status:up", "master_sync_in_progress:0"] {
                    if !replication.lines().any(|line| line.trim() == wanted) {
                        return Err(format!("replica {me} does not report {wanted}"));
                    }
                }
                let master = own.master_id.as_deref().unwrap_or("-");
                if !nodes.iter().any(|node| {
                    node.id == master && node.role == Role::Master && node.pid.is_some()
                }) {
                    return Err(format!(
                        "replica {me} follows {master}, not a running master"
                    ));
                }
            }
        }
        let (_, slots, _) = agreed.ok_or("no node of the cluster is running")?;
        let mut next = 0u32;
        for (start, (end, _)) in &slots {
            if u32::from(*start) != next {
                return Err(format!("slot {next} is served by nobody"));
            }
            next = u32::from(*end) + 1;
        }
        if next != u32::from(SLOTS) {
            return Err(format!("slot {next} is served by nobody"));
        }
        Ok(slots)
    }

    /// Polls `check` with the cluster's patience; a timeout's error ends with the tail of every node's log.
    fn wait_all(
        &self,
        what: &str,
        mut check: impl FnMut(&Cluster) -> Result<(), String>,
    ) -> Result<(), String> {
        let within = PATIENCE + Duration::from_millis(self.options.node_timeout_ms * 4);
        wait_until(within, what, || check(self)).map_err(|error| self.with_logs(error))
    }

    /// `error` followed by the last lines of every node's log.
    fn with_logs(&self, error: String) -> String {
        let mut text = error;
        for server in &self.servers {
            text.push_str(&format!(
                "\n--- log of {} (pid {}, {}):\n{}",
                addr(server),
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

    fn running(&self) -> impl Iterator<Item = &RedisServer> {
        self.servers.iter().filter(|server| server.is_running())
    }

    /// `server`'s `CLUSTER NODES`, parsed, with our pids filled in.
    fn view(&self, server: &RedisServer) -> Result<Vec<ClusterNode>, String> {
        let text = server.query_as::<String>(&["CLUSTER", "NODES"])?;
        let tls = self.options.tls.is_some();
        text.lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| {
                let mut node = parse_node(line, tls)?;
                node.pid = self
                    .servers
                    .iter()
                    .find(|s| s.is_running() && addr(s) == node.addr)
                    .map(RedisServer::pid);
                Ok(node)
            })
            .collect()
    }

    /// Every node, as the first running node that answers sees them (after [`Cluster::wait_healthy`], every
    /// node sees the same). In the order of `CLUSTER NODES`, which is arbitrary: sort by what matters.
    pub fn nodes(&self) -> Result<Vec<ClusterNode>, String> {
        let mut last = "no node of the cluster is running".to_string();
        for server in self.running() {
            match self.view(server) {
                Ok(nodes) => return Ok(nodes),
                Err(error) => last = error,
            }
        }
        Err(last)
    }

    /// The masters that serve slots, ordered by their first slot.
    pub fn masters(&self) -> Result<Vec<ClusterNode>, String> {
        let mut masters: Vec<ClusterNode> = self
            .nodes()?
            .into_iter()
            .filter(|node| node.role == Role::Master && !node.slots.is_empty())
            .collect();
        masters.sort_by_key(|node| *node.slots[0].start());
        Ok(masters)
    }

    /// The replicas of the master with id `master_id`.
    pub fn replicas_of(&self, master_id: &str) -> Result<Vec<ClusterNode>, String> {
        Ok(self
            .nodes()?
            .into_iter()
            .filter(|node| node.master_id.as_deref() == Some(master_id))
            .collect())
    }

    /// The master serving `slot`.
    pub fn master_for_slot(&self, slot: u16) -> Result<ClusterNode, String> {
        self.masters()?
            .into_iter()
            .find(|node| node.serves(slot))
            .ok_or_else(|| format!("no master serves slot {slot}"))
    }

    /// The master serving `key` (its slot: [`key_slot`]).
    pub fn master_for_key(&self, key: &str) -> Result<ClusterNode, String> {
        self.master_for_slot(key_slot(key.as_bytes()))
    }

    /// URLs of the masters, to seed a cluster client: `redis://127.0.0.1:PORT`, or `rediss://localhost:PORT`
    /// with TLS.
    pub fn seeds(&self) -> Result<Vec<String>, String> {
        Ok(self.masters()?.into_iter().map(|node| node.url).collect())
    }

    /// For each master (in the order of [`Cluster::masters`]), `per_master` queue names `q-N` whose hash tag
    /// `{q-N}` (kmqd's keys are `PREFIX:{QUEUE}:...`) falls in that master's slots.
    pub fn queue_names_on_distinct_masters(
        &self,
        per_master: usize,
    ) -> Result<Vec<(ClusterNode, Vec<String>)>, String> {
        let mut masters: Vec<(ClusterNode, Vec<String>)> = self
            .masters()?
            .into_iter()
            .map(|node| (node, Vec::new()))
            .collect();
        let mut n = 0u64;
        while masters.iter().any(|(_, names)| names.len() < per_master) {
            let name = format!("q-{n}");
            let slot = key_slot(name.as_bytes());
            if let Some((_, names)) = masters.iter_mut().find(|(node, _)| node.serves(slot)) {
                if names.len() < per_master {
                    names.push(name);
                }
            }
            n += 1;
        }
        Ok(masters)
    }

    /// Our server at `addr` (`127.0.0.1:PORT`): to pause it, read its log, query it.
    pub fn server(&self, addr: &str) -> Option<&RedisServer> {
        self.servers
            .iter()
            .find(|server| self::addr(server) == addr)
    }

    /// As [`Cluster::server`], to stop or restart it yourself.
    pub fn server_mut(&mut self, addr: &str) -> Option<&mut RedisServer> {
        self.servers
            .iter_mut()
            .find(|server| self::addr(server) == addr)
    }

    /// Every node's server, in the order they were started (masters first, then replicas).
    pub fn servers(&self) -> &[RedisServer] {
        &self.servers
    }

    /// Ends the master at `addr` with `signal` (see [`RedisServer::stop`]); returns it as the cluster saw it
    /// just before, and remembers it for [`Cluster::wait_failover`].
    pub fn kill_master(&mut self, addr: &str, signal: Signal) -> Result<ClusterNode, String> {
        let master = self
            .nodes()?
            .into_iter()
            .find(|node| node.addr == addr)
            .ok_or_else(|| format!("{addr} is not a node of the cluster"))?;
        if master.role != Role::Master || master.slots.is_empty() {
            return Err(format!("{addr} is not a master serving slots: {master:?}"));
        }
        self.server_mut(addr)
            .expect("every node of the cluster is one of our servers")
            .stop(signal)?;
        self.killed = Some(master.clone());
        Ok(master)
    }

    /// Waits until a replica of the master [`Cluster::kill_master`] killed last has taken over its slots and the
    /// cluster is healthy again ([`Cluster::wait_healthy`]) from every running node's point of view; returns
    /// the new master.
    pub fn wait_failover(&self) -> Result<ClusterNode, String> {
        let killed = self
            .killed
            .as_ref()
            .ok_or("wait_failover without kill_master")?;
        let slot = *killed.slots[0].start();
        let mut promoted = None;
        self.wait_all(
            &format!("a replica of {} to take over its slots", killed.addr),
            |cluster| {
                cluster.healthy()?;
                let owner = cluster.master_for_slot(slot)?;
                if owner.id == killed.id {
                    return Err(format!("{} still serves slot {slot}", killed.addr));
                }
                if owner.slots != killed.slots {
                    return Err(format!(
                        "{} serves {:?}, the killed master served {:?}",
                        owner.addr, owner.slots, killed.slots
                    ));
                }
                promoted = Some(owner);
                Ok(())
            },
        )?;
        Ok(promoted.expect("set when the wait succeeded"))
    }

    /// Starts the node at `addr` again on its directory and port (a running one is first stopped with
    /// SIGTERM) and waits until the cluster is healthy with it: a master that lost its slots to a failover
    /// comes back as a replica of its replacement.
    pub fn restart_node(&mut self, addr: &str) -> Result<(), String> {
        self.server_mut(addr)
            .ok_or_else(|| format!("{addr} is not a node of the cluster"))?
            .restart()?;
        self.wait_healthy()
    }

    /// Moves `slot`, with its keys, to the master at `to` while the cluster serves it, as `redis-cli --cluster
    /// reshard` does but for this slot: `SETSLOT IMPORTING` on the target and `MIGRATING` on the source, then
    /// `MIGRATE` in batches of 100 keys until the source has none, then `SETSLOT NODE` on the target, the source
    /// and every other master; returns once every running node sees `to` serving the slot, with the number of
    /// keys moved. Meanwhile clients that follow `ASK` and `MOVED` redirections keep working: a key not yet
    /// moved is served by the source, a new or moved one by the target. Keys must be UTF-8 (kmqd's are).
    pub fn reshard_slot(&self, slot: u16, to: &str) -> Result<usize, String> {
        if slot >= SLOTS {
            return Err(format!("slot {slot} is not below {SLOTS}"));
        }
        let nodes = self.nodes()?;
        let source = nodes
            .iter()
            .find(|node| node.role == Role::Master && node.serves(slot))
            .ok_or_else(|| format!("no master serves slot {slot}"))?;
        let target = nodes
            .iter()
            .find(|node| node.addr == to && node.role == Role::Master)
            .ok_or_else(|| format!("{to} is not a master of the cluster"))?;
        if source.id == target.id {
            return Ok(0);
        }
        let server = |node: &ClusterNode| {
            self.server(&node.addr)
                .ok_or_else(|| format!("{} is not one of our servers", node.addr))
        };
        let (from, into) = (server(source)?, server(target)?);
        let slot_arg = slot.to_string();
        into.query(&["CLUSTER", "SETSLOT", &slot_arg, "IMPORTING", &source.id])?;
        from.query(&["CLUSTER", "SETSLOT", &slot_arg, "MIGRATING", &target.id])?;
        let (host, port) = target
            .addr
            .rsplit_once(':')
            .expect("addresses are HOST:PORT");
        let batch = MIGRATE_BATCH.to_string();
        let mut moved = 0;
        loop {
            let keys: Vec<String> =
                from.query_as(&["CLUSTER", "GETKEYSINSLOT", &slot_arg, &batch])?;
            if keys.is_empty() {
                break;
            }
            // No REPLACE: the target cannot hold a key the source still has (a write to a key the source lacks
            // is redirected to the target), so a BUSYKEY would be a bug worth seeing.
            let mut args = vec!["MIGRATE", host, port, "", "0", "2000", "KEYS"];
            args.extend(keys.iter().map(String::as_str));
            from.query(&args)?;
            moved += keys.len();
        }
        // The target first: once it owns the slot, it bumps its epoch and the cluster takes its word.
        into.query(&["CLUSTER", "SETSLOT", &slot_arg, "NODE", &target.id])?;
        from.query(&["CLUSTER", "SETSLOT", &slot_arg, "NODE", &target.id])?;
        for node in &nodes {
            if node.role == Role::Master
                && !node.slots.is_empty()
                && node.id != source.id
                && node.id != target.id
                && node.pid.is_some()
            {
                server(node)?.query(&["CLUSTER", "SETSLOT", &slot_arg, "NODE", &target.id])?;
            }
        }
        self.wait_all(
            &format!("every node to see slot {slot} on {to}"),
            |cluster| {
                for server in cluster.running() {
                    let view = cluster.view(server)?;
                    let owner = view
                        .iter()
                        .find(|node| node.role == Role::Master && node.serves(slot));
                    match owner {
                        Some(owner) if owner.id == target.id => {}
                        other => {
                            return Err(format!(
                                "{} sees slot {slot} on {:?}",
                                addr(server),
                                other.map(|node| &node.addr)
                            ));
                        }
                    }
                }
                Ok(())
            },
        )?;
        Ok(moved)
    }
}

/// The slot of `key`: CRC16 (XMODEM) of its hash tag (the text between the first `{` and the next `}`, if
/// not empty) or else of the whole key, modulo 16384. kmqd's keys `PREFIX:{QUEUE}:...` all fall in the slot
/// of `QUEUE`.
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16(hashed) % SLOTS
}

/// CRC16/XMODEM (polynomial 0x1021, initial value 0), as Redis Cluster hashes keys.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc = 0u16;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The slots of master `index` of `masters`: equal shares, the remainder spread over the first ones.
fn slot_range(index: usize, masters: usize) -> RangeInclusive<u16> {
    let slots = usize::from(SLOTS);
    let start = index * slots / masters;
    let end = (index + 1) * slots / masters - 1;
    // Both are below SLOTS, so they fit.
    start as u16..=end as u16
}

/// A node's address for comparison with `CLUSTER NODES` (cluster nodes always listen on TCP).
fn addr(server: &RedisServer) -> String {
    server.addr().expect("cluster nodes listen on TCP")
}

/// Parses one line of `CLUSTER NODES`: `ID IP:PORT@BUSPORT[,HOSTNAME] FLAGS MASTER PING PONG EPOCH LINK SLOT...`.
fn parse_node(line: &str, tls: bool) -> Result<ClusterNode, String> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.len() < 8 {
        return Err(format!("not a CLUSTER NODES line: {line:?}"));
    }
    // A node met but not yet handshaken has no address yet (`:0@0`): "?" never matches one of ours.
    let address = fields[1].split(['@', ',']).next().unwrap_or("");
    let address = if address.starts_with(':') || address.ends_with(":0") {
        "?".to_string()
    } else {
        address.to_string()
    };
    let flags: Vec<&str> = fields[2].split(',').collect();
    let role = if flags.contains(&"slave") {
        Role::Replica
    } else {
        Role::Master
    };
    let mut slots = Vec::new();
    for field in &fields[8..] {
        // `[SLOT->-ID]` / `[SLOT-<-ID]`: a migration in progress, shown on the nodes taking part only.
        if field.starts_with('[') {
            continue;
        }
        let parse = |s: &str| {
            s.parse::<u16>()
                .map_err(|_| format!("bad slot {s:?} in CLUSTER NODES line {line:?}"))
        };
        let range = match field.split_once('-') {
            Some((start, end)) => parse(start)?..=parse(end)?,
            None => parse(field)?..=parse(field)?,
        };
        slots.push(range);
    }
    let port = address.rsplit_once(':').map(|(_, port)| port).unwrap_or("");
    Ok(ClusterNode {
        id: fields[0].to_string(),
        url: if tls {
            format!("rediss://localhost:{port}")
        } else {
            format!("redis://{address}")
        },
        addr: address,
        role,
        master_id: (fields[3] != "-").then(|| fields[3].to_string()),
        slots,
        failing: flags.contains(&"fail") || flags.contains(&"fail?"),
        flags: flags.iter().map(|flag| flag.to_string()).collect(),
        connected: fields[7] == "connected",
        pid: None,
    })
}

/// Starts one node on a fresh port pair, trying other ports when one turns out to be taken (between our check
/// and redis-server's bind, someone else may take it).
fn start_node(options: &ClusterOptions) -> Result<RedisServer, String> {
    let mut last = String::new();
    for _ in 0..5 {
        let port = cluster_port()?;
        let server = RedisServer::start_with(Options {
            listen: Listen::Port(port),
            appendonly: options.appendonly,
            debug_command: false,
            tls: options.tls.clone(),
            clock_shift: false,
            extra_args: [
                "--cluster-enabled",
                "yes",
                // Relative to the node's own `--dir`.
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                &options.node_timeout_ms.to_string(),
                // A replica may always replace its master, however long ago it last heard from it: a test
                // that kills a master must see a failover, not a cluster that stays down.
                "--cluster-replica-validity-factor",
                "0",
                // Redis 7 makes a new replica's first sync wait 5 s for more replicas to share it.
                "--repl-diskless-sync-delay",
                "0",
                // A master shutting down waits this long (default 10 s) for its replicas to catch up: less than
                // RedisServer's patience for a stop, so a stop with a replica down still succeeds.
                "--shutdown-timeout",
                "2",
            ]
            .map(String::from)
            .to_vec(),
        });
        match server {
            Ok(server) => return Ok(server),
            Err(error) if error.contains("Address already in use") => last = error,
            Err(error) => return Err(error),
        }
    }
    Err(format!(
        "no free port pair for a cluster node after 5 tries: {last}"
    ))
}

/// A port P such that P and P + 10000 (its cluster bus port) are free on 127.0.0.1 now and were never handed
/// out before by this process. Picked at random below the ephemeral range by 10000, so that the kernel hands
/// neither to an outgoing connection or a `Listen::Loopback` server meanwhile.
fn cluster_port() -> Result<u16, String> {
    static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let (low, high) = if ephemeral_low >= 10000 + 10000 + 1000 {
        (10000, ephemeral_low - 10000)
    } else {
        // An unusual ephemeral range: any port pair will do, collisions are retried.
        (20000, 55535)
    };
    let random = std::collections::hash_map::RandomState::new();
    let mut handed_out = HANDED_OUT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let handed_out = handed_out.get_or_insert_with(HashSet::new);
    for attempt in 0..1000u32 {
        let port =
            (low + random.hash_one((std::process::id(), attempt)) as u32 % (high - low)) as u16;
        let bus = port + 10000;
        if handed_out.contains(&port) || handed_out.contains(&bus) {
            continue;
        }
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(bus) {
            handed_out.insert(port);
            handed_out.insert(bus);
            return Ok(port);
        }
    }
    Err(format!(
        "no free port pair P, P+10000 with P in {low}..{high} after 1000 tries"
    ))
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Each RedisServer kills its process when dropped; kill them all first, so that no node spends its
        // last moments failing the others over.
        for server in &mut self.servers {
            let _ = server.stop(Signal::Kill);
        }
    }
}
