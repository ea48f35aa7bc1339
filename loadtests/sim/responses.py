"""vLLM's Responses API, ``POST /v1/responses``, on the simulated engine.

Shapes follow vLLM's ``entrypoints/openai/responses/`` (``api_router.py``, ``serving.py``,
``protocol.py``, ``streaming_events.py``, ``utils.py``) for a model served without a reasoning
or tool parser: vLLM's "simple" path, not gpt-oss's Harmony one. With
``VLLM_ENABLE_RESPONSES_API_STORE=1``, that is: ``store`` and ``previous_response_id`` work.

* **Prompt.** The request becomes chat messages as vLLM's ``construct_input_messages`` builds
  them: ``instructions`` as a system message; with ``previous_response_id``, the stored
  conversation of that response without its system messages (instructions do not carry over)
  and then its output as an assistant message; then ``input``: a string is one user message, a
  list holds message items (content a string, or parts whose ``text`` are joined as a chat
  message's are), ``function_call_output`` items (tool messages), ``function_call`` items
  (assistant messages) and ``reasoning`` items (skipped). The messages are rendered and
  tokenized exactly as a chat request's, so the prefix cache and ``cache_salt`` work as for
  chat, and a follow-up shares its predecessor's prefix. A final assistant item whose
  ``status`` is ``in_progress`` or ``incomplete`` is continued, as vLLM does.
* **Length.** ``max_output_tokens`` bounds the output (default: the profile's, as for chat),
  capped by what the context leaves (vLLM: ``min(max_output_tokens, max_model_len - prompt)``);
  a prompt that fills the context is a 400. The simulated engine always generates exactly the
  bound, so a request that gave ``max_output_tokens`` (or was capped by the context) ends
  ``"incomplete"`` with ``incomplete_details {"reason": "max_output_tokens"}``, as vLLM reports a
  generation stopped by its length; one that gave no bound ends ``"completed"`` (the default
  length stands for the model's natural stop).
* **Usage.** ``input_tokens`` with ``input_tokens_details.cached_tokens`` from the prefix cache,
  ``output_tokens``, ``output_tokens_details.reasoning_tokens`` (0), ``total_tokens``, plus
  vLLM's per-turn lists (empty on this path) and ``tool_output_tokens`` (0).
* **Stream.** Each event is ``event: <type>\\ndata: <json>\\n\\n`` and the stream just ends
  (no ``data: [DONE]``). Events, ``sequence_number`` from 0: ``response.created`` and
  ``response.in_progress`` (sent at once, before the first token), then with the first token
  ``response.output_item.added`` and ``response.content_part.added``, one
  ``response.output_text.delta`` per token, then ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done`` and ``response.completed``
  (also when the status is ``incomplete``: vLLM never sends ``response.incomplete``). As in
  vLLM, the streamed item's id is a bare hex uuid while the final response's message id is a
  fresh ``msg_...``, and the done item carries an extra ``"summary": []``.
* **Store.** A response with ``store`` (the default) is kept for ``previous_response_id`` once it
  has finished (an aborted one is not); the engine keeps the last ``STORE_LIMIT`` in memory
  (vLLM keeps all, forever). An unknown id is vLLM's 404
  ``{"error": {"message": "Response with id '<id>' not found.", "type": "invalid_request_error",
  "param": "response_id", "code": 404}}``. The store is per engine, as vLLM's is per server.
* **Function calls.** The function tools of ``tools`` (``{"type": "function", "name",
  "description", "parameters"}``; other kinds are echoed, without effect) are rendered into the
  prompt as chat's are (a ``tools`` turn before the messages; not stored for a follow-up, which
  renders its own). A ``tool_choice`` that forces a call (``"required"``: the first function
  tool; ``{"type": "function", "name": ...}``: that one, a 400 if no function tool has the name)
  makes the answer one call, as chat's forced call (``protocol.py``): its arguments, a JSON
  object valid for the tool's ``parameters``, one piece a token, ending at the last token, so
  the status is ``completed`` (the object ends the generation) whatever the bound; ``"auto"``,
  ``"none"`` and other choices answer text. Shapes, as vLLM's (``build_response_output_items``
  and the simple path's streaming processor):

  - whole: ``output`` is the one item ``{"arguments", "call_id": "chatcmpl-tool-<32 hex>",
    "name", "type": "function_call", "id": "fc_<32 hex>", "status": "completed"}`` (no message);
    ``"required"`` re-serialises the arguments (``json.dumps``), a named call keeps them as
    generated;
  - streamed: with the first token ``response.output_item.added`` (the item with ``"arguments":
    ""`` and ``"status": "in_progress"``), one ``response.function_call_arguments.delta``
    ``{"delta", "item_id", "output_index", "sequence_number", "type"}`` per token, then
    ``response.function_call_arguments.done`` (``arguments``: the deltas joined, and ``name``),
    ``response.output_item.done`` (the item ``completed``) and ``response.completed``. As for a
    message, the streamed item is vLLM's own: a bare hex ``id`` and a ``call_<32 hex>``
    ``call_id``, while ``response.completed`` carries the whole answer's fresh ids.

  A follow-up by ``previous_response_id`` to a function call continues the stored conversation
  without the call, as vLLM's does (it adds only a previous output's messages); the call's
  result comes as a ``function_call_output`` item, a tool message.

Accepted and echoed in the response, without effect: ``temperature``, ``top_p``,
``parallel_tool_calls``, ``metadata``, ``reasoning``, ``text``, ``user``, ``max_tool_calls``,
``service_tier``, ``truncation``; ``include`` and the other sampling fields are ignored (no
logprobs). ``background`` and ``prompt`` are 400s.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from loadtests.sim.protocol import ApiError, ToolCall, field_of, model_body, tools_turn
from loadtests.sim.tokenizer import output_text, render_chat, tokenize

RESPONSES_PATH = "/v1/responses"
STORE_LIMIT = 10_000
_SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
_TRUNCATIONS = ("auto", "disabled")

Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """What a follow-up needs of a finished response: its conversation and its output length."""

    messages: tuple[Message, ...]
    output_tokens: int
    called: bool = False  # the output was a function call, which a follow-up leaves out (as vLLM)


class ResponseStore:
    """Finished responses by id, for ``previous_response_id``: the last ``limit`` stored."""

    def __init__(self, limit: int = STORE_LIMIT) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def put(self, response_id: str, messages: Sequence[Message], output_tokens: int, *, called: bool = False) -> None:
        """Store a finished response; ``called``: its output was a function call (a follow-up leaves it out)."""
        self._items[response_id] = StoredResponse(tuple(messages), output_tokens, called)
        self._items.move_to_end(response_id)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated ``POST /v1/responses`` body, with the prompt it gives the engine."""

    response_id: str
    model: str
    messages: tuple[Message, ...]  # the whole conversation, as stored for a follow-up
    token_ids: list[int]
    max_tokens: int
    bounded: bool  # max_output_tokens (or the context) set max_tokens: reaching it is "incomplete"
    stream: bool
    store: bool
    priority: int
    cache_salt: str | None
    echo: dict[str, Any]  # request fields the response object repeats
    tool_call: ToolCall | None = None  # the call a forced tool_choice makes instead of text

    def status(self, output_tokens: int) -> str:
        """``incomplete`` when the bound cut the text; a call's object ends the generation."""
        if self.tool_call is not None:
            return "completed"
        return "incomplete" if self.bounded and output_tokens >= self.max_tokens else "completed"


