'use strict';
/**
 * Handlers for kmqd in Node.js: long-lived handler processes of the exec plugin (mode = "persistent").
 *
 * One file, no dependencies (Node 18 or later): copy it next to your handlers. The protocol it speaks is
 * docs/HANDLERS.md (version 1): a hello line, then one JSON task per line on standard input, one JSON answer per
 * task on standard output.
 *
 *     const { handle, run, Retry, Fail, Throttle } = require('./kmq-handler');
 *
 *     handle('report.mail', async (task) => {
 *       if (!task.data.to.includes('@')) throw new Fail('not an address');  // dead-lettered, no retries
 *       const reply = await send(task.data.to);
 *       if (reply.status === 429) throw new Throttle(30000, 'too many');     // the queue waits 30 s, uncharged
 *       return `sent to ${task.data.to}`;                                    // done, logged with the task
 *     });
 *
 *     run();
 *
 * A handler that returns `new Result(value)` is done with that result: any JSON value, which kmqd keeps with the
 * task when its queue has `keep_results` (`kmqd task result QUEUE ID` prints it; docs/HANDLERS.md, "Results").
 *
 * A handler returns (or resolves: done; a string is the outcome's message), or throws `Retry` (this attempt
 * failed), `Fail` (the task can never succeed) or `Throttle` (the upstream every task of the queue uses said "too
 * many requests"). Any other error is a failed attempt: retried with `Name: message` as the reason, its stack on
 * standard error. A task type with no handler fails. With
 * `concurrency` in the config, that many tasks run at once (async handlers; a sync one blocks the event loop).
 *
 * A task's W3C trace context is `task.traceparent` (and `task.tracestate`): the span of kmqd's run when kmqd
 * traces, the producer's otherwise. With @opentelemetry/api installed, the handler runs in that context (with the
 * application's context manager registered, a span it starts is a child of the run: docs/HANDLERS.md, "Tracing").
 *
 * Standard output carries the protocol, so `run()` sends console.log (and info, debug) to standard error: a log
 * line in a handler lands in kmqd's log, attributed to the task, instead of breaking the protocol.
 */

const { inspect } = require('node:util');

const PROTOCOL = 1;

// Optional: with @opentelemetry/api installed, a handler runs in its task's trace context.
let otel = null;
try {
  otel = require('@opentelemetry/api');
} catch {
  otel = null;
}

const TRACEPARENT = /^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$/;

/**
 * The task's trace context as an OpenTelemetry context, or null (no API, no context, or a malformed one). Read
 * into a span context by hand rather than through a propagator, so that it works whether or not the application
 * registered one.
 */
function traceContextOf(task) {
  if (!otel || typeof task.traceparent !== 'string') return null;
  const parts = TRACEPARENT.exec(task.traceparent);
  if (!parts || parts[1] === 'ff' || (parts[1] === '00' && parts[5] !== undefined)) return null;
  const spanContext = {
    traceId: parts[2],
    spanId: parts[3],
    traceFlags: parseInt(parts[4], 16) & 0xff,
    isRemote: true,
  };
  if (typeof task.tracestate === 'string' && task.tracestate && otel.createTraceState) {
    spanContext.traceState = otel.createTraceState(task.tracestate);
  }
  if (!otel.isSpanContextValid(spanContext)) return null;
  return otel.trace.setSpanContext(otel.ROOT_CONTEXT, spanContext);
}

/** This attempt failed: retried after `afterMs` milliseconds, or the queue's backoff. */
class Retry extends Error {
  constructor(message = '', { afterMs } = {}) {
    super(message);
    this.name = 'Retry';
    this.afterMs = afterMs;
  }
}

/** The task can never succeed: kmqd dead-letters it at once. */
class Fail extends Error {
  constructor(message = '') {
    super(message);
    this.name = 'Fail';
  }
}

/**
 * Back-pressure: the upstream every task of the queue shares said "too many requests" (an HTTP 429, a quota). The
 * task goes back to the head of its queue, its attempt not charged (never dead-lettered for it), and no daemon
 * takes a task of the queue for `afterMs` milliseconds (kmqd makes that at least 1 ms and at most an hour). A
 * failure of this task alone is a `Retry`.
 *
 * `afterMs` is required: the wait the upstream asked for (its Retry-After). One that is not a number of ms, 0 or
 * more, throws here: the handler's bug is then a failed attempt that says so, not a throttle of a guessed length.
 */
class Throttle extends Error {
  constructor(afterMs, message = '') {
    if (typeof afterMs !== 'number') {
      throw new TypeError(`Throttle(afterMs): the ms the queue waits, a number, not ${inspect(afterMs)}`);
    }
    if (!(afterMs >= 0 && afterMs < Infinity)) {
      throw new RangeError(`Throttle(afterMs): the ms the queue waits, 0 or more, not ${inspect(afterMs)}`);
    }
    super(message);
    this.name = 'Throttle';
    this.afterMs = afterMs;
  }
}

/**
 * What a handler returns to be done with a result: `value` is any JSON value, kept with the task when its queue has
 * `keep_results`; `message` is logged as a returned string is. A value JSON.stringify cannot encode (a BigInt, a
 * cycle, undefined) makes the attempt fail (a retry that says why), so a handler's bug is not a task done without
 * its result.
 */
class Result {
  constructor(value, message = '') {
    this.value = value;
    this.message = String(message);
  }
}

const handlers = new Map();

/** Registers `fn(task)` (sync or async) as the handler of `type`. */
function handle(type, fn) {
  if (handlers.has(type)) throw new Error(`a handler for ${JSON.stringify(type)} is registered already`);
  handlers.set(type, fn);
}

