package kmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gomodule/redigo/redis"
)

// A Redis Cluster client for redigo, which has none: kmqd's keys of one queue share the hash tag `{QUEUE}`, so
// each call of this package goes to the one master serving its queue's slot. A command's key decides its node (the
// slot of the key's hash tag, CRC16 mod 16384, looked up in the slot map read with CLUSTER SLOTS), over a redigo
// pool per master. A `MOVED` reply (the slot has a new master: the command did not run) reloads the map and sends
// the command again to the new master; an `ASK` reply (the slot is being migrated and this key is already on the
// target) sends `ASKING` and the command once to the node it names. Nothing else is resent: a connection that
// breaks after the command was written is ErrReplyLost, as on a single Redis.

// clusterSlots is how many hash slots a Redis Cluster has.
const clusterSlots = 16384

// maxRedirects bounds how many MOVED and ASK replies one command follows: a slot migrating back and forth (or a
// map that will not settle) ends in an error rather than a loop.
const maxRedirects = 5

// tryAgainFor is how long a command answered TRYAGAIN is sent again: while a slot migrates, a script whose keys
// are partly moved cannot run on either side until the migration of the slot's keys ends, which redis-cli's
// resharding does in moments.
const tryAgainFor = 10 * time.Second

// cluster is the slot map and the pools of a Redis Cluster's masters.
type cluster struct {
	// seeds are the addresses (host:port) given to NewCluster, asked for the slot map when no known master
	// answers.
	seeds []string
	// nodeURL makes the URL of a node's address, keeping the seeds' scheme (rediss:// for TLS) and credentials.
	nodeURL func(addr string) string
	dial    []redis.DialOption

	// mu guards slots and pools: calls read them, a MOVED reply or a refresh after a failure replaces them.
	mu    sync.Mutex
	slots [clusterSlots]string // the master's address (host:port) of each slot, "" when no node serves it
	pools map[string]*redis.Pool
	// loaded is when the map was last read: a burst of MOVED replies (a slot just moved, every caller learns it at
	// once) reads it once, not once per caller.
	loaded time.Time
}

// NewCluster connects lazily to a Redis Cluster: seeds are redis:// (or rediss://, for TLS on every node) URLs of
// any of its nodes, with the user and password every node takes; database 0, the only one a cluster has. The
// client reads the slot map (CLUSTER SLOTS) from a seed on its first call and keeps a pool per master. The
// nodes' ACL users need `+ping +cluster|slots +asking` beside the producers' rules (docs/OPERATIONS.md, "ACL
// rules").
func NewCluster(seeds []string, options ...Option) (*Client, error) {
	if len(seeds) == 0 {
		return nil, invalid("a cluster needs at least one seed node's URL")
	}
	s, err := newSettings(options)
	if err != nil {
		return nil, err
	}
	parsed, err := parseURLs("cluster seed", seeds)
	if err != nil {
		return nil, err
	}
	addrs := make([]string, 0, len(parsed))
	for n, seed := range parsed {
		if db := strings.Trim(seed.Path, "/"); db != "" && db != "0" {
			return nil, invalid("cluster seed %q: a Redis Cluster has database 0 only", seeds[n])
		}
		addrs = append(addrs, hostPort(&seed))
	}
	template := parsed[0]
	template.Path = ""
	c := &cluster{
		seeds: addrs,
		nodeURL: func(addr string) string {
			node := template
			node.Host = addr
			return node.String()
		},
		dial:  s.dial,
		pools: map[string]*redis.Pool{},
	}
	return &Client{cluster: c, prefix: s.prefix, levels: map[string]queueLevels{}, ownsPool: true}, nil
}

// parseURLs reads the URLs of a deployment's servers (what names them in errors): all redis:// or all rediss://.
func parseURLs(what string, urls []string) ([]url.URL, error) {
	parsed := make([]url.URL, 0, len(urls))
	for _, raw := range urls {
		if _, err := redisURL(raw); err != nil {
			return nil, err
		}
		each, err := url.Parse(raw)
		if err != nil || each.Host == "" {
			return nil, invalid("%s %q: not a redis://host:port URL", what, raw)
		}
		if len(parsed) > 0 && each.Scheme != parsed[0].Scheme {
			return nil, invalid("%ss %q and %q: give all redis:// or all rediss://", what, urls[0], raw)
		}
		parsed = append(parsed, *each)
	}
	return parsed, nil
}

