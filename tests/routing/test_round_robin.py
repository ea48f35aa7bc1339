"""What the round-robin router chooses (``gateway/routing/round_robin.py``). The contract every
strategy shares is in ``tests/dispatch/test_router.py``.
"""

from __future__ import annotations

from tests.routing.conftest import dispatch, router_for, states, strategy


def test_round_robin_cycles_through_the_candidates() -> None:
    snapshot = strategy("round_robin")
    router, candidates = router_for(snapshot), states(snapshot)
    names = [dispatch(router, snapshot, "acme", candidates, "Hi") for _ in range(6)]
    assert names == ["b0", "b1", "b2", "b0", "b1", "b2"]
