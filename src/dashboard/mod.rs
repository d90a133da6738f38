//! `kmqd dashboard`: a web UI and its JSON API for every queue of a config, served from one process that needs
//! only Redis (docs/DASHBOARD.md). It claims nothing and registers nowhere: run it on any host, as many as wanted.
//!
//! - [`auth`]: users (HTTP Basic, Argon2id hashes) and a bearer token, when `[dashboard]` configures them;
//! - [`server`]: the HTTP side (served by [`crate::http`], as the metrics endpoint: synchronous, a few threads of
//!   its own, bounded in connections, sizes and time, no async runtime): routing, the checks every request passes
//!   (Host, and for an action the CSRF token, the Origin and `--read-only`), the audit log of actions;
//! - [`api`]: what each `/api/...` route answers, through [`Client`], the same calls the CLI makes: one
//!   implementation of each action, shared by `kmqd dead requeue` and the dashboard's button;
//! - [`assets`]: the pages, CSS and JavaScript, embedded in the binary (no build step, nothing to install).
//!
//! The overview is the poller of `kmqd stats --watch` ([`crate::overview`]) on a thread of its own, once a
//! second: every page view and API call reads its last rows instead of asking Redis again, so a dozen open
//! browsers cost Redis what one does.

mod api;
mod assets;
pub mod auth;
mod server;

use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::client::Client;
use crate::config::Config;
use crate::http::{Limits, Request, Server};
use crate::overview::{self, Overview};
use crate::poison::lock;
use crate::shutdown::Trigger;

/// Where `kmqd dashboard` listens unless `--listen` says otherwise: loopback only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// How often the overview polls Redis, and how often the pages ask the dashboard.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Threads answering requests: a slow Redis call of one page view does not hold up the others.
const HANDLERS: usize = 4;

/// The most bytes an action's body may have: a list of dead records' ids to requeue or purge (the page lists
/// 500 at most, a few dozen bytes each).
const MAX_BODY: usize = 64 * 1024;

/// The server's bounds (crate::http): 4 handler threads, 64 connections, 10 s timeouts, heads of 16 KiB.
const LIMITS: Limits = Limits::new(HANDLERS, MAX_BODY);

/// How `kmqd dashboard` was asked to run.
#[derive(Clone, Debug)]
pub struct Options {
    pub listen: SocketAddr,
    /// Show everything, change nothing: the pages have no buttons and every action is refused (403).
    pub read_only: bool,
}

/// A bound dashboard, ready to [`Dashboard::run`].
pub struct Dashboard {
    listener: TcpListener,
    state: Arc<server::State>,
    queues: Vec<crate::config::QueueConfig>,
    addr: SocketAddr,
}

impl Dashboard {
    /// Binds `options.listen` (port 0: a free one, see [`Dashboard::addr`]); every request needs `auth`'s
    /// credentials when there is one.
    pub fn bind(
        config: &Config,
        client: Client,
        options: &Options,
        auth: Option<auth::Auth>,
    ) -> std::io::Result<Dashboard> {
        let listener = TcpListener::bind(options.listen)?;
        let addr = listener.local_addr()?;
        let state = server::State::new(config, client, options, auth, addr);
        Ok(Dashboard {
            listener,
            state: Arc::new(state),
            queues: config.queues.clone(),
            addr,
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until the process is stopped (SIGINT, SIGTERM: nothing to hand back or settle).
    pub fn run(self) -> std::io::Result<()> {
        let Dashboard {
            listener,
            state,
            queues,
            addr: _,
        } = self;
        // Fired when this function returns: the server stops with the dashboard.
        let stop = Trigger::new();
        let handlers = Arc::clone(&state);
        let server = Server::start(
            listener,
            "kmqd-dashboard",
            LIMITS,
            move |request: &Request| server::handle(&handlers, request),
            stop.listener(),
        )?;
        let serving = std::thread::Builder::new()
            .name("kmqd-dashboard-http".to_string())
            .spawn(move || server.run())?;
        let stopped = take_polls(&state, queues);
        stop.fire();
        // Within a tick of the trigger, once the requests in hand are answered.
        if serving.join().is_err() {
            tracing::error!("the dashboard's HTTP server panicked");
        }
        stopped
    }
}

/// Takes in the overview's polls until its poller stops (it does not, but for a panic).
fn take_polls(
    state: &Arc<server::State>,
    queues: Vec<crate::config::QueueConfig>,
) -> std::io::Result<()> {
    let (polls_tx, polls) = crossbeam_channel::bounded(1);
    let polling = Arc::clone(state);
    std::thread::Builder::new()
        .name("kmqd-dashboard-poller".to_string())
        .spawn(move || {
            overview::poll_forever(&polling.client, &queues, POLL_INTERVAL, &polls_tx)
        })?;
    for poll in polls {
        let mut overview = lock(&state.overview);
        if !overview.update(poll) {
            tracing::warn!(
                error = overview.error.as_deref(),
                "overview poll failed (retrying)"
            );
        }
    }
    Err(std::io::Error::other("the overview poller stopped"))
}

/// The overview as the API serves it, shared by the request threads and written by the poll loop.
type SharedOverview = Mutex<Overview>;
