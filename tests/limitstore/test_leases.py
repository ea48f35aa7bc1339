"""Leases of tenant limits (``gateway/limitstore/lease.py``): the limits hold fleet-wide at every
instant, and a steady rate costs Redis a small fraction of a round trip per request.

The stateful property test runs 2 to 5 store instances (gateway processes) against the real
Redis, each through a proxy of its own (``loadtests/harness/delay_proxy.py``) that a step may cut, on
one fake clock (Redis's scripts take it too, so leases expire when the test moves it). Steps:
admissions (a concurrency slot, a request and some tokens, all from leases), settlements
(some give tokens back), keeper ticks (the clock moves a second, every live process syncs),
a process's death (its leases lapse ``lease_ttl_s`` later, second by second), a process
joining, Redis cut and restored for one process. ``on_store_loss: closed`` (a process cut off
admits nothing), so the bounds are exact, and checked after every step:

* the requests holding a slot, over every live process, never exceed ``max_concurrent``;
* the requests admitted in any window of ``w`` seconds never exceed ``capacity + refill * w``,
  and the tokens likewise plus what was given back (one token bucket's bound; the buckets
  refill in seconds here, so that a few steps reach a full bucket beside leases held out),
  whichever process admitted them and whatever each held in its lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from gateway.admission.tenant_limits import TenantLimiter
from gateway.dialects.chat import CHAT
from gateway.limitstore.base import Adjust, Ask, Bucket, LimitVerdict, Settlement, Take
from gateway.limitstore.redis import RedisConfig, RedisLimitStore
from gateway.policy.model import Tenant
from gateway.service import parse_policy
from gateway.types import InferenceRequest
from loadtests.harness.delay_proxy import DelayProxy
from tests.fake_clock import FakeClock
from tests.limitstore.redis_server import REDIS_URL, drop_keys, eventually, unique_prefix
from tests.policy_builder import build_policy

REDIS_PORT = int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])
SLOTS = 32  # spare slots in a lease: 2 (1/16)
RPM = Bucket("rpm", 128, 32.0)  # prefetch up to 2 requests (1/64); full again in 4 s
TPM = Bucket("tpm", 6400, 3200.0)  # prefetch up to 100 tokens; full again in 2 s
TTL_S = 5.0
MOST = 5


@dataclasses.dataclass
class Running:
    verdict: LimitVerdict
    tokens: int


class Fleet(RuleBasedStateMachine):
    """Store instances sharing one tenant's limits through leases (module docstring)."""

    loop: asyncio.AbstractEventLoop
    proxies: list[DelayProxy]

    def __init__(self) -> None:
        super().__init__()
        self.prefix = unique_prefix()
        self.clock = FakeClock(time.time())
        self.stores: list[RedisLimitStore | None] = []
        self.running: list[list[Running]] = []
        self.taken: list[tuple[float, int, int]] = []  # (time, requests, tokens) admitted
        self.given_back = 0
        for proxy in self.proxies:
            proxy.restore()

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def live(self) -> list[int]:
        return [i for i, store in enumerate(self.stores) if store is not None]

    def cut_off(self) -> bool:
        return any(self.proxies[i].refusing for i in self.live())

    @initialize(processes=st.integers(2, MOST))
    def start(self, processes: int) -> None:
        for _ in range(processes):
            self.join()

    def join(self) -> None:
        proxy = self.proxies[len(self.stores)]
        config = RedisConfig(
            url=proxy.url,
            key_prefix=self.prefix,
            timeout_s=0.5,
            request_budget_s=1.0,
            lease_ttl_s=TTL_S,
            on_store_loss="closed",
        )
        self.stores.append(RedisLimitStore(config, clock=self.clock))
        self.running.append([])

    @precondition(lambda self: len(self.stores) < MOST)
    @rule()
    def a_process_joins(self) -> None:
        self.join()

    @rule(data=st.data(), tokens=st.sampled_from([1, 50, 400]))
    def admit(self, data: st.DataObject, tokens: int) -> None:
        process = data.draw(st.sampled_from(self.live()))
        store = self.stores[process]
        assert store is not None
        ask = Ask(scope="acme", slot_limit=SLOTS, takes=(Take(RPM, 1), Take(TPM, tokens)))
        verdict = self.run(store.admit(ask))
        if verdict.admitted:
            self.running[process].append(Running(verdict, tokens))
            self.taken.append((self.clock.now(), 1, tokens))

    @precondition(lambda self: any(self.running[i] for i in self.live()))
    @rule(data=st.data(), give_back=st.booleans())
    def settle(self, data: st.DataObject, give_back: bool) -> None:
        process = data.draw(st.sampled_from([i for i in self.live() if self.running[i]]))
        index = data.draw(st.integers(0, len(self.running[process]) - 1))
        done = self.running[process].pop(index)
        store = self.stores[process]
        assert store is not None
        assert done.verdict.slot_at is not None
        back = done.tokens // 2 if give_back else 0
        self.given_back += back
        adjusts = (Adjust(TPM, back),) if back else ()
        settlement = Settlement(scope="acme", release_slot=True, slot_at=done.verdict.slot_at, adjusts=adjusts)
        self.run(store.settle(settlement))

    @precondition(lambda self: not self.cut_off())
    @rule()
    def a_second_passes_and_every_keeper_syncs(self) -> None:
        self.tick()

    def tick(self) -> None:
        self.clock.advance(1.0)
        for i in self.live():
            store = self.stores[i]
            assert store is not None
            self.run(store.flush(every=False))
            self.run(store.check())

    @precondition(lambda self: not self.cut_off() and len(self.live()) > 1)
    @rule(data=st.data())
    def a_process_dies(self, data: st.DataObject) -> None:
        """Killed: its requests end with it, its leases return only when they lapse in Redis."""
        process = data.draw(st.sampled_from(self.live()))
        store = self.stores[process]
        assert store is not None
        self.run(store._redis.aclose())  # no lease given back
        self.stores[process] = None
        self.running[process] = []
        for _ in range(int(TTL_S) + 1):
            self.tick()

    @rule(data=st.data())
    def redis_is_cut_off_for_one(self, data: st.DataObject) -> None:
        self.proxies[data.draw(st.sampled_from(self.live()))].cut()

    @precondition(lambda self: self.cut_off())
    @rule()
    def redis_is_back(self) -> None:
        for i in self.live():
            self.proxies[i].restore()
            store = self.stores[i]
            assert store is not None
            self.run(eventually(store.check, what="Redis back"))

    @invariant()
    def never_more_requests_running_than_the_limit(self) -> None:
        running = sum(len(self.running[i]) for i in self.live())
        assert running <= SLOTS, f"{running} running for a limit of {SLOTS}"

    @invariant()
    def never_more_admitted_in_any_window_than_one_bucket_allows(self) -> None:
        now = self.clock.now()
        for start, _, _ in self.taken:
            window = now - start
            requests = sum(r for t, r, _ in self.taken if t >= start)
            tokens = sum(k for t, _, k in self.taken if t >= start)
            assert requests <= RPM.capacity + RPM.refill_per_s * window + 1e-6, (requests, window)
            assert tokens <= TPM.capacity + TPM.refill_per_s * window + self.given_back + 1e-6, (tokens, window)

    def teardown(self) -> None:
        try:
            for proxy in self.proxies:
                proxy.restore()
            for i in self.live():
                store = self.stores[i]
                assert store is not None
                self.run(eventually(store.check, what="Redis back"))
                for done in self.running[i]:
                    assert done.verdict.slot_at is not None
                    self.run(store.settle(Settlement(scope="acme", release_slot=True, slot_at=done.verdict.slot_at)))
                self.run(store.aclose())  # gives every lease back
            self.clock.advance(TTL_S + 1)  # and the dead processes' leases lapse
            checker = RedisLimitStore(RedisConfig(url=REDIS_URL, key_prefix=self.prefix), clock=self.clock)
            assert self.run(checker.slots_in_use("acme")) == 0, "slots left in Redis"
            self.run(checker.aclose())
        finally:
            drop_keys(REDIS_URL, self.prefix)


