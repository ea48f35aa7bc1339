"""What only the Redis store does: share limits between replicas, expire a dead replica's
slots, and fail open (then recover) when Redis is unreachable, slow or restarted.

The behaviour both stores share is the conformance suite (``test_limit_store.py``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack

import pytest

from gateway.state.redis import RedisConfig, RedisLimitStore
from tests.fake_clock import FakeClock
from tests.servers import free_port
from tests.state.redis_server import REDIS_URL, RedisProcess, drop_keys, eventually, shared_client, unique_prefix


class Events:
    """What the store reported, by operation (the gateway turns these into counters)."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.fallbacks: list[str] = []


class Replicas:
    """Stores built on one key prefix: the replicas of one gateway deployment."""

    def __init__(self, stack: AsyncExitStack, prefix: str) -> None:
        self.stack = stack
        self.prefix = prefix

    def new(
        self, url: str = REDIS_URL, *, clock: FakeClock | None = None, timeout_s: float = 1.0, lease_ttl_s: float = 10.0
    ) -> tuple[RedisLimitStore, Events]:
        events = Events()
        config = RedisConfig(url=url, key_prefix=self.prefix, timeout_s=timeout_s, lease_ttl_s=lease_ttl_s)
        store = RedisLimitStore(config, clock=clock, on_error=events.errors.append, on_fallback=events.fallbacks.append)
        self.stack.push_async_callback(store.aclose)
        return store, events


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    prefix = unique_prefix()
    async with AsyncExitStack() as stack:
        yield Replicas(stack, prefix)
    drop_keys(REDIS_URL, prefix)


@pytest.fixture
def private_redis() -> Iterator[RedisProcess]:
    """A redis-server of the test's own, not yet started (so it can start "late")."""
    server = RedisProcess()
    try:
        yield server
    finally:
        server.stop()


async def test_two_replicas_share_one_tenants_requests_per_minute(replicas: Replicas) -> None:
    first, _ = replicas.new()
    second, _ = replicas.new()
    assert [(await first.take("rpm:acme", 1, 3, 3 / 60)).allowed for _ in range(3)] == [True, True, True]
    refused = await second.take("rpm:acme", 1, 3, 3 / 60)
    assert not refused.allowed
    assert refused.retry_after_s == pytest.approx(20.0, abs=0.5)  # one request refills in 60/3 s
    await first.refund("rpm:acme", 1, 3, 3 / 60)
    assert (await second.take("rpm:acme", 1, 3, 3 / 60)).allowed


async def test_two_replicas_share_one_tenants_concurrency(replicas: Replicas) -> None:
    first, _ = replicas.new()
    second, _ = replicas.new()
    assert await first.acquire_slot("conc:acme", 2)
    assert await second.acquire_slot("conc:acme", 2)
    assert not await first.acquire_slot("conc:acme", 2)
    assert await first.slots_in_use("conc:acme") == 2
    await second.release_slot("conc:acme")
    assert await first.acquire_slot("conc:acme", 2)


async def test_buckets_refill_on_the_redis_servers_clock(replicas: Replicas) -> None:
    store, _ = replicas.new()  # no injected clock: the scripts read TIME
    assert (await store.take("rpm:fast", 1, 1, 2.0)).allowed
    refused = await store.take("rpm:fast", 1, 1, 2.0)
    assert not refused.allowed
    assert 0 < refused.retry_after_s <= 0.5
    await eventually(lambda: _allowed(store, "rpm:fast", 1, 1, 2.0), what="the bucket to refill (2 per second)")


async def _allowed(store: RedisLimitStore, key: str, amount: float, capacity: float, rate: float) -> bool:
    return (await store.take(key, amount, capacity, rate)).allowed


async def test_key_prefixes_keep_deployments_apart(replicas: Replicas) -> None:
    first, _ = replicas.new()
    other = Replicas(replicas.stack, unique_prefix())
    second, _ = other.new()
    try:
        assert (await first.take("rpm:acme", 1, 1, 1 / 60)).allowed
        assert (await second.take("rpm:acme", 1, 1, 1 / 60)).allowed
    finally:
        drop_keys(REDIS_URL, other.prefix)


async def test_a_dead_replicas_slots_expire_with_its_lease(replicas: Replicas) -> None:
    clock = FakeClock()
    dead, _ = replicas.new(clock=clock, lease_ttl_s=5.0)
    live, _ = replicas.new(clock=clock, lease_ttl_s=5.0)
    assert await dead.acquire_slot("conc:acme", 2)
    assert await dead.acquire_slot("conc:acme", 2)
    assert not await live.acquire_slot("conc:acme", 2)
    clock.advance(4.9)  # the dead replica never renews
    assert not await live.acquire_slot("conc:acme", 2)
    clock.advance(0.2)
    assert await live.acquire_slot("conc:acme", 2)
    assert await live.slots_in_use("conc:acme") == 1


