"""The queue-depth scorer's formula (``gateway/routing/scorers/queue_depth.py``), as its docstring states it.
What every scorer must honour is in ``tests/routing/test_framework.py``.
"""

from __future__ import annotations

import pytest

from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.scorers.queue_depth import QueueDepthScorer
from tests.routing.conftest import SCORED_AT, chat_request, scoring_cycle, states


def test_queue_depth_is_one_minus_waiting_over_the_longest_queue_plus_one(snapshot: PolicySnapshot) -> None:
    a, b, c = states(snapshot)
    for state, waiting in ((a, 0), (b, 1), (c, 3)):
        state.waiting, state.scraped_at = waiting, SCORED_AT
    scores = QueueDepthScorer().score(chat_request(snapshot, "Hi"), [a, b, c], scoring_cycle([0, 0, 0]))
    assert scores == pytest.approx([1.0, 0.75, 0.25])


def test_queue_depth_ignores_a_stale_scrape(snapshot: PolicySnapshot) -> None:
    a, b, c = states(snapshot)
    a.waiting, a.scraped_at = 50, SCORED_AT - 60
    scores = QueueDepthScorer().score(chat_request(snapshot, "Hi"), [a, b, c], scoring_cycle([0, 0, 0]))
    assert scores == [1.0, 1.0, 1.0]
