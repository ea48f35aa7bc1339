"""Streaming: chunks pass through unbuffered, usage is always asked for and stripped when not
wanted, the stream always ends with ``[DONE]``, and an upstream failure ends it OpenAI-style.
What the backend's stream may hold (error events, CRLF framing, comments, fields) is relayed by
the SSE specification; the relay alone, with exact times, is in ``tests/pipeline/test_relay.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from typing import Any, cast

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionUserMessageParam

from tests.conftest import CHAT_MODEL, metric
from tests.fake_backend import FakeBackend
from tests.servers import wait_until

USER: ChatCompletionUserMessageParam = {"role": "user", "content": "Hi"}


def stream_body(**fields: Any) -> dict[str, Any]:
    return {"model": CHAT_MODEL, "messages": [USER], "max_tokens": 8, "stream": True, **fields}


def sse_payloads(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (events are separated by blank lines)."""
    payloads = []
    for event in text.split("\n\n"):
        if event.startswith("data:"):
            payloads.append(event[5:].strip())
        else:
            assert event.strip() == "", f"unexpected SSE content: {event!r}"
    return payloads


def chunks(payloads: list[str]) -> list[dict[str, Any]]:
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    return [orjson.loads(payload) for payload in payloads[:-1]]


def test_each_chunk_reaches_the_client_before_the_backend_sends_the_next(
    client: openai.OpenAI, backend: FakeBackend
) -> None:
    gate = threading.Event()  # the backend waits for it before each content chunk after the first
    backend.gate = gate
    backend.tokens = 4
    stream = client.chat.completions.create(model=CHAT_MODEL, messages=[USER], max_tokens=8, stream=True)
    received = []
    with stream:
        for chunk in stream:
            content = chunk.choices[0].delta.content if chunk.choices else None
            if not content:
                continue
            # The backend is blocked before the next token, so this one was not held back
            # waiting for it: release the backend only now.
            assert not gate.is_set()
            received.append(content)
            gate.set()
    assert received == [" t0", " t1", " t2", " t3"]


async def test_an_async_client_also_gets_each_chunk_before_the_next_is_sent(
    async_client: openai.AsyncOpenAI, backend: FakeBackend
) -> None:
    gate = threading.Event()
    backend.gate = gate
    backend.tokens = 3
    stream = await async_client.chat.completions.create(model=CHAT_MODEL, messages=[USER], max_tokens=8, stream=True)
    received = []
    async with stream:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                assert not gate.is_set()
                received.append(chunk.choices[0].delta.content)
                gate.set()
    assert received == [" t0", " t1", " t2"]


def test_raw_bytes_of_the_first_token_arrive_while_the_backend_is_blocked(
    http: httpx.Client, backend: FakeBackend
) -> None:
    backend.gate = threading.Event()
    backend.tokens = 2
    with http.stream("POST", "/v1/chat/completions", json=stream_body()) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        pieces = response.iter_raw()
        seen = b""
        for piece in pieces:
            seen += piece
            if b'"content":" t0"' in seen:
                break
        assert b" t1" not in seen
        backend.gate.set()
        rest = b"".join(pieces)
    assert b" t1" in rest
    assert rest.endswith(b"data: [DONE]\n\n")


def test_without_include_usage_the_backend_is_asked_for_it_and_the_client_gets_no_usage_chunk(
    http: httpx.Client, backend: FakeBackend
) -> None:
    backend.tokens = 3
    response = http.post("/v1/chat/completions", json=stream_body())
    assert response.status_code == 200
    # Usage at the end, and in every chunk: the exact token count a stream migration needs.
    assert backend.received[-1].body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    events = chunks(sse_payloads(response.text))
    assert all(event["choices"] for event in events), "a usage-only chunk reached the client"
    assert not any(event.get("usage") for event in events)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == " t0 t1 t2"


