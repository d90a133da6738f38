package kmq

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// The conformance suite (clients/conformance/README.md): every case of clients/conformance/cases runs against
// a redis-server this test starts, flushed between cases. KMQ_CONFORMANCE_CASES names another folder of cases.
func TestConformance(t *testing.T) {
	folder := os.Getenv("KMQ_CONFORMANCE_CASES")
	if folder == "" {
		folder = filepath.Join("..", "conformance", "cases")
	}
	if _, err := os.Stat(folder); os.IsNotExist(err) {
		t.Skipf("no folder %s: the conformance suite is not in this checkout", folder)
	}
	files, _ := filepath.Glob(filepath.Join(folder, "*.json"))
	if len(files) == 0 {
		t.Fatalf("no conformance cases in %s", folder)
	}
	server := startRedis(t)
	conn := server.conn(t)
	for _, file := range files {
		file := file
		t.Run(strings.TrimSuffix(filepath.Base(file), ".json"), func(t *testing.T) {
			if _, err := conn.Do("FLUSHALL"); err != nil {
				t.Fatal(err)
			}
			runCase(t, file, server, conn)
		})
	}
}

type conformanceCase struct {
	Name   string            `json:"name"`
	Skip   map[string]string `json:"skip"`
	Given  [][]interface{}   `json:"given"`
	Client struct {
		KeyPrefix string `json:"key_prefix"`
	} `json:"client"`
	Calls []map[string]interface{} `json:"calls"`
	Then  struct {
		Keys map[string]map[string]interface{} `json:"keys"`
	} `json:"then"`
}

func decodeNumbers(text []byte, into interface{}) error {
	decoder := json.NewDecoder(bytes.NewReader(text))
	decoder.UseNumber()
	return decoder.Decode(into)
}

