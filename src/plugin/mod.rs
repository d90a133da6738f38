//! The plugin registry: loads every `[plugins.NAME]` of the config and every drop-in `.so` of `plugins_dir`, and
//! maps each task type to its plugin; [`Plugins`] is the snapshot a reload swaps.

mod ffi;

use std::cell::{Ref, RefCell};
use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use rustc_hash::FxHashMap;
use serde_json::value::RawValue;

pub(crate) use ffi::{LoadedPlugin, MESSAGE_CAPACITY, Run, Status};

use crate::config::{Config, PluginConfig};
use crate::poison::{read, write};
use crate::settlement::DeadHook;
use crate::task::Envelope;
use kmq_plugin::host::ProgressSink;

/// Why a plugin was refused. Every variant names the file and says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// A refusal of a plugin the config names, with where its `[plugins.NAME]` section stands.
    #[error("{location}: {error}")]
    At {
        location: String,
        error: Box<PluginError>,
    },
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
    #[error("{}", duplicate_type(kind, (first, first_section), (second, second_section), *same_file))]
    DuplicateType {
        kind: String,
        first: PathBuf,
        first_section: String,
        second: PathBuf,
        second_section: String,
        /// Both are sections of one file (the paths differ for a hard link).
        same_file: bool,
    },
    #[error("plugin {}: it handles no task types; list them in its descriptor's `types` (or in its config, if it reads them from there)", path.display())]
    NoTypes { path: PathBuf },
}

/// The refusal of a type two plugins claim: by their files, or by their sections when one file serves both.
fn duplicate_type(
    kind: &str,
    (first, first_section): (&Path, &str),
    (second, second_section): (&Path, &str),
    same_file: bool,
) -> String {
    if same_file {
        let also = if first == second {
            String::new()
        } else {
            format!(" (also reached as {})", second.display())
        };
        format!(
            "plugins.{first_section} and plugins.{second_section}, two sections of the same file {}{also}, both handle task type {kind:?}; a type must belong to one plugin: give each section its own types",
            first.display()
        )
    } else {
        format!(
            "plugins {} and {} both handle task type {kind:?}; a type must belong to one plugin: remove it from one of them",
            first.display(),
            second.display()
        )
    }
}

/// The loaded plugins, by task type: one snapshot. A reload builds a new one (reusing every plugin whose file did
/// not change) and swaps it into [`Plugins`]; a task runs on the snapshot its worker took when it started.
pub struct Registry {
    plugins: Vec<Arc<LoadedPlugin>>,
    /// Looked up once per task: FxHash, not SipHash (the keys are the config's types, so no producer can fill it).
    by_type: FxHashMap<String, Arc<LoadedPlugin>>,
    /// Drop-in files that were refused (and so skipped): reported by their file name.
    refused: Vec<PluginError>,
}

/// What a reload found out about the plugins besides the new set.
#[derive(Debug, Default)]
pub struct Changes {
    /// Plugins loaded afresh (new files, or files replaced by a new inode), by their file's path.
    pub loaded: Vec<PathBuf>,
    /// `plugins.NAME.config` keys whose table changed for a plugin already loaded from the same file: the running
    /// instance keeps its config until a restart.
    pub needs_restart: Vec<String>,
}

/// The files a reload has met: each one's library, loaded once, and the files the config's sections name.
struct Files {
    libraries: HashMap<(u64, u64), Arc<ffi::Library>>,
    named: HashSet<(u64, u64)>,
}

/// Where a plugin comes from: a `[plugins.NAME]` section, or a drop-in file of `plugins_dir` no section names.
struct Source<'a> {
    /// Where its `[plugins.NAME]` stands in the config (`file:line:column`); `None` for a drop-in.
    location: Option<&'a str>,
    section: String,
    path: PathBuf,
    configured: PathBuf,
    config_json: &'a str,
    drop_in: bool,
}

impl PluginError {
    /// The refusal as the operator reads it: at its `[plugins.NAME]` line, or at the config file `config` for a
    /// drop-in of `plugins_dir`.
    pub(crate) fn located(&self, config: &Path) -> String {
        match self {
            PluginError::At { .. } => self.to_string(),
            _ => format!("{}: {self}", config.display()),
        }
    }

    /// The refusal, located at a plugin's `[plugins.NAME]` section.
    fn at(self, location: &str) -> PluginError {
        match self {
            located @ PluginError::At { .. } => located,
            error => PluginError::At {
                location: location.to_string(),
                error: Box::new(error),
            },
        }
    }
}

