package kmq

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/gomodule/redigo/redis"
)

// ErrInvalidFlow: PushFlow refused the flow before anything was written (a *FlowError says which node and why).
// It matches ErrInvalidArgument too.
var ErrInvalidFlow = errors.New("kmq: invalid flow")

// FlowError is PushFlow's refusal of a flow: Path names the node ("the root", "after[1].after[0]"), Reason what
// is wrong with it (a cycle, an id defined twice, a reference to a task the flow does not define, ...).
type FlowError struct {
	Path   string
	Reason string
}

func (e *FlowError) Error() string { return "kmq: invalid flow: " + e.Path + ": " + e.Reason }

// Is makes errors.Is(err, ErrInvalidFlow) and errors.Is(err, ErrInvalidArgument) true.
func (e *FlowError) Is(target error) bool {
	return target == ErrInvalidFlow || target == ErrInvalidArgument
}

func flowError(path, format string, args ...interface{}) error {
	return &FlowError{Path: path, Reason: fmt.Sprintf(format, args...)}
}

// FlowTask is a task of a pushed flow.
type FlowTask struct {
	Queue string
	ID    string
	// GeneratedAt is its path in the flow when its id was generated, else "".
	GeneratedAt string
}

// FlowOption is an option of PushFlow.
type FlowOption func(*flowSettings)

type flowSettings struct {
	deadMax int64
	keepMs  int64
}

// WithDeadMax is the waiting tasks' queue's `dead_max` (default 10000), which bounds the dead-letter list when a
// dead dependency dead-letters a waiting task.
func WithDeadMax(deadMax int64) FlowOption { return func(s *flowSettings) { s.deadMax = deadMax } }

// WithKeep is how long a finished waiting task's hashes are kept for `kmqd flow show`: the queue's
// `keep_results` (default ten minutes, as a daemon keeps them without it).
func WithKeep(keep time.Duration) FlowOption {
	return func(s *flowSettings) { s.keepMs = keep.Milliseconds() }
}

// flowFields are the fields a node may have (docs/PROTOCOL.md, "Flows"); any other is refused, as `kmqd flow
// push` does.
var flowFields = []string{"queue", "type", "id", "data", "priority", "if_failed", "after"}

// flowNode is a task the flow defines, once read and checked (src/flow.rs of kmqd does the same).
type flowNode struct {
	queue, kind, id string
	data            json.RawMessage
	level           string
	ifFailed        string
	priority        string
	deps            [][2]string
	path            string
	generated       bool
}

// flowWaiter names a task waiting for another, in the order kmqd writes it (`{"queue","id"}`).
type flowWaiter struct {
	Queue string `json:"queue"`
	ID    string `json:"id"`
}

type flowReference struct {
	path string
	task [2]string
}

