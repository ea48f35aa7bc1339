"""A sweep: the same workload at increasing rates, one run each, then where it saturates.

Each rate R runs into ``DIR/rate-R/``; ``DIR/sweep.json`` holds one point per rate and the
findings. Saturation is the first rate at which any of these appears (the point before it is
the highest sustainable rate):

* throughput stops rising: the run's efficiency (completed requests/s over the requests/s it
  actually offered) fell below ``min_efficiency`` (0.75) of the lowest rate's. Comparing with
  the lowest rate absorbs the drain time of short runs, and using the realised offered rate
  (requests sent / duration) rather than the nominal one absorbs the randomness of arrivals;
* errors appear: more than ``max_error_fraction`` (1%) of requests failed;
* P99 blows up: P99 TTFT or ITL more than ``p99_blowup`` (5×) their value at the lowest rate.

Goodput under SLO is reported two ways: the highest goodput of any rate, and the highest rate
whose SLO attainment is at least ``attainment_target`` (0.9), DistServe's definition.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from loadtests.loadgen.runner import ProgressSink, RunConfig, run_workload
from loadtests.loadgen.workload import Workload

SWEEP_FILE = "sweep.json"


@dataclass(frozen=True, slots=True)
class SweepPoint:
    rate: float
    run_dir: str
    offered: float
    """Requests sent per second of the sending window (wall), the rate the schedule realised."""
    throughput: float
    goodput: float
    attainment: float
    error_fraction: float
    ttft_p99: float | None
    itl_p99: float | None
    e2e_p99: float | None

    @classmethod
    def from_summary(cls, rate: float, run_dir: str, summary: Mapping[str, Any]) -> SweepPoint:
        overall = summary["overall"]
        requests = overall["requests"] or 1
        return cls(
            rate=rate,
            run_dir=run_dir,
            offered=overall["requests"] / summary["duration_s"],
            throughput=overall["request_throughput"],
            goodput=overall["goodput_rps"],
            attainment=overall["slo_attainment"] or 0.0,
            error_fraction=(overall["requests"] - overall["ok"]) / requests,
            ttft_p99=overall["ttft_s"]["p99"],
            itl_p99=overall["itl_s"]["p99"],
            e2e_p99=overall["e2e_s"]["p99"],
        )


@dataclass(frozen=True, slots=True)
class Criteria:
    """Thresholds of the saturation rules; see the module docstring."""

    min_efficiency: float = 0.75
    max_error_fraction: float = 0.01
    p99_blowup: float = 5.0
    attainment_target: float = 0.9


def saturation_reasons(points: Sequence[SweepPoint], i: int, criteria: Criteria) -> list[str]:
    """Why point i counts as saturated (empty if it does not)."""
    point, first = points[i], points[0]
    reasons = []
    if point.error_fraction > criteria.max_error_fraction:
        reasons.append(f"errors {point.error_fraction:.1%} > {criteria.max_error_fraction:.0%}")
    if i > 0 and first.offered > 0 and point.offered > 0 and first.throughput > 0:
        efficiency = (point.throughput / point.offered) / (first.throughput / first.offered)
        if efficiency < criteria.min_efficiency:
            reasons.append(
                f"throughput stopped rising ({point.throughput:.2f} req/s done of {point.offered:.2f} offered)"
            )
    for name in ("ttft_p99", "itl_p99"):
        base, value = getattr(first, name), getattr(point, name)
        if i > 0 and base and value and value > criteria.p99_blowup * base:
            reasons.append(f"{name.replace('_', ' ').upper()} {value / base:.1f}× the lowest rate's")
    return reasons


def analyse(points: Sequence[SweepPoint], criteria: Criteria = Criteria()) -> dict[str, Any]:
    """Findings of a sweep whose points are sorted by rate."""
    saturation = None
    for i in range(len(points)):
        reasons = saturation_reasons(points, i, criteria)
        if reasons:
            saturation = {
                "rate": points[i].rate,
                "reasons": reasons,
                "max_sustainable_rate": points[i - 1].rate if i > 0 else None,
            }
            break
    best = max(points, key=lambda p: p.goodput, default=None)
    meeting = [p.rate for p in points if p.attainment >= criteria.attainment_target]
    return {
        "saturation": saturation,
        "best_goodput": None if best is None else {"rate": best.rate, "goodput_rps": best.goodput},
        "max_rate_meeting_attainment": max(meeting, default=None),
        "criteria": asdict(criteria),
    }


def rate_dir_name(rate: float) -> str:
    return f"rate-{rate:g}"


def write_sweep(path: Path, points: Sequence[SweepPoint], findings: Mapping[str, Any], info: Mapping[str, Any]) -> None:
    document = {**info, "points": [asdict(p) for p in points], **findings}
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))


def parse_rates(text: str) -> list[float]:
    """``"10,20,40"`` → [10.0, 20.0, 40.0]; positive, strictly increasing."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"--rates {text!r}: expected comma-separated numbers") from exc
    if not rates or any(r <= 0 for r in rates) or rates != sorted(set(rates)):
        raise ValueError(f"--rates {text!r}: expected positive, increasing rates")
    return rates


async def run_sweep(
    workload: Workload,
    rates: Sequence[float],
    template: RunConfig,
    *,
    base_dir: Path,
    progress: Callable[[float], AbstractContextManager[ProgressSink | None]],
    criteria: Criteria = Criteria(),
) -> dict[str, Any]:
    """Run every rate into ``template.out_dir/rate-R`` one after the other; write ``sweep.json``."""
    points = []
    for rate in rates:
        run_dir = template.out_dir / rate_dir_name(rate)
        config = replace(template, rate=rate, out_dir=run_dir)
        with progress(rate) as sink:
            result = await run_workload(workload, config, base_dir=base_dir, progress=sink)
        points.append(SweepPoint.from_summary(rate, run_dir.name, result.summary))
    findings = analyse(points, criteria)
    info = {"workload": workload.name, "target": template.target, "duration_s": template.duration_s,
            "time_scale": template.time_scale, "seed": template.seed}  # fmt: skip
    write_sweep(template.out_dir / SWEEP_FILE, points, findings, info)
    return findings
