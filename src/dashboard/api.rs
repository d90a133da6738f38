//! What each `/api/...` route answers (docs/DASHBOARD.md lists them with their JSON). Reads go through
//! [`Client`](crate::client::Client) and the overview's last poll; actions call the same `Client` methods as
//! the CLI's commands, so a requeue from a button is a `kmqd dead requeue`.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value as Json, json};

use super::server::State;
use crate::broker::dead::DeadRecord;
use crate::broker::groups::Group;
use crate::broker::history::Sample;
use crate::broker::peek::DueTask;
use crate::client::{ClientError, DeadSelection};
use crate::poison::lock;
use crate::task::Envelope;

/// Tasks per list on a queue's page unless `?limit=` says otherwise, and the most it may say.
pub const DEFAULT_LIMIT: usize = 20;
pub const MAX_LIMIT: usize = 500;

/// The most of an envelope, a dead record's task, an error or a reason that a queue's page is sent, per task
/// (review M7): a list of 500 tasks of 16 MiB would be 8 GiB an answer, every second. Cut on a character
/// boundary; the answer says how long the whole was (`envelope_bytes`, `record_bytes`), and the task's own page
/// shows it whole.
pub const LIST_TEXT_BYTES: usize = 4096;

/// What one lookup of a task's page may read of its queue's lists (review M7): a queue of a million tasks is not
/// read whole for it. The task may be further on (the answer's `complete` is then false); `kmqd task show`
/// searches everything.
pub const LOOKUP_BUDGET: crate::broker::lookup::Budget = crate::broker::lookup::Budget {
    tasks: 10_000,
    bytes: 64 << 20,
};

/// How old a grouped queue's read of its busiest groups may be before its page reads them again, and how many it
/// reads: [`crate::broker::groups::groups`] scans every group of the queue in pages (each level's ring, its flows'
/// lengths, the running counts: round trips that grow with the groups, a few hundred for 100,000 of them), so a
/// page asking every second reads them at most once per [`GROUPS_EVERY`] and queue, however many pages are open,
/// one queue's read at a time; `kmqd groups QUEUE --limit N` lists more than [`GROUPS_LIMIT`].
pub const GROUPS_EVERY: Duration = Duration::from_secs(5);
pub const GROUPS_LIMIT: usize = 20;

/// A grouped queue's busiest groups, as read at `at` ([`State::groups`](super::server::State::groups)).
pub struct GroupsRead {
    at: Instant,
    /// The same moment by the wall clock, which the page shows.
    read_at: SystemTime,
    groups: Vec<Group>,
}

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
    let overview = lock(&state.overview);
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
    let rows = lock(&state.overview).rows.clone();
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

/// `GET /api/queues/Q?limit=N`: the queue's stats, its limits against what Redis counts (as `kmqd stats`
/// shows them; null for a queue with none), a grouped queue's busiest groups (null for a queue without
/// `[queues.groups]`), its daemons, the heads of its ready lists, the delayed tasks and retries due soonest, and its
/// newest dead-letter records.
pub fn queue(state: &State, queue: &str, limit: usize) -> Result<Json, ApiError> {
    let mode = state
        .queues
        .iter()
        .find(|(name, _)| name == queue)
        .map(|(_, mode)| *mode);
    let stats = state.client.stats(queue)?;
    let config = state.configs.iter().find(|config| config.name == queue);
    // Read beside the stats, as `kmqd stats` reads them: bounded by the queue's config, not by its tasks.
    let limits = match config {
        Some(config) => crate::overview::read_limits(&state.client, config, &stats)?,
        None => None,
    };
    // Bounded by GROUPS_EVERY and GROUPS_LIMIT instead: their read grows with the groups.
    let groups = match config {
        Some(config) => busiest_groups(state, config)?,
        None => None,
    };
    let daemons = state.client.workers(queue)?;
    let waiting = state.client.peek(queue, limit)?;
    let dead = state.client.dead_head(queue, limit)?;
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
        "limits": limits,
        "groups": groups,
        "daemons": daemons,
        "ready": waiting.ready.iter().map(|head| json!({
            "level": head.level,
            "tasks": head.envelopes.iter().map(|e| task_view(e)).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "delayed": waiting.delayed.iter().map(due).collect::<Vec<_>>(),
        "retrying": waiting.retrying.iter().map(due).collect::<Vec<_>>(),
        "dead": dead.iter().map(dead_view).collect::<Vec<_>>(),
    }))
}

