//! Connecting to Redis: a connector for each deployment (one Redis, a Sentinel-managed master, a Redis Cluster;
//! each with or without TLS), the pool, and a thread's own [`Session`].
//!
//! Every caller talks through [`Conn`], one type for a node connection and a cluster connection, so the daemon and
//! the CLI have one code path: each call of kmqd touches one queue, whose keys share one hash tag, so in a cluster
//! each call goes to the master of that queue's slot (the redis crate routes it by its first key, and follows
//! MOVED and ASK).

use std::sync::Mutex;
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConnection};
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    Cmd, Connection, ConnectionAddr, ConnectionInfo, ConnectionLike, IntoConnectionInfo,
    RedisError, RedisResult, TlsCertificates, Value,
};

use super::node::Node;
use super::payloads::Payloads;
use super::{BrokerError, Result};
use crate::config::{Deployment, RedisConfig, TlsFiles};
use crate::poison::lock;

/// Opens connections with a connect timeout and read/write timeouts, so no Redis call can hang a thread forever.
pub struct Connector {
    target: Target,
    connect_timeout: Duration,
    /// The read timeout outside blocking calls (`[redis] io_timeout`): a healthy Redis answers in microseconds, a
    /// stuck one is noticed after this.
    io_timeout: Duration,
    wait: Option<Wait>,
    display: String,
    /// The ACL user the connections log in as, for messages (`default` when none is named).
    username: String,
    /// The daemon's `kmqd:HOST:PID`: its connections are named `kmqd:HOST:PID:ROLE` (`CLIENT SETNAME`), so that
    /// `CLIENT LIST` tells which daemon and thread each one is. `None` for the command line and the library.
    client_name: Option<String>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("redis", &self.display)
            .finish_non_exhaustive()
    }
}

enum Target {
    Single(redis::Client),
    /// Asks a Sentinel for the master at every new connection, so a connection made after a failover reaches
    /// the new master (the old connections fail, and their callers reconnect).
    Sentinel(Mutex<SentinelClient>),
    /// The cluster client, and one client per seed for the pub/sub listener: kmqd's wake-ups are plain
    /// `PUBLISH`es, which a Redis Cluster forwards to every node, so one subscription on any node hears all.
    Cluster {
        client: ClusterClient,
        seeds: Vec<redis::Client>,
    },
}

