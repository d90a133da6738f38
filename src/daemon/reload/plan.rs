//! What a reload (SIGHUP, `systemctl reload kmqd`) changes: the pure comparison of the running config with the
//! new one. The supervisor (`daemon`) applies the [`Plan`] (`reload/apply.rs`); docs/OPERATIONS.md ("Reloading")
//! is the operator's view.
//!
//! Live: every queue setting but its mode (a queue whose settings changed gets a new lane: the old one stops the
//! way a graceful shutdown stops it, finishing its running tasks, while the new one starts at once), new and
//! removed queues, schedules, `shutdown_grace`, `plugins_dir`, `log_level`, and plugins (new files, replaced
//! files). Not live, kept as they run and reported as "needs a restart: KEY": everything in `[redis]` (the
//! connections, the pool, the key prefix are made at start), `metrics_addr`, `otlp_endpoint` (the span
//! exporter is the daemon run's), `log_format`, a queue's `mode` (an
//! owner registers its mode; a queue switching mode under its own tasks is a restart's job), and the config of a
//! plugin section already loaded from the same file (its `init` ran once; see `plugin::Registry::reload`). A
//! section added for a loaded file is live: one more `init` on it.

use crate::config::{Config, QueueConfig, RedisConfig};

/// What to do with a new config, and the config that results (the new one, with what cannot change live kept
/// from the running one).
#[derive(Debug)]
pub struct Plan {
    pub config: Config,
    /// Keys that changed but need a restart.
    pub needs_restart: Vec<String>,
    /// Queues in both configs whose settings changed: their lanes are replaced.
    pub changed: Vec<String>,
    /// Queues only in the new config: their lanes start.
    pub added: Vec<String>,
    /// Queues only in the running config: their lanes stop.
    pub removed: Vec<String>,
    /// What changed, one `KEY OLD → NEW` per key (for the summary line).
    pub changes: Vec<String>,
    /// Whether the `[[schedules]]` changed.
    pub schedules_changed: bool,
    /// Whether `[daemon] report_interval` changed (the reporter starts again with it).
    pub reports_changed: bool,
}

impl Plan {
    /// Whether the lanes, the queues' contexts, the schedules or the reports change: the per-daemon threads
    /// that hold them (monitor, delay listener, scheduler, reporter) start again on the new set.
    pub fn queues_changed(&self) -> bool {
        !(self.changed.is_empty() && self.added.is_empty() && self.removed.is_empty())
            || self.schedules_changed
            || self.reports_changed
    }
}

/// Compares the running config with a new one.
pub fn plan(running: &Config, new: &Config) -> Plan {
    let mut config = new.clone();
    let mut needs_restart = redis_changes(&running.redis, &new.redis);
    // The pool cannot grow: a reload that needs more connections than it holds (more queues, the reporter) says
    // so. A pool_size the file gives (or gave) and changes waits for a restart too, and says so; the default,
    // computed from the queues, moves with them unreported unless the pool falls short.
    if new.connections_needed() > running.redis.pool_size {
        needs_restart.push(format!(
            "redis.pool_size (the new config needs {} connections, the pool holds {}; until a restart, threads \
             wait for connections)",
            new.connections_needed(),
            running.redis.pool_size
        ));
    } else if (running.redis.pool_size_given || new.redis.pool_size_given)
        && running.redis.pool_size != new.redis.pool_size
    {
        needs_restart.push("redis.pool_size".to_string());
    }
    // Kept whole: the connections, pool and key names were made from it.
    config.redis = running.redis.clone();
    // `--metrics-addr` overrides the file, at a reload too.
    if !running.daemon.metrics_addr_overridden
        && running.daemon.metrics_addr != new.daemon.metrics_addr
    {
        needs_restart.push("daemon.metrics_addr".to_string());
    }
    config.daemon.metrics_addr = running.daemon.metrics_addr;
    config.daemon.metrics_addr_overridden = running.daemon.metrics_addr_overridden;
    // The exporter is made once, at the start: its queues and thread are the daemon run's.
    if running.daemon.otlp_endpoint != new.daemon.otlp_endpoint {
        needs_restart.push("daemon.otlp_endpoint".to_string());
        config.daemon.otlp_endpoint = running.daemon.otlp_endpoint.clone();
    }
    if running.daemon.log_format != new.daemon.log_format {
        needs_restart.push("daemon.log_format".to_string());
        config.daemon.log_format = running.daemon.log_format;
    }
    let mut changes = Vec::new();
    let mut daemon = |key: &str, old: String, new: String| {
        if old != new {
            changes.push(format!("daemon.{key} {old} → {new}"));
        }
    };
    daemon(
        "shutdown_grace",
        humantime::format_duration(running.daemon.shutdown_grace).to_string(),
        humantime::format_duration(new.daemon.shutdown_grace).to_string(),
    );
    daemon(
        "plugins_dir",
        running.daemon.plugins_dir.display().to_string(),
        new.daemon.plugins_dir.display().to_string(),
    );
    daemon(
        "log_level",
        running.daemon.log_level.clone(),
        new.daemon.log_level.clone(),
    );
    let interval = |config: &Config| {
        config
            .daemon
            .report_interval
            .map_or("off".to_string(), |every| {
                humantime::format_duration(every).to_string()
            })
    };
    let reports_changed = interval(running) != interval(new);
    daemon("report_interval", interval(running), interval(new));
    let (mut changed, mut added) = (Vec::new(), Vec::new());
    for queue in &mut config.queues {
        let Some(old) = running.queue(&queue.name) else {
            added.push(queue.name.clone());
            continue;
        };
        if old.mode != queue.mode {
            needs_restart.push(format!("queues.{}.mode", queue.name));
            queue.mode = old.mode;
        }
        let differences = queue_changes(old, queue);
        if !differences.is_empty() {
            changed.push(queue.name.clone());
            changes.extend(differences);
        }
    }
    let removed: Vec<String> = running
        .queues
        .iter()
        .filter(|queue| new.queue(&queue.name).is_none())
        .map(|queue| queue.name.clone())
        .collect();
    let schedules_changed = format!("{:?}", running.schedules) != format!("{:?}", new.schedules);
    Plan {
        config,
        needs_restart,
        changed,
        added,
        removed,
        changes,
        schedules_changed,
        reports_changed,
    }
}

