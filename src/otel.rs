//! Tracing over OpenTelemetry (`[daemon] otlp_endpoint`, docs/OPERATIONS.md, "Tracing"): one span per run of a
//! task, exported over OTLP (HTTP with protobuf) to a collector.
//!
//! A run's place in its trace ([`RunTrace`]: its span id, its start) is chosen when the run starts, so that the
//! handler is handed the run span's context and its own spans nest under the run; the span is made whole where
//! the run's outcome is decided, [`crate::queue::QueueContext::settle`], and ends there. Its parent is the
//! producer's W3C trace context, which the envelope carries in its `traceparent` and `tracestate` fields
//! (docs/CLIENTS.md). A run that another party ends while its handler still runs (the execution timeout,
//! a safe-mode shutdown) is exported with the span its handler was handed: the worker keeps a copy of the
//! [`RunTrace`] with the held task for that party. A task that no worker of this daemon started (handed back unrun,
//! recovered from a dead daemon) gets a span that starts at the decision. The envelope keeps both fields through a
//! retry, a recovery and a dead letter's requeue (they are fields kmqd does not decode, kept byte for byte), so
//! every run of one task is a child of the same producer's span, in the same trace. A task without them gets a root
//! span.
//!
//! A span never waits for the collector: ending it hands it to the SDK's batch processor, which queues it
//! (bounded, [`MAX_QUEUED_SPANS`]) and exports from a thread of its own; with the queue full (a collector down
//! or slow), the span is dropped. An export that fails loses its spans: [`Reported`] says so once, then every
//! [`SUMMARY_EVERY`] while exports keep failing, and once when one succeeds again (the SDK alone would log an
//! error per batch, many a second for a busy daemon whose collector is down). Both losses are counted in
//! `kmqd_otel_spans_dropped_total` (docs/OPERATIONS.md, "Metrics"): the SDK keeps its count of full-queue drops
//! to itself, so [`Gated`] bounds the queue in front of it, where a drop can be counted. Tracing is best effort;
//! tasks are not.

use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Span, SpanId, SpanKind, Status, TraceContextExt, TraceId, Tracer as _, TracerProvider,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, IdGenerator, RandomIdGenerator, SdkTracerProvider,
    SpanData, SpanExporter, SpanProcessor, Tracer,
};

use crate::observed::observed;
use crate::poison::lock;
use crate::policy::Action;
use crate::retry::SUMMARY_EVERY;
use crate::task::Envelope;

/// How many ended spans wait for the exporter at most; past it, spans are dropped, not waited for. At the SDK's
/// default (2,048) a collector that is down for its export timeout drops every span of a queue that runs a few
/// hundred tasks a second; 16,384 spans of about 1 KB each bound the memory the daemon spends on a dead collector
/// to some 16 MB.
pub(crate) const MAX_QUEUED_SPANS: usize = 16_384;

/// How long one export may take before the batch is given up (the SDK's default is 10 s): a collector that
/// accepts connections and never answers holds the export thread this long, while spans queue behind it.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the shutdown waits for the last spans to be exported, on top of the daemon's own drain.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// The daemon's exporter: a tracer for the spans, and the provider that owns the batch processor's thread.
#[derive(Debug)]
pub struct Exporter {
    provider: SdkTracerProvider,
    tracer: Tracer,
}

/// The exporter could not be made (an endpoint the HTTP client refuses, a thread that could not start).
#[derive(Debug, thiserror::Error)]
#[error("cannot export spans to otlp_endpoint {endpoint}: {reason}")]
pub struct ExporterError {
    endpoint: String,
    reason: String,
}

impl Exporter {
    /// Starts exporting to the collector at `endpoint`, the OTLP/HTTP base URL (`http://127.0.0.1:4318`): spans go
    /// to its `/v1/traces`, as `OTEL_EXPORTER_OTLP_ENDPOINT` would send them.
    pub fn start(endpoint: &str) -> Result<Exporter, ExporterError> {
        let error = |reason: String| ExporterError {
            endpoint: endpoint.to_string(),
            reason,
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(traces_url(endpoint))
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|build| error(build.to_string()))?;
        let queued = Arc::new(AtomicUsize::new(0));
        let exporter = Reported {
            inner: exporter,
            failures: Mutex::new(Failures::default()),
            queued: Arc::clone(&queued),
        };
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(MAX_QUEUED_SPANS)
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(Gated {
                inner: processor,
                queued,
                most: MAX_QUEUED_SPANS,
            })
            .with_resource(Resource::builder().with_service_name("kmqd").build())
            .build();
        let tracer = provider.tracer("kmqd");
        Ok(Exporter { provider, tracer })
    }

