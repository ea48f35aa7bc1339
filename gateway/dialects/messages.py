"""``POST /v1/messages``: Anthropic's Messages API, passed through or translated to chat.

* **Fields**: the Messages request's (``model``, ``messages``, ``max_tokens`` (required),
  ``system``, ``tools``, ``tool_choice``, ``stop_sequences``, sampling, ``thinking``,
  ``metadata``, ...; ``service_tier`` is the gateway's, dropped as everywhere) and vLLM's
  extras (``chat_template_kwargs``, ``output_config``).
* **Nested rules** (``check_messages_content``, shared with token counting): ``stop_sequences``
  and ``metadata`` bounded (``engine_fields.py``); block types (``allowlists.MESSAGES_BLOCKS``,
  inside a ``tool_result`` ``TOOL_RESULT_BLOCKS``, ``system`` text only) and media URLs; custom
  tools only, unless the tenant opted into Anthropic's server tools (``web_search_20250305``, ...:
  ``allowlists.MESSAGES_TOOLS``). All on the client's body, before a translation to chat.
* **Prompt**: ``system`` (a string or text blocks) and ``messages``, each a string or content
  blocks (``text``, ``image``, ``document``, ``tool_use``, ``tool_result``, ``thinking``): at most
  ``limits.max_messages`` messages, ``max_content_parts`` blocks each and ``max_tools`` tools,
  counted by length before a text is read. The estimate: every text, a few template tokens a
  message, tool inputs and definitions as JSON, images and documents at the policy's media charge.
* **Rendering for prefix keys**: the tools, the system prompt as a system turn, then every
  message as ``\\x1e<role>\\x1f<blocks>``: a conversation's next turn extends the previous one's.
* **Output bound**: ``max_tokens`` on the native endpoint; chat's bound field when translated.
* **Passthrough or translation** (``translation``): vLLM serves ``/v1/messages`` itself, but its
  Messages request has no ``cache_salt`` and no ``priority`` (``AnthropicMessagesRequest``
  ignores both): passed through, a request would reach the engine unsalted, and could reuse
  (and time) another cache scope's blocks. So a request is passed through only to a backend
  whose kind serves Messages natively (``EngineKind.native_messages`` in ``gateway/engines.py``:
  vLLM and the simulator; llama.cpp's server has one too, but whether it honours
  ``cache_prompt`` there is not documented, so it is translated), that no two cache scopes reach by
  any path, model groups included (``PolicySnapshot.multi_scope_backends``), and that does not
  take the class as the engine's priority; everywhere else it is translated to chat
  completions and its answer back (``gateway/dialects/messages_chat.py``), which carries the
  salt and the priority. The cache key is a security boundary: a translation costs a little
  CPU, a passthrough would cost it. So a backend is offered Messages requests (``serves``)
  when its kind serves chat, natively or not: any request may have to be translated.
* **Stream**: typed events under SSE ``event:`` names (``message_start``,
  ``content_block_start``, ``content_block_delta``, ``content_block_stop``, ``message_delta``,
  ``message_stop``), no ``[DONE]``. Deltas time TTFT and the gaps (text, tool input, thinking);
  usage arrives split (``input_tokens`` in ``message_start``, ``output_tokens`` in
  ``message_delta``, vLLM's carries both) and the stop reason with ``message_delta``.
* **Errors** in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}`` (the
  SDK's exception classes follow the status; ``code`` and ``param`` are kept inside ``error``
  for the gateway's own codes), and as an ``event: error`` in a stream.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any, final

import orjson

from gateway.dialects.allowlists import MESSAGES_TOOLS, EngineGrants, check_blocks, check_tools_allowed
from gateway.dialects.base import (
    FIELD_SEPARATOR,
    NO_OUTPUT,
    OUTPUT,
    ChunkReading,
    Translation,
    render_conversation,
)
from gateway.dialects.chat import check_template_kwargs, check_tools
from gateway.dialects.counts import at_most
from gateway.dialects.defaults import OpenAIDialect
from gateway.dialects.engine_fields import check_engine_fields
from gateway.dialects.messages_chat import MESSAGES_VIA_CHAT
from gateway.dialects.openai_answers import serves_chat, stream_flag
from gateway.engines import engine
from gateway.errors import GatewayError, InvalidRequest
from gateway.policy.model import Backend, BackendKind, ModelPolicy, RequestLimits
from gateway.request.body_fields import screen_fields
from gateway.request.media import check_block_urls
from gateway.request.tokens import TokenEstimator, json_text, json_tokens

FIELDS = frozenset(
    {
        "model", "messages", "max_tokens", "system", "stream", "temperature", "top_p", "top_k", "tools",
        "tool_choice", "stop_sequences", "metadata", "thinking", "chat_template_kwargs",
        "output_config",
    }
)  # fmt: skip
OUTPUT_ALIASES = ("max_tokens",)
MESSAGE_OVERHEAD_TOKENS = 4
OUTPUT_DELTAS = frozenset({"text_delta", "input_json_delta", "thinking_delta"})
STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}
"""Anthropic's stop reasons as the gateway's (chat's) finish reasons."""
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "request_too_large",
    503: "overloaded_error",
    504: "timeout_error",
}
"""Anthropic's error type for a status (``api_error`` for the others)."""


