"""A real three-node Redis Cluster on free loopback ports, for the tests of every user of the
shared store (``cluster``: the fixture of ``tests/shared/conftest.py``)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

import redis

from tests.servers import free_port, wait_until


def cluster_nodes(tmp_path: Path) -> Iterator[list[int]]:
    """Three redis-server nodes joined in a cluster (no replicas), on free ports."""
    ports: list[int] = []
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        while len(ports) < 3:
            port, node = _start_node(tmp_path, taken=ports)
            ports.append(port)
            nodes.append(node)
        create = ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=30)
        # Every node, not the first alone: a node that has not yet heard the cluster is ok answers
        # CLUSTERDOWN, and the store's client does not retry (``gateway/shared/store.py``).
        wait_until(lambda: all(_cluster_ok(port) for port in ports), what="every node to find the cluster ok")
        yield ports
    finally:
        for node in nodes:
            node.kill()
            node.wait()


def _start_node(tmp_path: Path, taken: list[int], attempts: int = 5) -> tuple[int, subprocess.Popen[bytes]]:
    """One cluster node on a free port pair, answering. A port found free may be taken before the
    node binds it (other servers of the suite take ephemeral ports too): the node then exits, and
    another port is tried."""
    for _ in range(attempts):
        port = _cluster_port()
        if port in taken:
            continue
        folder = tmp_path / str(port)
        folder.mkdir()
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes"]
        argv += ["--cluster-config-file", str(folder / "nodes.conf"), "--save", "", "--appendonly", "no"]
        node = subprocess.Popen(argv, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(partial(_up_or_gone, node, port), what=f"cluster node {port} to answer or exit")
        if node.poll() is None:
            return port, node
    raise AssertionError(f"no cluster node started in {attempts} attempts")


def _up_or_gone(node: subprocess.Popen[bytes], port: int) -> bool:
    return node.poll() is not None or _pings(port)


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too (so at most 55535)."""
    for _ in range(1000):
        port = free_port()
        if port <= 55535:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise AssertionError("no free port pair for a cluster node")


def _pings(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_timeout=0.5) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def _cluster_ok(port: int) -> bool:
    with redis.Redis(port=port, socket_timeout=0.5) as client:
        return bool(client.cluster("info").get("cluster_state") == "ok")


def cluster_url(ports: Sequence[int]) -> str:
    """The ``redis+cluster://`` URL naming ``ports`` as start-up nodes."""
    return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports)
