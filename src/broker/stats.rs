//! A queue's depths and counters, and the protocol-version check.

use std::collections::HashMap;

use redis::{ConnectionLike, Value};
use serde::Serialize;

use super::{BrokerError, PROTOCOL_VERSION, QueueKeys, Result, reply_error, time_ms};
use crate::task::Envelope;

/// Records the protocol version in the queue's meta hash, or refuses keys written by another version; then the
/// queue's shape, its `levels` (comma-separated, highest first) and `default_priority` (docs/PROTOCOL.md, "The
/// queue's shape"), so that a producer in another language learns which priorities the queue has without its
/// config. Called at start and by a reload that adds a queue or changes its levels: the last daemon to start (or
/// reload) describes the queue, as its config is the newest.
pub fn check_protocol(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    queue: &str,
    default_level: usize,
) -> Result<()> {
    // Two commands rather than a pipeline, so that a refusal (NOAUTH, an ACL's NOPERM) comes back as itself and
    // not inside a pipeline's list of failures.
    let _: i64 = redis::cmd("HSETNX")
        .arg(&keys.meta)
        .arg("protocol")
        .arg(PROTOCOL_VERSION)
        .query(conn)?;
    let found: String = redis::cmd("HGET")
        .arg(&keys.meta)
        .arg("protocol")
        .query(conn)?;
    if found != PROTOCOL_VERSION.to_string() {
        return Err(BrokerError::ProtocolVersion {
            queue: queue.to_string(),
            found,
            expected: PROTOCOL_VERSION,
        });
    }
    let _: i64 = redis::cmd("HSET")
        .arg(&keys.meta)
        .arg("levels")
        .arg(keys.levels.join(","))
        .arg("default_priority")
        .arg(&keys.levels[default_level])
        .query(conn)?;
    Ok(())
}

/// A queue's depth and counters, as `kmqd stats` shows them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct QueueStats {
    /// Tasks waiting in the ready lists (quarantined ones included, and those of a limited type waiting in its
    /// flow: claim.lua, "Type limits").
    pub ready: u64,
    /// `ready` counts the flows of a level with more than [`COUNTED_FLOWS`] of them (a grouped queue's groups) as
    /// that many times the average of the first ones: an estimate.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub ready_estimated: bool,
    /// Ready tasks per level, highest first (a JSON object in level order): the configured levels, then any
    /// other level a registered owner claims from.
    #[serde(serialize_with = "pairs_as_map")]
    pub ready_by_level: Vec<(String, u64)>,
    /// Of `ready`, the tasks in quarantine: recovered more than once from an expired lease, they are claimed
    /// one at a time, to run alone (docs/RELIABILITY.md, "Poison pills").
    pub quarantined: u64,
    /// Safe mode: tasks claimed and not yet settled.
    pub processing: u64,
    /// Of `processing`, the tasks claimed under the queue's `max_running` and not yet settled, by every daemon
    /// (0 without the limit; claims of a daemon whose config has none are not counted).
    pub running: u64,
    /// Tasks waiting for their due time, retries in backoff included.
    pub delayed: u64,
    /// Of `delayed`, the retries waiting out their backoff.
    pub retrying: u64,
    /// Tasks of a flow waiting for their dependencies (docs/design/flows.md): pushed, not yet released to a
    /// ready list nor failed. Counted nowhere else, so without it a flow's waiting tasks would be invisible until
    /// they run (`kmqd stats`' WAITING, the length of the queue's `deps-waiting` hash).
    pub waiting: u64,
    /// Records in the dead-letter list (bounded by `dead_max`).
    pub dead: u64,
    /// Tasks accepted by the enqueue script or moved from a source list (plain RPUSH producers onto a ready list
    /// are not counted).
    pub pushed: u64,
    /// Of `pushed`, the tasks moved from the queue's `source_lists` (move.lua).
    pub moved: u64,
    /// Tasks acknowledged.
    pub done: u64,
    /// Tasks queued again for another attempt.
    pub retried: u64,
    /// Tasks returned to the queue, uncharged, from a daemon whose lease expired while it held them.
    pub recovered: u64,
    /// Runs that failed (handler error, panic, timeout, lost lease).
    pub failed: u64,
    /// Runs whose handler answered back-pressure (`throttle`): each task went back uncharged, and the queue took
    /// nothing for the time asked.
    pub throttled: u64,
    /// Tasks moved to the dead-letter list.
    pub dead_lettered: u64,
    /// Waiting tasks removed by `task cancel` (or `Client::cancel`).
    pub cancelled: u64,
    /// Dead-letter records moved back to a ready list by `kmqd dead requeue` (`Client::dead_requeue`).
    pub requeued: u64,
    /// Dead-letter records removed by `kmqd dead purge` (`Client::dead_purge`).
    pub purged: u64,
    /// Age of the oldest task at the head of a ready list, ms; `None` when nothing is ready.
    pub lag_ms: Option<i64>,
    /// The queue is paused (`kmqd queue pause`): no daemon takes its tasks until it is resumed.
    pub paused: bool,
    /// A handler throttled the queue: no daemon takes its tasks for this many ms more; `None` when it is not.
    pub throttle_ms: Option<i64>,
}

