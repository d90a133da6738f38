// Package kmq is the Go producer client of kmqd: it pushes tasks with kmqd's own enqueue script (push.lua, a
// byte-identical copy shipped in this package), and shows, cancels and reads the results of tasks, as
// docs/PROTOCOL.md describes. docs/CLIENTS.md shows it in use.
//
//	client, err := kmq.New("redis://127.0.0.1:6379/0", kmq.WithKeyPrefix("kmq"))
//	id, err := client.Push(ctx, "mail", "mail.send", map[string]string{"to": "ada@example.com"},
//		kmq.WithDelay(30*time.Second))
package kmq

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha1"
	"crypto/tls"
	"crypto/x509"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/gomodule/redigo/redis"
)

// pushLua is src/broker/scripts/push.lua, byte for byte (scripts/test compares the two).
//
//go:embed push.lua
var pushLua string

// removeLua is remove.lua with checks.lua and unique_hold.lua before it, as the broker concatenates them
// (src/broker/mod.rs, `sources`); the files are byte-identical copies, compared by scripts/test.
//
//go:embed checks.lua
var checksLua string

//go:embed unique_hold.lua
var uniqueHoldLua string

//go:embed remove.lua
var removeLuaOwn string

// depsLua and flowPushLua go after checks.lua, as the broker runs flow_push.lua (src/broker/mod.rs, FLOW_PUSH).
//
//go:embed deps.lua
var depsLua string

//go:embed flow_push.lua
var flowPushLuaOwn string

var (
	pushScript     = newScript(pushLua)
	removeScript   = newScript(checksLua + uniqueHoldLua + removeLuaOwn)
	flowPushScript = newScript("#!lua\n" + checksLua + depsLua + flowPushLuaOwn)
)

// BatchSize is how many tasks one push.lua call carries: push.lua advises keeping a call under ~1,000 tasks, as
// Redis runs nothing else meanwhile, so PushBatch makes one round trip per 1,000.
const BatchSize = 1000

// levelsFor is how long a queue's levels, read from P:{Q}:meta, are trusted before they are read again; a push
// with a priority the cache does not know reads them again at once before refusing it.
const levelsFor = 10 * time.Second

// MaxUniqueFor is the longest hold UniqueFor takes: push.lua reads at most 12 digits of ms (about 31 years).
const MaxUniqueFor = 999_999_999_999 * time.Millisecond

// Client pushes tasks to the queues of one Redis, or of a Redis Cluster (NewCluster). It is
// safe for concurrent use: each call takes a connection from its pool.
type Client struct {
	// pool is the one Redis's connections; nil for a cluster, whose masters each have one (cluster.pools).
	pool     *redis.Pool
	cluster  *cluster
	prefix   string
	ownsPool bool

	mu     sync.Mutex
	levels map[string]queueLevels
}

type queueLevels struct {
	levels   []string
	fallback string
	read     time.Time
}

// Option configures New, NewCluster and NewSentinel.
type Option func(*settings)

type settings struct {
	prefix string
	dial   []redis.DialOption
	// err is an option's refusal (a CA file that cannot be read), returned by the constructor.
	err error
}

// newSettings applies options over the defaults; dial is the dial options with a 5 s connect timeout first.
func newSettings(options []Option) (settings, error) {
	s := settings{prefix: "kmq", dial: []redis.DialOption{redis.DialConnectTimeout(5 * time.Second)}}
	for _, option := range options {
		option(&s)
	}
	return s, s.err
}

// WithKeyPrefix sets the key prefix the queues' daemons are configured with (`key_prefix`, default "kmq").
func WithKeyPrefix(prefix string) Option { return func(s *settings) { s.prefix = prefix } }

// WithDialOptions passes options to redigo's DialURL (a TLS config, timeouts, a client name).
func WithDialOptions(options ...redis.DialOption) Option {
	return func(s *settings) { s.dial = append(s.dial, options...) }
}

