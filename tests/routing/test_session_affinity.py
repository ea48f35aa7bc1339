"""What the session-affinity router chooses (``gateway/routing/session_affinity.py``). The contract
every strategy shares is in ``tests/dispatch/test_router.py``.
"""

from __future__ import annotations

from gateway.dispatch.backends import BackendState
from gateway.dispatch.router import Router
from gateway.policy.snapshot import PolicySnapshot
from tests.routing.conftest import chat_request, load, router_for, states, strategy, tenant


def session_pick(router: Router, snapshot: PolicySnapshot, candidates: list[BackendState], session: str) -> str:
    request = chat_request(snapshot, "Hi")
    request.session_id = session
    return router.pick(request, tenant(snapshot, "acme"), candidates).state.name


def test_session_affinity_keeps_a_session_on_one_backend_and_spreads_sessions() -> None:
    snapshot = strategy("session_affinity")
    router, candidates = router_for(snapshot), states(snapshot)
    homes = {s: session_pick(router, snapshot, candidates, s) for s in (f"session-{i}" for i in range(30))}
    assert all(session_pick(router, snapshot, candidates, s) == home for s, home in homes.items())
    assert len(set(homes.values())) == 3


def test_session_affinity_moves_only_the_sessions_of_a_backend_that_leaves() -> None:
    snapshot = strategy("session_affinity")
    router, candidates = router_for(snapshot), states(snapshot)
    homes = {s: session_pick(router, snapshot, candidates, s) for s in (f"session-{i}" for i in range(30))}
    remaining = [c for c in candidates if c.name != "b0"]
    for session, home in homes.items():
        if home != "b0":
            assert session_pick(router, snapshot, remaining, session) == home


def test_session_affinity_reads_the_user_field_without_a_header() -> None:
    snapshot = strategy("session_affinity")
    router, candidates = router_for(snapshot), states(snapshot)
    decision = router.pick(chat_request(snapshot, "Hi", user="u-17"), tenant(snapshot, "acme"), candidates)
    assert decision.reason == "session_hash"
    assert router.pick(chat_request(snapshot, "Hi"), tenant(snapshot, "acme"), candidates).reason == "no_session"


def test_session_affinity_spills_past_the_load_bound() -> None:
    snapshot = strategy("session_affinity", epsilon=0.0)
    router, candidates = router_for(snapshot), states(snapshot)
    home = session_pick(router, snapshot, candidates, "s")
    load(next(s for s in candidates if s.name == home), 3)
    assert session_pick(router, snapshot, candidates, "s") != home
