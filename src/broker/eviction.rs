//! Redis's `maxmemory-policy`, read at start: kmqd's keys must never be evicted (docs/OPERATIONS.md,
//! "maxmemory-policy").
//!
//! A Redis at its `maxmemory` makes room for a write as its policy says. Under `noeviction` it refuses the write
//! (an OOM error, which kmqd's callers see and retry, and which its scripts check before they write); under any
//! other policy it deletes keys, and no kmqd key may go:
//! - `allkeys-*`: any key, a ready list, a claim list, an owner's registration: tasks lost without a trace, in
//!   safe mode too;
//! - `volatile-*`: the keys with a TTL first, and kmqd's only ones are settle.lua's records of the calls it
//!   applied (`settled:SETTLER`): a settle sent again after a lost reply is then applied twice (in default mode,
//!   a retry or a dead letter twice over). Once no key with a TTL is left, Redis refuses writes as under
//!   `noeviction`, so the loss is bounded, but it is the very record that makes a resent call safe. Refused like
//!   `allkeys-*`: it can evict kmqd's keys.
//!
//! So anything but `noeviction` (a policy a newer Redis adds included: it is not known to be safe) is refused,
//! unless `[redis] allow_eviction` accepts it knowingly. The policy alone decides, not `maxmemory`: a limit can
//! be set later, live, with no restart of kmqd.
//!
//! The policy is read with `INFO memory` (its `maxmemory_policy:` line), then `CONFIG GET maxmemory-policy` when
//! INFO is refused or has no such line: the documented ACL users have `+info` and not `+config|get` (CONFIG GET
//! reads every setting, `masterauth` included), and managed services that disable CONFIG keep INFO. In a
//! Redis Cluster every master is asked. A policy that neither command reads is reported, and kmqd goes on.

use redis::{RedisError, Value};

use super::{BrokerError, Conn, Result};

/// The one policy under which Redis never deletes a key to make room.
pub const SAFE: &str = "noeviction";

/// Whether Redis may delete keys under `policy` (anything but `noeviction`).
pub fn may_evict(policy: &str) -> bool {
    !policy.eq_ignore_ascii_case(SAFE)
}

/// What a policy may evict of kmqd's keys, for messages.
fn what_goes(policy: &str) -> &'static str {
    if policy.starts_with("volatile-") {
        "the keys with a TTL first, and kmqd's only ones are the records of the settle calls it applied: a \
         settle sent again after a lost reply is then applied twice"
    } else {
        "any key: a ready list, a claim list, an owner's registration, so tasks are lost without a trace"
    }
}

/// One master's policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reading {
    /// The master's address in a cluster; `None` for the one Redis (or the Sentinels' master).
    pub node: Option<String>,
    /// The policy, or why neither INFO nor CONFIG GET told it.
    pub policy: std::result::Result<String, String>,
}

impl Reading {
    fn at(&self) -> String {
        self.node
            .as_ref()
            .map_or(String::new(), |node| format!(" (node {node})"))
    }
}

/// Every master's policy ([`check`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub readings: Vec<Reading>,
    /// `[redis] allow_eviction`.
    pub allowed: bool,
}

impl Finding {
    /// The policies that may evict, with where (none under `noeviction`).
    pub fn evicting(&self) -> impl Iterator<Item = (&Reading, &str)> {
        self.readings
            .iter()
            .filter_map(|reading| match &reading.policy {
                Ok(policy) if may_evict(policy) => Some((reading, policy.as_str())),
                _ => None,
            })
    }

    /// The refusal, when a policy may evict and the config does not accept it.
    pub fn refusal(&self) -> Option<BrokerError> {
        if self.allowed {
            return None;
        }
        let (reading, policy) = self.evicting().next()?;
        Some(BrokerError::Eviction {
            policy: policy.to_string(),
            node: reading.node.clone(),
        })
    }

