package kmq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/gomodule/redigo/redis"
)

// 1,001 waiting tasks of one queue take two flow_push.lua calls (each all or nothing, none too long for Redis),
// and the task they all wait for is pushed last, carrying every one of them as a waiter.
func TestAFlowOfMoreWaitingTasksThanACallTakesIsWrittenInCallsOf1000(t *testing.T) {
	server := startRedis(t)
	client := newClient(t, server.url())
	parts := make([]map[string]interface{}, 1001)
	for n := range parts {
		parts[n] = map[string]interface{}{"queue": "parts", "type": "part.build", "id": fmt.Sprintf("p-%d", n),
			"after": []interface{}{map[string]string{"queue": "fetch", "id": "f"}}}
	}
	parts[0]["after"] = []interface{}{map[string]string{"queue": "fetch", "type": "fetch.csv", "id": "f"}}
	flow, _ := json.Marshal(map[string]interface{}{"queue": "reports", "type": "report.merge", "id": "r", "after": parts})
	tasks, err := client.PushFlow(context.Background(), flow)
	if err != nil || len(tasks) != 1003 || tasks[0].ID != "r" || tasks[1].ID != "p-0" || tasks[2].ID != "f" {
		t.Fatalf("%d tasks (%v), %v", len(tasks), tasks[:3], err)
	}
	conn := server.conn(t)
	stats, _ := redis.String(conn.Do("INFO", "commandstats"))
	// reports: 1 call, parts: 2, fetch's push: 1.
	if !strings.Contains(stats, "cmdstat_evalsha:calls=4,") {
		t.Fatalf("want 4 EVALSHA calls:\n%s", stats)
	}
	if waiting, _ := redis.Int(conn.Do("HLEN", "kmq:{parts}:deps-waiting")); waiting != 1001 {
		t.Fatalf("%d waiting parts", waiting)
	}
	fetch, _ := redis.Bytes(conn.Do("LINDEX", "kmq:{fetch}:ready:normal", 0))
	var envelope struct{ Waiters []flowWaiter }
	if err := json.Unmarshal(fetch, &envelope); err != nil || len(envelope.Waiters) != 1001 {
		t.Fatalf("%d waiters, %v", len(envelope.Waiters), err)
	}
}

func TestABadFlowNamesTheNodeAndWritesNothing(t *testing.T) {
	server := startRedis(t)
	client := newClient(t, server.url())
	for _, bad := range []struct{ flow, path, reason string }{
		{`{"queue": "a", "type": "t", "after": [{"queue": "b", "type": "t", "colour": 1}]}`, "after[0]", "colour"},
		{`{"queue": "a", "type": "t", "after": [{"queue": "b", "type": "t", "after": [7]}]}`, "after[0].after[0]",
			"a node is a JSON object"},
		{`{"queue": "a", "id": "x"}`, "the root", "not a reference"},
		{`{"queue": "a", "type": "t"`, "the root", "a node is a JSON object"},
	} {
		_, err := client.PushFlow(context.Background(), []byte(bad.flow))
		var refused *FlowError
		if !errors.As(err, &refused) || refused.Path != bad.path || !strings.Contains(refused.Reason, bad.reason) ||
			!errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: %v", bad.flow, err)
		}
	}
	if keys, _ := redis.Strings(server.conn(t).Do("KEYS", "*")); len(keys) != 0 {
		t.Fatalf("written: %v", keys)
	}
}
