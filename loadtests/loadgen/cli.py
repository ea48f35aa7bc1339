"""``inference-gateway loadtest run|sweep|report|ceiling``: the load generator's command line.

Configuration errors (a bad workload file, a non-loopback target, bad rates) print one message
naming what is wrong and exit with status 2; a run that completes exits 0 even when requests
failed, because failures are what it measures (they are in the summary).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtests.loadgen.ceiling import measure_ceiling
from loadtests.loadgen.progress import progress_for
from loadtests.loadgen.runner import ProgressSink, RunConfig, TargetRefused, check_target, run_sync, run_workload
from loadtests.loadgen.sweep import Criteria, parse_rates, run_sweep
from loadtests.loadgen.workload import WorkloadError, load_workload

USAGE_ERROR = 2


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``loadtest`` and its sub-commands."""
    parser = subparsers.add_parser("loadtest", help="open-loop load generator, sweeps and reports")
    commands = parser.add_subparsers(dest="loadtest_command", required=True)

    run = commands.add_parser("run", help="one run at one rate")
    _common(run)
    run.add_argument("--rate", type=float, help="requests/s (optional for a trace: its own speed)")
    run.set_defaults(func=_guarded(_run))

    sweep = commands.add_parser("sweep", help="one run per rate, then the saturation point and a report")
    _common(sweep)
    sweep.add_argument("--rates", required=True, help="comma-separated, increasing: 10,20,40,80")
    sweep.add_argument("--attainment", type=float, default=0.9, help="SLO attainment target (default 0.9)")
    sweep.set_defaults(func=_guarded(_sweep))

    report = commands.add_parser("report", help="Markdown report with PNG plots of runs or sweeps")
    report.add_argument("dirs", nargs="+", type=Path, help="run or sweep directories, compared side by side")
    report.add_argument("--out", type=Path, help="report file (default: DIR/report.md of the first DIR)")
    report.set_defaults(func=_guarded(_report))

    ceiling = commands.add_parser("ceiling", help="the generator's own ceiling against a zero-delay backend")
    ceiling.add_argument("--target", required=True, help="a zero-delay backend, e.g. sim --profile instant")
    ceiling.add_argument("--out", type=Path, default=Path("loadtest-ceiling"))
    ceiling.add_argument("--start-rate", type=float, default=100.0)
    ceiling.add_argument("--max-rate", type=float, default=8000.0)
    ceiling.add_argument("--step-duration", type=float, default=3.0)
    ceiling.add_argument("--model", default="probe")
    ceiling.add_argument("--quiet", action="store_true")
    ceiling.set_defaults(func=_guarded(_ceiling))


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, type=Path, help="workload YAML")
    parser.add_argument("--target", required=True, help="base URL on loopback, e.g. http://127.0.0.1:8000")
    parser.add_argument("--duration", required=True, type=float, help="seconds of sending per run")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--max-requests", type=int, help="stop sending after this many")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=1.0, help="match a simulator run with --time-scale K")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to wait for stragglers")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (WorkloadError, TargetRefused, ValueError) as exc:
            print(f"loadtest: {exc}", file=sys.stderr)
            return USAGE_ERROR

    return run


def _config(args: argparse.Namespace, rate: float | None) -> RunConfig:
    check_target(args.target)
    if args.duration <= 0 or args.time_scale <= 0:
        raise ValueError("--duration and --time-scale must be positive")
    return RunConfig(
        target=args.target,
        rate=rate,
        duration_s=args.duration,
        out_dir=args.out,
        max_requests=args.max_requests,
        seed=args.seed,
        time_scale=args.time_scale,
        drain_timeout_s=args.drain_timeout,
    )


def _bars(quiet: bool, label: str) -> Callable[[float], AbstractContextManager[ProgressSink | None]]:
    @contextmanager
    def bar(rate: float) -> Iterator[ProgressSink | None]:
        with progress_for(f"{label} {rate:g} req/s", quiet=quiet) as sink:
            yield sink

    return bar


