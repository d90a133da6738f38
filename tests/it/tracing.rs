//! Tracing (`[daemon] otlp_endpoint`, src/otel.rs) through the real `kmqd` binary, against an OTLP/HTTP receiver
//! the test runs: a span per run, under the producer's `traceparent`, kept across a retry; a collector that is
//! down or never answers does not hold tasks back.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kmqd::NewTask;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;

use crate::reload::stop;
use crate::support::*;

/// The producer's context the tests push with (W3C's own example, sampled).
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_SPAN_ID: &str = "00f067aa0ba902b7";

fn traceparent() -> String {
    format!("00-{TRACE_ID}-{PARENT_SPAN_ID}-01")
}

/// One span as the receiver decoded it, its ids in hex and its attributes as text.
#[derive(Clone, Debug)]
struct ReceivedSpan {
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    trace_state: String,
    /// `opentelemetry.proto.trace.v1.Span.SpanKind`: 5 is CONSUMER.
    kind: i32,
    /// `Status.StatusCode`: 0 unset, 2 error.
    status_code: i32,
    start_ns: u64,
    end_ns: u64,
    attributes: BTreeMap<String, String>,
    /// The resource's `service.name`.
    service: String,
}

/// An OTLP/HTTP receiver on a port of its own: it answers every `POST /v1/traces` with 200 and keeps the spans
/// it decoded. Its thread ends with the test process (it blocks in `accept`, holding nothing the test waits for).
struct Receiver {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
}

impl Receiver {
    fn start() -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&spans);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let kept = Arc::clone(&kept);
                std::thread::spawn(move || serve(stream, &kept));
            }
        });
        Receiver { addr, spans }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Waits for spans until `enough` says so (at most 30 s), and returns them.
    fn wait_for(&self, what: &str, enough: impl Fn(&[ReceivedSpan]) -> bool) -> Vec<ReceivedSpan> {
        eventually(Duration::from_secs(30), what, || {
            let spans = self.spans.lock().unwrap().clone();
            (enough(&spans), spans)
        })
    }
}

/// Serves one connection's requests (the exporter keeps its connection alive between batches).
fn serve(stream: TcpStream, spans: &Mutex<Vec<ReceivedSpan>>) {
    let mut writer = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        let mut length = 0;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            let header = header.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        assert!(
            request_line.starts_with("POST /v1/traces "),
            "the exporter posts to /v1/traces: {request_line}"
        );
        let request = ExportTraceServiceRequest::decode(body.as_slice())
            .expect("the body is an ExportTraceServiceRequest");
        spans.lock().unwrap().extend(decoded(request));
        let answer =
            "HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";
        if writer.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

fn decoded(request: ExportTraceServiceRequest) -> Vec<ReceivedSpan> {
    let text = |value: Option<Value>| match value {
        Some(Value::StringValue(text)) => text,
        Some(Value::IntValue(number)) => number.to_string(),
        other => format!("{other:?}"),
    };
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let mut spans = Vec::new();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|resource| &resource.attributes)
            .find(|kv| kv.key == "service.name")
            .map(|kv| text(kv.value.clone().and_then(|v| v.value)))
            .unwrap_or_default();
        for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
            spans.push(ReceivedSpan {
                name: span.name,
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent_span_id: hex(&span.parent_span_id),
                trace_state: span.trace_state,
                kind: span.kind,
                status_code: span.status.map_or(0, |status| status.code),
                start_ns: span.start_time_unix_nano,
                end_ns: span.end_time_unix_nano,
                attributes: span
                    .attributes
                    .into_iter()
                    .map(|kv| (kv.key, text(kv.value.and_then(|v| v.value))))
                    .collect(),
                service: service.clone(),
            });
        }
    }
    spans
}

/// A daemon tracing to `endpoint`, its handler the testkit plugin; exports every 100 ms (the SDK's
/// `OTEL_BSP_SCHEDULE_DELAY`), at info level (at debug, every run is timed for its log line anyway).
fn start_traced(redis: &RedisServer, dir: &TestDir, endpoint: &str) -> (PathBuf, Process) {
    start_traced_with(redis, dir, endpoint, "")
}

