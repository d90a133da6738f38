package kmq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

func newClient(t *testing.T, url string) *Client {
	t.Helper()
	client, err := New(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	return client
}

// The scripts this package ships are the broker's, byte for byte (scripts/test also compares them with cmp).
func TestShippedScriptsAreTheBrokersByteForByte(t *testing.T) {
	for _, name := range []string{"push.lua", "checks.lua", "remove.lua", "unique_hold.lua", "deps.lua", "flow_push.lua"} {
		ours, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		theirs, err := os.ReadFile("../../src/broker/scripts/" + name)
		if err != nil {
			t.Skipf("not in a kmqd checkout: %v", err)
		}
		if string(ours) != string(theirs) {
			t.Errorf("clients/go/%s differs from src/broker/scripts/%s: copy it again", name, name)
		}
	}
}

func TestPushWritesTheEnvelopeAndReturnsTheGivenID(t *testing.T) {
	server := startRedis(t)
	client := newClient(t, server.url())
	id, err := client.Push(context.Background(), "mail", "mail.send", map[string]string{"to": "a<b>"},
		WithID("order-1"), WithTraceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "k=v"))
	if err != nil || id != "order-1" {
		t.Fatalf("push: %q, %v", id, err)
	}
	stored, err := redis.String(server.conn(t).Do("LINDEX", "kmq:{mail}:ready:normal", 0))
	if err != nil {
		t.Fatal(err)
	}
	var envelope map[string]interface{}
	if err := json.Unmarshal([]byte(stored), &envelope); err != nil {
		t.Fatalf("%q: %v", stored, err)
	}
	if envelope["traceparent"] != "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" ||
		envelope["tracestate"] != "k=v" || !strings.Contains(stored, `"to":"a<b>"`) {
		t.Fatalf("envelope %s", stored)
	}
}

func TestAUniquePushOfALiveIDIsErrDuplicate(t *testing.T) {
	server := startRedis(t)
	client := newClient(t, server.url())
	ctx := context.Background()
	if _, err := client.Push(ctx, "mail", "mail.send", nil, WithID("w-1"), Unique()); err != nil {
		t.Fatal(err)
	}
	id, err := client.Push(ctx, "mail", "mail.send", nil, WithID("w-1"), Unique())
	if !errors.Is(err, ErrDuplicate) || id != "w-1" {
		t.Fatalf("second push: %q, %v; want ErrDuplicate", id, err)
	}
	ids, err := client.PushBatch(ctx, "mail", []Task{
		{Type: "a", Options: []PushOption{WithID("w-2"), Unique()}},
		{Type: "a", Options: []PushOption{WithID("w-1"), Unique()}}})
	var duplicate *DuplicateError
	if !errors.As(err, &duplicate) || !errors.Is(err, ErrDuplicate) || len(ids) != 2 ||
		fmt.Sprint(duplicate.IDs) != "[w-1]" {
		t.Fatalf("batch: %v, %v", ids, err)
	}
}

func TestAUniqueForPushOfAnIDHeldAfterItsTaskEndedIsErrDuplicate(t *testing.T) {
	server := startRedis(t)
	client := newClient(t, server.url())
	conn := server.conn(t)
	ctx := context.Background()
	// The hold key stands for a task of w-1 that ended less than its window ago (docs/PROTOCOL.md, "Debounce, and
	// unique for a time"): push.lua refuses every unique push of w-1 while it exists.
	if _, err := conn.Do("SET", "kmq:{mail}:unique:held:w-1", "1765000000000", "PX", 600000); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Push(ctx, "mail", "t", nil, WithID("w-1"), UniqueFor(time.Hour)); !errors.Is(err, ErrDuplicate) {
		t.Fatalf("push of a held id: %v; want ErrDuplicate", err)
	}
	if _, err := conn.Do("DEL", "kmq:{mail}:unique:held:w-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Push(ctx, "mail", "t", nil, WithID("w-1"), UniqueFor(time.Hour)); err != nil {
		t.Fatalf("push once the hold expired: %v", err)
	}
	field, err := redis.String(conn.Do("HGET", "kmq:{mail}:unique", "w-1"))
	if err != nil || !strings.HasSuffix(field, ":3600000") {
		t.Fatalf("the unique hash's field %q (%v), want NOW:3600000", field, err)
	}
	stored, _ := redis.String(conn.Do("LINDEX", "kmq:{mail}:ready:normal", 0))
	if !strings.Contains(stored, `"unique":true`) {
		t.Fatalf("envelope %s, want unique", stored)
	}
}

