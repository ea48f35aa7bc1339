"""Session affinity: the requests of one session go to the same backend while it has room.

The session is the ``x-session-id`` header, else the body's ``user`` field, scoped by the
tenant (two tenants' session "42" are unrelated). Each candidate gets the weight
``rendezvous(xxh64(session, seed=root), backend)``, the root keyed with the cache-salt secret
from the tenant's scope and the model (``prefix_secret.py``), and the heaviest one that
passes the bounded-load rule (``framework.py``) wins: consistent hashing, so a backend leaving
moves only its own sessions, and a hot session spills to its next backend instead of piling
up. A request with no session goes to the least loaded candidate.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter
from typing import TYPE_CHECKING

import xxhash

from gateway.dispatch.cache_report import CacheReport
from gateway.dispatch.router import RoutingDecision
from gateway.policy.model import Tenant
from gateway.routing.framework import load_bound, rendezvous, within_bound
from gateway.routing.isolation import tenant_scope
from gateway.routing.least_load import least_loaded
from gateway.routing.prefix_secret import PrefixSecret
from gateway.types import InferenceRequest

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendState


def session_key(request: InferenceRequest) -> str | None:
    if request.session_id:
        return request.session_id
    user = request.body.get("user")
    return user if isinstance(user, str) and user else None


class SessionAffinityRouter:
    """Consistent hashing of the session with bounded loads (see the module docstring)."""

    __slots__ = ("epsilon", "secret")
    strategy = "session_affinity"

    def __init__(self, epsilon: float, secret: PrefixSecret) -> None:
        self.epsilon = epsilon
        self.secret = secret

    def pick(self, request: InferenceRequest, tenant: Tenant, candidates: Sequence[BackendState]) -> RoutingDecision:
        start = perf_counter()
        root = self.secret.root(tenant_scope(tenant), request.model)
        session = session_key(request)
        if session is None:
            tied = least_loaded(candidates)
            chosen = max(tied, key=lambda s: rendezvous(root, s.name))
            return RoutingDecision(chosen, self.strategy, "no_session", pick_s=perf_counter() - start)
        seed = xxhash.xxh64_intdigest(session.encode(), root)
        ranked = sorted(candidates, key=lambda s: rendezvous(seed, s.name), reverse=True)
        bound = load_bound(candidates, self.epsilon)
        chosen = next((s for s in ranked if within_bound(s, bound)), ranked[0])
        reason = "session_hash" if chosen is ranked[0] else "load_bound"
        return RoutingDecision(chosen, self.strategy, reason, pick_s=perf_counter() - start)

    def on_dispatch(self, request: InferenceRequest, tenant: Tenant, decision: RoutingDecision) -> None:
        pass

    def forget_backend(self, backend: str) -> None:
        pass

    def on_answer(self, request: InferenceRequest, decision: RoutingDecision, report: CacheReport) -> None:
        pass  # predicts no cache: nothing to correct
