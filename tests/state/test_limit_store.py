"""Conformance suite of the LimitStore protocol, run over every implementation."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.state.base import LimitStore
from gateway.state.memory import MemoryLimitStore
from gateway.state.redis import RedisConfig, RedisLimitStore
from tests.fake_clock import FakeClock
from tests.state.redis_server import REDIS_URL, drop_keys, unique_prefix


@pytest.fixture(params=["memory", "redis"])
async def store_and_clock(request: pytest.FixtureRequest) -> AsyncIterator[tuple[LimitStore, FakeClock]]:
    """Each implementation, on a fake clock (Redis's scripts take it instead of the server's TIME)."""
    clock = FakeClock()
    if request.param == "memory":
        memory = MemoryLimitStore(clock)
        yield memory, clock
        await memory.aclose()
        return
    prefix = unique_prefix()
    store = RedisLimitStore(RedisConfig(url=REDIS_URL, key_prefix=prefix, timeout_s=1.0), clock=clock)
    assert await store.check(), f"Redis at {REDIS_URL} does not answer"
    yield store, clock
    assert store.up, "a Redis command failed: the test ran (partly) on the fallback"
    await store.aclose()
    drop_keys(REDIS_URL, prefix)


async def test_a_full_bucket_allows_up_to_its_capacity_then_refuses(
    store_and_clock: tuple[LimitStore, FakeClock],
) -> None:
    store, _ = store_and_clock
    results = [await store.take("k", 1, 3, 1.0) for _ in range(4)]
    assert [r.allowed for r in results] == [True, True, True, False]
    assert results[2].remaining == 0
    assert results[3].retry_after_s == pytest.approx(1.0)


async def test_the_bucket_refills_at_its_rate(store_and_clock: tuple[LimitStore, FakeClock]) -> None:
    store, clock = store_and_clock
    assert (await store.take("k", 10, 10, 2.0)).allowed
    refused = await store.take("k", 4, 10, 2.0)
    assert not refused.allowed
    assert refused.retry_after_s == pytest.approx(2.0)
    assert refused.reset_s == pytest.approx(5.0)
    clock.advance(2.0)
    assert (await store.take("k", 4, 10, 2.0)).allowed


async def test_a_refund_gives_back_but_never_above_capacity(store_and_clock: tuple[LimitStore, FakeClock]) -> None:
    store, _ = store_and_clock
    await store.take("k", 8, 10, 1.0)
    await store.refund("k", 5, 10, 1.0)
    assert (await store.take("k", 7, 10, 1.0)).remaining == pytest.approx(0)
    await store.refund("k", 100, 10, 1.0)
    assert (await store.take("k", 0, 10, 1.0)).remaining == pytest.approx(10)


async def test_keys_are_independent(store_and_clock: tuple[LimitStore, FakeClock]) -> None:
    store, _ = store_and_clock
    await store.take("a", 5, 5, 1.0)
    assert (await store.take("b", 5, 5, 1.0)).allowed


async def test_slots_are_bounded_and_released(store_and_clock: tuple[LimitStore, FakeClock]) -> None:
    store, _ = store_and_clock
    assert [await store.acquire_slot("c", 2) for _ in range(3)] == [True, True, False]
    assert await store.slots_in_use("c") == 2
    await store.release_slot("c")
    await store.release_slot("c")
    assert await store.slots_in_use("c") == 0
    assert await store.acquire_slot("c", 2)