@final
class MessagesDialect(OpenAIDialect):
    """The Messages dialect (module docstring); ``MESSAGES`` is its one instance. Of the OpenAI
    defaults (``gateway/dialects/defaults.py``) it keeps only the answer state: none on the engine."""

    __slots__ = ()

    name = "messages"
    path = "/v1/messages"
    operation = "chat"
    fields = FIELDS
    prompt_field = "messages"
    output_aliases = OUTPUT_ALIASES
    sse_event_names = True
    ends_with_done = False
    serves = staticmethod(serves_chat)  # natively or translated to chat

    def output_field(self, kind: BackendKind) -> str | None:
        return "max_tokens"

    def translation(self, backend: Backend, multi_scope: bool) -> Translation | None:
        """None (passthrough) where that weakens nothing (module docstring), else chat's translation."""
        if engine(backend.kind).native_messages and not multi_scope and not backend.engine_priority:
            return None
        return MESSAGES_VIA_CHAT

    def screen(self, body: dict[str, Any], limits: RequestLimits, grants: EngineGrants) -> bool:
        stripped = screen_fields(FIELDS, body, limits)
        check_messages_content(body, limits, grants)
        if body.get("max_tokens") is None:
            raise InvalidRequest("'max_tokens' is required.", param="max_tokens")
        return stripped

    def stream_flags(self, body: dict[str, Any]) -> tuple[bool, bool]:
        return stream_flag(body), True  # usage is in message_start and message_delta, always

    def prompt_tokens(
        self, body: dict[str, Any], model: ModelPolicy, limits: RequestLimits, estimator: TokenEstimator
    ) -> int:
        messages = _messages(body)
        _check_messages(messages, limits)
        check_tools(body, limits.max_tools, ("tools",))
        tools = body.get("tools")
        system = _system(body)
        if isinstance(system, list):
            at_most(system, limits.max_content_parts, "system", "blocks", "too_many_content_parts")
        media = limits.media_tokens
        total = 0
        if system:
            total += MESSAGE_OVERHEAD_TOKENS + _content_tokens(system, estimator, media.image_url, media.file)
        for message in messages:
            content = message.get("content")
            total += MESSAGE_OVERHEAD_TOKENS + _content_tokens(content, estimator, media.image_url, media.file)
        if tools:
            total += json_tokens(tools, estimator)
        return total

    def render(self, body: dict[str, Any]) -> str | array[int]:
        system = body.get("system")
        turns: list[tuple[object, str]] = [("system", _content_text(system))] if system else []
        turns += [(m.get("role"), _content_text(m.get("content"))) for m in _messages(body) if isinstance(m, dict)]
        return render_conversation(body.get("tools"), turns)

    def stream_usage_fields(self, body: dict[str, Any], per_chunk: bool) -> Mapping[str, Any]:
        return {}

    def read_chunk(self, chunk: dict[str, Any]) -> ChunkReading:
        kind = chunk.get("type")
        if kind == "content_block_delta":
            delta = chunk.get("delta")
            return OUTPUT if isinstance(delta, dict) and delta.get("type") in OUTPUT_DELTAS else NO_OUTPUT
        if kind == "message_start":
            message = chunk.get("message")
            usage = messages_usage(message.get("usage")) if isinstance(message, dict) else None
            return (False, usage, (), False) if usage else NO_OUTPUT
        if kind == "message_delta":
            delta = chunk.get("delta")
            stop = delta.get("stop_reason") if isinstance(delta, dict) else None
            reasons = (STOP_REASONS.get(stop, stop),) if isinstance(stop, str) else ()
            return False, messages_usage(chunk.get("usage")), reasons, False
        return NO_OUTPUT

    def is_answer(self, answer: dict[str, Any]) -> bool:
        return answer.get("type") == "message" and isinstance(answer.get("content"), list)

    def answer_usage(self, answer: dict[str, Any]) -> Mapping[str, Any] | None:
        return messages_usage(answer.get("usage"))

    def error_body(self, error: GatewayError) -> bytes:
        return orjson.dumps({"type": "error", "error": _error_object(error)})

    def error_event(self, error: GatewayError) -> bytes:
        """Anthropic's ``error`` event (the SDK raises it as an ``APIStatusError``)."""
        return b"event: error\ndata: " + self.error_body(error) + b"\n\n"

    def can_continue(self, body: dict[str, Any]) -> bool:
        return False

    def continue_body(self, body: dict[str, Any], partial: str) -> None:
        raise NotImplementedError("a Messages stream is never continued")