/// As [`start_traced`], with `daemon` the extra `[daemon]` keys.
fn start_traced_with(
    redis: &RedisServer,
    dir: &TestDir,
    endpoint: &str,
    daemon: &str,
) -> (PathBuf, Process) {
    dir.install_plugin(&built_plugin("kmq-testkit"), "libkmq_testkit.so");
    let config = dir.config_with(
        redis,
        &format!("shutdown_grace = \"5s\"\notlp_endpoint = \"{endpoint}\"\n{daemon}"),
        &safe_queue("workers = 4\nretry_times = 3\nbackoff = \"10ms\""),
    );
    let daemon = Process::start_with_env(
        &config,
        dir.path("kmqd.log"),
        &[("RUST_LOG", "info"), ("OTEL_BSP_SCHEDULE_DELAY", "100")],
    );
    (config, daemon)
}

fn push_traced(config: &Path, id: &str, data: &str, tracestate: Option<&str>) {
    let task = NewTask::new("test", data)
        .unwrap()
        .id(id)
        .trace(traceparent(), tracestate.map(str::to_string));
    assert!(client(config).push("jobs", task).unwrap().is_accepted());
}

/// A test's own Redis, directory and OTLP receiver.
fn fixture() -> (RedisServer, TestDir, Receiver) {
    (RedisServer::start(), TestDir::new(), Receiver::start())
}

#[test]
fn a_traced_task_s_run_is_a_consumer_span_under_the_producer_s_span() {
    let (redis, dir, receiver) = fixture();
    let (config, daemon) = start_traced(&redis, &dir, &receiver.endpoint());
    push_traced(
        &config,
        "traced",
        r#"{"sleep_ms": 50}"#,
        Some("congo=t61rcWkgMzE"),
    );
    let spans = receiver.wait_for("the run's span", |spans| !spans.is_empty());
    assert_eq!(spans.len(), 1, "{spans:#?}");
    let span = &spans[0];
    println!("the span as the receiver decoded it: {span:#?}");
    assert_eq!(span.name, "kmqd.run test");
    assert_eq!((span.kind, span.status_code), (5, 0), "consumer, no error");
    assert_eq!(
        (span.trace_id.as_str(), span.parent_span_id.as_str()),
        (TRACE_ID, PARENT_SPAN_ID)
    );
    assert_ne!(span.span_id, PARENT_SPAN_ID);
    assert_eq!(span.trace_state, "congo=t61rcWkgMzE");
    assert_eq!(span.service, "kmqd");
    let attribute = |key: &str| span.attributes.get(key).map(String::as_str);
    assert_eq!(attribute("messaging.system"), Some("kmqd"));
    assert_eq!(attribute("messaging.operation.type"), Some("process"));
    assert_eq!(attribute("messaging.destination.name"), Some("jobs"));
    assert_eq!(attribute("messaging.message.id"), Some("traced"));
    assert_eq!(attribute("kmqd.task.type"), Some("test"));
    assert_eq!(attribute("kmqd.task.attempt"), Some("0"));
    assert_eq!(attribute("kmqd.task.outcome"), Some("done"));
    let waited: i64 = attribute("kmqd.task.waited_ms").unwrap().parse().unwrap();
    assert!(waited >= 0, "{waited}");
    // The span covers the handler's run (it slept 50 ms), timed at info level too.
    assert!(
        span.end_ns - span.start_ns >= 50_000_000,
        "the span lasts the run: {span:#?}"
    );
    stop(daemon);
}

#[test]
fn a_task_that_fails_once_then_succeeds_has_two_spans_in_its_producer_s_trace() {
    let (redis, dir, receiver) = fixture();
    let (config, daemon) = start_traced(&redis, &dir, &receiver.endpoint());
    push_traced(
        &config,
        "twice",
        r#"{"fail_attempts": 1, "retry_after_ms": 10}"#,
        None,
    );
    // And one without a trace context: a root span of a trace of its own.
    let untraced = NewTask::new("test", "{}").unwrap().id("untraced");
    assert!(
        client(&config)
            .push("jobs", untraced)
            .unwrap()
            .is_accepted()
    );
    let spans = receiver.wait_for("three spans", |spans| spans.len() >= 3);
    let mut twice: Vec<_> = spans
        .iter()
        .filter(|span| span.attributes["messaging.message.id"] == "twice")
        .collect();
    twice.sort_by_key(|span| span.attributes["kmqd.task.attempt"].clone());
    let runs: Vec<_> = twice
        .iter()
        .map(|span| {
            (
                span.trace_id.as_str(),
                span.parent_span_id.as_str(),
                span.attributes["kmqd.task.attempt"].as_str(),
                span.attributes["kmqd.task.outcome"].as_str(),
                span.status_code,
            )
        })
        .collect();
    assert_eq!(
        runs,
        [
            (TRACE_ID, PARENT_SPAN_ID, "0", "retry", 2),
            (TRACE_ID, PARENT_SPAN_ID, "1", "done", 0)
        ],
        "{spans:#?}"
    );
    assert_ne!(twice[0].span_id, twice[1].span_id);
    let root = spans
        .iter()
        .find(|span| span.attributes["messaging.message.id"] == "untraced")
        .unwrap();
    assert!(
        root.parent_span_id.is_empty() && root.trace_id != TRACE_ID,
        "{root:#?}"
    );
    stop(daemon);
}

