"""The token ids a request reaches a vLLM engine with, computed in the gateway.

Why: the engine's block hashes (``engine_hashes.py``) are hashes of its own prompt token ids, so
routing on its KV-event index needs those exact ids: the same chat template, rendered from the
same messages as vLLM shapes them, tokenized the same way. Anything the gateway cannot reproduce
exactly gives ``None`` (route without the index), never an approximation.

**Completions** (``api == "completions"``): a string ``prompt`` is ``tokenizer.encode(prompt,
add_special_tokens=...)`` with the request's ``add_special_tokens`` (vLLM's default True: the
tokenizer's BOS); a list of token ids is itself. A list of prompts, ``prompt_embeds``, anything
else: None.

**Chat** (``api == "chat"``; vLLM's ``parse_chat_messages`` and its renderer):

* each message becomes ``{"role", "content", ...}`` as vLLM's parser builds it: text parts
  (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``, plain strings) joined
  with ``"\\n"`` when the template takes a string (``ChatTemplate.content_format``), or kept as
  ``{"type": "text", "text"}`` parts when it loops over content; ``content: null`` is ``""`` (or
  ``[]``); an assistant's ``tool_calls`` (arguments parsed from JSON, ``{}`` when they are not
  JSON; an empty list dropped) and ``reasoning`` (also as ``reasoning_content``); a tool's
  ``tool_call_id`` and text content joined; ``name`` and ``task`` when strings; a developer
  message's ``tools``. Any other field is dropped, as vLLM drops it;
* ``tools`` as vLLM dumps its pydantic model: ``{"type": "function", "function": {"name",
  "description", "parameters", ...extra fields}}``, with ``null`` for a missing description or
  parameters (templates that print tools as JSON print those ``null``\\ s too);
* the template's variables: ``chat_template_kwargs`` under the request's own
  ``add_generation_prompt`` (default True), ``documents``, ``reasoning_effort`` and, when a
  reasoning effort is given and the caller did not set it, ``enable_thinking``;
* the text tokenized with ``add_special_tokens`` from the request, default False: the template
  writes the BOS itself (vLLM's ``ChatCompletionRequest.add_special_tokens``).

None for: no template; multimodal or unknown content parts; ``continue_final_message``; a
request-supplied ``chat_template``; ``truncate_prompt_tokens``; template kwargs that
transformers would consume itself (``tokenize``, ``max_length``, ...); a template that raises;
a malformed body (the engine would refuse it anyway).

**Limits.** vLLM's own parser and transformers' tokenizer class sit between the body and the
ids; this module models them for text chat, not byte for byte for every model: processor chat
templates of multimodal models, Mistral's and Harmony's renderers, and tokenizers whose
transformers class changes the saved ``tokenizer.json`` (e.g. ``add_bos_token`` flags) are not.
The tokenizer must not truncate or pad (``TokenizerEstimator`` turns both off on its own).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from gateway.request.chat_template import ChatTemplate
    from gateway.request.segment_encoder import SegmentEncoder

TEXT_PART_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""Content part types vLLM reads as text, and the field holding the text."""

SKIPPED_WHEN_EMPTY = frozenset({"text", "refusal"})
"""Text part types vLLM skips (with a warning) when their text is null."""

