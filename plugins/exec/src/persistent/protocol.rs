//! The line protocol, version 1 (docs/HANDLERS.md): a child's hello, the task lines kmqd writes, the answers it
//! reads. One JSON object per line, each way.

use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kmq_plugin::serde_json::{self, Value};
use kmq_plugin::{Outcome, Task};
use serde::Deserialize;

/// The protocol version this plugin speaks, as the hello line names it.
pub const VERSION: u64 = 1;

/// The longest line kmqd reads from a child: an answer is a few hundred bytes; anything this long is a child
/// that writes something else on its standard output.
pub const MAX_LINE: u64 = 1 << 20;

/// Checks a child's first line: `{"hello": 1}` (other fields allowed).
pub fn check_hello(line: &[u8]) -> Result<(), String> {
    let value: Value = serde_json::from_slice(line).map_err(|_| {
        format!(
            "its first line is not the hello {{\"hello\": {VERSION}}} but {}",
            quote(line)
        )
    })?;
    match value.get("hello") {
        Some(Value::Number(n)) if n.as_u64() == Some(VERSION) => Ok(()),
        Some(other) => Err(format!(
            "it speaks protocol version {other}, this kmqd speaks {VERSION}: update the handler's SDK or kmqd"
        )),
        None => Err(format!(
            "its first line is not the hello {{\"hello\": {VERSION}}} but {}",
            quote(line)
        )),
    }
}

/// The line for one task, newline included. `deadline`: when the run must be over, if ever. Written into one
/// buffer: this runs once per task on the worker's thread.
pub fn task_line(task: &Task<'_>, deadline: Option<SystemTime>) -> Vec<u8> {
    let data = task.data_json();
    let mut line = Vec::with_capacity(128 + data.len());
    let text = |line: &mut Vec<u8>, s: &str| {
        serde_json::to_writer(line, s).expect("a string serializes into memory")
    };
    let millis = |line: &mut Vec<u8>, time: Option<SystemTime>| match time {
        Some(time) => {
            let millis = time.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
            let _ = write!(line, "{}", millis.as_millis());
        }
        None => line.extend_from_slice(b"null"),
    };
    line.extend_from_slice(b"{\"id\":");
    text(&mut line, task.id());
    line.extend_from_slice(b",\"type\":");
    text(&mut line, task.kind());
    line.extend_from_slice(b",\"queue\":");
    text(&mut line, task.queue());
    let _ = write!(line, ",\"attempt\":{},\"data\":", task.attempt());
    // The host passes compact or pretty JSON as the producer wrote it; a line break inside it (whitespace between
    // tokens: inside strings JSON escapes them) would cut the line, so such data is written again, compact.
    if data.contains(['\n', '\r']) {
        match serde_json::from_str::<Value>(data) {
            Ok(value) => {
                serde_json::to_writer(&mut line, &value).expect("a value serializes into memory")
            }
            Err(_) => line.extend_from_slice(b"null"),
        }
    } else if data.is_empty() {
        line.extend_from_slice(b"null");
    } else {
        line.extend_from_slice(data.as_bytes());
    }
    // A task of a flow that waited for others: their outcomes (docs/HANDLERS.md, "Flows"), compact, as `data`.
    if let Some(after) = task.dependencies() {
        line.extend_from_slice(b",\"after\":");
        match serde_json::from_str::<Value>(after) {
            Ok(value) if after.contains(['\n', '\r']) => {
                serde_json::to_writer(&mut line, &value).expect("a value serializes into memory")
            }
            Ok(_) => line.extend_from_slice(after.as_bytes()),
            Err(_) => line.extend_from_slice(b"null"),
        }
    }
    // The run's W3C trace context (docs/HANDLERS.md, "Tracing"): the run span's when kmqd traces, the
    // producer's otherwise; left out when the task has none.
    if let Some(traceparent) = task.traceparent() {
        line.extend_from_slice(b",\"traceparent\":");
        text(&mut line, traceparent);
    }
    if let Some(tracestate) = task.tracestate() {
        line.extend_from_slice(b",\"tracestate\":");
        text(&mut line, tracestate);
    }
    line.extend_from_slice(b",\"deadline_ms\":");
    millis(&mut line, deadline);
    line.extend_from_slice(b",\"created_at_ms\":");
    millis(&mut line, task.created_at());
    line.extend_from_slice(b"}\n");
    line
}