// WithCAFile makes a rediss:// client trust the CA certificates (PEM) in the file at path, as well as the
// system's: a Redis whose certificate a private CA signed. The server's name is checked against the URL's host.
func WithCAFile(path string) Option {
	return func(s *settings) {
		pem, err := os.ReadFile(path)
		if err != nil {
			s.err = invalid("CA file: %v", err)
			return
		}
		roots, err := x509.SystemCertPool()
		if err != nil {
			roots = x509.NewCertPool()
		}
		if !roots.AppendCertsFromPEM(pem) {
			s.err = invalid("CA file %q: no PEM certificate in it", path)
			return
		}
		s.dial = append(s.dial, redis.DialTLSConfig(&tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}))
	}
}

// New connects lazily to the Redis at url (redis://[user:password@]host:port/db or rediss:// for TLS).
func New(url string, options ...Option) (*Client, error) {
	s, err := newSettings(options)
	if err != nil {
		return nil, err
	}
	dial := s.dial
	if _, err := redisURL(url); err != nil {
		return nil, err
	}
	pool := newPool(url, dial)
	client := NewWithPool(pool, WithKeyPrefix(s.prefix))
	client.ownsPool = true
	return client, nil
}

// newPool is a pool of connections to the Redis at url, each checked with a PING when it was idle for a while.
func newPool(url string, dial []redis.DialOption) *redis.Pool {
	return &redis.Pool{
		MaxIdle:     8,
		IdleTimeout: 5 * time.Minute,
		Dial:        func() (redis.Conn, error) { return redis.DialURL(url, dial...) },
		TestOnBorrow: func(conn redis.Conn, idle time.Time) error {
			// A connection idle for a while may have been closed by Redis (`timeout`) or a proxy: a PING finds
			// that out before a push is written on it, where a broken connection would read as a lost reply.
			if time.Since(idle) < 5*time.Second {
				return nil
			}
			_, err := conn.Do("PING")
			return err
		},
	}
}

func redisURL(url string) (string, error) {
	if !strings.HasPrefix(url, "redis://") && !strings.HasPrefix(url, "rediss://") {
		return "", invalid("url %q: expected redis:// or rediss://", url)
	}
	return url, nil
}

// NewWithPool uses a redigo pool the caller made (a unix socket, a Sentinel-aware dial function); Close leaves
// it open.
func NewWithPool(pool *redis.Pool, options ...Option) *Client {
	s := settings{prefix: "kmq"}
	for _, option := range options {
		option(&s)
	}
	return &Client{pool: pool, prefix: s.prefix, levels: map[string]queueLevels{}}
}

// Close closes the client's pool (not one given to NewWithPool), or its pools of a cluster's masters.
func (c *Client) Close() error {
	if c.cluster != nil {
		return c.cluster.close()
	}
	if c.ownsPool {
		return c.pool.Close()
	}
	return nil
}

// PushOption is an option of one push: an id, a priority, a delay, unique, a group, a trace context.
type PushOption func(*pushSettings)

type pushSettings struct {
	id          string
	priority    string
	delay       time.Duration
	at          time.Time
	unique      bool
	group       *string
	traceparent string
	tracestate  string
	expiresAt   time.Time
	expiresIn   time.Duration
	debounce    time.Duration
	uniqueFor   *time.Duration // nil: none; a pointer so that UniqueFor(0) is refused rather than ignored
}

// WithID sets the task's id (otherwise a random UUID).
func WithID(id string) PushOption { return func(p *pushSettings) { p.id = id } }

// WithPriority names the level to push to (one of the queue's `priorities`).
func WithPriority(level string) PushOption { return func(p *pushSettings) { p.priority = level } }

// WithDelay makes the task ready that long after now, on Redis's clock.
func WithDelay(delay time.Duration) PushOption { return func(p *pushSettings) { p.delay = delay } }

// At makes the task ready at that time (ms precision; wins over WithDelay; a past time means now).
func At(at time.Time) PushOption { return func(p *pushSettings) { p.at = at } }

// Unique holds the task's id from the push until the task is done, dead or cancelled: a push of a held id is
// refused with ErrDuplicate. It needs WithID.
func Unique() PushOption { return func(p *pushSettings) { p.unique = true } }

// WithGroup sets the task's group (1 to 64 bytes of UTF-8), for a queue with `[queues.groups]`.
func WithGroup(group string) PushOption { return func(p *pushSettings) { p.group = &group } }

