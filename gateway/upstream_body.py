"""The body one attempt sends: the client's validated request plus what this backend needs.

Rule: the request a client sent is never edited after validation. Each attempt builds its
own body from that frozen request and the backend it goes to, so that nothing one backend
needed (vLLM's ``cache_salt`` or ``continuous_usage_stats``, an engine ``priority``) leaks into
a retry on a backend of another kind. The fields an attempt may set:

* the output bound (``gateway/output_length.py``): every alias the client may have sent
  (``max_tokens``, ``max_completion_tokens``, ``n_predict``) removed, and the request's one
  validated bound set in the field this kind of engine obeys;
* ``priority``: the class rank as the engine's priority, when the backend asks for it
  (``engine_priority``; vLLM runs lower numbers first, SGLang higher);
* the isolation fields of the tenant on this kind of engine (``isolation_fields`` in
  ``gateway/routing/isolation.py``): ``cache_salt`` for engines whose prefix cache honours it,
  ``cache_prompt: false`` for llama.cpp under ``cache_isolation.unsalted: no_prompt_cache``;
  a client's own values are always overwritten;
* what makes the engine report usage in a stream (the dialect's ``stream_usage_fields``; for
  the OpenAI APIs ``stream_options``): always at the end (the gateway settles tokens and
  records usage from it), and per chunk when the stream may have to be continued elsewhere
  (``gateway/migration.py``); the relay hides from the client what it did not ask for.

A field set to None is removed. When every field already holds in the client's body, its bytes
are forwarded as they came (no re-serialisation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gateway.dialects.base import Translation
from gateway.output_length import output_length_edits
from gateway.policy.model import Backend, BackendKind
from gateway.types import InferenceRequest


def engine_priority(kind: BackendKind, rank: int) -> int:
    """The class rank as the engine's ``priority``: vLLM runs lower numbers first, SGLang higher."""
    return -rank if kind is BackendKind.SGLANG else rank


def attempt_fields(
    request: InferenceRequest, backend: Backend, *, isolation: Mapping[str, object], rank: int, track: bool
) -> dict[str, Any]:
    """The fields this attempt sets on top of the client's body (see the module docstring)."""
    fields: dict[str, Any] = dict(isolation)
    fields.update(output_length_edits(backend.kind, request.api, request.max_tokens))
    if backend.engine_priority:
        fields["priority"] = engine_priority(backend.kind, rank)
    if request.stream:
        fields.update(request.api.stream_usage_fields(request.body, track))
    return fields


def attempt_body(
    request: InferenceRequest, backend: Backend, *, isolation: Mapping[str, object], rank: int, track: bool
) -> bytes:
    """The bytes of this attempt's request body."""
    return request.encode(attempt_fields(request, backend, isolation=isolation, rank=rank, track=track))


def translated_request(request: InferenceRequest, translation: Translation) -> InferenceRequest:
    """``request`` as the API ``translation`` calls the backend with (Messages as chat completions):
    its body translated, usage always asked for (the translation turns it into the client's)."""
    body = translation.request_body(request.body)
    return dataclasses.replace(
        request, api=translation.upstream, body=body, body_modified=True, client_wants_usage=True
    )
