"""A small llama.cpp server for the tests, served for real on loopback: what the gateway reads of one.

It answers ``GET /props`` (``total_slots`` and ``default_generation_settings.n_ctx``, as
``llama-server`` does), ``GET /metrics`` as ``llama-server --metrics`` (its gauges
``llamacpp:requests_processing`` and ``llamacpp:requests_deferred``, no labels), ``GET /health``,
and chat completions (whole answers). The test thread turns the knobs: ``deferred`` (requests the
engine says it queued for want of a slot), ``props_status`` and ``metrics_status`` (an engine whose
page fails), and reads ``chats``, the chat requests it was sent, to tell what reached it and when.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from tests.policy_builder import CHAT_MODEL, KEY_ACME, backend, build_policy, model, tenant

LLAMA = "llama"
"""The backend's name in ``llamacpp_policy``."""


def llamacpp_policy(engine_url: str, capacity: Any = "auto", max_wait_s: float = 30, **sections: Any) -> str:
    """A policy whose one backend, ``llama``, is the llama.cpp server at ``engine_url`` with ``capacity``;
    tenant acme only (an unsalted engine), scrapes and health checks every 50 ms (a page stays fresh
    for a second: ``scrape.fresh_s``), no retries, interactive requests waiting up to ``max_wait_s``."""
    llama = backend(LLAMA, engine_url, [CHAT_MODEL], kind="llamacpp", capacity=capacity)
    return build_policy(
        engine_url,
        backends=[llama],
        models=[model(CHAT_MODEL, max_prompt_tokens=64, max_output_tokens=32)],
        tenants=[tenant("acme", KEY_ACME)],
        classes={"interactive": {"queue": {"max_wait_s": max_wait_s}}},
        scrape={"interval_s": 0.05, "timeout_s": 0.5},
        health_checks={"interval_s": 0.05, "timeout_s": 0.5},
        retry={"max_retries": 0},
        **sections,
    )


@dataclass
class FakeLlamacpp:
    slots: int = 2
    n_ctx: int = 4096
    deferred: int = 0
    props_status: int = 200
    metrics_status: int = 200
    chats: list[dict[str, object]] = field(default_factory=list)
    props_reads: int = 0

    @property
    def kv_cache_tokens(self) -> int:
        """What the gateway computes from ``/props``: one context per slot."""
        return self.slots * self.n_ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if path == "/health":
            await _respond(send, 200, b'{"status":"ok"}')
        elif path == "/props":
            self.props_reads += 1
            props = {"total_slots": self.slots, "default_generation_settings": {"n_ctx": self.n_ctx}}
            await _respond(send, self.props_status, orjson.dumps(props))
        elif path == "/metrics":
            page = (
                "# HELP llamacpp:requests_processing Number of requests processing.\n"
                "# TYPE llamacpp:requests_processing gauge\n"
                f"llamacpp:requests_processing {min(self.slots, len(self.chats))}\n"
                "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
                "# TYPE llamacpp:requests_deferred gauge\n"
                f"llamacpp:requests_deferred {self.deferred}\n"
            )
            await _respond(send, self.metrics_status, page.encode(), b"text/plain; version=0.0.4")
        elif path == "/v1/chat/completions":
            await self._chat(receive, send)
        else:
            await _respond(send, 404, b'{"error": {"message": "not found", "type": "not_found_error"}}')

    async def _chat(self, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        document = orjson.loads(body)
        self.chats.append(document)
        answer = {
            "id": "chatcmpl-llama",
            "object": "chat.completion",
            "created": 1,
            "model": document["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }
        await _respond(send, 200, orjson.dumps(answer))


async def _respond(send: Send, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body})
