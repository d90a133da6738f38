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
            otlp_endpoint,
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
        let otlp_endpoint = match otlp_endpoint {
            Some(endpoint) => Some(otlp_base_url(endpoint.get_ref()).map_err(|why| {
                source.error(endpoint.span(), format!("daemon.otlp_endpoint: {why}"))
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
            otlp_endpoint,
            log_level,
            log_format,
            report_interval,
        })
    }
}

/// Checks an OTLP/HTTP base URL (`http://127.0.0.1:4318`): the scheme the exporter speaks and a host, so that a
/// typo fails at the start instead of every export failing later. Returns it as written. Plain HTTP only: the
/// exporter's HTTP client is built without TLS (Cargo.toml), since the collector runs beside the daemon and
/// forwards spans over TLS itself; an https:// URL would fail every export.
fn otlp_base_url(endpoint: &str) -> Result<String, String> {
    let fix = "write the collector's OTLP/HTTP base URL, like \"http://127.0.0.1:4318\" (spans go to its /v1/traces)";
    if endpoint.starts_with("https://") {
        return Err(format!(
            "{endpoint:?}: kmqd exports over plain HTTP only; run an OpenTelemetry collector beside the daemon and \
             let it forward the spans over TLS; {fix}"
        ));
    }
    let rest = endpoint
        .strip_prefix("http://")
        .ok_or_else(|| format!("{endpoint:?} is not an http:// URL; {fix}"))?;
    let host = rest.split(['/', '?', '#']).next().unwrap_or("");
    if host.is_empty()
        || endpoint
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!("{endpoint:?} names no host; {fix}"));
    }
    // A colon after the host (not inside an IPv6 address's brackets) starts its port.
    let port = host
        .rfind(':')
        .map(|colon| &host[colon + 1..])
        .filter(|port| !port.contains(']'));
    if port.is_some_and(|port| port.parse::<u16>().is_err()) {
        return Err(format!(
            "{endpoint:?} has no valid port after its host; {fix}"
        ));
    }
    Ok(endpoint.to_string())
}
