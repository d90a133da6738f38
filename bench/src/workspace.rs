//! The bench's workspace: its redis-server, the testkit plugin copied where the daemon accepts it, the daemons'
//! configs, and the daemon processes it starts.

use super::*;

/// A queue's `workers`, `batch` and `prefetch` in the daemons' config; `None` leaves a key at the daemon's
/// default (the `handlers` scenario measures kmqd out of the box).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub(crate) workers: usize,
    pub(crate) batch: Option<usize>,
    pub(crate) prefetch: Option<usize>,
    /// More `[[queues]]` lines (a limit, say), as written.
    pub(crate) extra: &'static str,
}

impl Shape {
    /// `workers` handler threads, `batch` and `prefetch` at the daemon's defaults.
    pub(crate) fn out_of_the_box(workers: usize) -> Shape {
        Shape {
            workers,
            batch: None,
            prefetch: None,
            extra: "",
        }
    }

    /// The `[[queues]]` lines for these keys.
    pub(crate) fn keys(&self) -> String {
        let mut keys = format!("workers = {}\n", self.workers);
        if let Some(batch) = self.batch {
            let _ = writeln!(keys, "batch = {batch}");
        }
        if let Some(prefetch) = self.prefetch {
            let _ = writeln!(keys, "prefetch = {prefetch}");
        }
        // Last, so that `extra` may end with a table of the queue's (`[[queues.limits]]`).
        keys.push_str(self.extra);
        keys
    }
}

/// The bench's workspace: a redis-server, a plugins dir with testkit, configs.
pub(crate) struct Bench {
    pub(crate) options: Options,
    pub(crate) server: RedisServer,
    pub(crate) dir: tempfile::TempDir,
    /// Where the plugins were built (next to the kmqd binary, or `--plugins-dir`).
    pub(crate) source: PathBuf,
    pub(crate) kmqd: PathBuf,
}

/// A daemon process started by the bench.
pub(crate) struct Daemon {
    pub(crate) child: Child,
}

