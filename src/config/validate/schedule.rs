//! A `[[schedules]]` table: when a periodic task is pushed (cron or every), to which queue and level, and what a
//! missed slot does. Its own module because it is checked against the queues, after them.

use std::ops::Range;
use std::time::Duration;

use toml::Spanned;

use super::{check_name, duration_or, one_of, parse_duration, ranged, toml_to_json};
use crate::config::errors::Source;
use crate::config::raw::RawSchedule;
use crate::config::*;

impl RawSchedule {
    pub(super) fn validate(
        self,
        source: &Source<'_>,
        index: usize,
        span: Range<usize>,
        queues: &[QueueConfig],
    ) -> Result<ScheduleConfig, ConfigError> {
        let RawSchedule {
            name,
            queue,
            kind,
            data,
            cron,
            every,
            priority,
            missed,
            misfire_grace,
            catch_up_max,
        } = self;
        let key = |field: &str| format!("schedules[{index}].{field}");
        let required = |value: Option<Spanned<String>>, field: &str, example: &str| {
            value.ok_or_else(|| {
                source.error(
                    span.clone(),
                    format!("{}: missing; e.g. {field} = {example}", key(field)),
                )
            })
        };
        let name = required(name, "name", "\"nightly-report\"")?;
        check_name(source, &key("name"), &name, "schedule name")?;
        let queue_name = required(queue, "queue", "\"reports\"")?;
        let queue = queues
            .iter()
            .find(|q| q.name == *queue_name.get_ref())
            .ok_or_else(|| {
                let known: Vec<&str> = queues.iter().map(|q| q.name.as_str()).collect();
                source.error(
                    queue_name.span(),
                    format!(
                        "{}: no queue {:?}; configured queues: {}",
                        key("queue"),
                        queue_name.get_ref(),
                        known.join(", ")
                    ),
                )
            })?;
        let kind = required(kind, "type", "\"report.build\"")?;
        if kind.get_ref().is_empty() {
            return Err(source.error(kind.span(), format!("{}: must not be empty", key("type"))));
        }
        let when = match (cron, every) {
            (Some(cron), None) => When::Cron(cron.get_ref().parse().map_err(|error: String| {
                source.error(cron.span(), format!("{}: {error}", key("cron")))
            })?),
            (None, Some(every)) => {
                let period = parse_duration(source, &key("every"), &every)?;
                if period < Duration::from_secs(1) || period.subsec_nanos() != 0 {
                    return Err(source.error(
                        every.span(),
                        format!("{}: use whole seconds, at least \"1s\"", key("every")),
                    ));
                }
                When::Every(period)
            }
            _ => {
                return Err(source.error(
                    span,
                    format!(
                        "{}: give exactly one of cron = \"0 3 * * *\" (UTC) or every = \"5m\"",
                        key("cron")
                    ),
                ));
            }
        };
        let level = match &priority {
            Some(level) => queue
                .priorities
                .iter()
                .position(|p| p == level.get_ref())
                .ok_or_else(|| {
                    source.error(
                        level.span(),
                        format!(
                            "{}: {:?} is not one of {:?} of queue {}",
                            key("priority"),
                            level.get_ref(),
                            queue.priorities,
                            queue.name
                        ),
                    )
                })?,
            None => queue.default_priority,
        };
        let missed = match &missed {
            Some(value) => one_of(
                source,
                &key("missed"),
                value,
                &[("skip", Missed::Skip), ("catch_up", Missed::CatchUp)],
            )?,
            None => Missed::Skip,
        };
        let misfire_grace = duration_or(
            source,
            &key("misfire_grace"),
            &misfire_grace,
            Duration::from_secs(60),
        )?;
        let catch_up_max = match &catch_up_max {
            Some(n) => {
                ranged(source, &key("catch_up_max"), n, 1..MAX_CATCH_UP as i64 + 1)? as usize
            }
            None => 100,
        };
        let data_json = match &data {
            Some(value) => {
                serde_json::to_string(&toml_to_json(value)).expect("a JSON value always serializes")
            }
            None => "null".to_string(),
        };
        Ok(ScheduleConfig {
            name: name.into_inner(),
            queue: queue.name.clone(),
            kind: kind.into_inner(),
            data_json,
            when,
            level,
            missed,
            misfire_grace,
            catch_up_max,
        })
    }
}