def test_include_usage_false_is_overridden_upstream_and_the_usage_chunk_stripped(
    http: httpx.Client, backend: FakeBackend
) -> None:
    body = stream_body(stream_options={"include_usage": False, "continuous_usage_stats": False})
    response = http.post("/v1/chat/completions", json=body)
    # The gateway asks for per-chunk usage (stream migration needs it); the client sees none.
    assert backend.received[-1].body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    events = chunks(sse_payloads(response.text))
    assert all(event["choices"] for event in events)
    assert not any("usage" in event for event in events)


def test_a_client_that_asks_for_usage_gets_the_usage_chunk_last(client: openai.OpenAI, backend: FakeBackend) -> None:
    backend.tokens = 5
    stream = client.chat.completions.create(
        model=CHAT_MODEL, messages=[USER], max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    received = list(stream)
    assert backend.received[-1].body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert all(chunk.usage is None for chunk in received[:-1]), "per-chunk usage the client did not ask for"
    last = received[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (7, 5)
    assert all(chunk.usage is None for chunk in received[:-1])


@pytest.mark.parametrize("tokens", [0, 1, 6])
def test_the_stream_always_ends_with_a_single_done(http: httpx.Client, backend: FakeBackend, tokens: int) -> None:
    backend.tokens = tokens
    response = http.post("/v1/chat/completions", json=stream_body())
    assert response.text.endswith("data: [DONE]\n\n")
    events = chunks(sse_payloads(response.text))
    assert events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("cut_after", [0, 2])
def test_a_stream_cut_by_the_backend_ends_with_an_error_event_then_done(
    http: httpx.Client, backend: FakeBackend, cut_after: int
) -> None:
    backend.tokens = 4
    backend.cut_after = cut_after
    response = http.post("/v1/chat/completions", json=stream_body())
    assert response.status_code == 200  # the stream had started when the backend failed
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    error = orjson.loads(payloads[-2])
    assert set(error) == {"error"}
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["code"] == "upstream_protocol_error"
    contents = [orjson.loads(p)["choices"][0]["delta"].get("content") for p in payloads[:-2]]
    assert contents == ["", *[f" t{i}" for i in range(cut_after)]]


def test_the_sdk_raises_on_the_error_event_of_a_cut_stream(client: openai.OpenAI, backend: FakeBackend) -> None:
    backend.tokens = 4
    backend.cut_after = 1
    stream = client.chat.completions.create(model=CHAT_MODEL, messages=[USER], max_tokens=8, stream=True)
    received: list[ChatCompletionChunk] = []
    with pytest.raises(openai.APIError, match="closed the stream"):
        received.extend(stream)
    assert [c.choices[0].delta.content for c in received] == ["", " t0"]


def test_a_client_that_disconnects_mid_stream_releases_the_backend(
    gateway_url: str, http: httpx.Client, backend: FakeBackend
) -> None:
    before = metric(gateway_url, "gateway_requests_total", outcome="client_disconnected")
    backend.gate = threading.Event()  # never released: the backend would hold the stream open
    backend.tokens = 2
    with http.stream("POST", "/v1/chat/completions", json=stream_body()) as response:
        # Kept in a variable: dropping this generator would close it, and the connection with it.
        lines = cast(Generator[str, None, None], response.iter_lines())
        for line in lines:
            if " t0" in line:
                break
        assert metric(gateway_url, "gateway_backend_in_flight_requests", backend="fake") == 1
        assert metric(gateway_url, "gateway_requests_total", outcome="client_disconnected") == before
        lines.close()
    # Closing the generator closed the connection mid-stream.
    wait_until(
        lambda: metric(gateway_url, "gateway_requests_total", outcome="client_disconnected") == before + 1,
        timeout=5,
        what="the gateway to record the disconnect",
    )
    assert metric(gateway_url, "gateway_backend_in_flight_requests", backend="fake") == 0


# --- what the backend's stream may hold: error events, CRLF framing, comments -----------------


def upstream_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    base = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1, "model": CHAT_MODEL}
    return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def upstream_event(payload: dict[str, Any], newline: bytes = b"\n") -> bytes:
    return b"data: " + orjson.dumps(payload) + newline + newline


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        pytest.param(
            {"error": {"message": "EngineCore failed at /opt/vllm/x.py on 10.0.0.7", "type": "Internal", "code": 500}},
            "upstream_error",
            "The backend failed to process the request.",
            id="an engine failure mid-stream hides its words",
        ),
        pytest.param(
            {"error": {"message": "Invalid tool call from http://10.0.0.7/x", "type": "BadRequestError", "code": 400}},
            "upstream_rejected",
            "The backend rejected the request: Invalid tool call from [url]",
            id="a rejection mid-stream keeps its sanitised reason",
        ),
    ],
)
def test_an_upstream_error_event_mid_stream_becomes_the_gateway_s_then_done(
    http: httpx.Client, client: openai.OpenAI, backend: FakeBackend, error: dict[str, Any], code: str, message: str
) -> None:
    backend.stream_script = [
        upstream_event(upstream_chunk({"role": "assistant", "content": ""})),
        upstream_event(upstream_chunk({"content": " t0"})),
        upstream_event(error),
        upstream_event(upstream_chunk({"content": " after the error"})),
        b"data: [DONE]\n\n",
    ]
    response = http.post("/v1/chat/completions", json=stream_body())
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    assert orjson.loads(payloads[-2]) == {
        "error": {
            "message": message,
            "type": "invalid_request_error" if code == "upstream_rejected" else "server_error",
            "param": None,
            "code": code,
        }
    }
    contents = [orjson.loads(p)["choices"][0]["delta"].get("content") for p in payloads[:-2]]
    assert contents == ["", " t0"], "nothing of the upstream after its error event"
    assert "10.0.0.7" not in response.text
    # The official SDK raises the gateway's error at that event.
    stream = client.chat.completions.create(model=CHAT_MODEL, messages=[USER], max_tokens=8, stream=True)
    received: list[ChatCompletionChunk] = []
    with pytest.raises(openai.APIError, match=message.split(":")[0]):
        received.extend(stream)
    assert [c.choices[0].delta.content for c in received] == ["", " t0"]


