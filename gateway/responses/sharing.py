"""Where stored responses live, in Redis: one round trip to find one, a write retried until it lands.

``ResponseAffinity`` (``gateway/responses/affinity.py``) keeps each process's own maps; this is
what every replica shares, so that a follow-up may come through any of them.

**Layout.** A tenant's entries are one hash (a SHA-256 of the id to its backend and model; the
keyspace never holds an id a tenant could present) and one sorted set of the same hashes by
expiry, under the tenant's hash tag (``gw:{acme}:responses``, one cluster slot, beside its
limits). One script writes an entry, drops the tenant's expired ones and its oldest past
``per_tenant`` (the same bound, shared by every replica); one script reads an entry and how
long it has left on Redis's clock. Why not a key per entry with its own expiry: a per-tenant
bound would then need a script deleting keys it cannot declare, which Redis Cluster forbids.

**A lookup is one round trip, timed as Redis's.** The script runs by ``EVALSHA`` on a
connection taken from the pool first: a new connection's handshake (TCP, ``AUTH``, redis-py's
``CLIENT SETINFO``) is two or three more round trips that are not the lookup, so it has its own
bound (``CONNECT_S``), and the lookup's budget (``timeout_s``, the policy's
``state.timeout_ms``, at least ``LOOKUP_MIN_S``: ``lookup_budget_s``) covers the command alone.
Both are counted in the event loop's free time (``gateway/shared/lag.py``): a reply that waits in
the socket while the loop runs other callbacks is not a slow Redis. Handshake and command are one
call to the client's shared store (``SharedStore.budget``, ``gateway/shared/store.py``), which
judges Redis's health by it: an open connection taken from the pool is no answer from Redis.
After a ``NOSCRIPT`` (a Redis restarted or flushed) the same connection sends ``EVAL``, which
loads the script: two round trips, once; and a write that met one loads the lookup script in its
own round trip, so that a lookup rarely pays it.
Once, redis-py's ``Script`` (``EVALSHA``, then ``SCRIPT LOAD`` and ``EVALSHA`` again) under a
50 ms timeout that also held the connection's handshake made every follow-up through another
replica a 404 ``previous_response_not_found`` while Redis answered in 30 ms.

**Unreachable is not unknown.** A lookup whose Redis failed or was too slow raises
``SharedUnavailable``: the caller answers a retryable 503, never the 404 that tells a client
its conversation is gone.

**A write is retried until it lands, or its entry expires.** An entry is written once at once
(``publish``; a whole answer waits for it, so that its follow-up may come through any replica);
when that fails or is too slow, the entry waits in ``pending`` (at most ``max_pending``, the
oldest given up first) for one background task, owned here, that writes the waiting entries
with a longer budget (``RETRY_TIMEOUT_S``, off every request's path) after a growing pause
(``RETRY_FIRST_S`` doubling up to ``RETRY_MAX_S``), or at once when another call of this
process has just found Redis answering, until Redis takes them. Writing again is harmless: the
same hash, the same field, the expiry the entry had left. An entry forgotten meanwhile (its
backend lost it) is not written. Until it lands, a follow-up through another replica does not
find it (a 404, as for any id that replica cannot know of): an outage's entries reach Redis
within about ``RETRY_MAX_S`` of its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import NoScriptError

from gateway.clock import Clock
from gateway.shared.connect import RedisClient
from gateway.shared.lag import FreeTimeout
from gateway.shared.loops import stop_loops
from gateway.shared.lua import lua_script
from gateway.shared.store import FAILURES, SharedStore

log = logging.getLogger(__name__)

CONNECT_S = 0.5
"""A new connection's handshake: a few round trips, not the lookup's (module docstring). Also
the longest a whole answer waits for its entry's first write when Redis is silent and no
connection is open (``ResponseAffinity.shared_now``), on top of ``timeout_s``."""
LOOKUP_MIN_S = 0.05
"""A lookup's and a first write's budget at least (``lookup_budget_s``), whatever ``state.timeout_ms``
says: an operator may set that low for the limit store, which falls back on its own when Redis is
late, while a lookup that runs out answers its follow-up with a 503. 50 ms: the default
``state.timeout_ms``."""
RETRY_TIMEOUT_S = 1.0
"""A background write's budget: off the request path, so a slow Redis still takes it."""
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 1.0
"""The longest pause between two rounds of the retrier: a try a second while Redis is out."""
MAX_PENDING = 10_000
"""Entries waiting for Redis at most; past it the oldest is given up (its follow-ups then need
the replica that holds it in memory)."""

