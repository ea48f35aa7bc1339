"""The shared store (``gateway/shared/store.py``): one client and pool opened from the policy and
used by every feature of a process, one budget in the event loop's free time, one health fed by
every user's calls (``gateway_redis_up``), closed once; and nothing else in the gateway opens Redis.

Real parts: the service's own composition root (``Gateway``) on a private ``redis-server``, whose
``CLIENT LIST`` shows every connection the process holds; ``CLIENT PAUSE`` for a Redis that does
not answer, a closed port for one that is gone, a delaying proxy for one that is slow, and a
callback that holds the event loop for a process that is busy.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.limitstore.redis import RedisLimitStore
from gateway.policy.model import StatePolicy
from gateway.rollout.store import RedisRolloutStore
from gateway.service import Gateway, parse_policy
from gateway.settings import Settings
from gateway.shared.store import FAILURES, SharedStore, store_url
from tests.limitstore.redis_server import REDIS_URL, DelayingProxy, RedisProcess, private_redis, unique_prefix
from tests.policy_builder import build_policy, redis_state
from tests.servers import wait_until

ROOT = Path(__file__).resolve().parents[2]
OPENS_REDIS = re.compile(r"\b(?:redis_client|Redis|RedisCluster|Sentinel|from_url)\(")
"""A call that opens a Redis client: redis-py's constructors and URL parsers, or the gateway's own."""
OPENER = "gateway/shared/"
"""The one stage that may open one (``store.py``, through ``connect.py``)."""
SECRET_ENV = "GATEWAY_CACHE_SALT_SECRET"
STALL_S = 0.2
"""How long a test holds the event loop: four times the store's budget."""


def test_state_in_memory_opens_nothing() -> None:
    shared = SharedStore.from_state(StatePolicy())
    assert shared.client is None
    assert not shared.enabled
    assert store_url(StatePolicy()) is None


async def test_state_in_redis_is_one_client_that_answers_and_closes_once() -> None:
    state = StatePolicy(backend="redis", redis_url=REDIS_URL, key_prefix="gw-test:", timeout_ms=40)
    shared = SharedStore.from_state(state)
    assert shared.client is not None
    assert SharedStore.of(shared.client) is shared  # what a feature handed the client finds
    answered = await shared.client.ping()
    await shared.aclose()
    await shared.aclose()  # a second close is nothing
    assert answered is True
    assert shared.closed
    assert (shared.key_prefix, shared.timeout_s) == ("gw-test:", 0.04)


def test_no_module_of_the_gateway_but_the_shared_stage_opens_a_redis_connection() -> None:
    opening = sorted(
        where
        for path in (ROOT / "gateway").rglob("*.py")
        if not (where := str(path.relative_to(ROOT))).startswith(OPENER) and OPENS_REDIS.search(path.read_text())
    )
    assert opening == []


def test_the_scan_finds_every_way_of_opening_a_client() -> None:
    """The check above is only as good as its pattern: each opener is caught, a type test is not."""
    for line in (
        'redis_client("redis://x")',
        "aioredis.Redis(host=h)",
        'Redis.from_url("redis://x")',
        "RedisCluster(startup_nodes=n)",
        "Sentinel([(h, p)])",
    ):
        assert OPENS_REDIS.search(line), line
    assert not OPENS_REDIS.search("isinstance(client, RedisCluster)")
    assert not OPENS_REDIS.search("class SentinelMaster(aioredis.Redis):")


# One client and pool, shared by every feature the service builds


