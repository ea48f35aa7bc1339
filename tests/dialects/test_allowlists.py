"""Content-part types and tool types per API, and the tenant's opt-ins (``gateway/dialects/allowlists.py``).

Each row is a body through its dialect's ``screen`` (what the request path runs first) with a
tenant's grants: it passes, or it is refused with the code and the place it must name.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gateway.dialects.allowlists import NO_GRANTS, EngineGrants, Grants
from gateway.dialects.base import Dialect
from gateway.dialects.count_tokens import COUNT_TOKENS
from gateway.dialects.registry import DIALECTS
from gateway.errors import InvalidRequest
from gateway.policy.model import RequestLimits

CHAT = DIALECTS["/v1/chat/completions"]
RESPONSES = DIALECTS["/v1/responses"]
MESSAGES = DIALECTS["/v1/messages"]
TOKENIZE = DIALECTS["/tokenize"]
RERANK = DIALECTS["/v1/rerank"]
SCORE = DIALECTS["/v1/score"]

PNG = "data:image/png;base64,iVBORw0KGgo="
EMBEDS = "ZmFrZSB0ZW5zb3I="
EMBEDDINGS = Grants(allow_content_parts=frozenset({"image_embeds"}))
WEB = Grants(allow_builtin_tools=frozenset({"web_search_preview"}))
MCP = Grants(allow_builtin_tools=frozenset({"mcp"}))
SERVER_SEARCH = Grants(allow_builtin_tools=frozenset({"web_search_20250305"}))
LIMITS = RequestLimits()


def chat(*parts: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}], **fields}


def responses(*parts: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": [{"role": "user", "content": list(parts)}], **fields}


def messages(*blocks: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": list(blocks)}], **fields}


def scored(*parts: Any) -> dict[str, Any]:
    return {"model": "m", "query": "q", "documents": [{"content": list(parts)}]}


TEXT = {"type": "text", "text": "Hi"}
IMAGE_EMBEDS = {"type": "image_embeds", "image_embeds": EMBEDS}
FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
RESPONSES_FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}
CUSTOM_TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}
SERVER_TOOL = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
TOOL_RESULT = {"type": "tool_result", "tool_use_id": "toolu_1"}

ACCEPTED = [
    # chat: OpenAI's parts and vLLM's media and text parts
    pytest.param(CHAT, chat(TEXT, {"type": "image_url", "image_url": {"url": PNG}}), NO_GRANTS, id="chat text, image"),
    pytest.param(
        CHAT,
        chat(
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}},
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
            {"type": "file", "file": {"file_data": "JVBERi0x", "filename": "a.pdf"}},
        ),
        NO_GRANTS,
        id="chat audio, video and file parts",
    ),
    pytest.param(CHAT, chat("a bare string part"), NO_GRANTS, id="chat a bare string part (vLLM's text)"),
    pytest.param(CHAT, chat(TEXT, IMAGE_EMBEDS), EMBEDDINGS, id="chat image_embeds for a tenant that opted in"),
    pytest.param(CHAT, chat(TEXT, tools=[FUNCTION, {"function": {"name": "g"}}]), NO_GRANTS, id="chat function tools"),
    pytest.param(
        CHAT,
        chat(TEXT, tools=[FUNCTION], tool_choice={"type": "function", "function": {"name": "f"}}),
        NO_GRANTS,
        id="chat a named function choice",
    ),
    pytest.param(
        CHAT,
        chat(
            TEXT,
            tools=[FUNCTION],
            tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [FUNCTION] * 128}},
        ),
        NO_GRANTS,
        id="chat allowed_tools as long as max_tools",
    ),
    # Responses
    pytest.param(
        RESPONSES,
        responses({"type": "input_text", "text": "Hi"}, {"type": "input_image", "image_url": PNG}),
        NO_GRANTS,
        id="responses input text and image",
    ),
    pytest.param(
        RESPONSES,
        {"model": "m", "input": [{"role": "assistant", "content": [{"type": "output_text", "text": "Yo"}]}]},
        NO_GRANTS,
        id="responses an assistant's output text",
    ),
    pytest.param(RESPONSES, responses(IMAGE_EMBEDS), EMBEDDINGS, id="responses image_embeds when opted in"),
    pytest.param(RESPONSES, responses(tools=[RESPONSES_FUNCTION]), NO_GRANTS, id="responses a function tool"),
    pytest.param(RESPONSES, responses(tools=[{"type": "web_search_preview"}]), WEB, id="responses web search opted in"),
    pytest.param(
        RESPONSES,
        responses(tools=[{"type": "mcp", "server_label": "d", "server_url": "https://mcp.example.com/sse"}]),
        MCP,
        id="responses mcp on a public https server, opted in",
    ),
    pytest.param(
        RESPONSES,
        responses(tools=[{"type": "web_search_preview"}], tool_choice={"type": "web_search_preview"}),
        WEB,
        id="responses a choice of an opted-in tool",
    ),
    # Messages
    pytest.param(
        MESSAGES,
        messages(
            TEXT,
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "a"}},
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
            {**TOOL_RESULT, "content": [TEXT, {"type": "tool_reference", "tool_name": "f"}]},
        ),
        NO_GRANTS,
        id="messages every block a client sends back",
    ),
    pytest.param(MESSAGES, messages(TEXT, system=[TEXT]), NO_GRANTS, id="messages system text blocks"),
    pytest.param(
        MESSAGES, messages(TEXT, tools=[CUSTOM_TOOL, {**CUSTOM_TOOL, "type": "custom"}]), NO_GRANTS, id="custom tools"
    ),
    pytest.param(MESSAGES, messages(TEXT, tools=[SERVER_TOOL]), SERVER_SEARCH, id="messages a server tool opted in"),
    # the others
    pytest.param(TOKENIZE, chat(TEXT, IMAGE_EMBEDS), EMBEDDINGS, id="tokenize image_embeds opted in"),
    pytest.param(RERANK, scored(TEXT, {"type": "image_url", "image_url": {"url": PNG}}), NO_GRANTS, id="rerank parts"),
    pytest.param(RERANK, scored(IMAGE_EMBEDS), EMBEDDINGS, id="rerank image_embeds opted in"),
]


@pytest.mark.parametrize(("dialect", "body", "grants"), ACCEPTED)
def test_what_the_api_and_the_tenant_allow_passes(dialect: Dialect, body: dict[str, Any], grants: EngineGrants) -> None:
    dialect.screen(copy.deepcopy(body), LIMITS, grants)


REFUSED = [
    # content parts
    pytest.param(
        CHAT, chat(TEXT, IMAGE_EMBEDS), NO_GRANTS, "content_part_not_allowed", "messages[0].content[1].type",
        id="chat image_embeds without an opt-in",
    ),
    pytest.param(
        CHAT, chat({"type": "audio_embeds", "audio_embeds": EMBEDS}), EMBEDDINGS, "content_part_not_allowed",
        "messages[0].content[0].type", id="chat audio_embeds when only image_embeds was opted into",
    ),
    pytest.param(
        CHAT, chat({"type": "prompt_embeds", "data": EMBEDS}), NO_GRANTS, "content_part_not_allowed",
        "messages[0].content[0].type", id="chat prompt_embeds",
    ),
    pytest.param(
        CHAT, chat({"type": "mystery"}), NO_GRANTS, "content_part_not_allowed", "messages[0].content[0].type",
        id="chat an unknown part type",
    ),
    pytest.param(
        CHAT, chat({"image_url": {"url": PNG}}), NO_GRANTS, "invalid_field", "messages[0].content[0]",
        id="chat a part without a type (vLLM would guess one)",
    ),
    pytest.param(
        CHAT, chat({**TEXT, "image_embeds": EMBEDS}), NO_GRANTS, "content_part_not_allowed",
        "messages[0].content[0].image_embeds", id="chat a text part carrying embeddings",
    ),
    pytest.param(
        CHAT, chat({"type": "image_url", "image_url": None, "uuid": "another-tenants-image"}), NO_GRANTS,
        "unsupported_field", "messages[0].content[0].uuid", id="chat a media uuid (the engine's shared cache)",
    ),
    pytest.param(
        CHAT, chat(5), NO_GRANTS, "invalid_field", "messages[0].content[0]", id="chat a part that is a number",
    ),
    pytest.param(
        RESPONSES, responses(IMAGE_EMBEDS), NO_GRANTS, "content_part_not_allowed", "input[0].content[0].type",
        id="responses image_embeds without an opt-in",
    ),
    pytest.param(
        RESPONSES, responses({"type": "image_url", "image_url": {"url": PNG}}), NO_GRANTS, "content_part_not_allowed",
        "input[0].content[0].type", id="responses a chat part",
    ),
    pytest.param(
        RESPONSES,
        {"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": [IMAGE_EMBEDS]}]},
        NO_GRANTS, "content_part_not_allowed", "input[0].output[0].type", id="responses embeddings in a call's output",
    ),
    pytest.param(
        RESPONSES,
        {"model": "m", "input": [
            {"type": "function_call_output", "call_id": "c",
             "output": [{"type": "input_image", "image_url": "http://169.254.169.254/latest/meta-data/"}]},
        ]},
        NO_GRANTS, "media_url_not_allowed", "input[0].output[0].image_url", id="responses a call output's media URL",
    ),
    pytest.param(
        MESSAGES, messages(IMAGE_EMBEDS), EMBEDDINGS, "content_part_not_allowed", "messages[0].content[0].type",
        id="messages takes no tensors, opted in or not",
    ),
    pytest.param(
        MESSAGES, messages({"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}), NO_GRANTS,
        "content_part_not_allowed", "messages[0].content[0].type", id="messages a server tool's result block",
    ),
    pytest.param(
        MESSAGES, messages({**TOOL_RESULT, "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}),
        NO_GRANTS, "content_part_not_allowed", "messages[0].content[0].content[0].type",
        id="messages a block a tool result cannot hold",
    ),
    pytest.param(
        MESSAGES, messages(TEXT, system=[{"type": "image", "source": {}}]), NO_GRANTS, "content_part_not_allowed",
        "system[0].type", id="messages an image in the system prompt",
    ),
    pytest.param(
        MESSAGES, messages({"text": "Hi"}), NO_GRANTS, "invalid_field", "messages[0].content[0]",
        id="messages a block without a type",
    ),
    pytest.param(
        TOKENIZE, chat(IMAGE_EMBEDS), NO_GRANTS, "content_part_not_allowed", "messages[0].content[0].type",
        id="tokenize image_embeds without an opt-in",
    ),
    pytest.param(
        RERANK, scored(IMAGE_EMBEDS), NO_GRANTS, "content_part_not_allowed", "documents[0].content[0].type",
        id="rerank image_embeds without an opt-in",
    ),
    pytest.param(
        SCORE, {"model": "m", "queries": "q", "documents": {"content": [{"type": "audio_url"}]}}, NO_GRANTS,
        "content_part_not_allowed", "documents.content[0].type", id="score a part vLLM's scorer does not take",
    ),
    # tools
    pytest.param(
        CHAT, chat(TEXT, tools=[{"type": "custom", "custom": {"name": "c"}}]), NO_GRANTS, "tool_type_not_allowed",
        "tools[0].type", id="chat a custom tool",
    ),
    pytest.param(
        CHAT, chat(TEXT, tools=[FUNCTION], tool_choice={"type": "custom", "custom": {"name": "c"}}), NO_GRANTS,
        "tool_type_not_allowed", "tool_choice.type", id="chat a choice of a custom tool",
    ),
    pytest.param(
        CHAT,
        chat(TEXT, tools=[FUNCTION], tool_choice={"type": "allowed_tools",
                                                   "allowed_tools": {"mode": "auto", "tools": [FUNCTION] * 129}}),
        NO_GRANTS, "too_many_tools", "tool_choice.allowed_tools.tools", id="chat allowed_tools one over max_tools",
    ),
    pytest.param(
        CHAT, chat(TEXT, tools=["f"]), NO_GRANTS, "invalid_field", "tools[0]", id="chat a tool that is no object",
    ),
    pytest.param(
        RESPONSES, responses(tools=[{"type": "web_search_preview"}]), NO_GRANTS, "tool_type_not_allowed",
        "tools[0].type", id="responses web_search_preview without an opt-in",
    ),
    pytest.param(
        RESPONSES, responses(tools=[{"type": "code_interpreter", "container": {"type": "auto"}}]), WEB,
        "tool_type_not_allowed", "tools[0].type", id="responses a built-in tool other than the one opted into",
    ),
    pytest.param(
        RESPONSES, responses(tools=[{"name": "f", "parameters": {}}]), NO_GRANTS, "invalid_field", "tools[0].type",
        id="responses a tool without a type",
    ),
    pytest.param(
        RESPONSES, responses(tools=[RESPONSES_FUNCTION], tool_choice={"type": "file_search"}), NO_GRANTS,
        "tool_type_not_allowed", "tool_choice.type", id="responses a choice forcing a built-in tool",
    ),
    pytest.param(
        RESPONSES,
        responses(tools=[RESPONSES_FUNCTION], tool_choice={"type": "allowed_tools", "mode": "auto",
                                                           "tools": [{"type": "mcp", "server_label": "x"}]}),
        NO_GRANTS, "tool_type_not_allowed", "tool_choice.tools[0].type", id="responses allowed_tools naming mcp",
    ),
    pytest.param(
        RESPONSES, responses(tools=[{"type": "mcp", "server_label": "m", "server_url": "http://169.254.169.254/"}]),
        MCP, "server_url_not_allowed", "tools[0].server_url", id="responses mcp on the metadata address, opted in",
    ),
    pytest.param(
        RESPONSES, responses(tools=[{"type": "mcp", "server_label": "m", "server_url": "http://mcp.example.com/"}]),
        MCP, "server_url_not_allowed", "tools[0].server_url", id="responses mcp over plain http, opted in",
    ),
    pytest.param(
        MESSAGES, messages(TEXT, tools=[SERVER_TOOL]), NO_GRANTS, "tool_type_not_allowed", "tools[0].type",
        id="messages a server tool without an opt-in",
    ),
    pytest.param(
        MESSAGES, messages(TEXT, tools=[CUSTOM_TOOL, {"type": "bash_20250124", "name": "bash"}]), SERVER_SEARCH,
        "tool_type_not_allowed", "tools[1].type", id="messages bash when only web search was opted into",
    ),
    pytest.param(
        COUNT_TOKENS, {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": [SERVER_TOOL]},
        NO_GRANTS, "tool_type_not_allowed", "tools[0].type", id="count_tokens holds Messages tools to the same rule",
    ),
    pytest.param(
        TOKENIZE, chat(TEXT, tools=[{"type": "custom", "custom": {"name": "c"}}]), NO_GRANTS, "tool_type_not_allowed",
        "tools[0].type", id="tokenize chat's tool rule",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("dialect", "body", "grants", "code", "param"), REFUSED)
def test_what_neither_the_api_nor_the_tenant_allows_is_refused_naming_it(
    dialect: Dialect, body: dict[str, Any], grants: EngineGrants, code: str, param: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        dialect.screen(copy.deepcopy(body), LIMITS, grants)
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, code, param)


def test_a_refusal_says_why_and_where_the_opt_in_is() -> None:
    with pytest.raises(InvalidRequest) as parts:
        CHAT.screen(chat(IMAGE_EMBEDS), LIMITS, NO_GRANTS)
    with pytest.raises(InvalidRequest) as tools:
        RESPONSES.screen(responses(tools=[{"type": "web_search_preview"}]), LIMITS, NO_GRANTS)
    assert "crash" in parts.value.message
    assert "allow_content_parts" in parts.value.message
    assert "runs itself" in tools.value.message
    assert "allow_builtin_tools" in tools.value.message
