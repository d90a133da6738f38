"""End to end: tasks pushed with kmq.Client are run by a real kmqd daemon (the exec plugin running a handler process
of the Python handler SDK), and the client reads their kept results and the levels the daemon described.

The daemon is the workspace's binary: KMQD_BIN (scripts/test sets it), else target/debug/kmqd; the exec plugin is
the libkmq_exec.so beside it (`cargo build --workspace` builds both)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

import kmq
from conftest import REPOSITORY, RedisServer, eventually

HANDLER = """
import sys
sys.path.insert(0, {sdk!r})
from kmq_handler import Fail, Result, handler, run

@handler("report.build")
def build(task):
    if task.data["rows"] < 0:
        raise Fail("rows must be 0 or more")
    return Result({{"rows": task.data["rows"], "file": task.id + ".csv"}})

run()
"""


def kmqd_binary() -> Path:
    binary = Path(os.environ.get("KMQD_BIN") or REPOSITORY / "target" / "debug" / "kmqd")
    if not binary.exists():
        pytest.fail(f"no kmqd binary at {binary}: build the workspace (cargo build --workspace) or set KMQD_BIN")
    return binary


@pytest.fixture
def daemon(fresh: RedisServer) -> Iterator[RedisServer]:
    binary = kmqd_binary()
    work = Path(tempfile.mkdtemp(prefix="kmq-py-daemon-"))
    plugins = work / "plugins"
    plugins.mkdir(mode=0o755)
    shutil.copy(binary.parent / "libkmq_exec.so", plugins / "libkmq_exec.so")
    os.chmod(plugins / "libkmq_exec.so", 0o755)
    handler = work / "handler.py"
    handler.write_text(HANDLER.format(sdk=str(REPOSITORY / "sdk" / "python")))
    config = work / "kmqd.toml"
    config.write_text(
        f'[redis]\nurl = "{fresh.url}"\n\n[daemon]\nplugins_dir = "{plugins}"\nshutdown_grace = "5s"\n\n'
        '[[queues]]\nname = "reports"\nmode = "safe"\npriorities = ["high", "normal"]\n'
        'default_priority = "normal"\nkeep_results = "1h"\nretry_times = 0\n\n'
        '[plugins.handlers]\nfile = "libkmq_exec.so"\n'
        f'config = {{ command = "/usr/bin/python3", args = ["{handler}"], types = ["report.build"], '
        'mode = "persistent" }\n'
    )
    log = open(work / "kmqd.log", "wb")
    process = subprocess.Popen([str(binary), "--config", str(config)], stdout=log, stderr=log)
    try:
        yield fresh
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def test_a_pushed_task_runs_in_the_daemon_and_its_result_is_read_back(daemon: RedisServer) -> None:
    # The daemon describes the queue's levels at start; the client reads them (once) to accept "high".
    eventually(30, "the daemon's description of the queue",
               lambda: daemon.client().hget("kmq:{reports}:meta", "levels") == b"high,normal")
    client = kmq.Client(daemon.url)
    assert client.shape("reports") == (["high", "normal"], "normal")
    built = client.push("reports", "report.build", {"rows": 3}, priority="high")
    refused = client.push("reports", "report.build", {"rows": -1}, id="negative")
    kept = client.result("reports", built, wait=60)
    assert kept is not None and kept["state"] == "done", kept
    assert kept["result"] == {"rows": 3, "file": built + ".csv"}
    dead = client.result("reports", refused, wait=60)
    assert dead is not None and dead["state"] == "dead" and "rows must be 0 or more" in dead["reason"], dead
    with pytest.raises(kmq.UnknownPriority):
        client.push("reports", "report.build", {"rows": 1}, priority="low")