impl Connector {
    pub fn new(config: &RedisConfig) -> Result<Connector> {
        let certificates = || certificates(&config.tls);
        let target = match &config.deployment {
            Deployment::Single => {
                let info = with_credentials(config.url.as_str().into_connection_info()?, config);
                Target::Single(open_client(info, config)?)
            }
            Deployment::Sentinel { seeds, master } => {
                let mut addrs = Vec::new();
                let mut db = 0;
                for seed in seeds {
                    let info = seed.as_str().into_connection_info()?;
                    db = info.redis_settings().db();
                    addrs.push(info.addr().clone());
                }
                let tls = addrs
                    .iter()
                    .any(|addr| matches!(addr, ConnectionAddr::TcpTls { .. }));
                let mut builder =
                    SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)?
                        .set_client_to_redis_db(db);
                if let Some(username) = &config.username {
                    builder = builder
                        .set_client_to_redis_username(username)
                        .set_client_to_sentinel_username(username);
                }
                if let Some(password) = &config.password {
                    builder = builder
                        .set_client_to_redis_password(password)
                        .set_client_to_sentinel_password(password);
                }
                if tls {
                    builder = builder
                        .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                        .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure)
                        .set_client_to_redis_certificates(certificates())
                        .set_client_to_sentinel_certificates(certificates());
                }
                Target::Sentinel(Mutex::new(builder.build()?))
            }
            Deployment::Cluster { seeds } => {
                let infos = seeds
                    .iter()
                    .map(|seed| {
                        Ok(with_credentials(
                            seed.as_str().into_connection_info()?,
                            config,
                        ))
                    })
                    .collect::<RedisResult<Vec<ConnectionInfo>>>()?;
                let mut builder = ClusterClientBuilder::new(infos.clone())
                    .connection_timeout(config.connect_timeout)
                    .response_timeout(config.io_timeout);
                if let Some(username) = &config.username {
                    builder = builder.username(username);
                }
                if let Some(password) = &config.password {
                    builder = builder.password(password);
                }
                if config.uses_tls() {
                    builder = builder.tls(redis::TlsMode::Secure).certs(certificates());
                }
                let seeds = infos
                    .into_iter()
                    .map(|info| open_client(info, config))
                    .collect::<Result<Vec<_>>>()?;
                Target::Cluster {
                    client: builder.build()?,
                    seeds,
                }
            }
        };
        let username = config
            .username
            .clone()
            .or_else(|| {
                let info = config.url.as_str().into_connection_info().ok()?;
                info.redis_settings().username().map(str::to_string)
            })
            .unwrap_or_else(|| "default".to_string());
        Ok(Connector {
            client_name: None,
            username,
            target,
            connect_timeout: config.connect_timeout,
            io_timeout: config.io_timeout,
            wait: (config.wait_replicas > 0).then(|| Wait {
                replicas: config.wait_replicas,
                timeout_ms: config.wait_timeout.as_millis().max(1) as u64,
            }),
            display: config.describe(),
        })
    }

    /// Names every connection this connector makes `BASE:ROLE` (`CLIENT SETNAME`; ROLE is `pool` unless
    /// [`Connector::connect_as`] says otherwise): the daemon's, `kmqd:HOST:PID`.
    pub(crate) fn with_client_name(mut self, base: impl Into<String>) -> Connector {
        self.client_name = Some(base.into());
        self
    }

    /// A new connection, outside any pool.
    pub fn connect(&self) -> Result<Conn> {
        self.connect_as(self.io_timeout, "pool")
    }

    /// A new connection whose replies must come within `timeout` (the heartbeat's is shorter than a lease), named
    /// `BASE:role` when the connector names its connections.
    pub(crate) fn connect_as(&self, timeout: Duration, role: &str) -> Result<Conn> {
        let mut connection = self.open(timeout)?;
        if let Some(base) = &self.client_name {
            set_name(&mut connection, &format!("{base}:{role}"))?;
        }
        Ok(connection)
    }

    fn open(&self, timeout: Duration) -> Result<Conn> {
        let connect_timeout = self.connect_timeout.min(timeout);
        let node = |client: &redis::Client| {
            Node::connect(client.get_connection_info(), Some(connect_timeout), || {
                client.get_connection_with_timeout(connect_timeout)
            })
        };
        let link = match &self.target {
            Target::Single(client) => Link::Node(node(client)?),
            Target::Sentinel(sentinel) => {
                let client = lock(sentinel).get_client()?;
                Link::Node(node(&client)?)
            }
            Target::Cluster { client, .. } => {
                Link::Cluster(Box::new(client.get_generic_connection::<NodeConnection>()?))
            }
        };
        let connection = Conn {
            link,
            wait: self.wait,
        };
        connection.set_read_timeout(Some(timeout))?;
        connection.set_write_timeout(Some(timeout))?;
        Ok(connection)
    }

    /// A connection for `SUBSCRIBE`: to the one Redis or the master, or in a cluster to the first seed that
    /// answers (a plain `PUBLISH` reaches every node of a cluster).
    pub(crate) fn subscriber(&self) -> Result<Connection> {
        match &self.target {
            Target::Cluster { seeds, .. } => {
                let mut last = None;
                for seed in seeds {
                    match self.subscribe_at(seed) {
                        Ok(connection) => return Ok(connection),
                        Err(error) => last = Some(error),
                    }
                }
                Err(last.expect("a cluster has at least one seed"))
            }
            Target::Single(client) => self.subscribe_at(client),
            Target::Sentinel(sentinel) => {
                let client = lock(sentinel).get_client()?;
                self.subscribe_at(&client)
            }
        }
    }

    /// A redis-rs connection for `SUBSCRIBE` (its pub/sub reads the messages) to `client`'s node.
    fn subscribe_at(&self, client: &redis::Client) -> Result<Connection> {
        let mut connection = client.get_connection_with_timeout(self.connect_timeout)?;
        connection.set_read_timeout(Some(self.io_timeout))?;
        connection.set_write_timeout(Some(self.io_timeout))?;
        self.name_subscriber(&mut connection)?;
        Ok(connection)
    }

    /// Names the delay listener's connection, as [`Connector::connect_as`] does the others.
    fn name_subscriber(&self, connection: &mut Connection) -> RedisResult<()> {
        match &self.client_name {
            Some(base) => set_name(connection, &format!("{base}:delay-listener")),
            None => Ok(()),
        }
    }

    /// The ACL user the connections log in as (`default`: Redis's own, when the config names none).
    pub(crate) fn username(&self) -> &str {
        &self.username
    }

    /// After a failure that reads as a Redis that is down: whether it is the ACL user's instead. A cluster
    /// client turns a refusal of its own commands (PING each node, CLUSTER SLOTS) into an I/O error or "no
    /// connections found", so the seeds are asked directly; elsewhere a refusal comes back as itself (`None`).
    pub(crate) fn refusal(&self) -> Option<redis::RedisError> {
        match &self.target {
            Target::Cluster { seeds, .. } => refusal_at_seeds(seeds, self.connect_timeout),
            Target::Single(_) | Target::Sentinel(_) => None,
        }
    }
}

