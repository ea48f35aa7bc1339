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
``StreamSplice`` (here) follows what the client of a continuable stream has seen and, once
resumed (``resume``), splices the next upstream into the client's stream: the new role-only chunk is
dropped, the chunk ``id`` is the first upstream's, and usage counts from the original prompt and
the tokens already sent. The relay (``gateway/pipeline/relay.py``) only forwards: it hands each
chunk of a tracked stream to the splice, which may rewrite it. Tracking and splicing read OpenAI
choice chunks: only a dialect that streams them may say a stream can be continued
(``Dialect.can_continue``).

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
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from gateway.dialects.base import ChunkReading
from gateway.dialects.openai_answers import OUTPUT_DELTA_KEYS, has_output
from gateway.engines import engine
from gateway.policy.model import BackendKind
from gateway.types import InferenceRequest

_MAX_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens")


class StreamProgress:
    """What the client of a stream has seen so far: enough to continue it elsewhere.

    ``tokens`` and ``prompt_tokens`` come from the latest per-chunk usage (None until one was
    seen: without it the count is unknown and the stream cannot be continued exactly).
    ``continuable`` turns False for what a partial assistant message cannot express: several
    choices, tool calls or reasoning in progress, or a finish reason already sent.
    """

    __slots__ = ("base_tokens", "chunk_id", "continuable", "pieces", "prompt_tokens", "tokens")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.base_tokens = 0
        self.chunk_id: str | None = None
        self.continuable = True

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Spliced(NamedTuple):
    """A chunk of a tracked stream after the splice read it: what the relay times and counts
    (``reading``, its usage spliced after a resume), and whether the chunk's JSON was changed
    and must be serialised again (``rewritten``)."""

    reading: ChunkReading
    rewritten: bool


class StreamSplice:
    """Follows one continuable stream for its client, across every upstream that serves it.

    The relay hands it each chunk (``take``); the attempts loop reads ``progress`` when the
    stream breaks, builds the continuation (``continuation``) and, before the next upstream,
    calls ``resume``. One per request, created with its relay."""

    __slots__ = ("_on_resumed_output", "_resumed", "progress")

    def __init__(self) -> None:
        self.progress = StreamProgress()
        self._resumed = False
        self._on_resumed_output: Callable[[], None] | None = None

    def resume(self, on_output: Callable[[], None] | None = None) -> None:
        """The next upstream continues the stream; ``on_output`` at its first output (its prefill done)."""
        assert self.progress.tokens is not None
        self.progress.base_tokens = self.progress.tokens
        self._resumed = True
        self._on_resumed_output = on_output

    def not_continuable(self) -> None:
        """What happened cannot be continued elsewhere (a rejection, a protocol error)."""
        self.progress.continuable = False

    def take(self, chunk: dict[str, Any], reading: ChunkReading) -> Spliced | None:
        """Record ``chunk``; rewrite it (in place) when it must change on its way out. None: drop
        it (a continuation's own role chunk: the client had one already)."""
        progress = self.progress
        output, usage, reasons, _ = reading
        choices = chunk.get("choices")
        rewritten = False
        if self._resumed:
            if choices and not (output or reasons):
                return None
            if progress.chunk_id is not None and chunk.get("id") != progress.chunk_id:
                chunk["id"] = progress.chunk_id
                rewritten = True
            if usage:
                usage = chunk["usage"] = _spliced_usage(usage, progress)
                reading = (output, usage, reasons, reading[3])
                rewritten = True
        elif progress.chunk_id is None and isinstance(chunk.get("id"), str):
            progress.chunk_id = chunk["id"]
        if usage and isinstance(usage.get("completion_tokens"), int):
            progress.tokens = usage["completion_tokens"]
            if progress.prompt_tokens is None and isinstance(usage.get("prompt_tokens"), int):
                progress.prompt_tokens = usage["prompt_tokens"]
        if choices:
            _track(progress, choices)
        if output and self._on_resumed_output is not None:
            hook, self._on_resumed_output = self._on_resumed_output, None
            hook()
        return Spliced(reading, rewritten)


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


def _track(progress: StreamProgress, choices: list[dict[str, Any]]) -> None:
    """Add choice 0's text to ``progress``, or mark it not continuable."""
    for choice in choices:
        if not has_output(choice):
            if choice.get("finish_reason"):
                progress.continuable = False
            continue
        delta = choice.get("delta")
        text = delta.get("content") if delta else choice.get("text")
        plain = isinstance(text, str) and not (delta and _other_output(delta))
        if choice.get("index", 0) != 0 or choice.get("finish_reason") or not plain:
            progress.continuable = False
        else:
            progress.pieces.append(str(text))


_OTHER_OUTPUT_KEYS = OUTPUT_DELTA_KEYS[1:]


def _other_output(delta: dict[str, Any]) -> bool:
    """Whether a delta carries output other than content (reasoning, tool calls); a loop, not a
    generator, since it runs for every relayed chunk of a tracked stream."""
    for key in _OTHER_OUTPUT_KEYS:  # noqa: SIM110 (see the docstring)
        if delta.get(key):
            return True
    return False


def _spliced_usage(usage: Mapping[str, Any], progress: StreamProgress) -> dict[str, Any]:
    """A continuation's usage as the client's one stream: its prompt, all its tokens."""
    completion = int(usage.get("completion_tokens") or 0) + progress.base_tokens
    prompt = progress.prompt_tokens if progress.prompt_tokens is not None else int(usage.get("prompt_tokens") or 0)
    return {**usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
