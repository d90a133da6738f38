package kmq

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// startSentinel starts a Sentinel (redis-server --sentinel, with a config file it may rewrite) watching master as
// "mymaster", and waits until it names the master.
func startSentinel(t *testing.T, master *redisServer) *redisServer {
	t.Helper()
	dir := t.TempDir()
	port := freePort(t)
	config := filepath.Join(dir, "sentinel.conf")
	text := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nsentinel monitor mymaster 127.0.0.1 %d 1\n", port, dir, master.port)
	if err := os.WriteFile(config, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("redis-server", config, "--sentinel", "--logfile", filepath.Join(dir, "redis.log"))
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting a Sentinel (redis-server --sentinel): %v", err)
	}
	sentinel := &redisServer{port: port, dir: dir, cmd: cmd}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	eventually(t, 10*time.Second, "the Sentinel names the master", func() bool {
		return sentinelMaster(sentinel) == master.addr()
	}, sentinel.log)
	return sentinel
}

// sentinelMaster is the master's address the Sentinel gives, "" when it gives none.
func sentinelMaster(sentinel *redisServer) string {
	conn, err := redis.Dial("tcp", sentinel.addr())
	if err != nil {
		return ""
	}
	defer conn.Close()
	addr, err := redis.Strings(conn.Do("SENTINEL", "get-master-addr-by-name", "mymaster"))
	if err != nil || len(addr) != 2 {
		return ""
	}
	return addr[0] + ":" + addr[1]
}

// One master and one Sentinel for the file's tests, in order: the last one demotes the master.
func TestSentinel(t *testing.T) {
	master := startRedis(t)
	sentinel := startSentinel(t, master)
	ctx := context.Background()
	client, err := NewSentinel([]string{"redis://" + sentinel.addr() + "/0"}, "mymaster")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })

	t.Run("APushGoesToTheMasterTheSentinelNames", func(t *testing.T) {
		pushLandsOn(t, client, master, "s-1")
	})

	t.Run("AnUnknownMasterNameIsErrUnreachable", func(t *testing.T) {
		other, err := NewSentinel([]string{"redis://" + sentinel.addr()}, "nosuchmaster")
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close()
		_, err = other.Push(ctx, "mail", "mail.send", nil)
		if err == nil || !strings.Contains(err.Error(), "nosuchmaster") || !strings.Contains(err.Error(), "unreachable") {
			t.Fatalf("push: %v, want ErrUnreachable naming the master", err)
		}
	})

	t.Run("AMasterDemotedUnderPooledConnectionsIsAskedForAgainNotUsedAgain", func(t *testing.T) {
		// Three pooled connections to the master, as a busy client has.
		var held []redis.Conn
		for n := 0; n < 3; n++ {
			conn := client.pool.Get()
			if _, err := conn.Do("PING"); err != nil {
				t.Fatal(err)
			}
			held = append(held, conn)
		}
		for _, conn := range held {
			conn.Close()
		}
		// The master becomes a replica (of no server that answers), as a failover makes an old master that comes
		// back; the Sentinel does not know yet and still names it.
		if _, err := master.conn(t).Do("REPLICAOF", "127.0.0.1", fmt.Sprint(freePort(t))); err != nil {
			t.Fatal(err)
		}
		// A cancel: remove.lua's write is refused READONLY (push.lua reports the refusal of its RPUSH as a
		// WRONGTYPE, "is a list, not a list", which is push.lua's to fix).
		_, err := client.Cancel(ctx, "mail", "s-1")
		if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "READONLY") {
			t.Fatalf("a cancel on the demoted master: %v, want ErrRefused with READONLY", err)
		}
		// The next call does not take a pooled connection to it: it asks the Sentinel, dials what it names and
		// finds, with ROLE, that it is not the master.
		_, err = client.Push(ctx, "mail", "mail.send", nil, WithID("d-2"))
		if !errors.Is(err, ErrUnreachable) || !strings.Contains(err.Error(), "not master") {
			t.Fatalf("second push: %v, want ErrUnreachable (the Sentinel's master is not a master)", err)
		}
	})
}
