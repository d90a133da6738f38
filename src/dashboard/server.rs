//! Routing and the checks every request passes.
//!
//! - Authentication, when `[dashboard]` configures it ([`super::auth`]): every request, pages and API, needs a
//!   user's password (HTTP Basic) or the bearer token, else 401.
//! - Host, without authentication (loopback): the page and the API answer only to the names of the address
//!   they listen on (`127.0.0.1:PORT`, `localhost:PORT`, `[::1]:PORT`), so a web page elsewhere cannot reach
//!   them through DNS rebinding (a name of its own that resolves to 127.0.0.1) and read them as same-origin.
//!   With authentication a rebound name gets nothing either: the browser has no credentials for it.
//! - Actions (POST) need the process's CSRF token in the `X-Kmqd-Csrf` header (the pages have it from their
//!   `<meta name="kmqd-csrf">`, scripts from `GET /api/session`), and an `Origin`, when the client sends one,
//!   of this server; a cross-site form can set neither. `--read-only` refuses every one (403).
//! - Every action is logged (info, `dashboard action`) with who asked, from where, what and the outcome.
//!
//! Responses carry a Content-Security-Policy that allows only this server's own scripts and styles (the pages
//! have no inline script), `X-Frame-Options: DENY` (no clickjacking of the buttons) and `Cache-Control:
//! no-store`.

use std::net::SocketAddr;

use percent_encoding::percent_decode_str;
use serde_json::{Value as Json, json};

use super::api::{self, Action, ApiError};
use super::auth::{self, Auth};
use super::{Options, SharedOverview, assets};
use crate::client::Client;
use crate::config::Config;
use crate::http::{Request, Response};
use crate::overview::Overview;

/// What every request thread shares.
pub(super) struct State {
    pub client: Client,
    pub overview: SharedOverview,
    pub read_only: bool,
    /// `None`: no authentication (loopback only).
    auth: Option<Auth>,
    /// Random per process: a page served by an earlier run no longer acts.
    csrf: String,
    /// The `Host` values the server answers to.
    hosts: Vec<String>,
    /// Queue names and modes, in config order.
    pub queues: Vec<(String, &'static str)>,
    /// The queues' configs, in config order: a queue's page reads what its limits count ([`api::queue`]).
    pub configs: Vec<crate::config::QueueConfig>,
    /// Held by a task page's lookup while it scans its queue's lists: one at a time (`api::task`).
    pub lookups: std::sync::Mutex<()>,
    /// Each grouped queue's busiest groups as last read, by queue name: a queue's page reads them again only once
    /// the read is [`api::GROUPS_EVERY`] old, and the lock is held while it does (one read of groups at a time,
    /// whichever pages ask); a group's pause or resume forgets its queue's read, so the page shows the change.
    pub groups: std::sync::Mutex<std::collections::HashMap<String, api::GroupsRead>>,
}

impl State {
    pub fn new(
        config: &Config,
        client: Client,
        options: &Options,
        auth: Option<Auth>,
        addr: SocketAddr,
    ) -> State {
        let port = addr.port();
        let mut hosts = vec![
            format!("127.0.0.1:{port}"),
            format!("localhost:{port}"),
            format!("[::1]:{port}"),
        ];
        if !hosts.contains(&addr.to_string()) {
            hosts.push(addr.to_string());
        }
        State {
            client,
            overview: SharedOverview::new(Overview::new(config)),
            read_only: options.read_only,
            auth,
            csrf: uuid::Uuid::new_v4().simple().to_string(),
            hosts,
            queues: config
                .queues
                .iter()
                .map(|q| (q.name.clone(), q.mode.as_str()))
                .collect(),
            configs: config.queues.clone(),
            lookups: std::sync::Mutex::new(()),
            groups: std::sync::Mutex::new(std::collections::HashMap::new()),
        }
    }

