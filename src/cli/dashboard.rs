//! `kmqd dashboard [--listen 127.0.0.1:8080] [--read-only]`: the web UI and JSON API (src/dashboard/,
//! docs/DASHBOARD.md). Thin: checks the authentication, the listen address and the Redis user's rights, then
//! serves. `kmqd dashboard hash-password NAME` makes a line of the users file.

use std::io::{BufRead, IsTerminal, Write};
use std::net::SocketAddr;

use clap::{Args, Subcommand};

use crate::broker::access::Action;
use crate::config::Config;
use crate::dashboard::auth::{self, Auth};
use crate::dashboard::{DEFAULT_LISTEN, Dashboard, Options};

use super::Failure;

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct DashboardArgs {
    #[command(subcommand)]
    pub(crate) command: Option<DashboardCommand>,
    /// The address to serve on (port 0: a free one, logged at start). An address beyond loopback needs
    /// authentication: `[dashboard] users_file`, `token_env` or `token_file`.
    #[arg(long, value_name = "ADDR", default_value = DEFAULT_LISTEN)]
    pub(crate) listen: SocketAddr,
    /// Show everything, change nothing: no buttons, and every action refused (403).
    #[arg(long)]
    pub(crate) read_only: bool,
}

#[derive(Subcommand, Debug)]
pub enum DashboardCommand {
    /// Read a password from standard input (its first line) and print `NAME:HASH`, a line of `[dashboard]
    /// users_file` (Argon2id). Needs no config.
    HashPassword { name: String },
}

/// What the pages read, and what their buttons do.
const READS: [Action; 5] = [
    Action::Stats,
    Action::Workers,
    Action::Show,
    Action::DeadRead,
    Action::History,
];
const ACTIONS: [Action; 5] = [
    Action::Pause,
    Action::Resume,
    Action::Cancel,
    Action::DeadRequeue,
    Action::DeadPurge,
];

/// `kmqd dashboard hash-password NAME`.
pub(super) fn hash_password(name: &str) -> Result<(), Failure> {
    if name.is_empty() || name.contains(':') || name.chars().any(char::is_whitespace) {
        return Err(Failure::Usage(format!(
            "{name:?}: a user name is not empty and has no ':' and no spaces"
        )));
    }
    if std::io::stdin().is_terminal() {
        eprint!("password for {name} (the line is shown as typed): ");
    }
    let mut password = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut password)
        .map_err(|error| Failure::Runtime(format!("cannot read the password: {error}")))?;
    let password = password.trim_end_matches(['\r', '\n']);
    if password.is_empty() {
        return Err(Failure::Usage("the password is empty".to_string()));
    }
    let hash = auth::hash_password(password).map_err(Failure::Runtime)?;
    let _ = writeln!(std::io::stdout(), "{name}:{hash}");
    Ok(())
}

pub(super) fn run_dashboard(config: &Config, args: DashboardArgs) -> Result<(), Failure> {
    let auth = Auth::load(&config.dashboard).map_err(Failure::Usage)?;
    if auth.is_none() && !args.listen.ip().is_loopback() {
        return Err(Failure::Usage(format!(
            "--listen {}: beyond loopback (127.0.0.1, ::1) the dashboard needs authentication: set \
             [dashboard] users_file, token_env or token_file in {} (docs/DASHBOARD.md, \"Authentication\"), or \
             reach a loopback dashboard through an SSH tunnel (ssh -L 8080:127.0.0.1:8080 HOST)",
            args.listen,
            config.path.display()
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
    if !args.read_only {
        // The buttons requeue dead tasks as `dead requeue` does, which refuses a Redis that may evict them; the
        // dashboard is also for looking, so it warns once, at start (a Redis not answering yet is waited for).
        match super::check_eviction(&client, super::OnEviction::Warn) {
            Ok(()) | Err(Failure::Runtime(_)) => {}
            Err(other) => return Err(other),
        }
    }
    let options = Options {
        listen: args.listen,
        read_only: args.read_only,
    };
    let authenticated = auth.is_some();
    let dashboard = Dashboard::bind(config, client, &options, auth)
        .map_err(|error| Failure::Runtime(format!("cannot listen on {}: {error}", args.listen)))?;
    let addr = dashboard.addr();
    // The bound address: with port 0 this line is how to find the dashboard.
    tracing::info!(
        %addr,
        read_only = args.read_only,
        authenticated,
        "dashboard on http://{addr}/"
    );
    dashboard
        .run()
        .map_err(|error| Failure::Runtime(format!("dashboard: {error}")))
}
