"""The what-if documents: ``report.md`` (two policies side by side) and ``plan.md`` (a fleet size),
each with its JSON twin and PNG plots, like the load-test reports (``loadgen/report.py``).

``write_report`` writes, into one directory:

* ``report.md``: the setup (trace, traffic scaling, time compression, fleet, repeats, policies),
  the spread rule, the headline table (per class: TTFT P99, attainment, goodput, rejections),
  then per tenant, latency percentiles, rejections by reason, prefix hit rate, engine load, cost;
  each cell ``median (min–max)`` over a side's repeats, and a verdict per row (``compare.py``);
* ``whatif-ttft-cdf.png``: TTFT CDFs per class, one line per repeat, a colour per side;
* ``whatif-attainment.png``: attainment per class, bars at the median, whiskers over the spread;
* ``comparison.json``: every figure of every repeat, machine-readable.

``write_plan_report`` writes ``plan.md``, ``plan.json`` and ``plan-attainment.png`` (each target
class's worst-repeat attainment against engines). Latencies are in trace time (ms): a replay run
``speed`` times faster has them multiplied back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from matplotlib.figure import Figure

from loadtests.loadgen.report import _decorate
from loadtests.whatif.compare import (
    ERRORS_PREFIX,
    MIN_REPEATS,
    REJECTED_PREFIX,
    Comparison,
    Difference,
    GroupComparison,
    Metric,
    Spread,
    Verdict,
    engine_medians,
    goodput_requests,
)
from loadtests.whatif.model import SideRun, StageSettings, Trace
from loadtests.whatif.plan import PlanResult, Trial, load_policy, queue_settings

REPORT_FILE = "report.md"
COMPARISON_FILE = "comparison.json"
TTFT_CDF_PNG = "whatif-ttft-cdf.png"
ATTAINMENT_PNG = "whatif-attainment.png"
PLAN_FILE = "plan.md"
PLAN_JSON = "plan.json"
PLAN_PNG = "plan-attainment.png"
HEADLINE = ("ttft_p99_s", "attainment", "goodput_rps", "errors")
LATENCIES = tuple(f"{m}_p{q}_s" for m in ("ttft", "itl", "e2e") for q in (50, 95, 99))
_SIDE_COLOURS = ("C0", "C1")
_REPEAT_STYLES = ("-", "--", ":", "-.")
_VERDICT_TEXT = {
    Verdict.NOT_JUDGED: "not judged",
    Verdict.SAME: "within spread",
    Verdict.BETTER: "better",
    Verdict.WORSE: "**worse**",
    Verdict.HIGHER: "higher",
    Verdict.LOWER: "lower",
}


# --- formatting --------------------------------------------------------------------------------


def fmt(metric: Metric, value: float | None) -> str:
    """One value in the metric's display unit: ms, %, req/s, dollars..."""
    if value is None or math.isnan(value):
        return "–"
    if metric.unit == "s":
        ms = value * 1000
        return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"
    if metric.is_share:
        return f"{value * 100:.1f}%"
    if metric.unit == "$/h":
        return f"${value:.2f}"
    if metric.unit == "$":
        return f"${value:.3g}"
    return f"{value:g}" if metric.unit == "count" else f"{value:.2f}"


def cell(metric: Metric, spread: Spread) -> str:
    """``median (min–max)``, or the median alone when the repeats agree or there is one."""
    low, high = spread.low, spread.high
    if low is None or high is None or len(spread.measured) < 2 or low == high:
        return fmt(metric, spread.median)
    return f"{fmt(metric, spread.median)} ({fmt(metric, low)}–{fmt(metric, high)})"


def change_text(difference: Difference) -> str:
    delta = difference.change
    if delta is None:
        return "–"
    if difference.metric.is_share:
        return f"{delta * 100:+.1f} pp"
    return "from 0" if math.isinf(delta) else f"{delta * 100:+.1f} %"


def unit_label(metric: Metric) -> str:
    unit = {"s": " (ms)", "req/s": " (req/s)"}.get(metric.unit, "")
    return metric.label + unit


def _rows(groups: Iterable[GroupComparison], keys: Sequence[str], sides: tuple[str, str], what: str) -> list[str]:
    lines = [
        f"| {what} | figure | {sides[0]} | {sides[1]} | change | verdict |",
        "|---|---|---:|---:|---:|---|",
    ]
    for group in groups:
        for key in keys:
            d = group.get(key)
            if d is not None:
                lines.append(
                    f"| {group.name} | {unit_label(d.metric)} | {cell(d.metric, d.current)} "
                    f"| {cell(d.metric, d.candidate)} | {change_text(d)} | {_VERDICT_TEXT[d.verdict]} |"
                )
    return lines


