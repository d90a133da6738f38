//! The `[plugins.NAME] config` table: read, checked, and turned into what each mode runs.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde::Deserialize;

/// The `PATH` a command gets unless the config's `env` sets one.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// How a handler process runs: one per task (the default), or long-lived ones that tasks are streamed to.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    PerTask,
    Persistent,
}

/// The `[plugins.NAME] config` table, as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    command: String,
    #[serde(default)]
    args: Vec<String>,
    timeout: Option<String>,
    types: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    mode: Mode,
    // Persistent mode only (docs/HANDLERS.md, "Configuration").
    processes: Option<usize>,
    concurrency: Option<usize>,
    max_tasks_per_process: Option<u64>,
    max_rss: Option<String>,
    start_timeout: Option<String>,
    kill_grace: Option<String>,
}

/// The program to run, checked: an absolute path to an executable, its arguments and its extra environment.
pub struct Program {
    pub command: PathBuf,
    args: Vec<String>,
    env: BTreeMap<String, String>,
}

impl Program {
    /// The command with a clean environment (`PATH`, then the config's `env`), its three standard streams piped,
    /// in a process group of its own that it leads: one kill reaches everything it started. It gets SIGKILL if
    /// kmqd dies (`process::die_with_parent`), in both modes.
    pub fn command(&self) -> Command {
        let mut command = Command::new(&self.command);
        command
            .args(&self.args)
            .env_clear()
            .env("PATH", DEFAULT_PATH)
            .envs(&self.env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        crate::process::die_with_parent(&mut command);
        command
    }

    /// The command's file name, for log lines.
    pub fn name(&self) -> String {
        self.command.file_name().map_or_else(
            || self.command.display().to_string(),
            |name| name.to_string_lossy().into_owned(),
        )
    }
}

/// The persistent mode's settings (docs/HANDLERS.md, "Configuration").
pub struct Persistent {
    /// How many children run at once; `None`: as many as tasks run at once, started as they arrive.
    pub processes: Option<usize>,
    /// How many tasks one child holds at once.
    pub concurrency: usize,
    /// The longest a task may take, besides the queue's `execution_timeout`.
    pub timeout: Option<Duration>,
    /// A child is replaced after this many tasks.
    pub max_tasks_per_process: Option<u64>,
    /// A child is replaced once its resident memory passes this many bytes (checked after each task).
    pub max_rss: Option<u64>,
    /// How long a child may take to write its hello line.
    pub start_timeout: Duration,
    /// How long a child has to exit after its input closes, and again after SIGTERM, before SIGKILL.
    pub kill_grace: Duration,
}

/// The checked config.
pub struct Config {
    pub program: Program,
    pub types: Vec<String>,
    pub run: Run,
}

/// What each mode needs beyond the program.
pub enum Run {
    PerTask { timeout: Duration },
    Persistent(Persistent),
}

fn duration(key: &str, text: &str) -> Result<Duration, String> {
    let parsed = humantime::parse_duration(text).map_err(|error| {
        format!("exec: {key} {text:?}: {error}; write a duration like \"30s\" or \"5m\"")
    })?;
    if parsed.is_zero() {
        return Err(format!(
            "exec: {key} is 0; give the command some time, e.g. \"30s\""
        ));
    }
    Ok(parsed)
}

/// `"512MiB"`, `"1GB"`, `"800kB"` or a plain number of bytes.
fn bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit_bytes: u64 = match unit.trim() {
        "" | "B" => 1,
        "kB" | "KB" => 1000,
        "KiB" => 1 << 10,
        "MB" => 1_000_000,
        "MiB" => 1 << 20,
        "GB" => 1_000_000_000,
        "GiB" => 1 << 30,
        _ => 0,
    };
    match number.parse::<u64>() {
        Ok(n) if n > 0 && unit_bytes > 0 => Ok(n.saturating_mul(unit_bytes)),
        _ => Err(format!(
            "exec: max_rss {text:?} is not a size; write one like \"512MiB\" or \"1GB\""
        )),
    }
}

