//! `kmqd run` (the daemon, the default) and `kmqd check-config`.

use std::io::Write;
use std::sync::Arc;

use crate::config::Config;
use crate::plugin::Registry;

use super::Failure;

pub(super) fn load_plugins(config: &Config) -> Result<Registry, Failure> {
    Registry::load(config)
        .map_err(|error| Failure::Usage(format!("{}: {error}", config.path.display())))
}

pub(super) fn run_daemon(config: &Config) -> Result<(), Failure> {
    // Before the plugins load (their init may take a while): a SIGTERM meanwhile is a graceful stop, not death
    // by the default action.
    let (stop_tx, stop_rx) = crossbeam_channel::bounded(1);
    crate::daemon::signals::forward(stop_tx)
        .map_err(|error| Failure::Runtime(format!("cannot install signal handlers: {error}")))?;
    crate::daemon::notify::status("loading plugins");
    let registry = Arc::new(load_plugins(config)?);
    for warning in unhandled_schedules(config, &registry) {
        tracing::warn!("{warning}");
    }
    crate::daemon::run(config, registry, stop_rx).map_err(|error| {
        if error.is_config_error() {
            Failure::Usage(error.to_string())
        } else {
            Failure::Runtime(error.to_string())
        }
    })
}

pub(super) fn check_config(config: &Config) -> Result<(), Failure> {
    let registry = load_plugins(config)?;
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
    // Not an error: another daemon, or this one after a plugin is installed, may handle the type.
    for warning in unhandled_schedules(config, &registry) {
        let _ = writeln!(out, "  warning: {warning}");
    }
    Ok(())
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
