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
        // One write per line, so lines from concurrent workers do not interleave.
        let line = format!(
            "{}echo: queue={} id={} type={} attempt={} data={}\n",
            self.prefix,
            task.queue(),
            task.id(),
            task.kind(),
            task.attempt(),
            task.data_json()
        );
        // Standard error is the journal under systemd; a failed write there is not the task's failure.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
        Outcome::Done
    }

    fn on_dead(&self, task: &Task<'_>, reason: &str) {
        let line = format!(
            "{}echo: dead id={} reason={reason}\n",
            self.prefix,
            task.id()
        );
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

kmq_plugin::export!(Echo);

#[cfg(test)]
mod tests {
    use kmq_plugin::testing::{Harness, Status, TestTask};

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