/// The first NOAUTH, WRONGPASS or NOPERM that the seeds give the cluster client's own commands, asked of each
/// directly ([`Connector::refusal`]): the daemon would otherwise wait for ever for a cluster that is up, and
/// the command line time out; both report it as a config error naming the command (docs/OPERATIONS.md, "ACL
/// rules").
fn refusal_at_seeds(seeds: &[redis::Client], timeout: Duration) -> Option<redis::RedisError> {
    for seed in seeds {
        let mut connection = match seed.get_connection_with_timeout(timeout) {
            Ok(connection) => connection,
            Err(error) if super::is_auth_error(&error) => return Some(error),
            Err(_) => continue,
        };
        let _ = connection.set_read_timeout(Some(timeout));
        for command in [
            redis::cmd("PING"),
            redis::cmd("CLUSTER").arg("SLOTS").clone(),
        ] {
            if let Err(error) = command.query::<Value>(&mut connection)
                && super::is_auth_error(&error)
            {
                return Some(error);
            }
        }
    }
    None
}

/// Names a connection for `CLIENT LIST`. A refusal (a user without `+client|setname`, which the daemon's check
/// at start reports by name; a proxy without CLIENT) leaves it unnamed, quietly; an I/O error is returned, since
/// the connection is broken and its caller's retry, rate-limited and logged once, handles it. Through a cluster
/// connection the name goes to every node it is connected to; a node connection the cluster client makes later
/// (after a failover, a slot migration) stays unnamed until its thread reconnects.
pub(crate) fn set_name(connection: &mut impl ConnectionLike, name: &str) -> RedisResult<()> {
    match redis::cmd("CLIENT")
        .arg("SETNAME")
        .arg(name)
        .query::<()>(connection)
    {
        Err(error)
            if error.is_io_error() || error.is_timeout() || error.is_connection_dropped() =>
        {
            Err(error)
        }
        Err(error) => {
            tracing::debug!(%error, name, "CLIENT SETNAME refused; the connection stays unnamed");
            Ok(())
        }
        Ok(()) => Ok(()),
    }
}

/// The URL's connection info with the config's user and password (a URL's own stay when the config has none).
fn with_credentials(info: ConnectionInfo, config: &RedisConfig) -> ConnectionInfo {
    let mut settings = info.redis_settings().clone();
    if let Some(username) = &config.username {
        settings = settings.set_username(username);
    }
    if let Some(password) = &config.password {
        settings = settings.set_password(password);
    }
    info.set_redis_settings(settings)
}

/// A client for one node; with `rediss://`, it trusts the config's CA (or the system's) and presents its client
/// certificate.
fn open_client(info: ConnectionInfo, config: &RedisConfig) -> Result<redis::Client> {
    let tls = matches!(info.addr(), ConnectionAddr::TcpTls { .. });
    Ok(if tls {
        redis::Client::build_with_tls(info, certificates(&config.tls))?
    } else {
        redis::Client::open(info)?
    })
}

fn certificates(tls: &TlsFiles) -> TlsCertificates {
    TlsCertificates {
        client_tls: tls
            .client
            .as_ref()
            .map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
        root_cert: tls.ca.clone(),
    }
}

/// A connection to one Redis (or the Sentinels' master), or to a Redis Cluster; with the deployment's
/// `wait_replicas`, which the calls that change a task's state wait for ([`Conn::replicated`]).
pub struct Conn {
    link: Link,
    wait: Option<Wait>,
}

enum Link {
    Node(Node),
    /// Boxed: it holds a connection per node and the slot map.
    Cluster(Box<ClusterConnection<NodeConnection>>),
}

