package kmq

import (
	"errors"
	"fmt"
	"strings"

	"github.com/gomodule/redigo/redis"
)

// The errors a call returns wrap one of these, so that a caller tells what happened with errors.Is, whatever the
// message says about the queue, the id or the cause.
var (
	// ErrDuplicate: push.lua refused the task (it replied 0): a unique task with its id is live, or a delayed
	// task with its id is already waiting. Nothing was written for it.
	ErrDuplicate = errors.New("kmq: duplicate")
	// ErrInvalidArgument: the call was refused before anything was sent (no type, a group that is empty or over
	// 64 bytes, a unique task without an id, data that is not JSON, ...).
	ErrInvalidArgument = errors.New("kmq: invalid argument")
	// ErrUnknownPriority: the queue has no level of that name (its levels are read from P:{Q}:meta; a queue no
	// daemon has described has the one level "normal"). Nothing was written.
	ErrUnknownPriority = errors.New("kmq: unknown priority")
	// ErrUnreachable: Redis could not be reached, or the connection failed before the command was written:
	// nothing was pushed, and the same call may be made again.
	ErrUnreachable = errors.New("kmq: redis unreachable")
	// ErrReplyLost: the connection broke (or the context's deadline passed) after the command was written and
	// before its reply came: the tasks may have been pushed. Push again with the same ids and unique set to make
	// a retry safe (a second push is then refused with ErrDuplicate if the first one landed).
	ErrReplyLost = errors.New("kmq: reply lost, the call may have been applied")
	// ErrRefused: Redis answered with an error (a key of the wrong type, OOM, a missing ACL rule); push.lua
	// and remove.lua write nothing when they refuse. The error unwraps to redigo's redis.Error too.
	ErrRefused = errors.New("kmq: refused by redis")
	// ErrPending: Result's wait ended while the task was still waiting to run (delayed, retrying or ready) or
	// running (in a daemon's claim list, safe mode).
	ErrPending = errors.New("kmq: task still waiting")
	// ErrNoResult: Result found neither a result nor the task: running in default mode (out of Redis), never
	// pushed, done on a queue without keep_results, or its result expired.
	ErrNoResult = errors.New("kmq: no result")
)

// DuplicateError is PushBatch's error when push.lua refused some of the tasks (the others were pushed). It
// matches ErrDuplicate with errors.Is.
type DuplicateError struct {
	// IDs are the refused tasks' ids, in the batch's order.
	IDs []string
}

func (e *DuplicateError) Error() string {
	return fmt.Sprintf("kmq: duplicate: %d task(s) refused, their ids live: %s", len(e.IDs), strings.Join(e.IDs, ", "))
}

// Is makes errors.Is(err, ErrDuplicate) true.
func (e *DuplicateError) Is(target error) bool { return target == ErrDuplicate }

// refused is Redis's error reply: errors.Is(err, ErrRefused), and errors.As gives the redis.Error.
type refused struct{ reply redis.Error }

func (r refused) Error() string        { return "kmq: refused by redis: " + string(r.reply) }
func (r refused) Is(target error) bool { return target == ErrRefused }
func (r refused) Unwrap() error        { return r.reply }

func invalid(format string, args ...interface{}) error {
	return fmt.Errorf("%w: %s", ErrInvalidArgument, fmt.Sprintf(format, args...))
}