impl Config {
    pub fn from_raw(raw: RawConfig) -> Result<Config, String> {
        let RawConfig {
            command,
            args,
            timeout,
            types,
            env,
            mode,
            processes,
            concurrency,
            max_tasks_per_process,
            max_rss,
            start_timeout,
            kill_grace,
        } = raw;
        let command = PathBuf::from(command);
        if !command.is_absolute() {
            return Err(format!(
                "exec: command {:?} is not an absolute path; write the full path of the executable",
                command.display().to_string()
            ));
        }
        let metadata = std::fs::metadata(&command)
            .map_err(|error| format!("exec: command {}: {error}", command.display()))?;
        if !metadata.is_file() || metadata.permissions().mode() & 0o111 == 0 {
            return Err(format!(
                "exec: command {} is not an executable file; chmod +x it or name another",
                command.display()
            ));
        }
        if types.is_empty() || types.iter().any(String::is_empty) {
            return Err(
                "exec: types must list the task types to run the command for, e.g. types = [\"report.build\"]"
                    .to_string(),
            );
        }
        if let Some(key) = env
            .keys()
            .find(|key| key.is_empty() || key.contains('=') || key.contains('\0'))
        {
            return Err(format!(
                "exec: env key {key:?} is not a variable name; it must be non-empty, without '=' or NUL"
            ));
        }
        if let Some((key, _)) = env.iter().find(|(_, value)| value.contains('\0')) {
            return Err(format!("exec: env value of {key} contains a NUL byte"));
        }
        let timeout = timeout.map(|text| duration("timeout", &text)).transpose()?;
        let run = match mode {
            Mode::PerTask => {
                let persistent_only = [
                    ("processes", processes.is_some()),
                    ("concurrency", concurrency.is_some()),
                    ("max_tasks_per_process", max_tasks_per_process.is_some()),
                    ("max_rss", max_rss.is_some()),
                    ("start_timeout", start_timeout.is_some()),
                    ("kill_grace", kill_grace.is_some()),
                ];
                if let Some((key, _)) = persistent_only.iter().find(|(_, given)| *given) {
                    return Err(format!(
                        "exec: {key} applies to long-lived handler processes only; add mode = \"persistent\" or remove it"
                    ));
                }
                let timeout = timeout.ok_or(
                    "missing field `timeout`: one process per task needs the longest a run may take, e.g. timeout = \"30s\"",
                )?;
                Run::PerTask { timeout }
            }
            Mode::Persistent => {
                if processes == Some(0) {
                    return Err("exec: processes is 0; run at least 1, or leave it out to start one per running task".to_string());
                }
                if concurrency == Some(0) {
                    return Err(
                        "exec: concurrency is 0; a process holds at least 1 task at once"
                            .to_string(),
                    );
                }
                if max_tasks_per_process == Some(0) {
                    return Err("exec: max_tasks_per_process is 0; give at least 1, or leave it out to never recycle".to_string());
                }
                Run::Persistent(Persistent {
                    processes,
                    concurrency: concurrency.unwrap_or(1),
                    timeout,
                    max_tasks_per_process,
                    max_rss: max_rss.as_deref().map(bytes).transpose()?,
                    start_timeout: duration(
                        "start_timeout",
                        start_timeout.as_deref().unwrap_or("10s"),
                    )?,
                    kill_grace: duration("kill_grace", kill_grace.as_deref().unwrap_or("2s"))?,
                })
            }
        };
        Ok(Config {
            program: Program { command, args, env },
            types,
            run,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::bytes;

    #[test]
    fn sizes_read_decimal_and_binary_units() {
        assert_eq!(bytes("512MiB"), Ok(512 << 20));
        assert_eq!(bytes("1GB"), Ok(1_000_000_000));
        assert_eq!(bytes("800 kB"), Ok(800_000));
        assert_eq!(bytes("4096"), Ok(4096));
        assert!(bytes("0MiB").is_err());
        assert!(bytes("1TB").is_err());
    }
}
