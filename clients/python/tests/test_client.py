"""kmq.Client's own behaviour against real redis-servers: its errors (Redis unreachable, a reply lost through a
proxy that drops it, a duplicate, a refused key), the round trips it makes, its connection URLs, tracing."""

from __future__ import annotations

import json
import os
import socket
import threading
from typing import List

import pytest

import kmq
from conftest import RedisServer, eventually, free_port


def commandstats(server: RedisServer, command: str) -> int:
    stats = server.client().info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_redis_unreachable_is_its_own_error_and_nothing_is_pushed() -> None:
    client = kmq.Client(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(kmq.RedisUnreachable):
        client.push("mail", "mail.send", {})
    # With the shape given, the push itself is what fails to connect.
    client = kmq.Client(f"redis://127.0.0.1:{free_port()}/0", levels=["normal"])
    with pytest.raises(kmq.RedisUnreachable):
        client.push("mail", "mail.send", {})


class ReplyDroppingProxy:
    """A TCP proxy to Redis that forwards everything, except that once a client has sent a script call (EVALSHA or
    EVAL), it closes the client's connection instead of forwarding Redis's reply: the call ran, its reply is lost."""

    def __init__(self, port: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = port
        self.dropped = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            state = {"script": False}
            threading.Thread(target=self._forward, args=(client, upstream, state, True), daemon=True).start()
            threading.Thread(target=self._forward, args=(upstream, client, state, False), daemon=True).start()

    def _forward(self, source: socket.socket, sink: socket.socket, state: dict, upstream: bool) -> None:
        """Copies ``source`` to ``sink``: the client's commands up (noting a script call), Redis's replies down
        (cutting the client off at the first reply after a script call)."""
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                sink.close()
                return
            if upstream and b"EVAL" in data.upper():
                state["script"] = True
            if not upstream and state["script"]:
                self.dropped.set()
                sink.shutdown(socket.SHUT_RDWR)
                sink.close()
                source.close()
                return
            sink.sendall(data)

    def close(self) -> None:
        self.listener.close()


def test_a_reply_lost_after_the_push_was_sent_is_reply_lost_and_the_task_may_be_queued(fresh: RedisServer) -> None:
    # The script is cached first, so that the call the proxy cuts is the one that runs it (a NOSCRIPT reply lost
    # is a ReplyLost too, but nothing ran).
    kmq.Client(fresh.url).push("warm", "t", {})
    proxy = ReplyDroppingProxy(fresh.port)
    try:
        client = kmq.Client(f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=10)
        with pytest.raises(kmq.ReplyLost) as lost:
            client.push("mail", "mail.send", {"n": 1}, id="maybe-1")
        assert lost.value.ids == ["maybe-1"]
        assert "may have been pushed" in str(lost.value)
        assert proxy.dropped.is_set()
    finally:
        proxy.close()
    # It was: the script ran before its reply was lost.
    queued = fresh.client().lrange("kmq:{mail}:ready:normal", 0, -1)
    assert [json.loads(task)["id"] for task in queued] == ["maybe-1"]


def test_a_live_unique_id_is_refused_with_duplicate_task(fresh: RedisServer) -> None:
    client = kmq.Client(fresh.url)
    client.push("mail", "mail.send", {}, id="u-1", unique=True)
    with pytest.raises(kmq.DuplicateTask) as refused:
        client.push("mail", "mail.send", {}, id="u-1", unique=True)
    assert refused.value.id == "u-1"
    pushed = client.push_batch("mail", [kmq.Task("mail.send", {}, id="u-1", unique=True), ("mail.send", {})])
    assert [p.accepted for p in pushed] == [False, True]


def test_a_key_of_the_wrong_type_is_refused_by_redis_and_nothing_is_written(fresh: RedisServer) -> None:
    fresh.client().set("kmq:{mail}:wake", "not a list")
    client = kmq.Client(fresh.url)
    with pytest.raises(kmq.RedisRefused, match="WRONGTYPE"):
        client.push("mail", "mail.send", {}, id="w-1")
    assert sorted(fresh.client().keys("*")) == [b"kmq:{mail}:wake"]


def test_the_queues_shape_is_kept_and_an_unknown_level_is_refused(fresh: RedisServer) -> None:
    fresh.client().hset("kmq:{mail}:meta", mapping={"levels": "high,low", "default_priority": "low"})
    client = kmq.Client(fresh.url)
    client.push("mail", "mail.send", {}, priority="high")
    # Kept: with the hash gone, the client still knows the levels for the pushes whose level it knows (a re-read
    # would find none and fall back to the one level normal, refusing "high").
    fresh.client().delete("kmq:{mail}:meta")
    for n in range(2):
        client.push("mail", "mail.send", {"n": n}, priority="high")
    client.push("mail", "mail.send", {})
    assert fresh.client().llen("kmq:{mail}:ready:high") == 3
    assert fresh.client().llen("kmq:{mail}:ready:low") == 1
    fresh.client().hset("kmq:{mail}:meta", mapping={"levels": "high,low", "default_priority": "low"})
    with pytest.raises(kmq.UnknownPriority) as refused:
        client.push("mail", "mail.send", {}, priority="normal")
    assert refused.value.levels == ["high", "low"]
    # Levels given to the constructor win over the hash (here: none), and a new client reads the hash afresh.
    given = kmq.Client(fresh.url, levels=["urgent", "normal"], default_priority="normal")
    given.push("mail", "mail.send", {}, priority="urgent")
    fresh.client().delete("kmq:{mail}:meta")
    assert kmq.Client(fresh.url).shape("mail") == (["normal"], "normal")


def test_a_level_an_operator_adds_is_pushed_to_at_once_by_a_client_that_kept_the_old_shape(fresh: RedisServer) -> None:
    """The rule of every client (docs/CLIENTS.md): a priority the kept shape lacks reads the meta hash again
    before it is refused, so a level a daemon's reload added is known at the first push that names it."""
    fresh.client().hset("kmq:{mail}:meta", mapping={"levels": "high,low", "default_priority": "low"})
    client = kmq.Client(fresh.url)
    client.push("mail", "mail.send", {})
    fresh.client().hset("kmq:{mail}:meta", "levels", "urgent,high,low")
    client.push("mail", "mail.send", {}, priority="urgent")
    assert fresh.client().llen("kmq:{mail}:ready:urgent") == 1


def test_a_batch_takes_one_script_call_per_1000_tasks(fresh: RedisServer) -> None:
    client = kmq.Client(fresh.url)
    client.push("warm", "t", {})
    fresh.client().config_resetstat()
    pushed = client.push_batch("mail", [("mail.send", {"n": n}) for n in range(2500)])
    assert len(pushed) == 2500 and all(p.accepted for p in pushed)
    assert commandstats(fresh, "evalsha") + commandstats(fresh, "eval") == 3
    queued = fresh.client().lrange("kmq:{mail}:ready:normal", 0, -1)
    assert [json.loads(task)["data"]["n"] for task in queued] == list(range(2500))


def test_the_script_is_sent_again_after_redis_forgot_it(fresh: RedisServer) -> None:
    client = kmq.Client(fresh.url)
    client.push("mail", "mail.send", {}, id="before")
    fresh.client().script_flush()
    client.push("mail", "mail.send", {}, id="after")
    assert fresh.client().llen("kmq:{mail}:ready:normal") == 2


def test_bad_arguments_are_refused_before_anything_is_sent(fresh: RedisServer) -> None:
    client = kmq.Client(fresh.url, levels=["normal"])
    for call in [
        lambda: client.push("mail", "", {}),
        lambda: client.push("mail", "t", {}, unique=True),
        lambda: client.push("mail", "t", {}, group=""),
        lambda: client.push("mail", "t", {}, group="é" * 33),
        lambda: client.push("mail", "t", {}, delay=0),
        lambda: client.push("mail", "t", object()),
    ]:
        with pytest.raises(kmq.InvalidArgument):
            call()
    with pytest.raises(kmq.UnknownPriority):
        client.push_batch("mail", [("t", {}), kmq.Task("t", {}, priority="high")])
    assert fresh.client().keys("*") == []


def test_unix_sockets_and_passwords_in_the_url() -> None:
    server = RedisServer(["--requirepass", "s3cret"])
    try:
        kmq.Client(f"redis://:s3cret@127.0.0.1:{server.port}/0").push("mail", "t", {}, id="tcp")
        kmq.Client(f"unix://{server.socket}?password=s3cret").push("mail", "t", {}, id="unix")
        kmq.Client(f"redis://default:s3cret@127.0.0.1:{server.port}/0").push("mail", "t", {}, id="user")
        with pytest.raises(kmq.KmqError):
            kmq.Client(f"redis://:wrong@127.0.0.1:{server.port}/0").push("mail", "t", {})
        import redis

        ids = [json.loads(t)["id"] for t in redis.Redis(port=server.port, password="s3cret").lrange(
            "kmq:{mail}:ready:normal", 0, -1)]
        assert ids == ["tcp", "unix", "user"]
    finally:
        server.stop()


def test_an_explicit_trace_context_goes_into_the_envelope(fresh: RedisServer) -> None:
    client = kmq.Client(fresh.url)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    client.push("mail", "t", {}, id="traced", traceparent=parent, tracestate="kmq=1")
    envelope = json.loads(fresh.client().lindex("kmq:{mail}:ready:normal", 0))
    assert (envelope["traceparent"], envelope["tracestate"]) == (parent, "kmq=1")


def test_the_current_opentelemetry_context_goes_into_the_envelope(fresh: RedisServer) -> None:
    # scripts/test runs this in a venv with opentelemetry-api (CI sets CI=true): there a skip would hide the test.
    try:
        from opentelemetry import context, trace
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("opentelemetry-api is not installed, and CI=true: scripts/test runs this in a venv that has it")
        pytest.skip("opentelemetry-api is not installed (pip install opentelemetry-api)")
    producer = trace.SpanContext(
        trace_id=0x4BF92F3577B34DA6A3CE929D0E0E4736,
        span_id=0x00F067AA0BA902B7,
        is_remote=False,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
        trace_state=trace.TraceState([("congo", "t61rcWkgMzE")]),
    )
    client = kmq.Client(fresh.url)
    token = context.attach(trace.set_span_in_context(trace.NonRecordingSpan(producer)))
    try:
        client.push("mail", "t", {}, id="current")
    finally:
        context.detach(token)
    client.push("mail", "t", {}, id="outside")  # no span is current: no context
    traced, untraced = [json.loads(t) for t in fresh.client().lrange("kmq:{mail}:ready:normal", 0, -1)]
    assert (traced["traceparent"], traced["tracestate"]) == (
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "congo=t61rcWkgMzE",
    )
    assert "traceparent" not in untraced and "tracestate" not in untraced


def test_show_cancel_and_a_kept_result(fresh: RedisServer) -> None:
    client = kmq.Client(fresh.url)
    client.push("mail", "t", {}, id="g-1", group="tenant:1")
    fresh.client().hset("kmq:{mail}:routes", "groups", "1")
    client.push("mail", "t", {}, id="g-2", group="tenant:1")
    places: List[dict] = client.show("mail", "g-2")
    assert [(p["state"], p.get("group"), p["position"]) for p in places] == [("ready", "tenant:1", 0)]
    assert client.cancel("mail", "g-2") == 1
    assert client.cancel("mail", "g-1") == 1
    assert client.show("mail", "g-1") == []
    assert client.result("mail", "r-1") is None
    def keep() -> None:
        r = fresh.client()
        r.hset("kmq:{mail}:results:1000", "r-1", json.dumps({"ended_at": 1, "state": "done", "result": {"rows": 3}}))
        r.zadd("kmq:{mail}:results", {"1000": 4102444800000})
    threading.Timer(0.2, keep).start()
    kept = eventually(10, "the result", lambda: client.result("mail", "r-1", wait=5))
    assert kept["result"] == {"rows": 3}


PRODUCER_RULES = (
    "+evalsha +eval +script|load +time +info +wait +rpush +lpush +ltrim +hget +hsetnx +hdel +hincrby +zadd +zrange "
    "+type +publish ~kmq:{*}:ready:* ~kmq:{*}:delayed:* ~kmq:{*}:delayed-tasks ~kmq:{*}:wake ~kmq:{*}:unique "
    "~kmq:{*}:stats ~kmq:{*}:routes ~kmq:{*}:flow:* ~kmq:{*}:ring:* ~kmq:{*}:sched &kmq:{*}:delay-wake"
)


def test_a_producer_user_reads_the_shape_with_todays_rules_and_pushes_without_it_on_older_ones(
    fresh: RedisServer,
) -> None:
    admin = fresh.client()
    admin.hset("kmq:{mail}:meta", mapping={"levels": "high,normal", "default_priority": "normal"})
    # docs/OPERATIONS.md's producer line, and the same line of an older kmqd (no read of the meta hash).
    admin.execute_command("ACL", "SETUSER", "today", "reset", "on", ">pw", *PRODUCER_RULES.split(), "%R~kmq:{*}:meta")
    admin.execute_command("ACL", "SETUSER", "older", "reset", "on", ">pw", *PRODUCER_RULES.split())
    today = kmq.Client(f"redis://today:pw@127.0.0.1:{fresh.port}/0")
    today.push("mail", "t", {}, id="high-1", priority="high")
    older = kmq.Client(f"redis://older:pw@127.0.0.1:{fresh.port}/0")
    assert older.shape("mail") == (["normal"], "normal")
    older.push("mail", "t", {}, id="normal-1")
    with pytest.raises(kmq.UnknownPriority):
        older.push("mail", "t", {}, priority="high")
    assert admin.lrange("kmq:{mail}:ready:high", 0, -1)[0].find(b"high-1") > 0
    assert admin.llen("kmq:{mail}:ready:normal") == 1


def test_a_flow_of_more_waiting_tasks_than_a_call_takes_is_written_in_calls_of_1000(fresh: RedisServer) -> None:
    """1,001 waiting tasks of one queue take two flow_push.lua calls (each all or nothing, none too long for Redis),
    and the task they all wait for is pushed last, carrying every one of them as a waiter."""
    r = fresh.client()
    client = kmq.Client(fresh.url)
    parts = [{"queue": "parts", "type": "part.build", "id": f"p-{n}", "after": [{"queue": "fetch", "id": "f"}]}
             for n in range(1001)]
    parts[0]["after"] = [{"queue": "fetch", "type": "fetch.csv", "id": "f"}]
    before = commandstats(fresh, "evalsha")
    tasks = client.push_flow({"queue": "reports", "type": "report.merge", "id": "r", "after": parts})
    assert [task.id for task in tasks[:3]] == ["r", "p-0", "f"] and len(tasks) == 1003
    # reports: 1 call, parts: 2, fetch's push: 1 (each an EVALSHA, and an EVAL after the first NOSCRIPT).
    assert commandstats(fresh, "evalsha") - before == 4
    assert r.hlen("kmq:{parts}:deps-waiting") == 1001
    (fetch,) = r.lrange("kmq:{fetch}:ready:normal", 0, -1)
    assert len(json.loads(fetch)["waiters"]) == 1001


def test_a_bad_flow_names_the_node_and_writes_nothing(fresh: RedisServer) -> None:
    r = fresh.client()
    client = kmq.Client(fresh.url)
    for flow, path, reason in [
        ({"queue": "a", "type": "t", "after": [{"queue": "b", "type": "t", "colour": 1}]}, "after[0]", "colour"),
        ({"queue": "a", "type": "t", "after": [{"queue": "b", "type": "t", "after": [7]}]}, "after[0].after[0]",
         "a node is a JSON object"),
        ({"queue": "a", "id": "x"}, "the root", "not a reference"),
        ('{"queue": "a", "type": "t"', "the root", "not JSON"),
    ]:
        with pytest.raises(kmq.InvalidFlow) as refused:
            client.push_flow(flow)
        assert refused.value.path == path and reason in str(refused.value), str(refused.value)
    assert r.keys("*") == []
