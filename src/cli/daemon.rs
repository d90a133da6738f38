//! `kmqd run` (the daemon, the default) and `kmqd check-config`.

use std::io::Write;
use std::sync::Arc;

use crate::config::Config;
use crate::plugin::Registry;

use super::Failure;

pub(super) fn load_plugins(config: &Config) -> Result<Registry, Failure> {
    Registry::load(config).map_err(|error| Failure::Usage(error.located(&config.path)))
}

pub(super) fn run_daemon(config: &Config) -> Result<(), Failure> {
    // Before the plugins load (their init may take a while): a SIGTERM meanwhile is a graceful stop, not death
    // by the default action. A SIGHUP meanwhile waits for the daemon to serve, then reloads.
    let (stop_tx, stop_rx) = crossbeam_channel::bounded(1);
    let (reload_tx, reload_rx) = crossbeam_channel::bounded(1);
    crate::daemon::signals::forward(stop_tx, reload_tx)
        .map_err(|error| Failure::Runtime(format!("cannot install signal handlers: {error}")))?;
    crate::daemon::notify::status("loading plugins");
    let registry = load_plugins(config)?;
    for refused in registry.refused() {
        // Not fatal: the other handlers serve; `check-config` (and so `systemctl reload`) fails on it.
        tracing::error!("{}: {refused}; the file is skipped", config.path.display());
    }
    for warning in unhandled_schedules(config, &registry) {
        tracing::warn!("{warning}");
    }
    let plugins = crate::plugin::Plugins::new(Arc::new(registry));
    crate::daemon::serve(config, plugins, stop_rx, reload_rx).map_err(|error| {
        if error.is_config_error() {
            Failure::Usage(error.to_string())
        } else {
            Failure::Runtime(error.to_string())
        }
    })
}

/// Checks the config and loads its plugins as the daemon would. A refused drop-in file, which the daemon skips,
/// fails the check here, so that `systemctl reload` (which runs this first) shows it. Redis's `maxmemory-policy`
/// is read when Redis answers, and one that may evict kmqd's keys is refused as the daemon refuses it (unless
/// `[redis] allow_eviction`); a Redis that does not answer is only noted: the daemon waits for it at start.
pub(super) fn check_config(config: &Config) -> Result<(), Failure> {
    let registry = load_plugins(config)?;
    if !registry.refused().is_empty() {
        let path = config.path.display();
        let refusals: Vec<String> = registry
            .refused()
            .iter()
            .map(|refused| format!("{path}: {refused}"))
            .collect();
        return Err(Failure::Usage(refusals.join("\nkmqd: ")));
    }
    let redis = redis_lines(config)?;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}: ok", config.path.display());
    for queue in &config.queues {
        let mode = match queue.mode {
            crate::config::Mode::Default => "default",
            crate::config::Mode::Safe => "safe",
        };
        let _ = writeln!(
            out,
            "  queue {}: {mode} mode, {} workers, priorities {:?}",
            queue.name, queue.workers, queue.priorities
        );
        for list in &queue.source_lists {
            let _ = writeln!(
                out,
                "    source list {:?}: its tasks join level {:?}",
                list.key, list.priority
            );
        }
    }
    for plugin in registry.plugins() {
        let _ = writeln!(
            out,
            "  plugin {} ({}): types {:?}",
            plugin.name,
            plugin.path.display(),
            plugin.types
        );
    }
    for line in redis {
        let _ = writeln!(out, "  {line}");
    }
    // Not an error: another daemon, or this one after a plugin is installed, may handle the type.
    for warning in unhandled_schedules(config, &registry) {
        let _ = writeln!(out, "  warning: {warning}");
    }
    Ok(())
}

/// What `check-config` says of Redis: its `maxmemory-policy`, a warning when it is accepted or unreadable, or that
/// it was not read because Redis did not answer or refused the connection (not an error here: Redis may be down
/// for now, and the daemon waits for it, or reports the refusal itself). A policy that may evict kmqd's keys,
/// unaccepted, is the daemon's refusal, exit 2.
fn redis_lines(config: &Config) -> Result<Vec<String>, Failure> {
    let redis = config.redis.describe();
    let finding = match crate::client::Client::new(config).and_then(|client| client.eviction()) {
        Ok(finding) => finding,
        Err(error) => {
            return Ok(vec![format!(
                "redis {redis}: maxmemory-policy not read ({error}); the daemon reads it when it starts"
            )]);
        }
    };
    if let Some(refusal) = finding.refusal() {
        return Err(refusal.into());
    }
    let mut lines = vec![format!(
        "redis {redis}: maxmemory-policy {}",
        finding.describe()
    )];
    lines.extend(
        finding
            .warnings()
            .into_iter()
            .map(|warning| format!("warning: {warning}")),
    );
    Ok(lines)
}

/// A line for each schedule whose task type no loaded plugin handles: its tasks would wait through their retries
/// and then be dead-lettered, unless another daemon handles the type.
fn unhandled_schedules(config: &Config, registry: &Registry) -> Vec<String> {
    config
        .schedules
        .iter()
        .filter(|schedule| registry.for_type(&schedule.kind).is_none())
        .map(|schedule| {
            format!(
                "schedule {:?} fires type {:?} on queue {:?}, which no plugin here handles: its tasks are retried \
                 (retry_times) for a daemon that does, then dead-lettered",
                schedule.name, schedule.kind, schedule.queue
            )
        })
        .collect()
}
