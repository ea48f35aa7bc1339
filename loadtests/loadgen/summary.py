"""``summary.json``: per class and overall, what the records of one run add up to.

Throughputs divide by the run's elapsed time, from the first send to the last response
(``elapsed_s``), so a run whose responses trail long after the last send is not flattered.
ITL is the distribution of every gap; a gateway trace line keeps only a summary of its gaps,
so for those the distribution is of each request's median gap (``RequestRecord.itl_values``).

The generator checks itself: its CPU seconds per request give a ceiling of 1/cpu requests/s on
one core, and its send lateness (actual minus scheduled send time) shows it falling behind
directly. The summary warns when the sending rate passes half that ceiling, or when the P99
lateness passes half the mean gap between arrivals (at least 5 ms) or a tenth of the tightest TTFT
SLO —
beyond that, latencies measure the generator as much as the system under test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from loadtests.loadgen.records import RequestRecord
from loadtests.loadgen.stats import Distribution, attainment, goodput
from loadtests.loadgen.workload import Slo

SUMMARY_FILE = "summary.json"
CEILING_FRACTION = 0.5
LATENESS_FLOOR_S = 0.005
"""Lateness below 5 ms is timer granularity (uvloop ticks in milliseconds) and scheduling noise on a
shared machine, and 1% of a 500 ms TTFT SLO: not worth a warning at any rate."""


@dataclass(frozen=True, slots=True)
class ClassSummary:
    requests: int
    ok: int
    request_throughput: float
    input_token_throughput: float
    output_token_throughput: float
    ttft_s: Distribution
    itl_s: Distribution
    tpot_s: Distribution
    e2e_s: Distribution
    errors_by_status: dict[str, int]
    errors_by_reason: dict[str, int]
    slo_met: int
    goodput_rps: float
    slo_attainment: float | None
    cached_tokens: int
    slo: dict[str, float | None] | None = None


@dataclass(frozen=True, slots=True)
class GeneratorHealth:
    """How close the generator itself came to its limits during the run."""

    cpu_s: float
    cpu_s_per_request: float | None
    ceiling_rps: float | None
    send_rate: float
    lateness_s: Distribution
    warnings: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What the run was asked to do, repeated in the summary so a file explains itself."""

    workload: str
    target: str
    rate: float | None
    duration_s: float
    time_scale: float
    seed: int
    planned: int
    extra: dict[str, Any] = field(default_factory=dict)


def summarise_class(records: Sequence[RequestRecord], elapsed_s: float, slo: Slo | None = None) -> ClassSummary:
    ok = [r for r in records if r.ok]
    errors = [r for r in records if not r.ok]
    met = sum(1 for r in records if r.slo_met)
    per_s = (1 / elapsed_s) if elapsed_s > 0 else 0.0
    return ClassSummary(
        requests=len(records),
        ok=len(ok),
        request_throughput=len(ok) * per_s,
        input_token_throughput=sum(r.tokens_in or 0 for r in ok) * per_s,
        output_token_throughput=sum(r.tokens_out or 0 for r in ok) * per_s,
        ttft_s=Distribution.of(r.ttft_s for r in ok if r.ttft_s is not None),
        itl_s=Distribution.of(gap for r in ok for gap in r.itl_values),
        tpot_s=Distribution.of(t for r in ok if (t := r.tpot_s) is not None),
        e2e_s=Distribution.of(r.e2e_s for r in ok if r.e2e_s is not None),
        errors_by_status=_count(str(r.status) for r in errors),
        errors_by_reason=_count(r.error or "none" for r in errors),
        slo_met=met,
        goodput_rps=goodput(met, elapsed_s),
        slo_attainment=attainment(met, len(records)),
        cached_tokens=sum(r.cached_tokens or 0 for r in ok),
        slo=None if slo is None else slo.model_dump(),
    )


def group_by(records: Sequence[RequestRecord], key: Callable[[RequestRecord], str]) -> dict[str, list[RequestRecord]]:
    """Records per key value, keys in order of first appearance."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(key(record), []).append(record)
    return groups


def elapsed(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    start = min(r.t_send for r in records)
    end = max(r.t_send + (r.e2e_s or 0.0) for r in records)
    return end - start


def generator_health(
    records: Sequence[RequestRecord], *, cpu_s: float, rate: float | None, slos: Sequence[Slo]
) -> GeneratorHealth:
    n = len(records)
    cpu_per = cpu_s / n if n else None
    ceiling = 1 / cpu_per if cpu_per else None
    sends = sorted(r.t_send for r in records)
    send_window = sends[-1] - sends[0] if n > 1 else 0.0
    send_rate = (n - 1) / send_window if send_window > 0 else 0.0
    lateness = Distribution.of(r.lateness_s for r in records)
    warnings = []
    if cpu_per is not None and ceiling is not None and send_rate > CEILING_FRACTION * ceiling:
        warnings.append(
            f"generator near its ceiling: sending {send_rate:.0f} req/s with {cpu_per * 1e3:.2f} ms CPU "
            f"per request (ceiling ≈ {ceiling:.0f} req/s on one core); latencies may include the generator"
        )
    limit = lateness_limit(rate or send_rate, slos)
    if lateness.p99 is not None and lateness.p99 > limit:
        warnings.append(
            f"generator falling behind: P99 send lateness {lateness.p99 * 1e3:.1f} ms exceeds "
            f"{limit * 1e3:.1f} ms; the offered load was lower and later than scheduled"
        )
    return GeneratorHealth(cpu_s, cpu_per, ceiling, send_rate, lateness, tuple(warnings))


def lateness_limit(rate: float, slos: Sequence[Slo] = ()) -> float:
    """The P99 send lateness beyond which a run is suspect: half the mean arrival gap, but never
    under `LATENESS_FLOOR_S`, and never over a tenth of the tightest TTFT SLO."""
    limit = max(CEILING_FRACTION / rate, LATENESS_FLOOR_S) if rate > 0 else LATENESS_FLOOR_S
    return min([limit, *(slo.ttft_ms / 1000 / 10 for slo in slos)])


def build_summary(
    records: Sequence[RequestRecord], *, info: RunInfo, slos: Mapping[str, Slo], cpu_s: float
) -> dict[str, Any]:
    """The whole ``summary.json`` document; ``slos`` are already scaled by the run's time scale."""
    span = elapsed(records)
    by_class: dict[str, list[RequestRecord]] = {name: [] for name in slos}
    for record in records:
        by_class.setdefault(record.class_name, []).append(record)
    effective_rate = info.rate / info.time_scale if info.rate is not None else None
    health = generator_health(records, cpu_s=cpu_s, rate=effective_rate, slos=list(slos.values()))
    return {
        **asdict(info),
        "effective_rate": effective_rate,
        "note": f"time scale {info.time_scale:g}: SLOs multiplied and the rate divided by it",
        "requests": len(records),
        "elapsed_s": span,
        "overall": asdict(summarise_class(records, span)),
        "classes": {name: asdict(summarise_class(rs, span, slos.get(name))) for name, rs in by_class.items()},
        "generator": asdict(health),
        "warnings": list(health.warnings),
    }


def write_summary(path: Path, summary: Mapping[str, Any]) -> None:
    path.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def read_summary(path: Path) -> dict[str, Any]:
    data = orjson.loads(path.read_bytes())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a summary")
    return data


def _count(keys: Any) -> dict[str, int]:
    return dict(Counter(keys).most_common())
