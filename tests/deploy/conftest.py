"""Paths of the deploy files, and the Debian binaries the deploy tests run (``prometheus``, ``redis-server``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
ALERTS_TEST = DEPLOY / "prometheus" / "alerts_test.yaml"
DASHBOARD = DEPLOY / "grafana" / "inference-gateway.json"
METRICS_DOC = DEPLOY / "metrics.md"


def binary(name: str, package: str = "prometheus") -> str:
    """The binary's path; skips (with the install hint) where it is missing. CI installs it."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (apt-get install {package}; .ci/run does)")
    return path