CONSUMED_KWARGS = frozenset(
    {
        "chat_template",
        "tokenize",
        "conversation",
        "messages",
        "tools",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""Template kwargs vLLM refuses or transformers' ``apply_chat_template`` would take for itself."""

FUNCTION_FIELDS = ("name", "description", "parameters")
"""vLLM's ``FunctionDefinition`` fields, in the order its ``model_dump`` writes them."""


class _Unmodelled(Exception):
    """A request whose engine-side ids this module does not reproduce."""


@dataclass(frozen=True, slots=True)
class EngineTokenizer:
    """A model's tokenizer and chat template (None: chat requests give None), held together, and
    the tokenizer's ``SegmentEncoder`` (None: every chat encoded whole)."""

    tokenizer: Tokenizer
    template: ChatTemplate | None = None
    encoder: SegmentEncoder | None = None


def engine_prompt_ids(
    body: Mapping[str, Any],
    api: str,
    tokenizer: Tokenizer | EngineTokenizer,
    template: ChatTemplate | None = None,
) -> list[int] | None:
    """The prompt token ids vLLM computes for ``body`` on ``api`` (a dialect's name: ``"chat"``,
    ``"completions"``), or None (module docstring). ``tokenizer`` may carry its template."""
    encoder = None
    if isinstance(tokenizer, EngineTokenizer):
        template, encoder = tokenizer.template, tokenizer.encoder
        tokenizer = tokenizer.tokenizer
    try:
        if api == "completions":
            return _completion_ids(body, tokenizer)
        if api == "chat" and template is not None:
            return _chat_ids(body, tokenizer, template, encoder)
    except _Unmodelled:
        return None
    return None


def _completion_ids(body: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    if body.get("prompt_embeds") is not None or body.get("truncate_prompt_tokens") is not None:
        raise _Unmodelled
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids: list[int] = tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True)).ids
        return ids
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return list(prompt)
    raise _Unmodelled


def _chat_ids(
    body: Mapping[str, Any], tokenizer: Tokenizer, template: ChatTemplate, encoder: SegmentEncoder | None
) -> list[int]:
    if body.get("chat_template") is not None or body.get("truncate_prompt_tokens") is not None:
        raise _Unmodelled
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _Unmodelled
    tools = _tool_dicts(body.get("tools"))
    variables = _template_variables(body)
    add_generation_prompt = variables.pop("add_generation_prompt")
    documents = variables.pop("documents", None)
    if variables.pop("continue_final_message", False) is not False:
        raise _Unmodelled
    content_format = template.content_format(tools=tools)
    conversation = [_message(m, content_format) for m in messages]
    try:
        text = template.render(
            conversation, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **variables
        )
    except ValueError as exc:  # ChatTemplateError: the engine answers this request with a 400
        raise _Unmodelled from exc
    add_special_tokens = _flag(body, "add_special_tokens", False)
    if encoder is not None and not add_special_tokens:
        return encoder.encode(text)  # each message's piece tokenized once (segment_encoder.py)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    return ids


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise _Unmodelled
    return value


def _template_variables(body: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``merge_kwargs(chat_template_kwargs, request fields)``: set request fields win."""
    user = body.get("chat_template_kwargs") or {}
    if not isinstance(user, dict) or CONSUMED_KWARGS & user.keys():
        raise _Unmodelled
    effort = body.get("reasoning_effort")
    fields = {
        "add_generation_prompt": _flag(body, "add_generation_prompt", True),
        "continue_final_message": _flag(body, "continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in user:
        fields["enable_thinking"] = effort != "none"
    merged = {**user, **{k: v for k, v in fields.items() if v is not None and not (isinstance(v, str) and v == "auto")}}
    documents = merged.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
        raise _Unmodelled
    return merged


def _tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """The tools as vLLM's ``[tool.model_dump() for tool in request.tools]`` writes them."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise _Unmodelled  # vLLM refuses an empty tools array
    return [_tool_dict(tool) for tool in tools]


def _tool_dict(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise _Unmodelled
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _Unmodelled
    if not isinstance(function.get("description"), str | None) or not isinstance(
        function.get("parameters"), dict | None
    ):
        raise _Unmodelled
    dumped = {field: function.get(field) for field in FUNCTION_FIELDS}
    defer = function.get("defer_loading")
    if defer is None:
        defer = tool.get("defer_loading")
    if defer is not None:
        dumped["defer_loading"] = defer
    dumped.update((k, v) for k, v in function.items() if k not in FUNCTION_FIELDS and k != "defer_loading")
    out: dict[str, Any] = {"type": "function", "function": dumped}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def _message(message: Any, content_format: str) -> dict[str, Any]:
    """One message as vLLM's ``_parse_chat_message_content`` and ``_postprocess_messages`` build it."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _Unmodelled
    role: str = message["role"]
    texts = _texts(message.get("content"))
    content: Any = "\n".join(texts) if content_format == "string" else [{"type": "text", "text": t} for t in texts]
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        _assistant_fields(message, out)
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        out["content"] = "\n".join(texts)
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise _Unmodelled
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict) or part.get("uuid") is not None or part.get("type") not in TEXT_PART_FIELDS:
            raise _Unmodelled  # media (not modelled: their hashes join the block keys), unknown parts
        text = part.get(TEXT_PART_FIELDS[part["type"]])
        if text is None and part["type"] in SKIPPED_WHEN_EMPTY:
            continue
        if not isinstance(text, str):
            raise _Unmodelled
        texts.append(text)
    return texts


def _assistant_fields(message: Mapping[str, Any], out: dict[str, Any]) -> None:
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise _Unmodelled
        if tool_calls:
            out["tool_calls"] = [_tool_call(call) for call in tool_calls]
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")  # vLLM renames the deprecated field first
    if reasoning is not None:
        out["reasoning"] = reasoning
        out["reasoning_content"] = reasoning


def _tool_call(call: Any) -> dict[str, Any]:
    """A tool call with its JSON ``arguments`` parsed (``{}`` unless valid JSON, a dict or a list)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise _Unmodelled
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = {}
    elif not isinstance(arguments, dict | list):
        arguments = {}
    function["arguments"] = arguments
    return {**call, "function": function}
