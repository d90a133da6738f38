"""Handlers for kmqd in Python: long-lived handler processes of the exec plugin (mode = "persistent").

One file, the standard library only: copy it next to your handlers. The protocol it speaks is docs/HANDLERS.md
(version 1): a hello line, then one JSON task per line on standard input, one JSON answer per task on standard
output.

    from kmq_handler import handler, run, Retry, Fail, Throttle

    @handler("report.build")
    def build(task):                  # sync: runs on a thread of its own
        return f"built {task.data['rows']} rows"   # done; the text is logged with the task

    @handler("report.mail")
    async def mail(task):             # async: runs on the event loop, many at once with `concurrency`
        if "@" not in task.data["to"]:
            raise Fail("not an address")           # dead-lettered, no retries
        if await smtp_says_too_many():
            raise Throttle(30, "421 too many connections")  # the whole queue waits 30 s; this task, uncharged
        raise Retry("mailbox busy", after=5)       # retried in 5 s (without `after`: the queue's backoff)

    if __name__ == "__main__":
        run()

A handler that returns `Result(value)` is done with that result: any JSON value, which kmqd keeps with the task
when its queue has `keep_results` (`kmqd task result QUEUE ID` prints it; docs/HANDLERS.md, "Results").

A handler returns (done; a returned string is the outcome's message), raises `Retry` (this attempt failed),
`Fail` (the task can never succeed) or `Throttle` (the upstream every task of the queue uses said "too many
requests"). Any other exception is a failed attempt: retried with `Type: message` as the reason, its traceback on
standard error. A task type with no handler fails.

A task's W3C trace context is `task.traceparent` (and `task.tracestate`): the span of kmqd's run when kmqd traces,
the producer's otherwise. With opentelemetry-api installed, the handler runs in that context: a span it starts is
a child of the run (docs/HANDLERS.md, "Tracing").

Standard output carries the protocol, so `run()` points `sys.stdout` at standard error: a `print` in a handler
lands in kmqd's log, attributed to the task, instead of breaking the protocol.
"""

import asyncio
import codecs
import contextvars
import inspect
import itertools
import json
import math
import numbers
import os
import stat
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

__all__ = ["Fail", "Result", "Retry", "Task", "Throttle", "handler", "run"]

PROTOCOL = 1

_handlers = {}

# json.loads and json.dumps without their per-call handling of keyword arguments; _quote is the C string encoder
# json.dumps uses (ASCII, as json.dumps writes by default).
_decode = json.JSONDecoder().decode
_encode = json.JSONEncoder().encode
_quote = json.encoder.encode_basestring_ascii


class Retry(Exception):
    """This attempt failed: the queue's on_handler_error decides (by default a retry, after `after` seconds or the
    queue's backoff, until retry_times is used up)."""

    def __init__(self, message="", after=None):
        super().__init__(message)
        self.message = str(message)
        self.after = after


class Fail(Exception):
    """The task can never succeed: kmqd dead-letters it at once."""

    def __init__(self, message=""):
        super().__init__(message)
        self.message = str(message)


class Throttle(Exception):
    """Back-pressure: the upstream every task of the queue shares said "too many requests" (an HTTP 429, a quota).
    The task goes back to the head of its queue, its attempt not charged (never dead-lettered for it), and no
    daemon takes a task of the queue for `after` seconds (kmqd makes that at least 1 ms and at most an hour). A
    failure of this task alone is a `Retry`.

    `after` is required: the wait the upstream asked for (its Retry-After), in seconds as `Retry`'s `after`. A
    value that is not a number of seconds, 0 or more, raises ValueError here: the handler's bug is then a failed
    attempt that says so, not a throttle of a guessed length."""

    def __init__(self, after, message=""):
        if isinstance(after, bool) or not isinstance(after, numbers.Real) or not 0 <= after < math.inf:
            raise ValueError(f"Throttle(after): seconds the queue waits, 0 or more, not {after!r}")
        super().__init__(message)
        self.message = str(message)
        self.after = after


class Result:
    """What a handler returns to be done with a result: `value` is any JSON value (dicts, lists, strings, numbers,
    True, False, None), kept with the task when its queue has `keep_results`; `message` is logged as a returned
    string is. A value json cannot encode makes the attempt fail (a `Retry` that says why), so a handler's bug is
    not a task done without its result."""

    __slots__ = ("value", "message")

    def __init__(self, value, message=""):
        self.value = value
        self.message = str(message)


# The longest `after_ms` written: the protocol reads a whole number that fits 64 bits, and kmqd holds a queue
# back at most an hour whatever it is told; the Node SDK's bound too (its largest exact integer).
_MAX_AFTER_MS = 2**53 - 1

