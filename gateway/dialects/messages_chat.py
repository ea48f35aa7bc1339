"""Anthropic Messages answered through chat completions: the body there, the answer and the stream back.

The conversion is vLLM's own (``vllm/entrypoints/anthropic/serving.py``), so that a client sees
the same answer whether the gateway passes its request through to vLLM's ``/v1/messages`` or
translates it to any engine's ``/v1/chat/completions``:

* **Request**: ``system`` (a string or text blocks) becomes one system message; each message's
  blocks become chat content (``text``; ``image`` as an ``image_url``, base64 as a data URL),
  ``tool_use`` blocks the assistant's ``tool_calls`` (input as JSON arguments), ``thinking``
  its ``reasoning``, and a user's ``tool_result`` a ``tool`` message (before the user's other
  content, as the API orders them); ``tools`` become function tools (``input_schema`` as
  ``parameters``), ``tool_choice`` auto/any/none/tool becomes auto/required/none/named;
  ``stop_sequences`` is ``stop``; ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` and
  ``chat_template_kwargs`` carry over; ``metadata``, ``thinking`` and ``service_tier`` have no
  chat equivalent and are dropped (vLLM ignores them too).
* **Answer**: one ``message`` whose content is the reasoning as a ``thinking`` block, the text
  as a ``text`` block, then each tool call as a ``tool_use`` block (arguments parsed back to an
  object; arguments that are not a JSON object are kept whole as ``{"arguments": <text>}``);
  finish reasons stop/length/tool_calls as stop reasons end_turn/max_tokens/tool_use (a stop
  on one of the client's ``stop_sequences``, which vLLM reports in the choice's ``stop_reason``,
  is ``stop_sequence`` with that sequence); usage as ``input_tokens``/``output_tokens``. One
  departure from vLLM: an answer that holds a tool call stops with ``tool_use`` even when the
  engine said ``stop`` (vLLM's finish for a named ``tool_choice``, hence ``end_turn`` from its own
  Messages endpoint): an agent runs its tools when, and only when, the stop reason is ``tool_use``.
* **Stream** (``MessagesStream``): ``message_start`` at the first chunk (``input_tokens`` from
  its usage when the engine reports it per chunk, else 0, as vLLM), then one content block at
  a time (``content_block_start``, its deltas, ``content_block_stop``; a new kind of output
  closes the open block), ``message_delta`` (stop reason, usage) at the usage chunk, and
  ``message_stop`` once the chat stream completed. Every event is ``event: <type>`` framed.
"""

from __future__ import annotations

import os
from typing import Any, final

import orjson

from gateway.dialects.base import Dialect
from gateway.dialects.chat import CHAT

COPIED_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
"""Chat finish reasons as Anthropic's stop reasons (others pass as they are)."""


@final
class MessagesViaChat:
    """The ``Translation`` of Messages to chat completions (module docstring)."""

    __slots__ = ()

    @property
    def upstream(self) -> Dialect:
        return CHAT

    def request_body(self, body: dict[str, Any]) -> dict[str, Any]:
        return chat_body(body)

    def answer(self, document: dict[str, Any]) -> dict[str, Any]:
        return messages_answer(document)

    def stream(self) -> MessagesStream:
        return MessagesStream()


