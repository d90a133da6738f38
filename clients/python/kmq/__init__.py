"""kmq: the Python producer of kmqd, a task-queue daemon on Redis.

>>> import kmq
>>> client = kmq.Client("redis://127.0.0.1:6379/0")
>>> task_id = client.push("mail", "mail.send", {"to": "ada@example.com"})

See docs/CLIENTS.md in the kmqd repository.
"""

from .client import PUSH_CHUNK, Client, FlowTask, Pushed, Task
from .errors import (
    DuplicateTask,
    InvalidArgument,
    InvalidFlow,
    KmqError,
    RedisRefused,
    RedisUnreachable,
    ReplyLost,
    UnknownPriority,
)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Task",
    "Pushed",
    "FlowTask",
    "PUSH_CHUNK",
    "KmqError",
    "InvalidArgument",
    "UnknownPriority",
    "InvalidFlow",
    "DuplicateTask",
    "RedisUnreachable",
    "ReplyLost",
    "RedisRefused",
]
