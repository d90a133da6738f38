"""kmq.Client: push tasks to kmqd's queues, look them up, cancel them, read their results.

Everything here follows docs/PROTOCOL.md of the kmqd repository (the contract): the key names, the envelope,
push.lua's keys, arguments and replies (a copy of push.lua ships in this package, checked byte for byte against
kmqd's by kmqd's tests), the queue's shape in its meta hash, cancel through remove.lua.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import time
import uuid
from importlib import resources
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union
from urllib.parse import unquote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .errors import (
    DuplicateTask,
    InvalidArgument,
    InvalidFlow,
    RedisRefused,
    RedisUnreachable,
    ReplyLost,
    UnknownPriority,
)

#: The most tasks sent in one push.lua call: one round trip per 1,000 tasks, and no call holds Redis for long.
PUSH_CHUNK = 1000
#: A group's name is 1 to 64 bytes of UTF-8 (docs/PROTOCOL.md, "The envelope").
MAX_GROUP_BYTES = 64
#: The longest unique_for push.lua takes, in ms: 12 digits (about 31 years).
MAX_UNIQUE_FOR_MS = 999_999_999_999
#: The envelope's encoding: compact, UTF-8 as it is (as kmqd's own pushes), no NaN (not JSON).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
#: Pages of list reads when looking a task up: bounded replies, whatever a list's length.
PAGE = 1000
#: How long a queue's shape read from its meta hash is trusted (docs/PROTOCOL.md, "The queue's shape"): a push
#: that names a level the kept shape lacks reads it again at once, before refusing it; so does any push after this long.
SHAPE_FOR = 10.0

Seconds = Union[int, float, _dt.timedelta]
When = Union[int, float, _dt.datetime]


def _script(name: str) -> str:
    return resources.files("kmq").joinpath("scripts").joinpath(name).read_text(encoding="utf-8")


PUSH_LUA = _script("push.lua")
#: remove.lua with checks.lua and unique_hold.lua before it, exactly as kmqd's broker runs it (src/broker/mod.rs, `sources`).
REMOVE_LUA = _script("checks.lua") + _script("unique_hold.lua") + _script("remove.lua")
#: flow_push.lua with its preludes, exactly as kmqd's broker runs it (src/broker/mod.rs, `sources`, FLOW_PUSH).
FLOW_PUSH_LUA = "#!lua\n" + _script("checks.lua") + _script("deps.lua") + _script("flow_push.lua")
#: The fields a flow's node may have (docs/PROTOCOL.md, "Flows"); any other is refused, as `kmqd flow push` does.
_FLOW_FIELDS = ("queue", "type", "id", "data", "priority", "if_failed", "after")
#: JSON as kmqd's own flow push writes it (compact, UTF-8 as it is).
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


class Pushed(NamedTuple):
    """What became of one task of :meth:`Client.push_batch`."""

    id: str
    #: False: refused as a duplicate (its unique id is live, or a delayed task with its id waits).
    accepted: bool


class Task(NamedTuple):
    """A task for :meth:`Client.push_batch`; a plain ``(type, data)`` tuple is one too."""

    type: str
    data: Any = None
    id: Optional[str] = None
    priority: Optional[str] = None
    delay: Optional[Seconds] = None
    at: Optional[When] = None
    unique: bool = False
    group: Optional[str] = None
    traceparent: Optional[str] = None
    tracestate: Optional[str] = None
    #: Dead-lettered unrun (reason "expired") when not started by then: a timezone-aware datetime or seconds since
    #: the epoch, compared with Redis's clock by the daemon (docs/PROTOCOL.md, "Expiry").
    expires_at: Optional[When] = None
    #: Seconds (or a timedelta): start that long after the push, replacing the task of this id that still waits
    #: for its own start (its data and start time), so that only the last push of a burst runs; needs an id, not
    #: with ``unique``, ``delay`` or ``at`` (docs/PROTOCOL.md, "Debounce, and unique for a time").
    debounce: Optional[Seconds] = None
    #: Seconds (or a timedelta): unique, and the id stays held that long after its task ended, so that one task of
    #: the id runs per such window; needs an id (docs/PROTOCOL.md, "Debounce, and unique for a time").
    unique_for: Optional[Seconds] = None


class FlowTask(NamedTuple):
    """A task of a flow :meth:`Client.push_flow` pushed, root first, in the flow's order."""

    queue: str
    id: str
    #: Its path in the flow (``the root``, ``after[0]``) when its id was generated, else None.
    generated_at: Optional[str] = None


