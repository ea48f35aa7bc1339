"""Load from the requests waiting inside each engine (scraped ``num_requests_waiting``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.routing.framework import Cycle
from gateway.types import InferenceRequest

if TYPE_CHECKING:
    from gateway.backends import BackendState


class QueueDepthScorer:
    """``1 − w_b / (max_c w_c + 1)``: ``w`` the engine's own waiting requests, when scraped
    within ``fresh_s`` (else 0, as if idle). 1 for an engine with no queue."""

    __slots__ = ("name",)

    def __init__(self, name: str = "queue-depth-scorer") -> None:
        self.name = name

    def score(self, request: InferenceRequest, candidates: Sequence[BackendState], cycle: Cycle) -> list[float]:
        oldest = cycle.now - cycle.fresh_s
        waiting = [s.waiting if s.scraped_at >= oldest else 0.0 for s in candidates]
        scale = max(waiting) + 1.0
        return [1.0 - w / scale for w in waiting]