#[test]
fn a_dead_letter_requeued_runs_again_in_its_producer_s_trace() {
    let (redis, dir, receiver) = fixture();
    let (config, daemon) = start_traced(&redis, &dir, &receiver.endpoint());
    push_traced(&config, "doomed", r#"{"outcome": "fail"}"#, None);
    receiver.wait_for("the first run's span", |spans| spans.len() == 1);
    let requeued = client(&config)
        .dead_requeue("jobs", kmqd::client::DeadSelection::Ids(&["doomed"]), true)
        .unwrap();
    assert_eq!(requeued.requeued, ["doomed"], "{requeued:?}");
    let spans = receiver.wait_for("the second run's span", |spans| spans.len() == 2);
    for span in &spans {
        assert_eq!(
            (
                span.trace_id.as_str(),
                span.parent_span_id.as_str(),
                span.attributes["kmqd.task.outcome"].as_str()
            ),
            (TRACE_ID, PARENT_SPAN_ID, "dead"),
            "{spans:#?}"
        );
    }
    stop(daemon);
}

/// A collector that accepts connections and never answers: every export waits for its timeout.
fn silent_collector() -> (SocketAddr, Arc<Mutex<Vec<TcpStream>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    let holding = Arc::clone(&held);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            holding.lock().unwrap().push(stream);
        }
    });
    (addr, held)
}

#[test]
fn a_collector_that_is_down_or_never_answers_does_not_hold_tasks_back() {
    let (silent, _held) = silent_collector();
    // Nothing listens on a port the OS just handed out and took back: connections are refused.
    let down = format!("http://127.0.0.1:{}", free_port());
    for endpoint in [down, format!("http://{silent}")] {
        let redis = RedisServer::start();
        let dir = TestDir::new();
        let (config, daemon) = start_traced(&redis, &dir, &endpoint);
        push_many(&config, "t", 2000, "{}");
        wait_done(&config, 2000, Duration::from_secs(60));
        // Said once, not per failed batch (four at least: 512 spans a batch).
        let said = "cannot export spans to otlp_endpoint";
        let log = eventually(Duration::from_secs(30), "the failed export's line", || {
            let log = daemon.log_text();
            (log.contains(said), log)
        });
        assert_eq!(log.matches(said).count(), 1, "{log}");
        assert!(!log.contains("BatchSpanProcessor.ExportError"), "{log}");
        // The shutdown's last export is bounded too: the daemon stops, and says the spans may be lost.
        stop(daemon);
    }
}

/// A daemon whose handler is the Python SDK's (the exec plugin's persistent mode), returning as its result the
/// trace context it was handed; `daemon` the extra `[daemon]` keys. The results are kept, for the test to read.
fn start_python_handler(redis: &RedisServer, dir: &TestDir, daemon: &str) -> (PathBuf, Process) {
    start_python_handler_with(
        redis,
        dir,
        daemon,
        "return Result([task.traceparent, task.tracestate])",
        "",
    )
}

/// As [`start_python_handler`], the handler's body `body` (Python, its lines indented four spaces: `task` is the
/// task) and `queue` the queue's extra keys.
fn start_python_handler_with(
    redis: &RedisServer,
    dir: &TestDir,
    daemon: &str,
    body: &str,
    queue: &str,
) -> (PathBuf, Process) {
    dir.install_plugin(&built_plugin("kmq-exec"), "libkmq_exec.so");
    let sdk = workspace_dir().join("sdk/python");
    let script = dir.path("handler.py");
    std::fs::write(
        &script,
        format!(
            "import sys\nsys.path.insert(0, {sdk:?})\nfrom kmq_handler import Result, handler, run\n\n\
             @handler(\"traced\")\ndef traced(task):\n    {body}\n\nrun()\n",
            sdk = sdk.display().to_string()
        ),
    )
    .unwrap();
    let config = dir.config_with(
        redis,
        &format!("shutdown_grace = \"5s\"\n{daemon}"),
        &format!(
            "{}\n[plugins.handlers]\nfile = \"libkmq_exec.so\"\nconfig = {{ command = \"/usr/bin/python3\", \
             args = [\"{}\"], types = [\"traced\"], mode = \"persistent\" }}\n",
            safe_queue(&format!("keep_results = \"1h\"\n{queue}")),
            script.display(),
        ),
    );
    let daemon = Process::start_with_env(
        &config,
        dir.path("kmqd.log"),
        &[("OTEL_BSP_SCHEDULE_DELAY", "100")],
    );
    (config, daemon)
}

