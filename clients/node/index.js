"use strict";
// kmq-client: a producer for kmqd's queues (docs/PROTOCOL.md is the contract this follows; docs/CLIENTS.md shows
// it in use). Tasks are pushed with push.lua, the script kmqd's own `push` runs (a byte-identical copy ships
// beside this file: scripts/test checks it), by EVALSHA falling back to EVAL when Redis answers NOSCRIPT.

const crypto = require("node:crypto");
const fs = require("node:fs");
const path = require("node:path");
const Redis = require("ioredis");

const PUSH_SOURCE = fs.readFileSync(path.join(__dirname, "push.lua"), "utf8");
// remove.lua runs with checks.lua and unique_hold.lua before it, as the daemon's broker sends it (src/broker/mod.rs,
// `sources`).
const REMOVE_SOURCE = ["checks.lua", "unique_hold.lua", "remove.lua"]
  .map((name) => fs.readFileSync(path.join(__dirname, name), "utf8"))
  .join("");

// flow_push.lua runs with checks.lua and deps.lua before it, as the broker sends it (src/broker/mod.rs, FLOW_PUSH).
const FLOW_PUSH_SOURCE =
  "#!lua\n" +
  ["checks.lua", "deps.lua", "flow_push.lua"]
    .map((name) => fs.readFileSync(path.join(__dirname, name), "utf8"))
    .join("");
/** The fields a flow's node may have (docs/PROTOCOL.md, "Flows"); any other is refused, as `kmqd flow push` does. */
const FLOW_FIELDS = ["queue", "type", "id", "data", "priority", "if_failed", "after"];

/** The most tasks sent in one push.lua call, as kmqd's own client sends: one call never holds Redis for long. */
const PUSH_CHUNK = 1000;
/** Group names are 1 to 64 bytes of UTF-8 (docs/PROTOCOL.md, "The envelope"). */
const MAX_GROUP_BYTES = 64;
/** The longest `uniqueFor` push.lua takes, in ms: 12 digits (about 31 years). */
const MAX_UNIQUE_FOR_MS = 999_999_999_999;
/**
 * How long a queue's shape read from its meta hash is trusted (docs/PROTOCOL.md, "The queue's shape"): a push that
 * names a level the kept shape lacks reads it again at once, before refusing it; so does any push after this long.
 */
const SHAPE_FOR_MS = 10_000;
/** Elements read per command while looking a task up, so that no one command stalls Redis. */
const SCAN_CHUNK = 1000;

// ---------------------------------------------------------------------------------------------------------------
// Errors: one class per thing that happened, all under KmqError, so that callers can catch by kind.

class KmqError extends Error {
  constructor(message, options) {
    super(message, options);
    this.name = this.constructor.name;
  }
}

/** push.lua refused the task: its unique id is live, or a delayed task with its id waits. Nothing was written. */
class DuplicateError extends KmqError {
  constructor(queue, id) {
    super(
      `queue ${JSON.stringify(queue)} refused task ${JSON.stringify(id)}: a unique task with this id is live, or a ` +
        "delayed task with this id is waiting; nothing was written"
    );
    this.queue = queue;
    this.id = id;
  }
}

/** An argument the client refuses before sending anything (no type, a bad group, unique without an id...). */
class InvalidArgumentError extends KmqError {}

/** A priority that is not one of the queue's levels: nothing was sent. */
class UnknownPriorityError extends InvalidArgumentError {
  constructor(queue, priority, levels) {
    super(
      `queue ${JSON.stringify(queue)} has no priority ${JSON.stringify(priority)}; its levels are ` +
        levels.map((level) => JSON.stringify(level)).join(", ")
    );
    this.queue = queue;
    this.priority = priority;
    this.levels = levels;
  }
}

/**
 * pushFlow refused the flow before anything was written: `path` names the node ("the root", "after[1].after[0]"),
 * `reason` what is wrong with it (a cycle, an id defined twice, a reference to no task of the flow, ...).
 */
class InvalidFlowError extends InvalidArgumentError {
  constructor(path, reason) {
    super(`${path}: ${reason}`);
    this.path = path;
    this.reason = reason;
  }
}

/** Redis could not be reached (or answered nothing before the connect timeout): nothing was sent. */
class RedisUnreachableError extends KmqError {}

/**
 * The connection broke (or timed out) after the command was written: Redis may have run it. A push may have been
 * pushed; send it again only with a unique id (a second copy is then refused as a duplicate), or look it up.
 */
class ReplyLostError extends KmqError {}

/** Redis refused the command (an error reply: a key of the wrong type, a missing ACL rule...): nothing was written. */
class RedisRefusedError extends KmqError {}

// ---------------------------------------------------------------------------------------------------------------
// Tracing: a W3C trace context from the caller's current OpenTelemetry context, when @opentelemetry/api is
// installed (an optional peer dependency). Read through the span context rather than a propagator, so that it
// works whether or not the application registered one.

let otel = null;
try {
  otel = require("@opentelemetry/api");
} catch {
  otel = null;
}

function currentTraceContext() {
  if (!otel) return null;
  const span = otel.trace.getSpan(otel.context.active());
  const spanContext = span && span.spanContext();
  if (!spanContext || !otel.isSpanContextValid(spanContext)) return null;
  const flags = (spanContext.traceFlags & 0xff).toString(16).padStart(2, "0");
  const traceparent = `00-${spanContext.traceId}-${spanContext.spanId}-${flags}`;
  const tracestate = spanContext.traceState ? spanContext.traceState.serialize() : "";
  return { traceparent, tracestate: tracestate || undefined };
}

