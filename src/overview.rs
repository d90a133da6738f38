//! Every queue at a glance, polled: what `kmqd stats --watch` draws and the dashboard's overview serves
//! (`kmqd dashboard`, docs/DASHBOARD.md). One poller for both, so the two show the same numbers the same way.
//!
//! A poll reads each queue's stats, what its flow-control limits count ([`read_limits`]) and the daemons alive on
//! it ([`poll_forever`], on a thread of its own, so a slow or absent Redis never blocks a screen or a page);
//! [`Overview::update`] turns a poll into one [`Row`] per queue. done/s and failed/s are the growth of the queue's Redis counters between two polls divided by the
//! real time between the two reads: the queue's rates across every daemon.

use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::Sender;
use serde::Serialize;

use crate::broker::{QueueStats, Rates, TypeUsage};
use crate::client::{Client, ClientError};
use crate::config::{Config, QueueConfig};

/// One queue at one poll.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    pub name: String,
    pub mode: &'static str,
    pub paused: bool,
    /// A handler's throttle holds the queue back (docs/HANDLERS.md, "Back-pressure").
    pub throttled: bool,
    pub ready: u64,
    /// Ready tasks per level, highest first (JSON: `[["high", 0], ["normal", 12]]`).
    pub ready_by_level: Vec<(String, u64)>,
    pub processing: u64,
    pub delayed: u64,
    /// Tasks of flows waiting for their dependencies (`QueueStats::waiting`).
    pub waiting: u64,
    pub dead: u64,
    /// Since the poll before; `None` at the first poll.
    pub rates: Option<Rates>,
    pub lag_ms: Option<i64>,
    /// Daemons alive on the queue (what `kmqd workers` lists).
    pub daemons: usize,
    /// Its limits against what Redis counts, as `kmqd stats` says them; `None` for a queue with no limit and no
    /// throttle.
    pub limits: Option<Limits>,
}

impl Row {
    /// One word for whether daemons take the queue's tasks, as `kmqd stats` says it (`QueueStats::state`).
    pub fn state(&self) -> &'static str {
        if self.paused {
            "paused"
        } else if self.throttled {
            "throttled"
        } else {
            "active"
        }
    }
}

/// One queue's read at one poll: its stats, its limits' counts, the daemons alive on it, and when the stats
/// were read.
pub struct Read {
    at: Instant,
    stats: QueueStats,
    limits: Option<Limits>,
    daemons: usize,
}

/// One poll of every queue, or why it failed.
pub struct Poll {
    pub wall: SystemTime,
    pub reads: Result<Vec<Read>, String>,
}

/// The rows of the last good poll, the reads their rates are measured from, and the last poll's failure.
pub struct Overview {
    names: Vec<(String, &'static str)>,
    last: Vec<Option<Read>>,
    pub rows: Vec<Row>,
    /// When the rows were read; `None` before the first good poll.
    pub updated: Option<SystemTime>,
    /// The last poll's failure, kept until a poll succeeds again (the rows stay those of the last good one).
    pub error: Option<String>,
}

impl Overview {
    pub fn new(config: &Config) -> Overview {
        Overview {
            names: config
                .queues
                .iter()
                .map(|q| (q.name.clone(), q.mode.as_str()))
                .collect(),
            last: config.queues.iter().map(|_| None).collect(),
            rows: Vec::new(),
            updated: None,
            error: None,
        }
    }

