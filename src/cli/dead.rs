//! `kmqd dead list|show|requeue|purge`: the dead-letter list, without redis-cli (docs/OPERATIONS.md, "Dead
//! letters").

use std::io::Write;
use std::time::Duration;

use clap::{Args, Subcommand};
use serde_json::Value as Json;

use crate::broker::access::Action;
use crate::broker::dead::DeadRecord;
use crate::client::{Client, DeadSelection};
use crate::config::Config;

use super::Failure;

#[derive(Subcommand, Debug)]
pub enum DeadCommand {
    /// List the newest dead-letter records: id, type, attempt, reason, when, and the daemon that dead-lettered
    /// the task.
    List {
        queue: String,
        /// Show at most this many records.
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// Print one JSON array of the records: their fields as stored, plus `parsed_task` (the task as JSON, or
        /// null when it is not JSON).
        #[arg(long)]
        json: bool,
    },
    /// Show the whole record of a dead task, its task pretty-printed. Exit 4 when no record has this id.
    Show { queue: String, id: String },
    /// Move dead tasks back to the ready list of their level, each record in one atomic step. Exit 4 when an id
    /// has no record.
    Requeue {
        #[command(flatten)]
        which: Which,
        /// Start the tasks' attempt count again at 0, for the full retry budget.
        #[arg(long)]
        reset_attempts: bool,
    },
    /// Remove dead-letter records. Exit 4 when an id has no record.
    Purge {
        #[command(flatten)]
        which: Which,
    },
}

/// The records a requeue or purge works on.
#[derive(Args, Debug)]
pub struct Which {
    /// The queue, as the config names it.
    queue: String,
    /// The task ids whose records to work on (every record of each id).
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    ids: Vec<String>,
    /// Every record in the list when the command starts (not those dead-lettered while it runs).
    #[arg(long)]
    all: bool,
}

impl Which {
    fn selection<'a>(&self, ids: &'a [&'a str]) -> DeadSelection<'a> {
        if self.all {
            DeadSelection::All
        } else {
            DeadSelection::Ids(ids)
        }
    }
}

/// The width a table row is fitted to (the reason column gives way): `COLUMNS` when the shell exports it.
fn width() -> usize {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|columns| columns.parse().ok())
        .filter(|&columns: &usize| columns >= 60)
        .unwrap_or(120)
}

pub(super) fn run_dead(config: &Config, command: DeadCommand) -> Result<(), Failure> {
    let client = Client::new(config)?;
    let mut out = std::io::stdout().lock();
    match command {
        DeadCommand::List { queue, limit, json } => {
            client.check_access(&[&queue], Action::DeadRead)?;
            let records = client.dead_list(&queue, limit)?;
            if json {
                let all: Vec<Json> = records.iter().map(DeadRecord::with_parsed_task).collect();
                let _ = writeln!(out, "{}", Json::Array(all));
                return Ok(());
            }
            let now = client.redis_now(&queue)?;
            let _ = out.write_all(table(&records, now, width()).as_bytes());
            Ok(())
        }
        DeadCommand::Show { queue, id } => {
            client.check_access(&[&queue], Action::DeadRead)?;
            let records = client.dead_show(&queue, &id)?;
            if records.is_empty() {
                return Err(Failure::NotFound(format!(
                    "no dead-letter record of task {id} in queue {queue} (see `kmqd dead list {queue}`)"
                )));
            }
            let now = client.redis_now(&queue)?;
            for record in &records {
                let _ = writeln!(out, "{}", show(record, now));
            }
            Ok(())
        }
        DeadCommand::Requeue {
            which,
            reset_attempts,
        } => {
            client.check_access(&[&which.queue], Action::DeadRequeue)?;
            super::check_eviction(&client, super::OnEviction::Refuse)?;
            let ids: Vec<&str> = which.ids.iter().map(String::as_str).collect();
            let report = client
                .dead_requeue(&which.queue, which.selection(&ids), reset_attempts)
                .map_err(|error| {
                    super::change_failed(error, "the requeue", &format!(
                        "see `kmqd dead list {}`; running it again is safe (each record moves once, and one \
                         already requeued is not found)",
                        which.queue
                    ))
                })?;
            let _ = writeln!(
                out,
                "requeued {}, not found {}, held {}, malformed {}",
                report.requeued.len(),
                report.not_found.len(),
                report.held.len(),
                report.malformed.len()
            );
            if !report.held.is_empty() {
                let _ = writeln!(
                    out,
                    "held (a live task, or a unique_for window, holds the unique id; the record stays): {}",
                    report.held.join(", ")
                );
            }
            if !report.malformed.is_empty() {
                let _ = writeln!(
                    out,
                    "malformed (no task to queue; the record stays, see `kmqd dead show`): {}",
                    named(&report.malformed)
                );
            }
            not_found(&which, &report.not_found)
        }
        DeadCommand::Purge { which } => {
            client.check_access(&[&which.queue], Action::DeadPurge)?;
            super::check_eviction(&client, super::OnEviction::Warn)?;
            let ids: Vec<&str> = which.ids.iter().map(String::as_str).collect();
            let report = client
                .dead_purge(&which.queue, which.selection(&ids))
                .map_err(|error| {
                    super::change_failed(
                        error,
                        "the purge",
                        &format!(
                            "see `kmqd dead list {}`; running it again is safe",
                            which.queue
                        ),
                    )
                })?;
            let _ = writeln!(
                out,
                "purged {}, not found {}",
                report.purged.len(),
                report.not_found.len()
            );
            not_found(&which, &report.not_found)
        }
    }
}

