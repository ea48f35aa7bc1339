"""Load from the requests waiting inside each engine (scraped ``num_requests_waiting``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.routing.framework import Cycle, scraped_signal
from gateway.types import InferenceRequest

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendState


class QueueDepthScorer:
    """``1 − w_b / (max_c w_c + 1)``: ``w`` the engine's own waiting requests, when scraped
    within ``fresh_s`` and a finite number (else 0, as if idle; a negative count reads as 0).
    1 for an engine with no queue."""

    __slots__ = ("name",)

    def __init__(self, name: str = "queue-depth-scorer") -> None:
        self.name = name

    def score(self, request: InferenceRequest, candidates: Sequence[BackendState], cycle: Cycle) -> list[float]:
        waiting = [scraped_signal(s, s.waiting, cycle) for s in candidates]
        scale = max(waiting) + 1.0
        return [1.0 - w / scale for w in waiting]
