"""Redis for the tests: the shared server on 127.0.0.1:6379, and private ones to kill.

Every test works under a key prefix of its own (``unique_prefix``), so runs and tests that
share the Redis never see each other's limits. ``REDIS_URL`` and ``drop_keys`` are the harness's
(``loadtests/harness/shared_redis.py``, which the proofs use too), re-exported here.
``RedisProcess`` runs a private ``redis-server`` on a free port, without persistence, which a
test may kill and start again on the same port (an outage and a recovery).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import pytest
import redis

from gateway.dialects.chat import CHAT
from gateway.types import InferenceRequest
from loadtests.harness.shared_redis import REDIS_URL
from loadtests.harness.shared_redis import drop_keys as drop_keys  # re-exported: the tests import it from here
from tests.servers import free_port, wait_until


def unique_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}:"


def shared_client() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL, socket_timeout=2)


async def eventually(condition: Callable[[], Awaitable[bool]], within: float = 10.0, what: str = "condition") -> None:
    """``wait_until`` for an async condition: poll it, on the event loop, until a deadline."""
    deadline = time.monotonic() + within
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.005)


def limit_request() -> InferenceRequest:
    """A chat request of 10 prompt tokens and 90 of output, as the limit-store tests admit it."""
    return InferenceRequest("id", CHAT, "m", {}, b"", False, False, 10, 90, 0.0)


class StoreEvents:
    """What a limit store reported through its error and fallback hooks."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.fallbacks: list[str] = []


@contextmanager
def private_redis() -> Iterator[RedisProcess]:
    """A ``redis-server`` of the test's own on a free port, stopped at the end (a test may kill it)."""
    server = RedisProcess()
    server.start()
    try:
        yield server
    finally:
        server.stop()


class RedisProcess:
    """A private ``redis-server`` on a loopback port: ``start()``, ``kill()``, ``start()`` again."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server not installed (apt-get install redis-server; .ci/run does)")
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.process is None, "already running"
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self.answers, what=f"redis-server on port {self.port} to answer PING")

    def answers(self) -> bool:
        try:
            with redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5) as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)

    def kill(self) -> None:
        """SIGKILL: no shutdown, connections cut at once, every key and script lost."""
        assert self.process is not None, "not running"
        self.process.kill()
        self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.kill()


class DelayingProxy:
    """A TCP proxy in front of a Redis that holds every reply ``delay_s`` before passing it on.

    A slow Redis that never fails: every command answers, just late. ``delay_s`` may be changed
    while it runs (0 passes replies at once). Runs on the test's event loop: ``async with``."""

    def __init__(self, upstream_port: int = 6379, delay_s: float = 0.03) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def __aenter__(self) -> DelayingProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        redis_reader, redis_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        up = asyncio.create_task(self._pipe(client_reader, redis_writer, delayed=False))
        down = asyncio.create_task(self._pipe(redis_reader, client_writer, delayed=True))
        self._tasks |= {up, down}
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (up, down):
                task.cancel()
                self._tasks.discard(task)
            for writer in (client_writer, redis_writer):
                writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, delayed: bool) -> None:
        while data := await reader.read(65536):
            if delayed and self.delay_s > 0:
                await asyncio.sleep(self.delay_s)  # replies keep their order
            writer.write(data)
            await writer.drain()
