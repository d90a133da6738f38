package kmq

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/gomodule/redigo/redis"
)

// certificates makes, with openssl, a test CA and a server certificate it signed for localhost and 127.0.0.1, in
// dir (as the Rust harness does for tests/it/tls.rs and the Node client's tls.test.js), with P-256 keys, which
// openssl makes at once where RSA keys take seconds.
func certificates(t *testing.T, dir string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, "server.ext"), []byte("subjectAltName = DNS:localhost, IP:127.0.0.1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
			"-subj", "/CN=kmq go test CA"},
		{"req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"},
		{"x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
			"server.crt", "-days", "2", "-extfile", "server.ext"},
	} {
		openssl := exec.Command("openssl", args...)
		openssl.Dir = dir
		if out, err := openssl.CombinedOutput(); err != nil {
			t.Fatalf("openssl %v (install Debian's openssl): %v\n%s", args, err, out)
		}
	}
}

// A redis-server with a TLS port (and its plain one, for the test's own reads), for the file's tests.
func TestTLS(t *testing.T) {
	dir := t.TempDir()
	certificates(t, dir)
	tlsPort := freePort(t)
	server := startRedis(t, "--tls-port", fmt.Sprint(tlsPort), "--tls-cert-file", filepath.Join(dir, "server.crt"),
		"--tls-key-file", filepath.Join(dir, "server.key"), "--tls-ca-cert-file", filepath.Join(dir, "ca.crt"),
		"--tls-auth-clients", "no")
	ctx := context.Background()
	url := fmt.Sprintf("rediss://localhost:%d/0", tlsPort)

	t.Run("AClientTrustingTheCAFilePushesOverTLS", func(t *testing.T) {
		client, err := New(url, WithCAFile(filepath.Join(dir, "ca.crt")))
		if err != nil {
			t.Fatal(err)
		}
		defer client.Close()
		pushLandsOn(t, client, server, "tls-1")
	})

	t.Run("AClientNotTrustingTheCertificateIsErrUnreachableWithNothingWritten", func(t *testing.T) {
		client, err := New(url)
		if err != nil {
			t.Fatal(err)
		}
		defer client.Close()
		if _, err := client.Push(ctx, "refused", "mail.send", nil); !errors.Is(err, ErrUnreachable) {
			t.Fatalf("push: %v, want ErrUnreachable", err)
		}
		if keys, err := redis.Strings(server.conn(t).Do("KEYS", "kmq:{refused}:*")); err != nil || len(keys) != 0 {
			t.Fatalf("keys written: %v, %v", keys, err)
		}
	})

	t.Run("ACAFileThatIsMissingOrNotPEMIsErrInvalidArgument", func(t *testing.T) {
		for _, path := range []string{filepath.Join(dir, "missing.crt"), filepath.Join(dir, "server.ext")} {
			if _, err := New(url, WithCAFile(path)); !errors.Is(err, ErrInvalidArgument) {
				t.Errorf("WithCAFile(%s): %v, want ErrInvalidArgument", path, err)
			}
		}
	})
}
