"""The canary bench's pure parts (``loadtests/proofs/canary.py``): no process is started here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gateway.service import parse_policy
from loadtests.proofs import canary
from loadtests.proofs.canary import (
    DEFAULT_STEPS,
    RESERVED_PORTS,
    SCENARIOS,
    RunResult,
    bench_port,
    engine_requests,
    format_table,
    parse_args,
    percentile,
    policy_text,
    spread,
    summarize,
)


def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile([7.0], 95) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match=r"within 0\.\.100"):
        percentile(values, 101)


def test_spread_of_nothing_is_nan() -> None:
    assert spread([1.0, 2.0, 10.0]) == {"n": 3, "p50": 2.0, "p95": pytest.approx(9.2), "max": 10.0}
    empty = spread([])
    assert empty["n"] == 0
    assert all(math.isnan(empty[k]) for k in ("p50", "p95", "max"))


def _run(scenario: str, verdict: str, seconds: float | None, candidate: float | None, steps: list[float]) -> RunResult:
    run = RunResult(scenario, steps, 0, SCENARIOS[scenario].expect, verdict=verdict)
    run.seconds_to_verdict, run.candidate_requests, run.requests_before_verdict = seconds, candidate, 100
    return run


def test_summary_counts_wrong_verdicts_and_spreads_only_decided_runs() -> None:
    steps = [5.0, 25.0, 50.0, 100.0]
    runs = [
        _run("healthy", "promoted", 20.0, 80.0, steps),
        _run("healthy", "rolled_back", 10.0, 30.0, steps),  # wrong
        _run("healthy", "timeout", None, None, steps),  # no verdict: not wrong, not in the spread
        _run("slow_2x", "rolled_back", 8.0, 12.0, steps),
        _run("slow_2x", "promoted", 30.0, 90.0, steps),  # wrong
        _run("failing", "error", None, None, steps),
        _run("healthy", "promoted", 12.0, 50.0, [20.0, 50.0, 100.0]),
    ]
    rows = {(r["steps"], r["scenario"]): r for r in summarize(runs)}
    healthy = rows[("5,25,50,100", "healthy")]
    assert healthy["runs"] == 3
    assert healthy["wrong"] == 1
    assert healthy["no_verdict"] == 1
    assert healthy["verdicts"] == {"promoted": 1, "rolled_back": 1, "timeout": 1}
    assert healthy["seconds_to_verdict"] == {"n": 2, "p50": 15.0, "p95": pytest.approx(19.5), "max": 20.0}
    assert healthy["candidate_requests"]["max"] == 80.0
    assert rows[("5,25,50,100", "slow_2x")]["wrong"] == 1
    assert rows[("5,25,50,100", "failing")]["no_verdict"] == 1
    assert rows[("20,50,100", "healthy")]["wrong"] == 0
    table = format_table(summarize(runs))
    assert "20,50,100" in table
    assert "15.0 / 19.5 / 20.0" in table
    assert len(table.splitlines()) == 2 + len(rows)


def test_arguments_have_the_briefs_defaults() -> None:
    args = parse_args([])
    assert args.repeats == 5
    assert args.out == Path("loadtests/results/canary")
    assert args.interval_s == 0.5
    assert args.rate == 40.0
    assert args.steps == list(DEFAULT_STEPS)
    assert args.scenarios == ("slow_2x", "failing", "healthy")
    args = parse_args(["--repeats", "2", "--rate", "20", "--steps", "10,100", "--scenarios", "healthy", "--out", "x"])
    assert (args.repeats, args.rate, args.steps, args.scenarios, args.out) == (
        2,
        20.0,
        [(10.0, 100.0)],
        ("healthy",),
        Path("x"),
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "5,25,50"],
        ["--steps", "50,25,100"],
        ["--steps", "a,100"],
        ["--scenarios", "slow_3x"],
        ["--rate", "0"],
    ],
)
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


@pytest.mark.parametrize("steps", DEFAULT_STEPS)
def test_the_policy_loads_with_the_gateways_loader(steps: tuple[float, ...]) -> None:
    text = policy_text("http://127.0.0.1:1", "http://127.0.0.1:2", steps=steps, interval_s=0.5)
    snapshot = parse_policy(text, "canary-bench")
    (group,) = snapshot.policy.model_groups
    assert group.name == canary.GROUP
    rollout = group.rollout
    assert rollout is not None
    assert (rollout.baseline, rollout.candidate) == ("v1", "v2")
    assert rollout.steps == steps
    assert (rollout.interval_s, rollout.min_requests) == (0.5, 20)
    assert snapshot.policy.admin.key_hashes
    assert {b.name: b.url for b in snapshot.policy.backends} == {
        "engine-a": "http://127.0.0.1:1",
        "engine-b": "http://127.0.0.1:2",
    }


def test_engine_requests_count_every_finish_reason_and_injected_faults() -> None:
    samples = canary._parse(
        "# TYPE vllm:request_success counter\n"
        'vllm:request_success_total{finished_reason="length",model_name="m"} 7\n'
        'vllm:request_success_total{finished_reason="stop",model_name="m"} 2\n'
        'vllm:request_success_total{finished_reason="abort",model_name="m"} 1\n'
        "# TYPE sim:faults_injected counter\n"
        'sim:faults_injected_total{mode="fail_503"} 4\n'
    )
    assert engine_requests(samples) == 14


def test_bench_ports_avoid_the_reserved_range(monkeypatch: pytest.MonkeyPatch) -> None:
    offered = iter([19000, 19799, 30001, 30001, 30002])
    monkeypatch.setattr(canary, "free_port", lambda: next(offered))
    taken: set[int] = set()
    assert [bench_port(taken), bench_port(taken)] == [30001, 30002]
    assert not taken & set(RESERVED_PORTS)
