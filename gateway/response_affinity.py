"""Where a stored response lives: a follow-up that names it goes to the backend that holds it.

The Responses API keeps state on the engine: ``previous_response_id`` (and ``store``) name a
response that one engine holds in its memory (vLLM's response store), so a follow-up must reach
that engine and no other. Each answer of an API that keeps state (``Dialect.keeps_state``) is
remembered here as ``(tenant, backend, model)`` under its id; a follow-up is pinned to that
backend and model (``InferenceRequest.pinned_backend``).

**Each tenant has its own map.** A lookup names its tenant and looks in that tenant's map only,
so an id another tenant created is simply absent there: it takes the very path of an unknown id
(the same lookups, the same Redis command) and is answered the same way (404
``previous_response_not_found``, the same message). A tenant can neither use another's
responses nor learn that an id exists, not even from the time the answer takes.

**Bounded per tenant, then in all.** In the process each tenant's map is a least-recently-used
map of at most ``per_tenant`` entries (``Settings.responses_per_tenant``): a tenant that creates
more loses its own oldest, never another's. The maps together hold at most ``max_entries``;
past it the tenant holding the most loses its oldest (the one adding, when it holds more than
its fair share: no scan on a flood's path), so a tenant within its share is never evicted by
others. Entries expire ``ttl_s`` after they are created.

**Redis** (``state.backend: redis``): every replica also writes each entry there and looks
there when it does not know an id, so a follow-up may come through any replica. A tenant's
entries are one hash (a SHA-256 of the id to its backend and model; the keyspace never holds
an id a tenant could present) and one sorted set of the same hashes by expiry, under the
tenant's hash tag (``gw:{acme}:responses``, one cluster slot, beside its limits). One script
writes an entry, drops the tenant's expired ones and its oldest past ``per_tenant`` (the same
bound, shared by every replica, one round trip); one script reads an entry and how long it
has left on Redis's clock (one round trip). Why not a key per entry with its own expiry: a
per-tenant bound would then need a script deleting keys it cannot declare, which Redis Cluster
forbids. When Redis is unreachable a replica answers from what it knows (a follow-up through
another replica is then a 404, never a guess). When the holding backend is down the follow-up
is a 503 ``no_healthy_backend`` (the state may come back with it), once the policy no longer
has it a 404; when it answers that it lost the response, the entry is forgotten.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.clock import Clock

log = logging.getLogger(__name__)

PER_TENANT = 10_000
"""The default bound per tenant (``Settings.responses_per_tenant``)."""
MAX_ENTRIES = 100_000
"""The bound of the process's maps together: about 30 MB."""
_TRIM_PER_WRITE = 1000  # entries one write may drop: Lua's ``unpack`` takes a few thousand at most

# Times are Redis's, in microseconds (exact in a double until the year 2255), so that entries
# written a millisecond apart keep their order.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
"""

# KEYS: the tenant's hash, its sorted set by expiry. ARGV: the id's hash, the entry, ttl (ms),
# the tenant's bound. Writes the entry, then drops the expired and the oldest past the bound.
_PUBLISH = (
    _NOW
    + f"""