// ---------------------------------------------------------------------------------------------------------------

function sha1(text) {
  return crypto.createHash("sha1").update(text).digest("hex");
}

function isRedisReplyError(error) {
  return error && error.name === "ReplyError";
}

/** A queue's key names (docs/PROTOCOL.md, "Key layout"): every key carries the queue as its hash tag. */
class QueueKeys {
  constructor(prefix, queue) {
    this.base = `${prefix}:{${queue}}`;
  }
  key(suffix) {
    return `${this.base}:${suffix}`;
  }
}

/**
 * A producer for kmqd's queues.
 *
 * `new Client("redis://127.0.0.1:6379/0", { keyPrefix: "kmq" })`; the first argument may also be `rediss://...`,
 * carry a username and password, or be an ioredis options object (a unix socket's `path`, `sentinels` and `name`).
 */
class Client {
  constructor(connection = "redis://127.0.0.1:6379/0", options = {}) {
    this.keyPrefix = options.keyPrefix ?? "kmq";
    this.connectTimeoutMs = options.connectTimeoutMs ?? 5000;
    this.commandTimeoutMs = options.commandTimeoutMs ?? 30000;
    this.queues = options.queues ?? {};
    this.shapes = new Map();
    this.lastConnectError = null;
    // What makes a lost reply tell itself apart from an unreachable Redis: no command waits offline (one sent
    // while the connection is down fails at once, after this client waited for the connection), none is sent
    // again on its own after a reconnect (a push sent twice could run twice), and a written command whose
    // connection closes is failed at once (maxRetriesPerRequest 0) rather than left waiting.
    const fixed = {
      lazyConnect: true,
      enableOfflineQueue: false,
      autoResendUnfulfilledCommands: false,
      maxRetriesPerRequest: 0,
      commandTimeout: this.commandTimeoutMs,
      connectTimeout: this.connectTimeoutMs,
    };
    if (options.cluster) {
      // A Redis Cluster: `connection` is its seed nodes. A node's connection keeps the same rules; the cluster
      // client follows MOVED and ASK (the command did not run) but never sends a command again after its
      // connection closed (retryDelayOnFailover 0): that is a lost reply too. A node's offline queue holds only
      // commands not yet written, so it stays.
      const { enableOfflineQueue, ...nodeRules } = fixed;
      this.redis = new Redis.Cluster(connection, {
        ...options.cluster,
        lazyConnect: true,
        enableOfflineQueue,
        retryDelayOnFailover: 0,
        redisOptions: { ...(options.cluster.redisOptions ?? {}), ...nodeRules, lazyConnect: false },
      });
    } else {
      this.redis =
        typeof connection === "string" ? new Redis(connection, fixed) : new Redis({ ...connection, ...fixed });
    }
    // ioredis reports connection errors as events; without a listener it prints them. The last one says why
    // Redis is unreachable.
    this.redis.on("error", (error) => {
      this.lastConnectError = error;
    });
    this.pushSha = sha1(PUSH_SOURCE);
    this.removeSha = sha1(REMOVE_SOURCE);
    this.flowPushSha = sha1(FLOW_PUSH_SOURCE);
  }

  /** Closes the connection (waits for replies to what was sent). */
  async close() {
    if (this.redis.status === "end" || this.redis.status === "wait") {
      this.redis.disconnect();
      return;
    }
    try {
      await this.redis.quit();
    } catch {
      this.redis.disconnect();
    }
  }

  /** Waits for a ready connection, up to `connectTimeoutMs`; RedisUnreachableError otherwise. */
  async ready() {
    const redis = this.redis;
    if (redis.status === "ready") return;
    if (redis.status === "wait" || redis.status === "end") {
      redis.connect().catch(() => {});
    }
    await new Promise((resolve, reject) => {
      const done = (error) => {
        clearTimeout(timer);
        redis.off("ready", onReady);
        if (error) reject(error);
        else resolve();
      };
      const onReady = () => done(null);
      const timer = setTimeout(() => {
        const why = this.lastConnectError ? `: ${this.lastConnectError.message}` : "";
        done(
          new RedisUnreachableError(`Redis did not answer within ${this.connectTimeoutMs} ms${why}`, {
            cause: this.lastConnectError ?? undefined,
          })
        );
      }, this.connectTimeoutMs);
      redis.on("ready", onReady);
      if (redis.status === "ready") done(null);
    });
  }

  /** Sends one command on a ready connection, mapping what went wrong to this module's errors. */
  async call(command, ...args) {
    await this.ready();
    try {
      return await this.redis.call(command, ...args);
    } catch (error) {
      throw this.failure(error, command);
    }
  }

  /** A pipeline's replies, or the first failure (an error reply of one command is its own RedisRefusedError). */
  async pipeline(commands) {
    await this.ready();
    let replies;
    try {
      replies = await this.redis
        .pipeline(commands.map(([command, ...args]) => [command.toLowerCase(), ...args]))
        .exec();
    } catch (error) {
      throw this.failure(error, commands[0] && commands[0][0]);
    }
    return replies.map(([error, reply]) => {
      if (error) throw this.failure(error, "pipeline");
      return reply;
    });
  }

