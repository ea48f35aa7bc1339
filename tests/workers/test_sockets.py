"""The sockets of a set (``gateway/workers/sockets.py``), with raw sockets on loopback."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from gateway.workers.sockets import WorkerSockets


@pytest.fixture
def group() -> Iterator[WorkerSockets]:
    sockets = WorkerSockets("127.0.0.1", 0, 2)
    try:
        yield sockets
    finally:
        sockets.close()


def accepted(sock: socket.socket) -> int:
    """How many connections wait in ``sock``'s accept queue (accepting and closing them)."""
    sock.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def connect(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]


def test_port_zero_gives_one_port_to_every_worker_and_the_kernel_spreads_connections(group: WorkerSockets) -> None:
    assert group.port != 0
    assert {group.api(i).getsockname()[1] for i in range(2)} == {group.port}
    clients = connect(group.port, 64)
    try:
        counts = [accepted(group.api(i)) for i in range(2)]
    finally:
        for client in clients:
            client.close()
    assert sum(counts) == 64
    assert min(counts) > 0, f"every connection went to one socket: {counts}"


def test_a_socket_out_of_the_group_gets_nothing_and_the_port_stays_the_sets(group: WorkerSockets) -> None:
    group.close_api(0)
    clients = connect(group.port, 16)
    try:
        assert accepted(group.api(1)) == 16
    finally:
        for client in clients:
            client.close()
    with socket.socket() as intruder, pytest.raises(OSError, match="Address already in use"):
        intruder.bind(("127.0.0.1", group.port))
    assert group.api(0).getsockname()[1] == group.port  # opened again for the restart


def test_each_worker_has_its_own_loopback_operator_listener(group: WorkerSockets) -> None:
    urls = {group.admin_url(i) for i in range(2)}
    assert len(urls) == 2
    assert all(url.startswith("http://127.0.0.1:") for url in urls)


def test_a_taken_port_fails_at_once_and_leaves_nothing_open() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            WorkerSockets("127.0.0.1", port, 2)
        assert len(os.listdir("/proc/self/fd")) == before
