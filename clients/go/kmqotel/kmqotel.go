// Package kmqotel pushes kmqd tasks in the trace of the caller's context: the W3C trace context of the span in
// ctx goes into the task's envelope (`traceparent`, `tracestate`), so that the daemon's run span, and the
// handler's spans under it, join the producer's trace (docs/CLIENTS.md, "Tracing" under Go).
//
// It is a package (and a module) of its own so that the kmq client does not depend on OpenTelemetry: only a
// program that imports kmqotel builds go.opentelemetry.io/otel.
package kmqotel

import (
	"context"

	kmq "github.com/kmqd/kmqd/clients/go"
	"go.opentelemetry.io/otel/propagation"
)

// Push is client.Push with the trace context of ctx's span in the envelope (none when ctx has no valid span).
// A kmq.WithTraceparent among options wins over it.
func Push(ctx context.Context, client *kmq.Client, queue, taskType string, data interface{},
	options ...kmq.PushOption) (string, error) {
	return client.Push(ctx, queue, taskType, data, append([]kmq.PushOption{Trace(ctx)}, options...)...)
}

// Trace is the push option that writes the trace context of ctx's span into a task's envelope, for the tasks of a
// PushBatch (kmq.Task's Options); put it before a kmq.WithTraceparent that should win over it.
func Trace(ctx context.Context) kmq.PushOption {
	// W3C's propagator itself, not the global one: the envelope's fields are W3C's, whatever propagators the
	// program registered for its own HTTP calls (the global one is a no-op until a program sets one).
	// A HeaderCarrier rather than a MapCarrier: Debian's API (1.1.0) predates the latter.
	carrier := propagation.HeaderCarrier{}
	propagation.TraceContext{}.Inject(ctx, carrier)
	return kmq.WithTraceparent(carrier.Get("traceparent"), carrier.Get("tracestate"))
}
