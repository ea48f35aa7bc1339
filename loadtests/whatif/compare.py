"""Two policies' replays side by side: every figure per repeat, its median, its spread, and a
verdict only where the sides differ beyond the run-to-run spread.

Figures, per side and per group (all requests, each class, each tenant), each computed on every
repeat: request count; TTFT, ITL and E2E P50/P95/P99 (``stats.Distribution``: linear
interpolation); goodput (requests that met their class's SLO per second of the replay's elapsed
trace time); SLO attainment (those over all requests sent: errors count as misses); requests
rejected or failed, in all and by reason code; prefix hit rate (cached over prompt tokens). Over
all requests only: the gateway's own rejections by reason (``SideRun.rejections``), engine load
(busy fraction, mean running and waiting requests, each averaged over the engines), cost per hour
and cost per goodput request (cost per hour × elapsed hours / requests that met their SLO).
ITL is every inter-token gap of the records that carry them (``RequestRecord.itl_s``); a record
without gaps (a gateway trace line, a whole answer) counts its TPOT once.

The flagging rule, written before the code:

* A figure's *value* is its median over a side's repeats; its *spread* is their range, min..max.
* A difference is flagged only when (1) each side has a value from at least ``MIN_REPEATS`` (2)
  repeats, (2) the two ranges do not overlap (one side's max below the other's min; touching
  ranges overlap), and (3) the medians differ by more than a floor: ``RELATIVE_FLOOR`` (5 %) of
  the current value for quantities (latencies, rates, counts, money), ``SHARE_FLOOR`` (1
  percentage point) for shares (attainment, hit rate, busy fraction), whose relative change says
  little near 100 %. From a current value of zero any change is infinitely large.
* With one repeat a side has no spread: noise cannot be told from a difference, so nothing is
  flagged (``Verdict.NOT_JUDGED``).
* A flagged figure is BETTER or WORSE by its metric's direction (lower latency, higher
  attainment...); figures with no better direction (request count, engine load) are HIGHER or LOWER.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from loadtests.loadgen.records import RequestRecord
from loadtests.loadgen.stats import Distribution, attainment, goodput
from loadtests.loadgen.summary import elapsed
from loadtests.whatif.model import EngineLoad, SideRun

RELATIVE_FLOOR = 0.05
SHARE_FLOOR = 0.01
MIN_REPEATS = 2
MAX_TENANTS = 10
"""Tenants shown one by one: the busiest ``MAX_TENANTS − 1``, the rest together as ``other``."""
OTHER_TENANTS = "other"
OVERALL = "all"
ERRORS_PREFIX = "errors:"
"""Requests the client saw fail, by reason code (the OpenAI error ``code``, else the status)."""
REJECTED_PREFIX = "rejected:"
"""Requests the gateway refused, by reason, from its own ``gateway_rejections_total``."""

Figures = dict[str, float | None]


class Better(StrEnum):
    LOWER = "lower"
    HIGHER = "higher"
    NEITHER = "neither"


class Verdict(StrEnum):
    NOT_JUDGED = "not judged"
    SAME = "within spread"
    BETTER = "better"
    WORSE = "worse"
    HIGHER = "higher"
    LOWER = "lower"

    @property
    def flagged(self) -> bool:
        return self not in (Verdict.NOT_JUDGED, Verdict.SAME)


@dataclass(frozen=True, slots=True)
class Metric:
    """One figure: ``unit`` is ``s``, ``share`` (0..1), ``req/s``, ``count``, ``mean``, ``$/h`` or ``$``."""

    key: str
    label: str
    unit: str
    better: Better

    @property
    def is_share(self) -> bool:
        return self.unit == "share"


def _latencies(name: str, label: str) -> tuple[Metric, ...]:
    return tuple(Metric(f"{name}_p{q}_s", f"{label} P{q}", "s", Better.LOWER) for q in (50, 95, 99))


METRICS: dict[str, Metric] = {
    m.key: m
    for m in (
        Metric("requests", "requests", "count", Better.NEITHER),
        *_latencies("ttft", "TTFT"),
        *_latencies("itl", "ITL"),
        *_latencies("e2e", "E2E"),
        Metric("goodput_rps", "goodput", "req/s", Better.HIGHER),
        Metric("attainment", "SLO attainment", "share", Better.HIGHER),
        Metric("errors", "rejected or failed", "count", Better.LOWER),
        Metric("prefix_hit_rate", "prefix hit rate", "share", Better.HIGHER),
        Metric("engines", "engines", "count", Better.NEITHER),
        Metric("engine_busy", "busy fraction per engine", "share", Better.NEITHER),
        Metric("engine_running", "running per engine", "mean", Better.NEITHER),
        Metric("engine_waiting", "waiting per engine", "mean", Better.NEITHER),
        Metric("cost_per_hour", "cost per hour", "$/h", Better.LOWER),
        Metric("cost_per_goodput_request", "cost per goodput request", "$", Better.LOWER),
    )
}


def metric(key: str) -> Metric:
    """The metric of a figure's key, including the per-reason counts (``errors:queue_full``)."""
    if key in METRICS:
        return METRICS[key]
    for prefix, label in ((ERRORS_PREFIX, "rejected or failed"), (REJECTED_PREFIX, "rejected by the gateway")):
        if key.startswith(prefix):
            return Metric(key, f"{label}: {key.removeprefix(prefix)}", "count", Better.LOWER)
    raise KeyError(key)


