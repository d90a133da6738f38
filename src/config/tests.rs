//! Parsing and validating configs: defaults, paths, and every error's location and words.

use super::*;

fn parse(text: &str) -> Result<Config, String> {
    Config::parse(Path::new("/etc/kmqd/queues.toml"), text).map_err(|e| e.to_string())
}

const MINIMAL: &str = "[[queues]]\nname = \"mail\"\nmode = \"safe\"\n";

#[test]
fn minimal_config_gets_documented_defaults() {
    let config = parse(MINIMAL).unwrap();
    let queue = &config.queues[0];
    assert_eq!(queue.priorities, ["normal"]);
    assert_eq!(queue.workers, defaults::WORKERS);
    assert_eq!(queue.worker_nice, 0, "workers at the daemon's priority");
    assert_eq!(queue.prefetch, Prefetch::Auto);
    assert_eq!(queue.batch, MAX_TAKE);
    assert_eq!(
        queue.max_held,
        queue.workers + defaults::HELD_BEYOND_WORKERS
    );
    assert_eq!(queue.lease_timeout, defaults::LEASE_TIMEOUT);
    assert_eq!(queue.execution_timeout, Some(defaults::EXECUTION_TIMEOUT));
    assert_eq!(queue.alive_timeout, None);
    assert_eq!(queue.lag_warn, None);
    assert_eq!(
        queue.keep_results, None,
        "results are kept only when asked for"
    );
    let kept =
        parse("[[queues]]\nname = \"mail\"\nmode = \"safe\"\nkeep_results = \"1h\"\n").unwrap();
    assert_eq!(kept.queues[0].keep_results, Some(Duration::from_secs(3600)));
    assert_eq!(config.daemon.report_interval, None);
    assert!(!config.reports(), "no reporter unless asked for");
    assert_eq!(config.redis.key_prefix, "kmq");
    assert!(
        !config.redis.allow_eviction,
        "a Redis that may evict kmqd's keys is refused unless accepted"
    );
    assert_eq!(
        config.redis.pool_size,
        config.connections_needed() + 2,
        "sized from the queues when not set"
    );
    assert_eq!(
        config.daemon.plugins_dir,
        PathBuf::from("/usr/lib/kmqd/plugins")
    );
}

#[test]
fn relative_paths_are_resolved_against_the_config_file() {
    let config =
        parse("[daemon]\nplugins_dir = \"plugins\"\n[plugins.echo]\nfile = \"libkmq_echo.so\"\n")
            .unwrap();
    assert_eq!(
        config.daemon.plugins_dir,
        PathBuf::from("/etc/kmqd/plugins")
    );
    assert_eq!(
        config.plugins[0].file,
        PathBuf::from("/etc/kmqd/plugins/libkmq_echo.so")
    );
    assert_eq!(config.plugins[0].config_json, "{}");
}

#[test]
fn default_priority_is_the_middle_or_first_level() {
    for (levels, expected) in [
        ("[\"a\"]", 0),
        ("[\"a\", \"b\"]", 0),
        ("[\"a\", \"b\", \"c\"]", 1),
        ("[\"a\", \"b\", \"c\", \"d\"]", 1),
    ] {
        let config = parse(&format!("{MINIMAL}priorities = {levels}\n")).unwrap();
        assert_eq!(config.queues[0].default_priority, expected, "for {levels}");
    }
}

#[test]
fn plugin_config_table_becomes_json() {
    let config = parse("[plugins.mail]\nfile = \"/opt/libmail.so\"\nconfig = { smtp = \"127.0.0.1:25\", tries = 2, when = 1979-05-27T07:32:00Z }\n").unwrap();
    let json: serde_json::Value = serde_json::from_str(&config.plugins[0].config_json).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"smtp": "127.0.0.1:25", "tries": 2, "when": "1979-05-27T07:32:00Z"})
    );
}

