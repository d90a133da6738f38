package kmq

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gomodule/redigo/redis"
)

// A master watched by Redis Sentinel, for redigo, which has no Sentinel client: every new connection asks a
// Sentinel for the master's address (SENTINEL get-master-addr-by-name), dials it and checks with ROLE that it is
// the master, as kmqd's daemons do. A reply that shows the master is gone or demoted (READONLY, or a broken
// connection) makes every pooled connection stale, so the next call dials the master Sentinel names then.

// NewSentinel connects lazily to the master that Sentinels watch under the name master: sentinels are redis://
// (or rediss://, for TLS to the Sentinels and to the master) URLs of the Sentinels, whose user and password are
// used for the Sentinels and for the master alike and whose database (the first URL's) is the master's. The
// users need `+role` beside the producers' rules on the master and its replicas, and on the Sentinels
// `+sentinel|get-master-addr-by-name` (docs/CLIENTS.md, "Sentinel and TLS").
func NewSentinel(sentinels []string, master string, options ...Option) (*Client, error) {
	if len(sentinels) == 0 || master == "" {
		return nil, invalid("a Sentinel deployment needs at least one Sentinel's URL and the master's name")
	}
	s, err := newSettings(options)
	if err != nil {
		return nil, err
	}
	parsed, err := parseURLs("sentinel", sentinels)
	if err != nil {
		return nil, err
	}
	addrs := make([]string, 0, len(parsed))
	for _, sentinel := range parsed {
		// A Sentinel has no databases (it refuses SELECT): the path is the master's database only.
		sentinel.Path = ""
		addrs = append(addrs, sentinel.String())
	}
	watch := &sentinelWatch{sentinels: addrs, name: master, template: parsed[0],
		dial: s.dial}
	pool := newPool("", nil)
	pool.Dial = watch.dialMaster
	idle := pool.TestOnBorrow
	pool.TestOnBorrow = func(conn redis.Conn, since time.Time) error {
		if watched, ok := conn.(*watchedConn); ok && watched.generation != watch.generation.Load() {
			return errors.New("kmq: a connection to a master before a failover")
		}
		return idle(conn, since)
	}
	client := NewWithPool(pool, WithKeyPrefix(s.prefix))
	client.ownsPool = true
	return client, nil
}

// sentinelWatch asks the Sentinels for the master, and counts failovers seen from the master's replies.
type sentinelWatch struct {
	// sentinels are the Sentinels' URLs, without a database.
	sentinels []string
	name      string
	// template is the first Sentinel's URL, whose scheme, credentials and database the master's URL takes.
	template url.URL
	dial     []redis.DialOption
	// generation counts the replies that showed the master failed or was demoted: a pooled connection dialled
	// in an older generation is closed rather than used (pool.TestOnBorrow).
	generation atomic.Uint64

	// mu guards next, the Sentinel asked first: the one that answered last.
	mu   sync.Mutex
	next int
}

// dialMaster asks each Sentinel in turn (the last that answered first) for the master's address and dials it;
// a server that is not the master (ROLE) is closed and the next Sentinel asked.
func (w *sentinelWatch) dialMaster() (redis.Conn, error) {
	generation := w.generation.Load()
	w.mu.Lock()
	start := w.next
	w.mu.Unlock()
	var failures []string
	for n := range w.sentinels {
		at := (start + n) % len(w.sentinels)
		conn, err := w.askAndDial(w.sentinels[at])
		if err != nil {
			failures = append(failures, err.Error())
			continue
		}
		w.mu.Lock()
		w.next = at
		w.mu.Unlock()
		return &watchedConn{Conn: conn, watch: w, generation: generation}, nil
	}
	return nil, fmt.Errorf("master %q of the Sentinels: %s", w.name, strings.Join(failures, "; "))
}

func (w *sentinelWatch) askAndDial(sentinelURL string) (redis.Conn, error) {
	sentinel, err := redis.DialURL(sentinelURL, w.dial...)
	if err != nil {
		return nil, fmt.Errorf("sentinel %s: %v", sentinelURL, err)
	}
	addr, err := redis.Strings(sentinel.Do("SENTINEL", "get-master-addr-by-name", w.name))
	sentinel.Close()
	if err != nil || len(addr) != 2 {
		return nil, fmt.Errorf("sentinel %s: SENTINEL get-master-addr-by-name %s: %v", sentinelURL, w.name, err)
	}
	master := w.template
	master.Host = net.JoinHostPort(addr[0], addr[1])
	conn, err := redis.DialURL(master.String(), w.dial...)
	if err != nil {
		return nil, fmt.Errorf("master %s (from sentinel %s): %v", master.Host, sentinelURL, err)
	}
	role, err := redis.Values(conn.Do("ROLE"))
	if err == nil && (len(role) == 0 || fmt.Sprintf("%s", role[0]) != "master") {
		err = fmt.Errorf("its ROLE is %s, not master (a failover under way)", role[0])
	}
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("master %s (from sentinel %s): %v", master.Host, sentinelURL, err)
	}
	return conn, nil
}

// failed records a reply of the generation's master that shows it is no longer the master: READONLY (demoted to
// a replica), or a connection that broke. Every connection of the generation is then stale.
func (w *sentinelWatch) failed(generation uint64, err error) {
	var reply redis.Error
	if err == nil || (errors.As(err, &reply) && !strings.HasPrefix(string(reply), "READONLY")) {
		return
	}
	w.generation.CompareAndSwap(generation, generation+1)
}

// watchedConn is a connection to the master of one generation, which reports the replies that show a failover.
type watchedConn struct {
	redis.Conn
	watch      *sentinelWatch
	generation uint64
}

func (c *watchedConn) Do(command string, args ...interface{}) (interface{}, error) {
	reply, err := c.Conn.Do(command, args...)
	c.watch.failed(c.generation, err)
	return reply, err
}

func (c *watchedConn) Receive() (interface{}, error) {
	reply, err := c.Conn.Receive()
	c.watch.failed(c.generation, err)
	return reply, err
}

// DoWithTimeout and ReceiveWithTimeout keep redigo's timeouts, which `do` uses for a context's deadline.
func (c *watchedConn) DoWithTimeout(timeout time.Duration, command string, args ...interface{}) (interface{}, error) {
	reply, err := redis.DoWithTimeout(c.Conn, timeout, command, args...)
	c.watch.failed(c.generation, err)
	return reply, err
}

func (c *watchedConn) ReceiveWithTimeout(timeout time.Duration) (interface{}, error) {
	reply, err := redis.ReceiveWithTimeout(c.Conn, timeout)
	c.watch.failed(c.generation, err)
	return reply, err
}