/// Runs finished per second between two reads of a queue's counters: what `kmqd stats --watch` and the daemon's
/// queue report show.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Rates {
    /// Tasks acknowledged per second.
    pub done: f64,
    /// Runs failed per second (each failed run counts, retried or not).
    pub failed: f64,
}

impl QueueStats {
    /// The counters' growth since `earlier` over `elapsed`, the real time between the two reads. A counter that
    /// went down (its keys were deleted) counts as no growth; a zero `elapsed`, as no time to measure over.
    pub fn rates_since(&self, earlier: &QueueStats, elapsed: std::time::Duration) -> Rates {
        let seconds = elapsed.as_secs_f64();
        if seconds <= 0.0 {
            return Rates::default();
        }
        let per_second = |now: u64, then: u64| now.saturating_sub(then) as f64 / seconds;
        Rates {
            done: per_second(self.done, earlier.done),
            failed: per_second(self.failed, earlier.failed),
        }
    }

    /// One word for whether daemons take the queue's tasks: `paused` (by an operator), `throttled` (by a
    /// handler's back-pressure, for `throttle_ms` more), or `active`.
    pub fn state(&self) -> &'static str {
        if self.paused {
            "paused"
        } else if self.throttle_ms.is_some() {
            "throttled"
        } else {
            "active"
        }
    }

    /// The ready tasks per level as one word, highest level first: `high:0,normal:12`.
    pub fn levels_text(&self) -> String {
        let levels: Vec<String> = self
            .ready_by_level
            .iter()
            .map(|(level, n)| format!("{level}:{n}"))
            .collect();
        levels.join(",")
    }
}

fn pairs_as_map<S: serde::Serializer>(
    pairs: &[(String, u64)],
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    serializer.collect_map(pairs.iter().map(|(k, v)| (k, v)))
}

/// Reads a queue's depth and counters as one snapshot: every list, set and counter of the queue is read in one
/// transaction (`MULTI` ... `EXEC`), so a task is counted once wherever it is, even while daemons claim, settle
/// and retry (a drained queue's snapshot has `done` with every task it settled, and no task both ready and done).
///
/// Safe mode's processing area is one claim set per owner and level, so the snapshot needs the owners, their
/// levels and the types of their processing keys first: up to three round trips before the transaction, which
/// reads the owners and their levels again. If they changed meanwhile (a daemon started, stopped or reloaded),
/// it reads again, up to [`SNAPSHOT_ATTEMPTS`] times; a snapshot of the last try misses at most the claims of an
/// owner that came in during it.
///
/// The levels are the queue's configured ones and any other a registered owner claims from (a rolling config
/// change: another daemon serves a level this config does not name), so tasks there are counted too.
pub fn stats(conn: &mut dyn ConnectionLike, keys: &QueueKeys) -> Result<QueueStats> {
    let mut owners = Owners::read(conn, keys)?;
    let mut attempt = 1;
    loop {
        let last = attempt == SNAPSHOT_ATTEMPTS;
        match snapshot(conn, keys, &owners) {
            Ok((stats, now)) if now == owners || last => return Ok(stats),
            Ok(_) => {}
            // A processing key that was gone when its type was read may have come back as an older owner's hash.
            Err(BrokerError::Redis(error)) if error.code() == Some("WRONGTYPE") && !last => {}
            Err(error) => return Err(error),
        }
        owners = Owners::read(conn, keys)?;
        attempt += 1;
    }
}

