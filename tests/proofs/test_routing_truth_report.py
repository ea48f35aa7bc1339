"""The engine-truth bench's figures (``loadtests/proofs/routing_truth_report.py``): stale hit predictions
from a trace log, the gateway's forget signals from its log, the goals and the table."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from loadtests.proofs.routing_truth_report import (
    main,
    restart_signals,
    stale_predictions,
    truth_goals,
    truth_summary,
    truth_totals,
)

RESTART = 1_000.0
TOKENS_PER_HASH = 64


def line(t: float, backend: str, hashes: list[str], predicted: int, cached: int = 0) -> dict[str, Any]:
    """A trace-log line: dispatched at epoch ``t``, a prompt of one block per hash."""
    return {
        "t_dispatch": t,
        "backend": backend,
        "prefix_hashes": hashes,
        "tokens_in": TOKENS_PER_HASH * len(hashes),
        "predicted_cached_tokens": predicted,
        "cached_tokens": cached,
    }


CHAIN = [f"h{i}" for i in range(10)]
TRACE = [
    line(RESTART - 5, "engine-0", CHAIN, 640),  # before the restart: not counted
    line(RESTART + 0.4, "engine-1", CHAIN, 640),  # another engine
    line(RESTART + 0.8, "engine-0", CHAIN, 600, 0),  # stale: predicts 600 of a chain never sent since
    line(RESTART + 2.0, "engine-0", ["y0", "y1", "y2", "y3"], 200, 0),  # stale again, after the index was cleared
    line(RESTART + 4.0, "engine-0", CHAIN, 500, 448),  # the chain was sent since: an honest prediction
    line(RESTART + 6.0, "engine-0", ["x1", "x2"], 0, 0),  # no prediction: routed after the last stale
]


def test_stale_predictions_count_what_the_restarted_engine_cannot_hold_and_when_the_last_came() -> None:
    found = stale_predictions(TRACE, "engine-0", RESTART, k=4.0, cleared_at=RESTART + 1.0)
    assert found["routed_after"] == 4
    assert found["stale_hit_predictions"] == 2
    assert found["stale_predicted_tokens"] == 800
    assert (found["first_stale_s"], found["last_stale_s"]) == (0.2, 0.5)  # simulated: wall / k
    assert found["routed_after_last_stale"] == 2
    assert found["stale_after_index_cleared"] == 1


def test_without_an_index_watch_there_is_no_count_after_the_clear() -> None:
    assert stale_predictions(TRACE, "engine-0", RESTART, k=1.0)["stale_after_index_cleared"] is None
    assert stale_predictions(TRACE, "engine-0", RESTART, k=1.0, cleared_at=RESTART)["stale_after_index_cleared"] == 2


def _stamp(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch)) + f",{int(epoch % 1 * 1000):03d}"


@pytest.mark.parametrize(
    ("message", "signal"),
    [
        ("backend engine-0 restarted: forgetting what was learnt about it", "scrape (work counters went back)"),
        ("backend engine-0 is now unhealthy", "down"),
        ("kv events of engine-0: the engine restarted (batch 1 after 812)", "kv events (batch numbers went back)"),
    ],
    ids=["a scrape", "a health check", "the kv-event feed"],
)
def test_each_forget_signal_of_the_restarted_engine_is_found_with_its_time(message: str, signal: str) -> None:
    stop = float(int(time.time())) + 0.5
    log = "\n".join(
        [
            f"{_stamp(stop + 2)} WARNING gateway: {message.replace('engine-0', 'engine-10')}",  # another backend
            f"{_stamp(stop - 30)} WARNING gateway: {message}",  # long before the stop
            f"{_stamp(stop + 2)} WARNING gateway: {message}",
        ]
    )
    assert restart_signals(log, "engine-0", stop, k=4.0) == [{"signal": signal, "after_stop_s": 0.5}]


def _run(
    mode: str, hit: float, stale: int, last: float | None, cleared: float | None, after: int | None
) -> dict[str, Any]:
    prompt = 10_000
    return {
        "mode": mode,
        "repetition": 1,
        "built": True,
        "requests": 10,
        "ok": 10,
        "prompt_tokens": prompt,
        "cached_tokens": int(hit * prompt),
        "computed_tokens": prompt - int(hit * prompt),
        "hit_rate": hit,
        "ttft_ms": {"p50": 10.0, "p95": 100.0},
        "after_restart": {"prompt_tokens": prompt, "cached_tokens": int(hit * prompt), "hit_rate": hit},
        "engines": {"computed_tokens": 20_000, "steps_later_than_10ms": 0.01},
        "restart": {
            "stale_hit_predictions": stale,
            "last_stale_s": last,
            "routed_after_last_stale": 3,
            "after_s": 20.0,
            "signals": [],
            "index_cleared_s": cleared,
            "stale_after_index_cleared": after,
        },
        "load_average_start": [1.0, 1.0, 1.0],
    }


def _totals(events: dict[str, Any]) -> dict[str, dict[str, Any]]:
    runs = [
        _run("estimate", 0.80, 5, 1.0, None, None),
        _run("closed-loop", 0.84, 4, 0.9, None, None),
        events,
        _run("oracle", 0.86, 0, None, None, None),
    ]
    return {r["mode"]: truth_totals([r]) for r in runs}


def test_events_that_match_the_oracle_and_stop_at_the_clear_meet_both_goals() -> None:
    goals = truth_goals(_totals(_run("events", 0.855, 1, 0.05, 0.04, 0)), ttl_s=600)
    assert goals["events_hit_rate_vs_oracle"]["met"]
    assert goals["events_hit_rate_vs_oracle"]["value"] == pytest.approx(0.855 / 0.86)
    assert goals["events_stop_after_restart"]["met"]
    assert goals["events_stop_after_restart"]["value"] == 0
    assert goals["closed_loop_gap_recovered"]["value"] == pytest.approx(4 / 6)
    assert goals["estimate_stops_within_ttl"]["met"]


@pytest.mark.parametrize(
    ("events", "missed"),
    [
        (_run("events", 0.80, 0, None, 0.04, 0), "events_hit_rate_vs_oracle"),
        (_run("events", 0.86, 3, 2.0, 0.04, 2), "events_stop_after_restart"),
        (_run("events", 0.86, 0, None, None, None), "events_stop_after_restart"),
    ],
    ids=["a hit rate short of the oracle's", "stale predictions after the clear", "an index never seen empty"],
)
def test_events_miss_a_goal(events: dict[str, Any], missed: str) -> None:
    assert not truth_goals(_totals(events), ttl_s=600)[missed]["met"]


def test_a_mode_that_did_not_run_says_why_in_its_goals_and_the_table() -> None:
    why = "not run: the engines count with the simulator's tokenizer and publish no KV events"
    totals = _totals({"mode": "events", "repetition": 1, "built": False, "why": why})
    goals = truth_goals(totals, ttl_s=600)
    assert goals["events_hit_rate_vs_oracle"]["note"] == f"events: {why}"
    report = {
        "load": _load(),
        "load_average_start": [1.0, 1.0, 1.0],
        "load_average_end": [2.0, 2.0, 2.0],
        "totals": totals,
        "runs": [],
        "goals": goals,
    }
    assert f"events               {why}" in truth_summary(report)


def _load() -> dict[str, Any]:
    return {
        "config": "pressure",
        "engines": 3,
        "profile": "p",
        "kv_cache_tokens": 1,
        "restart_engine": 0,
        "tenants": 8,
        "conversations": 6,
        "turns": 6,
        "at_once": 8,
        "interleave": 2,
        "system_words": 1,
        "user_words": 1,
        "reply_tokens": 1,
        "direct_share": 0.3,
        "direct_words": 1,
        "time_scale": 4,
        "index_ttl_s": 600,
        "engine_tokenizer": "bench",
    }


def test_the_table_shows_when_the_events_index_was_emptied_and_what_came_after() -> None:
    totals = _totals(_run("events", 0.855, 1, 0.05, 0.04, 0))
    report = {
        "load": _load(),
        "load_average_start": [1.0, 1.0, 1.0],
        "load_average_end": [2.0, 2.0, 2.0],
        "totals": totals,
        "runs": [],
        "goals": truth_goals(totals, 600),
    }
    text = truth_summary(report)
    assert "configuration pressure:" in text
    assert "index of the restarted engine dropped 0.04 s after the restart; stale hit predictions after that: 0" in text
    assert "events_stop_after_restart: 0.000" in text


@pytest.mark.parametrize("folder", ["routing-truth", "routing-truth-pressure"])
def test_the_committed_results_render_again_as_committed(
    folder: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    committed = Path(__file__).resolve().parents[2] / "loadtests" / "results" / folder
    if not (committed / "results.json").exists():
        pytest.skip(f"{folder} has no committed results")
    (tmp_path / "results.json").write_text((committed / "results.json").read_text())
    assert main([str(tmp_path / "results.json"), "--write"]) == 0
    assert (tmp_path / "summary.txt").read_text() == (committed / "summary.txt").read_text()
    assert json.loads((committed / "results.json").read_text())["runs"]  # the file itself is left as it was
    assert capsys.readouterr().out == ""
