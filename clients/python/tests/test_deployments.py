"""kmq.Client.sentinel and kmq.Client.cluster against real deployments the tests start: a master watched by a
Sentinel, and a Redis Cluster of three masters (redis-cli --cluster create)."""

from __future__ import annotations

import json
import subprocess
from typing import Iterator, List

import pytest
import redis

import kmq
from conftest import RedisServer, eventually, free_port


@pytest.fixture
def sentinel() -> Iterator[tuple]:
    master = RedisServer()
    # A Sentinel is a redis-server started with --sentinel and a config file it may rewrite.
    config = master.dir / "sentinel.conf"
    port = free_port()
    config.write_text(f"port {port}\nbind 127.0.0.1\nsentinel monitor mymaster 127.0.0.1 {master.port} 1\n")
    process = subprocess.Popen(["redis-server", str(config), "--sentinel", "--logfile", str(master.dir / "s.log")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        eventually(10, "the Sentinel to know the master", lambda: _masters(port))
        yield master, port
    finally:
        process.kill()
        process.wait(10)
        master.stop()


def _masters(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).sentinel_masters())
    except redis.exceptions.ConnectionError:
        return False


def test_a_client_of_a_sentinel_watched_master_pushes_to_the_master(sentinel: tuple) -> None:
    master, port = sentinel
    client = kmq.Client.sentinel([("127.0.0.1", port)], "mymaster")
    client.push("mail", "mail.send", {"to": "ada"}, id="s-1")
    queued = master.client().lrange("kmq:{mail}:ready:normal", 0, -1)
    assert [json.loads(task)["id"] for task in queued] == ["s-1"]


@pytest.fixture
def cluster() -> Iterator[List[RedisServer]]:
    # Its own bus port: the default (the port + 10000) does not exist for a free port above 55535.
    nodes = [
        RedisServer(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port",
                     str(free_port())])
        for _ in range(3)
    ]
    try:
        subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{node.port}" for node in nodes], "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60,
        )
        eventually(30, "the cluster to be ok", lambda: all(
            b"cluster_state:ok" in node.client().execute_command("CLUSTER", "INFO") for node in nodes))
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def test_a_client_of_a_cluster_pushes_cancels_and_shows_on_the_queues_node(cluster: List[RedisServer]) -> None:
    client = kmq.Client.cluster(cluster[0].url)
    queues = [f"q{n}" for n in range(6)]
    for queue in queues:
        client.push(queue, "t", {}, id=f"{queue}-1")
        client.push_batch(queue, [("t", {"n": n}) for n in range(3)])
        assert [p["state"] for p in client.show(queue, f"{queue}-1")] == ["ready"]
        assert client.cancel(queue, f"{queue}-1") == 1
    any_node = redis.RedisCluster.from_url(cluster[0].url)
    for queue in queues:
        assert any_node.llen(f"kmq:{{{queue}}}:ready:normal") == 3
