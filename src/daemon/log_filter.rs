//! The log filter a reload changes (`[daemon] log_level`): logging is set up by the command line (`cli`), with
//! tracing-subscriber's reload layer; it hands the layer's handle here, as a function that installs a filter.

use std::sync::OnceLock;

type Setter = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

static SETTER: OnceLock<Setter> = OnceLock::new();

/// Where [`set`] sends a new filter (the first call wins: logging is set up once per process).
pub fn install(setter: impl Fn(&str) -> Result<(), String> + Send + Sync + 'static) {
    let _ = SETTER.set(Box::new(setter));
}

/// Filters log events with `level` (a checked `log_level`) from now on; `RUST_LOG`, when set, keeps precedence.
pub fn set(level: &str) {
    if std::env::var("RUST_LOG").is_ok_and(|value| !value.trim().is_empty()) {
        tracing::warn!(
            log_level = level,
            "RUST_LOG is set and takes precedence over log_level: the log filter stays as it is"
        );
        return;
    }
    match SETTER.get() {
        Some(setter) => match setter(level) {
            Ok(()) => tracing::info!(log_level = level, "log filter changed"),
            Err(error) => tracing::error!(%error, "cannot change the log filter"),
        },
        None => tracing::warn!("logging was not set up by kmqd: log_level cannot change live"),
    }
}
