//! The `[redis]` section: which deployment (one Redis, Sentinel, Cluster), TLS files, credentials, timeouts and
//! the pool. Its own module because the deployment and the TLS files are rules of their own that only it needs.

use std::path::Path;
use std::time::Duration;

use toml::Spanned;

use super::{check_name, duration_or};
use crate::config::errors::Source;
use crate::config::raw::RawRedis;
use crate::config::*;

impl RawRedis {
    pub(super) fn validate(
        self,
        source: &Source<'_>,
        base: &Path,
    ) -> Result<RedisConfig, ConfigError> {
        let RawRedis {
            url,
            cluster,
            sentinel,
            sentinel_master,
            username,
            tls_ca_file,
            tls_cert_file,
            tls_key_file,
            wait_replicas,
            wait_timeout,
            password_env,
            password_file,
            pool_size,
            key_prefix,
            connect_timeout,
            io_timeout,
            allow_eviction,
        } = self;
        let url_text = url
            .as_ref()
            .map_or(defaults::REDIS_URL.to_string(), |u| u.get_ref().clone());
        if let Some(url) = &url {
            let scheme_ok = ["redis://", "rediss://", "unix://", "redis+unix://"]
                .iter()
                .any(|s| url.get_ref().starts_with(s));
            if !scheme_ok {
                return Err(source.error(
                    url.span(),
                    format!(
                        "redis.url: {:?} is not a Redis URL; write redis://HOST:PORT/DB, rediss://HOST:PORT/DB (TLS) \
                         or unix:///path/to/redis.sock",
                        redact_url(url.get_ref())
                    ),
                ));
            }
        }
        let deployment = deployment(source, &url, cluster, sentinel, sentinel_master)?;
        let username = match username {
            Some(name) if name.get_ref().is_empty() => {
                return Err(source.error(
                    name.span(),
                    "redis.username: is empty; leave it out for the default user",
                ));
            }
            other => other.map(Spanned::into_inner),
        };
        let tls = tls_files(source, base, tls_ca_file, tls_cert_file, tls_key_file)?;
        let wait_timeout_value = duration_or(
            source,
            "redis.wait_timeout",
            &wait_timeout,
            defaults::WAIT_TIMEOUT,
        )?;
        if let Some(value) = &wait_timeout
            && (wait_timeout_value.is_zero() || wait_timeout_value > Duration::from_secs(60))
        {
            // WAIT's 0 means forever: a replica that is down would stop every claim and settle.
            return Err(source.error(
                value.span(),
                "redis.wait_timeout: must be between 1ms and 1m; a change that no replica has by then counts \
                 as not replicated, and is retried",
            ));
        }
        let wait_replicas = wait_replicas.map_or(0, Spanned::into_inner);
        let password = match (&password_env, &password_file) {
            (Some(_), Some(file)) => {
                return Err(source.error(
                    file.span(),
                    "redis.password_file: set password_env or password_file, not both",
                ));
            }
            (Some(var), None) => Some(std::env::var(var.get_ref()).map_err(|_| {
                source.error(
                    var.span(),
                    format!(
                        "redis.password_env: environment variable {} is not set",
                        var.get_ref()
                    ),
                )
            })?),
            (None, Some(file)) => {
                let path = base.join(file.get_ref());
                let text = read_small_file(&path).map_err(|error| {
                    source.error(
                        file.span(),
                        format!(
                            "redis.password_file: cannot read {}: {error}",
                            path.display()
                        ),
                    )
                })?;
                Some(text.trim_end_matches(['\r', '\n']).to_string())
            }
            (None, None) => None,
        };
        let pool_size = match &pool_size {
            Some(size) if *size.get_ref() == 0 => {
                return Err(source.error(size.span(), "redis.pool_size: must be at least 1; leave it out to size the pool from the queues"));
            }
            Some(size) => *size.get_ref(),
            // Filled in once the number of queues is known.
            None => 0,
        };
        let key_prefix = match key_prefix {
            Some(prefix) => {
                check_name(source, "redis.key_prefix", &prefix, "key prefix")?;
                prefix.into_inner()
            }
            None => defaults::KEY_PREFIX.to_string(),
        };
        let connect_timeout = duration_or(
            source,
            "redis.connect_timeout",
            &connect_timeout,
            defaults::CONNECT_TIMEOUT,
        )?;
        let io_timeout_value = duration_or(
            source,
            "redis.io_timeout",
            &io_timeout,
            defaults::IO_TIMEOUT,
        )?;
        if let Some(value) = &io_timeout {
            if io_timeout_value < Duration::from_millis(100)
                || io_timeout_value > Duration::from_secs(300)
            {
                return Err(source.error(
                    value.span(),
                    "redis.io_timeout: must be between 100ms and 5m; it should outlast the slowest command your \
                     Redis runs, and bounds how long a stalled Redis holds a call",
                ));
            }
        }
        let tls_span = tls.1;
        let config = RedisConfig {
            url: url_text,
            deployment,
            username,
            tls: tls.0,
            wait_replicas,
            wait_timeout: wait_timeout_value,
            password,
            pool_size,
            pool_size_given: pool_size != 0,
            key_prefix,
            connect_timeout,
            io_timeout: io_timeout_value,
            allow_eviction: allow_eviction.is_some_and(Spanned::into_inner),
        };
        if let Some(span) = tls_span
            && !config.uses_tls()
        {
            return Err(source.error(
                span,
                "redis: TLS files are set but no URL is rediss://; write rediss://HOST:PORT to reach Redis over TLS",
            ));
        }
        Ok(config)
    }
}

