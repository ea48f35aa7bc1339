"""Connection guards (``gateway/server/connections.py``) against hostile clients, with raw sockets.

A gateway with deadlines of a fraction of a second and a 4 KiB header bound serves these
tests; each waits on a condition with a deadline (a socket closed = ``recv`` returns ``b""``),
and the clients that must be served are the official SDK and httpx. The gateways of the
connection-bound tests are their own, with a test-sized ``max_connections``.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import orjson
import pytest

from gateway.server.connections import ConnectionLimits, Listener, Reason, ThrottledLog
from gateway.settings import Settings
from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer, metric, run_gateway
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy
from tests.servers import free_port, wait_until

TIMEOUT_S = 0.3
"""The header, body and keep-alive timeouts of the guarded gateway."""
MAX_HEADER_BYTES = 4096
MAX_HEADERS = 100
"""The default bound on header lines (``Settings.max_headers``): the tests' gateway keeps it."""
CLOSE_WITHIN_S = TIMEOUT_S + 5.0
"""How long a test waits for a close that is due after TIMEOUT_S (the machine is shared)."""
GUARDS = {
    "header_timeout_s": TIMEOUT_S,
    "body_timeout_s": TIMEOUT_S,
    "keepalive_timeout_s": TIMEOUT_S,
    "max_header_bytes": MAX_HEADER_BYTES,
}


@pytest.fixture(scope="module")
def guarded(backend_server: BackendServer, backend_credential: str) -> Iterator[str]:
    with run_gateway(session_policy(backend_server.url), **GUARDS) as url:
        yield url


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=CLOSE_WITHIN_S)


def read_until_closed(sock: socket.socket, within_s: float = CLOSE_WITHIN_S) -> bytes:
    """Everything the gateway sends until it closes the connection; fails after ``within_s``."""
    deadline = time.monotonic() + within_s
    received = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the connection was still open after {within_s}s; got {received[:200]!r}")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            return received
        received += chunk


def response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the one HTTP response in ``raw``."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def assert_error(raw: bytes, status: int, code: str) -> dict[str, str]:
    got, headers, body = response(raw)
    assert got == status, raw[:300]
    assert headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    error = orjson.loads(body)["error"]
    assert error["code"] == code
    assert error["type"]
    assert error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    return headers


def closed_count(url: str, reason: str, listener: str = "api") -> float:
    return metric(url, "gateway_connections_closed_total", listener=listener, reason=reason)


def healthz(host: str = "x") -> bytes:
    return f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()


def chat_request(content_length: int, head_padding: int = 0) -> bytes:
    pad = f"X-Pad: {'p' * head_padding}\r\n" if head_padding else ""
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_ACME}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n{pad}\r\n"
    ).encode()


# Deadlines


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(guarded: str) -> None:
    before = closed_count(guarded, "header_timeout")
    with connect(guarded) as sock:
        start = time.monotonic()
        assert read_until_closed(sock) == b"", "nothing was asked, nothing is answered"
        assert time.monotonic() - start >= TIMEOUT_S * 0.9
    wait_until(lambda: closed_count(guarded, "header_timeout") == before + 1, what="the close counted")


