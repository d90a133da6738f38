"use strict";
// End to end: tasks pushed with the client are run by a real kmqd daemon (the workspace's binary, KMQD_BIN, which
// scripts/test sets) with the testkit plugin beside it, and `result` reads what the settle kept.

const assert = require("node:assert/strict");
const { spawn } = require("node:child_process");
const fs = require("node:fs");
const path = require("node:path");
const { after, before, test } = require("node:test");
const kmq = require("..");
const { RedisServer, eventually } = require("./support");

const KMQD_BIN = process.env.KMQD_BIN;
let server;
let daemon;
let client;
let daemonLog;

before(async () => {
  if (!KMQD_BIN) return;
  server = await RedisServer.start();
  const plugins = path.join(server.dir, "plugins");
  fs.mkdirSync(plugins, { mode: 0o755 });
  // kmqd refuses a plugin that others could write: a copy with safe permissions.
  const testkit = process.env.KMQD_TESTKIT ?? path.join(path.dirname(KMQD_BIN), "libkmq_testkit.so");
  fs.copyFileSync(testkit, path.join(plugins, "libkmq_testkit.so"));
  fs.chmodSync(path.join(plugins, "libkmq_testkit.so"), 0o755);
  const config = path.join(server.dir, "kmqd.toml");
  fs.writeFileSync(
    config,
    `[redis]
url = "${server.url}"

[daemon]
plugins_dir = "${plugins}"
shutdown_grace = "5s"

[[queues]]
name = "jobs"
mode = "safe"
priorities = ["high", "normal", "low"]
keep_results = "1h"
retry_times = 0
backoff = "10ms"

[plugins.testkit]
file = "libkmq_testkit.so"
config = { types = ["test"] }
`
  );
  daemonLog = path.join(server.dir, "kmqd.log");
  const out = fs.openSync(daemonLog, "w");
  daemon = spawn(KMQD_BIN, ["--config", config], { stdio: ["ignore", out, out] });
  client = new kmq.Client(server.url);
});

after(async () => {
  if (!KMQD_BIN) return;
  await client.close();
  if (daemon.exitCode === null) {
    const exited = new Promise((resolve) => daemon.once("exit", resolve));
    daemon.kill("SIGTERM");
    await exited;
  }
  server.stop();
});

test("a task pushed by the client at a level the daemon described runs in kmqd, and result reads what it kept", async (t) => {
  if (!KMQD_BIN) {
    t.skip("KMQD_BIN is not set: scripts/test sets it to the workspace's kmqd");
    return;
  }
  // The daemon describes the queue's levels at start; the client reads them at its first push.
  await eventually(async () => (await server.admin.hget("kmq:{jobs}:meta", "levels")) === "high,normal,low",
    "the daemon's levels in the queue's meta hash", 60000);
  const id = await client.push("jobs", "test", { result: { rows: 3 } }, { id: "report-7", unique: true, priority: "high" });
  const ended = await client.result("jobs", id, { wait: 60000 });
  assert.deepEqual(
    { state: ended.state, result: ended.result },
    { state: "done", result: { rows: 3 } },
    `daemon log: ${fs.readFileSync(daemonLog, "utf8").slice(-2000)}`
  );
  assert.equal(typeof ended.endedAt, "number");

  const [doomed] = await client.pushBatch("jobs", [{ type: "test", data: { outcome: "fail" } }]);
  const dead = await client.result("jobs", doomed.id, { wait: 60000 });
  assert.equal(dead.state, "dead");
  assert.match(dead.reason, /testkit: asked to fail/);
  // Ended: no longer anywhere but the dead-letter list.
  assert.deepEqual((await client.show("jobs", doomed.id)).map((place) => place.state), ["dead"]);
  assert.deepEqual(await client.show("jobs", id), []);
});

test("a flow pushed by the client runs in kmqd: the waiting task after the tasks it waits for", async (t) => {
  if (!KMQD_BIN) {
    t.skip("KMQD_BIN is not set: scripts/test sets it to the workspace's kmqd");
    return;
  }
  await eventually(async () => (await server.admin.hget("kmq:{jobs}:meta", "levels")) === "high,normal,low",
    "the daemon's levels in the queue's meta hash", 60000);
  const tasks = await client.pushFlow({
    queue: "jobs",
    type: "test",
    id: "merge-1",
    data: { result: "merged" },
    after: [
      { queue: "jobs", type: "test", id: "part-1", data: { result: 1 } },
      { queue: "jobs", type: "test", id: "part-2", data: { result: 2 }, priority: "low" },
    ],
  });
  assert.deepEqual(tasks.map((task) => task.id), ["merge-1", "part-1", "part-2"]);
  const merged = await client.result("jobs", "merge-1", { wait: 60000 });
  assert.equal(merged.state, "done", `daemon log: ${fs.readFileSync(daemonLog, "utf8").slice(-2000)}`);
  assert.equal(merged.result, "merged");
  for (const part of ["part-1", "part-2"]) {
    const ended = await client.result("jobs", part, { wait: 0 });
    assert.equal(ended.state, "done");
    assert.ok(ended.endedAt <= merged.endedAt, `${part} ended at ${ended.endedAt}, after the merge at ${merged.endedAt}`);
  }
});
