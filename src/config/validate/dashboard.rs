//! The `[dashboard]` section: where its users, and its token, come from. Its own module, as each section is; only
//! the shape is checked here, the files are read when the dashboard starts.

use std::path::Path;

use toml::Spanned;

use crate::config::errors::Source;
use crate::config::raw::RawDashboard;
use crate::config::*;

impl RawDashboard {
    /// Only the shape: the files are read, and the variable looked up, when the dashboard starts.
    pub(super) fn validate(
        self,
        source: &Source<'_>,
        base: &Path,
    ) -> Result<DashboardConfig, ConfigError> {
        let RawDashboard {
            users_file,
            token_env,
            token_file,
        } = self;
        let located = |key: &str, value: &Spanned<String>| -> Result<String, ConfigError> {
            if value.get_ref().trim().is_empty() {
                return Err(source.error(
                    value.span(),
                    format!("dashboard.{key}: is empty; leave it out or name one"),
                ));
            }
            Ok(format!(
                "{}: dashboard.{key}",
                source.location(&value.span())
            ))
        };
        if let (Some(_), Some(file)) = (&token_env, &token_file) {
            return Err(source.error(
                file.span(),
                "dashboard.token_file: set token_env or token_file, not both",
            ));
        }
        let path = |key: &str, value: Option<Spanned<String>>| -> Result<_, ConfigError> {
            value
                .map(|value| {
                    Ok(Located {
                        at: located(key, &value)?,
                        value: base.join(value.get_ref()),
                    })
                })
                .transpose()
        };
        Ok(DashboardConfig {
            users_file: path("users_file", users_file)?,
            token_env: token_env
                .map(|var| {
                    Ok::<_, ConfigError>(Located {
                        at: located("token_env", &var)?,
                        value: var.into_inner(),
                    })
                })
                .transpose()?,
            token_file: path("token_file", token_file)?,
        })
    }
}
