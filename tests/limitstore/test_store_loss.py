"""What each process enforces while Redis is lost (``state.on_store_loss``), and after it is back.

Store instances play the gateway processes: each reaches the real Redis through a proxy of its
own (``loadtests/harness/delay_proxy.py``), which a test cuts (connections reset, new ones refused: Redis lost)
and restores. Issue 28: a slot taken in Redis was given back to the fallback, so two replicas
admitted 12 for a concurrency limit of 4 during an outage; and every process enforced the
whole limit alone, so a tenant could get N times its rate for as long as it lasted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, ExitStack

import pytest

from gateway.admission.tenant_limits import TenantLimiter
from gateway.dialects.chat import CHAT
from gateway.errors import Overloaded
from gateway.limitstore.base import UNAVAILABLE, Adjust, Ask, Bucket, LimitVerdict, Settlement, Take
from gateway.limitstore.outage import LossMode
from gateway.limitstore.redis import RedisConfig, RedisLimitStore
from gateway.policy.model import Tenant
from gateway.service import parse_policy
from gateway.types import InferenceRequest
from loadtests.harness.delay_proxy import DelayProxy
from tests.fake_clock import FakeClock
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix
from tests.policy_builder import build_policy

REDIS_PORT = int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])
RPM60 = Bucket("rpm", 60, 1.0)


class Processes:
    """Store instances on one key prefix, each behind its own proxy to the real Redis."""

    def __init__(self, stack: AsyncExitStack, proxies: ExitStack, prefix: str) -> None:
        self.stack, self.proxies, self.prefix = stack, proxies, prefix
        self.links: list[DelayProxy] = []

    def new(
        self, mode: LossMode = "share", *, live: int = 2, unknown: int | None = None, clock: FakeClock | None = None
    ) -> RedisLimitStore:
        proxy = self.proxies.enter_context(DelayProxy(upstream_port=REDIS_PORT))
        self.links.append(proxy)
        config = RedisConfig(url=proxy.url, key_prefix=self.prefix, timeout_s=0.5, request_budget_s=1.0)
        if mode != "open" or unknown is not None:  # open is RedisConfig's default, and the only mode before
            config = dataclasses.replace(config, on_store_loss=mode, processes_when_unknown=unknown)
            store = RedisLimitStore(config, clock=clock, processes=lambda: live)
        else:
            store = RedisLimitStore(config, clock=clock)
        self.stack.push_async_callback(store.aclose)
        return store

    def lose_redis(self) -> None:
        for proxy in self.links:
            proxy.cut()

    def restore_redis(self) -> None:
        for proxy in self.links:
            proxy.restore()


@pytest.fixture
async def processes() -> AsyncIterator[Processes]:
    prefix = unique_prefix()
    with ExitStack() as proxies:
        async with AsyncExitStack() as stack:
            yield Processes(stack, proxies, prefix)
    drop_keys(REDIS_URL, prefix)


def acme(max_concurrent: int) -> Tenant:
    text = build_policy(tenants={"acme": {"limits": {"max_concurrent": max_concurrent}}})
    return parse_policy(text, "t.yaml").policy.tenants[0]


def request() -> InferenceRequest:
    return InferenceRequest("id", CHAT, "m", {}, b"", False, False, 10, 90, 0.0)


def slot(limit: int) -> Ask:
    return Ask(scope="acme", slot_limit=limit)


def give_back(verdict: LimitVerdict) -> Settlement:
    assert verdict.slot_at is not None
    return Settlement(scope="acme", release_slot=True, slot_at=verdict.slot_at)


async def admit_all(store: RedisLimitStore, ask: Ask) -> list[LimitVerdict]:
    """Every admission ``store`` grants for ``ask``, until the first refusal."""
    admitted: list[LimitVerdict] = []
    while (verdict := await store.admit(ask)).admitted:
        admitted.append(verdict)
        assert len(admitted) < 1000, "never refused"
    return admitted


async def level(store: RedisLimitStore, bucket: Bucket) -> float:
    verdict = await store.admit(Ask(scope="acme", takes=(Take(bucket, bucket.capacity * 10),)))
    assert not verdict.admitted
    return verdict.buckets[0].remaining


async def test_every_slot_returns_to_zero_once_redis_is_back_and_every_request_ended(processes: Processes) -> None:
    first, second = processes.new("share"), processes.new("share")
    before = await admit_all(first, slot(4))
    await first.settle(give_back(before.pop()))
    await first.settle(give_back(before.pop()))
    processes.lose_redis()
    during = {first: await admit_all(first, slot(4)), second: await admit_all(second, slot(4))}
    assert (len(during[first]), len(during[second])) == (0, 2)  # 2 each: the first holds 2 in Redis
    await first.settle(give_back(before.pop()))  # a Redis slot given back while Redis is lost
    processes.restore_redis()
    assert await first.check()
    assert await second.check()
    await first.settle(give_back(before.pop()))
    for store, verdicts in during.items():
        for verdict in verdicts:
            await store.settle(give_back(verdict))
    for store in (first, second):
        assert await store.check()
        assert store.fallback.slots_in_use("acme") == 0
    assert await first.slots_in_use("acme") == 0


async def test_while_redis_is_lost_each_process_takes_its_share_of_what_was_left(processes: Processes) -> None:
    """rpm 60, 30 spent before the outage, two processes: the outage's 30 are shared, not 60 each."""
    clock = FakeClock()
    first, second = processes.new("share", clock=clock), processes.new("share", clock=clock)
    take = Ask(scope="acme", takes=(Take(RPM60, 1),))
    for _ in range(29):
        assert (await first.admit(take)).admitted
    assert (await second.admit(take)).admitted  # the second saw the level too: 30 left
    processes.lose_redis()
    during = len(await admit_all(first, take)) + len(await admit_all(second, take))
    assert during == 30


