"""Arrival schedules: when each request is sent, in seconds from the start of the run.

The schedule is computed before the run, so the sender never decides anything from the
responses (open loop). Three processes:

* Poisson at rate λ: exponential gaps of mean 1/λ (CV = 1).
* Gamma at rate λ with coefficient of variation ``cv``: gaps ~ Gamma(k = 1/cv², θ = 1/(λk)),
  so the mean gap is still 1/λ; cv > 1 gives bursts and lulls, cv < 1 a smoother stream.
* A recorded trace: the ``t_send`` of a JSONL file, relative to its first one, optionally
  compressed to a target mean rate.

Every schedule stops at ``duration_s`` and after ``max_requests``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import orjson

from loadtests.loadgen.workload import Arrival


def poisson_gaps(rate: float, rng: random.Random) -> Iterator[float]:
    while True:
        yield rng.expovariate(rate)


def gamma_gaps(rate: float, cv: float, rng: random.Random) -> Iterator[float]:
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    while True:
        yield rng.gammavariate(shape, scale)


def offsets_from_gaps(gaps: Iterator[float], *, duration_s: float, max_requests: int | None) -> list[float]:
    """Cumulative send offsets; the first request goes at its first gap, not at zero."""
    offsets = []
    t = 0.0
    for gap in itertools.islice(gaps, max_requests):
        t += gap
        if t >= duration_s:
            break
        offsets.append(t)
    return offsets


def read_trace(path: Path) -> list[float]:
    """The ``t_send`` of every line (any other field is ignored), relative to the first, sorted."""
    stamps = []
    with path.open("rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                stamps.append(float(orjson.loads(line)["t_send"]))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: a trace line needs a numeric t_send") from exc
    if not stamps:
        raise ValueError(f"{path}: the trace is empty")
    stamps.sort()
    return [t - stamps[0] for t in stamps]


def trace_offsets(
    stamps: list[float],
    *,
    rate: float | None,
    duration_s: float,
    max_requests: int | None,
    time_scale: float = 1.0,
) -> list[float]:
    """Replay recorded offsets; with ``rate``, stretch or compress them to that mean rate,
    otherwise stretch them by ``time_scale``."""
    factor = time_scale
    if rate is not None and len(stamps) > 1 and stamps[-1] > 0:
        recorded_rate = (len(stamps) - 1) / stamps[-1]
        factor = recorded_rate / rate
    offsets = [t * factor for t in stamps if t * factor < duration_s]
    return offsets[:max_requests] if max_requests is not None else offsets


def build_schedule(
    arrival: Arrival,
    *,
    rate: float | None,
    duration_s: float,
    max_requests: int | None,
    seed: int,
    base_dir: Path,
    time_scale: float = 1.0,
) -> list[float]:
    """Send offsets in seconds for this workload's arrival process at ``rate / time_scale`` per second.

    ``time_scale`` K matches a simulator slowed down K times: the same load in simulated time.
    """
    rng = random.Random(seed)
    if rate is not None:
        rate = rate / time_scale
    if arrival.process == "trace":
        assert arrival.path is not None
        stamps = read_trace(base_dir / arrival.path)
        return trace_offsets(stamps, rate=rate, duration_s=duration_s, max_requests=max_requests, time_scale=time_scale)
    if rate is None or rate <= 0:
        raise ValueError(f"a {arrival.process} arrival process needs a positive --rate")
    if arrival.process == "gamma":
        assert arrival.cv is not None
        gaps = gamma_gaps(rate, arrival.cv, rng)
    else:
        gaps = poisson_gaps(rate, rng)
    return offsets_from_gaps(gaps, duration_s=duration_s, max_requests=max_requests)
