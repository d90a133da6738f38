"""The producers' conformance suite (clients/conformance/README.md) through kmq.Client: each case's calls against
a real redis-server, then exactly the keys it names."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest

import kmq
from conftest import REPOSITORY, RedisServer

CASES = sorted((REPOSITORY / "clients" / "conformance" / "cases").glob("*.json"))
NEAR_MS = 5000
UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


def test_the_suite_has_its_cases() -> None:
    assert len(CASES) >= 8


def task_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """The case's snake_case options as kmq's keyword arguments."""
    mapped: Dict[str, Any] = {}
    for name, value in options.items():
        if name == "delay_ms":
            mapped["delay"] = dt.timedelta(milliseconds=value)
        elif name == "at_ms":
            mapped["at"] = dt.datetime.fromtimestamp(value / 1000, dt.timezone.utc)
        elif name == "debounce_ms":
            mapped["debounce"] = dt.timedelta(milliseconds=value)
        elif name == "unique_for_ms":
            mapped["unique_for"] = dt.timedelta(milliseconds=value)
        elif name == "expires_at_ms":
            mapped["expires_at"] = dt.datetime.fromtimestamp(value / 1000, dt.timezone.utc)
        elif name in ("id", "priority", "unique", "group", "traceparent", "tracestate"):
            mapped[name] = value
        else:
            raise AssertionError(f"kmq has no option {name!r}: give the case a \"skip\" for python")
    return mapped


def error_kind(error: kmq.KmqError) -> Dict[str, str]:
    if isinstance(error, kmq.InvalidFlow):
        return {"error": "invalid_flow", "at": error.path}
    if isinstance(error, kmq.UnknownPriority):
        return {"error": "unknown_priority"}
    if isinstance(error, kmq.InvalidArgument):
        return {"error": "invalid_argument"}
    if isinstance(error, kmq.DuplicateTask):
        return {"error": "duplicate"}
    raise error


def run_call(client: kmq.Client, call: Dict[str, Any]) -> Any:
    queue = call.get("queue")
    try:
        if call["call"] == "push_flow":
            return {"tasks": [{"queue": task.queue, "id": task.id} for task in client.push_flow(call["flow"])]}
        if call["call"] == "push":
            return {"id": client.push(queue, call["type"], call["data"], **task_options(call["options"]))}
        if call["call"] == "push_batch":
            tasks = [kmq.Task(task["type"], task["data"], **task_options(task["options"])) for task in call["tasks"]]
            pushed = client.push_batch(queue, tasks)
            if all(p.accepted for p in pushed):
                return {"ids": [p.id for p in pushed]}
            return {"results": [list(p) for p in pushed]}
        if call["call"] == "cancel":
            return {"removed": client.cancel(queue, call["id"])}
        if call["call"] == "show":
            return {"found": client.show(queue, call["id"])}
        if call["call"] == "result":
            return client.result(queue, call["id"])
    except kmq.KmqError as error:
        return error_kind(error)
    raise AssertionError(f"the runner has no call {call['call']!r}")


class Checker:
    def __init__(self, now_ms: int):
        self.now_ms = now_ms
        self.captures: Dict[str, str] = {}

    def check(self, at: str, expected: Any, actual: Any, subset: bool = False) -> None:
        text = actual if isinstance(actual, str) else (str(actual) if isinstance(actual, int) and not isinstance(actual, bool) else None)
        if isinstance(expected, dict) and len(expected) == 1:
            ((key, argument),) = expected.items()
            if key == "json":
                assert text is not None, f"{at}: {actual!r} is not JSON text"
                self.check(at, argument, json.loads(text))
                return
            if key == "$ms_near_now":
                assert text is not None and abs(int(float(text)) - (self.now_ms + argument)) <= NEAR_MS, \
                    f"{at}: {actual!r} is not within {NEAR_MS} ms of now + {argument}"
                return
            if key == "$uuid":
                assert text is not None and UUID.match(text), f"{at}: {actual!r} is not a UUID"
                return
            if key == "$capture":
                assert text is not None, f"{at}: {actual!r} is not a string to capture"
                self.captures[argument] = text
                return
            if key == "$same_as":
                assert argument in self.captures, f"{at}: nothing was captured as {argument!r} before"
                assert text == self.captures[argument], f"{at}: {actual!r} is not {self.captures[argument]!r}"
                return
        if isinstance(expected, dict):
            assert isinstance(actual, dict), f"{at}: {actual!r} is not an object"
            if not subset:
                extra = set(actual) - set(expected)
                assert not extra, f"{at}: unexpected fields {sorted(extra)} in {actual!r}"
            for key, value in expected.items():
                assert key in actual, f"{at}: no field {key!r} in {actual!r}"
                self.check(f"{at}.{key}", value, actual[key], subset)
            return
        if isinstance(expected, list):
            assert isinstance(actual, list) and len(actual) == len(expected), f"{at}: {actual!r} is not {expected!r}"
            for n, (value, item) in enumerate(zip(expected, actual)):
                self.check(f"{at}[{n}]", value, item, subset)
            return
        if isinstance(expected, int) and not isinstance(expected, bool) and text is not None:
            assert text == str(expected), f"{at}: {actual!r} is not {expected!r}"
            return
        assert expected == actual, f"{at}: {actual!r} is not {expected!r}"


def redis_state(r: Any) -> Dict[str, Any]:
    state: Dict[str, Any] = {}
    for raw in r.keys("*"):
        key = raw.decode()
        kind = r.type(key).decode()
        if kind == "list":
            state[key] = {"list": [v.decode() for v in r.lrange(key, 0, -1)]}
        elif kind == "hash":
            state[key] = {"hash": {k.decode(): v.decode() for k, v in r.hgetall(key).items()}}
        elif kind == "string":
            state[key] = {"string": r.get(key).decode()}
        elif kind == "set":
            state[key] = {"set": sorted(v.decode() for v in r.smembers(key))}
        elif kind == "zset":
            state[key] = {"zset": {m.decode(): int(s) for m, s in r.zrange(key, 0, -1, withscores=True)}}
        else:
            raise AssertionError(f"key {key} has type {kind}")
    return state


@pytest.mark.parametrize("path", CASES, ids=[case.stem for case in CASES])
def test_case(path: Path, server: RedisServer) -> None:
    case = json.loads(path.read_text())
    if "python" in case.get("skip", {}):
        pytest.skip(case["skip"]["python"])
    r = server.client()
    r.flushall()
    for command in case["given"]:
        r.execute_command(*command)
    client = kmq.Client(server.url, **case.get("client", {}))
    outcomes: List[Any] = [run_call(client, call) for call in case["calls"]]
    seconds, micros = r.time()
    checker = Checker(seconds * 1000 + micros // 1000)
    for n, (call, outcome) in enumerate(zip(case["calls"], outcomes)):
        checker.check(f"{case['name']}: call {n} ({call['call']})", call["expect"], outcome, call["call"] == "show")
    state = redis_state(r)
    expected = case["then"]["keys"]
    assert set(state) == set(expected), f"{case['name']}: keys differ; Redis holds {state}"
    for key, want in expected.items():
        if "zset" in want:
            want = {"zset": {member: score for member, score in want["zset"]}}
        if "set" in want:
            want = {"set": sorted(want["set"])}
        checker.check(f"{case['name']}: {key}", want, state[key])
