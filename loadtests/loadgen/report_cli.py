"""``inference-gateway report TRACE.jsonl... [--out report.md]``: a report of past traffic.

Why a command of its own and not ``loadtest report``: this one reads the gateway's request trace log
(``gateway/telemetry/tracelog.py``), i.e. production traffic, not load-test runs. The work is done by
``trace_report.py``, which shares the load generator's record format and its
report arithmetic; it is imported only when a report is written, because it loads matplotlib.
Rotated files (``trace.jsonl.1``, ...) are read when named, e.g. ``report trace.jsonl*``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``report`` to the ``inference-gateway`` command line."""
    report = subparsers.add_parser("report", help="Markdown report with PNG plots of request trace logs")
    report.add_argument("traces", nargs="+", type=Path, help="JSONL trace logs (or load-generator records)")
    report.add_argument("--out", type=Path, default=Path("report.md"), help="report file (plots go next to it)")
    report.add_argument("--bucket-s", type=float, default=None, help="time bucket of the plots (default: span/60)")
    report.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    from loadtests.loadgen.trace_report import write_trace_report

    if args.bucket_s is not None and args.bucket_s <= 0:
        print("--bucket-s must be greater than 0", file=sys.stderr)
        return 2
    try:
        out = write_trace_report(args.traces, args.out, bucket_s=args.bucket_s)
    except (OSError, ValueError) as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0
