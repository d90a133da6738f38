"use strict";
// The client over TLS (rediss://): a redis-server with a TLS port and a certificate of a test CA this test makes
// with openssl (as the Rust harness does for tests/it/tls.rs): a client trusting the CA pushes; one that does not
// is refused before anything is sent.

const assert = require("node:assert/strict");
const { execFileSync } = require("node:child_process");
const fs = require("node:fs");
const path = require("node:path");
const { after, before, test } = require("node:test");
const kmq = require("..");
const { RedisServer, freePort } = require("./support");

/** A CA and a server certificate it signed for localhost and 127.0.0.1, in `dir`. */
function certificates(dir) {
  const run = (...args) => execFileSync("openssl", args, { cwd: dir, stdio: "pipe" });
  fs.writeFileSync(path.join(dir, "server.ext"), "subjectAltName = DNS:localhost, IP:127.0.0.1\n");
  run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
    "-subj", "/CN=kmq node test CA");
  run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost");
  run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
    "server.crt", "-days", "2", "-extfile", "server.ext");
  return { ca: fs.readFileSync(path.join(dir, "ca.crt")) };
}

let server;
let tlsPort;
let ca;
before(async () => {
  tlsPort = await freePort();
  server = await RedisServer.start((dir) => {
    ({ ca } = certificates(dir));
    return ["--tls-port", String(tlsPort), "--tls-cert-file", path.join(dir, "server.crt"),
      "--tls-key-file", path.join(dir, "server.key"), "--tls-ca-cert-file", path.join(dir, "ca.crt"),
      "--tls-auth-clients", "no"];
  });
});
after(() => server.stop());

test("a client trusting the server's CA pushes over TLS", async () => {
  const client = new kmq.Client({ host: "localhost", port: tlsPort, tls: { ca } });
  try {
    const id = await client.push("mail", "mail.send", { to: "ada" }, { id: "tls-1" });
    assert.equal(id, "tls-1");
    const stored = JSON.parse(await server.admin.lindex("kmq:{mail}:ready:normal", 0));
    assert.equal(stored.id, "tls-1");
  } finally {
    await client.close();
  }
});

test("a rediss:// client that does not trust the server's certificate is refused, with nothing sent", async () => {
  const client = new kmq.Client(`rediss://localhost:${tlsPort}/0`, { connectTimeoutMs: 2000 });
  try {
    await assert.rejects(client.push("refused", "mail.send", {}), kmq.RedisUnreachableError);
    assert.deepEqual(await server.admin.keys("kmq:{refused}:*"), []);
  } finally {
    await client.close();
  }
});