/// How many times [`stats`] reads when the owners change under it.
const SNAPSHOT_ATTEMPTS: usize = 4;

/// The registered owners of a queue and the levels each records (`None`: the queue's configured ones), and the
/// flows its levels' rings name (type limits: claim.lua moves the tasks a type's limits hold back there; groups:
/// every grouped task waits in one), each level's first [`COUNTED_FLOWS`] members in ring order and how many it
/// has: the keys a snapshot reads beyond the queue's fixed ones.
struct Owners {
    ids: Vec<String>,
    levels: Vec<Option<String>>,
    rings: Vec<Vec<String>>,
    ring_sizes: Vec<u64>,
}

/// A snapshot is taken again when the owners or their levels changed under it; flows come and go with a grouped
/// queue's every claim, and one that came in meanwhile is counted at the next snapshot.
impl PartialEq for Owners {
    fn eq(&self, other: &Owners) -> bool {
        self.ids == other.ids && self.levels == other.levels
    }
}

/// The most flows of a level whose tasks a snapshot counts one by one: a grouped queue may have 100,000, and
/// `stats` is polled every second by the dashboard and the metrics. Past it, the level's flows are counted as
/// that many times their average (`QueueStats::ready_estimated`).
pub const COUNTED_FLOWS: usize = 1000;

impl Owners {
    fn read(conn: &mut dyn ConnectionLike, keys: &QueueKeys) -> Result<Owners> {
        let mut pipe = redis::pipe();
        pipe.cmd("ZRANGE").arg(&keys.owners).arg(0).arg(-1);
        for ring in keys.rings() {
            pipe.cmd("ZRANGE").arg(&ring).arg(0).arg(COUNTED_FLOWS - 1);
            pipe.cmd("ZCARD").arg(ring);
        }
        let mut replies = Replies(pipe.query::<Vec<Value>>(conn)?.into_iter());
        let ids: Vec<String> = replies.one()?;
        let (mut rings, mut ring_sizes) = (Vec::new(), Vec::new());
        for _ in 0..keys.levels() {
            rings.push(replies.one()?);
            ring_sizes.push(replies.one()?);
        }
        let levels = if ids.is_empty() {
            Vec::new()
        } else {
            let mut pipe = redis::pipe();
            for owner in &ids {
                pipe.cmd("HGET").arg(keys.owner_info(owner)).arg("levels");
            }
            pipe.query(conn)?
        };
        Ok(Owners {
            ids,
            levels,
            rings,
            ring_sizes,
        })
    }
}

/// How many starts each of the queue's rate-limit windows (`windows_ms`, each a window's length) holds now: the
/// entries of its log (claim.lua's and pop.lua's, rate.lua) younger than the window, on Redis's clock. Read
/// whole, in one transaction: a log holds about a thousand entries at most. (The log's sum is not enough: a
/// take trims the entries that aged out, so an idle queue's sum still counts them.)
pub fn rate_used(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    windows_ms: &[u64],
) -> Result<Vec<u64>> {
    let mut pipe = redis::pipe();
    pipe.atomic().cmd("TIME");
    for window in windows_ms {
        pipe.cmd("LRANGE")
            .arg(keys.rate_log(*window).0)
            .arg(0)
            .arg(-1);
    }
    let mut replies = Replies(pipe.query::<Vec<Value>>(conn)?.into_iter());
    let now_ms = time_ms(replies.one()?);
    windows_ms
        .iter()
        .map(|window| used_in(&replies.one::<Vec<String>>()?, *window, now_ms))
        .collect()
}

