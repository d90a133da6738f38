//! The config's shape, as serde reads it: every key optional and spanned (so that `validate` can say where a
//! value is wrong), unknown keys refused.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) redis: RawRedis,
    #[serde(default)]
    pub(super) daemon: RawDaemon,
    #[serde(default)]
    pub(super) queues: Vec<Spanned<RawQueue>>,
    #[serde(default)]
    pub(super) plugins: BTreeMap<Spanned<String>, Spanned<RawPlugin>>,
    #[serde(default)]
    pub(super) schedules: Vec<Spanned<RawSchedule>>,
    #[serde(default)]
    pub(super) dashboard: RawDashboard,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDashboard {
    pub(super) users_file: Option<Spanned<String>>,
    pub(super) token_env: Option<Spanned<String>>,
    pub(super) token_file: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSchedule {
    pub(super) name: Option<Spanned<String>>,
    pub(super) queue: Option<Spanned<String>>,
    #[serde(rename = "type")]
    pub(super) kind: Option<Spanned<String>>,
    pub(super) data: Option<toml::Value>,
    pub(super) cron: Option<Spanned<String>>,
    pub(super) every: Option<Spanned<String>>,
    pub(super) priority: Option<Spanned<String>>,
    pub(super) missed: Option<Spanned<String>>,
    pub(super) misfire_grace: Option<Spanned<String>>,
    pub(super) catch_up_max: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRedis {
    pub(super) url: Option<Spanned<String>>,
    pub(super) cluster: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) sentinel: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) sentinel_master: Option<Spanned<String>>,
    pub(super) username: Option<Spanned<String>>,
    pub(super) tls_ca_file: Option<Spanned<String>>,
    pub(super) tls_cert_file: Option<Spanned<String>>,
    pub(super) tls_key_file: Option<Spanned<String>>,
    pub(super) wait_replicas: Option<Spanned<u32>>,
    pub(super) wait_timeout: Option<Spanned<String>>,
    pub(super) password_env: Option<Spanned<String>>,
    pub(super) password_file: Option<Spanned<String>>,
    pub(super) pool_size: Option<Spanned<u32>>,
    pub(super) key_prefix: Option<Spanned<String>>,
    pub(super) connect_timeout: Option<Spanned<String>>,
    pub(super) io_timeout: Option<Spanned<String>>,
    pub(super) allow_eviction: Option<Spanned<bool>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDaemon {
    pub(super) plugins_dir: Option<Spanned<String>>,
    pub(super) shutdown_grace: Option<Spanned<String>>,
    pub(super) metrics_addr: Option<Spanned<String>>,
    pub(super) otlp_endpoint: Option<Spanned<String>>,
    pub(super) log_level: Option<Spanned<String>>,
    pub(super) log_format: Option<Spanned<String>>,
    pub(super) report_interval: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawQueue {
    pub(super) name: Option<Spanned<String>>,
    pub(super) mode: Option<Spanned<String>>,
    pub(super) priorities: Option<Spanned<Vec<String>>>,
    pub(super) priority_weights: Option<Spanned<Vec<i64>>>,
    pub(super) default_priority: Option<Spanned<String>>,
    pub(super) workers: Option<Spanned<i64>>,
    pub(super) worker_nice: Option<Spanned<i64>>,
    pub(super) batch: Option<Spanned<i64>>,
    pub(super) prefetch: Option<Spanned<i64>>,
    pub(super) max_held: Option<Spanned<i64>>,
    pub(super) max_running: Option<Spanned<i64>>,
    /// A rate (`"200/s"`) or a list of them (checked by hand in `validate`).
    pub(super) rate_limit: Option<Spanned<toml::Value>>,
    pub(super) lease_timeout: Option<Spanned<String>>,
    pub(super) execution_timeout: Option<Spanned<String>>,
    pub(super) alive_timeout: Option<Spanned<String>>,
    pub(super) retry_times: Option<Spanned<i64>>,
    pub(super) on_handler_error: Option<Spanned<String>>,
    pub(super) backoff: Option<Spanned<String>>,
    pub(super) backoff_max: Option<Spanned<String>>,
    pub(super) dead_max: Option<Spanned<i64>>,
    pub(super) idle_poll: Option<Spanned<String>>,
    pub(super) foreign_type_field: Option<Spanned<String>>,
    pub(super) delay_batch: Option<Spanned<i64>>,
    pub(super) max_task_bytes: Option<Spanned<i64>>,
    pub(super) lag_warn: Option<Spanned<String>>,
    /// How long a task's result (or a dead task's reason) is kept (`"1h"`); absent: none is kept.
    pub(super) keep_results: Option<Spanned<String>>,
    /// Each a list's name, or a table `{ list = NAME, priority = LEVEL }` (checked by hand in `validate`).
    pub(super) source_lists: Option<Spanned<Vec<Spanned<toml::Value>>>>,
    /// `[[queues.limits]]`: limits of one task type each.
    pub(super) limits: Option<Vec<Spanned<RawTypeLimit>>>,
    /// `[queues.groups]`: fair groups, with limits per group.
    pub(super) groups: Option<Spanned<RawGroups>>,
}

/// The `[queues.groups]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGroups {
    pub(super) max_running: Option<Spanned<i64>>,
    /// As the queue's `rate_limit`.
    pub(super) rate_limit: Option<Spanned<toml::Value>>,
    /// Group name -> its share of turns (checked by hand: each a positive integer).
    pub(super) weights: Option<Spanned<toml::Table>>,
}

/// One `[[queues.limits]]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTypeLimit {
    #[serde(rename = "type")]
    pub(super) kind: Option<Spanned<String>>,
    pub(super) max_running: Option<Spanned<i64>>,
    /// As the queue's `rate_limit`.
    pub(super) rate_limit: Option<Spanned<toml::Value>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPlugin {
    pub(super) file: Option<Spanned<String>>,
    pub(super) config: Option<toml::Table>,
}
