"""A request gives its concurrency slot back where it took it, through any Redis loss and recovery.

Issue 28: during a 10 s Redis outage two replicas admitted 12 requests of a tenant whose limit
is 4 (the README promised at most N x): ``settle`` gave a fallback slot back for a request whose
slot was taken in Redis, so the fallback had room again while the request still ran.

First the issue's scenario, then a stateful property test: two limiter instances (two gateway
processes) against the real Redis, each through a proxy of its own that a step may cut
(``loadtests/harness/delay_proxy.py``), over random interleavings of admissions, settlements, Redis lost and back
for one or both, and pings. After every step the test checks the bounds the design promises
(``gateway/limitstore/outage.py``), from its own record of which requests hold a slot and where:

* Redis never grants more than the limit: the requests holding a slot taken in Redis are at
  most ``limit`` (its count includes every slot, wherever taken, once a process renewed);
* a process admits alone only within its cap (``open``: the limit; ``share``: limit // N), the
  slots it still holds in Redis included: a process never holds more than its cap that way;
* so in ``open`` no process ever holds more than the limit (the fleet at most N x the limit),
  and in ``share`` an admission leaves the fleet at most ``limit`` plus the slots taken alone
  by processes still cut off from Redis (each at most limit // N): exactly the limit while
  every process reaches Redis, whatever happened before;
* once Redis is back for all, every request has ended and each process has pinged, every slot
  is back: none in Redis, none in any fallback.
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
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from gateway.admission.tenant_limits import Admission, TenantLimiter
from gateway.dialects.chat import CHAT
from gateway.errors import Overloaded
from gateway.limitstore.redis import RedisConfig, RedisLimitStore
from gateway.policy.model import Tenant
from gateway.service import parse_policy
from gateway.types import InferenceRequest
from loadtests.harness.delay_proxy import DelayProxy
from tests.fake_clock import FakeClock
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix
from tests.policy_builder import build_policy

REDIS_PORT = int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])
LIMIT = 3
PROCESSES = 2


def acme(max_concurrent: int) -> Tenant:
    text = build_policy(tenants={"acme": {"limits": {"max_concurrent": max_concurrent}}})
    return parse_policy(text, "t.yaml").policy.tenants[0]


def request() -> InferenceRequest:
    return InferenceRequest("id", CHAT, "m", {}, b"", False, False, 10, 90, 0.0)


def store_behind(proxy: DelayProxy, prefix: str, mode: str, clock: FakeClock | None = None) -> RedisLimitStore:
    """A store through ``proxy``; ``open`` is RedisConfig's default (and the only mode before issue 28)."""
    config = RedisConfig(url=proxy.url, key_prefix=prefix, timeout_s=0.5, request_budget_s=1.0)
    if mode == "open":
        return RedisLimitStore(config, clock=clock)
    options: dict[str, Any] = {"on_store_loss": mode}  # untyped: the file also runs on the code before issue 28
    return RedisLimitStore(dataclasses.replace(config, **options), clock=clock, processes=lambda: PROCESSES)


async def fill(limiter: TenantLimiter, tenant: Tenant) -> list[Admission]:
    """Every admission granted until the first refusal."""
    held = []
    while True:
        try:
            held.append(await limiter.admit(tenant, request()))
        except Overloaded:
            return held
        assert len(held) < 100, "never refused"


@pytest.fixture
def links() -> Iterator[list[DelayProxy]]:
    with ExitStack() as stack:
        yield [stack.enter_context(DelayProxy(upstream_port=REDIS_PORT)) for _ in range(PROCESSES)]


async def test_a_slot_taken_in_redis_is_given_back_to_redis_even_when_redis_was_lost_meanwhile(
    links: list[DelayProxy],
) -> None:
    """The issue's scenario on two replicas, concurrency limit 4: 12 at once before; now at most
    4 per replica (``open``: each the whole limit, the slots it holds in Redis included)."""
    prefix = unique_prefix()
    first, second = (store_behind(link, prefix, "open") for link in links)
    limiter_one, limiter_two, tenant = TenantLimiter(first), TenantLimiter(second), acme(4)
    try:
        in_redis = await fill(limiter_one, tenant)
        assert len(in_redis) == 4
        for link in links:
            link.cut()
        most = 0
        for _ in range(2):  # twice: the first replica's Redis requests end one by one meanwhile
            held_one, held_two = await fill(limiter_one, tenant), await fill(limiter_two, tenant)
            most = max(most, len(in_redis) + len(held_one) + len(held_two))
            await limiter_one.settle(in_redis.pop(0), used_tokens=1)
            in_redis += held_one
        assert most <= 8, f"{most} requests of acme at once for a limit of 4 on two replicas"
    finally:
        await first.aclose()
        await second.aclose()
        drop_keys(REDIS_URL, prefix)