func runCase(t *testing.T, file string, server *redisServer, conn redis.Conn) {
	text, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var c conformanceCase
	if err := decodeNumbers(text, &c); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	if reason, ok := c.Skip["go"]; ok {
		t.Skipf("skipped for go: %s", reason)
	}
	for _, command := range c.Given {
		if _, err := conn.Do(fmt.Sprint(command[0]), plain(command[1:])...); err != nil {
			t.Fatalf("given %v: %v", command, err)
		}
	}
	prefix := c.Client.KeyPrefix
	if prefix == "" {
		prefix = "kmq"
	}
	client, err := New(server.url(), WithKeyPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	m := &matcher{t: t, conn: conn, captures: map[string]string{}}
	ctx := context.Background()
	for n, call := range c.Calls {
		where := fmt.Sprintf("%s: call %d (%s)", c.Name, n, call["call"])
		expect, _ := call["expect"].(map[string]interface{})
		queue, _ := call["queue"].(string)
		var got map[string]interface{}
		var callErr error
		switch call["call"] {
		case "push":
			var id string
			id, callErr = client.Push(ctx, queue, str(call["type"]), rawData(call["data"]), pushOptions(t, call["options"])...)
			got = map[string]interface{}{"id": id}
		case "push_batch":
			var tasks []Task
			for _, each := range call["tasks"].([]interface{}) {
				task := each.(map[string]interface{})
				tasks = append(tasks, Task{Type: str(task["type"]), Data: rawData(task["data"]),
					Options: pushOptions(t, task["options"])})
			}
			var ids []string
			ids, callErr = client.PushBatch(ctx, queue, tasks)
			list := make([]interface{}, len(ids))
			for i, id := range ids {
				list[i] = id
			}
			got = map[string]interface{}{"ids": list}
		case "push_flow":
			var tasks []FlowTask
			tasks, callErr = client.PushFlow(ctx, rawData(call["flow"]))
			list := make([]interface{}, len(tasks))
			for i, task := range tasks {
				list[i] = map[string]interface{}{"queue": task.Queue, "id": task.ID}
			}
			got = map[string]interface{}{"tasks": list}
		case "cancel":
			var removed int
			removed, callErr = client.Cancel(ctx, queue, str(call["id"]))
			got = map[string]interface{}{"removed": removed}
		case "show":
			var found []Found
			found, callErr = client.Show(ctx, queue, str(call["id"]))
			var list []interface{}
			for _, place := range found {
				var each map[string]interface{}
				encoded, _ := json.Marshal(place)
				_ = decodeNumbers(encoded, &each)
				list = append(list, each)
			}
			got = map[string]interface{}{"found": list}
		case "result":
			wait := time.Duration(0)
			if ms, ok := call["wait_ms"].(json.Number); ok {
				n, _ := ms.Int64()
				wait = time.Duration(n) * time.Millisecond
			}
			var result *Result
			result, callErr = client.Result(ctx, queue, str(call["id"]), wait)
			if result != nil {
				encoded, _ := json.Marshal(result)
				var each map[string]interface{}
				_ = decodeNumbers(encoded, &each)
				got = map[string]interface{}{"result": each}
			}
		default:
			t.Fatalf("%s: unknown call", where)
		}
		if kind, ok := expect["error"]; ok {
			if want := errorKinds[str(kind)]; want == nil || !errors.Is(callErr, want) {
				t.Fatalf("%s: got %v, want the error %v", where, callErr, kind)
			}
			var flowErr *FlowError
			if at, ok := expect["at"]; ok && (!errors.As(callErr, &flowErr) || flowErr.Path != str(at)) {
				t.Fatalf("%s: got %v, want the node %v", where, callErr, at)
			}
			continue
		}
		if callErr != nil {
			t.Fatalf("%s: %v", where, callErr)
		}
		for field, want := range expect {
			if field == "found" {
				m.subsetList(where+": found", want, got[field])
				continue
			}
			m.match(where+": "+field, want, got[field])
		}
	}
	m.keys(c.Name, c.Then.Keys)
}

var errorKinds = map[string]error{
	"duplicate": ErrDuplicate, "invalid_argument": ErrInvalidArgument, "unknown_priority": ErrUnknownPriority,
	"invalid_flow": ErrInvalidFlow,
	"unreachable":  ErrUnreachable, "reply_lost": ErrReplyLost, "pending": ErrPending, "no_result": ErrNoResult,
}

func plain(values []interface{}) []interface{} {
	out := make([]interface{}, len(values))
	for i, value := range values {
		out[i] = fmt.Sprint(value)
	}
	return out
}

func str(value interface{}) string {
	text, _ := value.(string)
	return text
}

// rawData keeps a case's data as the JSON it was written as (numbers too).
func rawData(value interface{}) json.RawMessage {
	encoded, _ := json.Marshal(value)
	return encoded
}

func pushOptions(t *testing.T, value interface{}) []PushOption {
	options, _ := value.(map[string]interface{})
	var out []PushOption
	var traceparent, tracestate string
	for name, option := range options {
		switch name {
		case "id":
			out = append(out, WithID(str(option)))
		case "priority":
			out = append(out, WithPriority(str(option)))
		case "delay_ms":
			n, _ := option.(json.Number).Int64()
			out = append(out, WithDelay(time.Duration(n)*time.Millisecond))
		case "at_ms":
			n, _ := option.(json.Number).Int64()
			out = append(out, At(time.UnixMilli(n)))
		case "unique":
			if option == true {
				out = append(out, Unique())
			}
		case "group":
			out = append(out, WithGroup(str(option)))
		case "expires_at_ms":
			n, _ := option.(json.Number).Int64()
			out = append(out, ExpiresAt(time.UnixMilli(n)))
		case "debounce_ms":
			n, _ := option.(json.Number).Int64()
			out = append(out, Debounce(time.Duration(n)*time.Millisecond))
		case "unique_for_ms":
			n, _ := option.(json.Number).Int64()
			out = append(out, UniqueFor(time.Duration(n)*time.Millisecond))
		case "expires_in_ms":
			n, _ := option.(json.Number).Int64()
			out = append(out, ExpiresIn(time.Duration(n)*time.Millisecond))
		case "traceparent":
			traceparent = str(option)
		case "tracestate":
			tracestate = str(option)
		default:
			t.Fatalf("unknown push option %q", name)
		}
	}
	if traceparent != "" || tracestate != "" {
		out = append(out, WithTraceparent(traceparent, tracestate))
	}
	return out
}

type matcher struct {
	t        *testing.T
	conn     redis.Conn
	captures map[string]string
	now      int64
}

var uuidPattern = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// matches says whether actual (a string read from Redis, or a value a call returned) is what expected describes.
func (m *matcher) matches(expected, actual interface{}) bool {
	switch want := expected.(type) {
	case map[string]interface{}:
		if inner, ok := want["json"]; ok && len(want) == 1 {
			var decoded interface{}
			if decodeNumbers([]byte(fmt.Sprint(actual)), &decoded) != nil {
				return false
			}
			return m.matches(inner, decoded)
		}
		if _, ok := want["$uuid"]; ok {
			return uuidPattern.MatchString(fmt.Sprint(actual))
		}
		if offset, ok := want["$ms_near_now"]; ok {
			n, _ := offset.(json.Number).Int64()
			value, err := strconv.ParseFloat(fmt.Sprint(actual), 64)
			if err != nil {
				return false
			}
			near := m.redisNow() + n
			return value > float64(near-5000) && value <= float64(near+1000)
		}
		if name, ok := want["$capture"]; ok {
			m.captures[str(name)] = fmt.Sprint(actual)
			return true
		}
		if name, ok := want["$same_as"]; ok {
			return m.captures[str(name)] == fmt.Sprint(actual)
		}
		got, ok := actual.(map[string]interface{})
		if !ok || len(got) != len(want) {
			return false
		}
		for key, value := range want {
			if _, ok := got[key]; !ok || !m.matches(value, got[key]) {
				return false
			}
		}
		return true
	case []interface{}:
		got, ok := actual.([]interface{})
		if !ok || len(got) != len(want) {
			return false
		}
		for i := range want {
			if !m.matches(want[i], got[i]) {
				return false
			}
		}
		return true
	case json.Number:
		a, err1 := strconv.ParseFloat(fmt.Sprint(actual), 64)
		b, err2 := want.Float64()
		return err1 == nil && err2 == nil && a == b
	case nil:
		return actual == nil
	default:
		return fmt.Sprint(want) == fmt.Sprint(actual)
	}
}

func (m *matcher) redisNow() int64 {
	parts, err := redis.Int64s(m.conn.Do("TIME"))
	if err != nil {
		m.t.Fatal(err)
	}
	return parts[0]*1000 + parts[1]/1000
}

func (m *matcher) match(where string, expected, actual interface{}) {
	m.t.Helper()
	if !m.matches(expected, actual) {
		m.t.Fatalf("%s: got %#v, want %s", where, actual, show(expected))
	}
}

// subsetList: show's places, each compared on the fields the case names.
func (m *matcher) subsetList(where string, expected, actual interface{}) {
	m.t.Helper()
	want, _ := expected.([]interface{})
	got, _ := actual.([]interface{})
	if len(want) != len(got) {
		m.t.Fatalf("%s: got %s, want %s", where, show(actual), show(expected))
	}
	for i := range want {
		for field, value := range want[i].(map[string]interface{}) {
			if !m.matches(value, got[i].(map[string]interface{})[field]) {
				m.t.Fatalf("%s: got %s, want %s", where, show(actual), show(expected))
			}
		}
	}
}

func show(value interface{}) string {
	encoded, _ := json.Marshal(value)
	return string(encoded)
}

// keys checks that Redis holds exactly the keys the case names, each with its type and contents.
func (m *matcher) keys(name string, expected map[string]map[string]interface{}) {
	m.t.Helper()
	actual, err := redis.Strings(m.conn.Do("KEYS", "*"))
	if err != nil {
		m.t.Fatal(err)
	}
	sort.Strings(actual)
	var want []string
	for key := range expected {
		want = append(want, key)
	}
	sort.Strings(want)
	if strings.Join(actual, "\n") != strings.Join(want, "\n") {
		m.t.Fatalf("%s: Redis holds the keys %q, want %q", name, actual, want)
	}
	for key, shape := range expected {
		for kind, contents := range shape {
			where := fmt.Sprintf("%s: key %s", name, key)
			switch kind {
			case "list":
				items, err := redis.Strings(m.conn.Do("LRANGE", key, 0, -1))
				if err != nil {
					m.t.Fatalf("%s: %v", where, err)
				}
				m.match(where, contents, strings2values(items))
			case "hash":
				fields, err := redis.StringMap(m.conn.Do("HGETALL", key))
				if err != nil {
					m.t.Fatalf("%s: %v", where, err)
				}
				got := map[string]interface{}{}
				for field, value := range fields {
					got[field] = value
				}
				m.match(where, contents, got)
			case "string":
				value, err := redis.String(m.conn.Do("GET", key))
				if err != nil {
					m.t.Fatalf("%s: %v", where, err)
				}
				m.match(where, contents, value)
			case "zset", "set":
				var got [][]string
				if kind == "zset" {
					items, err := redis.Strings(m.conn.Do("ZRANGE", key, 0, -1, "WITHSCORES"))
					if err != nil {
						m.t.Fatalf("%s: %v", where, err)
					}
					for i := 0; i+1 < len(items); i += 2 {
						got = append(got, []string{items[i], items[i+1]})
					}
				} else {
					items, err := redis.Strings(m.conn.Do("SMEMBERS", key))
					if err != nil {
						m.t.Fatalf("%s: %v", where, err)
					}
					for _, item := range items {
						got = append(got, []string{item})
					}
				}
				m.unordered(where, contents, got)
			default:
				m.t.Fatalf("%s: unknown key type %q in the case", where, kind)
			}
		}
	}
}

// unordered matches a zset's (member, score) pairs or a set's members in any order.
func (m *matcher) unordered(where string, expected interface{}, got [][]string) {
	m.t.Helper()
	want, _ := expected.([]interface{})
	if len(want) != len(got) {
		m.t.Fatalf("%s: got %q, want %s", where, got, show(expected))
	}
	used := make([]bool, len(got))
	for _, each := range want {
		parts, ok := each.([]interface{})
		if !ok {
			parts = []interface{}{each}
		}
		found := false
		for i, pair := range got {
			if used[i] || len(pair) != len(parts) {
				continue
			}
			all := true
			for j := range parts {
				all = all && m.matches(parts[j], pair[j])
			}
			if all {
				used[i], found = true, true
				break
			}
		}
		if !found {
			m.t.Fatalf("%s: got %q, want %s", where, got, show(expected))
		}
	}
}

func strings2values(items []string) []interface{} {
	out := make([]interface{}, len(items))
	for i, item := range items {
		out[i] = item
	}
	return out
}
