// Types of kmq-client (index.js). docs/PROTOCOL.md in the kmqd repository is the contract it follows.
import type { ClusterNode, ClusterOptions, RedisOptions } from "ioredis";

/** Options of one push (each optional). */
export interface PushOptions {
  /** The task id; a random UUID when absent. Needed with `unique`. */
  id?: string;
  /** One of the queue's levels; the queue's default level when absent. */
  priority?: string;
  /** Ready this many ms after the push, on Redis's clock. */
  delay?: number;
  /** Ready at this time (a Date, or ms since the epoch); wins over `delay`. */
  at?: Date | number;
  /** Refuse the push (DuplicateError) while a task with this id is delayed, ready or running. */
  unique?: boolean;
  /**
   * Unique, and the id stays held this many ms after its task ended (1 to 999,999,999,999): a push of it is refused
   * (DuplicateError) until then, so that one task of the id runs per such window. Needs `id`; not with `debounce`.
   */
  uniqueFor?: number;
  /** The task's group, for a queue with `[queues.groups]`: 1 to 64 bytes of UTF-8. */
  group?: string;
  /** A W3C trace context; when absent, the current OpenTelemetry span's (if @opentelemetry/api is installed). */
  traceparent?: string;
  tracestate?: string;
  /** Not started at or after this time (a Date, or ms since the epoch, on Redis's clock): dead-lettered "expired". */
  expiresAt?: Date | number;
  /** As `expiresAt`, this many ms after now on Redis's clock (one TIME a batch). */
  expiresIn?: number;
  /**
   * Start this many ms after the push, replacing the task of this id that still waits for its start (its data and
   * start time): only the last push of a burst runs. Needs `id`; not with `unique`, `delay` or `at`.
   */
  debounce?: number;
}

/** One task of a batch. */
export interface NewTask extends PushOptions {
  type: string;
  data?: unknown;
}

export interface Pushed {
  id: string;
  /** False: refused, its unique id is live. */
  accepted: boolean;
}

/** A queue's levels, highest first, and where a push without a priority goes. */
export interface QueueShape {
  levels?: string[];
  defaultPriority?: string;
}

export interface ClientOptions {
  /** The `[redis] key_prefix` of the daemons' config; default "kmq". */
  keyPrefix?: string;
  /** How long a call waits for a connection before RedisUnreachableError; default 5000 ms. */
  connectTimeoutMs?: number;
  /** How long a call waits for its reply before ReplyLostError; default 30000 ms. */
  commandTimeoutMs?: number;
  /** A Redis Cluster: the first argument is then its seed nodes; these are ioredis's cluster options. */
  cluster?: ClusterOptions;
  /** Queue shapes given here rather than read (once per queue) from the queue's meta hash. */
  queues?: Record<string, QueueShape>;
}

export type Place =
  | { state: "delayed" | "retrying"; level: string; dueInMs: number; envelope: string }
  | { state: "ready"; level: string; position: number; flow?: string; group?: string; envelope: string }
  | { state: "processing"; owner: string; token: string; leaseLeftMs: number; envelope: string }
  | { state: "dead"; record: string };

export type Result =
  | { state: "done"; result: unknown; resultError?: string; endedAt: number }
  | { state: "dead"; reason: string; endedAt: number | null }
  | { state: "pending" }
  | { state: "unknown" };

/** A node of a flow: a task (queue and type) and what it waits for, or a reference (queue and id alone). */
export interface FlowNode {
  queue: string;
  type?: string;
  id?: string;
  data?: unknown;
  priority?: string;
  if_failed?: "fail" | "continue";
  after?: FlowNode[];
}

/** A task of a pushed flow; `generatedAt`: its path in the flow when its id was generated. */
export interface FlowTask {
  queue: string;
  id: string;
  generatedAt: string | null;
}

export class Client {
  /** `url`: `redis://[user:password@]host:port/db`, `rediss://...`, or ioredis options (`path`, `sentinels`...). */
  constructor(url?: string | RedisOptions | ClusterNode[], options?: ClientOptions);
  /** Resolves to the task's id; DuplicateError for a unique push of a live id. */
  push(queue: string, type: string, data?: unknown, options?: PushOptions): Promise<string>;
  /** One push.lua call per 1,000 tasks; one result per task, in order. */
  pushBatch(queue: string, tasks: NewTask[]): Promise<Pushed[]>;
  /**
   * Pushes a flow (docs/PROTOCOL.md, "Flows"), checked whole first (InvalidFlowError names the node); every task,
   * root first. `deadMax`, `keepMs`: the waiting tasks' queue's `dead_max` and `keep_results` (10000, 600000).
   */
  pushFlow(flow: FlowNode | string, options?: { deadMax?: number; keepMs?: number }): Promise<FlowTask[]>;
  /** Every place the task is in (none: not in Redis). */
  show(queue: string, id: string): Promise<Place[]>;
  /** Removes every waiting copy; resolves to how many. */
  cancel(queue: string, id: string): Promise<number>;
  /** The task's kept result, waiting up to `wait` ms. */
  result(queue: string, id: string, options?: { wait?: number }): Promise<Result>;
  close(): Promise<void>;
}

export class KmqError extends Error {}
export class DuplicateError extends KmqError {
  queue: string;
  id: string;
}
export class InvalidArgumentError extends KmqError {}
export class UnknownPriorityError extends InvalidArgumentError {
  queue: string;
  priority: string;
  levels: string[];
}
export class InvalidFlowError extends InvalidArgumentError {
  /** The node: "the root", "after[1].after[0]". */
  path: string;
  reason: string;
}
export class RedisUnreachableError extends KmqError {}
export class ReplyLostError extends KmqError {}
export class RedisRefusedError extends KmqError {}
export const PUSH_CHUNK: number;