/// A JSON string's text, borrowed, when it needs no unescaping (a W3C trace context never does: its characters
/// are printable ASCII without `"` or `\`); `None` for anything else, which no handler could use as a context.
fn plain_string(value: &RawValue) -> Option<&str> {
    let text = value.get().strip_prefix('"')?.strip_suffix('"')?;
    (!text.contains('\\')).then_some(text)
}

impl<'a> Run<'a> {
    /// The run of the task `envelope` of `queue`: `deadline_ms` is Redis's time by which it must be done (0:
    /// none), `cancel` the flag raised to ask its handler to stop, `traceparent` the run span's context when the
    /// run is traced (`None`: the handler is handed the producer's, unchanged), `progress` where its handler's
    /// progress reports go and its run's number there (the lane's table of the latest reports, keyed by the held
    /// task's id; `None`: dropped). Built in one place, every field at once: a run is made for every task.
    pub(crate) fn of(
        envelope: &'a Envelope<'_>,
        queue: &'a str,
        deadline_ms: i64,
        cancel: &'a AtomicU32,
        traceparent: Option<&'a str>,
        progress: Option<(&'a Arc<dyn ProgressSink>, u64)>,
    ) -> Run<'a> {
        let mut run = Run {
            id: envelope.id_str(),
            queue,
            kind: &envelope.kind,
            data: envelope.data.get(),
            attempt: envelope.attempt,
            created_at_ms: envelope.created_at.unwrap_or(0),
            deadline_ms,
            cancel,
            after: None,
            traceparent,
            tracestate: None,
            progress,
        };
        // The fields kmqd does not decode are the decoder's list of them: empty for most tasks, which then pay
        // this one test and no pass over them.
        if !envelope.extra.is_empty() {
            run.read_extra(envelope, traceparent.is_some());
        }
        run
    }

    /// Takes `after`, `traceparent` (unless `traced`: the run span's context replaces the producer's) and
    /// `tracestate` from the envelope's undecoded fields, in one pass, the first usable one of each name counting.
    #[cold]
    fn read_extra(&mut self, envelope: &'a Envelope<'_>, traced: bool) {
        let mut producer_context = None;
        for (name, value) in &envelope.extra {
            match &**name {
                "after" if self.after.is_none() => self.after = Some(value.get()),
                "traceparent" if producer_context.is_none() => {
                    producer_context = plain_string(value)
                }
                "tracestate" if self.tracestate.is_none() => self.tracestate = plain_string(value),
                _ => {}
            }
        }
        if !traced {
            self.traceparent = producer_context;
        }
    }
}

impl Registry {
    /// A registry without plugins (producers and `stats` need none).
    pub fn empty() -> Registry {
        Registry {
            plugins: Vec::new(),
            by_type: FxHashMap::default(),
            refused: Vec::new(),
        }
    }

    /// Loads every plugin the config names, then every other `.so` of `plugins_dir` (a drop-in, with an empty
    /// config). A refused `[plugins.NAME]` stops the load: a daemon with a missing handler would dead-letter that
    /// handler's tasks. A refused drop-in is skipped and kept in [`Registry::refused`]: one bad file copied into
    /// the directory does not keep every other handler from serving.
    pub fn load(config: &Config) -> Result<Registry, PluginError> {
        Registry::reload(config, &Registry::empty()).map(|(registry, _)| registry)
    }

