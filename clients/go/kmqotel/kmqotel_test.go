package kmqotel

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
	kmq "github.com/kmqd/kmqd/clients/go"
	"go.opentelemetry.io/otel/trace"
)

// TestPushWritesTheSpanOfItsContextIntoTheEnvelope pushes through a redis-server of its own (a unix socket in a
// temp dir, no TCP port) and reads the envelopes back.
func TestPushWritesTheSpanOfItsContextIntoTheEnvelope(t *testing.T) {
	pool := startRedis(t)
	client := kmq.NewWithPool(pool)
	traceID, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	spanID, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	state, err := trace.ParseTraceState("congo=t61rcWkgMzE")
	if err != nil {
		t.Fatal(err)
	}
	span := trace.NewSpanContext(trace.SpanContextConfig{TraceID: traceID, SpanID: spanID,
		TraceFlags: trace.FlagsSampled, TraceState: state})
	ctx := trace.ContextWithSpanContext(context.Background(), span)
	steps := []func() (string, error){
		func() (string, error) { return Push(ctx, client, "mail", "t", nil, kmq.WithID("traced")) },
		func() (string, error) {
			return Push(context.Background(), client, "mail", "t", nil, kmq.WithID("plain"))
		},
		func() (string, error) {
			return Push(ctx, client, "mail", "t", nil, kmq.WithID("explicit"),
				kmq.WithTraceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", ""))
		},
	}
	for _, push := range steps {
		if _, err := push(); err != nil {
			t.Fatal(err)
		}
	}
	ids, err := client.PushBatch(ctx, "mail", []kmq.Task{{Type: "t", Options: []kmq.PushOption{Trace(ctx), kmq.WithID("batched")}}})
	if err != nil || len(ids) != 1 {
		t.Fatalf("PushBatch: %v %v", ids, err)
	}
	conn := pool.Get()
	defer conn.Close()
	payloads, err := redis.Strings(conn.Do("LRANGE", "kmq:{mail}:ready:normal", 0, -1))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][2]string{}
	for _, payload := range payloads {
		var envelope struct{ ID, Traceparent, Tracestate string }
		if err := json.Unmarshal([]byte(payload), &envelope); err != nil {
			t.Fatal(err)
		}
		got[envelope.ID] = [2]string{envelope.Traceparent, envelope.Tracestate}
	}
	producer := [2]string{"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "congo=t61rcWkgMzE"}
	want := map[string][2]string{
		"traced":   producer,
		"plain":    {"", ""},
		"explicit": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", ""},
		"batched":  producer,
	}
	for id, fields := range want {
		if got[id] != fields {
			t.Errorf("task %s: traceparent and tracestate %q, want %q", id, got[id], fields)
		}
	}
}

// startRedis starts a redis-server on a unix socket in a temp dir (killed when the test ends), and returns a pool
// of connections to it once it answers PING (within 10 s).
func startRedis(t *testing.T) *redis.Pool {
	t.Helper()
	dir := t.TempDir()
	socket := filepath.Join(dir, "redis.sock")
	cmd := exec.Command("redis-server", "--port", "0", "--unixsocket", socket, "--save", "", "--appendonly", "no",
		"--dir", dir, "--logfile", filepath.Join(dir, "redis.log"))
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting redis-server (install Debian's redis-server): %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	pool := &redis.Pool{Dial: func() (redis.Conn, error) { return redis.Dial("unix", socket) }}
	t.Cleanup(func() { pool.Close() })
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		conn := pool.Get()
		_, err := conn.Do("PING")
		conn.Close()
		if err == nil {
			return pool
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "redis.log"))
			t.Fatalf("redis-server did not answer PING within 10 s: %v\n%s", err, log)
		}
	}
}