/// The starts a rate log (`MS COUNT` entries) holds within `window_ms` of `now_ms`.
fn used_in(log: &[String], window_ms: u64, now_ms: i64) -> Result<u64> {
    let since = now_ms.saturating_sub(i64::try_from(window_ms).unwrap_or(i64::MAX));
    let mut used = 0;
    for entry in log {
        let parsed = entry
            .split_once(' ')
            .and_then(|(ms, count)| Some((ms.parse::<i64>().ok()?, count.parse::<u64>().ok()?)));
        let (ms, count) =
            parsed.ok_or_else(|| reply_error("rate log", format!("entry {entry:?}")))?;
        if ms > since {
            used += count;
        }
    }
    Ok(used)
}

/// What one `[[queues.limits]]` entry counts now ([`type_usage`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypeUsage {
    /// Its tasks taken and not yet settled (under a `max_running`; 0 without one).
    pub running: u64,
    /// The starts each of its rate windows holds now, in the entry's order.
    pub rate_used: Vec<u64>,
    /// Its tasks held back in its flows, over every level.
    pub waiting: u64,
    /// How long its throttle (a handler's back-pressure on one of its tasks) still lasts, ms; `None`: none.
    pub throttle_ms: Option<i64>,
}

/// What each of `limits` (a queue's `[[queues.limits]]`) counts now, in one transaction: its running count,
/// its rate windows' starts (as [`rate_used`]) and its tasks waiting in its flows.
pub fn type_usage(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    limits: &[crate::config::TypeLimit],
) -> Result<Vec<TypeUsage>> {
    if limits.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    pipe.atomic().cmd("TIME");
    for limit in limits {
        pipe.cmd("HGET")
            .arg(&keys.running)
            .arg(super::keys::type_scope(&limit.kind));
        for rate in &limit.rate_limit {
            let (log, _) = keys.type_rate_log(&limit.kind, rate.window_ms());
            pipe.cmd("LRANGE").arg(log).arg(0).arg(-1);
        }
        let member = super::keys::flow_member(&limit.kind);
        for level in 0..keys.levels() {
            pipe.cmd("LLEN").arg(keys.flow(level, &member));
        }
        pipe.cmd("PTTL").arg(keys.type_throttle(&limit.kind));
    }
    let mut replies = Replies(pipe.query::<Vec<Value>>(conn)?.into_iter());
    let now_ms = time_ms(replies.one()?);
    limits
        .iter()
        .map(|limit| {
            let running: Option<u64> = replies.one()?;
            let rate_used = limit
                .rate_limit
                .iter()
                .map(|rate| used_in(&replies.one::<Vec<String>>()?, rate.window_ms(), now_ms))
                .collect::<Result<Vec<u64>>>()?;
            let waiting: Vec<u64> = replies.many(keys.levels())?;
            // -2: none; -1: set by hand without an expiry (claims look at it again every second).
            let throttle_ttl: i64 = replies.one()?;
            Ok(TypeUsage {
                running: running.unwrap_or(0),
                rate_used,
                waiting: waiting.iter().sum(),
                throttle_ms: (throttle_ttl != -2).then_some(throttle_ttl.max(0)),
            })
        })
        .collect()
}