  failure(error, what) {
    if (error instanceof KmqError) return error;
    if (isRedisReplyError(error)) {
      return new RedisRefusedError(`redis refused ${what}: ${error.message}`, { cause: error });
    }
    if (/writeable|enableOfflineQueue/.test(error.message)) {
      // The connection went down between ready() and the write: nothing was sent.
      return new RedisUnreachableError(`Redis is unreachable: ${error.message}`, { cause: error });
    }
    if (error.name === "MaxRetriesPerRequestError" || /Connection is closed|Command timed out/.test(error.message)) {
      return new ReplyLostError(
        `the connection to Redis broke after ${what} was sent, so it may have run (a push may have been pushed): ` +
          error.message,
        { cause: error }
      );
    }
    return error;
  }

  /** EVALSHA, and EVAL when the script is not in Redis's cache (a restart, a failover, SCRIPT FLUSH). */
  async evalScript(sha, source, keys, args) {
    try {
      return await this.call("EVALSHA", sha, keys.length, ...keys, ...args);
    } catch (error) {
      if (error instanceof RedisRefusedError && /NOSCRIPT/.test(error.message)) {
        return await this.call("EVAL", source, keys.length, ...keys, ...args);
      }
      throw error;
    }
  }

  /**
   * The queue's levels (highest first) and default level: from the `queues` option when given, else from the
   * queue's meta hash (`levels`, `default_priority`: docs/PROTOCOL.md, "The queue's shape"), kept for
   * SHAPE_FOR_MS and read again at once when `wanted` names a level it lacks, else the one level `normal`.
   */
  async shape(queue, wanted = []) {
    const given = this.queues[queue];
    if (given) {
      const levels = given.levels ?? ["normal"];
      return { levels, defaultPriority: given.defaultPriority ?? levels[Math.floor((levels.length - 1) / 2)] };
    }
    const cached = this.shapes.get(queue);
    if (
      cached &&
      performance.now() - cached.read < SHAPE_FOR_MS &&
      wanted.every((level) => cached.levels.includes(level))
    ) {
      return cached;
    }
    const keys = new QueueKeys(this.keyPrefix, queue);
    // Two HGETs in one round trip: HGET is in the producers' ACL rules (docs/OPERATIONS.md), HMGET is not.
    let levelsField = null;
    let defaultField = null;
    try {
      [levelsField, defaultField] = await this.pipeline([
        ["HGET", keys.key("meta"), "levels"],
        ["HGET", keys.key("meta"), "default_priority"],
      ]);
    } catch (error) {
      // A producer user of older ACL rules may not read the meta hash: it pushes as to a queue without
      // priorities (or with the levels given to the constructor).
      if (!(error instanceof RedisRefusedError && /NOPERM/.test(error.message))) throw error;
    }
    const levels = levelsField ? levelsField.split(",").filter((level) => level !== "") : ["normal"];
    // The daemons' own default when none is written: the middle level, the first of two (docs/CONFIG.md).
    const fallback = levels[Math.floor((levels.length - 1) / 2)];
    const shape = {
      levels,
      defaultPriority: levels.includes(defaultField) ? defaultField : fallback,
      read: performance.now(),
    };
    this.shapes.set(queue, shape);
    return shape;
  }

  /** The envelope's text, its id, level and due time, or InvalidArgumentError before anything is sent. */
  prepare(queue, shape, task, redisNowMs = null) {
    const { type, data, id, priority, group, delay, at, expiresAt, expiresIn, debounce, uniqueFor } = task;
    const given = (value) => value !== undefined && value !== null;
    // A hold after the task ended is a kind of uniqueness: the id must be free to be pushed at all.
    const unique = Boolean(task.unique) || given(uniqueFor);
    if (typeof type !== "string" || type === "") {
      throw new InvalidArgumentError("a task needs a type: a non-empty string");
    }
    if (id !== undefined && id !== null && (typeof id !== "string" || id === "")) {
      throw new InvalidArgumentError("a task id is a non-empty string");
    }
    if (unique && (id === undefined || id === null)) {
      throw new InvalidArgumentError("a unique task needs an id: uniqueness is per id");
    }
    if (group !== undefined && group !== null) {
      const bytes = typeof group === "string" ? Buffer.byteLength(group) : 0;
      if (bytes < 1 || bytes > MAX_GROUP_BYTES) {
        throw new InvalidArgumentError(
          `group ${JSON.stringify(group)} is not a group name: use a string of 1 to ${MAX_GROUP_BYTES} bytes`
        );
      }
    }
    let level = shape.defaultPriority;
    if (priority !== undefined && priority !== null) {
      if (!shape.levels.includes(priority)) throw new UnknownPriorityError(queue, priority, shape.levels);
      level = priority;
    }
    let delayMs = delay === undefined || delay === null ? 0 : delay;
    // push.lua's OPTIONS_n (docs/PROTOCOL.md, "Debounce, and unique for a time"): "1" for unique, as older copies of
    // the script read it, "unique_for=MS" (unique, and the id held MS after its task ended), or "debounce", whose
    // delay is the task's.
    let options = unique ? "1" : "0";
    if (given(uniqueFor)) {
      if (!Number.isInteger(uniqueFor) || uniqueFor < 1 || uniqueFor > MAX_UNIQUE_FOR_MS) {
        throw new InvalidArgumentError(
          `uniqueFor is a whole number of ms, 1 to ${MAX_UNIQUE_FOR_MS} (not ${uniqueFor})`
        );
      }
      options = `unique_for=${uniqueFor}`;
    }
    if (given(debounce)) {
      if (!given(id) || unique || given(delay) || given(at)) {
        throw new InvalidArgumentError(
          "debounce: give an id, and neither unique, uniqueFor, delay nor at (it is the delay)"
        );
      }
      if (!Number.isInteger(debounce) || debounce <= 0) {
        throw new InvalidArgumentError(`debounce is a positive whole number of ms (not ${debounce})`);
      }
      delayMs = debounce;
      options = "debounce";
    }
    if (!Number.isInteger(delayMs) || delayMs < 0) {
      throw new InvalidArgumentError(`delay is a whole number of ms, 0 or more (not ${delay})`);
    }
    let atMs = 0;
    if (at !== undefined && at !== null) {
      atMs = at instanceof Date ? at.getTime() : at;
      if (!Number.isInteger(atMs) || atMs < 0) {
        throw new InvalidArgumentError(`at is a Date or ms since the epoch (not ${at})`);
      }
    }
    const taskId = id ?? crypto.randomUUID();
    // The fields in the order kmqd's own client writes them; `attempt` 0 as it does (docs/PROTOCOL.md).
    const envelope = { id: taskId, type, data: data === undefined ? null : data, attempt: 0 };
    if (priority !== undefined && priority !== null) envelope.priority = priority;
    if (unique) envelope.unique = true;
    if (group !== undefined && group !== null) envelope.group = group;
    const expires = expiry(expiresAt, expiresIn, redisNowMs);
    if (expires !== null) envelope.expires_at = expires;
    const trace =
      task.traceparent !== undefined && task.traceparent !== null
        ? { traceparent: task.traceparent, tracestate: task.tracestate }
        : currentTraceContext();
    if (trace) {
      envelope.traceparent = trace.traceparent;
      if (trace.tracestate !== undefined && trace.tracestate !== null) envelope.tracestate = trace.tracestate;
    }
    let text;
    try {
      text = JSON.stringify(envelope);
    } catch (error) {
      throw new InvalidArgumentError(`the task's data is not JSON: ${error.message}`, { cause: error });
    }
    return { id: taskId, options, level, delayMs, atMs, text };
  }

