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