def _run(args: argparse.Namespace) -> int:
    workload = load_workload(args.workload)
    config = _config(args, args.rate)
    with progress_for(f"{workload.name} {args.rate or 'trace'} req/s", quiet=args.quiet) as sink:
        result = run_sync(lambda: run_workload(workload, config, base_dir=args.workload.parent, progress=sink))
    _print_summary(result.summary, args.out)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    workload = load_workload(args.workload)
    rates = parse_rates(args.rates)
    template = _config(args, rates[0])
    criteria = Criteria(attainment_target=args.attainment)
    bars = _bars(args.quiet, workload.name)
    findings = run_sync(
        lambda: run_sweep(workload, rates, template, base_dir=args.workload.parent, progress=bars, criteria=criteria)
    )
    from loadtests.loadgen.report import write_report  # matplotlib: only when a report is written

    report = write_report([args.out], args.out / "report.md")
    console = Console()
    console.print(f"saturation: {findings['saturation']}")
    console.print(f"best goodput: {findings['best_goodput']}")
    console.print(f"wrote {args.out / 'sweep.json'} and {report}")
    return 0


def _report(args: argparse.Namespace) -> int:
    out = args.out or args.dirs[0] / "report.md"
    from loadtests.loadgen.report import write_report  # matplotlib: only when a report is written

    print(write_report(args.dirs, out))
    return 0


def _ceiling(args: argparse.Namespace) -> int:
    check_target(args.target)
    document = run_sync(
        lambda: measure_ceiling(
            args.target,
            args.out,
            start_rate=args.start_rate,
            max_rate=args.max_rate,
            step_s=args.step_duration,
            model=args.model,
            progress=_bars(args.quiet, "ceiling"),
        )
    )
    table = Table("rate", "sent req/s", "CPU ms/req", "P99 lateness ms", "errors", "sustained")
    for step in document["steps"]:
        cpu, late = step["cpu_s_per_request"], step["lateness_p99_s"]
        table.add_row(
            f"{step['rate']:g}", f"{step['send_rate']:.0f}", "–" if cpu is None else f"{cpu * 1e3:.3f}",
            "–" if late is None else f"{late * 1e3:.2f}", f"{step['error_fraction']:.1%}", str(step["sustained"]),
        )  # fmt: skip
    console = Console()
    console.print(table)
    estimate = document["one_core_estimate_rps"]
    console.print(
        f"ceiling: {document['ceiling_rps']} req/s sustained"
        + (f"; one-core estimate from CPU/request: {estimate:.0f} req/s" if estimate else "")
        + (" (reached --max-rate)" if document["reached_max_rate"] else "")
    )
    return 0


def _print_summary(summary: dict[str, Any], out: Path) -> None:
    k = float(summary["time_scale"])
    table = Table("class", "requests", "ok", "req/s", "goodput", "attainment", "TTFT P50/P99 ms", "ITL P50/P99 ms")
    rows = [*summary["classes"].items(), ("overall", summary["overall"])]
    for name, c in rows:
        ttft, itl = c["ttft_s"], c["itl_s"]
        table.add_row(
            name, str(c["requests"]), str(c["ok"]), f"{c['request_throughput']:.2f}", f"{c['goodput_rps']:.2f}",
            "–" if c["slo_attainment"] is None else f"{c['slo_attainment']:.1%}",
            f"{_ms(ttft['p50'])}/{_ms(ttft['p99'])}", f"{_ms(itl['p50'])}/{_ms(itl['p99'])}",
        )  # fmt: skip
    console = Console()
    console.print(table)
    if k != 1:
        console.print(f"time scale {k:g}: SLOs ×{k:g}, rate ÷{k:g}; throughputs are per wall second")
    for warning in summary["warnings"]:
        console.print(f"[bold yellow]warning:[/] {warning}")
    console.print(f"wrote {out}/records.jsonl and {out}/summary.json")


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.1f}"
