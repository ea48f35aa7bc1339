"""The data plane's HTTP/1.1 client (``gateway/upstream/wire.py``) against real loopback servers.

Each server here is a raw asyncio server that writes exactly the bytes a case needs, and counts
the connections it accepted, so that reuse, closing and the pool's bound are seen from the
server's side of the socket.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from gateway.upstream import wire
from gateway.upstream.wire import ConnectionFailed, ConnectionPool, Origin, ReadTimeout, head_prefix, request_head

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
"""Answers one request (the n-th on its connection, from 0); False closes the connection."""

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class RawServer:
    """A loopback server that reads each request head and body, then lets ``answer`` write."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests = 0
        self.open = 0
        self.max_open = 0
        self.port = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        try:
            n = 0
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                self.requests += 1
                if not await self.answer(reader, writer, n):
                    break
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@asynccontextmanager
async def serving(answer: Answer, tls: ssl.SSLContext | None = None) -> AsyncIterator[RawServer]:
    server = RawServer(answer)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=tls)
    server.port = listener.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listener.close()
        await server.close()
        await listener.wait_closed()


def then_silent(data: bytes) -> Answer:
    """An answer that writes ``data``, then neither writes nor closes until the client does."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(data)
        await writer.drain()
        await reader.read()
        return False

    return answer


FIRST_CHUNK_ONLY = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n"


async def ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
    writer.write(OK)
    await writer.drain()
    return True


def head(origin: Origin, body: bytes) -> bytes:
    return request_head(head_prefix(b"/v1/chat/completions", origin, []), {"x-request-id": "gw-1"}, len(body))


async def fetch(pool: ConnectionPool, origin: Origin, *, read_timeout: float | None = 5.0) -> tuple[int, bytes]:
    connection = await pool.request(origin, head(origin, b"{}"), b"{}", connect_s=2.0, read_timeout=read_timeout)
    try:
        parts = []
        while data := await connection.read():
            parts.append(data)
        return connection.status, b"".join(parts)
    finally:
        connection.finish()


async def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_connection_is_reused_for_the_next_request_to_its_origin() -> None:
    async with serving(ok) as server:
        pool = ConnectionPool()
        origin = Origin("127.0.0.1", server.port)
        for _ in range(5):
            assert await fetch(pool, origin) == (200, b"{}")
        await pool.aclose()
    assert server.requests == 5
    assert server.connections == 1


async def test_chunked_and_close_delimited_bodies_arrive_whole_and_decoded() -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        return True

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nthe whole body")
        await writer.drain()
        return False

    pool = ConnectionPool()
    async with serving(chunked) as server:
        assert await fetch(pool, Origin("127.0.0.1", server.port)) == (200, b"data: 1\n\ndata: 2\n\n")
    async with serving(until_close) as server:
        assert await fetch(pool, Origin("127.0.0.1", server.port)) == (200, b"the whole body")
    await wait_for(lambda: pool.open_connections == 0, "the closed connection to leave the pool")
    await pool.aclose()


async def test_an_answer_abandoned_half_way_closes_its_connection() -> None:
    async with serving(then_silent(FIRST_CHUNK_ONLY)) as server:
        pool = ConnectionPool()
        origin = Origin("127.0.0.1", server.port)
        connection = await pool.request(origin, head(origin, b"{}"), b"{}", connect_s=2.0, read_timeout=5.0)
        assert await connection.read() == b"first"
        connection.finish()  # the consumer left before the end
        await wait_for(lambda: server.open == 0, "the server to see the connection closed")
        assert pool.open_connections == 0
        await pool.aclose()


async def test_an_answer_left_unread_past_the_high_water_mark_does_not_stall_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole answer arrived, reading paused at the high-water mark, the consumer read none of it:
    the connection goes back to the pool reading again, and the next request on it is answered."""
    monkeypatch.setattr(wire, "HIGH_WATER", 10)

    async def hundred_bytes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 100)
        await writer.drain()
        return True

    async with serving(hundred_bytes) as server:
        pool = ConnectionPool()
        origin = Origin("127.0.0.1", server.port)
        connection = await pool.request(origin, head(origin, b"{}"), b"{}", connect_s=2.0, read_timeout=None)
        await wait_for(lambda: connection.reusable, "the whole answer to arrive")
        connection.finish()  # nothing of it read
        async with asyncio.timeout(5):
            assert await fetch(pool, origin, read_timeout=None) == (200, b"x" * 100)
        await pool.aclose()
    assert server.connections == 1