# --- the what-if report ------------------------------------------------------------------------


def write_report(
    comparison: Comparison,
    out_dir: Path,
    *,
    title: str,
    settings: StageSettings,
    trace: Trace,
    traffic: float = 1.0,
    policies: Mapping[str, Path] | None = None,
) -> Path:
    """Write ``report.md``, its plots and ``comparison.json`` into ``out_dir``; return the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot_ttft_cdf(comparison, out_dir / TTFT_CDF_PNG)
    _plot_attainment(comparison, out_dir / ATTAINMENT_PNG)
    setup = setup_dict(settings, trace, traffic, policies)
    document = {"title": title, "setup": setup, **comparison.to_dict()}
    (out_dir / COMPARISON_FILE).write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    path = out_dir / REPORT_FILE
    path.write_text(_markdown(comparison, title, settings, trace, traffic, policies), encoding="utf-8")
    return path


def setup_dict(
    settings: StageSettings, trace: Trace, traffic: float, policies: Mapping[str, Path] | None = None
) -> dict[str, Any]:
    return {
        "trace": None if trace.path is None else str(trace.path),
        "trace_format": trace.source,
        "requests": len(trace.requests),
        "skipped_lines": trace.skipped,
        "trace_duration_s": trace.duration_s,
        "traffic": traffic,
        "speed": settings.speed,
        "profile": settings.profile,
        "engines": settings.engines,
        "policies": {side: str(p) for side, p in (policies or {}).items()},
    }


def setup_lines(settings: StageSettings, trace: Trace, traffic: float, *, fleet: str | None = None) -> list[str]:
    """What was replayed, and how: the bullets every what-if document opens with (``fleet`` says
    how many engines when ``settings`` does not)."""
    source = f"`{trace.path}`" if trace.path is not None else "a trace"
    minutes = trace.duration_s / 60
    speed = (
        f"**{settings.speed:g}×**: {minutes:.1f} min of trace replayed in {minutes / settings.speed:.1f} min; "
        "arrivals, the policy's times and the simulated engines' time all divided by it, every latency "
        "and rate below multiplied back (trace time)"
        if settings.speed != 1
        else "none (replayed in real time)"
    )
    scaling = f"**x{traffic:g}**: arrivals {traffic:g} times as fast, same mix" if traffic != 1 else "x1 (as recorded)"
    engines = fleet or (
        f"{settings.engines} per served model" if settings.engines else "one per backend the policy names"
    )
    skipped = f"; {trace.skipped} lines left out (nothing replayable known of them)" if trace.skipped else ""
    skipped += " (durations after the traffic scaling)" if traffic != 1 else ""
    return [
        f"- Trace: {source} ({trace.source} format), {len(trace.requests)} requests over {trace.duration_s:.1f} s"
        + skipped,
        f"- Traffic scaling: {scaling}",
        f"- Time compression (speed): {speed}",
        f"- Fleet: simulated engines of profile `{settings.profile}`, {engines}",
    ]


def spread_rule(comparison: Comparison) -> list[str]:
    current, candidate = comparison.sides
    repeats = f"{current} ran {len(comparison.current)} repeats and {candidate} {len(comparison.candidate)}"
    rule = (
        f"Repeats: {repeats}, alternated ({current} r0, {candidate} r0, "
        f"{current} r1, ...) so that drift of the machine falls on both. A cell reads "
        "`median (min–max)` over a side's repeats. **Spread rule**: a difference is flagged only where "
        "the two sides' ranges do not overlap *and* the medians differ by more than "
        f"{comparison.relative_floor:.0%} ({comparison.share_floor * 100:g} percentage point for shares: "
        "attainment, hit rate, busy fraction); better or worse by the figure's direction."
    )
    if comparison.judged:
        return [rule]
    return [
        rule,
        "",
        f"**Nothing can be flagged here**: a side ran fewer than {MIN_REPEATS} repeats, so it has no spread "
        "and run-to-run noise cannot be told from a difference (every verdict reads *not judged*).",
    ]


def _markdown(
    comparison: Comparison,
    title: str,
    settings: StageSettings,
    trace: Trace,
    traffic: float,
    policies: Mapping[str, Path] | None,
) -> str:
    sides, by_class = comparison.sides, [comparison.overall, *comparison.classes]
    lines = [f"# {title}", "", *setup_lines(settings, trace, traffic)]
    lines += [f"- {side}: `{path}`" for side, path in (policies or {}).items()]
    lines += ["", *spread_rule(comparison), "", "## Headline", "", *_flag_summary(comparison), ""]
    lines += _rows(by_class, HEADLINE, sides, "class")
    lines += ["", "## Per tenant", "", *_rows(comparison.tenants, HEADLINE, sides, "tenant")]
    lines += ["", "## Latency per class (trace time)", ""]
    lines += _rows(by_class, LATENCIES, sides, "class")
    lines += ["", "## Rejections by reason", "", *_rejections(comparison)]
    lines += [
        "",
        "## Prefix cache",
        "",
        *_rows([comparison.overall, *comparison.classes], ["prefix_hit_rate"], sides, "class"),
    ]
    lines += ["", "## Engine load", "", *_engine_load(comparison)]
    lines += ["", "## Cost", "", *_cost(comparison)]
    lines += ["", "## Plots", "", f"![TTFT CDF per class]({TTFT_CDF_PNG})", ""]
    lines += [f"![SLO attainment per class, spread over repeats]({ATTAINMENT_PNG})"]
    return "\n".join(lines) + "\n"


def _flag_summary(comparison: Comparison) -> list[str]:
    """The headline figures flagged over all requests and per class; how many more the tables hold."""
    if not comparison.judged:
        return ["Not judged: one repeat per side (see above)."]
    flagged = comparison.flagged()
    if not flagged:
        return ["No figure differs beyond the run-to-run spread."]
    headline = [(g, d) for g, d in flagged if g.scope != "tenant" and d.metric.key in HEADLINE]
    lines = [
        f"- {group.name}: {d.metric.label} {d.verdict} ({change_text(d)}): "
        f"{cell(d.metric, d.current)} → {cell(d.metric, d.candidate)}"
        for group, d in headline
    ]
    more = len(flagged) - len(headline)
    return lines + ([f"- and {more} more figures flagged in the tables below"] if more else [])


def _rejections(comparison: Comparison) -> list[str]:
    sides, overall = comparison.sides, comparison.overall
    gateway = overall.keys_with(REJECTED_PREFIX)
    lines = ["The gateway's own count (`gateway_rejections_total`), by reason:", ""]
    lines += _rows([overall], gateway, sides, "") if gateway else ["None on either side."]
    lines += ["", "What the clients saw fail, per class and reason code:", ""]
    groups = [comparison.overall, *comparison.classes]
    keys = sorted({k for g in groups for k in g.keys_with(ERRORS_PREFIX)})
    return lines + (_rows(groups, keys, sides, "class") if keys else ["No request failed on either side."])


def _engine_load(comparison: Comparison) -> list[str]:
    keys = ("engines", "engine_busy", "engine_running", "engine_waiting")
    lines = [*_rows([comparison.overall], keys, comparison.sides, ""), ""]
    lines += ["Per engine, medians over the repeats:", ""]
    lines += ["| side | engine | requests | busy | mean running | mean waiting |", "|---|---|---:|---:|---:|---:|"]
    for side, runs in zip(comparison.sides, (comparison.current, comparison.candidate), strict=True):
        lines += [
            f"| {side} | {e.engine} | {e.requests} | {e.busy_fraction * 100:.1f}% | {e.mean_running:.2f} "
            f"| {e.mean_waiting:.2f} |"
            for e in engine_medians(runs)
        ]
    return lines


def _cost(comparison: Comparison) -> list[str]:
    keys = ("cost_per_hour", "cost_per_goodput_request", "goodput_rps")
    note = (
        "Cost per hour: each engine's `price_per_gpu_hour × gpus`; per goodput request: that over the replay's "
        "elapsed trace time, divided by the requests that met their SLO."
    )
    return [note, "", *_rows([comparison.overall], keys, comparison.sides, "")]


def _ttft_ms(run: SideRun, class_name: str | None) -> np.ndarray[Any, Any]:
    values = [
        r.ttft_s * 1000
        for r in run.records
        if r.ok and r.ttft_s is not None and (class_name is None or r.class_name == class_name)
    ]
    return np.sort(np.asarray(values, dtype=float))


def _plot_ttft_cdf(comparison: Comparison, path: Path) -> None:
    names: list[str | None] = [g.name for g in comparison.classes] or [None]
    fig = Figure(figsize=(6 * len(names), 4.5), layout="constrained")
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names, strict=True):
        for colour, runs in zip(_SIDE_COLOURS, (comparison.current, comparison.candidate), strict=True):
            for run in runs:
                xs = _ttft_ms(run, name)
                if xs.size:
                    label = f"{run.side} r{run.repeat}"
                    style = _REPEAT_STYLES[run.repeat % len(_REPEAT_STYLES)]
                    ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, style, color=colour, alpha=0.8, label=label)
        _decorate(ax, f"TTFT CDF: {name or 'all'}", "TTFT (ms, trace time)", "fraction of requests")
    fig.savefig(path, dpi=100)


def _plot_attainment(comparison: Comparison, path: Path) -> None:
    groups = [comparison.overall, *comparison.classes]
    fig = Figure(figsize=(max(6, 2 * len(groups)), 4.5), layout="constrained")
    ax = fig.subplots()
    xs = np.arange(len(groups))
    for i, side in enumerate(comparison.sides):
        spreads = [g["attainment"].current if i == 0 else g["attainment"].candidate for g in groups]
        middle = [100 * (s.median if s.median is not None else math.nan) for s in spreads]
        below = [100 * (s.median - s.low) if s.median is not None and s.low is not None else 0 for s in spreads]
        above = [100 * (s.high - s.median) if s.median is not None and s.high is not None else 0 for s in spreads]
        offset = (i - 0.5) * 0.4
        ax.bar(xs + offset, middle, 0.4, yerr=[below, above], capsize=4, label=side, color=_SIDE_COLOURS[i])
    ax.set_xticks(xs, [g.name for g in groups])
    _decorate(ax, "SLO attainment per class (median, min–max)", "class", "% of requests")
    fig.savefig(path, dpi=100)


# --- the plan report ---------------------------------------------------------------------------


def write_plan_report(
    result: PlanResult,
    out_dir: Path,
    *,
    title: str,
    settings: StageSettings,
    trace: Trace,
    traffic: float = 1.0,
    policy: Path | None = None,
) -> Path:
    """Write ``plan.md``, ``plan.json`` and the plot into ``out_dir``; return the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot_plan(result, out_dir / PLAN_PNG)
    setup = setup_dict(settings, trace, traffic, {"policy": policy} if policy else None)
    (out_dir / PLAN_JSON).write_bytes(orjson.dumps(plan_dict(result, title, setup), option=orjson.OPT_INDENT_2))
    path = out_dir / PLAN_FILE
    path.write_text(_plan_markdown(result, title, settings, trace, traffic, policy), encoding="utf-8")
    return path