/// `WAIT replicas timeout_ms` after each state change of a task.
#[derive(Clone, Copy, Debug)]
struct Wait {
    replicas: u32,
    timeout_ms: u64,
}

/// A node connection made elsewhere (the tests' and the benchmark's own), without `wait_replicas`.
impl From<Connection> for Conn {
    fn from(connection: Connection) -> Conn {
        Conn {
            link: Link::Node(Node::Redis(connection)),
            wait: None,
        }
    }
}

impl Conn {
    /// Whether kmqd's own connection reads this node's replies (`broker::node`), not redis-rs's: for the tests
    /// that hold the two to the same results.
    #[doc(hidden)]
    pub fn reads_replies_itself(&self) -> bool {
        matches!(self.link, Link::Node(Node::Plain(_)))
    }

    /// Whether this is one node's connection (a plain Redis, or the Sentinels' master), not a cluster's: a
    /// pipeline of a blocking command and a transaction behind it goes to one node.
    pub fn is_node(&self) -> bool {
        matches!(self.link, Link::Node(_))
    }

    /// Runs `call`, with the bulk strings at `depth` of the replies it reads (the reply itself is depth 1) read
    /// into one buffer where kmqd's own connection reads them: each then stands in its reply as `Value::Int` of
    /// its index there ([`super::payloads::Gather`] takes both forms).
    pub(crate) fn with_payloads<T>(
        &mut self,
        depth: usize,
        call: impl FnOnce(&mut Conn) -> RedisResult<T>,
    ) -> RedisResult<(T, Payloads)> {
        let Link::Node(node) = &mut self.link else {
            return Ok((call(self)?, Payloads::default()));
        };
        node.collect_payloads(depth);
        let result = call(self);
        let Link::Node(node) = &mut self.link else {
            unreachable!("a connection's link does not change");
        };
        let collected = node.collected();
        Ok((result?, collected))
    }

    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> RedisResult<()> {
        match &self.link {
            Link::Node(connection) => connection.set_read_timeout(timeout),
            Link::Cluster(connection) => connection.set_read_timeout(timeout),
        }
    }

    pub(crate) fn set_write_timeout(&self, timeout: Option<Duration>) -> RedisResult<()> {
        match &self.link {
            Link::Node(connection) => connection.set_write_timeout(timeout),
            Link::Cluster(connection) => connection.set_write_timeout(timeout),
        }
    }

    /// Sends a command that names no key (`WAIT`, `UNWATCH`, `TIME`) to the master that holds `key`: where the
    /// calls before it on this key went.
    pub(crate) fn query_at<T: redis::FromRedisValue>(
        &mut self,
        key: &str,
        command: &Cmd,
    ) -> RedisResult<T> {
        match &mut self.link {
            Link::Node(connection) => command.query(connection),
            Link::Cluster(connection) => {
                let route = Route::with_key(key, SlotAddr::Master);
                let value = connection.route_command(
                    command,
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                )?;
                Ok(redis::from_redis_value(value)?)
            }
        }
    }