async def test_open_gives_each_process_the_whole_limit(processes: Processes) -> None:
    clock = FakeClock()
    first, second = processes.new("open", clock=clock), processes.new("open", clock=clock)
    take = Ask(scope="acme", takes=(Take(RPM60, 1),))
    for _ in range(30):
        assert (await first.admit(take)).admitted
    processes.lose_redis()
    assert len(await admit_all(first, take)) + len(await admit_all(second, take)) == 120


@pytest.mark.parametrize(
    ("live", "unknown", "each"),
    [
        pytest.param(2, None, 2, id="two live processes: 2 slots of 4 each"),
        pytest.param(3, None, 1, id="three live processes: 1 slot each (4 // 3)"),
        pytest.param(0, 4, 1, id="never counted, processes_when_unknown 4: 1 each"),
        pytest.param(5, None, 0, id="five processes for 4 slots: none"),
    ],
)
async def test_the_concurrency_limit_is_shared_by_the_live_processes(
    processes: Processes, live: int, unknown: int | None, each: int
) -> None:
    store = processes.new("share", live=live, unknown=unknown)
    assert await store.check()
    processes.lose_redis()
    assert len(await admit_all(store, slot(4))) == each


async def test_slots_held_in_redis_count_against_the_share(processes: Processes) -> None:
    store = processes.new("share", live=2)
    held = await admit_all(store, slot(4))
    await store.settle(give_back(held.pop()))
    await store.settle(give_back(held.pop()))  # two left in Redis: exactly its share of 4
    processes.lose_redis()
    assert await admit_all(store, slot(4)) == []
    await store.settle(give_back(held.pop()))  # released (in Redis's count at its next renewal)
    assert len(await admit_all(store, slot(4))) == 1


@pytest.mark.parametrize(
    ("mode", "live", "unknown"),
    [
        pytest.param("closed", 2, None, id="closed"),
        pytest.param("share", 0, None, id="share, but the processes were never counted"),
    ],
)
async def test_a_process_that_cannot_enforce_the_limits_refuses_limited_tenants_with_503(
    processes: Processes, mode: LossMode, live: int, unknown: int | None
) -> None:
    store = processes.new(mode, live=live, unknown=unknown)
    limiter = TenantLimiter(store)
    assert await store.check()
    processes.lose_redis()
    verdict = await store.admit(slot(4))
    assert (verdict.admitted, verdict.refused_by) == (False, UNAVAILABLE)
    with pytest.raises(Overloaded) as refused:
        await limiter.admit(acme(4), request())
    assert (refused.value.status, refused.value.code) == (503, "limits_unavailable")
    assert refused.value.headers["retry-after"] == "1"


async def test_what_a_process_admitted_alone_is_charged_to_redis_when_it_is_back(processes: Processes) -> None:
    clock = FakeClock()
    store = processes.new("share", live=2, clock=clock)
    take = Ask(scope="acme", takes=(Take(RPM60, 1),))
    for _ in range(20):
        assert (await store.admit(take)).admitted  # 40 left in Redis
    processes.lose_redis()
    for _ in range(5):
        assert (await store.admit(take)).admitted  # from its share: 20
    await store.settle(Settlement(scope="acme", adjusts=(Adjust(RPM60, 1),)))  # one given back meanwhile
    processes.restore_redis()
    assert await store.check()
    assert await level(store, RPM60) == pytest.approx(36)
    assert await store.check()
    assert await level(store, RPM60) == pytest.approx(36), "charged twice"


async def test_closed_remembers_what_requests_give_back_during_the_outage(processes: Processes) -> None:
    clock = FakeClock()
    store = processes.new("closed", clock=clock)
    take = Ask(scope="acme", takes=(Take(RPM60, 1),))
    for _ in range(10):
        assert (await store.admit(take)).admitted
    processes.lose_redis()
    assert (await store.admit(take)).refused_by == UNAVAILABLE
    await store.settle(Settlement(scope="acme", adjusts=(Adjust(RPM60, 1),)))  # a refund during the outage
    processes.restore_redis()
    assert await store.check()
    assert await level(store, RPM60) == pytest.approx(51)


async def test_slots_taken_alone_count_in_redis_once_it_is_back_until_released(processes: Processes) -> None:
    first, second = processes.new("share", live=1), processes.new("share", live=1)
    assert await first.check()
    processes.lose_redis()
    alone = await first.admit(slot(2))
    assert alone.slot_at == "local"
    processes.restore_redis()
    assert await first.check()
    assert len(await admit_all(second, slot(2))) == 1, "the slot taken alone must count in Redis"
    await first.settle(give_back(alone))
    assert len(await admit_all(second, slot(2))) == 1, "released in Redis at once"