@pytest.mark.parametrize(
    "start",
    [
        pytest.param(b"GET /", id="a request line trickled a byte at a time"),
        pytest.param(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ", id="a header trickled a byte at a time"),
    ],
)
def test_headers_trickled_past_the_header_timeout_get_408_and_the_close(guarded: str, start: bytes) -> None:
    with connect(guarded) as sock:
        sock.sendall(start)
        began = time.monotonic()
        received = b""
        # Keep trickling one byte every 20 ms: the deadline runs from the first byte, not the last.
        while not received:
            assert time.monotonic() - began < CLOSE_WITHIN_S, "still open while trickling"
            try:
                sock.sendall(b"a")
            except OSError:
                break
            sock.settimeout(0.02)
            try:
                received = sock.recv(65536) or b"closed"
            except TimeoutError:
                continue
        received = (received if received != b"closed" else b"") + read_until_closed(sock)
    assert time.monotonic() - began >= TIMEOUT_S * 0.9
    assert_error(received, 408, "request_timeout")


def test_a_body_trickled_past_the_body_timeout_gets_408_and_the_request_ends(guarded: str) -> None:
    before = metric(guarded, "gateway_requests_total", outcome="client_disconnected")
    closed_before = closed_count(guarded, "body_timeout")
    with connect(guarded) as sock:
        sock.sendall(chat_request(content_length=500) + b'{"model": ')
        received = b""
        began = time.monotonic()
        while not received:
            assert time.monotonic() - began < CLOSE_WITHIN_S, "still open while the body trickles"
            try:
                sock.sendall(b" ")
            except OSError:
                break
            sock.settimeout(0.02)
            try:
                received = sock.recv(65536) or b"closed"
            except TimeoutError:
                continue
        received = (received if received != b"closed" else b"") + read_until_closed(sock)
    headers = assert_error(received, 408, "request_timeout")
    assert "body" in orjson.loads(response(received)[2])["error"]["message"]
    assert "x-request-id" not in headers  # the connection's answer, not the application's
    # The application saw a disconnect: the request ended and was counted once.
    wait_until(
        lambda: metric(guarded, "gateway_requests_total", outcome="client_disconnected") == before + 1,
        what="the request to end as client_disconnected",
    )
    assert closed_count(guarded, "body_timeout") == closed_before + 1


def test_a_body_still_trickling_after_an_early_answer_is_cut_without_a_second_answer(guarded: str) -> None:
    with connect(guarded) as sock:
        sock.sendall(chat_request(content_length=10_000_000))  # over the policy's body limit: 413 at once
        received = read_until_closed(sock)
    status, _, _ = response(received)
    assert status == 413
    assert received.count(b"HTTP/1.1 ") == 1


def test_an_idle_kept_alive_connection_is_closed_at_the_keepalive_timeout(guarded: str) -> None:
    before = closed_count(guarded, "keepalive_timeout")
    with connect(guarded) as sock:
        sock.sendall(healthz())
        start = time.monotonic()
        received = read_until_closed(sock)
        assert time.monotonic() - start >= TIMEOUT_S * 0.9
    assert response(received)[0] == 200
    wait_until(lambda: closed_count(guarded, "keepalive_timeout") == before + 1, what="the close counted")


def test_a_kept_alive_connection_that_stalls_in_its_next_request_gets_408(guarded: str) -> None:
    with connect(guarded) as sock:
        sock.sendall(healthz() + b"GET /healthz HTTP/1.1\r\nHo")
        received = read_until_closed(sock)
    first, _, rest = received.partition(b"\r\n\r\nok")
    assert response(first + b"\r\n\r\nok")[0] == 200
    assert_error(rest, 408, "request_timeout")


def test_a_slow_response_is_not_cut_by_any_deadline(guarded: str, backend: FakeBackend) -> None:
    """Deadlines cover what the client sends; a stream may take as long as the backend does."""
    gate = threading.Event()
    backend.gate, backend.tokens = gate, 3
    with openai.OpenAI(base_url=f"{guarded}/v1", api_key=KEY_ACME, max_retries=0, timeout=30) as sdk:
        stream = sdk.chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
        )
        chunks = iter(stream)
        first = next(c for c in chunks if c.choices and c.choices[0].delta.content)
        with connect(guarded) as witness:  # closed by its header timeout: TIMEOUT_S has passed
            read_until_closed(witness)
        backend.gate = None  # the chunks after the next one do not wait
        gate.set()
        rest = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert [first.choices[0].delta.content, *rest] == [" t0", " t1", " t2"]


# Header size


def _padded_healthz(total: int) -> bytes:
    """A GET /healthz whose request line and headers are exactly ``total`` bytes."""
    bare = len(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: \r\n\r\n")
    return f"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: {'p' * (total - bare)}\r\n\r\n".encode()


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(_padded_healthz(MAX_HEADER_BYTES + 1), id="one byte over the bound"),
        pytest.param(_padded_healthz(MAX_HEADER_BYTES * 4), id="one long header value"),
        pytest.param(
            b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(1000)) + b"\r\n",
            id="many small headers",
        ),
        pytest.param(b"GET /" + b"a" * MAX_HEADER_BYTES * 2 + b" HTTP/1.1\r\nHost: x\r\n\r\n", id="a long URL"),
        pytest.param(_padded_healthz(MAX_HEADER_BYTES * 4)[: MAX_HEADER_BYTES * 2], id="a long header unfinished"),
    ],
)
def test_headers_over_the_bound_get_431_and_the_close(guarded: str, request_bytes: bytes) -> None:
    before = closed_count(guarded, "header_too_large")
    with connect(guarded) as sock:
        sock.sendall(request_bytes)
        received = read_until_closed(sock)
    assert_error(received, 431, "request_header_too_large")
    wait_until(lambda: closed_count(guarded, "header_too_large") == before + 1, what="the close counted")