# --- figures of one repeat ---------------------------------------------------------------------


def itl_values(records: Sequence[RequestRecord]) -> list[float]:
    values: list[float] = []
    for record in records:
        if record.itl_s:
            values.extend(record.itl_s)
        elif (tpot := record.tpot_s) is not None:
            values.append(tpot)
    return values


def prefix_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    """Cached prompt tokens over prompt tokens, of the answered records that report them."""
    answered = [r for r in records if r.ok and r.tokens_in]
    prompt = sum(r.tokens_in or 0 for r in answered)
    return sum(r.cached_tokens or 0 for r in answered) / prompt if prompt else None


def error_reason(record: RequestRecord) -> str:
    return record.error or f"status {record.status}"


def group_figures(records: Sequence[RequestRecord], elapsed_s: float) -> Figures:
    """Every per-group figure of one repeat; goodput is per second of ``elapsed_s`` (trace time:
    the whole replay's for the overall group, the group's own span for a class or a tenant)."""
    ok = [r for r in records if r.ok]
    met = sum(1 for r in records if r.slo_met)
    figures: Figures = {"requests": float(len(records))}
    for name, values in (
        ("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]),
        ("itl", itl_values(ok)),
        ("e2e", [r.e2e_s for r in ok if r.e2e_s is not None]),
    ):
        d = Distribution.of(values)
        figures |= {f"{name}_p50_s": d.p50, f"{name}_p95_s": d.p95, f"{name}_p99_s": d.p99}
    figures["goodput_rps"] = goodput(met, elapsed_s)
    figures["attainment"] = attainment(met, len(records))
    figures["errors"] = float(len(records) - len(ok))
    figures["prefix_hit_rate"] = prefix_hit_rate(records)
    reasons = Counter(error_reason(r) for r in records if not r.ok)
    return figures | {ERRORS_PREFIX + reason: float(n) for reason, n in reasons.items()}


def goodput_requests(run: SideRun) -> int:
    return sum(1 for r in run.records if r.slo_met)


def cost_per_goodput_request(run: SideRun, cost_per_hour: float | None = None) -> float | None:
    """What the fleet cost over the replay divided by the requests that met their SLO: cost per
    hour × elapsed hours / goodput requests; None when unpriced or nothing met its SLO."""
    hourly = run.cost_per_hour if cost_per_hour is None else cost_per_hour
    met = goodput_requests(run)
    if not hourly or not met:
        return None
    return hourly * run.elapsed_s / 3600 / met


def engine_figures(engines: Sequence[EngineLoad]) -> Figures:
    if not engines:
        return {"engines": None, "engine_busy": None, "engine_running": None, "engine_waiting": None}
    return {
        "engines": float(len(engines)),
        "engine_busy": statistics.fmean(e.busy_fraction for e in engines),
        "engine_running": statistics.fmean(e.mean_running for e in engines),
        "engine_waiting": statistics.fmean(e.mean_waiting for e in engines),
    }


def run_figures(run: SideRun) -> Figures:
    """The overall figures of one repeat: its group figures plus what only the run knows."""
    figures = group_figures(run.records, run.elapsed_s)
    if run.prefix_hit_rate is not None:  # the replay's own measure wins over the records'
        figures["prefix_hit_rate"] = run.prefix_hit_rate
    figures |= engine_figures(run.engines)
    figures["cost_per_hour"] = run.cost_per_hour or None
    figures["cost_per_goodput_request"] = cost_per_goodput_request(run)
    return figures | {REJECTED_PREFIX + reason: float(n) for reason, n in run.rejections.items()}


# --- spreads and verdicts ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spread:
    """One figure over a side's repeats: per-repeat values (None where a repeat had nothing to
    measure), their median (the value shown) and their range (the spread)."""

    values: tuple[float | None, ...]

    @property
    def measured(self) -> tuple[float, ...]:
        return tuple(v for v in self.values if v is not None)

    @property
    def median(self) -> float | None:
        return statistics.median(self.measured) if self.measured else None

    @property
    def low(self) -> float | None:
        return min(self.measured, default=None)

    @property
    def high(self) -> float | None:
        return max(self.measured, default=None)

    def to_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "median": self.median, "low": self.low, "high": self.high}


