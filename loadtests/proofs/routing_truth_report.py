"""The engine-truth bench's figures and report: what a run's records say, the goals, the text table.

Usage (the summary again from a run's results, e.g. after the table's format changed)::

    python -m loadtests.proofs.routing_truth_report loadtests/results/routing-truth/results.json [--write]

``loadtests/proofs/routing_truth.py`` runs the modes and keeps what each run left behind: the
gateway's trace log, its log, its metrics, the engines' counters, the time the restarted
engine's KV-event index was seen empty. Everything here is a pure function of those records (no
process, no clock), so that how a figure is computed can be read, tested and re-run apart from
the minutes a run takes:

* ``stale_predictions``: requests routed to the restarted engine after its restart expecting
  more of their prompt cached than the engine was sent since (the trace log's block chains, two
  blocks of slack as ``cache_report.MISS_SLACK_BLOCKS``). An empty cache cannot honour those:
  they are the gateway believing in a cache that is gone. How many, when the last came
  (simulated s after the restart), and, for KV events, how many came after the gateway's index
  of that engine was dropped (the fresh engine's ``AllBlocksCleared``, or the feed seeing the
  engine's batch numbers go back): the goal "within one event batch" is none.
* ``restart_signals``: the gateway's log lines that voided what it knew of the engine.
* ``truth_totals``, ``truth_goals``, ``truth_summary``: a mode over its repetitions, issue 30's
  goals, the text table (``summary.txt``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.dispatch.cache_report import MISS_SLACK_BLOCKS
from loadtests.harness.processes import Samples, metric_sum
from loadtests.loadgen.stats import percentile
from loadtests.proofs.routing_system import loads

RESTART_SIGNALS = {
    "backend {backend} restarted: forgetting": "scrape (work counters went back)",
    "backend {backend} is now unhealthy": "down",
    "kv events of {backend}: the engine restarted": "kv events (batch numbers went back)",
}
"""The gateway's log lines that void what it learnt of a backend (``BackendPool.restarted``,
``mark_down``: a failed health check or a refused connection; the KV-event subscriber's reset),
and what each says."""


def engine_truth(marks: dict[str, Any], restarted: int) -> dict[str, Any]:
    """What the engines counted over the run (gateway and direct requests): the restarted engine's
    counters are its first process's until the restart plus its second's."""
    start, before, end = marks["start"], marks["before_restart"], marks["end"]

    def delta(i: int, key: str) -> float:
        if i == restarted:
            return float(before[i][key] - start[i][key] + end[i][key])
        return float(end[i][key] - start[i][key])

    queries = [delta(i, "queries") for i in range(len(start))]
    hits = [delta(i, "hits") for i in range(len(start))]
    steps = sum(delta(i, "steps") for i in range(len(start)))
    return {
        "prompt_tokens": sum(queries),
        "computed_tokens": sum(queries) - sum(hits),
        "computed_per_engine": [q - h for q, h in zip(queries, hits, strict=True)],
        "requests_per_engine": [delta(i, "finished") for i in range(len(start))],
        "steps_later_than_10ms": round(sum(delta(i, "steps_late") for i in range(len(start))) / steps, 4)
        if steps
        else None,
    }


def stale_predictions(
    lines: Sequence[dict[str, Any]], backend: str, restart_at: float, k: float, cleared_at: float | None = None
) -> dict[str, Any]:
    """Requests the gateway sent to the restarted engine after its restart (epoch ``restart_at``)
    expecting it to hold more of the prompt than it was sent since (see the module docstring);
    ``cleared_at``: when the gateway's KV-event index of the engine was seen empty (epoch), or None.
    Times in simulated seconds after the restart (wall seconds / ``k``)."""
    after = sorted((ln for ln in lines if (ln.get("t_dispatch") or 0) >= restart_at), key=lambda ln: ln["t_dispatch"])
    held: set[str] = set()
    routed = 0
    stale: list[tuple[float, int, int, float]] = []
    for line in after:
        if line.get("backend") != backend:
            continue
        routed += 1
        hashes, prompt = line.get("prefix_hashes") or [], line.get("tokens_in") or 0
        predicted = line.get("predicted_cached_tokens") or 0
        if hashes and prompt:
            sent_since = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
            if predicted > (sent_since + MISS_SLACK_BLOCKS) * prompt / len(hashes):
                at = line["t_dispatch"]
                stale.append(((at - restart_at) / k, predicted, line.get("cached_tokens") or 0, at))
        held.update(hashes)
    last = stale[-1][0] if stale else None
    return {
        "routed_after": routed,
        "stale_hit_predictions": len(stale),
        "stale_predicted_tokens": sum(s[1] for s in stale),
        "stale_cached_tokens": sum(s[2] for s in stale),
        "first_stale_s": round(stale[0][0], 2) if stale else None,
        "last_stale_s": round(last, 2) if last is not None else None,
        "routed_after_last_stale": sum(
            1
            for ln in after
            if ln.get("backend") == backend and last is not None and ln["t_dispatch"] > restart_at + last * k
        ),
        "stale_after_index_cleared": None if cleared_at is None else sum(s[3] >= cleared_at for s in stale),
    }


def restart_signals(log: str, backend: str, since: float, k: float) -> list[dict[str, Any]]:
    """The gateway's log lines, from the engine's stop (epoch ``since``) on, that voided what it
    learnt of the restarted engine (``RESTART_SIGNALS``), with when (simulated s after the stop)."""
    needles = {needle.format(backend=backend): signal for needle, signal in RESTART_SIGNALS.items()}
    found = []
    for line in log.splitlines():
        for needle, signal in needles.items():
            if needle in line:
                at = _log_time(line)
                if at is not None and at >= since - 1:
                    found.append({"signal": signal, "after_stop_s": round((at - since) / k, 2)})
    return found


def _log_time(line: str) -> float | None:
    """The epoch seconds of a log line that starts with ``logging``'s asctime (local time)."""
    try:
        stamp, millis = line[:23].split(",")
        return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
    except ValueError:
        return None