@asynccontextmanager
async def gateway_on(url: str, prefix: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    """The service's composition root with its state in the Redis at ``url``, every fleet-wide
    feature on (the prefix view needs the cache-salt secret); its loops not started, so that the
    test makes each feature's calls itself, one after another."""
    monkeypatch.setenv(SECRET_ENV, "shared-store-test-secret")
    state = {**redis_state(url, prefix, timeout_ms=50), "request_budget_ms": 1000}
    text = build_policy(state=state, fleet={"timeout_ms": 200})
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "policy.yaml"
        path.write_text(text)
        settings = Settings(policy_path=str(path), health_checks=False, port=0, admin_port=0, rollout_dir=folder)
        gateway = Gateway(settings, parse_policy(text, str(path)))
        try:
            yield gateway
        finally:
            await gateway.aclose()


class Users:
    """The users of the shared store a gateway built: each of them is on."""

    def __init__(self, gateway: Gateway) -> None:
        limits, fleet, view = gateway.limit_store, gateway.fleet, gateway.prefix_view
        sharing, rollouts = gateway.affinity.sharing, gateway.rollouts.store
        assert isinstance(limits, RedisLimitStore)
        assert fleet is not None
        assert view is not None
        assert sharing is not None
        assert isinstance(rollouts, RedisRolloutStore)
        self.limits, self.fleet, self.view, self.sharing, self.rollouts = limits, fleet, view, sharing, rollouts

    def stores(self) -> dict[str, SharedStore]:
        """The store each one bounds its calls with and reports them to."""
        return {
            "limits": self.limits.shared,
            "ledger": self.fleet.ledger.store,
            "prefix view": self.view.store,
            "responses": self.sharing.store,
            "rollouts": self.rollouts.shared,
        }

    async def call_each(self) -> None:
        """One call of each, in turn: none waits for another's connection."""
        assert await self.limits.check()
        await self.fleet.sync_once()
        assert self.fleet.up, "the ledger's sync failed"
        await self.view.exchange()
        assert await self.sharing.lookup("resp_unknown", "acme") is None
        assert await self.rollouts.load("no-such-rollout") is None


def connections(server: RedisProcess) -> list[dict[str, str]]:
    """Every client connection the private Redis holds but the one asking."""
    with server.client() as observer:
        me = observer.client_id()
        return [entry for entry in observer.client_list() if int(entry["id"]) != me]


async def test_every_feature_the_service_builds_uses_the_one_client_of_the_shared_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with private_redis() as server:
        async with gateway_on(server.url, unique_prefix(), monkeypatch) as gateway:
            shared = gateway.shared
            assert shared.client is not None
            assert connections(server) == []  # built, not yet called: nothing opened ahead
            users = Users(gateway)
            await users.call_each()
            assert users.stores() == dict.fromkeys(users.stores(), shared)  # the very object (no __eq__)
            # Calls one after another take one connection from the one pool: a feature with a
            # client of its own would show up here as a connection of its own.
            held = connections(server)
            assert len(held) == 1, held
            assert int(held[0]["id"]) == await shared.client.client_id()
        wait_until(lambda: connections(server) == [], what="the one client closed, by the service, after every user")


async def test_a_gateway_without_redis_has_no_shared_client_and_no_redis_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SECRET_ENV, "shared-store-test-secret")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "policy.yaml"
        path.write_text(text := build_policy())
        settings = Settings(policy_path=str(path), health_checks=False, port=0, admin_port=0, rollout_dir=folder)
        gateway = Gateway(settings, parse_policy(text, str(path)))
        try:
            assert gateway.shared.client is None
            assert gateway.metrics.registry.get_sample_value("gateway_redis_up") is None
        finally:
            await gateway.aclose()


# One health, fed by every user's calls


def redis_up(gateway: Gateway) -> float | None:
    return gateway.metrics.registry.get_sample_value("gateway_redis_up")


async def test_a_redis_that_stops_answering_any_user_sets_redis_up_to_0_and_an_answer_to_any_user_back_to_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with private_redis() as server:
        async with gateway_on(server.url, unique_prefix(), monkeypatch) as gateway:
            users = Users(gateway)
            await users.call_each()
            assert redis_up(gateway) == 1
            with server.client() as admin:
                admin.execute_command("CLIENT", "PAUSE", 2000, "ALL")  # Redis holds every command 2 s
            await users.fleet.sync_once()  # the ledger's sync: cut after fleet.timeout_ms (200 ms)
            assert not users.fleet.up
            assert redis_up(gateway) == 0
            wait_until(server.answers, timeout=10, what="the pause to end")
            assert await users.rollouts.load("no-such-rollout") is None  # another user
            assert redis_up(gateway) == 1


