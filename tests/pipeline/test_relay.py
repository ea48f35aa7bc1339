"""The SSE relay on its own: framing by the SSE specification, TTFT, and what it refuses to relay.

An upstream here is a list of ``(time, bytes)`` pieces; a ``FakeClock`` reads each piece's time
as it arrives, so TTFT and the gaps are exact. What the client got is every body ``send``
joined. The same relay behind real servers is checked at the end of this file.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Generator
from typing import Any, cast

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionUserMessageParam
from starlette.types import Message

from gateway.dialects.base import Dialect
from gateway.dialects.chat import CHAT
from gateway.dialects.responses import RESPONSES
from gateway.pipeline.migration import StreamSplice
from gateway.pipeline.relay import MAX_EVENT_BYTES, SseRelay, StreamEnd, TokenTimer
from gateway.upstream.errors import Redactor, UpstreamFault
from tests.conftest import CHAT_MODEL, metric
from tests.fake_backend import FakeBackend
from tests.fake_clock import FakeClock
from tests.servers import wait_until

SECRET = "backend-secret-123"
BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def event(payload: dict[str, Any] | str, newline: bytes = b"\n") -> bytes:
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return b"data: " + data.encode() + newline + newline


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {**BASE, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


ROLE = chunk({"role": "assistant", "content": ""})
T0, T1 = chunk({"content": " t0"}), chunk({"content": " t1"})
END = chunk({}, "length")


class Relayed:
    """One relay run: what the client got, the timer, how it ended, the faults reported."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.faults: list[UpstreamFault] = []
        self.pieces_read = 0
        self.upstream_closed = False
        self.timer = TokenTimer(arrival=0.0)
        self.end: StreamEnd | None = None
        self.relay: SseRelay | None = None
        self.splice: StreamSplice | None = None

    async def send(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m["body"] for m in self.messages)

    @property
    def payloads(self) -> list[str]:
        """The ``data:`` payloads the client got; every event must be LF-framed and known."""
        out = []
        for raw in self.body.split(b"\n\n")[:-1]:
            assert not raw.startswith(b"\n"), f"badly framed event {raw!r}"
            assert b"\r" not in raw, f"badly framed event {raw!r}"
            if raw == b": keep-alive":
                out.append(": keep-alive")
                continue
            assert raw.startswith(b"data: "), f"unexpected event {raw!r}"
            assert b"\n" not in raw, f"an event of several lines {raw!r}"
            out.append(raw[6:].decode())
        assert self.body.endswith(b"\n\n")
        return out


async def relay(pieces: list[tuple[float, bytes]], *, track: bool = False, dialect: Dialect = CHAT) -> Relayed:
    clock = FakeClock(0.0)
    run = Relayed()

    async def upstream() -> AsyncIterator[bytes]:
        try:
            for at, piece in pieces:
                clock.t = at
                run.pieces_read += 1
                yield piece
        finally:
            run.upstream_closed = True

    run.splice = StreamSplice() if track else None
    sse = SseRelay(
        run.send, run.timer, clock, dialect=dialect, strip_usage=True, splice=run.splice, redactor=Redactor([SECRET])
    )
    run.relay = sse
    run.end = await sse.run(upstream(), run.faults.append)
    return run


def texts(payloads: list[str]) -> list[str]:
    return [
        p if p in ("[DONE]", ": keep-alive") else orjson.loads(p)["choices"][0]["delta"].get("content")
        for p in payloads
    ]


CRLF_STREAM = (
    b": ping\r\n\r\n"
    + event(ROLE, b"\r\n")
    + b": comment in the event\r\n"
    + event(T0, b"\r\n")
    + event(T1, b"\r\n")
    + event(END, b"\r\n")
    + b"data: [DONE]\r\n\r\n"
)
LF_EXPECTED = [": keep-alive", "", " t0", " t1", None, "[DONE]"]


@pytest.mark.parametrize("split", range(1, len(CRLF_STREAM)), ids=lambda i: f"split at byte {i}")
async def test_a_crlf_framed_stream_is_relayed_whole_wherever_a_read_ends(split: int) -> None:
    run = await relay([(1.0, CRLF_STREAM[:split]), (2.0, CRLF_STREAM[split:])])
    assert texts(run.payloads) == LF_EXPECTED
    assert run.end is StreamEnd.COMPLETED


@pytest.mark.parametrize("size", [1, 2, 3, 5, 64], ids=lambda n: f"{n}-byte reads")
async def test_a_crlf_framed_stream_is_relayed_whole_in_small_reads(size: int) -> None:
    pieces = [(1.0, CRLF_STREAM[i : i + size]) for i in range(0, len(CRLF_STREAM), size)]
    run = await relay(pieces)
    assert texts(run.payloads) == LF_EXPECTED


async def test_lone_cr_line_ends_are_line_ends_too() -> None:
    run = await relay([(1.0, event(ROLE, b"\r") + event(T0, b"\r") + b"data: [DONE]\r\r")])
    assert texts(run.payloads) == ["", " t0", "[DONE]"]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"], ids=["LF", "CRLF"])