    /// Sends a command that names no key to every master: the one Redis (or the Sentinels' master) or, in a
    /// cluster, each master of the slot map. Each reply comes with its node's address in a cluster (`None`
    /// otherwise); a failure on any node fails the whole.
    pub(crate) fn query_every_master(
        &mut self,
        command: &Cmd,
    ) -> RedisResult<Vec<(Option<String>, Value)>> {
        match &mut self.link {
            Link::Node(connection) => Ok(vec![(None, command.query(connection)?)]),
            Link::Cluster(connection) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                match connection.route_command(command, routing)? {
                    Value::Map(replies) => replies
                        .into_iter()
                        .map(|(node, reply)| {
                            let node: String = redis::from_redis_value(node)?;
                            Ok((Some(node), reply))
                        })
                        .collect(),
                    other => Ok(vec![(None, other)]),
                }
            }
        }
    }

    /// With `[redis] wait_replicas` set, waits until that many replicas of the master holding `key` have every
    /// write made so far on this connection (`WAIT`); a failover to one of them then cannot undo the change.
    /// Fewer acknowledgements within `wait_timeout` is [`BrokerError::NotReplicated`]: the change was made on
    /// the master, and its caller treats the call as one whose reply was lost (the calls are safe to repeat).
    pub(crate) fn replicated(&mut self, key: &str) -> Result<()> {
        let Some(wait) = self.wait else {
            return Ok(());
        };
        let acknowledged: u32 = self.query_at(
            key,
            redis::cmd("WAIT").arg(wait.replicas).arg(wait.timeout_ms),
        )?;
        if acknowledged < wait.replicas {
            return Err(BrokerError::NotReplicated {
                acknowledged,
                wanted: wait.replicas,
            });
        }
        Ok(())
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        match &mut self.link {
            Link::Node(connection) => connection.req_packed_command(cmd),
            Link::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    /// In a cluster, a pipeline goes to the node of its first command's key: each pipeline kmqd sends is one
    /// queue's and starts with a command that names a key of it (`MULTI` aside).
    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        match &mut self.link {
            Link::Node(connection) => connection.req_packed_commands(cmd, offset, count),
            Link::Cluster(connection) => connection.req_packed_commands(cmd, offset, count),
        }
    }

    fn req_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        match &mut self.link {
            Link::Node(connection) => connection.req_command(cmd),
            Link::Cluster(connection) => connection.req_command(cmd),
        }
    }

    fn supports_pipelining(&self) -> bool {
        true
    }

    fn get_db(&self) -> i64 {
        match &self.link {
            Link::Node(connection) => connection.get_db(),
            Link::Cluster(connection) => connection.get_db(),
        }
    }

    fn check_connection(&mut self) -> bool {
        match &mut self.link {
            Link::Node(connection) => connection.check_connection(),
            Link::Cluster(connection) => connection.check_connection(),
        }
    }

    fn is_open(&self) -> bool {
        match &self.link {
            Link::Node(connection) => connection.is_open(),
            Link::Cluster(connection) => connection.is_open(),
        }
    }
}

/// The message of the error a cluster node's connection turns a lost reply into; [`BrokerError::may_have_run`]
/// recognises it.
pub(super) const LOST_REPLY: &str = "kmqd: the reply was lost; the command may have run";

/// A cluster node's connection that does not let the cluster client send a command again after its reply was
/// lost. The redis crate's cluster connection resends a command after an I/O error or a timeout (up to 16
/// times), which is right for a read but not for kmqd's writes: a claim or a pop whose reply was lost has run,
/// and kmqd resolves such a call itself (the claim's floor and adopt.lua, the settler's idempotent settle), which
/// it can only do when it sees the loss. So an I/O error after a command was sent becomes an error the cluster
/// client does not retry (`ErrorKind::Client`, [`LOST_REPLY`]); redirects (MOVED, ASK) and refusals (TRYAGAIN,
/// CLUSTERDOWN, READONLY), where the command did not run, are still followed and retried by the crate.
pub(crate) struct NodeConnection(Node);

fn lost(error: RedisError) -> RedisError {
    if error.is_io_error() || error.is_timeout() || error.is_connection_dropped() {
        RedisError::from((redis::ErrorKind::Client, LOST_REPLY, error.to_string()))
    } else {
        error
    }
}

impl ConnectionLike for NodeConnection {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        self.0.req_packed_command(cmd).map_err(lost)
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        self.0.req_packed_commands(cmd, offset, count).map_err(lost)
    }

    fn get_db(&self) -> i64 {
        self.0.get_db()
    }

    fn check_connection(&mut self) -> bool {
        self.0.check_connection()
    }

    fn is_open(&self) -> bool {
        self.0.is_open()
    }
}

impl redis::cluster::Connect for NodeConnection {
    fn connect<T: IntoConnectionInfo>(info: T, timeout: Option<Duration>) -> RedisResult<Self> {
        let info = info.into_connection_info()?;
        Node::connect(&info, timeout, || {
            <Connection as redis::cluster::Connect>::connect(info.clone(), timeout)
        })
        .map(NodeConnection)
    }

    fn send_packed_command(&mut self, cmd: &[u8]) -> RedisResult<()> {
        self.0.send_packed_command(cmd).map_err(lost)
    }

    fn set_write_timeout(&self, dur: Option<Duration>) -> RedisResult<()> {
        self.0.set_write_timeout(dur)
    }

    fn set_read_timeout(&self, dur: Option<Duration>) -> RedisResult<()> {
        self.0.set_read_timeout(dur)
    }

    fn recv_response(&mut self) -> RedisResult<Value> {
        self.0.recv_response().map_err(lost)
    }
}

/// The connection the pool manages (r2d2's `ManageConnection::Connection`; a [`PooledConnection`] is one checked out
/// of the pool), which can be marked broken, so that one which failed mid-reply (a timeout leaves the
/// unread reply in the socket) is closed instead of going back to the pool.
pub struct ManagedConn {
    inner: Conn,
    broken: bool,
}

