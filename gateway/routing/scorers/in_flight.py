"""Load from the tokens the gateway has in flight on each backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.routing.framework import Cycle
from gateway.types import InferenceRequest

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendState


class InFlightScorer:
    """``1 − t_b / (max_c t_c + r)``: ``t`` the tokens (prompt plus ``max_tokens``) in flight on
    a backend from the whole fleet (``BackendState.fleet_in_flight_tokens``), ``r`` this
    request's. 1 for an idle backend; the busiest gets ``r / (t_max + r)``, so a difference of
    one request matters at low load and little at high load."""

    __slots__ = ("name",)

    def __init__(self, name: str = "in-flight-scorer") -> None:
        self.name = name

    def score(self, request: InferenceRequest, candidates: Sequence[BackendState], cycle: Cycle) -> list[float]:
        tokens = [s.fleet_in_flight_tokens for s in candidates]
        scale = max(tokens) + max(1, cycle.request_tokens)
        return [1.0 - t / scale for t in tokens]
