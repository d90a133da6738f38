//! The daemon's start: waiting for Redis and checking, before any thread starts, what waiting would not fix
//! (credentials, ACL rules, the keys' protocol version, an eviction policy), and warning of tasks left in priority
//! levels the config dropped (which a reload that drops a level warns of too). Its own module because it runs
//! before the supervisor exists and shares nothing with it but the error type.

use std::time::Duration;

use crossbeam_channel::Receiver;

use super::{DaemonError, notify};
use crate::broker::{self, BrokerError, Connector, access, eviction, levels};
use crate::config::{Config, QueueConfig};

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
                broker::check_protocol(
                    &mut connection,
                    &keys,
                    &queue.name,
                    queue.default_priority,
                )?;
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

/// Warns of each priority level whose keys in `queue`'s slot hold tasks while the queue's config names no such
/// level (`broker::levels`): no daemon of this config takes them, and `kmqd stats` does not count them (review L5).
/// One warning per level, naming its keys and how many tasks each holds, and where the docs say how to move them.
/// Looking is a courtesy, not a condition of serving: a look that fails (Redis gone meanwhile, a user of rules
/// older than this check, without SCAN) is a warning that says so.
pub(super) fn warn_of_stranded_levels(connector: &Connector, prefix: &str, queue: &QueueConfig) {
    let keys = broker::QueueKeys::for_queue(prefix, queue);
    let found = connector
        .connect()
        .and_then(|mut connection| levels::stranded(&mut connection, &keys));
    let stranded = match found {
        Ok(stranded) => stranded,
        Err(error) => {
            tracing::warn!(
                queue = %queue.name,
                %error,
                "cannot look for tasks in priority levels the config does not name (a user without the rule for \
                 SCAN: docs/OPERATIONS.md, \"ACL rules\")"
            );
            return;
        }
    };
    for level in stranded {
        let listed: Vec<String> = level
            .keys
            .iter()
            .map(|(key, tasks)| format!("{key} ({tasks})"))
            .collect();
        tracing::warn!(
            queue = %queue.name,
            priority = %level.level,
            tasks = level.tasks(),
            keys = %listed.join(", "),
            "a priority level the config does not name holds tasks, which no daemon of this config takes; serve \
             the level again, or move them to a level the config names \
             (docs/OPERATIONS.md, \"Removing a priority level\")"
        );
    }
}
