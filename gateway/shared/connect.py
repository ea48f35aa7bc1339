"""Opens the Redis the policy names (``state.redis_url``): directly, or through Redis Sentinel.

``redis://``, ``rediss://`` and ``unix://`` URLs are redis-py's own (``Redis.from_url``). A
Sentinel deployment is named the way Kombu and most Redis clients do, since redis-py has no URL
for it::

    redis+sentinel://[[username]:password@]host:port[,host:port...]/service_name[/db]
    rediss+sentinel://...     (TLS to the master)

Every sentinel listed is asked, in turn, where the master of ``service_name`` is (port 26379 when
a host gives none); the client then talks to that master and asks again after a failover (its
connections fail, redis-py's ``SentinelConnectionPool`` looks the master up anew). The username
and password are the master's; the sentinels are reached without them.

**Redis Cluster**::

    redis+cluster://[[username]:password@]host:port[,host:port...]
    rediss+cluster://...      (TLS)

The nodes listed are where the client starts; it learns the cluster's slots from them (port 6379
when a host gives none). Every user of the shared store fits a cluster, because every call
touches the keys of one hash slot: the limit store's and the responses' keys carry their
tenant's hash tag (``gw:{acme}:held``, ...), the capacity ledger's its cell's
(``gw:{fleet}:...``, ``gw:{fleet:eu-1}:...``: ``gateway/fleet/ledger.py``), the prefix view is one
stream and a rollout's calls one key each. A cluster spreads them over its shards by tenant and
by cell (``tests/shared/test_cluster_users.py`` runs each against a real three-node cluster).

**Options** are the caller's (``SharedStore.open`` passes the store's: no socket timeouts, no
retries), and reach every kind of client: a cluster's ``retry`` is its own, taken from the
options like the rest (it re-learns the slots at the call after a failed one, retries or not), and
the sentinels of a Sentinel URL are asked with the same timeouts and retries as the master.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
CLUSTER_PORT = 6379

RedisClient = aioredis.Redis | RedisCluster
"""What the shared store's users talk to: one server (directly or through Sentinel) or a cluster.
Both run the commands the gateway sends; only a pipeline of scripts differs (a cluster's
pipelines refuse ``EVALSHA``), which the one user that pipelines scripts checks for."""


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL (module docstring)."""

    nodes: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False


def parse_sentinel_url(url: str) -> SentinelURL:
    """The parts of a Sentinel URL; ``ValueError`` naming what is wrong."""
    scheme, _, rest = url.partition("://")
    if scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL: the scheme must be one of {', '.join(SENTINEL_SCHEMES)}")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    parts = [part for part in path.split("/") if part]
    if not hosts or not parts or len(parts) > 2:
        raise ValueError("a Sentinel URL is redis+sentinel://host:port[,host:port...]/service_name[/db]")
    nodes = tuple(_node(host) for host in hosts.split(","))
    if len(parts) == 2 and not parts[1].isdigit():
        raise ValueError(f"the database of a Sentinel URL must be a number, not {parts[1]!r}")
    return SentinelURL(
        nodes=nodes,
        service=unquote(parts[0]),
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=unquote(username) or None,
        password=unquote(password) or None,
        tls=scheme.startswith("rediss"),
    )


def _node(host: str, default_port: int = SENTINEL_PORT, what: str = "sentinel") -> tuple[str, int]:
    name, _, port = host.rpartition(":") if ":" in host else (host, "", "")
    if port and not port.isdigit():
        raise ValueError(f"a {what}'s port must be a number: {host!r}")
    return (name or host, int(port) if port else default_port)


@dataclass(frozen=True, slots=True)
class ClusterURL:
    """A parsed ``redis+cluster://`` URL (module docstring)."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False


def parse_cluster_url(url: str) -> ClusterURL:
    """The parts of a Redis Cluster URL; ``ValueError`` naming what is wrong."""
    scheme, _, rest = url.partition("://")
    if scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"not a Redis Cluster URL: the scheme must be one of {', '.join(CLUSTER_SCHEMES)}")
    netloc, _, path = rest.partition("/")
    if path.strip("/"):
        raise ValueError("a Redis Cluster URL names no database: a cluster has only database 0")
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    if not hosts:
        raise ValueError("a Redis Cluster URL is redis+cluster://host:port[,host:port...]")
    return ClusterURL(
        nodes=tuple(_node(host, CLUSTER_PORT, "cluster node") for host in hosts.split(",")),
        username=unquote(username) or None,
        password=unquote(password) or None,
        tls=scheme.startswith("rediss"),
    )


class SentinelMaster(aioredis.Redis):
    """The client of a Sentinel's master, which closes its connections to the sentinels with its own."""

    sentinels_of: Sentinel | None = None
    """The Sentinel that found the master (not named ``sentinel``: that is a Redis command)."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinels_of is not None:
            for client in self.sentinels_of.sentinels:
                await client.aclose()


def redis_client(url: str, **options: Any) -> RedisClient:
    """An asyncio client for ``url`` with redis-py's connection ``options`` (timeouts, retry): a
    ``RedisCluster`` for a cluster URL, the master's client for a Sentinel URL."""
    if url.partition("://")[0] in CLUSTER_SCHEMES:
        return _cluster_client(parse_cluster_url(url), options)
    if url.partition("://")[0] not in SENTINEL_SCHEMES:
        return aioredis.Redis.from_url(url, **options)
    where = parse_sentinel_url(url)
    sentinel = Sentinel(list(where.nodes), sentinel_kwargs=_sentinel_options(options))  # type: ignore[no-untyped-call]
    master: SentinelMaster = sentinel.master_for(
        where.service,
        redis_class=SentinelMaster,
        db=where.db,
        username=where.username,
        password=where.password,
        ssl=where.tls,
        **options,
    )
    master.sentinels_of = sentinel
    return master


def _cluster_client(where: ClusterURL, options: dict[str, Any]) -> RedisCluster:
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in where.nodes],
        username=where.username,
        password=where.password,
        ssl=where.tls,
        **options,
    )


def _sentinel_options(options: dict[str, Any]) -> dict[str, Any]:
    """The timeouts and retries of ``options`` for the sentinels too: a silent sentinel must not hang
    a call, and one that refuses is not asked again before the next one is."""
    return {key: options[key] for key in ("socket_timeout", "socket_connect_timeout", "retry") if key in options}