// WithTraceparent sets the envelope's W3C `traceparent` (and `tracestate`, when not empty). This package does not
// read ctx's span, so as not to depend on OpenTelemetry: kmqotel.Push (the kmqotel package beside it) does.
func WithTraceparent(traceparent, tracestate string) PushOption {
	return func(p *pushSettings) { p.traceparent, p.tracestate = traceparent, tracestate }
}

// ExpiresAt makes the task not start at or after t (ms precision, on Redis's clock): a daemon that takes it later
// dead-letters it unrun with the reason "expired" (docs/PROTOCOL.md, "Expiry").
func ExpiresAt(t time.Time) PushOption { return func(p *pushSettings) { p.expiresAt = t } }

// ExpiresIn is ExpiresAt of Redis's clock now plus d: the push reads Redis's TIME first (once a batch).
func ExpiresIn(d time.Duration) PushOption { return func(p *pushSettings) { p.expiresIn = d } }

// UniqueFor is Unique, and the id stays held d after its task ended (1 ms to MaxUniqueFor, whole ms): a push of it
// is refused with ErrDuplicate until then, so that one task of the id runs per such window (docs/PROTOCOL.md,
// "Debounce, and unique for a time"). It needs WithID, and does not combine with Debounce.
func UniqueFor(d time.Duration) PushOption {
	return func(p *pushSettings) { p.unique, p.uniqueFor = true, &d }
}

// Debounce starts the task d after the push and replaces the task of its id that still waits for its start (its
// data and start time), so that only the last push of a burst runs (docs/PROTOCOL.md, "Debounce, and unique for a
// time"). It needs WithID, and does not combine with Unique, WithDelay or At (d is the delay).
func Debounce(d time.Duration) PushOption { return func(p *pushSettings) { p.debounce = d } }

// Task is one task of PushBatch.
type Task struct {
	Type    string
	Data    interface{}
	Options []PushOption
}

// envelope is the task as push.lua stores it (docs/PROTOCOL.md, "The envelope"); push.lua adds created_at.
type envelope struct {
	ID          string          `json:"id"`
	Type        string          `json:"type"`
	Data        json.RawMessage `json:"data"`
	Attempt     int             `json:"attempt"`
	Priority    string          `json:"priority,omitempty"`
	Unique      bool            `json:"unique,omitempty"`
	Group       *string         `json:"group,omitempty"`
	Traceparent string          `json:"traceparent,omitempty"`
	Tracestate  string          `json:"tracestate,omitempty"`
	ExpiresAt   int64           `json:"expires_at,omitempty"`
}

// prepared is one validated task: the call it joins (level, delay) and its push.lua triple.
type prepared struct {
	level   string
	delayMs int64
	atMs    int64
	id      string
	options string // push.lua's OPTIONS_n: "0", "1" (unique), "unique_for=MS" or "debounce"
	payload []byte
}

var traceparentPattern = regexp.MustCompile(`^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$`)

// Push enqueues one task and returns its id. A refused unique id returns the id and an error matching
// ErrDuplicate.
func (c *Client) Push(ctx context.Context, queue, taskType string, data interface{}, options ...PushOption) (string, error) {
	ids, err := c.PushBatch(ctx, queue, []Task{{Type: taskType, Data: data, Options: options}})
	var duplicate *DuplicateError
	if errors.As(err, &duplicate) {
		return ids[0], fmt.Errorf("%w: queue %q: task %q is live (unique) or already delayed", ErrDuplicate, queue, ids[0])
	}
	if err != nil {
		return "", err
	}
	return ids[0], nil
}

