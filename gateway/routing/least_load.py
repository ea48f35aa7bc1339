"""Least-loaded picking: the healthy backend with the fewest requests (then tokens) in flight.

Ties, which are the rule at low load, rotate through the tied backends, so that an idle
pool spreads requests instead of sending all of them to the first backend listed. The
rotation advances in ``on_dispatch`` (picking stays pure). The prefix-affinity router
replaces this as the default; it stays as the ``least_load`` strategy.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter
from typing import TYPE_CHECKING

from gateway.dispatch.cache_report import CacheReport
from gateway.dispatch.router import RoutingDecision
from gateway.policy.model import Tenant
from gateway.types import InferenceRequest

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendState


def least_loaded(candidates: Sequence[BackendState]) -> list[BackendState]:
    """The candidates with the lowest (in_flight, in_flight_tokens), in candidate order."""
    best: list[BackendState] = []
    best_load = (0, 0)
    for state in candidates:
        load = (state.fleet_in_flight, state.fleet_in_flight_tokens)
        if not best or load < best_load:
            best, best_load = [state], load
        elif load == best_load:
            best.append(state)
    return best


class LeastLoadRouter:
    """Pick the candidate with the lowest (in_flight, in_flight_tokens)."""

    __slots__ = ("_turn",)
    strategy = "least_load"

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, request: InferenceRequest, tenant: Tenant, candidates: Sequence[BackendState]) -> RoutingDecision:
        start = perf_counter()
        best = least_loaded(candidates)
        chosen = best[0] if len(best) == 1 else best[self._turn % len(best)]
        reason = "least_loaded" if len(best) == 1 else "tie_rotated"
        return RoutingDecision(chosen, self.strategy, reason, pick_s=perf_counter() - start)

    def on_dispatch(self, request: InferenceRequest, tenant: Tenant, decision: RoutingDecision) -> None:
        if decision.reason == "tie_rotated":
            self._turn += 1

    def forget_backend(self, backend: str) -> None:
        pass

    def on_answer(self, request: InferenceRequest, decision: RoutingDecision, report: CacheReport) -> None:
        pass  # predicts no cache: nothing to correct
