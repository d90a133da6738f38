//! `echo`: prints each task it receives to standard error and succeeds. The README's first plugin.
//!
//! Config: `prefix` (optional) is printed before every line.

use std::io::Write;

use kmq_plugin::{Handler, Outcome, Task};
use serde::Deserialize;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default)]
    prefix: String,
    /// The task types to claim; defaults to `["echo"]`.
    #[serde(default)]
    types: Vec<String>,
}

struct Echo {
    prefix: String,
    types: Vec<String>,
}

impl Handler for Echo {
    const NAME: &'static str = "echo";
    type Config = Config;

    fn init(config: Config) -> Result<Echo, String> {
        let types = if config.types.is_empty() {
            vec!["echo".to_string()]
        } else {
            config.types
        };
        Ok(Echo {
            prefix: config.prefix,
            types,
        })
    }

    fn types(&self) -> Vec<String> {
        self.types.clone()
    }

    fn handle(&self, task: &Task<'_>) -> Outcome {
        // The id and the type are the producer's: their control characters are escaped, so that a task cannot
        // forge a line of the journal or send escapes to a terminal (the review's L3). The data is JSON, escaped.
        let (id, kind) = (escaped(task.id()), escaped(task.kind()));
        // One write per line, so lines from concurrent workers do not interleave.
        let line = format!(
            "{}echo: queue={} id={} type={} attempt={} data={}\n",
            self.prefix,
            task.queue(),
            id,
            kind,
            task.attempt(),
            task.data_json()
        );
        // Standard error is the journal under systemd; a failed write there is not the task's failure.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
        Outcome::Done
    }

    fn on_dead(&self, task: &Task<'_>, reason: &str) {
        let line = format!(
            "{}echo: dead id={} reason={}\n",
            self.prefix,
            escaped(task.id()),
            escaped(reason)
        );
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

/// `text` with its control characters escaped (`\n`, `\u{1b}`), as the daemon writes its own log fields.
fn escaped(text: &str) -> std::borrow::Cow<'_, str> {
    if text.chars().any(char::is_control) {
        std::borrow::Cow::Owned(text.escape_debug().to_string())
    } else {
        std::borrow::Cow::Borrowed(text)
    }
}

kmq_plugin::export!(Echo);

#[cfg(test)]
mod tests {
    use kmq_plugin::testing::{Harness, Status, TestTask};

    #[test]
    fn control_characters_of_an_id_or_a_reason_are_escaped() {
        assert_eq!(crate::escaped("job-1"), "job-1");
        assert_eq!(crate::escaped("x\n<a forged line>"), "x\\n<a forged line>");
        assert_eq!(crate::escaped("\u{1b}[2J"), "\\u{1b}[2J");
    }

    #[test]
    fn claims_echo_unless_the_config_names_types() {
        let plain = Harness::new(crate::kmq_plugin_v1, "{}").unwrap();
        assert_eq!(
            (plain.name(), plain.types()),
            ("echo", &["echo".to_string()][..])
        );
        let mail = Harness::new(
            crate::kmq_plugin_v1,
            r#"{"prefix": "[mail] ", "types": ["mail.send"]}"#,
        )
        .unwrap();
        assert_eq!(mail.types(), ["mail.send"]);
    }

    #[test]
    fn every_task_is_done_whatever_its_data() {
        let harness = Harness::new(crate::kmq_plugin_v1, "{}").unwrap();
        for data in ["null", "{}", r#"{"to":"ada@example.com"}"#, "[1,2]"] {
            let result = harness.run(TestTask::new("echo", data));
            assert_eq!(
                (result.status, result.message.as_str()),
                (Status::Done, ""),
                "data {data}"
            );
        }
        harness.on_dead(TestTask::new("echo", "{}"), "a reason");
        harness.shutdown();
    }

    #[test]
    fn an_unknown_config_key_is_refused() {
        let error = Harness::new(crate::kmq_plugin_v1, r#"{"prefx": ">"}"#)
            .err()
            .unwrap();
        assert!(error.contains("unknown field `prefx`"), "{error}");
    }
}