class _FlowNode:
    """A task a flow defines, once read and checked (src/flow.rs of kmqd does the same)."""

    __slots__ = ("queue", "type", "id", "data", "level", "if_failed", "priority", "deps", "path", "generated")

    def __init__(self, queue: str, kind: str, task_id: str, data: Any, level: str, if_failed: str,
                 priority: Optional[str], path: str, generated: bool):
        self.queue, self.type, self.id, self.data = queue, kind, task_id, data
        self.level, self.if_failed, self.priority = level, if_failed, priority
        self.deps: List[Tuple[str, str]] = []
        self.path, self.generated = path, generated


class _Prepared(NamedTuple):
    level: str
    after_ms: int
    at_ms: int
    id: str
    #: push.lua's OPTIONS_n: "0", "1" (unique), "unique_for=MS" or "debounce".
    options: str
    envelope: str


def _no_retries() -> Retry:
    # A command sent again after a lost reply would push its tasks twice: kmq never retries on its own, it says
    # ReplyLost and leaves the choice to the caller.
    return Retry(NoBackoff(), 0)


try:
    # Optional (the "tracing" extra): imported once, since a failed import is searched for again at every try.
    from opentelemetry import propagate as _propagate  # type: ignore[import-not-found]
except ImportError:
    _propagate = None


def _current_trace() -> Dict[str, str]:
    """The current OpenTelemetry context as W3C headers, when opentelemetry-api is installed and a span is active."""
    if _propagate is None:
        return {}
    carrier: Dict[str, str] = {}
    _propagate.inject(carrier)
    return {k: v for k, v in carrier.items() if k in ("traceparent", "tracestate")}


def _ms(value: Seconds) -> int:
    if isinstance(value, _dt.timedelta):
        return round(value.total_seconds() * 1000)
    return round(float(value) * 1000)


def _at_ms(value: When) -> int:
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            raise InvalidArgument("at: give a timezone-aware datetime (a naive one has no instant)")
        return round(value.timestamp() * 1000)
    return round(float(value) * 1000)


