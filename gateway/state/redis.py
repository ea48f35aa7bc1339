"""Redis-backed ``LimitStore``: tenant limits shared by every gateway replica.

Each operation is one Lua script (registered once, run by EVALSHA; redis-py loads it again
after a ``NOSCRIPT``, e.g. when Redis restarted), so a take or an acquire is one atomic step
and never a read-modify-write race between replicas.

**Time.** Token buckets refill from Redis's own clock (``TIME`` inside the script), never from
the replica's: replicas whose clocks disagree still see one bucket level. A ``clock`` may be
injected for tests; the scripts then use it instead.

**Concurrency slots: a lease per replica, renewed while it holds slots.** A slot key is a hash
``replica -> slots it holds`` plus a sorted set ``replica -> lease expiry``. A replica renews
its leases (and rewrites its counts from what it really holds) every ``ping_interval_s``; an
acquire first drops the replicas whose lease expired. So a replica that dies holding slots
frees them ``lease_ttl_s`` later, while a live one keeps slots for requests of any length.
The alternative, a plain counter with a TTL longer than the longest request deadline (600 s
by default), would block a tenant for ten minutes after a crash, and never free a leaked slot
at all while traffic keeps refreshing the TTL. The rewrite also repairs a count that a failed
release left behind, within one renewal.

**Failure: fail open to a per-replica fallback** (Envoy's global rate limit with
``failure_mode_deny: false``). A command that fails or takes longer than ``timeout_s`` marks
Redis down; from then on every operation goes straight to an in-process ``MemoryLimitStore``
(same limits, enforced by this replica alone, so a tenant may get up to N replicas x its limit)
without waiting on Redis, until the background ping succeeds again. Requests are never held up
or failed because Redis is: an outage costs accuracy of the limits, not availability. ``up``
tells whether the last command or ping succeeded; ``on_error``/``on_fallback`` count failures
and the operations answered locally.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.clock import Clock
from gateway.state.base import BucketResult
from gateway.state.memory import MemoryLimitStore

log = logging.getLogger(__name__)

T = TypeVar("T")
FAILURES = (RedisError, OSError, TimeoutError)

# ARGV[1], ARGV[2]: the injected clock's seconds and microseconds, or "" for the server's TIME.
_NOW = """
local function now(sec, usec)
  if sec == '' then
    local t = redis.call('TIME')
    return t[1], t[2]
  end
  return sec, usec
end
local sec, usec = now(ARGV[1], ARGV[2])
local t = tonumber(sec) + tonumber(usec) / 1e6
"""

# KEYS[1]: the bucket hash {level, s, us}; ARGV[3..5]: amount, capacity, refill per second.
_BUCKET = (
    _NOW
    + """
local amount, capacity, rate = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local state = redis.call('HMGET', KEYS[1], 'level', 's', 'us')
local level = capacity
if state[1] then
  local elapsed = (tonumber(sec) - tonumber(state[2])) + (tonumber(usec) - tonumber(state[3])) / 1e6
  level = math.min(capacity, tonumber(state[1]) + math.max(0, elapsed) * rate)
end
local function store(value)
  redis.call('HSET', KEYS[1], 'level', string.format('%.17g', value), 's', sec, 'us', usec)
  redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - value) / rate * 1000) + 1000)
end
"""
)

TAKE = (
    _BUCKET
    + """
local allowed = 0
if level >= amount then
  level = level - amount
  allowed = 1
end
store(level)
return {allowed, string.format('%.17g', level)}
"""
)

REFUND = (
    _BUCKET
    + """
level = math.min(capacity, level + amount)
if level >= capacity then
  redis.call('DEL', KEYS[1])
else
  store(level)
end
return 1
"""
)

# KEYS[1]: hash replica -> slots held; KEYS[2]: zset replica -> lease expiry (seconds).
_SLOTS = (
    _NOW
    + """
local function purge()
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', t)
  for _, replica in ipairs(expired) do
    redis.call('HDEL', KEYS[1], replica)
  end
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', t)
  end
  local used = 0
  for _, n in ipairs(redis.call('HVALS', KEYS[1])) do
    used = used + tonumber(n)
  end
  return used
end
"""
)

# ARGV[3..5]: replica, limit, lease ttl in seconds.
ACQUIRE = (
    _SLOTS
    + """
if purge() >= tonumber(ARGV[4]) then
  return 0
end
local ttl = tonumber(ARGV[5])
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
redis.call('ZADD', KEYS[2], t + ttl, ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000))
redis.call('PEXPIRE', KEYS[2], math.ceil(ttl * 1000))
return 1
"""
)

RELEASE = """
local n = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if n <= 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
end
return n
"""

IN_USE = _SLOTS + "return purge()\n"

# KEYS: pairs (held hash, lease zset); ARGV[3..4]: replica, ttl; ARGV[5..]: per pair, the
# slots this replica holds there (written as the truth), or -1 (an operation is in flight:
# only extend the lease).
RENEW = (
    _NOW
    + """