    /// As [`Registry::load`], reusing every plugin of `old` whose file (device and inode) and section are the
    /// same: its instance keeps serving, with the config it was given (a changed config is reported in
    /// [`Changes::needs_restart`]). A file replaced by a new inode is loaded afresh. A drop-in refused here while
    /// `old` had its file loaded under the same path keeps the old instance.
    pub fn reload(config: &Config, old: &Registry) -> Result<(Registry, Changes), PluginError> {
        let mut registry = Registry::empty();
        let mut changes = Changes::default();
        let mut files = Files {
            // Each file's library is loaded once, by device and inode (a symbolic or hard link reaches the same
            // file): the dynamic loader would hand back the library already loaded anyway. The old snapshot's
            // libraries count as loaded: a section added to a loaded file is one more `init` on it.
            libraries: old
                .plugins
                .iter()
                .map(|p| (p.identity, Arc::clone(&p.library)))
                .collect(),
            named: HashSet::new(),
        };
        let mut sources = Vec::new();
        for plugin in &config.plugins {
            sources.push(Source {
                location: Some(&plugin.location),
                section: plugin.name.clone(),
                path: canonical(plugin).map_err(|error| error.at(&plugin.location))?,
                configured: plugin.file.clone(),
                config_json: &plugin.config_json,
                drop_in: false,
            });
        }
        sources.extend(drop_ins(&config.daemon.plugins_dir));
        for source in sources {
            match registry.add(&source, old, &mut files, &mut changes) {
                Ok(()) => {}
                Err(error) if source.drop_in => {
                    // The instance loaded from this path before, if any, keeps serving its types.
                    if let Some(previous) = old.plugins.iter().find(|p| p.path == source.path) {
                        // Unless its types went to another plugin meanwhile: then nothing of it is kept.
                        let _ = registry.insert(previous);
                    }
                    registry.refused.push(error);
                }
                Err(error) => return Err(error.at(source.location.unwrap_or_default())),
            }
        }
        Ok((registry, changes))
    }

    /// Initialises (or reuses from `old`) the plugin of `source` and maps its types.
    fn add(
        &mut self,
        source: &Source<'_>,
        old: &Registry,
        files: &mut Files,
        changes: &mut Changes,
    ) -> Result<(), PluginError> {
        let path = source.path.clone();
        // Opened once, checked through its descriptor, and loaded (if it is not already) through it.
        let file = open_trusted(&path, &source.configured)?;
        let metadata = file.metadata().map_err(|error| PluginError::Open {
            path: path.clone(),
            message: error.to_string(),
        })?;
        let identity = (metadata.dev(), metadata.ino());
        if source.drop_in && files.named.contains(&identity) {
            // A drop-in that a section names (or a link to it): it serves under its sections only.
            return Ok(());
        }
        files.named.insert(identity);
        let reused = old
            .plugins
            .iter()
            .find(|p| p.identity == identity && p.section == source.section);
        let loaded = match reused {
            Some(previous) => {
                if previous.config_json != source.config_json {
                    changes
                        .needs_restart
                        .push(format!("plugins.{}.config", source.section));
                }
                Arc::clone(previous)
            }
            None => {
                let library = match files.libraries.get(&identity) {
                    Some(library) => Arc::clone(library),
                    None => {
                        let library = Arc::new(ffi::load(&path, file)?);
                        files.libraries.insert(identity, Arc::clone(&library));
                        library
                    }
                };
                let loaded = Arc::new(library.init(&path, &source.section, source.config_json)?);
                if loaded.types.is_empty() {
                    return Err(PluginError::NoTypes { path });
                }
                changes.loaded.push(path.clone());
                tracing::info!(plugin = %loaded.name, section = %source.section, path = %path.display(), types = ?loaded.types, "plugin loaded");
                loaded
            }
        };
        self.insert(&loaded)
    }

    /// Maps the plugin's types to it, unless one already belongs to another plugin.
    fn insert(&mut self, loaded: &Arc<LoadedPlugin>) -> Result<(), PluginError> {
        for kind in &loaded.types {
            if let Some(first) = self.by_type.get(kind) {
                if !Arc::ptr_eq(first, loaded) {
                    return Err(PluginError::DuplicateType {
                        kind: kind.clone(),
                        first: first.path.clone(),
                        first_section: first.section.clone(),
                        second: loaded.path.clone(),
                        second_section: loaded.section.clone(),
                        same_file: first.identity == loaded.identity,
                    });
                }
            }
        }
        for kind in &loaded.types {
            // A type listed twice by one plugin is still one owner.
            self.by_type.insert(kind.clone(), Arc::clone(loaded));
        }
        self.plugins.push(Arc::clone(loaded));
        Ok(())
    }

    /// The plugin that handles `kind`.
    pub fn for_type(&self, kind: &str) -> Option<&Arc<LoadedPlugin>> {
        self.by_type.get(kind)
    }

    /// Calls the `on_dead` hook of the plugin that handles the task's type, if any: the task was dead-lettered
    /// for `reason` (the settle that did it is in Redis).
    pub(crate) fn on_dead(&self, queue: &str, envelope: &Envelope<'_>, reason: &str) {
        let Some(plugin) = self.for_type(&envelope.kind) else {
            return;
        };
        let cancel = AtomicU32::new(0);
        plugin.on_dead(&Run::of(envelope, queue, 0, &cancel, None, None), reason);
    }

