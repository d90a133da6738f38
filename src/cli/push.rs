//! `kmqd push`: one task from the arguments, or one per line of standard input.

use std::io::BufRead;
use std::time::Duration;

use crate::broker::Due;
use crate::broker::access::Action;
use crate::client::{Client, Expiry, NewTask, PUSH_CHUNK, Pushed};
use crate::config::Config;
use crate::task;

use super::Failure;

#[derive(clap::Args, Debug)]
pub struct PushArgs {
    /// The queue, as named in the config.
    pub queue: String,
    /// The task type, which selects the handler.
    #[arg(value_name = "TYPE")]
    pub kind: String,
    /// The task's data as JSON (default: null).
    #[arg(value_name = "DATA_JSON", conflicts_with = "stdin")]
    pub data: Option<String>,
    /// The task id (default: a random UUID).
    #[arg(long, conflicts_with = "stdin")]
    pub id: Option<String>,
    /// Read one task per line from standard input, each line the task's data as JSON; pushed in batches.
    #[arg(long)]
    pub stdin: bool,
    /// A priority level of the queue (default: the queue's default_priority).
    #[arg(long)]
    pub priority: Option<String>,
    /// Refuse the push (exit 3) while a task with this --id is delayed, ready or processing.
    #[arg(long, requires = "id")]
    pub unique: bool,
    /// Unique (as --unique), and the id stays held this long after its task ended: one run of the id per such
    /// window ("1h"; at least 1ms).
    #[arg(long, value_parser = humantime::parse_duration, requires = "id", conflicts_with = "unique")]
    pub unique_for: Option<Duration>,
    /// The task's group, for a queue with [queues.groups]: groups take turns, each within its own limits (1 to 64
    /// bytes; default: the group of tasks without one).
    #[arg(long)]
    pub group: Option<String>,
    /// Make the task ready after this long, on Redis's clock ("30s", "5m").
    #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "at")]
    pub delay: Option<Duration>,
    /// Make the task ready at this time (RFC 3339, e.g. 2026-12-01T08:00:00Z).
    #[arg(long, value_parser = parse_time)]
    pub at: Option<i64>,
    /// Start the task this long after the push, replacing the task of its --id that still waits for its own
    /// start (its data and start time): only the last push of a burst less than this apart runs ("5s").
    #[arg(long, value_parser = humantime::parse_duration, requires = "id",
          conflicts_with_all = ["unique", "unique_for", "delay", "at"])]
    pub debounce: Option<Duration>,
    /// Dead-letter the task unrun (reason "expired") when no worker started it within this long of the push, on
    /// Redis's clock ("10m", "1h"); with --stdin, every task of the input.
    #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "expires_at")]
    pub expires: Option<Duration>,
    /// Dead-letter the task unrun (reason "expired") when no worker started it by this time, on Redis's clock
    /// (RFC 3339, e.g. 2026-12-01T08:00:00Z, or ms since the epoch).
    #[arg(long, value_parser = parse_time_or_ms)]
    pub expires_at: Option<i64>,
}

/// A time as RFC 3339 or as ms since the epoch (all digits: what a program has at hand).
fn parse_time_or_ms(text: &str) -> Result<i64, String> {
    if !text.is_empty() && text.bytes().all(|byte| byte.is_ascii_digit()) {
        return text
            .parse()
            .map_err(|_| format!("{text} ms since the epoch is out of range"));
    }
    parse_time(text).map_err(|error| format!("{error}, or ms since the epoch"))
}

pub(super) fn parse_time(text: &str) -> Result<i64, String> {
    let time = humantime::parse_rfc3339_weak(text)
        .map_err(|error| format!("{error}; write e.g. 2026-12-01T08:00:00Z"))?;
    let since_epoch = time
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| "time before 1970".to_string())?;
    Ok(since_epoch.as_millis() as i64)
}

pub(super) fn run_push(config: &Config, args: PushArgs) -> Result<(), Failure> {
    let client = Client::new(config)?;
    client.check_access(&[&args.queue], Action::Push)?;
    super::check_eviction(&client, super::OnEviction::Refuse)?;
    let due = match (args.debounce.or(args.delay), args.at) {
        (Some(delay), _) => Due::After(delay),
        (None, Some(at)) => Due::At(at),
        (None, None) => Due::Now,
    };
    let expires = match (args.expires, args.expires_at) {
        (Some(expiry), _) => Some(Expiry::After(expiry)),
        (None, Some(at_ms)) => Some(Expiry::At(at_ms)),
        (None, None) => None,
    };
    let prepare = |data: Box<serde_json::value::RawValue>| {
        let mut task = NewTask::with_data(&args.kind, data);
        task.priority = args.priority.clone();
        task.group = args.group.clone();
        task.due = due;
        task.expires = expires;
        task
    };
    if args.stdin {
        return push_lines(&client, &args.queue, std::io::stdin().lock(), prepare);
    }
    let data =
        task::data_from_str(args.data.as_deref().unwrap_or("null")).map_err(Failure::Usage)?;
    let mut task = prepare(data);
    task.id = args.id;
    task.unique = args.unique || args.unique_for.is_some();
    task.unique_for = args.unique_for;
    task.debounce = args.debounce.is_some();
    let unique = task.unique;
    match client.push(&args.queue, task)? {
        Pushed::Accepted(id) => {
            println!("{id}");
            Ok(())
        }
        Pushed::Duplicate(id) if due != Due::Now && !unique => Err(Failure::Refused(format!(
            "a delayed task {id} is already waiting; to reschedule it, cancel it first (kmqd task cancel {} {id})",
            args.queue
        ))),
        Pushed::Duplicate(id) => Err(Failure::Refused(format!(
            "task {id} is already queued (delayed, ready or processing){}",
            if args.unique_for.is_some() {
                ", or its unique_for window after its end is still running"
            } else if args.unique {
                "; a unique id is accepted again once that task is done or dead"
            } else {
                ""
            }
        ))),
    }
}

/// Pushes one task per line of `input` in batches of [`PUSH_CHUNK`]. A line that is not JSON stops the push
/// with its line number; the batches before it are already queued, and the message says how many tasks that is.
pub(super) fn push_lines(
    client: &Client,
    queue: &str,
    input: impl BufRead,
    prepare: impl Fn(Box<serde_json::value::RawValue>) -> NewTask,
) -> Result<(), Failure> {
    let mut pushed = 0usize;
    let mut batch = Vec::with_capacity(PUSH_CHUNK);
    let flush = |batch: &mut Vec<NewTask>, pushed: &mut usize| -> Result<(), Failure> {
        let results = client.push_batch(queue, batch.drain(..))?;
        *pushed += results.iter().filter(|r| r.is_accepted()).count();
        Ok(())
    };
    for (index, line) in input.lines().enumerate() {
        let line =
            line.map_err(|error| Failure::Runtime(format!("reading standard input: {error}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let data = match task::data_from_str(&line) {
            Ok(data) => data,
            Err(error) => {
                flush(&mut batch, &mut pushed)?;
                return Err(Failure::Usage(format!(
                    "line {}: {error}; the {pushed} tasks before it were pushed, none after",
                    index + 1
                )));
            }
        };
        batch.push(prepare(data));
        if batch.len() == PUSH_CHUNK {
            flush(&mut batch, &mut pushed)?;
        }
    }
    flush(&mut batch, &mut pushed)?;
    println!("pushed {pushed} tasks to {queue}");
    Ok(())
}