/// Ids for a message; a record without one shows as `(no id)`.
fn named(ids: &[String]) -> String {
    ids.iter()
        .map(|id| if id.is_empty() { "(no id)" } else { id })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Exit 4 when ids given by name were not found, as `task cancel` does; with `--all` a record gone meanwhile is
/// only counted.
fn not_found(which: &Which, missing: &[String]) -> Result<(), Failure> {
    if which.all || missing.is_empty() {
        return Ok(());
    }
    Err(Failure::NotFound(format!(
        "no dead-letter record in queue {} (any more) for: {}",
        which.queue,
        named(missing)
    )))
}

/// `text` cut to `max` characters, the cut marked with `…`.
fn fit(text: &str, max: usize) -> String {
    // A reason may hold newlines (a handler's message): one line per record.
    let text = text.replace(['\n', '\r', '\t'], " ");
    if text.chars().count() <= max {
        return text;
    }
    let mut cut: String = text.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// `2026-12-01 14:03:12 (3m ago)`: local time, and the age on Redis's clock (`now_ms`).
fn when(dead_at_ms: Option<i64>, now_ms: i64) -> String {
    let Some(at) = dead_at_ms else {
        return "-".to_string();
    };
    let age = Duration::from_secs(((now_ms - at).max(0) / 1000) as u64);
    let age = match age.as_secs() {
        0 => "just now".to_string(),
        // The largest unit only: "3m ago", "2h ago", "4days ago".
        _ => format!(
            "{} ago",
            humantime::format_duration(age)
                .to_string()
                .split(' ')
                .next()
                .unwrap_or_default()
        ),
    };
    format!("{} ({age})", local_time(at))
}

/// `at_ms` as local time, `YYYY-MM-DD HH:MM:SS`, in the system's zone (`TZ`, /etc/localtime).
fn local_time(at_ms: i64) -> String {
    match jiff::Timestamp::from_millisecond(at_ms) {
        Ok(at) => at
            .to_zoned(jiff::tz::TimeZone::system())
            .strftime("%Y-%m-%d %H:%M:%S")
            .to_string(),
        Err(_) => format!("{at_ms} ms"),
    }
}

/// The table of `dead list`, fitted to `width` columns by shortening the reasons.
fn table(records: &[DeadRecord], now_ms: i64, width: usize) -> String {
    let rows: Vec<[String; 6]> = records
        .iter()
        .map(|record| {
            [
                fit(
                    if record.id().is_empty() {
                        "-"
                    } else {
                        record.id()
                    },
                    36,
                ),
                fit(
                    record.text("type").filter(|t| !t.is_empty()).unwrap_or("-"),
                    24,
                ),
                record
                    .int("attempt")
                    .map_or("-".to_string(), |n| n.to_string()),
                record.text("reason").unwrap_or("").to_string(),
                when(record.int("dead_at"), now_ms),
                fit(record.text("daemon").unwrap_or("-"), 32),
            ]
        })
        .collect();
    let header = ["ID", "TYPE", "ATTEMPT", "REASON", "WHEN", "DAEMON"];
    let mut widths = header.map(|h| h.chars().count());
    for row in &rows {
        for (column, cell) in row.iter().enumerate() {
            widths[column] = widths[column].max(cell.chars().count());
        }
    }
    // The reason takes what the other columns leave, at least 20 characters.
    let others: usize = widths
        .iter()
        .enumerate()
        .filter(|(c, _)| *c != 3)
        .map(|(_, w)| w)
        .sum();
    widths[3] = widths[3].min(width.saturating_sub(others + 5 * 2).max(20));
    let line = |cells: [&str; 6]| {
        let mut text = String::new();
        for (column, cell) in cells.iter().enumerate() {
            let cell = if column == 3 {
                fit(cell, widths[3])
            } else {
                cell.to_string()
            };
            if column == 5 {
                text.push_str(&cell);
            } else if column == 2 {
                text.push_str(&format!("{cell:>w$}  ", w = widths[column]));
            } else {
                text.push_str(&format!("{cell:<w$}  ", w = widths[column]));
            }
        }
        text.push('\n');
        text
    };
    let mut text = line(header);
    for row in &rows {
        text.push_str(&line(row.each_ref().map(String::as_str)));
    }
    text
}

/// `dead show`'s text: the record's fields, then its task pretty-printed as JSON (a payload that is not JSON as
/// it was stored, and one that was not UTF-8 as its base64).
fn show(record: &DeadRecord, now_ms: i64) -> String {
    let mut text = String::new();
    if record.fields.is_empty() {
        return format!(
            "a record that is not a JSON object:\n{}\n",
            String::from_utf8_lossy(&record.raw)
        );
    }
    // The fields kmqd writes in the order it writes them, then any others.
    let known = [
        "dead_at", "queue", "id", "type", "level", "attempt", "reason", "size", "daemon",
    ];
    let others = record
        .fields
        .keys()
        .map(String::as_str)
        .filter(|name| !known.contains(name) && !matches!(*name, "task" | "task_base64"));
    for name in known.into_iter().chain(others) {
        let Some(value) = record.fields.get(name) else {
            continue;
        };
        let shown = match (name, value) {
            ("dead_at", Json::Number(n)) => format!("{n}, {}", when(n.as_i64(), now_ms)),
            (_, Json::String(s)) => s.clone(),
            (_, other) => other.to_string(),
        };
        text.push_str(&format!("{name}: {shown}\n"));
    }
    match (record.task(), record.text("task_base64")) {
        (Some(task), _) => match serde_json::from_str::<&serde_json::value::RawValue>(task) {
            Ok(_) => text.push_str(&format!("task:\n{}\n", pretty(task))),
            Err(_) => text.push_str(&format!("task (not JSON, as stored):\n{task}\n")),
        },
        (None, Some(base64)) => text.push_str(&format!(
            "task_base64 (the payload was not UTF-8):\n{base64}\n"
        )),
        (None, None) => text.push_str("task: (none in the record)\n"),
    }
    text
}

/// Valid JSON `text` indented by two spaces, its members in their stored order (a parsed `Value` would sort
/// them) and its strings and numbers byte for byte.
fn pretty(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    let mut depth = 0usize;
    let (mut in_string, mut escaped) = (false, false);
    let mut chars = text.chars().peekable();
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
    };
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            ' ' | '\t' | '\n' | '\r' => {}
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                // An empty object or array stays on its line.
                while chars.peek().is_some_and(|c| c.is_ascii_whitespace()) {
                    chars.next();
                }
                if matches!(chars.peek(), Some('}' | ']')) {
                    out.push(chars.next().expect("peeked"));
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(text: &str) -> DeadRecord {
        DeadRecord::parse(text.as_bytes().to_vec())
    }

    #[test]
    fn the_table_fits_its_width_by_shortening_reasons() {
        let long = "x".repeat(300);
        let records = [record(&format!(
            r#"{{"dead_at":1000,"id":"a1","type":"t","attempt":3,"reason":"{long}","daemon":"h:1"}}"#
        ))];
        let text = table(&records, 61_000, 100);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("ID"), "{text}");
        assert!(
            lines[1].contains("a1") && lines[1].contains("(1m ago)"),
            "{text}"
        );
        assert!(lines[1].contains('…'), "{text}");
        assert!(
            lines.iter().all(|line| line.chars().count() <= 100),
            "{text}"
        );
    }

    #[test]
    fn show_pretty_prints_the_task() {
        let text = show(
            &record(r#"{"dead_at":1000,"id":"a","task":"{\"id\":\"a\",\"type\":\"t\"}"}"#),
            1000,
        );
        assert!(
            text.contains("task:\n{\n  \"id\": \"a\",\n  \"type\": \"t\"\n}"),
            "{text}"
        );
        let text = show(&record(r#"{"id":"","task_base64":"/w=="}"#), 0);
        assert!(
            text.contains("task_base64 (the payload was not UTF-8):\n/w=="),
            "{text}"
        );
    }

    #[test]
    fn pretty_keeps_the_members_order_and_the_strings() {
        assert_eq!(
            pretty(r#"{"z":1,"a":{"s":"x, {y}: \"q\"","e":[],"o":{ }},"l":[1,2]}"#),
            "{\n  \"z\": 1,\n  \"a\": {\n    \"s\": \"x, {y}: \\\"q\\\"\",\n    \"e\": [],\n    \"o\": {}\n  },\n  \"l\": [\n    1,\n    2\n  ]\n}"
        );
    }

    #[test]
    fn ages_name_their_largest_unit() {
        assert!(when(Some(0), 180_500).ends_with(" (3m ago)"));
        assert!(when(Some(0), 10).ends_with(" (just now)"));
        assert_eq!(when(None, 0), "-");
    }
}
