//! `kmqd dashboard [--listen 127.0.0.1:8080] [--read-only]`: the web UI and JSON API (src/dashboard/,
//! docs/DASHBOARD.md). Thin: checks the Redis user's rights and the listen address, then serves.

use std::net::SocketAddr;

use clap::Args;

use crate::broker::access::Action;
use crate::config::Config;
use crate::dashboard::{DEFAULT_LISTEN, Dashboard, Options};

use super::Failure;

#[derive(Args, Debug)]
pub struct DashboardArgs {
    /// The address to serve on (port 0: a free one, logged at start). Loopback only: another address needs
    /// authentication, which this dashboard does not have yet.
    #[arg(long, value_name = "ADDR", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Show everything, change nothing: no buttons, and every action refused (403).
    #[arg(long)]
    pub read_only: bool,
}

/// What the pages read, and what their buttons do.
const READS: [Action; 4] = [
    Action::Stats,
    Action::Workers,
    Action::Show,
    Action::DeadRead,
];
const ACTIONS: [Action; 5] = [
    Action::Pause,
    Action::Resume,
    Action::Cancel,
    Action::DeadRequeue,
    Action::DeadPurge,
];

pub(super) fn run_dashboard(config: &Config, args: DashboardArgs) -> Result<(), Failure> {
    if !args.listen.ip().is_loopback() {
        return Err(Failure::Usage(format!(
            "--listen {}: the dashboard serves loopback addresses only (127.0.0.1, ::1), since it has no \
             authentication; reach it from elsewhere through an SSH tunnel (ssh -L 8080:127.0.0.1:8080 HOST)",
            args.listen
        )));
    }
    let client = crate::client::Client::new(config)?;
    let names: Vec<&str> = config.queues.iter().map(|q| q.name.as_str()).collect();
    let needed: Vec<Action> = if args.read_only {
        READS.to_vec()
    } else {
        READS.iter().chain(&ACTIONS).copied().collect()
    };
    for action in needed {
        // A refusal (credentials, ACL rules) is the setup's to fix; a Redis that does not answer yet is waited
        // for, as `stats --watch` does, and shown on the pages.
        match client.check_access(&names, action).map_err(Failure::from) {
            Ok(()) | Err(Failure::Runtime(_)) => {}
            Err(Failure::Usage(why)) if ACTIONS.contains(&action) => {
                return Err(Failure::Usage(format!(
                    "{why} (the dashboard's buttons need it; with --read-only they are off)"
                )));
            }
            Err(other) => return Err(other),
        }
    }
    let options = Options {
        listen: args.listen,
        read_only: args.read_only,
    };
    let dashboard = Dashboard::bind(config, client, &options)
        .map_err(|error| Failure::Runtime(format!("cannot listen on {}: {error}", args.listen)))?;
    let addr = dashboard.addr();
    // The bound address: with port 0 this line is how to find the dashboard.
    tracing::info!(%addr, read_only = args.read_only, "dashboard on http://{addr}/");
    dashboard
        .run()
        .map_err(|error| Failure::Runtime(format!("dashboard: {error}")))
}
