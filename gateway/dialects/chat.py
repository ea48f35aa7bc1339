"""``POST /v1/chat/completions``: the chat dialect.

* **Fields**: the OpenAI chat request's, the engines' sampling and structured-output extras
  (``body_fields.SAMPLING_EXTRAS``), the chat-only engine switches (``CHAT_EXTRAS``: prefill,
  reasoning, template switches) and every output-length alias.
* **Nested rules**: the engine features' bounds (``stop``, ``logit_bias``, ``bad_words``, ...:
  ``engine_fields.py``); ``stream_options`` (``body_fields.check_stream_options``); content-part
  types (``allowlists.CHAT_PARTS``) and media URLs in content parts (``gateway/request/media.py``);
  function tools only, unless the tenant opted into others (``allowlists.CHAT_TOOLS``, also in
  ``tool_choice``); ``chat_template_kwargs`` carries template switches
  (``enable_thinking``, ``reasoning_effort``, ...): scalars or short lists of them, never a
  ``chat_template`` (what vLLM refuses without ``--trust-request-chat-template``, enforced here
  whatever the engine's flag) nor a key the renderer sets itself (``messages``, ``tools``,
  ``documents``, ``add_generation_prompt``, ...), which could replace the prompt the gateway
  estimated, routed and continues on migration.
* **Prompt**: ``messages``, a non-empty array of objects with a known role and a string or an
  array of parts as content; at most ``limits.max_messages`` messages, ``max_content_parts``
  parts each, ``max_tools`` tools (and legacy functions), all checked by length before the
  estimate reads a text. The estimate: each message's text parts plus a few template tokens
  (``MESSAGE_OVERHEAD_TOKENS``); the assistant's ``tool_calls`` (name and ``arguments``) and
  legacy ``function_call``; ``tool`` messages' content; the ``tools`` (and legacy
  ``functions``) definitions and a ``response_format`` JSON schema, as the size of their JSON
  (chat templates render tool schemas as JSON into the prompt); media parts at the policy's
  charge (``tokens.parts_tokens``).
* **Rendering for prefix keys**: the ``tools`` (JSON, sorted keys) first, then every message in
  order as ``\\x1e<role>\\x1f<content>`` (text parts joined, other parts and ``tool_calls`` as
  JSON); the system prompt, the first message in practice, leads, and a next turn (which
  resends the previous ones) extends the previous turn's text.
* **Output bound**: vLLM, SGLang and the simulator obey ``max_tokens``, llama.cpp
  ``n_predict``, OpenAI ``max_completion_tokens`` (``EngineKind.chat_output_field`` in
  ``gateway/engines.py``; ``gateway/request/output_length.py`` says why).
* **Served by** every kind whose record says so (``EngineKind.serves_chat``).
* **Answer**: OpenAI choice chunks when streamed, ``choices`` when whole
  (``gateway/dialects/openai_answers.py``).
* **Continuation**: the conversation plus the partial answer as a final assistant message to
  continue (vLLM's ``continue_final_message: true`` with ``add_generation_prompt: false``);
  when the client itself asked to continue its final message, the partial answer extends it.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any, final

import orjson

from gateway.dialects.allowlists import CHAT_PARTS, CHAT_TOOLS, EngineGrants, check_items_parts, check_tools_allowed
from gateway.dialects.base import FIELD_SEPARATOR, MESSAGE_START
from gateway.dialects.counts import at_most
from gateway.dialects.defaults import OpenAIDialect
from gateway.dialects.engine_fields import check_engine_fields
from gateway.dialects.openai_answers import serves_chat, stream_flag, usage_flag
from gateway.engines import engine
from gateway.errors import InvalidRequest
from gateway.policy.model import BackendKind, MediaTokens, ModelPolicy, RequestLimits
from gateway.request.body_fields import (
    OUTPUT_LENGTH_ALIASES,
    SAMPLING_EXTRAS,
    check_stream_options,
    screen_fields,
    shown,
)
from gateway.request.media import check_media_urls
from gateway.request.output_length import OUTPUT_LENGTH_FIELDS
from gateway.request.tokens import TokenEstimator, json_tokens, parts_tokens

OPENAI_CHAT = frozenset(
    {
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
        "logprobs", "max_completion_tokens", "max_tokens", "modalities", "n", "parallel_tool_calls",
        "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format",
        "safety_identifier", "seed", "stop", "stream", "stream_options", "temperature", "tool_choice",
        "tools", "top_logprobs", "top_p", "user", "verbosity",
    }
)  # fmt: skip
CHAT_EXTRAS = frozenset(
    {
        "echo", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
        "include_reasoning", "separate_reasoning", "stream_reasoning", "reasoning_format",
    }
)  # fmt: skip
FIELDS = OPENAI_CHAT | SAMPLING_EXTRAS | CHAT_EXTRAS | OUTPUT_LENGTH_ALIASES

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MESSAGE_OVERHEAD_TOKENS = 4
TOOL_CALL_OVERHEAD_TOKENS = 4

TEMPLATE_RENDERER_KEYS = frozenset(
    {
        "chat_template", "tokenize", "messages", "conversation", "tools", "documents",
        "add_generation_prompt", "continue_final_message", "return_dict", "return_assistant_tokens_mask",
    }
)  # fmt: skip
MAX_SWITCH_CHARS = 256
MAX_SWITCH_ITEMS = 16
CONTENT = ("content",)
"""Where a chat message holds content parts."""


@final
class ChatDialect(OpenAIDialect):
    """The chat dialect (module docstring) on the OpenAI defaults (``gateway/dialects/defaults.py``);
    ``CHAT`` is its one instance."""

    __slots__ = ()

    name = "chat"
    path = "/v1/chat/completions"
    operation = "chat"
    fields = FIELDS
    prompt_field = "messages"
    serves = staticmethod(serves_chat)
    output_aliases = OUTPUT_LENGTH_FIELDS

    def output_field(self, kind: BackendKind) -> str | None:
        return engine(kind).chat_output_field

    def screen(self, body: dict[str, Any], limits: RequestLimits, grants: EngineGrants) -> bool:
        stripped = screen_fields(FIELDS, body, limits)
        check_engine_fields(body, limits)
        check_stream_options(body.get("stream_options"))
        check_template_kwargs(body.get("chat_template_kwargs"))
        check_items_parts(body.get("messages"), "messages", CHAT_PARTS, grants, CONTENT)
        check_media_urls(body.get("messages"), limits.media_url_allowlist)
        check_tools_allowed(body, CHAT_TOOLS, grants, limits.max_tools)
        return stripped

    def stream_flags(self, body: dict[str, Any]) -> tuple[bool, bool]:
        return stream_flag(body), usage_flag(body)

    def prompt_tokens(
        self, body: dict[str, Any], model: ModelPolicy, limits: RequestLimits, estimator: TokenEstimator
    ) -> int:
        _check_messages(body.get("messages"), limits)
        check_tools(body, limits.max_tools)
        return chat_prompt_tokens(body, estimator, limits.media_tokens)

    def render(self, body: dict[str, Any]) -> str | array[int]:
        return render_chat(body)

    def can_continue(self, body: dict[str, Any]) -> bool:
        messages = body.get("messages")
        return isinstance(messages, list) and bool(messages)

    def continue_body(self, body: dict[str, Any], partial: str) -> None:
        body["messages"] = _with_partial_answer(body["messages"], partial, bool(body.get("continue_final_message")))
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False


CHAT = ChatDialect()


# --- the body's nested rules ---------------------------------------------------------------


def check_template_kwargs(kwargs: Any) -> None:
    """``chat_template_kwargs`` are switches for the model's template, never content or a template."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise InvalidRequest("'chat_template_kwargs' must be an object.", param="chat_template_kwargs")
    for name, value in kwargs.items():
        param = f"chat_template_kwargs.{shown(name)}"
        if name in TEMPLATE_RENDERER_KEYS:
            raise InvalidRequest(
                f"'{param}' may not be set: the gateway renders requests with the model's own template "
                "and the request's own fields.",
                code="unsupported_field",
                param=param,
            )
        if not _is_switch(value) and not (
            isinstance(value, list) and len(value) <= MAX_SWITCH_ITEMS and all(map(_is_switch, value))
        ):
            raise InvalidRequest(
                f"'{param}' must be a boolean, a number, a string of at most {MAX_SWITCH_CHARS} characters, "
                f"or a list of at most {MAX_SWITCH_ITEMS} of those.",
                param=param,
            )


