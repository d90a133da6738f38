"""kmq's push rate against redis-py's own pipeline of RPUSH, on a private redis-server (docs/CLIENTS.md, "Python").

    python3 clients/python/bench.py [--tasks 100000] [--singles 10000] [--runs 3]

Each figure is the median of --runs runs, each on an emptied server: push_batch of --tasks small tasks, the same
tasks as one redis-py pipeline of RPUSH (1,000 a command, as push.lua takes them), and --singles pushes one at a
time against as many single RPUSH calls. Prints tasks per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))

import kmq  # noqa: E402
from conftest import RedisServer  # noqa: E402


def rate(runs: int, count: int, setup: Callable[[], None], work: Callable[[], None]) -> float:
    rates: List[float] = []
    for _ in range(runs):
        setup()
        start = time.perf_counter()
        work()
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--singles", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    options = parser.parse_args()
    server = RedisServer()
    try:
        r = server.client()
        client = kmq.Client(server.url)
        flush = r.flushall

        def envelope(n: int) -> str:
            return json.dumps({"id": str(uuid.uuid4()), "type": "bench", "data": {"n": n}, "attempt": 0},
                              separators=(",", ":"))

        def pipeline(count: int) -> None:
            pipe = r.pipeline(transaction=False)
            for start in range(0, count, 1000):
                pipe.rpush("kmq:{bench}:ready:normal", *[envelope(n) for n in range(start, min(start + 1000, count))])
            pipe.execute()

        def singles_rpush(count: int) -> None:
            for n in range(count):
                r.rpush("kmq:{bench}:ready:normal", envelope(n))

        def singles_kmq(count: int) -> None:
            for n in range(count):
                client.push("bench", "bench", {"n": n})

        batch = rate(options.runs, options.tasks, flush,
                     lambda: client.push_batch("bench", [("bench", {"n": n}) for n in range(options.tasks)]))
        piped = rate(options.runs, options.tasks, flush, lambda: pipeline(options.tasks))
        one = rate(options.runs, options.singles, flush, lambda: singles_kmq(options.singles))
        one_rpush = rate(options.runs, options.singles, flush, lambda: singles_rpush(options.singles))
        print(f"push_batch of {options.tasks}: {batch:,.0f}/s; redis-py pipeline of RPUSH: {piped:,.0f}/s "
              f"({batch / piped:.2f}x)")
        print(f"single push, {options.singles}: {one:,.0f}/s; single RPUSH: {one_rpush:,.0f}/s "
              f"({one / one_rpush:.2f}x)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
