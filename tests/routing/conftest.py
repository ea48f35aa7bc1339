"""Helpers for the routing tests: a policy with three backends, tenants, requests, states, routers
built by strategy, and the scorer-formula tests' cycle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from gateway.admission.build import build_request
from gateway.clock import Clock
from gateway.dialects.chat import CHAT
from gateway.dispatch.backends import BackendPool, BackendState
from gateway.dispatch.router import Router
from gateway.policy.model import Tenant
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.tokens import CharRatioEstimator
from gateway.routing.framework import Cycle
from gateway.routing.prefix_secret import PrefixSecret
from gateway.routing.registry import build_routers
from gateway.service import parse_policy
from gateway.types import InferenceRequest, PrefixKeys
from tests.fake_clock import FakeClock
from tests.policy_builder import NOWHERE, OMIT, backend, build_policy, model
from tests.policy_builder import tenant as tenant_entry

MODEL = "m"
SECRET = PrefixSecret(b"routing-test-secret")
"""The cache-salt secret of the routers these tests build (it keys the prefix roots)."""
SYSTEM = "You are the assistant of a large company. " * 40  # ~1,700 characters: several blocks


SCOPED_TENANTS = [
    tenant_entry("acme", "key-acme"),
    tenant_entry("globex", "key-globex"),
    tenant_entry("shared-a", "key-sa", cache_scope="public-bot"),
    tenant_entry("shared-b", "key-sb", cache_scope="public-bot"),
]
"""Two tenants of their own cache scope, and two sharing the scope ``public-bot``."""
PUBLIC_BOT = {"public-bot": {"description": "the public help bot's system prompt"}}


def routing_policy(backend_count: int = 3, **sections: Any) -> str:
    """Model ``m`` on ``backend_count`` sim backends ``b0``, ``b1``, ... at ports 1, 2, ... (100
    requests and 6,400 KV tokens each), one class, ``SCOPED_TENANTS``; ``sections`` edit it
    (``tests/policy_builder.py``), e.g. ``models={MODEL: {"routing": {"strategy": "round_robin"}}}``."""
    capacity = {"max_concurrent": 100, "kv_cache_tokens": 6400}
    routing = {
        "version": "t",
        "classes": {"batch": OMIT},
        "models": [model(MODEL, max_prompt_tokens=100000)],
        "backends": [
            backend(f"b{i}", f"http://127.0.0.1:{1 + i}", [MODEL], kind="sim", capacity=capacity)
            for i in range(backend_count)
        ],
        "cache_scopes": PUBLIC_BOT,
        "tenants": SCOPED_TENANTS,
    }
    return build_policy(NOWHERE, routing, **sections)


@pytest.fixture
def snapshot() -> PolicySnapshot:
    return parse_policy(routing_policy(), "t.yaml")


def tenant(snapshot: PolicySnapshot, name: str) -> Tenant:
    return next(t for t in snapshot.policy.tenants if t.name == name)


def chat_request(
    snapshot: PolicySnapshot, *turns: str, system: str = SYSTEM, max_tokens: int = 16, **fields: Any
) -> InferenceRequest:
    """A chat request: the system prompt, then ``turns`` alternating user and assistant."""
    messages = [{"role": "system", "content": system}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **fields}
    return build_request(
        api=CHAT,
        body=body,
        raw_body=b"",
        request_id="r",
        arrival=0.0,
        model_policy=snapshot.models[MODEL],
        limits=snapshot.policy.limits,
        estimator=CharRatioEstimator(),
    )


def states(snapshot: PolicySnapshot) -> list[BackendState]:
    return list(BackendPool(snapshot).for_model(MODEL))


def load(state: BackendState, requests: int, tokens_each: int = 100) -> BackendState:
    for _ in range(requests):
        state.reserve(0, tokens_each)
    return state


def counters(candidates: Sequence[BackendState]) -> list[tuple[object, ...]]:
    """What the dispatcher and the scraper own on each candidate (a router or scorer must not change it)."""
    return [
        (
            *(s.name, s.healthy, s.in_flight, s.in_flight_tokens, s.waiting, s.kv_usage, s.scraped_at),
            *(dict(s.class_in_flight), dict(s.class_tokens), dict(s.class_prefilling)),
        )
        for s in candidates
    ]


# Routers of one strategy (the strategy tests: tests/routing/test_<strategy>.py)


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


# The scorer-formula tests' cycle (tests/routing/scorers/, and the profile's in test_framework.py)

SCORED_AT = 100.0
"""The time of ``scoring_cycle``, whose scrapes are fresh for 3 s."""


def scoring_cycle(matched: list[int], blocks: int = 10, request_tokens: int = 100) -> Cycle:
    keys = PrefixKeys(0, 16, tuple(range(blocks)))
    return Cycle(SCORED_AT, 3.0, keys, matched, request_tokens)
