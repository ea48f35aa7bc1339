"""Stream migration: a stream whose engine fails mid-way continues on another engine, unbroken.

The continuation request is checked as a value (``continuation``), then end to end: real
simulated engines (one told to drop or stall its streams after a few tokens), a gateway
process, and the official ``openai`` SDK as the client, which must see one stream with every
token, one chunk id, one role chunk and the usage of its own prompt and all its tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from gateway.dialects.chat import CHAT
from gateway.dialects.completions import COMPLETIONS
from gateway.pipeline.migration import StreamProgress, can_continue, continuation
from gateway.policy.model import BackendKind
from gateway.types import InferenceRequest
from loadtests.sim.tokenizer import render_chat, tokenize
from tests.resilience_harness import KEY, MODEL, Engine, Fleet, engines, gateway, policy, set_fault
from tests.servers import wait_until


def chat_request(max_tokens: int = 20, **fields: object) -> InferenceRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": True}
    return InferenceRequest(
        request_id="r",
        api=CHAT,
        model=MODEL,
        body={**body, **fields},
        raw_body=b"",
        stream=True,
        client_wants_usage=False,
        prompt_tokens=10,
        max_tokens=max_tokens,
        arrival=0.0,
    )


def progress(text: str, tokens: int | None, *, continuable: bool = True) -> StreamProgress:
    seen = StreamProgress()
    seen.continuable = continuable
    if text:
        seen.pieces.append(text)
    seen.tokens = tokens
    return seen


def test_a_chat_continues_with_the_partial_answer_as_a_final_assistant_message() -> None:
    request = chat_request(max_tokens=20)
    follow_up = continuation(request, progress("Once upon", 3))
    assert follow_up is not None
    assert follow_up.body["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert follow_up.body["continue_final_message"] is True
    assert follow_up.body["add_generation_prompt"] is False
    assert follow_up.body["max_tokens"] == follow_up.max_tokens == 17
    assert follow_up.prompt_tokens == 13
    assert follow_up.body_modified
    assert request.body["messages"] == [{"role": "user", "content": "hi"}], "the original must not change"


def test_a_client_s_own_final_message_to_continue_is_extended_not_doubled() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Dear"}]
    request = chat_request(messages=messages, continue_final_message=True, add_generation_prompt=False)
    follow_up = continuation(request, progress(" Sir", 1))
    assert follow_up is not None
    assert follow_up.body["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Dear Sir"},
    ]


def test_a_completion_continues_from_its_prompt_and_the_partial_text() -> None:
    request = dataclasses.replace(chat_request(), api=COMPLETIONS, body={"prompt": "1, 2,", "max_tokens": 20})
    follow_up = continuation(request, progress(" 3,", 2))
    assert follow_up is not None
    assert follow_up.body["prompt"] == "1, 2, 3,"
    assert follow_up.body["max_tokens"] == 18


def test_a_stream_broken_before_any_output_is_simply_sent_again() -> None:
    request = chat_request()
    follow_up = continuation(request, progress("", None))
    assert follow_up is not None
    assert follow_up.body == request.body


@pytest.mark.parametrize(
    ("request_", "seen"),
    [
        (chat_request(max_tokens=5), progress("abcde", 5)),  # nothing left to generate
        (chat_request(), progress("abc", None)),  # output sent, token count unknown
        (chat_request(), progress("abc", 3, continuable=False)),  # tool call, n > 1, ...
    ],
    ids=["all_tokens_sent", "count_unknown", "not_continuable"],
)
def test_what_cannot_be_continued_exactly_is_not(request_: InferenceRequest, seen: StreamProgress) -> None:
    assert continuation(request_, seen) is None


def test_only_engines_that_continue_a_final_message_are_asked_to() -> None:
    assert can_continue(chat_request(), BackendKind.VLLM)
    assert can_continue(chat_request(), BackendKind.SIM)
    assert not can_continue(chat_request(), BackendKind.OPENAI)
    assert not can_continue(chat_request(), BackendKind.LLAMACPP)
    assert not can_continue(chat_request(n=2), BackendKind.VLLM)
    echo = dataclasses.replace(chat_request(), api=COMPLETIONS, body={"prompt": "x", "echo": True})
    assert not can_continue(echo, BackendKind.VLLM)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with engines(2, names=["faulty", "healthy"]) as pair:
        yield pair


GENEROUS_BUDGET = {"max_retries": 2, "budget_min_per_s": 100}
"""Round robin sends nearly every request to the faulty engine first (each migration's pick moves
the cursor past it): a budget that cannot run out, so these tests see migration, not the budget."""


def faulty_first(
    fleet: Fleet, *, kind: str = "sim", between_chunks_s: float = 30.0, retry: dict[str, float] = GENEROUS_BUDGET
) -> str:
    """A policy where the faulty engine (the first, of ``kind``) takes the first attempt (round robin from it)."""
    return policy(
        fleet.engines,
        between_chunks_s=between_chunks_s,
        breaker={"consecutive_failures": None},
        retry=retry,
        models={MODEL: {"routing": {"strategy": "round_robin"}}},
        backends={fleet.engines[0].name: {"kind": kind}},
    )


def prompt_tokens(content: str) -> int:
    """The prompt tokens the simulator counts for one user message (what usage must report)."""
    messages = [{"role": "user", "content": content}]
    return len(tokenize(render_chat(messages, add_generation_prompt=True, continue_final_message=False)))


@contextmanager
def faulted(engine: Engine, mode: str, after_tokens: int) -> Iterator[None]:
    """``engine`` fails its streams after ``after_tokens`` tokens for the block's duration."""
    set_fault(engine, mode, after_tokens=after_tokens)
    try:
        yield
    finally:
        set_fault(engine, "none")


