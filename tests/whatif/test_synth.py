"""Prompts rebuilt from signatures: sizes agree for the gateway and the simulator, shared heads
stay shared under the gateway's own block chain and the engine's tokens, and nothing is shared
that was not recorded."""

from __future__ import annotations

import orjson
import pytest

from gateway.dialects.chat import render_chat as gateway_render
from gateway.request.tokens import CharRatioEstimator
from gateway.routing.prefix_keys import CHARS_PER_TOKEN, chain, scope_root
from loadtests.sim.protocol import Endpoint, parse_request
from loadtests.sim.tokenizer import count_tokens
from loadtests.whatif.model import ReplayRequest
from loadtests.whatif.synth import TEMPLATE_TOKENS, block_text, chat_body, prompt_text, request_body, request_headers
from tests.whatif.conftest import BLOCK_TOKENS, request

ROUTING_BLOCK = 16


def engine_tokens(replayed: ReplayRequest, index: int) -> list[int]:
    """The token ids the simulator makes of the replayed body (its chat template included)."""
    body = request_body(replayed, index)
    return parse_request(Endpoint.CHAT, body, served_model=replayed.model, default_max_tokens=1).token_ids


def gateway_chain(replayed: ReplayRequest, index: int) -> tuple[int, ...]:
    """The gateway's routing chain of the replayed body (estimate tokenizer)."""
    rendered = gateway_render(chat_body(replayed, index)).encode()
    return chain(rendered, CHARS_PER_TOKEN * ROUTING_BLOCK, scope_root("tenant:acme", replayed.model))


def common_head(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("block_tokens", [16, 64, 512])
def test_a_block_is_exactly_its_tokens_for_the_gateway_estimate_and_the_simulator(block_tokens: int) -> None:
    text = block_text("00ff00ff00ff00ff", block_tokens)
    assert len(text.encode()) == CHARS_PER_TOKEN * block_tokens
    assert CharRatioEstimator().count(text) == block_tokens
    assert count_tokens(text) == block_tokens


def test_equal_ids_give_equal_text_and_different_ids_different_text() -> None:
    assert block_text("a1", BLOCK_TOKENS) == block_text("a1", BLOCK_TOKENS)
    assert block_text("a1", BLOCK_TOKENS) != block_text("a2", BLOCK_TOKENS)


@pytest.mark.parametrize(
    ("prompt_tokens", "hashes"),
    [(200, ()), (300, ("a", "b", "c")), (1000, ("a",)), (4096, tuple("abcdefgh"))],
    ids=["no shared block", "three blocks and a tail", "one block and a long tail", "eight blocks"],
)
def test_the_simulator_counts_the_recorded_prompt_tokens(prompt_tokens: int, hashes: tuple[str, ...]) -> None:
    assert len(engine_tokens(request(0.0, prompt_tokens=prompt_tokens, hashes=hashes), 7)) == prompt_tokens


def test_a_prompt_shorter_than_its_blocks_is_its_blocks() -> None:
    replayed = request(0.0, prompt_tokens=10, hashes=("a", "b"))
    assert prompt_text(replayed, 0) == block_text("a", BLOCK_TOKENS) + block_text("b", BLOCK_TOKENS)
    assert len(engine_tokens(replayed, 0)) == 2 * BLOCK_TOKENS + TEMPLATE_TOKENS


def test_a_shared_hash_head_is_exactly_the_shared_engine_prefix() -> None:
    first = request(0.0, prompt_tokens=200, hashes=("a", "b", "c"))
    second = request(1.0, prompt_tokens=200, hashes=("a", "b", "x"))
    template_head = 5  # "<|user|>" before the content
    assert common_head(engine_tokens(first, 0), engine_tokens(second, 1)) == template_head + 2 * BLOCK_TOKENS


def test_shared_hash_heads_share_the_gateway_blocks_they_cover_and_no_more() -> None:
    first = request(0.0, prompt_tokens=400, hashes=("a", "b", "c"))
    second = request(1.0, prompt_tokens=400, hashes=("a", "b", "x"))
    one, two = gateway_chain(first, 0), gateway_chain(second, 1)
    # The gateway renders "\x1euser\x1f" (6 bytes) before the content: its blocks wholly within
    # those 6 bytes and the shared text are shared, the first block reaching past them is not.
    assert one[:2] == two[:2]
    assert one[2] != two[2]


def test_a_conversation_turn_extends_the_previous_turns_blocks() -> None:
    turn1 = request(0.0, prompt_tokens=200, hashes=("a", "b"))
    turn2 = request(5.0, prompt_tokens=500, hashes=("a", "b", "c", "d", "e"))
    assert prompt_text(turn2, 1).startswith(block_text("a", BLOCK_TOKENS) + block_text("b", BLOCK_TOKENS))
    assert gateway_chain(turn2, 1)[:2] == gateway_chain(turn1, 0)[:2]


def test_the_tails_of_two_requests_share_nothing() -> None:
    one, two = request(0.0, prompt_tokens=400), request(0.0, prompt_tokens=400)
    assert common_head(engine_tokens(one, 0), engine_tokens(two, 1)) == 5
    assert not set(gateway_chain(one, 0)) & set(gateway_chain(two, 1))


def test_the_same_request_index_gives_the_same_prompt_on_both_sides() -> None:
    replayed = request(0.0, prompt_tokens=300, hashes=("a",))
    assert request_body(replayed, 3) == request_body(replayed, 3)


@pytest.mark.parametrize(
    ("stream", "output_tokens", "expected"),
    [
        (True, 40, {"max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}),
        (False, 40, {"max_tokens": 40, "stream": False}),
        (False, 0, {"max_tokens": 1, "stream": False}),
    ],
    ids=["a stream asks for usage", "a whole answer does not", "no recorded output still asks for one token"],
)
def test_the_body_asks_for_the_recorded_output(stream: bool, output_tokens: int, expected: dict[str, object]) -> None:
    body = orjson.loads(request_body(request(0.0, stream=stream, output_tokens=output_tokens), 0))
    assert {k: body[k] for k in expected} == expected
    assert ("stream_options" in body) == stream
    assert [m["role"] for m in body["messages"]] == ["user"]


def test_headers_carry_the_key_the_class_asked_for_and_the_session() -> None:
    assert request_headers(request(0.0, session="5e55"), api_key="k1", send_class="batch") == {
        "authorization": "Bearer k1",
        "content-type": "application/json",
        "x-priority": "batch",
        "x-session-id": "5e55",
    }


def test_no_class_and_no_session_send_no_such_header() -> None:
    headers = request_headers(request(0.0), api_key="k1", send_class=None)
    assert set(headers) == {"authorization", "content-type"}
