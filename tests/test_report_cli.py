"""`inference-gateway report TRACE.jsonl...`: tables per class, tenant and backend, and the plots."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.telemetry.tracelog import ItlSummary, TraceLog, trace_line
from loadtests.loadgen import report_cli
from loadtests.loadgen.records import RequestRecord
from loadtests.loadgen.trace_report import MAX_GROUPS, OTHER, bucket_width, folded, over_time, read_traces

EPOCH = 1_700_000_000.0


def line(
    i: int, *, tenant: str = "acme", class_name: str = "interactive", ok: bool = True, backend: str = "b1"
) -> bytes:
    t = float(i)
    record = trace_line(
        request_id=f"r{i}",
        epoch_offset=EPOCH,
        t_arrival=t,
        t_admit=t,
        t_dispatch=t + 0.01 if ok else None,
        t_first_token=t + 0.2 if ok else None,
        t_end=t + 1.0,
        class_name=class_name,
        tenant=tenant,
        model="test/chat",
        stream=True,
        status=200 if ok else 503,
        outcome="completed" if ok else "queue_full",
        backend=backend if ok else "",
        queue_s=0.01 if ok else 0.0,
        itl=ItlSummary.of([0.02, 0.04, 0.02]) if ok else None,
        tokens_in=10,
        tokens_out=4 if ok else None,
        slo_met=ok and i % 2 == 0,
    )
    return TraceLog.serialise(record)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    report_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


@pytest.fixture
def traces(tmp_path: Path) -> list[Path]:
    older, newer = tmp_path / "trace.jsonl.1", tmp_path / "trace.jsonl"
    older.write_bytes(b"".join(line(i, backend="b2") for i in range(50, 100)))
    newer.write_bytes(
        b"".join(line(i) for i in range(0, 40))
        + b"".join(line(i, class_name="batch", tenant="globex", ok=False) for i in range(40, 50))
    )
    return [newer, older]


def test_the_report_has_a_table_per_class_tenant_and_backend_and_its_plots(
    traces: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out" / "traffic.md"
    assert run(["report", *map(str, traces), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    text = out.read_text()
    for heading in ("## Per class", "## Per tenant", "## Per backend", "## Over time"):
        assert heading in text
    assert "| interactive | 90 | 90 | 50.0% |" in text
    assert "| batch | 10 | 0 | 0.0% |" in text
    assert "queue_full: 10" in text
    assert "| b2 | 50 | 50 |" in text
    assert "| - | 10 | 0 |" in text  # rejected requests never reached a backend
    assert "| 200 | 200 | 20.0 | 20.0 |" in text  # TTFT P50/P99 200 ms; ITL = each request's median gap, 20 ms
    for plot in ("traffic-over-time.png", "traffic-breakdown.png"):
        assert (tmp_path / "out" / plot).read_bytes().startswith(b"\x89PNG")


def test_files_are_merged_in_arrival_order(traces: list[Path]) -> None:
    records = read_traces(traces)
    assert [r.request_id for r in records] == [f"r{i}" for i in range(100)]


def test_over_time_buckets_cover_the_span_with_empty_buckets_kept(traces: list[Path]) -> None:
    records = [r for r in read_traces(traces) if r.request_id in {"r0", "r1", "r7"}]
    assert bucket_width(read_traces(traces)) == 2.0  # 100 s over 60 buckets, rounded up
    assert [(t, [r.request_id for r in b]) for t, b in over_time(records, 3.0)] == [
        (0.0, ["r0", "r1"]),
        (3.0, []),
        (6.0, ["r7"]),
    ]


def test_tenants_beyond_the_busiest_fold_into_other() -> None:
    records = [
        RequestRecord.from_json(line(i, tenant=f"t{i % (MAX_GROUPS + 5)}")) for i in range(10 * (MAX_GROUPS + 5))
    ]
    groups = folded(records, lambda r: r.tenant)
    assert len(groups) == MAX_GROUPS
    assert len(groups[OTHER]) == 10 * 6
    assert sum(map(len, groups.values())) == len(records)


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "No such file"), (b"", "no request records"), (b"{not json\n", "not a request record")],
    ids=["a missing file", "an empty file", "a malformed line"],
)
def test_a_bad_input_exits_1_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, message: str
) -> None:
    path = tmp_path / "trace.jsonl"
    if content is not None:
        path.write_bytes(content)
    assert run(["report", str(path), "--out", str(tmp_path / "r.md")]) == 1
    assert message in capsys.readouterr().err


def test_a_load_generator_record_keeps_every_gap_and_a_trace_line_its_median() -> None:
    generated = RequestRecord.from_json(line(0)).to_dict() | {"itl_s": [0.01, 0.03]}
    assert RequestRecord.from_dict(generated).itl_values == (0.01, 0.03)
    assert RequestRecord.from_json(line(0)).itl_values == (0.02,)
