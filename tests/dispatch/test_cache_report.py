"""An answer's cache figures: the engine's own count against the router's prediction, in its tokens."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.dispatch.backends import BackendState
from gateway.dispatch.cache_report import MISS_SLACK_BLOCKS, cache_report, reported_cached_tokens
from gateway.dispatch.router import RouteDetail, RoutingDecision
from gateway.policy.model import Backend


def decision(matched: int, prompt_blocks: int, state: BackendState | None = None) -> RoutingDecision:
    state = state or BackendState(
        Backend.model_validate({"name": "b", "url": "http://b", "models": ["m"], "kind": "vllm"})
    )
    detail = RouteDetail((state.name,), (matched,), prompt_blocks, {}, (1.0,), 0)
    return RoutingDecision(state, "prefix_affinity", "prefix_match", matched, {}, 0.0, detail, matched_at=1.0)


def usage(prompt: int, cached: int | None) -> dict[str, Any]:
    details = None if cached is None else {"cached_tokens": cached}
    return {"prompt_tokens": prompt, "completion_tokens": 2, "prompt_tokens_details": details}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, None),
        ({}, None),
        ({"prompt_tokens": 3}, None),
        ({"prompt_tokens_details": None}, None),
        ({"prompt_tokens_details": {"cached_tokens": 32}}, 32),
        ({"prompt_tokens_details": {"cached_tokens": -1}}, None),
        ({"prompt_tokens_details": {"cached_tokens": "32"}}, None),
    ],
)
def test_the_engine_s_figure_is_read_only_where_it_says_one(given: dict[str, Any] | None, expected: int | None) -> None:
    assert reported_cached_tokens(given) == expected


def test_the_prediction_is_the_matched_share_of_the_engine_s_prompt() -> None:
    report = cache_report(decision(matched=6, prompt_blocks=10), usage(200, 112))
    assert report is not None
    assert (report.predicted_tokens, report.cached_tokens, report.prompt_tokens) == (120, 112, 200)
    assert (report.confirmed_tokens, report.computed_tokens) == (112, 88)
    assert not report.missed, "a block short is the engine's rounding, not an eviction"


def test_holding_more_than_the_slack_fewer_blocks_is_a_miss() -> None:
    matched, blocks, prompt = 8, 10, 200
    short = (matched - MISS_SLACK_BLOCKS) * prompt // blocks  # exactly at the slack: not a miss
    at_slack = cache_report(decision(matched, blocks), usage(prompt, short))
    under = cache_report(decision(matched, blocks), usage(prompt, short - 1))
    assert at_slack is not None
    assert under is not None
    assert not at_slack.missed
    assert under.missed


def test_a_backend_that_never_said_is_unknown_and_one_that_did_means_zero_by_its_silence() -> None:
    state = BackendState(Backend.model_validate({"name": "b", "url": "http://b", "models": ["m"], "kind": "vllm"}))
    assert cache_report(decision(4, 10, state), usage(200, None)) is None, "vLLM without the flag says nothing"
    assert not state.reports_cached
    assert cache_report(decision(4, 10, state), usage(200, 64)) is not None
    assert state.reports_cached
    silent = cache_report(decision(4, 10, state), usage(200, None))
    assert silent is not None, "vLLM leaves the field out when it reused nothing"
    assert (silent.cached_tokens, silent.missed) == (0, True)


def test_no_prediction_is_never_a_miss_and_the_engine_s_count_is_capped_by_the_prompt() -> None:
    report = cache_report(decision(matched=0, prompt_blocks=10), usage(100, 500))
    assert report is not None
    assert (report.predicted_tokens, report.cached_tokens, report.missed) == (0, 100, False)
    assert cache_report(decision(3, 10), {"completion_tokens": 1}) is None, "no prompt count: nothing to compare"