// PushBatch enqueues tasks in order, one push.lua call (one round trip) per 1,000 tasks of the same level and
// delay, and returns their ids in order. Every task is checked before anything is sent: a bad one fails the
// whole batch with nothing written. The calls are not one transaction: an error of a later call (ErrReplyLost,
// ErrUnreachable) says how many tasks the earlier calls pushed. Refused duplicates return the ids and a
// *DuplicateError.
func (c *Client) PushBatch(ctx context.Context, queue string, tasks []Task) ([]string, error) {
	conn, err := c.session(ctx, queue)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	levels, err := c.queueLevels(ctx, conn, queue, tasks)
	if err != nil {
		return nil, err
	}
	// An expiry given as a length is a time on Redis's clock (docs/PROTOCOL.md, "Expiry"): TIME on the queue's
	// node, once a batch and only when a task of it needs it.
	var now int64
	for _, task := range tasks {
		if settingsOf(task).expiresIn != 0 {
			if now, err = redisNow(ctx, conn); err != nil {
				return nil, err
			}
			break
		}
	}
	all := make([]prepared, 0, len(tasks))
	ids := make([]string, 0, len(tasks))
	for n, task := range tasks {
		p, err := prepare(task, levels, now)
		if err != nil {
			if len(tasks) > 1 {
				return nil, fmt.Errorf("task %d of the batch: %w", n, err)
			}
			return nil, err
		}
		all = append(all, p)
		ids = append(ids, p.id)
	}
	refused, err := c.pushPrepared(ctx, conn, queue, all)
	if err != nil {
		return nil, err
	}
	if len(refused) > 0 {
		return ids, &DuplicateError{IDs: refused}
	}
	return ids, nil
}

// pushPrepared sends checked tasks, one push.lua call per 1,000 in a row of the same level and due time, and
// returns the ids push.lua refused.
func (c *Client) pushPrepared(ctx context.Context, conn redis.Conn, queue string, all []prepared) ([]string, error) {
	var refused []string
	for start := 0; start < len(all); {
		end := start + 1
		for end < len(all) && end-start < BatchSize && sameCall(all[start], all[end]) {
			end++
		}
		replies, err := c.pushCall(ctx, conn, queue, all[start:end])
		if err != nil {
			if start > 0 {
				return nil, fmt.Errorf("after %d of %d tasks were pushed: %w", start, len(all), err)
			}
			return nil, err
		}
		for i, accepted := range replies {
			if accepted != 1 {
				refused = append(refused, all[start+i].id)
			}
		}
		start = end
	}
	return refused, nil
}

func sameCall(a, b prepared) bool {
	return a.level == b.level && a.delayMs == b.delayMs && a.atMs == b.atMs
}

func checkQueue(queue string) error {
	if queue == "" || strings.ContainsAny(queue, "{}") {
		return invalid("queue name %q: must not be empty or hold { or }", queue)
	}
	return nil
}

func settingsOf(task Task) pushSettings {
	var s pushSettings
	for _, option := range task.Options {
		option(&s)
	}
	return s
}

// prepare checks a task and makes its envelope; now is Redis's clock (ms), read when a task expires in a length.
func prepare(task Task, levels queueLevels, now int64) (prepared, error) {
	s := settingsOf(task)
	if task.Type == "" {
		return prepared{}, invalid("a task needs a type")
	}
	if s.group != nil && (len(*s.group) == 0 || len(*s.group) > 64 || !utf8.ValidString(*s.group)) {
		return prepared{}, invalid("group %q: must be 1 to 64 bytes of UTF-8", *s.group)
	}
	if s.unique && s.id == "" {
		return prepared{}, invalid("a unique task needs an id (uniqueness is per id)")
	}
	if s.delay < 0 {
		return prepared{}, invalid("delay %v is negative", s.delay)
	}
	if s.traceparent != "" && !traceparentPattern.MatchString(s.traceparent) {
		return prepared{}, invalid("traceparent %q is not a W3C trace context (00-TRACEID-SPANID-FLAGS)", s.traceparent)
	}
	level := levels.fallback
	if s.priority != "" {
		if !contains(levels.levels, s.priority) {
			return prepared{}, fmt.Errorf("%w: %q: the queue's levels are %s", ErrUnknownPriority, s.priority,
				strings.Join(levels.levels, ", "))
		}
		level = s.priority
	}
	data, err := encodeJSON(task.Data)
	if err != nil {
		return prepared{}, invalid("data of task %q: %v", task.Type, err)
	}
	id := s.id
	if id == "" {
		id = newUUID()
	}
	var expiresAt int64
	switch {
	case !s.expiresAt.IsZero() && s.expiresIn != 0:
		return prepared{}, invalid("give ExpiresAt or ExpiresIn, not both")
	case !s.expiresAt.IsZero():
		if expiresAt = s.expiresAt.UnixMilli(); expiresAt <= 0 {
			return prepared{}, invalid("ExpiresAt %v is before 1970", s.expiresAt)
		}
	case s.expiresIn < 0:
		return prepared{}, invalid("ExpiresIn %v is negative", s.expiresIn)
	case s.expiresIn > 0:
		expiresAt = now + s.expiresIn.Milliseconds()
	}
	payload, err := encodeJSON(envelope{ID: id, Type: task.Type, Data: data, Priority: s.priority, Unique: s.unique,
		Group: s.group, Traceparent: s.traceparent, Tracestate: s.tracestate, ExpiresAt: expiresAt})
	if err != nil {
		return prepared{}, invalid("task %q: %v", task.Type, err)
	}
	p := prepared{level: level, id: id, options: "0", payload: payload, delayMs: s.delay.Milliseconds()}
	if s.unique {
		p.options = "1" // as older copies of push.lua read it
	}
	if s.uniqueFor != nil {
		if *s.uniqueFor < time.Millisecond || *s.uniqueFor > MaxUniqueFor {
			return prepared{}, invalid("UniqueFor %v: give 1 ms to %v", *s.uniqueFor, MaxUniqueFor)
		}
		p.options = fmt.Sprintf("unique_for=%d", s.uniqueFor.Milliseconds())
	}
	if s.debounce != 0 {
		if s.id == "" || s.unique || s.delay != 0 || !s.at.IsZero() {
			return prepared{}, invalid("Debounce: give WithID, and neither Unique, UniqueFor, WithDelay nor At (it is the delay)")
		}
		if s.debounce < time.Millisecond {
			return prepared{}, invalid("Debounce %v: give a positive time of 1 ms or more", s.debounce)
		}
		p.options, p.delayMs = "debounce", s.debounce.Milliseconds()
	}
	if !s.at.IsZero() {
		p.atMs = s.at.UnixMilli()
		if p.atMs <= 0 {
			p.atMs = 1 // push.lua reads 0 as "no due time"; a time before 1970 is past: now.
		}
	}
	return p, nil
}

