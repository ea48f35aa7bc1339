"""The Responses API (``POST /v1/responses``) on a real simulated engine, through the official SDK.

The SDK talks straight to the engine on loopback; raw SSE is read with httpx where the framing
itself is the point. See ``loadtests/sim/responses.py`` for the vLLM formats reproduced.
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
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)

from loadtests.sim.profiles import BLOCK_SIZE
from loadtests.sim.protocol import argument_pieces
from loadtests.sim.responses import ResponseStore, generated_text
from loadtests.sim.server import EngineApp
from loadtests.sim.tokenizer import count_tokens, render_chat
from tests.servers import metric, wait_until

SIM = "sim-model"
FAST = {"ttft_ms": 5, "itl_ms": 1}
DEFAULT_MAX_TOKENS = 128  # the fixed profile's, as for chat
Engine = Callable[..., AbstractContextManager[tuple[str, EngineApp]]]
Client = Callable[..., openai.OpenAI]
LONG = "Summarise the following notes about the quarterly capacity review. " * 4  # 40 tokens
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "The forecast.", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": TIME},
]
NAMED: Any = {"type": "function", "name": "get_time"}
ASK = "What is the weather in Paris?"
CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")  # the whole answer's call id, as chat's
ITEM_ID = re.compile(r"fc_[0-9a-f]{32}")


@pytest.fixture
def client() -> Iterator[Client]:
    """``client(url, **options)``: an SDK client of the engine at ``url``, closed after the test
    (an unclosed one leaks its socket into a later test's ResourceWarning)."""
    made: list[openai.OpenAI] = []

    def make(url: str, **options: Any) -> openai.OpenAI:
        made.append(openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, **options))
        return made[-1]

    yield make
    for sdk in made:
        sdk.close()


def prompt_tokens(*messages: tuple[str, str]) -> int:
    """Tokens of ``messages`` rendered as a chat prompt (the simulator's template)."""
    rendered = [{"role": role, "content": content} for role, content in messages]
    return count_tokens(render_chat(rendered, add_generation_prompt=True, continue_final_message=False))


