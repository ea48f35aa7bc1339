"""Fixtures for the simulated-engine tests: a real engine on a loopback port."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest

from loadtests.sim import build_engine_app
from loadtests.sim.server import EngineApp
from tests.servers import serve_in_thread


@contextmanager
def _engine(profile: str, **options: Any) -> Iterator[tuple[str, EngineApp]]:
    app = build_engine_app(profile, **options)
    with serve_in_thread(app) as url:
        yield url, app


@pytest.fixture
def sim_engine() -> Callable[..., AbstractContextManager[tuple[str, EngineApp]]]:
    """Start an engine: ``with sim_engine("llama-3.1-8b-h100", time_scale=0.1) as (url, app)``."""
    return _engine