def _is_switch(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= MAX_SWITCH_CHARS
    return value is None or isinstance(value, (bool, int, float))


# --- the prompt's structure and estimate ---------------------------------------------------


def _check_messages(messages: Any, limits: RequestLimits) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty array.", param="messages")
    at_most(messages, limits.max_messages, "messages", "entries", "too_many_messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"'messages[{i}]' must be an object.", param=f"messages[{i}]")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"'messages[{i}].role' must be one of {sorted(CHAT_ROLES)}.", param=f"messages[{i}].role"
            )
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise InvalidRequest(
                f"'messages[{i}].content' must be a string or an array of parts.",
                param=f"messages[{i}].content",
            )
        at_most(content, limits.max_content_parts, f"messages[{i}].content", "parts", "too_many_content_parts")


def check_tools(body: dict[str, Any], max_tools: int, names: tuple[str, ...] = ("tools", "functions")) -> None:
    """Each tool list of ``body`` (chat's ``tools`` and legacy ``functions``; one ``tools`` for the
    Responses and Messages APIs) is an array of at most ``max_tools`` entries, by length alone."""
    for name in names:
        tools = body.get(name)
        if tools is None:
            continue
        if not isinstance(tools, list):
            raise InvalidRequest(f"'{name}' must be an array.", param=name)
        at_most(tools, max_tools, name, "entries", "too_many_tools")


def chat_prompt_tokens(body: Mapping[str, Any], estimator: TokenEstimator, media: MediaTokens) -> int:
    """Tokens of a chat request's prompt: messages, tool calls, tool definitions, output schema."""
    total = 0
    for message in body["messages"]:
        total += MESSAGE_OVERHEAD_TOKENS
        content = message.get("content")
        if isinstance(content, str):
            total += estimator.count(content)
        elif isinstance(content, list):
            total += parts_tokens(content, estimator, media)
        calls = message.get("tool_calls")
        if calls:
            total += _tool_calls_tokens(calls, estimator)
        legacy_call = message.get("function_call")
        if legacy_call:
            total += _call_tokens(legacy_call, estimator)
    for name in ("tools", "functions"):
        definitions = body.get(name)
        if definitions:
            total += json_tokens(definitions, estimator)
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        total += json_tokens(response_format.get("json_schema"), estimator)
    return total


def _tool_calls_tokens(calls: Any, estimator: TokenEstimator) -> int:
    if not isinstance(calls, list):
        return json_tokens(calls, estimator)
    total = 0
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        total += TOOL_CALL_OVERHEAD_TOKENS + (_call_tokens(function, estimator) if function else 0)
    return total


def _call_tokens(function: Any, estimator: TokenEstimator) -> int:
    """A function call's name and arguments (a JSON string, or an object some clients send)."""
    if not isinstance(function, dict):
        return json_tokens(function, estimator)
    name, arguments = function.get("name"), function.get("arguments")
    total = estimator.count(name) if isinstance(name, str) else 0
    if isinstance(arguments, str):
        total += estimator.count(arguments)
    elif arguments is not None:
        total += json_tokens(arguments, estimator)
    return total


# --- rendering and continuation ------------------------------------------------------------


def render_chat(body: dict[str, Any]) -> str:
    """The canonical prompt of a chat body (module docstring)."""
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts += (MESSAGE_START, "tools", FIELD_SEPARATOR, orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
    for message in body.get("messages") or ():
        parts += (MESSAGE_START, str(message.get("role")), FIELD_SEPARATOR)
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += (_part_text(part) for part in content)
        calls = message.get("tool_calls")
        if calls:
            parts += (FIELD_SEPARATOR, orjson.dumps(calls, option=orjson.OPT_SORT_KEYS).decode())
    return "".join(parts)


def _part_text(part: Any) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        text: str = part["text"]
        return text
    return orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode()


def _with_partial_answer(messages: list[Any], text: str, already_continuing: bool) -> list[Any]:
    """The conversation ending with the partial answer as an assistant message to continue."""
    last = messages[-1]
    if already_continuing and isinstance(last, dict) and isinstance(last.get("content"), str):
        # The client asked to continue its own final message: the partial answer extends it.
        return [*messages[:-1], {**last, "content": last["content"] + text}]
    return [*messages, {"role": "assistant", "content": text}]