    /// Takes in a poll: new rows when it succeeded (returns true), the error and the old rows when it failed.
    pub fn update(&mut self, poll: Poll) -> bool {
        let reads = match poll.reads {
            Ok(reads) => reads,
            Err(error) => {
                self.error = Some(error);
                return false;
            }
        };
        self.error = None;
        self.rows = reads
            .iter()
            .zip(&self.last)
            .zip(&self.names)
            .map(|((read, before), (name, mode))| {
                let s = &read.stats;
                Row {
                    name: name.clone(),
                    mode,
                    paused: s.paused,
                    throttled: s.throttle_ms.is_some(),
                    ready: s.ready,
                    ready_by_level: s.ready_by_level.clone(),
                    processing: s.processing,
                    delayed: s.delayed,
                    waiting: s.waiting,
                    dead: s.dead,
                    rates: before
                        .as_ref()
                        .map(|b| s.rates_since(&b.stats, read.at - b.at)),
                    lag_ms: s.lag_ms,
                    daemons: read.daemons,
                    limits: read.limits.clone(),
                }
            })
            .collect();
        self.last = reads.into_iter().map(Some).collect();
        self.updated = Some(poll.wall);
        true
    }
}

/// Polls every queue every `interval` until the receiver is gone.
pub fn poll_forever(
    client: &Client,
    queues: &[QueueConfig],
    interval: Duration,
    polls: &Sender<Poll>,
) {
    loop {
        let started = Instant::now();
        let reads = queues
            .iter()
            .map(|queue| {
                let stats = client.stats(&queue.name)?;
                let at = Instant::now();
                let limits = read_limits(client, queue, &stats)?;
                let daemons = client.workers(&queue.name)?.len();
                Ok(Read {
                    at,
                    stats,
                    limits,
                    daemons,
                })
            })
            .collect::<Result<Vec<Read>, ClientError>>()
            .map_err(|error| error.to_string());
        let poll = Poll {
            wall: SystemTime::now(),
            reads,
        };
        if polls.send(poll).is_err() {
            return;
        }
        std::thread::sleep(interval.saturating_sub(started.elapsed()));
    }
}

/// A queue's flow-control limits against what Redis counts now, as `kmqd stats` shows them under its table (and
/// under `limits` in its JSON): the dashboard's limits panel draws the same, so the two never disagree on
/// whether, and by what, a queue is held back.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Limits {
    /// The line `kmqd stats` prints: `running 20/20, held back · rate 200/200 per 1s, held back · type "report":
    /// running 2/2, held back, 14 waiting · groups waiting 12 · throttled 1.2s more`.
    pub line: String,
    /// What holds tasks back now, one entry per scope that does, in the line's words (`running 20/20`, `rate
    /// 200/200 per 1s`, `type "report": running 2/2`, `throttled 1.2s more`); empty when nothing does. A type's
    /// entry holds back only its own tasks; the queue's hold back all of them.
    pub held_back: Vec<String>,
    /// The same as JSON, `kmqd stats --json`'s `limits`: `max_running` (`limit`, `running`, `held_back`),
    /// `rate_limit` (per window: `window_ms`, `limit`, `used`, `held_back`), `types` (per `[[queues.limits]]`
    /// entry: `type`, its `max_running` and `rate_limit` alike, `waiting`, `throttle_ms`), `groups` (a grouped
    /// queue's: `waiting`, how many of its groups have tasks waiting) and
    /// `throttle_ms`, each present only when configured (or, for a throttle, in force).
    #[serde(flatten)]
    pub detail: serde_json::Map<String, serde_json::Value>,
}

/// Reads what `queue`'s limits count now (its rate windows' starts, its types' running counts, windows, waiting
/// tasks and throttles, and a grouped queue's groups waiting) and puts them beside `stats` ([`limits`]); `None`
/// for a queue with no limit, no groups and no throttle. Three reads at most, each bounded by the queue's config
/// (its windows, its `[[queues.limits]]` entries and levels), never by its tasks, flows or groups: cheap enough
/// for a poll every second.
pub fn read_limits(
    client: &Client,
    queue: &QueueConfig,
    stats: &QueueStats,
) -> Result<Option<Limits>, ClientError> {
    let windows: Vec<u64> = queue
        .rate_limit
        .iter()
        .map(|rate| rate.window_ms())
        .collect();
    let used = client.rate_used(&queue.name, &windows)?;
    let types = if queue.type_limits.is_empty() {
        Vec::new()
    } else {
        client.type_usage(&queue.name, &queue.type_limits)?
    };
    let groups_waiting = match queue.groups {
        Some(_) => Some(client.groups_waiting(&queue.name)?),
        None => None,
    };
    Ok(limits(queue, stats, &used, &types, groups_waiting))
}

