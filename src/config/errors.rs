//! Where a config error is ("file:line:column", from a byte span) and how it is worded: the key path, TOML's
//! words for types, and "did you mean" for a misspelled key or value.

use std::ops::Range;
use std::path::{Path, PathBuf};

use super::ConfigError;

/// The config key a shape error is at, from serde_path_to_error's path: without the segments `toml::Spanned`
/// adds, and with a plugin's name (a map key that is itself spanned, so the path only has `?` for it) read from
/// the nearest `[plugins.NAME]` header before the error.
pub(super) fn key_path(path: &str, before: &str) -> String {
    let path = path.replace(".$__serde_spanned_private_value", "");
    if !path.starts_with("plugins.?") {
        return path;
    }
    let name = before.lines().rev().find_map(|line| {
        let header = line.trim().strip_prefix("[plugins.")?;
        Some(header.split(']').next()?.trim().to_string())
    });
    match name {
        Some(name) => path.replacen('?', &name, 1),
        None => path.replacen(".?", "", 1),
    }
}

/// A serde shape error in words an operator reads: the key path first (`queues[0].workers: ...`), Rust's type
/// names as TOML's ("an integer", not "i64"), and for a misspelled key the valid one it most resembles.
pub(super) fn shape_message(key: &str, message: &str) -> String {
    let (key, message) = match message.strip_prefix("unknown field `") {
        // The path ends with the unknown key itself: name the table that holds it.
        Some(rest) => (
            key.rsplit_once('.').map_or("", |(table, _)| table),
            unknown_key(rest).unwrap_or_else(|| message.to_string()),
        ),
        None if is_duration_key(key) && message.ends_with("expected a string") => (
            key,
            format!(
                "{}; a duration is a string with a unit, such as \"30s\", \"5m\" or \"250ms\"",
                toml_words(message)
            ),
        ),
        None => (key, toml_words(message)),
    };
    match key {
        "" | "." => message,
        key => format!("{key}: {message}"),
    }
}

/// Whether the key at `path` holds a duration ("30s"), for the hint on a number given instead.
fn is_duration_key(path: &str) -> bool {
    const DURATIONS: [&str; 14] = [
        "connect_timeout",
        "io_timeout",
        "wait_timeout",
        "shutdown_grace",
        "report_interval",
        "lease_timeout",
        "execution_timeout",
        "alive_timeout",
        "backoff",
        "backoff_max",
        "idle_poll",
        "lag_warn",
        "every",
        "misfire_grace",
    ];
    let key = path.rsplit('.').next().unwrap_or(path);
    DURATIONS.contains(&key)
}

/// "unknown field `worker`, expected one of `name`, `workers`, ..." (the text after "unknown field `") as
/// "unknown key `worker`; did you mean `workers`? (valid keys: ...)".
fn unknown_key(rest: &str) -> Option<String> {
    let (unknown, rest) = rest.split_once('`')?;
    let valid: Vec<&str> = rest
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|name| !name.is_empty())
        .collect();
    let listed = valid
        .iter()
        .map(|name| format!("`{name}`"))
        .collect::<Vec<_>>()
        .join(", ");
    Some(match did_you_mean(unknown, &valid) {
        Some(near) => {
            format!("unknown key `{unknown}`; did you mean `{near}`? (valid keys: {listed})")
        }
        None => format!("unknown key `{unknown}` (valid keys: {listed})"),
    })
}

/// The candidate closest to `word`, when it is close enough to be a typo of it: a few edits apart for its
/// length, whatever the case (`Workers`, `retries_times`, `wokrers`).
pub(super) fn did_you_mean<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let word = word.to_ascii_lowercase();
    candidates
        .iter()
        .map(|candidate| (strsim::damerau_levenshtein(&word, candidate), *candidate))
        .filter(|(distance, candidate)| *distance <= (candidate.len().max(word.len()) / 3).max(1))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate)
}

/// Rust's names for what serde expected, as a TOML user would say them.
fn toml_words(message: &str) -> String {
    const WORDS: [(&str, &str); 12] = [
        ("expected i64", "expected an integer"),
        ("expected u64", "expected an integer"),
        ("expected u32", "expected an integer"),
        ("expected u16", "expected an integer"),
        ("expected usize", "expected an integer"),
        ("expected a sequence", "expected an array"),
        ("expected a map", "expected a table"),
        ("expected struct", "expected a table, for"),
        ("invalid type: sequence", "invalid type: array"),
        ("invalid type: map", "invalid type: table"),
        ("expected a boolean", "expected true or false"),
        ("invalid type: floating point", "invalid type: float"),
    ];
    let mut message = message.to_string();
    for (rust, toml) in WORDS {
        message = message.replace(rust, toml);
    }
    message
}

/// The config text and its file, to turn byte spans into "file:line:column".
pub(super) struct Source<'a> {
    pub(super) path: &'a Path,
    pub(super) text: &'a str,
}

impl Source<'_> {
    pub(super) fn location(&self, span: &Range<usize>) -> String {
        let start = span.start.min(self.text.len());
        let before = &self.text[..start];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        format!("{}:{line}:{column}", self.path.display())
    }

    pub(super) fn error(&self, span: Range<usize>, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            location: self.location(&span),
            message: message.into(),
        }
    }

    pub(super) fn base_dir(&self) -> PathBuf {
        match self.path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
            _ => PathBuf::from("."),
        }
    }
}
