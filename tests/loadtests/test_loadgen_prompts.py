"""Request bodies: lengths in words, shared prefixes per tenant, multi-turn prefix extension."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from loadtests.loadgen.prompts import RequestFactory, sample_length
from loadtests.loadgen.workload import LogNormal, Normal, Uniform, parse_workload
from tests.loadtests.test_loadgen_workload import VALID


def _workload(**changes: Any) -> Any:
    return parse_workload({**VALID, **changes}, source="x")


def _messages(factory: RequestFactory, index: int) -> list[dict[str, str]]:
    body = orjson.loads(factory.plan(index).body)
    messages: list[dict[str, str]] = body["messages"]
    return messages


def test_the_body_asks_for_exact_lengths_and_usage() -> None:
    factory = RequestFactory(_workload(), seed=0, run_id="r")
    planned = factory.plan(0)
    body = orjson.loads(planned.body)
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    assert 1 <= body["max_tokens"] <= 5
    assert len(body["messages"][-1]["content"].split()) == 10  # one word is one token


def test_headers_carry_key_priority_deadline_and_request_id() -> None:
    data = {**VALID, "classes": {"only": {**VALID["classes"]["batch"], "share": 1, "deadline_s": 2}}}
    factory = RequestFactory(parse_workload(data, source="x"), seed=0, run_id="r", time_scale=10)
    headers = factory.plan(3).headers
    assert headers["authorization"] == "Bearer k"
    assert headers["x-priority"] == "batch"
    assert headers["x-request-timeout"] == "20"  # the deadline scales with the simulator
    assert headers["x-request-id"] == "r-0000003"


def test_tenants_share_their_own_system_prompt_and_not_another_tenants() -> None:
    tenants = {"a": {"share": 0.5, "api_key": "ka"}, "b": {"share": 0.5, "api_key": "kb"}}
    factory = RequestFactory(_workload(tenants=tenants, prefix={"system_prompt_tokens": 50}), seed=0, run_id="r")
    systems: dict[str, set[str]] = {"a": set(), "b": set()}
    for i in range(40):
        planned = factory.plan(i)
        system = orjson.loads(planned.body)["messages"][0]
        assert system["role"] == "system"
        assert len(system["content"].split()) == 50
        systems[planned.tenant].add(system["content"])
    assert len(systems["a"]) == len(systems["b"]) == 1
    assert systems["a"] != systems["b"]


def test_a_conversations_next_turn_extends_the_previous_request_with_the_reply() -> None:
    workload = _workload(
        conversation={"turns": {"dist": "fixed", "value": 3}, "active_per_tenant": 1},
        classes={"c": {**VALID["classes"]["batch"], "share": 1}},
        prefix={"system_prompt_tokens": 8},
    )
    factory = RequestFactory(workload, seed=0, run_id="r")
    turns = [_messages(factory, i) for i in range(4)]
    first, second, third, fresh = turns
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert second[: len(first)] == first  # the previous request is a prefix of the next
    assert third[: len(second)] == second
    assert second[len(first)]["role"] == "assistant"
    # After three turns the conversation ends and a new one starts from the system prompt.
    assert [m["role"] for m in fresh] == ["system", "user"]


def test_few_shot_templates_are_shared_within_a_tenant() -> None:
    workload = _workload(
        fewshot={"templates_per_tenant": 2, "examples": 3, "example_tokens": {"dist": "fixed", "value": 10}}
    )
    factory = RequestFactory(workload, seed=0, run_id="r")
    templates = {orjson.dumps(_messages(factory, i)[:-1]) for i in range(30)}
    assert len(templates) == 2
    assert all(len(orjson.loads(t)) == 6 for t in templates)


def test_completions_api_sends_a_prompt() -> None:
    factory = RequestFactory(_workload(api="completions", stream=False), seed=0, run_id="r")
    body = orjson.loads(factory.plan(0).body)
    assert factory.path == "/v1/completions"
    assert "stream_options" not in body
    assert len(body["prompt"].split()) == 10


@pytest.mark.parametrize(
    ("length", "mean"),
    [
        (Uniform(dist="uniform", min=10, max=20), 15),
        (Normal(dist="normal", mean=100, std=10), 100),
        (LogNormal(dist="lognormal", mean=200, sigma=0.8), 200),
    ],
    ids=["uniform is centred", "normal has its mean", "lognormal has its arithmetic mean"],
)
def test_length_distributions_have_their_mean(length: Any, mean: float) -> None:
    rng = random.Random(5)
    samples = [sample_length(length, rng) for _ in range(20_000)]
    assert sum(samples) / len(samples) == pytest.approx(mean, rel=0.03)


def test_lengths_are_clipped_to_their_bounds() -> None:
    rng = random.Random(0)
    samples = [sample_length(Normal(dist="normal", mean=5, std=50, min=2, max=9), rng) for _ in range(1000)]
    assert min(samples) == 2
    assert max(samples) == 9