def change(metric: Metric, current: float | None, candidate: float | None) -> float | None:
    """Candidate against current: absolute for shares, relative to current for quantities."""
    if current is None or candidate is None:
        return None
    if metric.is_share:
        return candidate - current
    if current == 0:
        return 0.0 if candidate == 0 else math.copysign(math.inf, candidate)
    return (candidate - current) / abs(current)


def judge(
    metric: Metric,
    current: Spread,
    candidate: Spread,
    *,
    relative_floor: float = RELATIVE_FLOOR,
    share_floor: float = SHARE_FLOOR,
) -> Verdict:
    """The flagging rule of the module docstring, in its order."""
    if len(current.measured) < MIN_REPEATS or len(candidate.measured) < MIN_REPEATS:
        return Verdict.NOT_JUDGED
    cur, cand = current.measured, candidate.measured
    if not (max(cur) < min(cand) or max(cand) < min(cur)):
        return Verdict.SAME
    delta = change(metric, current.median, candidate.median)
    if delta is None or abs(delta) <= (share_floor if metric.is_share else relative_floor):
        return Verdict.SAME
    higher = delta > 0
    if metric.better is Better.NEITHER:
        return Verdict.HIGHER if higher else Verdict.LOWER
    return Verdict.BETTER if higher == (metric.better is Better.HIGHER) else Verdict.WORSE


@dataclass(frozen=True, slots=True)
class Difference:
    """One figure of one group on both sides, and the verdict on them."""

    metric: Metric
    current: Spread
    candidate: Spread
    verdict: Verdict

    @property
    def change(self) -> float | None:
        return change(self.metric, self.current.median, self.candidate.median)

    def to_dict(self) -> dict[str, Any]:
        delta = self.change
        return {
            "label": self.metric.label,
            "unit": self.metric.unit,
            "better": str(self.metric.better),
            "current": self.current.to_dict(),
            "candidate": self.candidate.to_dict(),
            "change": None if delta is None or math.isinf(delta) else delta,
            "verdict": str(self.verdict),
        }


@dataclass(frozen=True, slots=True)
class GroupComparison:
    """The figures of one group (``scope`` is ``overall``, ``class`` or ``tenant``) by metric key,
    in display order."""

    scope: str
    name: str
    differences: Mapping[str, Difference]

    def __getitem__(self, key: str) -> Difference:
        return self.differences[key]

    def get(self, key: str) -> Difference | None:
        return self.differences.get(key)

    def keys_with(self, prefix: str) -> list[str]:
        return [key for key in self.differences if key.startswith(prefix)]

    def to_dict(self) -> dict[str, Any]:
        metrics = {key: d.to_dict() for key, d in self.differences.items()}
        return {"scope": self.scope, "name": self.name, "metrics": metrics}


@dataclass(frozen=True, slots=True)
class Comparison:
    """Both sides' repeats and every group's differences (see the module docstring)."""

    current: tuple[SideRun, ...]
    candidate: tuple[SideRun, ...]
    overall: GroupComparison
    classes: tuple[GroupComparison, ...]
    tenants: tuple[GroupComparison, ...]
    relative_floor: float = RELATIVE_FLOOR
    share_floor: float = SHARE_FLOOR

    @property
    def sides(self) -> tuple[str, str]:
        return self.current[0].side, self.candidate[0].side

    @property
    def judged(self) -> bool:
        """Whether any difference could be flagged: both sides were repeated."""
        return min(len(self.current), len(self.candidate)) >= MIN_REPEATS

    def groups(self) -> Iterator[GroupComparison]:
        yield self.overall
        yield from self.classes
        yield from self.tenants

    def flagged(self) -> list[tuple[GroupComparison, Difference]]:
        return [(g, d) for g in self.groups() for d in g.differences.values() if d.verdict.flagged]

    def to_dict(self) -> dict[str, Any]:
        return {
            "sides": list(self.sides),
            "repeats": {self.sides[0]: len(self.current), self.sides[1]: len(self.candidate)},
            "judged": self.judged,
            "rule": {
                "min_repeats": MIN_REPEATS,
                "relative_floor": self.relative_floor,
                "share_floor": self.share_floor,
            },
            "overall": self.overall.to_dict(),
            "classes": [g.to_dict() for g in self.classes],
            "tenants": [g.to_dict() for g in self.tenants],
            "engines": {
                side: _engines_dict(runs) for side, runs in zip(self.sides, (self.current, self.candidate), strict=True)
            },
        }


def _engines_dict(runs: Sequence[SideRun]) -> dict[str, Any]:
    fields = ("requests", "busy_fraction", "mean_running", "mean_waiting")
    return {e.engine: {name: getattr(e, name) for name in fields} for e in engine_medians(runs)}