try:
    # Optional: with opentelemetry-api, a handler runs in its task's trace context. Imported once, since a failed
    # import is searched for again at every try.
    from opentelemetry import context as _otel_context  # type: ignore[import-not-found]
    from opentelemetry import propagate as _otel_propagate  # type: ignore[import-not-found]
except ImportError:
    _otel_context = _otel_propagate = None


class Task:
    """One run of a task: what kmqd's task line says."""

    __slots__ = ("id", "type", "queue", "attempt", "data", "deadline", "created_at", "after", "traceparent", "tracestate",
                 "_report")

    def __init__(self, line, report=None):
        self.id = line["id"]
        self.type = line["type"]
        self.queue = line.get("queue", "")
        self.attempt = line.get("attempt", 0)
        self.data = line.get("data")
        # A task of a flow that waited for others: their outcomes, a list of {"queue", "id", "state", "result" or
        # "reason"}; None for a task that waited for none.
        self.after = line.get("after")
        # The W3C trace context: the run's span when kmqd traces, the producer's otherwise; None without one.
        self.traceparent = line.get("traceparent")
        self.tracestate = line.get("tracestate")
        deadline, created = line.get("deadline_ms"), line.get("created_at_ms")
        # Seconds since the epoch, as time.time() counts them; None when there is none.
        self.deadline = deadline / 1000 if deadline is not None else None
        self.created_at = created / 1000 if created is not None else None
        # Sends a progress line (thread-safe: a sync handler runs on a thread of its own); None outside kmqd.
        self._report = report

    def progress(self, fraction, message=""):
        """Reports how far the task is (docs/HANDLERS.md, "Progress"): `fraction` from 0 to 1 (NaN is ignored,
        anything else clamped, since JSON has no infinity) and a short message; `kmqd task show` and the dashboard
        show the latest. Call it as often as you like: kmqd writes each task's latest report a few times a second."""
        fraction = float(fraction)
        if fraction != fraction or self._report is None:
            return
        self._report({"id": self.id, "progress": min(1.0, max(0.0, fraction)), "message": str(message)})

    def remaining(self):
        """Seconds left before the deadline (the execution timeout), or None without one."""
        return None if self.deadline is None else self.deadline - time.time()

    def __repr__(self):
        return f"Task(id={self.id!r}, type={self.type!r}, attempt={self.attempt})"


def _attach_trace(task):
    """Makes the task's trace context the current OpenTelemetry context of the asyncio task that runs it (each task
    runs in an asyncio task of its own, whose context ends with it: nothing to detach). Returns the attach's token,
    or None without opentelemetry-api or a context."""
    if _otel_propagate is None or not task.traceparent:
        return None
    carrier = {"traceparent": task.traceparent}
    if task.tracestate:
        carrier["tracestate"] = task.tracestate
    return _otel_context.attach(_otel_propagate.extract(carrier))


def handler(task_type):
    """Registers the decorated function (sync or `async def`) as the handler of `task_type`."""

    def register(function):
        if task_type in _handlers:
            raise ValueError(f"a handler for {task_type!r} is registered already: {_handlers[task_type]!r}")
        _handlers[task_type] = function
        return function

    return register


def _outcome(task_id, result=None, error=None):
    if error is None:
        answer = {"id": task_id, "outcome": "done"}
        if isinstance(result, str) and result:
            answer["message"] = result
        elif isinstance(result, Result):
            try:
                _encode(result.value)
            except (TypeError, ValueError) as refused:
                return {"id": task_id, "outcome": "retry", "message": f"the handler's result is not JSON: {refused}"}
            answer["result"] = result.value
            if result.message:
                answer["message"] = result.message
        return answer
    if isinstance(error, Fail):
        return {"id": task_id, "outcome": "fail", "message": error.message or "failed"}
    if isinstance(error, Retry):
        answer = {"id": task_id, "outcome": "retry", "message": error.message}
        if error.after is not None:
            answer["retry_after_ms"] = max(0, int(error.after * 1000))
        return answer
    if isinstance(error, Throttle):
        # Rounded up, so that the queue waits no less than the upstream asked; to the µs first, since in floating
        # point 0.07 s is 70.00000000000001 ms.
        after_ms = min(math.ceil(round(error.after * 1000, 3)), _MAX_AFTER_MS)
        return {"id": task_id, "outcome": "throttle", "after_ms": after_ms, "message": error.message}
    message = f"{type(error).__name__}: {error}"
    return {"id": task_id, "outcome": "retry", "message": message}


def run(handlers=None):
    """Speaks the protocol on standard input and output until standard input ends, then returns.

    `handlers`: a dict of task type to function, instead of (or besides) the `@handler` ones."""
    table = dict(_handlers)
    table.update(handlers or {})
    out = sys.stdout
    # Prints of the handlers go to standard error (kmqd's log), never into the protocol.
    sys.stdout = sys.stderr
    concurrency = max(1, int(os.environ.get("KMQ_CONCURRENCY", "1") or 1))
    asyncio.run(_serve(table, out, concurrency))