local replica, ttl = ARGV[3], tonumber(ARGV[4])
for i = 1, #KEYS, 2 do
  local held, leases = KEYS[i], KEYS[i + 1]
  local n = tonumber(ARGV[4 + (i + 1) / 2])
  if n == 0 then
    redis.call('HDEL', held, replica)
    redis.call('ZREM', leases, replica)
  else
    if n > 0 then
      redis.call('HSET', held, replica, n)
    end
    if redis.call('HEXISTS', held, replica) == 1 then
      redis.call('ZADD', leases, t + ttl, replica)
      redis.call('PEXPIRE', held, math.ceil(ttl * 1000))
      redis.call('PEXPIRE', leases, math.ceil(ttl * 1000))
    end
  end
end
return 1
"""
)


def _ignore(operation: str) -> None:
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisConfig:
    """Where the shared state lives and how long to wait for it.

    ``RedisConfig(url="redis://127.0.0.1:6379/0", key_prefix="gw:", timeout_s=0.05)``; several
    gateways (or test runs) share one Redis under different prefixes. The URL may hold a
    password, so ``repr`` shows only where it points.
    """

    url: str
    key_prefix: str = "gw:"
    timeout_s: float = 0.05
    ping_interval_s: float = 1.0
    lease_ttl_s: float = 10.0

    def __repr__(self) -> str:
        where = self.url.rsplit("@", 1)[-1].split("://")[-1]
        return f"RedisConfig(url=<{where}>, key_prefix={self.key_prefix!r}, timeout_s={self.timeout_s})"


class RedisLimitStore:
    """``LimitStore`` in Redis, failing open to a ``MemoryLimitStore`` (see the module docstring).

    Built in the lifespan; ``await store.check()`` once, then ``run()`` as an owned task (pings,
    renews leases, brings Redis back after an outage); ``aclose()`` at shutdown.
    """

    def __init__(
        self,
        config: RedisConfig,
        *,
        clock: Clock | None = None,
        on_error: Callable[[str], None] = _ignore,
        on_fallback: Callable[[str], None] = _ignore,
    ) -> None:
        self.config = config
        self.replica = uuid.uuid4().hex[:16]
        self.up = True  # optimistic until a command fails; check() at start-up tells for sure
        self.fallback = MemoryLimitStore(clock)
        self._clock = clock
        self._on_error = on_error
        self._on_fallback = on_fallback
        self._redis: aioredis.Redis = aioredis.Redis.from_url(
            config.url,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            retry=Retry(NoBackoff(), 0),  # no retry: a failure falls back at once
        )
        self._take = self._redis.register_script(TAKE)
        self._refund = self._redis.register_script(REFUND)
        self._acquire = self._redis.register_script(ACQUIRE)
        self._release = self._redis.register_script(RELEASE)
        self._in_use = self._redis.register_script(IN_USE)
        self._renew = self._redis.register_script(RENEW)
        self._held: dict[str, int] = {}  # slot key -> slots this replica holds in Redis
        self._pending: dict[str, int] = {}  # slot key -> acquires/releases in flight
        self._local: dict[str, int] = {}  # slot key -> slots this replica holds in the fallback

    def _now(self) -> tuple[str, str]:
        if self._clock is None:
            return "", ""
        sec, usec = divmod(round(self._clock.now() * 1e6), 1_000_000)
        return str(sec), str(usec)

    def _bucket_key(self, key: str) -> str:
        return f"{self.config.key_prefix}{key}"

    def _slot_keys(self, key: str) -> list[str]:
        base = f"{self.config.key_prefix}{{{key}}}"  # a hash tag keeps both on one cluster slot
        return [f"{base}:held", f"{base}:leases"]

    async def _call(self, operation: str, remote: Callable[[], Awaitable[T]], local: Callable[[], Awaitable[T]]) -> T:
        """``remote()`` while Redis is up, ``local()`` (the fallback) when it is down or fails."""
        if self.up:
            try:
                async with asyncio.timeout(self.config.timeout_s * 4):  # connect plus command
                    return await remote()
            except FAILURES as exc:
                self._failed(operation, exc)
        self._on_fallback(operation)
        return await local()

    def _failed(self, operation: str, exc: BaseException) -> None:
        self._on_error(operation)
        if self.up:
            log.warning(
                "Redis %r failed on %s (%s: %s): tenant limits now enforced by this replica alone",
                self.config,
                operation,
                type(exc).__name__,
                exc,
            )
        self.up = False

    async def take(self, key: str, amount: float, capacity: float, refill_per_s: float) -> BucketResult:
        async def remote() -> BucketResult:
            args = [*self._now(), repr(float(amount)), repr(float(capacity)), repr(float(refill_per_s))]
            allowed, level = await self._take(keys=[self._bucket_key(key)], args=args)
            remaining = float(level)
            reset = (capacity - remaining) / refill_per_s
            if allowed:
                return BucketResult(True, remaining, 0.0, reset)
            return BucketResult(False, remaining, (amount - remaining) / refill_per_s, reset)

        return await self._call("take", remote, lambda: self.fallback.take(key, amount, capacity, refill_per_s))

    async def refund(self, key: str, amount: float, capacity: float, refill_per_s: float) -> None:
        async def remote() -> None:
            args = [*self._now(), repr(float(amount)), repr(float(capacity)), repr(float(refill_per_s))]
            await self._refund(keys=[self._bucket_key(key)], args=args)

        await self._call("refund", remote, lambda: self.fallback.refund(key, amount, capacity, refill_per_s))

    async def acquire_slot(self, key: str, limit: int) -> bool:
        async def remote() -> bool:
            # Counted as held before the answer, and marked in flight: a renewal meanwhile
            # only extends the lease and never writes a count that misses this slot.
            self._held[key] = self._held.get(key, 0) + 1
            self._pending[key] = self._pending.get(key, 0) + 1
            ok = False
            try:
                args = [*self._now(), self.replica, str(limit), repr(self.config.lease_ttl_s)]
                ok = bool(await self._acquire(keys=self._slot_keys(key), args=args))
            finally:
                if not ok:
                    self._held[key] -= 1  # a lost answer may leave one counted: the renewal repairs it
                self._done(key)
            return ok

        async def local() -> bool:
            ok = await self.fallback.acquire_slot(key, limit)
            if ok:
                self._local[key] = self._local.get(key, 0) + 1
            return ok

        return await self._call("acquire_slot", remote, local)

    async def release_slot(self, key: str) -> None:
        """Frees a fallback slot first (those are certain), else one held in Redis.

        A release that fails is not retried: the slot is counted out here, and the next
        renewal writes the true count to Redis."""
        if self._local.get(key, 0) > 0:
            self._local[key] -= 1
            await self.fallback.release_slot(key)
            return
        if self._held.get(key, 0) <= 0:
            return
        self._held[key] -= 1

        async def remote() -> None:
            self._pending[key] = self._pending.get(key, 0) + 1
            try:
                await self._release(keys=self._slot_keys(key), args=[self.replica])
            finally:
                self._done(key)

        async def local() -> None:
            return None

        await self._call("release_slot", remote, local)

    def _done(self, key: str) -> None:
        pending = self._pending.get(key, 0) - 1
        if pending > 0:
            self._pending[key] = pending
        else:
            self._pending.pop(key, None)

    async def slots_in_use(self, key: str) -> int:
        async def remote() -> int:
            return int(await self._in_use(keys=self._slot_keys(key), args=list(self._now())))

        return await self._call("slots_in_use", remote, lambda: self.fallback.slots_in_use(key))

    async def check(self) -> bool:
        """Ping Redis (renewing this replica's leases on the way); sets and returns ``up``."""
        try:
            if not self.up:
                # Idle connections from before the outage may be dead (a partition sends no FIN).
                await self._redis.connection_pool.disconnect(inuse_connections=False)
            async with asyncio.timeout(self.config.timeout_s * 4):
                await self._heartbeat()
        except FAILURES as exc:
            self._failed("ping", exc)
            return False
        if not self.up:
            log.warning("Redis %r is reachable again: tenant limits are shared again", self.config)
        self.up = True
        return True

    async def _heartbeat(self) -> None:
        keys: list[str] = []
        counts: list[str] = []
        for key, held in list(self._held.items()):
            keys += self._slot_keys(key)
            counts.append("-1" if self._pending.get(key) else str(max(0, held)))
        if not keys:
            await self._redis.ping()
            return
        args = [*self._now(), self.replica, repr(self.config.lease_ttl_s), *counts]
        await self._renew(keys=keys, args=args)
        for key, held in list(self._held.items()):
            if held <= 0 and not self._pending.get(key):
                del self._held[key]

    async def run(self) -> None:
        """Ping every ``ping_interval_s`` until cancelled (the gateway owns the task)."""
        while True:
            await asyncio.sleep(self.config.ping_interval_s)
            await self.check()

    async def aclose(self) -> None:
        """Give back this replica's leases (best effort), then close the connections."""
        for key in self._held:
            self._held[key] = 0
        if self.up and self._held:
            try:
                async with asyncio.timeout(self.config.timeout_s * 4):
                    await self._heartbeat()
            except FAILURES:
                log.info("leases not given back at shutdown; they expire in %ss", self.config.lease_ttl_s)
        await self._redis.aclose()
        await self.fallback.aclose()
