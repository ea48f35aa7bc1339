"""vLLM's Anthropic Messages API, ``POST /v1/messages`` and ``/v1/messages/count_tokens``, on the simulated engine.

vLLM (``entrypoints/anthropic/``: ``api_router.py``, ``protocol.py``, ``serving.py``) turns a
Messages request into a chat completions request, serves that, and turns the chat answer or
stream back; so does the simulator, down to the chat path's faults, engine, prefix cache,
disconnects and metrics.

* **Request to chat** (``_convert_anthropic_to_openai_request``): ``system`` (a string, or its
  text blocks without Claude Code's ``x-anthropic-billing-header`` one) and the text of any
  ``system``-role message, joined with no separator, as one system message; each other message
  in order: a string content as is; blocks as chat parts (``text`` to a text part, ``image`` to
  an ``image_url`` part with a ``data:`` URL for base64 sources, a lone text part to a string),
  ``tool_use`` to the message's ``tool_calls`` (``arguments`` is ``json.dumps(input)``),
  ``thinking`` to its ``reasoning``, ``redacted_thinking`` and ``tool_reference`` skipped, and a
  ``tool_result`` from the user to a ``tool`` message (its text blocks joined with newlines;
  images in a user message after it) while one from the assistant becomes a ``Tool result: ...``
  text part; a user message left with no content is dropped. ``tools`` become function tools
  whose ``parameters`` is the ``input_schema``; ``tool_choice`` ``auto``/``any``/``none``/``tool``
  becomes ``auto``/``required``/``none``/the named function (``auto`` when absent with tools);
  ``stop_sequences`` is ``stop`` (which the simulator, as for chat, does not apply);
  ``max_tokens`` bounds the output. The chat request is then rendered and tokenized, and a
  forced tool choice answered, exactly as chat's (see ``protocol.py``).
* **Not passed on**: vLLM's ``AnthropicMessagesRequest`` has no ``cache_salt`` and no
  ``priority`` (unknown fields are ignored), so the engine runs a Messages request unsalted at
  priority 0 whatever its body says; the simulator ignores both too. The gateway relies on this:
  it passes ``/v1/messages`` through only where an unsalted, unprioritised request is harmless,
  and translates it to chat everywhere else.
* **Length**: the engine generates exactly ``max_tokens`` tokens, and a text answer is cut by
  it: ``stop_reason`` is ``max_tokens`` (chat's ``length``, mapped). A forced tool call ends with
  its arguments' object at the last token: chat's ``tool_calls`` (``tool_choice`` ``any``) maps to
  ``tool_use``, while a named function (``{"type": "tool"}``) finishes ``stop`` in vLLM's chat
  and so answers ``end_turn``. vLLM's map: ``stop`` to ``end_turn``, ``length`` to
  ``max_tokens``, ``tool_calls`` to ``tool_use``.
* **Whole answer** (``model_dump(exclude_none=True)``): ``{"id": "chatcmpl-...", "type":
  "message", "role": "assistant", "content": [...], "model", "stop_reason", "usage":
  {"input_tokens", "output_tokens"}}``: one ``text`` block, or one ``tool_use`` block ``{"type",
  "id", "name", "input"}`` (no text block: the call's message content is empty); no
  ``stop_sequence`` (it is null, and nulls are left out).
* **Stream** (``message_stream_converter``, events ``event: <type>\\ndata: <json>\\n\\n``, each
  serialised with ``exclude_unset``, no ``data: [DONE]``): with the first chunk (sent with the
  first token) ``message_start``, whose message has only ``id``, ``content`` ``[]``, ``model``,
  ``stop_reason`` and ``stop_sequence`` null and ``usage`` ``{"input_tokens": <prompt>,
  "output_tokens": 0}`` (no ``type`` or ``role``: defaults are unset); then
  ``content_block_start`` (``{"type": "text", "text": ""}``, or ``{"type": "tool_use", "id",
  "name", "input": {}}``) at index 0 and one ``content_block_delta`` per token (``text_delta``,
  or ``input_json_delta`` with the arguments' piece); after the last token
  ``content_block_stop``, ``message_delta`` ``{"delta": {"stop_reason"}, "usage":
  {"input_tokens", "output_tokens"}}`` and ``message_stop``.
* **Token counting** (``count_tokens``, ``AnthropicCountTokensRequest``): ``model``,
  ``messages``, ``system``, ``tools`` and ``tool_choice`` validated as a Messages request's
  (``max_tokens`` and the other generation fields are not read), converted to chat the same
  way, rendered and tokenized, answered ``{"input_tokens": n, "context_management":
  {"original_input_tokens": n}}``: ``n`` is the ``input_tokens`` a Messages request of the same
  body reports. Nothing reaches the engine; the ``fail_503`` fault applies.
* **Errors**, as vLLM's: the request's own validation (``max_tokens`` missing or not positive,
  a missing ``model`` or ``messages``, a block of an unknown type, ``tool_choice`` ``tool``
  without a ``name``, a field of the wrong type) fails before the handler and gets vLLM's
  generic 400 in the OpenAI shape, ``{"error": {"message": "1 validation error: ...", "type":
  "Bad Request", "param": "body.<field>", "code": 400}}`` (vLLM issue #57997); what the handler
  refuses (another model: 404, a prompt over the context, a bad tool choice, the ``fail_503``
  fault) gets Anthropic's ``{"type": "error", "error": {"type": <vLLM's error type>, "message"}}``
  with the same status.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from loadtests.sim.faults import drop_connection
from loadtests.sim.protocol import ApiError, Endpoint, ParsedRequest, ToolCall, parse_body
from loadtests.sim.stream import FinishReason, TokenStream
from loadtests.sim.tokenizer import output_text

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "ctx": "user", "msg": "user"}
_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking")
_CHOICE_TYPES = ("auto", "any", "tool", "none")
_BILLING_HEADER = "x-anthropic-billing-header"

Send = Callable[[dict[str, Any]], Any]


class AnthropicError(ApiError):
    """An error vLLM's Messages handler answers in Anthropic's shape (see the module docstring)."""

    @classmethod
    def of(cls, error: ApiError) -> AnthropicError:
        return cls(error.status, error.message, param=error.param, kind=error.error_type)

    def body(self) -> bytes:
        return orjson.dumps({"type": "error", "error": {"type": self.error_type, "message": self.message}})


def _invalid(loc: tuple[str | int, ...], kind: str, msg: str, value: Any, cause: str | None = None) -> ApiError:
    """vLLM's answer to a request that fails ``AnthropicMessagesRequest``'s validation."""
    error: dict[str, Any] = {"type": kind, "loc": ("body", *loc), "msg": msg, "input": value}
    if cause is not None:
        error["ctx"] = {"error": ValueError(cause)}
    param = ".".join(str(p) for p in ("body", *loc))
    return ApiError(400, f"1 validation error:\n  {error}", param=param, kind="Bad Request")


_TYPES: dict[type, tuple[str, str]] = {
    str: ("string_type", "Input should be a valid string"),
    int: ("int_type", "Input should be a valid integer"),
    bool: ("bool_type", "Input should be a valid boolean"),
    list: ("list_type", "Input should be a valid list"),
    dict: ("dict_type", "Input should be a valid dictionary"),
}


def _typed(obj: dict[str, Any], key: str, kind: type, loc: tuple[str | int, ...] = (), required: bool = False) -> Any:
    """``obj[key]`` if it is a ``kind`` (None when absent or null and not ``required``)."""
    if required and key not in obj:
        raise _invalid((*loc, key), "missing", "Field required", obj)
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        error_type, msg = _TYPES[kind]
        raise _invalid((*loc, key), error_type, msg, value)
    return value


def _check_block(block: Any, loc: tuple[str | int, ...]) -> dict[str, Any]:
    if not isinstance(block, dict):
        raise _invalid(
            loc, "model_type", "Input should be a valid dictionary or instance of AnthropicContentBlock", block
        )
    kind = block.get("type")
    if kind not in _BLOCK_TYPES:
        expected = ", ".join(repr(t) for t in _BLOCK_TYPES[:-1]) + f" or {_BLOCK_TYPES[-1]!r}"
        raise _invalid((*loc, "type"), "literal_error", f"Input should be {expected}", kind)
    for key in ("text", "id", "tool_use_id", "name", "thinking", "signature", "data", "tool_name"):
        _typed(block, key, str, loc)
    _typed(block, "source", dict, loc)
    _typed(block, "input", dict, loc)
    if not isinstance(block.get("content"), str | list | None):
        raise _invalid((*loc, "content"), "string_type", "Input should be a valid string", block["content"])
    return block


def _check_content(value: Any, loc: tuple[str | int, ...]) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _invalid(loc, "string_type", "Input should be a valid string", value)
    return [_check_block(block, (*loc, i)) for i, block in enumerate(value)]


def _check_messages(body: dict[str, Any]) -> list[tuple[str, str | list[dict[str, Any]]]]:
    messages = _typed(body, "messages", list, required=True)
    checked = []
    for i, message in enumerate(messages):
        loc: tuple[str | int, ...] = ("messages", i)
        if not isinstance(message, dict):
            raise _invalid(
                loc, "model_type", "Input should be a valid dictionary or instance of AnthropicMessage", message
            )
        role = _ROLES.get(_typed(message, "role", str, loc, required=True))
        if role is None:
            raise _invalid(
                (*loc, "role"), "literal_error", "Input should be 'user', 'assistant' or 'system'", message["role"]
            )
        if "content" not in message:
            raise _invalid((*loc, "content"), "missing", "Field required", message)
        checked.append((role, _check_content(message["content"], (*loc, "content"))))
    return checked


def _check_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools: list[dict[str, Any]] | None = _typed(body, "tools", list)
    if tools is None:
        return None
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _invalid(
                ("tools", i), "model_type", "Input should be a valid dictionary or instance of AnthropicTool", tool
            )
        _typed(tool, "name", str, ("tools", i), required=True)
        _typed(tool, "description", str, ("tools", i))
        _typed(tool, "input_schema", dict, ("tools", i), required=True)
    return tools


def _check_tool_choice(body: dict[str, Any]) -> dict[str, Any] | None:
    choice: dict[str, Any] | None = _typed(body, "tool_choice", dict)
    if choice is None:
        return None
    if choice.get("type") not in _CHOICE_TYPES:
        msg = "Input should be 'auto', 'any', 'tool' or 'none'"
        raise _invalid(("tool_choice", "type"), "literal_error", msg, choice.get("type"))
    if choice["type"] == "tool" and not _typed(choice, "name", str, ("tool_choice",)):
        cause = "tool_choice.name is required when type is 'tool'"
        raise _invalid(("tool_choice",), "value_error", f"Value error, {cause}", choice, cause)
    return choice


def _check_model(body: dict[str, Any]) -> str:
    model: str = _typed(body, "model", str, required=True)
    if not model:
        raise _invalid(("model",), "value_error", "Value error, Model is required", model, "Model is required")
    return model


def _check_system(body: dict[str, Any]) -> str | list[dict[str, Any]] | None:
    system = body.get("system")
    return None if system is None else _check_content(system, ("system",))


def _check(body: dict[str, Any]) -> dict[str, Any]:
    """The fields vLLM's ``AnthropicMessagesRequest`` validates, in a 400 of its shape when wrong."""
    model = _check_model(body)
    messages = _check_messages(body)
    max_tokens = _typed(body, "max_tokens", int, required=True)
    if max_tokens <= 0:
        cause = "max_tokens must be positive"
        raise _invalid(("max_tokens",), "value_error", f"Value error, {cause}", max_tokens, cause)
    system = _check_system(body)
    stops = _typed(body, "stop_sequences", list)
    for i, stop in enumerate(stops or []):
        if not isinstance(stop, str):
            raise _invalid(("stop_sequences", i), "string_type", "Input should be a valid string", stop)
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "system": system,
        "stop_sequences": stops,
        "stream": bool(_typed(body, "stream", bool)),
        "tools": _check_tools(body),
        "tool_choice": _check_tool_choice(body),
    }