/// The trace context the handler of `id` was handed: its kept result.
fn handed(redis: &RedisServer, id: &str) -> serde_json::Value {
    eventually(Duration::from_secs(60), &format!("{id}'s result"), || {
        let kept = redis.kept_result("jobs", id);
        (kept.is_some(), kept)
    })
    .unwrap()["result"]
        .clone()
}

/// Pushes a traced task of type `kind`, whose handler returns the trace context it was handed as its result, and
/// checks that it was the run span's: the handler's own spans nest under the run, in the producer's trace.
fn handler_is_handed_the_run_span(
    config: &Path,
    redis: &RedisServer,
    receiver: &Receiver,
    kind: &str,
) {
    let task = NewTask::new(kind, "{}")
        .unwrap()
        .id("nested")
        .trace(traceparent(), Some("congo=t61rcWkgMzE".to_string()));
    assert!(client(config).push("jobs", task).unwrap().is_accepted());
    let seen = handed(redis, "nested");
    let spans = receiver.wait_for("the run's span", |spans| !spans.is_empty());
    assert_eq!(
        seen,
        serde_json::json!([
            format!("00-{TRACE_ID}-{}-01", spans[0].span_id),
            "congo=t61rcWkgMzE"
        ]),
        "{spans:#?}"
    );
    assert_eq!(spans[0].parent_span_id, PARENT_SPAN_ID);
}

#[test]
fn a_traced_run_hands_its_exec_handler_the_run_span_s_context() {
    let (redis, dir, receiver) = fixture();
    let (config, daemon) = start_python_handler(
        &redis,
        &dir,
        &format!("otlp_endpoint = \"{}\"", receiver.endpoint()),
    );
    handler_is_handed_the_run_span(&config, &redis, &receiver, "traced");
    stop(daemon);
}

#[test]
fn an_untraced_daemon_hands_its_exec_handler_the_producer_s_context_unchanged() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let (config, daemon) = start_python_handler(&redis, &dir, "");
    let task = NewTask::new("traced", "{}")
        .unwrap()
        .id("passed")
        .trace(traceparent(), None);
    assert!(client(&config).push("jobs", task).unwrap().is_accepted());
    let plain = NewTask::new("traced", "{}").unwrap().id("plain");
    assert!(client(&config).push("jobs", plain).unwrap().is_accepted());
    assert_eq!(
        handed(&redis, "passed"),
        serde_json::json!([traceparent(), null])
    );
    assert_eq!(handed(&redis, "plain"), serde_json::json!([null, null]));
    stop(daemon);
}

/// A C plugin reads the context through `kmq_host.traceparent` and `.tracestate` (tests/it/c/configurable.c).
#[test]
fn a_c_plugin_reads_the_run_s_trace_context_from_kmq_host() {
    let (redis, dir, receiver) = fixture();
    compile_c_plugin(
        &workspace_dir().join("tests/it/c/configurable.c"),
        &["PLUGIN_TRACE_RESULT", "PLUGIN_TYPE=\"c.traced\""],
        &dir.plugins_dir().join("libtraced.so"),
    );
    let config = dir.config_with(
        &redis,
        &format!("otlp_endpoint = \"{}\"", receiver.endpoint()),
        &format!(
            "{}\n[plugins.traced]\nfile = \"libtraced.so\"\n",
            safe_queue("keep_results = \"1h\"")
        ),
    );
    let daemon = Process::start_with_env(
        &config,
        dir.path("kmqd.log"),
        &[("OTEL_BSP_SCHEDULE_DELAY", "100")],
    );
    handler_is_handed_the_run_span(&config, &redis, &receiver, "c.traced");
    stop(daemon);
}