impl Daemon {
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status, if the daemon has stopped.
    pub(crate) fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGTERM, then wait (at most 30 s) for a graceful exit.
    pub(crate) fn stop(mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The daemon when `--daemon` names none: the `kmqd` binary beside this executable, where cargo builds both
/// (target/release/kmqd-bench runs target/release/kmqd). The bench is a binary of its own so that the daemon's
/// does not carry it; what it measures is always a real `kmqd` process.
pub fn default_daemon() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    let kmqd = exe.with_file_name("kmqd");
    if !kmqd.is_file() {
        return Err(format!(
            "{} not found: kmqd-bench runs the kmqd beside it; build both (cargo build --release --workspace) \
             or pass --daemon PATH",
            kmqd.display()
        ));
    }
    Ok(kmqd)
}

/// Copies plugin `name` from `source` into `into` (made if need be), with the permissions the daemon accepts (it
/// refuses plugins writable by others).
pub(crate) fn copy_plugin(source: &Path, name: &str, into: &Path) -> Result<(), String> {
    let from = source.join(name);
    if !from.is_file() {
        return Err(format!(
            "{} not found: build the workspace (cargo build --release --workspace) or pass --plugins-dir",
            from.display()
        ));
    }
    std::fs::create_dir_all(into).map_err(|e| format!("{}: {e}", into.display()))?;
    std::fs::copy(&from, into.join(name)).map_err(|e| format!("copy {name}: {e}"))?;
    for path in [into, &into.join(name)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

impl Bench {
    /// Copies plugin `name` from where the plugins were built into the directory `into`.
    pub(crate) fn copy_plugin(&self, name: &str, into: &Path) -> Result<(), String> {
        copy_plugin(&self.source, name, into)
    }

    pub(crate) fn new(options: Options) -> Result<Bench, String> {
        let kmqd = match &options.daemon {
            Some(path) if path.is_file() => path.clone(),
            Some(path) => return Err(format!("--daemon {}: no such file", path.display())),
            None => default_daemon()?,
        };
        let source = options
            .plugins_dir
            .clone()
            .or_else(|| kmqd.parent().map(Path::to_path_buf))
            .ok_or("cannot tell where the plugins are; pass --plugins-dir")?;
        let dir = tempfile::Builder::new()
            .prefix("kmqd-bench-")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        copy_plugin(&source, "libkmq_testkit.so", &dir.path().join("plugins"))?;
        let server = RedisServer::start(Listen::Loopback)?;
        Ok(Bench {
            options,
            server,
            dir,
            source,
            kmqd,
        })
    }

    pub(crate) fn redis(&self) -> Result<redis::Connection, String> {
        self.server.connection().map_err(|e| format!("redis: {e}"))
    }

    pub(crate) fn flush(&self) -> Result<(), String> {
        redis::cmd("FLUSHALL")
            .exec(&mut self.redis()?)
            .map_err(|e| format!("FLUSHALL: {e}"))
    }

    /// The bench's own Redis, as a drain target.
    pub(crate) fn own(&self) -> Target<'_> {
        Target {
            label: None,
            section: format!("url = \"{}\"", self.server.url()),
            masters: vec![&self.server],
            holder: &self.server,
        }
    }

    /// The queue shape of the bench's flags (`--workers`, `--batch`, `--prefetch`).
    pub(crate) fn shape(&self) -> Shape {
        Shape {
            workers: self.options.workers,
            batch: Some(self.options.batch),
            prefetch: Some(self.options.prefetch),
            extra: "",
        }
    }

    /// Writes a config for one queue `q` in `mode` on the bench's own Redis, shaped by the bench's flags;
    /// `record` makes the testkit write a line per run.
    pub(crate) fn config(
        &self,
        name: &str,
        mode: &str,
        record: Option<&Path>,
    ) -> Result<PathBuf, String> {
        self.config_on(&self.own().section, name, mode, record, self.shape())
    }

    /// As [`Bench::config`], with the `[redis]` keys and the queue's shape given.
    pub(crate) fn config_on(
        &self,
        redis: &str,
        name: &str,
        mode: &str,
        record: Option<&Path>,
        shape: Shape,
    ) -> Result<PathBuf, String> {
        let record = record.map_or(String::new(), |path| {
            format!("config = {{ record = \"{}\" }}", path.display())
        });
        self.write_config(redis, name, mode, &record, shape)
    }

    /// As [`Bench::config_on`] with a record file whose `end` lines carry the end time too (the testkit's
    /// `end_times`): only the scenarios that read the times ask for them, since a testkit built before that key
    /// refuses it (`--daemon` runs the plugins beside an older build).
    pub(crate) fn config_timed(
        &self,
        redis: &str,
        name: &str,
        mode: &str,
        record: &Path,
        shape: Shape,
    ) -> Result<PathBuf, String> {
        let record = format!(
            "config = {{ record = \"{}\", end_times = true }}",
            record.display()
        );
        self.write_config(redis, name, mode, &record, shape)
    }

    /// Writes the config `name`, with `record`, the testkit's config line (empty: none).
    pub(crate) fn write_config(
        &self,
        redis: &str,
        name: &str,
        mode: &str,
        record: &str,
        shape: Shape,
    ) -> Result<PathBuf, String> {
        let text = format!(
            "[redis]\n{redis}\n\n[daemon]\nplugins_dir = \"{plugins}\"\nshutdown_grace = \"5s\"\nlog_level = \"warn\"\n\n\
             [[queues]]\nname = \"q\"\nmode = \"{mode}\"\nlease_timeout = \"30s\"\n{shape}\
             \n[plugins.testkit]\nfile = \"libkmq_testkit.so\"\n{record}\n",
            plugins = self.dir.path().join("plugins").display(),
            shape = shape.keys(),
        );
        let path = self.dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, text).map_err(|e| e.to_string())?;
        Ok(path)
    }

    pub(crate) fn client(&self, config: &Path) -> Result<Client, String> {
        let config = Config::load(config).map_err(|e| e.to_string())?;
        Client::new(&config).map_err(|e| e.to_string())
    }

    /// Where the daemons' standard error goes (kept with the bench's temp dir until it ends).
    pub(crate) fn log(&self) -> PathBuf {
        self.dir.path().join("daemon.log")
    }

    pub(crate) fn daemon(&self, config: &Path) -> Result<Daemon, String> {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.log())
            .map_err(|e| e.to_string())?;
        let child = Command::new(&self.kmqd)
            .arg("--config")
            .arg(config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("start kmqd: {e}"))?;
        Ok(Daemon { child })
    }

    /// Pushes `n` no-op tasks (data `1`) with the library, in batches.
    pub(crate) fn fill(&self, client: &Client, n: usize) -> Result<(), String> {
        self.fill_with(client, n, "1")
    }

    /// Pushes `n` tasks with `data` (JSON: the testkit's behaviour) with the library, in batches.
    pub(crate) fn fill_with(&self, client: &Client, n: usize, data: &str) -> Result<(), String> {
        let data = kmqd::task::data_from_str(data).map_err(|e| format!("{data}: {e}"))?;
        let mut left = n;
        while left > 0 {
            let chunk = left.min(10_000);
            let tasks = (0..chunk).map(|_| NewTask::with_data("test", data.clone()));
            client.push_batch("q", tasks).map_err(|e| e.to_string())?;
            left -= chunk;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_leaves_unset_keys_to_the_daemon() {
        assert_eq!(Shape::out_of_the_box(64).keys(), "workers = 64\n");
        let flags = Shape {
            workers: 4,
            batch: Some(1000),
            prefetch: Some(4000),
            extra: "",
        };
        assert_eq!(flags.keys(), "workers = 4\nbatch = 1000\nprefetch = 4000\n");
    }
}