  /**
   * Enqueues one task; resolves to its id. Options: `id`, `priority`, `delay` (ms), `at` (a Date or ms since the
   * epoch), `unique`, `uniqueFor` (ms: unique, and the id stays held that long after its task ended), `group`,
   * `traceparent`, `tracestate`, `expiresAt`, `expiresIn`, `debounce`. A unique push of a live or held id rejects with
   * DuplicateError.
   */
  async push(queue, type, data, options = {}) {
    const [pushed] = await this.pushBatch(queue, [{ ...options, type, data }]);
    if (!pushed.accepted) throw new DuplicateError(queue, pushed.id);
    return pushed.id;
  }

  /**
   * Enqueues many tasks (`[{type, data, ...options}]`) with one push.lua call per 1,000 tasks of the same level
   * and due time in a row. Resolves to `{id, accepted}` per task, in order (`accepted` false: a duplicate unique
   * id). Every task is checked before the first call; a failure after the first call leaves the calls before it
   * applied.
   */
  async pushBatch(queue, tasks) {
    if (typeof queue !== "string" || queue === "") throw new InvalidArgumentError("a queue name is a non-empty string");
    if (!Array.isArray(tasks)) throw new InvalidArgumentError("pushBatch takes an array of tasks");
    if (tasks.length === 0) return [];
    const wanted = tasks.map((task) => task && task.priority).filter((priority) => typeof priority === "string");
    const shape = await this.shape(queue, wanted);
    // An expiry given as a length is a time on Redis's clock (docs/PROTOCOL.md, "Expiry"): TIME on the queue's
    // node, once a batch and only when a task of it needs it.
    let redisNowMs = null;
    if (tasks.some((task) => task && task.expiresIn !== undefined && task.expiresIn !== null)) {
      const [seconds, micros] = await this.call("TIME");
      redisNowMs = Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
    }
    const prepared = tasks.map((task) => {
      if (task === null || typeof task !== "object") throw new InvalidArgumentError("a task is an object {type, data, ...}");
      return this.prepare(queue, shape, task, redisNowMs);
    });
    return this.pushPrepared(queue, prepared);
  }

  /** push.lua calls for checked tasks: one per 1,000 tasks of the same level and due time in a row. */
  async pushPrepared(queue, prepared) {
    const keys = new QueueKeys(this.keyPrefix, queue);
    const results = [];
    let start = 0;
    while (start < prepared.length) {
      const first = prepared[start];
      let end = start + 1;
      while (
        end < prepared.length &&
        end - start < PUSH_CHUNK &&
        prepared[end].level === first.level &&
        prepared[end].delayMs === first.delayMs &&
        prepared[end].atMs === first.atMs
      ) {
        end += 1;
      }
      const chunk = prepared.slice(start, end);
      const scriptKeys = [
        keys.key(`ready:${first.level}`),
        keys.key(`delayed:${first.level}`),
        keys.key("delayed-tasks"),
        keys.key("wake"),
        keys.key("unique"),
        keys.key("stats"),
        keys.key("routes"),
      ];
      const args = [String(first.delayMs), String(first.atMs), keys.key("delay-wake")];
      for (const task of chunk) args.push(task.id, task.options, task.text);
      const replies = await this.evalScript(this.pushSha, PUSH_SOURCE, scriptKeys, args);
      chunk.forEach((task, index) => results.push({ id: task.id, accepted: replies[index] === 1 }));
      start = end;
    }
    return results;
  }