// PushFlow pushes a flow (docs/PROTOCOL.md, "Flows"): flow is the flow's JSON, one task with the tasks it waits
// for nested in "after". It is checked whole before anything is written, as `kmqd flow push` checks it (a
// *FlowError names the node); its waiting tasks are then written with flow_push.lua, a queue at a time, 1,000 a
// call, and last the tasks that wait for nothing are pushed, so that no task can end before the tasks waiting
// for it exist. It returns every task, root first.
func (c *Client) PushFlow(ctx context.Context, flow []byte, options ...FlowOption) ([]FlowTask, error) {
	settings := flowSettings{deadMax: 10000, keepMs: 600000}
	for _, option := range options {
		option(&settings)
	}
	if settings.deadMax < 0 || settings.keepMs < 1 {
		return nil, invalid("dead_max %d or keep %d ms: give a count and a positive time", settings.deadMax, settings.keepMs)
	}
	conn, err := c.conn(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	reader := flowReader{client: c, ctx: ctx, conn: conn, shapes: map[string]queueLevels{}}
	root, err := reader.read(json.RawMessage(flow), "the root")
	if err != nil {
		return nil, err
	}
	if root == nil {
		return nil, flowError("the root", "a flow's root is a task (queue and type), not a reference")
	}
	nodes := reader.nodes
	defined := map[[2]string]int{}
	for at, node := range nodes {
		key := [2]string{node.queue, node.id}
		if first, ok := defined[key]; ok {
			return nil, flowError(node.path, "task %s/%s is defined twice (first at %s); to wait for one task twice, "+
				"refer to it with {\"queue\": ..., \"id\": ...} only", node.queue, node.id, nodes[first].path)
		}
		defined[key] = at
	}
	for _, reference := range reader.references {
		if _, ok := defined[reference.task]; !ok {
			return nil, flowError(reference.path, "refers to task %s/%s, which the flow does not define",
				reference.task[0], reference.task[1])
		}
	}
	if err := checkAcyclic(nodes, defined); err != nil {
		return nil, err
	}
	up := map[[2]string][]flowWaiter{}
	for _, node := range nodes {
		for _, dep := range node.deps {
			for _, waiter := range up[dep] {
				if waiter == (flowWaiter{node.queue, node.id}) {
					return nil, flowError(node.path, "task %s/%s waits for %s/%s twice", node.queue, node.id, dep[0], dep[1])
				}
			}
			up[dep] = append(up[dep], flowWaiter{node.queue, node.id})
		}
	}
	var order []string
	waiting := map[string][][]interface{}{}
	waitingIDs := map[string][]string{}
	leaves := map[string][]prepared{}
	for _, node := range nodes {
		waiters := up[[2]string{node.queue, node.id}]
		if waiters == nil {
			waiters = []flowWaiter{}
		}
		payload, err := flowEnvelope(node, waiters)
		if err != nil {
			return nil, err
		}
		if !contains(order, node.queue) {
			order = append(order, node.queue)
		}
		if len(node.deps) == 0 {
			leaves[node.queue] = append(leaves[node.queue], prepared{level: node.level, id: node.id, options: "0",
				payload: payload})
			continue
		}
		deps, _ := encodeJSON(node.deps)
		upText, _ := encodeJSON(waiters)
		keys := []interface{}{c.key(node.queue, "deps:"+node.id), c.key(node.queue, "deps-ended:"+node.id),
			c.key(node.queue, "ready:"+node.level)}
		args := []interface{}{node.id, node.kind, payload, node.ifFailed, len(node.deps), deps, upText}
		waiting[node.queue] = append(waiting[node.queue], append(keys, args...))
		waitingIDs[node.queue] = append(waitingIDs[node.queue], node.id)
	}
	for _, queue := range order {
		tasks := waiting[queue]
		for start := 0; start < len(tasks); start += BatchSize {
			end := start + BatchSize
			if end > len(tasks) {
				end = len(tasks)
			}
			if err := c.flowPushCall(ctx, conn, queue, settings, tasks[start:end]); err != nil {
				return nil, err
			}
		}
	}
	for _, queue := range order {
		ready := leaves[queue]
		levels := reader.shapes[queue].levels
		// Stable: a level's tasks keep the flow's order.
		sort.SliceStable(ready, func(a, b int) bool { return index(levels, ready[a].level) < index(levels, ready[b].level) })
		if _, err := c.pushPrepared(ctx, conn, queue, ready); err != nil {
			return nil, err
		}
	}
	tasks := make([]FlowTask, 0, len(nodes))
	for _, node := range nodes {
		task := FlowTask{Queue: node.queue, ID: node.id}
		if node.generated {
			task.GeneratedAt = node.path
		}
		tasks = append(tasks, task)
	}
	return tasks, nil
}

// flowEnvelope is a flow's task as kmqd's flow push writes it: the envelope, with its waiters when any.
func flowEnvelope(node *flowNode, waiters []flowWaiter) ([]byte, error) {
	type flowTaskEnvelope struct {
		envelope
		Waiters []flowWaiter `json:"waiters,omitempty"`
	}
	payload, err := encodeJSON(flowTaskEnvelope{envelope{ID: node.id, Type: node.kind, Data: node.data,
		Priority: node.priority}, waiters})
	if err != nil {
		return nil, flowError(node.path, "data is not JSON: %v", err)
	}
	return payload, nil
}

// flowPushCall writes one queue's waiting tasks (each task its 3 keys and 7 arguments, in order) with
// flow_push.lua, all or nothing (docs/PROTOCOL.md, "Flows").
func (c *Client) flowPushCall(ctx context.Context, conn redis.Conn, queue string, settings flowSettings, tasks [][]interface{}) error {
	keys := []interface{}{c.key(queue, "deps-waiting"), c.key(queue, "wake"), c.key(queue, "dead"),
		c.key(queue, "stats"), c.key(queue, "deps-outbox")}
	args := []interface{}{queue, settings.deadMax, settings.keepMs}
	for _, task := range tasks {
		keys = append(keys, task[:3]...)
		args = append(args, task[3:]...)
	}
	replies, err := redis.Strings(flowPushScript.run(ctx, conn, keys, args))
	if err != nil {
		return fmt.Errorf("queue %q: flow_push.lua: %w", queue, err)
	}
	if len(replies) != len(tasks) {
		return fmt.Errorf("queue %q: flow_push.lua answered %d replies for %d tasks", queue, len(replies), len(tasks))
	}
	return nil
}

// flowReader reads a flow's nodes depth first, in the file's order, and the queues' shapes they name.
type flowReader struct {
	client     *Client
	ctx        context.Context
	conn       redis.Conn
	shapes     map[string]queueLevels
	nodes      []*flowNode
	references []flowReference
}

// read reads the node at path and what it waits for; it returns the task it names (nil for a reference at the
// root).
func (r *flowReader) read(raw json.RawMessage, path string) (*[2]string, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil || fields == nil {
		return nil, flowError(path, "a node is a JSON object")
	}
	for field := range fields {
		if !contains(flowFields, field) {
			return nil, flowError(path, "unknown field %q; a node has %s", field, strings.Join(flowFields, ", "))
		}
	}
	text := map[string]*string{}
	for _, field := range []string{"queue", "type", "id", "priority", "if_failed"} {
		var value *string
		if given, ok := fields[field]; ok && json.Unmarshal(given, &value) != nil {
			return nil, flowError(path, "%q is not a string", field)
		}
		text[field] = value
	}
	var after []json.RawMessage
	if given, ok := fields["after"]; ok && json.Unmarshal(given, &after) != nil {
		return nil, flowError(path, "\"after\" is not a list of nodes")
	}
	data, hasData := fields["data"]
	hasData = hasData && string(bytes.TrimSpace(data)) != "null"
	if text["queue"] == nil || *text["queue"] == "" {
		return nil, flowError(path, "no \"queue\"")
	}
	queue := *text["queue"]
	if text["type"] == nil {
		// A reference: a queue and an id, nothing else.
		if text["id"] == nil {
			return nil, flowError(path, "no \"type\" (a task needs one; a reference to a task defined elsewhere needs an \"id\")")
		}
		if hasData || text["priority"] != nil || text["if_failed"] != nil || len(after) > 0 {
			return nil, flowError(path, "no \"type\", so this refers to task %s/%s: a reference has only \"queue\" and \"id\"",
				queue, *text["id"])
		}
		task := [2]string{queue, *text["id"]}
		r.references = append(r.references, flowReference{path, task})
		if path == "the root" {
			return nil, nil
		}
		return &task, nil
	}
	if *text["type"] == "" {
		return nil, flowError(path, "\"type\" is empty")
	}
	ifFailed := "fail"
	if text["if_failed"] != nil {
		ifFailed = *text["if_failed"]
	}
	if ifFailed != "fail" && ifFailed != "continue" {
		return nil, flowError(path, "if_failed %q is neither \"fail\" (the default) nor \"continue\"", ifFailed)
	}
	if err := checkQueue(queue); err != nil {
		return nil, flowError(path, "%v", err)
	}
	// As a push's: kept a while, read again at once for a priority the kept levels lack.
	var wanted []Task
	if p := text["priority"]; p != nil {
		wanted = []Task{{Options: []PushOption{WithPriority(*p)}}}
	}
	shape, err := r.client.queueLevels(r.ctx, r.conn, queue, wanted)
	if err != nil {
		return nil, err
	}
	r.shapes[queue] = shape
	node := &flowNode{queue: queue, kind: *text["type"], ifFailed: ifFailed, level: shape.fallback, path: path,
		data: json.RawMessage("null")}
	if p := text["priority"]; p != nil {
		if !contains(shape.levels, *p) {
			return nil, flowError(path, "queue %q has no priority %q; its levels are %s", queue, *p,
				strings.Join(shape.levels, ", "))
		}
		node.priority, node.level = *p, *p
	}
	if hasData {
		node.data = data
	}
	switch id := text["id"]; {
	case id == nil:
		node.id, node.generated = newUUID(), true
	case *id == "":
		return nil, flowError(path, "\"id\" is empty")
	default:
		node.id = *id
	}
	r.nodes = append(r.nodes, node)
	for n, dep := range after {
		depPath := fmt.Sprintf("%s.after[%d]", path, n)
		if path == "the root" {
			depPath = fmt.Sprintf("after[%d]", n)
		}
		task, err := r.read(dep, depPath)
		if err != nil {
			return nil, err
		}
		node.deps = append(node.deps, *task)
	}
	return &[2]string{queue, node.id}, nil
}

// checkAcyclic refuses a cycle through references: a depth-first walk from every node (white, grey, black), in
// the order `kmqd flow push` walks, so that both name the same node.
func checkAcyclic(nodes []*flowNode, defined map[[2]string]int) error {
	state := make([]int, len(nodes))
	for start := range nodes {
		stack := [][2]int{{start, 0}}
		for len(stack) > 0 {
			top := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			at, next := top[0], top[1]
			if next == 0 {
				if state[at] == 2 {
					continue
				}
				state[at] = 1
			}
			if next >= len(nodes[at].deps) {
				state[at] = 2
				continue
			}
			stack = append(stack, [2]int{at, next + 1})
			dep := defined[nodes[at].deps[next]]
			switch state[dep] {
			case 1:
				d, w := nodes[dep], nodes[at]
				return flowError(d.path, "task %s/%s waits for itself through %s/%s (a cycle); a flow must end",
					d.queue, d.id, w.queue, w.id)
			case 0:
				stack = append(stack, [2]int{dep, 0})
			}
		}
	}
	return nil
}

func index(list []string, item string) int {
	for n, each := range list {
		if each == item {
			return n
		}
	}
	return len(list)
}
