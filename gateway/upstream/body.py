"""The body one attempt sends: the client's validated request plus what this backend needs.

Rule: the request a client sent is never edited after validation. Each attempt builds its
own body from that frozen request and the backend it goes to, so that nothing one backend
needed (vLLM's ``cache_salt`` or ``continuous_usage_stats``, an engine ``priority``) leaks into
a retry on a backend of another kind. The fields an attempt may set:

* the output bound (``gateway/request/output_length.py``): every alias the client may have sent
  (``max_tokens``, ``max_completion_tokens``, ``n_predict``) removed, and the request's one
  validated bound set in the field this kind of engine obeys;
* ``priority``: the class rank as the engine's priority, when the backend asks for it
  (``engine_priority``; vLLM runs lower numbers first, SGLang higher: ``EngineKind.priority_sign``
  in ``gateway/engines.py``);
* the isolation fields of the tenant on this kind of engine (``isolation_fields`` in
  ``gateway/routing/isolation.py``): ``cache_salt`` for engines whose prefix cache honours it,
  ``cache_prompt: false`` for llama.cpp under ``cache_isolation.unsalted: no_prompt_cache``;
  a client's own values are always overwritten. With the API the backend is called with, they
  are decided by ``attempt_isolation``, which every attempt and every shadow copy goes through;
* what makes the engine report usage in a stream (the dialect's ``stream_usage_fields``; for
  the OpenAI APIs ``stream_options``): always at the end (the gateway settles tokens and
  records usage from it), and per chunk when the stream may have to be continued elsewhere
  (``gateway/pipeline/migration.py``); the relay hides from the client what it did not ask for.

A field set to None is removed. When every field already holds in the client's body, its bytes
are forwarded as they came (no re-serialisation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.dialects.base import Dialect, Translation
from gateway.engines import engine
from gateway.policy.model import Backend, BackendKind, Tenant
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.output_length import output_length_edits
from gateway.routing.isolation import CacheSalter, isolation_fields
from gateway.types import InferenceRequest


@dataclass(frozen=True, slots=True)
class AttemptIsolation:
    """What keeps one attempt's prompt inside its tenant's cache scope on the backend it goes to:
    the API the backend is called with (``translation``; None: the client's own, passed through)
    and the body fields that isolate it (``isolation_fields``)."""

    translation: Translation | None
    fields: Mapping[str, object]


def attempt_isolation(
    api: Dialect, backend: Backend, tenant: Tenant, snapshot: PolicySnapshot, salter: CacheSalter
) -> AttemptIsolation:
    """The one decision every request sent to an engine goes through (a request's attempts,
    ``gateway/pipeline/attempt.py``, and its shadow copies, ``gateway/shadow/runner.py``): an API whose
    engine endpoint drops ``cache_salt`` (vLLM's ``/v1/messages``) is passed through only to a
    backend that one cache scope alone reaches, by any path (``snapshot.multi_scope_backends``)."""
    translation = api.translation(backend, backend.name in snapshot.multi_scope_backends)
    fields = isolation_fields(backend.kind, snapshot.policy.cache_isolation.unsalted, salter, tenant)
    return AttemptIsolation(translation, fields)


def engine_priority(kind: BackendKind, rank: int) -> int:
    """The class rank as the engine's ``priority``: vLLM runs lower numbers first, SGLang higher
    (``EngineKind.priority_sign``)."""
    return engine(kind).priority_sign * rank


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
