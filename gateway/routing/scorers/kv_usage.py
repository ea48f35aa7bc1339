"""Load from each engine's scraped KV-cache usage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.routing.framework import Cycle
from gateway.types import InferenceRequest

if TYPE_CHECKING:
    from gateway.backends import BackendState


class KvUsageScorer:
    """``1 − kv_b``: the free share of the engine's KV cache, when scraped within ``fresh_s``
    (else 1, as if empty)."""

    __slots__ = ("name",)

    def __init__(self, name: str = "kv-usage-scorer") -> None:
        self.name = name

    def score(self, request: InferenceRequest, candidates: Sequence[BackendState], cycle: Cycle) -> list[float]:
        oldest = cycle.now - cycle.fresh_s
        return [1.0 - s.kv_usage if s.scraped_at >= oldest else 1.0 for s in candidates]