// encodeJSON is json.Marshal without HTML escaping (kept as the caller wrote it) and without the newline.
func encodeJSON(value interface{}) ([]byte, error) {
	var buffer bytes.Buffer
	encoder := json.NewEncoder(&buffer)
	encoder.SetEscapeHTML(false)
	if err := encoder.Encode(value); err != nil {
		return nil, err
	}
	return bytes.TrimRight(buffer.Bytes(), "\n"), nil
}

func contains(list []string, item string) bool {
	for _, each := range list {
		if each == item {
			return true
		}
	}
	return false
}

func newUUID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic("kmq: crypto/rand failed: " + err.Error()) // The OS's random source does not fail on Linux.
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

func (c *Client) key(queue, rest string) string {
	return c.prefix + ":{" + queue + "}:" + rest
}

func (c *Client) pushCall(ctx context.Context, conn redis.Conn, queue string, tasks []prepared) ([]int64, error) {
	first := tasks[0]
	keys := []interface{}{
		c.key(queue, "ready:"+first.level), c.key(queue, "delayed:"+first.level), c.key(queue, "delayed-tasks"),
		c.key(queue, "wake"), c.key(queue, "unique"), c.key(queue, "stats"), c.key(queue, "routes"),
	}
	args := make([]interface{}, 0, 3+3*len(tasks))
	args = append(args, first.delayMs, first.atMs, c.key(queue, "delay-wake"))
	for _, task := range tasks {
		args = append(args, task.id, task.options, task.payload)
	}
	replies, err := redis.Int64s(pushScript.run(ctx, conn, keys, args))
	if err != nil {
		return nil, fmt.Errorf("queue %q: push.lua: %w", queue, err)
	}
	if len(replies) != len(tasks) {
		return nil, fmt.Errorf("queue %q: push.lua answered %d replies for %d tasks", queue, len(replies), len(tasks))
	}
	return replies, nil
}

