"""``redis+sentinel://`` and ``redis+cluster://`` URLs: parsed strictly, and a store reaching its
master through a real Sentinel, and a real three-node Redis Cluster."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.limitstore.base import Ask, Bucket, Take
from gateway.limitstore.redis import RedisConfig, RedisLimitStore
from gateway.service import parse_policy
from gateway.shared.connect import ClusterURL, SentinelURL, parse_cluster_url, parse_sentinel_url
from tests.limitstore.redis_server import RedisProcess, private_redis, unique_prefix
from tests.policy_builder import session_policy
from tests.servers import free_port, wait_until
from tests.shared.redis_cluster import cluster_url


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        pytest.param(
            "redis+sentinel://10.0.0.1:26380,10.0.0.2/gateway",
            SentinelURL(nodes=(("10.0.0.1", 26380), ("10.0.0.2", 26379)), service="gateway"),
            id="two sentinels, the default port for one",
        ),
        pytest.param(
            "rediss+sentinel://gw:s%40cret@sentinel:26379/gateway/2",
            SentinelURL(
                nodes=(("sentinel", 26379),), service="gateway", db=2, username="gw", password="s@cret", tls=True
            ),
            id="TLS, credentials and a database",
        ),
        pytest.param(
            "redis+sentinel://:pw@sentinel/gateway",
            SentinelURL(nodes=(("sentinel", 26379),), service="gateway", password="pw"),
            id="a password alone",
        ),
    ],
)
def test_a_sentinel_url_names_the_sentinels_the_service_and_the_masters_credentials(
    url: str, parsed: SentinelURL
) -> None:
    assert parse_sentinel_url(url) == parsed


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        pytest.param("redis+sentinel://sentinel:26379", "service_name", id="no service"),
        pytest.param("redis+sentinel:///gateway", "service_name", id="no sentinel"),
        pytest.param("redis+sentinel://sentinel:x/gateway", "port must be a number", id="a port that is not one"),
        pytest.param("redis+sentinel://sentinel/gateway/zero", "must be a number", id="a database that is not one"),
        pytest.param("redis://sentinel/gateway", "not a Sentinel URL", id="another scheme"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_with_what_is_wrong(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_sentinel_url(url)


def test_the_policy_accepts_a_sentinel_url() -> None:
    text = session_policy(state={"backend": "redis", "redis_url": "redis+sentinel://sentinel:26379/gateway"})
    assert parse_policy(text, "p.yaml").policy.state.redis_url == "redis+sentinel://sentinel:26379/gateway"


@pytest.fixture
def master() -> Iterator[RedisProcess]:
    with private_redis() as server:
        yield server


@pytest.fixture
def sentinel(master: RedisProcess, tmp_path: Path) -> Iterator[int]:
    """A real Redis Sentinel watching ``master`` as service ``gateway``; yields its port."""
    port = free_port()
    config = tmp_path / "sentinel.conf"
    config.write_text(f"port {port}\nbind 127.0.0.1\nsentinel monitor gateway 127.0.0.1 {master.port} 1\n")
    process = subprocess.Popen(
        [master.binary, str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )

    def knows_the_master() -> bool:
        try:
            with redis.Redis(port=port, socket_timeout=0.5) as client:
                return client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "gateway") is not None
        except redis.RedisError:
            return False

    try:
        wait_until(knows_the_master, what="the sentinel to answer for service gateway")
        yield port
    finally:
        process.kill()
        process.wait(timeout=10)


async def test_a_store_reaches_its_master_through_a_sentinel(master: RedisProcess, sentinel: int) -> None:
    prefix = unique_prefix()
    config = RedisConfig(url=f"redis+sentinel://127.0.0.1:{sentinel}/gateway", key_prefix=prefix, timeout_s=1.0)
    store = RedisLimitStore(config)
    try:
        assert await store.check()
        assert (await store.admit(Ask(scope="acme", takes=(Take(Bucket("rpm", 5, 1.0), 1),)))).admitted
        with master.client() as client:
            assert client.exists(f"{prefix}{{acme}}:rpm")
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        pytest.param(
            "redis+cluster://10.0.0.1:7000,10.0.0.2",
            ClusterURL(nodes=(("10.0.0.1", 7000), ("10.0.0.2", 6379))),
            id="two nodes, the default port for one",
        ),
        pytest.param(
            "rediss+cluster://gw:s%40cret@node:7000",
            ClusterURL(nodes=(("node", 7000),), username="gw", password="s@cret", tls=True),
            id="TLS and credentials",
        ),
    ],
)
def test_a_cluster_url_names_its_startup_nodes_and_credentials(url: str, parsed: ClusterURL) -> None:
    assert parse_cluster_url(url) == parsed


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        pytest.param("redis+cluster://node:7000/2", "no database", id="a database"),
        pytest.param("redis+cluster://", "host:port", id="no node"),
        pytest.param("redis+cluster://node:x", "port must be a number", id="a port that is not one"),
    ],
)
def test_a_malformed_cluster_url_is_refused_with_what_is_wrong(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_cluster_url(url)


async def test_the_limit_store_works_on_a_redis_cluster_each_tenant_in_one_slot(cluster: list[int]) -> None:
    url = cluster_url(cluster[:2])
    store = RedisLimitStore(RedisConfig(url=url, key_prefix=unique_prefix(), timeout_s=1.0, request_budget_s=2.0))
    rpm = Bucket("rpm", 2, 2 / 60)
    try:
        assert await store.check()
        tenants = [f"tenant-{i}" for i in range(12)]  # their hash tags spread over the three nodes
        for tenant in tenants:
            ask = Ask(scope=tenant, slot_limit=5, takes=(Take(rpm, 1),))
            assert [(await store.admit(ask)).admitted for _ in range(3)] == [True, True, False]
        assert await store.check()  # one pipeline of syncs, split by node
        assert [await store.slots_in_use(tenant) for tenant in tenants] == [2] * len(tenants)
        assert store.up
    finally:
        await store.aclose()
