"""Conformance suite of the ``Router`` protocol (``gateway/dispatch/router.py``), run over every
strategy of ``registry.STRATEGIES``: a strategy registered later is checked here without an edit.

Each test states one clause of the protocol's docstring. Routers are built by the registry from
a parsed policy; candidates are the real ``BackendState``s of its pool. Learning clauses compare
two worlds that differ in one thing only (what a tenant sent, what was forgotten): a router
honours the clause when the difference does not reach the decision it is not allowed to reach.
What each strategy chooses is in ``tests/routing/test_<strategy>.py``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest

from gateway.dispatch.backends import BackendState
from gateway.dispatch.router import Router, RoutingDecision
from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.base import LoadBounded
from gateway.routing.framework import load_bound
from gateway.routing.registry import STRATEGIES, build_routers
from gateway.service import parse_policy
from gateway.types import InferenceRequest
from tests.fake_clock import FakeClock
from tests.routing.conftest import MODEL, SECRET, chat_request, counters, load, routing_policy, states, tenant

NAN, INF = math.nan, math.inf
REASON = re.compile(r"[a-z]+(_[a-z]+)*")


def snapshot_for(strategy: str, epsilon: float = 0.25) -> PolicySnapshot:
    routing = {"strategy": strategy, "block_tokens": 16, "epsilon": epsilon}
    return parse_policy(routing_policy(models={MODEL: {"routing": routing}}), "t.yaml")


def router_for(snapshot: PolicySnapshot) -> Router:
    return build_routers(snapshot, FakeClock(), SECRET)[MODEL]


BOUNDED = sorted(name for name in STRATEGIES if isinstance(router_for(snapshot_for(name)), LoadBounded))


@dataclass
class World:
    """One strategy's router over the pool of a parsed policy."""

    strategy: str
    epsilon: float = 0.25

    def __post_init__(self) -> None:
        self.snapshot = snapshot_for(self.strategy, self.epsilon)
        self.router = router_for(self.snapshot)
        self.candidates = states(self.snapshot)

    def twin(self) -> Router:
        """Another router of the same strategy, to run over the same candidates."""
        return router_for(self.snapshot)

    def ask(self, topic: str, session: str | None = None) -> InferenceRequest:
        """A new chat request about ``topic``: its own system prompt (many blocks), a question, and
        a session (``topic`` unless given) for the session-affine strategies."""
        system = f"You answer questions about {topic}. " * 30
        request = chat_request(self.snapshot, f"Tell me about {topic}.", system=system)
        request.session_id = session or topic
        return request

    def pick(
        self, who: str, request: InferenceRequest, router: Router | None = None, among: Sequence[BackendState] = ()
    ) -> RoutingDecision:
        return (router or self.router).pick(request, tenant(self.snapshot, who), among or self.candidates)

    def dispatch(
        self, who: str, request: InferenceRequest, router: Router | None = None, among: Sequence[BackendState] = ()
    ) -> RoutingDecision:
        decision = self.pick(who, request, router, among)
        (router or self.router).on_dispatch(request, tenant(self.snapshot, who), decision)
        return decision

    def teach(self, router: Router | None = None) -> None:
        """A little history: three tenants, a few topics each, every decision dispatched."""
        for who, topic in itertools.product(("acme", "globex", "shared-a"), ("billing", "returns", "shipping")):
            self.dispatch(who, self.ask(topic), router)


def decided(decision: RoutingDecision) -> RoutingDecision:
    """The decision without its timing, to compare two decisions."""
    return replace(decision, pick_s=0.0)


