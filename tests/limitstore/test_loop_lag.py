"""A busy process is not a slow Redis: the store tells the event loop's lag from Redis's latency.

Issue 28, item 4: under ordinary load on a 2-core machine every gateway process logged, every
second or two, that Redis failed on settle ("the request's budget for Redis is spent") and
fell back to enforcing the limits alone, while Redis was healthy: a callback that held the
loop longer than the 20 ms budget made every reply waiting in a socket look late.

Here a hog on the test's own event loop (a task that blocks it for 60 ms, again and again)
runs beside requests through the tenant limiter, against the real Redis; then Redis itself is
slowed by a proxy on its own thread (``loadtests/harness/delay_proxy.py``), which must still be cut.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest

from gateway.admission.tenant_limits import TenantLimiter
from gateway.limitstore.redis import RedisConfig, RedisLimitStore
from gateway.policy.model import Tenant
from gateway.service import parse_policy
from loadtests.harness.delay_proxy import DelayProxy
from tests.limitstore.redis_server import REDIS_URL, StoreEvents, drop_keys, limit_request, unique_prefix
from tests.policy_builder import build_policy

BUDGET_S = 0.02
REDIS_PORT = int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])


def acme() -> Tenant:
    """Limits the requests below never reach; a concurrency limit under 16 keeps no spare slot in
    a lease (``limitstore/lease.py``), so every admission and every settlement waits on Redis, as
    every request did before leases: the stalls must overlap those waits."""
    text = build_policy(tenants={"acme": {"limits": {"rpm": 100000, "tpm": 100000000, "max_concurrent": 15}}})
    return parse_policy(text, "t.yaml").policy.tenants[0]


@pytest.fixture
def prefix() -> Iterator[str]:
    value = unique_prefix()
    yield value
    drop_keys(REDIS_URL, value)


@pytest.fixture
def slow_redis() -> Iterator[DelayProxy]:
    with DelayProxy(upstream_port=REDIS_PORT) as proxy:
        yield proxy


def store_at(url: str, prefix: str, events: StoreEvents) -> RedisLimitStore:
    config = RedisConfig(url=url, key_prefix=prefix, timeout_s=0.05, request_budget_s=BUDGET_S)
    return RedisLimitStore(config, on_error=events.errors.append, on_fallback=events.fallbacks.append)


@asynccontextmanager
async def hog(block_s: float, every_s: float) -> AsyncIterator[list[int]]:
    """A task that holds the event loop ``block_s`` at a time (a callback doing CPU work), then
    lets it go for ``every_s - block_s``; yields a list whose length counts the stalls."""
    stalls: list[int] = []

    async def run() -> None:
        while True:
            time.sleep(block_s)  # noqa: ASYNC251  # blocks the loop on purpose
            stalls.append(1)
            await asyncio.sleep(every_s - block_s)

    task = asyncio.create_task(run())
    try:
        yield stalls
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def one_request(limiter: TenantLimiter, tenant: Tenant, waits: list[float]) -> None:
    started = time.perf_counter()
    admission = await limiter.admit(tenant, limit_request())
    await limiter.settle(admission, used_tokens=50)
    waits.append(time.perf_counter() - started)


async def test_a_loop_stalled_past_the_budget_never_takes_a_healthy_redis_for_lost(prefix: str) -> None:
    events = StoreEvents()
    store = store_at(REDIS_URL, prefix, events)
    limiter, tenant = TenantLimiter(store), acme()
    pinger = asyncio.create_task(store.run())
    waits: list[float] = []
    try:
        assert await store.check()
        async with hog(block_s=0.06, every_s=0.07) as stalls:
            while len(stalls) < 30:  # requests 10 at a time through 30 stalls of 60 ms (about 2 s)
                await asyncio.gather(*(one_request(limiter, tenant, waits) for _ in range(10)))
        assert events.errors == [], f"Redis taken for lost while it was healthy: {events.errors[:5]}"
        assert events.fallbacks == []
        assert store.up
        late = sum(1 for wait in waits if wait > BUDGET_S)
        assert late >= 40, f"only {late} of {len(waits)} requests waited past the budget: no stall overlapped them"
    finally:
        pinger.cancel()
        await store.aclose()


async def test_a_redis_slower_than_the_budget_is_still_cut_at_about_the_budget(
    slow_redis: DelayProxy, prefix: str
) -> None:
    events = StoreEvents()
    store = store_at(slow_redis.url, prefix, events)
    limiter, tenant = TenantLimiter(store), acme()
    try:
        assert await store.check()
        slow_redis.delay_s = 0.08  # every reply four budgets late
        waits: list[float] = []
        await one_request(limiter, tenant, waits)
        assert events.errors == ["admit"]
        assert events.fallbacks == ["admit", "settle"]
        assert waits[0] < BUDGET_S + 0.04, f"the request waited {waits[0] * 1000:.0f} ms (budget 20 ms)"
        assert not store.up
    finally:
        await store.aclose()


async def test_a_slow_redis_is_still_cut_while_the_loop_is_half_stalled(slow_redis: DelayProxy, prefix: str) -> None:
    """Lag forgiven is only the lag: with the loop free half the time, a reply 200 ms late is
    given up after about twice the budget of wall time, not waited for."""
    events = StoreEvents()
    store = store_at(slow_redis.url, prefix, events)
    limiter, tenant = TenantLimiter(store), acme()
    try:
        assert await store.check()
        slow_redis.delay_s = 0.2
        waits: list[float] = []
        async with hog(block_s=0.01, every_s=0.02):
            await one_request(limiter, tenant, waits)
        assert events.errors == ["admit"]
        assert waits[0] < 0.15, f"the request waited {waits[0] * 1000:.0f} ms on a Redis 200 ms late"
    finally:
        await store.aclose()


async def test_a_redis_cut_off_by_a_partition_is_given_up_after_the_budget(slow_redis: DelayProxy, prefix: str) -> None:
    """Every byte dropped, nothing refused (a partition): the call is cut after the budget, the
    fallback answers, and the store comes back once a ping is answered again."""
    events = StoreEvents()
    store = store_at(slow_redis.url, prefix, events)
    limiter, tenant = TenantLimiter(store), acme()
    try:
        assert await store.check()
        slow_redis.pause()
        waits: list[float] = []
        await one_request(limiter, tenant, waits)
        assert events.errors == ["admit"]
        assert waits[0] < BUDGET_S + 0.04, f"the request waited {waits[0] * 1000:.0f} ms (budget 20 ms)"
        assert not await store.check()
        slow_redis.resume()
        assert await store.check()
        assert store.up
    finally:
        await store.aclose()