/// A traced task `overdue` whose Python handler writes the trace context it was handed into a file, then hangs;
/// `queue` the queue's extra keys. Returns once the handler wrote it, with that context.
fn start_a_hanging_run(
    redis: &RedisServer,
    dir: &TestDir,
    receiver: &Receiver,
    queue: &str,
) -> (PathBuf, Process, String) {
    let written = dir.path("handed");
    let (config, daemon) = start_python_handler_with(
        redis,
        dir,
        &format!("otlp_endpoint = \"{}\"", receiver.endpoint()),
        &format!(
            "if not task.data:\n        return Result(None)\n    \
             open({:?}, \"w\").write(task.traceparent)\n    import time\n    time.sleep(60)",
            written.display().to_string()
        ),
        queue,
    );
    // A first task starts the handler's process, whose start (Python's, on a busy machine) is then not part of
    // the timed run.
    let warm = NewTask::new("traced", "{}").unwrap().id("warm");
    assert!(client(&config).push("jobs", warm).unwrap().is_accepted());
    handed(redis, "warm");
    let task = NewTask::new("traced", r#"{"hang": true}"#)
        .unwrap()
        .id("overdue")
        .trace(traceparent(), None);
    assert!(client(&config).push("jobs", task).unwrap().is_accepted());
    let handed = eventually(Duration::from_secs(30), "the handler's file", || {
        let text = std::fs::read_to_string(&written).unwrap_or_default();
        (!text.is_empty(), text)
    });
    (config, daemon, handed)
}

/// Checks that the one span of `overdue` is the run's the handler was handed (`handed`), under the producer's,
/// with the `outcome` whoever took the run decided.
fn the_overdue_run_s_span_is_the_handed_one(receiver: &Receiver, handed: &str, outcome: &str) {
    let overdue = |span: &ReceivedSpan| span.attributes["messaging.message.id"] == "overdue";
    let spans = receiver.wait_for("the overdue run's span", |spans| spans.iter().any(overdue));
    let spans: Vec<_> = spans.into_iter().filter(overdue).collect();
    assert_eq!(
        handed,
        format!("00-{TRACE_ID}-{}-01", spans[0].span_id),
        "{spans:#?}"
    );
    assert_eq!(
        (
            spans.len(),
            spans[0].parent_span_id.as_str(),
            spans[0].attributes["kmqd.task.outcome"].as_str(),
        ),
        (1, PARENT_SPAN_ID, outcome),
        "{spans:#?}"
    );
}

/// The execution timeout ends a run whose handler still runs: the span it exports is the one the handler was
/// handed (its spans nest under it), not one with an id of its own.
#[test]
fn a_run_ended_by_the_execution_timeout_exports_the_span_its_handler_was_handed() {
    let (redis, dir, receiver) = fixture();
    let (_config, daemon, handed) = start_a_hanging_run(
        &redis,
        &dir,
        &receiver,
        "retry_times = 0\nexecution_timeout = \"2s\"",
    );
    the_overdue_run_s_span_is_the_handed_one(&receiver, &handed, "dead");
    stop(daemon);
}

/// Safe mode's shutdown hands back a run still going after `shutdown_grace`: its span too is the handler's.
#[test]
fn a_run_the_shutdown_hands_back_exports_the_span_its_handler_was_handed() {
    let (redis, dir, receiver) = fixture();
    let (_config, daemon, handed) = start_a_hanging_run(&redis, &dir, &receiver, "");
    stop(daemon);
    the_overdue_run_s_span_is_the_handed_one(&receiver, &handed, "back");
}

/// Spans the collector never got are counted on the metrics page: here every export fails (nothing listens).
#[test]
fn spans_an_export_lost_are_counted_in_kmqd_otel_spans_dropped_total() {
    let redis = RedisServer::start();
    let dir = TestDir::new();
    let (config, daemon) = start_traced_with(
        &redis,
        &dir,
        &format!("http://127.0.0.1:{}", free_port()),
        "metrics_addr = \"127.0.0.1:0\"",
    );
    let addr = daemon.metrics_addr();
    push_many(&config, "t", 10, "{}");
    wait_done(&config, 10, Duration::from_secs(60));
    eventually(
        Duration::from_secs(30),
        "ten spans counted as dropped",
        || {
            let page = scrape_with(addr, None, Duration::from_secs(10)).body;
            (
                page.lines()
                    .any(|line| line == "kmqd_otel_spans_dropped_total 10"),
                page,
            )
        },
    );
    stop(daemon);
}
