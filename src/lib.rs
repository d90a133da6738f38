//! kmqd: a task-queue worker daemon. Tasks live in Redis; handlers live in plugins (`.so` files speaking the C
//! ABI of `plugins/include/kmq_plugin.h`).
//!
//! Module map (ARCHITECTURE.md has the data flow and the invariants):
//! - [`config`]: the TOML config, parsed then validated, with errors that name file, line and key;
//! - [`task`]: the task envelope, the only module that knows the wire format of a task;
//! - [`broker`]: the only module that talks to Redis (key layout, Lua scripts);
//! - [`client`]: the producer API ([`Client::push`], [`Client::push_batch`]);
//! - [`policy`]: pure decisions (retry, dead-letter, backoff);
//! - [`daemon`]: the supervisor, which starts and stops the threads: [`fetcher`], [`worker`], [`acker`],
//!   [`heartbeat`], [`monitor`], [`delay`], [`metrics`], all sharing a queue's [`inflight`] table;
//! - [`plugin`]: the plugin registry and the FFI (the only unsafe code);
//! - [`cli`]: the `kmqd` command line; [`bench`]: `kmqd bench`, which measures kmqd against a private
//!   [`redis_server`].
#![deny(unsafe_code)]

pub mod acker;
pub mod bench;
pub mod broker;
pub mod cli;
pub mod client;
pub mod config;
pub mod daemon;
pub mod delay;
pub mod fetcher;
pub mod heartbeat;
pub mod inflight;
pub mod metrics;
pub mod monitor;
pub mod plugin;
pub mod policy;
pub mod redis_server;
pub mod schedule;

pub mod settlement;
pub mod shutdown;
pub mod signals;
pub mod task;
pub mod worker;

pub use client::{Client, ClientError, NewTask, Pushed};
pub use config::Config;
