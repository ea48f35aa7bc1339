"""The map of stored responses on its own: tenant-scoped, bounded, expiring."""

from __future__ import annotations

from gateway.response_affinity import ResponseAffinity
from tests.fake_clock import FakeClock


async def test_only_the_creating_tenant_finds_a_response_and_only_until_it_expires() -> None:
    clock = FakeClock(0.0)
    affinity = ResponseAffinity(clock, ttl_s=60)
    affinity.remember("resp_1", "acme", "engine-0", "llama")
    held = await affinity.holder("resp_1", "acme")
    assert held is not None
    assert (held.backend, held.model) == ("engine-0", "llama")
    assert await affinity.holder("resp_1", "globex") is None
    assert await affinity.holder("resp_2", "acme") is None
    clock.t = 61.0
    assert await affinity.holder("resp_1", "acme") is None
    assert len(affinity) == 0


async def test_the_map_is_bounded_least_recently_used_first_out() -> None:
    affinity = ResponseAffinity(FakeClock(0.0), max_entries=2)
    affinity.remember("a", "acme", "b0", "m")
    affinity.remember("b", "acme", "b0", "m")
    assert await affinity.holder("a", "acme") is not None  # "a" is now the most recent
    affinity.remember("c", "acme", "b0", "m")
    assert len(affinity) == 2
    assert await affinity.holder("b", "acme") is None
    assert await affinity.holder("a", "acme") is not None
