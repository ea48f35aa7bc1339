"""The scoring framework of the scored strategies: Scorer plugins, weights, and the load bound.

A ``Scorer`` rates every candidate in [0, 1] (1 is best) from what the ``Cycle`` of one pick
holds; it never sees weights or other scorers. ``Profile.run`` clamps each score to [0, 1],
multiplies it by the scorer's weight from the policy and sums, then divides by the sum of the
weights, so a total is in [0, 1] too. A score that is not a number counts as 0, so one broken
scorer or signal can lower a candidate's total but never make the totals incomparable.

Bounded load (consistent hashing with bounded loads, Mirrokni et al. 2018): with ``n``
candidates holding ``L`` requests in flight in all, no candidate may take the request if it
would then hold more than ``ceil((1 + epsilon) × (L + 1) / n)``. The least loaded candidate
always passes, so the rule only ever removes candidates, and affinity can never pile more than
(1 + epsilon) times the average load onto one backend. Loads are the fleet's
(``BackendState.fleet_in_flight``: this process's requests, plus the other processes' as of
the last sync): with each replica's own small part alone, the bound's rounding would exclude
a backend holding a single request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import xxhash

from gateway.types import InferenceRequest, PrefixKeys

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendState


@dataclass(frozen=True, slots=True)
class Cycle:
    """What one pick computed once and every scorer may read."""

    now: float
    fresh_s: float
    """Scraped signals older than this are ignored (treated as idle)."""
    keys: PrefixKeys | None
    """The prompt's block hashes under the request's tenant scope; None when the strategy keys none."""
    matched: Sequence[int]
    """Leading prefix blocks each candidate is expected to hold, in candidate order."""
    request_tokens: int
    engine_reported: frozenset[str] = frozenset()
    """Candidates whose ``matched`` is their engine's own report (KV events), not the estimate."""


class Scorer(Protocol):
    """Rates each candidate in [0, 1], 1 best; states its formula in its docstring.

    The contract, checked for every registered scorer by ``tests/routing/test_framework.py``:

    * One finite score in [0, 1] per candidate, in candidate order, whatever the signals hold.
    * Pure: ``score`` changes nothing (request, candidates, cycle, itself), and the same inputs
      give the same scores. A scorer keeps no memory between calls.
    * Per candidate: permuting the candidates (and ``cycle.matched`` with them) permutes the
      scores; identical candidates score the same.
    * Monotone: a candidate no worse than another on every signal (requests and tokens in flight,
      waiting requests, KV usage, matched blocks) never scores lower; one that is idle and holds
      the whole prompt scores 1.
    * A scraped signal (``waiting``, ``kv_usage``) that is older than ``cycle.fresh_s``, was never
      scraped, or is not a finite number counts as idle; one out of its range is clamped into it
      (``scraped_signal``).
    * Affinity comes from ``cycle.keys`` and ``cycle.matched`` only, which the router computed
      under the request's tenant scope, so no scorer ever rates another scope's cached prefix. A
      prompt with no full block (``keys`` None or empty) favours no candidate for affinity.
    """

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
            scores = [s if 0.0 <= s <= 1.0 else 1.0 if s > 1.0 else 0.0 for s in raw]  # NaN is 0
            by_scorer[item.scorer.name] = scores
            weight = item.weight / self._total_weight
            totals = [t + weight * s for t, s in zip(totals, scores, strict=True)]
        return Scored(totals, by_scorer)


def scraped_signal(state: BackendState, value: float, cycle: Cycle, ceiling: float = math.inf) -> float:
    """A scraped ``value`` of ``state`` as scorers read it: 0 (idle) when the scrape is older than
    ``cycle.fresh_s`` (or never happened) or the value is not a finite number (a page may say
    ``NaN`` or ``+Inf``), else the value clamped to ``[0, ceiling]``."""
    if state.scraped_at < cycle.now - cycle.fresh_s or not math.isfinite(value):
        return 0.0
    return min(max(value, 0.0), ceiling)


def load_bound(candidates: Sequence[BackendState], epsilon: float) -> int:
    """``ceil((1 + epsilon) × (L + 1) / n)``: the most requests a candidate may hold after this one."""
    total = sum(state.fleet_in_flight for state in candidates)
    return math.ceil((1.0 + epsilon) * (total + 1) / len(candidates))


def within_bound(state: BackendState, bound: int) -> bool:
    return state.fleet_in_flight + 1 <= bound


def rendezvous(seed: int, backend: str) -> int:
    """Highest-random-weight hashing: ``xxh64(backend, seed)``; the largest wins a tie.

    Consistent: when a backend leaves, only the keys it won move, and each key's order of
    preference among the others is unchanged.
    """
    return xxhash.xxh64_intdigest(backend.encode(), seed)