async def test_a_backend_silent_past_the_read_timeout_fails_the_read() -> None:
    async with serving(then_silent(FIRST_CHUNK_ONLY)) as server:
        pool = ConnectionPool()
        origin = Origin("127.0.0.1", server.port)
        connection = await pool.request(origin, head(origin, b"{}"), b"{}", connect_s=2.0, read_timeout=30.0)
        connection.read_timeout = 0.2  # the gap between chunks, set after the headers
        assert await connection.read() == b"first"
        started = time.monotonic()
        with pytest.raises(ReadTimeout):
            await connection.read()
        assert 0.15 <= time.monotonic() - started < 2.0
        connection.finish()
        await pool.aclose()


async def test_a_timeout_stays_a_timeout_after_the_close_it_causes() -> None:
    """The read timer fails the request, then closes the connection; the close must not turn the
    timeout (not retried) into a connection failure (retried) when it is seen first."""

    async with serving(then_silent(b"")) as server:
        pool = ConnectionPool()
        origin = Origin("127.0.0.1", server.port)
        connection = await pool._acquire(origin, 2.0)  # sent by hand, so that nobody waits yet
        connection.send(head(origin, b"{}"), b"{}", read_timeout=0.05)
        await wait_for(lambda: connection.transport is None, "the timed-out connection to be closed")
        with pytest.raises(ReadTimeout):
            await connection.response_head()
        connection.finish()
        await pool.aclose()


