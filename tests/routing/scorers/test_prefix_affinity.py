"""The prefix-affinity scorer's formula (``gateway/routing/scorers/prefix_affinity.py``), as its docstring states it.
What every scorer must honour is in ``tests/routing/test_framework.py``.
"""

from __future__ import annotations

from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.scorers.prefix_affinity import PrefixAffinityScorer
from tests.routing.conftest import chat_request, scoring_cycle, states


def test_prefix_affinity_is_the_matched_share_of_the_prompts_blocks(snapshot: PolicySnapshot) -> None:
    scores = PrefixAffinityScorer().score(chat_request(snapshot, "Hi"), states(snapshot), scoring_cycle([10, 5, 0]))
    assert scores == [1.0, 0.5, 0.0]


def test_prefix_affinity_is_zero_everywhere_for_a_prompt_shorter_than_a_block(snapshot: PolicySnapshot) -> None:
    scores = PrefixAffinityScorer().score(
        chat_request(snapshot, "Hi"), states(snapshot), scoring_cycle([0, 0, 0], blocks=0)
    )
    assert scores == [0.0, 0.0, 0.0]