/// What one line from a child (after its hello) says.
#[derive(Debug, PartialEq)]
pub enum Line {
    /// A well-formed answer.
    Answer { id: String, outcome: Outcome },
    /// A line that names a task but is not a valid answer: it fails that task.
    Bad { id: String, problem: String },
    /// A progress report for a task (`{"id": ID, "progress": 0.4, "message": "..."}`: docs/HANDLERS.md,
    /// "Progress"); the host clamps the fraction.
    Progress {
        id: String,
        fraction: f32,
        message: String,
    },
    /// A progress line that is malformed: logged, and nothing else (the task runs on).
    BadProgress { id: String, problem: String },
    /// A line that names no task: the child is restarted.
    Foreign { problem: String },
}

/// Reads one answer line.
pub fn parse_answer(line: &[u8]) -> Line {
    match serde_json::from_slice::<Plain>(line) {
        Ok(plain) => plain.into_line(),
        Err(_) => parse_any(line),
    }
}

/// A well-formed answer, read straight into its fields: no tree of values per line, as [`parse_any`] builds.
/// Whatever it refuses (a field of the wrong type, a field twice, an outcome it does not know) goes to
/// [`parse_any`], which says what is wrong.
#[derive(Deserialize)]
struct Plain {
    id: String,
    outcome: Kind,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    retry_after_ms: Option<u64>,
    #[serde(default)]
    after_ms: Option<u64>,
    /// A done answer's result (any JSON; `null` is none), kept with a queue's `keep_results`.
    #[serde(default)]
    result: Option<Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum Kind {
    Done,
    Retry,
    Fail,
    Throttle,
}

impl Plain {
    fn into_line(self) -> Line {
        let message = self.message.unwrap_or_default();
        let outcome = match (self.outcome, self.retry_after_ms) {
            (Kind::Done, _) => match self.result {
                Some(result) => Outcome::done_with_result(result),
                None => Outcome::done_with_output(message),
            },
            (Kind::Retry, None) => Outcome::retry(message),
            (Kind::Retry, Some(ms)) => Outcome::retry_after(Duration::from_millis(ms), message),
            (Kind::Fail, _) => fail(message),
            (Kind::Throttle, _) => match self.after_ms {
                Some(ms) => Outcome::throttle_because(Duration::from_millis(ms), message),
                // Refused here, in the words `parse_any` uses (the agreement test holds both to them).
                None => {
                    return Line::Bad {
                        id: self.id,
                        problem: throttle_without_delay(&Value::Null),
                    };
                }
            },
        };
        Line::Answer {
            id: self.id,
            outcome,
        }
    }
}

/// A final failure with the handler's message, or one that says it gave none.
fn fail(message: String) -> Outcome {
    if message.is_empty() {
        Outcome::fail("the handler answered fail")
    } else {
        Outcome::fail(message)
    }
}

/// Why a throttle answer whose `after_ms` is `found` (`null`: absent) is malformed. The delay is required, not
/// defaulted: a handler that throttles knows what its upstream asked for (a `Retry-After`), and one that forgot
/// it has a bug worth a dead letter that says so, not a guess.
fn throttle_without_delay(found: &Value) -> String {
    if found.is_null() {
        "a \"throttle\" answer needs \"after_ms\", a whole number of milliseconds".to_string()
    } else {
        format!("\"after_ms\" must be a whole number of milliseconds, not {found}")
    }
}

/// Reads any line, as a tree of values: what is wrong with a line [`Plain`] refused.
fn parse_any(line: &[u8]) -> Line {
    let foreign = |problem: String| Line::Foreign { problem };
    let Ok(value) = serde_json::from_slice::<Value>(line) else {
        return foreign(format!("not a JSON object: {}", quote(line)));
    };
    let Some(id) = value.get("id").and_then(Value::as_str) else {
        return foreign(format!(
            "an object without a string \"id\": {}",
            quote(line)
        ));
    };
    let id = id.to_string();
    let message = match value.get("message") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(text)) => text.clone(),
        Some(other) if value.get("outcome").is_none() && value.get("progress").is_some() => {
            return Line::BadProgress {
                id,
                problem: format!("\"message\" must be a string, not {other}"),
            };
        }
        Some(other) => {
            return Line::Bad {
                id,
                problem: format!("\"message\" must be a string, not {other}"),
            };
        }
    };
    if value.get("outcome").is_none()
        && let Some(progress) = value.get("progress")
    {
        return match progress.as_f64() {
            Some(fraction) => Line::Progress {
                id,
                fraction: fraction as f32,
                message,
            },
            None => Line::BadProgress {
                id,
                problem: format!("\"progress\" must be a number from 0 to 1, not {progress}"),
            },
        };
    }
    let outcome = match value.get("outcome").and_then(Value::as_str) {
        Some("done") => match value.get("result") {
            None | Some(Value::Null) => Outcome::done_with_output(message),
            Some(result) => Outcome::done_with_result(result.clone()),
        },
        Some("retry") => match value.get("retry_after_ms") {
            None | Some(Value::Null) => Outcome::retry(message),
            Some(Value::Number(n)) if n.as_u64().is_some() => {
                Outcome::retry_after(Duration::from_millis(n.as_u64().expect("checked")), message)
            }
            Some(other) => {
                return Line::Bad {
                    id,
                    problem: format!(
                        "\"retry_after_ms\" must be a whole number of milliseconds, not {other}"
                    ),
                };
            }
        },
        Some("fail") => fail(message),
        Some("throttle") => match value.get("after_ms") {
            Some(Value::Number(n)) if n.as_u64().is_some() => Outcome::throttle_because(
                Duration::from_millis(n.as_u64().expect("checked")),
                message,
            ),
            other => {
                return Line::Bad {
                    id,
                    problem: throttle_without_delay(other.unwrap_or(&Value::Null)),
                };
            }
        },
        _ => {
            return Line::Bad {
                id,
                problem: format!(
                    "\"outcome\" must be \"done\", \"retry\", \"fail\" or \"throttle\": {}",
                    quote(line)
                ),
            };
        }
    };
    Line::Answer { id, outcome }
}