func TestBadArgumentsAreRefusedWithNothingWritten(t *testing.T) {
	server := startRedis(t)
	client := newClient(t, server.url())
	ctx := context.Background()
	cases := map[string][]PushOption{
		"empty group":             {WithGroup("")},
		"group over 64 bytes":     {WithGroup(strings.Repeat("g", 65))},
		"unique without id":       {Unique()},
		"bad traceparent":         {WithTraceparent("nope", "")},
		"negative delay":          {WithDelay(-time.Second)},
		"expiry both ways":        {ExpiresAt(time.Now().Add(time.Minute)), ExpiresIn(time.Minute)},
		"negative expiry":         {ExpiresIn(-time.Second)},
		"debounce without id":     {Debounce(time.Second)},
		"debounce and delay":      {WithID("d"), Debounce(time.Second), WithDelay(time.Second)},
		"unique for without id":   {UniqueFor(time.Second)},
		"unique for 0":            {WithID("u"), UniqueFor(0)},
		"unique for too long":     {WithID("u"), UniqueFor(MaxUniqueFor + time.Millisecond)},
		"debounce and unique for": {WithID("d"), Debounce(time.Second), UniqueFor(time.Second)},
	}
	for name, options := range cases {
		if _, err := client.Push(ctx, "mail", "mail.send", nil, options...); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", name, err)
		}
	}
	if _, err := client.Push(ctx, "mail", "", nil); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("no type: %v", err)
	}
	if _, err := client.Push(ctx, "mail", "t", func() {}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("data that is not JSON: %v", err)
	}
	if _, err := client.Push(ctx, "mail", "t", nil, WithPriority("urgent")); !errors.Is(err, ErrUnknownPriority) {
		t.Errorf("unknown priority: %v", err)
	}
	keys, _ := redis.Strings(server.conn(t).Do("KEYS", "*"))
	if len(keys) != 0 {
		t.Fatalf("keys written: %v", keys)
	}
}

func TestPriorityLevelsAreReadFromTheQueuesMeta(t *testing.T) {
	server := startRedis(t)
	conn := server.conn(t)
	if _, err := conn.Do("HSET", "kmq:{mail}:meta", "protocol", "1", "levels", "high,low", "default_priority", "low"); err != nil {
		t.Fatal(err)
	}
	client := newClient(t, server.url())
	ctx := context.Background()
	if _, err := client.Push(ctx, "mail", "t", nil, WithPriority("high")); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Push(ctx, "mail", "t", nil); err != nil {
		t.Fatal(err)
	}
	high, _ := redis.Int(conn.Do("LLEN", "kmq:{mail}:ready:high"))
	low, _ := redis.Int(conn.Do("LLEN", "kmq:{mail}:ready:low"))
	if high != 1 || low != 1 {
		t.Fatalf("high %d, low %d", high, low)
	}
	// The rule of every client (docs/CLIENTS.md): a priority the kept levels lack reads them again before it is
	// refused, so a level an operator adds is known at the first push that names it.
	if _, err := conn.Do("HSET", "kmq:{mail}:meta", "levels", "urgent,high,low"); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Push(ctx, "mail", "t", nil, WithPriority("urgent")); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Push(ctx, "mail", "t", nil, WithPriority("normal")); !errors.Is(err, ErrUnknownPriority) {
		t.Fatalf("normal: %v", err)
	}
}

