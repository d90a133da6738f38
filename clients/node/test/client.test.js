"use strict";
// The client against a real redis-server of its own (test/support.js): pushes, errors, show, cancel, result.

const assert = require("node:assert/strict");
const fs = require("node:fs");
const path = require("node:path");
const { after, before, beforeEach, describe, test } = require("node:test");
const kmq = require("..");
const { RedisServer, Proxy, eventually, freePort } = require("./support");

let server;
let client;

before(async () => {
  server = await RedisServer.start();
  client = new kmq.Client(server.url, { keyPrefix: "kmq" });
});

after(async () => {
  await client.close();
  server.stop();
});

beforeEach(async () => {
  await server.admin.flushall();
});

async function readyList(queue, level = "normal") {
  return (await server.admin.lrange(`kmq:{${queue}}:ready:${level}`, 0, -1)).map((text) => JSON.parse(text));
}

describe("push", () => {
  test("a push stores the envelope push.lua stamps, wakes the daemon and counts it", async () => {
    const id = await client.push("mail", "mail.send", { to: "ada" });
    assert.match(id, /^[0-9a-f-]{36}$/);
    const [task] = await readyList("mail");
    assert.deepEqual(Object.keys(task).sort(), ["attempt", "created_at", "data", "id", "type"]);
    assert.equal(task.id, id);
    assert.deepEqual(task.data, { to: "ada" });
    assert.equal(await server.admin.hget("kmq:{mail}:stats", "pushed"), "1");
    assert.deepEqual(await server.admin.lrange("kmq:{mail}:wake", 0, -1), ["1"]);
  });

  test("a unique push of a live id rejects with DuplicateError and changes nothing", async () => {
    await client.push("mail", "mail.send", {}, { id: "w-1", unique: true });
    await assert.rejects(client.push("mail", "mail.send", { other: 1 }, { id: "w-1", unique: true }), (error) => {
      assert.ok(error instanceof kmq.DuplicateError);
      assert.equal(error.id, "w-1");
      return true;
    });
    assert.equal((await readyList("mail")).length, 1);
    assert.equal(await server.admin.hget("kmq:{mail}:stats", "pushed"), "1");
  });

  test("a uniqueFor push of an id held after its task ended rejects with DuplicateError, and holds its own id", async () => {
    // The hold key stands for a task of w-1 that ended less than its window ago (docs/PROTOCOL.md, "Debounce, and
    // unique for a time"); push.lua refuses every unique push of w-1 while it exists.
    await server.admin.set("kmq:{mail}:unique:held:w-1", "1765000000000", "PX", 600000);
    await assert.rejects(client.push("mail", "t", {}, { id: "w-1", uniqueFor: 3_600_000 }), kmq.DuplicateError);
    await assert.rejects(client.push("mail", "t", {}, { id: "w-1", unique: true }), kmq.DuplicateError);
    assert.deepEqual(await readyList("mail"), []);
    await server.admin.del("kmq:{mail}:unique:held:w-1");
    assert.equal(await client.push("mail", "t", {}, { id: "w-1", uniqueFor: 3_600_000 }), "w-1");
    assert.equal((await readyList("mail"))[0].unique, true);
    assert.match(await server.admin.hget("kmq:{mail}:unique", "w-1"), /^\d+:3600000$/);
  });

  test("bad arguments are refused before anything is sent", async () => {
    const cases = [
      [() => client.push("mail", "", {}), kmq.InvalidArgumentError, /type/],
      [() => client.push("mail", "t", {}, { unique: true }), kmq.InvalidArgumentError, /unique task needs an id/],
      [() => client.push("mail", "t", {}, { group: "" }), kmq.InvalidArgumentError, /group/],
      [() => client.push("mail", "t", {}, { group: "g".repeat(65) }), kmq.InvalidArgumentError, /1 to 64 bytes/],
      [() => client.push("mail", "t", {}, { priority: "urgent" }), kmq.UnknownPriorityError, /no priority "urgent"/],
      [() => client.push("mail", "t", {}, { delay: -1 }), kmq.InvalidArgumentError, /delay/],
      [() => client.push("mail", "t", {}, { expiresIn: 0 }), kmq.InvalidArgumentError, /expiresIn/],
      [() => client.push("mail", "t", {}, { debounce: 5000 }), kmq.InvalidArgumentError, /debounce: give an id/],
      [() => client.push("mail", "t", {}, { id: "d", debounce: 5000, delay: 1 }), kmq.InvalidArgumentError, /debounce/],
      [() => client.push("mail", "t", {}, { uniqueFor: 5000 }), kmq.InvalidArgumentError, /unique task needs an id/],
      [() => client.push("mail", "t", {}, { id: "u", uniqueFor: 0 }), kmq.InvalidArgumentError, /uniqueFor/],
      [() => client.push("mail", "t", {}, { id: "u", uniqueFor: 1e12 }), kmq.InvalidArgumentError, /uniqueFor/],
      [() => client.push("mail", "t", {}, { id: "u", uniqueFor: 1.5 }), kmq.InvalidArgumentError, /uniqueFor/],
      [() => client.push("mail", "t", {}, { id: "d", debounce: 5, uniqueFor: 5 }), kmq.InvalidArgumentError, /debounce/],
      [() => client.push("mail", "t", {}, { expiresAt: 1, expiresIn: 5 }), kmq.InvalidArgumentError, /not both/],
      [() => client.pushBatch("mail", [{ type: "t" }, { data: 1 }]), kmq.InvalidArgumentError, /type/],
    ];
    for (const [call, kind, words] of cases) {
      await assert.rejects(call(), (error) => error instanceof kind && words.test(error.message));
    }
    assert.deepEqual(await server.admin.keys("*"), []);
  });

  test("an unknown priority is one not among the levels the queue's meta names", async () => {
    await server.admin.hset("kmq:{jobs}:meta", "protocol", "1", "levels", "high,normal,low", "default_priority", "low");
    const fresh = new kmq.Client(server.url);
    try {
      await fresh.push("jobs", "t", 1);
      await fresh.push("jobs", "t", 2, { priority: "high" });
      assert.equal((await readyList("jobs", "low")).length, 1);
      assert.equal((await readyList("jobs", "high"))[0].priority, "high");
      await assert.rejects(fresh.push("jobs", "t", 3, { priority: "urgent" }), (error) => {
        assert.ok(error instanceof kmq.UnknownPriorityError);
        assert.deepEqual(error.levels, ["high", "normal", "low"]);
        return true;
      });
    } finally {
      await fresh.close();
    }
  });

  test("a level an operator adds is pushed to at once by a client that kept the old shape", async () => {
    // The rule of every client (docs/CLIENTS.md): a priority the kept shape lacks reads the meta hash again before
    // it is refused, so a level a daemon's reload added is known at the first push that names it.
    await server.admin.hset("kmq:{jobs}:meta", "levels", "high,low", "default_priority", "low");
    const fresh = new kmq.Client(server.url);
    try {
      await fresh.push("jobs", "t", 1);
      await server.admin.hset("kmq:{jobs}:meta", "levels", "urgent,high,low");
      await fresh.push("jobs", "t", 2, { priority: "urgent" });
      assert.equal((await readyList("jobs", "urgent")).length, 1);
    } finally {
      await fresh.close();
    }
  });

  test("a producer user that may not read the meta hash (older ACL rules) pushes as to a queue of the one level normal", async () => {
    await server.admin.hset("kmq:{jobs}:meta", "protocol", "1", "levels", "high,normal,low", "default_priority", "low");
    await server.admin.call("ACL", "SETUSER", "older", "on", ">secret", "~*", "&*", "+@all", "-hget");
    await server.admin.call("ACL", "SETUSER", "today", "on", ">secret", "~*", "&*", "+@all");
    const older = new kmq.Client(`redis://older:secret@127.0.0.1:${server.port}/0`);
    const today = new kmq.Client(`redis://today:secret@127.0.0.1:${server.port}/0`);
    try {
      await older.push("jobs", "t", "older");
      await today.push("jobs", "t", "today");
      assert.deepEqual((await readyList("jobs", "normal")).map((task) => task.data), ["older"]);
      assert.deepEqual((await readyList("jobs", "low")).map((task) => task.data), ["today"]);
    } finally {
      await older.close();
      await today.close();
      await server.admin.call("ACL", "DELUSER", "older", "today");
    }
  });

  test("a delayed push waits in the delayed set, due on Redis's clock", async () => {
    const id = await client.push("mail", "t", {}, { delay: 60000 });
    const [seconds] = await server.admin.time();
    const due = Number(await server.admin.zscore("kmq:{mail}:delayed:normal", id));
    assert.ok(Math.abs(due - (Number(seconds) * 1000 + 60000)) < 5000, `due ${due}`);
    assert.ok(await server.admin.hget("kmq:{mail}:delayed-tasks", id));
    const at = await client.push("mail", "t", {}, { at: new Date(Date.now() + 3600000) });
    assert.ok(Number(await server.admin.zscore("kmq:{mail}:delayed:normal", at)) > due);
  });

  test("a batch goes one push.lua call per 1,000 tasks and keeps their order", async () => {
    const calls = [];
    const original = client.evalScript.bind(client);
    client.evalScript = (sha, source, keys, args) => {
      calls.push((args.length - 3) / 3);
      return original(sha, source, keys, args);
    };
    try {
      const tasks = Array.from({ length: 2500 }, (_, n) => ({ type: "t", data: n }));
      const pushed = await client.pushBatch("mail", tasks);
      assert.equal(pushed.length, 2500);
      assert.ok(pushed.every((p) => p.accepted));
      assert.deepEqual(calls, [1000, 1000, 500]);
      const stored = await readyList("mail");
      assert.deepEqual(stored.map((task) => task.data), tasks.map((task) => task.data));
      assert.deepEqual(stored.map((task) => task.id), pushed.map((p) => p.id));
    } finally {
      client.evalScript = original;
    }
  });

  test("a batch reports a duplicate among accepted tasks without refusing the others", async () => {
    const pushed = await client.pushBatch("mail", [
      { type: "t", id: "a", unique: true },
      { type: "t", id: "a", unique: true },
      { type: "t", id: "b" },
    ]);
    assert.deepEqual(pushed, [
      { id: "a", accepted: true },
      { id: "a", accepted: false },
      { id: "b", accepted: true },
    ]);
  });

  test("a push after SCRIPT FLUSH falls back from EVALSHA to EVAL", async () => {
    await client.push("mail", "t", 1);
    await server.admin.script("FLUSH");
    await client.push("mail", "t", 2);
    assert.equal((await readyList("mail")).length, 2);
  });

  test("an explicit traceparent and tracestate go into the envelope", async () => {
    const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    await client.push("mail", "t", {}, { traceparent, tracestate: "congo=t61rcWkgMzE" });
    const [task] = await readyList("mail");
    assert.equal(task.traceparent, traceparent);
    assert.equal(task.tracestate, "congo=t61rcWkgMzE");
  });

  test("the current OpenTelemetry span's context goes into the envelope", async () => {
    const otel = require("@opentelemetry/api");
    const { AsyncLocalStorageContextManager } = require("@opentelemetry/context-async-hooks");
    const manager = new AsyncLocalStorageContextManager().enable();
    otel.context.setGlobalContextManager(manager);
    try {
      const spanContext = {
        traceId: "4bf92f3577b34da6a3ce929d0e0e4736",
        spanId: "00f067aa0ba902b7",
        traceFlags: otel.TraceFlags.SAMPLED,
        traceState: otel.createTraceState("congo=t61rcWkgMzE"),
      };
      const current = otel.trace.setSpanContext(otel.ROOT_CONTEXT, spanContext);
      await otel.context.with(current, () => client.push("mail", "t", {}));
      await client.push("mail", "t", {}); // outside the span: no context
    } finally {
      otel.context.disable();
    }
    const [traced, untraced] = await readyList("mail");
    assert.equal(traced.traceparent, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    assert.equal(traced.tracestate, "congo=t61rcWkgMzE");
    assert.equal(untraced.traceparent, undefined);
  });

  test("a key of the wrong type is refused by push.lua as RedisRefusedError, nothing written", async () => {
    await server.admin.set("kmq:{mail}:wake", "x");
    await assert.rejects(client.push("mail", "t", {}), (error) => {
      assert.ok(error instanceof kmq.RedisRefusedError, error.stack);
      assert.match(error.message, /WRONGTYPE push\.lua/);
      return true;
    });
    assert.deepEqual(await server.admin.keys("*"), ["kmq:{mail}:wake"]);
  });
});

describe("show and cancel", () => {
  test("show finds a task where it waits, and cancel removes it and frees its unique id", async () => {
    await client.push("mail", "t", { n: 1 }, { id: "u-1", unique: true });
    await client.push("mail", "t", {}, { id: "d-1", delay: 60000 });
    const [ready] = await client.show("mail", "u-1");
    assert.equal(ready.state, "ready");
    assert.equal(ready.level, "normal");
    assert.equal(ready.position, 0);
    assert.deepEqual(JSON.parse(ready.envelope).data, { n: 1 });
    const [delayed] = await client.show("mail", "d-1");
    assert.equal(delayed.state, "delayed");
    assert.ok(delayed.dueInMs > 50000 && delayed.dueInMs <= 60000, `${delayed.dueInMs}`);
    assert.deepEqual(await client.show("mail", "nobody"), []);

    assert.equal(await client.cancel("mail", "u-1"), 1);
    assert.equal(await client.cancel("mail", "d-1"), 1);
    assert.equal(await client.cancel("mail", "u-1"), 0);
    assert.deepEqual(await client.show("mail", "u-1"), []);
    assert.equal(await server.admin.hexists("kmq:{mail}:unique", "u-1"), 0);
    assert.equal(await server.admin.hget("kmq:{mail}:stats", "cancelled"), "2");
    // The id is free again.
    await client.push("mail", "t", {}, { id: "u-1", unique: true });
  });

  test("show finds a retrying, a claimed and a dead task", async () => {
    const envelope = JSON.stringify({ id: "r-1", type: "t", data: null, attempt: 1 });
    await server.admin.zadd("kmq:{mail}:retry:normal", Date.now() + 30000, envelope);
    await server.admin.zadd("kmq:{mail}:owners", Date.now() + 30000, "host-1-2-3.1");
    await server.admin.zadd("kmq:{mail}:processing:host-1-2-3.1:normal", 2, "7");
    await server.admin.rpush(
      "kmq:{mail}:processing:host-1-2-3.1:normal:7",
      JSON.stringify({ id: "p-0", type: "t" }),
      JSON.stringify({ id: "p-1", type: "t" })
    );
    // Position 0 is settled already: its bit is set.
    await server.admin.setbit("kmq:{mail}:processing:host-1-2-3.1:normal:7:settled", 0, 1);
    await server.admin.lpush("kmq:{mail}:dead", JSON.stringify({ id: "x-1", reason: "boom", task: "{}" }));

    assert.equal((await client.show("mail", "r-1"))[0].state, "retrying");
    assert.deepEqual(await client.show("mail", "p-0"), []);
    const [claimed] = await client.show("mail", "p-1");
    assert.equal(claimed.state, "processing");
    assert.equal(claimed.owner, "host-1-2-3.1");
    assert.equal(claimed.token, "7.1");
    assert.equal((await client.show("mail", "x-1"))[0].state, "dead");
    assert.equal(await client.cancel("mail", "p-1"), 0, "a running task is not cancelled");
    assert.equal(await client.cancel("mail", "r-1"), 1);
  });

  test("a grouped task waiting in its group's flow is shown and cancelled there", async () => {
    await server.admin.hset("kmq:{mail}:routes", "groups", "1");
    await client.push("mail", "t", {}, { id: "g-1", group: "tenant:42" });
    const [place] = await client.show("mail", "g-1");
    assert.equal(place.state, "ready");
    assert.equal(place.group, "tenant:42");
    assert.equal(await client.cancel("mail", "g-1"), 1);
    assert.equal(await server.admin.llen("kmq:{mail}:flow:normal:tenant%3A42:"), 0);
  });
});

describe("result", () => {
  test("a kept result is read back; a task still waiting is pending; an unknown id is unknown", async () => {
    await server.admin.hset(
      "kmq:{reports}:results:1000",
      "r-7",
      JSON.stringify({ ended_at: 1795997223121, state: "done", result: { rows: 3 } })
    );
    await server.admin.zadd("kmq:{reports}:results", 4102444800000, "1000");
    assert.deepEqual(await client.result("reports", "r-7"), {
      state: "done",
      result: { rows: 3 },
      endedAt: 1795997223121,
    });
    await server.admin.hset("kmq:{reports}:results:2000", "r-8", JSON.stringify({ ended_at: 5, state: "dead", reason: "no" }));
    await server.admin.zadd("kmq:{reports}:results", 4102444800001, "2000");
    assert.deepEqual(await client.result("reports", "r-8"), { state: "dead", reason: "no", endedAt: 5 });
    await client.push("reports", "t", {}, { id: "r-9" });
    assert.deepEqual(await client.result("reports", "r-9", { wait: 50 }), { state: "pending" });
    assert.deepEqual(await client.result("reports", "nobody"), { state: "unknown" });
  });
});

describe("connection failures", () => {
  test("Redis unreachable rejects with RedisUnreachableError, not a lost reply", async () => {
    const port = await freePort();
    const lonely = new kmq.Client(`redis://127.0.0.1:${port}/0`, { connectTimeoutMs: 300 });
    try {
      await assert.rejects(lonely.push("mail", "t", {}), kmq.RedisUnreachableError);
    } finally {
      await lonely.close();
    }
  });

  test("a reply lost after push.lua ran rejects with ReplyLostError, the task was pushed, and the client reconnects", async () => {
    const proxy = await Proxy.start(server.port);
    const proxied = new kmq.Client(`redis://127.0.0.1:${proxy.port}/0`, { connectTimeoutMs: 5000 });
    try {
      await proxied.push("mail", "t", 1);
      proxy.swallow();
      await assert.rejects(proxied.push("mail", "t", 2), (error) => {
        assert.ok(error instanceof kmq.ReplyLostError, error.stack);
        assert.match(error.message, /may have been pushed/);
        return true;
      });
      // Redis ran it: the second task is there; and the client did not send it again on its own.
      await eventually(async () => (await readyList("mail")).length === 2, "the second push in Redis");
      proxy.swallowing = false;
      await proxied.push("mail", "t", 3);
      assert.deepEqual((await readyList("mail")).map((task) => task.data), [1, 2, 3]);
    } finally {
      await proxied.close();
      await proxy.stop();
    }
  });
});

describe("pushFlow", () => {
  test("1,001 waiting tasks of a queue take two flow_push.lua calls; the task they wait for is pushed last", async () => {
    const calls = [];
    const original = client.evalScript.bind(client);
    client.evalScript = (sha, source, keys, args) => {
      calls.push([source.includes("flow_push.lua") ? "flow_push" : "push", keys[0]]);
      return original(sha, source, keys, args);
    };
    try {
      const parts = Array.from({ length: 1001 }, (_, n) => ({
        queue: "parts",
        type: "part.build",
        id: `p-${n}`,
        after: [{ queue: "fetch", id: "f" }],
      }));
      parts[0].after = [{ queue: "fetch", type: "fetch.csv", id: "f" }];
      const tasks = await client.pushFlow({ queue: "reports", type: "report.merge", id: "r", after: parts });
      assert.equal(tasks.length, 1003);
      assert.deepEqual(tasks.slice(0, 3).map((t) => t.id), ["r", "p-0", "f"]);
      assert.deepEqual(calls, [
        ["flow_push", "kmq:{reports}:deps-waiting"],
        ["flow_push", "kmq:{parts}:deps-waiting"],
        ["flow_push", "kmq:{parts}:deps-waiting"],
        ["push", "kmq:{fetch}:ready:normal"],
      ]);
      assert.equal(await server.admin.hlen("kmq:{parts}:deps-waiting"), 1001);
      const [fetch] = await readyList("fetch");
      assert.equal(fetch.waiters.length, 1001);
    } finally {
      client.evalScript = original;
    }
  });

  test("a bad flow is refused with the node's path and nothing is written", async () => {
    for (const [flow, at, reason] of [
      [{ queue: "a", type: "t", after: [{ queue: "b", type: "t", colour: 1 }] }, "after[0]", "colour"],
      [{ queue: "a", type: "t", after: [{ queue: "b", type: "t", after: [7] }] }, "after[0].after[0]", "JSON object"],
      [{ queue: "a", id: "x" }, "the root", "not a reference"],
      ['{"queue": "a"', "the root", "not JSON"],
    ]) {
      await assert.rejects(client.pushFlow(flow), (error) => {
        assert.ok(error instanceof kmq.InvalidFlowError, String(error));
        assert.equal(error.path, at);
        assert.match(error.message, new RegExp(reason));
        return true;
      });
    }
    assert.deepEqual(await server.admin.keys("*"), []);
  });
});

test("the packaged scripts (push, checks, remove, deps, flow_push) are byte-identical to the daemon's", (t) => {
  const scripts = path.join(__dirname, "..", "..", "..", "src", "broker", "scripts");
  if (!fs.existsSync(scripts)) {
    t.skip("not in a kmqd checkout");
    return;
  }
  for (const name of ["push.lua", "checks.lua", "remove.lua", "unique_hold.lua", "deps.lua", "flow_push.lua"]) {
    const packaged = fs.readFileSync(path.join(__dirname, "..", name));
    assert.ok(packaged.equals(fs.readFileSync(path.join(scripts, name))), `${name} differs from ${scripts}/${name}`);
  }
});
