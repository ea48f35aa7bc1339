"""The `inference-gateway` command line.

Each sub-command lives next to the code it drives; this module only assembles the parser.
Sub-command modules expose ``register(subparsers)``, which adds a parser whose ``func``
default takes the parsed ``argparse.Namespace`` and returns the process exit code.

The gateway's own commands (``serve``, ``policy``, ``keys``) are always there. Other packages
add theirs through the ``inference_gateway.commands`` entry point group: the bench
(``loadtests/``: ``demo``, ``sim``, ``loadtest``, ``report``) does, so that the gateway never
imports its bench. A command whose package cannot be imported (the runtime image ships
without the bench) still answers, whatever its arguments, with how to get it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

COMMAND_GROUP = "inference_gateway.commands"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command`` naming one of the gateway's own, no other package is imported
    (``serve`` must not load the bench's simulator, load generator and plotting)."""
    from gateway.cli.commands import register as register_own

    parser = argparse.ArgumentParser(prog="inference-gateway", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    register_own(subparsers)
    if command in subparsers.choices:
        return parser
    for entry in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        if command is not None and entry.name != command:
            continue
        try:
            register = entry.load()
        except ImportError as exc:
            _unavailable(subparsers, entry.name, exc, entry.module.partition(".")[0])
            continue
        register(subparsers)
    return parser


def _unavailable(subparsers: argparse._SubParsersAction[Any], name: str, error: ImportError, package: str) -> None:
    """A command whose code cannot be imported here: it says why and how to get it. Either its
    package is absent (the runtime image installs ``gateway/`` alone) or its dependencies are."""
    parser = subparsers.add_parser(name, help=f"(unavailable: {error.name or error})", add_help=False)
    if error.name == package:
        remedy = f"'{package}' is not in this installation (the runtime image carries the gateway only); "
        remedy += "run it from a checkout: pip install -e '.[bench]'"
    else:
        remedy = f"needs the bench's packages ({error}); install them with: pip install 'inference-gateway[bench]'"

    def explain(args: argparse.Namespace) -> int:
        print(f"inference-gateway {name}: {remedy}", file=sys.stderr)
        return 2

    parser.set_defaults(func=explain, any_arguments=True)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command = words[0] if words and not words[0].startswith("-") else None
    parser = build_parser(command)
    # An unavailable command takes any arguments (its own flags are unknown here) to say why.
    args, unknown = parser.parse_known_args(words)
    if unknown and not getattr(args, "any_arguments", False):
        parser.parse_args(words)  # reports the unknown arguments, exit 2
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
