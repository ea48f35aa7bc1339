"""Stream migration: continue a stream whose backend died on another backend, unbroken.

Why: a backend that dies mid-stream (a crashed engine, a node drained, a network cut) would
otherwise end every stream it carried with an error, after the client has already shown half
an answer to its user. The client cannot retry without throwing that half away; the gateway
can do better, because it saw every token it relayed.

How: the gateway asks migratable backends for vLLM's per-chunk usage
(``stream_options.continuous_usage_stats``), so that it always knows exactly how many tokens
the client has received. When the stream breaks, the continuation request is the original
conversation plus the partial answer as a final assistant message to *continue* (vLLM's
``continue_final_message: true`` with ``add_generation_prompt: false``; for ``/v1/completions``
the prompt plus the partial text: each dialect's ``continue_body``, ``gateway/dialects/``),
with the output budget reduced by the tokens already sent.
The relay (``gateway/pipeline/relay.py``) splices the new upstream into the client's stream; the
client's usage counts its original prompt and every token it received.

What cannot be continued ends with the error event as before: backends that do not know
``continue_final_message`` (only vLLM and the simulator do: ``EngineKind.continuable`` in
``gateway/engines.py``), several choices (``n > 1``), tool
calls or reasoning in progress, what the dialect cannot continue (``Dialect.can_continue``:
embeddings, echoed prompts, token-id prompts), and streams whose exact token
count is unknown (a backend that ignored ``continuous_usage_stats``). A migration is a retry:
it spends from the retry budget, counts against ``retry.max_retries`` and never starts past the
request's deadline (``gateway/pipeline/handler.py`` decides).
"""

from __future__ import annotations

import dataclasses

from gateway.engines import engine
from gateway.pipeline.relay import StreamProgress
from gateway.policy.model import BackendKind
from gateway.types import InferenceRequest

_MAX_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens")


def can_continue(request: InferenceRequest, kind: BackendKind) -> bool:
    """Whether a stream of ``request`` from a backend of ``kind`` could be continued if it broke."""
    if not request.stream or not engine(kind).continuable or request.body.get("n", 1) not in (1, None):
        return False
    return request.api.can_continue(request.body)


def continuation(request: InferenceRequest, progress: StreamProgress) -> InferenceRequest | None:
    """The request that continues ``request`` after what ``progress`` says was sent; None if none can."""
    if not progress.continuable:
        return None
    text = progress.text
    if progress.tokens is None:
        if text:
            return None  # output was sent but its token count is unknown: usage would be wrong
        progress.tokens = 0
    if not text:
        return dataclasses.replace(request, prefix_keys=None)
    remaining = request.max_tokens - progress.tokens
    if remaining < 1:
        return None
    body = dict(request.body)
    for field in _MAX_TOKEN_FIELDS:
        if body.get(field) is not None:
            body[field] = remaining
    request.api.continue_body(body, text)
    return dataclasses.replace(
        request,
        body=body,
        body_modified=True,
        prompt_tokens=request.prompt_tokens + progress.tokens,
        max_tokens=remaining,
        prefix_keys=None,
    )
