"""Handlers for kmqd in Python: long-lived handler processes of the exec plugin (mode = "persistent").

One file, the standard library only: copy it next to your handlers. The protocol it speaks is docs/HANDLERS.md
(version 1): a hello line, then one JSON task per line on standard input, one JSON answer per task on standard
output.

    from kmq_handler import handler, run, Retry, Fail

    @handler("report.build")
    def build(task):                  # sync: runs on a thread of its own
        return f"built {task.data['rows']} rows"   # done; the text is logged with the task

    @handler("report.mail")
    async def mail(task):             # async: runs on the event loop, many at once with `concurrency`
        if "@" not in task.data["to"]:
            raise Fail("not an address")           # dead-lettered, no retries
        raise Retry("mailbox busy", after=5)       # retried in 5 s (without `after`: the queue's backoff)

    if __name__ == "__main__":
        run()

A handler returns (done; a returned string is the outcome's message), raises `Retry` (this attempt failed) or
`Fail` (the task can never succeed). Any other exception is a failed attempt: retried with `Type: message` as the
reason, its traceback on standard error. A task type with no handler fails.

Standard output carries the protocol, so `run()` points `sys.stdout` at standard error: a `print` in a handler
lands in kmqd's log, attributed to the task, instead of breaking the protocol.
"""

import asyncio
import inspect
import json
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

__all__ = ["Fail", "Retry", "Task", "handler", "run"]

PROTOCOL = 1

_handlers = {}


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


class Task:
    """One run of a task: what kmqd's task line says."""

    __slots__ = ("id", "type", "queue", "attempt", "data", "deadline", "created_at")

    def __init__(self, line):
        self.id = line["id"]
        self.type = line["type"]
        self.queue = line.get("queue", "")
        self.attempt = line.get("attempt", 0)
        self.data = line.get("data")
        deadline, created = line.get("deadline_ms"), line.get("created_at_ms")
        # Seconds since the epoch, as time.time() counts them; None when there is none.
        self.deadline = deadline / 1000 if deadline is not None else None
        self.created_at = created / 1000 if created is not None else None

    def remaining(self):
        """Seconds left before the deadline (the execution timeout), or None without one."""
        return None if self.deadline is None else self.deadline - time.time()

    def __repr__(self):
        return f"Task(id={self.id!r}, type={self.type!r}, attempt={self.attempt})"


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
        return answer
    if isinstance(error, Fail):
        return {"id": task_id, "outcome": "fail", "message": error.message or "failed"}
    if isinstance(error, Retry):
        answer = {"id": task_id, "outcome": "retry", "message": error.message}
        if error.after is not None:
            answer["retry_after_ms"] = max(0, int(error.after * 1000))
        return answer
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
    lines = asyncio.Queue()

    def read():
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    def send(answer):
        # Only the event loop's thread writes: one whole line at a time, never interleaved.
        out.write(json.dumps(answer) + "\n")
        out.flush()

    async def settle(line):
        try:
            task = Task(json.loads(line))
        except (ValueError, KeyError, TypeError) as error:
            print(f"kmq_handler: not a task line ({error}): {line!r}", file=sys.stderr, flush=True)
            return
        function = table.get(task.type)
        if function is None:
            send({"id": task.id, "outcome": "fail", "message": f"no handler for task type {task.type!r}"})
            return
        try:
            if inspect.iscoroutinefunction(function):
                result = await function(task)
            else:
                result = await loop.run_in_executor(threads, function, task)
        except Exception as error:  # noqa: BLE001 - every error of a handler is its task's outcome
            if not isinstance(error, (Retry, Fail)):
                traceback.print_exc(file=sys.stderr)
                sys.stderr.flush()
            send(_outcome(task.id, error=error))
        else:
            send(_outcome(task.id, result=result))

    send({"hello": PROTOCOL, "sdk": "python/1"})
    threading.Thread(target=read, name="kmq-handler-stdin", daemon=True).start()
    running = set()
    while True:
        line = await lines.get()
        if line is None:
            break
        if not line.strip():
            continue
        job = asyncio.ensure_future(settle(line))
        running.add(job)
        job.add_done_callback(running.discard)
    # Standard input ended: kmqd wants this process to exit; it holds no task then, but finish any left.
    if running:
        await asyncio.gather(*running)
    threads.shutdown(wait=True)
