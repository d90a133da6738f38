//! The plugin registry: loads every `[plugins.NAME]` of the config and maps each task type to its plugin.

mod ffi;

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

pub use ffi::{LoadedPlugin, MESSAGE_CAPACITY, Run, Status};

use crate::config::{Config, PluginConfig};

/// Why a plugin was refused. Every variant names the file and says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("plugin {}: no such file; build the plugin and copy it there, or fix plugins.{section}.file (relative names are looked up in plugins_dir)", path.display())]
    Missing { path: PathBuf, section: String },
    #[error("plugin {}: cannot load: {message}", path.display())]
    Open { path: PathBuf, message: String },
    #[error("plugin {}: refused: {reason}", path.display())]
    Untrusted { path: PathBuf, reason: String },
    #[error("plugin {}: no kmq_plugin_v1 symbol, so it is not a kmqd plugin; export `const kmq_plugin *kmq_plugin_v1(void)` (C: include kmq_plugin.h; Rust: kmq_plugin::export!)", path.display())]
    MissingSymbol { path: PathBuf },
    #[error("plugin {}: built for ABI version {found}, but this kmqd speaks version {expected}; rebuild the plugin against this kmqd's kmq_plugin.h (or its kmq-plugin crate)", path.display())]
    AbiVersion {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error("plugin {}: its descriptor's struct_size is {found} bytes, smaller than the {minimum} bytes of ABI v1; set struct_size = sizeof(kmq_plugin) and rebuild it against kmq_plugin.h", path.display())]
    StructSize {
        path: PathBuf,
        found: usize,
        minimum: usize,
    },
    #[error("plugin {}: bad descriptor: {problem}", path.display())]
    Descriptor { path: PathBuf, problem: String },
    #[error("plugin {} ({name}): init failed: {message}; its config is the table plugins.{section}.config", path.display())]
    InitFailed {
        path: PathBuf,
        name: String,
        section: String,
        message: String,
    },
    #[error("plugins {} and {} both handle task type {kind:?}; a type must belong to one plugin: remove it from one of them", first.display(), second.display())]
    DuplicateType {
        kind: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("plugins.{first} and plugins.{second} name the same file {}{}; a plugin is loaded once: remove one of them", path.display(), same_as(path, other_path))]
    DuplicateFile {
        first: String,
        second: String,
        path: PathBuf,
        /// The second name's path, when it differs (a hard link to the same file).
        other_path: PathBuf,
    },
    #[error("plugin {}: it handles no task types; list them in its descriptor's `types` (or in its config, if it reads them from there)", path.display())]
    NoTypes { path: PathBuf },
}

fn same_as(path: &Path, other: &Path) -> String {
    if path == other {
        String::new()
    } else {
        format!(" (also reached as {})", other.display())
    }
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
        // Each file once: by canonical path (symbolic links) and by device and inode (hard links), since the
        // dynamic loader would hand back the already-loaded library and `init` would run twice on it.
        let mut files: HashMap<(u64, u64), (String, PathBuf)> = HashMap::new();
        for plugin in &config.plugins {
            let path = canonical(plugin)?;
            let identity = identity(&path)?;
            check_trusted(&path, &plugin.file)?;
            if let Some((first, first_path)) = files.get(&identity) {
                return Err(PluginError::DuplicateFile {
                    first: first.clone(),
                    second: plugin.name.clone(),
                    path: first_path.clone(),
                    other_path: path,
                });
            }
            files.insert(identity, (plugin.name.clone(), path.clone()));
            let loaded = Arc::new(ffi::load(&path, &plugin.name, &plugin.config_json)?);
            if loaded.types.is_empty() {
                return Err(PluginError::NoTypes { path });
            }
            for kind in &loaded.types {
                if let Some(first) = registry.by_type.get(kind) {
                    if Arc::ptr_eq(first, &loaded) {
                        // The plugin listed the type twice; it is still one owner.
                        continue;
                    }
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

fn canonical(plugin: &PluginConfig) -> Result<PathBuf, PluginError> {
    plugin.file.canonicalize().map_err(|error| {
        if error.kind() == std::io::ErrorKind::NotFound {
            PluginError::Missing {
                path: plugin.file.clone(),
                section: plugin.name.clone(),
            }
        } else {
            PluginError::Open {
                path: plugin.file.clone(),
                message: error.to_string(),
            }
        }
    })
}

/// The device and inode of a file: two paths with the same identity are the same file.
fn identity(path: &Path) -> Result<(u64, u64), PluginError> {
    let metadata = std::fs::metadata(path).map_err(|error| PluginError::Open {
        path: path.to_owned(),
        message: error.to_string(),
    })?;
    Ok((metadata.dev(), metadata.ino()))
}

/// Refuses a plugin that someone other than root or the daemon's user could have replaced: loading a library runs
/// its code with the daemon's rights. Checked: the file (`path`, canonical), its directory, and the directory the
/// config names it in (`configured`'s parent), which differs when the config names a symbolic link.
fn check_trusted(path: &Path, configured: &Path) -> Result<(), PluginError> {
    let daemon_uid = ffi::effective_uid();
    let mut candidates = vec![("file", path.to_owned())];
    if let Some(directory) = path.parent() {
        candidates.push(("directory", directory.to_owned()));
    }
    if let Some(directory) = configured.parent().and_then(|d| d.canonicalize().ok()) {
        if !candidates.iter().any(|(_, c)| *c == directory) {
            candidates.push(("directory", directory));
        }
    }
    for (what, candidate) in candidates {
        let metadata = std::fs::metadata(&candidate).map_err(|error| PluginError::Open {
            path: path.to_owned(),
            message: format!("{}: {error}", candidate.display()),
        })?;
        let mode = metadata.mode() & 0o7777;
        let reason = if mode & 0o022 != 0 {
            Some(format!(
                "its {what} {} is writable by group or others (mode {mode:o}); run chmod go-w on it",
                candidate.display(),
            ))
        } else if metadata.uid() != 0 && metadata.uid() != daemon_uid {
            Some(format!(
                "its {what} {} is owned by uid {}, which is neither root nor the daemon's user (uid {daemon_uid}); run chown root on it (or chown it to the daemon's user)",
                candidate.display(),
                metadata.uid()
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(PluginError::Untrusted {
                path: path.to_owned(),
                reason,
            });
        }
    }
    Ok(())
}