func TestRedisUnreachableIsErrUnreachable(t *testing.T) {
	client := newClient(t, fmt.Sprintf("redis://127.0.0.1:%d/0", freePort(t)))
	_, err := client.Push(context.Background(), "mail", "mail.send", nil)
	if !errors.Is(err, ErrUnreachable) || errors.Is(err, ErrReplyLost) {
		t.Fatalf("%v, want ErrUnreachable", err)
	}
}

// A connection that breaks after push.lua was written is "may have been pushed", and the task is in fact there.
func TestAReplyLostAfterTheCommandWasWrittenIsErrReplyLost(t *testing.T) {
	server := startRedis(t)
	proxy := startReplyDropper(t, server.addr())
	client := newClient(t, proxy.url())
	ctx := context.Background()
	if _, err := client.Push(ctx, "mail", "warm.up", nil); err != nil { // loads the levels and the script
		t.Fatal(err)
	}
	proxy.arm()
	_, err := client.Push(ctx, "mail", "mail.send", nil, WithID("lost-1"))
	if !errors.Is(err, ErrReplyLost) || errors.Is(err, ErrUnreachable) {
		t.Fatalf("%v, want ErrReplyLost", err)
	}
	conn := server.conn(t)
	eventually(t, 10*time.Second, "the task whose reply was lost is in the ready list", func() bool {
		n, _ := redis.Int(conn.Do("LLEN", "kmq:{mail}:ready:normal"))
		return n == 2
	}, nil)
}