def _check_count(body: dict[str, Any]) -> dict[str, Any]:
    """The fields vLLM's ``AnthropicCountTokensRequest`` validates (``_check``'s, without the
    generation's: no ``max_tokens``, ``stop_sequences`` or ``stream``, ignored if sent)."""
    return {
        "model": _check_model(body),
        "messages": _check_messages(body),
        "system": _check_system(body),
        "tools": _check_tools(body),
        "tool_choice": _check_tool_choice(body),
    }


def _image_url(source: Any) -> str:
    if not isinstance(source, dict):
        return ""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _system_texts(content: str | list[dict[str, Any]] | None) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    return [
        b["text"]
        for b in content
        if b["type"] == "text" and b.get("text") and not b["text"].startswith(_BILLING_HEADER)
    ]


def _tool_message(block: dict[str, Any]) -> list[dict[str, Any]]:
    """A user's ``tool_result`` as chat messages: the tool's, then its images, then its references."""
    content, texts, images, references = block.get("content"), [], [], []
    for item in content if isinstance(content, list) else []:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            texts.append(item.get("text", ""))
        elif kind == "image" and (url := _image_url(item.get("source") or {})):
            images.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
            references.append({"type": "tool_reference", "name": name})
    text = content if isinstance(content, str) else "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": text or ""}]
    if images:
        out.append({"role": "user", "content": images})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return out