def _choice(body: dict[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    value = body.get(key)
    if value is None:
        return default
    if value not in allowed:
        raise ApiError(400, f"'{key}' must be one of {list(allowed)}", param=key)
    return str(value)


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or its parts' ``text`` joined as chat's are."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise ApiError(400, f"{where}.content must be a string or a list of parts", param="input")


def _item_message(item: Any, index: int) -> Message | None:
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise ApiError(400, f"{where} must be an object", param="input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str):
            raise ApiError(400, f"{where} must have a string 'role'", param="input")
        return {"role": role, "content": _text_of(item.get("content"), where)}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "content": output if isinstance(output, str) else orjson.dumps(output).decode()}
    if kind == "function_call":
        return {"role": "assistant", "content": f"{item.get('name', '')} {item.get('arguments', '')}"}
    if kind == "reasoning":
        return None
    raise ApiError(400, f"{where}: input items of type {kind!r} are not supported by the simulator", param="input")


def _input_messages(value: Any) -> tuple[list[Message], bool]:
    """The messages of ``input`` and whether the last one is an assistant turn to continue."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], False
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", param="input")
    messages = [m for i, item in enumerate(value) if (m := _item_message(item, i)) is not None]
    last = value[-1]
    cont = (
        last.get("type", "message") == "message"
        and last.get("status") in ("in_progress", "incomplete")
        and bool(messages)
        and messages[-1]["role"] == "assistant"
    )
    return messages, cont


def _function_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The function tools of ``tools``; the other kinds (built-in tools) are echoed, without effect."""
    functions = []
    for i, tool in enumerate(field_of(body, "tools", list, [])):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("parameters"), dict | None):
            raise ApiError(400, f"tools[{i}] must be a function tool with a string 'name'", param="tools")
        functions.append(tool)
    return functions


def _forced_call(choice: Any, functions: list[dict[str, Any]], n: int) -> ToolCall | None:
    """The call of ``n`` tokens that ``tool_choice`` forces, if any (see the module docstring)."""
    if choice == "required":
        return ToolCall.forced(functions[0], False, n) if functions else None
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    function = next((f for f in functions if f["name"] == choice.get("name")), None)
    if function is None:
        raise ApiError(
            400,
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            param="tool_choice",
        )
    return ToolCall.forced(function, True, n)


def generated_text(output_tokens: int) -> str:
    """The text of a response's ``output_tokens`` generated tokens."""
    return "".join(output_text(i) for i in range(output_tokens))


def parse_responses_request(
    raw: bytes, *, served_model: str, default_max_tokens: int, max_model_len: int, store: ResponseStore
) -> ResponsesRequest:
    """Validate a body; raise `ApiError` (400; 404 for another model or an unknown previous response)."""
    body = model_body(raw, served_model)
    model = served_model
    if "input" not in body:
        raise ApiError(400, "'input' is required", param="input")
    if body.get("prompt") is not None:
        raise ApiError(400, "prompt template is not supported", param="prompt")
    if body.get("background"):
        raise ApiError(400, "background mode is not supported by the simulator", param="background")
    salt = field_of(body, "cache_salt", str, None)
    if salt == "":
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    requested = field_of(body, "max_output_tokens", int, None)
    if requested is not None and requested < 1:
        raise ApiError(400, "max_output_tokens must be at least 1", param="max_output_tokens")
    instructions = field_of(body, "instructions", str, None)
    previous_id = field_of(body, "previous_response_id", str, None)
    request_id = field_of(body, "request_id", str, None) or f"resp_{uuid.uuid4().hex}"
    functions = _function_tools(body)

    messages: list[Message] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous_id is not None:
        previous = store.get(previous_id)
        if previous is None:
            raise ApiError(
                404,
                f"Response with id '{previous_id}' not found.",
                param="response_id",
                kind="invalid_request_error",
            )
        messages.extend(m for m in previous.messages if m["role"] != "system")
        if previous.output_tokens and not previous.called:
            messages.append({"role": "assistant", "content": generated_text(previous.output_tokens)})
    new, cont = _input_messages(body["input"])
    messages.extend(new)
    rendered = [tools_turn(functions), *messages] if functions else messages
    tokens = tokenize(render_chat(rendered, add_generation_prompt=not cont, continue_final_message=cont))
    room = max_model_len - len(tokens)
    if room <= 0:
        raise ApiError(
            400,
            f"The engine prompt length {len(tokens)} exceeds the max_model_len {max_model_len}. Please reduce prompt.",
            param="input",
            kind="invalid_request_error",
        )
    wanted = default_max_tokens if requested is None else requested
    max_tokens = min(wanted, room)

    echo = {
        "instructions": instructions,
        "metadata": field_of(body, "metadata", dict, None),
        "parallel_tool_calls": field_of(body, "parallel_tool_calls", bool, True),
        "temperature": float(field_of(body, "temperature", (int, float), 1.0)),
        "tool_choice": field_of(body, "tool_choice", (str, dict), "auto"),
        "tools": field_of(body, "tools", list, []),
        "top_p": float(field_of(body, "top_p", (int, float), 1.0)),
        "max_tool_calls": field_of(body, "max_tool_calls", int, None),
        "previous_response_id": previous_id,
        "reasoning": field_of(body, "reasoning", dict, None),
        "service_tier": _choice(body, "service_tier", _SERVICE_TIERS, "auto"),
        "text": field_of(body, "text", dict, None),
        "truncation": _choice(body, "truncation", _TRUNCATIONS, "disabled"),
        "user": field_of(body, "user", str, None),
    }
    req = ResponsesRequest(
        response_id=request_id,
        model=model,
        messages=tuple(messages),
        token_ids=tokens,
        max_tokens=max_tokens,
        bounded=requested is not None or wanted > room,
        stream=field_of(body, "stream", bool, False),
        store=field_of(body, "store", bool, True),
        priority=field_of(body, "priority", int, 0),
        cache_salt=salt,
        echo=echo,
        tool_call=_forced_call(body.get("tool_choice"), functions, max_tokens),
    )
    return req


def response_usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """vLLM's ``ResponseUsage`` (its per-turn lists are empty on the simple path)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {
            "cached_tokens": cached_tokens,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": input_tokens + output_tokens,
    }


def response_object(
    req: ResponsesRequest,
    created: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """vLLM's ``ResponsesResponse.from_request``, its fields in its order."""
    e = req.echo
    return {
        "id": req.response_id,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": e["instructions"],
        "metadata": e["metadata"],
        "model": req.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": e["parallel_tool_calls"],
        "temperature": e["temperature"],
        "tool_choice": e["tool_choice"],
        "tools": e["tools"],
        "top_p": e["top_p"],
        "background": False,
        "max_output_tokens": req.max_tokens,
        "max_tool_calls": e["max_tool_calls"],
        "previous_response_id": e["previous_response_id"],
        "prompt": None,
        "reasoning": e["reasoning"],
        "service_tier": e["service_tier"],
        "status": status,
        "text": e["text"],
        "top_logprobs": None,
        "truncation": e["truncation"],
        "usage": usage,
        "user": e["user"],
        "input_messages": None,
        "output_messages": None,
    }


def final_response(
    req: ResponsesRequest, created: int, text: str, input_tokens: int, output_tokens: int, cached_tokens: int
) -> dict[str, Any]:
    """The finished response: the body of a non-streaming answer and of ``response.completed``;
    its output is the message of ``text`` or, for a forced call, the call (``text`` unused)."""
    use = response_usage(input_tokens, output_tokens, cached_tokens)
    call = req.tool_call
    if call is not None:
        item = _call_item(call, call.arguments(output_tokens), call.call_id, f"fc_{uuid.uuid4().hex}", "completed")
        return response_object(req, created, status=req.status(output_tokens), output=[item], usage=use)
    content: list[dict[str, Any]] = (
        [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}] if text else []
    )
    message = {
        "id": f"msg_{uuid.uuid4().hex}",
        "content": content,
        "role": "assistant",
        "status": "completed",
        "type": "message",
    }
    return response_object(req, created, status=req.status(output_tokens), output=[message], usage=use)