/// One transaction's reading of the queue with `owners`' processing keys; returns it with the owners as the
/// transaction found them, which the caller compares with `owners`.
fn snapshot(
    conn: &mut dyn ConnectionLike,
    keys: &QueueKeys,
    owners: &Owners,
) -> Result<(QueueStats, Owners)> {
    let mut levels = keys.levels.clone();
    let mut processing_keys = Vec::new();
    for (owner, recorded) in owners.ids.iter().zip(&owners.levels) {
        let owned: Vec<String> = match recorded {
            Some(list) => list.split(',').map(str::to_string).collect(),
            None => keys.levels.clone(),
        };
        for level in &owned {
            if !levels.contains(level) {
                levels.push(level.clone());
            }
        }
        processing_keys.extend(keys.with_levels(&owned).processing_all(owner));
    }
    let kinds = super::processing::kinds(conn, &processing_keys)?;
    let flows: Vec<(usize, String)> = owners
        .rings
        .iter()
        .enumerate()
        .flat_map(|(level, members)| {
            members
                .iter()
                .map(move |member| (level, keys.flow(level, member)))
        })
        .collect();
    let keys = &keys.with_levels(&levels);
    let mut pipe = redis::pipe();
    // First a key of the queue's: in a cluster a pipeline goes to its first key's node (`broker::Conn`).
    pipe.atomic().ignore_errors();
    pipe.cmd("ZRANGE").arg(&keys.owners).arg(0).arg(-1);
    for owner in &owners.ids {
        pipe.cmd("HGET").arg(keys.owner_info(owner)).arg("levels");
    }
    for (_, flow) in &flows {
        pipe.cmd("LLEN").arg(flow);
    }
    // The flows' heads count in the lag as the ready lists' do: a grouped queue's tasks all wait in flows.
    for (_, flow) in &flows {
        pipe.cmd("LINDEX").arg(flow).arg(0);
    }
    for key in keys.ready.iter().chain(&keys.quarantine) {
        pipe.cmd("LLEN").arg(key);
    }
    for key in &keys.ready {
        pipe.cmd("LINDEX").arg(key).arg(0);
    }
    for key in keys.delayed.iter().chain(&keys.retry) {
        pipe.cmd("ZCARD").arg(key);
    }
    super::processing::add_count_reads(&mut pipe, &processing_keys, &kinds);
    pipe.cmd("LLEN").arg(&keys.dead);
    pipe.cmd("HGETALL").arg(&keys.stats);
    pipe.cmd("EXISTS").arg(&keys.paused);
    pipe.cmd("PTTL").arg(&keys.throttle);
    pipe.cmd("HGET").arg(&keys.running).arg("q");
    pipe.cmd("HLEN").arg(keys.deps_waiting());
    pipe.cmd("TIME");
    let mut replies = Replies(pipe.query::<Vec<Value>>(conn)?.into_iter());
    let now = Owners {
        ids: replies.one()?,
        levels: replies.many(owners.ids.len())?,
        rings: Vec::new(),
        ring_sizes: Vec::new(),
    };
    let flow_counts: Vec<u64> = replies.many(flows.len())?;
    let flow_heads: Vec<Option<Vec<u8>>> = replies.many(flows.len())?;
    let level_count = levels.len();
    let mut ready_counts: Vec<u64> = replies.many(level_count)?;
    let mut in_flows = vec![0u64; owners.rings.len()];
    for ((level, _), count) in flows.iter().zip(flow_counts) {
        in_flows[*level] += count;
    }
    let mut ready_estimated = false;
    for (level, counted) in in_flows.into_iter().enumerate() {
        let (read, size) = (owners.rings[level].len() as u64, owners.ring_sizes[level]);
        ready_counts[level] += if size > read && read > 0 {
            ready_estimated = true;
            counted * size / read
        } else {
            counted
        };
    }
    // Stage-major: each stage's lists over the levels; summed per level.
    let quarantine_counts: Vec<u64> = replies.many(keys.quarantine.len())?;
    let quarantined: Vec<u64> = (0..level_count)
        .map(|level| {
            quarantine_counts
                .iter()
                .skip(level)
                .step_by(level_count)
                .sum()
        })
        .collect();
    let heads: Vec<Option<Vec<u8>>> = replies.many(level_count)?;
    let zset_counts: Vec<u64> = replies.many(2 * level_count)?;
    let mut processing = 0;
    for _ in &processing_keys {
        processing += super::processing::count_of(replies.next()?)?;
    }
    let dead: u64 = replies.one()?;
    let counters: HashMap<String, u64> = replies.one()?;
    let paused: bool = replies.one()?;
    // -2: none; -1: set by hand without an expiry (claims look at it again every second).
    let throttle_ttl: i64 = replies.one()?;
    let running: Option<u64> = replies.one()?;
    let waiting: u64 = replies.one()?;
    let time: (i64, i64) = replies.one()?;
    let now_ms = time_ms(time);
    let lag_ms = heads
        .into_iter()
        .chain(flow_heads)
        .flatten()
        .filter_map(|head| {
            Envelope::decode(&String::from_utf8_lossy(&head))
                .ok()?
                .created_at
        })
        .map(|created_at| (now_ms - created_at).max(0))
        .max();
    let counter = |name: &str| counters.get(name).copied().unwrap_or(0);
    let retrying: u64 = zset_counts[level_count..].iter().sum();
    let ready_by_level: Vec<(String, u64)> = levels
        .iter()
        .cloned()
        .zip(ready_counts.iter().zip(&quarantined).map(|(r, q)| r + q))
        .collect();
    let stats = QueueStats {
        ready: ready_by_level.iter().map(|(_, n)| n).sum(),
        ready_by_level,
        quarantined: quarantined.iter().sum(),
        processing,
        running: running.unwrap_or(0),
        delayed: zset_counts.iter().sum(),
        retrying,
        waiting,
        dead,
        pushed: counter("pushed"),
        moved: counter("moved"),
        done: counter("done"),
        retried: counter("retried"),
        recovered: counter("recovered"),
        failed: counter("failed"),
        throttled: counter("throttled"),
        dead_lettered: counter("dead_lettered"),
        cancelled: counter("cancelled"),
        requeued: counter("requeued"),
        purged: counter("purged"),
        lag_ms,
        paused,
        throttle_ms: (throttle_ttl != -2).then_some(throttle_ttl.max(0)),
        ready_estimated,
    };
    Ok((stats, now))
}