/// Which deployment `url`, `cluster` and `sentinel` name: at most one of them, with `sentinel_master` exactly
/// when `sentinel`.
fn deployment(
    source: &Source<'_>,
    url: &Option<Spanned<String>>,
    cluster: Option<Spanned<Vec<Spanned<String>>>>,
    sentinel: Option<Spanned<Vec<Spanned<String>>>>,
    sentinel_master: Option<Spanned<String>>,
) -> Result<Deployment, ConfigError> {
    if let (Some(_), Some(cluster)) = (url, &cluster) {
        return Err(source.error(
            cluster.span(),
            "redis.cluster: set url (one Redis) or cluster (seed nodes of a Redis Cluster), not both",
        ));
    }
    if let (Some(_), Some(sentinel)) = (url, &sentinel) {
        return Err(source.error(
            sentinel.span(),
            "redis.sentinel: set url (one Redis) or sentinel (the Sentinels of a master), not both",
        ));
    }
    if let (Some(_), Some(sentinel)) = (&cluster, &sentinel) {
        return Err(source.error(
            sentinel.span(),
            "redis.sentinel: set cluster or sentinel, not both (a Redis Cluster fails over by itself)",
        ));
    }
    if let (None, Some(master)) = (&sentinel, &sentinel_master) {
        return Err(source.error(
            master.span(),
            "redis.sentinel_master: only with sentinel = [\"redis://HOST:26379\", ...], the Sentinels to ask",
        ));
    }
    let seeds = |key: &str,
                 list: Spanned<Vec<Spanned<String>>>|
     -> Result<Vec<String>, ConfigError> {
        if list.get_ref().is_empty() {
            return Err(source.error(
                list.span(),
                format!("redis.{key}: lists no node; write [\"redis://HOST:PORT\", ...]"),
            ));
        }
        let tls = list.get_ref()[0].get_ref().starts_with("rediss://");
        for seed in list.get_ref() {
            let text = seed.get_ref();
            let scheme = if text.starts_with("rediss://") {
                Some(true)
            } else if text.starts_with("redis://") {
                Some(false)
            } else {
                None
            };
            match scheme {
                None => {
                    return Err(source.error(
                        seed.span(),
                        format!(
                            "redis.{key}: {:?} is not a node URL; write redis://HOST:PORT or rediss://HOST:PORT (TLS)",
                            redact_url(text)
                        ),
                    ));
                }
                Some(seed_tls) if seed_tls != tls => {
                    return Err(source.error(
                        seed.span(),
                        format!("redis.{key}: mixes redis:// and rediss:// seeds; TLS is for every node or none"),
                    ));
                }
                Some(_) => {}
            }
            let db = text
                .split_once("://")
                .and_then(|(_, rest)| rest.split_once('/'))
                .map(|(_, db)| db);
            if key == "cluster" && db.is_some_and(|db| !db.is_empty() && db != "0") {
                return Err(source.error(
                    seed.span(),
                    "redis.cluster: a Redis Cluster has database 0 only; drop the /DB of the URL",
                ));
            }
        }
        Ok(list
            .into_inner()
            .into_iter()
            .map(Spanned::into_inner)
            .collect())
    };
    match (cluster, sentinel) {
        (Some(cluster), _) => Ok(Deployment::Cluster {
            seeds: seeds("cluster", cluster)?,
        }),
        (None, Some(sentinel)) => {
            let span = sentinel.span();
            let seeds = seeds("sentinel", sentinel)?;
            match sentinel_master {
                Some(master) if !master.get_ref().is_empty() => Ok(Deployment::Sentinel {
                    seeds,
                    master: master.into_inner(),
                }),
                _ => Err(source.error(
                    span,
                    "redis.sentinel: needs sentinel_master = \"NAME\", the master's name in the Sentinels' config",
                )),
            }
        }
        (None, None) => Ok(Deployment::Single),
    }
}

