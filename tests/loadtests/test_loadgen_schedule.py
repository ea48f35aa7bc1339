"""Arrival schedules: the right mean rate and burstiness with a fixed seed, bounded in count and time."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import orjson
import pytest

from loadtests.loadgen.schedule import build_schedule, gamma_gaps, offsets_from_gaps, poisson_gaps
from loadtests.loadgen.workload import Arrival


def _gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]


def test_poisson_has_the_asked_mean_rate_and_unit_cv() -> None:
    offsets = offsets_from_gaps(poisson_gaps(50.0, random.Random(7)), duration_s=200, max_requests=None)
    gaps = _gaps(offsets)
    assert len(offsets) / 200 == pytest.approx(50, rel=0.03)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0], ids=["smoother than poisson", "bursty", "very bursty"])
def test_gamma_keeps_the_mean_rate_and_has_the_asked_cv(cv: float) -> None:
    gaps = [next(g) for g in [gamma_gaps(20.0, cv, random.Random(3))] for _ in range(40_000)]
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.08)


def test_the_same_seed_gives_the_same_schedule() -> None:
    def make(seed: int) -> list[float]:
        return build_schedule(Arrival(), rate=10, duration_s=5, max_requests=None, seed=seed, base_dir=Path())

    assert make(1) == make(1)
    assert make(1) != make(2)


@pytest.mark.parametrize(
    ("duration_s", "max_requests", "bound"),
    [(1.0, None, "time"), (100.0, 25, "count")],
    ids=["sending stops at the duration", "sending stops at the request cap"],
)
def test_schedules_are_bounded(duration_s: float, max_requests: int | None, bound: str) -> None:
    offsets = build_schedule(
        Arrival(), rate=100, duration_s=duration_s, max_requests=max_requests, seed=0, base_dir=Path()
    )
    assert all(t < duration_s for t in offsets)
    if bound == "count":
        assert len(offsets) == 25
    assert offsets == sorted(offsets)


def test_time_scale_divides_the_rate() -> None:
    offsets = build_schedule(
        Arrival(), rate=100, duration_s=100, max_requests=None, seed=0, base_dir=Path(), time_scale=10
    )
    assert len(offsets) / 100 == pytest.approx(10, rel=0.1)


def _trace(tmp_path: Path, stamps: list[float]) -> Arrival:
    lines = [orjson.dumps({"t_send": t, "class_name": "x", "extra": 1}) for t in stamps]
    (tmp_path / "trace.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return Arrival(process="trace", path="trace.jsonl")


def test_a_trace_replays_its_timestamps_relative_to_the_first(tmp_path: Path) -> None:
    arrival = _trace(tmp_path, [1000.5, 1000.0, 1001.0, 1003.0])
    offsets = build_schedule(arrival, rate=None, duration_s=10, max_requests=None, seed=0, base_dir=tmp_path)
    assert offsets == [0.0, 0.5, 1.0, 3.0]


def test_a_trace_is_compressed_to_an_asked_rate(tmp_path: Path) -> None:
    arrival = _trace(tmp_path, [0.0, 1.0, 2.0, 3.0])  # 1 req/s
    offsets = build_schedule(arrival, rate=4, duration_s=10, max_requests=None, seed=0, base_dir=tmp_path)
    assert offsets == pytest.approx([0.0, 0.25, 0.5, 0.75])


def test_a_trace_line_without_t_send_is_reported(tmp_path: Path) -> None:
    (tmp_path / "trace.jsonl").write_bytes(b'{"t_send": 1}\n{"t": 2}\n')
    arrival = Arrival(process="trace", path="trace.jsonl")
    with pytest.raises(ValueError, match=r"trace.jsonl:2: a trace line needs a numeric t_send"):
        build_schedule(arrival, rate=None, duration_s=10, max_requests=None, seed=0, base_dir=tmp_path)