def _call_item(call: ToolCall, arguments: str, call_id: str, item_id: str, status: str) -> dict[str, Any]:
    """A ``function_call`` output item, the fields in the SDK's order."""
    return {
        "arguments": arguments,
        "call_id": call_id,
        "name": call.name,
        "type": "function_call",
        "id": item_id,
        "status": status,
    }


class ResponseEvents:
    """The SSE events of one streamed response, in vLLM's order (see the module docstring): a
    message's, or a forced function call's.

    A delta event is built from byte templates: its per-token cost is one ``orjson.dumps`` of
    the token text (or argument piece), as for chat chunks.
    """

    def __init__(self, req: ResponsesRequest, created: int) -> None:
        self._req = req
        self._created = created
        self._seq = 0
        self._item_id = uuid.uuid4().hex
        self._pieces: list[str] = []
        self._call = req.tool_call
        item = orjson.dumps(self._item_id)
        if self._call is None:
            self._delta_open = b'event: response.output_text.delta\ndata: {"content_index":0,"delta":'
            self._delta_mid = b',"item_id":' + item + b',"logprobs":[],"output_index":0,"sequence_number":'
            self._delta_close = b',"type":"response.output_text.delta"}\n\n'
        else:
            self._call_id = f"call_{uuid.uuid4().hex}"
            self._delta_open = b'event: response.function_call_arguments.delta\ndata: {"delta":'
            self._delta_mid = b',"item_id":' + item + b',"output_index":0,"sequence_number":'
            self._delta_close = b',"type":"response.function_call_arguments.delta"}\n\n'
        self._opened = False

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        initial = response_object(self._req, self._created, status="in_progress", output=[], usage=None)
        created = {"response": initial, "sequence_number": self._next(), "type": "response.created"}
        progress = {"response": initial, "sequence_number": self._next(), "type": "response.in_progress"}
        return _event(created) + _event(progress)

    def delta(self, text: str) -> bytes:
        """One token's delta event, after the item's opening events for the first: the token's
        ``text``, or for a call its next argument piece (``text`` unused)."""
        head = b"" if self._opened else self._open()
        if self._call is not None:
            text = self._call.pieces[len(self._pieces)]
        self._pieces.append(text)
        seq = str(self._next()).encode()
        return head + self._delta_open + orjson.dumps(text) + self._delta_mid + seq + self._delta_close

    def finish(self, final: dict[str, Any]) -> bytes:
        """The done events of the item (if one was opened) and ``response.completed`` with ``final``."""
        parts: list[bytes] = []
        if self._opened:
            parts += self._message_done() if self._call is None else self._call_done(self._call)
        completed = {"response": final, "sequence_number": self._next(), "type": "response.completed"}
        parts.append(_event(completed))
        return b"".join(parts)

    def _message_done(self) -> list[bytes]:
        text = "".join(self._pieces)
        part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
        common: dict[str, Any] = {"content_index": 0, "item_id": self._item_id}
        done_text = {
            **common,
            "logprobs": [],
            "output_index": 0,
            "sequence_number": self._next(),
            "text": text,
            "type": "response.output_text.done",
        }
        done_part = {
            **common,
            "output_index": 0,
            "part": part,
            "sequence_number": self._next(),
            "type": "response.content_part.done",
        }
        item = {
            "id": self._item_id,
            "content": [part] if text else [],
            "role": "assistant",
            "status": "completed",
            "type": "message",
            "summary": [],
        }
        return [_event(done_text), _event(done_part), self._item_event("done", item)]

    def _call_done(self, call: ToolCall) -> list[bytes]:
        arguments = "".join(self._pieces)
        done_arguments = {
            "arguments": arguments,
            "item_id": self._item_id,
            "output_index": 0,
            "sequence_number": self._next(),
            "type": "response.function_call_arguments.done",
            "name": call.name,  # vLLM's extra field, after the SDK's
        }
        item = _call_item(call, arguments, self._call_id, self._item_id, "completed")
        return [_event(done_arguments), self._item_event("done", item)]

    def _open(self) -> bytes:
        self._opened = True
        if self._call is not None:
            return self._item_event("added", _call_item(self._call, "", self._call_id, self._item_id, "in_progress"))
        item = {"id": self._item_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message"}
        added = self._item_event("added", item)
        part: dict[str, Any] = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        part_added = {
            "content_index": 0,
            "item_id": self._item_id,
            "output_index": 0,
            "part": part,
            "sequence_number": self._next(),
            "type": "response.content_part.added",
        }
        return added + _event(part_added)

    def _item_event(self, kind: str, item: dict[str, Any]) -> bytes:
        """``response.output_item.added`` or ``.done`` (``kind``) with ``item``."""
        seq = self._next()
        return _event({"item": item, "output_index": 0, "sequence_number": seq, "type": f"response.output_item.{kind}"})

    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq


def _event(obj: dict[str, Any]) -> bytes:
    return b"event: " + str(obj["type"]).encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


__all__ = [
    "RESPONSES_PATH",
    "STORE_LIMIT",
    "ResponseEvents",
    "ResponseStore",
    "ResponsesRequest",
    "final_response",
    "generated_text",
    "parse_responses_request",
    "response_object",
    "response_usage",
]