def answer_text(result: PlanResult) -> str:
    """The plan's answer in one sentence."""
    targets = ", ".join(f"{name} ≥ {target:.1%}" for name, target in result.targets.items())
    chosen = result.chosen
    if chosen is None:
        return f"No fleet of up to {result.max_engines} engines meets {targets} in every repeat."
    cost = result.cost_per_hour
    per_request = result.cost_per_goodput_request
    money = (
        f"; ${cost:.2f} per hour, ${per_request.median:.3g} per goodput request"
        if cost is not None and per_request.median is not None
        else "; no price in the policy"
    )
    return f"{chosen.engines} engines with queues {chosen.variant.name} meet {targets} in every repeat{money}."


def plan_dict(result: PlanResult, title: str, setup: Mapping[str, Any]) -> dict[str, Any]:
    per_request = result.cost_per_goodput_request
    return {
        "title": title,
        "setup": dict(setup),
        "targets": dict(result.targets),
        "max_engines": result.max_engines,
        "repeats": result.repeats,
        "engines": result.engines,
        "queue_variant": None if result.variant is None else result.variant.name,
        "base_engines": result.base_engines,
        "monotone": result.monotone,
        "cost_per_engine_hour": result.cost_per_engine_hour,
        "cost_per_hour": result.cost_per_hour,
        "cost_per_goodput_request": per_request.to_dict(),
        "answer": answer_text(result),
        "trials": [_trial_dict(t) for t in result.trials],
    }