async def test_ttft_is_the_first_output_token_not_a_comment_or_the_role_chunk(newline: bytes) -> None:
    run = await relay(
        [
            (0.1, b": ping" + newline + newline),
            (0.2, event(ROLE, newline)),
            (0.3, b": keep-alive" + newline + newline),
            (0.5, b": ping" + newline + event(T0, newline)),
            (0.8, event(T1, newline)),
            (0.9, event(END, newline) + b"data: [DONE]" + newline + newline),
        ]
    )
    assert run.timer.first_output == 0.5
    assert run.timer.ttft == 0.5
    assert run.timer.gaps == [pytest.approx(0.3)]
    assert run.timer.finish_reasons == ["length"]
    assert texts(run.payloads) == [": keep-alive", "", ": keep-alive", " t0", " t1", None, "[DONE]"]


async def test_event_id_and_retry_fields_are_dropped_and_data_lines_joined() -> None:
    two_lines = b'data: {"id": "chatcmpl-1", "choices":\ndata: [{"index": 0, "delta": {"content": " t0"}}]}\n\n'
    run = await relay(
        [
            (1.0, b"retry: 1\n\n" + b"event: message\nid: 7\n" + event(ROLE)),
            (2.0, two_lines + b"id: 8\n\n" + b"data: [DONE]\n\n"),
        ]
    )
    assert texts(run.payloads) == ["", " t0", "[DONE]"]
    assert b"retry" not in run.body
    assert b"id: " not in run.body
    assert b"event:" not in run.body
    assert run.timer.first_output == 2.0


async def test_the_backend_s_comment_text_never_reaches_the_client() -> None:
    run = await relay([(1.0, b": proxied by 10.1.2.3 with Bearer x\n\n" + event(T0) + b"data: [DONE]\n\n")])
    assert b"10.1.2.3" not in run.body
    assert b"Bearer" not in run.body
    assert texts(run.payloads) == [": keep-alive", " t0", "[DONE]"]


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        pytest.param(
            event({"error": {"message": "EngineCore died at http://10.0.0.9:8000", "type": "Internal", "code": 500}}),
            "upstream_error",
            "The backend failed to process the request.",
            id="vLLM's engine failure",
        ),
        pytest.param(
            event({"error": {"message": "bad schema", "type": "BadRequestError", "code": 400}}),
            "upstream_rejected",
            "The backend rejected the request: bad schema",
            id="vLLM's rejection keeps its sanitised words",
        ),
        pytest.param(
            b'error: {"code": 500, "message": "slot died", "type": "server_error"}\n\n',
            "upstream_error",
            "The backend failed to process the request.",
            id="llama.cpp's error field",
        ),
        pytest.param(
            b"error: segfault in /srv/llama\n\n",
            "upstream_error",
            "The backend failed to process the request.",
            id="llama.cpp's error field with plain text",
        ),
        pytest.param(
            event({"object": "error", "message": "queue full", "code": 503}),
            "upstream_unavailable",
            "The backend is unavailable; retry after 1s.",
            id="a flat error object",
        ),
    ],
)
async def test_an_upstream_error_event_becomes_the_gateway_s_then_done(error: bytes, code: str, message: str) -> None:
    run = await relay([(1.0, event(ROLE) + event(T0)), (2.0, error + event(T1)), (3.0, b"data: [DONE]\n\n")])
    payloads = run.payloads
    assert texts(payloads[:2]) == ["", " t0"]
    assert orjson.loads(payloads[2]) == {
        "error": {"message": message, "type": run_type(code), "param": None, "code": code}
    }
    assert payloads[3:] == ["[DONE]"], "nothing of the upstream after its error event"
    assert (run.pieces_read, run.upstream_closed) == (2, True), "the upstream is closed at its error event"
    assert run.end is StreamEnd.UPSTREAM_ERROR
    assert [f.where for f in run.faults] == ["event"]
    assert "10.0.0.9" not in run.faults[0].excerpt
    assert "/srv" not in run.faults[0].excerpt


def run_type(code: str) -> str:
    return "invalid_request_error" if code == "upstream_rejected" else "server_error"


async def test_a_rejection_event_is_not_continued_elsewhere_and_a_failure_is() -> None:
    rejected = await relay([(1.0, event(ROLE) + event({"error": {"message": "m", "code": 400}}))], track=True)
    failed = await relay([(1.0, event(ROLE) + event({"error": {"message": "m", "code": 500}}))], track=True)
    assert rejected.splice is not None
    assert failed.splice is not None
    assert not rejected.splice.progress.continuable, "another engine would reject it too"
    assert failed.splice.progress.continuable


async def test_a_payload_that_is_not_a_json_object_is_dropped() -> None:
    run = await relay(
        [
            (1.0, event(ROLE) + b"data: <html>oops at 10.0.0.9</html>\n\n" + b"data: 42\n\n" + event(T0)),
            (2.0, b"data: [DONE]\n\n"),
        ]
    )
    assert texts(run.payloads) == ["", " t0", "[DONE]"]
    assert run.relay is not None
    assert run.relay.dropped_events == 2
    assert run.end is StreamEnd.COMPLETED


