"""How the OpenAI APIs answer: the ``stream``/``stream_options`` flags, the choice chunks of a
stream, and whole answers.

Shared by the chat, completions and embeddings dialects (embeddings are never streamed), with
their ``serves``: whether a kind answers the API, from its record in ``gateway/engines.py``. The
defaults every dialect is built on (``OpenAIDialect``, ``gateway/dialects/defaults.py``) are
these functions.

**Flags.** ``stream`` is a boolean (``null`` means false); ``stream_options.include_usage`` says
whether the client wants the usage chunk. The gateway asks the engine for usage in every stream
anyway (``stream_usage_fields``: it settles the tenant's tokens and records usage from it), and
for vLLM's per-chunk usage (``continuous_usage_stats``) when the stream may have to be continued
elsewhere (``gateway/pipeline/migration.py``); the relay hides from the client what it did not ask for.

**Chunks.** A chunk carries output when one of its choices has a content, reasoning or
tool-call delta (chat) or a ``text`` (completions). Both shapes count on both APIs: an engine
that answers one API in the other's shape is still timed. vLLM's first, role-only chunk
carries none. Usage is the chunk's ``usage`` object (already in the gateway's shape); the
usage-only chunk has ``"choices": []``.

**Prompt tokens reused** (``usage.prompt_tokens_details.cached_tokens``): vLLM (under
``--enable-prompt-tokens-details``), SGLang (under ``--enable-cache-report``) and llama.cpp since
its PR #19361 write them there, vLLM and SGLang only when above 0 (else the details are null or
absent: 0, or the switch is off). llama.cpp before that PR writes them only in the chunk's or
answer's top-level ``timings.cache_n``: the usage read then gets ``prompt_tokens_details:
{"cached_tokens": cache_n}`` (``with_cache_n``), in a new mapping (the relay may forward the
chunk's bytes as they came). llama.cpp puts ``timings`` on the last chunk it sends: the usage chunk,
which the gateway always asks for (``stream_usage_fields``), so the count is always read there;
the ``finish_reason`` chunk carries them only in a stream without a usage chunk, and is not read
for them (a usage from a chunk whose ``usage`` is absent would be mistaken for per-chunk usage to
cut out of it). A chunk without usage costs nothing more: ``timings`` is looked for only beside a
usage.

**Whole answers** are objects with ``choices`` (chat, completions) or ``data`` (embeddings)
(``is_openai_answer``), their usage in ``usage``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.dialects.base import NO_OUTPUT, OUTPUT, ChunkReading, Translation
from gateway.engines import engine
from gateway.errors import GatewayError, InvalidRequest
from gateway.policy.model import Backend, BackendKind

OUTPUT_DELTA_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")
"""The delta fields that are generated output (a role alone is not)."""


def stream_flag(body: dict[str, Any]) -> bool:
    """The body's ``stream`` (``null`` and absent mean false)."""
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    return stream


