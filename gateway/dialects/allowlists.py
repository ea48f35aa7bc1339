"""The content parts and the tools each API takes, and what a tenant's policy may add to them.

**Content parts.** An engine's content-part parser takes more than the API it serves documents:
vLLM's chat parser (which also reads the Responses API's input and the score inputs) takes
``image_embeds``, ``audio_embeds`` and ``prompt_embeds`` parts, tensors it loads as they come (a
bad shape can crash the engine; vLLM says to enable them for trusted users only), and infers a
part's type from its keys when the part has a ``uuid``. So each API has its list of part types
(``PartRule``): a part of another type is 400 ``content_part_not_allowed`` naming it
(``messages[2].content[0].type``), a part without a ``type`` 400 ``invalid_field``. The tensor
parts (``body_fields.TENSOR_PART_TYPES``, also as a key of another part) pass only for a tenant
whose policy lists them (``tenants[].allow_content_parts``) and only in the APIs whose engines
read them. A part's ``uuid`` is refused (400 ``unsupported_field``): it names an item of the
engine's multimodal cache, which every tenant shares, so one tenant could use (or plant) another's
media by its id.

* chat (and the tokenizer's chat form): ``CHAT_PARTS``, OpenAI's parts and vLLM's media and text
  parts; the tensor parts by opt-in.
* Responses input items (``content``, and a function call output's ``output`` list):
  ``RESPONSES_PARTS``, OpenAI's input and output parts; the tensor parts by opt-in.
* Messages content blocks: ``MESSAGES_BLOCKS`` (Anthropic's blocks a client sends back, less the
  server tools' results), inside a ``tool_result`` ``TOOL_RESULT_BLOCKS``, ``system`` text only.
* rerank and score inputs: ``SCORING_PARTS`` (vLLM's score parts); ``image_embeds`` by opt-in.
* completions and embeddings take text or token ids only (``text_prompt.py``), nothing to list.

**Tools.** A function tool is a schema: the model may ask for a call and the client runs it. Any
other type is one the engine itself runs when it was started with a tool server: the Responses
API's ``web_search_preview``, ``code_interpreter``, ``mcp`` (a server the tool names),
Anthropic's ``web_search_*``, ``bash_*``, ``code_execution_*``, ... A tenant sending one makes the
engine browse, run code or call a server for it. So a tool (and a ``tool_choice`` naming a type)
must be a function (``ToolRule``: chat and Responses ``function``; a Messages custom tool has no
type or ``custom``), else 400 ``tool_type_not_allowed`` naming ``tools[i].type``, unless the
tenant's policy lists that exact type (``tenants[].allow_builtin_tools``). Even then an ``mcp``
tool's ``server_url`` must be https to a public host (``media.check_server_url``): never the
metadata service at 169.254.169.254, nor anything on the engine's own network.

**The tenant's opt-ins** reach the checks as an ``EngineGrants``: the two sets, read from the
tenant (``gateway.policy.model.Tenant`` satisfies it) by ``Dialect.screen``. Every API checks the
client's body before anything else reads it, so a Messages request translated to chat, a shadow
copy or a retry carries only what was checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gateway.dialects.counts import at_most
from gateway.errors import InvalidRequest
from gateway.policy.body_names import TENSOR_PART_TYPES
from gateway.request.body_fields import shown
from gateway.request.media import check_server_url


class EngineGrants(Protocol):
    """What a tenant's policy allows beyond each API's lists (``Tenant`` has both fields)."""

    @property
    def allow_builtin_tools(self) -> frozenset[str]:
        """Tool types beyond functions the tenant may declare (``tenants[].allow_builtin_tools``)."""
        ...

    @property
    def allow_content_parts(self) -> frozenset[str]:
        """Tensor part types the tenant may send (``tenants[].allow_content_parts``)."""
        ...


@dataclass(frozen=True, slots=True)
class Grants:
    """An ``EngineGrants`` value, for callers that hold no tenant (tests, tools)."""

    allow_builtin_tools: frozenset[str] = frozenset()
    allow_content_parts: frozenset[str] = frozenset()


NO_GRANTS = Grants()
"""Nothing beyond each API's lists."""


