"""``POST /v1/responses``: OpenAI's Responses API, passed through to engines that serve it (vLLM).

* **Fields**: the Responses request's (``input``, ``instructions``, ``max_output_tokens``,
  ``tools``, ``previous_response_id``, ``store``, ...). ``background`` is not among them: a
  background response is polled later on the one engine that holds it, which the gateway does
  not route (400 ``unsupported_field``).
* **Nested rules**: the engine features' bounds (``include``, ``metadata``, ``top_logprobs``:
  ``engine_fields.py``); content-part types (``allowlists.RESPONSES_PARTS``, in a message's
  ``content`` and a function call output's ``output``) and their media URLs; function tools only,
  unless the tenant opted into built-in ones (``web_search_preview``, ``mcp``, ...:
  ``allowlists.RESPONSES_TOOLS``, also in ``tool_choice``), an ``mcp`` server https to a public host.
* **Prompt**: ``instructions`` plus ``input``, a string or a list of items (messages whose
  content is a string or a list of parts; function calls and their outputs), at most
  ``limits.max_messages`` items, ``max_content_parts`` parts each and ``max_tools`` tools, all
  checked by length before the estimate reads a text. The estimate: every text, a few template
  tokens per item, function-call names, arguments and outputs, tool definitions as their JSON,
  image and file parts at the policy's media charge.
* **Rendering for prefix keys**: the tools (JSON, sorted keys), the instructions as a system
  turn, then every item as ``\\x1e<role>\\x1f<text>``: a conversation's next turn, which resends
  the previous items, extends the previous turn's text, exactly as chat's.
* **Output bound**: ``max_output_tokens``, on every kind of engine that serves this API.
* **Stream**: typed events (``response.created``, ``response.output_text.delta``, ...,
  ``response.completed``) under SSE ``event:`` names, which the relay keeps; no ``[DONE]``: the
  stream is complete at ``response.completed`` (or ``response.incomplete``). Output events
  (text, reasoning and refusal deltas, function-call argument deltas) time TTFT and the gaps;
  usage comes with the final event, as ``input_tokens``/``output_tokens``, and is reported in
  the gateway's shape. Engines always report it: no field to ask for it.
* **Answer**: an object ``"object": "response"`` with ``usage``; ``status`` ``incomplete``
  with ``incomplete_details.reason`` ``max_output_tokens`` is a ``length`` finish.
* **Continuation**: none (a broken Responses stream ends with an error event).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any, final

import orjson

from gateway.dialects.allowlists import (
    RESPONSES_PARTS,
    RESPONSES_TOOLS,
    EngineGrants,
    check_items_parts,
    check_tools_allowed,
)
from gateway.dialects.base import FIELD_SEPARATOR, NO_OUTPUT, OUTPUT, ChunkReading, render_conversation
from gateway.dialects.chat import check_tools
from gateway.dialects.counts import at_most
from gateway.dialects.defaults import OpenAIDialect
from gateway.dialects.engine_fields import check_engine_fields
from gateway.dialects.openai_answers import serves_responses, stream_flag
from gateway.errors import GatewayError, InvalidRequest
from gateway.policy.model import BackendKind, ModelPolicy, RequestLimits
from gateway.request.body_fields import screen_fields
from gateway.request.media import check_media_urls, check_parts_urls
from gateway.request.tokens import TokenEstimator, json_tokens

FIELDS = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "stream", "temperature", "top_p", "tools",
        "tool_choice", "parallel_tool_calls", "previous_response_id", "store", "metadata", "reasoning",
        "text", "truncation", "user", "include", "top_logprobs", "prompt_cache_key", "safety_identifier",
        "max_tool_calls", "stream_options",
    }
)  # fmt: skip
OUTPUT_ALIASES = ("max_output_tokens",)
ITEM_OVERHEAD_TOKENS = 4
OUTPUT_EVENTS = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.refusal.delta",
        "response.function_call_arguments.delta",
    }
)
"""Events that carry generated output: their arrival times TTFT and the inter-token gaps."""
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete"})
TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"})
PART_LISTS = ("content", "output")
"""Where an input item holds content parts: a message's ``content``, a function call output's ``output``."""


@final
class ResponsesDialect(OpenAIDialect):
    """The Responses dialect (module docstring); ``RESPONSES`` is its one instance. Of the OpenAI
    defaults (``gateway/dialects/defaults.py``) it keeps the error answer and the passthrough."""

    __slots__ = ()

    name = "responses"
    path = "/v1/responses"
    operation = "chat"
    fields = FIELDS
    prompt_field = "input"
    output_aliases = OUTPUT_ALIASES
    sse_event_names = True
    ends_with_done = False
    keeps_state = True
    serves = staticmethod(serves_responses)

    def output_field(self, kind: BackendKind) -> str | None:
        return "max_output_tokens"

    def screen(self, body: dict[str, Any], limits: RequestLimits, grants: EngineGrants) -> bool:
        stripped = screen_fields(FIELDS, body, limits)
        check_engine_fields(body, limits)
        items = body.get("input")
        check_items_parts(items, "input", RESPONSES_PARTS, grants, PART_LISTS)
        check_media_urls(items, limits.media_url_allowlist, "input")  # input_image, input_file parts
        _check_output_urls(items, limits.media_url_allowlist)
        check_tools_allowed(body, RESPONSES_TOOLS, grants, limits.max_tools)
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
        return stripped

    def stream_flags(self, body: dict[str, Any]) -> tuple[bool, bool]:
        return stream_flag(body), True  # usage is in response.completed, always: nothing to hide

    def prompt_tokens(
        self, body: dict[str, Any], model: ModelPolicy, limits: RequestLimits, estimator: TokenEstimator
    ) -> int:
        items = _items(body)
        _check_items(items, limits)
        check_tools(body, limits.max_tools, ("tools",))
        tools = body.get("tools")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise InvalidRequest("'instructions' must be a string.", param="instructions")
        total = estimator.count(instructions) + ITEM_OVERHEAD_TOKENS if instructions else 0
        media = limits.media_tokens
        for item in items:
            total += ITEM_OVERHEAD_TOKENS + _item_tokens(item, estimator, media.image_url, media.file)
        if tools:
            total += json_tokens(tools, estimator)
        return total

    def render(self, body: dict[str, Any]) -> str | array[int]:
        instructions = body.get("instructions")
        turns: list[tuple[object, str]] = (
            [("system", instructions)] if isinstance(instructions, str) and instructions else []
        )
        for item in _items(body):
            if isinstance(item, dict):
                turns.append((item.get("role") or item.get("type") or "user", _item_text(item)))
        return render_conversation(body.get("tools"), turns)

    def stream_usage_fields(self, body: dict[str, Any], per_chunk: bool) -> Mapping[str, Any]:
        return {}

    def read_chunk(self, chunk: dict[str, Any]) -> ChunkReading:
        kind = chunk.get("type")
        if kind in OUTPUT_EVENTS:
            return OUTPUT
        if kind in FINAL_EVENTS:
            response = chunk.get("response")
            if not isinstance(response, dict):
                return NO_OUTPUT
            return False, response_usage(response), (finish_reason(response),), False
        return NO_OUTPUT

    def is_answer(self, answer: dict[str, Any]) -> bool:
        return answer.get("object") == "response" and isinstance(answer.get("output"), list)

    def answer_usage(self, answer: dict[str, Any]) -> Mapping[str, Any] | None:
        return response_usage(answer)

    def answer_id(self, document: dict[str, Any]) -> str | None:
        response = document.get("response") if document.get("type") == "response.created" else document
        if not isinstance(response, dict) or response.get("object") != "response":
            return None
        value = response.get("id")
        return value if isinstance(value, str) else None

    def previous_id(self, body: dict[str, Any]) -> str | None:
        value = body.get("previous_response_id")
        if value is None:
            return None
        if not isinstance(value, str) or not value or len(value) > 256:
            raise InvalidRequest("'previous_response_id' must be a response id.", param="previous_response_id")
        return value

    def error_event(self, error: GatewayError) -> bytes:
        """The Responses API's own ``error`` event (``openai`` yields it as a ``ResponseErrorEvent``)."""
        event = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"

    def can_continue(self, body: dict[str, Any]) -> bool:
        return False

    def continue_body(self, body: dict[str, Any], partial: str) -> None:
        raise NotImplementedError("a Responses stream is never continued")