    /// Calls `on_dead` for each task of a settle call whose record Redis applied (`Some(true)`: a record refused
    /// or left unanswered dead-lettered nothing), after `beat`: a call may dead-letter many tasks, each hook a
    /// plugin call, and the watchdog must see a hang only in a hook that never returns. The acker and the monitor,
    /// the two that settle dead letters, both call it.
    pub(crate) fn run_dead_hooks<'h>(
        &self,
        queue: &str,
        hooks: impl IntoIterator<Item = (Option<&'h DeadHook>, Option<bool>)>,
        mut beat: impl FnMut(),
    ) {
        for (hook, applied) in hooks {
            if let (Some(hook), Some(true)) = (hook, applied) {
                beat();
                self.on_dead(queue, &hook.envelope, &hook.reason);
            }
        }
    }

    /// The loaded plugins: the config's sections in order, then the drop-ins by file name.
    pub fn plugins(&self) -> &[Arc<LoadedPlugin>] {
        &self.plugins
    }

    /// The drop-in files that were refused, each error naming its file.
    pub(crate) fn refused(&self) -> &[PluginError] {
        &self.refused
    }

    /// Calls every plugin's shutdown (each runs once). The caller guarantees that no handler runs any more.
    pub(crate) fn shutdown(&self) {
        for plugin in &self.plugins {
            plugin.shutdown();
        }
    }
}

/// The registry every worker, acker and the monitor read: one snapshot per task (or hook), swapped whole by a
/// reload. A task that started on a snapshot finishes on it, so a replaced plugin's old instance serves its
/// running tasks to the end, and is shut down when its last reference goes (`LoadedPlugin`'s `Drop`).
///
/// A `RwLock` around an `Arc`, written once per reload; the acker and the monitor read it once per hook. Workers,
/// once per task, go through a [`Reader`]: one atomic load while nothing changed.
pub struct Plugins {
    current: RwLock<Arc<Registry>>,
    /// Bumped by every [`Plugins::replace`]: a [`Reader`]'s cached snapshot is current while this is unchanged.
    generation: AtomicU64,
}

impl Plugins {
    pub fn new(registry: Arc<Registry>) -> Arc<Plugins> {
        Arc::new(Plugins {
            current: RwLock::new(registry),
            generation: AtomicU64::new(0),
        })
    }

    /// The registry now: the one a task starting now runs on.
    pub(crate) fn current(&self) -> Arc<Registry> {
        Arc::clone(&read(&self.current))
    }

    /// Serves `registry` from now on; returns the one it replaces.
    pub(crate) fn replace(&self, registry: Registry) -> Arc<Registry> {
        let mut current = write(&self.current);
        let old = std::mem::replace(&mut *current, Arc::new(registry));
        // Under the lock, after the swap: a reader that sees the new generation reads the new registry.
        self.generation.fetch_add(1, Ordering::Release);
        old
    }
}

/// One worker's view of [`Plugins`]: the snapshot it read last, kept while the generation is unchanged, so that a
/// task costs one atomic load of a line nobody writes, instead of a read lock and a reference count every worker
/// would bounce between cores (docs/PERFORMANCE.md, "Reloadable plugins"). A task that starts after a reload sees
/// its generation and reads the new snapshot. The worker [`Reader::forget`]s its snapshot when it goes idle, so
/// that an idle worker does not keep a replaced plugin from its shutdown.
pub(crate) struct Reader {
    plugins: Arc<Plugins>,
    cached: RefCell<Option<(u64, Arc<Registry>)>>,
}

impl Reader {
    pub(crate) fn new(plugins: Arc<Plugins>) -> Reader {
        Reader {
            plugins,
            cached: RefCell::new(None),
        }
    }

    /// The registry a task starting now runs on (held for the task: the snapshot cannot change under it).
    pub(crate) fn current(&self) -> Ref<'_, Arc<Registry>> {
        let generation = self.plugins.generation.load(Ordering::Acquire);
        let stale = !matches!(&*self.cached.borrow(), Some((seen, _)) if *seen == generation);
        if stale {
            *self.cached.borrow_mut() = Some((generation, self.plugins.current()));
        }
        Ref::map(self.cached.borrow(), |cached| {
            &cached.as_ref().expect("filled above").1
        })
    }

    /// Drops the cached snapshot (the next task reads the current one).
    pub(crate) fn forget(&self) {
        self.cached.borrow_mut().take();
    }
}