/// A line as a reason quotes it: at most 200 bytes of it.
fn quote(line: &[u8]) -> String {
    let text = String::from_utf8_lossy(line);
    let text = text.trim_end();
    match text.char_indices().nth(200) {
        Some((cut, _)) => format!("{:?}...", &text[..cut]),
        None => format!("{text:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kmq_plugin::abi::KmqStr;

    #[test]
    fn the_hello_names_version_1() {
        assert_eq!(check_hello(br#"{"hello": 1, "sdk": "python"}"#), Ok(()));
        let wrong = check_hello(br#"{"hello": 2}"#).unwrap_err();
        assert!(wrong.starts_with("it speaks protocol version 2"), "{wrong}");
        let other = check_hello(b"starting up...").unwrap_err();
        assert_eq!(
            other,
            r#"its first line is not the hello {"hello": 1} but "starting up...""#
        );
    }

    #[test]
    fn a_progress_line_is_a_report_and_a_malformed_one_is_only_refused() {
        assert_eq!(
            parse_answer(br#"{"id": "a", "progress": 0.4, "message": "page 40"}"#),
            Line::Progress {
                id: "a".into(),
                fraction: 0.4,
                message: "page 40".into()
            }
        );
        assert_eq!(
            parse_answer(br#"{"id": "a", "progress": 1}"#),
            Line::Progress {
                id: "a".into(),
                fraction: 1.0,
                message: String::new()
            }
        );
        for line in [
            &br#"{"id": "a", "progress": "half"}"#[..],
            br#"{"id": "a", "progress": null}"#,
            br#"{"id": "a", "progress": 0.5, "message": 7}"#,
        ] {
            assert!(
                matches!(parse_answer(line), Line::BadProgress { ref id, .. } if id == "a"),
                "{}",
                String::from_utf8_lossy(line)
            );
        }
    }

    #[test]
    fn a_done_answer_carries_its_result() {
        assert_eq!(
            parse_answer(br#"{"id": "a", "outcome": "done", "result": {"rows": 3}}"#),
            Line::Answer {
                id: "a".into(),
                outcome: Outcome::done_with_result(serde_json::json!({"rows": 3}))
            }
        );
        assert_eq!(
            parse_answer(br#"{"id": "a", "outcome": "done", "result": null}"#),
            Line::Answer {
                id: "a".into(),
                outcome: Outcome::Done
            },
            "a null result is none"
        );
    }

    #[test]
    fn answers_are_read_with_their_optional_fields() {
        assert_eq!(
            parse_answer(br#"{"id": "a", "outcome": "done"}"#),
            Line::Answer {
                id: "a".into(),
                outcome: Outcome::Done
            }
        );
        assert_eq!(
            parse_answer(
                br#"{"id": "b", "outcome": "retry", "message": "locked", "retry_after_ms": 5000, "extra": 1}"#
            ),
            Line::Answer {
                id: "b".into(),
                outcome: Outcome::retry_after(Duration::from_secs(5), "locked")
            }
        );
        assert_eq!(
            parse_answer(br#"{"id": "c", "outcome": "fail", "message": "no such customer"}"#),
            Line::Answer {
                id: "c".into(),
                outcome: Outcome::fail("no such customer")
            }
        );
        assert_eq!(
            parse_answer(
                br#"{"id": "d", "outcome": "throttle", "after_ms": 1500, "message": "429"}"#
            ),
            Line::Answer {
                id: "d".into(),
                outcome: Outcome::throttle_because(Duration::from_millis(1500), "429")
            }
        );
        // 0 is a whole number: the daemon makes it its shortest throttle (1 ms).
        assert_eq!(
            parse_answer(br#"{"id": "e", "outcome": "throttle", "after_ms": 0}"#),
            Line::Answer {
                id: "e".into(),
                outcome: Outcome::throttle(Duration::ZERO)
            }
        );
    }

    #[test]
    fn a_throttle_answer_without_a_whole_after_ms_is_malformed() {
        let problem = |line: &[u8]| match parse_answer(line) {
            Line::Bad { id, problem } if id == "t" => problem,
            other => panic!("{}: {other:?}", String::from_utf8_lossy(line)),
        };
        let needs = r#"a "throttle" answer needs "after_ms", a whole number of milliseconds"#;
        assert_eq!(problem(br#"{"id": "t", "outcome": "throttle"}"#), needs);
        assert_eq!(
            problem(br#"{"id": "t", "outcome": "throttle", "after_ms": null}"#),
            needs
        );
        // A retry's field is not a throttle's: no guess at what the handler meant.
        assert_eq!(
            problem(br#"{"id": "t", "outcome": "throttle", "retry_after_ms": 1000}"#),
            needs
        );
        for (after, shown) in [("-1", "-1"), ("1.5", "1.5"), (r#""1000""#, r#""1000""#)] {
            let line = format!(r#"{{"id": "t", "outcome": "throttle", "after_ms": {after}}}"#);
            assert_eq!(
                problem(line.as_bytes()),
                format!(r#""after_ms" must be a whole number of milliseconds, not {shown}"#)
            );
        }
    }

    #[test]
    fn a_bad_answer_names_its_task_or_no_task() {
        assert!(matches!(
            parse_answer(br#"{"id": "a", "outcome": "finished"}"#),
            Line::Bad { id, .. } if id == "a"
        ));
        assert!(matches!(
            parse_answer(br#"{"id": "a", "outcome": "retry", "retry_after_ms": -1}"#),
            Line::Bad { id, .. } if id == "a"
        ));
        assert!(matches!(
            parse_answer(b"print debugging"),
            Line::Foreign { .. }
        ));
        assert!(matches!(
            parse_answer(br#"{"outcome": "done"}"#),
            Line::Foreign { .. }
        ));
    }

    #[test]
    fn the_reading_of_plain_answers_agrees_with_the_general_one() {
        let lines: [&[u8]; 17] = [
            br#"{"id": "a", "outcome": "done"}"#,
            br#"{"id": "a", "outcome": "done", "result": {"rows": 3, "files": ["a.csv"]}}"#,
            br#"{"id": "a", "outcome": "done", "result": null, "message": "ok"}"#,
            br#"{"id": "a", "outcome": "done", "result": "text"}"#,
            br#"{"id": "a", "outcome": "done", "message": "report.pdf", "extra": [1, {"x": 2}]}"#,
            br#"{"outcome": "retry", "id": "b\u00e9", "message": null, "retry_after_ms": 5000}"#,
            br#"{"id": "b", "outcome": "retry", "retry_after_ms": null}"#,
            br#"{"id": "c", "outcome": "fail"}"#,
            br#"{"id": "c", "outcome": "fail", "message": "no such customer"}"#,
            // What the plain reading refuses, the general one reads (or names) the same as before.
            br#"{"id": "d", "outcome": "done", "retry_after_ms": "soon"}"#,
            br#"{"id": "d", "id": "e", "outcome": "done"}"#,
            br#"{"id": "f", "outcome": "retry", "retry_after_ms": -1}"#,
            br#"{"id": "g", "outcome": "throttle", "after_ms": 1500, "message": "429"}"#,
            br#"{"id": "g", "outcome": "throttle", "after_ms": 0, "message": null}"#,
            br#"{"id": "h", "outcome": "throttle"}"#,
            br#"{"id": "h", "outcome": "throttle", "after_ms": null}"#,
            br#"{"id": "h", "outcome": "throttle", "after_ms": 2.5}"#,
        ];
        for line in lines {
            assert_eq!(
                parse_answer(line),
                parse_any(line),
                "{}",
                String::from_utf8_lossy(line)
            );
        }
        assert!(serde_json::from_slice::<Plain>(lines[0]).is_ok());
        assert!(serde_json::from_slice::<Plain>(lines[11]).is_err());
    }

    #[test]
    #[expect(
        unsafe_code,
        reason = "a task as the host passes it: built from its ABI struct"
    )]
    fn a_task_line_is_one_json_object_with_its_data_compacted() {
        let (id, queue, kind) = ("t-\"1\"", "mail", "mail.send");
        let data = "{\n  \"to\": \"ada@example.com\",\n  \"n\": [1, 2]\n}";
        let raw = kmq_plugin::abi::KmqTask {
            id: KmqStr::borrow(id),
            queue: KmqStr::borrow(queue),
            type_: KmqStr::borrow(kind),
            data: KmqStr::borrow(data),
            attempt: 2,
            created_at_ms: 1_796_000_000_000,
            deadline_ms: 0,
            cancel: std::ptr::null(),
            retry_after_ms: std::ptr::null_mut(),
            run: std::ptr::null_mut(),
        };
        // SAFETY: every pointer in `raw` outlives the task.
        let task = unsafe { Task::from_raw(&raw) };
        let deadline = UNIX_EPOCH + Duration::from_millis(1_796_000_030_000);
        let line = task_line(&task, Some(deadline));
        assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
        assert_eq!(line.last(), Some(&b'\n'));
        let value: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(
            value,
            serde_json::json!({
                "id": id, "type": kind, "queue": queue, "attempt": 2,
                "data": {"to": "ada@example.com", "n": [1, 2]},
                "deadline_ms": 1_796_000_030_000u64, "created_at_ms": 1_796_000_000_000u64,
            })
        );
        let line = task_line(&task, None);
        let value: Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(value["deadline_ms"], Value::Null);
    }
}