/// A grouped queue's busiest groups as `kmqd groups` lists them, at most [`GROUPS_LIMIT`], from a read at most
/// [`GROUPS_EVERY`] old (`age_ms` says how old), with the group's `max_running` (null without one); `None` for a
/// queue without `[queues.groups]`.
fn busiest_groups(
    state: &State,
    config: &crate::config::QueueConfig,
) -> Result<Option<Json>, ApiError> {
    let Some(groups) = &config.groups else {
        return Ok(None);
    };
    // Held through the read: pages asking meanwhile wait for it rather than read again.
    let mut reads = lock(&state.groups);
    let stale = reads
        .get(&config.name)
        .is_none_or(|read| read.at.elapsed() >= GROUPS_EVERY);
    if stale {
        let list = state.client.groups(&config.name, GROUPS_LIMIT)?;
        let read = GroupsRead {
            at: Instant::now(),
            read_at: SystemTime::now(),
            groups: list,
        };
        reads.insert(config.name.clone(), read);
    }
    // Cannot be missing: found or inserted above, under the lock.
    let read = &reads[&config.name];
    Ok(Some(json!({
        "max_running": groups.max_running,
        "limit": GROUPS_LIMIT,
        "every_ms": GROUPS_EVERY.as_millis() as u64,
        "read_at_ms": read.read_at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
        "age_ms": read.at.elapsed().as_millis() as u64,
        "list": read.groups,
    })))
}

/// `GET /api/queues/Q/tasks/ID`: every place the task is in, as `kmqd task show` finds them, within
/// [`LOOKUP_BUDGET`]; `complete` says whether every list was searched to its end, `searched` how many tasks were
/// looked at. One lookup at a time per dashboard: more pages asking wait their turn, so Redis serves one scan
/// at a time whoever asks (the page itself asks once, and again on its button).
pub fn task(state: &State, queue: &str, id: &str, page: FlowPage) -> Result<Json, ApiError> {
    let _turn = lock(&state.lookups);
    let located = state.client.find_within(queue, id, LOOKUP_BUDGET)?;
    let found: Vec<_> = located.found.into_iter().map(|(_, found)| found).collect();
    let mut answer = json!({
        "queue": queue,
        "id": id,
        "found": found,
        "complete": located.complete,
        "searched": located.searched,
    });
    // Its kept result and its flow ("Results and flows" below).
    answer["result"] = result_of(state, queue, id)?;
    answer["flow"] = flow_of(state, queue, id, page)?;
    Ok(answer)
}

// --- Results and flows: a task's kept result and its flow's graph (the task page's sections) ---------------

/// Which of a flow's root's dependencies a task's page shows: from `offset`, at most `limit` ([`FLOW_LIMIT`]
/// unless `?limit=` says otherwise, at most [`MAX_FLOW_LIMIT`]).
#[derive(Clone, Copy, Debug)]
pub struct FlowPage {
    pub offset: usize,
    pub limit: usize,
}

pub const FLOW_LIMIT: usize = 20;
pub const MAX_FLOW_LIMIT: usize = 100;

/// What one answer shows of a flow's graph below its root's page: [`FLOW_PER_NODE`] dependencies of each node,
/// [`FLOW_DEPTH`] levels below the root, [`FLOW_NODES`] nodes in all (each costs Redis a few reads; a node's
/// dependencies are read whole, its waiting task's hash and ended hash, so a fan-in of 100,000 is read once per
/// answer, never drawn: its page shows counts and 20 of them). The rest is counted (`more`), and each node's own
/// page shows more of it.
pub const FLOW_PER_NODE: usize = 5;
pub const FLOW_DEPTH: usize = 3;
pub const FLOW_NODES: usize = 200;

/// The task's kept result as `kmqd task result --json` prints it, or null.
fn result_of(state: &State, queue: &str, id: &str) -> Result<Json, ApiError> {
    Ok(state
        .client
        .kept_result(queue, id)?
        .map_or(Json::Null, |ended| crate::task_view::ended_json(&ended)))
}

/// The graph under the task within the bounds above (`task_view::Node`), or null when it waits for nothing.
fn flow_of(state: &State, queue: &str, id: &str, page: FlowPage) -> Result<Json, ApiError> {
    let bounds = crate::task_view::Bounds {
        offset: page.offset,
        limit: page.limit.min(MAX_FLOW_LIMIT),
        per_node: FLOW_PER_NODE,
        depth: FLOW_DEPTH,
        nodes: FLOW_NODES,
        running: LOOKUP_BUDGET,
    };
    let graph = crate::task_view::graph(&state.client, queue, id, bounds)?;
    Ok(serde_json::to_value(graph).expect("a flow's graph serializes"))
}

/// `GET /api/queues/Q/tasks/ID/flow?offset=0&limit=20`: the task's kept result and its flow's graph, without
/// the lookup of where the task waits (what a script polling a flow needs). One at a time per dashboard, as
/// lookups are.
pub fn flow(state: &State, queue: &str, id: &str, page: FlowPage) -> Result<Json, ApiError> {
    let _turn = lock(&state.lookups);
    Ok(json!({
        "queue": queue,
        "id": id,
        "result": result_of(state, queue, id)?,
        "flow": flow_of(state, queue, id, page)?,
    }))
}