    /// What to warn about: a policy that may evict, accepted by the config; a policy that could not be read.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.allowed {
            for (reading, policy) in self.evicting() {
                warnings.push(format!(
                    "Redis{} runs with maxmemory-policy {policy}: when full it may evict {}; accepted by \
                     [redis] allow_eviction = true (docs/OPERATIONS.md, \"maxmemory-policy\")",
                    reading.at(),
                    what_goes(policy)
                ));
            }
        }
        for reading in &self.readings {
            if let Err(why) = &reading.policy {
                warnings.push(format!(
                    "cannot read Redis's maxmemory-policy{} ({why}), so kmqd cannot tell whether Redis may \
                     evict its keys: make sure it is noeviction, and let kmqd's user run INFO to have it checked \
                     (docs/OPERATIONS.md, \"maxmemory-policy\")",
                    reading.at()
                ));
            }
        }
        warnings
    }

    /// The policies read, for `check-config`: `noeviction`, or each master's.
    pub fn describe(&self) -> String {
        let each: Vec<String> = self
            .readings
            .iter()
            .map(|reading| {
                let policy = match &reading.policy {
                    Ok(policy) => policy.clone(),
                    Err(_) => "unknown".to_string(),
                };
                match &reading.node {
                    Some(node) => format!("{node} {policy}"),
                    None => policy,
                }
            })
            .collect();
        each.join(", ")
    }
}

/// The message of [`BrokerError::Eviction`].
pub(super) fn describe_refusal(policy: &str, node: Option<&str>) -> String {
    let at = node.map_or(String::new(), |node| format!(" (node {node})"));
    format!(
        "Redis{at} runs with maxmemory-policy {policy}: when full it may evict {}. Set it to noeviction \
         (`CONFIG SET maxmemory-policy noeviction`, and `maxmemory-policy noeviction` in redis.conf so that a \
         restart keeps it; on a managed service, in its parameter group), or accept the loss knowingly with \
         [redis] allow_eviction = true (docs/OPERATIONS.md, \"maxmemory-policy\")",
        what_goes(policy)
    )
}

/// Reads every master's policy and holds it against `allowed` (`[redis] allow_eviction`): a policy that may
/// evict is [`BrokerError::Eviction`] (a config error: exit 2) unless `allowed`; see [`Finding::warnings`] for
/// the rest. A Redis that does not answer is an error as any call's; a refusal of both commands is a reading
/// without a policy.
pub fn check(conn: &mut Conn, allowed: bool) -> Result<Finding> {
    let finding = Finding {
        readings: read(conn)?,
        allowed,
    };
    match finding.refusal() {
        Some(refusal) => Err(refusal),
        None => Ok(finding),
    }
}

/// Every master's policy: INFO memory, then CONFIG GET where INFO did not tell.
pub fn read(conn: &mut Conn) -> Result<Vec<Reading>> {
    let info = match conn.query_every_master(redis::cmd("INFO").arg("memory")) {
        Ok(replies) => replies
            .into_iter()
            .map(|(node, reply)| {
                let policy =
                    from_info(&reply).ok_or_else(|| "INFO has no maxmemory_policy".to_string());
                Reading { node, policy }
            })
            .collect(),
        Err(error) if refused(&error) => vec![Reading {
            node: None,
            policy: Err(format!("INFO memory: {error}")),
        }],
        Err(error) => return Err(error.into()),
    };
    if info.iter().all(|reading| reading.policy.is_ok()) {
        return Ok(info);
    }
    let config = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .clone();
    match conn.query_every_master(&config) {
        Ok(replies) => Ok(replies
            .into_iter()
            .map(|(node, reply)| {
                let policy = from_config(&reply).ok_or_else(|| {
                    let before = info
                        .iter()
                        .find(|reading| reading.node == node)
                        .or(info.first())
                        .and_then(|reading| reading.policy.clone().err())
                        .unwrap_or_default();
                    format!("{before}; CONFIG GET maxmemory-policy answered {reply:?}")
                });
                Reading { node, policy }
            })
            .collect()),
        Err(error) if refused(&error) => Ok(info
            .into_iter()
            .map(|reading| Reading {
                policy: reading
                    .policy
                    .map_err(|why| format!("{why}; CONFIG GET maxmemory-policy: {error}")),
                ..reading
            })
            .collect()),
        Err(error) => Err(error.into()),
    }
}