MESSAGES_VIA_CHAT = MessagesViaChat()


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request for a validated Messages body."""
    out: dict[str, Any] = {name: body[name] for name in COPIED_FIELDS if body.get(name) is not None}
    messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for message in body["messages"]:
        _add_message(message, messages)
    out["messages"] = messages
    stop = body.get("stop_sequences")
    if stop:
        out["stop"] = stop
    tools = body.get("tools")
    if tools:
        out["tools"] = [_function_tool(tool) for tool in tools if isinstance(tool, dict)]
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        out["tool_choice"] = choice
    elif tools:
        out["tool_choice"] = "auto"
    return out


def messages_answer(answer: dict[str, Any]) -> dict[str, Any]:
    """The Messages answer for a whole chat answer."""
    choices = answer.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = _object(choice.get("message"))
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": os.urandom(16).hex()})
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            content.append(
                {
                    "type": "tool_use",
                    "id": call.get("id") or _tool_use_id(),
                    "name": function.get("name") or "",
                    "input": tool_input(function.get("arguments")),
                }
            )
    stop_reason, stop_sequence = stop_of(choice)
    if stop_reason == "end_turn" and any(block["type"] == "tool_use" for block in content):
        stop_reason = "tool_use"  # a named tool choice finishes "stop" on vLLM; the client must run the tool
    usage = _object(answer.get("usage"))
    return {
        "id": answer.get("id") or f"msg_{os.urandom(12).hex()}",
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": answer.get("model"),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": usage.get("prompt_tokens") or 0,
            "output_tokens": usage.get("completion_tokens") or 0,
        },
    }


def stop_of(choice: dict[str, Any]) -> tuple[str | None, str | None]:
    """A chat choice's finish as Anthropic's ``(stop_reason, stop_sequence)``."""
    reason = choice.get("finish_reason")
    if not isinstance(reason, str):
        return None, None
    matched = choice.get("stop_reason")
    if reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(reason, reason), None


def tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's JSON arguments as the ``input`` object of a ``tool_use`` block."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            parsed = orjson.loads(arguments) if arguments else {}
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
    return {"arguments": arguments}


class MessagesStream:
    """Chat chunks of one stream as Messages events (module docstring); one per stream."""

    __slots__ = ("_block", "_delta_sent", "_finish", "_index", "_started", "_tool_index", "_tool_used")

    def __init__(self) -> None:
        self._started = False
        self._block: str | None = None
        """The type of the open content block (``text``, ``thinking``, ``tool_use``), if one is."""
        self._index = -1
        self._tool_index: int | None = None
        """The chat tool-call index the open ``tool_use`` block belongs to."""
        self._tool_used = False
        self._finish: dict[str, Any] = {}
        self._delta_sent = False

    def event(self, chunk: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        if not self._started:
            self._started = True
            out.append(_event("message_start", {"message": _start_message(chunk)}))
        choices = chunk.get("choices")
        if not choices:
            usage = chunk.get("usage")
            if isinstance(usage, dict) and not self._delta_sent:
                out.extend(self._close_block())
                out.append(self._message_delta(usage))
            return b"".join(out)
        choice = choices[0]
        if not isinstance(choice, dict):
            return b"".join(out)
        if choice.get("finish_reason"):
            self._finish = choice
        delta = choice.get("delta")
        if isinstance(delta, dict):
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                out.extend(self._open("thinking", {"type": "thinking", "thinking": ""}))
                out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            text = delta.get("content")
            if isinstance(text, str) and text:
                out.extend(self._open("text", {"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": text}))
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    out.extend(self._tool_call(call))
        return b"".join(out)

    def end(self) -> bytes:
        out = [] if self._started else [_event("message_start", {"message": _start_message({})})]
        if not self._delta_sent:  # an engine that sent no usage chunk
            out.extend(self._close_block())
            out.append(self._message_delta({}))
        out.append(_event("message_stop", {}))
        return b"".join(out)

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        index = call.get("index", 0)
        function = _object(call.get("function"))
        out: list[bytes] = []
        if call.get("id") and function.get("name"):
            self._tool_used = True
            out.extend(self._close_block())
            block = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
            out.extend(self._open("tool_use", block))
            self._tool_index = index
        arguments = function.get("arguments")
        if arguments and self._block == "tool_use" and self._tool_index == index:
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        if self._block == kind and kind != "tool_use":
            return []
        out = self._close_block()
        self._index += 1
        self._block = kind
        out.append(_event("content_block_start", {"index": self._index, "content_block": block}))
        return out

    def _close_block(self) -> list[bytes]:
        if self._block is None:
            return []
        out = []
        if self._block == "thinking":  # vLLM signs a thinking block before closing it
            out.append(self._delta({"type": "signature_delta", "signature": os.urandom(16).hex()}))
        out.append(_event("content_block_stop", {"index": self._index}))
        self._block = None
        self._tool_index = None
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self._index, "delta": delta})

    def _message_delta(self, usage: dict[str, Any]) -> bytes:
        self._delta_sent = True
        stop_reason, stop_sequence = stop_of(self._finish) if self._finish else ("end_turn", None)
        if stop_reason == "end_turn" and self._tool_used:
            stop_reason = "tool_use"  # as for a whole answer (``messages_answer``)
        return _event(
            "message_delta",
            {
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": _usage(usage),
            },
        )


def _event(kind: str, fields: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def _start_message(chunk: dict[str, Any]) -> dict[str, Any]:
    usage = _object(chunk.get("usage"))
    return {
        "id": chunk.get("id") or f"msg_{os.urandom(12).hex()}",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": chunk.get("model"),
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": usage.get("prompt_tokens") or 0, "output_tokens": 0},
    }


def _tool_use_id() -> str:
    return f"toolu_{os.urandom(12).hex()}"


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "".join(
            b["text"]
            for b in system
            if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        )
    return ""


def _add_message(message: dict[str, Any], out: list[dict[str, Any]]) -> None:
    role = message["role"]
    content = message.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content or ():
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and isinstance(block.get("source"), dict):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            arguments = orjson.dumps(block.get("input") or {}).decode()
            calls.append(
                {
                    "id": block.get("id") or _tool_use_id(),
                    "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            if role == "user":
                out.append(
                    {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": _result_text(block)}
                )
            else:
                parts.append({"type": "text", "text": f"Tool result: {_result_text(block)}"})
    chat: dict[str, Any] = {"role": role}
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if len(chat) > 1 or role == "assistant":
        out.append(chat)


def _result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p["text"]
            for p in content
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    return ""


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url") or "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.get("name"), "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None


def _object(value: Any) -> dict[str, Any]:
    """``value`` when it is a JSON object, else an empty one (an engine's odd chunk breaks nothing)."""
    return value if isinstance(value, dict) else {}


def _texts(blocks: list[Any]) -> list[str]:
    """The texts of the ``text`` blocks among ``blocks``."""
    return [
        b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
    ]


def _usage(usage: dict[str, Any]) -> dict[str, int]:
    """Chat usage as Messages usage."""
    return {"input_tokens": usage.get("prompt_tokens") or 0, "output_tokens": usage.get("completion_tokens") or 0}


def _is_text(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)
