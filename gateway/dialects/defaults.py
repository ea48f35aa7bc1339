"""The members most APIs share, written once: each dialect class states only what differs.

``OpenAIDialect`` holds the OpenAI APIs' values (chat, completions, embeddings): every backend
that serves the API answers it natively (no ``translation``); its stream is OpenAI choice
chunks under unnamed SSE events ending with ``[DONE]``, whose usage ``stream_options`` asks
for, and a failed stream ends with vLLM's ``data: {"error": ...}``; its whole answer holds
``choices`` or ``data`` with ``usage``; its errors are OpenAI's ``{"error": {...}}``; the
engine keeps no answer for a later request to name (``gateway/dialects/openai_answers.py`` has
the functions). Every dialect is built on it, the other vendors' APIs too, and overrides a
default by defining the member: of the defaults, Responses keeps the error answer and the
passthrough, Messages only the absence of state on the engine.

``WholeAnswerOnly`` adds what the APIs that generate nothing share (the tokenizer's, rerank and
score, token counting): no output bound, never streamed (``never_streamed``), never continued.

What no default fits, each dialect states: its identity (``name``, ``path``, ``operation``), its
body rules (``fields``, ``prompt_field``, ``screen``, ``stream_flags``, ``prompt_tokens``,
``render``), which backends serve it (``serves``) and, unless it is a ``WholeAnswerOnly``, its
output bound and whether it continues (``output_aliases``, ``output_field``, ``can_continue``,
``continue_body``).

A default is the shared function itself (a ``staticmethod``), so reading it on the hot path
gives the function, as when each class listed it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.dialects.openai_answers import (
    answer_usage,
    is_openai_answer,
    no_answer_id,
    no_previous_id,
    no_translation,
    openai_error_body,
    read_choices_chunk,
    stream_flag,
    stream_usage_fields,
)
from gateway.errors import InvalidRequest, sse_error_event
from gateway.policy.model import BackendKind


class OpenAIDialect:
    """The OpenAI defaults of the ``Dialect`` members (module docstring); subclassed, never used alone."""

    __slots__ = ()

    sse_event_names = False
    ends_with_done = True
    keeps_state = False
    error_event = staticmethod(sse_error_event)
    error_body = staticmethod(openai_error_body)
    translation = staticmethod(no_translation)
    answer_id = staticmethod(no_answer_id)
    previous_id = staticmethod(no_previous_id)
    read_chunk = staticmethod(read_choices_chunk)
    answer_usage = staticmethod(answer_usage)
    is_answer = staticmethod(is_openai_answer)
    stream_usage_fields = staticmethod(stream_usage_fields)


def never_streamed(body: dict[str, Any], what: str) -> tuple[bool, bool]:
    """``Dialect.stream_flags`` of an API that is never streamed: ``stream: true`` is refused."""
    if stream_flag(body):
        raise InvalidRequest(f"{what} cannot be streamed.", param="stream")
    return False, False


class WholeAnswerOnly(OpenAIDialect):
    """The members of a dialect without output: no bound, no stream, no continuation (module
    docstring: the tokenizer's dialects, rerank and score, token counting)."""

    __slots__ = ()

    output_aliases: tuple[str, ...] = ()

    def output_field(self, kind: BackendKind) -> str | None:
        return None

    def stream_usage_fields(self, body: dict[str, Any], per_chunk: bool) -> Mapping[str, Any]:
        return {}  # never streamed

    def can_continue(self, body: dict[str, Any]) -> bool:
        return False

    def continue_body(self, body: dict[str, Any], partial: str) -> None:
        raise AssertionError("an answer that is never streamed is never continued")