def prediction_figures(samples: Samples) -> dict[str, Any]:
    """The gateway's own cache-truth counters: what it predicted, how much of it the engines held, misses."""
    predicted = metric_sum(samples, "gateway_predicted_cached_tokens_total")
    confirmed = metric_sum(samples, "gateway_predicted_cached_tokens_confirmed_total")
    return {
        "predicted_tokens": predicted,
        "confirmed_tokens": confirmed,
        "precision": round(confirmed / predicted, 4) if predicted else None,
        "misses": metric_sum(samples, "gateway_prefix_cache_misses_total"),
    }


def truth_totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode over its repetitions: token sums (the hit rate of the sums), the medians of the
    repetitions' TTFT percentiles, each repetition's restart figures."""
    done = [r for r in runs if r.get("built")]
    if not done:
        return {"built": False, "why": runs[0].get("why") if runs else None}

    def rate(figures: list[dict[str, Any]]) -> float | None:
        prompt = sum(f["prompt_tokens"] for f in figures)
        return round(sum(f["cached_tokens"] for f in figures) / prompt, 4) if prompt else None

    def median(values: list[float | None]) -> float | None:
        known = sorted(v for v in values if v is not None)
        return percentile(known, 50) if known else None

    restarts = [r["restart"] for r in done]
    return {
        "built": True,
        "repetitions": len(done),
        "requests": sum(r["requests"] for r in done),
        "ok": sum(r["ok"] for r in done),
        "prompt_tokens": sum(r["prompt_tokens"] for r in done),
        "computed_tokens": sum(r["computed_tokens"] for r in done),
        "hit_rate": rate(done),
        "hit_rate_after_restart": rate([r["after_restart"] for r in done]),
        "hit_rate_per_repetition": [r["hit_rate"] for r in done],
        "ttft_p50_ms": median([r["ttft_ms"]["p50"] for r in done]),
        "ttft_p95_ms": median([r["ttft_ms"]["p95"] for r in done]),
        "stale_hit_predictions": [x["stale_hit_predictions"] for x in restarts],
        "last_stale_s": [x["last_stale_s"] for x in restarts],
        "routed_after_last_stale": [x["routed_after_last_stale"] for x in restarts],
        "after_restart_s": [x["after_s"] for x in restarts],
        "restart_signals": sorted({s["signal"] for x in restarts for s in x["signals"]}),
        "index_cleared_s": [x.get("index_cleared_s") for x in restarts],
        "stale_after_index_cleared": [x.get("stale_after_index_cleared") for x in restarts],
    }


def truth_goals(totals: dict[str, dict[str, Any]], ttl_s: float) -> dict[str, Any]:
    """Issue 30's goals, from the modes' totals; a goal of a mode that did not run says why, with no figure."""
    out: dict[str, Any] = {}
    est, loop, events, oracle = (totals.get(m, {}) for m in ("estimate", "closed-loop", "events", "oracle"))
    if events and not events.get("built"):
        note = f"events: {events.get('why') or 'not built'}"
        out["events_hit_rate_vs_oracle"] = {"goal": ">= 0.98", "note": note}
        out["events_stop_after_restart"] = {"goal": "within one event batch", "note": note}
    elif events:
        if oracle.get("built"):
            value = events["hit_rate"] / oracle["hit_rate"] if oracle["hit_rate"] else None
            out["events_hit_rate_vs_oracle"] = {
                "value": value,
                "goal": ">= 0.98",
                "met": value is not None and value >= 0.98,
            }
        after = events["stale_after_index_cleared"]
        out["events_stop_after_restart"] = {
            "value": max((a for a in after if a is not None), default=None),
            "index_cleared_s": events["index_cleared_s"],
            "stale_hit_predictions": events["stale_hit_predictions"],
            "last_stale_s": events["last_stale_s"],
            "goal": "within one event batch: no stale hit prediction on the restarted engine once its "
            "index is dropped (the fresh engine's AllBlocksCleared, or its first batch), in every repetition",
            "met": bool(after) and all(a == 0 for a in after),
        }
    if est.get("built") and loop.get("built") and oracle.get("built"):
        gap = oracle["hit_rate"] - est["hit_rate"]
        value = (loop["hit_rate"] - est["hit_rate"]) / gap if gap > 0 else None
        saved = est["computed_tokens"] - oracle["computed_tokens"]
        out["closed_loop_gap_recovered"] = {
            "value": value,
            "estimate_to_oracle_gap": round(gap, 4),
            "prefill_gap_recovered": (est["computed_tokens"] - loop["computed_tokens"]) / saved if saved > 0 else None,
            "goal": ">= 0.5 of the estimate's hit-rate loss to the oracle",
            "met": value is not None and value >= 0.5,
        }
    if est.get("built"):
        last = [v for v in est["last_stale_s"] if v is not None]
        stopped = all(
            v is None or (v < ttl_s and after > 0)
            for v, after in zip(est["last_stale_s"], est["routed_after_last_stale"], strict=True)
        )
        out["estimate_stops_within_ttl"] = {
            "value": max(last) if last else None,
            "goal": f"the last stale hit prediction on the restarted engine within the index TTL ({ttl_s:g} s), "
            "and requests routed there after it",
            "met": stopped,
        }
    return out


def truth_summary(report: dict[str, Any]) -> str:
    """The report as text: the load, a row per mode (totals), a row per run, the goals."""
    w = report["load"]
    lines = [
        f"configuration {w.get('config', 'default')}: {w['engines']} engines ({w['profile']}, KV cache "
        f"{w['kv_cache_tokens']} tokens each), engine-{w['restart_engine']} restarted halfway; {w['tenants']} "
        f"tenants x {w['conversations']} conversations x {w['turns']} turns, {w['at_once']} workers x "
        f"{w['interleave']} open; system prompts {w['system_words']} tokens, user turns {w['user_words']}, replies "
        f"{w['reply_tokens']}; {w['direct_share']:.0%} of requests sent straight to an engine "
        f"({w['direct_words']}-token prompts); K = {w['time_scale']:g}; index TTL {w['index_ttl_s']:g} s; "
        f"engines count tokens with {w.get('engine_tokenizer', 'sim')}",
        f"load average {loads(report['load_average_start'])} at the start, "
        f"{loads(report['load_average_end'])} at the end",
        "",
        f"{'mode':20} {'hit rate':>8} {'after restart':>13} {'prefill computed':>16} {'TTFT p50':>9} "
        f"{'TTFT p95':>9}  stale hit predictions on the restarted engine: count; last (s after the restart); "
        "forget signals",
    ]
    for name, t in report["totals"].items():
        if not t.get("built"):
            lines.append(f"{name:20} {t.get('why') or 'not built'}")
            continue
        last = " ".join("-" if v is None else f"{v:.1f}" for v in t["last_stale_s"])
        stale = " ".join(map(str, t["stale_hit_predictions"]))
        lines.append(
            f"{name:20} {t['hit_rate']:8.1%} {t['hit_rate_after_restart'] or 0:13.1%} {t['computed_tokens']:16,.0f} "
            f"{_ms(t['ttft_p50_ms']):>9} {_ms(t['ttft_p95_ms']):>9}  {stale}; {last}; "
            f"{', '.join(t['restart_signals']) or 'none'}"
        )
        cleared = t.get("index_cleared_s") or []
        if any(c is not None for c in cleared):
            lines.append(
                f"{'':20} index of the restarted engine dropped "
                + " ".join("-" if c is None else f"{c:.2f}" for c in cleared)
                + " s after the restart; stale hit predictions after that: "
                + " ".join("-" if a is None else str(a) for a in t["stale_after_index_cleared"])
            )
    lines += [
        "",
        f"{'run':26} {'hit rate':>8} {'after restart':>13} {'computed':>9} {'all':>9} {'late':>6}  load avg",
    ]
    for r in report["runs"]:
        if r.get("built"):
            lines.append(
                f"{r['mode'] + ' #' + str(r['repetition']):26} {r['hit_rate']:8.1%} "
                f"{r['after_restart']['hit_rate'] or 0:13.1%} {r['computed_tokens']:9,.0f} "
                f"{r['engines']['computed_tokens']:9,.0f} {r['engines']['steps_later_than_10ms'] or 0:6.1%}  "
                f"{loads(r['load_average_start'])}"
            )
    lines.append("")
    for name, goal in report["goals"].items():
        if goal.get("note"):
            lines.append(f"{name}: {goal['note']} (goal {goal['goal']})")
        else:
            value = "-" if goal["value"] is None else f"{goal['value']:.3f}"
            lines.append(f"{name}: {value} (goal {goal['goal']}): {'met' if goal['met'] else 'MISSED'}")
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("results", type=Path, help="a run's results.json")
    parser.add_argument("--write", action="store_true", help="write summary.txt beside it (else print it)")
    args = parser.parse_args(argv)
    text = truth_summary(json.loads(args.results.read_text()))
    if args.write:
        (args.results.parent / "summary.txt").write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