def _trial_dict(trial: Trial) -> dict[str, Any]:
    return {
        "engines": trial.engines,
        "queue_variant": trial.variant.name,
        "policy": str(trial.policy),
        "repeats_run": len(trial.runs),
        "attainment": {name: list(values) for name, values in trial.attainment.items()},
        "passed": trial.passed,
        "margin": trial.margin,
        "goodput_requests": [goodput_requests(run) for run in trial.runs],
    }


def _plan_markdown(
    result: PlanResult, title: str, settings: StageSettings, trace: Trace, traffic: float, policy: Path | None
) -> str:
    fleet = f"as many per served model as the plan finds (1 to {result.max_engines})"
    lines = [f"# {title}", "", *setup_lines(settings, trace, traffic, fleet=fleet)]
    lines += [f"- Policy: `{policy}`"] if policy else []
    targets = ", ".join(f"{n} ≥ {t:.1%}" for n, t in result.targets.items())
    lines += [f"- Targets: {targets}; {result.repeats} repeats per size, up to {result.max_engines} engines"]
    lines += ["", "## Answer", "", f"**{answer_text(result)}**", "", *_queues(result), *_plan_rule(result)]
    lines += ["", "## Every size tried", "", *_trial_rows(result)]
    lines += ["", "## Plot", "", f"![worst-repeat attainment against engines]({PLAN_PNG})"]
    return "\n".join(lines) + "\n"