/// A pipeline's replies, read in the order of its commands.
struct Replies(std::vec::IntoIter<Value>);

impl Replies {
    /// The next reply; a command's error (the transaction's replies keep each in its place) as itself.
    fn next(&mut self) -> Result<Value> {
        let value = self
            .0
            .next()
            .ok_or_else(|| reply_error("stats", "fewer replies than commands"))?;
        Ok(value.extract_error()?)
    }

    fn one<T: redis::FromRedisValue>(&mut self) -> Result<T> {
        let value = self.next()?;
        redis::from_redis_value(value).map_err(|error| reply_error("stats", error.to_string()))
    }

    fn many<T: redis::FromRedisValue>(&mut self, n: usize) -> Result<Vec<T>> {
        (0..n).map(|_| self.one()).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn rates_are_counter_growth_over_real_time() {
        let before = QueueStats {
            done: 100,
            failed: 7,
            ..QueueStats::default()
        };
        let after = QueueStats {
            done: 350,
            failed: 8,
            ..QueueStats::default()
        };
        let rates = after.rates_since(&before, Duration::from_millis(500));
        assert_eq!((rates.done, rates.failed), (500.0, 2.0));
        // Counters that went down (keys deleted) and a zero interval measure nothing.
        assert_eq!(
            before.rates_since(&after, Duration::from_secs(1)),
            Rates::default()
        );
        assert_eq!(after.rates_since(&before, Duration::ZERO), Rates::default());
    }

    #[test]
    fn levels_text_lists_levels_in_order() {
        let stats = QueueStats {
            ready_by_level: vec![("high".into(), 0), ("normal".into(), 12)],
            ..QueueStats::default()
        };
        assert_eq!(stats.levels_text(), "high:0,normal:12");
    }
}