def faults(fleet: Fleet, engine: Engine) -> float:
    return fleet.metric(engine, "sim:faults_injected_total")


@pytest.mark.parametrize("mode", ["close_mid_stream", "stall"])
def test_a_chat_stream_broken_mid_way_reaches_the_client_whole(fleet: Fleet, mode: str) -> None:
    faulty, _ = fleet.engines
    with faulted(faulty, mode, after_tokens=5), gateway(faulty_first(fleet, between_chunks_s=0.5)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
        before = faults(fleet, faulty)
        for _ in range(4):  # round robin: some of them start on the faulty engine
            chunks = list(
                client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Tell me a story."}],
                    max_tokens=30,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            content = [c for c in chunks if c.choices and c.choices[0].delta.content]
            assert len(content) == 30
            assert len({c.id for c in chunks}) == 1, "the client must see one stream"
            assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
            usage = chunks[-1].usage
            assert usage is not None
            assert all(c.usage is None for c in chunks[:-1]), "per-chunk usage the client did not ask for"
            assert (usage.completion_tokens, usage.total_tokens - usage.prompt_tokens) == (30, 30)
            assert usage.prompt_tokens == prompt_tokens("Tell me a story.")
        broken = faults(fleet, faulty) - before
        assert broken >= 1
        assert gw.metric("gateway_stream_migrations_total", outcome="continued") == broken
        wait_until(lambda: gw.metric("gateway_backend_in_flight_requests") == 0, what="slots released")


def test_a_completions_stream_broken_mid_way_reaches_the_client_whole(fleet: Fleet) -> None:
    faulty, _ = fleet.engines
    with faulted(faulty, "close_mid_stream", after_tokens=3), gateway(faulty_first(fleet)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
        before = faults(fleet, faulty)
        for _ in range(3):
            chunks = list(
                client.completions.create(
                    model=MODEL,
                    prompt="Count: 1, 2,",
                    max_tokens=12,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 12
            usage = chunks[-1].usage
            assert usage is not None
            assert usage.completion_tokens == 12
        assert gw.metric("gateway_stream_migrations_total", outcome="continued") == faults(fleet, faulty) - before
        assert faults(fleet, faulty) > before


def test_a_migration_the_retry_budget_refuses_ends_the_stream_with_an_error_event(fleet: Fleet) -> None:
    faulty, _ = fleet.engines
    no_budget = {"max_retries": 2, "budget_ratio": 0, "budget_min_per_s": 0}
    with faulted(faulty, "close_mid_stream", after_tokens=5), gateway(faulty_first(fleet, retry=no_budget)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
        before = faults(fleet, faulty)
        while faults(fleet, faulty) == before:  # round robin: the first or the second lands there
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=30, stream=True
            )
            error = None
            try:
                for _ in stream:
                    pass
            except openai.APIError as exc:
                error = exc
        assert error is not None
        assert "dropped the connection" in error.message
        assert gw.metric("gateway_stream_migrations_total", outcome="budget_exhausted") == 1
        assert gw.metric("gateway_stream_migrations_total", outcome="continued") == 0


def test_a_backend_that_cannot_continue_ends_the_stream_with_an_error_event(fleet: Fleet) -> None:
    faulty, _ = fleet.engines
    with faulted(faulty, "close_mid_stream", after_tokens=5), gateway(faulty_first(fleet, kind="openai")) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
        before = faults(fleet, faulty)
        while faults(fleet, faulty) == before:  # round robin: the first or the second lands there
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=30, stream=True
            )
            received, error = 0, None
            try:
                for chunk in stream:
                    received += bool(chunk.choices and chunk.choices[0].delta.content)
            except openai.APIError as exc:
                error = exc
        assert error is not None
        assert "dropped the connection" in error.message
        assert received == 5
        assert gw.metric("gateway_stream_migrations_total", outcome="not_continuable") == 1
