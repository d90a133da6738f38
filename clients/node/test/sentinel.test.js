"use strict";
// The client of a Sentinel-watched master (ioredis's `sentinels` and `name`): a master and a Sentinel this test
// starts on free ports; the client asks the Sentinel where the master is and pushes there.

const assert = require("node:assert/strict");
const { spawn } = require("node:child_process");
const fs = require("node:fs");
const path = require("node:path");
const { after, before, test } = require("node:test");
const Redis = require("ioredis");
const kmq = require("..");
const { RedisServer, eventually, freePort } = require("./support");

let master;
let sentinel;
let sentinelPort;
before(async () => {
  master = await RedisServer.start();
  sentinelPort = await freePort();
  // A Sentinel is a redis-server started with --sentinel and a config file it may rewrite.
  const config = path.join(master.dir, "sentinel.conf");
  fs.writeFileSync(
    config,
    `port ${sentinelPort}\nbind 127.0.0.1\nsentinel monitor mymaster 127.0.0.1 ${master.port} 1\n`
  );
  sentinel = spawn("redis-server", [config, "--sentinel", "--logfile", path.join(master.dir, "sentinel.log")], {
    stdio: "ignore",
  });
  const asker = new Redis({ port: sentinelPort, host: "127.0.0.1", lazyConnect: true, retryStrategy: () => 50 });
  asker.on("error", () => {});
  try {
    await eventually(async () => {
      if (asker.status === "wait") await asker.connect();
      return (await asker.call("SENTINEL", "MASTERS")).length > 0;
    }, "the Sentinel to know the master");
  } finally {
    asker.disconnect();
  }
});
after(() => {
  if (sentinel && sentinel.exitCode === null) sentinel.kill("SIGKILL");
  master.stop();
});

test("a client of a Sentinel-watched master pushes to the master", async () => {
  const client = new kmq.Client({ sentinels: [{ host: "127.0.0.1", port: sentinelPort }], name: "mymaster" });
  try {
    await client.push("mail", "mail.send", { to: "ada" }, { id: "s-1" });
    const queued = await master.admin.lrange("kmq:{mail}:ready:normal", 0, -1);
    assert.deepEqual(queued.map((task) => JSON.parse(task).id), ["s-1"]);
  } finally {
    await client.close();
  }
});
