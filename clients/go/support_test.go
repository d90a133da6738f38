package kmq

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// redisServer is a redis-server this test started: its own free port on loopback and its own temp dir, killed
// when the test ends (never a Redis the test did not start). extra are more of redis-server's arguments.
type redisServer struct {
	port int
	dir  string
	cmd  *exec.Cmd
}

func startRedis(t *testing.T, extra ...string) *redisServer {
	t.Helper()
	dir := t.TempDir()
	port := freePort(t)
	args := append([]string{"--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--logfile", filepath.Join(dir, "redis.log")}, extra...)
	cmd := exec.Command("redis-server", args...)
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting redis-server (install Debian's redis-server): %v", err)
	}
	server := &redisServer{port: port, dir: dir, cmd: cmd}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	eventually(t, 10*time.Second, "redis-server answers PING", func() bool {
		conn, err := redis.Dial("tcp", server.addr())
		if err != nil {
			return false
		}
		defer conn.Close()
		_, err = conn.Do("PING")
		return err == nil
	}, server.log)
	return server
}

func (s *redisServer) addr() string { return fmt.Sprintf("127.0.0.1:%d", s.port) }
func (s *redisServer) url() string  { return "redis://" + s.addr() + "/0" }

func (s *redisServer) log() string {
	text, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
	return string(text)
}

// conn is a plain connection for the test's own reads and writes.
func (s *redisServer) conn(t *testing.T) redis.Conn {
	t.Helper()
	conn, err := redis.Dial("tcp", s.addr())
	if err != nil {
		t.Fatalf("connecting to the test's redis-server: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func freePort(t *testing.T) int {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close()
	return listener.Addr().(*net.TCPAddr).Port
}

// eventually polls cond until it holds or the deadline passes; explain adds what helps to read a failure.
func eventually(t *testing.T, within time.Duration, what string, cond func() bool, explain func() string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			extra := ""
			if explain != nil {
				extra = "\n" + explain()
			}
			t.Fatalf("not within %v: %s%s", within, what, extra)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// replyDropper is a TCP proxy in front of a Redis that forwards what the client writes and, once armed, closes
// the client's connection instead of forwarding Redis's next reply: the command ran, its reply is lost.
type replyDropper struct {
	listener net.Listener
	mu       sync.Mutex
	armed    bool
}

func startReplyDropper(t *testing.T, upstream string) *replyDropper {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	proxy := &replyDropper{listener: listener}
	t.Cleanup(func() { listener.Close() })
	go func() {
		for {
			client, err := listener.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", upstream)
			if err != nil {
				client.Close()
				continue
			}
			go func() {
				_, _ = io.Copy(server, client)
				server.Close()
			}()
			go func() {
				buffer := make([]byte, 64*1024)
				for {
					n, err := server.Read(buffer)
					if n > 0 {
						proxy.mu.Lock()
						armed := proxy.armed
						proxy.mu.Unlock()
						if armed {
							break
						}
						if _, err := client.Write(buffer[:n]); err != nil {
							break
						}
					}
					if err != nil {
						break
					}
				}
				client.Close()
				server.Close()
			}()
		}
	}()
	return proxy
}

func (p *replyDropper) url() string { return "redis://" + p.listener.Addr().String() + "/0" }

func (p *replyDropper) arm() {
	p.mu.Lock()
	p.armed = true
	p.mu.Unlock()
}

// pushLandsOn pushes a task of id to queue mail and checks that server holds it first in the queue's ready list.
func pushLandsOn(t *testing.T, client *Client, server *redisServer, id string) {
	t.Helper()
	if _, err := client.Push(context.Background(), "mail", "mail.send", nil, WithID(id)); err != nil {
		t.Fatal(err)
	}
	stored, err := redis.String(server.conn(t).Do("LINDEX", "kmq:{mail}:ready:normal", 0))
	if err != nil || envelopeID(stored) != id {
		t.Fatalf("the first ready task on %s: %q, %v; want %s", server.addr(), stored, err, id)
	}
}
