"""A tiny OpenAI-compatible backend for the load generator's tests, in raw ASGI.

It streams chunks shaped like vLLM's: a first chunk carrying only the role (with ``content: ""``),
content chunks with ``"usage": null`` when usage was asked for, a chunk with ``finish_reason``,
a chunk with ``"choices": []`` and the usage totals (``prompt_tokens_details.cached_tokens``),
then ``data: [DONE]``. With the default zero delays it is the zero-delay backend that the
generator's ceiling is measured against; run it in its own process with
``uvicorn --factory tests.loadtests.fake_backend:create_app``.

``tokens_per_chunk`` > 1 makes usage disagree with the chunk count, which is how a test proves
that token counts come from usage. ``error_every`` = n answers every n-th request with
``error_status`` and an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_JSON_HEADERS = [(b"content-type", b"application/json")]


@dataclass
class FakeBackend:
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0
    tokens_per_chunk: int = 1
    cached_tokens: int = 0
    error_every: int = 0
    error_status: int = 429
    error_code: str = "rate_limit_exceeded"
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    keep: bool = True
    """Keep request bodies and headers for assertions (off for the ceiling benchmark)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":
            await _respond(send, 200, b'{"status":"ok"}')
            return
        body = await _read_body(receive)
        request = orjson.loads(body)
        if self.keep:
            self.bodies.append(request)
            self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        count = len(self.bodies) if self.keep else 0
        if self.error_every and count % self.error_every == 0:
            error = {"error": {"message": "fake", "type": "fake", "code": self.error_code}}
            await _respond(send, self.error_status, orjson.dumps(error))
            return
        if request.get("stream"):
            await self._stream(send, receive, request)
        else:
            await _respond(send, 200, orjson.dumps(self._completion(request)))

    def _usage(self, request: dict[str, Any]) -> dict[str, Any]:
        messages = request.get("messages") or [{"content": request.get("prompt", "")}]
        prompt = sum(len(m["content"].split()) for m in messages)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": request["max_tokens"],
            "total_tokens": prompt + request["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _completion(self, request: dict[str, Any]) -> dict[str, Any]:
        text = " ".join(["tok"] * request["max_tokens"])
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": "length"}
        return {"id": "cmpl-fake", "object": "chat.completion", "choices": [choice], "usage": self._usage(request)}

    async def _stream(self, send: Send, receive: Receive, request: dict[str, Any]) -> None:
        chat = "messages" in request
        usage_on = bool((request.get("stream_options") or {}).get("include_usage"))
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        if chat:
            await _event(send, _chunk({"role": "assistant", "content": ""}, None, usage_on))
        if self.first_token_delay_s and await _client_left_within(receive, self.first_token_delay_s):
            return  # like an engine aborting a request whose client went away
        remaining = request["max_tokens"]
        while remaining > 0:
            n = min(self.tokens_per_chunk, remaining)
            remaining -= n
            text = " tok" * n
            await _event(send, _chunk({"content": text}, None, usage_on) if chat else _text(text, usage_on))
            if remaining and self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
        await _event(send, _chunk({"content": ""}, "length", usage_on) if chat else _text("", usage_on, "length"))
        if usage_on:
            await _event(send, {"id": "x", "object": "chat.completion.chunk", "created": int(time.time()),
                                "choices": [], "usage": self._usage(request)})  # fmt: skip
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _chunk(delta: dict[str, Any], finish: str | None, usage_on: bool) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    chunk: dict[str, Any] = {"id": "x", "object": "chat.completion.chunk", "choices": [choice]}
    if usage_on:
        chunk["usage"] = None
    return chunk


def _text(text: str, usage_on: bool, finish: str | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": "x", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "finish_reason": finish}]}  # fmt: skip
    if usage_on:
        chunk["usage"] = None
    return chunk


async def _event(send: Send, payload: dict[str, Any]) -> None:
    await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(payload) + b"\n\n", "more_body": True})


async def _respond(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON_HEADERS})
    await send({"type": "http.response.body", "body": body})


async def _client_left_within(receive: Receive, seconds: float) -> bool:
    """Wait ``seconds`` unless the client disconnects first (so a server can stop promptly)."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    try:
        await asyncio.wait_for(disconnected(), seconds)
    except TimeoutError:
        return False
    return True


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def create_app() -> FakeBackend:
    """Factory for ``uvicorn --factory``: the zero-delay backend, keeping nothing."""
    return FakeBackend(keep=False)
