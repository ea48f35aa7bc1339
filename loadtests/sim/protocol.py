"""vLLM's OpenAI-compatible wire format: strict request parsing and byte-exact response shapes.

Shapes follow vLLM's ``entrypoints/openai/protocol.py`` and ``serving_chat.py`` /
``serving_completion.py``: a chat stream starts with a chunk whose delta is only
``{"role": "assistant", "content": ""}``; content chunks carry ``"logprobs": null`` and
``"finish_reason": null`` (and ``"usage": null`` when ``stream_options.include_usage``); the last
content chunk carries ``finish_reason`` and ``stop_reason``; with ``include_usage`` a final chunk
has ``"choices": []`` and the usage totals; then ``data: [DONE]``. The prompt tokens the engine
reused (``prompt_tokens_details``), and llama.cpp's shapes of the usage and ``timings``, are
``usage_report.py``'s: the renderer takes the usage objects it builds. With
``stream_options.continuous_usage_stats`` (and ``include_usage``) every chunk carries the usage so
far instead of ``null``, as vLLM does: the gateway reads the exact count of tokens already streamed
from it when it migrates a broken stream to another engine. Errors use vLLM's shape
``{"error": {"message", "type", "param", "code"}}``.

Tool calls, as vLLM makes them when ``tool_choice`` forces one (``"required"``, or a named
function ``{"type": "function", "function": {"name": ...}}``; vLLM's structured outputs then
force arguments valid for the tool's ``parameters``). The simulator stands for vLLM started with
``--enable-auto-tool-choice`` and a tool-call parser: under ``"auto"`` (the default when
``tools`` is given) or ``"none"`` the simulated model answers in text, as today (the parser finds
no call in it; without those flags vLLM refuses ``"auto"`` with a 400). A forced call is one call
to the named function, or with ``"required"`` to the first tool; its arguments are a JSON object
with a value for each property the schema lists in ``required`` (else for its first property):
the generated words inside a string, a fixed value otherwise (the first of an ``enum``, 1 for an
integer, 1.5 for a number, true, [], {}, null). Each generated token is one piece of the
arguments' text and the pieces end the object exactly at the generation's last token, so token
counts, TTFT and ITL are as for text. Shapes, as vLLM's:

* whole: ``message`` ``{"role": "assistant", "content": "", "tool_calls": [{"id":
  "chatcmpl-tool-<32 hex>", "type": "function", "function": {"name", "arguments"}}]}``;
* streamed: after the role chunk, one chunk per token whose delta is ``{"tool_calls": [{"id",
  "type": "function", "index": 0, "function": {"name", "arguments": <first piece>}}]}`` for the
  first token and ``{"tool_calls": [{"index": 0, "function": {"arguments": <piece>}}]}`` after;
* ``finish_reason``: the generation stops at the end of the object, and vLLM reports
  ``"tool_calls"`` for ``"required"`` but ``"stop"`` for a named function (as OpenAI does).

Not modelled: with ``"required"`` vLLM's model writes ``[{"name": ..., "parameters": {...}}]``
and the tokens of that wrapper stream no delta; here every token is an argument piece. The
engine's ``vllm:request_success_total`` still counts the request under its finished reason
(``length``). The tools (name, description, parameters) are rendered into the prompt as a
``tools`` turn before the messages, and an assistant message's ``tool_calls`` as ``name
arguments`` after its content, as chat templates put both in the prompt.

Content chunks are built from pre-rendered byte templates: the per-token cost is one
``orjson.dumps`` of the token text.

Prompts: by default the simulator's word tokenizer and tiny template (``tokenizer.py``) give the
ids; with a ``PromptTokenizer`` (``sim --tokenizer``: ``tokenizer.HfTokenization``) a text prompt's
ids are vLLM's, after the same validation (a chat without a chat template is vLLM's 400).
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from loadtests.sim.tokenizer import PromptError, count_tokens, output_text, render_chat, tokenize


class Endpoint(enum.Enum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"


class ApiError(Exception):
    """An error answered to the client in vLLM's JSON shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind  # the error's "type"; by default derived from the status, as vLLM does

    @property
    def error_type(self) -> str:
        return self.kind or {
            400: "BadRequestError",
            404: "NotFoundError",
            405: "MethodNotAllowed",
            503: "ServiceUnavailableError",
        }.get(self.status, "InternalServerError")

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.error_type, "param": self.param, "code": self.status}
        return orjson.dumps({"error": error})


