"""Load from each engine's scraped KV-cache usage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.routing.framework import Cycle, scraped_signal
from gateway.types import InferenceRequest

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendState


class KvUsageScorer:
    """``1 − kv_b``: the free share of the engine's KV cache, with ``kv_b`` clamped to [0, 1],
    when scraped within ``fresh_s`` and a finite number (else 1, as if empty)."""

    __slots__ = ("name",)

    def __init__(self, name: str = "kv-usage-scorer") -> None:
        self.name = name

    def score(self, request: InferenceRequest, candidates: Sequence[BackendState], cycle: Cycle) -> list[float]:
        return [1.0 - scraped_signal(s, s.kv_usage, cycle, ceiling=1.0) for s in candidates]