_PUBLISH = lua_script("gateway.responses", "sharing_clock.lua", "sharing_publish.lua")
"""Writes an entry, then drops the tenant's expired ones and its oldest past the bound."""
_LOOKUP = lua_script("gateway.responses", "sharing_clock.lua", "sharing_lookup.lua")
"""An entry and the microseconds it has left on Redis's clock, or nil."""
_UNPUBLISH = lua_script("gateway.responses", "sharing_unpublish.lua")
"""Forgets an entry."""


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script and the SHA-1 ``EVALSHA`` names it by."""

    text: str
    sha: str

    @classmethod
    def of(cls, text: str) -> Script:
        return cls(text, hashlib.sha1(text.encode()).hexdigest())  # Redis names a script by its SHA-1


PUBLISH, LOOKUP, UNPUBLISH = Script.of(_PUBLISH), Script.of(_LOOKUP), Script.of(_UNPUBLISH)


def lookup_budget_s(store_timeout_s: float) -> float:
    """The budget of a lookup and of a first write on a store whose ``state.timeout_ms`` is
    ``store_timeout_s``: that, or ``LOOKUP_MIN_S`` when longer."""
    return max(store_timeout_s, LOOKUP_MIN_S)


class SharedUnavailable(Exception):
    """Redis failed or was too slow to answer a lookup: the id may well exist (module docstring)."""


class Found(NamedTuple):
    """An entry as Redis holds it: where the response lives, and how long Redis keeps it."""

    backend: str
    model: str
    left_s: float


@dataclass(frozen=True, slots=True)
class Entry:
    """An entry to write: whose, which id, where it lives, and when it expires (the process's clock)."""

    tenant: str
    response_id: str
    backend: str
    model: str
    expires_at: float


class SharedResponses:
    """The replicas' shared entries in Redis (module docstring).
    ``SharedResponses(client, clock, key_prefix="gw:", per_tenant=10_000, timeout_s=0.05)``."""

    def __init__(
        self,
        client: RedisClient,
        clock: Clock,
        *,
        key_prefix: str,
        per_tenant: int,
        timeout_s: float,
        max_pending: int = MAX_PENDING,
        owns_client: bool = False,
    ) -> None:
        self.client = client
        self.owns_client = owns_client
        """Whether ``aclose`` closes ``client`` (not the process's shared one: ``gateway/shared/store.py``)."""
        self.clock = clock
        self.key_prefix = key_prefix
        self.per_tenant = per_tenant
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.store = SharedStore.of(client)
        """Bounds every call and judges Redis's health by it (``gateway/shared/store.py``)."""
        self.pending: dict[tuple[str, str], Entry] = {}
        """Entries whose write failed, by (tenant, id), oldest first: the retrier's to write."""
        self.given_up = 0
        """Entries dropped from ``pending`` for room since it was last empty."""
        self._retrier: asyncio.Task[None] | None = None
        self._answered = asyncio.Event()
        """Set when a call found Redis answering: the retrier need not wait out its pause."""
        self._on_cluster = (
            {
                PUBLISH.sha: client.register_script(_PUBLISH),
                LOOKUP.sha: client.register_script(_LOOKUP),
                UNPUBLISH.sha: client.register_script(_UNPUBLISH),
            }
            if isinstance(client, RedisCluster)
            else {}
        )
        """On a cluster, each script through the cluster client (its node found by the keys' tag)."""

    async def lookup(self, response_id: str, tenant: str) -> Found | None:
        """The entry of ``response_id`` in ``tenant``'s map, or None; ``SharedUnavailable`` when
        Redis did not answer within the budget (module docstring)."""
        try:
            found = await self._call(LOOKUP, self._keys(tenant), [self.field(response_id)], self.timeout_s)
        except FAILURES as error:
            log.warning("response affinity: Redis lookup failed (%s)", type(error).__name__)
            raise SharedUnavailable(str(error) or type(error).__name__) from error
        if not found:
            return None
        try:
            raw, left_us = found
            entry = orjson.loads(raw)
            return Found(str(entry["backend"]), str(entry["model"]), int(left_us) / 1e6)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None

    async def publish(self, entry: Entry) -> None:
        """Write ``entry`` once now; if that fails, leave it to the retrier (module docstring)."""
        try:
            await self._write(entry, self.timeout_s)
        except FAILURES as error:
            self._hold(entry, error)

    def forget(self, response_id: str, tenant: str) -> None:
        """An entry forgotten before its write landed is not written any more."""
        self.pending.pop((tenant, response_id), None)

    async def unpublish(self, response_id: str, tenant: str) -> None:
        try:
            await self._call(UNPUBLISH, self._keys(tenant), [self.field(response_id)], self.timeout_s)
        except FAILURES as error:
            log.warning("response affinity: could not forget response %s... (%s)", response_id[:12], error)

    async def aclose(self) -> None:
        """A last try for what still waits (one round, bounded), then the retrier goes (and the
        client, if it is this object's own)."""
        if self._retrier is not None:
            await stop_loops({self._retrier})  # cancelled again if a Redis call swallowed it
        if self.pending and not await self._flush():
            log.warning("response affinity: %d entries never reached Redis", len(self.pending))
        if self.owns_client:
            await self.client.aclose()

    # The retrier

    def _hold(self, entry: Entry, error: BaseException) -> None:
        if not self.pending:
            log.warning("response affinity: could not share a response (%s); retrying in the background", error)
        key = (entry.tenant, entry.response_id)
        self.pending.pop(key, None)
        while len(self.pending) >= self.max_pending:
            del self.pending[next(iter(self.pending))]
            self.given_up += 1
            if self.given_up == 1:
                log.warning("response affinity: %d entries wait for Redis; giving up the oldest", self.max_pending)
        self.pending[key] = entry
        if self._retrier is None or self._retrier.done():
            self._retrier = asyncio.get_running_loop().create_task(self._retry(), name="response-affinity-retry")

    async def _retry(self) -> None:
        pause = RETRY_FIRST_S
        while self.pending:
            self._answered.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._answered.wait(), pause)
            pause = RETRY_FIRST_S if await self._flush() else min(pause * 2, RETRY_MAX_S)
        log.warning("response affinity: no response waits for Redis any more (%d given up)", self.given_up)
        self.given_up = 0

    async def _flush(self) -> bool:
        """Write what waits, oldest first; False at the first failure (Redis is still out)."""
        for key, entry in list(self.pending.items()):
            if entry.expires_at > self.clock.now():
                try:
                    await self._write(entry, RETRY_TIMEOUT_S)
                except FAILURES:
                    return False
            if self.pending.get(key) is entry:
                del self.pending[key]
        return True

    # One round trip

    async def _write(self, entry: Entry, budget_s: float) -> None:
        left_ms = max(1, int((entry.expires_at - self.clock.now()) * 1000))
        value = orjson.dumps({"backend": entry.backend, "model": entry.model})
        args: list[str | bytes | int] = [self.field(entry.response_id), value, left_ms, self.per_tenant]
        await self._call(PUBLISH, self._keys(entry.tenant), args, budget_s, also_load=LOOKUP)

    async def _call(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | bytes | int],
        budget_s: float,
        *,
        also_load: Script | None = None,
    ) -> Any:
        """``script`` in one round trip on a connection opened beforehand (module docstring); on a
        cluster, through the cluster client, which finds the tenant's node by the keys' hash tag
        and connects to it on first use."""
        if isinstance(self.client, RedisCluster):
            async with self.store.budget(budget_s):
                answer = await self._on_cluster[script.sha](keys=list(keys), args=list(args))
            self._answered.set()
            return answer
        pool = self.client.connection_pool
        async with self.store.budget(CONNECT_S + budget_s):  # one call: what the store judges
            async with FreeTimeout(self.store.lag, CONNECT_S):
                connection: AbstractConnection = await pool.get_connection()  # type: ignore[no-untyped-call]
            try:
                async with FreeTimeout(self.store.lag, budget_s):
                    answer = await _evaluate(connection, script, [*keys, *args], len(keys), also_load)
            finally:
                await pool.release(connection)
        self._answered.set()
        return answer

    def _keys(self, tenant: str) -> list[str]:
        """The tenant's hash and sorted set: one hash tag, one cluster slot."""
        base = f"{self.key_prefix}{{{tenant}}}:responses"
        return [base, f"{base}:expiry"]

    @staticmethod
    def field(response_id: str) -> str:
        # A hash, not the id: the keyspace never holds an id a tenant could present.
        return hashlib.sha256(response_id.encode()).hexdigest()


async def _evaluate(
    connection: AbstractConnection, script: Script, keys_and_args: list[Any], keys: int, also_load: Script | None
) -> Any:
    """``EVALSHA``, else (``NOSCRIPT``) ``EVAL`` with ``also_load``'s ``SCRIPT LOAD`` in the same round trip."""
    try:
        await connection.send_command("EVALSHA", script.sha, keys, *keys_and_args)
        return await connection.read_response()
    except NoScriptError:
        pass
    if also_load is not None:
        await connection.send_packed_command(
            connection.pack_commands([("SCRIPT", "LOAD", also_load.text), ("EVAL", script.text, keys, *keys_and_args)])
        )
        await connection.read_response()
    else:
        await connection.send_command("EVAL", script.text, keys, *keys_and_args)
    return await connection.read_response()
