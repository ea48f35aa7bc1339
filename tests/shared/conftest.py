"""Fixtures of the shared store's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.shared.redis_cluster import cluster_nodes


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[int]]:
    """Three redis-server nodes joined in a cluster (no replicas), on free ports: their ports."""
    yield from cluster_nodes(tmp_path)
