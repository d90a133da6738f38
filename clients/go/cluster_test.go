package kmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// startCluster starts a Redis Cluster of three masters (redis-cli --cluster create, as the Python client's tests
// do), each its own redis-server of startRedis, and waits until every node reports it ok. Each node has a TLS port
// too (tls-cluster: its bus speaks TLS, and CLUSTER SLOTS names the TLS ports to a client that came over TLS), with
// a certificate of the CA in caFile.
func startCluster(t *testing.T) (nodes []*redisServer, tlsPorts []int, caFile string) {
	t.Helper()
	dir := t.TempDir()
	certificates(t, dir)
	var addrs []string
	for n := 0; n < 3; n++ {
		tlsPort := freePort(t)
		// Its own bus port: the default (the port + 10000) does not exist for a free port above 55535.
		node := startRedis(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-port", fmt.Sprint(freePort(t)), "--tls-port", fmt.Sprint(tlsPort), "--tls-cluster", "yes",
			"--tls-cert-file", filepath.Join(dir, "server.crt"), "--tls-key-file", filepath.Join(dir, "server.key"),
			"--tls-ca-cert-file", filepath.Join(dir, "ca.crt"), "--tls-auth-clients", "no")
		nodes = append(nodes, node)
		tlsPorts = append(tlsPorts, tlsPort)
		addrs = append(addrs, node.addr())
	}
	// redis-cli waits for the nodes to agree without a bound of its own.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	create := exec.CommandContext(ctx, "redis-cli",
		append(append([]string{"--cluster", "create"}, addrs...), "--cluster-yes")...)
	if out, err := create.CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	eventually(t, 30*time.Second, "every node reports cluster_state:ok", func() bool {
		for _, node := range nodes {
			info, err := redis.String(node.conn(t).Do("CLUSTER", "INFO"))
			if err != nil || !strings.Contains(info, "cluster_state:ok") {
				return false
			}
		}
		return true
	}, nil)
	return nodes, tlsPorts, filepath.Join(dir, "ca.crt")
}

// ownerOf is the node that serves key: the others answer MOVED.
func ownerOf(t *testing.T, nodes []*redisServer, key string) *redisServer {
	t.Helper()
	for _, node := range nodes {
		if _, err := node.conn(t).Do("TYPE", key); err == nil {
			return node
		}
	}
	t.Fatalf("no node serves %q", key)
	return nil
}