class Client:
    """A producer for kmqd's queues on one Redis (or Cluster, or Sentinel-watched master).

    ``url``: ``redis://[[user]:password@]host:port/db``, ``rediss://`` (TLS), or ``unix:///path/redis.sock``;
    ``redis_options`` go to redis-py (``socket_timeout``, ``ssl_ca_certs``, ...). ``levels`` and
    ``default_priority`` give a queue's shape for every queue instead of reading it from Redis
    (docs/PROTOCOL.md, "The queue's shape").
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        key_prefix: str = "kmq",
        *,
        levels: Optional[Sequence[str]] = None,
        default_priority: Optional[str] = None,
        redis_client: Optional[Union["redis.Redis[bytes]", "redis.RedisCluster[bytes]"]] = None,
        **redis_options: Any,
    ):
        if redis_client is None:
            if not url.startswith("unix:"):
                # redis-py 4.3's unix socket connections take no connect timeout.
                redis_options.setdefault("socket_connect_timeout", 5)
            redis_options.setdefault("retry", _no_retries())
            redis_client = redis.Redis.from_url(url, **redis_options)
        self.redis = redis_client
        self.key_prefix = key_prefix
        if levels is not None:
            levels = list(levels)
            if not levels or any(not level or "," in level for level in levels):
                raise InvalidArgument(f"levels {levels!r}: give one or more non-empty names without commas")
            if default_priority is not None and default_priority not in levels:
                raise InvalidArgument(f"default_priority {default_priority!r} is not one of {levels!r}")
        self._given_levels = levels
        self._given_default = default_priority
        self._shapes: Dict[str, Tuple[List[str], str, float]] = {}
        self._push_sha: Optional[str] = None
        self._remove_sha: Optional[str] = None
        self._flow_push_sha: Optional[str] = None

    @classmethod
    def cluster(cls, url: str, key_prefix: str = "kmq", **options: Any) -> "Client":
        """A client of a Redis Cluster, through redis-py's RedisCluster (``url`` names any node). RedisCluster's own
        retries are turned off (one attempt per call): a command sent twice after a lost reply would push twice."""
        kmq_options = {k: options.pop(k) for k in ("levels", "default_priority") if k in options}
        # redis-py 4 counts every attempt in cluster_error_retry_attempts (0 makes none at all), 5 the retries.
        options.setdefault("cluster_error_retry_attempts", 1 if int(redis.__version__.split(".")[0]) < 5 else 0)
        options.setdefault("socket_connect_timeout", 5)
        return cls(key_prefix=key_prefix, redis_client=redis.RedisCluster.from_url(url, **options), **kmq_options)

    @classmethod
    def sentinel(
        cls,
        sentinels: Sequence[Tuple[str, int]],
        service_name: str,
        key_prefix: str = "kmq",
        *,
        sentinel_options: Optional[Dict[str, Any]] = None,
        **options: Any,
    ) -> "Client":
        """A client of the master that Sentinels watch as ``service_name``, through redis-py's Sentinel: each
        connection asks the Sentinels where the master is, so a failover is followed."""
        from redis.sentinel import Sentinel

        kmq_options = {k: options.pop(k) for k in ("levels", "default_priority") if k in options}
        options.setdefault("socket_connect_timeout", 5)
        options.setdefault("retry", _no_retries())
        watcher = Sentinel(list(sentinels), sentinel_kwargs=sentinel_options, **options)
        return cls(key_prefix=key_prefix, redis_client=watcher.master_for(service_name), **kmq_options)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    # Keys (docs/PROTOCOL.md, "Key layout").

    def _key(self, queue: str, name: str) -> str:
        return f"{self.key_prefix}:{{{queue}}}:{name}"

    def shape(self, queue: str, wanted: Iterable[str] = ()) -> Tuple[List[str], str]:
        """The queue's levels (highest first) and its default level: the constructor's, else what a daemon wrote
        into the queue's meta hash, kept for :data:`SHAPE_FOR` seconds and read again at once when ``wanted`` names
        a level it lacks, else the one level ``normal``."""
        known = self._shapes.get(queue)
        if (
            known is not None
            and time.monotonic() - known[2] < SHAPE_FOR
            and all(level in known[0] for level in wanted)
        ):
            return known[0], known[1]
        if self._given_levels is not None:
            levels = self._given_levels
            default = self._given_default
        else:
            # Two HGETs in one round trip: HGET is in the producers' ACL rules (docs/OPERATIONS.md), HMGET not.
            def read() -> List[Optional[bytes]]:
                pipe = self.redis.pipeline(transaction=False)
                pipe.hget(self._key(queue, "meta"), "levels")
                pipe.hget(self._key(queue, "meta"), "default_priority")
                return pipe.execute()

            try:
                raw_levels, raw_default = self._call(read, sent_is_safe=True)
            except RedisRefused as refused:
                # A producer user of older ACL rules may not read the meta hash (docs/OPERATIONS.md, "ACL rules"):
                # it pushes as a queue without priorities, or with the levels given to the constructor.
                if not isinstance(refused.__cause__, redis.exceptions.NoPermissionError):
                    raise
                raw_levels = raw_default = None
            levels = raw_levels.decode().split(",") if raw_levels else ["normal"]
            default = raw_default.decode() if raw_default else None
        if default is None or default not in levels:
            # The daemons' own default: the middle level, the first of two (docs/CONFIG.md, `default_priority`).
            default = levels[(len(levels) - 1) // 2]
        self._shapes[queue] = (levels, default, time.monotonic())
        return levels, default

    # Pushing.

    def push(
        self,
        queue: str,
        type: str,
        data: Any = None,
        *,
        id: Optional[str] = None,
        priority: Optional[str] = None,
        delay: Optional[Seconds] = None,
        at: Optional[When] = None,
        unique: bool = False,
        group: Optional[str] = None,
        traceparent: Optional[str] = None,
        tracestate: Optional[str] = None,
        expires_at: Optional[When] = None,
        debounce: Optional[Seconds] = None,
        unique_for: Optional[Seconds] = None,
    ) -> str:
        """Queues one task; returns its id (``id``, or a new random UUID). ``delay`` (seconds, or a timedelta) is
        counted on Redis's clock; ``at`` is a timezone-aware datetime or seconds since the epoch, and so is
        ``expires_at`` (a task not started by then is dead-lettered unrun, reason "expired"). ``debounce``
        (seconds, with ``id``) delays the task and replaces the task of its id that still waits. ``unique_for``
        (seconds, with ``id``) makes it unique and keeps its id held that long after it ended. Raises
        :class:`DuplicateTask` when a unique id is live."""
        task = Task(type, data, id, priority, delay, at, unique, group, traceparent, tracestate, expires_at, debounce,
                    unique_for)
        pushed = self.push_batch(queue, [task])[0]
        if not pushed.accepted:
            raise DuplicateTask(queue, pushed.id)
        return pushed.id

    def push_batch(self, queue: str, tasks: Iterable[Union[Task, Tuple[Any, ...]]]) -> List[Pushed]:
        """Queues many tasks: one push.lua call (one round trip) per 1,000 consecutive tasks of the same level and
        due time. Every task is checked before anything is sent: one bad task refuses the whole batch. Returns one
        :class:`Pushed` per task, in order (a duplicate is not an error here)."""
        tasks = [Task(*task) for task in tasks]
        levels, default = self.shape(queue, {task.priority for task in tasks if isinstance(task.priority, str)})
        trace = _current_trace()
        prepared = [self._prepare(queue, task, levels, default, trace) for task in tasks]
        return self._push_prepared(queue, prepared)

    def _push_prepared(self, queue: str, prepared: Sequence[_Prepared]) -> List[Pushed]:
        """push.lua calls for checked tasks: one per 1,000 consecutive tasks of the same level and due time."""
        results: List[Pushed] = []
        start = 0
        while start < len(prepared):
            first = prepared[start]
            end = start + 1
            while (
                end < len(prepared)
                and end - start < PUSH_CHUNK
                and prepared[end][:3] == first[:3]
            ):
                end += 1
            chunk = prepared[start:end]
            replies = self._push_call(queue, first.level, first.after_ms, first.at_ms, chunk)
            if len(replies) != len(chunk):
                raise RedisRefused(f"push.lua replied {len(replies)} results for {len(chunk)} tasks")
            results.extend(Pushed(task.id, reply == 1) for task, reply in zip(chunk, replies))
            start = end
        return results

    def _prepare(
        self, queue: str, task: Task, levels: List[str], default: str, trace: Dict[str, str]
    ) -> _Prepared:
        if not isinstance(task.type, str) or not task.type:
            raise InvalidArgument("a task needs a type (a non-empty string): it selects the handler")
        if task.id is not None and (not isinstance(task.id, str) or not task.id):
            raise InvalidArgument("id: give a non-empty string, or None for a random UUID")
        unique = task.unique or task.unique_for is not None
        if unique and task.id is None:
            raise InvalidArgument("a unique task needs an id: uniqueness is per id")
        if task.group is not None and (
            not isinstance(task.group, str) or not 1 <= len(task.group.encode("utf-8")) <= MAX_GROUP_BYTES
        ):
            raise InvalidArgument(f"group {task.group!r} is not a group name: use 1 to {MAX_GROUP_BYTES} bytes")
        if task.priority is not None and task.priority not in levels:
            raise UnknownPriority(queue, task.priority, levels)
        after_ms = at_ms = 0
        options = "1" if unique else "0"
        if task.unique_for is not None:
            hold = _ms(task.unique_for)
            if not 1 <= hold <= MAX_UNIQUE_FOR_MS:
                raise InvalidArgument(f"unique_for {task.unique_for!r}: give 1 ms to {MAX_UNIQUE_FOR_MS} ms")
            options = f"unique_for={hold}"
        if task.debounce is not None:
            if task.id is None or unique or task.delay is not None or task.at is not None:
                raise InvalidArgument("debounce: give an id, and neither unique, delay nor at (it is the delay)")
            after_ms = _ms(task.debounce)
            if after_ms <= 0:
                raise InvalidArgument(f"debounce {task.debounce!r}: give a positive time")
            options = "debounce"
        elif task.at is not None:
            at_ms = max(_at_ms(task.at), 1)
        elif task.delay is not None:
            after_ms = _ms(task.delay)
            if after_ms <= 0:
                raise InvalidArgument(f"delay {task.delay!r}: give a positive delay, or none")
        task_id = task.id if task.id is not None else str(uuid.uuid4())
        envelope: Dict[str, Any] = {"id": task_id, "type": task.type, "data": task.data, "attempt": 0}
        if task.priority is not None:
            envelope["priority"] = task.priority
        if unique:
            envelope["unique"] = True
        if task.group is not None:
            envelope["group"] = task.group
        if task.expires_at is not None:
            envelope["expires_at"] = _at_ms(task.expires_at)
        traceparent = task.traceparent or trace.get("traceparent")
        if traceparent:
            envelope["traceparent"] = traceparent
            tracestate = task.tracestate if task.traceparent else trace.get("tracestate")
            if tracestate:
                envelope["tracestate"] = tracestate
        try:
            text = _ENCODER.encode(envelope)
        except (TypeError, ValueError) as error:
            raise InvalidArgument(f"data of task {task_id!r} is not JSON: {error}") from None
        return _Prepared(task.priority or default, after_ms, at_ms, task_id, options, text)

    def _push_call(self, queue: str, level: str, after_ms: int, at_ms: int, chunk: Sequence[_Prepared]) -> List[int]:
        keys = [
            self._key(queue, f"ready:{level}"),
            self._key(queue, f"delayed:{level}"),
            self._key(queue, "delayed-tasks"),
            self._key(queue, "wake"),
            self._key(queue, "unique"),
            self._key(queue, "stats"),
            self._key(queue, "routes"),
        ]
        args: List[Any] = [after_ms, at_ms, self._key(queue, "delay-wake")]
        for task in chunk:
            args += [task.id, task.options, task.envelope]
        return self._script(PUSH_LUA, "_push_sha", keys, args, ids=[task.id for task in chunk])

    # Flows (docs/PROTOCOL.md, "Flows").

    def push_flow(self, flow: Union[Dict[str, Any], str, bytes], *, dead_max: int = 10000,
                  keep: Seconds = 600) -> List[FlowTask]:
        """Pushes a flow: ``flow`` is the flow's JSON (its text, or the decoded dict), one task with the tasks it
        waits for nested in ``after``. The flow is checked whole before anything is written (:class:`InvalidFlow`
        names the node), as ``kmqd flow push`` checks it; its waiting tasks are then written with flow_push.lua, a
        queue at a time, 1,000 a call, and last the tasks that wait for nothing are pushed (push.lua, 1,000 a call),
        so that no task can end before the tasks waiting for it exist. ``dead_max`` and ``keep`` (seconds, or a
        timedelta) are what a daemon takes from the waiting tasks' queue's config (``dead_max``, ``keep_results``;
        without it ten minutes): give your queues' values when they differ. Returns every task, root first."""
        if isinstance(flow, (str, bytes)):
            try:
                flow = json.loads(flow)
            except ValueError as error:
                raise InvalidFlow("the root", f"the flow is not JSON: {error}") from None
        keep_ms = max(_ms(keep), 1)
        if isinstance(dead_max, bool) or not isinstance(dead_max, int) or dead_max < 0:
            raise InvalidArgument(f"dead_max {dead_max!r}: give a count (an integer, 0 or more)")
        nodes: List[_FlowNode] = []
        references: List[Tuple[str, Tuple[str, str]]] = []
        if self._read_flow_node(flow, "the root", nodes, references) is None:
            raise InvalidFlow("the root", "a flow's root is a task (queue and type), not a reference")
        defined: Dict[Tuple[str, str], int] = {}
        for at, node in enumerate(nodes):
            first = defined.setdefault((node.queue, node.id), at)
            if first != at:
                raise InvalidFlow(node.path, f"task {node.queue}/{node.id} is defined twice (first at "
                                             f"{nodes[first].path}); to wait for one task twice, refer to it "
                                             f"with {{\"queue\": ..., \"id\": ...}} only")
        for path, key in references:
            if key not in defined:
                raise InvalidFlow(path, f"refers to task {key[0]}/{key[1]}, which the flow does not define")
        _check_acyclic(nodes, defined)
        up: Dict[Tuple[str, str], List[Tuple[str, str]]] = {}
        for node in nodes:
            for dep in node.deps:
                waiters = up.setdefault(dep, [])
                if (node.queue, node.id) in waiters:
                    raise InvalidFlow(node.path, f"task {node.queue}/{node.id} waits for {dep[0]}/{dep[1]} twice")
                waiters.append((node.queue, node.id))
        order: List[str] = []
        waiting: Dict[str, List[Tuple[_FlowNode, str, str]]] = {}
        leaves: Dict[str, List[_Prepared]] = {}
        for node in nodes:
            envelope: Dict[str, Any] = {"id": node.id, "type": node.type, "data": node.data, "attempt": 0}
            if node.priority is not None:
                envelope["priority"] = node.priority
            its_up = _COMPACT.encode([{"queue": q, "id": i} for q, i in up.get((node.queue, node.id), [])])
            if its_up != "[]":
                envelope["waiters"] = json.loads(its_up)
            try:
                text = _COMPACT.encode(envelope)
            except (TypeError, ValueError) as error:
                raise InvalidFlow(node.path, f"data is not JSON: {error}") from None
            if node.queue not in order:
                order.append(node.queue)
            if node.deps:
                waiting.setdefault(node.queue, []).append((node, text, its_up))
            else:
                leaves.setdefault(node.queue, []).append(_Prepared(node.level, 0, 0, node.id, "0", text))
        for queue in order:
            for start in range(0, len(waiting.get(queue, [])), PUSH_CHUNK):
                self._flow_push_call(queue, dead_max, keep_ms, waiting[queue][start:start + PUSH_CHUNK])
        for queue in order:
            levels, _ = self.shape(queue)
            # Stable: a level's tasks keep the flow's order.
            rank = {level: n for n, level in enumerate(levels)}
            self._push_prepared(queue, sorted(leaves.get(queue, []), key=lambda task: rank.get(task.level, len(rank))))
        return [FlowTask(node.queue, node.id, node.path if node.generated else None) for node in nodes]

    def _read_flow_node(self, raw: Any, path: str, nodes: List["_FlowNode"],
                        references: List[Tuple[str, Tuple[str, str]]]) -> Optional[Tuple[str, str]]:
        """Reads the node ``raw`` at ``path`` and, depth first, what it waits for into ``nodes``; a reference goes
        to ``references``. Returns the task it names (None for a reference at the root)."""
        if not isinstance(raw, dict):
            raise InvalidFlow(path, "a node is a JSON object")
        for field in raw:
            if field not in _FLOW_FIELDS:
                raise InvalidFlow(path, f"unknown field {field!r}; a node has {', '.join(_FLOW_FIELDS)}")
        for field in ("queue", "type", "id", "priority", "if_failed"):
            if raw.get(field) is not None and not isinstance(raw[field], str):
                raise InvalidFlow(path, f"{field!r} is not a string")
        after = raw.get("after", [])
        if not isinstance(after, list):
            raise InvalidFlow(path, "\"after\" is not a list of nodes")
        queue = raw.get("queue")
        if not queue:
            raise InvalidFlow(path, "no \"queue\"")
        kind = raw.get("type")
        if kind is None:
            # A reference: a queue and an id, nothing else.
            if raw.get("id") is None:
                raise InvalidFlow(path, "no \"type\" (a task needs one; a reference to a task defined elsewhere "
                                        "needs an \"id\")")
            if any(raw.get(field) is not None for field in ("data", "priority", "if_failed")) or after:
                raise InvalidFlow(path, f"no \"type\", so this refers to task {queue}/{raw['id']}: a reference "
                                        f"has only \"queue\" and \"id\"")
            references.append((path, (queue, raw["id"])))
            return None if path == "the root" else (queue, raw["id"])
        if not kind:
            raise InvalidFlow(path, "\"type\" is empty")
        if_failed = "fail" if raw.get("if_failed") is None else raw["if_failed"]
        if if_failed not in ("fail", "continue"):
            raise InvalidFlow(path, f"if_failed {if_failed!r} is neither \"fail\" (the default) nor \"continue\"")
        priority = raw.get("priority")
        levels, default = self.shape(queue, [priority] if priority is not None else [])
        if priority is not None and priority not in levels:
            raise InvalidFlow(path, f"queue {queue!r} has no priority {priority!r}; its levels are {levels!r}")
        if raw.get("id") == "":
            raise InvalidFlow(path, "\"id\" is empty")
        generated = raw.get("id") is None
        task_id = str(uuid.uuid4()) if generated else raw["id"]
        node = _FlowNode(queue, kind, task_id, raw.get("data"), priority or default, if_failed, priority, path,
                         generated)
        nodes.append(node)
        for n, dep in enumerate(after):
            dep_path = f"after[{n}]" if path == "the root" else f"{path}.after[{n}]"
            node.deps.append(self._read_flow_node(dep, dep_path, nodes, references))  # type: ignore[arg-type]
        return queue, task_id

    def _flow_push_call(self, queue: str, dead_max: int, keep_ms: int,
                        chunk: Sequence[Tuple["_FlowNode", str, str]]) -> List[str]:
        """One flow_push.lua call: a queue's waiting tasks, all or nothing (docs/PROTOCOL.md, "Flows")."""
        keys = [self._key(queue, name) for name in ("deps-waiting", "wake", "dead", "stats", "deps-outbox")]
        args: List[Any] = [queue, dead_max, keep_ms]
        for node, envelope, its_up in chunk:
            keys += [self._key(queue, f"deps:{node.id}"), self._key(queue, f"deps-ended:{node.id}"),
                     self._key(queue, f"ready:{node.level}")]
            args += [node.id, node.type, envelope, node.if_failed, len(node.deps),
                     _COMPACT.encode([list(dep) for dep in node.deps]), its_up]
        replies = self._script(FLOW_PUSH_LUA, "_flow_push_sha", keys, args, ids=[node.id for node, _, _ in chunk])
        if len(replies) != len(chunk):
            raise RedisRefused(f"flow_push.lua replied {len(replies)} results for {len(chunk)} tasks")
        return [reply.decode() if isinstance(reply, bytes) else str(reply) for reply in replies]

    # Sending: EVALSHA, EVAL after NOSCRIPT; unreachable and lost replies told apart.

    def _script(self, source: str, sha_attr: str, keys: List[str], args: List[Any], ids: Sequence[str] = ()) -> Any:
        sha = getattr(self, sha_attr)
        if sha is None:
            sha = hashlib.sha1(source.encode("utf-8")).hexdigest()
            setattr(self, sha_attr, sha)
        try:
            return self._command(["EVALSHA", sha, len(keys), *keys, *args], ids)
        except redis.exceptions.NoScriptError:
            # NOSCRIPT: nothing ran; the source itself, which Redis also caches for the next EVALSHA.
            return self._command(["EVAL", source, len(keys), *keys, *args], ids)

    def _command(self, command: List[Any], ids: Sequence[str] = ()) -> Any:
        if isinstance(self.redis, redis.RedisCluster):
            # The cluster client routes by the first key; a failure can come from either side of the send.
            return self._call(lambda: self.redis.execute_command(*command), sent_is_safe=False, ids=ids)
        pool = self.redis.connection_pool
        try:
            connection = pool.get_connection(command[0])
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as error:
            raise RedisUnreachable(f"cannot reach Redis: {error}") from error
        try:
            try:
                connection.send_command(*command)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as error:
                connection.disconnect()
                raise RedisUnreachable(f"cannot send to Redis: {error}") from error
            try:
                return connection.read_response()
            except redis.exceptions.NoScriptError:
                raise
            except redis.exceptions.ResponseError as error:
                raise RedisRefused(str(error)) from error
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as error:
                connection.disconnect()
                raise ReplyLost(
                    f"the connection to Redis broke after the call was sent: the tasks may have been pushed "
                    f"({error})",
                    ids,
                ) from error
        finally:
            pool.release(connection)

    def _call(self, thunk: Any, sent_is_safe: bool, ids: Sequence[str] = ()) -> Any:
        """A call through redis-py's own client: reads (safe to repeat) and the cluster's commands."""
        try:
            return thunk()
        except redis.exceptions.NoScriptError:
            raise
        except redis.exceptions.ResponseError as error:
            raise RedisRefused(str(error)) from error
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as error:
            if sent_is_safe:
                raise RedisUnreachable(f"cannot reach Redis: {error}") from error
            raise ReplyLost(f"the call to Redis failed and may have been applied: {error}", ids) from error

    # Looking tasks up, cancelling them, their results.

    def show(self, queue: str, task_id: str) -> List[Dict[str, Any]]:
        """Every place task ``task_id`` is in, as ``kmqd task show`` finds them: ``{"state": "delayed" | "retrying" |
        "ready" | "processing" | "dead", "level": ..., "envelope": ...}`` (ready: ``position``, 0 the next taken, and
        ``group`` or ``flow`` when it waits in a group's or a limited type's flow; delayed and retrying:
        ``due_in_ms``; processing: ``owner``, ``token``; dead: ``record``). Reads in pages of 1,000."""
        return self._call(lambda: self._locate(queue, task_id, everywhere=True), sent_is_safe=True)

    def _locate(self, queue: str, task_id: str, everywhere: bool) -> List[Dict[str, Any]]:
        r = self.redis
        levels, _ = self.shape(queue)
        needle = json.dumps(task_id, ensure_ascii=False)[1:-1]

        def matches(payload: bytes) -> bool:
            text = payload.decode("utf-8", "replace")
            if needle not in text:
                return False
            try:
                decoded = json.loads(text)
            except ValueError:
                return False
            return isinstance(decoded, dict) and decoded.get("id") == task_id

        seconds, micros = r.time()
        now = seconds * 1000 + micros // 1000
        found: List[Dict[str, Any]] = []
        delayed = r.hget(self._key(queue, "delayed-tasks"), task_id)
        if delayed is not None:
            for level in levels:
                score = r.zscore(self._key(queue, f"delayed:{level}"), task_id)
                if score is not None:
                    found.append({"state": "delayed", "level": level, "due_in_ms": int(score) - now,
                                  "envelope": delayed.decode()})
        for level in levels:
            for member, score in r.zscan_iter(self._key(queue, f"retry:{level}"), count=PAGE, score_cast_func=int):
                if matches(member):
                    found.append({"state": "retrying", "level": level, "due_in_ms": score - now,
                                  "envelope": member.decode()})
        for level in levels:
            for position, payload in self._scan_list(self._key(queue, f"ready:{level}")):
                if matches(payload):
                    found.append({"state": "ready", "level": level, "position": position,
                                  "envelope": payload.decode()})
            for member in r.zrange(self._key(queue, f"ring:{level}"), 0, -1):
                group, _, kind = member.decode().partition(":")
                place: Dict[str, Any] = {"flow": unquote(kind)} if kind else {"group": unquote(group)}
                for position, payload in self._scan_list(self._key(queue, f"flow:{level}:{member.decode()}")):
                    if matches(payload):
                        found.append({"state": "ready", "level": level, "position": position, **place,
                                      "envelope": payload.decode()})
        if not everywhere:
            return found
        for owner, deadline in r.zrange(self._key(queue, "owners"), 0, -1, withscores=True):
            owner = owner.decode()
            for level in levels:
                claims = self._key(queue, f"processing:{owner}:{level}")
                if r.type(claims) != b"zset":
                    continue
                for claim in r.zrange(claims, 0, -1):
                    claim_key = f"{claims}:{claim.decode()}"
                    for position, payload in self._scan_list(claim_key):
                        if matches(payload) and not r.getbit(f"{claim_key}:settled", position):
                            found.append({"state": "processing", "level": level, "owner": owner,
                                          "token": f"{claim.decode()}.{position}",
                                          "lease_left_ms": int(deadline) - now, "envelope": payload.decode()})
        for _, record in self._scan_list(self._key(queue, "dead")):
            try:
                if json.loads(record).get("id") == task_id:
                    found.append({"state": "dead", "record": record.decode()})
            except (ValueError, AttributeError):
                continue
        return found

    def _scan_list(self, key: str) -> Iterable[Tuple[int, bytes]]:
        start = 0
        while True:
            page = self.redis.lrange(key, start, start + PAGE - 1)
            for offset, payload in enumerate(page):
                yield start + offset, payload
            if len(page) < PAGE:
                return
            start += PAGE

    def cancel(self, queue: str, task_id: str) -> int:
        """Removes every waiting (delayed, retrying or ready) copy of task ``task_id`` with remove.lua, releasing its
        unique id and counting ``cancelled``; returns how many were removed (0: it was not waiting: unknown,
        running, done or dead). A task taken meanwhile is left alone."""
        removed = 0
        for place in self._call(lambda: self._locate(queue, task_id, everywhere=False), sent_is_safe=True):
            level, envelope = place["level"], place["envelope"]
            if place["state"] == "delayed":
                key, kind, task, expected = self._key(queue, f"delayed:{level}"), "delayed", task_id, envelope
            elif place["state"] == "retrying":
                key, kind, task, expected = self._key(queue, f"retry:{level}"), "retry", envelope, ""
            else:
                key = self._key(queue, f"ready:{level}")
                if "flow" in place:
                    key = self._key(queue, f"flow:{level}::{_encode(place['flow'])}")
                elif "group" in place:
                    key = self._key(queue, f"flow:{level}:{_encode(place['group'])}:")
                kind, task, expected = "list", envelope, ""
            try:
                unique = json.loads(envelope).get("unique") is True
            except (ValueError, AttributeError):
                unique = False
            keys = [key, self._key(queue, "delayed-tasks"), self._key(queue, "unique"), self._key(queue, "stats")]
            args = [kind, task, expected, task_id if unique else ""]
            removed += int(self._script(REMOVE_LUA, "_remove_sha", keys, args))
        return removed

    def result(self, queue: str, task_id: str, wait: Seconds = 0) -> Optional[Dict[str, Any]]:
        """Task ``task_id``'s kept result (a queue with ``keep_results``; docs/PROTOCOL.md, "Results"):
        ``{"state": "done", "result": ...}`` or ``{"state": "dead", "reason": ...}``, with ``ended_at``. Polls for up
        to ``wait`` (seconds or a timedelta), from 10 ms doubling to 500 ms; None when there is none by then."""
        deadline = time.monotonic() + _ms(wait) / 1000
        pause = 0.01
        while True:
            kept = self._call(lambda: self._kept_result(queue, task_id), sent_is_safe=True)
            if kept is not None:
                return json.loads(kept)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)

    def _kept_result(self, queue: str, task_id: str) -> Optional[bytes]:
        """The kept result's JSON text, or None: the buckets the queue's index lists, newest first, each asked for
        the id until one holds it (docs/PROTOCOL.md, "Results")."""
        starts = self.redis.execute_command("ZRANGE", self._key(queue, "results"), 0, -1, "REV")
        for start in starts:
            start = start.decode() if isinstance(start, bytes) else str(start)
            kept = self.redis.hget(self._key(queue, f"results:{start}"), task_id)
            if kept is not None:
                return kept
        return None