// queueLevels reads the queue's levels from P:{Q}:meta (`levels`, highest first, and `default_priority`), or
// takes them from the cache; a task naming a level the cache lacks makes it read them again.
func (c *Client) queueLevels(ctx context.Context, conn redis.Conn, queue string, tasks []Task) (queueLevels, error) {
	c.mu.Lock()
	cached, ok := c.levels[queue]
	c.mu.Unlock()
	if ok && time.Since(cached.read) < levelsFor {
		fresh := true
		for _, task := range tasks {
			if s := settingsOf(task); s.priority != "" && !contains(cached.levels, s.priority) {
				fresh = false
				break
			}
		}
		if fresh {
			return cached, nil
		}
	}
	// HGET, one field at a time: the producers' ACL rules allow it (docs/OPERATIONS.md, "ACL rules"), not HMGET.
	var fields [2]interface{}
	for n, field := range []string{"levels", "default_priority"} {
		value, err := do(ctx, conn, "HGET", c.key(queue, "meta"), field)
		var reply redis.Error
		if errors.As(err, &reply) && strings.HasPrefix(string(reply), "NOPERM") {
			// A producer user of an older kmqd's rules may not read the meta hash: it pushes as to a queue of
			// the one level normal, as it did before queues described their levels.
			break
		}
		if err != nil {
			return queueLevels{}, fmt.Errorf("queue %q: reading its levels: %w", queue, err)
		}
		fields[n] = value
	}
	read := queueLevels{levels: []string{"normal"}, fallback: "normal", read: time.Now()}
	if text, _ := redis.String(fields[0], nil); text != "" {
		read.levels = strings.Split(text, ",")
		read.fallback = read.levels[0]
		if contains(read.levels, "normal") {
			read.fallback = "normal"
		}
	}
	if text, _ := redis.String(fields[1], nil); text != "" && contains(read.levels, text) {
		read.fallback = text
	}
	c.mu.Lock()
	c.levels[queue] = read
	c.mu.Unlock()
	return read, nil
}

// session checks the queue's name and takes a connection for one call on it.
func (c *Client) session(ctx context.Context, queue string) (redis.Conn, error) {
	if err := checkQueue(queue); err != nil {
		return nil, err
	}
	if c.cluster != nil {
		return c.routed(queue), nil
	}
	return c.conn(ctx)
}

// conn takes a connection for a call that may touch several queues (a flow); on a cluster, one that sends each
// command to its key's master.
func (c *Client) conn(ctx context.Context) (redis.Conn, error) {
	if c.cluster != nil {
		return c.routed(""), nil
	}
	conn, err := c.pool.GetContext(ctx)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnreachable, err)
	}
	return conn, nil
}

// script is a Lua script sent with EVALSHA, and with EVAL when Redis answers NOSCRIPT (a restart, a failover,
// SCRIPT FLUSH).
type script struct {
	source string
	sha    string
}

func newScript(source string) script {
	sum := sha1.Sum([]byte(source))
	return script{source: source, sha: hex.EncodeToString(sum[:])}
}

func (s script) run(ctx context.Context, conn redis.Conn, keys, args []interface{}) (interface{}, error) {
	call := make([]interface{}, 0, 2+len(keys)+len(args))
	call = append(call, s.sha, len(keys))
	call = append(append(call, keys...), args...)
	reply, err := do(ctx, conn, "EVALSHA", call...)
	var redisError redis.Error
	if errors.As(err, &redisError) && strings.HasPrefix(string(redisError), "NOSCRIPT") {
		call[0] = s.source
		reply, err = do(ctx, conn, "EVAL", call...)
	}
	return reply, err
}

// do sends one command and reads its reply, telling apart a failure before the command was written
// (ErrUnreachable: nothing ran) from one after (ErrReplyLost: it may have run). Redis's own error replies come
// back as an error matching ErrRefused.
func do(ctx context.Context, conn redis.Conn, command string, args ...interface{}) (interface{}, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if routed, ok := conn.(*routedConn); ok {
		return routed.do(ctx, command, args...)
	}
	if err := conn.Send(command, args...); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnreachable, err)
	}
	if err := conn.Flush(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnreachable, err)
	}
	var reply interface{}
	var err error
	if deadline, ok := ctx.Deadline(); ok {
		reply, err = redis.ReceiveWithTimeout(conn, time.Until(deadline))
	} else {
		reply, err = conn.Receive()
	}
	var redisError redis.Error
	if errors.As(err, &redisError) {
		return nil, refused{redisError}
	}
	if err != nil {
		return nil, fmt.Errorf("%w (%s): %v", ErrReplyLost, command, err)
	}
	return reply, nil
}