/// Reads the TLS files (PEM, relative to the config's directory); also returns where the first of them was set,
/// for the error of TLS files without a `rediss://` URL.
fn tls_files(
    source: &Source<'_>,
    base: &Path,
    ca_file: Option<Spanned<String>>,
    cert_file: Option<Spanned<String>>,
    key_file: Option<Spanned<String>>,
) -> Result<(TlsFiles, Option<std::ops::Range<usize>>), ConfigError> {
    let first = [&ca_file, &cert_file, &key_file]
        .into_iter()
        .flatten()
        .map(Spanned::span)
        .next();
    let read = |key: &str, file: &Spanned<String>, marker: &str| -> Result<Vec<u8>, ConfigError> {
        let path = base.join(file.get_ref());
        let text = read_small_file(&path).map_err(|error| {
            source.error(
                file.span(),
                format!("redis.{key}: cannot read {}: {error}", path.display()),
            )
        })?;
        if !text.contains("-----BEGIN ") || !text.contains(marker) {
            return Err(source.error(
                file.span(),
                format!(
                    "redis.{key}: {} holds no PEM {}; give the PEM file (-----BEGIN ...-----)",
                    path.display(),
                    marker.trim_end_matches('-')
                ),
            ));
        }
        Ok(text.into_bytes())
    };
    let ca = ca_file
        .as_ref()
        .map(|file| read("tls_ca_file", file, "CERTIFICATE-"))
        .transpose()?;
    let client = match (&cert_file, &key_file) {
        (Some(cert), Some(key)) => Some((
            read("tls_cert_file", cert, "CERTIFICATE-")?,
            read("tls_key_file", key, "PRIVATE KEY-")?,
        )),
        (Some(cert), None) => {
            return Err(source.error(
                cert.span(),
                "redis.tls_cert_file: needs tls_key_file too (a client certificate and its key, both or neither)",
            ));
        }
        (None, Some(key)) => {
            return Err(source.error(
                key.span(),
                "redis.tls_key_file: needs tls_cert_file too (a client certificate and its key, both or neither)",
            ));
        }
        (None, None) => None,
    };
    Ok((TlsFiles { ca, client }, first))
}
