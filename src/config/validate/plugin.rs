//! A `[plugins.NAME]` table: the plugin's file (relative to `plugins_dir`) and its config, handed to it as JSON.
//! Its own module, as each section is, so that its rules read apart from the others.

use std::ops::Range;
use std::path::Path;

use super::toml_to_json;
use crate::config::errors::Source;
use crate::config::raw::RawPlugin;
use crate::config::*;

impl RawPlugin {
    pub(super) fn validate(
        &self,
        source: &Source<'_>,
        name: &str,
        span: Range<usize>,
        plugins_dir: &Path,
    ) -> Result<PluginConfig, ConfigError> {
        let RawPlugin { file, config } = self;
        let file = file.as_ref().ok_or_else(|| {
            source.error(
                span.clone(),
                format!("plugins.{name}.file: missing; name the plugin's .so file, e.g. file = \"libkmq_{name}.so\""),
            )
        })?;
        let config_json = match config {
            Some(table) => serde_json::to_string(&toml_to_json(&toml::Value::Table(table.clone())))
                .expect("a JSON value always serializes"),
            None => "{}".to_string(),
        };
        Ok(PluginConfig {
            name: name.to_string(),
            file: plugins_dir.join(file.get_ref()),
            config_json,
            location: source.location(&span),
        })
    }
}