/// `queues.NAME.KEY OLD → NEW` for every setting that differs (Debug forms: durations read `1s`, `250ms`).
fn queue_changes(old: &QueueConfig, new: &QueueConfig) -> Vec<String> {
    let mut out = Vec::new();
    // Every field but `name` (the key) and `mode` (not live). The list destructures `QueueConfig` without `..`,
    // so a field added to it does not compile until it is compared here.
    macro_rules! compare {
        ($($field:ident),* $(,)?) => {
            let QueueConfig { name: _, mode: _, $($field: _),* } = old;
            $(
                let (before, after) = (format!("{:?}", old.$field), format!("{:?}", new.$field));
                if before != after {
                    out.push(format!("queues.{}.{} {before} → {after}", new.name, stringify!($field)));
                }
            )*
        };
    }
    compare!(
        priorities,
        priority_weights,
        default_priority,
        workers,
        worker_nice,
        batch,
        prefetch,
        max_held,
        max_running,
        rate_limit,
        type_limits,
        groups,
        lease_timeout,
        execution_timeout,
        alive_timeout,
        retry_times,
        on_handler_error,
        backoff,
        backoff_max,
        dead_max,
        foreign_type_field,
        delay_batch,
        max_task_bytes,
        idle_poll,
        lag_warn,
        keep_results,
        source_lists,
    );
    out
}

