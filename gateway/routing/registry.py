"""The routing plugin registry: strategies and scorers by name, and building a model's router.

A model's ``routing`` policy section names a strategy and, for the scored ones, weights per
scorer. New behaviour is a new module and one line here. ``routing_problems`` is what the
policy loader checks (unknown names fail at load, with their path); ``build_routers`` is what
the gateway calls at start-up.

A new scorer is a module in ``scorers/`` whose class follows the ``Scorer`` contract
(``framework.py``) and states its formula, plus its line in ``SCORERS`` (and in
``DEFAULT_WEIGHTS`` to run without weights in the policy). A new strategy is a module whose
class follows the ``Router`` contract (``base.py``), with an ``epsilon`` if it applies the
bounded-load rule, plus its line in ``STRATEGIES`` (or a ``register_strategy`` call). The
conformance suites (``tests/routing/test_framework.py`` for scorers, ``tests/dispatch/test_router.py``
for strategies) run every entry of these registries, so they check a new one without an edit;
its own formula or choices go in ``tests/routing/scorers/test_<name>.py`` or
``tests/routing/test_<name>.py``.

Usage::

    routers = build_routers(snapshot, clock, secret)  # {model: Router}; secret: PrefixSecret
    register_strategy("oracle", make_oracle)          # a benchmark's own strategy
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.clock import Clock
from gateway.dispatch.router import Router
from gateway.policy.model import Routing
from gateway.routing.engine_view import EngineView
from gateway.routing.framework import Profile, Scorer, Weighted
from gateway.routing.least_load import LeastLoadRouter
from gateway.routing.prefix_affinity import PrefixAffinityRouter
from gateway.routing.prefix_keys import TOKENIZERS
from gateway.routing.prefix_secret import PrefixSecret
from gateway.routing.round_robin import RoundRobinRouter
from gateway.routing.scorers.in_flight import InFlightScorer
from gateway.routing.scorers.kv_usage import KvUsageScorer
from gateway.routing.scorers.prefix_affinity import PrefixAffinityScorer
from gateway.routing.scorers.queue_depth import QueueDepthScorer
from gateway.routing.session_affinity import SessionAffinityRouter

if TYPE_CHECKING:
    from gateway.policy.snapshot import PolicySnapshot


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """What a strategy factory gets: the model, its routing section, the clock, the cache-salt
    secret keying the prefix roots (``prefix_secret.py``), scrape freshness."""

    model: str
    routing: Routing
    clock: Clock
    secret: PrefixSecret
    fresh_s: float = 3.0
    engines: EngineView | None = None
    """The engines' own reports of what they hold (KV events, ``engine_view.py``); None: estimate only."""


RouterFactory = Callable[[RouterSpec], Router]
ScorerFactory = Callable[[str], Scorer]

SCORERS: dict[str, ScorerFactory] = {
    "prefix-affinity-scorer": PrefixAffinityScorer,
    "in-flight-scorer": InFlightScorer,
    "queue-depth-scorer": QueueDepthScorer,
    "kv-usage-scorer": KvUsageScorer,
}
DEFAULT_WEIGHTS = {
    "prefix-affinity-scorer": 3.0,
    "in-flight-scorer": 1.0,
    "queue-depth-scorer": 1.0,
    "kv-usage-scorer": 0.5,
}


def profile_for(routing: Routing) -> Profile:
    weights = routing.weights if routing.weights is not None else DEFAULT_WEIGHTS
    return Profile([Weighted(SCORERS[name](name), weight) for name, weight in weights.items()])


def _prefix_affinity(spec: RouterSpec) -> Router:
    tokenizer = TOKENIZERS.get(spec.routing.tokenizer)
    return PrefixAffinityRouter(
        spec.routing,
        profile_for(spec.routing),
        spec.clock,
        spec.secret,
        fresh_s=spec.fresh_s,
        tokenizer=tokenizer,
        engines=spec.engines,
    )


STRATEGIES: dict[str, RouterFactory] = {
    "round_robin": lambda spec: RoundRobinRouter(),
    "least_load": lambda spec: LeastLoadRouter(),
    "session_affinity": lambda spec: SessionAffinityRouter(spec.routing.epsilon, spec.secret),
    "prefix_affinity": _prefix_affinity,
}


def register_strategy(name: str, factory: RouterFactory) -> None:
    """Add a strategy (before policies naming it are loaded)."""
    STRATEGIES[name] = factory


def routing_problems(routing: Routing) -> Iterable[str]:
    """Unknown strategy or scorer names, each as ``<field>: <problem>`` relative to the section."""
    if routing.strategy not in STRATEGIES:
        known = ", ".join(sorted(STRATEGIES))
        yield f"strategy: unknown strategy '{routing.strategy}' (known: {known})"
    for name in routing.weights or ():
        if name not in SCORERS:
            yield f"weights.{name}: unknown scorer (known: {', '.join(sorted(SCORERS))})"


def build_router(spec: RouterSpec) -> Router:
    return STRATEGIES[spec.routing.strategy](spec)


def build_routers(
    snapshot: PolicySnapshot, clock: Clock, secret: PrefixSecret, engines: EngineView | None = None
) -> dict[str, Router]:
    """One router per model of the policy."""
    fresh_s = snapshot.policy.scrape.fresh_s
    return {
        name: build_router(RouterSpec(name, model.routing, clock, secret, fresh_s, engines))
        for name, model in snapshot.models.items()
    }


def update_routers(
    current: Mapping[str, Router],
    old: PolicySnapshot,
    new: PolicySnapshot,
    clock: Clock,
    secret: PrefixSecret,
    engines: EngineView | None = None,
) -> dict[str, Router]:
    """Routers for a reloaded policy under the same ``secret``: a model whose routing section (and
    scrape interval) did not change keeps its router and what it learnt; others get a new one.
    (Another secret is other chains: the caller builds every router anew.)"""
    same_scrape = old.policy.scrape.interval_s == new.policy.scrape.interval_s
    fresh = build_routers(new, clock, secret, engines)
    for name, model in new.models.items():
        before = old.models.get(name)
        if same_scrape and before is not None and before.routing == model.routing and name in current:
            fresh[name] = current[name]
    return fresh