@dataclass(frozen=True, slots=True)
class PartRule:
    """The content parts one API takes: ``types`` from anyone, ``tensors`` (tensor part types)
    from a tenant that opted in."""

    types: frozenset[str]
    tensors: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class ToolRule:
    """How one API names a tool its client runs: a ``type`` among ``types``, or no type at all
    when ``untyped`` (chat defaults a tool to a function; a Messages custom tool has none)."""

    types: frozenset[str]
    untyped: bool
    what: str
    """What the error calls such tools (``function tools``)."""


TENSOR_PARTS = frozenset(TENSOR_PART_TYPES)
_SUSPECT_KEYS = TENSOR_PARTS | {"uuid"}
"""Keys that make vLLM read a part as something its type does not say (``check_part``)."""
_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal"})
CHAT_PARTS = PartRule(
    _TEXT_PARTS
    | {"image_url", "input_image", "input_audio", "audio_url", "video_url", "file", "thinking", "tool_reference"},
    TENSOR_PARTS,
)
RESPONSES_PARTS = PartRule(
    _TEXT_PARTS | {"summary_text", "reasoning_text", "input_image", "input_file"},
    TENSOR_PARTS,
)
MESSAGES_BLOCKS = PartRule(
    frozenset(
        {"text", "image", "document", "search_result", "thinking", "redacted_thinking", "tool_use", "tool_result"}
    )
    | {"tool_reference"}
)
TOOL_RESULT_BLOCKS = PartRule(frozenset({"text", "image", "document", "search_result", "tool_reference"}))
SYSTEM_BLOCKS = PartRule(frozenset({"text"}))
SCORING_PARTS = PartRule(frozenset({"text", "image_url", "video_url"}), frozenset({"image_embeds"}))

CHAT_TOOLS = ToolRule(frozenset({"function"}), untyped=True, what="function tools")
RESPONSES_TOOLS = ToolRule(frozenset({"function"}), untyped=False, what="function tools")
MESSAGES_TOOLS = ToolRule(frozenset({"custom"}), untyped=True, what="custom tools")


# --- content parts -------------------------------------------------------------------------


def check_parts(parts: Any, where: str, rule: PartRule, grants: EngineGrants) -> None:
    """Each part of the list ``parts`` (the body's ``where``) is one ``rule`` takes; anything but a
    list is left to the structure checks. The common part (a listed type, no tensor key, no
    ``uuid``) costs two lookups; only another is named and checked in full."""
    if not isinstance(parts, list):
        return
    for j, part in enumerate(parts):
        if isinstance(part, dict) and part.get("type") in rule.types and part.keys().isdisjoint(_SUSPECT_KEYS):
            continue
        check_part(part, f"{where}[{j}]", rule, grants)


def check_part(part: Any, param: str, rule: PartRule, grants: EngineGrants) -> None:
    """One content part (the body's ``param``): its type, its tensor keys, no ``uuid``."""
    if isinstance(part, str):
        return  # a text part as a bare string (vLLM); where an API takes none, its structure check refuses it
    if not isinstance(part, dict):
        raise InvalidRequest(f"'{param}' must be a content part: an object with a 'type'.", param=param)
    kind = part.get("type")
    if not isinstance(kind, str):
        raise InvalidRequest(f"'{param}' must be a content part with a 'type'.", param=param)
    if kind not in rule.types:
        _tensor_or_refuse(kind, f"{param}.type", rule, grants)
    if not part.keys().isdisjoint(TENSOR_PARTS):  # vLLM reads a part by such a key too
        for key in sorted(part.keys() & TENSOR_PARTS - {kind}):
            _tensor_or_refuse(key, f"{param}.{key}", rule, grants)
    if "uuid" in part:
        raise InvalidRequest(
            f"'{param}.uuid' names a media item of the engine's multimodal cache, which every tenant "
            "shares; send the media itself.",
            code="unsupported_field",
            param=f"{param}.uuid",
        )


