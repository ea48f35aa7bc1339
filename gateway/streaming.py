"""Server-sent-event relay: pass chunks through as they arrive, and time the tokens in them.

Every upstream read is split into complete SSE events; the complete ones are forwarded in a
single ``send`` before the next read, so the client sees each chunk before the gateway asks
the backend for the next one (nothing is buffered beyond an incomplete event). Each event's
JSON is parsed once to learn three things:

* whether it carries generated output (a content, reasoning or tool-call delta, or a
  completions ``text``): its arrival time feeds TTFT and the inter-token gaps. vLLM's first,
  role-only chunk carries none, so it does not count;
* the ``usage`` totals (the gateway always asks for ``include_usage``); the usage-only chunk
  (``"choices": []``) is dropped when the client did not ask for it;
* an upstream ``{"error": ...}`` event, forwarded as is.

The stream the client sees always ends with ``data: [DONE]``. When the upstream fails or
closes early, an OpenAI-style error event comes first, the way vLLM reports a failure.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from enum import Enum
from typing import Any

import orjson
from starlette.types import Send

from gateway.clock import Clock
from gateway.errors import GatewayError, UpstreamError, sse_error_event

DONE_EVENT = b"data: [DONE]\n\n"
_OUTPUT_DELTA_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")


class StreamEnd(Enum):
    """How a relayed stream ended; the label of ``gateway_requests_total{outcome}``."""

    COMPLETED = "completed"
    UPSTREAM_ERROR = "upstream_error"


class TokenTimer:
    """Arrival times of output chunks: TTFT from the request's arrival, then every gap."""

    __slots__ = ("_on_first", "arrival", "finish_reasons", "first_output", "gaps", "last_output", "usage")

    def __init__(self, arrival: float, on_first: Callable[[], None] | None = None) -> None:
        self._on_first = on_first
        self.arrival = arrival
        self.first_output: float | None = None
        self.last_output = 0.0
        self.gaps: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reasons: list[str] = []

    def on_output(self, t: float) -> None:
        if self.first_output is None:
            self.first_output = t
            if self._on_first is not None:
                self._on_first()
        else:
            self.gaps.append(t - self.last_output)
        self.last_output = t

    @property
    def ttft(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.arrival


class SseRelay:
    """Relays one upstream SSE body to one client, feeding a ``TokenTimer``."""

    __slots__ = ("_buffer", "_clock", "_send", "_strip_usage", "_timer", "saw_done", "saw_error")

    def __init__(self, send: Send, timer: TokenTimer, clock: Clock, *, strip_usage: bool) -> None:
        self._send = send
        self._timer = timer
        self._clock = clock
        self._strip_usage = strip_usage
        self._buffer = b""
        self.saw_done = False
        self.saw_error = False

    async def run(self, chunks: AsyncIterator[bytes]) -> StreamEnd:
        """Relay until the upstream ends; then close the client's stream properly."""
        failure: GatewayError | None = None
        try:
            async for chunk in chunks:
                out = self._feed(chunk, self._clock.now())
                if out:
                    await self._send({"type": "http.response.body", "body": out, "more_body": True})
        except GatewayError as exc:
            failure = exc
        if failure is None and not self.saw_done and not self.saw_error:
            failure = UpstreamError("The backend closed the stream before it finished.", code="upstream_protocol_error")
        tail = DONE_EVENT if failure is None else sse_error_event(failure) + DONE_EVENT
        await self._send({"type": "http.response.body", "body": tail, "more_body": False})
        if failure is not None or self.saw_error:
            return StreamEnd.UPSTREAM_ERROR
        return StreamEnd.COMPLETED

    def _feed(self, chunk: bytes, t: float) -> bytes:
        data = self._buffer + chunk if self._buffer else chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        kept: list[bytes] = []
        start = 0
        while (end := data.find(b"\n\n", start)) >= 0:
            event = data[start : end + 2]
            start = end + 2
            if self._keep(event, t):
                kept.append(event)
        self._buffer = data[start:]
        return b"".join(kept)

    def _keep(self, event: bytes, t: float) -> bool:
        if not event.startswith(b"data:"):
            return True  # comments and other fields pass through untouched
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.saw_done = True
            return False  # the relay writes its own [DONE] last
        try:
            document = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return True
        if not isinstance(document, dict):
            return True
        if "error" in document:
            self.saw_error = True
            return True
        return self._inspect_chunk(document, t)

    def _inspect_chunk(self, chunk: dict[str, Any], t: float) -> bool:
        usage = chunk.get("usage")
        if usage:
            self._timer.usage = usage
        choices = chunk.get("choices")
        if not choices:
            return not (usage and self._strip_usage)
        has_output = False
        for choice in choices:
            delta = choice.get("delta")
            if delta:
                for key in _OUTPUT_DELTA_KEYS:
                    if delta.get(key):
                        has_output = True
                        break
            elif choice.get("text"):
                has_output = True
            reason = choice.get("finish_reason")
            if reason:
                self._timer.finish_reasons.append(reason)
        if has_output:
            self._timer.on_output(t)
        return True