    pub fn csrf(&self) -> &str {
        &self.csrf
    }
}

type Reply = Response;

/// Answers one request (its body was read whole by the server, within `super::MAX_BODY`).
pub(super) fn handle(state: &State, request: &Request) -> Reply {
    match route(state, request) {
        Ok(reply) => reply,
        Err(error) => json_reply(error.status, &json!({ "error": error.message })),
    }
}

fn route(state: &State, request: &Request) -> Result<Reply, ApiError> {
    let user = match &state.auth {
        Some(auth) => match auth.user(request.header("Authorization")) {
            Some(user) => user,
            None => return Ok(unauthorized(auth)),
        },
        None => {
            let host = request.header("Host").unwrap_or_default();
            if !state
                .hosts
                .iter()
                .any(|allowed| allowed.eq_ignore_ascii_case(host))
            {
                return Err(ApiError::new(
                    421,
                    format!("this dashboard answers to {} only", state.hosts.join(", ")),
                ));
            }
            LOCAL_USER.to_string()
        }
    };
    let url = request.target();
    let (path, query) = url.split_once('?').unwrap_or((url, ""));
    let segments: Vec<String> = path
        .split('/')
        .skip(1)
        .map(|segment| percent_decode_str(segment).decode_utf8_lossy().into_owned())
        .collect();
    let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
    match (request.method(), segments.as_slice()) {
        ("GET", [""] | ["daemons"] | ["task"] | ["queues", _]) => Ok(page(state)),
        ("GET", ["assets", name]) => assets::file(name)
            .map(|(content_type, body)| reply(200, content_type, body.as_bytes().to_vec()))
            .ok_or_else(|| ApiError::new(404, format!("no asset {name}"))),
        ("GET", ["api", "session"]) => Ok(json_reply(200, &api::session(state, &user))),
        ("GET", ["api", "overview"]) => Ok(json_reply(200, &api::overview(state))),
        ("GET", ["api", "daemons"]) => Ok(json_reply(200, &api::daemons(state)?)),
        ("GET", ["api", "history"]) => Ok(json_reply(200, &api::history(state)?)),
        ("GET", ["api", "queues", queue]) => {
            let limit = number(query, "limit")?
                .unwrap_or(api::DEFAULT_LIMIT)
                .min(api::MAX_LIMIT);
            Ok(json_reply(200, &api::queue(state, queue, limit)?))
        }
        ("GET", ["api", "queues", queue, "tasks", id]) => Ok(json_reply(
            200,
            &api::task(state, queue, id, flow_page(query)?)?,
        )),
        ("GET", ["api", "queues", queue, "tasks", id, "flow"]) => Ok(json_reply(
            200,
            &api::flow(state, queue, id, flow_page(query)?)?,
        )),
        ("POST", ["api", "queues", queue, rest @ ..]) => {
            let action = match rest {
                ["pause"] => Action::Pause,
                ["resume"] => Action::Resume,
                ["dead", "requeue"] => Action::Requeue,
                ["dead", "purge"] => Action::Purge,
                ["tasks", id, "cancel"] => Action::Cancel(id.to_string()),
                ["groups", group, "pause"] => Action::PauseGroup(group.to_string()),
                ["groups", group, "resume"] => Action::ResumeGroup(group.to_string()),
                _ => return Err(ApiError::new(404, format!("no action at {path}"))),
            };
            let queue = queue.to_string();
            act(state, request, &user, &queue, action)
        }
        ("GET" | "POST", _) => Err(ApiError::new(404, format!("nothing at {path}"))),
        _ => Err(ApiError::new(405, "GET pages and the API, POST actions")),
    }
}

/// The checks of an action, then the action, logged with who asked and what came of it.
fn act(
    state: &State,
    request: &Request,
    user: &str,
    queue: &str,
    action: Action,
) -> Result<Reply, ApiError> {
    if state.read_only {
        return Err(ApiError::new(
            403,
            "this dashboard is read-only (--read-only): actions are off",
        ));
    }
    // Compared in constant time, as the bearer token is (review L8).
    let token = request.header("X-Kmqd-Csrf").unwrap_or_default();
    if !auth::same(token.as_bytes(), state.csrf().as_bytes()) {
        return Err(ApiError::new(
            403,
            "missing or stale CSRF token (X-Kmqd-Csrf): reload the page, or read it from GET /api/session",
        ));
    }
    if let Some(origin) = request.header("Origin") {
        // The page's own origin: the host it asked for (checked above on loopback), over HTTP, or HTTPS behind
        // a proxy that terminates TLS.
        let host = request.header("Host").unwrap_or_default();
        let ours = ["http://", "https://"]
            .iter()
            .any(|scheme| origin.eq_ignore_ascii_case(&format!("{scheme}{host}")));
        if host.is_empty() || !ours {
            return Err(ApiError::new(
                403,
                format!("cross-origin action refused (Origin {origin})"),
            ));
        }
    }
    let body = std::str::from_utf8(request.body())
        .map_err(|error| ApiError::new(400, format!("cannot read the body: {error}")))?;
    let body: Json = if body.trim().is_empty() {
        json!({})
    } else {
        serde_json::from_str(body).map_err(|error| ApiError::new(400, format!("body: {error}")))?
    };
    let from = request.peer().to_string();
    let what = action.name();
    let result = api::act(state, queue, &action, &body);
    match &result {
        Ok(outcome) => tracing::info!(
            user,
            from = %from,
            action = what,
            queue,
            target = action.target(),
            outcome = %outcome,
            "dashboard action"
        ),
        Err(error) => tracing::warn!(
            user,
            from = %from,
            action = what,
            queue,
            target = action.target(),
            status = error.status,
            error = %error.message,
            "dashboard action failed"
        ),
    }
    result.map(|outcome| json_reply(200, &outcome))
}

/// Who asks, without authentication: anyone on this host; the peer address says which connection.
pub const LOCAL_USER: &str = "local";

/// 401, asking a browser for a password when there are users (a script sends the token).
fn unauthorized(auth: &Auth) -> Reply {
    let challenge = if auth.has_users() {
        r#"Basic realm="kmqd dashboard", charset="UTF-8""#
    } else {
        r#"Bearer realm="kmqd dashboard""#
    };
    let body = json!({ "error": "authentication required: a dashboard user's password, or the bearer token" });
    json_reply(401, &body).header("WWW-Authenticate", challenge)
}

/// The page shell: one HTML document for every page, its script draws the page its path names.
fn page(state: &State) -> Reply {
    reply(
        200,
        "text/html; charset=utf-8",
        assets::page(state.csrf(), state.read_only).into_bytes(),
    )
}

/// The number `name` in a query string, if there; 400 when it is not a number.
fn number(query: &str, name: &str) -> Result<Option<usize>, ApiError> {
    query_value(query, name)
        .map(|text| text.parse::<usize>())
        .transpose()
        .map_err(|_| ApiError::new(400, format!("{name}: not a number")))
}

/// A task's page of its flow's root's dependencies: `?offset=` (0) and `?limit=` (`api::FLOW_LIMIT`, at most
/// `api::MAX_FLOW_LIMIT`).
fn flow_page(query: &str) -> Result<api::FlowPage, ApiError> {
    Ok(api::FlowPage {
        offset: number(query, "offset")?.unwrap_or(0),
        limit: number(query, "limit")?
            .unwrap_or(api::FLOW_LIMIT)
            .min(api::MAX_FLOW_LIMIT),
    })
}

/// The value of `name` in a query string (`limit=20&x=y`), percent-decoded.
fn query_value(query: &str, name: &str) -> Option<String> {
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| percent_decode_str(value).decode_utf8_lossy().into_owned())
}

fn json_reply(status: u16, body: &Json) -> Reply {
    reply(status, "application/json", body.to_string().into_bytes())
}

fn reply(status: u16, content_type: &str, body: Vec<u8>) -> Reply {
    let headers = [
        ("Cache-Control", "no-store"),
        ("X-Content-Type-Options", "nosniff"),
        ("X-Frame-Options", "DENY"),
        ("Referrer-Policy", "no-referrer"),
        (
            "Content-Security-Policy",
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    ];
    headers.into_iter().fold(
        Response::new(status, content_type, body),
        |response, (name, value)| response.header(name, value),
    )
}