/// The drop-in files of `plugins_dir`: every `*.so` file (not a directory, not a hidden `.name.so`, which is how
/// a copy in progress is best named), by file name. A directory that cannot be read has none.
fn drop_ins(plugins_dir: &Path) -> Vec<Source<'static>> {
    let Ok(entries) = std::fs::read_dir(plugins_dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.ends_with(".so") && !name.starts_with('.') && path.is_file()
        })
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|configured| {
            let section = configured
                .file_stem()
                .map_or_else(String::new, |stem| stem.to_string_lossy().into_owned());
            Source {
                location: None,
                section,
                path: configured
                    .canonicalize()
                    .unwrap_or_else(|_| configured.clone()),
                configured,
                config_json: "{}",
                drop_in: true,
            }
        })
        .collect()
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

/// Opens the plugin file at `path` (canonical) for loading, refusing one that someone other than root or the
/// daemon's user could have replaced: loading a library runs its code with the daemon's rights (review L9).
///
/// The check and the load must be about the same file. Checking paths and then opening the path again leaves a
/// window in which whoever can write one of its directories swaps a component for one of theirs. So the path is
/// walked one directory at a time from `/`, each opened relative to the one before (`openat`, following no
/// symbolic link: `path` is canonical, and a link found now means it changed since), each checked through its
/// descriptor, and the file is opened relative to its directory's descriptor and checked through its own. The
/// caller loads the library through that descriptor (`/proc/self/fd/N`, [`ffi::load`]): the file loaded is the
/// file checked, reached through the directories checked.
///
/// Checked: the file and its directory, which nobody but root or the daemon's user may own or be able to write
/// (group or others); every directory above them likewise, except that one with the sticky bit may be writable
/// by others (`/tmp`: only an entry's owner, the directory's or root may rename or remove it, and the entry below
/// is checked for its owner); and the directory the config names the file in (`configured`'s parent), which
/// differs when the config names a symbolic link: whoever can write it can point the link elsewhere.
fn open_trusted(path: &Path, configured: &Path) -> Result<std::fs::File, PluginError> {
    use rustix::fs::{Mode, OFlags};
    let open_error = |at: &Path, error: &dyn std::fmt::Display| PluginError::Open {
        path: path.to_owned(),
        message: format!("{}: {error}", at.display()),
    };
    let names: Vec<&std::ffi::OsStr> = path
        .components()
        .filter_map(|component| match component {
            std::path::Component::Normal(name) => Some(name),
            _ => None,
        })
        .collect();
    let Some((file_name, directories)) = names.split_last() else {
        return Err(open_error(path, &"not a file"));
    };
    let trusted = Trust::new(path);
    let walk = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut at = PathBuf::from("/");
    let mut directory = std::fs::File::from(
        rustix::fs::open("/", walk, Mode::empty()).map_err(|error| open_error(&at, &error))?,
    );
    for name in directories {
        trusted.check(&directory, Part::Above, &at)?;
        at.push(name);
        let next = rustix::fs::openat(&directory, *name, walk, Mode::empty())
            .map_err(|error| open_error(&at, &error))?;
        directory = std::fs::File::from(next);
    }
    trusted.check(&directory, Part::Directory, &at)?;
    // Not blocking: a FIFO put there would hang the open; it is refused as not a regular file instead.
    let file = rustix::fs::openat(
        &directory,
        *file_name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|error| open_error(path, &error))?;
    let file = std::fs::File::from(file);
    trusted.check(&file, Part::File, path)?;
    if let Some(named_in) = configured.parent().and_then(|d| d.canonicalize().ok())
        && named_in != at
    {
        let named_in_file =
            std::fs::File::open(&named_in).map_err(|error| open_error(&named_in, &error))?;
        trusted.check(&named_in_file, Part::Directory, &named_in)?;
    }
    Ok(file)
}

/// What a checked file or directory is to the plugin, as a refusal names it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    File,
    /// Its directory, or the one the config names it in.
    Directory,
    /// A directory above its directory.
    Above,
}

impl Part {
    fn name(self) -> &'static str {
        match self {
            Part::File => "file",
            Part::Directory => "directory",
            Part::Above => "ancestor directory",
        }
    }
}

/// The owner and mode checks of [`open_trusted`], for one plugin file.
struct Trust<'a> {
    /// The plugin file, which a refusal names.
    path: &'a Path,
    /// The daemon's effective user: the one user besides root whose plugin files are trusted.
    daemon_uid: u32,
}

