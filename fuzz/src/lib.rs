//! What the config targets check, shared by `config` (arbitrary text) and `config_values` (valid configs with
//! their values mutated).

use std::path::Path;
use std::time::Duration;

use kmqd::Config;
use kmqd::config::MAX_TAKE;

/// The file name every config error must start with.
pub const FILE: &str = "fuzz.toml";

/// Times the schedules are asked for their next slot: the epoch, a present-day time, and the far future.
const TIMES_MS: [i64; 4] = [0, 1_795_997_223_121, 253_402_300_799_000, i64::MAX / 4];

/// Parses `text` as `fuzz.toml` and checks what kmqd promises of the result:
/// - an error's Display starts with the file name, and a line and column, when given, are in the text;
/// - a config that validates has the values its documentation allows, JSON where kmqd hands JSON on (the
///   scheduler `expect`s a schedule's data to be JSON), and schedules whose next slot is strictly later.
pub fn check_config(text: &str) {
    match Config::parse(Path::new(FILE), text) {
        Err(error) => check_error(text, &error.to_string()),
        Ok(config) => check_valid(&config),
    }
}

fn check_error(text: &str, message: &str) {
    let Some(rest) = message.strip_prefix(FILE) else {
        panic!("the error does not start with {FILE:?}: {message}");
    };
    let Some(rest) = rest.strip_prefix(':') else {
        panic!("the error does not go on with ':' after the file name: {message}");
    };
    // "fuzz.toml:LINE:COLUMN: message", or "fuzz.toml: message" for errors about the whole file.
    let mut parts = rest.splitn(3, ':');
    let (Some(line), Some(column)) = (parts.next(), parts.next()) else {
        return;
    };
    let (Ok(line), Ok(column)) = (line.parse::<usize>(), column.parse::<usize>()) else {
        return;
    };
    let lines: Vec<&str> = text.split('\n').collect();
    assert!(
        (1..=lines.len()).contains(&line),
        "line {line} of a text of {} lines: {message}",
        lines.len()
    );
    let width = lines[line - 1].chars().count();
    assert!(
        (1..=width + 1).contains(&column),
        "column {column} of a line {width} characters long: {message}"
    );
}

fn check_valid(config: &Config) {
    assert!(config.redis.pool_size >= config.connections_needed());
    for queue in &config.queues {
        let name = &queue.name;
        assert!(!queue.priorities.is_empty(), "{name}: no priorities");
        assert!(
            queue.default_priority < queue.priorities.len(),
            "{name}: default_priority"
        );
        assert!(
            (1..=1024).contains(&queue.workers),
            "{name}: workers {}",
            queue.workers
        );
        assert!(
            (1..=MAX_TAKE).contains(&queue.batch),
            "{name}: batch {}",
            queue.batch
        );
        assert!(
            (1..=MAX_TAKE).contains(&queue.delay_batch),
            "{name}: delay_batch"
        );
        assert!(
            queue.lease_timeout >= Duration::from_millis(300),
            "{name}: lease_timeout"
        );
        assert!(
            queue.backoff_max >= queue.backoff,
            "{name}: backoff_max < backoff"
        );
        assert!(
            (Duration::from_millis(10)..=Duration::from_secs(5)).contains(&queue.idle_poll),
            "{name}: idle_poll {:?}",
            queue.idle_poll
        );
        assert!(
            queue.execution_timeout.is_none_or(|d| !d.is_zero()),
            "{name}: execution_timeout 0"
        );
        assert!(
            queue.alive_timeout.is_none_or(|d| !d.is_zero()),
            "{name}: alive_timeout 0"
        );
        assert!(queue.dead_max >= 1, "{name}: dead_max");
    }
    for plugin in &config.plugins {
        assert!(
            is_json(&plugin.config_json),
            "plugins.{}: config_json {}",
            plugin.name,
            plugin.config_json
        );
    }
    for schedule in &config.schedules {
        let name = &schedule.name;
        let queue = config
            .queue(&schedule.queue)
            .unwrap_or_else(|| panic!("schedule {name}: no queue {}", schedule.queue));
        assert!(
            schedule.level < queue.priorities.len(),
            "schedule {name}: level"
        );
        assert!(
            is_json(&schedule.data_json),
            "schedule {name}: data {}",
            schedule.data_json
        );
        for t in TIMES_MS {
            if let Some(next) = schedule.when.next_after(t) {
                assert!(
                    next > t,
                    "schedule {name} ({:?}): next slot after {t} is {next}",
                    schedule.when
                );
            }
        }
    }
}

fn is_json(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text).is_ok()
}

/// Valid configs to mutate: the shipped examples and one with every key the shipped ones leave out.
pub const BASES: [&str; 3] = [
    include_str!("../../config/queues.toml"),
    include_str!("../../config/demo.toml"),
    include_str!("every-key.toml"),
];

/// Values worth putting anywhere: the edges of every range, of every integer type and of durations, the names
/// the config knows, and the shapes TOML has.
pub const INTERESTING: &[&str] = &[
    "0",
    "1",
    "-1",
    "2",
    "3",
    "7",
    "1000",
    "1001",
    "1024",
    "1025",
    "100000",
    "100001",
    "100000000",
    "100000001",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "-9223372036854775808",
    "1e3",
    "nan",
    "inf",
    "-0.0",
    "true",
    "false",
    "[]",
    "{}",
    "[1, \"a\"]",
    "[\"high\", \"high\"]",
    "[\"\"]",
    "{ a = { b = [1.5, nan] } }",
    "1979-05-27T07:32:00Z",
    "1979-05-27",
    "07:32:00",
    "\"\"",
    "\"0s\"",
    "\"1ns\"",
    "\"1ms\"",
    "\"9ms\"",
    "\"10ms\"",
    "\"299ms\"",
    "\"300ms\"",
    "\"999ms\"",
    "\"1s\"",
    "\"1500ms\"",
    "\"5s\"",
    "\"5001ms\"",
    "\"1h\"",
    "\"30 parsecs\"",
    "\"-1s\"",
    "\"1.5s\"",
    "\"18446744073709551615s\"",
    "\"18446744073709551616s\"",
    "\"9223372036854775s\"",
    "\"9223372036854776s\"",
    "\"2305843009213693952s\"",
    "\"584942417355y\"",
    "\"safe\"",
    "\"default\"",
    "\"retry\"",
    "\"finish\"",
    "\"dead\"",
    "\"skip\"",
    "\"catch_up\"",
    "\"type\"",
    "\"callback\"",
    "\"normal\"",
    "\"high\"",
    "\"low\"",
    "\"mail\"",
    "\"a.b-c_d\"",
    "\"ma il\"",
    "\"é\"",
    "\"\\u0000\"",
    "\"redis://\"",
    "\"redis://u:p@h:1/0\"",
    "\"rediss://h\"",
    "\"unix:///x\"",
    "\"redis+unix:///x\"",
    "\"http://x\"",
    "\"127.0.0.1:9464\"",
    "\"[::1]:0\"",
    "\"localhost\"",
    "\"* * * * *\"",
    "\"0 3 * * *\"",
    "\"@yearly\"",
    "\"@hourly\"",
    "\"0 0 30 2 *\"",
    "\"59 23 31 12 7\"",
    "\"*/0 * * * *\"",
    "\"5-1 * * * *\"",
    "\"0-59/61 * * * sun-sat\"",
    "\"* * * jan,DEC mon-fri\"",
    "\"* * * *\"",
    "\"KMQD_FUZZ_SURELY_UNSET\"",
    "\"PATH\"",
    "\"libkmq_x.so\"",
    "\"/\"",
];