def _chat_message(role: str, blocks: list[dict[str, Any]], out: list[dict[str, Any]]) -> None:
    """Append the chat messages of one message made of content blocks (tool results first)."""
    message: dict[str, Any] = {"role": role}
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            function = {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}
            call_id = block.get("id") or f"call_{int(time.time())}"
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            out.extend(_tool_message(block))
        elif kind == "tool_result":
            result = str(block["content"]) if block.get("content") else ""
            parts.append({"type": "text", "text": f"Tool result: {result}"})
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    if parts:
        single = len(parts) == 1 and parts[0]["type"] == "text"
        message["content"] = parts[0]["text"] if single else parts
    if not (role == "user" and "content" not in message):
        out.append(message)


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions request vLLM makes of a Messages body (see the module docstring);
    raise vLLM's validation 400 if the body is not a valid Messages request."""
    return chat_body(_check(body))


def chat_body(request: dict[str, Any]) -> dict[str, Any]:
    """The chat completions request vLLM makes of a validated Messages request (module docstring)."""
    chat: dict[str, Any] = {
        "model": request["model"],
        "messages": _chat_messages(request),
        "max_tokens": request["max_tokens"],
        "max_completion_tokens": request["max_tokens"],
        "stop": request["stop_sequences"],
        "stream": request["stream"],
    }
    if request["stream"]:
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    chat.update(_chat_tools(request["tools"], request["tool_choice"]))
    return chat