async def test_a_slow_consumer_is_no_gap_of_the_backend() -> None:
    """Past the high-water mark the socket is not read; that wait is the consumer's, not a timeout."""
    total = 2 << 20

    async def floods(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        writer.write(b"x" * total)
        await writer.drain()
        return True

    async with serving(floods) as server:
        pool = ConnectionPool()
        origin = Origin("127.0.0.1", server.port)
        connection = await pool.request(origin, head(origin, b"{}"), b"{}", connect_s=2.0, read_timeout=0.2)
        received = len(await connection.read())
        await asyncio.sleep(0.5)  # the consumer is slow on purpose: longer than the read timeout
        while data := await connection.read():
            received += len(data)
        assert received == total
        connection.finish()
        await pool.aclose()


async def test_a_reused_connection_closed_by_the_backend_before_answering_is_retried_once_anew() -> None:
    async def closes_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        if n == 1:
            return False  # read the request, closed without a byte: as a server closing an idle one
        writer.write(OK)
        await writer.drain()
        return True

    async with serving(closes_second) as server:
        pool = ConnectionPool()
        origin = Origin("127.0.0.1", server.port)
        assert await fetch(pool, origin) == (200, b"{}")
        assert await fetch(pool, origin) == (200, b"{}")
        await pool.aclose()
    assert server.connections == 2


async def test_a_fresh_connection_closed_before_answering_is_an_error() -> None:
    async def closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        return False

    async with serving(closes) as server:
        pool = ConnectionPool()
        with pytest.raises(ConnectionFailed):
            await fetch(pool, Origin("127.0.0.1", server.port))
        await pool.aclose()
    assert server.connections == 1


async def test_an_answer_that_is_not_http_is_a_connection_failure() -> None:
    async with serving(then_silent(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")) as server:
        pool = ConnectionPool()
        with pytest.raises(ConnectionFailed):
            await fetch(pool, Origin("127.0.0.1", server.port))
        await wait_for(lambda: server.open == 0, "the connection to be closed")
        await pool.aclose()


async def test_headers_that_never_end_are_refused_past_the_bound() -> None:
    # 20,000 headers of ~30 bytes, and never the blank line: far past the 64 KiB bound
    endless = b"HTTP/1.1 200 OK\r\n" + b"".join(b"x-filler-%d: %s\r\n" % (i, b"y" * 16) for i in range(20_000))
    async with serving(then_silent(endless)) as server:
        pool = ConnectionPool()
        with pytest.raises(ConnectionFailed, match="headers exceed"):
            await fetch(pool, Origin("127.0.0.1", server.port))
        await wait_for(lambda: server.open == 0, "the connection to be closed")
        await pool.aclose()


async def test_an_interim_answer_is_skipped_for_the_real_one() -> None:
    async def early_hints(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + OK)
        await writer.drain()
        return True

    async with serving(early_hints) as server:
        pool = ConnectionPool()
        assert await fetch(pool, Origin("127.0.0.1", server.port)) == (200, b"{}")
        await pool.aclose()


async def test_the_pool_never_opens_more_than_its_bound() -> None:
    release = asyncio.Event()

    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        await release.wait()
        writer.write(OK)
        await writer.drain()
        return True

    async with serving(held) as server:
        pool = ConnectionPool(max_connections=2)
        origin = Origin("127.0.0.1", server.port)
        fetches = [asyncio.create_task(fetch(pool, origin)) for _ in range(5)]
        await wait_for(lambda: server.requests == 2, "two requests to reach the server")
        assert pool.open_connections == 2
        release.set()
        assert [await f for f in fetches] == [(200, b"{}")] * 5
        await pool.aclose()
    assert server.max_open == 2
    assert server.requests == 5


async def test_a_waiter_cancelled_after_its_turn_came_passes_the_turn_on() -> None:
    """At the bound, a released connection wakes the first waiter; if that request is cancelled
    (its client left) before it runs, the next waiter gets the connection instead of waiting on."""
    async with serving(ok) as server:
        pool = ConnectionPool(max_connections=1)
        origin = Origin("127.0.0.1", server.port)
        held = await pool.request(origin, head(origin, b"{}"), b"{}", connect_s=2.0, read_timeout=5.0)
        await wait_for(lambda: held.reusable, "the held answer to arrive")
        first = asyncio.create_task(fetch(pool, origin))
        second = asyncio.create_task(fetch(pool, origin))
        await wait_for(lambda: pool.waiting == 2, "both requests to wait for the one connection")
        held.finish()  # wakes the first waiter...
        first.cancel()  # ...whose client leaves before it runs
        async with asyncio.timeout(5):
            assert await second == (200, b"{}")
        with pytest.raises(asyncio.CancelledError):
            await first
        await pool.aclose()


async def test_idle_connections_are_closed_after_the_keepalive_time() -> None:
    async with serving(ok) as server:
        pool = ConnectionPool(keepalive_s=0.1)
        assert await fetch(pool, Origin("127.0.0.1", server.port)) == (200, b"{}")
        assert pool.open_connections == 1
        await wait_for(lambda: server.open == 0, "the idle connection to be closed")
        assert pool.open_connections == 0
        await pool.aclose()


def test_the_host_header_names_the_port_unless_it_is_the_scheme_s_default() -> None:
    assert Origin("engine", 8000).host_header() == b"engine:8000"
    assert Origin("engine", 80).host_header() == b"engine"
    assert Origin("::1", 8000).host_header() == b"[::1]:8000"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (openssl), and its key."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    request = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
    subprocess.run(
        [*request, "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
        check=True,
        capture_output=True,
    )
    return cert, key


def server_tls(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
async def test_an_https_backend_is_verified_against_the_trusted_certificates(certificate: tuple[str, str]) -> None:
    cert, key = certificate
    async with serving(ok, server_tls(cert, key)) as server:
        pool = ConnectionPool()
        trusting = ssl.create_default_context(cafile=cert)
        assert await fetch(pool, Origin("127.0.0.1", server.port, trusting)) == (200, b"{}")
        assert await fetch(pool, Origin("127.0.0.1", server.port, trusting)) == (200, b"{}")
        assert server.connections == 1, "the TLS connection is kept alive and reused"
        with pytest.raises(ConnectionFailed, match="SSLCertVerificationError"):
            await fetch(pool, Origin("127.0.0.1", server.port, ssl.create_default_context()))
        await pool.aclose()