    /// A run of `envelope` starts now: its span's ids, chosen before the handler runs so that it can be
    /// handed them (the span itself is made at the settle, [`Exporter::run_span`]).
    pub(crate) fn begin(&self, envelope: &Envelope<'_>) -> Box<RunTrace> {
        let parent = parent_context(envelope);
        let ids = RandomIdGenerator::default();
        let (trace_id, sampled) = {
            let producer = parent.span();
            let producer = producer.span_context();
            if producer.is_valid() {
                (producer.trace_id(), producer.is_sampled())
            } else {
                // A root: the SDK's sampler (parent-based, always on) keeps it.
                (ids.new_trace_id(), true)
            }
        };
        Box::new(RunTrace {
            span_id: ids.new_span_id(),
            trace_id,
            sampled,
            started: SystemTime::now(),
            parent,
        })
    }

    /// The span of one run of `envelope` on `queue`, which came to `action`, ended now. `trace`: the run's own,
    /// when a worker started it ([`Exporter::begin`]); otherwise `ran_for`, how long its handler ran when one
    /// ran (the span then starts that long ago), or a moment (a task handed back or recovered unrun).
    pub(crate) fn run_span(
        &self,
        queue: &str,
        envelope: &Envelope<'_>,
        action: &Action,
        trace: Option<&RunTrace>,
        ran_for: Option<Duration>,
    ) {
        let now = SystemTime::now();
        let started = match trace {
            Some(trace) => trace.started,
            None => ran_for.and_then(|ran| now.checked_sub(ran)).unwrap_or(now),
        };
        let parent = match trace {
            Some(trace) => trace.parent.clone(),
            None => parent_context(envelope),
        };
        let mut attributes = vec![
            KeyValue::new("messaging.system", "kmqd"),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.operation.name", "run"),
            KeyValue::new("messaging.destination.name", queue.to_string()),
            KeyValue::new("messaging.message.id", envelope.id_str().to_string()),
            KeyValue::new("kmqd.task.type", envelope.kind.to_string()),
            KeyValue::new("kmqd.task.attempt", i64::from(envelope.attempt)),
            KeyValue::new("kmqd.task.outcome", outcome(action)),
        ];
        // Enqueue (or the producer's own `created_at`) to the run's start, both in ms since the epoch; Redis's
        // clock and this host's may differ by their skew.
        if let Some(created_at) = envelope.created_at {
            let started_ms = started
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |since| {
                    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
                });
            attributes.push(KeyValue::new(
                "kmqd.task.waited_ms",
                started_ms.saturating_sub(created_at).max(0),
            ));
        }
        let mut builder = self
            .tracer
            .span_builder(format!("kmqd.run {}", envelope.kind))
            .with_kind(SpanKind::Consumer)
            .with_start_time(started)
            .with_attributes(attributes);
        if let Some(trace) = trace {
            // The ids the handler was handed (the trace id is the parent's, when there is one).
            builder = builder
                .with_span_id(trace.span_id)
                .with_trace_id(trace.trace_id);
        }
        let mut span = builder.start_with_context(&self.tracer, &parent);
        if let Some(reason) = failure(action) {
            span.set_status(Status::error(reason.to_string()));
        }
        span.end_with_timestamp(now);
    }

    /// Exports what is queued and stops the export thread, waiting at most [`SHUTDOWN_TIMEOUT`].
    pub fn shut_down(&self) {
        if let Err(error) = self.provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
            tracing::warn!(%error, "the last spans may not have been exported");
        }
    }
}

/// The batch processor behind a bound of its own, so that the spans it would drop with its queue full are
/// counted: `queued` counts the spans handed on and not yet through an export ([`Reported`] takes them off), which
/// holds every span in the batch processor's queue, so that queue (as large as `most`) never fills, and a span
/// past `most` is dropped here, counted.
#[derive(Debug)]
struct Gated<P> {
    inner: P,
    queued: Arc<AtomicUsize>,
    most: usize,
}

