//! What each `/api/...` route answers (docs/DASHBOARD.md lists them with their JSON). Reads go through
//! [`Client`](crate::client::Client) and the overview's last poll; actions call the same `Client` methods as
//! the CLI's commands, so a requeue from a button is a `kmqd dead requeue`.

use std::time::UNIX_EPOCH;

use serde_json::{Value as Json, json};

use super::server::State;
use crate::broker::dead::DeadRecord;
use crate::broker::history::Sample;
use crate::broker::peek::DueTask;
use crate::client::{ClientError, DeadSelection};
use crate::task::Envelope;

/// Tasks per list on a queue's page unless `?limit=` says otherwise, and the most it may say.
pub const DEFAULT_LIMIT: usize = 20;
pub const MAX_LIMIT: usize = 500;

/// An answer other than 200: its status and what to tell the user.
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }
}

impl From<ClientError> for ApiError {
    fn from(error: ClientError) -> ApiError {
        let status = match &error {
            ClientError::UnknownQueue { .. } => 404,
            // Redis down, slow or refusing: the dashboard is up, what it stands on is not.
            ClientError::Broker(_) => 503,
            _ => 400,
        };
        ApiError::new(status, error.to_string())
    }
}

/// `GET /api/session`: what a script needs to act (the CSRF token) and what it may do.
pub fn session(state: &State, user: &str) -> Json {
    json!({
        "csrf": state.csrf(),
        "read_only": state.read_only,
        "user": user,
    })
}

/// `GET /api/overview`: every queue's row of the last good poll, when it was read, and the last poll's error.
pub fn overview(state: &State) -> Json {
    let overview = state.overview.lock().unwrap_or_else(|e| e.into_inner());
    json!({
        "updated_ms": overview.updated.map(|at| at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)),
        "error": overview.error,
        "read_only": state.read_only,
        "queues": overview.rows,
    })
}

/// `GET /api/history`: per queue, the points of its charts over the last hour, oldest first: one per minute's
/// sample (broker/history.rs), then the overview's last poll as the newest.
pub fn history(state: &State) -> Result<Json, ApiError> {
    let Some((first, _)) = state.queues.first() else {
        return Ok(json!({ "queues": {} }));
    };
    let now_ms = state.client.redis_now(first)?;
    let rows = state
        .overview
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .rows
        .clone();
    let mut queues = serde_json::Map::new();
    for (queue, _) in &state.queues {
        let mut points = points(&state.client.history(queue)?, now_ms);
        if let Some(row) = rows.iter().find(|row| &row.name == queue) {
            points.push(json!({
                "ago_ms": 0,
                "done": row.rates.map(|r| r.done),
                "failed": row.rates.map(|r| r.failed),
                "ready": row.ready,
                "delayed": row.delayed,
                "dead": row.dead,
            }));
        }
        queues.insert(queue.clone(), Json::Array(points));
    }
    Ok(json!({ "now_ms": now_ms, "minutes": crate::broker::history::MINUTES, "queues": queues }))
}

/// The charts' points of these samples: how long ago each was taken, its depths, and the rates (per second)
/// since the sample before (null for the first; a counter that went down, its keys deleted, counts as 0).
fn points(samples: &[Sample], now_ms: i64) -> Vec<Json> {
    let mut before: Option<&Sample> = None;
    samples
        .iter()
        .map(|sample| {
            let rate = |pick: fn(&Sample) -> u64| {
                before.filter(|b| sample.at > b.at).map(|b| {
                    pick(sample).saturating_sub(pick(b)) as f64 * 1000.0 / (sample.at - b.at) as f64
                })
            };
            let point = json!({
                "ago_ms": now_ms - sample.at,
                "done": rate(|s| s.done),
                "failed": rate(|s| s.failed),
                "ready": sample.ready,
                "delayed": sample.delayed,
                "dead": sample.dead,
            });
            before = Some(sample);
            point
        })
        .collect()
}

/// `GET /api/daemons`: the daemons alive on every queue, as `kmqd workers --json` lists them.
pub fn daemons(state: &State) -> Result<Json, ApiError> {
    let mut all = Vec::new();
    for (queue, _) in &state.queues {
        all.extend(state.client.workers(queue)?);
    }
    Ok(json!({ "daemons": all }))
}

