"""Tool calls on the simulated engine's chat completions, through the official OpenAI SDK.

A forced ``tool_choice`` (``"required"`` or a named function) makes the engine answer one call
in vLLM's shapes; ``"auto"``, ``"none"`` or no choice keep the text answer. See the module
docstring of ``loadtests/sim/protocol.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import openai
import orjson
import pytest

from loadtests.sim.protocol import argument_pieces
from loadtests.sim.responses import generated_text
from loadtests.sim.server import EngineApp
from loadtests.sim.tokenizer import count_tokens, render_chat
from tests.servers import metric

SIM = "sim-model"
FAST = {"ttft_ms": 5, "itl_ms": 1}
Engine = Callable[..., AbstractContextManager[tuple[str, EngineApp]]]
Client = Callable[[str], openai.OpenAI]
CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
        "detail": {"type": "string"},
    },
    "required": ["city", "unit", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]
NAMED = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client() -> Iterator[Client]:
    made: list[openai.OpenAI] = []

    def make(url: str) -> openai.OpenAI:
        made.append(openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0))
        return made[-1]

    yield make
    for sdk in made:
        sdk.close()


def words(n: int) -> str:
    return generated_text(n)


def test_required_calls_the_first_tool_with_arguments_of_its_schema(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        reply = client(url).chat.completions.create(
            model=SIM, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=7
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"  # vLLM: "tool_calls" for required
    assert choice.message.content == ""  # vLLM's content of a forced call
    calls = choice.message.tool_calls
    assert calls is not None
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function"
    assert CALL_ID.fullmatch(call.id)
    assert call.function.name == "get_weather"
    arguments = call.function.arguments
    # the required properties only; 7 tokens: 2 literal pieces and 5 words in the one string
    assert json.loads(arguments) == {"city": words(5), "unit": "celsius", "days": 1}
    assert arguments == json.dumps(json.loads(arguments))  # re-serialised, as vLLM's required path does
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 7


def test_a_named_function_is_called_and_finishes_stop(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        reply = client(url).chat.completions.create(
            model=SIM, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=4
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # vLLM (as OpenAI): "stop" for a named function
    calls = choice.message.tool_calls
    assert calls is not None
    assert [c.function.name for c in calls] == ["get_time"]
    # no "required" list: the first property takes the words
    assert json.loads(calls[0].function.arguments) == {"zone": words(2)}


def test_streamed_call_is_one_delta_per_token_after_the_role_chunk(sim_engine: Engine, client: Client) -> None:
    n = 9
    with sim_engine("fixed", **FAST) as (url, _):
        chunks = list(
            client(url).chat.completions.create(
                model=SIM,
                messages=ASK,
                tools=TOOLS,
                tool_choice="required",
                max_tokens=n,
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
            )
        )
    role, *calls, end = chunks
    assert role.choices[0].delta.role == "assistant"
    assert role.choices[0].delta.tool_calls is None
    assert len(calls) == n
    deltas = [c.choices[0].delta.tool_calls for c in calls]
    assert all(d is not None and len(d) == 1 and d[0].index == 0 for d in deltas)
    first, *rest = [d[0] for d in deltas if d is not None]
    assert CALL_ID.fullmatch(first.id or "")
    assert first.type == "function"
    assert first.function is not None
    assert first.function.name == "get_weather"
    assert all(d.id is None and d.type is None and d.function is not None and d.function.name is None for d in rest)
    pieces = [d.function.arguments or "" for d in [first, *rest] if d.function is not None]
    assert all(pieces)
    assert json.loads("".join(pieces)) == {"city": words(n - 2), "unit": "celsius", "days": 1}
    # every token is a chunk: the running usage counts one more each time
    assert [c.usage.completion_tokens for c in calls if c.usage is not None] == list(range(1, n + 1))
    assert [c.choices[0].finish_reason for c in calls] == [None] * (n - 1) + ["tool_calls"]
    assert end.choices == []
    assert end.usage is not None
    assert end.usage.completion_tokens == n


@pytest.mark.parametrize("choice", ["auto", "none", None], ids=["auto", "none", "absent"])
def test_without_a_forced_choice_the_answer_is_text(sim_engine: Engine, client: Client, choice: str | None) -> None:
    extra: dict[str, Any] = {} if choice is None else {"tool_choice": choice}
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        with_tools = sdk.chat.completions.create(model=SIM, messages=ASK, tools=TOOLS, max_tokens=3, **extra)
        plain = sdk.chat.completions.create(model=SIM, messages=ASK, max_tokens=3)
    choice_ = with_tools.choices[0]
    assert choice_.message.content == words(3)
    assert not choice_.message.tool_calls
    assert choice_.finish_reason == "length"
    assert with_tools.usage is not None
    assert plain.usage is not None
    # the tool definitions are part of the prompt, as a chat template renders them
    definitions = [{k: t["function"].get(k) for k in ("name", "description", "parameters")} for t in TOOLS]
    rendered = [{"role": "tools", "content": orjson.dumps(definitions).decode()}, *ASK]
    expected = count_tokens(render_chat(rendered, add_generation_prompt=True, continue_final_message=False))
    assert with_tools.usage.prompt_tokens == expected > plain.usage.prompt_tokens


def test_a_previous_call_and_its_result_are_part_of_the_prompt(sim_engine: Engine, client: Client) -> None:
    arguments = '{"zone": "CET"}'
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    with sim_engine("fixed", **FAST) as (url, _):
        reply = client(url).chat.completions.create(model=SIM, messages=history, max_tokens=1)
    rendered = [*ASK, {"role": "assistant", "content": f" get_time {arguments}"}, {"role": "tool", "content": "12:00"}]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == count_tokens(
        render_chat(rendered, add_generation_prompt=True, continue_final_message=False)
    )


@pytest.mark.parametrize("profile", ["fixed", "instant"], ids=["on an engine", "on the instant profile"])
def test_raw_tool_chunks_have_vllms_shapes(sim_engine: Engine, profile: str) -> None:
    body = {"model": SIM, "messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 3, "stream": True}
    with (
        sim_engine(profile, **(FAST if profile == "fixed" else {})) as (url, _),
        httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as response,
    ):
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    _role, *chunks = [orjson.loads(line) for line in lines[:-1]]
    choices = [c["choices"][0] for c in chunks]
    call_id = choices[0]["delta"]["tool_calls"][0]["id"]
    assert choices[0] == {
        "index": 0,
        "delta": {
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "index": 0,
                    "function": {"name": "get_time", "arguments": '{"zone": "'},
                }
            ]
        },
        "logprobs": None,
        "finish_reason": None,
    }
    assert choices[1] == {
        "index": 0,
        "delta": {"tool_calls": [{"index": 0, "function": {"arguments": " the"}}]},
        "logprobs": None,
        "finish_reason": None,
    }
    assert choices[2] == {
        "index": 0,
        "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"}'}}]},
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
    }


def test_whole_tool_answer_on_the_instant_profile(sim_engine: Engine) -> None:
    body = {"model": SIM, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 5}
    with sim_engine("instant") as (url, _):
        answer = httpx.post(url + "/v1/chat/completions", json=body).json()
        generated = metric(url, "vllm:generation_tokens_total")
    message = answer["choices"][0]["message"]
    assert set(message) == {"role", "content", "tool_calls"}
    assert message["content"] == ""
    (call,) = message["tool_calls"]
    assert set(call) == {"id", "type", "function"}
    assert json.loads(call["function"]["arguments"]) == {"city": words(3), "unit": "celsius", "days": 1}
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert generated == 5


@pytest.mark.parametrize(
    "schema",
    [
        WEATHER,
        {},
        {"type": "object", "properties": {"flag": {"type": "boolean"}, "n": {"type": ["number", "null"]}}},
        {"type": "object", "properties": {"a": {}, "b": {"type": "string"}}, "required": ["a", "b", "c"]},
        {"type": "object", "properties": {"tags": {"type": "array"}}, "required": ["tags"]},
    ],
    ids=["strings and fixed values", "no properties", "no string", "three strings", "an array"],
)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 10, 129])
def test_arguments_are_exactly_n_pieces_of_one_json_object(schema: dict[str, Any], n: int) -> None:
    pieces = argument_pieces(schema, n)
    assert len(pieces) == n
    assert all(pieces)
    value = json.loads("".join(pieces))
    assert isinstance(value, dict)
    wanted = schema.get("required") or list(schema.get("properties", {}))[:1]
    assert list(value) == wanted


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ],
    ids=["choice without tools", "unknown function", "unknown choice", "tool without a name"],
)
def test_bad_tool_requests_are_400s(sim_engine: Engine, extra: dict[str, Any], param: str) -> None:
    with sim_engine("instant") as (url, _):
        response = httpx.post(url + "/v1/chat/completions", json={"model": SIM, "messages": ASK, **extra})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
