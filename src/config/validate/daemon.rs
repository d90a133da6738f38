//! The `[daemon]` section: the plugins' directory, the shutdown grace, metrics, logging and reports. Its own
//! module, as each section is, so that its rules read apart from the others.

use std::net::SocketAddr;
use std::path::Path;

use toml::Spanned;

use super::{at_least, duration_or};
use crate::config::errors::Source;
use crate::config::raw::RawDaemon;
use crate::config::*;

impl RawDaemon {
    pub(super) fn validate(
        self,
        source: &Source<'_>,
        base: &Path,
    ) -> Result<DaemonConfig, ConfigError> {
        let RawDaemon {
            plugins_dir,
            shutdown_grace,
            metrics_addr,
            log_level,
            log_format,
            report_interval,
        } = self;
        let plugins_dir =
            base.join(plugins_dir.map_or(defaults::PLUGINS_DIR.to_string(), Spanned::into_inner));
        let shutdown_grace = duration_or(
            source,
            "daemon.shutdown_grace",
            &shutdown_grace,
            defaults::SHUTDOWN_GRACE,
        )?;
        let metrics_addr = match metrics_addr {
            Some(addr) => Some(addr.get_ref().parse::<SocketAddr>().map_err(|_| {
                source.error(
                    addr.span(),
                    format!("daemon.metrics_addr: {:?} is not an address; write it like \"127.0.0.1:9464\"", addr.get_ref()),
                )
            })?),
            None => None,
        };
        let log_level = match log_level {
            Some(level) => {
                check_log_filter(level.get_ref()).map_err(|why| {
                    source.error(level.span(), format!("daemon.log_level: {why}"))
                })?;
                level.into_inner()
            }
            None => defaults::LOG_LEVEL.to_string(),
        };
        let log_format = match log_format.as_ref().map(|f| (f, f.get_ref().as_str())) {
            None | Some((_, "text")) => LogFormat::Text,
            Some((_, "json")) => LogFormat::Json,
            Some((format, other)) => {
                return Err(source.error(
                    format.span(),
                    format!(
                        "daemon.log_format: {other:?} is not a format; write \"text\" or \"json\""
                    ),
                ));
            }
        };
        let report_interval = match &report_interval {
            Some(value) => Some(at_least(
                source,
                "daemon.report_interval",
                value,
                MIN_WATCH_INTERVAL,
            )?),
            None => None,
        };
        Ok(DaemonConfig {
            plugins_dir,
            shutdown_grace,
            metrics_addr,
            metrics_addr_overridden: false,
            log_level,
            log_format,
            report_interval,
        })
    }
}