def _queues(result: PlanResult) -> list[str]:
    if result.chosen is None:
        return []
    queues = queue_settings(load_policy(result.chosen.policy))
    described = "; ".join(
        f"{name}: max_depth {q['max_depth']}, max_wait_s {q.get('max_wait_s', 'default (the TTFT objective)')}"
        for name, q in queues.items()
    )
    return [f"Queues at that size (`{result.chosen.policy.name}`): {described}.", ""]


def _plan_rule(result: PlanResult) -> list[str]:
    lines = [
        "A size passes only if its **worst** repeat meets every target (a failing repeat ends its trial). "
        "Search: engines 1, 2, 4, ... until one passes, then a binary search below it, valid because "
        "attainment grows with engines (more engines, shorter queues); the size found is confirmed by "
        "the next larger one. Then, one engine fewer, each queue variant (every class's `queue.max_depth` "
        "× ¼ or × 4, or `max_wait_s` = its TTFT objective or half of it) is tried; at the final size the "
        "passing variant with the largest margin is chosen.",
    ]
    base = "none up to the maximum" if result.base_engines is None else str(result.base_engines)
    lines += ["", f"- Smallest size with the queues as written: {base}"]
    if not result.monotone:
        lines += [
            "- ⚠ **Not monotone**: a size passed while the next larger one failed; the search went on "
            "upward to a size whose larger neighbour passes too. Near the threshold, the answer is noisy: "
            "consider more repeats."
        ]
    return lines


def _trial_rows(result: PlanResult) -> list[str]:
    names = list(result.targets)
    columns = " | ".join(f"{n} attainment: worst (each repeat)" for n in names)
    lines = [
        f"| engines | queues | repeats run | {columns} | passes | cost per hour |",
        "|---:|---|---:|" + "---:|" * len(names) + "---|---:|",
    ]
    for t in sorted(result.trials, key=lambda t: (t.engines, t.variant.name != "as-written", t.variant.name)):
        shares = " | ".join(
            f"{min(t.attainment[n]):.1%} ({', '.join(f'{v:.1%}' for v in t.attainment[n])})" for n in names
        )
        cost = "–" if (hourly := result.cost_at(t.engines)) is None else f"${hourly:.2f}"
        mark = "yes" if t.passed else "no"
        chosen = " ← chosen" if t is result.chosen else ""
        lines.append(f"| {t.engines} | {t.variant.name} | {len(t.runs)} | {shares} | {mark}{chosen} | {cost} |")
    return lines


def _plot_plan(result: PlanResult, path: Path) -> None:
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for i, (name, target) in enumerate(result.targets.items()):
        colour = f"C{i}"
        for variant in dict.fromkeys(t.variant.name for t in result.trials):
            tried = sorted((t for t in result.trials if t.variant.name == variant), key=lambda t: t.engines)
            worst = [100 * min(t.attainment[name]) for t in tried]
            style = "-" if variant == "as-written" else ":"
            ax.plot([t.engines for t in tried], worst, style, marker="o", color=colour, label=f"{name} {variant}")
        ax.axhline(100 * target, color=colour, linestyle="--", linewidth=0.8)
    _decorate(ax, "Worst-repeat SLO attainment (dashed: targets)", "engines", "% of requests")
    fig.savefig(path, dpi=100)
