//! kmqd's integration tests: one binary (ripgrep's layout). Every test starts its own redis-server and loads
//! real plugins built from this workspace (see `support`).

mod support;

mod acl;
mod budgets;
mod chaos;
mod cli;
mod cluster;
mod connection;
mod crash;
mod dashboard;
mod dead;
mod default_mode;
mod delayed;
mod eviction;
mod exec_persistent;
mod fault_proxy;
mod faults;
mod http_bounds;
mod lease_clock;
mod limits;
mod metrics;
mod plugins;
mod prefetch;
mod priorities;
mod protocol;
mod queue_admin;
mod redis_faults;
mod reload;
mod reload_faults;
mod report;
mod safe_mode;
mod schedules;
mod script_checks;
mod sdk;
mod sentinel;
mod shutdown;
mod source_lists;
mod splice;
mod systemd;
mod throttle;
mod tls;
mod topology;
mod unknown_types;
mod watch;
mod worker_nice;
