"""Messages answered through chat completions (``gateway/dialects/messages_chat.py``) and the
choice between that and passthrough (``MessagesDialect.translation``).

The chat side is what vLLM sends (role-only first chunk, one token a chunk, a finish chunk, the
usage-only chunk); the Messages side is compared with vLLM's own Messages stream (the
conformance samples): a client must not be able to tell a translated answer from a passed-through one.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from gateway.admission.build import build_request
from gateway.dialects.allowlists import NO_GRANTS
from gateway.dialects.chat import CHAT
from gateway.dialects.messages import MESSAGES
from gateway.dialects.messages_chat import MESSAGES_VIA_CHAT, chat_body, messages_answer
from gateway.policy.model import Backend, BackendKind
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.tokens import CharRatioEstimator
from tests.dialects.samples import MESSAGES as SAMPLES
from tests.dialects.samples import MODEL
from tests.dialects.test_dialect_conformance import snapshot  # noqa: F401 (the fixture)

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODEL, "choices": choices, **extra}


def call(arguments: str) -> dict[str, str]:
    """A chat tool call's ``function`` to ``get_weather``."""
    return {"name": "get_weather", "arguments": arguments}


def translated(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Messages events (name checked against the data's type) a translator makes of ``chunks``."""
    stream = MESSAGES_VIA_CHAT.stream()
    raw = b"".join(stream.event(copy.deepcopy(c)) for c in chunks) + stream.end()
    events = []
    for frame in raw.split(b"\n\n")[:-1]:
        name, data = frame.split(b"\n")
        document = orjson.loads(data.removeprefix(b"data: "))
        assert name == b"event: " + document["type"].encode()
        events.append(document)
    return events


TEXT_STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": " Once"}),
    chunk({"content": " upon"}, finish="length"),
    chunk(None, usage={"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}),
]


def test_a_text_stream_becomes_the_event_sequence_vllm_s_messages_endpoint_sends() -> None:
    events = translated(TEXT_STREAM)
    assert [e["type"] for e in events] == [e["type"] for e in SAMPLES.stream or ()]
    assert events[2]["delta"] == {"type": "text_delta", "text": " Once"}
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": 9, "output_tokens": 2}
    assert events[0]["message"]["model"] == MODEL
    assert events[0]["message"]["content"] == []
    # read back as the Messages dialect reads a passed-through stream: the same usage and finish
    readings = [MESSAGES.read_chunk(e) for e in events]
    assert sum(r[0] for r in readings) == 2
    assert [r for reading in readings for r in reading[2]] == ["length"]


def test_a_tool_call_stream_becomes_a_tool_use_block_with_its_input_in_json_deltas() -> None:
    events = translated(
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"content": "Let me check."}),
            chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": call("")}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, finish="tool_calls"),
            chunk(None, usage={"prompt_tokens": 30, "completion_tokens": 9}),
        ]
    )  # fmt: skip
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[4] == {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}},
    }
    partial = "".join(
        e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"
    )
    assert orjson.loads(partial) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_reasoning_becomes_a_signed_thinking_block_before_the_text() -> None:
    events = translated(
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"reasoning": "Think."}),
            chunk({"content": "Done."}, finish="stop"),
            chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 2}),
        ]
    )
    blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert blocks == ["thinking", "text"]
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "text_delta"]
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


def test_a_stream_without_a_usage_chunk_still_ends_with_message_delta_and_message_stop() -> None:
    events = translated([chunk({"role": "assistant", "content": ""}), chunk({"content": "Hi"}, finish="stop")])
    assert [e["type"] for e in events][-4:] == [
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_a_whole_answer_becomes_a_message_with_text_tool_use_stop_reason_and_usage() -> None:
    answer = {
        "id": "chatcmpl-7",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Checking.",
                    "tool_calls": [
                        {"id": "call_9", "type": "function", "function": call('{"city":"Oslo"}')},
                        {"id": "call_10", "type": "function", "function": call("not json")},
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
    }  # fmt: skip
    message = messages_answer(answer)
    assert message == {
        "id": "chatcmpl-7",
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "call_9", "name": "get_weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "call_10", "name": "get_weather", "input": {"arguments": "not json"}},
        ],
        "model": MODEL,
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 7},
    }
    assert MESSAGES.is_answer(message)
    assert MESSAGES.answer_usage(message) == {"prompt_tokens": 12, "completion_tokens": 7}


