"""Retries: which failures may be retried, the jittered backoff, the deadline, the budget.

The transport cases send a real request through ``UpstreamClient`` (the data plane's client,
``gateway/upstream/wire.py``, and ``map_upstream_errors``) to a loopback server that misbehaves.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.dialects.registry import DIALECTS
from gateway.errors import GatewayError, Overloaded, UpstreamError, UpstreamTimeout
from gateway.policy.model import Backend, BackendKind, Timeouts
from gateway.upstream.client import UpstreamClient
from gateway.upstream.retry import (
    Failure,
    RetryBudget,
    RetryPolicy,
    backoff_delay,
    backoff_delays,
    clamp_to_deadline,
    is_retryable,
    parse_retry_after,
    retry_delay,
)
from gateway.upstream.wire import ConnectionFailed, ConnectTimeout, ReadTimeout
from tests.fake_clock import FakeClock
from tests.servers import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def caused(error: GatewayError, cause: BaseException) -> GatewayError:
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    ("failure", "retryable"),
    [
        (Failure.from_status(502, {}), True),
        (Failure.from_status(503, {}), True),
        (Failure.from_status(429, {"retry-after": "1"}), True),
        (Failure.from_status(429, {}), False),
        (Failure.from_status(500, {}), False),
        (Failure.from_status(504, {}), False),
        (Failure.from_status(400, {}), False),
        (Failure.from_status(408, {"retry-after": "1"}), False),
        (Failure.from_status(503, {}, client_bytes_sent=True), False),
        (Failure(caused(UpstreamError("x", code="upstream_connect_error"), ConnectTimeout("x"))), True),
        (Failure(caused(UpstreamError("x"), ConnectionRefusedError())), True),
        (Failure(caused(UpstreamTimeout("x"), ConnectTimeout("x"))), True),
        (Failure(caused(UpstreamTimeout("x"), ReadTimeout("x"))), False),
        (Failure(UpstreamError("x", code="upstream_connect_error"), headers_received=True), False),
        (Failure(UpstreamError("x", code="upstream_connect_error"), client_bytes_sent=True), False),
        (Failure(UpstreamError("x", code="upstream_protocol_error")), False),
        (Failure(Overloaded("x", status=503, code="queue_full", retry_after_s=1)), False),
        (Failure(), False),
    ],
    ids=[
        "a 502 is retried",
        "a 503 is retried",
        "a 429 with Retry-After is retried",
        "a 429 without Retry-After is not",
        "a 500 is not: the backend may have done the work",
        "a 504 is not: the backend may have done the work",
        "a 400 is a client error and never retried",
        "a 408 is never retried even with Retry-After",
        "a 503 is not retried once a byte reached the client",
        "a refused or reset connection is retried",
        "a bare refused connection is retried",
        "a connect timeout is retried: nothing was sent",
        "a read timeout before the headers is not: the backend may be generating",
        "a connection cut after the headers is not retried",
        "a connection cut after bytes reached the client is not retried",
        "a protocol error is not retried",
        "the gateway's own refusal is not retried",
        "an empty failure is not retried",
    ],
)
def test_is_retryable(failure: Failure, retryable: bool) -> None:
    assert is_retryable(failure) is retryable


def test_statuses_come_from_the_policy() -> None:
    statuses = RetryPolicy(retryable_statuses=frozenset({502})).retryable_statuses
    assert not is_retryable(Failure.from_status(503, {}), statuses=statuses)
    assert not is_retryable(Failure.from_status(429, {"retry-after": "1"}), statuses=statuses)
    assert is_retryable(Failure.from_status(502, {}), statuses=statuses)


async def _reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(100)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
    writer.transport.abort()


async def _close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(100)
    writer.close()


async def _stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await reader.read(100):  # until the client gives up
        pass


async def _cut_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(100)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    writer.write(b"6\r\ndata: \r\n")
    await writer.drain()
    writer.close()


@asynccontextmanager
async def misbehaving(handler: Handler | None) -> AsyncIterator[str]:
    if handler is None:
        yield f"http://127.0.0.1:{free_port()}/v1/chat/completions"  # nothing listens: refused
        return
    tasks: set[asyncio.Task[None]] = set()

    async def owned(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(owned, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        server.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def send_through_transport(url: str) -> tuple[GatewayError, bool]:
    """The error the request raised, and whether it came before the response headers."""
    base = url.removesuffix("/v1/chat/completions")
    timeouts = Timeouts(connect_s=1.0, first_byte_s=0.2)
    backend = Backend(name="b1", url=base, kind=BackendKind.OPENAI, models=["m"], timeouts=timeouts)
    client = UpstreamClient({"b1": backend})
    chat = DIALECTS["/v1/chat/completions"]
    try:
        response = await client.open(backend, chat, b"{}", request_id="r", engine_request_id="gw-1")
        try:
            await client.read_all(backend, response)
        except GatewayError as error:
            return error, False
    except GatewayError as error:
        return error, True
    finally:
        await client.aclose()
    raise AssertionError("the request succeeded")


@pytest.mark.parametrize(
    ("handler", "error", "cause", "retryable"),
    [
        (None, UpstreamError, ConnectionFailed, True),
        (_reset, UpstreamError, ConnectionFailed, True),
        (_close, UpstreamError, ConnectionFailed, True),
        (_stall, UpstreamTimeout, ReadTimeout, False),
        (_cut_body, UpstreamError, ConnectionFailed, False),
    ],
    ids=[
        "a refused connection is a retryable connect error",
        "a reset before the headers is a retryable connect error",
        "a close before the headers is a retryable connect error",
        "a read timeout before the headers is a timeout, not retried",
        "a body cut after the headers has the connect-error code but is not retried",
    ],
)
async def test_real_transport_failures(
    handler: Handler | None, error: type[GatewayError], cause: type[Exception], retryable: bool
) -> None:
    async with misbehaving(handler) as url:
        raised, before_headers = await send_through_transport(url)
    assert type(raised) is error
    assert type(raised.__cause__) is cause
    assert is_retryable(Failure(raised, headers_received=not before_headers)) is retryable


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),
        ({"retry-after": "Thu, 01 Jan 1970 00:00:10 GMT"}, 4.0),
        ({"retry-after": "-4"}, 0.0),
        ({"retry-after": "soon"}, None),
        ({}, None),
    ],
    ids=[
        "whole seconds",
        "fractional seconds",
        "retry-after-ms wins over Retry-After",
        "an HTTP date counts from now",
        "a negative value means now",
        "garbage is ignored",
        "no header gives nothing",
    ],
)
def test_parse_retry_after(headers: dict[str, str], seconds: float | None) -> None:
    assert parse_retry_after(headers, wall_now=6.0) == seconds


@pytest.mark.parametrize("retry", [1, 2, 3, 4, 5, 6], ids=lambda k: f"retry {k} draws in the full-jitter window")
def test_backoff_is_full_jitter_within_the_exponential_window(retry: int) -> None:
    high = min(0.25, 0.025 * 2 ** (retry - 1))
    draws = [backoff_delay(retry, base_s=0.025, cap_s=0.25) for _ in range(300)]
    assert all(0 <= d <= high for d in draws)
    assert min(draws) < 0.2 * high
    assert max(draws) > 0.8 * high


def test_backoff_delays_gives_one_delay_per_allowed_retry() -> None:
    assert len(backoff_delays(RetryPolicy())) == 2
    assert backoff_delays(RetryPolicy(max_retries=0)) == []
    with pytest.raises(ValueError, match="retry counts from 1"):
        backoff_delay(0, base_s=1, cap_s=1)


@pytest.mark.parametrize(
    ("delay", "now", "deadline", "reserve", "expected"),
    [
        (0.2, 10.0, None, 0.0, 0.2),
        (0.2, 10.0, 11.0, 0.0, 0.2),
        (0.2, 10.0, 10.1, 0.0, pytest.approx(0.1)),
        (0.2, 10.0, 10.0, 0.0, None),
        (0.2, 10.0, 9.0, 0.0, None),
        (0.2, 10.0, 10.5, 0.5, None),
        (0.2, 10.0, 10.6, 0.5, pytest.approx(0.1)),
    ],
    ids=[
        "without a deadline the delay stands",
        "a delay that ends well before the deadline stands",
        "a delay past the deadline is cut to the time left",
        "at the deadline there is no retry",
        "past the deadline there is no retry",
        "no retry when only the reserve is left",
        "the reserve is kept free before the deadline",
    ],
)
def test_clamp_to_deadline(delay: float, now: float, deadline: float | None, reserve: float, expected: Any) -> None:
    assert clamp_to_deadline(delay, now=now, deadline=deadline, reserve_s=reserve) == expected


@pytest.mark.parametrize(
    ("same_backend", "deadline", "bounds"),
    [(True, 100.0, (2.0, 2.0)), (False, 100.0, (0.0, 0.025)), (True, 1.5, None)],
    ids=[
        "the same backend waits its Retry-After",
        "another backend does not wait for it",
        "a Retry-After past the deadline means no retry",
    ],
)
def test_retry_delay_honours_retry_after_on_the_same_backend(
    same_backend: bool, deadline: float, bounds: tuple[float, float] | None
) -> None:
    failure = Failure.from_status(429, {"retry-after": "2"})
    delay = retry_delay(RetryPolicy(), 1, failure, now=0.0, deadline=deadline, same_backend=same_backend)
    if bounds is None:
        assert delay is None
    else:
        assert delay is not None
        assert bounds[0] <= delay <= bounds[1]


def spend(budget: RetryBudget, n: int) -> int:
    return sum(budget.try_spend() for _ in range(n))


@pytest.mark.parametrize(
    ("requests", "attempts", "granted"),
    [(0, 40, 30), (10, 40, 32), (100, 60, 50), (1000, 300, 230)],
    ids=[
        "with no traffic the reserve allows thirty retries at once",
        "ten requests add two retries to the reserve",
        "a hundred requests allow twenty retries beyond the reserve",
        "a thousand requests allow two hundred retries beyond the reserve",
    ],
)
def test_budget_caps_retries_at_a_share_of_requests_with_a_floor(requests: int, attempts: int, granted: int) -> None:
    budget = RetryBudget(FakeClock())
    for _ in range(requests):
        budget.record_request()
    assert spend(budget, attempts) == granted
    assert (budget.spent, budget.refused, budget.requests) == (granted, attempts - granted, requests)


def test_budget_reserve_is_per_window_and_the_share_slides_with_the_window() -> None:
    clock = FakeClock()
    budget = RetryBudget(clock)
    assert spend(budget, 20) == 20  # a burst within the reserve, at once
    clock.advance(1.0)
    assert spend(budget, 20) == 10  # the rest of the window's reserve of 30
    for _ in range(100):
        budget.record_request()
    assert spend(budget, 30) == 20  # 20% of 100 on top of the spent reserve
    clock.advance(10.0)
    assert spend(budget, 40) == 30  # the requests and retries slid out; the reserve is whole again


def test_budget_from_policy_and_zero_budget() -> None:
    clock = FakeClock()
    budget = RetryBudget.from_policy(RetryPolicy(budget_ratio=0, budget_min_per_s=0), clock)
    budget.record_request()
    assert not budget.try_spend()
    assert repr(budget) == "RetryBudget(ratio=0.0, min_per_s=0.0, window_s=10.0, spent=0, refused=1)"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"retryable_statuses": [502, 400]}, "400: only 429 and 5xx statuses may be retried"),
        ({"max_retries": 11}, "less than or equal to 10"),
        ({"budget_ratio": 1.5}, "less than or equal to 1"),
        ({"backoff": 1}, "Extra inputs are not permitted"),
    ],
    ids=[
        "a client error status is rejected",
        "more than ten retries are rejected",
        "a budget above all requests is rejected",
        "an unknown key is rejected",
    ],
)
def test_retry_policy_rejects_bad_values(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RetryPolicy(**fields)


def test_retry_policy_defaults() -> None:
    policy = RetryPolicy()
    assert policy.max_retries == 2
    assert policy.retryable_statuses == {429, 502, 503}
    assert (policy.budget_ratio, policy.budget_min_per_s, policy.budget_window_s) == (0.2, 3.0, 10.0)
