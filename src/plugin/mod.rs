//! The plugin registry: loads every `[plugins.NAME]` of the config and maps each task type to its plugin.

mod ffi;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

pub use ffi::{LoadedPlugin, MESSAGE_CAPACITY, Run, Status};

use crate::config::Config;

/// Why a plugin was refused. Every variant names the file and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("plugin {}: cannot load: {message}", path.display())]
    Open { path: PathBuf, message: String },
    #[error("plugin {}: refused: {reason}", path.display())]
    Untrusted { path: PathBuf, reason: String },
    #[error("plugin {}: no kmq_plugin_v1 symbol; is it a kmqd plugin built against kmq_plugin.h?", path.display())]
    MissingSymbol { path: PathBuf },
    #[error("plugin {}: ABI version {found}, but this kmqd speaks version {expected}; rebuild the plugin against this kmqd's kmq_plugin.h", path.display())]
    AbiVersion {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error("plugin {}: its descriptor is {found} bytes, smaller than the {minimum} bytes of ABI v1; rebuild it against kmq_plugin.h", path.display())]
    StructSize {
        path: PathBuf,
        found: usize,
        minimum: usize,
    },
    #[error("plugin {} ({}): init failed: {message}", name, path.display())]
    InitFailed {
        path: PathBuf,
        name: String,
        message: String,
    },
    #[error("plugins {} and {} both handle task type {kind:?}; a type must belong to one plugin", first.display(), second.display())]
    DuplicateType {
        kind: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("plugins.{first} and plugins.{second} name the same file {}; load it once", path.display())]
    DuplicateFile {
        first: String,
        second: String,
        path: PathBuf,
    },
    #[error("plugin {}: it handles no task types; list them in its descriptor's `types`", path.display())]
    NoTypes { path: PathBuf },
}

/// The loaded plugins, by task type.
pub struct Registry {
    plugins: Vec<Arc<LoadedPlugin>>,
    by_type: HashMap<String, Arc<LoadedPlugin>>,
    shut_down: AtomicBool,
}

impl Registry {
    /// A registry without plugins (producers and `stats` need none).
    pub fn empty() -> Registry {
        Registry {
            plugins: Vec::new(),
            by_type: HashMap::new(),
            shut_down: AtomicBool::new(false),
        }
    }

    /// Loads every plugin the config names. The first refusal stops the load: a daemon with a missing handler
    /// would dead-letter that handler's tasks.
    pub fn load(config: &Config) -> Result<Registry, PluginError> {
        let mut registry = Registry::empty();
        let mut files: HashMap<PathBuf, String> = HashMap::new();
        for plugin in &config.plugins {
            let path = canonical(&plugin.file)?;
            if let Some(first) = files.insert(path.clone(), plugin.name.clone()) {
                return Err(PluginError::DuplicateFile {
                    first,
                    second: plugin.name.clone(),
                    path,
                });
            }
            let loaded = Arc::new(ffi::load(&path, &plugin.config_json)?);
            if loaded.types.is_empty() {
                return Err(PluginError::NoTypes { path });
            }
            for kind in &loaded.types {
                if let Some(first) = registry.by_type.get(kind) {
                    return Err(PluginError::DuplicateType {
                        kind: kind.clone(),
                        first: first.path.clone(),
                        second: path,
                    });
                }
                registry.by_type.insert(kind.clone(), Arc::clone(&loaded));
            }
            tracing::info!(plugin = %loaded.name, path = %path.display(), types = ?loaded.types, "plugin loaded");
            registry.plugins.push(loaded);
        }
        Ok(registry)
    }

    /// The plugin that handles `kind`.
    pub fn for_type(&self, kind: &str) -> Option<&LoadedPlugin> {
        self.by_type.get(kind).map(Arc::as_ref)
    }

    /// The loaded plugins, in the order of their names in the config.
    pub fn plugins(&self) -> &[Arc<LoadedPlugin>] {
        &self.plugins
    }

    /// Calls every plugin's shutdown, once. The caller guarantees that no handler runs any more.
    pub fn shutdown(&self) {
        if self.shut_down.swap(true, Ordering::SeqCst) {
            return;
        }
        for plugin in &self.plugins {
            plugin.shutdown();
        }
    }
}

fn canonical(path: &Path) -> Result<PathBuf, PluginError> {
    path.canonicalize().map_err(|error| PluginError::Open {
        path: path.to_owned(),
        message: error.to_string(),
    })
}
