"""``POST /v1/messages/count_tokens``: Anthropic's token counting, as vLLM serves it.

The anthropic SDK's ``client.messages.count_tokens(model=..., messages=..., system=..., tools=...)``
answered ``{"input_tokens": N}``. vLLM serves it beside ``/v1/messages``
(``vllm/entrypoints/anthropic/``: ``AnthropicCountTokensRequest``, ``count_tokens`` in
``serving.py``): it converts the body to chat completions as it does a Messages request, renders
and tokenizes that prompt, and answers ``{"input_tokens": N, "context_management":
{"original_input_tokens": N}}``.

* **Served by** ``vllm`` and ``sim`` backends only (``EngineKind.serves_count_tokens`` in
  ``gateway/engines.py``, the simulator as vLLM does): SGLang and llama.cpp have no such
  endpoint, OpenAI has none. A model none of whose backends serves it answers 404
  ``api_not_served`` (``Dispatcher``). Never translated: no other API a backend serves counts an
  Anthropic prompt.
* **Fields**: ``model``, ``messages``, ``system``, ``tools``, ``tool_choice``, ``thinking``
  (Anthropic's count request; vLLM ignores ``thinking``) and vLLM's ``chat_template_kwargs``.
  No ``max_tokens``: nothing is generated. ``stream`` only to be refused when true.
* **Nested rules**: the Messages request's (``messages.check_messages_content``: block types,
  media URLs, custom tools unless the tenant opted into server tools, template switches).
* **Prompt**: the Messages request's structure checks and estimate (``MESSAGES.prompt_tokens``:
  ``limits.max_messages`` messages, ``max_content_parts`` blocks, ``max_tools`` tools, by length
  before any text is read; every text, tool inputs and definitions, media at the policy's charge).
  The estimate is what the tenant is charged and what the model's prompt cap refuses, as for
  every API, though the engine's GPU does no work for it.
* **Rendering for prefix keys**: the Messages rendering behind a marker of its own
  (``COUNT_TOKENS_KEYS``): nothing is cached by counting, so its keys must never match an
  inference prompt's (the prefix router would take a counted conversation for a cached one, as
  ``TOKENIZER_KEYS`` explains for ``/tokenize``); they only keep equal requests on one backend.
* **Cache salt**: the question does not arise (counting caches nothing and reads no cache), so
  the request is passed through wherever it is served, whatever cache scopes reach the backend.
* **Output**: none (``max_tokens`` 0), never streamed, never continued. The answer's usage is
  ``input_tokens`` prompt tokens and no completion tokens.
* **Errors** in Anthropic's shape, as ``/v1/messages`` (``MESSAGES.error_body``).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any, final

from gateway.dialects.allowlists import EngineGrants
from gateway.dialects.defaults import WholeAnswerOnly, never_streamed
from gateway.dialects.messages import MESSAGES, check_messages_content
from gateway.engines import engine
from gateway.policy.model import BackendKind, ModelPolicy, RequestLimits
from gateway.request.body_fields import screen_fields
from gateway.request.tokens import TokenEstimator

COUNT_TOKENS_FIELDS = frozenset(
    {"model", "messages", "system", "tools", "tool_choice", "thinking", "chat_template_kwargs", "stream"}
)
COUNT_TOKENS_KEYS = "\x1dcount_tokens\x1d"
"""Starts every rendered count request: its prefix keys never match a Messages (or any inference)
prompt's, so counting a conversation does not tell the prefix router a backend caches it."""


def serves_counting(kind: BackendKind) -> bool:
    """``Dialect.serves`` of ``/v1/messages/count_tokens`` (module docstring)."""
    return engine(kind).serves_count_tokens


@final
class CountTokensDialect(WholeAnswerOnly):
    """``POST /v1/messages/count_tokens`` (module docstring); ``COUNT_TOKENS`` is its one instance."""

    __slots__ = ()

    name = "count_tokens"
    path = "/v1/messages/count_tokens"
    operation = "count_tokens"  # no GenAI operation name fits (a custom value, as tokenize's)
    fields = COUNT_TOKENS_FIELDS
    prompt_field = "messages"
    serves = staticmethod(serves_counting)
    error_body = staticmethod(MESSAGES.error_body)
    error_event = staticmethod(MESSAGES.error_event)

    def screen(self, body: dict[str, Any], limits: RequestLimits, grants: EngineGrants) -> bool:
        stripped = screen_fields(COUNT_TOKENS_FIELDS, body, limits)
        check_messages_content(body, limits, grants)  # Messages' rules: vLLM fetches media to count
        return stripped

    def stream_flags(self, body: dict[str, Any]) -> tuple[bool, bool]:
        return never_streamed(body, "Token counting")

    def prompt_tokens(
        self, body: dict[str, Any], model: ModelPolicy, limits: RequestLimits, estimator: TokenEstimator
    ) -> int:
        return MESSAGES.prompt_tokens(body, model, limits, estimator)

    def render(self, body: dict[str, Any]) -> str | array[int]:
        rendered = MESSAGES.render(body)
        return COUNT_TOKENS_KEYS + rendered if isinstance(rendered, str) else rendered

    def is_answer(self, answer: dict[str, Any]) -> bool:
        return _input_tokens(answer) is not None

    def answer_usage(self, answer: dict[str, Any]) -> Mapping[str, Any] | None:
        count = _input_tokens(answer)
        if count is None:
            return None
        return {"prompt_tokens": count, "completion_tokens": 0, "total_tokens": count}


def _input_tokens(answer: dict[str, Any]) -> int | None:
    count = answer.get("input_tokens")
    return count if isinstance(count, int) and not isinstance(count, bool) else None


COUNT_TOKENS = CountTokensDialect()