func nodeID(t *testing.T, node *redisServer) string {
	t.Helper()
	id, err := redis.String(node.conn(t).Do("CLUSTER", "MYID"))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// moveSlot makes target the master of key's slot on every node, as the last step of a resharding does (the slot
// holds no keys yet, so none are migrated).
func moveSlot(t *testing.T, nodes []*redisServer, key string, target *redisServer) {
	t.Helper()
	slot := keySlot(key)
	id := nodeID(t, target)
	for _, node := range append([]*redisServer{target}, nodes...) {
		if _, err := node.conn(t).Do("CLUSTER", "SETSLOT", slot, "NODE", id); err != nil {
			t.Fatalf("CLUSTER SETSLOT %d NODE on %s: %v", slot, node.addr(), err)
		}
	}
}

func otherThan(nodes []*redisServer, node *redisServer) *redisServer {
	for _, each := range nodes {
		if each != node {
			return each
		}
	}
	return nil
}

func newClusterClient(t *testing.T, nodes ...*redisServer) *Client {
	t.Helper()
	var seeds []string
	for _, node := range nodes {
		seeds = append(seeds, node.url())
	}
	client, err := NewCluster(seeds)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	return client
}

// One cluster for the file's tests (they use queues of their own), started once: a cluster takes seconds.
func TestCluster(t *testing.T) {
	nodes, tlsPorts, caFile := startCluster(t)
	ctx := context.Background()

	t.Run("KeySlotIsRedisClusterKeyslot", func(t *testing.T) {
		conn := nodes[0].conn(t)
		for _, key := range []string{"foo", "kmq:{mail}:ready:normal", "{user1000}.following", "a{}b", "a{b}{c}",
			"{}{x}", "x{", "日本{語}", ""} {
			want, err := redis.Int(conn.Do("CLUSTER", "KEYSLOT", key))
			if err != nil {
				t.Fatal(err)
			}
			if got := keySlot(key); got != want {
				t.Errorf("keySlot(%q) = %d, CLUSTER KEYSLOT says %d", key, got, want)
			}
		}
	})

	t.Run("EachQueueIsPushedShownAndCancelledOnItsMaster", func(t *testing.T) {
		client := newClusterClient(t, nodes[0])
		owners := map[*redisServer]bool{}
		for n := 0; n < 6; n++ {
			queue := fmt.Sprintf("q%d", n)
			owners[ownerOf(t, nodes, "kmq:{"+queue+"}:ready:normal")] = true
			if _, err := client.Push(ctx, queue, "t", nil, WithID(queue+"-1"), Unique()); err != nil {
				t.Fatalf("push to %s: %v", queue, err)
			}
			batch := []Task{{Type: "t"}, {Type: "t"}, {Type: "t", Options: []PushOption{ExpiresIn(time.Minute)}}}
			if _, err := client.PushBatch(ctx, queue, batch); err != nil {
				t.Fatalf("batch to %s: %v", queue, err)
			}
			if _, err := client.Push(ctx, queue, "t", nil, WithID(queue+"-1"), Unique()); !errors.Is(err, ErrDuplicate) {
				t.Fatalf("second unique push to %s: %v, want ErrDuplicate", queue, err)
			}
			found, err := client.Show(ctx, queue, queue+"-1")
			if err != nil || len(found) != 1 || found[0].State != "ready" {
				t.Fatalf("show on %s: %+v, %v", queue, found, err)
			}
			if removed, err := client.Cancel(ctx, queue, queue+"-1"); err != nil || removed != 1 {
				t.Fatalf("cancel on %s: %d, %v", queue, removed, err)
			}
		}
		if len(owners) < 2 {
			t.Fatalf("the queues' slots are all on one master: the test would not show routing")
		}
		for n := 0; n < 6; n++ {
			key := fmt.Sprintf("kmq:{q%d}:ready:normal", n)
			if length, err := redis.Int(ownerOf(t, nodes, key).conn(t).Do("LLEN", key)); err != nil || length != 3 {
				t.Fatalf("%s on its master: %d tasks, %v; want 3", key, length, err)
			}
		}
	})

	t.Run("OverTLSEveryMasterIsReachedOnItsTLSPort", func(t *testing.T) {
		client, err := NewCluster([]string{fmt.Sprintf("rediss://127.0.0.1:%d", tlsPorts[0])}, WithCAFile(caFile))
		if err != nil {
			t.Fatal(err)
		}
		defer client.Close()
		for n := 0; n < 6; n++ {
			queue := fmt.Sprintf("tls%d", n)
			if _, err := client.Push(ctx, queue, "t", nil); err != nil {
				t.Fatalf("push to %s over TLS: %v", queue, err)
			}
		}
		client.cluster.mu.Lock()
		pools := len(client.cluster.pools)
		for addr := range client.cluster.pools {
			if strings.HasSuffix(addr, fmt.Sprintf(":%d", nodes[0].port)) {
				t.Errorf("a pool of a plain port over TLS: %s", addr)
			}
		}
		client.cluster.mu.Unlock()
		if pools < 2 {
			t.Fatalf("%d masters' pools: the queues should have reached at least two", pools)
		}
	})

	t.Run("AFlowOverQueuesOfTwoMastersIsPushed", func(t *testing.T) {
		client := newClusterClient(t, nodes[1])
		flow := `{"queue": "q0", "type": "merge", "id": "f-root", "after": [{"queue": "q1", "type": "part", "id": "f-1"},
			{"queue": "q2", "type": "part", "id": "f-2"}]}`
		tasks, err := client.PushFlow(ctx, []byte(flow))
		if err != nil || len(tasks) != 3 {
			t.Fatalf("flow: %+v, %v", tasks, err)
		}
		for _, queue := range []string{"q1", "q2"} {
			found, err := client.Show(ctx, queue, "f-"+queue[1:])
			if err != nil || len(found) != 1 || found[0].State != "ready" {
				t.Fatalf("the flow's task on %s: %+v, %v", queue, found, err)
			}
		}
	})

	t.Run("AMovedSlotIsFollowedAndThePushLandsOnceOnTheNewMaster", func(t *testing.T) {
		client := newClusterClient(t, nodes...)
		if _, err := client.Push(ctx, "q0", "t", nil); err != nil { // reads the slot map
			t.Fatal(err)
		}
		key := "kmq:{moving}:ready:normal"
		source := ownerOf(t, nodes, key)
		target := otherThan(nodes, source)
		moveSlot(t, nodes, key, target)
		if _, err := client.Push(ctx, "moving", "t", nil, WithID("m-1")); err != nil {
			t.Fatalf("push after the slot moved: %v", err)
		}
		if length, err := redis.Int(target.conn(t).Do("LLEN", key)); err != nil || length != 1 {
			t.Fatalf("on the new master: %d tasks, %v; want 1", length, err)
		}
		if found, err := client.Show(ctx, "moving", "m-1"); err != nil || len(found) != 1 {
			t.Fatalf("show after the move: %+v, %v", found, err)
		}
	})

	t.Run("APushDuringAMigrationIsAskedThenWaitsAndLandsOnceOnTheTarget", func(t *testing.T) {
		client := newClusterClient(t, nodes...)
		key := "kmq:{asked}:ready:normal"
		source := ownerOf(t, nodes, key)
		target := otherThan(nodes, source)
		slot := keySlot(key)
		if _, err := target.conn(t).Do("CLUSTER", "SETSLOT", slot, "IMPORTING", nodeID(t, source)); err != nil {
			t.Fatal(err)
		}
		if _, err := source.conn(t).Do("CLUSTER", "SETSLOT", slot, "MIGRATING", nodeID(t, target)); err != nil {
			t.Fatal(err)
		}
		// The queue has no keys on the source, so the source answers ASK to every command of the push; the target
		// answers the levels' HGET (one key) after ASKING, and push.lua (keys it lacks) TRYAGAIN until the
		// migration ends.
		pushed := make(chan error, 1)
		go func() {
			_, err := client.Push(ctx, "asked", "t", nil, WithID("a-1"))
			pushed <- err
		}()
		eventually(t, 10*time.Second, "the target answered TRYAGAIN to the push", func() bool {
			stats, _ := redis.String(target.conn(t).Do("INFO", "errorstats"))
			return strings.Contains(stats, "errorstat_TRYAGAIN")
		}, nil)
		moveSlot(t, nodes, key, target)
		if err := <-pushed; err != nil {
			t.Fatalf("push during the migration: %v", err)
		}
		if length, err := redis.Int(target.conn(t).Do("LLEN", key)); err != nil || length != 1 {
			t.Fatalf("on the target: %d tasks, %v; want 1", length, err)
		}
		stats, _ := redis.String(target.conn(t).Do("INFO", "commandstats"))
		if !strings.Contains(stats, "cmdstat_asking:calls=") {
			t.Fatalf("the target was never sent ASKING: %s", stats)
		}
	})

	// Last: it makes a node announce a proxy's port, which the other nodes learn too.
	t.Run("AReplyLostOnAClusterIsReplyLostAndNotResent", func(t *testing.T) {
		node := nodes[2]
		proxy := startReplyDropper(t, node.addr())
		port := fmt.Sprint(proxy.listener.Addr().(*net.TCPAddr).Port)
		// With tls-cluster, Redis 7.0 takes a new cluster-announce-port (the plain port it names) only beside a
		// cluster-announce-tls-port: the node's own.
		if _, err := node.conn(t).Do("CONFIG", "SET", "cluster-announce-port", port,
			"cluster-announce-tls-port", tlsPorts[2]); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if conn, err := redis.Dial("tcp", node.addr()); err == nil {
				_, _ = conn.Do("CONFIG", "SET", "cluster-announce-port", "0", "cluster-announce-tls-port", "0")
				conn.Close()
			}
		})
		eventually(t, 10*time.Second, "the node announces the proxy's port", func() bool {
			slots, err := redis.Values(node.conn(t).Do("CLUSTER", "SLOTS"))
			return err == nil && strings.Contains(fmt.Sprint(slots), " "+port+" ")
		}, nil)
		queue := ""
		for n := 0; queue == ""; n++ {
			if ownerOf(t, nodes, fmt.Sprintf("kmq:{lost%d}:ready:normal", n)) == node {
				queue = fmt.Sprintf("lost%d", n)
			}
		}
		client := newClusterClient(t, node)
		if _, err := client.Push(ctx, queue, "t", nil); err != nil { // through the proxy, which still forwards
			t.Fatal(err)
		}
		proxy.arm()
		_, err := client.Push(ctx, queue, "t", nil, WithID("lost-1"))
		if !errors.Is(err, ErrReplyLost) || !strings.Contains(err.Error(), "may have been") {
			t.Fatalf("push whose reply was dropped: %v, want ErrReplyLost", err)
		}
		key := "kmq:{" + queue + "}:ready:normal"
		if length, err := redis.Int(node.conn(t).Do("LLEN", key)); err != nil || length != 2 {
			t.Fatalf("%s: %d tasks, %v; want 2 (the first push and the lost one, not resent)", key, length, err)
		}
	})
}

func TestNewClusterRefusesBadSeedsAndCallsOfNoReachableSeedAreErrUnreachable(t *testing.T) {
	for _, seeds := range [][]string{nil, {"http://127.0.0.1:7000"}, {"redis://127.0.0.1:7000/3"},
		{"redis://127.0.0.1:7000", "rediss://127.0.0.1:7001"}} {
		if _, err := NewCluster(seeds); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("NewCluster(%q): %v, want ErrInvalidArgument", seeds, err)
		}
	}
	client, err := NewCluster([]string{fmt.Sprintf("redis://127.0.0.1:%d", freePort(t))})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	if _, err := client.Push(context.Background(), "mail", "t", nil); !errors.Is(err, ErrUnreachable) ||
		!strings.Contains(err.Error(), "slot map") {
		t.Fatalf("push: %v, want ErrUnreachable reading the slot map", err)
	}
}