MESSAGES = MessagesDialect()


def check_messages_content(body: dict[str, Any], limits: RequestLimits, grants: EngineGrants) -> None:
    """What Messages and its token counting check past the allowlist: the engine features
    (``stop_sequences``, ``metadata``), template switches, block types (``allowlists.check_blocks``)
    and media URLs, custom tools only unless the tenant opted into server tools."""
    check_engine_fields(body, limits)
    check_template_kwargs(body.get("chat_template_kwargs"))
    check_blocks(body.get("messages"), body.get("system"), grants)
    check_block_urls(body.get("messages"), limits.media_url_allowlist)
    check_tools_allowed(body, MESSAGES_TOOLS, grants, limits.max_tools)


def messages_usage(usage: Any) -> dict[str, Any] | None:
    """Messages ``usage`` in the gateway's shape. Anthropic counts cache reads and writes apart
    from ``input_tokens``; the prompt is their sum, the reads its cached part. A usage without
    ``input_tokens`` (a ``message_delta`` of Anthropic's own API) has no ``prompt_tokens``: the
    relay keeps the one ``message_start`` gave."""
    if not isinstance(usage, dict):
        return None
    out: dict[str, Any] = {"completion_tokens": usage.get("output_tokens")}
    prompt = usage.get("input_tokens")
    if isinstance(prompt, int):
        read = usage.get("cache_read_input_tokens")
        written = usage.get("cache_creation_input_tokens")
        out["prompt_tokens"] = (
            prompt + (read if isinstance(read, int) else 0) + (written if isinstance(written, int) else 0)
        )
        if isinstance(read, int):
            out["prompt_tokens_details"] = {"cached_tokens": read}
    return out


def _error_object(error: GatewayError) -> dict[str, Any]:
    return {
        "type": ERROR_TYPES.get(error.status, "api_error"),
        "message": error.message,
        "code": error.code,
        "param": error.param,
    }


def _messages(body: Mapping[str, Any]) -> list[Any]:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'messages' is required: a non-empty array of messages.", param="messages")
    return value


def _system(body: Mapping[str, Any]) -> str | list[Any] | None:
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        raise InvalidRequest("'system' must be a string or an array of text blocks.", param="system")
    return system


def _check_messages(messages: list[Any], limits: RequestLimits) -> None:
    """Shapes and counts, by length, before any text is read."""
    at_most(messages, limits.max_messages, "messages", "entries", "too_many_messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object.", param=f"messages[{i}]")
        if message.get("role") not in ("user", "assistant"):
            raise InvalidRequest(f"messages[{i}].role must be 'user' or 'assistant'.", param=f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):
            at_most(content, limits.max_content_parts, f"messages[{i}].content", "blocks", "too_many_content_parts")
            for j, block in enumerate(content):
                if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                    raise InvalidRequest(
                        f"messages[{i}].content[{j}] must be a content block with a 'type'.",
                        param=f"messages[{i}].content[{j}]",
                    )
                inner = block.get("content") if block["type"] == "tool_result" else None
                if isinstance(inner, list):
                    where = f"messages[{i}].content[{j}].content"
                    at_most(inner, limits.max_content_parts, where, "blocks", "too_many_content_parts")
        elif not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or an array of content blocks.",
                param=f"messages[{i}].content",
            )


def _content_tokens(content: Any, estimator: TokenEstimator, image: int, file: int) -> int:
    """A message's (or the system prompt's) tokens: its texts counted as one text joined by
    newlines (``tokens.parts_tokens`` says why: one count, not one per block), media at its charge."""
    texts: list[str] = []
    total = _block_charges(content, texts, image, file)
    return total + (estimator.count("\n".join(texts)) if texts else 0)


def _block_charges(content: Any, texts: list[str], image: int, file: int) -> int:
    """The media charges of ``content``'s blocks; their texts (tool inputs and unknown blocks as
    JSON, as templates render them) appended to ``texts``."""
    if isinstance(content, str):
        texts.append(content)
        return 0
    if not isinstance(content, list):
        return 0
    total = 0
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "image":
            total += image
        elif kind == "document":
            total += file
        elif kind == "tool_use":
            texts.append(str(block.get("name") or ""))
            texts.append(json_text(block.get("input")))
        elif kind == "tool_result":
            total += _block_charges(block.get("content"), texts, image, file)
        else:
            text = block.get("text") if kind != "thinking" else block.get("thinking")
            texts.append(text if isinstance(text, str) else json_text(block))
    return total


def _content_text(content: Any) -> str:
    """A message's content as one canonical text (rendering only: equal content, equal text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    pieces = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            pieces.append(block["text"])
        else:
            pieces.append(orjson.dumps(block, option=orjson.OPT_SORT_KEYS).decode())
    return FIELD_SEPARATOR.join(pieces)
