"""Prefix affinity across a fleet: the continuation slack of the bounded-load rule.

A replica weighs the fleet's load, the other processes' part as of their last report. A
conversation's next turn is sent once the previous turn's answer is read, so when another
process served that turn its figure may still count it: the engine holding the conversation
looks one request busier than it is. At low load that ghost alone used to exclude the holder
(the bound is 2 at ``L`` of 1 or 2), and on an engine that keeps only its slots' prompts the
whole history was computed again elsewhere (issue 28).
"""

from __future__ import annotations

from gateway.dispatch.backends import BackendState
from gateway.routing.framework import load_bound
from gateway.routing.prefix_affinity import continuation_slack
from tests.routing.conftest import chat_request, load, states, tenant
from tests.routing.test_strategies import dispatch, router_for, strategy


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
