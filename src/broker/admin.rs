//! What an operator does to a queue as a whole: pause and resume it, and list the daemons serving it.
//!
//! A pause is one key, `PREFIX:{Q}:paused`, that every claim and pop checks in the same atomic step as the
//! take (claim.lua, pop.lua, the plain pop's `WATCH`), so it is a plain `SET` and `DEL` that any client can
//! send (docs/PROTOCOL.md, "Pausing a queue"). The daemons serving a queue are its owners: each registered
//! with a lease in `PREFIX:{Q}:owners` and a registration hash (owners.rs).

use serde::Serialize;

use redis::ConnectionLike;

use super::{QueueKeys, Result, SCRIPTS, owner_info, owners};

/// Pauses the queue of `keys`; returns false when it was paused already. `now_ms` is stored as the key's value,
/// for whoever looks (kmqd only checks that the key exists).
pub fn pause(conn: &mut dyn ConnectionLike, keys: &QueueKeys, now_ms: i64) -> Result<bool> {
    let set: Option<String> = redis::cmd("SET")
        .arg(&keys.paused)
        .arg(now_ms)
        .arg("NX")
        .query(conn)?;
    Ok(set.is_some())
}

/// Resumes the queue of `keys`; returns false when it was not paused. The fetchers notice within `idle_poll`.
pub fn resume(conn: &mut dyn ConnectionLike, keys: &QueueKeys) -> Result<bool> {
    let deleted: i64 = redis::cmd("DEL").arg(&keys.paused).query(conn)?;
    Ok(deleted > 0)
}

/// Whether the queue of `keys` is paused.
pub fn is_paused(conn: &mut dyn ConnectionLike, keys: &QueueKeys) -> Result<bool> {
    Ok(redis::cmd("EXISTS").arg(&keys.paused).query(conn)?)
}

/// Marks `owner`'s registration as draining (its daemon's graceful stop began), if it still exists. Returns
/// whether it did.
pub fn mark_draining(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    owner: &str,
    now_ms: i64,
) -> Result<bool> {
    let marked: i64 = SCRIPTS
        .drain
        .key(keys.owner_info(owner))
        .arg(now_ms)
        .invoke(conn)?;
    Ok(marked == 1)
}

/// One daemon serving a queue, as `kmqd workers` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Worker {
    pub queue: String,
    /// The owner id (`HOST-PID-MS-RANDOM.N`).
    pub owner: String,
    /// `safe` or `default`, as it registered.
    pub mode: String,
    pub host: String,
    pub pid: u32,
    /// The kmqd version it runs.
    pub version: String,
    /// When its daemon started, ms since the epoch (its own clock).
    pub started_at_ms: i64,
    /// How long its lease has left, ms (on Redis's clock); it is renewed every `lease_timeout / 3`.
    pub lease_left_ms: i64,
    /// Safe mode: the tasks it holds (claimed, not yet settled). `None` in
    /// default mode, whose popped tasks are no longer in Redis.
    pub held: Option<u64>,
    /// Its workers stuck in a handler that ignored its cancel (an execution timeout, a lost lease), as of its last
    /// renewal; `None` from a kmqd that does not say.
    pub stuck: Option<u64>,
    /// Its daemon began a graceful stop: it takes nothing more and finishes what it holds.
    pub draining: bool,
    /// The queue is paused (`kmqd queue pause`): the daemon takes nothing until it is resumed.
    pub paused: bool,
}

/// The daemons alive on the queue `queue` (owners whose lease has not run out), oldest registration first. An
/// owner without a registration (a kmqd older than registrations) is listed with what is known: its id.
pub fn workers(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    queue: &str,
) -> Result<Vec<Worker>> {
    let (now_ms, leases) = owners(conn, keys)?;
    let paused = is_paused(conn, keys)?;
    let mut workers = Vec::new();
    for (owner, deadline) in leases {
        if deadline <= now_ms {
            continue;
        }
        let info = owner_info(conn, keys, &owner)?.unwrap_or_default();
        let held = if info.mode == "safe" {
            let levels = keys.with_levels(&info.levels);
            let counts = super::processing::counts(conn, &levels.processing_all(&owner))?;
            Some(counts.iter().sum())
        } else {
            None
        };
        workers.push(Worker {
            queue: queue.to_string(),
            owner,
            mode: info.mode,
            host: info.host,
            pid: info.pid,
            version: info.version,
            started_at_ms: info.started_at_ms,
            lease_left_ms: deadline - now_ms,
            held,
            stuck: info.stuck,
            draining: info.draining,
            paused,
        });
    }
    Ok(workers)
}
