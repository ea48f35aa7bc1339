"""The shared store's one handle (``gateway/shared/store.py``): opened once from the policy, used by
every fleet-wide feature of a process, closed once; and nothing else in the gateway opens Redis."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.policy.model import StatePolicy
from gateway.shared.store import SharedStore, store_url
from tests.limitstore.redis_server import REDIS_URL

ROOT = Path(__file__).resolve().parents[2]
OPENS_REDIS = re.compile(r"\bredis_client\(|\blimits_client\(|\.from_url\(|\baioredis\.Redis\(|\bRedisCluster\(")
ALLOWED = {
    "gateway/shared/store.py",  # the one handle
    "gateway/shared/connect.py",  # how a URL becomes a client
    "gateway/limitstore/redis.py",  # the tenant limit store: it alone speaks Redis Cluster
}


def test_state_in_memory_opens_nothing() -> None:
    shared = SharedStore.from_state(StatePolicy())
    assert shared.client is None
    assert not shared.enabled
    assert store_url(StatePolicy()) is None


async def test_state_in_redis_is_one_client_that_answers_and_closes_once() -> None:
    state = StatePolicy(backend="redis", redis_url=REDIS_URL, key_prefix="gw-test:", timeout_ms=40)
    shared = SharedStore.from_state(state)
    assert shared.client is not None
    answered = await shared.client.ping()
    await shared.aclose()
    await shared.aclose()  # a second close is nothing
    assert answered is True
    assert shared.closed
    assert (shared.key_prefix, shared.timeout_s) == ("gw-test:", 0.04)


def test_no_module_of_the_gateway_but_the_stores_opens_a_redis_connection() -> None:
    opening = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "gateway").rglob("*.py")
        if OPENS_REDIS.search(path.read_text()) and str(path.relative_to(ROOT)) not in ALLOWED
    )
    assert opening == []