def test_headers_of_exactly_the_bound_are_served(guarded: str) -> None:
    with connect(guarded) as sock:
        sock.sendall(_padded_healthz(MAX_HEADER_BYTES))
        sock.settimeout(CLOSE_WITHIN_S)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_a_body_sent_with_its_headers_past_the_header_bound_is_served(guarded: str, backend: FakeBackend) -> None:
    """The bound counts the headers only: a body in the same packet is not header bytes."""
    body = orjson.dumps({"model": CHAT_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    body += b" " * MAX_HEADER_BYTES  # JSON may end in whitespace
    head = chat_request(len(body), head_padding=MAX_HEADER_BYTES - 300)
    assert len(head) <= MAX_HEADER_BYTES < len(head + body)
    with connect(guarded) as sock:
        sock.sendall(head + body)
        sock.settimeout(CLOSE_WITHIN_S)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_pipelined_requests_in_one_packet_are_each_served(guarded: str) -> None:
    with connect(guarded) as sock:
        sock.sendall(_padded_healthz(MAX_HEADER_BYTES - 100) + _padded_healthz(MAX_HEADER_BYTES - 100))
        received = read_until_closed(sock)  # then closed at the keep-alive timeout
    assert received.count(b"HTTP/1.1 200 OK") == 2


BIG_HEAD = _padded_healthz(MAX_HEADER_BYTES * 4)
"""A head four times the bound: 431 alone, 200 when it came in the read of the previous body (a
100,000-byte one in the issue). Small enough for one loopback segment, so that it does."""


def _after_a_head(sock: socket.socket) -> None:
    sock.sendall(healthz() + BIG_HEAD)


def _in_the_read_of_the_previous_body(sock: socket.socket) -> None:
    """The previous request's head alone, then its body and the big head in one send: the
    gateway reads the body's chunk while it reads a body (after its ``100 Continue``)."""
    body = b"[]"  # refused once read (400: not an object): an answer that needs the whole body
    head = chat_request(len(body)).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n")
    sock.sendall(head)
    sock.settimeout(CLOSE_WITHIN_S)
    assert sock.recv(65536).startswith(b"HTTP/1.1 100 ")
    sock.sendall(body + BIG_HEAD)


def _statuses(received: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", received)]


@pytest.mark.parametrize(
    ("send", "answers"),
    [
        pytest.param(_after_a_head, [200], id="in the read of the previous request's whole head"),
        pytest.param(_in_the_read_of_the_previous_body, [400], id="in the read of the previous request's body"),
    ],
)
def test_a_pipelined_head_over_the_bound_gets_431_after_the_answers_before_it(
    guarded: str, send: Callable[[socket.socket], None], answers: list[int]
) -> None:
    before = closed_count(guarded, "header_too_large")
    with connect(guarded) as sock:
        send(sock)
        received = read_until_closed(sock)
    assert _statuses(received) == [*answers, 431]
    assert_error(received[received.index(b"HTTP/1.1 431 ") :], 431, "request_header_too_large")
    wait_until(lambda: closed_count(guarded, "header_too_large") == before + 1, what="the close counted")


def _with_headers(count: int) -> bytes:
    """A GET /healthz with ``count`` header lines, Host among them."""
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(count - 1))
    return b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n"


def test_a_request_with_more_header_lines_than_the_bound_gets_431(guarded: str) -> None:
    assert len(_with_headers(MAX_HEADERS + 1)) < MAX_HEADER_BYTES  # the count refuses it, not the bytes
    before = closed_count(guarded, "header_too_large")
    with connect(guarded) as sock:
        sock.sendall(_with_headers(MAX_HEADERS + 1))
        received = read_until_closed(sock)
    assert_error(received, 431, "request_header_too_large")
    assert f"more than {MAX_HEADERS} header lines" in orjson.loads(response(received)[2])["error"]["message"]
    wait_until(lambda: closed_count(guarded, "header_too_large") == before + 1, what="the close counted")


def test_a_request_with_exactly_the_bound_of_header_lines_is_served(guarded: str) -> None:
    with connect(guarded) as sock:
        sock.sendall(_with_headers(MAX_HEADERS) + _with_headers(MAX_HEADERS))  # twice: counted per request
        received = read_until_closed(sock)  # then closed at the keep-alive timeout
    assert _statuses(received) == [200, 200]


def test_unfinished_32_mib_headers_do_not_grow_the_gateway(tmp_path: Path, backend_credential: str) -> None:
    """The issue's figure: four unfinished 32 MiB headers took RSS from 119 to 310 MiB."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(session_policy("http://127.0.0.1:9"))
    port, admin_port = free_port(), free_port()
    argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--port", str(port)]
    argv += ["--admin-port", str(admin_port)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(url + "/healthz"), timeout=30, what="the gateway to start")
        before = _rss_mib(process.pid)

        def flood() -> None:
            # The gateway closes the connection past 64 KiB (the send then fails): what this test wants.
            with connect(url) as sock, contextlib.suppress(OSError):
                sock.sendall(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (32 << 20))

        threads = [threading.Thread(target=flood) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        after = _rss_mib(process.pid)
        assert httpx.get(url + "/healthz").status_code == 200
        assert after - before < 16, f"RSS grew from {before:.0f} to {after:.0f} MiB"
    finally:
        process.terminate()
        process.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# The bound on open connections


def test_silent_sockets_past_the_bound_never_lock_out_a_client_or_a_probe(
    backend_server: BackendServer, backend: FakeBackend
) -> None:
    bound, silent = 50, 300
    with run_gateway(session_policy(backend_server.url), max_connections=bound) as url, ExitStack() as sockets:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=10) as sdk:
            usual = min(_timed_chat(sdk) for _ in range(3))
            for _ in range(silent):
                sockets.enter_context(connect(url))
            wait_until(lambda: closed_count(url, "evicted_idle") >= silent - bound, what="idle sockets evicted")
            # The client's pooled connection survives the flood: the silent ones go first.
            under_flood = [_timed_chat(sdk) for _ in range(3)]
            with httpx.Client(base_url=url) as fresh:  # and a new connection is served too
                assert fresh.get("/healthz").status_code == 200
        assert max(under_flood) < max(20 * usual, 1.0), f"usual {usual:.3f}s, under the flood {under_flood}"
        assert metric(url, "gateway_connections_open", listener="api") <= bound + 1
        assert closed_count(url, "refused") == 0


def _timed_chat(sdk: openai.OpenAI) -> float:
    start = time.monotonic()
    reply = sdk.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert reply.choices[0].message.content
    return time.monotonic() - start


def test_a_connection_past_the_bound_with_none_idle_is_refused_with_a_clean_503(
    backend_server: BackendServer, backend_credential: str
) -> None:
    bound = 4
    with run_gateway(session_policy(backend_server.url), max_connections=bound, body_timeout_s=60) as url:
        busy = [connect(url) for _ in range(bound)]
        try:
            for sock in busy:  # each holds a request whose body is not complete: busy, not idle
                sock.sendall(chat_request(content_length=100) + b"{")
            with connect(url) as late:
                late.sendall(healthz())
                refused = read_until_closed(late)
            headers = assert_error(refused, 503, "too_many_connections")
            assert headers["retry-after"] == "1"
            assert closed_count(url, "refused") == 1  # the operator listener has its own bound
        finally:
            for sock in busy:
                sock.close()
        wait_until(lambda: httpx.get(url + "/healthz").status_code == 200, what="a client served again")


def test_the_guards_come_from_the_serve_flags_and_the_environment(tmp_path: Path, backend_credential: str) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(session_policy("http://127.0.0.1:9"))
    port, admin_port = free_port(), free_port()
    argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--port", str(port)]
    argv += ["--admin-port", str(admin_port), "--header-timeout", "0.2"]
    env = {**os.environ, "GATEWAY_MAX_HEADER_BYTES": "1024"}
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(url + "/healthz"), timeout=30, what="the gateway to start")
        with connect(url) as sock:
            start = time.monotonic()
            assert read_until_closed(sock) == b""
            assert time.monotonic() - start < 0.2 + CLOSE_WITHIN_S - TIMEOUT_S
        with connect(url) as sock:
            sock.sendall(_padded_healthz(1025))
            assert_error(read_until_closed(sock), 431, "request_header_too_large")
        admin = f"http://127.0.0.1:{admin_port}"
        assert metric(admin, "gateway_connections_closed_total", listener="api", reason="header_timeout") == 1
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        pytest.param(
            {"GATEWAY_BODY_TIMEOUT_S": "soon"}, "GATEWAY_BODY_TIMEOUT_S='soon': not a valid float", id="a word"
        ),
        pytest.param({"GATEWAY_HEADER_TIMEOUT_S": "0"}, "header_timeout_s must be greater than 0", id="no time"),
        pytest.param({"GATEWAY_MAX_CONNECTIONS": "0"}, "max_connections must be at least 1", id="no connection"),
        pytest.param({"GATEWAY_ADMIN_PORT": "8080"}, "the admin port must differ", id="the API port"),
    ],
)
def test_invalid_guard_settings_are_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], problem: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=problem):
        Settings.from_env(policy_path="p.yaml", port=8080)


# The rules themselves, on the listener alone


class Connection:
    """A stand-in for a guarded connection: records that it was evicted."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.client = ("127.0.0.1", 1)
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True


def _listener(bound: int) -> Listener:
    limits = ConnectionLimits(
        header_timeout_s=1,
        body_timeout_s=1,
        keepalive_timeout_s=1,
        max_header_bytes=1024,
        max_headers=100,
        max_connections=bound,
    )
    return Listener("api", limits)


@pytest.mark.parametrize(
    ("states", "evicted"),
    [
        pytest.param(
            {"a": "fresh", "b": "fresh", "c": "kept"}, "a", id="the longest idle that never completed a request"
        ),
        pytest.param({"a": "kept", "b": "fresh", "c": "kept"}, "b", id="a fresh one before a kept-alive one"),
        pytest.param({"a": "busy", "b": "kept", "c": "kept"}, "b", id="the longest idle kept-alive one"),
        pytest.param({"a": "busy", "b": "busy", "c": "busy"}, None, id="none when every connection is busy"),
    ],
)
def test_at_the_bound_a_new_connection_closes_the_right_idle_one(states: dict[str, str], evicted: str | None) -> None:
    listener = _listener(bound=len(states))
    connections = {name: Connection(name) for name in states}
    for name, connection in connections.items():
        assert listener.admit(connection)
        if states[name] != "fresh":
            listener.busy(connection)  # its request's headers are complete
    for name, connection in connections.items():
        if states[name] == "kept":
            listener.idle(connection)  # its response is complete
    newcomer = Connection("new")
    admitted = listener.admit(newcomer)
    assert [c.name for c in connections.values() if c.evicted] == ([evicted] if evicted else [])
    assert admitted == (evicted is not None)
    assert listener.open == len(states) + (0 if evicted else 1)
    assert listener.closed[Reason.EVICTED_IDLE if evicted else Reason.REFUSED] == 1


def test_a_connection_that_goes_idle_again_is_the_newest_idle() -> None:
    listener = _listener(bound=2)
    first, second = Connection("first"), Connection("second")
    for connection in (first, second):
        listener.admit(connection)
        listener.busy(connection)
        listener.idle(connection)
    listener.busy(first)  # first serves another request, and finishes it
    listener.idle(first)
    listener.admit(Connection("new"))
    assert (first.evicted, second.evicted) == (False, True)


def test_a_flood_of_closes_logs_one_line_per_interval_with_the_count_held_back() -> None:
    now = [0.0]
    throttle = ThrottledLog(10.0, clock=lambda: now[0])
    seen = []
    for t in (0.0, 1.0, 2.0, 9.9, 10.0, 10.5, 25.0):
        now[0] = t
        seen.append(throttle.due(Reason.HEADER_TIMEOUT))
    assert seen == [0, None, None, None, 3, None, 1]
    assert throttle.due(Reason.BODY_TIMEOUT) == 0  # each reason has its own interval
