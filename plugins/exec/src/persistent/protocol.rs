//! The line protocol, version 1 (docs/HANDLERS.md): a child's hello, the task lines kmqd writes, the answers it
//! reads. One JSON object per line, each way.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kmq_plugin::serde_json::{self, Value};
use kmq_plugin::{Outcome, Task};

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

/// The line for one task, newline included. `deadline`: when the run must be over, if ever.
pub fn task_line(task: &Task<'_>, deadline: Option<SystemTime>) -> Vec<u8> {
    let text = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let data = task.data_json();
    // The host passes compact or pretty JSON as the producer wrote it; a line break inside it (whitespace between
    // tokens: inside strings JSON escapes them) would cut the line, so such data is written again, compact.
    let data = if data.contains(['\n', '\r']) {
        serde_json::from_str::<Value>(data)
            .map(|value| value.to_string())
            .unwrap_or_else(|_| "null".to_string())
    } else if data.is_empty() {
        "null".to_string()
    } else {
        data.to_string()
    };
    let millis = |time: SystemTime| {
        time.duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_millis()
            .to_string()
    };
    let deadline = deadline.map_or_else(|| "null".to_string(), millis);
    let created = task.created_at().map_or_else(|| "null".to_string(), millis);
    format!(
        "{{\"id\":{},\"type\":{},\"queue\":{},\"attempt\":{},\"data\":{data},\"deadline_ms\":{deadline},\"created_at_ms\":{created}}}\n",
        text(task.id()),
        text(task.kind()),
        text(task.queue()),
        task.attempt(),
    )
    .into_bytes()
}

/// What one line from a child (after its hello) says.
#[derive(Debug, PartialEq)]
pub enum Line {
    /// A well-formed answer.
    Answer { id: String, outcome: Outcome },
    /// A line that names a task but is not a valid answer: it fails that task.
    Bad { id: String, problem: String },
    /// A line that names no task: the child is restarted.
    Foreign { problem: String },
}

/// Reads one answer line.
pub fn parse_answer(line: &[u8]) -> Line {
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
        Some(other) => {
            return Line::Bad {
                id,
                problem: format!("\"message\" must be a string, not {other}"),
            };
        }
    };
    let outcome = match value.get("outcome").and_then(Value::as_str) {
        Some("done") => Outcome::done_with_output(message),
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
        Some("fail") if message.is_empty() => Outcome::fail("the handler answered fail"),
        Some("fail") => Outcome::fail(message),
        _ => {
            return Line::Bad {
                id,
                problem: format!(
                    "\"outcome\" must be \"done\", \"retry\" or \"fail\": {}",
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
}
