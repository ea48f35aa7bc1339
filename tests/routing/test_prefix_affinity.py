"""What the prefix-affinity router chooses (``gateway/routing/prefix_affinity.py``), and the
continuation slack of its bounded-load rule across a fleet. The contract every strategy shares
(purity, forgetting, isolation, the bound) is in ``tests/dispatch/test_router.py``.

Across a fleet, a replica weighs the fleet's load, the other processes' part as of their last
report. A conversation's next turn is sent once the previous turn's answer is read, so when
another process served that turn its figure may still count it: the engine holding the
conversation looks one request busier than it is. At low load that ghost alone used to exclude
the holder (the bound is 2 at ``L`` of 1 or 2), and on an engine that keeps only its slots'
prompts the whole history was computed again elsewhere (issue 28).
"""

from __future__ import annotations

from gateway.dispatch.backends import BackendState
from gateway.routing.framework import load_bound
from gateway.routing.prefix_affinity import PrefixAffinityRouter, continuation_slack
from tests.routing.conftest import chat_request, dispatch, load, router_for, states, strategy, tenant


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


# Across a fleet: the continuation slack of the bounded-load rule


def _home(candidates: list[BackendState], name: str) -> BackendState:
    return next(s for s in candidates if s.name == name)


def test_a_next_turn_stays_with_its_history_when_another_process_still_counts_the_last_turn() -> None:
    snapshot = strategy("prefix_affinity", epsilon=0.25)
    router = router_for(snapshot)
    candidates = states(snapshot)
    home = _home(candidates, dispatch(router, snapshot, "acme", candidates, "First question"))
    load(home, 1)  # another conversation's request, this process's own
    home.others_in_flight, home.others_in_flight_tokens = 1, 100  # the answered first turn, not yet reported gone
    assert load_bound(candidates, 0.25) == 2  # the holder would hold 3 by the figures
    request = chat_request(snapshot, "First question", "An answer", "Second question")
    decision = router.pick(request, tenant(snapshot, "acme"), candidates)
    assert (decision.state.name, decision.reason) == (home.name, "prefix_match")


def test_one_process_alone_keeps_the_bound_as_it_was() -> None:
    snapshot = strategy("prefix_affinity", epsilon=0.25)
    router = router_for(snapshot)
    candidates = states(snapshot)
    home = _home(candidates, dispatch(router, snapshot, "acme", candidates, "First question"))
    load(home, 2)  # exact figures: two requests of this process
    request = chat_request(snapshot, "First question", "An answer", "Second question")
    decision = router.pick(request, tenant(snapshot, "acme"), candidates)
    assert decision.state.name != home.name
    assert decision.reason == "load_bound"


def test_the_slack_is_one_request_and_only_the_longest_match_gets_it() -> None:
    snapshot = strategy("prefix_affinity", epsilon=0.25)
    router = router_for(snapshot)
    candidates = states(snapshot)
    home = _home(candidates, dispatch(router, snapshot, "acme", candidates, "First question"))
    load(home, 1)
    home.others_in_flight, home.others_in_flight_tokens = 2, 200
    request = chat_request(snapshot, "First question", "An answer", "Second question")
    decision = router.pick(request, tenant(snapshot, "acme"), candidates)
    assert decision.state.name != home.name
    assert decision.reason == "load_bound"
    for state in candidates:
        state.others_in_flight = 1
    matched = [3 if s is home else 1 for s in candidates]  # the others hold the system prompt only
    assert [continuation_slack(s, matched, i) for i, s in enumerate(candidates)] == [
        1 if s is home else 0 for s in candidates
    ]
    assert [continuation_slack(s, [0] * len(candidates), i) for i, s in enumerate(candidates)] == [0] * len(
        candidates
    ), "no match anywhere: no slack"