@pytest.fixture(params=sorted(STRATEGIES))
def strategy(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@dataclass(frozen=True, slots=True)
class Load:
    requests: int = 0
    waiting: float = 0.0
    kv: float = 0.0


LOADS = [
    pytest.param((Load(), Load(), Load()), id="an idle pool"),
    pytest.param((Load(6, 3, 0.8), Load(2, 1, 0.3), Load()), id="a skewed pool"),
    pytest.param((Load(1, NAN, NAN), Load(0, INF, INF), Load(2, -INF, 1.5)), id="metrics that are not numbers"),
]


def loaded(world: World, loads: tuple[Load, ...]) -> None:
    for state, each in zip(world.candidates, loads, strict=True):
        load(state, each.requests)
        state.waiting, state.kv_usage, state.scraped_at = each.waiting, each.kv, 1000.0


@pytest.mark.parametrize("loads", LOADS)
def test_a_pick_returns_one_of_the_candidates_offered(strategy: str, loads: tuple[Load, ...]) -> None:
    world = World(strategy)
    loaded(world, loads)
    world.teach()
    subsets = [c for n in (1, 2, 3) for c in itertools.combinations(world.candidates, n)]
    for among, who, topic in itertools.product(subsets, ("acme", "globex", "shared-b"), ("billing", "weather")):
        decision = world.dispatch(who, world.ask(topic), among=among)
        assert any(decision.state is c for c in among), (decision.state, among)


@pytest.mark.parametrize("loads", LOADS)
def test_a_decision_names_its_strategy_a_reason_code_and_the_pick_time(strategy: str, loads: tuple[Load, ...]) -> None:
    world = World(strategy)
    loaded(world, loads)
    decisions = [world.dispatch(who, world.ask(topic)) for who in ("acme", "globex") for topic in ("a", "b", "a")]
    decisions.append(world.pick("acme", world.ask("a"), among=world.candidates[:1]))
    for decision in decisions:
        assert decision.strategy == strategy
        assert REASON.fullmatch(decision.reason), decision.reason
        assert 0.0 <= decision.pick_s < 1.0


@pytest.mark.parametrize(
    "taught", [pytest.param(False, id="a new router"), pytest.param(True, id="a router that learnt a history")]
)
def test_picking_changes_nothing_a_later_decision_depends_on(strategy: str, taught: bool) -> None:
    world = World(strategy)
    load(world.candidates[0], 1)
    if taught:
        world.teach()
    probes = [(who, topic) for who in ("acme", "globex", "shared-b") for topic in ("billing", "weather")]
    before = [decided(world.pick(who, world.ask(topic))) for who, topic in probes]
    seen = counters(world.candidates)
    for who, topic in probes * 3:  # picks never acted on, some among fewer candidates
        request = world.ask(topic)
        assert decided(world.pick(who, request)) == decided(world.pick(who, request))
        world.pick(who, world.ask(topic), among=world.candidates[1:])
    assert counters(world.candidates) == seen
    assert [decided(world.pick(who, world.ask(topic))) for who, topic in probes] == before


def test_on_dispatch_learns_in_the_router_and_leaves_the_backend_counters_to_the_dispatcher(strategy: str) -> None:
    world = World(strategy)
    for who, topic in itertools.product(("acme", "shared-a"), ("billing", "billing", "weather")):
        request = world.ask(topic)
        decision = world.pick(who, request)
        decision.state.reserve(0, 100)  # what the dispatcher does before calling on_dispatch
        seen = counters(world.candidates)
        world.router.on_dispatch(request, tenant(world.snapshot, who), decision)
        assert counters(world.candidates) == seen


@pytest.mark.parametrize(
    ("scene", "requests"),
    [
        pytest.param("idle", 0, id="an idle backend"),
        pytest.param("busy", 50, id="a backend far above the average load"),
        pytest.param("not home", 0, id="a backend other than where the prompt was learnt"),
    ],
)
def test_a_lone_candidate_is_chosen(strategy: str, scene: str, requests: int) -> None:
    world = World(strategy, epsilon=0.0)
    home = world.dispatch("acme", world.ask("billing")).state
    lone = next(s for s in world.candidates if s is not home) if scene == "not home" else home
    load(lone, requests)
    decision = world.dispatch("acme", world.ask("billing"), among=[lone])
    assert decision.state is lone
    assert decision.strategy == strategy
    assert REASON.fullmatch(decision.reason)


def test_forgetting_a_backend_voids_what_the_requests_sent_there_taught(strategy: str) -> None:
    """World one sent "billing" four times, world two "returns"; both then forget every backend
    world one used: a pick of "billing" can no longer tell the worlds apart."""
    world = World(strategy)
    other = world.twin()
    used = {world.dispatch("acme", world.ask("billing")).state.name for _ in range(4)}
    for _ in range(4):
        world.dispatch("acme", world.ask("returns"), router=other)
    for name in used:
        world.router.forget_backend(name)
        other.forget_backend(name)
    after = world.pick("acme", world.ask("billing"))
    assert decided(after) == decided(world.pick("acme", world.ask("billing"), router=other))
    assert after.matched_blocks == 0


def test_forgetting_one_backend_keeps_what_was_learnt_about_the_others(strategy: str) -> None:
    world = World(strategy)
    other = world.twin()
    world.teach()
    world.teach(other)
    first = world.dispatch("acme", world.ask("billing")).state
    world.dispatch("acme", world.ask("billing"), router=other)
    gone = next(s.name for s in world.candidates if s is not first)
    world.router.forget_backend(gone)
    assert decided(world.pick("acme", world.ask("billing"))) == decided(
        world.pick("acme", world.ask("billing"), router=other)
    )


@pytest.mark.parametrize(
    ("teacher", "asker"),
    [
        pytest.param("acme", "globex", id="one tenant's prompt does not steer another tenant"),
        pytest.param("acme", "shared-a", id="a tenant's prompt does not steer a tenant of a shared scope"),
        pytest.param("shared-a", "acme", id="a shared scope's prompt does not steer a tenant outside it"),
    ],
)
def test_what_one_tenant_taught_never_changes_another_tenants_decision(strategy: str, teacher: str, asker: str) -> None:
    """The teacher sends "billing" in world one and "returns" in world two (same session id, same
    number of dispatches); the asker's "billing" must get the same decision in both."""
    world = World(strategy)
    other = world.twin()
    for _ in range(4):
        world.dispatch(teacher, world.ask("billing", session="s-1"))
        world.dispatch(teacher, world.ask("returns", session="s-1"), router=other)
    asked = world.pick(asker, world.ask("billing", session="s-1"))
    assert decided(asked) == decided(world.pick(asker, world.ask("billing", session="s-1"), router=other))


def test_tenants_of_one_cache_scope_share_what_was_learnt(strategy: str) -> None:
    world = World(strategy)
    world.teach()
    for _ in range(4):
        world.dispatch("shared-a", world.ask("billing"))
    own = world.pick("shared-a", world.ask("billing"))
    assert decided(world.pick("shared-b", world.ask("billing"))) == decided(own)


@pytest.mark.parametrize("strategy_name", BOUNDED)
@pytest.mark.parametrize(
    ("preload", "epsilon"),
    [
        pytest.param((0, 0, 0), 0.0, id="an idle pool with no slack"),
        pytest.param((0, 0, 0), 0.25, id="an idle pool with a quarter of slack"),
        pytest.param((10, 0, 0), 0.25, id="a pool with one backend already busy"),
        pytest.param((5, 2, 0), 1.0, id="a skewed pool with double slack"),
    ],
)
def test_a_load_bounded_router_never_puts_a_backend_above_the_bound(
    strategy_name: str, preload: tuple[int, int, int], epsilon: float
) -> None:
    """A hot prompt in one session, dispatched 30 times and all still in flight, between requests of
    other tenants: each choice holds at most ``ceil((1 + epsilon) × (L + 1) / n)`` with it."""
    world = World(strategy_name, epsilon)
    router = world.router
    assert isinstance(router, LoadBounded)
    assert router.epsilon == epsilon
    for state, requests in zip(world.candidates, preload, strict=True):
        load(state, requests)
    for i in range(30):
        who, topic = ("globex", f"topic {i}") if i % 5 == 4 else ("acme", "hot question")
        bound = load_bound(world.candidates, epsilon)
        decision = world.dispatch(who, world.ask(topic))
        decision.state.reserve(0, 100)
        assert decision.state.in_flight <= bound, (i, decision.reason, bound)
