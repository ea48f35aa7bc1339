"""The Markdown report: runs side by side, a headline table and PNG plots.

Each directory given is one *series*: a sweep (``sweep.json`` and its ``rate-*/`` runs) or a
single run (``summary.json``). Comparing two policies means two sweeps with the same rates,
e.g. ``report results/round-robin results/prefix-aware``. Plots, written next to the report:

* ``<stem>-latency.png``: P50 and P99 of TTFT, ITL and E2E against offered load;
* ``<stem>-cdf.png``: CDFs of TTFT and ITL (at most four rates per series, spread evenly);
* ``<stem>-goodput.png``: goodput and throughput against offered load.

Latencies are wall-clock as measured; with a time scale K they are K times the simulated ones,
and so are the SLOs they are judged against (the report states K).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from loadtests.loadgen.records import RECORDS_FILE, iter_records
from loadtests.loadgen.summary import SUMMARY_FILE, read_summary
from loadtests.loadgen.sweep import SWEEP_FILE

_MAX_CDF_POINTS = 20_000
_MAX_CDF_RUNS = 4


@dataclass(frozen=True, slots=True)
class RunPoint:
    rate: float
    run_dir: Path
    summary: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    path: Path
    points: list[RunPoint]
    findings: dict[str, Any] | None


def load_series(path: Path) -> Series:
    """A sweep directory, a run directory, or a directory of ``rate-*`` runs."""
    findings = read_summary(path / SWEEP_FILE) if (path / SWEEP_FILE).exists() else None
    if (path / SUMMARY_FILE).exists():
        dirs = [path]
    elif findings is not None:
        dirs = [path / point["run_dir"] for point in findings["points"]]
    else:
        dirs = sorted(p.parent for p in path.glob(f"*/{SUMMARY_FILE}"))
    if not dirs:
        raise ValueError(f"{path}: no {SUMMARY_FILE} or {SWEEP_FILE} found")
    points = [RunPoint(_rate(s := read_summary(d / SUMMARY_FILE)), d, s) for d in dirs]
    return Series(path.name or str(path), path, sorted(points, key=lambda p: p.rate), findings)


def _rate(summary: dict[str, Any]) -> float:
    rate = summary.get("rate")
    if rate is None:  # a trace replayed at its own speed
        return float(summary["generator"]["send_rate"]) * float(summary.get("time_scale", 1.0))
    return float(rate)


def write_report(dirs: Sequence[Path], out: Path) -> Path:
    series = [load_series(d) for d in dirs]
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.stem
    _plot_latency(series, out.with_name(f"{stem}-latency.png"))
    _plot_cdf(series, out.with_name(f"{stem}-cdf.png"))
    _plot_goodput(series, out.with_name(f"{stem}-goodput.png"))
    out.write_text(_markdown(series, stem), encoding="utf-8")
    return out


def _ms(value: float | None) -> float:
    return float("nan") if value is None else value * 1000


def _plot_latency(series: Sequence[Series], path: Path) -> None:
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, metric, title in zip(axes, ("ttft_s", "itl_s", "e2e_s"), ("TTFT", "ITL", "E2E"), strict=True):
        for s in series:
            rates = [p.rate for p in s.points]
            for q, style in (("p50", "--"), ("p99", "-")):
                values = [_ms(p.summary["overall"][metric][q]) for p in s.points]
                ax.plot(rates, values, style, marker="o", label=f"{s.name} {q.upper()}")
        _decorate(ax, f"{title} (ms)", "offered load (req/s)", "latency (ms)")
    fig.savefig(path, dpi=100)


def _plot_cdf(series: Sequence[Series], path: Path) -> None:
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ttft_ax, itl_ax = fig.subplots(1, 2)
    for s in series:
        for point in _spread(s.points, _MAX_CDF_RUNS):
            ttft, itl = _latencies(point.run_dir)
            label = f"{s.name} @ {point.rate:g} req/s"
            for ax, values in ((ttft_ax, ttft), (itl_ax, itl)):
                if values.size:
                    xs = np.sort(values)[:: max(1, values.size // _MAX_CDF_POINTS)]
                    ax.plot(xs * 1000, np.linspace(0, 1, xs.size), label=label)
    _decorate(ttft_ax, "CDF of TTFT", "TTFT (ms)", "fraction of requests")
    _decorate(itl_ax, "CDF of ITL", "inter-token gap (ms)", "fraction of gaps")
    fig.savefig(path, dpi=100)


def _plot_goodput(series: Sequence[Series], path: Path) -> None:
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    top = 0.0
    for s in series:
        rates = [p.rate for p in s.points]
        scale = [float(p.summary.get("time_scale", 1.0)) for p in s.points]
        # Throughputs are per wall second; times the scale they are per simulated second, like the rate.
        good = [p.summary["overall"]["goodput_rps"] * k for p, k in zip(s.points, scale, strict=True)]
        done = [p.summary["overall"]["request_throughput"] * k for p, k in zip(s.points, scale, strict=True)]
        ax.plot(rates, good, "-", marker="o", label=f"{s.name} goodput")
        ax.plot(rates, done, ":", marker=".", label=f"{s.name} throughput")
        top = max([top, *rates])
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, label="offered")
    _decorate(ax, "Goodput against load", "offered load (req/s)", "requests/s")
    fig.savefig(path, dpi=100)


def _decorate(ax: Axes, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # bar charts have nothing to list
        ax.legend(fontsize="small")


def _spread(points: Sequence[RunPoint], count: int) -> list[RunPoint]:
    if len(points) <= count:
        return list(points)
    picks = np.linspace(0, len(points) - 1, count).round().astype(int)
    return [points[i] for i in sorted(set(picks.tolist()))]


def _latencies(run_dir: Path) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    ttft: list[float] = []
    itl: list[float] = []
    path = run_dir / RECORDS_FILE
    if path.exists():
        for record in iter_records(path):
            if record.ok and record.ttft_s is not None:
                ttft.append(record.ttft_s)
                itl.extend(record.itl_s)
    return np.asarray(ttft, dtype=float), np.asarray(itl, dtype=float)


def _fmt(value: float | None, scale: float = 1000, digits: int = 0) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def _markdown(series: Sequence[Series], stem: str) -> str:
    lines = ["# Load-test report", ""]
    for s in series:
        first = s.points[0].summary
        lines.append(
            f"- **{s.name}** (`{s.path}`): workload `{first['workload']}`, target `{first['target']}`, "
            f"{first['duration_s']:g} s per run, time scale {first.get('time_scale', 1):g}, "
            f"seed {first['seed']}"
        )
    lines += ["", "Latencies in ms of wall-clock time; rates in requests per simulated second "
              "(wall rate × time scale).", "", "## Headline", ""]  # fmt: skip
    lines += _headline(series)
    lines += _findings(series)
    lines += ["", "## Per class", "", *_per_class(series), "", "## Plots", ""]
    lines += [f"![latency against load]({stem}-latency.png)", "", f"![CDFs of TTFT and ITL]({stem}-cdf.png)"]
    lines += ["", f"![goodput against load]({stem}-goodput.png)", "", "## Generator", "", *_generator(series)]
    return "\n".join(lines) + "\n"


def _headline(series: Sequence[Series]) -> list[str]:
    rows = [
        "| run | rate | done req/s | goodput req/s | SLO attainment | TTFT P50 | TTFT P99 | ITL P50 | ITL P99 "
        "| E2E P50 | E2E P99 | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in series:
        for p in s.points:
            o, k = p.summary["overall"], float(p.summary.get("time_scale", 1.0))
            errors = o["requests"] - o["ok"]
            rows.append(
                f"| {s.name} | {p.rate:g} | {o['request_throughput'] * k:.2f} | {o['goodput_rps'] * k:.2f} "
                f"| {_fmt(o['slo_attainment'], 100, 1)}% | {_fmt(o['ttft_s']['p50'])} | {_fmt(o['ttft_s']['p99'])} "
                f"| {_fmt(o['itl_s']['p50'], digits=1)} | {_fmt(o['itl_s']['p99'], digits=1)} "
                f"| {_fmt(o['e2e_s']['p50'])} | {_fmt(o['e2e_s']['p99'])} | {errors} |"
            )
    return rows


def _findings(series: Sequence[Series]) -> list[str]:
    lines: list[str] = []
    for s in series:
        f = s.findings
        if f is None:
            continue
        sat = f.get("saturation")
        saturation = (
            f"saturates at {sat['rate']:g} req/s ({'; '.join(sat['reasons'])}); highest sustainable rate "
            f"{sat['max_sustainable_rate'] if sat['max_sustainable_rate'] is not None else '–'}"
            if sat
            else "no saturation within the rates swept"
        )
        best = f.get("best_goodput") or {}
        best_goodput = best.get("goodput_rps", 0) * float(f.get("time_scale", 1.0))
        lines.append(
            f"- **{s.name}**: {saturation}; best goodput {best_goodput:.2f} req/s "
            f"at {best.get('rate', 0):g} req/s; highest rate with ≥ "
            f"{f['criteria']['attainment_target']:.0%} SLO attainment: {f.get('max_rate_meeting_attainment')}"
        )
    return ["", "## Findings", "", *lines] if lines else []


def _per_class(series: Sequence[Series]) -> list[str]:
    rows = [
        "| run | rate | class | SLO TTFT/TPOT ms | requests | attainment | goodput req/s | TTFT P99 | TPOT P99 "
        "| errors by reason |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in series:
        for p in s.points:
            k = float(p.summary.get("time_scale", 1.0))
            for name, c in p.summary["classes"].items():
                slo = c.get("slo") or {}
                reasons = ", ".join(f"{k}: {v}" for k, v in c["errors_by_reason"].items()) or "–"
                rows.append(
                    f"| {s.name} | {p.rate:g} | {name} | {slo.get('ttft_ms', 0):g}/{slo.get('tpot_ms', 0):g} "
                    f"| {c['requests']} | {_fmt(c['slo_attainment'], 100, 1)}% | {c['goodput_rps'] * k:.2f} "
                    f"| {_fmt(c['ttft_s']['p99'])} | {_fmt(c['tpot_s']['p99'], digits=1)} | {reasons} |"
                )
    return rows


def _generator(series: Sequence[Series]) -> list[str]:
    lines = []
    for s in series:
        for p in s.points:
            g = p.summary["generator"]
            ceiling = f"{g['ceiling_rps']:.0f}" if g.get("ceiling_rps") else "–"
            lines.append(
                f"- {s.name} @ {p.rate:g}: {_fmt(g.get('cpu_s_per_request'), digits=2)} ms CPU/request "
                f"(ceiling ≈ {ceiling} req/s), P99 send lateness {_fmt(g['lateness_s']['p99'], digits=1)} ms"
            )
            lines += [f"  - ⚠ {w}" for w in p.summary.get("warnings", [])]
    return lines
