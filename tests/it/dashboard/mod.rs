//! `kmqd dashboard` (docs/DASHBOARD.md): its JSON API over plain HTTP ([`api`]) and its pages in a real
//! headless Chromium ([`browser`]), each against a real Redis and real daemons with the testkit plugin.

mod api;
mod browser;
mod flows;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::Value as Json;

use crate::support::*;

/// A `kmqd dashboard` process on a free loopback port.
pub struct Dashboard {
    process: Process,
    pub addr: SocketAddr,
}

impl Dashboard {
    /// `kmqd --config CONFIG dashboard --listen 127.0.0.1:0 ARGS...`, once it logged the address it got.
    pub fn start(config: &Path, dir: &TestDir, args: &[&str]) -> Dashboard {
        Dashboard::start_named(config, dir, "dashboard.log", args)
    }

    /// As [`Dashboard::start`], logging to `log` in `dir` (two dashboards side by side).
    pub fn start_named(config: &Path, dir: &TestDir, log: &str, args: &[&str]) -> Dashboard {
        Dashboard::start_on(config, dir, log, "127.0.0.1:0", args)
    }

    /// As [`Dashboard::start_named`], listening on `listen`; [`Dashboard::addr`] is on loopback, whatever
    /// address it listens on.
    pub fn start_on(
        config: &Path,
        dir: &TestDir,
        log: &str,
        listen: &str,
        args: &[&str],
    ) -> Dashboard {
        let mut all = vec!["dashboard", "--listen", listen];
        all.extend_from_slice(args);
        let process = Process::start_with_args(config, dir.path(log), &all);
        let addr = eventually(Duration::from_secs(30), "the dashboard's address", || {
            let log = process.log_text();
            let addr: Option<SocketAddr> = log
                .split("dashboard on http://")
                .nth(1)
                .and_then(|rest| rest.split('/').next())
                .and_then(|addr| addr.parse().ok());
            (addr.is_some(), addr.ok_or(log))
        })
        .unwrap();
        let addr = match addr.ip().is_unspecified() {
            true => SocketAddr::from(([127, 0, 0, 1], addr.port())),
            false => addr,
        };
        Dashboard { process, addr }
    }

    pub fn log(&self) -> String {
        self.process.log_text()
    }

    /// The process's id, to read its /proc/PID/status.
    pub fn pid(&self) -> u32 {
        self.process.child.id()
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Scrape {
        http(
            self.addr,
            method,
            path,
            headers,
            body,
            Duration::from_secs(10),
        )
    }

    pub fn get(&self, path: &str) -> Scrape {
        self.request("GET", path, &[], "")
    }

    /// `GET path`, which must answer 200 with JSON.
    pub fn json(&self, path: &str) -> Json {
        let answer = self.get(path);
        assert_eq!(status(&answer), 200, "GET {path}: {answer:?}");
        assert_eq!(answer.content_type, "application/json", "GET {path}");
        serde_json::from_str(&answer.body).unwrap()
    }

    /// This process's CSRF token, as a script reads it.
    pub fn csrf(&self) -> String {
        self.json("/api/session")["csrf"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// An action as the pages send it (the token in its header); returns the status and the JSON answer.
    pub fn act(&self, path: &str, body: &str) -> (u16, Json) {
        let token = self.csrf();
        let answer = self.request("POST", path, &[("X-Kmqd-Csrf", &token)], body);
        (
            status(&answer),
            serde_json::from_str(&answer.body).unwrap_or(Json::Null),
        )
    }
}

/// The status code of an answer (0: nothing answered).
pub fn status(answer: &Scrape) -> u16 {
    answer
        .status
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}
