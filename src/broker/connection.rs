//! Connecting to Redis: a connector with timeouts, the pool, and a thread's own [`Session`].

use std::time::Duration;

use redis::{Connection, ConnectionLike, IntoConnectionInfo};

use super::{BrokerError, Result};
use crate::config::{RedisConfig, redact_url};

/// Opens connections with a connect timeout and read/write timeouts, so no Redis call can hang a thread forever.
#[derive(Debug)]
pub struct Connector {
    client: redis::Client,
    connect_timeout: Duration,
    /// The read timeout outside blocking calls (`[redis] io_timeout`): a healthy Redis answers in microseconds, a
    /// stuck one is noticed after this.
    io_timeout: Duration,
    display_url: String,
    /// The ACL user the connections log in as, for messages (`default` when none is named).
    username: String,
}

impl Connector {
    pub fn new(config: &RedisConfig) -> Result<Connector> {
        let mut info = config.url.as_str().into_connection_info()?;
        if let Some(username) = &config.username {
            let settings = info.redis_settings().clone().set_username(username);
            info = info.set_redis_settings(settings);
        }
        if let Some(password) = &config.password {
            let settings = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(settings);
        }
        let username = info
            .redis_settings()
            .username()
            .unwrap_or("default")
            .to_string();
        Ok(Connector {
            username,
            client: redis::Client::open(info)?,
            connect_timeout: config.connect_timeout,
            io_timeout: config.io_timeout,
            display_url: redact_url(&config.url),
        })
    }

    /// A new connection, outside any pool (the pub/sub listener needs one of its own).
    pub fn connect(&self) -> Result<Connection> {
        self.connect_with_timeout(self.io_timeout)
    }

    /// A new connection whose replies must come within `timeout` (the heartbeat's is shorter than a lease).
    pub fn connect_with_timeout(&self, timeout: Duration) -> Result<Connection> {
        let connection = self
            .client
            .get_connection_with_timeout(self.connect_timeout.min(timeout))?;
        connection.set_read_timeout(Some(timeout))?;
        connection.set_write_timeout(Some(timeout))?;
        Ok(connection)
    }

    /// The URL with any password replaced, for logs.
    pub fn display_url(&self) -> &str {
        &self.display_url
    }

    /// The ACL user the connections log in as (`default`: Redis's own, when the config names none).
    pub fn username(&self) -> &str {
        &self.username
    }
}

/// A pooled connection that can be marked broken, so that one which failed mid-reply (a timeout leaves the
/// unread reply in the socket) is closed instead of going back to the pool.
pub struct PoolConnection {
    inner: Connection,
    broken: bool,
}

impl PoolConnection {
    /// Closes the connection instead of returning it to the pool (it failed: it may hold a stale reply).
    pub fn mark_broken(&mut self) {
        self.broken = true;
    }
}

impl std::ops::Deref for PoolConnection {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        &self.inner
    }
}

impl std::ops::DerefMut for PoolConnection {
    fn deref_mut(&mut self) -> &mut Connection {
        &mut self.inner
    }
}

impl r2d2::ManageConnection for Connector {
    type Connection = PoolConnection;
    type Error = redis::RedisError;

    fn connect(&self) -> std::result::Result<PoolConnection, redis::RedisError> {
        let inner = Connector::connect(self).map_err(|error| match error {
            BrokerError::Redis(error) => error,
            other => redis::RedisError::from((redis::ErrorKind::Io, "connect", other.to_string())),
        })?;
        Ok(PoolConnection {
            inner,
            broken: false,
        })
    }

    fn is_valid(
        &self,
        connection: &mut PoolConnection,
    ) -> std::result::Result<(), redis::RedisError> {
        redis::cmd("PING")
            .query::<String>(&mut connection.inner)
            .map(drop)
    }

    fn has_broken(&self, connection: &mut PoolConnection) -> bool {
        connection.broken || !connection.inner.is_open()
    }
}

pub type Pool = r2d2::Pool<Connector>;
pub type PooledConnection = r2d2::PooledConnection<Connector>;

/// Builds the connection pool. Connections are made lazily, so this succeeds while Redis is down; the first
/// `get()` reports the failure.
pub fn pool(config: &RedisConfig) -> Result<Pool> {
    let connector = Connector::new(config)?;
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
}

impl Session {
    pub fn new(pool: Pool) -> Session {
        Session { pool, held: None }
    }

    /// The connection, connecting first if needed.
    pub fn get(&mut self) -> Result<&mut Connection> {
        if self.held.is_none() {
            self.held = Some(self.pool.get()?);
        }
        // Just filled above.
        Ok(self.held.as_mut().expect("connection present"))
    }

    /// Closes the connection after a failure; the next `get` opens a new one.
    pub fn reset(&mut self) {
        if let Some(mut connection) = self.held.take() {
            connection.broken = true;
        }
    }
}