@pytest.mark.parametrize(
    ("finish", "matched", "expected"),
    [
        ("stop", None, ("end_turn", None)),
        ("length", None, ("max_tokens", None)),
        ("stop", "END", ("stop_sequence", "END")),
    ],
)
def test_stop_reasons(finish: str, matched: str | None, expected: tuple[str, str | None]) -> None:
    answer = {"choices": [{"message": {"content": "x"}, "finish_reason": finish, "stop_reason": matched}], "usage": {}}
    message = messages_answer(answer)
    assert (message["stop_reason"], message["stop_sequence"]) == expected


def test_a_conversation_with_system_blocks_tools_and_tool_results_becomes_vllm_s_chat_request(
    snapshot: PolicySnapshot,  # noqa: F811
) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 64,
        "system": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Use tools."}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "stop_sequences": ["END"],
        "temperature": 0.2,
        "metadata": {"user_id": "u1"},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    }
    chat = chat_body(body)
    assert chat == {
        "model": MODEL,
        "max_tokens": 64,
        "temperature": 0.2,
        "messages": [
            {"role": "system", "content": "Be brief. Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": call('{"city":"Paris"}')}
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "stop": ["END"],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": WEATHER_TOOL["input_schema"],
                    "description": "The weather in a city.",
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }  # fmt: skip
    # and it is a valid chat request, which the gateway's own chat validation accepts
    limits = snapshot.policy.limits
    MESSAGES.screen(body, limits, NO_GRANTS)
    CHAT.screen(chat, limits, NO_GRANTS)
    request = build_request(
        api=CHAT,
        body=chat,
        raw_body=orjson.dumps(chat),
        request_id="r",
        arrival=0.0,
        model_policy=snapshot.models[MODEL],
        limits=limits,
        estimator=CharRatioEstimator(),
    )
    assert request.max_tokens == 64


def backend(kind: BackendKind, *, engine_priority: bool = False) -> Backend:
    return Backend(name="b", url="http://127.0.0.1:1", kind=kind, models=[MODEL], engine_priority=engine_priority)


@pytest.mark.parametrize("kind", [BackendKind.VLLM, BackendKind.SIM])
def test_passthrough_only_to_an_engine_that_serves_messages_and_needs_no_salt_nor_priority(kind: BackendKind) -> None:
    assert MESSAGES.translation(backend(kind), multi_scope=False) is None
    # vLLM's Messages request drops cache_salt and priority: passed through, a tenant's request
    # would reach an engine other scopes share without its salt
    assert MESSAGES.translation(backend(kind), multi_scope=True) is MESSAGES_VIA_CHAT
    assert MESSAGES.translation(backend(kind, engine_priority=True), multi_scope=False) is MESSAGES_VIA_CHAT


@pytest.mark.parametrize("kind", [BackendKind.SGLANG, BackendKind.LLAMACPP, BackendKind.OPENAI])
def test_other_engines_are_always_answered_through_chat(kind: BackendKind) -> None:
    assert MESSAGES.translation(backend(kind), multi_scope=False) is MESSAGES_VIA_CHAT


def test_errors_have_anthropic_s_shape_with_the_gateway_s_code() -> None:
    from gateway.errors import InvalidRequest, Overloaded

    body = orjson.loads(MESSAGES.error_body(InvalidRequest("'max_tokens' is required.", param="max_tokens")))
    assert body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "'max_tokens' is required.",
            "code": "invalid_field",
            "param": "max_tokens",
        },
    }
    busy = Overloaded("Queue full.", status=503, code="queue_full", retry_after_s=1.0)
    assert orjson.loads(MESSAGES.error_body(busy))["error"]["type"] == "overloaded_error"
    event = MESSAGES.error_event(busy)
    assert event.startswith(b"event: error\ndata: ")
    assert event.endswith(b"\n\n")