def _chat_messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a validated Messages (or count) request: the system, then each message."""
    messages: list[dict[str, Any]] = []
    system = _system_texts(request["system"] or None)  # vLLM: `if system:`, then an empty string counts
    system += [t for role, content in request["messages"] if role == "system" for t in _system_texts(content)]
    if system:
        messages.append({"role": "system", "content": "".join(system)})
    for role, content in request["messages"]:
        if role == "system":
            continue
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
        else:
            _chat_message(role, content, messages)
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None, choice: dict[str, Any] | None) -> dict[str, Any]:
    """The chat request's ``tools`` and ``tool_choice`` (none of them when they have no effect)."""
    out: dict[str, Any] = {}
    if choice is not None:
        names = {"auto": "auto", "any": "required", "none": "none"}
        tool = {"type": "function", "function": {"name": choice.get("name")}}
        out["tool_choice"] = names.get(choice["type"], tool)
    if tools is not None:
        out["tools"] = [_function_tool(tool) for tool in tools]
        out.setdefault("tool_choice", "auto")
    elif out.get("tool_choice") in ("auto", "none"):
        del out["tool_choice"]  # vLLM sets it on the request after validation: it has no effect without tools
    return out


def _function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", **tool["input_schema"]}
    function = {"name": tool["name"], "description": tool.get("description"), "parameters": schema}
    return {"type": "function", "function": function}


def parse_messages_request(raw: bytes, *, served_model: str, default_max_tokens: int) -> ParsedRequest:
    """Validate a Messages body and make it the chat request the engine serves; raise `ApiError`
    (vLLM's validation 400) or `AnthropicError` (what the handler refuses)."""
    chat = to_chat(_json_object(raw))
    _check_served(chat["model"], served_model)
    try:
        return parse_body(Endpoint.CHAT, chat, served_model=served_model, default_max_tokens=default_max_tokens)
    except ApiError as error:
        raise AnthropicError.of(error) from error


def count_tokens_answer(raw: bytes, *, served_model: str) -> bytes:
    """``POST /v1/messages/count_tokens`` (vLLM's ``count_tokens``): the body converted to chat as
    a Messages request's, its prompt rendered and tokenized exactly as that request's would be, so
    ``input_tokens`` is what ``/v1/messages`` reports for the same body. Nothing is generated:
    ``tool_choice`` is validated but forces nothing (it does not change the prompt). Errors as
    ``parse_messages_request``'s: vLLM's validation 400, the handler's in Anthropic's shape."""
    request = _check_count(_json_object(raw))
    _check_served(request["model"], served_model)
    chat = {"model": request["model"], "messages": _chat_messages(request), **_chat_tools(request["tools"], None)}
    try:
        parsed = parse_body(Endpoint.CHAT, chat, served_model=served_model, default_max_tokens=1)
    except ApiError as error:
        raise AnthropicError.of(error) from error
    n = len(parsed.token_ids)
    return orjson.dumps({"input_tokens": n, "context_management": {"original_input_tokens": n}})


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _invalid((0,), "json_invalid", "JSON decode error", {}) from exc
    if not isinstance(body, dict):
        msg = "Input should be a valid dictionary or object to extract fields from"
        raise _invalid((), "model_attributes_type", msg, body)
    return body


def _check_served(model: str, served_model: str) -> None:
    if model != served_model:
        raise AnthropicError(404, f"The model `{model}` does not exist.", param="model")


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def _finish_reason(req: ParsedRequest) -> str:
    return req.tool_call.finish_reason if req.tool_call is not None else "length"