@dataclasses.dataclass
class Held:
    admission: Admission
    where: str  # "store" (Redis) or "local" (the fallback)


class Slots(RuleBasedStateMachine):
    """Two limiter instances sharing a tenant's concurrency through Redis (module docstring)."""

    mode = "share"
    loop: asyncio.AbstractEventLoop
    proxies: list[DelayProxy]

    def __init__(self) -> None:
        super().__init__()
        self.prefix = unique_prefix()
        self.clock = FakeClock(time.time())  # leases never lapse unless the test moves it
        self.stores = [store_behind(proxy, self.prefix, self.mode, self.clock) for proxy in self.proxies]
        self.limiters = [TenantLimiter(store) for store in self.stores]
        self.tenant = acme(LIMIT)
        self.held: list[list[Held]] = [[] for _ in self.stores]
        self.cap = LIMIT if self.mode == "open" else LIMIT // PROCESSES
        for proxy in self.proxies:
            proxy.restore()

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def count(self, where: str, process: int | None = None) -> int:
        chosen = self.held if process is None else [self.held[process]]
        return sum(1 for held in chosen for h in held if h.where == where)

    def total(self) -> int:
        return sum(len(held) for held in self.held)

    @rule(process=st.integers(0, PROCESSES - 1))
    def admit(self, process: int) -> None:
        store, limiter = self.stores[process], self.limiters[process]
        try:
            admission = self.run(limiter.admit(self.tenant, request()))
        except Overloaded as refused:
            refusal = refused.code
            assert refusal in ("tenant_concurrency_limited", "limits_unavailable")
            return
        where = "store" if store.up else "local"  # a call that fell back leaves the store down
        self.held[process].append(Held(admission, where))
        if where == "local":
            mine = len(self.held[process])
            assert mine <= self.cap, f"process {process} holds {mine} after admitting alone (cap {self.cap})"
        else:
            cut_off = sum(self.count("local", j) for j, s in enumerate(self.stores) if not s.up)
            assert self.total() <= LIMIT + cut_off, f"{self.total()} held after a Redis admission"

    @precondition(lambda self: any(self.held))
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        process = data.draw(st.sampled_from([i for i, held in enumerate(self.held) if held]))
        index = data.draw(st.integers(0, len(self.held[process]) - 1))
        held = self.held[process].pop(index)
        self.run(self.limiters[process].settle(held.admission, used_tokens=1))

    @rule(process=st.integers(0, PROCESSES - 1))
    def lose_redis(self, process: int) -> None:
        self.proxies[process].cut()

    @rule()
    def lose_redis_everywhere(self) -> None:
        for proxy in self.proxies:
            proxy.cut()

    @rule(process=st.integers(0, PROCESSES - 1))
    def redis_back(self, process: int) -> None:
        self.proxies[process].restore()

    @rule(process=st.integers(0, PROCESSES - 1))
    def ping(self, process: int) -> None:
        self.run(self.stores[process].check())

    @invariant()
    def redis_never_grants_more_than_the_limit(self) -> None:
        assert self.count("store") <= LIMIT

    @invariant()
    def open_keeps_each_process_within_the_limit(self) -> None:
        if self.mode == "open":
            assert all(len(held) <= LIMIT for held in self.held), [len(held) for held in self.held]

    def teardown(self) -> None:
        try:
            for proxy in self.proxies:
                proxy.restore()
            for process, held in enumerate(self.held):
                for h in held:
                    self.run(self.limiters[process].settle(h.admission, used_tokens=1))
            for store in self.stores:  # a first ping may find its connection cut, the next reconnects
                assert any(self.run(store.check()) for _ in range(2)), "Redis did not come back"
            assert self.run(self.stores[0].slots_in_use("acme")) == 0, "slots left in Redis"
            for store in self.stores:
                fallback: Any = store.fallback
                left = fallback.slots_in_use("acme")
                left = self.run(left) if asyncio.iscoroutine(left) else left
                assert left == 0, "slots left in a fallback"
        finally:
            for store in self.stores:
                self.run(store.aclose())
            drop_keys(REDIS_URL, self.prefix)


@pytest.mark.parametrize("mode", ["open", "share"])
def test_slots_stay_within_their_bounds_and_all_come_back_over_any_interleaving(
    links: list[DelayProxy], mode: str
) -> None:
    loop = asyncio.new_event_loop()
    machine = type(f"Slots_{mode}", (Slots,), {"mode": mode, "loop": loop, "proxies": links})
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=100,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        loop.close()