// hostPort is a URL's host:port, with Redis's default port when it names none.
func hostPort(u *url.URL) string {
	if u.Port() == "" {
		return net.JoinHostPort(u.Hostname(), "6379")
	}
	return u.Host
}

func (c *cluster) close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var first error
	for _, pool := range c.pools {
		if err := pool.Close(); err != nil && first == nil {
			first = err
		}
	}
	c.pools = map[string]*redis.Pool{}
	return first
}

// pool is the pool of the node at addr, made on first use.
func (c *cluster) pool(addr string) *redis.Pool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if pool, ok := c.pools[addr]; ok {
		return pool
	}
	pool := newPool(c.nodeURL(addr), c.dial)
	c.pools[addr] = pool
	return pool
}

// master is the address of the master serving slot, reading the slot map first when it was never read.
func (c *cluster) master(ctx context.Context, slot int) (string, error) {
	c.mu.Lock()
	addr, loaded := c.slots[slot], !c.loaded.IsZero()
	c.mu.Unlock()
	if addr != "" {
		return addr, nil
	}
	if !loaded {
		if err := c.refresh(ctx, time.Time{}); err != nil {
			return "", err
		}
		c.mu.Lock()
		addr = c.slots[slot]
		c.mu.Unlock()
	}
	if addr == "" {
		return "", fmt.Errorf("%w: no node of the cluster serves slot %d (CLUSTER SLOTS)", ErrUnreachable, slot)
	}
	return addr, nil
}

// refresh reads the slot map with CLUSTER SLOTS from the known masters, then the seeds, the first that answers;
// seen is when the caller's map was read, so that callers who saw the same stale map read it once between them.
func (c *cluster) refresh(ctx context.Context, seen time.Time) error {
	c.mu.Lock()
	if c.loaded.After(seen) && !seen.IsZero() {
		c.mu.Unlock()
		return nil
	}
	var candidates []string
	known := map[string]bool{}
	for _, addr := range c.slots {
		if addr != "" && !known[addr] {
			known[addr] = true
			candidates = append(candidates, addr)
		}
	}
	for _, addr := range c.seeds {
		if !known[addr] {
			known[addr] = true
			candidates = append(candidates, addr)
		}
	}
	c.mu.Unlock()
	var failures []string
	for _, addr := range candidates {
		slots, err := c.readSlots(ctx, addr)
		if err != nil {
			failures = append(failures, fmt.Sprintf("%s: %v", addr, err))
			continue
		}
		c.mu.Lock()
		c.slots = slots
		c.loaded = time.Now()
		c.mu.Unlock()
		return nil
	}
	return fmt.Errorf("%w: reading the cluster's slot map: %s", ErrUnreachable, strings.Join(failures, "; "))
}

// readSlots asks the node at addr for the slot map. A node that answers with an empty host means "the address
// you reached me at", as Redis does when it does not know its own.
func (c *cluster) readSlots(ctx context.Context, addr string) (slots [clusterSlots]string, err error) {
	conn, err := c.pool(addr).GetContext(ctx)
	if err != nil {
		return slots, err
	}
	defer conn.Close()
	ranges, err := redis.Values(do(ctx, conn, "CLUSTER", "SLOTS"))
	if err != nil {
		return slots, err
	}
	served := 0
	for _, each := range ranges {
		fields, err := redis.Values(each, nil)
		if err != nil || len(fields) < 3 {
			return slots, fmt.Errorf("CLUSTER SLOTS: unexpected entry %v", each)
		}
		start, err1 := redis.Int(fields[0], nil)
		end, err2 := redis.Int(fields[1], nil)
		node, err3 := redis.Values(fields[2], nil)
		if err1 != nil || err2 != nil || err3 != nil || len(node) < 2 || start < 0 || end >= clusterSlots {
			return slots, fmt.Errorf("CLUSTER SLOTS: unexpected entry %v", each)
		}
		host, _ := redis.String(node[0], nil)
		port, _ := redis.Int(node[1], nil)
		if host == "" || host == "?" {
			host, _, _ = net.SplitHostPort(addr)
		}
		master := net.JoinHostPort(host, strconv.Itoa(port))
		for slot := start; slot <= end; slot++ {
			slots[slot] = master
		}
		served += end - start + 1
	}
	if served == 0 {
		return slots, errors.New("CLUSTER SLOTS: the node knows no slot's master (not a cluster yet?)")
	}
	return slots, nil
}

