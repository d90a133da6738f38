//! Owners: a daemon's claim identity on a queue, with its one lease and its registration (mode, levels, host...).
//!
//! An owner id is made by the daemon ([`super::instance_id`] and a generation), never by a counter in Redis, so
//! a Redis that lost its data cannot hand out an id a live daemon still uses. Its registration
//! (`P:{Q}:owner:ID`) records the levels and mode it claimed with, so that every monitor recovers whatever it
//! held, whatever the monitor's own config says.

use std::time::Duration;

use redis::{ConnectionLike, Value};

use super::{Conn, QueueKeys, Result, SCRIPTS, reply_error, text, time_ms};

/// What an owner registers about itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnerInfo {
    /// `safe` or `default`.
    pub mode: String,
    /// The priority levels it claims from, highest first.
    pub levels: Vec<String>,
    pub host: String,
    pub pid: u32,
    /// The kmqd version that registered it.
    pub version: String,
    /// When its daemon started, ms since the epoch (the daemon's clock).
    pub started_at_ms: i64,
    /// The size of the quarantined group it runs with nothing else, if it runs one (claim.lua).
    pub group: Option<usize>,
    /// Its daemon began a graceful stop (drain.lua): read for `kmqd workers`, never registered.
    pub draining: bool,
    /// Its workers stuck in a handler that ignored its cancel, as of its last renewal (renew.lua); `None` from a
    /// kmqd that does not say. Read for `kmqd workers`, never registered.
    pub stuck: Option<u64>,
}

/// An owner's lease as a script that read Redis's clock found it: the daemon believes in its lease for `left_ms`
/// from when it sent the call (never for longer than Redis counts it), and compares `now_ms` with its own clock to
/// see Redis's clock step (`daemon::lane::ownership`, review M2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseClock {
    /// Redis's clock when the script ran, ms since the epoch.
    pub(crate) now_ms: i64,
    /// The lease's deadline minus `now_ms` (ms).
    pub(crate) left_ms: i64,
}

/// Registers `owner` with a lease, describing itself with `info`. Returns `None` when the id is known and its
/// lease ran out (pick another id); registering a live owner again (a retry after a lost reply) is a success.
pub fn register(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    owner: &str,
    lease: Duration,
    info: &OwnerInfo,
) -> Result<Option<LeaseClock>> {
    let (registered, now_ms, left_ms): (i64, i64, i64) = SCRIPTS
        .register
        .key(&keys.owners)
        .key(keys.owner_info(owner))
        .arg(owner)
        .arg(lease.as_millis() as u64)
        .arg("mode")
        .arg(&info.mode)
        .arg("levels")
        .arg(info.levels.join(","))
        .arg("host")
        .arg(&info.host)
        .arg("pid")
        .arg(info.pid)
        .arg("version")
        .arg(&info.version)
        .arg("started_at")
        .arg(info.started_at_ms)
        .invoke(conn)?;
    Ok((registered == 1).then_some(LeaseClock { now_ms, left_ms }))
}

/// What a renewal found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renewal {
    /// Renewed: the lease as the renewal left it.
    Renewed(LeaseClock),
    /// The lease had run out (this daemon was silent too long, or Redis lost it); the monitors take its tasks
    /// back.
    Lost,
    /// Redis lost writes of this owner it had acknowledged (its journal is below the count of bumps it
    /// acknowledged: a failover to a
    /// replica that lagged, a restored backup); the owner was expired, and the monitors take its tasks back.
    WentBack,
}