def _tensor_or_refuse(kind: str, param: str, rule: PartRule, grants: EngineGrants) -> None:
    if kind in rule.tensors and kind in grants.allow_content_parts:
        return
    if kind in rule.tensors:
        message = (
            f"'{param}' is '{kind}': {TENSOR_PART_TYPES[kind]} go to the engine as they are, and one of the "
            "wrong shape can crash it; this API key may not send them (the policy's tenants[].allow_content_parts)."
        )
    else:
        message = f"'{param}' is {shown(kind)!r}, which this API does not take here; it takes {sorted(rule.types)}."
    raise InvalidRequest(message, code="content_part_not_allowed", param=param)


def check_items_parts(items: Any, field: str, rule: PartRule, grants: EngineGrants, keys: tuple[str, ...]) -> None:
    """The part lists under ``keys`` (``content``; a Responses output's ``output``) of each item of
    ``items``, the body's ``field`` (chat's ``messages``, the Responses API's ``input``)."""
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        if isinstance(item, dict):
            for key in keys:
                if isinstance(item.get(key), list):
                    check_parts(item[key], f"{field}[{i}].{key}", rule, grants)


def check_blocks(messages: Any, system: Any, grants: EngineGrants) -> None:
    """Anthropic Messages content: ``system`` text blocks, each message's blocks, and the blocks
    inside each ``tool_result``."""
    check_parts(system, "system", SYSTEM_BLOCKS, grants)
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        check_parts(content, f"messages[{i}].content", MESSAGES_BLOCKS, grants)
        for j, block in enumerate(content):
            if isinstance(block, dict) and block.get("type") == "tool_result":
                check_parts(block.get("content"), f"messages[{i}].content[{j}].content", TOOL_RESULT_BLOCKS, grants)


# --- tools ---------------------------------------------------------------------------------


def check_tools_allowed(body: dict[str, Any], rule: ToolRule, grants: EngineGrants, max_tools: int) -> None:
    """``tools`` (each a type ``rule`` takes, or one the tenant opted into) and, where the API's
    ``tool_choice`` names tool types (chat, Responses: not ``MESSAGES_TOOLS``), the choice."""
    tools = body.get("tools")
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            check_tool(tool, f"tools[{i}]", rule, grants)
    if rule is not MESSAGES_TOOLS:
        check_tool_choice(body.get("tool_choice"), rule, grants, max_tools)


def check_tool(tool: Any, param: str, rule: ToolRule, grants: EngineGrants) -> None:
    """One tool definition (or a choice naming one): a type ``rule`` takes, or an opted-in one."""
    if not isinstance(tool, dict):
        raise InvalidRequest(f"'{param}' must be an object.", param=param)
    kind = tool.get("type")
    if kind is None and rule.untyped:
        return
    if not isinstance(kind, str):
        raise InvalidRequest(f"'{param}.type' must be a string.", param=f"{param}.type")
    if kind in rule.types:
        return
    if kind not in grants.allow_builtin_tools:
        raise InvalidRequest(
            f"'{param}.type' is {shown(kind)!r}: a tool the engine runs itself (with a tool server it browses, "
            f"runs code or calls other servers for you); this API key may declare {rule.what} only "
            "(the policy's tenants[].allow_builtin_tools).",
            code="tool_type_not_allowed",
            param=f"{param}.type",
        )
    if kind == "mcp" and tool.get("server_url") is not None:
        check_server_url(tool["server_url"], f"{param}.server_url")


def check_tool_choice(choice: Any, rule: ToolRule, grants: EngineGrants, max_tools: int) -> None:
    """A ``tool_choice`` object: the type it forces, or each tool of an ``allowed_tools`` list
    (chat nests it under ``allowed_tools``, Responses does not), at most ``max_tools`` of them."""
    if not isinstance(choice, dict) or choice.get("type") is None:
        return
    if choice["type"] != "allowed_tools":
        check_tool(choice, "tool_choice", rule, grants)
        return
    nested = choice.get("allowed_tools")
    holder, where = (
        (nested, "tool_choice.allowed_tools.tools") if isinstance(nested, dict) else (choice, "tool_choice.tools")
    )
    tools = holder.get("tools")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequest(f"'{where}' must be an array.", param=where)
    at_most(tools, max_tools, where, "entries", "too_many_tools")
    for i, tool in enumerate(tools):
        check_tool(tool, f"{where}[{i}]", rule, grants)
