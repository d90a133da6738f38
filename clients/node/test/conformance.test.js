"use strict";
// The conformance suite (clients/conformance: its README is the format) run with this client: each case's raw
// commands, then its calls through kmq.Client, then every key Redis holds compared with the case's.

const assert = require("node:assert/strict");
const fs = require("node:fs");
const path = require("node:path");
const { after, before, test } = require("node:test");
const kmq = require("..");
const { RedisServer } = require("./support");

const CASES = process.env.KMQ_CONFORMANCE_CASES ?? path.join(__dirname, "..", "..", "conformance", "cases");
/** How far `$ms_near_now` may be from Redis's clock (plus its offset): a slow machine's pushes take a while. */
const NEAR_MS = 5000;

/** The client's option names for the files' snake_case ones. */
const OPTION_NAMES = {
  id: "id",
  priority: "priority",
  delay_ms: "delay",
  at_ms: "at",
  unique: "unique",
  group: "group",
  traceparent: "traceparent",
  tracestate: "tracestate",
  expires_at_ms: "expiresAt",
  expires_in_ms: "expiresIn",
  debounce_ms: "debounce",
  unique_for_ms: "uniqueFor",
};

/** Error kinds of the files, as this client's classes. */
const ERROR_KINDS = {
  duplicate: kmq.DuplicateError,
  invalid_argument: kmq.InvalidArgumentError,
  unknown_priority: kmq.UnknownPriorityError,
  invalid_flow: kmq.InvalidFlowError,
};

function options(given = {}) {
  const mapped = {};
  for (const [name, value] of Object.entries(given)) {
    if (!(name in OPTION_NAMES)) throw new Error(`the runner does not know the option ${name}`);
    mapped[OPTION_NAMES[name]] = value;
  }
  return mapped;
}

function clientOptions(given = {}) {
  const mapped = {};
  for (const [name, value] of Object.entries(given)) {
    if (name === "key_prefix") mapped.keyPrefix = value;
    else throw new Error(`the runner does not know the client option ${name}`);
  }
  return mapped;
}

function loadCases() {
  if (!fs.existsSync(CASES)) return [];
  return fs
    .readdirSync(CASES)
    .filter((name) => name.endsWith(".json"))
    .sort()
    .map((name) => ({ file: name, ...JSON.parse(fs.readFileSync(path.join(CASES, name), "utf8")) }));
}

/**
 * Whether `actual` matches `expected`, a case's value with its matchers; records captures in `names`. Throws an
 * AssertionError naming the path where they differ.
 */
function match(expected, actual, context, where) {
  const fail = (why) => assert.fail(`${where}: ${why} (expected ${JSON.stringify(expected)}, found ${JSON.stringify(actual)})`);
  if (expected !== null && typeof expected === "object" && !Array.isArray(expected)) {
    const keys = Object.keys(expected);
    if (keys.length === 1 && keys[0].startsWith("$")) {
      const [name] = keys;
      const argument = expected[name];
      switch (name) {
        case "$uuid":
          if (typeof actual !== "string" || !/^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/.test(actual)) {
            fail("not a UUID");
          }
          return;
        case "$ms_near_now": {
          const number = typeof actual === "string" ? Number(actual) : actual;
          if (!Number.isInteger(number)) fail("not an integer");
          if (Math.abs(number - (context.now + argument)) > NEAR_MS) fail(`not within ${NEAR_MS} ms of now + ${argument}`);
          return;
        }
        case "$capture":
          context.names[argument] = actual;
          return;
        case "$same_as":
          if (!(argument in context.names)) fail(`nothing captured as ${argument}`);
          if (actual !== context.names[argument]) fail(`not the same as ${argument} (${context.names[argument]})`);
          return;
        default:
          fail(`unknown matcher ${name}`);
      }
    }
    if (keys.length === 1 && keys[0] === "json") {
      if (typeof actual !== "string") fail("not JSON text");
      let decoded;
      try {
        decoded = JSON.parse(actual);
      } catch {
        fail("not JSON");
      }
      match(expected.json, decoded, context, `${where} (decoded)`);
      return;
    }
    if (actual === null || typeof actual !== "object" || Array.isArray(actual)) fail("not an object");
    assert.deepEqual(Object.keys(actual).sort(), keys.slice().sort(), `${where}: the fields differ`);
    for (const key of keys) match(expected[key], actual[key], context, `${where}.${key}`);
    return;
  }
  if (Array.isArray(expected)) {
    if (!Array.isArray(actual)) fail("not an array");
    if (actual.length !== expected.length) fail(`${actual.length} elements, not ${expected.length}`);
    expected.forEach((item, index) => match(item, actual[index], context, `${where}[${index}]`));
    return;
  }
  if (typeof expected === "number" && typeof actual === "string") {
    if (Number(actual) !== expected) fail("differs");
    return;
  }
  if (expected !== actual) fail("differs");
}

/** A zset's or a set's elements, in any order: each expected one matched with a different actual one. */
function matchUnordered(expected, actual, context, where) {
  assert.ok(Array.isArray(actual) && actual.length === expected.length,
    `${where}: ${JSON.stringify(actual)} has not the ${expected.length} elements of ${JSON.stringify(expected)}`);
  const left = actual.slice();
  expected.forEach((item, n) => {
    const at = left.findIndex((candidate) => {
      try {
        match(item, candidate, { ...context, names: { ...context.names } }, where);
        return true;
      } catch {
        return false;
      }
    });
    if (at < 0) assert.fail(`${where}: nothing matches ${JSON.stringify(item)} (element ${n}) in ${JSON.stringify(actual)}`);
    match(item, left[at], context, where);
    left.splice(at, 1);
  });
}