/// Renews `owner`'s lease, if Redis's journal of the owner is still at least `journal` (the count of its bumps
/// Redis acknowledged to this daemon, renew.lua), and
/// records how many of its workers are `stuck` (for `kmqd workers`).
///
/// With `[redis] wait_replicas`, a renewal counts only once the replicas have it ([`Conn::replicated`];
/// [`super::BrokerError::NotReplicated`] otherwise, which the heartbeat retries): the daemon's belief in its
/// lease then never runs ahead of the deadline a replica promoted by a failover holds (review M2's variant).
pub fn renew(
    conn: &mut Conn,
    keys: &QueueKeys,
    owner: &str,
    lease: Duration,
    journal: u64,
    stuck: usize,
) -> Result<Renewal> {
    let (renewed, now_ms, left_ms): (i64, i64, i64) = SCRIPTS
        .renew
        .key(&keys.owners)
        .key(keys.owner_info(owner))
        .arg(owner)
        .arg(lease.as_millis() as u64)
        .arg(journal)
        .arg(stuck)
        .invoke(conn)?;
    if renewed == 1 {
        conn.replicated(&keys.owners)?;
    }
    Ok(match renewed {
        1 => Renewal::Renewed(LeaseClock { now_ms, left_ms }),
        -1 => Renewal::WentBack,
        _ => Renewal::Lost,
    })
}

/// Forgets `owner` and its registration if it holds no task any more at the levels of `keys` (its own levels);
/// `by_monitor`: only if its lease has run out. Returns whether it was released.
pub fn release(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    owner: &str,
    by_monitor: bool,
) -> Result<bool> {
    let mut invocation = SCRIPTS.release.prepare_invoke();
    invocation
        .key(&keys.owners)
        .key(keys.owner_info(owner))
        .key(&keys.running)
        .key(keys.popped_running(owner))
        .key(&keys.wake);
    for key in keys.processing_all(owner) {
        invocation.key(key);
    }
    let released: i64 = invocation
        .arg(owner)
        .arg(if by_monitor { "expired" } else { "owner" })
        .invoke(conn)?;
    Ok(released == 1)
}

/// Every owner of the queue with its lease deadline (ms), and Redis's clock.
pub fn owners(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
) -> Result<(i64, Vec<(String, i64)>)> {
    // The keyed command first: in a cluster a pipeline goes to its first key's node (`broker::Conn`).
    let (owners, time): (Vec<(String, f64)>, (i64, i64)) = redis::pipe()
        .cmd("ZRANGE")
        .arg(&keys.owners)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .cmd("TIME")
        .query(conn)?;
    Ok((
        time_ms(time),
        owners
            .into_iter()
            .map(|(owner, deadline)| (owner, deadline as i64))
            .collect(),
    ))
}

/// `owner`'s registration; `None` for an owner registered by a kmqd that wrote none (before this version).
pub fn owner_info(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    owner: &str,
) -> Result<Option<OwnerInfo>> {
    let fields: Vec<Value> = redis::cmd("HGETALL")
        .arg(keys.owner_info(owner))
        .query(conn)?;
    if fields.is_empty() {
        return Ok(None);
    }
    let mut info = OwnerInfo::default();
    let mut fields = fields.into_iter();
    while let (Some(name), Some(value)) = (fields.next(), fields.next()) {
        let (name, value) = (text(name, "owner info")?, text(value, "owner info")?);
        match name.as_str() {
            "mode" => info.mode = value,
            "levels" => {
                info.levels = value
                    .split(',')
                    .filter(|level| !level.is_empty())
                    .map(str::to_string)
                    .collect()
            }
            "host" => info.host = value,
            "pid" => info.pid = value.parse().unwrap_or(0),
            "version" => info.version = value,
            "started_at" => info.started_at_ms = value.parse().unwrap_or(0),
            "draining" => info.draining = true,
            "stuck" => info.stuck = value.parse().ok(),
            "group" => {
                info.group = Some(
                    value
                        .parse()
                        .map_err(|_| reply_error("owner info", format!("group = {value:?}")))?,
                );
            }
            _ => {}
        }
    }
    // An owner always has at least one level; an info hash without any is not one kmqd wrote.
    if info.levels.is_empty() {
        return Ok(None);
    }
    Ok(Some(info))
}