/// The queue's limits against its counts: `used`, the starts each of its rate windows holds now
/// ([`Client::rate_used`]); `types`, what each of its `[[queues.limits]]` counts ([`Client::type_usage`]);
/// `groups_waiting`, how many of a grouped queue's groups have tasks waiting ([`Client::groups_waiting`]). `None` for a queue with neither a
/// limit, nor groups, nor a throttle.
pub fn limits(
    queue: &QueueConfig,
    stats: &QueueStats,
    used: &[u64],
    types: &[TypeUsage],
    groups_waiting: Option<u64>,
) -> Option<Limits> {
    let mut parts = Vec::new();
    let mut held_back = Vec::new();
    let mut detail = serde_json::Map::new();
    let (queue_parts, queue_json) =
        limit_parts(queue.max_running, stats.running, &queue.rate_limit, used);
    held_back.extend(held(&queue_parts));
    parts.extend(queue_parts.into_iter().map(|part| part.text));
    detail.extend(queue_json);
    let mut per_type = Vec::new();
    for (limit, usage) in queue.type_limits.iter().zip(types) {
        let (mut type_parts, mut type_json) = limit_parts(
            limit.max_running,
            usage.running,
            &limit.rate_limit,
            &usage.rate_used,
        );
        type_json.insert("type".into(), limit.kind.clone().into());
        type_json.insert("waiting".into(), usage.waiting.into());
        if let Some(ms) = usage.throttle_ms {
            type_parts.push(Part::held(throttled(ms)));
            type_json.insert("throttle_ms".into(), ms.into());
        }
        let type_held = held(&type_parts);
        if !type_held.is_empty() {
            held_back.push(format!("type {:?}: {}", limit.kind, type_held.join(", ")));
        }
        if usage.waiting > 0 {
            type_parts.push(Part::free(format!("{} waiting", usage.waiting)));
        }
        let words: Vec<String> = type_parts.into_iter().map(|part| part.text).collect();
        parts.push(format!("type {:?}: {}", limit.kind, words.join(", ")));
        per_type.push(serde_json::Value::Object(type_json));
    }
    if !per_type.is_empty() {
        detail.insert("types".into(), serde_json::Value::Array(per_type));
    }
    // Said, never held back: a group's limits and pause hold back its own tasks only (the other groups take their
    // turns), and a group at its max_running is how a fair queue runs; `kmqd groups` and the dashboard name them.
    if let Some(waiting) = groups_waiting {
        parts.push(format!("groups waiting {waiting}"));
        detail.insert("groups".into(), serde_json::json!({ "waiting": waiting }));
    }
    if let Some(ms) = stats.throttle_ms {
        parts.push(throttled(ms));
        held_back.push(throttled(ms));
        detail.insert("throttle_ms".into(), serde_json::Value::from(ms));
    }
    (!parts.is_empty()).then(|| Limits {
        line: parts.join(" · "),
        held_back,
        detail,
    })
}

/// One part of a scope's words (`running 20/20, held back`), and whether it holds the scope back.
struct Part {
    text: String,
    /// Its words without ", held back": what [`Limits::held_back`] lists; `None` when it does not hold back.
    held: Option<String>,
}

impl Part {
    fn free(text: String) -> Part {
        Part { text, held: None }
    }

    fn held(text: String) -> Part {
        Part {
            held: Some(text.clone()),
            text,
        }
    }

    /// `words`, holding back when `full` (said as `kmqd stats` says it: "…, held back").
    fn full_when(words: String, full: bool) -> Part {
        if full {
            Part {
                text: format!("{words}, held back"),
                held: Some(words),
            }
        } else {
            Part::free(words)
        }
    }
}

fn held(parts: &[Part]) -> Vec<String> {
    parts.iter().filter_map(|part| part.held.clone()).collect()
}

fn throttled(ms: i64) -> String {
    format!(
        "throttled {} more",
        humantime::format_duration(Duration::from_millis(ms.max(0) as u64))
    )
}

