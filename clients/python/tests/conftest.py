"""The tests' own redis-servers: each on a free loopback port in a temp dir (never 6379), waited for with a deadline,
killed at the end, its log in the failure when it does not start."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, List

import pytest
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPOSITORY = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """One redis-server of a test: ``url``, ``unix_url``, ``client()``, ``stop()``."""

    def __init__(self, extra: List[str] = ()):  # type: ignore[assignment]
        self.dir = Path(tempfile.mkdtemp(prefix="kmq-py-redis-"))
        self.port = free_port()
        self.socket = self.dir / "redis.sock"
        self.log = self.dir / "redis.log"
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--unixsocket", str(self.socket),
             "--save", "", "--appendonly", "no", "--dir", str(self.dir), "--logfile", str(self.log), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.unix_url = f"unix://{self.socket}"
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, password=self._password(extra)).ping():
                    return
            except redis.exceptions.ConnectionError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                log = self.log.read_text() if self.log.exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING within 10 s:\n{log}")
            time.sleep(0.02)

    @staticmethod
    def _password(extra: List[str]) -> str | None:
        extra = list(extra)
        return extra[extra.index("--requirepass") + 1] if "--requirepass" in extra else None

    def client(self) -> "redis.Redis[bytes]":
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    running = RedisServer()
    yield running
    running.stop()


@pytest.fixture
def fresh(server: RedisServer) -> RedisServer:
    server.client().flushall()
    return server


def eventually(within: float, what: str, condition):  # type: ignore[no-untyped-def]
    """Polls ``condition`` until it returns a truthy value, for at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        time.sleep(0.02)


__all__ = ["RedisServer", "free_port", "eventually", "REPOSITORY", "os"]