class PromptTokenizer(Protocol):
    """A text prompt's ids as the engine computes them (``tokenizer.HfTokenization``); raises
    ``tokenizer.PromptError`` for a prompt it refuses."""

    def prompt_ids(self, body: Mapping[str, Any], *, chat: bool) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated generation or embedding request."""

    endpoint: Endpoint
    model: str
    token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    priority: int
    continuous_usage: bool
    cache_salt: str | None
    tool_call: ToolCall | None = None  # the call a forced tool_choice makes instead of text


@dataclass(frozen=True, slots=True)
class ToolCall:
    """The one function call of a forced ``tool_choice``: ``pieces[i]`` is the ``i``-th token's
    text of its arguments (see the module docstring)."""

    call_id: str
    name: str
    named: bool  # a named function (finish "stop"), not "required" (finish "tool_calls")
    pieces: tuple[str, ...]

    @property
    def finish_reason(self) -> str:
        return "stop" if self.named else "tool_calls"

    def arguments(self, n: int) -> str:
        """The arguments after ``n`` tokens, as vLLM's whole answer gives them: a named call's text
        as generated, a required one's object re-serialised (``json.dumps``)."""
        text = "".join(self.pieces[:n])
        return text if self.named or n != len(self.pieces) else json.dumps(json.loads(text), ensure_ascii=False)

    def message_call(self, n: int) -> dict[str, Any]:
        """The call in a whole answer's ``message.tool_calls``."""
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments(n)}}

    @classmethod
    def forced(cls, function: dict[str, Any], named: bool, n: int) -> ToolCall:
        """The call to ``function`` (a definition with a ``name`` and ``parameters``) over ``n``
        tokens, with a fresh id in vLLM's form."""
        pieces = argument_pieces(function.get("parameters"), n)
        return cls(f"chatcmpl-tool-{uuid.uuid4().hex}", function["name"], named, pieces)

    def delta(self, index: int) -> dict[str, Any]:
        """The streamed delta of token ``index``: the first carries the call's id and name."""
        if index:
            return {"tool_calls": [{"index": 0, "function": {"arguments": self.pieces[index]}}]}
        function = {"name": self.name, "arguments": self.pieces[0]}
        return {"tool_calls": [{"id": self.call_id, "type": "function", "index": 0, "function": function}]}


