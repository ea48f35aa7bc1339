"""What only the Redis store does: share limits between replicas, expire a dead replica's
slots, fail open (then recover) when Redis is unreachable, slow or restarted, and cost one
round trip per admission and one per settlement.

The behaviour both stores share is the conformance suite (``test_limit_store.py``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack

import pytest

from gateway.limitstore.base import Adjust, Ask, Bucket, LimitVerdict, Settlement, Take
from gateway.limitstore.redis import RedisConfig, RedisLimitStore
from tests.fake_clock import FakeClock
from tests.limitstore.redis_server import (
    REDIS_URL,
    RedisProcess,
    drop_keys,
    eventually,
    shared_client,
    unique_prefix,
)
from tests.servers import free_port

RPM3 = Bucket("rpm", 3, 3 / 60)
RPM2 = Bucket("rpm", 2, 2 / 60)


def take(bucket: Bucket, amount: float = 1, scope: str = "acme") -> Ask:
    return Ask(scope=scope, takes=(Take(bucket, amount),))


def slot(limit: int, scope: str = "acme") -> Ask:
    return Ask(scope=scope, slot_limit=limit)


RELEASE = Settlement(scope="acme", release_slot=True)


def release(verdict: LimitVerdict, scope: str = "acme") -> Settlement:
    """The settlement giving back the slot ``verdict`` took, where it took it."""
    assert verdict.admitted
    assert verdict.slot_at is not None
    return Settlement(scope=scope, release_slot=True, slot_at=verdict.slot_at)


RUN_INSIDE_SCRIPTS = {"hmget", "hset", "hincrby", "hdel", "hvals", "pexpire", "del", "zadd", "zrem"}
RUN_INSIDE_SCRIPTS |= {"zrangebyscore", "zremrangebyscore", "time", "hget"}


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
        self,
        url: str = REDIS_URL,
        *,
        clock: FakeClock | None = None,
        timeout_s: float = 1.0,
        budget_s: float = 2.0,
        lease_ttl_s: float = 10.0,
    ) -> tuple[RedisLimitStore, Events]:
        events = Events()
        config = RedisConfig(
            url=url, key_prefix=self.prefix, timeout_s=timeout_s, request_budget_s=budget_s, lease_ttl_s=lease_ttl_s
        )
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
    assert [(await first.admit(take(RPM3))).admitted for _ in range(3)] == [True, True, True]
    refused = await second.admit(take(RPM3))
    assert not refused.admitted
    assert refused.buckets[0].retry_after_s == pytest.approx(20.0, abs=0.5)  # one request refills in 60/3 s
    await first.settle(Settlement(scope="acme", adjusts=(Adjust(RPM3, 1),)))
    assert (await second.admit(take(RPM3))).admitted


async def test_two_replicas_share_one_tenants_concurrency(replicas: Replicas) -> None:
    first, _ = replicas.new()
    second, _ = replicas.new()
    assert (await first.admit(slot(2))).admitted
    assert (await second.admit(slot(2))).admitted
    assert not (await first.admit(slot(2))).admitted
    assert await first.slots_in_use("acme") == 2
    await second.settle(RELEASE)
    assert (await first.admit(slot(2))).admitted


async def test_a_tenants_keys_share_one_hash_tag(replicas: Replicas) -> None:
    """One Redis Cluster slot per tenant: an admission script may touch all of its keys."""
    store, _ = replicas.new()
    ask = Ask(scope="acme", slot_limit=1, takes=(Take(RPM3, 1), Take(Bucket("tpm", 100, 1.0), 10)))
    assert (await store.admit(ask)).admitted
    with shared_client() as client:
        keys = sorted(k.decode() for k in client.scan_iter(match=f"{replicas.prefix}*"))
    assert keys == [f"{replicas.prefix}{{acme}}:{name}" for name in ("held", "leases", "rpm", "tpm")]


async def test_a_dry_lease_costs_one_script_call_and_a_lease_grown_to_the_burst_almost_none(
    replicas: Replicas, private_redis: RedisProcess
) -> None:
    """Leases (``limitstore/lease.py``): a lease short of the ask costs one SYNC script, a lease
    that holds it costs nothing, and so does a settlement (reported at the next sync); the
    prefetch doubles at each dry admission, so a burst soon runs from its lease (here without
    the keeper, which would top it up in the background). This replaces the test of one
    script per admission and one per settlement, the design before."""
    private_redis.start()
    store, _ = replicas.new(private_redis.url)
    rpm, tpm = Bucket("rpm", 64_000, 64_000 / 60), Bucket("tpm", 6_400_000, 6_400_000 / 60)

    def ask(scope: str) -> Ask:
        return Ask(scope=scope, slot_limit=160, takes=(Take(rpm, 1), Take(tpm, 100)))

    def done(scope: str) -> Settlement:
        return Settlement(scope=scope, release_slot=True, adjusts=(Adjust(tpm, 50),))

    assert (await store.admit(ask("warm"))).admitted  # loads the script (NOSCRIPT, then EVALSHA again)

    def sent() -> dict[str, int]:
        stats = {k.removeprefix("cmdstat_"): v["calls"] for k, v in client.info("commandstats").items()}
        return {name: calls for name, calls in stats.items() if name not in RUN_INSIDE_SCRIPTS}

    with private_redis.client() as client:
        client.config_resetstat()
        assert (await store.admit(ask("acme"))).admitted  # a new tenant: its lease is dry
        assert sent() == {"evalsha": 1, "config|resetstat": 1}
        for _ in range(100):
            await store.settle(done("acme"))
            assert (await store.admit(ask("acme"))).admitted
        client.config_resetstat()
        for _ in range(100):
            await store.settle(done("acme"))
            assert (await store.admit(ask("acme"))).admitted
        calls = sent()
        assert calls.get("evalsha", 0) <= 2, f"{calls} for 100 admissions and settlements"


async def test_buckets_refill_on_the_redis_servers_clock(replicas: Replicas) -> None:
    store, _ = replicas.new()  # no injected clock: the scripts read TIME
    fast = Bucket("rpm", 1, 2.0)
    assert (await store.admit(take(fast))).admitted
    refused = await store.admit(take(fast))
    assert not refused.admitted
    assert 0 < refused.buckets[0].retry_after_s <= 0.5

    async def allowed() -> bool:
        return (await store.admit(take(fast))).admitted

    await eventually(allowed, what="the bucket to refill (2 per second)")


async def test_key_prefixes_keep_deployments_apart(replicas: Replicas) -> None:
    first, _ = replicas.new()
    other = Replicas(replicas.stack, unique_prefix())
    second, _ = other.new()
    once = Bucket("rpm", 1, 1 / 60)
    try:
        assert (await first.admit(take(once))).admitted
        assert (await second.admit(take(once))).admitted
    finally:
        drop_keys(REDIS_URL, other.prefix)


async def test_a_dead_replicas_slots_expire_with_its_lease(replicas: Replicas) -> None:
    clock = FakeClock()
    dead, _ = replicas.new(clock=clock, lease_ttl_s=5.0)
    live, _ = replicas.new(clock=clock, lease_ttl_s=5.0)
    assert (await dead.admit(slot(2))).admitted
    assert (await dead.admit(slot(2))).admitted
    assert not (await live.admit(slot(2))).admitted
    clock.advance(4.9)  # the dead replica never renews
    assert not (await live.admit(slot(2))).admitted
    clock.advance(0.2)
    assert (await live.admit(slot(2))).admitted
    assert await live.slots_in_use("acme") == 1


async def test_a_live_replica_keeps_its_slots_by_renewing_its_lease(replicas: Replicas) -> None:
    clock = FakeClock()
    holder, _ = replicas.new(clock=clock, lease_ttl_s=5.0)
    other, _ = replicas.new(clock=clock, lease_ttl_s=5.0)
    assert (await holder.admit(slot(1))).admitted
    for _ in range(4):  # 16 s: three times the lease, renewed every 4 s
        clock.advance(4.0)
        assert await holder.check()
        assert not (await other.admit(slot(1))).admitted
    await holder.settle(RELEASE)
    assert (await other.admit(slot(1))).admitted


async def test_a_renewal_repairs_a_count_a_lost_release_left_behind(replicas: Replicas) -> None:
    store, _ = replicas.new()
    assert (await store.admit(slot(3))).admitted
    held_key = f"{replicas.prefix}{{acme}}:held"
    with shared_client() as client:
        client.hincrby(held_key, store.replica, 2)  # as if two grants' answers had been lost
        client.hincrby(held_key, "|slots", 2)
    assert await store.slots_in_use("acme") == 3
    assert await store.check()
    assert await store.slots_in_use("acme") == 1
    await store.settle(RELEASE)
    assert await store.check()
    assert await store.slots_in_use("acme") == 0


async def test_an_unreachable_redis_falls_back_to_memory_then_recovers(
    replicas: Replicas, private_redis: RedisProcess
) -> None:
    store, events = replicas.new(private_redis.url, timeout_s=0.05)  # nothing listens there yet
    assert (await store.admit(take(RPM2))).admitted
    assert not store.up
    assert events.errors == ["admit"]
    assert events.fallbacks == ["admit"]
    assert not await store.check()
    assert events.errors == ["admit", "ping"]
    assert (await store.admit(take(RPM2))).admitted  # the fallback's own bucket
    assert not (await store.admit(take(RPM2))).admitted
    assert events.errors == ["admit", "ping"], "a store that knows Redis is down must not try it per request"

    private_redis.start()
    assert await store.check()
    assert store.up
    assert (await store.admit(take(RPM2))).admitted  # Redis's bucket, untouched so far
    with private_redis.client() as client:
        assert client.exists(f"{replicas.prefix}{{acme}}:rpm")


async def test_a_redis_that_never_answers_costs_a_request_at_most_its_budget(replicas: Replicas) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", free_port()))
        silent.listen(64)  # connections complete in the kernel's backlog; nothing ever answers
        port = silent.getsockname()[1]
        store, events = replicas.new(f"redis://127.0.0.1:{port}/0", timeout_s=1.0, budget_s=0.05)
        started = time.monotonic()
        first = await store.admit(slot(1))
        assert first.admitted
        waited = time.monotonic() - started
        assert waited < 0.5, f"the call waited {waited:.3f}s on a silent Redis (budget 0.05 s)"
        assert events.errors == ["admit"]
        assert not (await store.admit(slot(1))).admitted  # the fallback holds the limit of 1
        assert events.errors == ["admit"], "a store that knows Redis is down must not wait on it again"
        await store.settle(release(first))
        assert (await store.admit(slot(1))).admitted


async def test_slots_taken_from_the_fallback_are_given_back_to_it_after_recovery(
    replicas: Replicas, private_redis: RedisProcess
) -> None:
    store, _ = replicas.new(private_redis.url, timeout_s=0.05)
    local = await store.admit(slot(1))
    assert local.admitted  # Redis down: the fallback's slot
    assert local.slot_at == "local"
    private_redis.start()
    assert await store.check()
    await store.settle(release(local))
    assert store.fallback.slots_in_use("acme") == 0
    assert (await store.admit(slot(1))).admitted  # now in Redis
    assert await store.slots_in_use("acme") == 1


async def test_scripts_are_loaded_again_after_redis_forgot_them(
    replicas: Replicas, private_redis: RedisProcess
) -> None:
    private_redis.start()
    store, events = replicas.new(private_redis.url)
    five = Bucket("rpm", 5, 5 / 60)
    assert (await store.admit(take(five))).admitted
    with private_redis.client() as client:
        client.script_flush()
    assert (await store.admit(take(five))).buckets[0].remaining == pytest.approx(3, abs=0.01)
    assert store.up
    assert events.errors == []