def _tool_block(call: ToolCall, n: int) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.call_id, "name": call.name, "input": json.loads(call.arguments(n))}


def message_answer(req: ParsedRequest, msg_id: str, text: str, input_tokens: int, output_tokens: int) -> bytes:
    """The whole answer (vLLM's ``messages_full_converter``; ``text`` unused for a tool call)."""
    call = req.tool_call
    content = [_tool_block(call, output_tokens)] if call is not None else [{"type": "text", "text": text}]
    if call is None and not text:
        content = []
    answer: dict[str, Any] = {"id": msg_id, "type": "message", "role": "assistant", "content": content}
    answer["model"] = req.model
    answer["stop_reason"] = STOP_REASONS[_finish_reason(req)]
    answer["usage"] = _usage(input_tokens, output_tokens)
    return orjson.dumps(answer)


class MessageEvents:
    """The SSE events of one streamed answer, in vLLM's order (see the module docstring).

    A delta event is built from byte templates: its per-token cost is one ``orjson.dumps`` of
    the token's text, as for chat chunks.
    """

    _DELTA_OPEN = b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":'
    _DELTA_CLOSE = b'},"index":0}\n\n'

    def __init__(self, req: ParsedRequest, msg_id: str) -> None:
        self._req = req
        self._id = msg_id
        self._started = False
        self._opened = False
        kind = b'"input_json_delta","partial_json":' if req.tool_call is not None else b'"text_delta","text":'
        self._delta_open = self._DELTA_OPEN + kind

    def tokens(self, indices: Iterable[int], input_tokens: int) -> bytes:
        """The events of generated tokens ``indices``, after ``message_start`` for the first batch."""
        parts = [] if self._started else [self._start(input_tokens)]
        call = self._req.tool_call
        for i in indices:
            piece = call.pieces[i] if call is not None else output_text(i)
            if not piece:
                continue  # vLLM sends no delta for an empty one
            if not self._opened:
                parts.append(self._open(call))
            parts.append(self._delta_open + orjson.dumps(piece) + self._DELTA_CLOSE)
        return b"".join(parts)

    def finish(self, input_tokens: int, output_tokens: int) -> bytes:
        """``content_block_stop`` (if a block was opened), ``message_delta`` and ``message_stop``."""
        parts = [] if self._started else [self._start(input_tokens)]
        if self._opened:
            parts.append(_event({"type": "content_block_stop", "index": 0}))
        delta = {"stop_reason": STOP_REASONS[_finish_reason(self._req)]}
        parts.append(_event({"type": "message_delta", "delta": delta, "usage": _usage(input_tokens, output_tokens)}))
        parts.append(_event({"type": "message_stop"}))
        return b"".join(parts)

    def _start(self, input_tokens: int) -> bytes:
        self._started = True
        message: dict[str, Any] = {
            "id": self._id,
            "content": [],
            "model": self._req.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(input_tokens, 0),
        }
        return _event({"type": "message_start", "message": message})

    def _open(self, call: ToolCall | None) -> bytes:
        self._opened = True
        block: dict[str, Any] = {"type": "text", "text": ""}
        if call is not None:
            block = {"type": "tool_use", "id": call.call_id, "name": call.name, "input": {}}
        return _event({"type": "content_block_start", "content_block": block, "index": 0})


async def stream_answer(events: MessageEvents, stream: TokenStream, send: Send, close_at: int | None) -> None:
    """Relay ``stream`` as Messages events (the connection dropped at ``close_at`` tokens, the
    ``close_mid_stream`` fault); nothing more once the engine aborted it."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    sent = 0
    while sent != close_at and (batch := await stream.drain()):
        await send(
            {"type": "http.response.body", "body": events.tokens(batch, stream.prompt_tokens), "more_body": True}
        )
        sent += len(batch)
    if sent == close_at:
        await drop_connection(send, stream)
        return
    if stream.finish_reason is FinishReason.ABORT:
        return
    tail = events.finish(stream.prompt_tokens, stream.num_tokens)
    await send({"type": "http.response.body", "body": tail, "more_body": False})


def _event(obj: dict[str, Any]) -> bytes:
    return b"event: " + str(obj["type"]).encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


__all__ = [
    "COUNT_TOKENS_PATH",
    "MESSAGES_PATH",
    "SSE_HEADERS",
    "STOP_REASONS",
    "AnthropicError",
    "MessageEvents",
    "chat_body",
    "count_tokens_answer",
    "message_answer",
    "parse_messages_request",
    "stream_answer",
    "to_chat",
]
