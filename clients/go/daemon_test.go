package kmq

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gomodule/redigo/redis"
)

// End to end: a task pushed with this client is run by a real kmqd daemon (the testkit plugin answers done with
// the task's `result`), and Result reads what its settle kept. KMQD_BIN is the daemon (scripts/test sets it to
// the workspace's build) and KMQD_PLUGINS the folder holding libkmq_testkit.so (default: KMQD_BIN's folder).
func TestAPushedTaskIsRunByTheDaemonAndItsResultRead(t *testing.T) {
	bin := os.Getenv("KMQD_BIN")
	if bin == "" {
		t.Skip("KMQD_BIN is not set: scripts/test sets it to target/debug/kmqd")
	}
	built := os.Getenv("KMQD_PLUGINS")
	if built == "" {
		built = filepath.Dir(bin)
	}
	server := startRedis(t)
	dir := t.TempDir()
	plugins := filepath.Join(dir, "plugins")
	if err := os.Mkdir(plugins, 0o755); err != nil {
		t.Fatal(err)
	}
	testkit, err := os.ReadFile(filepath.Join(built, "libkmq_testkit.so"))
	if err != nil {
		t.Fatalf("the testkit plugin (cargo build --workspace): %v", err)
	}
	// kmqd refuses a plugin that group or others may write.
	if err := os.WriteFile(filepath.Join(plugins, "libkmq_testkit.so"), testkit, 0o755); err != nil {
		t.Fatal(err)
	}
	template, err := os.ReadFile(filepath.Join("..", "testdata", "kmqd.toml"))
	if err != nil {
		t.Fatal(err)
	}
	config := filepath.Join(dir, "kmqd.toml")
	text := strings.NewReplacer("REDIS_URL", server.url(), "PLUGINS_DIR", plugins).Replace(string(template))
	if err := os.WriteFile(config, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(dir, "kmqd.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	daemon := exec.Command(bin, "--config", config)
	daemon.Stdout, daemon.Stderr = logFile, logFile
	if err := daemon.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = daemon.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = daemon.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = daemon.Process.Kill()
			<-done
		}
		logFile.Close()
	})
	// The daemon describes the queue's levels in its meta hash at start; the client learns them there.
	conn := server.conn(t)
	eventually(t, 30*time.Second, "the daemon writes the queue's levels", func() bool {
		levels, _ := redis.String(conn.Do("HGET", "kmq:{jobs}:meta", "levels"))
		return levels == "high,normal"
	}, func() string { text, _ := os.ReadFile(logPath); return string(text) })
	client := newClient(t, server.url())
	ctx := context.Background()
	id, err := client.Push(ctx, "jobs", "job", map[string]interface{}{"result": map[string]int{"rows": 3}},
		WithPriority("high"))
	if err != nil {
		t.Fatal(err)
	}
	result, err := client.Result(ctx, "jobs", id, 60*time.Second)
	if err != nil || result.State != "done" || string(result.Result) != `{"rows":3}` {
		text, _ := os.ReadFile(logPath)
		t.Fatalf("result %+v, %v\ndaemon log:\n%s", result, err, text)
	}
}
