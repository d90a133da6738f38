//! A connection to one Redis node: kmqd's own on a plain socket (TCP or a unix socket), whose replies
//! [`resp::Reader`] reads, or redis-rs's [`Connection`] where kmqd does not open its own (TLS, RESP3).
//!
//! Why a connection of our own: redis-rs's reply parser was the fetcher's largest cost, about 1,700 instructions
//! per claimed task, and its `Connection` gives no access to its socket (see [`resp`]). Everything above the
//! socket stays redis-rs's: commands are packed by [`redis::Cmd`] and [`redis::Pipeline`], scripts run through
//! [`redis::Script`], a cluster's routing is its [`redis::cluster::ClusterConnection`] over these nodes, and
//! every server error is redis-rs's own [`redis::ServerError`].
//!
//! What it does as redis-rs's `Connection` does: it connects with the same timeouts (each address the host name
//! resolves to, in turn), honours the URL's `TCP_NODELAY` setting (kmqd's URLs set no other TCP option), logs in
//! with `AUTH`, selects the URL's database and says which library it is (`CLIENT SETINFO`, here `kmqd`), all in
//! one pipeline; a reply that is an error is a value, a transaction's queued-command error aborts it with an
//! `EXECABORT` error. Where it differs, on purpose:
//! - a setup that Redis refuses (a wrong password, a user without `SELECT`, an old Redis without ACL users) is
//!   done again by redis-rs, whose error (its kind, `AuthenticationFailed` among them, and message) is the one
//!   reported: kmqd's config errors read the same whichever connection met them;
//! - an I/O error, a timeout or a malformed reply closes the connection ([`PlainConnection::is_open`] is false
//!   from then on, and every later call fails at once): the rest of that reply may still arrive, and kmqd never
//!   reuses a connection that failed (its pool drops it, its threads reconnect), where redis-rs counts replies to
//!   skip;
//! - a pipeline stops reading at the first I/O error instead of waiting a read timeout for each reply left.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use redis::{
    Cmd, Connection, ConnectionAddr, ConnectionInfo, ConnectionLike, ErrorKind, ProtocolVersion,
    RedisError, RedisResult, Value,
};

use super::payloads::Payloads;
use super::resp;

/// One node's connection (see the module's doc).
pub(crate) enum Node {
    Plain(PlainConnection),
    Redis(Connection),
}

impl Node {
    /// Connects to `info`'s node with kmqd's own connection when it can, else with `fallback` (redis-rs's):
    /// for TLS, RESP3, and a setup Redis refused (so that redis-rs reports it, see the module's doc).
    pub(crate) fn connect(
        info: &ConnectionInfo,
        timeout: Option<Duration>,
        fallback: impl FnOnce() -> RedisResult<Connection>,
    ) -> RedisResult<Node> {
        match PlainConnection::connect(info, timeout)? {
            Some(plain) => Ok(Node::Plain(plain)),
            None => fallback().map(Node::Redis),
        }
    }

    pub(crate) fn set_read_timeout(&self, timeout: Option<Duration>) -> RedisResult<()> {
        match self {
            Node::Plain(connection) => connection.set_read_timeout(timeout),
            Node::Redis(connection) => connection.set_read_timeout(timeout),
        }
    }

    pub(crate) fn set_write_timeout(&self, timeout: Option<Duration>) -> RedisResult<()> {
        match self {
            Node::Plain(connection) => connection.set_write_timeout(timeout),
            Node::Redis(connection) => connection.set_write_timeout(timeout),
        }
    }

    /// Reads the bulk strings at `depth` of the replies that follow into one buffer, until [`Node::collected`]
    /// (kmqd's own connection only; see [`resp::Reader::collect_payloads`]).
    pub(crate) fn collect_payloads(&mut self, depth: usize) {
        if let Node::Plain(connection) = self {
            connection.reader.collect_payloads(depth);
        }
    }

    /// What was collected since [`Node::collect_payloads`] (nothing on redis-rs's connection).
    pub(crate) fn collected(&mut self) -> Payloads {
        match self {
            Node::Plain(connection) => connection.reader.collected(),
            Node::Redis(_) => Payloads::default(),
        }
    }

    /// Sends a command without reading its reply (a cluster connection's pipelines over several nodes).
    pub(crate) fn send_packed_command(&mut self, command: &[u8]) -> RedisResult<()> {
        match self {
            Node::Plain(connection) => connection.send(command),
            Node::Redis(connection) => connection.send_packed_command(command),
        }
    }