  /**
   * Pushes a flow (docs/PROTOCOL.md, "Flows"): `flow` is the flow's JSON (an object, or its text), one task with
   * the tasks it waits for nested in `after`. It is checked whole before anything is written, as `kmqd flow push`
   * checks it (InvalidFlowError names the node); its waiting tasks are then written with flow_push.lua, a queue at
   * a time, 1,000 a call, and last the tasks that wait for nothing are pushed, so that no task can end before the
   * tasks waiting for it exist. `deadMax` and `keepMs` are what a daemon takes from the waiting tasks' queue's
   * config (`dead_max`, `keep_results`; ten minutes without it): give your queues' values when they differ.
   * Resolves to every task, root first: `{queue, id, generatedAt}` (`generatedAt`: its path when its id was
   * generated, else null).
   */
  async pushFlow(flow, { deadMax = 10000, keepMs = 600000 } = {}) {
    if (typeof flow === "string") {
      try {
        flow = JSON.parse(flow);
      } catch (error) {
        throw new InvalidFlowError("the root", `the flow is not JSON: ${error.message}`);
      }
    }
    if (!Number.isInteger(deadMax) || deadMax < 0) throw new InvalidArgumentError(`deadMax is a count, not ${deadMax}`);
    if (!Number.isInteger(keepMs) || keepMs < 1) throw new InvalidArgumentError(`keepMs is a count of ms, not ${keepMs}`);
    const nodes = [];
    const references = [];
    if ((await this.readFlowNode(flow, "the root", nodes, references)) === null) {
      throw new InvalidFlowError("the root", "a flow's root is a task (queue and type), not a reference");
    }
    const name = (queue, id) => JSON.stringify([queue, id]);
    const defined = new Map();
    nodes.forEach((node, at) => {
      const key = name(node.queue, node.id);
      if (defined.has(key)) {
        throw new InvalidFlowError(
          node.path,
          `task ${node.queue}/${node.id} is defined twice (first at ${nodes[defined.get(key)].path}); to wait for ` +
            'one task twice, refer to it with {"queue": ..., "id": ...} only'
        );
      }
      defined.set(key, at);
    });
    for (const [at, [queue, id]] of references) {
      if (!defined.has(name(queue, id))) {
        throw new InvalidFlowError(at, `refers to task ${queue}/${id}, which the flow does not define`);
      }
    }
    checkAcyclic(nodes, (dep) => defined.get(name(dep[0], dep[1])));
    const up = new Map();
    for (const node of nodes) {
      for (const [queue, id] of node.deps) {
        const waiters = up.get(name(queue, id)) ?? [];
        if (waiters.some((w) => w.queue === node.queue && w.id === node.id)) {
          throw new InvalidFlowError(node.path, `task ${node.queue}/${node.id} waits for ${queue}/${id} twice`);
        }
        waiters.push({ queue: node.queue, id: node.id });
        up.set(name(queue, id), waiters);
      }
    }
    const order = [];
    const waiting = new Map();
    const leaves = new Map();
    for (const node of nodes) {
      const envelope = { id: node.id, type: node.type, data: node.data, attempt: 0 };
      if (node.priority !== null) envelope.priority = node.priority;
      const waiters = up.get(name(node.queue, node.id)) ?? [];
      if (waiters.length > 0) envelope.waiters = waiters;
      let text;
      try {
        text = JSON.stringify(envelope);
      } catch (error) {
        throw new InvalidFlowError(node.path, `data is not JSON: ${error.message}`);
      }
      if (!order.includes(node.queue)) order.push(node.queue);
      const into = node.deps.length > 0 ? waiting : leaves;
      if (!into.has(node.queue)) into.set(node.queue, []);
      if (node.deps.length > 0) into.get(node.queue).push({ node, text, up: JSON.stringify(waiters) });
      else into.get(node.queue).push({ id: node.id, options: "0", level: node.level, delayMs: 0, atMs: 0, text });
    }
    for (const queue of order) {
      const list = waiting.get(queue) ?? [];
      for (let start = 0; start < list.length; start += PUSH_CHUNK) {
        await this.flowPushCall(queue, deadMax, keepMs, list.slice(start, start + PUSH_CHUNK));
      }
    }
    for (const queue of order) {
      const { levels } = await this.shape(queue);
      // Stable: a level's tasks keep the flow's order.
      const ready = (leaves.get(queue) ?? []).sort((a, b) => levels.indexOf(a.level) - levels.indexOf(b.level));
      await this.pushPrepared(queue, ready);
    }
    return nodes.map((node) => ({ queue: node.queue, id: node.id, generatedAt: node.generated ? node.path : null }));
  }

