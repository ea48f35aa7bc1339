"""The KV-usage scorer's formula (``gateway/routing/scorers/kv_usage.py``), as its docstring states it.
What every scorer must honour is in ``tests/routing/test_framework.py``.
"""

from __future__ import annotations

import pytest

from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.scorers.kv_usage import KvUsageScorer
from tests.routing.conftest import SCORED_AT, chat_request, scoring_cycle, states


def test_kv_usage_is_the_free_share_when_fresh_and_one_when_stale(snapshot: PolicySnapshot) -> None:
    a, b, c = states(snapshot)
    a.kv_usage, a.scraped_at = 0.25, SCORED_AT
    b.kv_usage, b.scraped_at = 0.9, SCORED_AT - 60
    scores = KvUsageScorer().score(chat_request(snapshot, "Hi"), [a, b, c], scoring_cycle([0, 0, 0]))
    assert scores == pytest.approx([0.75, 1.0, 1.0])