async def test_nothing_after_done_is_relayed() -> None:
    run = await relay([(1.0, event(T0) + b"data: [DONE]\n\n" + event(T1) + b"data: [DONE]\n\n")])
    assert texts(run.payloads) == [" t0", "[DONE]"]


async def test_an_event_that_never_ends_is_a_protocol_error_not_a_growing_buffer() -> None:
    run = await relay([(1.0, event(T0)), (2.0, b"data: " + b"x" * MAX_EVENT_BYTES), (3.0, b"more")])
    payloads = run.payloads
    assert texts(payloads[:1]) == [" t0"]
    assert orjson.loads(payloads[1])["error"]["code"] == "upstream_protocol_error"
    assert payloads[2:] == ["[DONE]"]
    assert len(run.body) < 1000


async def test_output_holding_the_gateway_s_credential_is_never_relayed() -> None:
    leak = chunk({"content": f"headers: authorization: Bearer {SECRET}"})
    run = await relay([(1.0, event(T0)), (2.0, event(leak) + event(T1)), (3.0, b"data: [DONE]\n\n")])
    assert SECRET.encode() not in run.body
    payloads = run.payloads
    assert texts(payloads[:1]) == [" t0"]
    assert orjson.loads(payloads[1])["error"]["code"] == "upstream_protocol_error"
    assert payloads[2:] == ["[DONE]"]
    assert [f.excerpt for f in run.faults] == ["the stream holds a credential of the gateway"]


# --- typed-event streams (Responses) ------------------------------------------------------------


def typed(kind: str, **fields: Any) -> bytes:
    """One typed event as vLLM writes it: its name on an ``event:`` line, then its data."""
    return f"event: {kind}\n".encode() + event({"type": kind, **fields})


COMPLETED = {"status": "completed", "usage": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}}


async def test_a_typed_stream_keeps_its_event_names_and_ends_at_its_final_event_without_done() -> None:
    run = await relay(
        [
            (0.1, typed("response.created", response={"status": "in_progress"})),
            (0.2, typed("response.output_text.delta", delta=" t0")),
            (0.3, typed("response.output_text.delta", delta=" t1") + b"event: x\nid: 7\nretry: 1\ndata: {}\n\n"),
            (0.5, typed("response.completed", response=COMPLETED)),
        ],
        dialect=RESPONSES,
    )
    events = run.body.split(b"\n\n")[:-1]
    names = [e.split(b"\n")[0] for e in events]
    assert names == [
        b"event: response.created",
        b"event: response.output_text.delta",
        b"event: response.output_text.delta",
        b"event: x",
        b"event: response.completed",
    ]  # no [DONE] of the gateway's either: the client's SDK reads the stream to its end
    assert not any(b"id: 7" in e or b"retry" in e for e in events)  # only the name is relayed
    assert run.end is StreamEnd.COMPLETED
    assert run.timer.ttft == pytest.approx(0.2)
    assert run.timer.gaps == pytest.approx([0.1])
    assert run.timer.usage == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert run.timer.finish_reasons == ["stop"]


async def test_a_typed_stream_cut_before_its_final_event_is_a_protocol_error() -> None:
    run = await relay([(0.1, typed("response.output_text.delta", delta=" t0"))], dialect=RESPONSES)
    assert run.end is StreamEnd.UPSTREAM_ERROR
    assert b"upstream_protocol_error" in run.body


@pytest.mark.parametrize(
    "failure",
    [
        typed("error", code="500", message="engine crashed at /srv/secret", param=None),
        typed("response.failed", response={"status": "failed", "error": {"code": "server_error", "message": "x"}}),
    ],
)
async def test_a_typed_error_event_becomes_the_gateway_s(failure: bytes) -> None:
    run = await relay([(0.1, typed("response.output_text.delta", delta=" t0")), (0.2, failure)], dialect=RESPONSES)
    assert run.end is StreamEnd.UPSTREAM_ERROR
    assert b"/srv/secret" not in run.body
    assert b"response.failed" not in run.body
    assert b"[DONE]" not in run.body
    assert run.body.endswith(b"\n\n")
    assert b'event: error\ndata: {"type":"error","code":"upstream_error"' in run.body.split(b"\n\n")[-2]  # the last
    assert len(run.faults) == 1


async def test_a_chat_stream_still_drops_event_names_and_needs_done() -> None:
    run = await relay([(0.1, b"event: delta\n" + event(T0)), (0.2, event(END))])
    assert b"event:" not in run.body
    assert run.end is StreamEnd.UPSTREAM_ERROR  # a choice-chunk stream ends with [DONE]


# Wired: behind real servers
# Streaming: chunks pass through unbuffered, usage is always asked for and stripped when not
# wanted, the stream always ends with ``[DONE]``, and an upstream failure ends it OpenAI-style.
# What the backend's stream may hold (error events, CRLF framing, comments, fields) is relayed by
# the SSE specification; the relay alone, with exact times, is in ``tests/pipeline/test_relay.py``.

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
