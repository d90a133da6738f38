//! Applying a reload: the supervisor's methods that re-read the config, check what is new in Redis, swap the
//! plugins, retire the lanes of changed and removed queues, start the new lanes and the per-daemon threads that
//! hold the set of queues. What changes is decided by `plan.rs`, a pure comparison; this module is its
//! side effects, apart from it so that the decision reads and tests without threads or Redis.

use std::sync::Arc;

use crate::broker::{self, access};
use crate::config::Config;
use crate::daemon::{Supervisor, notify, owners, reload};
use crate::plugin::Registry;

impl Supervisor {
    /// Stops a lane the way the shutdown stops every lane, without a deadline: no new tasks, jobs not started
    /// handed back, running ones finish and are settled; then its owner is released ([`Supervisor::exited`]).
    /// The jobs waiting for a worker are handed back at once, for the new lane: a worker hands back the jobs it
    /// receives once claiming stopped, but the lane's workers may be busy for as long as their handlers run.
    fn retire(&mut self, index: usize) {
        let serving = &mut self.serving[index];
        serving.retiring = true;
        serving.claiming.fire();
        serving.lane.hand_back_waiting();
        self.stopping.insert(serving.group);
        let lane = Arc::clone(&serving.lane);
        self.ask_owners(owners::Request::Drain(vec![lane]));
    }

    /// Re-reads the config file and applies it, or refuses it and keeps the running one.
    pub(in crate::daemon) fn reload(&mut self) {
        tracing::info!(config = %self.config.path.display(), "SIGHUP: reloading the config");
        notify::reloading("reloading the config");
        match self.try_reload() {
            Ok(summary) => tracing::info!("config reloaded: {summary}"),
            Err(why) => {
                tracing::error!("reload refused, still serving the config loaded before: {why}")
            }
        }
        notify::ready(&notify::summary(&self.lanes.snapshot()));
    }

    /// The reload itself; the error is what `kmqd check-config` would print.
    fn try_reload(&mut self) -> Result<String, String> {
        let new = Config::load(&self.config.path).map_err(|error| error.to_string())?;
        let (registry, plugin_changes) = Registry::reload(&new, &self.parts.plugins.current())
            .map_err(|error| error.located(&new.path))?;
        let plan = reload::plan(&self.config, &new);
        self.check_new_queues(&plan)?;
        for refused in registry.refused() {
            tracing::error!("{}: {refused}; the file is skipped", new.path.display());
        }
        let needs_restart: Vec<&String> = plan
            .needs_restart
            .iter()
            .chain(&plugin_changes.needs_restart)
            .collect();
        for key in &needs_restart {
            tracing::warn!("needs a restart: {key}; kept as it runs");
        }
        // Tasks that start from now on run on the new plugins; running ones finish on the old, whose instances
        // no longer referenced are shut down when their last task returns.
        drop(self.parts.plugins.replace(registry));
        if new.daemon.log_level != self.config.daemon.log_level {
            crate::daemon::log_filter::set(&new.daemon.log_level);
        }
        let queues_changed = plan.queues_changed();
        self.config = plan.config.clone();
        for name in plan.changed.iter().chain(&plan.removed) {
            if let Some(index) = self
                .serving
                .iter()
                .position(|s| !s.retiring && s.lane.name() == name)
            {
                self.retire(index);
            }
        }
        for name in plan.changed.iter().chain(&plan.added) {
            let queue = self.config.queue(name).expect("planned from it").clone();
            if let Err(error) = self.start_lane(&queue) {
                tracing::error!(queue = %name, %error, "cannot start the new lane");
            }
        }
        if queues_changed {
            if let Err(error) = self.start_helpers() {
                tracing::error!(%error, "cannot start the monitor, delay listener or scheduler again");
            }
        }
        let mut summary: Vec<String> = plan.changes.clone();
        let list = |what: &str, names: &[String]| format!("{what} {}", names.join(", "));
        if !plan.added.is_empty() {
            summary.push(list("queues started:", &plan.added));
        }
        if !plan.removed.is_empty() {
            summary.push(list("queues stopped:", &plan.removed));
        }
        if plan.schedules_changed {
            summary.push("schedules replaced".to_string());
        }
        for path in &plugin_changes.loaded {
            summary.push(format!("plugin loaded: {}", path.display()));
        }
        if !needs_restart.is_empty() {
            let keys: Vec<&str> = needs_restart.iter().map(|k| k.as_str()).collect();
            summary.push(format!("needs a restart: {}", keys.join(", ")));
        }
        if summary.is_empty() {
            summary.push("nothing changed".to_string());
        }
        Ok(summary.join("; "))
    }

    /// The checks the start makes on every queue, for the queues a reload adds and those whose `source_lists`
    /// or levels it changes: the ACL user may serve them (their new sources too), their keys are of this protocol
    /// version, and the meta hash describes their new levels to producers. Redis down refuses the reload too: it
    /// cannot be checked.
    fn check_new_queues(&self, plan: &reload::Plan) -> Result<(), String> {
        let reshaped = plan.changed.iter().filter(|name| {
            let shape = |config: &Config| {
                config.queue(name).map(|q| {
                    let keys = broker::QueueKeys::for_queue(&config.redis.key_prefix, q);
                    (q.source_lists.clone(), keys.levels, q.default_priority)
                })
            };
            shape(&self.config) != shape(&plan.config)
        });
        let to_check: Vec<&String> = plan.added.iter().chain(reshaped).collect();
        if to_check.is_empty() {
            return Ok(());
        }
        let mut connection = self
            .connector
            .connect()
            .map_err(|error| format!("cannot check the new queues in Redis: {error}"))?;
        for name in to_check {
            let queue = plan.config.queue(name).expect("planned from it");
            let keys = broker::QueueKeys::for_queue(&plan.config.redis.key_prefix, queue);
            access::check(&mut connection, &keys, access::Action::Serve)
                .and_then(|()| {
                    broker::check_protocol(&mut connection, &keys, name, queue.default_priority)
                })
                .map_err(|error| format!("queue {name}: {error}"))?;
        }
        Ok(())
    }
}