RESPONSES = ResponsesDialect()


def response_usage(response: Mapping[str, Any]) -> dict[str, Any] | None:
    """A response's ``usage`` in the gateway's shape (``prompt_tokens``, ``completion_tokens``, ...)."""
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return None
    out: dict[str, Any] = {
        "prompt_tokens": usage.get("input_tokens"),
        "completion_tokens": usage.get("output_tokens"),
    }
    if "total_tokens" in usage:
        out["total_tokens"] = usage["total_tokens"]
    details = usage.get("input_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        out["prompt_tokens_details"] = {"cached_tokens": details["cached_tokens"]}
    return out


def finish_reason(response: Mapping[str, Any]) -> str:
    """The chat-style finish reason of a final response: ``length`` when cut by its output bound."""
    status = response.get("status")
    if status == "completed":
        return "stop"
    details = response.get("incomplete_details")
    if status == "incomplete" and isinstance(details, dict) and details.get("reason") == "max_output_tokens":
        return "length"
    return status if isinstance(status, str) else "unknown"


def _items(body: Mapping[str, Any]) -> list[Any]:
    value = body.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return value
    raise InvalidRequest("'input' is required: a string or an array of input items.", param="input")


def _check_items(items: list[Any], limits: RequestLimits) -> None:
    """Shapes and counts, by length, before any text is read."""
    at_most(items, limits.max_messages, "input", "items", "too_many_messages")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object.", param=f"input[{i}]")
        content = item.get("content")
        if isinstance(content, list):
            at_most(content, limits.max_content_parts, f"input[{i}].content", "parts", "too_many_content_parts")
        if content is not None and not isinstance(content, str | list):
            raise InvalidRequest(f"input[{i}].content must be a string or an array.", param=f"input[{i}].content")


def _check_output_urls(items: Any, allowlist: tuple[str, ...]) -> None:
    """The media rule over a function call output given as parts (``input[i].output``)."""
    if isinstance(items, list):
        for i, item in enumerate(items):
            if isinstance(item, dict) and isinstance(item.get("output"), list):
                check_parts_urls(item["output"], f"input[{i}].output", allowlist)


def _item_tokens(item: dict[str, Any], estimator: TokenEstimator, image: int, file: int) -> int:
    """An input item's tokens: its texts counted as one text joined by newlines (one count, not
    one per part: ``tokens.parts_tokens``), images and files at their charge. A function call's
    output given as parts is counted as content is."""
    texts: list[str] = []
    total = _parts_charges(item.get("content"), texts, image, file)
    for key in ("name", "arguments", "output"):  # function calls and their outputs
        value = item.get(key)
        if isinstance(value, str):
            texts.append(value)
        elif key == "output":
            total += _parts_charges(value, texts, image, file)
    return total + (estimator.count("\n".join(texts)) if texts else 0)


def _parts_charges(content: Any, texts: list[str], image: int, file: int) -> int:
    """The media charges of ``content``'s parts; their texts appended to ``texts``."""
    if isinstance(content, str):
        texts.append(content)
        return 0
    total = 0
    for part in content if isinstance(content, list) else ():
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "input_image":
            total += image
        elif kind == "input_file":
            total += file
        elif isinstance(part.get("text"), str):
            texts.append(part["text"])
    return total


def _item_text(item: dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    pieces = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            else:
                pieces.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
    for key in ("name", "arguments", "output"):
        value = item.get(key)
        if isinstance(value, str):
            pieces.append(value)
    return FIELD_SEPARATOR.join(pieces)