def sse(url: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """The ``(event, data)`` pairs of a streamed response, checking the SSE framing as it goes."""
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw[:-2].split("\n\n"):
        event, data = block.split("\n")
        assert event.startswith("event: ")
        assert data.startswith("data: ")
        events.append((event[7:], orjson.loads(data[6:])))
    return events


def test_create_answers_a_completed_response_with_chat_usage(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        first = sdk.responses.create(model=SIM, input=LONG, instructions="Be brief.")
        again = sdk.responses.create(model=SIM, input=LONG, instructions="Be brief.")
        salted = sdk.responses.create(model=SIM, input=LONG, instructions="Be brief.", extra_body={"cache_salt": "t"})
        chat = sdk.chat.completions.create(
            model=SIM,
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG}],
            max_tokens=1,
        )
        finished = metric(url, "vllm:request_success_total", finished_reason="length")
        generated = metric(url, "vllm:generation_tokens_total")
    expected_prompt = prompt_tokens(("system", "Be brief."), ("user", LONG))
    assert first.id.startswith("resp_")
    assert first.object == "response"
    assert first.status == "completed"
    assert first.incomplete_details is None
    assert first.model == SIM
    assert first.instructions == "Be brief."
    assert first.max_output_tokens == DEFAULT_MAX_TOKENS
    assert first.output_text == generated_text(DEFAULT_MAX_TOKENS)
    assert len(first.output) == 1
    assert first.output[0].type == "message"
    assert first.output[0].id.startswith("msg_")
    usage = first.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (expected_prompt, DEFAULT_MAX_TOKENS)
    assert usage.total_tokens == expected_prompt + DEFAULT_MAX_TOKENS
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    # the same prompt as chat's: the repeat hits every full block, a salt isolates it
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == expected_prompt
    assert again.usage is not None
    assert salted.usage is not None
    assert again.usage.input_tokens_details.cached_tokens == (expected_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    assert salted.usage.input_tokens_details.cached_tokens == 0
    assert finished == 4  # counted with chat's requests
    assert generated == 3 * DEFAULT_MAX_TOKENS + 1


def test_streamed_create_gives_the_sdk_vllms_event_sequence(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        events = list(client(url).responses.create(model=SIM, input="Count to five.", stream=True))
    kinds = [type(e) for e in events]
    assert kinds[:4] == [
        ResponseCreatedEvent,
        ResponseInProgressEvent,
        ResponseOutputItemAddedEvent,
        ResponseContentPartAddedEvent,
    ]
    assert kinds[4:-4] == [ResponseTextDeltaEvent] * DEFAULT_MAX_TOKENS
    assert kinds[-4:] == [
        ResponseTextDoneEvent,
        ResponseContentPartDoneEvent,
        ResponseOutputItemDoneEvent,
        ResponseCompletedEvent,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, progress, added, _part, *deltas, text_done, _part_done, item_done, completed = events
    assert isinstance(created, ResponseCreatedEvent)
    assert isinstance(progress, ResponseInProgressEvent)
    assert created.response.status == progress.response.status == "in_progress"
    assert created.response.output == []
    assert created.response.usage is None
    assert isinstance(added, ResponseOutputItemAddedEvent)
    assert added.item.type == "message"
    streamed = "".join(e.delta for e in deltas if isinstance(e, ResponseTextDeltaEvent))
    assert all(isinstance(e, ResponseTextDeltaEvent) and e.item_id == added.item.id for e in deltas)
    assert isinstance(text_done, ResponseTextDoneEvent)
    assert text_done.text == streamed
    assert isinstance(item_done, ResponseOutputItemDoneEvent)
    assert item_done.item.id == added.item.id
    assert isinstance(completed, ResponseCompletedEvent)
    final = completed.response
    assert final.id == created.response.id
    assert final.status == "completed"
    assert final.output_text == streamed == generated_text(DEFAULT_MAX_TOKENS)
    assert final.usage is not None
    assert final.usage.input_tokens == prompt_tokens(("user", "Count to five."))
    assert final.usage.output_tokens == DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("profile", ["fixed", "instant"], ids=["on an engine", "on the instant profile"])
def test_stream_framing_is_named_events_without_done(sim_engine: Engine, profile: str) -> None:
    with sim_engine(profile, **(FAST if profile == "fixed" else {})) as (url, _):
        events = sse(url, {"model": SIM, "input": "Hi.", "max_output_tokens": 2, "stream": True})
    assert [name for name, data in events] == [data["type"] for name, data in events]
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(10))
    assert all(data.get("content_index", 0) == 0 and data.get("output_index", 0) == 0 for _, data in events)
    assert events[-1][1]["response"]["usage"]["output_tokens"] == 2


def test_max_output_tokens_cuts_the_response_incomplete(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        reply = sdk.responses.create(model=SIM, input="Tell me everything.", max_output_tokens=5)
        events = list(sdk.responses.create(model=SIM, input="Tell me everything.", max_output_tokens=3, stream=True))
    assert reply.status == "incomplete"
    assert reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.max_output_tokens == 5
    assert reply.usage is not None
    assert reply.usage.output_tokens == 5
    assert reply.output_text == generated_text(5)
    completed = events[-1]
    assert isinstance(completed, ResponseCompletedEvent)  # vLLM sends no response.incomplete event
    assert completed.response.status == "incomplete"
    assert completed.response.incomplete_details is not None
    assert completed.response.incomplete_details.reason == "max_output_tokens"
    assert sum(isinstance(e, ResponseTextDeltaEvent) for e in events) == 3


def test_previous_response_id_prepends_the_previous_turn(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        first_events = list(
            sdk.responses.create(model=SIM, input=LONG, instructions="Be brief.", max_output_tokens=6, stream=True)
        )
        first = first_events[-1]
        assert isinstance(first, ResponseCompletedEvent)
        second = sdk.responses.create(
            model=SIM, input="And then?", previous_response_id=first.response.id, max_output_tokens=4
        )
        third = sdk.responses.create(model=SIM, input="Last one.", previous_response_id=second.id, max_output_tokens=2)
    first_out, second_out = generated_text(6), generated_text(4)
    assert first.response.usage is not None
    assert second.usage is not None
    assert third.usage is not None
    # instructions do not carry over; the previous input and output do, turn after turn
    history = [("user", LONG), ("assistant", first_out), ("user", "And then?")]
    assert second.usage.input_tokens == prompt_tokens(*history)
    assert second.usage.input_tokens > prompt_tokens(("user", LONG)) + first.response.usage.output_tokens
    assert third.usage.input_tokens == prompt_tokens(*history, ("assistant", second_out), ("user", "Last one."))
    assert second.previous_response_id == first.response.id
    # a follow-up's prompt extends its predecessor's, so it hits the prefix cache (the second
    # does not: the first began with the system turn of its instructions)
    assert second.usage.input_tokens_details.cached_tokens == 0
    assert third.usage.input_tokens_details.cached_tokens == second.usage.input_tokens // BLOCK_SIZE * BLOCK_SIZE


def test_unknown_or_unstored_previous_response_is_vllms_404(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        unstored = sdk.responses.create(model=SIM, input="Forget me.", max_output_tokens=1, store=False)
        with pytest.raises(openai.NotFoundError) as unknown:
            sdk.responses.create(model=SIM, input="Hi.", previous_response_id="resp_nope")
        with pytest.raises(openai.NotFoundError) as forgotten:
            sdk.responses.create(model=SIM, input="Hi.", previous_response_id=unstored.id)
    assert unknown.value.status_code == 404
    assert unknown.value.body == {
        "message": "Response with id 'resp_nope' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    assert forgotten.value.status_code == 404


def test_store_keeps_only_the_most_recent_responses() -> None:
    store = ResponseStore(limit=2)
    for i in range(3):
        store.put(f"resp_{i}", [{"role": "user", "content": str(i)}], i)
    assert len(store) == 2
    assert store.get("resp_0") is None
    stored = store.get("resp_2")
    assert stored is not None
    assert stored.output_tokens == 2


def test_fail_503_answers_responses_like_chat(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        httpx.post(url + "/admin/fault", json={"mode": "fail_503"})
        with pytest.raises(openai.InternalServerError) as caught:
            client(url).responses.create(model=SIM, input="Hi.")
        injected = metric(url, "sim:faults_injected_total", mode="fail_503")
    assert caught.value.status_code == 503
    assert caught.value.body == {
        "message": "The engine is unavailable (injected fault fail_503).",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
    assert injected == 1


def test_close_mid_stream_drops_a_response_stream_after_n_tokens(sim_engine: Engine) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        httpx.post(url + "/admin/fault", json={"mode": "close_mid_stream", "after_tokens": 2})
        names: list[str] = []
        body = {"model": SIM, "input": "Hi.", "max_output_tokens": 20, "stream": True}
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=5) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                names.extend(line[7:] for line in response.iter_lines() if line.startswith("event: "))
        wait_until(lambda: metric(url, "sim:requests_aborted_total") == 1, what="the engine to free the request")
    assert names[-2:] == ["response.output_text.delta"] * 2
    assert "response.completed" not in names
    assert names.count("response.output_text.delta") == 2


def test_stall_ends_in_the_sdk_timeout_and_an_abort(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        httpx.post(url + "/admin/fault", json={"mode": "stall", "after_tokens": 0})
        with pytest.raises(openai.APITimeoutError):
            client(url, timeout=0.3).responses.create(model=SIM, input="Hi.", max_output_tokens=10)
        wait_until(lambda: metric(url, "sim:requests_aborted_total") == 1, what="the abort to be counted")
        assert metric(url, "vllm:num_requests_running") == 0
        assert metric(url, "sim:faults_injected_total", mode="stall") == 1


def test_a_response_cut_by_the_context_is_incomplete(sim_engine: Engine) -> None:
    with sim_engine("instant") as (url, app):
        room = app.max_model_len - prompt_tokens(("user", "Hi."))
        too_long = httpx.post(url + "/v1/responses", json={"model": SIM, "input": "word " * app.max_model_len})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["type"] == "invalid_request_error"
        # vLLM caps the bound by what the context leaves instead of refusing
        capped = httpx.post(
            url + "/v1/responses", json={"model": SIM, "input": "Hi.", "max_output_tokens": room + 50, "store": False}
        )
    assert capped.status_code == 200
    assert capped.json()["max_output_tokens"] == room
    assert capped.json()["status"] == "incomplete"


@pytest.mark.parametrize(
    ("method", "body", "status"),
    [
        ("POST", b"{not json", 400),
        ("POST", orjson.dumps({"model": SIM}), 400),
        ("POST", orjson.dumps({"model": "other", "input": "x"}), 404),
        ("POST", orjson.dumps({"model": SIM, "input": "x", "max_output_tokens": 0}), 400),
        ("POST", orjson.dumps({"model": SIM, "input": "x", "cache_salt": ""}), 400),
        ("POST", orjson.dumps({"model": SIM, "input": "x", "background": True}), 400),
        ("POST", orjson.dumps({"model": SIM, "input": [{"type": "computer_call"}]}), 400),
        ("POST", orjson.dumps({"model": SIM, "input": "x", "tools": TOOLS, "tool_choice": {"type": "function"}}), 400),
        (
            "POST",
            orjson.dumps({"model": SIM, "input": "x", "tools": [{"type": "function"}], "tool_choice": "auto"}),
            400,
        ),
        ("GET", b"", 405),
    ],
    ids=[
        "malformed JSON is a 400",
        "a missing input is a 400",
        "an unknown model is a 404",
        "max_output_tokens below 1 is a 400",
        "an empty cache_salt is a 400",
        "background mode is a 400",
        "an unsupported input item is a 400",
        "a tool_choice naming no function tool is a 400",
        "a function tool without a name is a 400",
        "GET is a 405",
    ],
)
def test_bad_requests_get_vllm_error_shape(sim_engine: Engine, method: str, body: bytes, status: int) -> None:
    with sim_engine("instant") as (url, _):
        response = httpx.request(method, url + "/v1/responses", content=body)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["code"] == status


def test_input_items_and_a_partial_assistant_turn(sim_engine: Engine, client: Client) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Say"}, {"type": "input_text", "text": "hi."}]},
        {"type": "message", "role": "assistant", "content": "Hi there", "status": "incomplete"},
    ]
    with sim_engine("fixed", **FAST) as (url, _):
        reply = client(url).responses.create(model=SIM, input=items, max_output_tokens=2)  # type: ignore[arg-type]
    continued = render_chat(
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert reply.usage is not None
    assert reply.usage.input_tokens == count_tokens(continued)


def tools_prompt_tokens(*messages: dict[str, str]) -> int:
    """Tokens of ``messages`` after the tools turn of ``TOOLS``, as chat renders its tools."""
    definitions = [{k: t.get(k) for k in ("name", "description", "parameters")} for t in TOOLS]
    rendered = [{"role": "tools", "content": orjson.dumps(definitions).decode()}, *messages]
    return count_tokens(render_chat(rendered, add_generation_prompt=True, continue_final_message=False))


@pytest.mark.parametrize(
    ("choice", "name", "arguments"),
    [
        (NAMED, "get_time", {"zone": generated_text(2)}),
        ("required", "get_weather", {"city": generated_text(2), "unit": "celsius"}),
    ],
    ids=["a named function is called", "required calls the first function tool"],
)
def test_a_forced_tool_choice_answers_one_function_call_item(
    sim_engine: Engine, client: Client, choice: Any, name: str, arguments: dict[str, Any]
) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        reply = client(url).responses.create(model=SIM, input=ASK, tools=TOOLS, tool_choice=choice, max_output_tokens=4)
    assert len(reply.output) == 1  # the call and no message
    item = reply.output[0]
    assert isinstance(item, ResponseFunctionToolCall)
    assert (item.type, item.name, item.status) == ("function_call", name, "completed")
    assert item.id is not None
    assert ITEM_ID.fullmatch(item.id)
    assert CALL_ID.fullmatch(item.call_id)
    assert json.loads(item.arguments) == arguments  # 4 tokens: 2 literal pieces and 2 words in the string
    if choice == "required":
        assert item.arguments == json.dumps(json.loads(item.arguments))  # re-serialised, as vLLM's required path
    else:
        assert item.arguments == "".join(argument_pieces(TIME, 4))  # as generated
    assert reply.output_text == ""
    # the object ends the generation: completed, not cut by max_output_tokens
    assert reply.status == "completed"
    assert reply.incomplete_details is None
    assert reply.usage is not None
    assert reply.usage.output_tokens == 4
    assert reply.usage.input_tokens == tools_prompt_tokens({"role": "user", "content": ASK})


@pytest.mark.parametrize("profile", ["fixed", "instant"], ids=["on an engine", "on the instant profile"])
def test_a_streamed_call_is_vllms_function_call_events(sim_engine: Engine, profile: str) -> None:
    body = {"model": SIM, "input": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_output_tokens": 3, "stream": True}
    with sim_engine(profile, **(FAST if profile == "fixed" else {})) as (url, _):
        events = sse(url, body)
    assert [name for name, data in events] == [data["type"] for name, data in events]
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(9))
    added, *deltas, done, item_done = [data for _, data in events[2:-1]]
    item = added["item"]
    item_id, call_id = item["id"], item["call_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", item_id)  # vLLM's streamed item: a bare hex id ...
    assert re.fullmatch(r"call_[0-9a-f]{32}", call_id)  # ... and its own call id
    assert added == {
        "item": {
            "arguments": "",
            "call_id": call_id,
            "name": "get_time",
            "type": "function_call",
            "id": item_id,
            "status": "in_progress",
        },
        "output_index": 0,
        "sequence_number": 2,
        "type": "response.output_item.added",
    }
    pieces = argument_pieces(TIME, 3)
    assert deltas == [
        {
            "delta": piece,
            "item_id": item_id,
            "output_index": 0,
            "sequence_number": 3 + i,
            "type": "response.function_call_arguments.delta",
        }
        for i, piece in enumerate(pieces)
    ]
    arguments = "".join(pieces)
    assert json.loads(arguments) == {"zone": generated_text(1)}
    assert done == {
        "arguments": arguments,
        "item_id": item_id,
        "output_index": 0,
        "sequence_number": 6,
        "type": "response.function_call_arguments.done",
        "name": "get_time",
    }
    assert item_done == {
        "item": {**added["item"], "arguments": arguments, "status": "completed"},
        "output_index": 0,
        "sequence_number": 7,
        "type": "response.output_item.done",
    }
    final = events[-1][1]["response"]
    assert final["status"] == "completed"
    assert final["usage"]["output_tokens"] == 3
    (output,) = final["output"]
    # the whole answer's item, with fresh ids as vLLM builds it
    assert output == {**item_done["item"], "call_id": output["call_id"], "id": output["id"]}
    assert CALL_ID.fullmatch(output["call_id"])
    assert ITEM_ID.fullmatch(output["id"])


def test_the_sdk_reads_a_streamed_call_whose_deltas_make_its_arguments(sim_engine: Engine, client: Client) -> None:
    n = 9
    with sim_engine("fixed", **FAST) as (url, _):
        events = list(
            client(url).responses.create(
                model=SIM, input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=n, stream=True
            )
        )
    created, progress, added, *deltas, done, item_done, completed = events
    assert isinstance(created, ResponseCreatedEvent)
    assert isinstance(progress, ResponseInProgressEvent)
    assert isinstance(added, ResponseOutputItemAddedEvent)
    assert isinstance(added.item, ResponseFunctionToolCall)
    assert added.item.name == "get_weather"
    assert all(isinstance(d, ResponseFunctionCallArgumentsDeltaEvent) for d in deltas)
    assert len(deltas) == n  # one a token
    streamed = "".join(d.delta for d in deltas if isinstance(d, ResponseFunctionCallArgumentsDeltaEvent))
    assert json.loads(streamed) == {"city": generated_text(n - 2), "unit": "celsius"}
    assert isinstance(done, ResponseFunctionCallArgumentsDoneEvent)
    assert done.arguments == streamed
    assert isinstance(item_done, ResponseOutputItemDoneEvent)
    assert isinstance(item_done.item, ResponseFunctionToolCall)
    assert (item_done.item.id, item_done.item.arguments) == (added.item.id, streamed)
    assert isinstance(completed, ResponseCompletedEvent)
    (final,) = completed.response.output
    assert isinstance(final, ResponseFunctionToolCall)
    assert final.arguments == json.dumps(json.loads(streamed))  # required: re-serialised in the whole answer
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_call_is_followed_up_by_its_output_by_id_or_with_the_items_resent(sim_engine: Engine, client: Client) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        call = sdk.responses.create(model=SIM, input=ASK, tools=TOOLS, tool_choice=NAMED, max_output_tokens=4)
        item = call.output[0]
        assert isinstance(item, ResponseFunctionToolCall)
        result: Any = {"type": "function_call_output", "call_id": item.call_id, "output": "18C"}
        by_id = sdk.responses.create(model=SIM, input=[result], previous_response_id=call.id, max_output_tokens=3)
        resent_items: Any = [{"role": "user", "content": ASK}, item.model_dump(exclude_none=True), result]
        resent = sdk.responses.create(model=SIM, input=resent_items, tools=TOOLS, max_output_tokens=3)
    for reply in (by_id, resent):
        assert reply.output_text == generated_text(3)
        assert [o.type for o in reply.output] == ["message"]
        assert reply.usage is not None
    assert by_id.usage is not None
    assert resent.usage is not None
    # by id: the stored conversation without the call (vLLM adds only a previous output's
    # messages), then the result as a tool message; no tools given, none rendered
    assert by_id.usage.input_tokens == prompt_tokens(("user", ASK), ("tool", "18C"))
    # resent: the call is an assistant turn of its name and arguments
    assert resent.usage.input_tokens == tools_prompt_tokens(
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": f"get_time {item.arguments}"},
        {"role": "tool", "content": "18C"},
    )


@pytest.mark.parametrize(
    "choice", ["auto", "none", {"type": "file_search"}, None], ids=["auto", "none", "a built-in tool", "absent"]
)
def test_without_a_forced_choice_the_answer_is_text_with_the_tools_in_the_prompt(
    sim_engine: Engine, client: Client, choice: Any
) -> None:
    extra: dict[str, Any] = {} if choice is None else {"tool_choice": choice}
    with sim_engine("fixed", **FAST) as (url, _):
        sdk = client(url)
        reply = sdk.responses.create(model=SIM, input=ASK, tools=TOOLS, max_output_tokens=3, **extra)
        built_in = sdk.responses.create(
            model=SIM, input=ASK, tools=[{"type": "web_search_preview"}], max_output_tokens=1
        )
    assert reply.output_text == generated_text(3)
    assert reply.status == "incomplete"
    assert reply.usage is not None
    assert reply.usage.input_tokens == tools_prompt_tokens({"role": "user", "content": ASK})
    assert built_in.usage is not None
    assert built_in.usage.input_tokens == prompt_tokens(("user", ASK))  # only function tools are rendered


def test_store_keeps_a_call_as_a_call() -> None:
    store = ResponseStore(limit=2)
    store.put("resp_0", [{"role": "user", "content": "0"}], 1, called=True)
    store.put("resp_1", [{"role": "user", "content": "1"}], 1)
    store.put("resp_2", [{"role": "user", "content": "2"}], 1, called=True)
    called = {i: stored.called for i in range(3) if (stored := store.get(f"resp_{i}")) is not None}
    assert called == {1: False, 2: True}  # the oldest is forgotten beyond the limit
