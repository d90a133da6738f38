"use strict";
// The tests' own redis-servers: each on a free loopback port in a temp dir of its own (never 6379), started and
// waited for with a deadline, killed at the end; and a TCP proxy that can swallow replies.

const { spawn } = require("node:child_process");
const fs = require("node:fs");
const net = require("node:net");
const os = require("node:os");
const path = require("node:path");
const Redis = require("ioredis");

/** A free loopback port: one the OS hands out, closed again at once. */
function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.unref();
    server.on("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/** Polls `check` until it returns a truthy value, or fails with `what` once `timeoutMs` passed. */
async function eventually(check, what, timeoutMs = 10000) {
  const deadline = Date.now() + timeoutMs;
  let last;
  for (;;) {
    try {
      const value = await check();
      if (value) return value;
    } catch (error) {
      last = error;
    }
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}${last ? `: ${last.message}` : ""}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

class RedisServer {
  /** `extra`: more redis-server arguments, given the server's temp dir (a TLS port, its certificates). */
  static async start(extra = () => []) {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "kmq-node-"));
    const port = await freePort();
    const child = spawn(
      "redis-server",
      ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir,
        "--logfile", path.join(dir, "redis.log"), ...(await extra(dir))],
      { stdio: "ignore" }
    );
    const server = new RedisServer(dir, port, child);
    child.on("error", (error) => {
      server.spawnError = error;
    });
    const admin = new Redis({ port, host: "127.0.0.1", lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => 50 });
    admin.on("error", () => {});
    try {
      await eventually(async () => {
        if (server.spawnError) throw server.spawnError;
        if (admin.status === "wait") await admin.connect();
        return (await admin.ping()) === "PONG";
      }, `redis-server on port ${port} (log: ${server.log()})`);
    } catch (error) {
      admin.disconnect();
      server.stop();
      throw error;
    }
    server.admin = admin;
    return server;
  }

  constructor(dir, port, child) {
    this.dir = dir;
    this.port = port;
    this.child = child;
    this.url = `redis://127.0.0.1:${port}/0`;
  }

  log() {
    try {
      return fs.readFileSync(path.join(this.dir, "redis.log"), "utf8").slice(-2000);
    } catch {
      return "(no log)";
    }
  }

  stop() {
    if (this.admin) this.admin.disconnect();
    if (this.child.exitCode === null) this.child.kill("SIGKILL");
    fs.rmSync(this.dir, { recursive: true, force: true });
  }
}

/**
 * A TCP proxy in front of a Redis port. `swallow()` makes it drop what Redis answers from then on and close the
 * client's connection once a request went through: the client wrote its command, Redis ran it, the reply was lost.
 */
class Proxy {
  static async start(targetPort) {
    const proxy = new Proxy(targetPort);
    await new Promise((resolve) => proxy.server.listen(0, "127.0.0.1", resolve));
    proxy.port = proxy.server.address().port;
    return proxy;
  }

  constructor(targetPort) {
    this.swallowing = false;
    this.sockets = new Set();
    this.server = net.createServer((client) => {
      const upstream = net.connect(targetPort, "127.0.0.1");
      this.sockets.add(client);
      this.sockets.add(upstream);
      client.on("data", (chunk) => upstream.write(chunk));
      upstream.on("data", (chunk) => {
        if (this.swallowing) {
          client.destroy();
          upstream.destroy();
        } else {
          client.write(chunk);
        }
      });
      const end = () => {
        client.destroy();
        upstream.destroy();
      };
      client.on("error", end);
      upstream.on("error", end);
      client.on("close", end);
      upstream.on("close", end);
    });
  }

  swallow() {
    this.swallowing = true;
  }

  stop() {
    for (const socket of this.sockets) socket.destroy();
    return new Promise((resolve) => this.server.close(resolve));
  }
}

module.exports = { RedisServer, Proxy, eventually, freePort };