impl<P: SpanProcessor> SpanProcessor for Gated<P> {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, context: &Context) {
        self.inner.on_start(span, context);
    }

    fn on_end(&self, span: SpanData) {
        if self.queued.fetch_add(1, Ordering::Relaxed) >= self.most {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            observed().spans_dropped.inc();
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, its failures reported without flooding the log (the module's doc) and counted in
/// `kmqd_otel_spans_dropped_total`.
#[derive(Debug)]
struct Reported<E> {
    inner: E,
    failures: Mutex<Failures>,
    /// [`Gated`]'s count of spans on their way, which an export's spans leave when it is over.
    queued: Arc<AtomicUsize>,
}

/// The current run of failed exports.
#[derive(Debug, Default)]
struct Failures {
    /// When the run began and when it was last reported; `None`: exports succeed.
    since: Option<(Instant, Instant)>,
    batches: u64,
    spans: u64,
}

impl<E: SpanExporter> SpanExporter for Reported<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let count = batch.len();
        let spans = count as u64;
        let result = self.inner.export(batch).await;
        self.queued.fetch_sub(count, Ordering::Relaxed);
        if result.is_err() {
            observed().spans_dropped.inc_by(spans);
        }
        // A poisoned lock only means a report panicked: the counts are still counts.
        let mut failures = lock(&self.failures);
        match result {
            Ok(()) => failures.exported(),
            Err(error) => failures.failed(spans, &error),
        }
        // Reported here: the SDK would log an error for every batch.
        Ok(())
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

impl Failures {
    fn failed(&mut self, spans: u64, error: &dyn std::fmt::Display) {
        self.batches += 1;
        self.spans += spans;
        let now = Instant::now();
        match &mut self.since {
            None => {
                self.since = Some((now, now));
                tracing::warn!(
                    %error,
                    spans,
                    "cannot export spans to otlp_endpoint; they are dropped until the collector takes them again \
                     (tasks are not affected)"
                );
            }
            Some((since, reported)) if reported.elapsed() >= SUMMARY_EVERY => {
                *reported = now;
                tracing::error!(
                    %error,
                    batches = self.batches,
                    spans = self.spans,
                    for_s = since.elapsed().as_secs(),
                    "still cannot export spans to otlp_endpoint; they are dropped"
                );
            }
            Some(_) => {}
        }
    }

    fn exported(&mut self) {
        if let Some((since, _)) = self.since.take() {
            tracing::info!(
                lost_spans = self.spans,
                after_s = since.elapsed().as_secs(),
                "exporting spans to otlp_endpoint again"
            );
            (self.batches, self.spans) = (0, 0);
        }
    }
}

/// One run's place in its trace, from its start to its settle (boxed in [`crate::settlement::Ran`], which a
/// run without tracing carries as a null pointer).
#[derive(Clone, Debug)]
pub(crate) struct RunTrace {
    /// The run span's own id.
    span_id: SpanId,
    /// The producer's trace, or a new one for a task pushed without a trace context.
    trace_id: TraceId,
    /// The producer's sampled flag (a root is sampled): a handler's spans under an unsampled run are not kept.
    sampled: bool,
    started: SystemTime,
    /// The producer's context (the empty context for a root), read once from the envelope.
    parent: Context,
}

impl RunTrace {
    /// The run span's context as a W3C `traceparent`, for the handler (its `tracestate` is the producer's).
    pub(crate) fn traceparent(&self) -> String {
        format!(
            "00-{}-{}-{}",
            self.trace_id,
            self.span_id,
            if self.sampled { "01" } else { "00" }
        )
    }
}

/// The OTLP/HTTP traces URL under the base `endpoint` (the OTLP exporter spec's "Endpoint URLs for OTLP/HTTP").
fn traces_url(endpoint: &str) -> String {
    format!("{}/v1/traces", endpoint.trim_end_matches('/'))
}

/// The producer's context, from the envelope's `traceparent` and `tracestate`; the empty context (a root span)
/// when there is none or it is malformed (the W3C rule: an invalid traceparent is ignored, not an error).
fn parent_context(envelope: &Envelope<'_>) -> Context {
    let fields = TraceFields {
        traceparent: string_field(envelope, "traceparent"),
        tracestate: string_field(envelope, "tracestate"),
    };
    if fields.traceparent.is_none() {
        return Context::new();
    }
    let context = TraceContextPropagator::new().extract(&fields);
    if context.span().span_context().is_valid() {
        context
    } else {
        Context::new()
    }
}

/// An envelope field kmqd does not decode, as a string (`None`: absent, or not a JSON string).
pub(crate) fn string_field(envelope: &Envelope<'_>, name: &str) -> Option<String> {
    let (_, raw) = envelope.extra.iter().find(|(key, _)| key == name)?;
    serde_json::from_str::<Cow<'_, str>>(raw.get())
        .ok()
        .map(Cow::into_owned)
}

/// The two fields of the W3C trace context, as the propagator reads them.
struct TraceFields {
    traceparent: Option<String>,
    tracestate: Option<String>,
}

impl Extractor for TraceFields {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => self.traceparent.as_deref(),
            "tracestate" => self.tracestate.as_deref(),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

/// The span's `kmqd.task.outcome`: what the settlement did with the task, in the words of the log and metrics.
fn outcome(action: &Action) -> &'static str {
    match action {
        Action::Ack => "done",
        Action::Retry { .. } => "retry",
        Action::Recover { .. } => "recover",
        Action::Dead { .. } => "dead",
        Action::Throttle { .. } => "throttle",
        Action::Back { .. } => "back",
    }
}

/// Why the run failed, for the span's error status: a retry or a dead letter (a throttle is the handler's
/// back-pressure, not a failure).
fn failure(action: &Action) -> Option<&str> {
    match action {
        Action::Retry { reason, .. } | Action::Dead { reason } => Some(reason),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch processor whose export never ends: it takes every span and lets none go.
    #[derive(Debug)]
    struct Stalled;

    impl SpanProcessor for Stalled {
        fn on_start(&self, _: &mut opentelemetry_sdk::trace::Span, _: &Context) {}
        fn on_end(&self, _: SpanData) {}
        fn force_flush(&self) -> OTelSdkResult {
            Ok(())
        }
        fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
            Ok(())
        }
    }

    #[test]
    fn a_span_past_the_queue_s_bound_is_dropped_and_counted() {
        let queued = Arc::new(AtomicUsize::new(0));
        let provider = SdkTracerProvider::builder()
            .with_span_processor(Gated {
                inner: Stalled,
                queued: Arc::clone(&queued),
                most: 2,
            })
            .build();
        let tracer = provider.tracer("test");
        let before = observed().spans_dropped.get();
        for _ in 0..3 {
            tracer.start("run").end();
        }
        // Other tests of this process may drop spans too, never fewer.
        assert!(observed().spans_dropped.get() > before);
        assert_eq!(queued.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn traces_go_to_v1_traces_under_the_endpoint() {
        for (endpoint, expected) in [
            ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
            ("http://127.0.0.1:4318/", "http://127.0.0.1:4318/v1/traces"),
            (
                "http://otel.example/otlp",
                "http://otel.example/otlp/v1/traces",
            ),
        ] {
            assert_eq!(traces_url(endpoint), expected);
        }
    }

    #[test]
    fn the_envelope_s_traceparent_is_the_parent_and_a_bad_one_makes_a_root() {
        let check = |payload: &str, parent: Option<(&str, &str)>| {
            let envelope = Envelope::decode(payload).unwrap();
            let context = parent_context(&envelope);
            let span = context.span();
            let found = span.span_context();
            match parent {
                Some((trace, span_id)) => {
                    assert!(found.is_remote(), "{payload}");
                    assert_eq!(found.trace_id().to_string(), trace, "{payload}");
                    assert_eq!(found.span_id().to_string(), span_id, "{payload}");
                }
                None => assert!(!found.is_valid(), "{payload}"),
            }
        };
        let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
        check(
            r#"{"type":"t","traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","tracestate":"k=v"}"#,
            Some((trace, "00f067aa0ba902b7")),
        );
        check(r#"{"type":"t"}"#, None);
        check(r#"{"type":"t","traceparent":"nonsense"}"#, None);
        check(r#"{"type":"t","traceparent":42}"#, None);
        check(
            r#"{"type":"t","traceparent":"00-00000000000000000000000000000000-00f067aa0ba902b7-01"}"#,
            None,
        );
    }
}
