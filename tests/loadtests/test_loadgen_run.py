"""End to end on loopback: open-loop runs, records, summary, sweep, report, ceiling and the CLI."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from gateway.cli import main
from loadtests.loadgen.ceiling import measure_ceiling
from loadtests.loadgen.records import read_records
from loadtests.loadgen.runner import CANCELLED_AT_END, RunConfig, TargetRefused, check_target, run_workload
from loadtests.loadgen.workload import parse_workload
from tests.loadtests.fake_backend import FakeBackend
from tests.loadtests.test_loadgen_workload import VALID
from tests.servers import serve_in_thread

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://127.8.9.10:8000", True),
        ("http://[::1]:8000", True),
        ("http://localhost:8000/prefix", True),
        ("http://10.0.0.1:8000", False),
        ("http://example.com", False),
        ("http://[2001:db8::1]:80", False),
        ("ftp://127.0.0.1", False),
    ],
    ids=[
        "127.0.0.1 is loopback",
        "all of 127.0.0.0/8 is loopback",
        "IPv6 ::1 is loopback",
        "localhost is loopback",
        "a private address is refused",
        "a public host name is refused",
        "a public IPv6 address is refused",
        "a non-HTTP scheme is refused",
    ],
)
def test_only_loopback_targets_are_accepted(url: str, allowed: bool) -> None:
    if allowed:
        check_target(url)
    else:
        with pytest.raises(TargetRefused, match="--target"):
            check_target(url)


def test_the_cli_refuses_a_non_loopback_target_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["loadtest", "run", "--workload", "loadtests/workloads/demo.yaml", "--target", "http://192.0.2.1:80",
                 "--rate", "1", "--duration", "1", "--out", str(tmp_path), "--quiet"])  # fmt: skip
    assert code == 2
    assert "refusing a non-loopback host '192.0.2.1'" in capsys.readouterr().err
    assert not (tmp_path / "records.jsonl").exists()


def _workload_file(tmp_path: Path, **changes: Any) -> Path:
    data = {**VALID, "prefix": {"system_prompt_tokens": 32}, **changes}
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def backend() -> Iterator[tuple[str, FakeBackend]]:
    fake = FakeBackend(token_delay_s=0.001)
    with serve_in_thread(fake) as url:
        yield url, fake


def test_a_short_run_writes_records_summary_and_a_report_with_plots(
    tmp_path: Path, backend: tuple[str, FakeBackend]
) -> None:
    url, fake = backend
    out = tmp_path / "run"
    args = ["loadtest", "run", "--workload", str(_workload_file(tmp_path)), "--target", url, "--rate", "40",
            "--duration", "1", "--out", str(out), "--seed", "3", "--quiet"]  # fmt: skip
    assert main(args) == 0

    records = read_records(out / "records.jsonl")
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert 20 <= len(records) == summary["requests"] == summary["planned"] == len(fake.bodies)
    asked = {h["x-request-id"]: b["max_tokens"] for h, b in zip(fake.headers, fake.bodies, strict=True)}
    assert all(r.ok and r.slo_met for r in records)
    assert {r.request_id: r.tokens_out for r in records} == asked  # exact lengths, counted from usage
    assert {h["x-priority"] for h in fake.headers} == {"interactive", "batch"}
    assert set(summary["classes"]) == {"interactive", "batch"}
    for scope in [summary["overall"], *summary["classes"].values()]:
        assert scope["slo_attainment"] == 1.0
        assert {"p50", "p90", "p95", "p99", "mean"} <= scope["ttft_s"].keys()
    assert summary["generator"]["cpu_s_per_request"] > 0

    assert main(["loadtest", "report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "| run | rate |" in report
    for name in ("report-latency.png", "report-cdf.png", "report-goodput.png"):
        assert f"({name})" in report
        assert (out / name).read_bytes().startswith(PNG)


async def test_sending_never_waits_for_responses(tmp_path: Path) -> None:
    """Every request of a 0.5 s window goes out while the first responses are still 1 s away."""
    with serve_in_thread(FakeBackend(first_token_delay_s=1.0)) as url:
        config = RunConfig(target=url, rate=40, duration_s=0.5, out_dir=tmp_path, seed=1)
        result = await run_workload(parse_workload(VALID, source="x"), config, base_dir=tmp_path)
    first_token = min(r.t_send + (r.ttft_s or 0) for r in result.records)
    assert len(result.records) >= 10
    assert max(r.t_send for r in result.records) < first_token


async def test_spread_targets_each_get_part_of_the_requests_and_every_record_comes_back(tmp_path: Path) -> None:
    """Like a Service without session affinity: each request to one of the targets, at random."""
    fakes = [FakeBackend(), FakeBackend(), FakeBackend()]
    with serve_in_thread(fakes[0]) as a, serve_in_thread(fakes[1]) as b, serve_in_thread(fakes[2]) as c:
        config = RunConfig(target=a, spread_to=(b, c), rate=200, duration_s=0.5, out_dir=tmp_path, seed=1)
        result = await run_workload(parse_workload(VALID, source="x"), config, base_dir=tmp_path)
    counts = [len(fake.bodies) for fake in fakes]
    assert sum(counts) == len(result.records) >= 60
    assert all(r.ok for r in result.records)
    assert min(counts) >= len(result.records) / 6, f"each target gets a fair part: {counts}"


def test_a_spread_target_off_loopback_is_refused(tmp_path: Path) -> None:
    config = RunConfig(target="http://127.0.0.1:1", spread_to=("http://192.0.2.1:80",), rate=1, duration_s=1,
                       out_dir=tmp_path)  # fmt: skip
    with pytest.raises(TargetRefused):
        asyncio.run(run_workload(parse_workload(VALID, source="x"), config, base_dir=tmp_path))


async def test_stragglers_are_cancelled_and_recorded_after_the_drain_timeout(tmp_path: Path) -> None:
    with serve_in_thread(FakeBackend(first_token_delay_s=30)) as url:
        config = RunConfig(target=url, rate=20, duration_s=0.3, out_dir=tmp_path, drain_timeout_s=0.2)
        result = await run_workload(parse_workload(VALID, source="x"), config, base_dir=tmp_path)
    assert result.records
    assert {(r.status, r.error, r.slo_met) for r in result.records} == {(0, CANCELLED_AT_END, False)}
    assert result.summary["overall"]["errors_by_reason"] == {CANCELLED_AT_END: len(result.records)}


def test_a_sweep_writes_one_run_per_rate_and_its_findings(tmp_path: Path, backend: tuple[str, FakeBackend]) -> None:
    url, _ = backend
    out = tmp_path / "sweep"
    args = ["loadtest", "sweep", "--workload", str(_workload_file(tmp_path)), "--target", url, "--rates", "10,20",
            "--duration", "0.6", "--out", str(out), "--quiet"]  # fmt: skip
    assert main(args) == 0
    sweep = orjson.loads((out / "sweep.json").read_bytes())
    assert [p["rate"] for p in sweep["points"]] == [10, 20]
    assert {"saturation", "best_goodput", "max_rate_meeting_attainment"} <= sweep.keys()
    assert (out / "rate-10" / "summary.json").exists()
    assert (out / "rate-20" / "records.jsonl").exists()
    report = (out / "report.md").read_text()
    assert "## Findings" in report
    # Two series side by side: the sweep and one of its runs compared against it.
    assert main(["loadtest", "report", str(out), str(out / "rate-10"), "--out", str(tmp_path / "cmp.md")]) == 0
    assert (tmp_path / "cmp-latency.png").read_bytes().startswith(PNG)


def test_time_scale_is_stated_and_scales_slos(tmp_path: Path, backend: tuple[str, FakeBackend]) -> None:
    url, _ = backend
    args = ["loadtest", "run", "--workload", str(_workload_file(tmp_path)), "--target", url, "--rate", "100",
            "--duration", "0.5", "--time-scale", "10", "--out", str(tmp_path / "o"), "--quiet"]  # fmt: skip
    assert main(args) == 0
    summary = orjson.loads((tmp_path / "o" / "summary.json").read_bytes())
    assert summary["time_scale"] == 10
    assert summary["effective_rate"] == 10
    assert summary["classes"]["interactive"]["slo"]["ttft_ms"] == 5000


async def test_ceiling_ramps_until_the_generator_or_the_cap(tmp_path: Path) -> None:
    with serve_in_thread(FakeBackend(keep=False)) as url:
        document = await measure_ceiling(
            url, tmp_path, start_rate=50, max_rate=100, step_s=0.4, progress=lambda rate: nullcontext(None)
        )
    assert [s["rate"] for s in document["steps"]][:1] == [50]
    assert document["cpu_s_per_request"] is None or document["cpu_s_per_request"] > 0
    assert (tmp_path / "ceiling.json").exists()
