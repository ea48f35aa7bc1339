"""Fleet cells (``fleet.cell``): each cell a ledger of its own; a reload never moves a process.

Real parts: gateways in threads sharing the real Redis, a fake backend counting what it holds,
the official SDK as client. Cells are for fleets too large for one ledger: each cell fronts
engines of its own (``deploy/README.md``, "Redis for many replicas"), so two cells never count
each other's requests, and a process that changed cells on a reload would carry requests
granted by one ledger into another: the cell is read at start-up only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.fleet.ledger import ledger_base
from gateway.service import parse_policy
from gateway.settings import Settings
from tests.fake_backend import FakeBackend
from tests.fleet.test_shared_capacity import CAPACITY, fleet_policy, gateways, held, sdk_stream
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix
from tests.policy_builder import redis_state
from tests.servers import metric, serve_gateway_in_thread, serve_in_thread, wait_until


@pytest.fixture
def fake() -> Iterator[tuple[FakeBackend, str]]:
    backend = FakeBackend()
    with serve_in_thread(backend) as url:
        yield backend, url


def test_two_cells_keep_two_ledgers_each_counting_only_its_own_processes(fake: tuple[FakeBackend, str]) -> None:
    backend, backend_url = fake
    prefix = unique_prefix()
    answers: list[str] = []
    state = redis_state(REDIS_URL, prefix)
    try:
        with (
            gateways(fleet_policy(backend_url, state, cell="a"), 1) as in_a,
            gateways(fleet_policy(backend_url, state, cell="b"), 1) as in_b,
        ):
            urls = [*in_a, *in_b]
            wait_until(lambda: all(metric(url, "gateway_fleet_syncs_total", result="ok") > 0 for url in urls))
            assert [metric(url, "gateway_fleet_processes") for url in urls] == [1, 1], "one process per cell"
            # Each cell grants the whole capacity to its one process: the same engine behind both
            # cells is held twice over, which is why a cell must front engines of its own.
            with held(backend, lambda url: sdk_stream(url, answers), urls, 2 * CAPACITY + 2):
                wait_until(lambda: backend.active == 2 * CAPACITY, what="each cell's process holding all of it")
    finally:
        drop_keys(REDIS_URL, prefix)
    assert len(answers) == 2 * CAPACITY + 2
    assert all(answers), answers


def test_a_reload_that_changes_the_cell_keeps_the_process_in_its_cell(
    fake: tuple[FakeBackend, str], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    _, backend_url = fake
    prefix = unique_prefix()
    state = redis_state(REDIS_URL, prefix)
    text = fleet_policy(backend_url, state, cell="a")
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    settings = Settings(policy_path=str(path), health_checks=False, port=0, admin_port=0)
    try:
        with serve_gateway_in_thread(settings, parse_policy(text, str(path))) as server:
            gateway = server.app.gateway  # type: ignore[attr-defined]
            assert gateway.fleet is not None
            assert gateway.fleet.ledger.base == ledger_base(prefix, "a")
            moved = fleet_policy(backend_url, state, cell="b").replace("version: ", "version: moved-", 1)
            with caplog.at_level(logging.WARNING, logger="gateway.runtime"):
                gateway.install(parse_policy(moved, "moved.yaml"))
            assert gateway.policy().policy.fleet.cell == "b", "the new policy is in force"
            assert gateway.fleet.ledger.base == ledger_base(prefix, "a"), "the process stays in its cell"
            assert "fleet.cell changed" in caplog.text
    finally:
        drop_keys(REDIS_URL, prefix)
