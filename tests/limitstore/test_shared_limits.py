"""Gateways sharing their tenant limits through Redis, seen by a client (the ``openai`` SDK).

Two gateway replicas on one Redis and one key prefix enforce one tenant's requests per minute
together; a replica whose Redis is killed keeps serving (its share of the limits,
``gateway_redis_up`` 0) and shares its limits again once Redis is back on the same port
(``gateway_redis_up`` 1); with ``on_store_loss: closed`` it refuses limited tenants meanwhile.

``gateway_redis_up`` is Redis's health as every user of the shared store finds it
(``gateway/shared/store.py``): back to 1 at the first answer to any of them (the ledger syncs 20
times a second), while the limit store comes back at its own keeper's next ping
(``state.ping_interval_s``). So a test waits for the limits themselves to be shared again.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import CHAT_MODEL, KEY_ACME, KEY_GLOBEX, BackendServer, StartGateway, metric
from tests.fake_backend import FakeBackend
from tests.limitstore.redis_server import REDIS_URL, RedisProcess, drop_keys, unique_prefix
from tests.policy_builder import redis_state, session_policy
from tests.servers import admin_url, wait_until


def sdk(url: str, key: str = KEY_ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=5)


def chat(client: openai.OpenAI) -> str | None:
    reply = client.chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4
    )
    return reply.choices[0].message.content


def served_or_refused_for_limits(client: openai.OpenAI) -> bool:
    """True once a chat is served; False while it is refused as ``limits_unavailable`` (the limit
    store not yet back); any other answer fails the test."""
    try:
        return bool(chat(client))
    except openai.InternalServerError as refused:
        if (refused.status_code, refused.code) != (503, "limits_unavailable"):
            raise
        return False


@pytest.fixture
def prefix() -> Iterator[str]:
    value = unique_prefix()
    yield value
    drop_keys(REDIS_URL, value)


def test_a_gateway_without_redis_exports_no_redis_up(gateway_url: str) -> None:
    """So that an alert on ``gateway_redis_up == 0`` never fires on a gateway that does not use Redis."""
    assert "gateway_redis_up" not in httpx.get(f"{admin_url(gateway_url)}/metrics").text


def test_two_replicas_share_a_tenants_requests_per_minute(
    backend_server: BackendServer, backend: FakeBackend, start_gateway: StartGateway, prefix: str
) -> None:
    text = session_policy(
        backend_server.url, tenants={"acme": {"limits": {"rpm": 3}}}, state=redis_state(REDIS_URL, prefix)
    )
    with start_gateway(text) as first, start_gateway(text) as second, sdk(first) as one, sdk(second) as two:
        assert metric(first, "gateway_redis_up") == 1
        assert metric(second, "gateway_redis_up") == 1
        for _ in range(3):
            assert chat(one)
        with pytest.raises(openai.RateLimitError) as refused:
            chat(two)  # its first request for acme: the minute's three were spent on the other replica
        assert refused.value.code == "tenant_rate_limited"
        assert "3 requests per minute" in refused.value.message
        assert metric(second, "gateway_rejections_total", reason="tenant_rate_limited") == 1


def test_a_replica_keeps_serving_while_redis_is_down_and_shares_again_when_it_is_back(
    backend_server: BackendServer, backend: FakeBackend, start_gateway: StartGateway, prefix: str
) -> None:
    redis_server = RedisProcess()
    redis_server.start()
    try:
        text = session_policy(backend_server.url, state=redis_state(redis_server.url, prefix))
        with start_gateway(text) as url, sdk(url) as client:
            wait_until(lambda: metric(url, "gateway_redis_up") == 1, what="gateway_redis_up 1")
            assert chat(client)
            with redis_server.client() as redis_client:
                assert redis_client.exists(f"{prefix}{{acme}}:rpm"), "the limits did not go to Redis"

            redis_server.kill()
            for _ in range(5):
                assert chat(client)  # served from the per-replica fallback, never a 5xx
            wait_until(lambda: metric(url, "gateway_redis_up") == 0, what="gateway_redis_up 0")
            assert metric(url, "gateway_redis_errors_total") >= 1
            assert metric(url, "gateway_redis_fallback_operations_total", operation="admit") >= 5

            redis_server.start()  # same port, empty: no keys, no scripts
            wait_until(lambda: metric(url, "gateway_redis_up") == 1, what="gateway_redis_up 1 again")

            def limits_back_in_redis() -> bool:
                assert chat(client)  # served at every step of the way back
                with redis_server.client() as redis_client:
                    return bool(redis_client.exists(f"{prefix}{{acme}}:rpm"))

            wait_until(limits_back_in_redis, what="the limits to go back to Redis")
    finally:
        redis_server.stop()


def test_with_on_store_loss_closed_a_limited_tenant_is_refused_with_503_while_redis_is_down(
    backend_server: BackendServer, backend: FakeBackend, start_gateway: StartGateway, prefix: str
) -> None:
    redis_server = RedisProcess()
    redis_server.start()
    try:
        state = {**redis_state(redis_server.url, prefix), "on_store_loss": "closed"}
        tenants = {"acme": {"limits": {"rpm": 100}}}
        text = session_policy(backend_server.url, tenants=tenants, state=state)
        with start_gateway(text) as url, sdk(url) as limited, sdk(url, KEY_GLOBEX) as unlimited:
            wait_until(lambda: metric(url, "gateway_redis_up") == 1, what="gateway_redis_up 1")
            assert chat(limited)
            redis_server.kill()
            # What the process's lease still holds is its own to spend (``limitstore/lease.py``);
            # once its keeper has found Redis lost, the tenant is refused.
            wait_until(lambda: metric(url, "gateway_redis_up") == 0, what="gateway_redis_up 0")
            wait_until(lambda: not served_or_refused_for_limits(limited), what="the limit store to find Redis lost")
            with pytest.raises(openai.InternalServerError) as refused:
                chat(limited)
            assert refused.value.status_code == 503
            assert refused.value.code == "limits_unavailable"
            assert refused.value.response.headers["retry-after"] == "1"
            assert chat(unlimited), "a tenant without limits needs no store"
            redis_server.start()
            wait_until(lambda: metric(url, "gateway_redis_up") == 1, what="gateway_redis_up 1 again")
            wait_until(lambda: served_or_refused_for_limits(limited), what="the limited tenant served again")
    finally:
        redis_server.stop()
