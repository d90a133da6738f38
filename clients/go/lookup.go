package kmq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/gomodule/redigo/redis"
)

// Found is one place a task is in (a non-unique id may be in several).
type Found struct {
	// State is "delayed", "retrying", "ready", "processing" or "dead".
	State string `json:"state"`
	// Level is the priority level it waits at (not set for "dead").
	Level string `json:"level,omitempty"`
	// Position is its place in its ready list or flow, 0 the next to be taken ("ready" only).
	Position *int64 `json:"position,omitempty"`
	// Group is the group whose flow it waits in, "" for tasks without a group (a grouped queue's flows only).
	Group *string `json:"group,omitempty"`
	// DueInMs is how long until it is due, on Redis's clock ("delayed", "retrying").
	DueInMs *int64 `json:"due_in_ms,omitempty"`
	// Owner is the daemon that claimed it, Token its token (claim.position), LeaseLeftMs how long until a monitor
	// takes it back if the owner stops renewing its lease ("processing").
	Owner       string `json:"owner,omitempty"`
	Token       string `json:"token,omitempty"`
	LeaseLeftMs *int64 `json:"lease_left_ms,omitempty"`
	// Envelope is the task as stored; Record the dead-letter record ("dead").
	Envelope string `json:"envelope,omitempty"`
	Record   string `json:"record,omitempty"`
	// holder is the key the task waits in, for Cancel.
	holder string
}

// Show finds every place the task id is in: delayed (by its index, O(log n)), retrying, ready (its ready list
// or, on a grouped queue, its group's flow), processing (a daemon's claim lists, safe mode) and dead, as `kmqd
// task show` does; the lists are scanned.
func (c *Client) Show(ctx context.Context, queue, id string) ([]Found, error) {
	conn, err := c.session(ctx, queue)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	return c.locate(ctx, conn, queue, id, true)
}

func (c *Client) locate(ctx context.Context, conn redis.Conn, queue, id string, dead bool) ([]Found, error) {
	levels, err := c.queueLevels(ctx, conn, queue, nil)
	if err != nil {
		return nil, err
	}
	now, err := redisNow(ctx, conn)
	if err != nil {
		return nil, err
	}
	var found []Found
	envelope, err := redis.String(do(ctx, conn, "HGET", c.key(queue, "delayed-tasks"), id))
	if err != nil && err != redis.ErrNil {
		return nil, err
	}
	if err == nil {
		for _, level := range levels.levels {
			due, err := redis.Int64(do(ctx, conn, "ZSCORE", c.key(queue, "delayed:"+level), id))
			if err == redis.ErrNil {
				continue
			}
			if err != nil {
				return nil, err
			}
			left := due - now
			found = append(found, Found{State: "delayed", Level: level, DueInMs: &left, Envelope: envelope})
			break
		}
	}
	needle := jsonEscaped(id)
	for _, level := range levels.levels {
		cursor := "0"
		for {
			page, err := redis.Values(do(ctx, conn, "ZSCAN", c.key(queue, "retry:"+level), cursor,
				"MATCH", globContaining(needle), "COUNT", 1000))
			if err != nil {
				return nil, err
			}
			cursor, _ = redis.String(page[0], nil)
			items, _ := redis.Strings(page[1], nil)
			for i := 0; i+1 < len(items); i += 2 {
				if envelopeID(items[i]) == id {
					var due int64
					fmt.Sscanf(items[i+1], "%d", &due)
					left := due - now
					found = append(found, Found{State: "retrying", Level: level, DueInMs: &left, Envelope: items[i]})
				}
			}
			if cursor == "0" {
				break
			}
		}
	}
	for _, level := range levels.levels {
		err := scanList(ctx, conn, c.key(queue, "ready:"+level), func(position int64, item string) {
			if strings.Contains(item, needle) && envelopeID(item) == id {
				p := position
				found = append(found, Found{State: "ready", Level: level, Position: &p, Envelope: item,
					holder: c.key(queue, "ready:"+level)})
			}
		})
		if err != nil {
			return nil, err
		}
		members, err := redis.Strings(do(ctx, conn, "ZRANGE", c.key(queue, "ring:"+level), 0, -1))
		if err != nil {
			return nil, err
		}
		for _, member := range members {
			group := decodeName(member[:strings.IndexByte(member+":", ':')])
			flow := c.key(queue, "flow:"+level+":"+member)
			err := scanList(ctx, conn, flow, func(position int64, item string) {
				if strings.Contains(item, needle) && envelopeID(item) == id {
					p, g := position, group
					found = append(found, Found{State: "ready", Level: level, Position: &p, Group: &g, Envelope: item,
						holder: flow})
				}
			})
			if err != nil {
				return nil, err
			}
		}
	}
	if dead {
		if err := c.locateProcessing(ctx, conn, queue, id, levels.levels, now, &found); err != nil {
			return nil, err
		}
		err := scanList(ctx, conn, c.key(queue, "dead"), func(_ int64, record string) {
			if envelopeID(record) == id {
				found = append(found, Found{State: "dead", Record: record})
			}
		})
		if err != nil {
			return nil, err
		}
	}
	if found == nil {
		found = []Found{}
	}
	return found, nil
}

