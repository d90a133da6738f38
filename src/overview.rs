//! Every queue at a glance, polled: what `kmqd stats --watch` draws and the dashboard's overview serves
//! (`kmqd dashboard`, docs/DASHBOARD.md). One poller for both, so the two show the same numbers the same way.
//!
//! A poll reads each queue's stats and the daemons alive on it ([`poll_forever`], on a thread of its own, so a
//! slow or absent Redis never blocks a screen or a page); [`Overview::update`] turns a poll into one [`Row`] per
//! queue. done/s and failed/s are the growth of the queue's Redis counters between two polls divided by the
//! real time between the two reads: the queue's rates across every daemon.

use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::Sender;
use serde::Serialize;

use crate::broker::{QueueStats, Rates};
use crate::client::{Client, ClientError};
use crate::config::Config;

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
    pub dead: u64,
    /// Since the poll before; `None` at the first poll.
    pub rates: Option<Rates>,
    pub lag_ms: Option<i64>,
    /// Daemons alive on the queue (what `kmqd workers` lists).
    pub daemons: usize,
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

/// One queue's read at one poll: its stats, the daemons alive on it, and when the stats were read.
pub struct Read {
    at: Instant,
    stats: QueueStats,
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
                    dead: s.dead,
                    rates: before
                        .as_ref()
                        .map(|b| s.rates_since(&b.stats, read.at - b.at)),
                    lag_ms: s.lag_ms,
                    daemons: read.daemons,
                }
            })
            .collect();
        self.last = reads.into_iter().map(Some).collect();
        self.updated = Some(poll.wall);
        true
    }
}

/// Polls every queue every `interval` until the receiver is gone.
pub fn poll_forever(client: &Client, queues: &[String], interval: Duration, polls: &Sender<Poll>) {
    loop {
        let started = Instant::now();
        let reads = queues
            .iter()
            .map(|queue| {
                let stats = client.stats(queue)?;
                let at = Instant::now();
                let daemons = client.workers(queue)?.len();
                Ok(Read { at, stats, daemons })
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
