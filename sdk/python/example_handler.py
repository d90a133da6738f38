#!/usr/bin/env python3
"""An example handler process for kmqd (docs/HANDLERS.md), with the Python SDK next to it:

    [plugins.reports]
    file = "libkmq_exec.so"
    config = { command = "/usr/bin/python3", args = ["/srv/reports/example_handler.py"], types = ["report.build", "report.mail"], mode = "persistent", concurrency = 8 }

`report.build` is sync (it runs on a thread of its own), `report.mail` async (many at once on the event loop).
"""

import asyncio

from kmq_handler import Fail, Retry, handler, run


@handler("report.build")
def build(task):
    rows = task.data["rows"]  # a task without "rows": KeyError, a failed attempt (retried)
    if rows < 0:
        raise Fail(f"rows must be 0 or more, not {rows}")
    print(f"building {rows} rows")  # to standard error: kmqd's log, with the task's id
    return f"built {rows} rows"


@handler("report.mail")
async def mail(task):
    to = task.data["to"]
    if "@" not in to:
        raise Fail(f"{to!r} is not an address")
    await asyncio.sleep(0.01)  # the SMTP conversation
    if to.startswith("busy@"):
        raise Retry("mailbox busy", after=0.05)
    return f"sent to {to}"


if __name__ == "__main__":
    run()