  /**
   * Reads the node `raw` at `path` and, depth first, what it waits for into `nodes`; a reference goes to
   * `references`. Resolves to the task it names as [queue, id] (null for a reference at the root).
   */
  async readFlowNode(raw, at, nodes, references) {
    if (raw === null || typeof raw !== "object" || Array.isArray(raw)) {
      throw new InvalidFlowError(at, "a node is a JSON object");
    }
    for (const field of Object.keys(raw)) {
      if (!FLOW_FIELDS.includes(field)) {
        throw new InvalidFlowError(at, `unknown field ${JSON.stringify(field)}; a node has ${FLOW_FIELDS.join(", ")}`);
      }
    }
    const given = (field) => raw[field] !== undefined && raw[field] !== null;
    for (const field of ["queue", "type", "id", "priority", "if_failed"]) {
      if (given(field) && typeof raw[field] !== "string") throw new InvalidFlowError(at, `"${field}" is not a string`);
    }
    const after = raw.after ?? [];
    if (!Array.isArray(after)) throw new InvalidFlowError(at, '"after" is not a list of nodes');
    if (!given("queue") || raw.queue === "") throw new InvalidFlowError(at, 'no "queue"');
    const queue = raw.queue;
    if (!given("type")) {
      // A reference: a queue and an id, nothing else.
      if (!given("id")) {
        throw new InvalidFlowError(
          at,
          'no "type" (a task needs one; a reference to a task defined elsewhere needs an "id")'
        );
      }
      if (given("data") || given("priority") || given("if_failed") || after.length > 0) {
        throw new InvalidFlowError(
          at,
          `no "type", so this refers to task ${queue}/${raw.id}: a reference has only "queue" and "id"`
        );
      }
      references.push([at, [queue, raw.id]]);
      return at === "the root" ? null : [queue, raw.id];
    }
    if (raw.type === "") throw new InvalidFlowError(at, '"type" is empty');
    const ifFailed = given("if_failed") ? raw.if_failed : "fail";
    if (ifFailed !== "fail" && ifFailed !== "continue") {
      throw new InvalidFlowError(
        at,
        `if_failed ${JSON.stringify(ifFailed)} is neither "fail" (the default) nor "continue"`
      );
    }
    const priority = given("priority") ? raw.priority : null;
    const shape = await this.shape(queue, priority === null ? [] : [priority]);
    if (priority !== null && !shape.levels.includes(priority)) {
      throw new InvalidFlowError(
        at,
        `queue ${JSON.stringify(queue)} has no priority ${JSON.stringify(priority)}; its levels are ` +
          shape.levels.map((level) => JSON.stringify(level)).join(", ")
      );
    }
    if (raw.id === "") throw new InvalidFlowError(at, '"id" is empty');
    const generated = !given("id");
    const id = generated ? crypto.randomUUID() : raw.id;
    const node = {
      queue,
      type: raw.type,
      id,
      data: raw.data === undefined ? null : raw.data,
      level: priority ?? shape.defaultPriority,
      ifFailed,
      priority,
      deps: [],
      path: at,
      generated,
    };
    nodes.push(node);
    for (let n = 0; n < after.length; n += 1) {
      const depPath = at === "the root" ? `after[${n}]` : `${at}.after[${n}]`;
      node.deps.push(await this.readFlowNode(after[n], depPath, nodes, references));
    }
    return [queue, id];
  }

  /** One flow_push.lua call: a queue's waiting tasks, all or nothing (docs/PROTOCOL.md, "Flows"). */
  async flowPushCall(queue, deadMax, keepMs, chunk) {
    const keys = new QueueKeys(this.keyPrefix, queue);
    const scriptKeys = ["deps-waiting", "wake", "dead", "stats", "deps-outbox"].map((suffix) => keys.key(suffix));
    const args = [queue, String(deadMax), String(keepMs)];
    for (const { node, text, up } of chunk) {
      scriptKeys.push(keys.key(`deps:${node.id}`), keys.key(`deps-ended:${node.id}`), keys.key(`ready:${node.level}`));
      args.push(node.id, node.type, text, node.ifFailed, String(node.deps.length), JSON.stringify(node.deps), up);
    }
    const replies = await this.evalScript(this.flowPushSha, FLOW_PUSH_SOURCE, scriptKeys, args);
    if (!Array.isArray(replies) || replies.length !== chunk.length) {
      throw new RedisRefusedError(`flow_push.lua replied ${JSON.stringify(replies)} for ${chunk.length} tasks`);
    }
    return replies;
  }

  /**
   * Every place task `id` is in, as `kmqd task show` finds it: `{state: "delayed"|"retrying", level, dueInMs,
   * envelope}`, `{state: "ready", level, position, flow?, group?, envelope}`, `{state: "processing", owner, token,
   * leaseLeftMs, envelope}`, `{state: "dead", record}` (a non-unique id may be in several; none: not in Redis).
   * Delayed tasks are found by their index; the other places are scanned, SCAN_CHUNK elements a command.
   */
  async show(queue, id) {
    return this.locate(queue, id, true);
  }

  async locate(queue, id, everywhere) {
    const shape = await this.shape(queue);
    const keys = new QueueKeys(this.keyPrefix, queue);
    const needle = JSON.stringify(id).slice(1, -1);
    const matches = (payload) => {
      if (!payload.includes(needle)) return false;
      try {
        const task = JSON.parse(payload);
        return task !== null && typeof task === "object" && task.id === id;
      } catch {
        return false;
      }
    };
    const found = [];
    const [seconds, micros] = await this.call("TIME");
    const now = Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
    // Delayed: by id, through the index.
    const envelope = await this.call("HGET", keys.key("delayed-tasks"), id);
    if (envelope !== null) {
      const scores = await this.pipeline(shape.levels.map((level) => ["ZSCORE", keys.key(`delayed:${level}`), id]));
      const at = scores.findIndex((score) => score !== null);
      if (at >= 0) {
        found.push({ state: "delayed", level: shape.levels[at], dueInMs: Number(scores[at]) - now, envelope });
      }
    }
    // Retrying: the retry sets' members hold whole envelopes.
    for (const level of shape.levels) {
      let cursor = "0";
      do {
        const [next, items] = await this.call(
          "ZSCAN", keys.key(`retry:${level}`), cursor, "MATCH", globContaining(needle), "COUNT", String(SCAN_CHUNK)
        );
        for (let i = 0; i < items.length; i += 2) {
          if (matches(items[i]) && !found.some((f) => f.state === "retrying" && f.envelope === items[i])) {
            found.push({ state: "retrying", level, dueInMs: Number(items[i + 1]) - now, envelope: items[i] });
          }
        }
        cursor = next;
      } while (cursor !== "0");
    }
    // Ready: each level's list, then the flows the rings name (groups, types held back by their limits).
    const lists = shape.levels.map((level) => ({ level, key: keys.key(`ready:${level}`) }));
    const rings = await this.pipeline(shape.levels.map((level) => ["ZRANGE", keys.key(`ring:${level}`), "0", "-1"]));
    rings.forEach((members, index) => {
      for (const member of members) {
        const colon = member.indexOf(":");
        if (colon < 0) continue;
        const group = member.slice(0, colon);
        const kind = member.slice(colon + 1);
        const level = shape.levels[index];
        lists.push({
          level,
          key: keys.key(`flow:${level}:${member}`),
          flow: kind !== "" ? decodeName(kind) : undefined,
          group: group !== "" || kind === "" ? decodeName(group) : undefined,
        });
      }
    });
    for (const list of lists) {
      await this.scanList(list.key, (position, payload) => {
        if (!matches(payload)) return;
        const place = { state: "ready", level: list.level, position, envelope: payload };
        if (list.flow !== undefined) place.flow = list.flow;
        if (list.group !== undefined) place.group = list.group;
        found.push(place);
      });
    }
    if (!everywhere) return found;
    await this.locateProcessing(keys, shape, matches, found);
    await this.scanList(keys.key("dead"), (_, record) => {
      try {
        if (JSON.parse(record).id === id) found.push({ state: "dead", record });
      } catch {
        // A record that is not JSON names no task.
      }
    });
    return found;
  }