CRLF_SCRIPT = [
    b": ping - 2026-01-01 00:00:00\r\n\r\n",
    upstream_event(upstream_chunk({"role": "assistant", "content": ""}), b"\r\n")[
        :-3
    ],  # the event ends in the next read
    b"\r\n\r",
    b"\n: keep warm\r\n",
    upstream_event(upstream_chunk({"content": " t0"}), b"\r\n"),
    b"event: message\r\nid: 2\r\n" + upstream_event(upstream_chunk({"content": " t1"}), b"\r\n"),
    upstream_event(upstream_chunk({}, "stop"), b"\r\n") + b": bye\r\n\r\ndata: [DONE]\r\n\r\n",
]


def test_a_crlf_framed_stream_with_comments_reaches_the_client_as_lf_data_events(
    http: httpx.Client, client: openai.OpenAI, backend: FakeBackend
) -> None:
    backend.stream_script = CRLF_SCRIPT
    response = http.post("/v1/chat/completions", json=stream_body())
    assert response.status_code == 200
    assert "\r" not in response.text
    events = response.text.split("\n\n")[:-1]
    assert events.count(": keep-alive") == 2, "the backend's comments become the gateway's keep-alives"
    for field in ("ping", "keep warm", "id: 2", "event:"):
        assert field not in response.text, f"{field!r} of the backend's stream reached the client"
    payloads = [e[6:] for e in events if e.startswith("data: ")]
    assert len(payloads) + 2 == len(events)
    assert payloads[-1] == "[DONE]"
    contents = [orjson.loads(p)["choices"][0]["delta"].get("content") for p in payloads[:-1]]
    assert contents == ["", " t0", " t1", None]
    stream = client.chat.completions.create(model=CHAT_MODEL, messages=[USER], max_tokens=8, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == " t0 t1"