// learn records what a MOVED reply says (slot's master is addr) until the next refresh.
func (c *cluster) learn(slot int, addr string) {
	c.mu.Lock()
	c.slots[slot] = addr
	c.mu.Unlock()
}

// routedConn is a cluster "connection" for one call of the client (a push, a show, a flow): each command goes to
// the master of its key's slot, on a connection taken from that master's pool for the rest of the call. It is a
// redis.Conn only so that it travels through the same functions as a single Redis's connection: `do` sends
// through it (routed.do), its other methods are not used.
type routedConn struct {
	cluster *cluster
	// slot is the call's queue's slot, where a command without a key (TIME) goes; -1 for a call of several
	// queues (a flow), where such a command goes to the node of the call's last command.
	slot  int
	conns map[string]redis.Conn
	last  string
}

func (c *Client) routed(queue string) *routedConn {
	slot := -1
	if queue != "" {
		slot = keySlot(c.key(queue, ""))
	}
	return &routedConn{cluster: c.cluster, slot: slot, conns: map[string]redis.Conn{}}
}

func (r *routedConn) Close() error {
	var first error
	for _, conn := range r.conns {
		if err := conn.Close(); err != nil && first == nil {
			first = err
		}
	}
	r.conns = map[string]redis.Conn{}
	return first
}

func (r *routedConn) Err() error { return nil }

func (r *routedConn) Do(command string, args ...interface{}) (interface{}, error) {
	return r.do(context.Background(), command, args...)
}

var errNotPipelined = errors.New("kmq: a cluster call sends one command at a time (not Send, Flush, Receive)")

func (r *routedConn) Send(string, ...interface{}) error { return errNotPipelined }
func (r *routedConn) Flush() error                      { return errNotPipelined }
func (r *routedConn) Receive() (interface{}, error)     { return nil, errNotPipelined }

// conn is the call's connection to the node at addr, taken from its pool on first use.
func (r *routedConn) conn(ctx context.Context, addr string) (redis.Conn, error) {
	if conn, ok := r.conns[addr]; ok {
		return conn, nil
	}
	conn, err := r.cluster.pool(addr).GetContext(ctx)
	if err != nil {
		return nil, fmt.Errorf("%w: cluster node %s: %v", ErrUnreachable, addr, err)
	}
	r.conns[addr] = conn
	return conn, nil
}

