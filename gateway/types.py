"""Value types shared by the request path: what a request is once parsed.

A request's API is its dialect (``gateway/dialects/``), the object that knows that API's
bodies and streams, rather than an enum that every per-API decision would branch on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.dialects.base import Dialect


@dataclass(frozen=True, slots=True)
class PrefixKeys:
    """The chained hashes of a request's full prompt blocks (``gateway/routing/prefix_keys.py``),
    and what they were computed for."""

    root: int
    block_tokens: int
    blocks: tuple[int, ...]


@dataclass(slots=True)
class InferenceRequest:
    """A request that passed intake: parsed, size-checked and estimated, not yet routed.

    ``body`` is the parsed JSON as validation left it (a model alias renamed, ``max_tokens``
    clamped, ...) and is never edited afterwards: each attempt builds its own body from it
    (``encode`` with that backend's fields, ``gateway/upstream/body.py``). ``raw_body`` is
    forwarded as-is when validation changed nothing (``body_modified``) and the attempt adds
    nothing, which saves a re-serialisation on the common path. Times are ``Clock.now()``
    seconds. ``api`` is the dialect of the endpoint it came in on (``gateway/dialects/``).
    ``session_id`` is the client's ``x-session-id`` (session-affinity routing);
    ``prefix_keys`` memoises the request's prefix block hashes, computed once by the first
    router that needs them (a queued request may be picked several times).
    """

    request_id: str
    api: Dialect
    model: str
    body: dict[str, Any]
    raw_body: bytes
    stream: bool
    client_wants_usage: bool
    prompt_tokens: int
    max_tokens: int
    arrival: float
    body_modified: bool = False
    session_id: str | None = None
    prefix_keys: PrefixKeys | None = None
    pinned_backend: str | None = None
    """The one backend that may answer: it holds the earlier answer the request continues
    (``previous_response_id``, ``gateway/responses/affinity.py``)."""
    public_previous_id: str | None = None
    """The client's ``previous_response_id`` when it is sealed (``gateway/responses/ids.py``): the
    body then carries the engine's own id, and the answer, which names it back, gets the client's."""
    engine_keys: dict[object, Any] | None = None
    """The request's token ids and block hashes as engines compute them, by hashing setting and
    salt (``gateway/routing/engine_view.py``): computed once, by the first pick that needs them."""

    @property
    def client_wants_continuous_usage(self) -> bool:
        """Whether the client itself asked for vLLM's per-chunk usage (else the relay hides it)."""
        options = self.body.get("stream_options")
        return bool(isinstance(options, dict) and options.get("continuous_usage_stats"))

    def encode(self, fields: Mapping[str, Any]) -> bytes:
        """The body with ``fields`` set on top, a None value removing its field; the client's own
        bytes when validation changed nothing and every field already holds in them."""
        body = self.body
        if not self.body_modified and all(
            (name not in body) if value is None else (body.get(name) == value and type(body.get(name)) is type(value))
            for name, value in fields.items()
        ):
            return self.raw_body
        if not fields:
            return orjson.dumps(body)
        merged = {**body, **fields}
        for name, value in fields.items():
            if value is None:
                del merged[name]
        return orjson.dumps(merged)