/// `GET /api/queues/Q?limit=N`: the queue's stats, its daemons, the heads of its ready lists, the delayed tasks
/// and retries due soonest, and its newest dead-letter records.
pub fn queue(state: &State, queue: &str, limit: usize) -> Result<Json, ApiError> {
    let mode = state
        .queues
        .iter()
        .find(|(name, _)| name == queue)
        .map(|(_, mode)| *mode);
    let stats = state.client.stats(queue)?;
    let daemons = state.client.workers(queue)?;
    let waiting = state.client.peek(queue, limit)?;
    let dead = state.client.dead_list(queue, limit)?;
    let now_ms = state.client.redis_now(queue)?;
    let due = |task: &DueTask| {
        json!({
            "level": task.level,
            "due_at_ms": task.due_at_ms,
            "due_in_ms": task.due_in_ms,
            "task": task_view(&task.envelope),
        })
    };
    Ok(json!({
        "queue": queue,
        "mode": mode,
        "now_ms": now_ms,
        "stats": stats,
        "daemons": daemons,
        "ready": waiting.ready.iter().map(|head| json!({
            "level": head.level,
            "tasks": head.envelopes.iter().map(|e| task_view(e)).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "delayed": waiting.delayed.iter().map(due).collect::<Vec<_>>(),
        "retrying": waiting.retrying.iter().map(due).collect::<Vec<_>>(),
        "dead": dead.iter().map(DeadRecord::with_parsed_task).collect::<Vec<_>>(),
    }))
}

/// `GET /api/queues/Q/tasks/ID`: every place the task is in, as `kmqd task show` finds them.
pub fn task(state: &State, queue: &str, id: &str) -> Result<Json, ApiError> {
    let found = state.client.find(queue, id)?;
    Ok(json!({ "queue": queue, "id": id, "found": found }))
}

/// A task as the pages show it: the envelope's fields decoded, and the envelope itself.
fn task_view(envelope: &str) -> Json {
    match Envelope::decode(envelope) {
        Ok(task) => json!({
            "id": task.id,
            "type": task.kind,
            "attempt": task.attempt,
            "created_at": task.created_at,
            "last_error": task.last_error,
            "envelope": envelope,
        }),
        // A payload the daemons will dead-letter as malformed: shown as it is.
        Err(_) => json!({ "id": null, "envelope": envelope }),
    }
}

/// An action of the dashboard's buttons (`POST /api/queues/Q/...`).
pub enum Action {
    Pause,
    Resume,
    /// Body `{"ids": [...]}` or `{"all": true}`, and `"reset_attempts": true` for the full retry budget.
    Requeue,
    /// Body `{"ids": [...]}` or `{"all": true}`.
    Purge,
    /// A waiting (delayed, retrying or ready) task, by id.
    Cancel(String),
}

impl Action {
    pub fn name(&self) -> &'static str {
        match self {
            Action::Pause => "pause",
            Action::Resume => "resume",
            Action::Requeue => "dead requeue",
            Action::Purge => "dead purge",
            Action::Cancel(_) => "task cancel",
        }
    }

    /// The task id it names, for the log.
    pub fn target(&self) -> Option<&str> {
        match self {
            Action::Cancel(id) => Some(id),
            _ => None,
        }
    }
}

/// Does `action` on `queue`; answers what came of it.
pub fn act(state: &State, queue: &str, action: &Action, body: &Json) -> Result<Json, ApiError> {
    let client = &state.client;
    let done = match action {
        Action::Pause => client
            .pause(queue)
            .map(|paused| json!({ "paused": paused })),
        Action::Resume => client
            .resume(queue)
            .map(|resumed| json!({ "resumed": resumed })),
        Action::Requeue => {
            let ids = selected_ids(body)?;
            let refs: Vec<&str> = ids.iter().flatten().map(String::as_str).collect();
            let reset = body
                .get("reset_attempts")
                .and_then(Json::as_bool)
                .unwrap_or(false);
            client
                .dead_requeue(queue, selection(&ids, &refs), reset)
                .map(|report| serde_json::to_value(report).expect("a report serializes"))
        }
        Action::Purge => {
            let ids = selected_ids(body)?;
            let refs: Vec<&str> = ids.iter().flatten().map(String::as_str).collect();
            client
                .dead_purge(queue, selection(&ids, &refs))
                .map(|report| serde_json::to_value(report).expect("a report serializes"))
        }
        Action::Cancel(id) => match client.cancel(queue, id) {
            Ok(0) => {
                return Err(ApiError::new(
                    404,
                    format!(
                        "task {id} is not waiting in {queue} (unknown, running, done or dead): not cancelled"
                    ),
                ));
            }
            other => other.map(|removed| json!({ "cancelled": removed })),
        },
    };
    done.map_err(|error| match error {
        // As the CLI says it (cli::change_failed): a lost reply leaves it unknown whether the change was made.
        ClientError::Broker(error) if error.may_have_run() => ApiError::new(
            503,
            format!("{error}; the reply was lost, so the action may have been applied, in part or whole: the page shows what Redis holds now, and doing it again is safe"),
        ),
        other => other.into(),
    })
}

/// `{"ids": [...]}` gives `Some(ids)`, `{"all": true}` gives `None`; anything else is refused, so that a
/// mistyped body never means "all".
fn selected_ids(body: &Json) -> Result<Option<Vec<String>>, ApiError> {
    match (body.get("ids"), body.get("all")) {
        (Some(Json::Array(ids)), None) if !ids.is_empty() => ids
            .iter()
            .map(|id| {
                id.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::new(400, "ids: a list of strings"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        (None, Some(Json::Bool(true))) => Ok(None),
        _ => Err(ApiError::new(
            400,
            r#"the body names the records: {"ids": ["ID", ...]} or {"all": true}"#,
        )),
    }
}

fn selection<'a>(ids: &Option<Vec<String>>, refs: &'a [&'a str]) -> DeadSelection<'a> {
    match ids {
        Some(_) => DeadSelection::Ids(refs),
        None => DeadSelection::All,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_are_rates_between_samples_and_depths_at_each() {
        let sample = |at: i64, done: u64, failed: u64, ready: u64| Sample {
            at,
            done,
            failed,
            ready,
            delayed: 1,
            dead: 2,
        };
        let samples = [
            sample(60_000, 100, 0, 5),
            sample(120_000, 700, 30, 7),
            // The counters' keys were deleted: no growth, not a negative rate.
            sample(180_000, 10, 0, 0),
        ];
        let points = points(&samples, 200_000);
        assert_eq!(
            points,
            [
                json!({"ago_ms": 140_000, "done": null, "failed": null, "ready": 5, "delayed": 1, "dead": 2}),
                json!({"ago_ms": 80_000, "done": 10.0, "failed": 0.5, "ready": 7, "delayed": 1, "dead": 2}),
                json!({"ago_ms": 20_000, "done": 0.0, "failed": 0.0, "ready": 0, "delayed": 1, "dead": 2}),
            ]
        );
    }
}