async def test_a_live_replica_keeps_its_slots_by_renewing_its_lease(replicas: Replicas) -> None:
    clock = FakeClock()
    holder, _ = replicas.new(clock=clock, lease_ttl_s=5.0)
    other, _ = replicas.new(clock=clock, lease_ttl_s=5.0)
    assert await holder.acquire_slot("conc:acme", 1)
    for _ in range(4):  # 16 s: three times the lease, renewed every 4 s
        clock.advance(4.0)
        assert await holder.check()
        assert not await other.acquire_slot("conc:acme", 1)
    await holder.release_slot("conc:acme")
    assert await other.acquire_slot("conc:acme", 1)


async def test_a_renewal_repairs_a_count_a_lost_release_left_behind(replicas: Replicas) -> None:
    store, _ = replicas.new()
    assert await store.acquire_slot("conc:acme", 3)
    held_key = f"{replicas.prefix}{{conc:acme}}:held"
    with shared_client() as client:
        client.hincrby(held_key, store.replica, 2)  # as if two releases had been lost
    assert await store.slots_in_use("conc:acme") == 3
    assert await store.check()
    assert await store.slots_in_use("conc:acme") == 1
    await store.release_slot("conc:acme")
    assert await store.check()
    assert await store.slots_in_use("conc:acme") == 0


async def test_an_unreachable_redis_falls_back_to_memory_then_recovers(
    replicas: Replicas, private_redis: RedisProcess
) -> None:
    store, events = replicas.new(private_redis.url, timeout_s=0.05)  # nothing listens there yet
    result = await store.take("rpm:acme", 1, 2, 2 / 60)
    assert result.allowed
    assert not store.up
    assert events.errors == ["take"]
    assert events.fallbacks == ["take"]
    assert not await store.check()
    assert events.errors == ["take", "ping"]
    assert (await store.take("rpm:acme", 1, 2, 2 / 60)).allowed  # the fallback's own bucket
    assert not (await store.take("rpm:acme", 1, 2, 2 / 60)).allowed
    assert events.errors == ["take", "ping"], "a store that knows Redis is down must not try it per request"

    private_redis.start()
    assert await store.check()
    assert store.up
    assert (await store.take("rpm:acme", 1, 2, 2 / 60)).allowed  # Redis's bucket, untouched so far
    with private_redis.client() as client:
        assert client.exists(f"{replicas.prefix}rpm:acme")


async def test_a_redis_that_never_answers_costs_a_request_at_most_its_timeout(replicas: Replicas) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", free_port()))
        silent.listen(64)  # connections complete in the kernel's backlog; nothing ever answers
        port = silent.getsockname()[1]
        store, events = replicas.new(f"redis://127.0.0.1:{port}/0", timeout_s=0.05)
        started = time.monotonic()
        assert await store.acquire_slot("conc:acme", 1)
        waited = time.monotonic() - started
        assert waited < 1.0, f"the call waited {waited:.3f}s on a silent Redis (timeout 0.05 s)"
        assert events.errors == ["acquire_slot"]
        assert not await store.acquire_slot("conc:acme", 1)  # the fallback holds the limit of 1
        assert events.errors == ["acquire_slot"], "a store that knows Redis is down must not wait on it again"
        await store.release_slot("conc:acme")
        assert await store.acquire_slot("conc:acme", 1)


async def test_slots_taken_from_the_fallback_are_given_back_to_it_after_recovery(
    replicas: Replicas, private_redis: RedisProcess
) -> None:
    store, _ = replicas.new(private_redis.url, timeout_s=0.05)
    assert await store.acquire_slot("conc:acme", 1)  # Redis down: the fallback's slot
    private_redis.start()
    assert await store.check()
    await store.release_slot("conc:acme")
    assert await store.fallback.slots_in_use("conc:acme") == 0
    assert await store.acquire_slot("conc:acme", 1)  # now in Redis
    assert await store.slots_in_use("conc:acme") == 1


async def test_scripts_are_loaded_again_after_redis_forgot_them(
    replicas: Replicas, private_redis: RedisProcess
) -> None:
    private_redis.start()
    store, events = replicas.new(private_redis.url)
    assert (await store.take("rpm:acme", 1, 5, 5 / 60)).allowed
    with private_redis.client() as client:
        client.script_flush()
    assert (await store.take("rpm:acme", 1, 5, 5 / 60)).remaining == pytest.approx(3, abs=0.01)
    assert store.up
    assert events.errors == []
