"""The SSE relay on its own: framing by the SSE specification, TTFT, and what it refuses to relay.

An upstream here is a list of ``(time, bytes)`` pieces; a ``FakeClock`` reads each piece's time
as it arrives, so TTFT and the gaps are exact. What the client got is every body ``send``
joined. The same relay behind real servers is checked in ``tests/pipeline/test_relay_wired.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from starlette.types import Message

from gateway.dialects.base import Dialect
from gateway.dialects.chat import CHAT
from gateway.dialects.responses import RESPONSES
from gateway.pipeline.relay import MAX_EVENT_BYTES, SseRelay, StreamEnd, TokenTimer
from gateway.upstream.errors import Redactor, UpstreamFault
from tests.fake_clock import FakeClock

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

    sse = SseRelay(
        run.send, run.timer, clock, dialect=dialect, strip_usage=True, track=track, redactor=Redactor([SECRET])
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
    assert rejected.relay is not None
    assert rejected.relay.progress is not None
    assert failed.relay is not None
    assert failed.relay.progress is not None
    assert not rejected.relay.progress.continuable, "another engine would reject it too"
    assert failed.relay.progress.continuable


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
