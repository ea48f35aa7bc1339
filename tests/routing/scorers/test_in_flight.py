"""The in-flight scorer's formula (``gateway/routing/scorers/in_flight.py``), as its docstring states it.
What every scorer must honour is in ``tests/routing/test_framework.py``.
"""

from __future__ import annotations

import pytest

from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.scorers.in_flight import InFlightScorer
from tests.routing.conftest import chat_request, scoring_cycle, states


def test_in_flight_is_one_minus_tokens_over_the_busiest_plus_this_request(snapshot: PolicySnapshot) -> None:
    a, b, c = states(snapshot)
    a.in_flight_tokens, b.in_flight_tokens, c.in_flight_tokens = 0, 300, 900
    scores = InFlightScorer().score(
        chat_request(snapshot, "Hi"), [a, b, c], scoring_cycle([0, 0, 0], request_tokens=100)
    )
    assert scores == pytest.approx([1.0, 1 - 300 / 1000, 1 - 900 / 1000])
