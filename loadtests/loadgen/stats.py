"""Percentiles, SLO checks, goodput and attainment: the arithmetic every report rests on.

Percentiles use linear interpolation between closest ranks, numpy's default ``"linear"``
method: for sorted values x₀..xₙ₋₁ and q in [0, 100], the rank is h = (n − 1)·q/100 and the
result x⌊h⌋ + (h − ⌊h⌋)·(x⌊h⌋₊₁ − x⌊h⌋). So P50 of [1, 2, 3, 4] is 2.5 and P99 of 1..100 is 99.01.

Goodput is the number of requests that succeeded *and* met every SLO of their class, per second
of the run; SLO attainment is that number over all requests sent (errors count as misses, so
shedding load never improves attainment).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loadtests.loadgen.workload import Slo

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100) of already-sorted values, numpy-compatible linear interpolation."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], not {q}")
    rank = (len(sorted_values) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = rank - low
    return sorted_values[low] + fraction * (sorted_values[high] - sorted_values[low])


@dataclass(frozen=True, slots=True)
class Distribution:
    """Count, mean and P50/P90/P95/P99 of a sample; the mean is never reported alone."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        ordered = sorted(values)
        if not ordered:
            return cls(0, None, None, None, None, None)
        p50, p90, p95, p99 = (percentile(ordered, q) for q in PERCENTILES)
        return cls(len(ordered), math.fsum(ordered) / len(ordered), p50, p90, p95, p99)


def scaled_slo(slo: Slo, time_scale: float) -> Slo:
    """The SLO of a run against a simulator slowed down ``time_scale`` times."""
    if time_scale == 1:
        return slo
    return Slo(
        ttft_ms=slo.ttft_ms * time_scale,
        tpot_ms=slo.tpot_ms * time_scale,
        e2e_ms=None if slo.e2e_ms is None else slo.e2e_ms * time_scale,
    )


def meets_slo(slo: Slo, *, ok: bool, ttft_s: float | None, tpot_s: float | None, e2e_s: float | None) -> bool:
    """True when the request succeeded and every SLO it can be judged on holds.

    A request with a single output token has no TPOT and is judged on TTFT (and E2E) only.
    """
    if not ok or ttft_s is None or e2e_s is None:
        return False
    if ttft_s * 1000 > slo.ttft_ms:
        return False
    if tpot_s is not None and tpot_s * 1000 > slo.tpot_ms:
        return False
    return slo.e2e_ms is None or e2e_s * 1000 <= slo.e2e_ms


def goodput(met: int, elapsed_s: float) -> float:
    """Requests per second that met all their SLOs."""
    return met / elapsed_s if elapsed_s > 0 else 0.0


def attainment(met: int, total: int) -> float | None:
    """Fraction of all sent requests that met their SLOs; None when nothing was sent."""
    return met / total if total else None