local ttl, bound = tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + ttl * 1000, ARGV[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, {_TRIM_PER_WRITE})
local over = math.min(redis.call('ZCARD', KEYS[2]) - #gone - bound, {_TRIM_PER_WRITE})
if over > 0 then
  for _, field in ipairs(redis.call('ZRANGE', KEYS[2], #gone, #gone + over - 1)) do
    gone[#gone + 1] = field
  end
end
if #gone > 0 then
  redis.call('HDEL', KEYS[1], unpack(gone))
  redis.call('ZREM', KEYS[2], unpack(gone))
end
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return #gone
"""
)

# KEYS: as above. ARGV: the id's hash. The entry and the microseconds it has left, or nil.
_LOOKUP = (
    _NOW
    + """
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then
  return false
end
local left = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]) or 0) - now
if left <= 0 then
  return false
end
return {entry, left}
"""
)


@dataclass(frozen=True, slots=True)
class Holder:
    """Who created a stored response, and where it lives."""

    tenant: str
    backend: str
    model: str
    expires_at: float


class ResponseAffinity:
    """Response id to its holder, per tenant (module docstring); ``shared`` adds Redis to the
    process's maps. ``ResponseAffinity(clock, per_tenant=10_000, shared=redis_client)``."""

    def __init__(
        self,
        clock: Clock,
        *,
        per_tenant: int = PER_TENANT,
        max_entries: int = MAX_ENTRIES,
        ttl_s: float = 3600.0,
        shared: aioredis.Redis | None = None,
        key_prefix: str = "gw:",
        timeout_s: float = 0.05,
    ) -> None:
        self.clock = clock
        self.per_tenant = per_tenant
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.shared = shared
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self._tenants: dict[str, OrderedDict[str, Holder]] = {}
        self._count = 0
        self._writes: set[asyncio.Task[None]] = set()
        if shared is not None:
            self._publish_script = shared.register_script(_PUBLISH)
            self._lookup_script = shared.register_script(_LOOKUP)

    def __len__(self) -> int:
        return self._count

    def held_by(self, tenant: str) -> int:
        """How many entries the process holds for ``tenant``."""
        return len(self._tenants.get(tenant, ()))

    def remember(self, response_id: str, tenant: str, backend: str, model: str) -> None:
        """Record where ``response_id`` lives: at once in the process, in Redis in the background
        (started as soon as the id is seen, so it is shared before the answer ends)."""
        self._keep(tenant, response_id, Holder(tenant, backend, model, self.clock.now() + self.ttl_s))
        if self.shared is not None:
            self._background(self._publish(response_id, tenant, backend, model))

    def forget(self, response_id: str, tenant: str) -> None:
        """Drop an entry whose backend no longer holds the response (it said so)."""
        held = self._tenants.get(tenant)
        if held is not None and held.pop(response_id, None) is not None:
            self._count -= 1
            if not held:
                del self._tenants[tenant]
        if self.shared is not None:
            self._background(self._unpublish(response_id, tenant))

    async def shared_now(self) -> None:
        """Wait until every entry remembered so far is in Redis (or failed to be): a whole answer
        is sent only then, so its follow-up may come through any replica at once."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def holder(self, response_id: str, tenant: str) -> Holder | None:
        """The holder of ``response_id`` if ``tenant`` created it and it has not expired; else None,
        by the same path for an id of another tenant as for an unknown one."""
        own = self._tenants.get(tenant)
        held = own.get(response_id) if own is not None else None
        if held is None and self.shared is not None:
            held = await self._lookup(response_id, tenant)
        if held is None:
            return None
        if held.expires_at <= self.clock.now():
            self.forget(response_id, tenant)
            return None
        self._keep(tenant, response_id, held)  # the most recent now; kept here, if Redis had it
        return held

    async def aclose(self) -> None:
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        if self.shared is not None:
            await self.shared.aclose()

    # The process's maps

    def _keep(self, tenant: str, response_id: str, held: Holder) -> None:
        own = self._tenants.get(tenant)
        if own is None:
            own = self._tenants[tenant] = OrderedDict()
        if response_id not in own:
            self._count += 1
        own[response_id] = held
        own.move_to_end(response_id)
        if len(own) > self.per_tenant:
            own.popitem(last=False)
            self._count -= 1
        if self._count > self.max_entries:
            over_share = len(own) > 1 and len(own) * len(self._tenants) > self.max_entries
            self._evict_one(tenant if over_share else self._largest())

    def _largest(self) -> str:
        return max(self._tenants, key=lambda name: len(self._tenants[name]))

    def _evict_one(self, tenant: str) -> None:
        """The oldest entry of ``tenant`` goes (it holds more than its fair share)."""
        own = self._tenants[tenant]
        own.popitem(last=False)
        self._count -= 1
        if not own:
            del self._tenants[tenant]

    # Redis

    def _background(self, write: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(write)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    def _keys(self, tenant: str) -> list[str]:
        """The tenant's hash and sorted set: one hash tag, one cluster slot."""
        base = f"{self.key_prefix}{{{tenant}}}:responses"
        return [base, f"{base}:expiry"]

    @staticmethod
    def _field(response_id: str) -> str:
        # A hash, not the id: the keyspace never holds an id a tenant could present.
        return hashlib.sha256(response_id.encode()).hexdigest()

    async def _publish(self, response_id: str, tenant: str, backend: str, model: str) -> None:
        entry = orjson.dumps({"backend": backend, "model": model})
        args: list[str | bytes | int] = [self._field(response_id), entry, int(self.ttl_s * 1000), self.per_tenant]
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._publish_script(keys=self._keys(tenant), args=args)
        except (RedisError, OSError, TimeoutError) as error:
            log.warning("response affinity: could not share response %s... (%s)", response_id[:12], error)

    async def _unpublish(self, response_id: str, tenant: str) -> None:
        assert self.shared is not None
        field = self._field(response_id)
        entries, expiry = self._keys(tenant)
        try:
            async with asyncio.timeout(self.timeout_s), self.shared.pipeline(transaction=True) as pipe:
                pipe.hdel(entries, field)
                pipe.zrem(expiry, field)
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as error:
            log.warning("response affinity: could not forget response %s... (%s)", response_id[:12], error)

    async def _lookup(self, response_id: str, tenant: str) -> Holder | None:
        try:
            async with asyncio.timeout(self.timeout_s):
                found = await self._lookup_script(keys=self._keys(tenant), args=[self._field(response_id)])
        except (RedisError, OSError, TimeoutError) as error:
            log.warning("response affinity: Redis lookup failed (%s); answering from this process's map", error)
            return None
        if not found:
            return None
        try:
            raw, left_us = found
            entry = orjson.loads(raw)
            return Holder(tenant, str(entry["backend"]), str(entry["model"]), self.clock.now() + int(left_us) / 1e6)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None
