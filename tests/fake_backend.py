"""A scriptable OpenAI-compatible backend for the gateway's tests, served for real on loopback.

It answers like vLLM (chunk shapes, usage chunk, ``[DONE]``) but lets a test decide what
happens: the number of tokens, a failure status, a stream cut short, a pause until the test
releases a gate. Every request it receives is kept (headers and body) so that a test can
check what the gateway forwarded, e.g. that the client's key never reaches the backend.
The simulated engine under ``loadtests/sim`` is the realistic backend; this one is for faults.

Hostile answers, for the gateway's error mapping: ``statuses`` fails the next requests one by
one (then ``status`` applies); ``error_body`` may hold ``{echo}``, replaced by the request's
headers and body (JSON-string-escaped, so it fits a JSON string and an HTML page alike), the
way a backend that echoes its request leaks the gateway's credential; ``error_headers`` sets
the error's content type and Retry-After; ``answer_body`` replaces a 200 non-streamed answer
(an HTML page, an echo); ``stream_script`` replaces a streamed answer by raw body pieces sent
one by one (CRLF framing, comments, error events), each ``{echo}`` replaced too.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

ENGINE_INFO_PATHS = frozenset({"/props", "/server_info", "/get_server_info"})
"""Where the gateway reads llama.cpp's and SGLang's own limits (``gateway/dispatch/engine_limits.py``):
the fake is no particular engine, so it answers 404 there (the gateway then says the limits are
unknown) and does not count the read among the requests it received."""


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeBackend:
    """Behaviour knobs, read on every request; the test thread sets them before sending."""

    tokens: int = 4
    status: int = 200
    error_body: bytes = b'{"error": {"message": "boom", "type": "BadRequestError", "param": null, "code": 400}}'
    cut_after: int | None = None  # close the stream after this many content chunks, without [DONE]
    gate: threading.Event | None = None  # when set, wait for it before each content chunk after the first
    waiting: int = 0  # reported as vllm:num_requests_waiting on /metrics
    received: list[Received] = field(default_factory=list)
    disconnects: int = 0
    statuses: list[int] = field(default_factory=list)  # consumed one per inference request, before ``status``
    error_headers: list[tuple[bytes, bytes]] = field(default_factory=lambda: [(b"content-type", b"application/json")])
    answer_body: bytes | None = None  # a 200 non-streamed answer as is
    active: int = 0  # inference requests being answered now
    most_active: int = 0  # the most ever answered at once (what a capacity bound must keep down)
    stream_script: list[bytes] | None = None  # a 200 streamed answer as these raw pieces

    def reset_hostile(self) -> None:
        """Back to well-behaved answers (the knobs above ``received`` are reset by the fixture)."""
        self.statuses, self.answer_body, self.stream_script = [], None, None
        self.error_headers = [(b"content-type", b"application/json")]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["path"] == "/health":
            await _respond(send, 200, b"")
            return
        if scope["path"] in ENGINE_INFO_PATHS:  # the gateway reading an engine's own limits: not one of ours
            await _respond(send, 404, b"")
            return
        if scope["path"] == "/metrics":
            page = f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}\n'
            await _respond(send, 200, page.encode())
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        document = orjson.loads(body) if body else {}
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.received.append(Received(scope["path"], headers, document))
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            await self._answer(scope, document, headers, body, send)
        finally:
            self.active -= 1

    async def _answer(
        self, scope: Scope, document: dict[str, Any], headers: dict[str, str], body: bytes, send: Send
    ) -> None:
        echo = orjson.dumps(f"headers={headers} body={body.decode(errors='replace')}")[1:-1]
        status = self.statuses.pop(0) if self.statuses else self.status
        if status != 200:
            await _respond(send, status, self.error_body.replace(b"{echo}", echo), self.error_headers)
        elif document.get("stream") and self.stream_script is not None:
            await _respond_in_pieces(send, [piece.replace(b"{echo}", echo) for piece in self.stream_script])
        elif document.get("stream"):
            await self._stream(document, send)
        elif self.answer_body is not None:
            await _respond(send, 200, self.answer_body.replace(b"{echo}", echo), self.error_headers)
        else:
            await _respond(send, 200, orjson.dumps(self._completion(scope["path"], document)))

    def _completion(self, path: str, document: dict[str, Any]) -> dict[str, Any]:
        usage = {"prompt_tokens": 7, "completion_tokens": self.tokens, "total_tokens": 7 + self.tokens}
        if path == "/v1/embeddings":
            return {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                "model": document["model"],
                "usage": {"prompt_tokens": 7, "total_tokens": 7},
            }
        if path == "/v1/completions":
            return {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": document["model"],
                "choices": [{"index": 0, "text": " tok" * self.tokens, "finish_reason": "length"}],
                "usage": usage,
            }
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": document["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " tok" * self.tokens},
                    "finish_reason": "length",
                }
            ],
            "usage": usage,
        }

    async def _stream(self, document: dict[str, Any], send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        options = document.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": document["model"]}
        extra: dict[str, Any] = {"usage": None} if include_usage else {}

        def so_far(tokens: int) -> dict[str, Any]:
            """vLLM's per-chunk usage with ``continuous_usage_stats``, else ``extra``."""
            if not continuous:
                return extra
            return {"usage": {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": 7 + tokens}}

        async def event(payload: dict[str, Any]) -> None:
            await send(
                {"type": "http.response.body", "body": b"data: " + orjson.dumps(payload) + b"\n\n", "more_body": True}
            )

        await event(
            {
                **base,
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ],
                **so_far(0),
            }
        )
        for i in range(self.tokens):
            if self.cut_after is not None and i == self.cut_after:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            gate = self.gate
            if gate is not None and i > 0:
                await asyncio.to_thread(gate.wait, 10)
                gate.clear()
            await event(
                {
                    **base,
                    "choices": [{"index": 0, "delta": {"content": f" t{i}"}, "logprobs": None, "finish_reason": None}],
                    **so_far(i + 1),
                }
            )
        await event(
            {
                **base,
                "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}],
                **so_far(self.tokens),
            }
        )
        if include_usage:
            await event(
                {
                    **base,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": 7,
                        "completion_tokens": self.tokens,
                        "total_tokens": 7 + self.tokens,
                        "prompt_tokens_details": {"cached_tokens": 0},
                    },
                }
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = headers if headers is not None else [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _respond_in_pieces(send: Send, pieces: list[bytes]) -> None:
    """A 200 event stream sent as exactly these body pieces (one ``send`` each)."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for piece in pieces:
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _lifespan(receive: Receive, send: Send) -> None:
    await receive()
    await send({"type": "lifespan.startup.complete"})
    await receive()
    await send({"type": "lifespan.shutdown.complete"})