// do sends one command to the master of its key's slot, following MOVED (the map is read again: the command did
// not run) and ASK (ASKING, then the command once on the node named), and waiting out TRYAGAIN (a migration has
// some of a script's keys on each side: the command did not run) for up to tryAgainFor. Any other outcome is
// `do`'s: a reply, an error reply (ErrRefused), ErrUnreachable (nothing sent) or ErrReplyLost (sent, and never
// resent).
func (r *routedConn) do(ctx context.Context, command string, args ...interface{}) (interface{}, error) {
	slot := r.slot
	if key, ok := commandKey(command, args); ok {
		slot = keySlot(key)
	}
	// moved is the master a MOVED reply named, where the command goes next whatever the map says (a node whose map
	// lags behind cannot undo it); ask the node an ASK reply named, for the next attempt only.
	moved, ask := "", ""
	redirects := 0
	pause, waitUntil := 10*time.Millisecond, time.Now().Add(tryAgainFor)
	for {
		seen := time.Now()
		addr, err := r.route(ctx, slot, moved, ask)
		if err != nil {
			return nil, err
		}
		conn, err := r.conn(ctx, addr)
		if err != nil {
			// A master that cannot be reached may have failed over: the next call reads the map again.
			_ = r.cluster.refresh(ctx, seen)
			return nil, err
		}
		if ask != "" {
			if _, err := do(ctx, conn, "ASKING"); err != nil {
				return nil, err
			}
		} else {
			r.last = addr
		}
		ask = ""
		reply, err := do(ctx, conn, command, args...)
		kind, to := redirection(err)
		switch kind {
		case "MOVED", "ASK":
			if redirects++; redirects > maxRedirects {
				return nil, fmt.Errorf("%s: %d redirections and no answer, the last %w", command, maxRedirects, err)
			}
			if kind == "ASK" {
				ask = to
				continue
			}
			// The map is read again for the other slots that moved with this one.
			_ = r.cluster.refresh(ctx, seen)
			if slot >= 0 {
				r.cluster.learn(slot, to)
			}
			moved = to
		case "TRYAGAIN":
			if time.Now().Add(pause).After(waitUntil) {
				return nil, err
			}
			if pause, err = pauseThenDouble(ctx, pause); err != nil {
				return nil, err
			}
			moved = ""
		default:
			if errors.Is(err, ErrUnreachable) {
				// The master may have failed over: read the map again for the next call (this one is not resent;
				// nothing was written, so the caller may make it again).
				_ = r.cluster.refresh(ctx, seen)
			}
			return reply, err
		}
	}
}

// route is the node a command of slot goes to: the one an ASK or a MOVED reply named, else the slot's master; a
// command without a key (slot -1) goes where the call's last command went.
func (r *routedConn) route(ctx context.Context, slot int, moved, ask string) (string, error) {
	switch {
	case ask != "":
		return ask, nil
	case moved != "":
		return moved, nil
	case slot >= 0:
		return r.cluster.master(ctx, slot)
	case r.last != "":
		return r.last, nil
	default:
		// A command without a key as a flow's first: any master answers it.
		return r.cluster.master(ctx, 0)
	}
}

// redirection reads a cluster's redirection from an error reply: "MOVED 3999 127.0.0.1:6381" and "ASK ..." with
// the node they name, "TRYAGAIN ..." without one; "" for any other error.
func redirection(err error) (kind, addr string) {
	var reply redis.Error
	if !errors.As(err, &reply) {
		return "", ""
	}
	fields := strings.Fields(string(reply))
	switch {
	case len(fields) == 3 && (fields[0] == "MOVED" || fields[0] == "ASK"):
		return fields[0], fields[2]
	case len(fields) > 0 && fields[0] == "TRYAGAIN":
		return "TRYAGAIN", ""
	}
	return "", ""
}

// commandKey is the key a command of this package names: the first argument, or the first key of a script call
// (EVAL and EVALSHA take the script, the key count, then the keys); TIME, PING and CLUSTER name none.
func commandKey(command string, args []interface{}) (string, bool) {
	switch strings.ToUpper(command) {
	case "TIME", "PING", "CLUSTER", "ASKING", "SCRIPT", "INFO":
		return "", false
	case "EVAL", "EVALSHA":
		if len(args) < 3 || fmt.Sprint(args[1]) == "0" {
			return "", false
		}
		return fmt.Sprint(args[2]), true
	}
	if len(args) == 0 {
		return "", false
	}
	return fmt.Sprint(args[0]), true
}

// keySlot is Redis Cluster's slot of a key: CRC16 (XMODEM) of its hash tag, the part between the first `{` and
// the next `}` when that is not empty, else of the whole key, mod 16384.
func keySlot(key string) int {
	if open := strings.IndexByte(key, '{'); open >= 0 {
		if close := strings.IndexByte(key[open+1:], '}'); close > 0 {
			key = key[open+1 : open+1+close]
		}
	}
	return int(crc16(key)) % clusterSlots
}

// crc16 is CRC-16/XMODEM (polynomial 0x1021, initial 0), the checksum Redis Cluster's key slots use.
func crc16(data string) uint16 {
	var crc uint16
	for i := 0; i < len(data); i++ {
		crc ^= uint16(data[i]) << 8
		for bit := 0; bit < 8; bit++ {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}