/** A key's contents as the case writes them: {list: [...]}, {hash: {...}}, {zset: [[member, score]...]}, ... */
async function read(admin, key) {
  const type = await admin.type(key);
  switch (type) {
    case "list":
      return { list: await admin.lrange(key, 0, -1) };
    case "hash":
      return { hash: await admin.hgetall(key) };
    case "zset": {
      const flat = await admin.zrange(key, 0, -1, "WITHSCORES");
      const pairs = [];
      for (let i = 0; i < flat.length; i += 2) pairs.push([flat[i], Number(flat[i + 1])]);
      return { zset: pairs };
    }
    case "set":
      return { set: (await admin.smembers(key)).sort() };
    case "string":
      return { string: await admin.get(key) };
    default:
      return { [type]: null };
  }
}

async function runCall(client, step, context) {
  switch (step.call) {
    case "push":
      return { id: await client.push(step.queue, step.type, step.data, options(step.options)) };
    case "push_batch": {
      const tasks = step.tasks.map((task) => ({ ...options(task.options), type: task.type, data: task.data }));
      const pushed = await client.pushBatch(step.queue, tasks);
      // A refused task (a duplicate) has no id in `ids`: null in its place.
      return { ids: pushed.map((p) => (p.accepted ? p.id : null)) };
    }
    case "push_flow": {
      const tasks = await client.pushFlow(step.flow);
      return { tasks: tasks.map(({ queue, id }) => ({ queue, id })) };
    }
    case "cancel":
      return { removed: await client.cancel(step.queue, step.id) };
    case "show":
      return { found: await client.show(step.queue, step.id) };
    case "result": {
      // As docs/PROTOCOL.md, "Results" writes it.
      const kept = await client.result(step.queue, step.id, { wait: step.wait_ms ?? 0 });
      const record = { state: kept.state };
      if ("result" in kept) record.result = kept.result;
      if ("resultError" in kept) record.result_error = kept.resultError;
      if ("reason" in kept) record.reason = kept.reason;
      if ("endedAt" in kept) record.ended_at = kept.endedAt;
      return record;
    }
    default:
      throw new Error(`${context.file}: the runner does not know the call ${step.call}`);
  }
}

let server;
before(async () => {
  server = await RedisServer.start();
});
after(() => server.stop());

const cases = loadCases();
test("the conformance cases are there", () => {
  assert.ok(cases.length > 0, `no case in ${CASES}`);
  const names = new Set();
  for (const { file, name } of cases) {
    assert.ok(!names.has(name), `${file}: the name ${name} is used twice`);
    names.add(name);
  }
});

for (const kase of cases) {
  test(`conformance: ${kase.name} (${kase.file})`, async (t) => {
    if (kase.skip && kase.skip.node) {
      t.skip(kase.skip.node);
      return;
    }
    await server.admin.flushall();
    for (const command of kase.given ?? []) await server.admin.call(...command.map(String));
    const client = new kmq.Client(server.url, clientOptions(kase.client));
    const context = { names: {}, file: kase.file, now: 0 };
    try {
      for (const [index, step] of (kase.calls ?? []).entries()) {
        const where = `${kase.file} call ${index} (${step.call})`;
        let outcome;
        try {
          outcome = await runCall(client, step, context);
        } catch (error) {
          const kind = Object.entries(ERROR_KINDS)
            .filter(([, type]) => error instanceof type)
            .map(([name]) => name);
          if (!step.expect || !("error" in step.expect)) throw error;
          assert.ok(kind.includes(step.expect.error), `${where}: ${error.name} (${error.message}), not ${step.expect.error}`);
          if ("at" in step.expect) assert.equal(error.path, step.expect.at, `${where}: ${error.message}`);
          continue;
        }
        if (step.expect && "error" in step.expect) assert.fail(`${where}: succeeded, not ${step.expect.error}`);
        const [seconds, micros] = await server.admin.time();
        context.now = Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
        if (step.expect && step.call === "show") {
          // Each place is compared as a subset: only the fields the case names.
          const found = outcome.found;
          assert.equal(found.length, step.expect.found.length, `${where}: found ${JSON.stringify(found)}`);
          step.expect.found.forEach((place, n) => {
            const named = Object.fromEntries(Object.keys(place).map((field) => [field, found[n][field]]));
            match(place, named, context, `${where}.found[${n}]`);
          });
        } else if (step.expect) {
          match(step.expect, outcome, context, where);
        }
      }
      if (kase.then && kase.then.keys) {
        const [seconds, micros] = await server.admin.time();
        context.now = Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
        const held = (await server.admin.keys("*")).sort();
        assert.deepEqual(held, Object.keys(kase.then.keys).sort(), `${kase.file}: the keys Redis holds`);
        for (const [key, expected] of Object.entries(kase.then.keys)) {
          const actual = await read(server.admin, key);
          const unordered = ["zset", "set"].find((kind) => kind in expected && kind in actual);
          if (unordered) {
            matchUnordered(expected[unordered], actual[unordered], context, `${kase.file}: ${key}.${unordered}`);
          } else {
            match(expected, actual, context, `${kase.file}: ${key}`);
          }
        }
      }
    } finally {
      await client.close();
    }
  });
}
