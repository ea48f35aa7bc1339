"""Placeholder: register(subparsers) adds this tool's sub-commands."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add this tool's sub-commands."""