  async scanList(key, visit) {
    for (let start = 0; ; start += SCAN_CHUNK) {
      const chunk = await this.call("LRANGE", key, String(start), String(start + SCAN_CHUNK - 1));
      chunk.forEach((payload, offset) => visit(start + offset, payload));
      if (chunk.length < SCAN_CHUNK) return;
    }
  }

  /** Safe mode's claimed tasks: each live or expired owner's claim lists, less the positions already settled. */
  async locateProcessing(keys, shape, matches, found) {
    const [seconds, micros] = await this.call("TIME");
    const now = Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
    const owners = await this.call("ZRANGE", keys.key("owners"), "0", "-1", "WITHSCORES");
    for (let o = 0; o < owners.length; o += 2) {
      const owner = owners[o];
      const leaseLeftMs = Number(owners[o + 1]) - now;
      for (const level of shape.levels) {
        const claims = keys.key(`processing:${owner}:${level}`);
        const kind = await this.call("TYPE", claims);
        if (kind === "hash") {
          // An owner registered by kmqd 0.1: token -> envelope.
          const fields = await this.call("HGETALL", claims);
          for (let i = 0; i < fields.length; i += 2) {
            if (matches(fields[i + 1])) {
              found.push({ state: "processing", owner, token: fields[i], leaseLeftMs, envelope: fields[i + 1] });
            }
          }
          continue;
        }
        if (kind !== "zset") continue;
        const numbers = await this.call("ZRANGE", claims, "0", "-1");
        for (const claim of numbers) {
          const list = `${claims}:${claim}`;
          const settled = await this.redis.getBuffer(`${list}:settled`).catch((error) => {
            throw this.failure(error, "GET");
          });
          await this.scanList(list, (position, payload) => {
            const byte = settled && position >> 3 < settled.length ? settled[position >> 3] : 0;
            if ((byte >> (7 - (position & 7))) & 1) return;
            if (matches(payload)) {
              found.push({ state: "processing", owner, token: `${claim}.${position}`, leaseLeftMs, envelope: payload });
            }
          });
        }
      }
    }
  }

  /**
   * Cancels every waiting copy (delayed, retrying or ready) of task `id` with remove.lua, as `kmqd task cancel`
   * does; resolves to how many were removed (0: it was not waiting: unknown, running, done or dead). A unique id
   * is released.
   */
  async cancel(queue, id) {
    const keys = new QueueKeys(this.keyPrefix, queue);
    let removed = 0;
    for (const place of await this.locate(queue, id, false)) {
      let holder;
      let kind;
      let task;
      let expected = "";
      if (place.state === "delayed") {
        [holder, kind, task, expected] = [keys.key(`delayed:${place.level}`), "delayed", id, place.envelope];
      } else if (place.state === "retrying") {
        [holder, kind, task] = [keys.key(`retry:${place.level}`), "retry", place.envelope];
      } else {
        let list = keys.key(`ready:${place.level}`);
        if (place.flow !== undefined) list = keys.key(`flow:${place.level}:${encodeName(place.group ?? "")}:${encodeName(place.flow)}`);
        else if (place.group !== undefined) list = keys.key(`flow:${place.level}:${encodeName(place.group)}:`);
        [holder, kind, task] = [list, "list", place.envelope];
      }
      let unique = false;
      try {
        unique = JSON.parse(place.envelope).unique === true;
      } catch {
        unique = false;
      }
      const done = await this.evalScript(
        this.removeSha,
        REMOVE_SOURCE,
        [holder, keys.key("delayed-tasks"), keys.key("unique"), keys.key("stats")],
        [kind, task, expected, unique ? id : ""]
      );
      removed += done;
    }
    return removed;
  }

