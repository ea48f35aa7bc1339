"""The comparison of two policies' replays: figures from known records, the spread rule, cost.

``record`` and ``side_run`` build the values a replay returns; the report and plan tests use them too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from loadtests.loadgen.records import RequestRecord
from loadtests.whatif.compare import (
    MAX_TENANTS,
    METRICS,
    OTHER_TENANTS,
    Metric,
    Spread,
    Verdict,
    compare,
    cost_per_goodput_request,
    group_figures,
    judge,
    metric,
    run_figures,
)
from loadtests.whatif.model import EngineLoad, SideRun

EPOCH = 1_700_000_000.0


def record(
    i: int,
    *,
    class_name: str = "interactive",
    tenant: str = "acme",
    ttft_s: float | None = 0.1,
    itl_s: tuple[float, ...] = (0.02, 0.02),
    e2e_s: float | None = 0.5,
    status: int = 200,
    error: str | None = None,
    slo_met: bool = True,
    tokens_in: int | None = 100,
    cached_tokens: int | None = 0,
    tokens_out: int | None = 3,
) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}",
        t_send=EPOCH + i,
        class_name=class_name,
        tenant=tenant,
        model="m",
        stream=True,
        status=status,
        error=error,
        ttft_s=ttft_s,
        itl_s=itl_s,
        e2e_s=e2e_s,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        cached_tokens=cached_tokens,
        slo_met=slo_met,
    )


def refused(
    i: int, reason: str = "queue_full", *, class_name: str = "interactive", tenant: str = "acme"
) -> RequestRecord:
    """A request the gateway refused: no latencies, no tokens, a miss."""
    return record(
        i,
        class_name=class_name,
        tenant=tenant,
        ttft_s=None,
        itl_s=(),
        e2e_s=None,
        status=503,
        error=reason,
        slo_met=False,
        tokens_in=None,
        cached_tokens=None,
        tokens_out=None,
    )


def engine(name: str, *, busy: float = 0.5, running: float = 2.0, waiting: float = 0.0) -> EngineLoad:
    return EngineLoad(name, 10, busy, running, waiting, gpus=2, price_per_gpu_hour=2.5)


def side_run(
    side: str,
    repeat: int,
    records: Sequence[RequestRecord],
    *,
    elapsed_s: float = 100.0,
    engines: Sequence[EngineLoad] = (),
    rejections: Mapping[str, int] | None = None,
    prefix_hit_rate: float | None = None,
) -> SideRun:
    return SideRun(
        side=side,
        repeat=repeat,
        records=tuple(records),
        elapsed_s=elapsed_s,
        engines=tuple(engines),
        rejections=dict(rejections or {}),
        prefix_hit_rate=prefix_hit_rate,
    )


def latency_run(side: str, repeat: int, ttft_s: float, *, batch_ttft_s: float = 1.0) -> SideRun:
    """Twenty interactive requests at about ``ttft_s`` (a few ms apart per repeat) and twenty batch."""
    jitter = 0.002 * repeat
    interactive = [record(i, ttft_s=ttft_s + jitter + i * 1e-4) for i in range(20)]
    batch = [record(100 + i, class_name="batch", tenant="globex", ttft_s=batch_ttft_s + jitter) for i in range(20)]
    return side_run(side, repeat, interactive + batch, engines=[engine("e0"), engine("e1")])


def spread(*values: float | None) -> Spread:
    return Spread(tuple(values))


TTFT_P99 = METRICS["ttft_p99_s"]
ATTAINMENT = METRICS["attainment"]
REQUESTS = METRICS["requests"]
ERRORS = METRICS["errors"]


@pytest.mark.parametrize(
    ("m", "current", "candidate", "expected"),
    [
        (TTFT_P99, spread(0.10, 0.20), spread(0.15, 0.30), Verdict.SAME),
        (TTFT_P99, spread(0.10, 0.15), spread(0.15, 0.20), Verdict.SAME),
        (TTFT_P99, spread(0.100, 0.110), spread(0.200, 0.210), Verdict.WORSE),
        (TTFT_P99, spread(0.200, 0.210), spread(0.100, 0.110), Verdict.BETTER),
        (TTFT_P99, spread(0.100, 0.101), spread(0.103, 0.104), Verdict.SAME),
        (ATTAINMENT, spread(0.90, 0.91), spread(0.97, 0.98), Verdict.BETTER),
        (ATTAINMENT, spread(0.990, 0.991), spread(0.995, 0.996), Verdict.SAME),
        (ATTAINMENT, spread(0.990, 0.991), spread(0.970, 0.975), Verdict.WORSE),
        (TTFT_P99, spread(0.1), spread(0.5), Verdict.NOT_JUDGED),
        (TTFT_P99, spread(None, 0.1), spread(0.5, 0.6), Verdict.NOT_JUDGED),
        (REQUESTS, spread(100, 100), spread(120, 121), Verdict.HIGHER),
        (ERRORS, spread(0, 0), spread(5, 6), Verdict.WORSE),
        (ERRORS, spread(0, 0), spread(0, 0), Verdict.SAME),
    ],
    ids=[
        "overlapping ranges are never flagged, however far apart the medians",
        "touching ranges overlap",
        "separated ranges beyond 5 % make a higher latency worse",
        "separated ranges beyond 5 % make a lower latency better",
        "separated ranges within 5 % of each other are not flagged",
        "a higher attainment beyond the spread is better",
        "shares differing by under one percentage point are not flagged",
        "shares differing by two points beyond the spread are flagged",
        "one repeat per side judges nothing",
        "a repeat with nothing measured does not count as a repeat",
        "a figure with no better direction is only higher or lower",
        "errors appearing from none are worse",
        "no errors on either side is the same",
    ],
)
def test_the_spread_rule(m: Metric, current: Spread, candidate: Spread, expected: Verdict) -> None:
    assert judge(m, current, candidate) is expected


def test_per_group_figures_from_known_records() -> None:
    records = [
        record(0, ttft_s=0.1, itl_s=(0.01, 0.03), e2e_s=1.0, tokens_in=100, cached_tokens=50),
        record(1, ttft_s=0.2, itl_s=(0.02,), e2e_s=2.0, tokens_in=300, cached_tokens=0, slo_met=False),
        record(2, ttft_s=0.3, itl_s=(), e2e_s=3.0, tokens_in=100, cached_tokens=100, tokens_out=11),
        record(3, ttft_s=0.4, itl_s=(0.04,), e2e_s=4.0, tokens_in=None, cached_tokens=None),
        refused(4, "queue_full"),
        refused(5, "rate_limited"),
        refused(6, "queue_full"),
    ]
    figures = group_figures(records, elapsed_s=10.0)
    assert figures["requests"] == 7
    assert figures["ttft_p50_s"] == pytest.approx(0.25)
    assert figures["ttft_p99_s"] == pytest.approx(0.397)
    # gaps 0.01, 0.03, 0.02, 0.04 and record 2's TPOT (3.0 - 0.3) / 10 = 0.27
    assert figures["itl_p50_s"] == pytest.approx(0.03)
    assert figures["itl_p99_s"] == pytest.approx(0.04 + 0.96 * (0.27 - 0.04))
    assert figures["e2e_p95_s"] == pytest.approx(3.85)
    assert figures["goodput_rps"] == pytest.approx(3 / 10)
    assert figures["attainment"] == pytest.approx(3 / 7)
    assert figures["errors"] == 3
    assert figures["errors:queue_full"] == 2
    assert figures["errors:rate_limited"] == 1
    assert figures["prefix_hit_rate"] == pytest.approx(150 / 500)


def test_a_group_with_nothing_answered_has_no_latencies_and_zero_attainment() -> None:
    figures = group_figures([refused(0), refused(1)], elapsed_s=5.0)
    assert figures["ttft_p99_s"] is None
    assert figures["prefix_hit_rate"] is None
    assert figures["attainment"] == 0
    assert figures["goodput_rps"] == 0


def test_cost_per_goodput_request_is_cost_per_hour_times_elapsed_hours_over_goodput_requests() -> None:
    met = [record(i) for i in range(50)]
    missed = [record(50 + i, slo_met=False) for i in range(30)]
    run = side_run("current", 0, met + missed, elapsed_s=360.0, engines=[engine("e0"), engine("e1")])
    assert run.cost_per_hour == pytest.approx(2 * 2 * 2.5)  # two engines of two GPUs at $2.5
    assert cost_per_goodput_request(run) == pytest.approx(10.0 * 0.1 / 50)
    assert cost_per_goodput_request(run, cost_per_hour=20.0) == pytest.approx(20.0 * 0.1 / 50)
    nothing_met = side_run("current", 0, missed, elapsed_s=360.0, engines=[engine("e0")])
    assert cost_per_goodput_request(nothing_met) is None
    unpriced = side_run("current", 0, met, elapsed_s=360.0, engines=[EngineLoad("e0", 1, 0.5, 1.0, 0.0)])
    assert cost_per_goodput_request(unpriced) is None


def test_run_figures_add_engine_load_cost_and_the_gateways_rejections() -> None:
    run = side_run(
        "current",
        0,
        [record(i, tokens_in=100, cached_tokens=10) for i in range(10)],
        elapsed_s=3600.0,
        engines=[engine("e0", busy=0.2, running=1.0, waiting=0.0), engine("e1", busy=0.6, running=3.0, waiting=2.0)],
        rejections={"queue_full": 4},
        prefix_hit_rate=0.42,
    )
    figures = run_figures(run)
    assert figures["engines"] == 2
    assert figures["engine_busy"] == pytest.approx(0.4)
    assert figures["engine_running"] == pytest.approx(2.0)
    assert figures["engine_waiting"] == pytest.approx(1.0)
    assert figures["cost_per_hour"] == pytest.approx(10.0)
    assert figures["cost_per_goodput_request"] == pytest.approx(1.0)
    assert figures["rejected:queue_full"] == 4
    assert figures["prefix_hit_rate"] == pytest.approx(0.42), "the replay's own hit rate wins over the records'"


def test_a_slower_candidate_is_flagged_worse_for_its_class_only() -> None:
    current = [latency_run("current", r, 0.100) for r in range(2)]
    candidate = [latency_run("candidate", r, 0.300) for r in range(2)]
    comparison = compare(current, candidate)
    assert comparison.judged
    assert comparison.sides == ("current", "candidate")
    interactive, batch = (next(g for g in comparison.classes if g.name == n) for n in ("interactive", "batch"))
    assert interactive["ttft_p99_s"].verdict is Verdict.WORSE
    assert interactive["ttft_p99_s"].change == pytest.approx(0.2 / 0.10288, rel=1e-3)
    assert batch["ttft_p99_s"].verdict is Verdict.SAME
    assert interactive["attainment"].verdict is Verdict.SAME, "every request still met its SLO"
    assert interactive["ttft_p99_s"].current.values == pytest.approx((0.1019, 0.1039), abs=1e-4)
    flagged = {(g.name, d.metric.key) for g, d in comparison.flagged()}
    assert ("interactive", "ttft_p99_s") in flagged
    assert ("batch", "ttft_p99_s") not in flagged
    assert [g.name for g in comparison.tenants] == ["acme", "globex"]


def test_one_repeat_per_side_flags_nothing() -> None:
    comparison = compare([latency_run("current", 0, 0.1)], [latency_run("candidate", 0, 0.9)])
    assert not comparison.judged
    assert comparison.flagged() == []
    assert comparison.classes[0]["ttft_p99_s"].verdict is Verdict.NOT_JUDGED


def test_a_reason_seen_on_one_side_only_counts_zero_on_the_other() -> None:
    current = [side_run("current", r, [record(i) for i in range(10)]) for r in range(2)]
    candidate = [
        side_run("candidate", r, [record(i) for i in range(8)] + [refused(8), refused(9)], rejections={"queue_full": 2})
        for r in range(2)
    ]
    comparison = compare(current, candidate)
    errors = comparison.overall["errors:queue_full"]
    assert errors.current.values == (0.0, 0.0)
    assert errors.candidate.values == (2.0, 2.0)
    assert errors.verdict is Verdict.WORSE
    assert comparison.overall["rejected:queue_full"].verdict is Verdict.WORSE
    assert metric("rejected:queue_full").label == "rejected by the gateway: queue_full"


def test_tenants_beyond_the_busiest_are_folded_into_other() -> None:
    records = [record(100 * t + i, tenant=f"t{t:02d}") for t in range(MAX_TENANTS + 2) for i in range(t + 1)]
    runs = [side_run("current", r, records) for r in range(2)]
    comparison = compare(runs, [side_run("candidate", r, records) for r in range(2)])
    names = [g.name for g in comparison.tenants]
    assert len(names) == MAX_TENANTS
    assert names[-1] == OTHER_TENANTS
    assert names[0] == f"t{MAX_TENANTS + 1:02d}", "the busiest tenant first"
    assert comparison.tenants[-1]["requests"].current.median == 1 + 2 + 3


def test_comparison_json_document_carries_every_repeat_and_the_rule() -> None:
    comparison = compare(
        [latency_run("current", r, 0.1) for r in range(2)], [latency_run("candidate", r, 0.3) for r in range(3)]
    )
    document = comparison.to_dict()
    assert document["repeats"] == {"current": 2, "candidate": 3}
    assert document["rule"] == {"min_repeats": 2, "relative_floor": 0.05, "share_floor": 0.01}
    interactive = next(c for c in document["classes"] if c["name"] == "interactive")
    ttft = interactive["metrics"]["ttft_p99_s"]
    assert len(ttft["candidate"]["values"]) == 3
    assert ttft["verdict"] == "worse"
    assert set(document["engines"]["current"]) == {"e0", "e1"}


def test_no_runs_on_a_side_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one run"):
        compare([], [latency_run("candidate", 0, 0.1)])