def usage_flag(body: dict[str, Any]) -> bool:
    """Whether the client asked for the usage chunk (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidRequest("'stream_options.include_usage' must be a boolean.", param="stream_options.include_usage")
    return include_usage


def stream_usage_fields(body: dict[str, Any], per_chunk: bool) -> Mapping[str, Any]:
    """``stream_options`` asking for usage at the end (and per chunk), keeping the client's own
    switches; empty when the body already asks for exactly that."""
    options = body.get("stream_options")
    wanted = {**(options or {}), "include_usage": True}
    if per_chunk:
        wanted["continuous_usage_stats"] = True
    return {} if wanted == options else {"stream_options": wanted}


def has_output(choice: dict[str, Any]) -> bool:
    """Whether a chunk's choice carries generated output (vLLM's role-only chunk does not)."""
    delta = choice.get("delta")
    if delta:
        for key in OUTPUT_DELTA_KEYS:  # noqa: SIM110 (a loop, not any(...): no generator per relayed chunk)
            if delta.get(key):
                return True
        return False
    return bool(choice.get("text"))


def read_choices_chunk(chunk: dict[str, Any]) -> ChunkReading:
    """``ChunkReading`` of an OpenAI chunk (module docstring); the common token chunk allocates nothing."""
    usage = chunk.get("usage")
    if usage is not None:
        if not (usage and isinstance(usage, dict)):
            usage = None
        elif "timings" in chunk:  # llama.cpp's: its cache_n when the usage has no cached_tokens
            usage = with_cache_n(usage, chunk["timings"])
    choices = chunk.get("choices")
    if not choices:
        return (False, usage, (), True) if usage is not None else NO_OUTPUT
    output = False
    reasons: tuple[str, ...] = ()
    for choice in choices:
        if has_output(choice):
            output = True
        reason = choice.get("finish_reason")
        if reason:
            reasons += (reason,)
    if usage is None and not reasons:
        return OUTPUT if output else NO_OUTPUT
    return output, usage, reasons, False


def answer_usage(answer: dict[str, Any]) -> Mapping[str, Any] | None:
    """The ``usage`` object of a whole OpenAI answer (already in the gateway's shape), with
    llama.cpp's ``timings.cache_n`` as its cached tokens when it has none (``with_cache_n``)."""
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return None
    timings = answer.get("timings")
    return usage if timings is None else with_cache_n(usage, timings)


def with_cache_n(usage: dict[str, Any], timings: Any) -> dict[str, Any]:
    """``usage`` with ``prompt_tokens_details.cached_tokens`` set from llama.cpp's ``timings.cache_n``
    (an integer) when it has no integer there itself (llama.cpp before its PR #19361); ``usage``
    itself otherwise. Never changes ``usage``: a new dict (its other details kept)."""
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and _is_count(details.get("cached_tokens")):
        return usage
    cache_n = timings.get("cache_n") if isinstance(timings, dict) else None
    if not _is_count(cache_n):
        return usage
    merged = {**details, "cached_tokens": cache_n} if isinstance(details, dict) else {"cached_tokens": cache_n}
    return {**usage, "prompt_tokens_details": merged}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def answer_text(document: dict[str, Any]) -> str:
    """Choice 0's text in an OpenAI answer or chunk: a chat ``message`` or ``delta`` content, or a
    completion's ``text`` (what a quality scorer compares)."""
    for choice in document.get("choices") or ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            part = choice.get("delta") or choice.get("message")
            text = part.get("content") if isinstance(part, dict) else choice.get("text")
            return text if isinstance(text, str) else ""
    return ""


def no_answer_id(document: dict[str, Any]) -> str | None:
    """``Dialect.answer_id`` of an API whose answers no later request names."""
    return None


def no_previous_id(body: dict[str, Any]) -> str | None:
    """``Dialect.previous_id`` of an API without conversation state on the engine."""
    return None


def openai_error_body(error: GatewayError) -> bytes:
    """``Dialect.error_body`` of the OpenAI APIs: ``{"error": {"message", "type", "param", "code"}}``."""
    return error.body()


def serves_chat(kind: BackendKind) -> bool:
    """``Dialect.serves`` of chat (and of Messages, which may be translated to chat): the kind's record."""
    return engine(kind).serves_chat


def serves_completions(kind: BackendKind) -> bool:
    """``Dialect.serves`` of completions: the kind's record (``gateway/engines.py``)."""
    return engine(kind).serves_completions


def serves_responses(kind: BackendKind) -> bool:
    """``Dialect.serves`` of Responses: the kind's record (``gateway/engines.py``)."""
    return engine(kind).serves_responses


def serves_embeddings(kind: BackendKind) -> bool:
    """``Dialect.serves`` of embeddings: the kind's record (``gateway/engines.py``)."""
    return engine(kind).serves_embeddings


def no_translation(backend: Backend, multi_scope: bool) -> Translation | None:
    """``Dialect.translation`` of an API every backend answers natively: always passed through."""
    return None


def is_openai_answer(document: dict[str, Any]) -> bool:
    """Whether a JSON object is shaped like an answer of the OpenAI APIs: ``choices`` (chat,
    completions) or ``data`` (embeddings). Their dialects' ``is_answer``."""
    return isinstance(document.get("choices"), list) or isinstance(document.get("data"), list)
