//! `kmqd stats --watch [--interval 1s]`: each queue's depths, rates and daemons, polled every interval.
//!
//! On a terminal, a full-screen view redrawn after every poll ([`screen`]); otherwise (a pipe, a log file) one
//! plain `key=value` line per queue per poll ([`view::line()`]). The poller thread ([`crate::overview`], which
//! the dashboard shares) reads Redis, so that the screen keeps answering keys while Redis is slow or down: a
//! failed poll is shown (on the screen, or on standard error in plain mode) and tried again next interval, never
//! a reason to exit.

mod screen;
mod view;

use std::io::{IsTerminal, Write};
use std::time::Duration;

use crossbeam_channel::Receiver;

use crate::broker::access::Action;
use crate::client::Client;
use crate::config::Config;
use crate::overview::{Overview, Poll, Row, poll_forever};

use super::Failure;
use super::colour::Colour;

/// What the view knows: the overview's rows, and when they were read in the two forms the view prints.
struct Watch {
    overview: Overview,
    /// When the rows were read: local time for the screen, RFC 3339 UTC for the plain lines.
    updated_local: Option<String>,
    updated_utc: String,
}

impl Watch {
    fn new(config: &Config) -> Watch {
        Watch {
            overview: Overview::new(config),
            updated_local: None,
            updated_utc: String::new(),
        }
    }

    /// Takes in a poll: new rows when it succeeded, the error (and the old rows) when it failed.
    fn update(&mut self, poll: Poll) {
        let wall = poll.wall;
        if self.overview.update(poll) {
            self.updated_local = Some(jiff::Zoned::now().strftime("%H:%M:%S").to_string());
            self.updated_utc = humantime::format_rfc3339_seconds(wall).to_string();
        }
    }

    fn rows(&self) -> &[Row] {
        &self.overview.rows
    }

    fn error(&self) -> Option<&str> {
        self.overview.error.as_deref()
    }
}

pub(super) fn run_watch(config: &Config, interval: Duration) -> Result<(), Failure> {
    let client = Client::new(config)?;
    let queues = config.queues.clone();
    let borrowed: Vec<&str> = queues.iter().map(|q| q.name.as_str()).collect();
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
        .spawn(move || poll_forever(&client, &queues, interval, &polls_tx))
        .map_err(|error| Failure::Runtime(format!("cannot start the poller: {error}")))?;
    let watch = Watch::new(config);
    if std::io::stdout().is_terminal() {
        screen::run(watch, &polls, interval, Colour::stdout())
    } else {
        print_lines(watch, &polls)
    }
}

/// The plain mode: one line per queue per poll on standard output, failures on standard error. Ends quietly when
/// standard output is closed (`| head`).
fn print_lines(mut watch: Watch, polls: &Receiver<Poll>) -> Result<(), Failure> {
    for poll in polls {
        watch.update(poll);
        if let Some(error) = watch.error() {
            let _ = writeln!(std::io::stderr(), "kmqd: {error} (retrying)");
            continue;
        }
        let mut out = std::io::stdout().lock();
        let written = watch
            .rows()
            .iter()
            .try_for_each(|row| writeln!(out, "{}", view::line(row, &watch.updated_utc)))
            .and_then(|()| out.flush());
        if written.is_err() {
            return Ok(());
        }
    }
    Err(Failure::Runtime("the poller stopped".to_string()))
}
