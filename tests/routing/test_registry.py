"""The routers the registry builds (``gateway/routing/registry.py``): the policy's strategy per
model, and a router kept across a reload that did not change its routing.
"""

from __future__ import annotations

from gateway.routing.registry import RouterSpec, build_router, build_routers
from gateway.service import parse_policy
from tests.fake_clock import FakeClock
from tests.routing.conftest import MODEL, SECRET, routing_policy, strategy


def test_the_registry_builds_the_policys_strategy_per_model() -> None:
    snapshot = strategy("round_robin")
    spec = RouterSpec(MODEL, snapshot.models[MODEL].routing, FakeClock(), SECRET)
    assert build_router(spec).strategy == "round_robin"  # type: ignore[attr-defined]
    assert build_routers(parse_policy(routing_policy(), "t"), FakeClock(), SECRET)[MODEL].strategy == "prefix_affinity"  # type: ignore[attr-defined]


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
