"""Percentile, SLO, goodput and attainment arithmetic on known inputs; sweep findings."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from loadtests.loadgen.records import RequestRecord
from loadtests.loadgen.stats import Distribution, attainment, goodput, meets_slo, percentile, scaled_slo
from loadtests.loadgen.summary import RunInfo, build_summary, summarise_class
from loadtests.loadgen.sweep import Criteria, SweepPoint, analyse, parse_rates
from loadtests.loadgen.workload import Slo


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),
        (list(range(1, 101)), 99, 99.01),
        (list(range(1, 101)), 50, 50.5),
        ([10], 99, 10),
        ([1, 2], 0, 1),
        ([1, 2], 100, 2),
        ([0, 10], 90, 9),
    ],
    ids=[
        "the median of four values interpolates the middle two",
        "P99 of 1..100 is 99.01",
        "P50 of 1..100 is 50.5",
        "one value is every percentile",
        "P0 is the minimum",
        "P100 is the maximum",
        "P90 of two values is nine tenths of the way",
    ],
)
def test_percentile_on_known_inputs(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_agrees_with_numpy_linear() -> None:
    rng = random.Random(1)
    for n in (2, 3, 7, 100, 1001):
        values = sorted(rng.lognormvariate(0, 1) for _ in range(n))
        for q in (50, 90, 95, 99, 99.9):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="within"):
        percentile([1.0], 101)


def test_distribution_reports_mean_with_percentiles_and_nothing_for_no_data() -> None:
    d = Distribution.of([4.0, 1.0, 3.0, 2.0])
    assert (d.count, d.mean, d.p50) == (4, 2.5, 2.5)
    assert d.p99 == pytest.approx(3.97)
    assert Distribution.of([]) == Distribution(0, None, None, None, None, None)


SLO = Slo(ttft_ms=500, tpot_ms=30, e2e_ms=5000)


@pytest.mark.parametrize(
    ("kwargs", "met"),
    [
        ({"ok": True, "ttft_s": 0.5, "tpot_s": 0.03, "e2e_s": 5.0}, True),
        ({"ok": True, "ttft_s": 0.501, "tpot_s": 0.01, "e2e_s": 1.0}, False),
        ({"ok": True, "ttft_s": 0.1, "tpot_s": 0.031, "e2e_s": 1.0}, False),
        ({"ok": True, "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 5.1}, False),
        ({"ok": False, "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 1.0}, False),
        ({"ok": True, "ttft_s": 0.1, "tpot_s": None, "e2e_s": 0.1}, True),
    ],
    ids=[
        "exactly at every limit meets the SLO",
        "a slow first token misses",
        "slow decoding misses",
        "a slow end to end misses",
        "a failed request never meets its SLO",
        "a one-token answer is judged without TPOT",
    ],
)
def test_meets_slo(kwargs: dict[str, Any], met: bool) -> None:
    assert meets_slo(SLO, **kwargs) is met


def test_time_scale_multiplies_every_slo() -> None:
    assert scaled_slo(SLO, 10) == Slo(ttft_ms=5000, tpot_ms=300, e2e_ms=50000)


def test_goodput_and_attainment() -> None:
    assert goodput(30, 10.0) == 3.0
    assert attainment(30, 40) == 0.75
    assert attainment(0, 0) is None


def _record(i: int, *, cls: str = "a", ok: bool = True, met: bool = True, t: float = 0.0, e2e: float = 1.0,
            itl: tuple[float, ...] = (0.01, 0.03)) -> RequestRecord:  # fmt: skip
    return RequestRecord(
        request_id=str(i), t_send=1000.0 + t, class_name=cls, tenant="x", model="m", stream=True,
        status=200 if ok else 429, error=None if ok else "rate_limit_exceeded", ttft_s=0.1 if ok else None,
        itl_s=itl if ok else (), e2e_s=e2e, tokens_in=100, tokens_out=3 if ok else None, cached_tokens=40,
        slo_met=met and ok,
    )  # fmt: skip


def test_class_summary_counts_throughput_goodput_and_errors() -> None:
    records = [_record(0, t=0), _record(1, t=1, met=False), _record(2, t=2, ok=False), _record(3, t=9)]
    summary = summarise_class(records, elapsed_s=10.0)
    assert (summary.requests, summary.ok, summary.slo_met) == (4, 3, 2)
    assert summary.request_throughput == pytest.approx(0.3)
    assert summary.output_token_throughput == pytest.approx(0.9)  # 3 ok × 3 tokens (from usage) / 10 s
    assert summary.goodput_rps == pytest.approx(0.2)
    assert summary.slo_attainment == pytest.approx(0.5)  # the error counts as a miss
    assert summary.errors_by_status == {"429": 1}
    assert summary.errors_by_reason == {"rate_limit_exceeded": 1}
    assert summary.itl_s.count == 6  # every gap of every successful request
    assert summary.tpot_s.p50 == pytest.approx((1.0 - 0.1) / 2)


def test_run_summary_is_per_class_and_overall_and_states_the_scale() -> None:
    records = [_record(0, cls="a", t=0), _record(1, cls="b", t=1, met=False), _record(2, cls="a", t=3, e2e=1.0)]
    info = RunInfo(workload="w", target="t", rate=20, duration_s=4, time_scale=10, seed=0, planned=3)
    summary = build_summary(records, info=info, slos={"a": SLO, "b": SLO, "c": SLO}, cpu_s=0.003)
    assert summary["elapsed_s"] == pytest.approx(4.0)  # first send to last response
    assert summary["time_scale"] == 10
    assert summary["effective_rate"] == 2
    assert summary["overall"]["slo_met"] == 2
    assert summary["classes"]["a"]["goodput_rps"] == pytest.approx(0.5)
    assert summary["classes"]["c"]["requests"] == 0  # a class that got no traffic is still listed
    assert summary["generator"]["cpu_s_per_request"] == pytest.approx(0.001)
    assert summary["generator"]["ceiling_rps"] == pytest.approx(1000)


def test_summary_warns_when_the_generator_nears_its_ceiling() -> None:
    records = [_record(i, t=i * 0.01) for i in range(100)]  # sending at 100 req/s
    info = RunInfo(workload="w", target="t", rate=100, duration_s=1, time_scale=1, seed=0, planned=100)
    summary = build_summary(records, info=info, slos={"a": SLO}, cpu_s=0.6)  # 6 ms/request: ceiling 167/s
    assert any("near its ceiling" in w for w in summary["warnings"])


def test_summary_warns_when_sends_are_late() -> None:
    records = [replace(_record(i, t=i * 0.1), lateness_s=0.06) for i in range(20)]  # 10 req/s, 60 ms late
    info = RunInfo(workload="w", target="t", rate=10, duration_s=2, time_scale=1, seed=0, planned=20)
    summary = build_summary(records, info=info, slos={"a": SLO}, cpu_s=0.0)
    assert any("falling behind" in w for w in summary["warnings"])  # 60 ms > min(half the 100 ms gap, TTFT SLO / 10)


def _point(rate: float, thr: float, *, errors: float = 0.0, ttft: float = 0.1, att: float = 1.0) -> SweepPoint:
    return SweepPoint(rate, f"rate-{rate:g}", rate, thr, thr * att, att, errors, ttft, 0.01, 1.0)


@pytest.mark.parametrize(
    ("points", "saturation", "reason"),
    [
        ([_point(10, 9), _point(20, 18), _point(40, 36)], None, None),
        ([_point(10, 9), _point(20, 18), _point(40, 20)], 40, "throughput stopped rising"),
        ([_point(10, 9), _point(20, 16), _point(40, 30)], None, None),
        ([_point(10, 9), _point(20, 18, errors=0.05)], 20, "errors 5.0%"),
        ([_point(10, 9), _point(20, 18, ttft=0.6)], 20, "TTFT P99 6.0×"),
    ],
    ids=[
        "throughput rising with the rate is not saturated",
        "throughput that stops rising saturates",
        "throughput rising a little slower than the rate is not saturated",
        "errors saturate",
        "a P99 blow-up saturates",
    ],
)
def test_sweep_saturation(points: list[SweepPoint], saturation: float | None, reason: str | None) -> None:
    findings = analyse(points)
    if saturation is None:
        assert findings["saturation"] is None
    else:
        assert findings["saturation"]["rate"] == saturation
        assert any(r.startswith(reason or "") for r in findings["saturation"]["reasons"])
        assert findings["saturation"]["max_sustainable_rate"] == points[points.index(
            next(p for p in points if p.rate == saturation)) - 1].rate  # fmt: skip


def test_sweep_best_goodput_and_attainment_target() -> None:
    points = [_point(10, 9, att=1.0), _point(20, 18, att=0.95), _point(40, 30, att=0.5)]
    findings = analyse(points, Criteria(attainment_target=0.9))
    assert findings["best_goodput"] == {"rate": 20, "goodput_rps": pytest.approx(17.1)}
    assert findings["max_rate_meeting_attainment"] == 20


@pytest.mark.parametrize("text", ["", "10,5", "a,b", "0,1"], ids=["empty", "decreasing", "not numbers", "zero"])
def test_parse_rates_refuses_bad_lists(text: str) -> None:
    with pytest.raises(ValueError, match="--rates"):
        parse_rates(text)
