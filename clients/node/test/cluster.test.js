"use strict";
// The client on a Redis Cluster of three masters this test starts (each on a free port in its own temp dir): each
// queue's calls go to the node of its hash tag, and a node that lost its scripts falls back to EVAL.

const assert = require("node:assert/strict");
const { execFileSync, spawn } = require("node:child_process");
const fs = require("node:fs");
const os = require("node:os");
const path = require("node:path");
const { after, before, test } = require("node:test");
const Redis = require("ioredis");
const kmq = require("..");
const { eventually, freePort } = require("./support");

const servers = [];
let client;
let admin;

before(async () => {
  for (let n = 0; n < 3; n++) {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "kmq-node-cluster-"));
    const port = await freePort();
    const child = spawn(
      "redis-server",
      ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir,
        "--cluster-enabled", "yes", "--cluster-config-file", path.join(dir, "nodes.conf"),
        "--logfile", path.join(dir, "redis.log")],
      { stdio: "ignore" }
    );
    servers.push({ dir, port, child });
  }
  for (const { port } of servers) {
    await eventually(() => execFileSync("redis-cli", ["-p", String(port), "ping"]).toString().trim() === "PONG",
      `redis-server on ${port}`);
  }
  execFileSync("redis-cli", ["--cluster", "create", ...servers.map(({ port }) => `127.0.0.1:${port}`),
    "--cluster-replicas", "0", "--cluster-yes"], { stdio: "ignore" });
  for (const { port } of servers) {
    await eventually(
      () => /cluster_state:ok/.test(execFileSync("redis-cli", ["-p", String(port), "cluster", "info"]).toString()),
      `the cluster's state ok on ${port}`, 30000);
  }
  const nodes = servers.map(({ port }) => ({ host: "127.0.0.1", port }));
  client = new kmq.Client(nodes, { cluster: {}, connectTimeoutMs: 10000 });
  admin = new Redis.Cluster(nodes);
});

after(async () => {
  if (client) await client.close();
  if (admin) admin.disconnect();
  for (const { dir, child } of servers) {
    child.kill("SIGKILL");
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

test("on a cluster, each queue's pushes, show and cancel go to its own node", async () => {
  const queues = ["mail", "reports", "sms", "billing", "thumbnails", "search"];
  for (const queue of queues) {
    await client.push(queue, "t", { queue }, { id: `${queue}-1`, unique: true });
    await client.pushBatch(queue, [{ type: "t", data: 1 }, { type: "t", data: 2, delay: 60000 }]);
  }
  // The queues' slots are on more than one node.
  const owners = new Set();
  for (const queue of queues) {
    const slot = Number(await admin.call("CLUSTER", "KEYSLOT", `{${queue}}`));
    const shards = await admin.call("CLUSTER", "SLOTS");
    owners.add(shards.find(([from, to]) => slot >= from && slot <= to)[2][1]);
  }
  assert.ok(owners.size > 1, `every queue on one node: ${[...owners]}`);
  for (const queue of queues) {
    assert.equal(await admin.llen(`kmq:{${queue}}:ready:normal`), 2);
    assert.equal(await admin.zcard(`kmq:{${queue}}:delayed:normal`), 1);
    assert.deepEqual((await client.show(queue, `${queue}-1`)).map((place) => place.state), ["ready"]);
    assert.equal(await client.cancel(queue, `${queue}-1`), 1);
  }
  // A node that lost its script cache (a restart, a failover) is sent EVAL.
  await Promise.all(admin.nodes("master").map((node) => node.script("FLUSH")));
  await client.push("mail", "t", {}, { id: "after-flush" });
  assert.equal((await client.show("mail", "after-flush")).length, 1);
  await assert.rejects(client.push("mail", "t", {}, { id: "mail-2", unique: true }).then(() =>
    client.push("mail", "t", {}, { id: "mail-2", unique: true })), kmq.DuplicateError);
});
