//! kmqd: a task-queue worker daemon. Tasks live in Redis; handlers live in plugins (`.so` files speaking the C
//! ABI of `plugins/include/kmq_plugin.h`).
//!
//! Module map, from the bottom up: no module imports one above it (ARCHITECTURE.md, "Layout", states the rules
//! and has the data flow and the invariants; the `tidy` tests check the rules):
//! - [`config`]: the TOML config, parsed then validated, with errors that name file, line and key; [`cron`], the
//!   5-field UTC cron expressions it holds;
//! - [`task`]: the task envelope, the only module that knows the wire format of a task;
//! - [`broker`]: the only module that talks to Redis (key layout, Lua scripts);
//! - [`poison`]: the daemon's locks, taken whether or not a panic poisoned them, and why that is safe;
//! - [`policy`]: pure decisions (retry, dead-letter, backoff); [`settlement`]: the one place a task's outcome is
//!   decided (a verdict, the policy's action, its log event) and the record that applies it;
//! - [`retry`] and [`shutdown`]: backoff, rate-limited failure reports, and the shutdown broadcasts; [`pulse`],
//!   what a long-lived loop beats for the watchdog; [`observed`], the process-wide counts of what the daemon saw
//!   (task outcomes, handler durations, Redis errors) that the metrics endpoint serves; [`otel`], a span per run
//!   of a task, exported over OTLP (`[daemon] otlp_endpoint`);
//! - [`plugin`]: the plugin registry and the FFI (the only unsafe code);
//! - [`queue`]: what every thread of a queue shares (config, keys, policy, verdicts); [`settler`]: settling a
//!   batch until Redis has answered for it (a lane's acker and the monitor);
//! - [`flow`]: a flow file (`kmqd flow push`) parsed and checked into what to write to each queue;
//! - [`client`]: the producer API ([`Client::push`], [`Client::push_batch`], [`Client::push_flow`]) and an
//!   operator's;
//! - [`overview`]: every queue polled, the rows `stats --watch` and the dashboard show;
//! - [`task_view`]: a task's kept result and its flow's graph, as `kmqd task show` and the dashboard's task page
//!   show them;
//! - [`http`]: the bounded HTTP server of the metrics endpoint and the dashboard;
//! - [`daemon`]: the supervisor on top; below it the per-daemon threads (heartbeat, monitor, timeouts, delay,
//!   scheduler, metrics, signals), and below those each queue's [`daemon::lane`] (fetcher, workers, acker);
//! - [`dashboard`]: `kmqd dashboard`, the web UI and its JSON API;
//! - [`cli`]: the `kmqd` command line.
//!
//! A producer that only enqueues builds this crate without its default feature `daemon`: the core ([`config`],
//! [`task`], [`broker`], [`client`]) and none of the daemon's, the command line's or the dashboard's dependencies.
//!
//! Not in this crate, since a worker host runs none of it: the benchmark, `kmqd-bench` (bench/, a binary of its
//! own that runs the `kmqd` binary as its daemons), and the private redis-servers it and the tests start
//! (`kmqd-harness`, harness/).
//!
//! Visibility: a module or an item is `pub` only when something outside the crate names it (the binary,
//! tests/it, the bench, examples/, and the fuzzers, a workspace of their own that `cargo clippy --workspace` does
//! not check: `cd fuzz && cargo check --all-targets`), or when it is the library's API: [`Client`] and every type
//! its methods take or return, whoever uses them. The rest is `pub(crate)`: the per-daemon threads and the lane
//! inside [`daemon`], and the internals of the public modules (issue 35, review P8), so that rustc's dead-code lint
//! sees what nothing uses.
#![deny(unsafe_code)]
// Without the `daemon` feature (a producer's build: Cargo.toml, "[features]") the broker's calls that only the
// daemon makes have no caller; the full build, which CI lints, still finds any code that nothing uses.
#![cfg_attr(
    not(feature = "daemon"),
    allow(
        dead_code,
        reason = "the daemon's calls into the broker have no caller without it"
    )
)]

pub mod broker;
#[cfg(feature = "daemon")]
pub mod cli;
pub mod client;
pub mod config;
pub(crate) mod cron;
#[cfg(feature = "daemon")]
pub mod daemon;
#[cfg(feature = "daemon")]
pub(crate) mod dashboard;
pub mod flow;
#[cfg(feature = "daemon")]
pub(crate) mod http;
#[cfg(feature = "daemon")]
pub(crate) mod observed;
#[cfg(feature = "daemon")]
pub mod otel;
#[cfg(feature = "daemon")]
pub(crate) mod overview;
#[cfg(feature = "daemon")]
pub mod plugin;
pub(crate) mod poison;
#[cfg(feature = "daemon")]
pub(crate) mod policy;
#[cfg(feature = "daemon")]
pub mod pulse;
#[cfg(feature = "daemon")]
pub mod queue;
#[cfg(feature = "daemon")]
pub(crate) mod retry;
#[cfg(feature = "daemon")]
pub(crate) mod settlement;
#[cfg(feature = "daemon")]
pub mod settler;
#[cfg(feature = "daemon")]
pub mod shutdown;
pub mod task;
#[cfg(feature = "daemon")]
pub(crate) mod task_view;

#[cfg(test)]
mod tidy;

pub use client::{Client, ClientError, Expiry, NewTask, Pushed, TaskResult};
pub use config::Config;