def engine_medians(runs: Sequence[SideRun]) -> list[EngineLoad]:
    """Each engine's load, the median over the repeats it appears in, in order of appearance."""
    by_name: dict[str, list[EngineLoad]] = {}
    for run in runs:
        for engine in run.engines:
            by_name.setdefault(engine.engine, []).append(engine)
    return [
        EngineLoad(
            engine=name,
            requests=round(statistics.median(e.requests for e in loads)),
            busy_fraction=statistics.median(e.busy_fraction for e in loads),
            mean_running=statistics.median(e.mean_running for e in loads),
            mean_waiting=statistics.median(e.mean_waiting for e in loads),
            gpus=loads[0].gpus,
            price_per_gpu_hour=loads[0].price_per_gpu_hour,
        )
        for name, loads in by_name.items()
    ]


# --- the comparison ----------------------------------------------------------------------------


def compare(
    current: Sequence[SideRun],
    candidate: Sequence[SideRun],
    *,
    relative_floor: float = RELATIVE_FLOOR,
    share_floor: float = SHARE_FLOOR,
) -> Comparison:
    """Every figure of both sides, per group, judged by the rule of the module docstring."""
    if not current or not candidate:
        raise ValueError("each side needs at least one run to compare")

    def differences(cur: Sequence[Figures], cand: Sequence[Figures]) -> dict[str, Difference]:
        return _differences(cur, cand, relative_floor=relative_floor, share_floor=share_floor)

    overall = GroupComparison(
        "overall", OVERALL, differences([run_figures(r) for r in current], [run_figures(r) for r in candidate])
    )
    labels = tenant_labels([*current, *candidate])
    return Comparison(
        current=tuple(current),
        candidate=tuple(candidate),
        overall=overall,
        classes=_grouped("class", current, candidate, lambda r: r.class_name, differences),
        tenants=_grouped("tenant", current, candidate, lambda r: labels[r.tenant], differences),
        relative_floor=relative_floor,
        share_floor=share_floor,
    )


def tenant_labels(runs: Sequence[SideRun]) -> dict[str, str]:
    """Each tenant's row: its own for the ``MAX_TENANTS − 1`` busiest, ``other`` for the rest."""
    counts = Counter(r.tenant for run in runs for r in run.records)
    if len(counts) <= MAX_TENANTS:
        return {tenant: tenant for tenant in counts}
    kept = {tenant for tenant, _ in counts.most_common(MAX_TENANTS - 1)}
    return {tenant: tenant if tenant in kept else OTHER_TENANTS for tenant in counts}


def _grouped(
    scope: str,
    current: Sequence[SideRun],
    candidate: Sequence[SideRun],
    key: Callable[[RequestRecord], str],
    differences: Callable[[Sequence[Figures], Sequence[Figures]], dict[str, Difference]],
) -> tuple[GroupComparison, ...]:
    """One comparison per group, busiest first (``other`` last)."""
    counts = Counter(key(r) for run in (*current, *candidate) for r in run.records)
    names = sorted(counts, key=lambda name: (name == OTHER_TENANTS, -counts[name], name))

    def figures(runs: Sequence[SideRun], name: str) -> list[Figures]:
        # A group's goodput is per second of its own span (first send to last answer): a class
        # the candidate did not change keeps its goodput even when another class's backlog
        # makes the whole replay end later.
        groups = ([r for r in run.records if key(r) == name] for run in runs)
        return [group_figures(records, elapsed(records)) for records in groups]

    return tuple(
        GroupComparison(scope, name, differences(figures(current, name), figures(candidate, name))) for name in names
    )


def _differences(
    current: Sequence[Figures], candidate: Sequence[Figures], *, relative_floor: float, share_floor: float
) -> dict[str, Difference]:
    out: dict[str, Difference] = {}
    for key in _ordered_keys([*current, *candidate]):
        m = metric(key)
        cur = Spread(tuple(_value(f, key) for f in current))
        cand = Spread(tuple(_value(f, key) for f in candidate))
        out[key] = Difference(m, cur, cand, judge(m, cur, cand, relative_floor=relative_floor, share_floor=share_floor))
    return out


def _ordered_keys(figures: Sequence[Figures]) -> list[str]:
    """The fixed metrics in catalogue order, then the per-reason counts in alphabetical order."""
    present = {key for f in figures for key in f}
    return [k for k in METRICS if k in present] + sorted(present - METRICS.keys())


def _value(figures: Figures, key: str) -> float | None:
    """A figure of a repeat; a reason that a repeat never saw counted zero times there."""
    if key in figures:
        return figures[key]
    return 0.0 if key not in METRICS else None