def _check_acyclic(nodes: List[_FlowNode], defined: Dict[Tuple[str, str], int]) -> None:
    """Refuses a cycle through references: a depth-first walk from every node (white, grey, black), in the order
    `kmqd flow push` walks, so that both name the same node."""
    state = [0] * len(nodes)
    for start in range(len(nodes)):
        stack = [(start, 0)]
        while stack:
            at, following = stack.pop()
            if following == 0:
                if state[at] == 2:
                    continue
                state[at] = 1
            if following < len(nodes[at].deps):
                stack.append((at, following + 1))
                dep = defined[nodes[at].deps[following]]
                if state[dep] == 1:
                    raise InvalidFlow(nodes[dep].path, f"task {nodes[dep].queue}/{nodes[dep].id} waits for itself "
                                                       f"through {nodes[at].queue}/{nodes[at].id} (a cycle); a flow "
                                                       f"must end")
                if state[dep] == 0:
                    stack.append((dep, 0))
            else:
                state[at] = 2


def _encode(name: str) -> str:
    """A group's or type's name as in a flow's key (docs/PROTOCOL.md, "Key layout", `flow`)."""
    out = []
    for byte in name.encode("utf-8"):
        if byte in b"%:{}" or byte <= 32 or byte == 127:
            out.append(f"%{byte:02X}")
        else:
            out.append(chr(byte))
    return "".join(out).encode("latin-1").decode("utf-8")
