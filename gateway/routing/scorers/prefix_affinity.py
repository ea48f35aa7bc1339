"""Expected cached prefix: the share of the prompt's blocks a backend is expected to hold."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.routing.framework import Cycle
from gateway.types import InferenceRequest

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendState


class PrefixAffinityScorer:
    """``matched_b / blocks``: leading blocks of the prompt that backend b served recently
    (``prefix_index.py``) over the prompt's full blocks; 0 for all when the prompt has none."""

    __slots__ = ("name",)

    def __init__(self, name: str = "prefix-affinity-scorer") -> None:
        self.name = name

    def score(self, request: InferenceRequest, candidates: Sequence[BackendState], cycle: Cycle) -> list[float]:
        total = len(cycle.keys.blocks) if cycle.keys is not None else 0
        if total == 0:
            return [0.0] * len(candidates)
        return [m / total for m in cycle.matched]
