"""The what-if report and the plan report: the files written, and what a reader must find in them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from loadtests.whatif.compare import compare
from loadtests.whatif.model import ReplayRequest, StageSettings, Trace
from loadtests.whatif.plan import QUEUE_VARIANTS
from loadtests.whatif.report import (
    ATTAINMENT_PNG,
    COMPARISON_FILE,
    PLAN_JSON,
    PLAN_PNG,
    TTFT_CDF_PNG,
    write_plan_report,
    write_report,
)
from tests.whatif.test_compare import latency_run, refused, side_run
from tests.whatif.test_plan import ScriptedReplayer, needs, run_plan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SETTINGS = StageSettings(profile="h100-llama8b", engines=2, speed=4.0)
TRACE = Trace(
    requests=tuple(
        ReplayRequest(i * 3.0, "acme", None, "m", True, 100, 20, 64, ("00000000000000aa",)) for i in range(41)
    ),
    source="gateway",
    path=Path("trace.jsonl"),
)


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path.name} is not a PNG"


def worse_candidate_report(tmp_path: Path) -> Path:
    current = [latency_run("current", r, 0.100) for r in range(2)]
    slower = [latency_run("candidate", r, 0.300).records for r in range(2)]
    refusals = [refused(900), refused(901, "rate_limited")]
    candidate = [side_run("candidate", r, [*slower[r], *refusals], rejections={"queue_full": 1}) for r in range(2)]
    return write_report(
        compare(current, candidate),
        tmp_path / "out",
        title="What-if: candidate.yaml against current.yaml",
        settings=SETTINGS,
        trace=TRACE,
        traffic=2.0,
        policies={"current": Path("current.yaml"), "candidate": Path("candidate.yaml")},
    )


def test_the_report_holds_the_headline_table_the_setup_and_the_spread_rule(tmp_path: Path) -> None:
    path = worse_candidate_report(tmp_path)
    text = path.read_text(encoding="utf-8")
    assert path.name == "report.md"
    assert "| class | figure | current | candidate | change | verdict |" in text
    headline = text.split("## Headline")[1].split("## Per tenant")[0]
    ttft_row = next(line for line in headline.splitlines() if line.startswith("| interactive | TTFT P99"))
    assert "**worse**" in ttft_row
    assert "103 (102–104)" in ttft_row, "median (min–max) over the repeats, in ms"
    batch_row = next(line for line in headline.splitlines() if line.startswith("| batch | TTFT P99"))
    assert "within spread" in batch_row
    assert "Spread rule" in text
    assert "do not overlap" in text
    assert "5%" in text
    assert "**4×**" in text, "the time compression is stated"
    assert "**x2**" in text, "the traffic scaling is stated"
    assert "`h100-llama8b`, 2 per served model" in text
    assert "current ran 2 repeats and candidate 2, alternated" in text
    assert "| acme | TTFT P99" in text, "the per-tenant table"
    assert "rejected by the gateway: queue_full" in text
    assert "rejected or failed: rate_limited" in text
    assert "## Prefix cache" in text
    assert "## Engine load" in text
    assert "| current | e0 |" in text
    assert "cost per goodput request" in text


def test_the_report_writes_its_plots_and_a_machine_readable_twin(tmp_path: Path) -> None:
    out = worse_candidate_report(tmp_path).parent
    assert_png(out / TTFT_CDF_PNG)
    assert_png(out / ATTAINMENT_PNG)
    document = orjson.loads((out / COMPARISON_FILE).read_bytes())
    assert document["setup"]["speed"] == 4.0
    assert document["setup"]["traffic"] == 2.0
    assert document["judged"] is True
    interactive = next(c for c in document["classes"] if c["name"] == "interactive")
    assert interactive["metrics"]["ttft_p99_s"]["verdict"] == "worse"
    assert len(interactive["metrics"]["ttft_p99_s"]["current"]["values"]) == 2


def test_with_one_repeat_per_side_the_report_says_nothing_can_be_flagged(tmp_path: Path) -> None:
    comparison = compare([latency_run("current", 0, 0.1)], [latency_run("candidate", 0, 0.9)])
    trace = replace(TRACE, skipped=3)
    path = write_report(comparison, tmp_path, title="t", settings=StageSettings("fixed"), trace=trace)
    text = path.read_text(encoding="utf-8")
    assert "Nothing can be flagged here" in text
    assert "3 lines left out" in text
    assert "**worse**" not in text
    assert "not judged" in text
    assert "none (replayed in real time)" in text
    assert "one per backend the policy names" in text


def test_a_report_without_classes_still_plots(tmp_path: Path) -> None:
    """Only refused requests: no latency to plot, every figure a dash."""
    runs = [side_run(side, r, [refused(i) for i in range(3)]) for side in ("current", "candidate") for r in range(2)]
    path = write_report(compare(runs[:2], runs[2:]), tmp_path, title="t", settings=SETTINGS, trace=TRACE)
    assert_png(tmp_path / TTFT_CDF_PNG)
    assert "| interactive | TTFT P99 (ms) | – | – | – |" in path.read_text(encoding="utf-8")


async def test_the_plan_report_gives_the_answer_and_every_size_tried(tmp_path: Path) -> None:
    result = await run_plan(ScriptedReplayer(needs(5)), tmp_path, variants=QUEUE_VARIANTS)
    path = write_plan_report(
        result, tmp_path / "plan", title="Capacity plan: demo.yaml", settings=SETTINGS, trace=TRACE, traffic=2.0
    )
    text = path.read_text(encoding="utf-8")
    assert "**5 engines with queues as-written meet interactive ≥ 99.0%, batch ≥ 90.0% in every repeat; " in text
    assert "$12.45 per hour" in text
    assert "worst" in text
    table = text.split("## Every size tried")[1].splitlines()
    rows = [line for line in table if line.startswith("| ") and not line.startswith("|---")]
    assert len(rows) - 1 == len(result.trials), "one row per trial, after the header"
    assert any(row.startswith("| 5 | as-written |") and "yes ← chosen" in row for row in rows)
    assert any(row.startswith("| 4 | as-written |") and "| no |" in row for row in rows)
    assert_png(path.parent / PLAN_PNG)
    document = orjson.loads((path.parent / PLAN_JSON).read_bytes())
    assert document["engines"] == 5
    assert document["cost_per_hour"] == pytest.approx(5 * 2.49)
    assert len(document["trials"]) == len(result.trials)


async def test_the_plan_report_says_when_there_is_no_answer(tmp_path: Path) -> None:
    result = await run_plan(ScriptedReplayer(needs(40)), tmp_path, max_engines=4)
    text = write_plan_report(result, tmp_path, title="t", settings=SETTINGS, trace=TRACE).read_text(encoding="utf-8")
    assert "No fleet of up to 4 engines meets" in text