/// `text` cut to [`LIST_TEXT_BYTES`] on a character boundary, and whether it was.
fn cut(text: &str) -> (&str, bool) {
    if text.len() <= LIST_TEXT_BYTES {
        return (text, false);
    }
    let mut end = LIST_TEXT_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    (&text[..end], true)
}

/// A task as a queue's page lists it: the envelope's fields decoded, and the envelope itself, both cut to
/// [`LIST_TEXT_BYTES`] (`envelope_bytes`: the whole envelope's length).
fn task_view(envelope: &str) -> Json {
    let (shown, truncated) = cut(envelope);
    match Envelope::decode(envelope) {
        Ok(task) => json!({
            "id": task.id.as_deref().map(|id| cut(id).0),
            "type": cut(&task.kind).0,
            "attempt": task.attempt,
            "created_at": task.created_at,
            "last_error": task.last_error.as_deref().map(|error| cut(error).0),
            "envelope": shown,
            "envelope_bytes": envelope.len(),
            "envelope_truncated": truncated,
        }),
        // A payload the daemons will dead-letter as malformed: shown as it is.
        Err(_) => json!({
            "id": null,
            "envelope": shown,
            "envelope_bytes": envelope.len(),
            "envelope_truncated": truncated,
        }),
    }
}

/// A dead record as a queue's page lists it: its fields, its strings cut to [`LIST_TEXT_BYTES`] (the task's,
/// its reason), without the task parsed (`kmqd dead list --json` has it); `record_bytes` is the whole record's
/// length, `truncated` whether anything was cut.
fn dead_view(record: &DeadRecord) -> Json {
    let mut truncated = false;
    let fields = record
        .fields
        .iter()
        .map(|(name, value)| {
            let value = match value {
                Json::String(text) => {
                    let (shown, was) = cut(text);
                    truncated |= was;
                    Json::String(shown.to_string())
                }
                other => other.clone(),
            };
            (name.clone(), value)
        })
        .collect::<serde_json::Map<_, _>>();
    let mut view = Json::Object(fields);
    view["record_bytes"] = json!(record.raw.len());
    view["truncated"] = json!(truncated);
    view
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
    /// A group of a grouped queue, by name ("" for the tasks without one), as `kmqd group pause|resume` does.
    PauseGroup(String),
    ResumeGroup(String),
}

impl Action {
    pub fn name(&self) -> &'static str {
        match self {
            Action::Pause => "pause",
            Action::Resume => "resume",
            Action::Requeue => "dead requeue",
            Action::Purge => "dead purge",
            Action::Cancel(_) => "task cancel",
            Action::PauseGroup(_) => "group pause",
            Action::ResumeGroup(_) => "group resume",
        }
    }

    /// The task id or group it names, for the log.
    pub fn target(&self) -> Option<&str> {
        match self {
            Action::Cancel(id) | Action::PauseGroup(id) | Action::ResumeGroup(id) => Some(id),
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
        Action::PauseGroup(group) | Action::ResumeGroup(group) => {
            grouped(state, queue, group)?;
            let done = if matches!(action, Action::PauseGroup(_)) {
                client
                    .pause_group(queue, group)
                    .map(|paused| json!({ "group": group, "paused": paused }))
            } else {
                client
                    .resume_group(queue, group)
                    .map(|resumed| json!({ "group": group, "resumed": resumed }))
            };
            // Whatever came of it, the page's next answer reads the groups again and shows what Redis holds.
            lock(&state.groups).remove(queue);
            done
        }
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

/// Refuses a group's action on a queue without `[queues.groups]` (its tasks take no turns by group: a pause would
/// hold back nothing) and a name no task can have (longer than [`crate::config::MAX_GROUP_BYTES`]), in the words of
/// `kmqd group`; an unknown queue is the client's 404.
fn grouped(state: &State, queue: &str, group: &str) -> Result<(), ApiError> {
    let config = state.configs.iter().find(|config| config.name == queue);
    if config.is_some_and(|config| config.groups.is_none()) {
        return Err(ApiError::new(
            400,
            format!("queue {queue:?} has no [queues.groups]: its tasks do not take turns by group"),
        ));
    }
    if group.len() > crate::config::MAX_GROUP_BYTES {
        return Err(ApiError::new(
            400,
            format!(
                "{group:?} is not a group name: group names are 1 to {} bytes",
                crate::config::MAX_GROUP_BYTES
            ),
        ));
    }
    Ok(())
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