    /// Reads the reply of a command sent with [`Node::send_packed_command`].
    pub(crate) fn recv_response(&mut self) -> RedisResult<Value> {
        match self {
            Node::Plain(connection) => connection.receive(),
            Node::Redis(connection) => connection.recv_response(),
        }
    }
}

impl ConnectionLike for Node {
    fn req_packed_command(&mut self, command: &[u8]) -> RedisResult<Value> {
        match self {
            Node::Plain(connection) => connection.req_packed_command(command),
            Node::Redis(connection) => connection.req_packed_command(command),
        }
    }

    fn req_packed_commands(
        &mut self,
        commands: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        match self {
            Node::Plain(connection) => connection.req_packed_commands(commands, offset, count),
            Node::Redis(connection) => connection.req_packed_commands(commands, offset, count),
        }
    }

    fn req_command(&mut self, command: &Cmd) -> RedisResult<Value> {
        match self {
            Node::Plain(connection) => connection.req_command(command),
            Node::Redis(connection) => connection.req_command(command),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Node::Plain(connection) => connection.get_db(),
            Node::Redis(connection) => connection.get_db(),
        }
    }

    fn check_connection(&mut self) -> bool {
        match self {
            Node::Plain(connection) => connection.check_connection(),
            Node::Redis(connection) => connection.check_connection(),
        }
    }

    fn is_open(&self) -> bool {
        match self {
            Node::Plain(connection) => connection.is_open(),
            Node::Redis(connection) => connection.is_open(),
        }
    }
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.set_read_timeout(timeout),
            Stream::Unix(stream) => stream.set_read_timeout(timeout),
        }
    }

    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.set_write_timeout(timeout),
            Stream::Unix(stream) => stream.set_write_timeout(timeout),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.read(buf),
            Stream::Unix(stream) => stream.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.write(buf),
            Stream::Unix(stream) => stream.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// kmqd's own connection to a Redis node on a plain socket (see the module's doc).
pub(crate) struct PlainConnection {
    stream: Stream,
    reader: resp::Reader,
    db: i64,
    /// False once a call failed in a way that may leave a reply half read.
    open: bool,
}

/// The error of a call on a connection that failed before.
fn closed() -> RedisError {
    io::Error::new(
        io::ErrorKind::NotConnected,
        "the connection failed earlier and was closed",
    )
    .into()
}

impl PlainConnection {
    /// Opens a connection to `info`'s node, logged in and on its database. `Ok(None)`: not one kmqd opens itself
    /// (TLS, RESP3), or Redis refused the setup; redis-rs's connection is used instead.
    pub(crate) fn connect(
        info: &ConnectionInfo,
        timeout: Option<Duration>,
    ) -> RedisResult<Option<PlainConnection>> {
        let settings = info.redis_settings();
        if settings.protocol() != ProtocolVersion::RESP2 {
            return Ok(None);
        }
        let began = Instant::now();
        let stream = match info.addr() {
            // redis-rs refuses these with an error of its own.
            ConnectionAddr::Tcp(host, _) if host == "0.0.0.0" || host == "::" => return Ok(None),
            ConnectionAddr::Tcp(host, port) => {
                let stream = connect_tcp((host.as_str(), *port), timeout)?;
                stream.set_nodelay(info.tcp_settings().nodelay())?;
                Stream::Tcp(stream)
            }
            ConnectionAddr::Unix(path) => Stream::Unix(UnixStream::connect(path)?),
            _ => return Ok(None),
        };
        // The setup's replies must come within what is left of the timeout, as with redis-rs.
        let left = match timeout {
            Some(timeout) => match timeout.checked_sub(began.elapsed()) {
                Some(left) if !left.is_zero() => Some(left),
                _ => return Err(io::Error::from(io::ErrorKind::TimedOut).into()),
            },
            None => None,
        };
        stream.set_read_timeout(left)?;
        stream.set_write_timeout(left)?;
        let mut connection = PlainConnection {
            stream,
            reader: resp::Reader::default(),
            db: settings.db(),
            open: true,
        };
        let mut setup = redis::pipe();
        if let Some(password) = settings.password() {
            let auth = setup.cmd("AUTH");
            if let Some(username) = settings.username() {
                auth.arg(username);
            }
            auth.arg(password);
        }
        if settings.db() != 0 {
            setup.cmd("SELECT").arg(settings.db());
        }
        let checked = setup.len();
        if !settings.skip_set_lib_name() {
            // As redis-rs: `CLIENT LIST` says which library connected; a Redis older than 7.2 refuses it, ignored.
            let name = settings.lib_name().unwrap_or("kmqd");
            let version = settings.lib_ver().unwrap_or(env!("CARGO_PKG_VERSION"));
            setup.cmd("CLIENT").arg("SETINFO").arg("LIB-NAME").arg(name);
            setup
                .cmd("CLIENT")
                .arg("SETINFO")
                .arg("LIB-VER")
                .arg(version);
        }
        let replies =
            connection.req_packed_commands(&setup.get_packed_pipeline(), 0, setup.len())?;
        if replies[..checked].iter().any(|reply| *reply != Value::Okay) {
            return Ok(None);
        }
        connection.stream.set_read_timeout(None)?;
        connection.stream.set_write_timeout(None)?;
        Ok(Some(connection))
    }