/** One run of a task: what kmqd's task line says. */
/** The line of a progress report for task `id`, or null for a fraction that is not a number (NaN: no report).
 * Clamped to 0..1 here, since JSON has no Infinity. */
function progressLine(id, fraction, message) {
  const value = Number(fraction);
  if (Number.isNaN(value)) return null;
  return { id, progress: Math.min(1, Math.max(0, value)), message: String(message ?? '') };
}

function taskOf(line, report = null) {
  const deadline = line.deadline_ms ?? null;
  const created = line.created_at_ms ?? null;
  return {
    id: line.id,
    type: line.type,
    queue: line.queue ?? '',
    attempt: line.attempt ?? 0,
    data: line.data ?? null,
    /** A task of a flow that waited for others: their outcomes ({queue, id, state, result or reason}); null for
     * a task that waited for none. */
    after: line.after ?? null,
    /** The W3C trace context: the run's span when kmqd traces, the producer's otherwise; null without one. */
    traceparent: line.traceparent ?? null,
    tracestate: line.tracestate ?? null,
    deadline: deadline === null ? null : new Date(deadline),
    createdAt: created === null ? null : new Date(created),
    /** Milliseconds left before the deadline (the execution timeout), or null without one. */
    remainingMs() {
      return deadline === null ? null : deadline - Date.now();
    },
    /** Reports how far the task is (docs/HANDLERS.md, "Progress"): `fraction` from 0 to 1 (NaN is ignored, others
     * clamped) and a short message; `kmqd task show` and the dashboard show the latest. Call it as often as you
     * like: kmqd writes each task's latest report a few times a second. */
    progress(fraction, message = '') {
      const answer = progressLine(line.id, fraction, message);
      if (answer !== null && report !== null) report(answer);
    },
  };
}

function outcome(id, result, error) {
  if (error === undefined) {
    const answer = { id, outcome: 'done' };
    if (typeof result === 'string' && result) answer.message = result;
    if (result instanceof Result) {
      let encoded;
      try {
        encoded = JSON.stringify(result.value);
      } catch (error) {
        return { id, outcome: 'retry', message: `the handler's result is not JSON: ${error.message}` };
      }
      if (encoded === undefined) {
        return { id, outcome: 'retry', message: `the handler's result is not JSON: ${inspect(result.value)}` };
      }
      answer.result = result.value;
      if (result.message) answer.message = result.message;
    }
    return answer;
  }
  if (error instanceof Fail) return { id, outcome: 'fail', message: error.message || 'failed' };
  if (error instanceof Retry) {
    const answer = { id, outcome: 'retry', message: error.message };
    if (error.afterMs !== undefined) answer.retry_after_ms = Math.max(0, Math.round(error.afterMs));
    return answer;
  }
  if (error instanceof Throttle) {
    // Whole ms, rounded up: the queue waits no less than the upstream asked. Bounded by the largest integer JSON
    // carries exactly here (kmqd holds a queue back at most an hour anyway).
    const afterMs = Math.min(Math.ceil(error.afterMs), Number.MAX_SAFE_INTEGER);
    return { id, outcome: 'throttle', after_ms: afterMs, message: error.message };
  }
  const name = error && error.name ? error.name : 'Error';
  const message = error && error.message !== undefined ? error.message : String(error);
  return { id, outcome: 'retry', message: `${name}: ${message}` };
}

/** Speaks the protocol on standard input and output until standard input ends; then the process exits. */
function run() {
  const out = process.stdout;
  // Answers settled in one turn of the event loop go out in one write (the protocol's lines unchanged, fewer
  // system calls per task): the first schedules the write, the others join it.
  let answers = [];
  const flush = () => {
    const text = answers.join('');
    answers = [];
    out.write(text);
  };
  const send = (answer) => {
    if (answers.length === 0) setImmediate(flush);
    answers.push(`${JSON.stringify(answer)}\n`);
  };
  // Handler logs go to standard error (kmqd's log), never into the protocol.
  console.log = console.error;
  console.info = console.error;
  console.debug = console.error;

  const settle = async (task) => {
    const fn = handlers.get(task.type);
    if (!fn) {
      send({ id: task.id, outcome: 'fail', message: `no handler for task type ${JSON.stringify(task.type)}` });
      return;
    }
    try {
      const context = traceContextOf(task);
      send(outcome(task.id, await (context ? otel.context.with(context, fn, undefined, task) : fn(task))));
    } catch (error) {
      if (!(error instanceof Retry) && !(error instanceof Fail) && !(error instanceof Throttle)) {
        process.stderr.write(`${error && error.stack ? error.stack : String(error)}\n`);
      }
      send(outcome(task.id, undefined, error));
    }
  };

  out.write(`${JSON.stringify({ hello: PROTOCOL, sdk: 'node/1' })}\n`);
  const take = (line) => {
    if (!line.trim()) return;
    let task;
    try {
      task = taskOf(JSON.parse(line), send);
    } catch (error) {
      process.stderr.write(`kmq-handler: not a task line (${error.message}): ${line}\n`);
      return;
    }
    settle(task);
  };
  // Every line a read brought, at once (no readline: its events per line cost more than the split).
  let partial = '';
  process.stdin.setEncoding('utf8');
  process.stdin.on('data', (chunk) => {
    const lines = (partial + chunk).split('\n');
    partial = lines.pop();
    for (const line of lines) take(line);
  });
  process.stdin.on('end', () => {
    if (partial) take(partial);
    partial = '';
  });
  // At the end of standard input the process exits once its running tasks are answered: nothing else keeps the
  // event loop alive.
}

module.exports = { Fail, PROTOCOL, Result, Retry, Throttle, handle, run };
