"""A TCP proxy in front of a real Redis that can slow it down, silence it or cut it, on its own thread.

``redis_server.DelayingProxy`` runs on the test's event loop, so a test that stalls its own loop
(a CPU hog) would stall the proxy too and prove nothing; this one runs its own event loop on a
thread of its own, and serves gateways in other processes as well (the ``limits_outage`` bench).

* ``delay_s``: every chunk Redis sends is passed on ``delay_s`` after it arrived (replies keep
  their order; a reply is not held for the one before it: each is delayed once).
* ``pause()``/``resume()``: a black hole, as a network partition: bytes in either direction are
  dropped while paused, connections stay open and nothing answers (calls time out).
* ``cut()``/``restore()``: every connection is reset and new ones are closed at once (calls fail
  fast, as when Redis is down).

Usage::

    with DelayProxy(upstream_port=6379, delay_s=0.03) as proxy:
        store = RedisLimitStore(RedisConfig(url=proxy.url, ...))
        proxy.pause()
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from types import TracebackType


class DelayProxy:
    """See the module docstring. ``start()``/``stop()``, or ``with``."""

    def __init__(self, upstream_port: int = 6379, delay_s: float = 0.0, host: str = "127.0.0.1") -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.host = host
        self.port = 0
        self.paused = False
        self.refusing = False
        self.connections = 0
        """Connections accepted so far (a test may check that its clients went through)."""
        self.sent = 0
        """Chunks passed on to Redis: about the commands sent, as a client writes each at once."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> DelayProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def cut(self) -> None:
        """Reset every connection and refuse new ones until ``restore()``."""
        self.refusing = True
        asyncio.run_coroutine_threadsafe(self._reset_all(), self._loop).result(timeout=10)

    def restore(self) -> None:
        self.refusing = False

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._reset_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _reset_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            client_writer.transport.abort()
            return
        self.connections += 1
        try:
            redis_reader, redis_writer = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            client_writer.transport.abort()
            return
        self._writers |= {client_writer, redis_writer}
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
                self._writers.discard(writer)
                writer.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, delayed: bool) -> None:
        """Copy ``reader`` to ``writer``: dropped while paused, each chunk ``delay_s`` late if ``delayed``."""
        loop = asyncio.get_running_loop()
        held: deque[tuple[float, bytes]] = deque()
        ready = asyncio.Event()
        sender = asyncio.create_task(self._send(held, ready, writer)) if delayed else None
        try:
            while data := await reader.read(65536):
                if self.paused:
                    continue
                if sender is None:
                    self.sent += 1
                    writer.write(data)
                    continue
                held.append((loop.time() + self.delay_s, data))
                ready.set()
        except ConnectionError:
            return  # reset by either side, or by cut()
        finally:
            if sender is not None:
                sender.cancel()

    async def _send(self, held: deque[tuple[float, bytes]], ready: asyncio.Event, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await ready.wait()
            while held:
                due, data = held[0]
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                held.popleft()
                if not self.paused:
                    writer.write(data)
            ready.clear()
