"""The floor plan's figures (``loadtests/proofs/architecture.py``), and the walls they keep."""

from __future__ import annotations

from pathlib import Path

from loadtests.proofs.architecture import imported, modules, report, stage_circles

ROOT = Path(__file__).resolve().parents[2]
MAX_TOP_FILES = 12
"""Issue 29: at most 12 modules at the top of ``gateway/``; every other belongs to a stage folder."""


def test_at_most_twelve_files_stay_at_the_top_of_the_gateway() -> None:
    top = sorted(p.name for p in (ROOT / "gateway").glob("*.py"))
    assert len(top) <= MAX_TOP_FILES, f"{len(top)} files at the top of gateway/: {top}; put the new one in its stage"


def test_the_report_says_each_figure() -> None:
    lines = report(ROOT)
    assert [line.split(":")[0] for line in lines if not line.startswith("  ")] == [
        "modules",
        "files at the top of gateway/",
        "longest import chain (layers)",
        "circles between stages",
        "layers with each stage one node",
        "modules with a test named after them",
        "modules with a test at the mirrored path",
    ]


def test_a_circle_between_stages_is_found_and_a_chain_is_not() -> None:
    chain = {"gateway.a.x": {"gateway.b.y"}, "gateway.b.y": {"gateway.c"}, "gateway.c": set()}
    circle = {**chain, "gateway.c": {"gateway.a.x"}}
    assert stage_circles(chain) == []
    assert stage_circles(circle) == [["a", "b", "c"]]


def test_the_gateway_s_stages_import_each_other_without_a_circle() -> None:
    found = modules(ROOT, "gateway")
    graph = {name: {t for t in imported(path) if t in found and t != name} for name, path in found.items()}
    assert stage_circles(graph) == [], "a stage imports one that imports it back: move the shared value down"
