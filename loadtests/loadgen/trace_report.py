"""The report of request records over time: per class, tenant and backend, with PNG plots.

``inference-gateway report TRACE.jsonl...`` writes it from the gateway's request trace log
(``gateway/telemetry/tracelog.py``); any file of load-generator records works too, since both share
``RequestRecord``. Where the load-test report (``report.py``) compares runs at fixed rates,
this one follows one stretch of real traffic: it reuses the same arithmetic
(``summary.summarise_class``, ``stats.Distribution``) on three groupings and on time buckets.

* tables per class, tenant (the ``MAX_GROUPS − 1`` busiest, the rest as ``other``) and backend
  (``-`` for requests that never reached one: rejections): requests, attainment, goodput,
  TTFT/ITL/E2E percentiles, queue wait P99 and errors by reason;
* ``<stem>-over-time.png``: throughput and goodput, TTFT P50/P99 and SLO attainment per class,
  over time buckets of ``bucket_s`` seconds (by default the span / 60, at least 1 s);
* ``<stem>-breakdown.png``: TTFT P99 and attainment per tenant and per backend.

Times are the records' own (``t_send``: arrival at the gateway, unix epoch seconds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from matplotlib.figure import Figure

from loadtests.loadgen.records import RequestRecord, iter_records
from loadtests.loadgen.report import _decorate, _fmt, _ms
from loadtests.loadgen.stats import Distribution, attainment
from loadtests.loadgen.summary import ClassSummary, elapsed, group_by, summarise_class

MAX_GROUPS = 10
OTHER = "other"
_BUCKETS = 60


def read_traces(paths: Sequence[Path]) -> list[RequestRecord]:
    """Every record of every file, in arrival order."""
    records = [record for path in paths for record in iter_records(path)]
    records.sort(key=lambda r: r.t_send)
    return records


def write_trace_report(paths: Sequence[Path], out: Path, *, bucket_s: float | None = None) -> Path:
    records = read_traces(paths)
    if not records:
        raise ValueError("no request records in " + ", ".join(map(str, paths)))
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.stem
    width = bucket_s or bucket_width(records)
    _plot_over_time(records, width, out.with_name(f"{stem}-over-time.png"))
    tenants = folded(records, lambda r: r.tenant)
    backends = group_by(records, _backend)
    _plot_breakdown(tenants, backends, out.with_name(f"{stem}-breakdown.png"))
    out.write_text(_markdown(paths, records, tenants, backends, width, stem), encoding="utf-8")
    return out


def bucket_width(records: Sequence[RequestRecord]) -> float:
    """About 60 buckets over the span, rounded up to a whole second (at least 1 s)."""
    return float(max(1, math.ceil(elapsed(records) / _BUCKETS)))


def folded(records: Sequence[RequestRecord], key: Callable[[RequestRecord], str]) -> dict[str, list[RequestRecord]]:
    """Groups by ``key``: the ``MAX_GROUPS − 1`` largest by request count, the rest as ``other``."""
    groups = group_by(records, key)
    if len(groups) <= MAX_GROUPS:
        return groups
    ranked = sorted(groups, key=lambda k: len(groups[k]), reverse=True)
    kept = {name: groups[name] for name in ranked[: MAX_GROUPS - 1]}
    kept[OTHER] = [r for name in ranked[MAX_GROUPS - 1 :] for r in groups[name]]
    return kept


def _backend(record: RequestRecord) -> str:
    return str(record.extra.get("backend") or "-")


def over_time(records: Sequence[RequestRecord], width: float) -> list[tuple[float, list[RequestRecord]]]:
    """Records per time bucket ``[start + i·width, start + (i+1)·width)``, empty buckets included."""
    start = records[0].t_send
    count = int((records[-1].t_send - start) // width) + 1
    buckets: list[list[RequestRecord]] = [[] for _ in range(count)]
    for record in records:
        buckets[int((record.t_send - start) // width)].append(record)
    return [(i * width, bucket) for i, bucket in enumerate(buckets)]


def _plot_over_time(records: Sequence[RequestRecord], width: float, path: Path) -> None:
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    rate_ax, ttft_ax, slo_ax = fig.subplots(1, 3)
    buckets = over_time(records, width)
    xs = [t for t, _ in buckets]
    for name in group_by(records, lambda r: r.class_name):
        mine = [[r for r in b if r.class_name == name] for _, b in buckets]
        rate_ax.plot(xs, [sum(r.ok for r in b) / width for b in mine], ":", label=f"{name} done")
        rate_ax.plot(xs, [sum(r.slo_met for r in b) / width for b in mine], "-", label=f"{name} goodput")
        ttft = [Distribution.of(r.ttft_s for r in b if r.ok and r.ttft_s is not None) for b in mine]
        ttft_ax.plot(xs, [_ms(d.p50) for d in ttft], "--", label=f"{name} P50")
        ttft_ax.plot(xs, [_ms(d.p99) for d in ttft], "-", label=f"{name} P99")
        share = [attainment(sum(r.slo_met for r in b), len(b)) for b in mine]
        slo_ax.plot(xs, [math.nan if a is None else a * 100 for a in share], "-", marker=".", label=name)
    _decorate(rate_ax, "Throughput and goodput", f"seconds since the first request ({width:g} s buckets)", "req/s")
    _decorate(ttft_ax, "TTFT (ms)", "seconds since the first request", "latency (ms)")
    _decorate(slo_ax, "SLO attainment (%)", "seconds since the first request", "% of requests")
    fig.savefig(path, dpi=100)


def _plot_breakdown(
    tenants: dict[str, list[RequestRecord]], backends: dict[str, list[RequestRecord]], path: Path
) -> None:
    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 2)
    for row, (what, groups) in enumerate((("tenant", tenants), ("backend", backends))):
        names = list(groups)
        ttft = [Distribution.of(r.ttft_s for r in groups[n] if r.ok and r.ttft_s is not None).p99 for n in names]
        share = [attainment(sum(r.slo_met for r in groups[n]), len(groups[n])) for n in names]
        axes[row][0].bar(names, [_ms(v) for v in ttft])
        axes[row][1].bar(names, [math.nan if a is None else a * 100 for a in share])
        _decorate(axes[row][0], f"TTFT P99 per {what} (ms)", what, "ms")
        _decorate(axes[row][1], f"SLO attainment per {what} (%)", what, "%")
        for ax in axes[row]:
            ax.tick_params(axis="x", labelrotation=30)
    fig.savefig(path, dpi=100)


def _markdown(
    paths: Sequence[Path],
    records: Sequence[RequestRecord],
    tenants: dict[str, list[RequestRecord]],
    backends: dict[str, list[RequestRecord]],
    width: float,
    stem: str,
) -> str:
    span = elapsed(records)
    first = datetime.fromtimestamp(records[0].t_send, UTC).isoformat(timespec="seconds")
    lines = [
        "# Request trace report",
        "",
        f"- {len(records)} requests from {len(paths)} file(s): " + ", ".join(f"`{p}`" for p in paths),
        f"- from {first} over {span:.1f} s; time buckets of {width:g} s",
        "- latencies in ms; goodput = requests per second that met every SLO of their class; "
        "attainment = those over all requests (errors count as misses)",
        "",
    ]
    classes = group_by(records, lambda r: r.class_name)
    for title, groups in (("class", classes), ("tenant", tenants), ("backend", backends)):
        lines += [f"## Per {title}", "", *_table(title, groups, span), ""]
    lines += ["## Over time", "", f"![throughput, TTFT and attainment over time]({stem}-over-time.png)", ""]
    lines += ["## Per tenant and backend", "", f"![TTFT P99 and attainment by tenant, backend]({stem}-breakdown.png)"]
    return "\n".join(lines) + "\n"


def _table(title: str, groups: dict[str, list[RequestRecord]], span: float) -> list[str]:
    rows = [
        f"| {title} | requests | ok | attainment | goodput req/s | TTFT P50 | TTFT P99 | ITL P50 | ITL P99 "
        "| E2E P50 | E2E P99 | queue P99 | errors by reason |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, group in sorted(groups.items(), key=lambda item: -len(item[1])):
        c: ClassSummary = summarise_class(group, span)
        queue = Distribution.of(float(q) for r in group if isinstance(q := r.extra.get("queue_s"), int | float))
        reasons = ", ".join(f"{k}: {v}" for k, v in c.errors_by_reason.items()) or "–"
        rows.append(
            f"| {name} | {c.requests} | {c.ok} | {_fmt(c.slo_attainment, 100, 1)}% | {c.goodput_rps:.2f} "
            f"| {_fmt(c.ttft_s.p50)} | {_fmt(c.ttft_s.p99)} | {_fmt(c.itl_s.p50, digits=1)} "
            f"| {_fmt(c.itl_s.p99, digits=1)} | {_fmt(c.e2e_s.p50)} | {_fmt(c.e2e_s.p99)} "
            f"| {_fmt(queue.p99, digits=1)} | {reasons} |"
        )
    return rows