impl std::ops::Deref for ManagedConn {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        &self.inner
    }
}

impl std::ops::DerefMut for ManagedConn {
    fn deref_mut(&mut self) -> &mut Conn {
        &mut self.inner
    }
}

impl r2d2::ManageConnection for Connector {
    type Connection = ManagedConn;
    type Error = redis::RedisError;

    fn connect(&self) -> std::result::Result<ManagedConn, redis::RedisError> {
        let inner = Connector::connect(self).map_err(|error| match error {
            BrokerError::Redis(error) => error,
            other => redis::RedisError::from((redis::ErrorKind::Io, "connect", other.to_string())),
        })?;
        Ok(ManagedConn {
            inner,
            broken: false,
        })
    }

    fn is_valid(&self, connection: &mut ManagedConn) -> std::result::Result<(), redis::RedisError> {
        redis::cmd("PING")
            .query::<String>(&mut connection.inner)
            .map(drop)
    }

    fn has_broken(&self, connection: &mut ManagedConn) -> bool {
        connection.broken || !connection.inner.is_open()
    }
}

pub type Pool = r2d2::Pool<Connector>;
pub type PooledConnection = r2d2::PooledConnection<Connector>;

/// Builds the connection pool. Connections are made lazily, so this succeeds while Redis is down; the first
/// `get()` reports the failure.
pub fn pool(config: &RedisConfig) -> Result<Pool> {
    pool_of(Connector::new(config)?, config)
}

/// [`pool`] with connections named `BASE:pool` until a [`Session`] renames its own (the daemon's).
pub fn named_pool(config: &RedisConfig, base: &str) -> Result<Pool> {
    pool_of(Connector::new(config)?.with_client_name(base), config)
}

fn pool_of(connector: Connector, config: &RedisConfig) -> Result<Pool> {
    Ok(r2d2::Pool::builder()
        .max_size(config.pool_size)
        .min_idle(Some(0))
        .connection_timeout(config.connect_timeout)
        // No PING before every use: a broken connection shows up as an error on use, which every caller handles
        // (and a PING per checkout doubled the round trips of a single push).
        .test_on_check_out(false)
        // The pool would log every failed connection attempt (several a second while Redis is down); the threads
        // that asked for a connection report their failures instead, rate-limited (`retry::Trouble`).
        .error_handler(Box::new(r2d2::NopErrorHandler))
        .build_unchecked(connector))
}

/// A long-lived thread's own connection: taken from the pool on first use, dropped after a failure (a broken
/// connection must not go back to the pool) and taken anew on the next use.
pub struct Session {
    pool: Pool,
    held: Option<PooledConnection>,
    /// `kmqd:HOST:PID:ROLE`, given to each connection it takes (`CLIENT SETNAME`).
    name: Option<String>,
}

impl Session {
    pub fn new(pool: Pool) -> Session {
        Session {
            pool,
            held: None,
            name: None,
        }
    }

    /// A session whose connections are named `name` (the daemon's threads: `kmqd:HOST:PID:fetcher-mail`).
    pub(crate) fn named(pool: Pool, name: String) -> Session {
        Session {
            pool,
            held: None,
            name: Some(name),
        }
    }

    /// The connection, connecting first if needed.
    pub(crate) fn get(&mut self) -> Result<&mut Conn> {
        if self.held.is_none() {
            let mut connection = self.pool.get()?;
            if let Some(name) = &self.name
                && let Err(error) = set_name(&mut **connection, name)
            {
                connection.broken = true;
                return Err(error.into());
            }
            self.held = Some(connection);
        }
        // Just filled above.
        Ok(self.held.as_mut().expect("connection present"))
    }

    /// Runs `op` on the connection, connecting first if needed; any failure closes the connection (the next use
    /// opens a new one), since one that failed mid-call may hold an unread reply.
    pub(crate) fn call<T>(&mut self, op: impl FnOnce(&mut Conn) -> Result<T>) -> Result<T> {
        let result = self.get().and_then(op);
        if result.is_err() {
            self.reset();
        }
        result
    }

    /// Closes the connection after a failure; the next `get` opens a new one.
    pub(crate) fn reset(&mut self) {
        if let Some(mut connection) = self.held.take() {
            connection.broken = true;
        }
    }
}
