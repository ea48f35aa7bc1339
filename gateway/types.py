"""Value types shared by the request path: what a request is once parsed, and its API."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.routing.prefix_keys import PrefixKeys


class Api(Enum):
    """The OpenAI endpoints the gateway proxies; the value is the upstream path."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"


@dataclass(slots=True)
class InferenceRequest:
    """A request that passed intake: parsed, size-checked and estimated, not yet routed.

    ``body`` is the parsed JSON; ``raw_body`` is forwarded as-is unless ``body_modified``
    says the gateway changed a field (clamped ``max_tokens``, added ``stream_options``, ...),
    which saves a re-serialisation on the common path. Times are ``Clock.now()`` seconds.
    ``session_id`` is the client's ``x-session-id`` (session-affinity routing); ``prefix_keys``
    caches the request's prefix block hashes, computed once by the first router that needs them
    (a queued request may be picked several times). ``client_wants_continuous_usage`` keeps
    per-chunk usage (vLLM's ``continuous_usage_stats``) that the gateway may ask for itself.
    """

    request_id: str
    api: Api
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
    client_wants_continuous_usage: bool = False

    def upstream_body(self) -> bytes:
        if not self.body_modified:
            return self.raw_body
        import orjson

        return orjson.dumps(self.body)