_STRING = object()  # a string property: it holds the generated words
_FIXED: dict[str, Any] = {"integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}, "null": None}


def _value_of(schema: Any) -> Any:
    """The fixed value of a property of ``schema``, or ``_STRING`` for one that takes words."""
    if not isinstance(schema, dict):
        return _STRING
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    return _FIXED.get(kind, _STRING) if isinstance(kind, str) else _STRING


def argument_pieces(parameters: Any, n: int) -> tuple[str, ...]:
    """``n`` pieces (``n`` >= 1) whose concatenation is a JSON object valid for ``parameters``:
    the literal text around the string values, and one generated word per token inside them."""
    schema = parameters if isinstance(parameters, dict) else {}
    found = schema.get("properties")
    properties: dict[str, Any] = found if isinstance(found, dict) else {}
    required = schema.get("required")
    names = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
    literals = ["{"]  # the text between string values
    for i, name in enumerate(dict.fromkeys(names or list(properties)[:1])):
        literals[-1] += ("" if i == 0 else ", ") + json.dumps(name) + ": "
        value = _value_of(properties.get(name))
        if value is _STRING:
            literals[-1] += '"'
            literals.append('"')
        else:
            literals[-1] += json.dumps(value, ensure_ascii=False)
    literals[-1] += "}"
    slots = len(literals) - 1
    if slots == 0:  # nothing to hold words: whitespace before the closing brace
        return (literals[0],) if n == 1 else (literals[0][:-1], *([" "] * (n - 2)), "}")
    words = max(0, n - len(literals))
    pieces: list[str] = []
    for k in range(slots):
        pieces.append(literals[k])
        first = k * (words // slots) + min(k, words % slots)
        count = words // slots + (1 if k < words % slots else 0)
        pieces.extend(json.dumps(output_text(w))[1:-1] for w in range(first, first + count))
    pieces.append(literals[-1])
    if len(pieces) > n:  # fewer tokens than the object's literal parts: the last token has the rest
        pieces[n - 1 :] = ["".join(pieces[n - 1 :])]
    return tuple(pieces)


def _function_of(tool: Any, index: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if (
        not isinstance(function, dict)
        or tool.get("type", "function") != "function"
        or not isinstance(function.get("name"), str)
        or not isinstance(function.get("parameters"), dict | None)
    ):
        raise ApiError(400, f"tools[{index}] must be a function tool with a string 'name'", param="tools")
    return function


def _tool_functions(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = field_of(body, "tools", list, [])
    return [_function_of(tool, i) for i, tool in enumerate(tools)]


def _forced_call(body: dict[str, Any], functions: list[dict[str, Any]], n: int) -> ToolCall | None:
    """The call ``tool_choice`` forces, if any (vLLM's ``check_tool_usage`` rules)."""
    choice = body.get("tool_choice")
    if choice is None or choice == "none":
        return None
    if "tools" not in body or body["tools"] is None:
        raise ApiError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto" or (choice == "required" and not functions):
        return None  # auto: the simulated model answers in text; required without tools: as none
    if choice == "required":
        function, named = functions[0], False
    elif isinstance(choice, dict):
        wanted = choice.get("function")
        name = wanted.get("name") if isinstance(wanted, dict) else None
        function = next((f for f in functions if f["name"] == name), {})
        if not isinstance(name, str) or not function:
            raise ApiError(
                400,
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                param="tool_choice",
            )
        named = True
    else:
        raise ApiError(
            400,
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are supported.',
            param="tool_choice",
        )
    return ToolCall.forced(function, named, n)


def field_of(body: dict[str, Any], key: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    """``body[key]`` checked against ``kinds`` (a bool is not an int), ``default`` when absent or null."""
    value = body.get(key, default)
    if value is None:
        return default
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise ApiError(400, f"'{key}' has the wrong type", param=key)
    return value


def model_body(raw: bytes, served_model: str) -> dict[str, Any]:
    """A request body as a JSON object naming the served model (400 otherwise; 404 for another model)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"invalid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = field_of(body, "model", str, served_model)
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")
    return body


def _message_text(message: Any, index: int) -> dict[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, f"messages[{index}] must be an object with a string 'role'", param="messages")
    content = message.get("content") or ""
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{index}].content must be a string or parts", param="messages")
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        content = " ".join([content, *(_call_text(call) for call in calls)])
    return {"role": message["role"], "content": content}


def _call_text(call: Any) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return ""
    return f"{function.get('name') or ''} {function.get('arguments') or ''}"


def tools_turn(functions: list[dict[str, Any]]) -> dict[str, str]:
    """The tools as the prompt shows them: a ``tools`` turn of their JSON definitions."""
    defined = [{k: f.get(k) for k in ("name", "description", "parameters")} for f in functions]
    return {"role": "tools", "content": orjson.dumps(defined).decode()}


def _chat_prompt(
    body: dict[str, Any], functions: list[dict[str, Any]], prompter: PromptTokenizer | None = None
) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    rendered = [_message_text(m, i) for i, m in enumerate(messages)]
    if functions:
        rendered.insert(0, tools_turn(functions))
    add_prompt = field_of(body, "add_generation_prompt", bool, True)
    cont = field_of(body, "continue_final_message", bool, False)
    if cont and add_prompt:
        raise ApiError(400, "continue_final_message requires add_generation_prompt=false")
    if cont and rendered[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message needs a final assistant message", param="messages")
    if prompter is not None:
        return _engine_ids(prompter, body, chat=True)
    return tokenize(render_chat(rendered, add_generation_prompt=add_prompt, continue_final_message=cont))


def _completion_prompt(body: dict[str, Any], key: str, prompter: PromptTokenizer | None = None) -> list[int]:
    prompt = body.get(key)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if prompter is not None:  # a batch of one is its prompt, for vLLM too
            return _engine_ids(prompter, {**body, "prompt": prompt}, chat=False)
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ApiError(400, f"'{key}' must be a string, a list of token ids, or a list of one of them", param=key)


def _engine_ids(prompter: PromptTokenizer, body: Mapping[str, Any], *, chat: bool) -> list[int]:
    try:
        return prompter.prompt_ids(body, chat=chat)
    except PromptError as exc:
        raise ApiError(400, str(exc)) from exc


def parse_request(
    endpoint: Endpoint,
    raw: bytes,
    *,
    served_model: str,
    default_max_tokens: int,
    prompter: PromptTokenizer | None = None,
) -> ParsedRequest:
    """Validate a request body; raise `ApiError` (400, or 404 for another model)."""
    body = model_body(raw, served_model)
    return parse_body(
        endpoint, body, served_model=served_model, default_max_tokens=default_max_tokens, prompter=prompter
    )


def parse_body(
    endpoint: Endpoint,
    body: dict[str, Any],
    *,
    served_model: str,
    default_max_tokens: int,
    prompter: PromptTokenizer | None = None,
) -> ParsedRequest:
    """Validate a request body already read as a JSON object (its model checked); raise `ApiError`.
    A text prompt's ids are ``prompter``'s when given, the word tokenizer's otherwise."""
    model = served_model
    if field_of(body, "n", int, 1) != 1:
        raise ApiError(400, "only n=1 is supported by the simulator", param="n")
    functions: list[dict[str, Any]] = []
    if endpoint is Endpoint.CHAT:
        functions = _tool_functions(body)
        tokens = _chat_prompt(body, functions, prompter)
        max_tokens = field_of(body, "max_completion_tokens", int, None) or field_of(body, "max_tokens", int, None)
    elif endpoint is Endpoint.COMPLETION:
        tokens = _completion_prompt(body, "prompt", prompter)
        max_tokens = field_of(body, "max_tokens", int, None)
    else:
        tokens = _completion_prompt(body, "input", prompter)
        max_tokens = 0
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens < 0 or (max_tokens == 0 and endpoint is not Endpoint.EMBEDDING):
        raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
    options = field_of(body, "stream_options", dict, {})
    salt = field_of(body, "cache_salt", str, None)
    if salt == "":
        raise ApiError(400, "cache_salt must be a non-empty string", param="cache_salt")
    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        token_ids=tokens,
        max_tokens=max_tokens,
        stream=field_of(body, "stream", bool, False),
        include_usage=bool(options.get("include_usage", False)),
        priority=field_of(body, "priority", int, 0),
        continuous_usage=bool(options.get("include_usage")) and bool(options.get("continuous_usage_stats")),
        cache_salt=salt,
        tool_call=_forced_call(body, functions, max_tokens) if endpoint is Endpoint.CHAT else None,
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` without ``prompt_tokens_details``: the per-chunk usage of continuous
    stats, which never has it (the answers' usage, with the reuse: ``usage_report.py``)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class StreamRenderer:
    """SSE byte chunks of one streamed chat or text completion.

    With ``continuous_prompt`` set (the prompt's token count), every chunk carries the usage so
    far (vLLM's ``continuous_usage_stats``); ``completion_tokens`` is the count including the chunk.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        req_id: str,
        model: str,
        created: int,
        include_usage: bool,
        continuous_prompt: int | None = None,
    ) -> None:
        self.chat = endpoint is Endpoint.CHAT
        self._head = {
            "id": req_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": created,
            "model": model,
        }
        self._include_usage = include_usage
        self._continuous_prompt = continuous_prompt
        head = orjson.dumps(self._head)[:-1]
        if self.chat:
            self._open = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
            self._close = b'},"logprobs":null,"finish_reason":null}]'
        else:
            self._open = b"data: " + head + b',"choices":[{"index":0,"text":'
            self._close = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]'
        if continuous_prompt is None:
            self._close += (b',"usage":null}' if include_usage else b"}") + b"\n\n"

    def role_chunk(self) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._event({**self._head, "choices": [choice]}, 0)

    def content(self, text: str, completion_tokens: int = 0) -> bytes:
        if self._continuous_prompt is None:
            return self._open + orjson.dumps(text) + self._close
        use = usage(self._continuous_prompt, completion_tokens)
        return self._open + orjson.dumps(text) + self._close + b',"usage":' + orjson.dumps(use) + b"}\n\n"

    def final(
        self, text: str, finish_reason: str, completion_tokens: int = 0, timings: dict[str, Any] | None = None
    ) -> bytes:
        """The last token's chunk, with the finish reason (and llama.cpp's ``timings`` when given)."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice.update(finish_reason=finish_reason, stop_reason=None)
        return self._event(self._with_timings({**self._head, "choices": [choice]}, timings), completion_tokens)

    def tool_chunk(self, call: ToolCall, index: int, last: bool, timings: dict[str, Any] | None = None) -> bytes:
        """Token ``index`` of a forced tool call (the last one carries the finish reason, and
        llama.cpp's ``timings`` when given)."""
        choice: dict[str, Any] = {"index": 0, "delta": call.delta(index), "logprobs": None, "finish_reason": None}
        if last:
            choice.update(finish_reason=call.finish_reason, stop_reason=None)
        return self._event(self._with_timings({**self._head, "choices": [choice]}, timings), index + 1)

    def usage_chunk(self, use: dict[str, Any], timings: dict[str, Any] | None = None) -> bytes:
        """The usage-only chunk (``"choices": []``) with ``use`` (``UsageReport.final``) and
        llama.cpp's ``timings`` when given."""
        return self._event(self._with_timings({**self._head, "choices": [], "usage": use}, timings), 0)

    @staticmethod
    def _with_timings(obj: dict[str, Any], timings: dict[str, Any] | None) -> dict[str, Any]:
        if timings is not None:
            obj["timings"] = timings
        return obj

    def _event(self, obj: dict[str, Any], completion_tokens: int) -> bytes:
        if self._include_usage and "usage" not in obj:
            prompt = self._continuous_prompt
            obj["usage"] = None if prompt is None else usage(prompt, completion_tokens)
        return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def full_response(
    endpoint: Endpoint,
    req_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    use: dict[str, Any],
    tool_calls: list[dict[str, Any]] | None = None,
    timings: dict[str, Any] | None = None,
) -> bytes:
    """A non-streaming `chat.completion` or `text_completion` body; with ``tool_calls`` (chat), a
    message that makes them (``text`` is then its content: vLLM's ``""``); with ``timings``,
    llama.cpp's object last (``usage_report.py``)."""
    if endpoint is Endpoint.CHAT:
        message = {"role": "assistant", "content": text, "tool_calls": tool_calls or []}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        obj = "text_completion"
    body = {"id": req_id, "object": obj, "created": created, "model": model, "choices": [choice], "usage": use}
    if endpoint is Endpoint.CHAT:
        body["prompt_logprobs"] = None
    if timings is not None:
        body["timings"] = timings
    return orjson.dumps(body)


def embedding_response(req_id: str, model: str, created: int, vector: list[float], prompt_tokens: int) -> bytes:
    data = [{"index": 0, "object": "embedding", "embedding": vector}]
    use = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    return orjson.dumps(
        {"id": req_id, "object": "list", "created": created, "model": model, "data": data, "usage": use}
    )


def models_response(model: str, created: int, max_model_len: int) -> bytes:
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [],
    }
    return orjson.dumps({"object": "list", "data": [card]})


__all__ = [
    "DONE",
    "ApiError",
    "Endpoint",
    "ParsedRequest",
    "PromptTokenizer",
    "StreamRenderer",
    "ToolCall",
    "argument_pieces",
    "count_tokens",
    "parse_body",
    "parse_request",
    "tools_turn",
]