@pytest.fixture
def links() -> Iterator[list[DelayProxy]]:
    with ExitStack() as stack:
        yield [stack.enter_context(DelayProxy(upstream_port=REDIS_PORT)) for _ in range(MOST)]


def test_the_limits_hold_fleet_wide_at_every_instant_over_any_interleaving(links: list[DelayProxy]) -> None:
    loop = asyncio.new_event_loop()
    machine = type("Fleet_", (Fleet,), {"loop": loop, "proxies": links})
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=60,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        loop.close()


def tenant(name: str) -> Tenant:
    limits = {"rpm": 600_000, "tpm": 1_000_000_000, "max_concurrent": 2000}
    text = build_policy(tenants={name: {"limits": limits}})
    return next(t for t in parse_policy(text, "t.yaml").policy.tenants if t.name == name)


@pytest.mark.parametrize("tenants", [1, 10], ids=["one tenant", "ten tenants"])
async def test_a_steady_rate_costs_at_most_a_tenth_of_a_round_trip_per_request(tenants: int) -> None:
    """400 requests a second, each 20 ms long, through the tenant limiter with the keeper running:
    the round trips (a command or a pipeline: one write, counted by the proxy) over the last two
    seconds, per request, at most 0.1 (before leases: 2, an admission and a settlement)."""
    prefix = unique_prefix()
    names = [f"t{i}" for i in range(tenants)]
    limited = [tenant("acme").model_copy(update={"name": name}) for name in names]
    with DelayProxy(upstream_port=REDIS_PORT) as proxy:
        config = RedisConfig(url=proxy.url, key_prefix=prefix, timeout_s=0.5, request_budget_s=1.0)
        store = RedisLimitStore(config)
        limiter = TenantLimiter(store)
        keeper = asyncio.create_task(store.run())
        tasks: set[asyncio.Task[None]] = set()

        async def one(who: Tenant) -> None:
            request = InferenceRequest("id", CHAT, "m", {}, b"", False, False, 10, 90, 0.0)
            admission = await limiter.admit(who, request)
            await asyncio.sleep(0.02)  # the request runs
            await limiter.settle(admission, used_tokens=50)

        try:
            assert await store.check()
            loop = asyncio.get_running_loop()
            start, rate, served, sent_at_warm = loop.time(), 400, 0, 0
            for i in range(rate * 3):
                if i == rate:
                    sent_at_warm, served = proxy.sent, 0
                if (delay := start + i / rate - loop.time()) > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(one(limited[i % tenants]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                served += 1
            await asyncio.gather(*tasks)
            per_request = (proxy.sent - sent_at_warm) / served
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            await store.aclose()
            drop_keys(REDIS_URL, prefix)
    assert store.up
    assert per_request <= 0.1, f"{per_request:.3f} round trips per request"


async def test_tokens_held_in_a_lease_while_the_bucket_refills_are_not_spent_twice() -> None:
    """One process holds a lease; the bucket refills meanwhile (to its capacity less the lease,
    ``limitstore/scripts.py``); another drains it; the first spends its lease: no more than the
    capacity is admitted in that instant, one token bucket's bound."""
    prefix, clock = unique_prefix(), FakeClock(time.time())
    tpm = Bucket("tpm", 6400, 3200.0)  # prefetch up to 100 tokens
    stores = [RedisLimitStore(RedisConfig(url=REDIS_URL, key_prefix=prefix), clock=clock) for _ in range(2)]
    holder, drainer = stores

    async def spend(store: RedisLimitStore, amount: int) -> int:
        admitted = 0
        while (await store.admit(Ask(scope="acme", takes=(Take(tpm, amount),)))).admitted:
            admitted += amount
        return admitted

    try:
        lease = holder._leases
        for _ in range(200):  # each dry admission doubles the prefetch: the lease grows to 100
            assert (await holder.admit(Ask(scope="acme", takes=(Take(tpm, 1),)))).admitted
            if lease["acme"].buckets["tpm"].unspent >= 50:
                break
        held = lease["acme"].buckets["tpm"].unspent
        assert held >= 50, f"the lease holds {held}"
        clock.advance(5.0)  # the bucket refills in full, the lease (10 s) is still valid
        now = await spend(drainer, 400) + await spend(drainer, 1)
        now += await spend(holder, 1)
        assert now <= tpm.capacity, f"{now} tokens admitted at one instant for a capacity of {tpm.capacity:g}"
        assert now >= tpm.capacity - 1, "the capacity is admitted in full"
    finally:
        for store in stores:
            await store.aclose()
        drop_keys(REDIS_URL, prefix)