async def test_a_closed_port_is_a_failure_at_once_and_a_later_answer_a_success() -> None:
    with private_redis() as server:
        server.kill()  # its port closed: connections refused
        store = SharedStore.open(server.url, timeout_s=0.05)
        assert store.client is not None
        try:
            started = time.monotonic()
            with pytest.raises(FAILURES):
                async with store.budget(5.0):
                    await store.client.ping()
            assert time.monotonic() - started < 1.0, "refused, then retried: the failure did not surface at once"
            assert not store.up
            server.start()  # the same port
            async with store.budget():
                assert await store.client.ping()
            assert store.up
        finally:
            await store.aclose()


# One budget, in the event loop's free time


async def test_a_call_over_its_budget_in_wall_time_but_not_in_free_time_is_answered_and_judged_up() -> None:
    """The loop is held for four times the budget while Redis's reply waits in the socket: a plain
    ``asyncio.timeout`` would cut the call and count Redis as lost; the store's budget does not."""
    store = SharedStore.open(REDIS_URL, timeout_s=0.05)
    assert store.client is not None
    try:
        await store.client.ping()  # a connection open: the call below is one round trip
        store.up = False  # as after an outage: the call below must bring it back
        loop = asyncio.get_running_loop()
        async with store.budget() as call:
            loop.call_soon(time.sleep, STALL_S)  # a callback that holds the loop (a large body parsed, say)
            assert await store.client.ping()
        assert call.wall_s >= STALL_S > store.timeout_s
        assert call.free_s < store.timeout_s
        assert store.up
    finally:
        await store.aclose()


async def test_an_answer_slower_than_the_store_s_timeout_is_slow_even_within_a_longer_budget() -> None:
    """A feature with a longer budget (the ledger's) still gets its answer; the health says slow."""
    async with DelayingProxy(delay_s=0.15) as proxy:
        store = SharedStore.open(proxy.url, timeout_s=0.05)
        assert store.client is not None
        try:
            async with store.budget(2.0):
                assert await store.client.ping()
            assert not store.up, "answered in 150 ms of free time, over the store's 50 ms"
            proxy.delay_s = 0.0
            async with store.budget(2.0):
                assert await store.client.ping()
            assert store.up
        finally:
            await store.aclose()


async def test_a_budget_shorter_than_the_store_s_timeout_that_runs_out_tells_nothing_of_redis() -> None:
    """A request's last milliseconds run out: Redis may well answer within ``state.timeout_ms``."""
    async with DelayingProxy(delay_s=0.15) as proxy:
        store = SharedStore.open(proxy.url, timeout_s=0.1)
        assert store.client is not None
        try:
            async with store.budget(2.0):
                await store.client.ping()  # a connection open, at the proxy's pace
            store.up = True
            with pytest.raises(TimeoutError, match="free time"):
                async with store.budget(0.02):
                    await store.client.ping()
            assert store.up
            with pytest.raises(TimeoutError, match="free time"):
                async with store.budget(0.1):
                    await store.client.ping()
            assert not store.up, "no answer within the store's own timeout: Redis is slow"
        finally:
            await store.aclose()


async def test_the_store_s_client_has_no_socket_timeouts_and_no_retries() -> None:
    store = SharedStore.open(REDIS_URL)
    try:
        assert isinstance(store.client, aioredis.Redis)
        options = store.client.connection_pool.connection_kwargs
        assert options.get("socket_timeout") is None
        assert options.get("socket_connect_timeout") is None
        assert options["retry"].get_retries() == 0
    finally:
        await store.aclose()