// locateProcessing finds the task in the daemons' claim lists (safe mode; docs/PROTOCOL.md, "Key layout",
// `processing:OWNER:L:C`), as `kmqd task show` does: for each owner of the owners set and each level, each claim's
// list, leaving out the positions its settled bitmap marks (a hash token -> envelope for an owner of kmqd 0.1).
func (c *Client) locateProcessing(ctx context.Context, conn redis.Conn, queue, id string, levels []string, now int64,
	found *[]Found) error {
	owners, err := redis.Strings(do(ctx, conn, "ZRANGE", c.key(queue, "owners"), 0, -1, "WITHSCORES"))
	if err != nil {
		return err
	}
	needle := jsonEscaped(id)
	for i := 0; i+1 < len(owners); i += 2 {
		owner := owners[i]
		deadline, _ := strconv.ParseFloat(owners[i+1], 64)
		left := int64(deadline) - now
		add := func(level, token, envelope string) {
			*found = append(*found, Found{State: "processing", Level: level, Owner: owner, Token: token,
				LeaseLeftMs: &left, Envelope: envelope})
		}
		for _, level := range levels {
			claims := c.key(queue, "processing:"+owner+":"+level)
			kind, err := redis.String(do(ctx, conn, "TYPE", claims))
			if err != nil {
				return err
			}
			if kind == "hash" {
				fields, err := redis.StringMap(do(ctx, conn, "HGETALL", claims))
				if err != nil {
					return err
				}
				for token, envelope := range fields {
					if envelopeID(envelope) == id {
						add(level, token, envelope)
					}
				}
				continue
			}
			if kind != "zset" {
				continue
			}
			numbers, err := redis.Strings(do(ctx, conn, "ZRANGE", claims, 0, -1))
			if err != nil {
				return err
			}
			for _, claim := range numbers {
				list := claims + ":" + claim
				settled, err := redis.Bytes(do(ctx, conn, "GET", list+":settled"))
				if err != nil && err != redis.ErrNil {
					return err
				}
				err = scanList(ctx, conn, list, func(position int64, item string) {
					if position>>3 < int64(len(settled)) && settled[position>>3]>>(7-uint(position&7))&1 == 1 {
						return
					}
					if strings.Contains(item, needle) && envelopeID(item) == id {
						add(level, claim+"."+strconv.FormatInt(position, 10), item)
					}
				})
				if err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// Cancel removes every waiting copy (delayed, retrying, ready) of the task id, releasing its unique id, with
// kmqd's remove.lua (one call per copy, each checked again inside Redis); it returns how many it removed: 0 when
// the task was not waiting (unknown, running, done or dead).
func (c *Client) Cancel(ctx context.Context, queue, id string) (int, error) {
	conn, err := c.session(ctx, queue)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	found, err := c.locate(ctx, conn, queue, id, false)
	if err != nil {
		return 0, err
	}
	removed := 0
	for _, place := range found {
		var holder, kind, task, expected string
		switch {
		case place.State == "delayed":
			holder, kind, task, expected = c.key(queue, "delayed:"+place.Level), "delayed", id, place.Envelope
		case place.State == "retrying":
			holder, kind, task = c.key(queue, "retry:"+place.Level), "retry", place.Envelope
		default:
			holder, kind, task = place.holder, "list", place.Envelope
		}
		unique := ""
		var head struct {
			Unique bool `json:"unique"`
		}
		if json.Unmarshal([]byte(place.Envelope), &head) == nil && head.Unique {
			unique = id
		}
		keys := []interface{}{holder, c.key(queue, "delayed-tasks"), c.key(queue, "unique"), c.key(queue, "stats")}
		done, err := redis.Int64(removeScript.run(ctx, conn, keys, []interface{}{kind, task, expected, unique}))
		if err != nil {
			return removed, fmt.Errorf("queue %q: remove.lua: %w", queue, err)
		}
		removed += int(done)
	}
	return removed, nil
}

// Result is what a task came to, kept by a queue with `keep_results` (docs/PROTOCOL.md, "Results").
type Result struct {
	// State is "done" or "dead".
	State string `json:"state"`
	// Result is the JSON the handler returned with done ("null" when none).
	Result json.RawMessage `json:"result,omitempty"`
	// ResultError says why a result was not kept (over 1 MiB, not JSON).
	ResultError string `json:"result_error,omitempty"`
	// Reason is a dead task's dead-letter reason.
	Reason string `json:"reason,omitempty"`
	// EndedAt is when the settle ran, ms since the epoch on Redis's clock.
	EndedAt int64 `json:"ended_at"`
}

// Result reads task id's result, polling up to wait for it (from 10 ms doubling to 500 ms; there is no notice
// to miss). When the wait ends without one it looks the task up: dead-lettered (a queue without keep_results)
// returns a Result of state "dead" with the record's reason; still waiting or running (found in a claim list, as
// kmqd::Client's result finds it) returns ErrPending; found nowhere returns ErrNoResult (never pushed, running in
// default mode, or its result was never kept or expired).
func (c *Client) Result(ctx context.Context, queue, id string, wait time.Duration) (*Result, error) {
	conn, err := c.session(ctx, queue)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	deadline := time.Now().Add(wait)
	pause := 10 * time.Millisecond
	for {
		kept, err := c.keptResult(ctx, conn, queue, id)
		if err == nil {
			var result Result
			if err := json.Unmarshal(kept, &result); err != nil {
				return nil, fmt.Errorf("queue %q: result of %q is not JSON: %v", queue, id, err)
			}
			return &result, nil
		}
		if !errors.Is(err, redis.ErrNil) {
			return nil, err
		}
		left := time.Until(deadline)
		if left <= 0 {
			break
		}
		if pause > left {
			pause = left
		}
		if pause, err = pauseThenDouble(ctx, pause); err != nil {
			return nil, err
		}
	}
	found, err := c.locate(ctx, conn, queue, id, true)
	if err != nil {
		return nil, err
	}
	for _, place := range found {
		if place.State != "dead" {
			return nil, fmt.Errorf("%w: queue %q: task %q is %s", ErrPending, queue, id, place.State)
		}
	}
	if len(found) > 0 {
		var record struct {
			Reason string `json:"reason"`
			DeadAt int64  `json:"dead_at"`
		}
		_ = json.Unmarshal([]byte(found[0].Record), &record)
		return &Result{State: "dead", Reason: record.Reason, EndedAt: record.DeadAt}, nil
	}
	return nil, fmt.Errorf("%w: queue %q: task %q", ErrNoResult, queue, id)
}

// pauseThenDouble waits pause (or until ctx ends: its error) and returns the next pause, twice as long up to 500 ms:
// the polls of Result and the retries of a cluster's TRYAGAIN.
func pauseThenDouble(ctx context.Context, pause time.Duration) (time.Duration, error) {
	select {
	case <-ctx.Done():
		return pause, ctx.Err()
	case <-time.After(pause):
	}
	if pause *= 2; pause > 500*time.Millisecond {
		pause = 500 * time.Millisecond
	}
	return pause, nil
}

// redisNow is Redis's clock in ms, read on the queue's node (TIME names no key: a cluster client would send it
// anywhere, so it goes on the connection the other reads use).
func redisNow(ctx context.Context, conn redis.Conn) (int64, error) {
	parts, err := redis.Int64s(do(ctx, conn, "TIME"))
	if err != nil {
		return 0, err
	}
	return parts[0]*1000 + parts[1]/1000, nil
}

// scanList calls visit with each element of a list and its position, 1,000 elements a command.
func scanList(ctx context.Context, conn redis.Conn, key string, visit func(int64, string)) error {
	const chunk = 1000
	for start := int64(0); ; start += chunk {
		items, err := redis.Strings(do(ctx, conn, "LRANGE", key, start, start+chunk-1))
		if err != nil {
			return err
		}
		for offset, item := range items {
			visit(start+int64(offset), item)
		}
		if len(items) < chunk {
			return nil
		}
	}
}

// envelopeID is the `id` of a JSON object, or "" (not an object, no string id).
func envelopeID(payload string) string {
	var head struct {
		ID string `json:"id"`
	}
	if json.Unmarshal([]byte(payload), &head) != nil {
		return ""
	}
	return head.ID
}

// jsonEscaped is id as it appears inside a JSON string, to skip payloads without it before decoding them.
func jsonEscaped(id string) string {
	quoted, _ := json.Marshal(id)
	return string(quoted[1 : len(quoted)-1])
}

// globContaining is a Redis glob matching any member that contains needle.
func globContaining(needle string) string {
	var b strings.Builder
	b.WriteByte('*')
	for _, r := range needle {
		if strings.ContainsRune(`*?[]\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	b.WriteByte('*')
	return b.String()
}

// decodeName undoes src/broker/keys.rs's encode_name (a group's name in its flow's key is percent-encoded).
func decodeName(part string) string {
	var b strings.Builder
	for i := 0; i < len(part); i++ {
		if part[i] == '%' && i+2 < len(part) {
			if c, err := strconv.ParseUint(part[i+1:i+3], 16, 8); err == nil {
				b.WriteByte(byte(c))
				i += 2
				continue
			}
		}
		b.WriteByte(part[i])
	}
	return b.String()
}

// keptResult reads task id's kept result: the buckets the queue's index lists, newest first, each asked for the
// id until one holds it (docs/PROTOCOL.md, "Results"); redis.ErrNil when none does.
func (c *Client) keptResult(ctx context.Context, conn redis.Conn, queue, id string) ([]byte, error) {
	starts, err := redis.Strings(do(ctx, conn, "ZRANGE", c.key(queue, "results"), 0, -1, "REV"))
	if err != nil {
		return nil, err
	}
	for _, start := range starts {
		kept, err := redis.Bytes(do(ctx, conn, "HGET", c.key(queue, "results:"+start), id))
		if !errors.Is(err, redis.ErrNil) {
			return kept, err
		}
	}
	return nil, redis.ErrNil
}
