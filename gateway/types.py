"""Value types shared by the request path: what a request is once parsed, and its API."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


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

    def upstream_body(self) -> bytes:
        if not self.body_modified:
            return self.raw_body
        import orjson

        return orjson.dumps(self.body)