func TestNoscriptFallsBackToEval(t *testing.T) {
	server := startRedis(t)
	client := newClient(t, server.url())
	ctx := context.Background()
	if _, err := client.Push(ctx, "mail", "a", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := server.conn(t).Do("SCRIPT", "FLUSH"); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Push(ctx, "mail", "b", nil); err != nil {
		t.Fatalf("after SCRIPT FLUSH: %v", err)
	}
}

func TestABatchMakesOnePushCallPer1000Tasks(t *testing.T) {
	server := startRedis(t)
	client := newClient(t, server.url())
	tasks := make([]Task, 2500)
	for n := range tasks {
		tasks[n] = Task{Type: "n", Data: n}
	}
	ids, err := client.PushBatch(context.Background(), "mail", tasks)
	if err != nil || len(ids) != 2500 {
		t.Fatalf("%d ids, %v", len(ids), err)
	}
	conn := server.conn(t)
	stats, _ := redis.String(conn.Do("INFO", "commandstats"))
	if !strings.Contains(stats, "cmdstat_evalsha:calls=3,") {
		t.Fatalf("want 3 EVALSHA calls:\n%s", stats)
	}
	last, _ := redis.String(conn.Do("LINDEX", "kmq:{mail}:ready:normal", -1))
	if envelopeID(last) != ids[2499] || !strings.Contains(last, `"data":2499`) {
		t.Fatalf("last %s", last)
	}
}

func TestShowAndCancelAWaitingTask(t *testing.T) {
	server := startRedis(t)
	client := newClient(t, server.url())
	ctx := context.Background()
	if _, err := client.Push(ctx, "mail", "a", nil, WithID("d-1"), WithDelay(time.Minute), Unique()); err != nil {
		t.Fatal(err)
	}
	found, err := client.Show(ctx, "mail", "d-1")
	if err != nil || len(found) != 1 || found[0].State != "delayed" || *found[0].DueInMs <= 50_000 {
		t.Fatalf("%+v, %v", found, err)
	}
	if removed, err := client.Cancel(ctx, "mail", "d-1"); removed != 1 || err != nil {
		t.Fatalf("cancel: %d, %v", removed, err)
	}
	if _, err := client.Push(ctx, "mail", "a", nil, WithID("d-1"), Unique()); err != nil {
		t.Fatalf("the cancelled task's unique id is free again: %v", err)
	}
}

func TestResultReadsWhatTheSettleKept(t *testing.T) {
	server := startRedis(t)
	client := newClient(t, server.url())
	ctx := context.Background()
	conn := server.conn(t)
	if _, err := conn.Do("HSET", "kmq:{r}:results:1000", "t-1", `{"ended_at":5,"state":"done","result":{"rows":3}}`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Do("ZADD", "kmq:{r}:results", 4102444800000, "1000"); err != nil {
		t.Fatal(err)
	}
	result, err := client.Result(ctx, "r", "t-1", 0)
	if err != nil || result.State != "done" || string(result.Result) != `{"rows":3}` {
		t.Fatalf("%+v, %v", result, err)
	}
	if _, err := client.Result(ctx, "r", "nobody", 20*time.Millisecond); !errors.Is(err, ErrNoResult) {
		t.Fatalf("%v, want ErrNoResult", err)
	}
	if _, err := client.Push(ctx, "r", "a", nil, WithID("w-1")); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Result(ctx, "r", "w-1", 0); !errors.Is(err, ErrPending) {
		t.Fatalf("%v, want ErrPending", err)
	}
}

func TestAKeyOfTheWrongTypeIsErrRefusedWithNothingWritten(t *testing.T) {
	server := startRedis(t)
	conn := server.conn(t)
	if _, err := conn.Do("SET", "kmq:{mail}:stats", "not a hash"); err != nil {
		t.Fatal(err)
	}
	client := newClient(t, server.url())
	_, err := client.Push(context.Background(), "mail", "mail.send", nil)
	var reply redis.Error
	if !errors.Is(err, ErrRefused) || !errors.As(err, &reply) || !strings.Contains(err.Error(), "WRONGTYPE") {
		t.Fatalf("%v, want ErrRefused with push.lua's WRONGTYPE", err)
	}
	if n, _ := redis.Int(conn.Do("DBSIZE")); n != 1 {
		t.Fatalf("%d keys, want only the stats string", n)
	}
}

// The producers' rules of docs/OPERATIONS.md, as the Python client's test has them, without and with the read of
// the meta hash that today's rules add.
const producerRules = "+evalsha +eval +script|load +time +info +wait +rpush +lpush +ltrim +hget +hsetnx +hdel " +
	"+hincrby +zadd +zrange +type +publish ~kmq:{*}:ready:* ~kmq:{*}:delayed:* ~kmq:{*}:delayed-tasks " +
	"~kmq:{*}:wake ~kmq:{*}:unique ~kmq:{*}:stats ~kmq:{*}:routes ~kmq:{*}:flow:* ~kmq:{*}:ring:* " +
	"~kmq:{*}:sched &kmq:{*}:delay-wake"

func TestAProducerUserReadsTheLevelsWithTodaysRulesAndPushesToNormalOnOlderOnes(t *testing.T) {
	server := startRedis(t)
	conn := server.conn(t)
	if _, err := conn.Do("HSET", "kmq:{mail}:meta", "levels", "high,normal", "default_priority", "normal"); err != nil {
		t.Fatal(err)
	}
	for user, extra := range map[string]string{"today": " %R~kmq:{*}:meta", "older": ""} {
		args := []interface{}{"SETUSER", user, "reset", "on", ">pw"}
		for _, rule := range strings.Fields(producerRules + extra) {
			args = append(args, rule)
		}
		if _, err := conn.Do("ACL", args...); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	today := newClient(t, fmt.Sprintf("redis://today:pw@%s/0", server.addr()))
	if _, err := today.Push(ctx, "mail", "t", nil, WithPriority("high")); err != nil {
		t.Fatalf("today's rules: %v", err)
	}
	older := newClient(t, fmt.Sprintf("redis://older:pw@%s/0", server.addr()))
	if _, err := older.Push(ctx, "mail", "t", nil); err != nil {
		t.Fatalf("older rules: %v", err)
	}
	if _, err := older.Push(ctx, "mail", "t", nil, WithPriority("high")); !errors.Is(err, ErrUnknownPriority) {
		t.Fatalf("older rules, priority high: %v, want ErrUnknownPriority", err)
	}
	high, _ := redis.Int(conn.Do("LLEN", "kmq:{mail}:ready:high"))
	normal, _ := redis.Int(conn.Do("LLEN", "kmq:{mail}:ready:normal"))
	if high != 1 || normal != 1 {
		t.Fatalf("high %d, normal %d", high, normal)
	}
}
