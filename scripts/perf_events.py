"""The trace scripts/cycle-stages and scripts/wake-stages record, and how they read it.

Both trace the whole host with `perf record -a` (the scheduler's wake-ups and switches, and the writes below) while
a `kmqd-bench` scenario runs, then follow a task from thread to thread by those events. Not a script of its own:
each imports it from its directory.
"""

import re
import subprocess

# raw_syscalls:sys_enter's filter: write(2), writev(2) and sendto(2), the syscalls by which a thread hands a task on
# (a record line, a command to Redis, Redis's reply).
WRITES = "id == 1 || id == 20 || id == 44"
LINE = re.compile(r"^\s*(?P<comm>.+?)\s+(?P<tid>\d+)\s+(?P<time>\d+\.\d+):\s+(?P<event>[\w:]+):\s*(?P<trace>.*)$")


def events(data):
    """(time in µs, comm, tid, event, its fields) of every event of the trace `data`, in time order."""
    script = subprocess.run(
        ["perf", "script", "-i", data, "--ns", "-F", "comm,tid,time,event,trace"],
        check=True,
        capture_output=True,
        text=True,
    )
    for line in script.stdout.splitlines():
        match = LINE.match(line)
        if match:
            yield (
                float(match["time"]) * 1e6,
                match["comm"],
                int(match["tid"]),
                match["event"],
                match["trace"],
            )


def field(trace, name):
    """The value of an event's field `name=VALUE`, or None."""
    match = re.search(rf"\b{name}=(\S+)", trace)
    return match and match[1]


def p90(values):
    """The 90th percentile of `values`, sorted."""
    return values[min(len(values) - 1, int(len(values) * 0.9))]
