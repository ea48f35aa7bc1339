"""Gateway sub-commands: serve, demo, policy validate, keys hash (filled in by the foundation work)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the gateway's own sub-commands."""
