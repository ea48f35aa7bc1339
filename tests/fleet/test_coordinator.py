"""The dispatch rate a process reports to the fleet's ledger (``FleetCoordinator._rate``): what the
other processes add to their drain estimate, measured since this process last went idle."""

from __future__ import annotations

from typing import cast

import pytest

from gateway.dispatch.backends import BackendPool
from gateway.fleet.coordinator import FleetCoordinator
from gateway.fleet.ledger import FleetLedger
from gateway.service import parse_policy
from gateway.telemetry.metrics import Metrics
from tests.dispatch.test_dispatcher import POLICY
from tests.fake_clock import FakeClock


def coordinator() -> FleetCoordinator:
    snapshot = parse_policy(POLICY, "t.yaml")
    return FleetCoordinator(
        cast(FleetLedger, None), BackendPool(snapshot), cast(object, None), lambda: snapshot, FakeClock(), Metrics()
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("idle_s", [2.5, 6.0, 30.0])
def test_a_burst_after_an_idle_spell_reports_its_own_rate(idle_s: float) -> None:
    """Syncs every 0.05 s: 10 dispatches in 1 s, then idle for ``idle_s``, then 10 dispatches in
    0.5 s. The rate reported is the new burst's, 20/s (counted from the sync before its first dispatch)."""
    fleet, now, sent = coordinator(), 0.0, 0
    for _ in range(20):
        now += 0.05
        sent += 1 if round(now * 100) % 10 == 0 else 0
        fleet._rate("b1", sent, now, backlogged=False)
    for _ in range(round(idle_s / 0.05)):
        now += 0.05
        fleet._rate("b1", sent, now, backlogged=False)
    for _ in range(10):
        now += 0.05
        sent += 1
        rate = fleet._rate("b1", sent, now, backlogged=True)
    assert rate == pytest.approx(10 / 0.5, rel=0.01)