async def _serve(table, out, concurrency):
    loop = asyncio.get_running_loop()
    threads = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kmq-handler")
    # Whether each handler is `async def`, asked once rather than per task.
    table = {task_type: (function, inspect.iscoroutinefunction(function)) for task_type, function in table.items()}
    ended = loop.create_future()
    # The tasks running, by number: strong references (the event loop keeps only weak ones), each dropped by its
    # own task at its end (cheaper than a done callback, which costs a turn of the loop per task).
    running = {}
    numbers = itertools.count()
    # Answers not yet written: those settled in one turn of the event loop go out in one write (the protocol's
    # lines unchanged, fewer system calls per task).
    answers = []

    def flush():
        text = "".join(answers)
        answers.clear()
        out.write(text)
        out.flush()

    def send(answer):
        # Only the event loop's thread writes, whole lines: never interleaved.
        if not answers:
            loop.call_soon(flush)
        answers.append(_encode(answer) + "\n")

    def report(answer):
        # From any thread: only the event loop's thread writes.
        loop.call_soon_threadsafe(send, answer)

    def done(task_id):
        # The common answer, without building a dict and encoding it: the same line json.dumps writes.
        if not answers:
            loop.call_soon(flush)
        answers.append(f'{{"id": {_quote(task_id)}, "outcome": "done"}}\n')

    async def settle(line, number):
        try:
            await run_one(line)
        finally:
            del running[number]

    async def run_one(line):
        try:
            task = Task(_decode(line), report)
        except (ValueError, KeyError, TypeError) as error:
            print(f"kmq_handler: not a task line ({error}): {line!r}", file=sys.stderr, flush=True)
            return
        function, is_async = table.get(task.type, (None, False))
        if function is None:
            send({"id": task.id, "outcome": "fail", "message": f"no handler for task type {task.type!r}"})
            return
        traced = _attach_trace(task)
        try:
            if is_async:
                result = await function(task)
            elif traced is None:
                result = await loop.run_in_executor(threads, function, task)
            else:
                # An executor's thread does not inherit the asyncio task's context: the call takes a copy.
                result = await loop.run_in_executor(threads, contextvars.copy_context().run, function, task)
        except Exception as error:  # noqa: BLE001 - every error of a handler is its task's outcome
            if not isinstance(error, (Retry, Fail, Throttle)):
                traceback.print_exc(file=sys.stderr)
                sys.stderr.flush()
            send(_outcome(task.id, error=error))
        else:
            if (result is None or result.__class__ is str and not result) and isinstance(task.id, str):
                done(task.id)
            else:
                send(_outcome(task.id, result=result))

    def take(line):
        if not line.strip():
            return
        number = next(numbers)
        running[number] = loop.create_task(settle(line, number))

    def end():
        if not ended.done():
            ended.set_result(None)

    out.write(json.dumps({"hello": PROTOCOL, "sdk": "python/1"}) + "\n")
    out.flush()
    if _is_pipe(sys.stdin):
        # Read by the event loop itself, every line a read brought at once: no thread, and no hand-off between
        # threads per task.
        await loop.connect_read_pipe(lambda: _Lines(take, end), sys.stdin)
    else:
        # Not a pipe (a file or a terminal, trying a handler by hand): a thread reads it, as it is.
        def read():
            for line in sys.stdin:
                loop.call_soon_threadsafe(take, line)
            loop.call_soon_threadsafe(end)

        threading.Thread(target=read, name="kmq-handler-stdin", daemon=True).start()
    await ended
    # Standard input ended: kmqd wants this process to exit; it holds no task then, but finish any left.
    if running:
        await asyncio.gather(*running.values())
    if answers:
        flush()
    threads.shutdown(wait=True)


def _is_pipe(stream):
    """Whether `stream` is a pipe or a socket (as kmqd gives), which the event loop can read; not a terminal,
    which it would leave non-blocking."""
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


class _Lines(asyncio.Protocol):
    """Standard input as lines: `take(line)` for each (text, without its newline), `end()` at its end."""

    def __init__(self, take, end):
        self.take = take
        self.end = end
        self.partial = ""
        # UTF-8 as it comes: a character may be cut between two reads.
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def data_received(self, data):
        *lines, self.partial = (self.partial + self.decoder.decode(data)).split("\n")
        for line in lines:
            self.take(line)

    def eof_received(self):
        return False

    def connection_lost(self, exc):
        rest = self.partial + self.decoder.decode(b"", final=True)
        self.partial = ""
        if rest:
            self.take(rest)
        self.end()