/// The parts and the JSON of one scope's limits (the queue's, or a type's): its running count against its
/// `max_running`, and each rate window's starts against its limit, each holding back when full.
fn limit_parts(
    max_running: Option<usize>,
    running: u64,
    rate_limit: &[crate::config::rate::RateLimit],
    used: &[u64],
) -> (Vec<Part>, serde_json::Map<String, serde_json::Value>) {
    let mut parts = Vec::new();
    let mut json = serde_json::Map::new();
    if let Some(limit) = max_running {
        let full = running as usize >= limit;
        parts.push(Part::full_when(format!("running {running}/{limit}"), full));
        json.insert(
            "max_running".into(),
            serde_json::json!({ "limit": limit, "running": running, "held_back": full }),
        );
    }
    let mut rates = Vec::new();
    for (rate, used) in rate_limit.iter().zip(used) {
        let full = *used >= rate.starts;
        let window = humantime::format_duration(Duration::from_millis(rate.window_ms()));
        parts.push(Part::full_when(
            format!("rate {used}/{} per {window}", rate.starts),
            full,
        ));
        rates.push(serde_json::json!({
            "window_ms": rate.window_ms(),
            "limit": rate.starts,
            "used": used,
            "held_back": full,
        }));
    }
    if !rates.is_empty() {
        json.insert("rate_limit".into(), serde_json::Value::Array(rates));
    }
    (parts, json)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(text: &str) -> QueueConfig {
        let config = Config::parse(
            std::path::Path::new("kmqd.toml"),
            &format!("[[queues]]\nname = \"api\"\nmode = \"safe\"\n{text}"),
        )
        .unwrap();
        config.queues[0].clone()
    }

    fn usage(running: u64, rate_used: &[u64], waiting: u64, throttle_ms: Option<i64>) -> TypeUsage {
        TypeUsage {
            running,
            rate_used: rate_used.to_vec(),
            waiting,
            throttle_ms,
        }
    }

    #[test]
    fn a_queue_without_limits_or_throttle_has_none() {
        assert_eq!(
            limits(&queue(""), &QueueStats::default(), &[], &[], None),
            None
        );
    }

    /// What holds back is listed by scope in `kmqd stats`'s words, and only what is full (or throttled).
    #[test]
    fn held_back_names_each_full_limit_in_the_stats_words() {
        let limited = queue(
            "max_running = 20\nrate_limit = [\"200/s\", \"1000/h\"]\n\
             [[queues.limits]]\ntype = \"report\"\nmax_running = 2\n\
             [[queues.limits]]\ntype = \"mail\"\nrate_limit = \"5/m\"\n",
        );
        let stats = QueueStats {
            running: 20,
            throttle_ms: Some(1200),
            ..QueueStats::default()
        };
        let types = [usage(2, &[], 14, None), usage(0, &[1], 0, None)];
        let read = limits(&limited, &stats, &[200, 310], &types, None).unwrap();
        assert_eq!(
            read.line,
            "running 20/20, held back · rate 200/200 per 1s, held back · rate 310/1000 per 1h · \
             type \"report\": running 2/2, held back, 14 waiting · type \"mail\": rate 1/5 per 1m · \
             throttled 1s 200ms more"
        );
        assert_eq!(
            read.held_back,
            [
                "running 20/20",
                "rate 200/200 per 1s",
                "type \"report\": running 2/2",
                "throttled 1s 200ms more"
            ]
        );
        let json = serde_json::to_value(&read).unwrap();
        assert_eq!(
            json["max_running"],
            serde_json::json!({"limit": 20, "running": 20, "held_back": true})
        );
        assert_eq!(json["types"][0]["waiting"], 14);
        assert_eq!(json["types"][1]["rate_limit"][0]["used"], 1);
        assert_eq!(json["throttle_ms"], 1200);

        // Below every limit, a type's throttle alone holds back (its tasks), and nothing else does.
        let stats = QueueStats {
            running: 3,
            ..QueueStats::default()
        };
        let types = [usage(1, &[], 0, Some(500)), usage(0, &[0], 0, None)];
        let read = limits(&limited, &stats, &[0, 0], &types, None).unwrap();
        assert_eq!(read.held_back, ["type \"report\": throttled 500ms more"]);
    }

    /// A grouped queue says how many groups wait, in the line and under `groups` in the JSON, but its groups never
    /// hold the queue back: a group's limits and pause hold back only its own tasks.
    #[test]
    fn a_grouped_queue_says_its_groups_waiting_and_is_not_held_back_by_them() {
        let grouped = queue("[queues.groups]\nmax_running = 1\n");
        let stats = QueueStats::default();
        let read = limits(&grouped, &stats, &[], &[], Some(12)).unwrap();
        assert_eq!(read.line, "groups waiting 12");
        assert!(read.held_back.is_empty(), "{:?}", read.held_back);
        assert_eq!(
            serde_json::to_value(&read).unwrap()["groups"],
            serde_json::json!({"waiting": 12})
        );
        let idle = limits(&grouped, &stats, &[], &[], Some(0)).unwrap();
        assert_eq!(idle.line, "groups waiting 0");
    }
}
