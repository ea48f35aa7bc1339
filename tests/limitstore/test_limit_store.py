"""Conformance suite of the LimitStore protocol, run over every implementation."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.limitstore.base import Adjust, Ask, Bucket, LimitStore, Settlement, Take
from gateway.limitstore.memory import MemoryLimitStore
from gateway.limitstore.redis import RedisConfig, RedisLimitStore
from tests.fake_clock import FakeClock
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix

RPM = Bucket("rpm", 3, 1.0)
TPM = Bucket("tpm", 10, 2.0)


def ask(*takes: tuple[Bucket, float], scope: str = "acme", slots: int | None = None) -> Ask:
    return Ask(scope=scope, slot_limit=slots, takes=tuple(Take(bucket, amount) for bucket, amount in takes))


def settle(*adjusts: tuple[Bucket, float], scope: str = "acme", release: bool = False) -> Settlement:
    return Settlement(scope=scope, release_slot=release, adjusts=tuple(Adjust(b, a) for b, a in adjusts))


async def level(store: LimitStore, bucket: Bucket, scope: str = "acme") -> float:
    """The bucket's level, read by an ask of nothing from it (refused asks take nothing)."""
    verdict = await store.admit(ask((bucket, bucket.capacity * 10), scope=scope))
    assert not verdict.admitted
    return verdict.buckets[0].remaining


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
    config = RedisConfig(url=REDIS_URL, key_prefix=prefix, timeout_s=1.0, request_budget_s=2.0)
    store = RedisLimitStore(config, clock=clock)
    assert await store.check(), f"Redis at {REDIS_URL} does not answer"
    yield store, clock
    assert store.up, "a Redis command failed: the test ran (partly) on the fallback"
    await store.aclose()
    drop_keys(REDIS_URL, prefix)


async def test_a_full_bucket_allows_up_to_its_capacity_then_refuses(
    store_and_clock: tuple[LimitStore, FakeClock],
) -> None:
    store, _ = store_and_clock
    verdicts = [await store.admit(ask((RPM, 1))) for _ in range(4)]
    assert [v.admitted for v in verdicts] == [True, True, True, False]
    assert verdicts[2].buckets[0].remaining == 0
    assert verdicts[3].refused_by == "rpm"
    assert verdicts[3].buckets[0].retry_after_s == pytest.approx(1.0)


async def test_the_bucket_refills_at_its_rate(store_and_clock: tuple[LimitStore, FakeClock]) -> None:
    store, clock = store_and_clock
    assert (await store.admit(ask((TPM, 10)))).admitted
    refused = await store.admit(ask((TPM, 4)))
    assert not refused.admitted
    assert refused.buckets[0].retry_after_s == pytest.approx(2.0)
    assert refused.buckets[0].reset_s == pytest.approx(5.0)
    clock.advance(2.0)
    assert (await store.admit(ask((TPM, 4)))).admitted


async def test_an_ask_takes_everything_or_nothing(store_and_clock: tuple[LimitStore, FakeClock]) -> None:
    store, _ = store_and_clock
    refused = await store.admit(ask((RPM, 1), (TPM, 11), slots=1))
    assert (refused.admitted, refused.refused_by) == (False, "tpm")
    assert [b.allowed for b in refused.buckets] == [True, False]
    assert await store.slots_in_use("acme") == 0, "the slot of a refused ask was kept"
    assert await level(store, RPM) == pytest.approx(3), "the request of a refused ask was taken"
    admitted = await store.admit(ask((RPM, 1), (TPM, 10), slots=1))
    assert admitted.admitted
    assert [b.remaining for b in admitted.buckets] == [pytest.approx(2), pytest.approx(0)]
    assert await store.slots_in_use("acme") == 1


async def test_the_slot_is_checked_first(store_and_clock: tuple[LimitStore, FakeClock]) -> None:
    store, _ = store_and_clock
    assert (await store.admit(ask(slots=1))).admitted
    refused = await store.admit(ask((RPM, 5), slots=1))
    assert (refused.admitted, refused.refused_by) == (False, "slot")


async def test_a_settlement_gives_back_but_never_above_capacity(
    store_and_clock: tuple[LimitStore, FakeClock],
) -> None:
    store, _ = store_and_clock
    await store.admit(ask((TPM, 8)))
    await store.settle(settle((TPM, 5)))
    assert await level(store, TPM) == pytest.approx(7)
    await store.settle(settle((TPM, 100)))
    assert await level(store, TPM) == pytest.approx(10)


async def test_usage_above_the_reservation_is_charged_into_debt_that_the_refill_pays_off(
    store_and_clock: tuple[LimitStore, FakeClock],
) -> None:
    store, clock = store_and_clock
    assert (await store.admit(ask((TPM, 6)))).admitted  # reserved 6 of 10
    await store.settle(settle((TPM, -10)))  # used 16: 10 more than reserved
    assert await level(store, TPM) == pytest.approx(-6)
    refused = await store.admit(ask((TPM, 2)))
    assert not refused.admitted
    assert refused.buckets[0].retry_after_s == pytest.approx(4.0)  # (2 - -6) / 2 per second
    assert refused.buckets[0].reset_s == pytest.approx(8.0)
    clock.advance(3.9)
    assert not (await store.admit(ask((TPM, 2)))).admitted
    clock.advance(0.2)
    assert (await store.admit(ask((TPM, 2)))).admitted


async def test_a_debt_is_floored_at_minus_the_capacity(store_and_clock: tuple[LimitStore, FakeClock]) -> None:
    store, _ = store_and_clock
    await store.settle(settle((TPM, -1_000_000)))
    assert await level(store, TPM) == pytest.approx(-10)


async def test_one_settlement_releases_the_slot_and_adjusts_every_bucket(
    store_and_clock: tuple[LimitStore, FakeClock],
) -> None:
    store, _ = store_and_clock
    assert (await store.admit(ask((RPM, 1), (TPM, 10), slots=1))).admitted
    await store.settle(settle((RPM, 1), (TPM, 4), release=True))
    assert await store.slots_in_use("acme") == 0
    assert await level(store, RPM) == pytest.approx(3)
    assert await level(store, TPM) == pytest.approx(4)


async def test_scopes_are_independent(store_and_clock: tuple[LimitStore, FakeClock]) -> None:
    store, _ = store_and_clock
    assert (await store.admit(ask((TPM, 10), scope="a", slots=1))).admitted
    assert (await store.admit(ask((TPM, 10), scope="b", slots=1))).admitted
    assert await store.slots_in_use("a") == await store.slots_in_use("b") == 1


async def test_slots_are_bounded_and_released(store_and_clock: tuple[LimitStore, FakeClock]) -> None:
    store, _ = store_and_clock
    assert [(await store.admit(ask(slots=2))).admitted for _ in range(3)] == [True, True, False]
    assert await store.slots_in_use("acme") == 2
    await store.settle(settle(release=True))
    await store.settle(settle(release=True))
    assert await store.slots_in_use("acme") == 0
    assert (await store.admit(ask(slots=2))).admitted
