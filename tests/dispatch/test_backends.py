"""The backend pool (``gateway/dispatch/backends.py``) tells the routers to forget a backend that
goes down or that a reload removes.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.service import parse_policy
from tests.routing.conftest import routing_policy, strategy

ForgetSpy = Callable[[str], None]


async def test_the_pool_tells_routers_to_forget_a_backend_that_goes_down() -> None:
    import httpx

    from gateway.dispatch.backends import BackendPool

    forgotten: list[str] = []
    snapshot = strategy("prefix_affinity")
    pool = BackendPool(snapshot, on_forget=forgotten.append)
    async with httpx.AsyncClient() as client:
        await pool.check_all(client, timeout_s=0.5)  # nothing listens on ports 1-3
    assert sorted(forgotten) == ["b0", "b1", "b2"]
    pool.adopt(parse_policy(routing_policy(backend_count=2), "t"))
    assert "b2" in forgotten[3:]
