package kmq

import (
	"context"
	"fmt"
	"os"
	"sort"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// The push rate of docs/CLIENTS.md ("Go", "Push rate"), run by hand: KMQ_BENCH=1 clients/go/run-tests -run
// PushRate -v. It measures, on a redis-server it starts, PushBatch of 100,000 small tasks against redigo's own
// pipeline of RPUSH (1,000 a flush, as PushBatch makes one call per 1,000), and 10,000 single Pushes against
// 10,000 single RPUSHes, each the median of 3 runs.
func TestPushRate(t *testing.T) {
	if os.Getenv("KMQ_BENCH") == "" {
		t.Skip("a measurement, not a test: KMQ_BENCH=1 runs it")
	}
	server := startRedis(t)
	client := newClient(t, server.url())
	conn := server.conn(t)
	ctx := context.Background()
	const batch, single = 100_000, 10_000
	data := map[string]int{"n": 1}
	median := func(what string, tasks int, run func()) {
		var rates []float64
		for round := 0; round < 3; round++ {
			if _, err := conn.Do("FLUSHALL"); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			run()
			rates = append(rates, float64(tasks)/time.Since(start).Seconds())
		}
		sort.Float64s(rates)
		fmt.Printf("%-44s %9.0f tasks/s (runs: %.0f %.0f %.0f)\n", what, rates[1], rates[0], rates[1], rates[2])
	}
	tasks := make([]Task, batch)
	for n := range tasks {
		tasks[n] = Task{Type: "bench", Data: data}
	}
	median("kmq PushBatch, 100,000 tasks", batch, func() {
		if _, err := client.PushBatch(ctx, "bench", tasks); err != nil {
			t.Fatal(err)
		}
	})
	median("redigo pipeline of RPUSH, 100,000 tasks", batch, func() {
		for start := 0; start < batch; start += BatchSize {
			for n := start; n < start+BatchSize; n++ {
				payload, _ := encodeJSON(envelope{ID: newUUID(), Type: "bench", Data: []byte(`{"n":1}`)})
				_ = conn.Send("RPUSH", "kmq:{bench}:ready:normal", payload)
			}
			if _, err := conn.Do(""); err != nil { // flushes and reads every reply
				t.Fatal(err)
			}
		}
	})
	median("kmq Push, 10,000 single pushes", single, func() {
		for n := 0; n < single; n++ {
			if _, err := client.Push(ctx, "bench", "bench", data); err != nil {
				t.Fatal(err)
			}
		}
	})
	median("redigo RPUSH, 10,000 single commands", single, func() {
		for n := 0; n < single; n++ {
			payload, _ := encodeJSON(envelope{ID: newUUID(), Type: "bench", Data: []byte(`{"n":1}`)})
			if _, err := redis.Int(conn.Do("RPUSH", "kmq:{bench}:ready:normal", payload)); err != nil {
				t.Fatal(err)
			}
		}
	})
}
