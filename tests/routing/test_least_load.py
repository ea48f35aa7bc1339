"""What the least-load router chooses (``gateway/routing/least_load.py``). The contract every
strategy shares is in ``tests/dispatch/test_router.py``.
"""

from __future__ import annotations

from tests.routing.conftest import chat_request, dispatch, load, router_for, states, strategy, tenant


def test_least_load_picks_the_fewest_requests_in_flight() -> None:
    snapshot = strategy("least_load")
    router, (a, b, c) = router_for(snapshot), states(snapshot)
    load(a, 2)
    load(c, 1)
    assert router.pick(chat_request(snapshot, "Hi"), tenant(snapshot, "acme"), [a, b, c]).state is b


def test_least_load_rotates_ties_as_dispatches_happen() -> None:
    snapshot = strategy("least_load")
    router, candidates = router_for(snapshot), states(snapshot)
    assert [dispatch(router, snapshot, "acme", candidates, "Hi") for _ in range(3)] == ["b0", "b1", "b2"]
