"""One request: send it, read the SSE stream, time it. Reused by the gateway's overhead benchmark.

`send_request` never raises for what the server or the network does: every outcome becomes an
`Exchange` whose ``status`` is 0 and ``error`` the exception's class name when no HTTP status
came back. Only cancellation propagates (the runner cancels stragglers at the end of a run).

Timing, all from `time.perf_counter` and relative to the moment before the request is written:

* TTFT is the first SSE chunk carrying generated output: a ``delta`` with ``content``,
  ``reasoning_content``/``reasoning`` or ``tool_calls``, or ``text`` for completions. vLLM's
  first chunk carries only the role and arrives before any token is computed, so it is skipped.
* ITL is every gap between successive output chunks (a chunk may hold several tokens; the gap
  is still what the user sees).
* Token counts come from the ``usage`` object (ask for it with
  ``stream_options.include_usage``), never from counting chunks.

The stream is read with ``iter_any`` and split on newlines here: one await per network read
rather than per line, which is most of this module's CPU cost at 1,000 requests/s.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

ERROR_INCOMPLETE = "incomplete_stream"
"""A 200 stream that ended without ``data: [DONE]``."""
ERROR_BAD_BODY = "invalid_response"
"""A 200 response whose body is not the JSON an OpenAI-compatible server sends."""


@dataclass(frozen=True, slots=True)
class Exchange:
    """The client's view of one request; times are `time.perf_counter` seconds."""

    status: int
    error: str | None
    t_start: float
    t_end: float
    output_times: tuple[float, ...]
    tokens_in: int | None = None
    tokens_out: int | None = None
    cached_tokens: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.output_times[0] - self.t_start if self.output_times else None

    @property
    def itl_s(self) -> tuple[float, ...]:
        times = self.output_times
        return tuple(b - a for a, b in itertools.pairwise(times))

    @property
    def e2e_s(self) -> float:
        return self.t_end - self.t_start


def make_session(*, connection_limit: int = 10_000, read_timeout_s: float = 300.0) -> aiohttp.ClientSession:
    """One session per run: keep-alive pool, no total timeout (streams are long), per-read timeout."""
    connector = aiohttp.TCPConnector(limit=connection_limit, keepalive_timeout=60, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)


async def send_request(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: Mapping[str, str], *, stream: bool
) -> Exchange:
    """POST ``body`` to ``url`` and measure it; see the module docstring for the timing rules."""
    t_start = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                raw = await resp.read()
                return Exchange(resp.status, error_code(raw, resp.status), t_start, time.perf_counter(), ())
            if stream:
                return await _read_stream(resp.content, t_start)
            raw = await resp.read()
            t_end = time.perf_counter()
            return _from_body(raw, t_start, t_end)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return Exchange(0, type(exc).__name__, t_start, time.perf_counter(), ())


def error_code(raw: bytes, status: int) -> str:
    """The OpenAI error ``code`` (or ``type``) from an error body, else ``http_<status>``."""
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return f"http_{status}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        if code:
            return str(code)
    return f"http_{status}"


class _StreamState:
    """Accumulates one stream's output times, usage and error while lines arrive."""

    __slots__ = ("done", "error", "output_times", "usage")

    def __init__(self) -> None:
        self.output_times: list[float] = []
        self.usage: Mapping[str, Any] | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, line: bytes, now: float) -> None:
        if line[:5] != b"data:":
            return  # comments, event names
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            event = orjson.loads(payload)
            choices = event.get("choices")
            usage = event.get("usage")
        except (orjson.JSONDecodeError, AttributeError):
            self.error = ERROR_BAD_BODY
            return
        if choices and _has_output(choices[0]):
            self.output_times.append(now)
        elif "error" in event:
            self.error = error_code(payload, 200)
        if usage:
            self.usage = usage


def _has_output(choice: Any) -> bool:
    delta = choice.get("delta")
    if delta:
        return bool(
            delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls")
        )
    return bool(choice.get("text"))


async def _read_stream(content: aiohttp.StreamReader, t_start: float) -> Exchange:
    state = _StreamState()
    buffer = b""
    async for data in content.iter_any():
        now = time.perf_counter()
        buffer += data
        if b"\n" not in data:
            continue
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line:  # half the lines are the blank event separators
                state.feed(line, now)
    if buffer:
        state.feed(buffer, time.perf_counter())
    t_end = time.perf_counter()
    error = state.error or (None if state.done else ERROR_INCOMPLETE)
    tokens_in, tokens_out, cached = _usage(state.usage)
    return Exchange(200, error, t_start, t_end, tuple(state.output_times), tokens_in, tokens_out, cached)


def _from_body(raw: bytes, t_start: float, t_end: float) -> Exchange:
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return Exchange(200, ERROR_BAD_BODY, t_start, t_end, ())
    if not isinstance(payload, dict):
        return Exchange(200, ERROR_BAD_BODY, t_start, t_end, ())
    if "error" in payload:
        return Exchange(200, error_code(raw, 200), t_start, t_end, ())
    tokens_in, tokens_out, cached = _usage(payload.get("usage"))
    # Without streaming the first token reaches the client with the rest: TTFT is E2E.
    return Exchange(200, None, t_start, t_end, (t_end,), tokens_in, tokens_out, cached)


def _usage(usage: Mapping[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    """Tokens in, out and reused. With a usage object but no ``cached_tokens`` the engine reused
    nothing: vLLM writes ``prompt_tokens_details`` only when its count is above 0 (null in a
    whole answer, absent from a stream's usage chunk), so the absence reads as 0, not unknown
    (else a hit rate over the requests that report would count only the hits)."""
    if not usage:
        return None, None, None
    details = usage.get("prompt_tokens_details") or {}
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), details.get("cached_tokens") or 0
