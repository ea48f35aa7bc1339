"""The `inference-gateway` command line.

Each sub-command lives next to the code it drives; this module only assembles the parser.
Sub-command modules expose ``register(subparsers)``, which adds a parser whose ``func``
default takes the parsed ``argparse.Namespace`` and returns the process exit code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from gateway import commands, report_cli
    from loadtests.loadgen import cli as loadgen_cli
    from loadtests.sim import cli as sim_cli

    parser = argparse.ArgumentParser(prog="inference-gateway", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    commands.register(subparsers)
    report_cli.register(subparsers)
    sim_cli.register(subparsers)
    loadgen_cli.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
