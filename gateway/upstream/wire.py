"""The data plane's HTTP/1.1 client: pooled keep-alive connections to backends, parsed by httptools.

Why not a general client: the gateway sends one kind of request (a POST of a JSON body to a
handful of known origins) and relays one kind of answer (a body, often a stream of small
chunks). aiohttp's client, called directly, builds per request a ``ClientRequest`` and a
``ClientResponse`` with their header multidicts, URL objects, payload wrappers, trace hooks and a
``StreamReader``, and reschedules a timer per chunk; that is most of the CPU the gateway spends
above its own logic (README, "Hot path": the same minimal proxy on this client and on aiohttp's,
measured in one run). Here a request is one ``bytes`` head written with its body, the answer is
parsed by the same C parser uvicorn uses (httptools), and the body is handed over as the reads
arrive.

What it does, and nothing more:

* a pool per origin (scheme, host, port), at most ``max_connections`` open in all; an idle
  connection is reused newest first, closed after ``keepalive_s`` idle, and dropped when the
  backend closes it. A connection is reused only when its answer was read to the end and both
  sides keep it alive; anything else (an answer abandoned half-way, a client gone) closes it.
* timeouts by phase: ``connect_s`` to open a connection (``ConnectTimeout``: nothing was sent);
  then a read timeout that bounds every wait for the backend's next byte (``ReadTimeout``): the
  first-byte timeout until the headers, and whatever the caller sets after (``read_timeout``),
  e.g. the stream's gap between chunks. One timer per request, re-armed lazily from the time of
  the last read (no timer operation per chunk); it is stopped while reading is paused because
  the consumer is slow, so it measures the backend only.
* backpressure: past ``HIGH_WATER`` bytes unread, the socket is not read until the consumer
  catches up.
* the answer's body as sent: chunked transfer decoded, nothing decompressed (the gateway asks
  for ``identity``).
* failures as three exception types: ``ConnectTimeout``, ``ReadTimeout`` (both ``TimeoutError``)
  and ``ConnectionFailed`` (an ``OSError``: refused, reset, closed early, or an answer that is
  not HTTP). A reused connection that the backend closed before answering (the race every
  keep-alive client has with a server closing it as idle) is retried once on a new connection.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import httptools

HIGH_WATER = 256 * 1024
"""Unread bytes past which the socket is not read until the consumer catches up."""
MAX_HEAD_BYTES = 64 * 1024
"""Header bytes of one answer past which it is refused: a backend that never ends its headers
must not grow the gateway's memory (the parser itself sets no bound)."""


class ConnectTimeout(TimeoutError):
    """No connection to the backend within the connect timeout: the request was never sent."""


class ReadTimeout(TimeoutError):
    """The backend sent nothing for the read timeout (before its headers, or between chunks)."""


class ConnectionFailed(ConnectionError):
    """The connection failed: refused, reset, closed before the answer ended, or not HTTP."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a backend listens: its connections are pooled together."""

    host: str
    port: int
    tls: ssl_module.SSLContext | None = None

    def host_header(self) -> bytes:
        default = 443 if self.tls is not None else 80
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        return (host if self.port == default else f"{host}:{self.port}").encode("idna")