/// Each bad config, and the location and words its error must contain.
#[test]
fn bad_configs_name_file_line_key_and_fix() {
    let cases: &[(&str, &str, &[&str])] = &[
        (
            "[redis]\nurl = \"http://x\"\n",
            "queues.toml:2:7",
            &["redis.url", "redis://"],
        ),
        (
            "[redis]\nurl = \"redis://a:1\"\ncluster = [\"redis://b:2\"]\n",
            "queues.toml:3:11",
            &["redis.cluster", "not both"],
        ),
        (
            "[redis]\nsentinel = [\"redis://s:26379\"]\n",
            "queues.toml:2:12",
            &["redis.sentinel", "sentinel_master"],
        ),
        (
            "[redis]\nsentinel_master = \"main\"\n",
            "queues.toml:2:19",
            &["redis.sentinel_master", "only with sentinel"],
        ),
        (
            "[redis]\ncluster = [\"redis://a:1\", \"rediss://b:2\"]\n",
            "queues.toml:2:27",
            &["redis.cluster", "mixes redis:// and rediss://"],
        ),
        (
            "[redis]\ncluster = [\"redis://a:1/3\"]\n",
            "queues.toml:2:12",
            &["redis.cluster", "database 0 only"],
        ),
        (
            "[redis]\ncluster = []\n",
            "queues.toml:2:11",
            &["redis.cluster", "lists no node"],
        ),
        (
            "[redis]\nurl = \"rediss://cache:6380\"\ntls_cert_file = \"/etc/client.pem\"\n",
            "queues.toml:3:17",
            &["redis.tls_cert_file", "tls_key_file too"],
        ),
        (
            "[redis]\nurl = \"rediss://cache:6380\"\ntls_ca_file = \"/nonexistent/ca.pem\"\n",
            "queues.toml:3:15",
            &["redis.tls_ca_file", "cannot read /nonexistent/ca.pem"],
        ),
        (
            "[daemon]\nlog_level = \"warning\"\n",
            "queues.toml:2:13",
            &["daemon.log_level", "did you mean \"warn\""],
        ),
        (
            "[daemon]\nlog_level = \"kmqd=verbose,info\"\n",
            "queues.toml:2:13",
            &["daemon.log_level", "\"verbose\"", "TARGET=LEVEL"],
        ),
        (
            "[daemon]\nreport_interval = \"often\"\n",
            "queues.toml:2:19",
            &["daemon.report_interval", "not a duration", "\"30s\""],
        ),
        (
            "[daemon]\nreport_interval = \"10ms\"\n",
            "queues.toml:2:19",
            &["daemon.report_interval", "too short", "100ms"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nlag_warn = \"0s\"\n",
            "queues.toml:4:12",
            &["queues[0].lag_warn", "too short", "100ms"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nkeep_results = \"10ms\"\n",
            "queues.toml:4:16",
            &["queues[0].keep_results", "too short", "1s"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nkeep_results = \"90days\"\n",
            "queues.toml:4:16",
            &["queues[0].keep_results", "too long", "30days"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nkeep_results = \"soon\"\n",
            "queues.toml:4:16",
            &["queues[0].keep_results", "not a duration"],
        ),
        (
            "[daemon]\nlog_format = \"yaml\"\n",
            "queues.toml:2:14",
            &["daemon.log_format", "\"json\""],
        ),
        (
            "[redis]\nwait_timeout = \"0s\"\n",
            "queues.toml:2:16",
            &["redis.wait_timeout", "between 1ms and 1m"],
        ),
        (
            "[daemon]\nshutdown_grace = \"30 parsecs\"\n",
            "queues.toml:2:18",
            &["daemon.shutdown_grace", "\"30s\""],
        ),
        (
            "[daemon]\nshutdown_grace = \"300000000000y\"\n",
            "queues.toml:2:18",
            &["daemon.shutdown_grace", "too long", "at most 10 years"],
        ),
        (
            "[redis]\nio_timeout = \"50ms\"\n",
            "queues.toml:2:14",
            &["redis.io_timeout", "between 100ms and 5m"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nmax_task_bytes = 10\n",
            "queues.toml:4:18",
            &["queues[0].max_task_bytes", "between 1024 and 536870912"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nworkers = 0\n",
            "queues.toml:4:11",
            &["queues[0].workers", "between 1 and 1024"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nworker_nice = 20\n",
            "queues.toml:4:15",
            &["queues[0].worker_nice", "between 0 and 19"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"fast\"\n",
            "queues.toml:3:8",
            &["queues[0].mode", "\"default\", \"safe\""],
        ),
        (
            "[[queues]]\nname = \"mail\"\n",
            "queues.toml:1:1",
            &["queues[0].mode", "mode = \"safe\""],
        ),
        (
            "[[queues]]\nname = \"ma il\"\nmode = \"safe\"\n",
            "queues.toml:2:8",
            &["queues[0].name", "a-z"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nwrkers = 3\n",
            "queues.toml:4:1",
            &["queues[0]: unknown key `wrkers`; did you mean `workers`?"],
        ),
        (
            "[redis]\nallow_eviction = \"yes\"\n",
            "queues.toml:2:18",
            &["redis.allow_eviction: invalid type: string \"yes\", expected true or false"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nworkers = \"4\"\n",
            "queues.toml:4:11",
            &["queues[0].workers: invalid type: string \"4\", expected an integer"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nbackoff = 5\n",
            "queues.toml:4:11",
            &[
                "queues[0].backoff: invalid type: integer `5`",
                "such as \"30s\"",
            ],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\npriorities = [\"high\", 1]\n",
            "queues.toml:4:23",
            &["queues[0].priorities[1]: invalid type: integer `1`, expected a string"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"sfe\"\n",
            "queues.toml:3:8",
            &["queues[0].mode", "did you mean \"safe\"?"],
        ),
        (
            "[deamon]\nplugins_dir = \"/x\"\n",
            "queues.toml:1:2",
            &["unknown key `deamon`; did you mean `daemon`?"],
        ),
        (
            "[plugins.mail]\nfile = \"a.so\"\nconfig = 5\n",
            "queues.toml:3:10",
            &["plugins.mail.config: invalid type: integer `5`, expected a table"],
        ),
        (
            "[plugins.mail]\nfiles = \"a.so\"\n",
            "queues.toml:2:1",
            &["plugins.mail: unknown key `files`; did you mean `file`?"],
        ),
        (
            "[[queues]]\nname = \"a\"\nmode = \"safe\"\n[[queues]]\nname = \"a\"\nmode = \"safe\"\n",
            "queues.toml:5:8",
            &["queues[1].name: queue \"a\" is defined twice"],
        ),
        (
            "[redis]\npool_size = 2\n[[queues]]\nname = \"a\"\nmode = \"safe\"\n",
            "queues.toml:2:13",
            &["redis.pool_size: 2 is too small"],
        ),
        (
            "[[queues]]\nname = \"mail\"\nmode = \"safe\"\nworkers = \"many\"\n",
            "queues.toml:4:11",
            &["invalid type"],
        ),
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\nbatch = 5000\n",
            "queues.toml:4:9",
            &["queues[0].batch", "between 1 and 1000"],
        ),
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\non_handler_error = \"ignore\"\n",
            "queues.toml:4:20",
            &["on_handler_error", "\"finish\""],
        ),
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\npriorities = [\"hi\", \"hi\"]\n",
            "queues.toml:4:14",
            &["listed twice"],
        ),
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\ndefault_priority = \"x\"\n",
            "queues.toml:4:20",
            &["not one of the queue's priorities"],
        ),
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\n[[queues]]\nname = \"m\"\nmode = \"safe\"\n",
            "queues.toml",
            &["defined twice"],
        ),
        (
            "[redis]\npool_size = 2\n[[queues]]\nname = \"m\"\nmode = \"safe\"\n",
            "queues.toml",
            &["redis.pool_size", "at least 7"],
        ),
        (
            "[plugins.mail]\nconfig = {}\n",
            "queues.toml:1:1",
            &["plugins.mail.file", "libkmq_mail.so"],
        ),
        (
            "[redis]\npassword_env = \"KMQD_TEST_SURELY_UNSET_VARIABLE\"\n",
            "queues.toml:2:16",
            &["is not set"],
        ),
        // Each of these three pointed at the queue's table (1:1), not at the value (the architecture review's P4).
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\nlease_timeout = \"100ms\"\n",
            "queues.toml:4:17",
            &["queues[0].lease_timeout", "too short", "300ms"],
        ),
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\nbackoff = \"10s\"\nbackoff_max = \"1s\"\n",
            "queues.toml:5:15",
            &["queues[0].backoff_max", "not be shorter than backoff"],
        ),
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\nbackoff = \"2h\"\n",
            "queues.toml:4:11",
            &["queues[0].backoff_max", "not be shorter than backoff"],
        ),
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\nidle_poll = \"10s\"\n",
            "queues.toml:4:13",
            &["queues[0].idle_poll", "between 10ms and 5s"],
        ),
        (
            "[daemon]\nmetrics_addr = \"localhost\"\n",
            "queues.toml:2:16",
            &["daemon.metrics_addr", "127.0.0.1:9464"],
        ),
        (
            "[daemon]\notlp_endpoint = \"127.0.0.1:4318\"\n",
            "queues.toml:2:17",
            &[
                "daemon.otlp_endpoint",
                "not an http:// URL",
                "http://127.0.0.1:4318",
            ],
        ),
        (
            "[daemon]\notlp_endpoint = \"https://otel.example:4318\"\n",
            "queues.toml:2:17",
            &["daemon.otlp_endpoint", "plain HTTP only", "collector"],
        ),
        (
            "[daemon]\notlp_endpoint = \"http://\"\n",
            "queues.toml:2:17",
            &["daemon.otlp_endpoint", "names no host"],
        ),
        (
            "[daemon]\notlp_endpoint = \"http://collector:43l8\"\n",
            "queues.toml:2:17",
            &["daemon.otlp_endpoint", "no valid port"],
        ),
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\nforeign_type_field = \"type\"\n",
            "queues.toml:4:22",
            &["queues[0].foreign_type_field", "\"callback\""],
        ),
        (
            "[[schedules]]\nname = \"s\"\nqueue = \"nope\"\ntype = \"t\"\nevery = \"1m\"\n",
            "queues.toml:3:9",
            &["schedules[0].queue", "no queue \"nope\""],
        ),
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\n[[schedules]]\nname = \"s\"\nqueue = \"m\"\ntype = \"t\"\ncron = \"0 25 * * *\"\n",
            "queues.toml:8:8",
            &["schedules[0].cron", "hour: 25 is outside 0-23"],
        ),
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\n[[schedules]]\nname = \"s\"\nqueue = \"m\"\ntype = \"t\"\ncron = \"* * * * *\"\nevery = \"1m\"\n",
            "queues.toml:4:1",
            &["exactly one of cron"],
        ),
        (
            "[[queues]]\nname = \"m\"\nmode = \"safe\"\n[[schedules]]\nname = \"s\"\nqueue = \"m\"\ntype = \"t\"\nevery = \"1500ms\"\n",
            "queues.toml:8:9",
            &["schedules[0].every", "whole seconds"],
        ),
    ];

    for (text, location, words) in cases {
        let error = parse(text).expect_err(text);
        assert!(
            error.starts_with(&format!("/etc/kmqd/{location}")),
            "{text:?}\n gave: {error}"
        );
        for word in *words {
            assert!(
                error.contains(word),
                "{text:?}\n gave: {error}\n missing: {word}"
            );
        }
    }
}

#[test]
fn every_longer_than_the_clock_holds_has_no_next_slot() {
    // Found by fuzz/fuzz_targets/config_values.rs: these validate (whole seconds, at least 1s), but their
    // length in ms does not fit an i64, and the next slot came out before `after_ms` (negative), or the
    // division by the truncated period panicked (2^61 s is 0 ms once truncated to 64 bits).
    // The config now refuses durations past ten years; the arithmetic stays safe on its own.
    for every in [
        "9223372036854776s",
        "2305843009213693952s",
        "18446744073709551615s",
    ] {
        let text = format!(
            "{MINIMAL}[[schedules]]\nname = \"s\"\nqueue = \"mail\"\ntype = \"t\"\nevery = \"{every}\"\n"
        );
        let error = parse(&text).unwrap_err();
        assert!(error.contains("is too long"), "{every}: {error}");
        let when = When::Every(humantime::parse_duration(every).unwrap());
        for after in [0, 1_795_997_223_121, i64::MAX - 1] {
            assert_eq!(when.next_after(after), None, "{every} after {after}");
        }
    }
    let longest = When::Every(Duration::from_millis(i64::MAX as u64));
    assert_eq!(longest.next_after(0), Some(i64::MAX));
    assert_eq!(
        longest.next_after(i64::MAX),
        None,
        "the slot after it overflows"
    );
    let hourly = When::Every(Duration::from_secs(3600));
    assert_eq!(hourly.next_after(3_600_000), Some(7_200_000));
    assert_eq!(hourly.next_after(-1), Some(0));
}

#[test]
fn passwords_are_redacted() {
    assert_eq!(
        redact_url("redis://user:secret@host:6379/0"),
        "redis://user:***@host:6379/0"
    );
    assert_eq!(redact_url("redis://:secret@host/0"), "redis://:***@host/0");
    assert_eq!(redact_url("redis://host:6379/0"), "redis://host:6379/0");
    assert_eq!(
        redact_url("unix:///run/redis.sock"),
        "unix:///run/redis.sock"
    );
}

#[test]
fn max_held_defaults_to_what_the_queue_may_hold_and_refuses_less() {
    let queue = |keys: &str| {
        parse(&format!("{MINIMAL}workers = 4\n{keys}")).map(|config| config.queues[0].clone())
    };
    let fixed = queue("prefetch = 10\n").unwrap();
    assert_eq!((fixed.prefetch, fixed.max_held), (Prefetch::Fixed(10), 14));
    let auto = queue("max_held = 100\n").unwrap();
    assert_eq!((auto.prefetch, auto.max_held), (Prefetch::Auto, 100));
    assert_eq!(auto.initial_prefetch(), 4, "starts at workers");
    let tight = queue("max_held = 6\n").unwrap();
    assert_eq!(tight.initial_prefetch(), 2, "within what max_held leaves");
    let error = queue("prefetch = 10\nmax_held = 12\n").unwrap_err();
    for words in [
        "queues[0].max_held: 12 is less than workers + prefetch (4 + 10)",
        "queues.toml:6:",
    ] {
        assert!(error.contains(words), "{words:?} in {error}");
    }
    let error = queue("max_held = 3\n").unwrap_err();
    assert!(
        error.contains("queues[0].max_held: 3 is less than workers (4)"),
        "{error}"
    );
}

/// `source_lists`: plain key names, each feeding one queue, never kmqd's own keys; on a Redis Cluster only in
/// the queue's slot (a task moves atomically only within one), with the name to give instead.
#[test]
fn source_lists_are_checked_where_they_are_written() {
    let config = parse(
        "[[queues]]\nname = \"email\"\nmode = \"safe\"\npriorities = [\"high\", \"normal\", \"low\"]\n\
         source_lists = [\"queue:email\", { list = \"queue:urgent\", priority = \"high\" }, { list = \"x\" }]\n",
    )
    .unwrap();
    let queue = &config.queues[0];
    assert_eq!(
        format!("{:?}", queue.source_lists),
        r#"["queue:email" (normal), "queue:urgent" (high), "x" (normal)]"#,
        "the default level unless the table names one"
    );
    assert_eq!(
        queue
            .source_lists
            .iter()
            .map(|s| s.level)
            .collect::<Vec<_>>(),
        [1, 0, 1]
    );
    assert_eq!(
        config.redis.pool_size,
        3 + 1 + 4 + 2,
        "the mover holds a connection of its own"
    );
    assert!(parse(MINIMAL).unwrap().queues[0].source_lists.is_empty());
    let queue = |lists: &str| {
        format!("[[queues]]\nname = \"email\"\nmode = \"safe\"\nsource_lists = {lists}\n")
    };
    let cluster = "[redis]\ncluster = [\"redis://127.0.0.1:7000\"]\n";
    for (text, location, words) in [
        (
            queue("[\"\"]"),
            "queues.toml:4:17",
            &[
                "queues[0].source_lists[0]",
                "not a list name",
                "\"queue:email\"",
            ][..],
        ),
        (
            queue("[7]"),
            "queues.toml:4:17",
            &[
                "queues[0].source_lists[0]",
                "write a list's name",
                "{ list = \"queue:email\", priority = \"normal\" }",
            ][..],
        ),
        (
            queue("[{ list = \"a\", level = \"high\" }]"),
            "queues.toml:4:17",
            &["unknown key \"level\""][..],
        ),
        (
            queue("[{ priority = \"normal\" }]"),
            "queues.toml:4:17",
            &["the table has no list"][..],
        ),
        (
            queue("[{ list = 1 }]"),
            "queues.toml:4:17",
            &["list must be a string"][..],
        ),
        (
            queue("[{ list = \"a\", priority = \"high\" }]"),
            "queues.toml:4:17",
            &["\"high\" is not one of the queue's priorities [\"normal\"]"][..],
        ),
        (
            queue("[\"a\", \"a\"]"),
            "queues.toml:4:22",
            &["\"a\" is listed twice"][..],
        ),
        (
            queue("[\"kmq:{email}:ready:normal\"]"),
            "queues.toml:4:17",
            &["one of kmqd's own keys", "\"kmq:{\""][..],
        ),
        (
            format!(
                "{}[[queues]]\nname = \"other\"\nmode = \"safe\"\nsource_lists = [\"b\", \"queue:email\"]\n",
                queue("[\"queue:email\"]")
            ),
            "queues.toml:8:22",
            &[
                "queues[1].source_lists[1]",
                "a source of queue \"email\" too",
            ][..],
        ),
        (
            format!("{cluster}{}", queue("[\"queue:email\"]")),
            "queues.toml:6:17",
            &[
                "another Redis Cluster slot",
                "kmq:{email}:...",
                "\"queue:{email}\"",
            ][..],
        ),
    ] {
        let error = parse(&text).unwrap_err();
        assert!(error.contains(location), "{location} in {error}");
        for word in words {
            assert!(error.contains(word), "{word:?} in {error}");
        }
    }
    // In the queue's slot: its hash tag, or any name that happens to hash there; Sentinel and one Redis take any.
    let tagged = parse(&format!(
        "{cluster}{}",
        queue("[\"queue:{email}\", \"{email}\"]")
    ))
    .unwrap();
    assert_eq!(tagged.queues[0].source_lists.len(), 2);
    let sentinel = "[redis]\nsentinel = [\"redis://127.0.0.1:26379\"]\nsentinel_master = \"m\"\n";
    assert!(parse(&format!("{sentinel}{}", queue("[\"queue:email\"]"))).is_ok());
}

#[test]
fn the_cluster_s_hint_gives_the_name_the_queue_s_hash_tag() {
    use super::validate::tagged;
    assert_eq!(tagged("queue:email", "email"), "queue:{email}");
    assert_eq!(tagged("legacy", "email"), "legacy:{email}");
    assert_eq!(tagged("{other}:email", "email"), "other:{email}");
    assert_eq!(tagged("email", "email"), "email:{email}");
}

/// The fuzz target's config of every key stays valid (the fuzzer mutates it from there).
#[test]
fn the_fuzz_config_of_every_key_is_valid() {
    let config = parse(include_str!("../../fuzz/src/every-key.toml")).unwrap();
    assert!(config.redis.allow_eviction);
    assert_eq!(config.queues[0].source_lists.len(), 2);
    assert_eq!(config.queues[0].max_running, Some(1_000_000));
    assert_eq!(config.queues[0].rate_limit.len(), 2);
    assert_eq!(config.queues[0].priority_weights, [1000, 3, 2, 1]);
    assert_eq!(config.queues[0].type_limits[0].rate_limit.len(), 2);
}

#[test]
fn priority_weights_are_one_per_level_each_from_1_to_1000() {
    let queue = |keys: &str| {
        let text = format!(
            "[[queues]]\nname = \"api\"\nmode = \"safe\"\npriorities = [\"high\", \"low\"]\n{keys}"
        );
        parse(&text).map(|config| config.queues[0].clone())
    };
    assert_eq!(
        queue("priority_weights = [3, 1]\n")
            .unwrap()
            .priority_weights,
        [3, 1]
    );
    assert!(
        queue("").unwrap().priority_weights.is_empty(),
        "strict order"
    );
    for (keys, words) in [
        (
            "priority_weights = [3]\n",
            "queues.toml:5:20: queues[0].priority_weights: 1 weights for 2 priorities",
        ),
        (
            "priority_weights = [3, 0]\n",
            "queues[0].priority_weights: 0 is out of range; each weight must be between 1 and 1000",
        ),
    ] {
        let error = queue(keys).unwrap_err();
        assert!(error.contains(words), "{words:?} in {error}");
    }
}

#[test]
fn the_dashboard_section_is_checked_at_load_and_read_by_the_dashboard() {
    // Paths resolved against the config's directory; where each key is written, for the dashboard's errors.
    let config = parse(&format!(
        "{MINIMAL}\n[dashboard]\nusers_file = \"dashboard-users\"\ntoken_env = \"KMQD_DASHBOARD_TOKEN_UNSET\"\n"
    ))
    .unwrap();
    let users = config.dashboard.users_file.as_ref().unwrap();
    assert_eq!(users.value, PathBuf::from("/etc/kmqd/dashboard-users"));
    assert_eq!(users.at, "/etc/kmqd/queues.toml:6:14: dashboard.users_file");
    assert_eq!(
        config
            .dashboard
            .token_env
            .as_ref()
            .unwrap()
            .error("environment variable X is not set"),
        "/etc/kmqd/queues.toml:7:13: dashboard.token_env: environment variable X is not set"
    );
    assert!(config.dashboard.has_authentication());
    assert!(!parse(MINIMAL).unwrap().dashboard.has_authentication());
    for (section, error) in [
        (
            "users_files = \"u\"",
            "/etc/kmqd/queues.toml:6:1: dashboard: unknown key `users_files`; did you mean `users_file`?",
        ),
        (
            "token_env = \"A\"\ntoken_file = \"t\"",
            "/etc/kmqd/queues.toml:7:14: dashboard.token_file: set token_env or token_file, not both",
        ),
        (
            "token_file = \" \"",
            "/etc/kmqd/queues.toml:6:14: dashboard.token_file: is empty; leave it out or name one",
        ),
    ] {
        let got = parse(&format!("{MINIMAL}\n[dashboard]\n{section}\n")).unwrap_err();
        assert!(got.starts_with(error), "{section}:\n{got}\nwanted {error}");
    }
}

#[test]
fn max_running_needs_no_prefetch_in_either_mode() {
    let queue = |mode: &str, keys: &str| {
        let text = format!("[[queues]]\nname = \"api\"\nmode = \"{mode}\"\nworkers = 4\n{keys}");
        parse(&text).map(|config| config.queues[0].clone())
    };
    let limited = queue("safe", "max_running = 20\n").unwrap();
    assert_eq!(limited.max_running, Some(20));
    assert_eq!(
        (limited.prefetch, limited.max_held),
        (Prefetch::Fixed(0), 4),
        "claims only for idle workers"
    );
    assert_eq!(queue("safe", "").unwrap().max_running, None);
    let popped = queue("default", "max_running = 2\n").unwrap();
    assert_eq!(
        (popped.max_running, popped.prefetch),
        (Some(2), Prefetch::Fixed(0)),
        "default mode counts its pops under their owner"
    );
    for (mode, keys, words) in [
        (
            "default",
            "max_running = 2\nprefetch = 8\n",
            "queues.toml:6:12: queues[0].prefetch: a queue with max_running claims only for its idle workers",
        ),
        (
            "safe",
            "max_running = 2\nprefetch = 8\n",
            "queues.toml:6:12: queues[0].prefetch: a queue with max_running claims only for its idle workers",
        ),
        (
            "safe",
            "max_running = 0\n",
            "queues[0].max_running: 0 is out of range; it must be between 1 and 1000000",
        ),
    ] {
        let error = queue(mode, keys).unwrap_err();
        assert!(error.contains(words), "{words:?} in {error}");
    }
    queue("safe", "max_running = 2\nprefetch = 0\n")
        .expect("an explicit prefetch of 0 is what it needs");
}

#[test]
fn rate_limit_is_a_rate_or_a_list_of_them_in_either_mode() {
    let queue = |mode: &str, keys: &str| {
        let text = format!("[[queues]]\nname = \"api\"\nmode = \"{mode}\"\nworkers = 4\n{keys}");
        parse(&text).map(|config| config.queues[0].clone())
    };
    let one = queue("safe", "rate_limit = \"200/s\"\n").unwrap();
    assert_eq!(format!("{:?}", one.rate_limit), "[200/1s]");
    assert_eq!(
        one.prefetch,
        Prefetch::Fixed(0),
        "claims only for idle workers"
    );
    let two = queue("safe", "rate_limit = [\"20/s\", \"1000/h\"]\n").unwrap();
    assert_eq!(format!("{:?}", two.rate_limit), "[20/1s, 1000/1h]");
    assert!(queue("safe", "").unwrap().rate_limit.is_empty());
    let popped = queue("default", "rate_limit = \"5/s\"\n").unwrap();
    assert_eq!(
        (format!("{:?}", popped.rate_limit), popped.prefetch),
        ("[5/1s]".to_string(), Prefetch::Fixed(0)),
        "default mode counts its pops, for idle workers only"
    );
    for (mode, keys, words) in [
        (
            "default",
            "rate_limit = \"5/s\"\nprefetch = 8\n",
            "queues.toml:6:12: queues[0].prefetch: a queue with rate_limit claims only for its idle workers",
        ),
        (
            "safe",
            "rate_limit = \"5/s\"\nprefetch = 8\n",
            "queues.toml:6:12: queues[0].prefetch: a queue with rate_limit claims only for its idle workers",
        ),
        (
            "safe",
            "rate_limit = \"5 per second\"\n",
            "queues[0].rate_limit: \"5 per second\" is not a rate",
        ),
        (
            "safe",
            "rate_limit = [\"5/s\", \"9/1s\"]\n",
            "queues[0].rate_limit: two rates for the window 1s",
        ),
        (
            "safe",
            "rate_limit = 5\n",
            "queues[0].rate_limit: write a rate as a string",
        ),
        (
            "safe",
            "rate_limit = []\n",
            "queues[0].rate_limit: write a rate as a string",
        ),
        (
            "safe",
            "rate_limit = [5]\n",
            "queues[0].rate_limit: 5 is not a rate",
        ),
    ] {
        let error = queue(mode, keys).unwrap_err();
        assert!(error.contains(words), "{words:?} in {error}");
    }
}

#[test]
fn type_limits_name_a_type_and_at_least_one_limit_in_either_mode() {
    let queue = |mode: &str, keys: &str| {
        let text = format!("[[queues]]\nname = \"api\"\nmode = \"{mode}\"\nworkers = 4\n{keys}");
        parse(&text).map(|config| config.queues[0].clone())
    };
    let limited = queue(
        "safe",
        "[[queues.limits]]\ntype = \"report.build\"\nmax_running = 2\nrate_limit = \"5/s\"\n\
         [[queues.limits]]\ntype = \"mail\"\nrate_limit = [\"20/s\", \"1000/h\"]\n",
    )
    .unwrap();
    assert_eq!(
        format!("{:?}", limited.type_limits),
        "[TypeLimit { kind: \"report.build\", max_running: Some(2), rate_limit: [5/1s] }, \
         TypeLimit { kind: \"mail\", max_running: None, rate_limit: [20/1s, 1000/1h] }]"
    );
    assert_eq!(
        (limited.prefetch, limited.max_running),
        (Prefetch::Fixed(0), None),
        "claims only for idle workers; the queue itself unlimited"
    );
    assert!(queue("safe", "").unwrap().type_limits.is_empty());
    let popped = queue(
        "default",
        "[[queues.limits]]\ntype = \"t\"\nmax_running = 2\n",
    )
    .unwrap();
    assert_eq!(
        (popped.type_limits.len(), popped.prefetch),
        (1, Prefetch::Fixed(0)),
        "a default-mode pop sorts tasks by type too, and pops only for idle workers"
    );
    for (mode, keys, words) in [
        (
            "safe",
            "prefetch = 8\n[[queues.limits]]\ntype = \"t\"\nmax_running = 2\n",
            "queues.toml:5:12: queues[0].prefetch: a queue with [[queues.limits]] claims only for its idle workers",
        ),
        (
            "safe",
            "[[queues.limits]]\nmax_running = 2\n",
            "queues[0].limits[0].type: every [[queues.limits]] entry names its task type",
        ),
        (
            "safe",
            "[[queues.limits]]\ntype = \"t\"\n",
            "queues[0].limits[0]: the entry for type \"t\" sets no limit",
        ),
        (
            "safe",
            "[[queues.limits]]\ntype = \"t\"\nmax_running = 1\n[[queues.limits]]\ntype = \"t\"\nrate_limit = \"1/s\"\n",
            "queues.toml:9:8: queues[0].limits[1].type: type \"t\" has two [[queues.limits]] entries",
        ),
        (
            "safe",
            "[[queues.limits]]\ntype = \"\"\nmax_running = 1\n",
            "queues[0].limits[0].type: \"\" is not a task type a limit can name",
        ),
        (
            "safe",
            "[[queues.limits]]\ntype = \"t\"\nmax_running = 0\n",
            "queues[0].limits[0].max_running: 0 is out of range",
        ),
        (
            "safe",
            "[[queues.limits]]\ntype = \"t\"\nrate_limit = \"5 a second\"\n",
            "queues[0].limits[0].rate_limit: \"5 a second\" is not a rate",
        ),
        (
            "safe",
            "[[queues.limits]]\ntype = \"t\"\nmax_running = 1\nconcurrency = 2\n",
            "queues[0].limits[0]: unknown key `concurrency` (valid keys: `type`, `max_running`, `rate_limit`)",
        ),
    ] {
        let error = queue(mode, keys).unwrap_err();
        assert!(error.contains(words), "{words:?} in {error}");
    }
}

#[test]
fn groups_take_limits_and_weights_in_safe_mode_without_type_limits() {
    let queue = |mode: &str, keys: &str| {
        let text = format!("[[queues]]\nname = \"api\"\nmode = \"{mode}\"\nworkers = 4\n{keys}");
        parse(&text).map(|config| config.queues[0].clone())
    };
    let grouped = queue(
        "safe",
        "[queues.groups]\nmax_running = 2\nrate_limit = \"10/s\"\nweights = { \"tenant-premium\" = 4 }\n",
    )
    .unwrap();
    assert_eq!(
        format!("{:?}", grouped.groups),
        "Some(Groups { max_running: Some(2), rate_limit: [10/1s], weights: [(\"tenant-premium\", 4)] })"
    );
    assert_eq!(
        grouped.prefetch,
        Prefetch::Fixed(0),
        "claims only for idle workers"
    );
    let plain = queue("safe", "[queues.groups]\n").unwrap();
    assert_eq!(
        (plain.groups.is_some(), plain.prefetch),
        (true, Prefetch::Fixed(0))
    );
    assert_eq!(
        queue("safe", "prefetch = 8\n[queues.groups]\n")
            .unwrap()
            .prefetch,
        Prefetch::Fixed(8),
        "without group limits, a prefetch is the operator's choice"
    );
    let both = queue(
        "safe",
        "[queues.groups]\nmax_running = 1\n[[queues.limits]]\ntype = \"t\"\nmax_running = 2\n",
    )
    .unwrap();
    assert_eq!(
        (
            both.groups.map(|groups| groups.max_running),
            both.type_limits.len()
        ),
        (Some(Some(1)), 1),
        "groups and limits per task type apply together on one queue"
    );
    for (mode, keys, words) in [
        (
            "default",
            "[queues.groups]\n",
            "queues.toml:5:1: queues[0].groups: groups need mode = \"safe\"",
        ),
        (
            "safe",
            "prefetch = 8\n[queues.groups]\nmax_running = 1\n",
            "queues.toml:5:12: queues[0].prefetch: a queue with group limits claims only for its idle workers",
        ),
        (
            "safe",
            "[queues.groups]\nmax_running = 0\n",
            "queues[0].groups.max_running: 0 is out of range",
        ),
        (
            "safe",
            "[queues.groups]\nrate_limit = \"ten a second\"\n",
            "queues[0].groups.rate_limit: \"ten a second\" is not a rate",
        ),
        (
            "safe",
            "[queues.groups]\nweights = { \"a\" = 0 }\n",
            "queues[0].groups.weights.\"a\": 0 is not a weight; write a whole number from 1 to 1000",
        ),
        (
            "safe",
            "[queues.groups]\nweights = { \"\" = 2 }\n",
            "queues[0].groups.weights.\"\": a group's name is 1 to 64 bytes",
        ),
        (
            "safe",
            "[queues.groups]\nconcurrency = 2\n",
            "queues[0].groups: unknown key `concurrency` (valid keys: `max_running`, `rate_limit`, `weights`)",
        ),
    ] {
        let error = queue(mode, keys).unwrap_err();
        assert!(error.contains(words), "{words:?} in {error}");
    }
}
