//! `kmqd stats --watch [--interval 1s]`: each queue's depths, rates and daemons, polled every interval.
//!
//! On a terminal, a full-screen view redrawn after every poll ([`screen`]); otherwise (a pipe, a log file) one
//! plain `key=value` line per queue per poll ([`view::line()`]). A poller thread reads Redis, so that the screen
//! keeps answering keys while Redis is slow or down: a failed poll is shown (on the screen, or on standard error
//! in plain mode) and tried again next interval, never a reason to exit. done/s and failed/s are the growth of
//! the queue's Redis counters between two polls divided by the real time between the two reads, so they are the
//! queue's rates across every daemon.

mod screen;
mod view;

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, Sender};

use crate::broker::QueueStats;
use crate::broker::access::Action;
use crate::client::{Client, ClientError};
use crate::config::Config;

use super::Failure;
use super::colour::Colour;
use view::Row;

/// One queue's read at one poll: its stats, the daemons alive on it, and when the stats were read.
struct Read {
    at: Instant,
    stats: QueueStats,
    daemons: usize,
}

/// One poll of every queue, or why it failed.
struct Poll {
    wall: SystemTime,
    reads: Result<Vec<Read>, String>,
}

/// What the view knows: the rows of the last good poll and the reads their rates are measured from.
struct Watch {
    names: Vec<(String, &'static str)>,
    last: Vec<Option<Read>>,
    rows: Vec<Row>,
    /// When the rows were read: local time for the screen, RFC 3339 UTC for the plain lines.
    updated_local: Option<String>,
    updated_utc: String,
    error: Option<String>,
}

impl Watch {
    fn new(config: &Config) -> Watch {
        Watch {
            names: config
                .queues
                .iter()
                .map(|q| (q.name.clone(), q.mode.as_str()))
                .collect(),
            last: config.queues.iter().map(|_| None).collect(),
            rows: Vec::new(),
            updated_local: None,
            updated_utc: String::new(),
            error: None,
        }
    }

    /// Takes in a poll: new rows when it succeeded, the error (and the old rows) when it failed.
    fn update(&mut self, poll: Poll) {
        let reads = match poll.reads {
            Ok(reads) => reads,
            Err(error) => {
                self.error = Some(error);
                return;
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
        self.updated_local = Some(jiff::Zoned::now().strftime("%H:%M:%S").to_string());
        self.updated_utc = humantime::format_rfc3339_seconds(poll.wall).to_string();
    }
}

pub(super) fn run_watch(config: &Config, interval: Duration) -> Result<(), Failure> {
    let client = Client::new(config)?;
    let names: Vec<String> = config.queues.iter().map(|q| q.name.clone()).collect();
    let borrowed: Vec<&str> = names.iter().map(String::as_str).collect();
    for action in [Action::Stats, Action::Workers] {
        // A refusal (credentials, ACL rules) is the setup's to fix: exit as `kmqd stats` does. A Redis that does
        // not answer yet is waited for, like any later failure, on the screen.
        match client
            .check_access(&borrowed, action)
            .map_err(Failure::from)
        {
            Ok(()) | Err(Failure::Runtime(_)) => {}
            Err(other) => return Err(other),
        }
    }
    let (polls_tx, polls) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name("kmqd-watch-poller".to_string())
        .spawn(move || poll_forever(&client, &names, interval, &polls_tx))
        .map_err(|error| Failure::Runtime(format!("cannot start the poller: {error}")))?;
    let watch = Watch::new(config);
    if std::io::stdout().is_terminal() {
        screen::run(watch, &polls, interval, Colour::stdout())
    } else {
        print_lines(watch, &polls)
    }
}

/// Polls every queue every `interval` until the receiver is gone.
fn poll_forever(client: &Client, queues: &[String], interval: Duration, polls: &Sender<Poll>) {
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

/// The plain mode: one line per queue per poll on standard output, failures on standard error. Ends quietly when
/// standard output is closed (`| head`).
fn print_lines(mut watch: Watch, polls: &Receiver<Poll>) -> Result<(), Failure> {
    for poll in polls {
        watch.update(poll);
        if let Some(error) = &watch.error {
            let _ = writeln!(std::io::stderr(), "kmqd: {error} (retrying)");
            continue;
        }
        let mut out = std::io::stdout().lock();
        let written = watch
            .rows
            .iter()
            .try_for_each(|row| writeln!(out, "{}", view::line(row, &watch.updated_utc)))
            .and_then(|()| out.flush());
        if written.is_err() {
            return Ok(());
        }
    }
    Err(Failure::Runtime("the poller stopped".to_string()))
}
