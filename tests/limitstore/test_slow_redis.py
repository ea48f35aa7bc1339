"""A Redis that answers everything, but late: a request waits on it at most its budget.

The real ``redis-server`` behind a TCP proxy that holds every reply (``DelayingProxy``). What
is measured is the time the request path spends in the tenant limiter's own calls (admission
and settlement), directly, with a margin for a busy test machine; the delays are chosen so that
waiting for even one reply would exceed that margin.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from gateway.admission.tenant_limits import TenantLimiter
from gateway.limitstore.redis import RedisConfig, RedisLimitStore
from gateway.policy.model import Tenant
from gateway.service import parse_policy
from tests.limitstore.redis_server import (
    REDIS_URL,
    DelayingProxy,
    StoreEvents,
    drop_keys,
    eventually,
    limit_request,
    shared_client,
    unique_prefix,
)
from tests.policy_builder import build_policy

MARGIN_S = 0.15  # scheduling noise on a shared 2-core machine; the delay below is well past budget + margin


def acme() -> Tenant:
    text = build_policy(tenants={"acme": {"limits": {"rpm": 6000, "tpm": 10000000, "max_concurrent": 100}}})
    return parse_policy(text, "t.yaml").policy.tenants[0]


@pytest.fixture
async def slow_redis() -> AsyncIterator[DelayingProxy]:
    async with DelayingProxy(upstream_port=int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])) as proxy:
        yield proxy


@pytest.fixture
def prefix() -> Iterator[str]:
    value = unique_prefix()
    yield value
    drop_keys(REDIS_URL, value)


def store_behind(
    proxy: DelayingProxy, prefix: str, *, timeout_s: float, budget_s: float
) -> tuple[RedisLimitStore, StoreEvents]:
    events = StoreEvents()
    config = RedisConfig(url=proxy.url, key_prefix=prefix, timeout_s=timeout_s, request_budget_s=budget_s)
    return RedisLimitStore(config, on_error=events.errors.append, on_fallback=events.fallbacks.append), events


async def timed_request(limiter: TenantLimiter, tenant: Tenant) -> tuple[float, float]:
    """Seconds the request path waited in admission, then in settlement."""
    started = time.perf_counter()
    admission = await limiter.admit(tenant, limit_request())
    admitted = time.perf_counter()
    await limiter.settle(admission, used_tokens=50)
    return admitted - started, time.perf_counter() - admitted


async def test_a_slow_redis_costs_one_request_its_budget_then_is_bypassed_until_fast_again(
    slow_redis: DelayingProxy, prefix: str
) -> None:
    slow_redis.delay_s = 0.5  # under the per-command timeout (1 s): Redis never fails, only slows
    store, events = store_behind(slow_redis, prefix, timeout_s=1.0, budget_s=0.02)
    limiter, tenant = TenantLimiter(store), acme()
    try:
        admit_s, settle_s = await timed_request(limiter, tenant)
        assert admit_s < 0.02 + MARGIN_S, f"admission waited {admit_s * 1000:.0f} ms on a Redis 500 ms slow"
        assert admit_s + settle_s < 0.02 + MARGIN_S, "admission and settlement share one budget"
        assert not store.up
        assert events.errors == ["admit"]
        assert events.fallbacks == ["admit", "settle"]

        waits = [sum(await timed_request(limiter, tenant)) for _ in range(20)]
        assert max(waits) < MARGIN_S, "a request waited on a Redis already known to be too slow"
        assert events.errors == ["admit"]

        assert not await store.check(), "a ping slower than half the budget must keep Redis out"
        slow_redis.delay_s = 0.0
        await eventually(store.check, what="the background probe to find Redis fast again")
        fallbacks = len(events.fallbacks)
        admit_s, settle_s = await timed_request(limiter, tenant)
        assert len(events.fallbacks) == fallbacks, "the limits did not go back to Redis"
        assert store.up
        with shared_client() as client:
            level = float(client.hget(f"{prefix}{{acme}}:rpm", "level") or 0)
        assert level == pytest.approx(5999, abs=1), "a request after recovery must be counted in Redis, once"
    finally:
        await store.aclose()


async def test_with_the_issues_numbers_the_median_request_waits_nothing_on_a_30ms_redis(
    slow_redis: DelayingProxy, prefix: str
) -> None:
    """Redis 30 ms per reply, timeout_ms 50: before, every request waited a round trip per call."""
    slow_redis.delay_s = 0.03
    store, _ = store_behind(slow_redis, prefix, timeout_s=0.05, budget_s=0.01)
    limiter, tenant = TenantLimiter(store), acme()
    try:
        waits = [sum(await timed_request(limiter, tenant)) for _ in range(30)]
        assert statistics.median(waits) < 0.005, f"median wait {statistics.median(waits) * 1000:.1f} ms"
        assert waits[0] < 0.01 + MARGIN_S
    finally:
        await store.aclose()


async def test_a_slow_ping_keeps_a_down_redis_out_but_does_not_take_an_up_one_out(
    slow_redis: DelayingProxy, prefix: str
) -> None:
    """A ping's time includes the event loop's delays: only requests (their budget) judge an up Redis slow."""
    slow_redis.delay_s = 0.05  # over half the budget (10 ms), under the timeout
    store, events = store_behind(slow_redis, prefix, timeout_s=1.0, budget_s=0.02)
    try:
        assert await store.check()
        assert store.up
        store.up = False  # as after a request found it too slow
        assert not await store.check()
        assert events.errors == ["ping"]
    finally:
        await store.aclose()
