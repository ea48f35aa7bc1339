"""One request against real loopback servers: TTFT, ITL, usage and error reasons."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import aiohttp
import orjson
import pytest

from loadtests.loadgen.client import ERROR_INCOMPLETE, make_session, send_request
from tests.loadtests.fake_backend import FakeBackend, Receive, Scope, Send
from tests.servers import free_port, serve_in_thread

HEADERS = {"content-type": "application/json"}


def _body(max_tokens: int = 5, *, stream: bool = True, chat: bool = True) -> bytes:
    body: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "stream": stream}
    body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "one two three"}]
    else:
        body["prompt"] = "one two three"
    return orjson.dumps(body)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with make_session() as s:
        yield s


@pytest.fixture
def slow_first_token() -> Iterator[str]:
    with serve_in_thread(FakeBackend(first_token_delay_s=0.1)) as url:
        yield url


async def test_ttft_ignores_the_role_only_first_chunk(session: aiohttp.ClientSession, slow_first_token: str) -> None:
    exchange = await send_request(session, f"{slow_first_token}/v1/chat/completions", _body(4), HEADERS, stream=True)
    assert (exchange.status, exchange.error) == (200, None)
    assert exchange.ttft_s is not None
    assert exchange.ttft_s >= 0.1  # the role chunk came at once; the first token after the delay
    assert len(exchange.itl_s) == 3  # four output chunks, three gaps
    assert exchange.e2e_s >= exchange.ttft_s


async def test_tokens_come_from_usage_not_from_counting_chunks(session: aiohttp.ClientSession) -> None:
    with serve_in_thread(FakeBackend(tokens_per_chunk=3, cached_tokens=2)) as url:
        exchange = await send_request(session, f"{url}/v1/chat/completions", _body(7), HEADERS, stream=True)
    assert len(exchange.output_times) == 3  # chunks of 3 + 3 + 1 tokens
    assert (exchange.tokens_in, exchange.tokens_out, exchange.cached_tokens) == (3, 7, 2)


async def test_completions_stream_times_text_chunks(session: aiohttp.ClientSession) -> None:
    with serve_in_thread(FakeBackend()) as url:
        exchange = await send_request(session, f"{url}/v1/completions", _body(5, chat=False), HEADERS, stream=True)
    assert len(exchange.output_times) == 5
    assert exchange.tokens_out == 5


async def test_without_streaming_the_first_token_arrives_with_the_body(session: aiohttp.ClientSession) -> None:
    with serve_in_thread(FakeBackend()) as url:
        exchange = await send_request(
            session, f"{url}/v1/chat/completions", _body(6, stream=False), HEADERS, stream=False
        )
    assert exchange.error is None
    assert exchange.ttft_s == exchange.e2e_s
    assert exchange.tokens_out == 6


async def test_an_error_status_records_the_openai_error_code(session: aiohttp.ClientSession) -> None:
    with serve_in_thread(FakeBackend(error_every=1, error_status=429, error_code="rate_limit_exceeded")) as url:
        exchange = await send_request(session, f"{url}/v1/chat/completions", _body(), HEADERS, stream=True)
    assert (exchange.status, exchange.error) == (429, "rate_limit_exceeded")
    assert exchange.ttft_s is None


async def test_a_refused_connection_is_status_zero_with_the_error_name(session: aiohttp.ClientSession) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/chat/completions"
    exchange = await send_request(session, url, _body(), HEADERS, stream=True)
    assert exchange.status == 0
    assert exchange.error == "ClientConnectorError"


class RawStream:
    """Sends the given byte pieces as one 200 SSE response, split exactly as given."""

    def __init__(self, pieces: Sequence[bytes], status: int = 200) -> None:
        self.pieces = pieces
        self.status = status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await send(
            {"type": "http.response.start", "status": self.status, "headers": [(b"content-type", b"text/event-stream")]}
        )
        for piece in self.pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _chunk(content: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}, "finish_reason": None}]
    return b"data: " + orjson.dumps({"choices": choices, "usage": usage}) + b"\n\n"


@pytest.mark.parametrize(
    ("pieces", "outputs", "error"),
    [
        (
            [
                _chunk("a") + _chunk("b")[:9],
                _chunk("b")[9:],
                _chunk(usage={"completion_tokens": 2}),
                b"data: [DONE]\n\n",
            ],
            2,
            None,
        ),
        ([b": keep-alive\n\n", _chunk(""), _chunk("a"), b"data: [DONE]\n\n"], 1, None),
        ([_chunk("a"), b'data: {"error": {"code": "engine_overloaded", "message": "x"}}\n\n'], 1, "engine_overloaded"),
        ([_chunk("a")], 1, ERROR_INCOMPLETE),
        ([_chunk("a"), b"data: {broken\n\n", b"data: [DONE]\n\n"], 1, "invalid_response"),
    ],
    ids=[
        "a chunk split across network reads is parsed once whole",
        "comments and empty deltas are not output",
        "an error event mid-stream records its code",
        "a stream cut before DONE is incomplete",
        "a malformed chunk is an invalid response",
    ],
)
async def test_sse_parsing(
    session: aiohttp.ClientSession, pieces: list[bytes], outputs: int, error: str | None
) -> None:
    with serve_in_thread(RawStream(pieces)) as url:
        exchange = await send_request(session, f"{url}/v1/chat/completions", _body(), HEADERS, stream=True)
    assert len(exchange.output_times) == outputs
    assert exchange.error == error