  /**
   * Task `id`'s kept result (a queue with `keep_results`: docs/PROTOCOL.md, "Results"), waiting up to `wait` ms
   * for it: `{state: "done", result, resultError?, endedAt}`, `{state: "dead", reason, endedAt}`, `{state:
   * "pending"}` (still waiting or running when the wait ended) or `{state: "unknown"}` (no result and no task:
   * never pushed, done without `keep_results`, or expired). Polls with a backoff from 10 ms doubling to 500 ms.
   */
  async result(queue, id, { wait = 0 } = {}) {
    const keys = new QueueKeys(this.keyPrefix, queue);
    const deadline = Date.now() + wait;
    let pause = 10;
    for (;;) {
      const kept = await this.readResult(keys, id);
      if (kept) return kept;
      const found = await this.locate(queue, id, true);
      const waiting = found.some((place) => place.state !== "dead");
      if (!waiting) {
        // The settle may have written the result between the two reads.
        const late = await this.readResult(keys, id);
        if (late) return late;
        const dead = found.find((place) => place.state === "dead");
        if (dead) {
          let reason = "";
          try {
            reason = JSON.parse(dead.record).reason ?? "";
          } catch {
            reason = "";
          }
          return { state: "dead", reason, endedAt: null };
        }
      }
      const left = deadline - Date.now();
      if (left <= 0) return { state: waiting ? "pending" : "unknown" };
      // A task found nowhere may be running in default mode (it left Redis): wait on until the deadline.
      await new Promise((resolve) => setTimeout(resolve, Math.min(pause, left)));
      pause = Math.min(pause * 2, 500);
    }
  }

  async readResult(keys, id) {
    // The buckets the queue's index lists, newest first, each asked for the id until one holds it
    // (docs/PROTOCOL.md, "Results").
    let text = null;
    let where = keys.key("results");
    for (const start of await this.call("ZRANGE", keys.key("results"), 0, -1, "REV")) {
      where = keys.key(`results:${start}`);
      text = await this.call("HGET", where, id);
      if (text !== null) break;
    }
    if (text === null) return null;
    let record;
    try {
      record = JSON.parse(text);
    } catch (error) {
      throw new KmqError(`${where} field ${id} does not hold a kept result (${error.message})`);
    }
    if (record.state === "done") {
      const done = { state: "done", result: record.result ?? null, endedAt: record.ended_at };
      if (record.result_error !== undefined) done.resultError = record.result_error;
      return done;
    }
    if (record.state === "dead") return { state: "dead", reason: record.reason ?? "", endedAt: record.ended_at };
    throw new KmqError(`${where} field ${id} holds a result of state ${JSON.stringify(record.state)}`);
  }
}

/**
 * Refuses a cycle through references: a depth-first walk from every node (white, grey, black), in the order
 * `kmqd flow push` walks, so that both name the same node. `index` finds a dependency's node.
 */
function checkAcyclic(nodes, index) {
  const state = new Array(nodes.length).fill(0);
  for (let start = 0; start < nodes.length; start += 1) {
    const stack = [[start, 0]];
    while (stack.length > 0) {
      const [at, next] = stack.pop();
      if (next === 0) {
        if (state[at] === 2) continue;
        state[at] = 1;
      }
      if (next < nodes[at].deps.length) {
        stack.push([at, next + 1]);
        const dep = index(nodes[at].deps[next]);
        if (state[dep] === 1) {
          const [d, w] = [nodes[dep], nodes[at]];
          throw new InvalidFlowError(
            d.path,
            `task ${d.queue}/${d.id} waits for itself through ${w.queue}/${w.id} (a cycle); a flow must end`
          );
        }
        if (state[dep] === 0) stack.push([dep, 0]);
      } else {
        state[at] = 2;
      }
    }
  }
}

/**
 * The envelope's `expires_at` (ms since the epoch on Redis's clock; docs/PROTOCOL.md, "Expiry") from `expiresAt` (a
 * Date or ms since the epoch) or `expiresIn` (ms after Redis's `nowMs`); null for neither.
 */
function expiry(expiresAt, expiresIn, nowMs) {
  const given = (value) => value !== undefined && value !== null;
  if (given(expiresAt) && given(expiresIn)) throw new InvalidArgumentError("give expiresAt or expiresIn, not both");
  if (given(expiresAt)) {
    const ms = expiresAt instanceof Date ? expiresAt.getTime() : expiresAt;
    if (!Number.isInteger(ms) || ms < 0) throw new InvalidArgumentError(`expiresAt is a Date or ms since the epoch (not ${expiresAt})`);
    return ms;
  }
  if (given(expiresIn)) {
    if (!Number.isInteger(expiresIn) || expiresIn <= 0) {
      throw new InvalidArgumentError(`expiresIn is a positive whole number of ms (not ${expiresIn})`);
    }
    return nowMs + expiresIn;
  }
  return null;
}

/** A Redis glob matching any member that contains `needle`. */
function globContaining(needle) {
  return `*${needle.replace(/[*?[\]\\]/g, (c) => `\\${c}`)}*`;
}

/** A group's or type's name as it appears in a flow's key (docs/PROTOCOL.md, "Key layout": `flow`). */
function encodeName(name) {
  // Only ASCII bytes are encoded, so the rest of the name's UTF-8 is kept as it is.
  return name.replace(/[%:{}\x00-\x20\x7f]/g, (c) => `%${c.charCodeAt(0).toString(16).toUpperCase().padStart(2, "0")}`);
}

function decodeName(encoded) {
  return decodeURIComponent(encoded.replace(/%(?![0-9A-Fa-f]{2})/g, "%25"));
}

module.exports = {
  Client,
  KmqError,
  DuplicateError,
  InvalidArgumentError,
  UnknownPriorityError,
  InvalidFlowError,
  RedisUnreachableError,
  ReplyLostError,
  RedisRefusedError,
  PUSH_CHUNK,
};
