"""The scoring framework of the scored strategies: Scorer plugins, weights, and the load bound.

A ``Scorer`` rates every candidate in [0, 1] (1 is best) from what the ``Cycle`` of one pick
holds; it never sees weights or other scorers. ``Profile.run`` clamps each score to [0, 1],
multiplies it by the scorer's weight from the policy and sums, then divides by the sum of the
weights, so a total is in [0, 1] too.

Bounded load (consistent hashing with bounded loads, Mirrokni et al. 2018): with ``n``
candidates holding ``L`` requests in flight in all, no candidate may take the request if it
would then hold more than ``ceil((1 + epsilon) × (L + 1) / n)``. The least loaded candidate
always passes, so the rule only ever removes candidates, and affinity can never pile more than
(1 + epsilon) times the average load onto one backend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import xxhash

from gateway.types import InferenceRequest, PrefixKeys

if TYPE_CHECKING:
    from gateway.backends import BackendState


@dataclass(frozen=True, slots=True)
class Cycle:
    """What one pick computed once and every scorer may read."""

    now: float
    fresh_s: float
    """Scraped signals older than this are ignored (treated as idle)."""
    keys: PrefixKeys | None
    matched: Sequence[int]
    """Leading prefix blocks each candidate is expected to hold, in candidate order."""
    request_tokens: int


class Scorer(Protocol):
    """Rates each candidate in [0, 1]; states its formula in its docstring."""

    name: str

    def score(self, request: InferenceRequest, candidates: Sequence[BackendState], cycle: Cycle) -> list[float]:
        """One score per candidate, in candidate order."""
        ...


@dataclass(frozen=True, slots=True)
class Weighted:
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class Scored:
    """Totals per candidate, and each scorer's clamped scores (for explanations)."""

    totals: list[float]
    by_scorer: Mapping[str, list[float]]


class Profile:
    """Scorers with their weights; ``run`` combines them (see the module docstring)."""

    __slots__ = ("_total_weight", "weighted")

    def __init__(self, weighted: Sequence[Weighted]) -> None:
        self.weighted = tuple(w for w in weighted if w.weight > 0)
        if not self.weighted:
            raise ValueError("a profile needs at least one scorer with a weight above 0")
        self._total_weight = sum(w.weight for w in self.weighted)

    def run(self, request: InferenceRequest, candidates: Sequence[BackendState], cycle: Cycle) -> Scored:
        totals = [0.0] * len(candidates)
        by_scorer: dict[str, list[float]] = {}
        for item in self.weighted:
            raw = item.scorer.score(request, candidates, cycle)
            scores = [0.0 if s < 0.0 else 1.0 if s > 1.0 else s for s in raw]
            by_scorer[item.scorer.name] = scores
            weight = item.weight / self._total_weight
            totals = [t + weight * s for t, s in zip(totals, scores, strict=True)]
        return Scored(totals, by_scorer)


def load_bound(candidates: Sequence[BackendState], epsilon: float) -> int:
    """``ceil((1 + epsilon) × (L + 1) / n)``: the most requests a candidate may hold after this one."""
    total = sum(state.in_flight for state in candidates)
    return math.ceil((1.0 + epsilon) * (total + 1) / len(candidates))


def within_bound(state: BackendState, bound: int) -> bool:
    return state.in_flight + 1 <= bound


def rendezvous(seed: int, backend: str) -> int:
    """Highest-random-weight hashing: ``xxh64(backend, seed)``; the largest wins a tie.

    Consistent: when a backend leaves, only the keys it won move, and each key's order of
    preference among the others is unchanged.
    """
    return xxhash.xxh64_intdigest(backend.encode(), seed)
