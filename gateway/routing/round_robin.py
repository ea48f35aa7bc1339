"""Round-robin picking: each dispatch moves a cursor on by one over the candidates with room.

The baseline of the routing benchmark: it knows nothing of load or caches. The cursor
advances in ``on_dispatch``, so a pick that is not acted on does not skip a backend.
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


class RoundRobinRouter:
    """``candidates[cursor mod n]``; the cursor counts dispatches."""

    __slots__ = ("_cursor",)
    strategy = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def pick(self, request: InferenceRequest, tenant: Tenant, candidates: Sequence[BackendState]) -> RoutingDecision:
        start = perf_counter()
        chosen = candidates[self._cursor % len(candidates)]
        return RoutingDecision(chosen, self.strategy, "rotation", pick_s=perf_counter() - start)

    def on_dispatch(self, request: InferenceRequest, tenant: Tenant, decision: RoutingDecision) -> None:
        self._cursor += 1

    def forget_backend(self, backend: str) -> None:
        pass

    def on_answer(self, request: InferenceRequest, decision: RoutingDecision, report: CacheReport) -> None:
        pass  # predicts no cache: nothing to correct