def head_prefix(target: bytes, origin: Origin, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The request line and the fixed headers of every POST to ``target`` (built once per backend)."""
    lines = [b"POST ", target, b" HTTP/1.1\r\nhost: ", origin.host_header(), b"\r\n"]
    for name, value in headers:
        lines += [name, b": ", value, b"\r\n"]
    return b"".join(lines)


def request_head(prefix: bytes, headers: Mapping[str, str], length: int) -> bytes:
    """``prefix`` with this request's own headers and its body's length: the head, ready to write."""
    lines = [prefix]
    for name, value in headers.items():
        lines += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
    lines += [b"content-length: ", str(length).encode(), b"\r\n\r\n"]
    return b"".join(lines)


_IDLE, _HEAD, _BODY, _DONE, _FAILED = range(5)


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to a backend, answering one request at a time."""

    def __init__(self, pool: ConnectionPool, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._state = _IDLE
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._head_waiter: asyncio.Future[None] | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._error: Exception | None = None
        self._length_known = False
        self._keep_alive = False
        self._received_any = False
        self._head_bytes = 0
        self._read_timeout: float | None = None
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.idle_since = 0.0
        self.reused = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it

    def data_received(self, data: bytes) -> None:
        if self._state not in (_HEAD, _BODY):
            self._close()  # bytes nobody asked for: this connection cannot be trusted again
            return
        self._received_any = True
        self._last_read = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            why = exc.__context__ if isinstance(exc.__context__, ConnectionFailed) else None
            self._fail(why or ConnectionFailed("the backend's answer is not valid HTTP/1.1"))
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._pool.lost(self)
        if self._state == _BODY and not self._length_known:
            self.on_message_complete()  # a body delimited by the close: this is its end
            return
        if self._state in (_HEAD, _BODY):
            reason = type(exc).__name__ if exc is not None else "closed"
            self._fail(ConnectionFailed(f"the backend closed the connection before its answer ended ({reason})"))

    def pause_writing(self) -> None:  # requests are written whole; the transport buffers them
        pass

    def resume_writing(self) -> None:
        pass

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise ConnectionFailed(f"the backend's headers exceed {MAX_HEAD_BYTES} bytes")
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # an interim answer (103 Early Hints, an unasked 100): the real one follows
            self.headers = []
            return
        self.status = status
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
                self._length_known = True
        self._state = _BODY
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake_body()

    def on_message_complete(self) -> None:
        if self._state != _BODY:
            return
        self._state = _DONE
        self._keep_alive = self._parser.should_keep_alive()  # the parser forgets it once this returns
        self._stop_timer()
        self._wake_body()

    # The request

    def send(self, head: bytes, body: bytes, read_timeout: float | None) -> None:
        """Write the request; the read timeout runs from now."""
        assert self._state == _IDLE
        if self.transport is None:
            raise ConnectionFailed("the backend closed the connection")
        self._state = _HEAD
        self.status, self.headers = 0, []
        self._chunks, self._buffered, self._error = [], 0, None
        self._length_known = self._received_any = self._keep_alive = False
        self._head_bytes = 0
        self._parser = httptools.HttpResponseParser(self)
        self._last_read = self._loop.time()
        self.read_timeout = read_timeout
        self.transport.write(head + body)

    async def response_head(self) -> None:
        """Wait for the status line and headers (``status``, ``headers``); a failure after them
        is the body's to raise."""
        if self._state == _HEAD and self._error is None:
            self._head_waiter = self._loop.create_future()
            try:
                await self._head_waiter
            finally:
                self._head_waiter = None
        if self.status == 0:
            assert self._error is not None
            raise self._error

    async def read(self) -> bytes:
        """The body bytes that arrived since the last read (waiting for some); b"" at its end."""
        while not self._chunks:
            if self._state == _DONE:
                return b""
            if self._error is not None:
                raise self._error
            self._body_waiter = self._loop.create_future()
            try:
                await self._body_waiter
            finally:
                self._body_waiter = None
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks, self._buffered = [], 0
        if self._paused:
            self._resume()
        return data

    @property
    def read_timeout(self) -> float | None:
        return self._read_timeout

    @read_timeout.setter
    def read_timeout(self, seconds: float | None) -> None:
        """Bound every wait for the backend's next byte from now on (None: no bound)."""
        self._read_timeout = seconds
        self._stop_timer()
        if seconds is not None and self._state in (_HEAD, _BODY) and not self._paused:
            self._timer = self._loop.call_at(self._last_read + seconds, self._check_timeout)

    @property
    def reusable(self) -> bool:
        """The whole answer arrived (read or not: the parser is at its end) and both sides keep the
        connection alive."""
        return (
            self._state == _DONE and self.transport is not None and not self.transport.is_closing() and self._keep_alive
        )

    def finish(self) -> None:
        """Back to the pool if reusable, else closed (once per request: then it is idle)."""
        if self._state == _IDLE:
            return
        self._stop_timer()
        transport = self.transport
        if self.reusable and transport is not None:
            if self._paused:
                # An answer left unread past the high-water mark: read again, or the idle
                # connection would miss the backend closing it and the next answer never come.
                self._paused = False
                transport.resume_reading()
            self._chunks, self._buffered = [], 0
            self._state = _IDLE
            self._pool.release(self)
        else:
            self._state = _FAILED
            self._close()
            self._pool.lost(self)

    # Internals

    def _check_timeout(self) -> None:
        self._timer = None
        seconds = self._read_timeout
        if seconds is None or self._paused or self._state not in (_HEAD, _BODY):
            return
        due = self._last_read + seconds
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check_timeout)
            return
        self._fail(ReadTimeout(f"the backend sent nothing for {seconds:g}s"))
        self._close()

    def _resume(self) -> None:
        self._paused = False
        self._last_read = self._loop.time()  # the wait on the consumer was no wait on the backend
        if self.transport is not None:
            self.transport.resume_reading()
        self.read_timeout = self._read_timeout

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, error: Exception) -> None:
        """The first failure of the request is the one it raises (a timeout, then the close it
        causes, stays a timeout)."""
        if self._state in (_DONE, _FAILED) or self._error is not None:
            return
        self._error = error
        if self._state == _HEAD:
            waiter = self._head_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._state = _FAILED if self._state == _BODY else self._state
        self._stop_timer()
        self._wake_body()

    def _wake_body(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # now: a half-read answer must not be drained, nor a slow close waited on

    @property
    def stale_failure(self) -> bool:
        """A reused connection the backend closed before a byte of the answer: retry it anew."""
        return self.reused and not self._received_any and isinstance(self._error, ConnectionFailed)


class ConnectionPool:
    """Keep-alive connections per origin, at most ``max_connections`` open in all (module docstring)."""

    def __init__(self, *, max_connections: int = 1000, keepalive_s: float = 5.0) -> None:
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._idle: dict[Origin, list[Connection]] = {}
        self._open: set[Connection] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def waiting(self) -> int:
        """Requests waiting for a connection: the pool is at its bound with none idle."""
        return sum(1 for waiter in self._waiters if not waiter.done())

    async def request(
        self, origin: Origin, head: bytes, body: bytes, *, connect_s: float | None, read_timeout: float | None
    ) -> Connection:
        """Send one request; return its connection once the answer's headers arrived."""
        connection = await self._acquire(origin, connect_s)
        connection.send(head, body, read_timeout)
        try:
            await connection.response_head()
        except ConnectionFailed:
            if not connection.stale_failure:
                connection.finish()
                raise
            connection.finish()
            connection = await self._connect(origin, connect_s)  # the backend had closed it as idle
            connection.send(head, body, read_timeout)
            await self._await_head(connection)
        except BaseException:
            connection.finish()
            raise
        return connection

    async def _await_head(self, connection: Connection) -> None:
        try:
            await connection.response_head()
        except BaseException:
            connection.finish()
            raise

    async def _acquire(self, origin: Origin, connect_s: float | None) -> Connection:
        idle = self._idle.get(origin)
        loop = asyncio.get_running_loop()
        while idle:
            connection = idle.pop()
            transport = connection.transport
            fresh = loop.time() - connection.idle_since < self.keepalive_s
            if fresh and transport is not None and not transport.is_closing():
                connection.reused = True
                return connection
            self._discard(connection)
        while len(self._open) >= self.max_connections:
            if not self._close_oldest_idle():
                waiter = loop.create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                except asyncio.CancelledError:
                    if waiter.done() and not waiter.cancelled():
                        self._wake_one()  # woken, then cancelled before its turn: pass the turn on
                    raise
                finally:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
                return await self._acquire(origin, connect_s)
        return await self._connect(origin, connect_s)

    async def _connect(self, origin: Origin, connect_s: float | None) -> Connection:
        if self._closed:
            raise ConnectionFailed("the connection pool is closed")
        loop = asyncio.get_running_loop()
        connection = Connection(self, origin)
        self._open.add(connection)
        try:
            async with asyncio.timeout(connect_s):
                await loop.create_connection(
                    lambda: connection,
                    origin.host,
                    origin.port,
                    ssl=origin.tls,
                    server_hostname=origin.host if origin.tls is not None else None,
                )
        except TimeoutError:
            self._discard(connection)
            raise ConnectTimeout(f"no connection to {origin.host}:{origin.port} within {connect_s:g}s") from None
        except OSError as exc:
            self._discard(connection)
            raise ConnectionFailed(f"cannot connect ({type(exc).__name__})") from exc
        except BaseException:
            self._discard(connection)
            raise
        return connection

    def release(self, connection: Connection) -> None:
        """A connection whose answer was read whole, kept for the next request to its origin."""
        if self._closed:
            self._discard(connection)
            return
        connection.idle_since = asyncio.get_running_loop().time()
        self._idle.setdefault(connection.origin, []).append(connection)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self.keepalive_s, self._sweep)
        self._wake_one()

    def lost(self, connection: Connection) -> None:
        """The connection closed (either side): it no longer counts."""
        self._discard(connection)

    def _discard(self, connection: Connection) -> None:
        idle = self._idle.get(connection.origin)
        if idle is not None and connection in idle:
            idle.remove(connection)
        if connection in self._open:
            self._open.discard(connection)
            connection._close()
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _close_oldest_idle(self) -> bool:
        """Close the longest idle connection of any origin (room for a new one); False if none."""
        oldest: Connection | None = None
        for idle in self._idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest.idle_since):
                oldest = idle[0]
        if oldest is None:
            return False
        self._discard(oldest)
        return True

    def _sweep(self) -> None:
        """Close the connections idle for ``keepalive_s`` (one timer per interval, not per request)."""
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        for idle in list(self._idle.values()):
            for connection in [c for c in idle if now - c.idle_since >= self.keepalive_s]:
                self._discard(connection)
        if any(self._idle.values()):
            self._sweeper = asyncio.get_running_loop().call_later(self.keepalive_s, self._sweep)

    async def aclose(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in list(self._open):
            self._discard(connection)