/// Whether Redis answered with an error that says it will not tell (NOPERM, an unknown or disabled command),
/// rather than one that says it is unreachable or busy for now, which the caller retries like any failure.
fn refused(error: &RedisError) -> bool {
    match error.code() {
        Some("LOADING" | "BUSY" | "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN" | "MOVED" | "ASK") => {
            false
        }
        Some(_) => true,
        None => false,
    }
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(text) => Some(text.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

/// The `maxmemory_policy:` line of an INFO reply.
fn from_info(reply: &Value) -> Option<String> {
    let text = text(reply)?;
    text.lines()
        .find_map(|line| line.trim_end().strip_prefix("maxmemory_policy:"))
        .map(|policy| policy.trim().to_string())
        .filter(|policy| !policy.is_empty())
}

/// The value of a `CONFIG GET maxmemory-policy` reply: `[name, value]` (RESP2) or `{name: value}` (RESP3).
fn from_config(reply: &Value) -> Option<String> {
    let value = match reply {
        Value::Array(items) => items.get(1)?,
        Value::Map(pairs) => &pairs.first()?.1,
        _ => return None,
    };
    text(value).filter(|policy| !policy.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_noeviction_is_safe() {
        assert!(!may_evict("noeviction"));
        for policy in [
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "volatile-lru",
            "volatile-lfu",
            "volatile-random",
            "volatile-ttl",
            "some-future-policy",
        ] {
            assert!(may_evict(policy), "{policy}");
        }
    }

    #[test]
    fn the_policy_is_read_from_info_and_from_config_get() {
        let info = Value::BulkString(
            b"# Memory\r\nused_memory:1\r\nmaxmemory:0\r\nmaxmemory_policy:allkeys-lru\r\n"
                .to_vec(),
        );
        assert_eq!(from_info(&info).as_deref(), Some("allkeys-lru"));
        assert_eq!(
            from_info(&Value::BulkString(b"# Memory\r\n".to_vec())),
            None
        );
        let resp2 = Value::Array(vec![
            Value::BulkString(b"maxmemory-policy".to_vec()),
            Value::BulkString(b"volatile-ttl".to_vec()),
        ]);
        assert_eq!(from_config(&resp2).as_deref(), Some("volatile-ttl"));
        let resp3 = Value::Map(vec![(
            Value::BulkString(b"maxmemory-policy".to_vec()),
            Value::BulkString(b"noeviction".to_vec()),
        )]);
        assert_eq!(from_config(&resp3).as_deref(), Some("noeviction"));
        assert_eq!(from_config(&Value::Array(vec![])), None);
    }

    fn finding(policies: &[std::result::Result<&str, &str>], allowed: bool) -> Finding {
        Finding {
            readings: policies
                .iter()
                .enumerate()
                .map(|(index, policy)| Reading {
                    node: (policies.len() > 1).then(|| format!("10.0.0.{index}:7000")),
                    policy: policy.map(str::to_string).map_err(str::to_string),
                })
                .collect(),
            allowed,
        }
    }

    #[test]
    fn a_policy_that_may_evict_is_refused_naming_it_the_fix_and_the_key() {
        let refused = finding(&[Ok("noeviction"), Ok("allkeys-lru")], false)
            .refusal()
            .expect("refused")
            .to_string();
        for words in [
            "Redis (node 10.0.0.1:7000) runs with maxmemory-policy allkeys-lru",
            "a ready list",
            "CONFIG SET maxmemory-policy noeviction",
            "redis.conf",
            "allow_eviction = true",
        ] {
            assert!(refused.contains(words), "{words}: {refused}");
        }
        let volatile = finding(&[Ok("volatile-lru")], false)
            .refusal()
            .unwrap()
            .to_string();
        assert!(volatile.contains("applied twice"), "{volatile}");
        assert!(volatile.starts_with("Redis runs with"), "{volatile}");
        assert!(finding(&[Ok("noeviction")], false).refusal().is_none());
        assert!(finding(&[Err("NOPERM")], false).refusal().is_none());
    }

    #[test]
    fn an_accepted_policy_and_an_unread_one_are_warned_about() {
        let accepted = finding(&[Ok("allkeys-lru")], true);
        assert!(accepted.refusal().is_none());
        let warnings = accepted.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("allkeys-lru") && warnings[0].contains("accepted"));
        let unread = finding(&[Err("INFO memory: NOPERM")], false).warnings();
        assert_eq!(unread.len(), 1, "{unread:?}");
        assert!(unread[0].contains("cannot read Redis's maxmemory-policy (INFO memory: NOPERM)"));
        assert!(finding(&[Ok("noeviction")], false).warnings().is_empty());
        assert_eq!(
            finding(&[Ok("noeviction"), Err("x")], false).describe(),
            "10.0.0.0:7000 noeviction, 10.0.0.1:7000 unknown"
        );
    }
}
