//! The daemon's start: waiting for Redis and checking, before any thread starts, what waiting would not fix
//! (credentials, ACL rules, the keys' protocol version, an eviction policy). Its own module because it runs before
//! the supervisor exists and shares nothing with it but the error type.

use std::time::Duration;

use crossbeam_channel::Receiver;

use super::{DaemonError, notify};
use crate::broker::{self, BrokerError, Connector, access, eviction};
use crate::config::Config;

/// Waits until Redis answers, its ACL user may do all the daemon does on every queue (one check per queue,
/// `broker::access`), every queue's keys are of this protocol version and no master's `maxmemory-policy` may
/// evict kmqd's keys (`broker::eviction`), however long Redis is down (one log line, then a summary every 30 s);
/// a stop request ends the wait (returns false). Wrong credentials, missing ACL rules, keys of another protocol
/// version and a policy that may evict (unless `[redis] allow_eviction` accepts it) end it too, as errors:
/// waiting would not fix them.
pub(super) fn wait_for_redis(
    config: &Config,
    connector: &Connector,
    stop: &Receiver<()>,
) -> Result<bool, DaemonError> {
    let redis = config.redis.describe();
    crate::retry::name_server(redis.clone());
    let mut trouble = crate::retry::Trouble::new("connecting to Redis at start", None);
    let mut delay = Duration::from_millis(100);
    notify::status(&format!("connecting to Redis at {redis}"));
    // What the status line last said went wrong, so that it is sent again only when that changes.
    let mut shown = String::new();
    loop {
        let checked = connector.connect().and_then(|mut connection| {
            for queue in &config.queues {
                let keys = broker::QueueKeys::for_queue(&config.redis.key_prefix, queue);
                // First, so that a missing ACL rule is reported by name, not as the NOPERM of whatever
                // command happens to come first (or of a script, at the first task that needs it).
                access::check(&mut connection, &keys, access::Action::Serve)?;
                broker::check_protocol(&mut connection, &keys, &queue.name)?;
            }
            eviction::check(&mut connection, config.redis.allow_eviction)
        });
        match checked {
            Ok(finding) => {
                trouble.recovered();
                for warning in finding.warnings() {
                    tracing::warn!("{warning}");
                }
                tracing::debug!(policy = %finding.describe(), "Redis's maxmemory-policy");
                return Ok(true);
            }
            Err(BrokerError::Redis(error)) if broker::is_auth_error(&error) => {
                return Err(DaemonError::Auth(error));
            }
            Err(error) if error.is_config_error() => {
                return Err(error.for_user(connector.username()).into());
            }
            Err(error) => {
                if let Some(refusal) = broker::tls_refusal(&error) {
                    return Err(DaemonError::Tls(refusal));
                }
                if let Some(refused) = connector.refusal() {
                    return Err(DaemonError::Auth(refused));
                }
                trouble.failed(&error);
                let text = error.to_string();
                if text != shown {
                    notify::status(&format!("waiting for Redis at {redis}: {text}"));
                    shown = text;
                }
            }
        }
        match stop.recv_timeout(delay) {
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            _ => {
                notify::stopping("stopping before Redis answered");
                return Ok(false);
            }
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}
