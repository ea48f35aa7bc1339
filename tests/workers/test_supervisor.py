"""The supervisor's restart rule (``gateway/workers/supervisor.py``); its processes: ``test_workers.py``."""

from __future__ import annotations

import pytest

from gateway.workers.supervisor import MAX_RESTART_DELAY_S, restart_delay


@pytest.mark.parametrize(
    ("quick_exits", "delay"),
    [
        pytest.param(1, 0.0, id="the first exit is restarted at once"),
        pytest.param(2, 1.0, id="the second quick exit waits a second"),
        pytest.param(3, 2.0, id="then twice as long"),
        pytest.param(6, 16.0, id="and so on"),
        pytest.param(7, MAX_RESTART_DELAY_S, id="up to the bound"),
        pytest.param(50, MAX_RESTART_DELAY_S, id="however often it died"),
    ],
)
def test_a_worker_that_keeps_dying_waits_longer_each_time(quick_exits: int, delay: float) -> None:
    assert restart_delay(quick_exits) == delay