/// The `[redis]` keys that differ (none of them can change live).
fn redis_changes(old: &RedisConfig, new: &RedisConfig) -> Vec<String> {
    // Every field named, none left to `..`: a field added to `RedisConfig` does not compile until it is compared
    // here (or said to be compared elsewhere), so a reload never keeps a changed one silently.
    let RedisConfig {
        url: _,
        deployment: _,
        username: _,
        password: _,
        tls: _,
        wait_replicas: _,
        wait_timeout: _,
        // Compared in `plan`, against what the new config needs.
        pool_size: _,
        pool_size_given: _,
        key_prefix: _,
        connect_timeout: _,
        io_timeout: _,
        allow_eviction: _,
    } = old;
    let mut out = Vec::new();
    let mut differs = |key: &str, differs: bool| {
        if differs {
            out.push(format!("redis.{key}"));
        }
    };
    differs("url", old.url != new.url);
    differs("deployment", old.deployment != new.deployment);
    differs("username", old.username != new.username);
    differs("password", old.password != new.password);
    differs(
        "tls",
        old.tls.ca != new.tls.ca || old.tls.client != new.tls.client,
    );
    differs("wait_replicas", old.wait_replicas != new.wait_replicas);
    differs("wait_timeout", old.wait_timeout != new.wait_timeout);
    differs("key_prefix", old.key_prefix != new.key_prefix);
    differs(
        "connect_timeout",
        old.connect_timeout != new.connect_timeout,
    );
    differs("io_timeout", old.io_timeout != new.io_timeout);
    differs("allow_eviction", old.allow_eviction != new.allow_eviction);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Config {
        Config::parse(std::path::Path::new("kmqd.toml"), text).unwrap()
    }

    const BASE: &str = "[redis]\nurl = \"redis://127.0.0.1:7000\"\n[[queues]]\nname = \"mail\"\nmode = \"safe\"\n\
                        workers = 2\n[[queues]]\nname = \"old\"\nmode = \"default\"\n";

    #[test]
    fn an_unchanged_config_changes_nothing() {
        let plan = plan(&parse(BASE), &parse(BASE));
        assert!(plan.needs_restart.is_empty() && plan.changes.is_empty());
        assert!(!plan.queues_changed());
    }

    #[test]
    fn queue_settings_change_live_and_the_mode_and_redis_need_a_restart() {
        let new = parse(
            "[redis]\nurl = \"redis://127.0.0.1:7001\"\nkey_prefix = \"other\"\n[[queues]]\nname = \"mail\"\n\
             mode = \"default\"\nworkers = 8\n[[queues]]\nname = \"new\"\nmode = \"safe\"\n",
        );
        let plan = plan(&parse(BASE), &new);
        assert_eq!(
            plan.needs_restart,
            ["redis.url", "redis.key_prefix", "queues.mail.mode"]
        );
        assert_eq!(plan.changed, ["mail"]);
        assert_eq!(plan.added, ["new"]);
        assert_eq!(plan.removed, ["old"]);
        assert_eq!(
            plan.changes,
            [
                "queues.mail.workers 2 → 8",
                "queues.mail.max_held 4098 → 4104"
            ],
            "max_held defaults to workers + 4096"
        );
        let mail = plan.config.queue("mail").unwrap();
        assert_eq!(
            (mail.mode, mail.workers),
            (crate::config::Mode::Safe, 8),
            "the mode kept, the rest applied"
        );
        assert_eq!(plan.config.redis.url, "redis://127.0.0.1:7000");
        assert_eq!(plan.config.redis.key_prefix, parse(BASE).redis.key_prefix);
    }

    #[test]
    fn a_pool_size_the_file_changes_is_reported_as_needing_a_restart() {
        let sized = |size: u32| parse(&format!("[redis]\npool_size = {size}\n{}", &BASE[8..]));
        let plan_of = |running: &Config, new: &Config| plan(running, new).needs_restart;
        assert_eq!(plan_of(&sized(20), &sized(30)), ["redis.pool_size"]);
        assert_eq!(plan_of(&parse(BASE), &sized(30)), ["redis.pool_size"]);
        assert_eq!(plan_of(&sized(30), &parse(BASE)), ["redis.pool_size"]);
        assert_eq!(
            plan(&sized(20), &sized(30)).config.redis.pool_size,
            20,
            "the pool keeps its size"
        );
        // Left out, the size follows the queues: one fewer queue needs fewer connections, and the pool it has is
        // enough.
        let fewer = parse(&BASE.replace("[[queues]]\nname = \"old\"\nmode = \"default\"\n", ""));
        assert_ne!(fewer.redis.pool_size, parse(BASE).redis.pool_size);
        assert!(plan_of(&parse(BASE), &fewer).is_empty());
    }

    #[test]
    fn a_new_report_interval_restarts_the_reporter_and_the_cli_s_metrics_addr_is_kept() {
        let mut running = parse(BASE);
        running.daemon.metrics_addr = Some("127.0.0.1:9999".parse().unwrap());
        running.daemon.metrics_addr_overridden = true;
        let new = parse(&BASE.replace(
            "[[queues]]\nname = \"mail\"",
            "[daemon]\nreport_interval = \"1m\"\n[[queues]]\nname = \"mail\"",
        ));
        let plan = plan(&running, &new);
        assert!(plan.reports_changed && plan.queues_changed());
        assert_eq!(plan.changes, ["daemon.report_interval off → 1m"]);
        assert!(
            plan.needs_restart.is_empty(),
            "--metrics-addr is not the file's to change: {:?}",
            plan.needs_restart
        );
        assert_eq!(plan.config.daemon.metrics_addr, running.daemon.metrics_addr);
    }

    #[test]
    fn a_new_otlp_endpoint_needs_a_restart_and_the_running_one_is_kept() {
        let running = parse(BASE);
        let new = parse(&BASE.replace(
            "[[queues]]\nname = \"mail\"",
            "[daemon]\notlp_endpoint = \"http://127.0.0.1:4318\"\n[[queues]]\nname = \"mail\"",
        ));
        let plan = plan(&running, &new);
        assert_eq!(plan.needs_restart, ["daemon.otlp_endpoint"]);
        assert_eq!(plan.config.daemon.otlp_endpoint, None);
    }
}