impl Trust<'_> {
    fn new(path: &Path) -> Trust<'_> {
        Trust {
            path,
            daemon_uid: rustix::process::geteuid().as_raw(),
        }
    }

    /// Checks the file or directory open as `opened` (at `at`), the plugin's `part`.
    fn check(&self, opened: &std::fs::File, part: Part, at: &Path) -> Result<(), PluginError> {
        let metadata = opened.metadata().map_err(|error| PluginError::Open {
            path: self.path.to_owned(),
            message: format!("{}: {error}", at.display()),
        })?;
        let mode = metadata.mode() & 0o7777;
        let what = part.name();
        let sticky_above = part == Part::Above && mode & 0o1000 != 0;
        let reason = if part == Part::File && !metadata.is_file() {
            Some(format!("its file {} is not a regular file", at.display()))
        } else if mode & 0o022 != 0 && !sticky_above {
            Some(format!(
                "its {what} {} is writable by group or others (mode {mode:o}); run chmod go-w on it",
                at.display(),
            ))
        } else if metadata.uid() != 0 && metadata.uid() != self.daemon_uid {
            Some(format!(
                "its {what} {} is owned by uid {}, which is neither root nor the daemon's user (uid {}); run chown root on it (or chown it to the daemon's user)",
                at.display(),
                metadata.uid(),
                self.daemon_uid,
            ))
        } else {
            None
        };
        match reason {
            Some(reason) => Err(PluginError::Untrusted {
                path: self.path.to_owned(),
                reason,
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a run hands its handler from the envelope's undecoded fields: `(after, traceparent, tracestate)`, the
    /// run untraced and traced (the run span's context, `span`, replaces the producer's `traceparent` only).
    #[test]
    fn a_run_takes_after_and_the_trace_context_from_the_envelope_s_other_fields() {
        let span = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        type Fields<'a> = (Option<&'a str>, Option<&'a str>, Option<&'a str>);
        let cases: [(&str, Fields<'_>); 5] = [
            (r#"{"type":"t"}"#, (None, None, None)),
            (r#"{"type":"t","other":1}"#, (None, None, None)),
            (
                r#"{"type":"t","after":[{"id":"a"}],"traceparent":"00-p","tracestate":"k=v"}"#,
                (Some(r#"[{"id":"a"}]"#), Some("00-p"), Some("k=v")),
            ),
            // A context that is not a plain string is no context; the first plain one counts.
            (
                r#"{"type":"t","traceparent":1,"traceparent":"00-q","traceparent":"00-r"}"#,
                (None, Some("00-q"), None),
            ),
            (r#"{"type":"t","tracestate":"a\u0041"}"#, (None, None, None)),
        ];
        let cancel = AtomicU32::new(0);
        for (payload, (after, traceparent, tracestate)) in cases {
            let envelope = Envelope::decode(payload).expect(payload);
            let run = Run::of(&envelope, "q", 0, &cancel, None, None);
            assert_eq!(
                (run.after, run.traceparent, run.tracestate),
                (after, traceparent, tracestate),
                "{payload}"
            );
            let traced = Run::of(&envelope, "q", 0, &cancel, Some(span), None);
            assert_eq!(
                (traced.after, traced.traceparent, traced.tracestate),
                (after, Some(span), tracestate),
                "{payload}, traced"
            );
        }
    }

    #[test]
    fn a_reader_sees_a_replaced_registry_at_its_next_task_and_lets_go_of_the_old_one_when_idle() {
        let plugins = Plugins::new(Arc::new(Registry::empty()));
        let reader = Reader::new(Arc::clone(&plugins));
        let first = Arc::clone(&reader.current());
        assert!(Arc::ptr_eq(&first, &reader.current()), "cached");
        let old = plugins.replace(Registry::empty());
        assert!(Arc::ptr_eq(&first, &old));
        let second = Arc::clone(&reader.current());
        assert!(
            !Arc::ptr_eq(&first, &second),
            "the next task runs on the new one"
        );
        assert!(Arc::ptr_eq(&second, &plugins.current()));
        drop(old);
        assert_eq!(
            Arc::strong_count(&first),
            1,
            "nobody else holds the old one"
        );
        reader.forget();
        assert_eq!(Arc::strong_count(&second), 2, "the Plugins and this test");
    }
}
