"""Anthropic's Messages API (``POST /v1/messages``) on a real simulated engine, through the official SDK.

The SDK talks straight to the engine on loopback; raw SSE and error bodies are read with httpx
where the exact bytes are the point. See ``loadtests/sim/messages.py`` for vLLM's conversion
and formats reproduced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from anthropic.types import Message, TextBlock, ToolUseBlock

from loadtests.sim.messages import to_chat
from loadtests.sim.profiles import BLOCK_SIZE
from loadtests.sim.responses import generated_text
from loadtests.sim.server import EngineApp
from loadtests.sim.tokenizer import count_tokens, render_chat
from tests.servers import metric, samples, wait_until

SIM = "sim-model"
FAST = {"ttft_ms": 5, "itl_ms": 1}
Engine = Callable[..., AbstractContextManager[tuple[str, EngineApp]]]
Client = Callable[..., anthropic.Anthropic]
CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
LONG = "Summarise the following notes about the quarterly capacity review. " * 4  # 40 tokens
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "The forecast.", "input_schema": SCHEMA},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}},
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": t["name"], "description": t.get("description"), "parameters": t["input_schema"]},
    }
    for t in TOOLS
]
WEATHER = {"type": "tool", "name": "get_weather"}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client() -> Iterator[Client]:
    """``client(url, **options)``: an SDK client of the engine at ``url``, closed after the test."""
    made: list[anthropic.Anthropic] = []

    def make(url: str, **options: Any) -> anthropic.Anthropic:
        made.append(anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, **options))
        return made[-1]

    yield make
    for sdk in made:
        sdk.close()


def prompt_tokens(*messages: tuple[str, str]) -> int:
    rendered = [{"role": role, "content": content} for role, content in messages]
    return count_tokens(render_chat(rendered, add_generation_prompt=True, continue_final_message=False))


def chat_prompt_tokens(url: str, messages: list[Any], **extra: Any) -> int:
    """The prompt tokens of a chat request to the same engine (vLLM's conversion's target)."""
    body = {"model": SIM, "messages": messages, "max_tokens": 1, **extra}
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens"])


def sse(url: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """The ``(event, data)`` pairs of a streamed answer, checking the SSE framing as it goes."""
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("\n\n")
    assert "[DONE]" not in raw
    events = []
    for block in raw[:-2].split("\n\n"):
        event, data = block.split("\n")
        assert event.startswith("event: ")
        assert data.startswith("data: ")
        events.append((event[7:], orjson.loads(data[6:])))
    assert [name for name, _ in events] == [data["type"] for _, data in events]
    return events


def test_create_answers_text_cut_by_max_tokens(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        reply = sdk.messages.create(
            model=SIM, max_tokens=6, system="Be brief.", messages=[{"role": "user", "content": LONG}]
        )
        raw = httpx.post(url + "/v1/messages", json={"model": SIM, "max_tokens": 2, "messages": ASK}).json()
        finished = metric(url, "vllm:request_success_total", finished_reason="length")
    assert isinstance(reply, Message)
    assert reply.id.startswith("chatcmpl-")
    assert reply.type == "message"
    assert reply.role == "assistant"
    assert reply.model == SIM
    assert reply.content == [TextBlock(type="text", text=generated_text(6))]
    assert reply.stop_reason == "max_tokens"  # the engine generated exactly max_tokens: chat's "length"
    assert reply.usage.input_tokens == prompt_tokens(("system", "Be brief."), ("user", LONG))
    assert reply.usage.output_tokens == 6
    # vLLM's model_dump(exclude_none=True): no stop_sequence, no cache fields
    assert raw == {
        "id": raw["id"],
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": generated_text(2)}],
        "model": SIM,
        "stop_reason": "max_tokens",
        "usage": {"input_tokens": prompt_tokens(("user", ASK[0]["content"])), "output_tokens": 2},
    }
    assert finished == 2


def test_system_as_blocks_is_one_system_message(sim_engine: Engine, client: Client) -> None:
    blocks: list[Any] = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
        {"type": "text", "text": "You are terse. "},
        {"type": "text", "text": "Answer in French."},
    ]
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        as_blocks = sdk.messages.create(model=SIM, max_tokens=1, system=blocks, messages=ASK)
        as_string = sdk.messages.create(
            model=SIM, max_tokens=1, system="You are terse. Answer in French.", messages=ASK
        )
        chat = chat_prompt_tokens(url, [{"role": "system", "content": "You are terse. Answer in French."}, *ASK])
    # the billing header (a per-request hash) is dropped, the other blocks joined without a separator
    assert as_blocks.usage.input_tokens == as_string.usage.input_tokens == chat
    assert chat == prompt_tokens(("system", "You are terse. Answer in French."), ("user", ASK[0]["content"]))


def test_streamed_text_gives_the_sdk_vllms_event_sequence(sim_engine: Engine, client: Client) -> None:
    n = 5
    with (
        sim_engine("fixed", **FAST) as (url, _),
        client(url).messages.stream(model=SIM, max_tokens=n, messages=ASK) as stream,
    ):
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[2:-3:2] == ["content_block_delta"] * n  # the SDK adds a "text" event after each delta
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert [(block.type, getattr(block, "text", None)) for block in final.content] == [("text", generated_text(n))]
    assert final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == prompt_tokens(("user", ASK[0]["content"]))
    assert final.usage.output_tokens == n


@pytest.mark.parametrize("profile", ["fixed", "instant"], ids=["on an engine", "on the instant profile"])
def test_raw_text_stream_is_vllms_exclude_unset_events(sim_engine: Engine, profile: str) -> None:
    with sim_engine(profile, **(FAST if profile == "fixed" else {})) as (url, _):
        events = sse(url, {"model": SIM, "max_tokens": 2, "stream": True, "messages": ASK})
    start = events[0][1]
    msg_id = start["message"]["id"]
    assert msg_id.startswith("chatcmpl-")
    input_tokens = prompt_tokens(("user", ASK[0]["content"]))
    assert events == [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {  # no "type" nor "role": vLLM leaves its defaults unset
                    "id": msg_id,
                    "content": [],
                    "model": SIM,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": input_tokens, "output_tokens": 0},
                },
            },
        ),
        (
            "content_block_start",
            {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": " the"}, "index": 0},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": " engine"}, "index": 0},
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens"},
                "usage": {"input_tokens": input_tokens, "output_tokens": 2},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def test_a_named_tool_gives_a_tool_use_block_with_a_dict_input(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        named = sdk.messages.create(model=SIM, max_tokens=6, messages=ASK, tools=TOOLS, tool_choice=WEATHER)
        any_tool = sdk.messages.create(model=SIM, max_tokens=6, messages=ASK, tools=TOOLS, tool_choice={"type": "any"})
        chat = chat_prompt_tokens(url, ASK, tools=CHAT_TOOLS, tool_choice="auto")
    for reply in (named, any_tool):
        (block,) = reply.content
        assert isinstance(block, ToolUseBlock)
        assert CALL_ID.fullmatch(block.id)
        assert block.name == "get_weather"  # "any": the first tool
        assert block.input == {"city": generated_text(4), "days": 1}
        assert reply.usage.output_tokens == 6
        assert reply.usage.input_tokens == chat  # the tools are converted and rendered as chat's
    # vLLM's chat finishes a named function "stop" (end_turn) and "required" "tool_calls" (tool_use)
    assert named.stop_reason == "end_turn"
    assert any_tool.stop_reason == "tool_use"


def test_auto_and_none_answer_text(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        replies = [
            sdk.messages.create(model=SIM, max_tokens=3, messages=ASK, tools=TOOLS),
            sdk.messages.create(model=SIM, max_tokens=3, messages=ASK, tools=TOOLS, tool_choice={"type": "auto"}),
            sdk.messages.create(model=SIM, max_tokens=3, messages=ASK, tools=TOOLS, tool_choice={"type": "none"}),
        ]
    for reply in replies:
        assert reply.content == [TextBlock(type="text", text=generated_text(3))]
        assert reply.stop_reason == "max_tokens"


def test_streamed_tool_use_is_input_json_deltas(sim_engine: Engine, client: Client) -> None:
    n = 7
    with sim_engine("fixed", **FAST) as (url, _):
        with client(url).messages.stream(
            model=SIM, max_tokens=n, messages=ASK, tools=TOOLS, tool_choice={"type": "any"}
        ) as stream:
            events = list(stream)
            final = stream.get_final_message()
        raw = sse(
            url,
            {"model": SIM, "max_tokens": 3, "stream": True, "messages": ASK, "tools": TOOLS, "tool_choice": WEATHER},
        )
    start = next(e for e in events if e.type == "content_block_start")
    assert start.type == "content_block_start"
    assert isinstance(start.content_block, ToolUseBlock)
    assert start.content_block.input == {}
    partials = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(partials) == n  # one per token
    assert json.loads("".join(partials)) == {"city": generated_text(n - 2), "days": 1}
    (block,) = final.content
    assert isinstance(block, ToolUseBlock)
    assert block.id == start.content_block.id
    assert block.input == {"city": generated_text(n - 2), "days": 1}
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == n
    names = [name for name, _ in raw]
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    block_start = raw[1][1]["content_block"]
    assert set(block_start) == {"type", "id", "name", "input"}
    assert block_start["input"] == {}
    assert [data["delta"] for _, data in raw[2:5]] == [
        {"type": "input_json_delta", "partial_json": '{"city": "'},
        {"type": "input_json_delta", "partial_json": " the"},
        {"type": "input_json_delta", "partial_json": '", "days": 1}'},
    ]
    assert raw[-2][1]["delta"] == {"stop_reason": "end_turn"}


def test_a_tool_result_follow_up_is_converted_as_vllm_does(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        call = sdk.messages.create(model=SIM, max_tokens=4, messages=ASK, tools=TOOLS, tool_choice=WEATHER)
        (use,) = call.content
        assert isinstance(use, ToolUseBlock)

        def follow_up(result: Any) -> Message:
            messages: list[Any] = [
                *ASK,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]},
            ]
            return sdk.messages.create(model=SIM, max_tokens=3, messages=messages, tools=TOOLS)

        answer = follow_up("Sunny, 21 degrees.")
        as_blocks = follow_up([{"type": "text", "text": "Sunny,"}, {"type": "text", "text": "21 degrees."}])
        other = follow_up("Rain all week, heavy at times.")
        chat_messages = [
            *ASK,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": use.name, "arguments": json.dumps(use.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 degrees."},
        ]
        chat = chat_prompt_tokens(url, chat_messages, tools=CHAT_TOOLS, tool_choice="auto")
    assert answer.content == [TextBlock(type="text", text=generated_text(3))]
    assert answer.usage.input_tokens == chat
    assert as_blocks.usage.input_tokens == chat  # text blocks joined with a newline: same tokens
    assert other.usage.input_tokens > answer.usage.input_tokens  # the result's text is in the prompt


def test_every_block_kind_is_converted_as_vllms_converter_does() -> None:
    image = {"type": "base64", "media_type": "image/png", "data": "iVBOR"}
    body = {
        "model": SIM,
        "max_tokens": 9,
        "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"],
        "tools": [{"name": "get_weather", "input_schema": {"properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "any"},
        "cache_salt": "tenant-a",
        "priority": 3,
        "messages": [
            {"role": "system", "content": " Use metric units."},
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "source": image}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "The user wants weather.", "signature": "s"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [
                            {"type": "text", "text": "Sunny"},
                            {"type": "image", "source": {"type": "url", "url": "https://x.test/map.png"}},
                            {"type": "text", "text": "21C"},
                        ],
                    },
                ],
            },
            {"role": "user", "content": [{"type": "text", "text": ""}]},
        ],
    }
    assert to_chat(body) == {
        "model": SIM,
        "messages": [
            {"role": "system", "content": "Be brief. Use metric units."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
                ],
            },
            {
                "role": "assistant",
                "reasoning": "The user wants weather.",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
                "content": "Checking.",
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny\n21C"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/map.png"}}]},
            # the user turn left without content is dropped; no cache_salt, no priority
        ],
        "max_tokens": 9,
        "max_completion_tokens": 9,
        "stop": ["END"],
        "stream": False,
        "tool_choice": "required",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": None,
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    }


def test_cache_salt_and_priority_are_not_passed_to_the_engine(sim_engine: Engine, client: Client) -> None:
    messages: list[Any] = [{"role": "user", "content": LONG}]
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        sdk.messages.create(model=SIM, max_tokens=1, messages=messages, extra_body={"cache_salt": "tenant-a"})
        unsalted = httpx.post(url + "/v1/chat/completions", json={"model": SIM, "messages": messages, "max_tokens": 1})
        salted = httpx.post(
            url + "/v1/chat/completions",
            json={"model": SIM, "messages": messages, "max_tokens": 1, "cache_salt": "tenant-a"},
        )
        # a request parked in the engine shows under the priority it runs at
        httpx.post(url + "/admin/fault", json={"mode": "stall", "after_tokens": 0})
        parked = {"model": SIM, "max_tokens": 5, "stream": True, "messages": messages, "priority": 7}
        with httpx.stream("POST", url + "/v1/messages", json=parked, timeout=5) as response:
            assert response.status_code == 200
            wait_until(
                lambda: sum(samples(url, "sim:num_requests_by_priority").values()) == 1,
                what="the request to be parked in the engine",
            )
            by_priority = samples(url, "sim:num_requests_by_priority")
        wait_until(lambda: metric(url, "sim:requests_aborted_total") == 1, what="the abort to be counted")
    prompt = prompt_tokens(("user", LONG))
    # the Messages request ran unsalted: the unsalted chat request reuses its blocks, the salted one not
    assert unsalted.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert salted.json()["usage"]["prompt_tokens_details"] is None  # vLLM: null when nothing was reused
    assert {dict(labels)["priority"]: value for labels, value in by_priority.items() if value} == {"0": 1}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": SIM, "messages": ASK}, "body.max_tokens"),
        ({"model": SIM, "max_tokens": 0, "messages": ASK}, "body.max_tokens"),
        ({"model": SIM, "max_tokens": -3, "messages": ASK}, "body.max_tokens"),
        ({"max_tokens": 5, "messages": ASK}, "body.model"),
        ({"model": SIM, "max_tokens": 5}, "body.messages"),
        ({"model": SIM, "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "body.messages.0.role"),
        (
            {"model": SIM, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "body.messages.0.content.0.type",
        ),
        (
            {"model": SIM, "max_tokens": 5, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool"}},
            "body.tool_choice",
        ),
    ],
    ids=[
        "no max_tokens",
        "max_tokens 0",
        "negative max_tokens",
        "no model",
        "no messages",
        "bad role",
        "document block",
        "tool without name",
    ],
)
def test_validation_errors_are_vllms_generic_400(
    sim_engine: Engine, client: Client, body: dict[str, Any], param: str
) -> None:
    with sim_engine("instant") as (url, _):
        response = httpx.post(url + "/v1/messages", json=body)
        with pytest.raises(anthropic.BadRequestError) as caught:
            client(url).post("/v1/messages", cast_to=Message, body=body)
    assert response.status_code == 400
    error = response.json()["error"]  # OpenAI's envelope, as vLLM's validation handler answers (issue #57997)
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("Bad Request", param, 400)
    assert error["message"].startswith("1 validation error:\n  {'type': ")
    assert caught.value.status_code == 400


def test_handler_errors_are_in_anthropics_shape(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, app):
        sdk = client(url)
        with pytest.raises(anthropic.NotFoundError) as missing:
            sdk.messages.create(model="other-model", max_tokens=5, messages=ASK)
        too_long = httpx.post(
            url + "/v1/messages", json={"model": SIM, "max_tokens": app.max_model_len, "messages": ASK}
        )
        with pytest.raises(anthropic.BadRequestError) as unknown_tool:
            sdk.messages.create(
                model=SIM, max_tokens=5, messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}
            )
        httpx.post(url + "/admin/fault", json={"mode": "fail_503"})
        with pytest.raises(anthropic.InternalServerError) as unavailable:
            sdk.messages.create(model=SIM, max_tokens=5, messages=ASK)
        injected = metric(url, "sim:faults_injected_total", mode="fail_503")
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "NotFoundError", "message": "The model `other-model` does not exist."},
    }
    assert too_long.status_code == 400
    assert too_long.json()["type"] == "error"
    assert too_long.json()["error"]["type"] == "BadRequestError"
    assert "maximum context length" in too_long.json()["error"]["message"]
    assert unknown_tool.value.body["error"]["type"] == "BadRequestError"
    assert unavailable.value.status_code == 503
    assert unavailable.value.body == {
        "type": "error",
        "error": {"type": "ServiceUnavailableError", "message": "The engine is unavailable (injected fault fail_503)."},
    }
    assert injected == 1


def test_close_mid_stream_drops_a_messages_stream_after_n_tokens(sim_engine: Engine) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        httpx.post(url + "/admin/fault", json={"mode": "close_mid_stream", "after_tokens": 2})
        names: list[str] = []
        body = {"model": SIM, "max_tokens": 20, "stream": True, "messages": ASK}
        with httpx.stream("POST", url + "/v1/messages", json=body, timeout=5) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                names.extend(line[7:] for line in response.iter_lines() if line.startswith("event: "))
        wait_until(lambda: metric(url, "sim:requests_aborted_total") == 1, what="the engine to free the request")
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_delta"]


def test_whole_answers_on_the_instant_profile(sim_engine: Engine, client: Client) -> None:
    with sim_engine("instant") as (url, _):
        sdk = client(url)
        text = sdk.messages.create(model=SIM, max_tokens=4, messages=ASK)
        tool = sdk.messages.create(model=SIM, max_tokens=4, messages=ASK, tools=TOOLS, tool_choice={"type": "any"})
        generated = metric(url, "vllm:generation_tokens_total")
    assert text.content == [TextBlock(type="text", text=generated_text(4))]
    assert text.stop_reason == "max_tokens"
    (block,) = tool.content
    assert isinstance(block, ToolUseBlock)
    assert block.input == {"city": generated_text(2), "days": 1}
    assert tool.stop_reason == "tool_use"
    assert generated == 8


def test_get_is_405(sim_engine: Engine) -> None:
    with sim_engine("instant") as (url, _):
        assert httpx.get(url + "/v1/messages").status_code == 405


# --- POST /v1/messages/count_tokens ----------------------------------------------------------

COUNTED: list[Any] = [
    pytest.param({"system": "Be brief.", "tools": TOOLS, "messages": ASK}, id="a system prompt and tools"),
    pytest.param(
        {
            "system": [{"type": "text", "text": "You are terse. "}, {"type": "text", "text": "Answer in French."}],
            "tools": TOOLS,
            "tool_choice": WEATHER,
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C"}]},
            ],
        },
        id="system blocks, a named tool choice and a tool result",
    ),
    pytest.param({"messages": [{"role": "user", "content": LONG}]}, id="a message alone"),
]


@pytest.mark.parametrize("request_body", COUNTED)
def test_count_tokens_is_the_input_tokens_a_message_of_the_same_body_reports(
    sim_engine: Engine, client: Client, request_body: dict[str, Any]
) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        counted = sdk.messages.count_tokens(model=SIM, **request_body)
        raw = httpx.post(url + "/v1/messages/count_tokens", json={"model": SIM, **request_body})
        counted_only = metric(url, "vllm:prompt_tokens_total")
        created = sdk.messages.create(model=SIM, max_tokens=2, **request_body)
        created_too = metric(url, "vllm:prompt_tokens_total")
    assert counted.input_tokens == created.usage.input_tokens
    assert raw.status_code == 200
    # vLLM's AnthropicCountTokensResponse, model_dump(exclude_none=True)
    assert raw.json() == {
        "input_tokens": counted.input_tokens,
        "context_management": {"original_input_tokens": counted.input_tokens},
    }
    assert (counted_only, created_too) == (0, created.usage.input_tokens)  # counting: nothing reaches the engine


def test_count_tokens_reads_no_generation_field(sim_engine: Engine) -> None:
    body = {"model": SIM, "messages": ASK}
    with sim_engine("instant") as (url, _):
        plain = httpx.post(url + "/v1/messages/count_tokens", json=body)
        # AnthropicCountTokensRequest has no max_tokens, stop_sequences or stream: ignored as unknown
        ignored = httpx.post(
            url + "/v1/messages/count_tokens", json={**body, "max_tokens": 0, "stream": "yes", "stop_sequences": 1}
        )
    assert plain.status_code == ignored.status_code == 200
    assert plain.json() == ignored.json()
    assert plain.json()["input_tokens"] == prompt_tokens(("user", ASK[0]["content"]))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": ASK}, "body.model"),
        ({"model": SIM}, "body.messages"),
        ({"model": SIM, "messages": [{"role": "tool", "content": "x"}]}, "body.messages.0.role"),
        ({"model": SIM, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool"}}, "body.tool_choice"),
    ],
    ids=["no model", "no messages", "bad role", "tool without name"],
)
def test_count_tokens_validation_errors_are_vllms_generic_400(
    sim_engine: Engine, body: dict[str, Any], param: str
) -> None:
    with sim_engine("instant") as (url, _):
        response = httpx.post(url + "/v1/messages/count_tokens", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("Bad Request", param, 400)
    assert error["message"].startswith("1 validation error:\n  {'type': ")


def test_count_tokens_handler_errors_are_in_anthropics_shape(sim_engine: Engine, client: Client) -> None:
    with sim_engine("instant") as (url, _):
        sdk = client(url)
        with pytest.raises(anthropic.NotFoundError) as missing:
            sdk.messages.count_tokens(model="other-model", messages=ASK)
        httpx.post(url + "/admin/fault", json={"mode": "fail_503"})
        with pytest.raises(anthropic.InternalServerError) as unavailable:
            sdk.messages.count_tokens(model=SIM, messages=ASK)
        wrong_method = httpx.get(url + "/v1/messages/count_tokens")
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "NotFoundError", "message": "The model `other-model` does not exist."},
    }
    assert unavailable.value.status_code == 503
    assert unavailable.value.body["type"] == "error"  # type: ignore[index]
    assert wrong_method.status_code == 405
