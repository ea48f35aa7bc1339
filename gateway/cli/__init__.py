"""The command line: ``inference-gateway`` and its sub-commands.

Owns the parser and the entry point (``main.py``: ``main``, ``build_parser``, the sub-commands
other packages add through the ``inference_gateway.commands`` entry points) and the built-in
commands' bodies (``commands.py``: ``serve``, ``policy validate|explain``, keys, rollouts).

The top stage: it may import every other (``STAGE_ORDER`` in ``tests/test_import_graph.py``); no
module of ``gateway/`` imports it. ``main`` and ``build_parser`` are re-exported here, so that
``inference-gateway = "gateway.cli:main"`` and ``from gateway.cli import main`` name the one
entry point.
"""

from gateway.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