    pub(crate) fn set_read_timeout(&self, timeout: Option<Duration>) -> RedisResult<()> {
        Ok(self.stream.set_read_timeout(timeout)?)
    }

    pub(crate) fn set_write_timeout(&self, timeout: Option<Duration>) -> RedisResult<()> {
        Ok(self.stream.set_write_timeout(timeout)?)
    }

    /// Closes the connection after `error` when it may have left it out of step.
    fn failed(&mut self, error: RedisError) -> RedisError {
        if error.kind() == ErrorKind::Io || error.kind() == ErrorKind::Parse {
            self.open = false;
            if let Stream::Tcp(stream) = &self.stream {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
        error
    }

    fn send(&mut self, command: &[u8]) -> RedisResult<()> {
        if !self.open {
            return Err(closed());
        }
        if command.is_empty() {
            return Err(RedisError::from((ErrorKind::Client, "empty command")));
        }
        self.stream
            .write_all(command)
            .map_err(|error| self.failed(error.into()))
    }

    fn receive(&mut self) -> RedisResult<Value> {
        if !self.open {
            return Err(closed());
        }
        self.reader
            .value(&mut self.stream)
            .map_err(|error| self.failed(error))
    }
}

/// `TcpStream::connect`, or with a timeout, each address the name resolves to in turn (as redis-rs does).
fn connect_tcp(addr: (&str, u16), timeout: Option<Duration>) -> RedisResult<TcpStream> {
    let Some(timeout) = timeout else {
        return Ok(TcpStream::connect(addr)?);
    };
    let mut last = None;
    for addr in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(stream) => return Ok(stream),
            Err(error) => last = Some(error),
        }
    }
    Err(match last {
        Some(error) => error.into(),
        None => RedisError::from((
            ErrorKind::InvalidClientConfig,
            "could not resolve to any addresses",
        )),
    })
}

impl ConnectionLike for PlainConnection {
    fn req_packed_command(&mut self, command: &[u8]) -> RedisResult<Value> {
        self.send(command)?;
        self.receive()
    }

    /// As redis-rs's `Connection`: reads `offset + count` replies and returns the last `count`. A transaction
    /// (`offset` counts `MULTI` and its `QUEUED`s) in which Redis refused a command when it was queued was
    /// discarded whole: that is an `EXECABORT` error naming the first refusal.
    fn req_packed_commands(
        &mut self,
        commands: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        self.send(commands)?;
        let mut replies = Vec::with_capacity(count);
        let mut refused = None;
        for index in 0..offset + count {
            let reply = self.receive()?;
            if index >= offset {
                replies.push(reply);
            } else if let Value::ServerError(error) = reply
                && refused.is_none()
            {
                refused = Some(error);
            }
        }
        match refused {
            Some(error) => Err(aborted(&error)),
            None => Ok(replies),
        }
    }

    fn get_db(&self) -> i64 {
        self.db
    }

    fn check_connection(&mut self) -> bool {
        redis::cmd("PING").query::<String>(self).is_ok()
    }

    fn is_open(&self) -> bool {
        self.open
    }
}

/// The error of a transaction that Redis discarded because it refused `refused` when it was queued: kind
/// `ExecAbort`, as redis-rs's, and the refusal in its detail.
fn aborted(refused: &redis::ServerError) -> RedisError {
    let line = format!(
        "-EXECABORT Transaction discarded because of a refused command: {}\r\n",
        refused.to_string().replace(['\r', '\n'], " ")
    );
    match redis::parse_redis_value(line.as_bytes()) {
        Ok(Value::ServerError(error)) => error.into(),
        _ => RedisError::from((
            ErrorKind::Server(redis::ServerErrorKind::ExecAbort),
            "Transaction discarded",
        )),
    }
}
