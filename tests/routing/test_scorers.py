"""Each scorer's formula, as its docstring states it, and the framework's combination."""

from __future__ import annotations

import pytest

from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.framework import Cycle, Profile, Weighted
from gateway.routing.scorers.in_flight import InFlightScorer
from gateway.routing.scorers.kv_usage import KvUsageScorer
from gateway.routing.scorers.prefix_affinity import PrefixAffinityScorer
from gateway.routing.scorers.queue_depth import QueueDepthScorer
from gateway.types import PrefixKeys
from tests.routing.conftest import chat_request, states

NOW = 100.0


def cycle(matched: list[int], blocks: int = 10, request_tokens: int = 100) -> Cycle:
    keys = PrefixKeys(0, 16, tuple(range(blocks)))
    return Cycle(NOW, 3.0, keys, matched, request_tokens)


def test_prefix_affinity_is_the_matched_share_of_the_prompts_blocks(snapshot: PolicySnapshot) -> None:
    scores = PrefixAffinityScorer().score(chat_request(snapshot, "Hi"), states(snapshot), cycle([10, 5, 0]))
    assert scores == [1.0, 0.5, 0.0]


def test_prefix_affinity_is_zero_everywhere_for_a_prompt_shorter_than_a_block(snapshot: PolicySnapshot) -> None:
    scores = PrefixAffinityScorer().score(chat_request(snapshot, "Hi"), states(snapshot), cycle([0, 0, 0], blocks=0))
    assert scores == [0.0, 0.0, 0.0]


def test_in_flight_is_one_minus_tokens_over_the_busiest_plus_this_request(snapshot: PolicySnapshot) -> None:
    a, b, c = states(snapshot)
    a.in_flight_tokens, b.in_flight_tokens, c.in_flight_tokens = 0, 300, 900
    scores = InFlightScorer().score(chat_request(snapshot, "Hi"), [a, b, c], cycle([0, 0, 0], request_tokens=100))
    assert scores == pytest.approx([1.0, 1 - 300 / 1000, 1 - 900 / 1000])


def test_queue_depth_is_one_minus_waiting_over_the_longest_queue_plus_one(snapshot: PolicySnapshot) -> None:
    a, b, c = states(snapshot)
    for state, waiting in ((a, 0), (b, 1), (c, 3)):
        state.waiting, state.scraped_at = waiting, NOW
    scores = QueueDepthScorer().score(chat_request(snapshot, "Hi"), [a, b, c], cycle([0, 0, 0]))
    assert scores == pytest.approx([1.0, 0.75, 0.25])


def test_queue_depth_ignores_a_stale_scrape(snapshot: PolicySnapshot) -> None:
    a, b, c = states(snapshot)
    a.waiting, a.scraped_at = 50, NOW - 60
    scores = QueueDepthScorer().score(chat_request(snapshot, "Hi"), [a, b, c], cycle([0, 0, 0]))
    assert scores == [1.0, 1.0, 1.0]


def test_kv_usage_is_the_free_share_when_fresh_and_one_when_stale(snapshot: PolicySnapshot) -> None:
    a, b, c = states(snapshot)
    a.kv_usage, a.scraped_at = 0.25, NOW
    b.kv_usage, b.scraped_at = 0.9, NOW - 60
    scores = KvUsageScorer().score(chat_request(snapshot, "Hi"), [a, b, c], cycle([0, 0, 0]))
    assert scores == pytest.approx([0.75, 1.0, 1.0])


class _Fixed:
    def __init__(self, name: str, scores: list[float]) -> None:
        self.name = name
        self._scores = scores

    def score(self, request: object, candidates: object, cycle: object) -> list[float]:
        return self._scores


def test_the_profile_clamps_weighs_and_normalises_scores(snapshot: PolicySnapshot) -> None:
    profile = Profile([Weighted(_Fixed("x", [2.0, -1.0, 0.5]), 3), Weighted(_Fixed("y", [0, 1, 1]), 1)])
    scored = profile.run(chat_request(snapshot, "Hi"), states(snapshot), cycle([0, 0, 0]))
    assert scored.by_scorer["x"] == [1.0, 0.0, 0.5]
    assert scored.totals == pytest.approx([0.75, 0.25, 0.625])


def test_a_profile_without_a_positive_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one scorer"):
        Profile([Weighted(_Fixed("x", []), 0)])


def test_the_profile_counts_a_score_that_is_not_a_number_as_zero(snapshot: PolicySnapshot) -> None:
    nan, inf = float("nan"), float("inf")
    profile = Profile([Weighted(_Fixed("x", [nan, inf, -inf]), 1)])
    scored = profile.run(chat_request(snapshot, "Hi"), states(snapshot), cycle([0, 0, 0]))
    assert scored.by_scorer["x"] == [0.0, 1.0, 0.0]
    assert scored.totals == [0.0, 1.0, 0.0]
