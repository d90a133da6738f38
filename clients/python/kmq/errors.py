"""The errors of kmq, each named for what happened, all under :class:`KmqError`."""

from __future__ import annotations

from typing import Optional, Sequence


class KmqError(Exception):
    """Anything kmq raises."""


class InvalidArgument(KmqError, ValueError):
    """The call was refused before anything was sent to Redis: a task without a type, a group that is empty or over
    64 bytes, a unique task without an id, a delay that is not positive. Nothing was written."""


class UnknownPriority(InvalidArgument):
    """The queue has no such priority level (its levels come from its meta hash, or from the constructor). Nothing
    was written: a push to a level no daemon serves would wait forever."""

    def __init__(self, queue: str, priority: str, levels: Sequence[str]):
        super().__init__(f"queue {queue!r} has no priority {priority!r}; its levels are {list(levels)!r}")
        self.queue = queue
        self.priority = priority
        self.levels = list(levels)


class InvalidFlow(InvalidArgument):
    """:meth:`kmq.Client.push_flow` refused the flow before anything was written: ``path`` names the node (``the
    root``, ``after[1].after[0]``), ``reason`` what is wrong with it (a cycle, an id defined twice, a reference to a
    task the flow does not define, a bad ``if_failed``, a priority its queue does not have, ...)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class DuplicateTask(KmqError):
    """push.lua refused the task: a unique task with this id is live (delayed, ready or running), or a delayed task
    with this id is already waiting. Nothing was written for it."""

    def __init__(self, queue: str, task_id: str):
        super().__init__(f"queue {queue!r} already holds a live task with the unique id {task_id!r}")
        self.queue = queue
        self.id = task_id


class RedisUnreachable(KmqError):
    """Redis could not be reached (connecting or sending failed): the command was not sent, nothing was written,
    and the same call may be made again."""


class ReplyLost(KmqError):
    """The command was sent, then the connection broke before its reply came: the tasks **may have been pushed**.
    Sending the same call again may queue them twice, unless they are unique (then a second push is refused as a
    duplicate) or you look them up first (:meth:`kmq.Client.show`)."""

    def __init__(self, message: str, ids: Optional[Sequence[str]] = None):
        super().__init__(message)
        self.ids = list(ids or [])


class RedisRefused(KmqError):
    """Redis answered with an error (a key of the wrong type, a counter that is not an integer, an ACL refusal):
    push.lua writes nothing when it refuses a call."""
