"""What each strategy chooses, and the load bound's arithmetic. The contract every strategy
shares (purity, forgetting, isolation, the bound) is in ``test_router_conformance.py``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gateway.clock import Clock
from gateway.dispatch.backends import BackendState
from gateway.dispatch.router import Router
from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.framework import load_bound
from gateway.routing.prefix_affinity import PrefixAffinityRouter
from gateway.routing.registry import RouterSpec, build_router, build_routers
from gateway.service import parse_policy
from tests.fake_clock import FakeClock
from tests.routing.conftest import MODEL, SECRET, chat_request, load, routing_policy, states, tenant


def router_for(snapshot: PolicySnapshot, clock: Clock | None = None) -> Router:
    return build_routers(snapshot, clock or FakeClock(), SECRET)[MODEL]


def strategy(name: str, epsilon: float = 0.25) -> PolicySnapshot:
    routing = {"strategy": name, "block_tokens": 16, "epsilon": epsilon}
    return parse_policy(routing_policy(models={MODEL: {"routing": routing}}), "t")


def dispatch(router: Router, snapshot: PolicySnapshot, who: str, candidates: list[BackendState], *turns: str) -> str:
    request = chat_request(snapshot, *turns)
    decision = router.pick(request, tenant(snapshot, who), candidates)
    router.on_dispatch(request, tenant(snapshot, who), decision)
    return decision.state.name


@pytest.mark.parametrize(
    ("loads", "epsilon", "bound"),
    [
        pytest.param([0, 0, 0], 0.25, 1, id="an idle pool allows one request each"),
        pytest.param([10, 10, 10], 0.25, 13, id="a balanced pool allows a quarter above the average"),
        pytest.param([30, 0, 0], 0.0, 11, id="epsilon zero allows the rounded-up average"),
    ],
)
def test_the_load_bound_is_ceil_one_plus_epsilon_times_the_average_after_this_request(
    snapshot: PolicySnapshot, loads: list[int], epsilon: float, bound: int
) -> None:
    candidates = [load(s, n) for s, n in zip(states(snapshot), loads, strict=True)]
    assert load_bound(candidates, epsilon) == bound


def test_prefix_affinity_returns_a_conversation_to_the_backend_that_served_it() -> None:
    snapshot = strategy("prefix_affinity")
    router, candidates = router_for(snapshot), states(snapshot)
    first = dispatch(router, snapshot, "acme", candidates, "What is up?")
    for turn in range(5):
        assert dispatch(router, snapshot, "acme", candidates, "What is up?", "Fine.", f"Turn {turn}?") == first


def test_prefix_affinity_never_matches_another_tenants_blocks() -> None:
    snapshot = strategy("prefix_affinity")
    router, candidates = router_for(snapshot), states(snapshot)
    dispatch(router, snapshot, "acme", candidates, "Hello")
    decision = router.pick(chat_request(snapshot, "Hello"), tenant(snapshot, "globex"), candidates)
    assert decision.matched_blocks == 0
    assert decision.reason == "no_prefix"


def test_prefix_affinity_shares_a_declared_scope() -> None:
    snapshot = strategy("prefix_affinity")
    router, candidates = router_for(snapshot), states(snapshot)
    first = dispatch(router, snapshot, "shared-a", candidates, "Hello")
    decision = router.pick(chat_request(snapshot, "Hello"), tenant(snapshot, "shared-b"), candidates)
    assert decision.state.name == first
    assert decision.reason == "prefix_match"
    assert decision.matched_blocks > 0


def test_prefix_affinity_spills_a_hot_prefix_past_the_load_bound() -> None:
    snapshot = strategy("prefix_affinity", epsilon=0.25)
    router, candidates = router_for(snapshot), states(snapshot)
    by_name = {s.name: s for s in candidates}
    for _ in range(24):  # every request stays in flight: the home backend fills up to the bound
        request = chat_request(snapshot, "Hot question")
        bound = load_bound(candidates, 0.25)
        decision = router.pick(request, tenant(snapshot, "acme"), candidates)
        router.on_dispatch(request, tenant(snapshot, "acme"), decision)
        decision.state.reserve(0, 100)
        assert decision.state.in_flight <= bound
    assert all(s.in_flight > 0 for s in by_name.values())
    assert max(s.in_flight for s in candidates) <= 1.25 * 24 / 3 + 1


def test_prefix_affinity_reports_a_spill_as_load_bound() -> None:
    snapshot = strategy("prefix_affinity", epsilon=0.0)
    router, candidates = router_for(snapshot), states(snapshot)
    home = dispatch(router, snapshot, "acme", candidates, "Hot question")
    load(next(s for s in candidates if s.name == home), 5)
    decision = router.pick(chat_request(snapshot, "Hot question"), tenant(snapshot, "acme"), candidates)
    assert decision.state.name != home
    assert decision.reason == "load_bound"


def test_the_load_weighed_is_the_fleets_the_other_processes_requests_included() -> None:
    """Each replica holds a small part of the load: the bound and the scores read the fleet's
    (``BackendState.fleet_in_flight``, the others' from the last sync), as one process would."""
    snapshot = strategy("prefix_affinity", epsilon=0.0)
    router, candidates = router_for(snapshot), states(snapshot)
    home = dispatch(router, snapshot, "acme", candidates, "Hot question")
    busy = next(s for s in candidates if s.name == home)
    busy.others_in_flight, busy.others_in_flight_tokens = 5, 500  # nothing of this process's own
    assert load_bound(candidates, 0.0) == 2
    decision = router.pick(chat_request(snapshot, "Hot question"), tenant(snapshot, "acme"), candidates)
    assert decision.state.name != home
    assert decision.reason == "load_bound"
    busy.others_in_flight, busy.others_in_flight_tokens = 0, 0
    decision = router.pick(chat_request(snapshot, "Hot question"), tenant(snapshot, "acme"), candidates)
    assert (decision.state.name, decision.reason) == (home, "prefix_match")


def test_prefix_affinity_spreads_first_requests_of_tenants_over_an_idle_pool() -> None:
    snapshot = strategy("prefix_affinity")
    router, candidates = router_for(snapshot), states(snapshot)
    homes = {router.pick(chat_request(snapshot, "Hi"), t, candidates).state.name for t in snapshot.policy.tenants}
    assert len(homes) > 1


def test_prefix_affinity_forgets_a_backend() -> None:
    snapshot = strategy("prefix_affinity")
    router, candidates = router_for(snapshot), states(snapshot)
    home = dispatch(router, snapshot, "acme", candidates, "Hello")
    router.forget_backend(home)
    assert router.pick(chat_request(snapshot, "Hello"), tenant(snapshot, "acme"), candidates).matched_blocks == 0


def test_prefix_affinity_sizes_each_index_from_the_backends_kv_capacity() -> None:
    snapshot = strategy("prefix_affinity")
    router = router_for(snapshot)
    assert isinstance(router, PrefixAffinityRouter)
    assert router.index_blocks(states(snapshot)[0]) == 6400 // 16


def test_round_robin_cycles_through_the_candidates() -> None:
    snapshot = strategy("round_robin")
    router, candidates = router_for(snapshot), states(snapshot)
    names = [dispatch(router, snapshot, "acme", candidates, "Hi") for _ in range(6)]
    assert names == ["b0", "b1", "b2", "b0", "b1", "b2"]


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


def test_the_registry_builds_the_policys_strategy_per_model() -> None:
    snapshot = strategy("round_robin")
    spec = RouterSpec(MODEL, snapshot.models[MODEL].routing, FakeClock(), SECRET)
    assert build_router(spec).strategy == "round_robin"  # type: ignore[attr-defined]
    assert build_routers(parse_policy(routing_policy(), "t"), FakeClock(), SECRET)[MODEL].strategy == "prefix_affinity"  # type: ignore[attr-defined]


ForgetSpy = Callable[[str], None]


async def test_the_pool_tells_routers_to_forget_a_backend_that_goes_down() -> None:
    import httpx

    from gateway.dispatch.backends import BackendPool

    forgotten: list[str] = []
    snapshot = strategy("prefix_affinity")
    pool = BackendPool(snapshot, on_forget=forgotten.append)
    async with httpx.AsyncClient() as client:
        await pool.check_all(client, timeout_s=0.5)  # nothing listens on ports 1-3
    assert sorted(forgotten) == ["b0", "b1", "b2"]
    pool.adopt(parse_policy(routing_policy(backend_count=2), "t"))
    assert "b2" in forgotten[3:]


def test_a_reload_keeps_the_router_of_a_model_whose_routing_did_not_change() -> None:
    from gateway.routing.registry import update_routers

    old = strategy("prefix_affinity")
    routers = build_routers(old, FakeClock(), SECRET)
    routing = {"strategy": "prefix_affinity", "block_tokens": 16, "epsilon": 0.25}
    new = parse_policy(routing_policy(version="t2", models={MODEL: {"routing": routing}}), "t")  # another text
    same = update_routers(routers, old, new, FakeClock(), SECRET)
    changed = update_routers(routers, old, strategy("round_robin"), FakeClock(), SECRET)
    assert same[MODEL] is routers[MODEL]
    assert changed[MODEL].strategy == "round_robin"  # type: ignore[attr-defined]
