"""Redis-backed ``LimitStore``: tenant limits shared by every gateway replica.

**One round trip per step.** An admission (the tenant's concurrency slot, its requests and
its tokens per minute) is one Lua script, and so is a settlement (the slot back, the tokens
adjusted to the real usage); scripts are registered once and run by EVALSHA (redis-py loads
them again after a ``NOSCRIPT``, e.g. when Redis restarted). Each is atomic, so replicas never
race on a read-modify-write. A tenant's keys share one hash tag (``gw:{acme}:rpm``, ...): one
Redis Cluster slot per script.

**Time.** Token buckets refill from Redis's own clock (``TIME`` inside the script), never from
the replica's: replicas whose clocks disagree still see one bucket level. A ``clock`` may be
injected for tests; the scripts then use it instead.

**Concurrency slots: a lease per replica, renewed while it holds slots.** A slot key is a hash
``replica -> slots it holds`` plus a sorted set ``replica -> lease expiry``. A replica renews
its leases (and rewrites its counts from what it really holds) every ``ping_interval_s``; an
admission first drops the replicas whose lease expired. So a replica that dies holding slots
frees them ``lease_ttl_s`` later, while a live one keeps slots for requests of any length.
The alternative, a plain counter with a TTL longer than the longest request deadline (600 s
by default), would block a tenant for ten minutes after a crash, and never free a leaked slot
at all while traffic keeps refreshing the TTL. The rewrite also repairs a count that a failed
release left behind, within one renewal.

**Failure: fail open to a per-replica fallback** (Envoy's global rate limit with
``failure_mode_deny: false``). A command that fails marks Redis down; from then on every
operation goes straight to an in-process ``MemoryLimitStore`` (same limits, enforced by this
replica alone, so a tenant may get up to N replicas x its limit) without waiting on Redis,
until the background ping succeeds again. Requests are never failed because Redis is: an
outage costs accuracy of the limits, not availability. ``up`` tells whether the last command
or ping succeeded; ``on_error``/``on_fallback`` count failures and the operations answered
locally.

**Slow is down: a latency budget per request.** A Redis that answers every command, but in
30 ms, would add 30 ms to every request per round trip without ever failing. So a request
may wait on Redis ``request_budget_s`` in all (its admission and its settlement share it, the
caller passes what is left as ``timeout_s``); a call that would exceed it is cut and answered
by the fallback, and Redis is marked down as for an outage. The background ping brings it back
only when it answers within ``probe_max_s`` (half the budget: a request makes two calls), so a
slow Redis costs one request its budget, not every request, and is used again once fast.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.clock import Clock
from gateway.limitstore.base import Ask, Bucket, BucketResult, Settlement, Take, Verdict
from gateway.limitstore.memory import MemoryLimitStore

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

# Bucket hashes {level, s, us}: the level and the time it was written (refilled lazily).
_BUCKETS = """
local function level_of(key, capacity, rate)
  local state = redis.call('HMGET', key, 'level', 's', 'us')
  if not state[1] then
    return capacity
  end
  local elapsed = (tonumber(sec) - tonumber(state[2])) + (tonumber(usec) - tonumber(state[3])) / 1e6
  return math.min(capacity, tonumber(state[1]) + math.max(0, elapsed) * rate)
end
local function store(key, value, capacity, rate)
  if value >= capacity then
    redis.call('DEL', key)
    return
  end
  redis.call('HSET', key, 'level', string.format('%.17g', value), 's', sec, 'us', usec)
  redis.call('PEXPIRE', key, math.ceil((capacity - value) / rate * 1000) + 1000)
end
"""

# KEYS[1]: hash replica -> slots held; KEYS[2]: zset replica -> lease expiry (seconds).
_SLOTS = (
    _NOW
    + _BUCKETS
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

# One admission: KEYS[3..] the buckets to take from; ARGV[3..5]: replica, slot limit ('' for
# none), lease ttl; then per bucket amount, capacity, refill per second. Everything or nothing.
# Returns {refused, level...}: refused 0 (admitted), 1 (the slot) or 1 + the refusing bucket's
# position; each bucket's level after the take (before it, when refused).
ADMIT = (
    _SLOTS
    + """
local replica, limit, ttl = ARGV[3], ARGV[4], tonumber(ARGV[5])
local refused = 0
if limit ~= '' and purge() >= tonumber(limit) then
  refused = 1
end
local levels, amounts = {}, {}
for i = 3, #KEYS do
  local j = 6 + (i - 3) * 3
  local amount = tonumber(ARGV[j])
  local level = level_of(KEYS[i], tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2]))
  levels[i - 2], amounts[i - 2] = level, amount
  if refused == 0 and level < amount then
    refused = i - 1
  end
end
if refused == 0 then
  if limit ~= '' then
    redis.call('HINCRBY', KEYS[1], replica, 1)
    redis.call('ZADD', KEYS[2], t + ttl, replica)
    redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000))
    redis.call('PEXPIRE', KEYS[2], math.ceil(ttl * 1000))
  end
  for i = 3, #KEYS do
    local j = 6 + (i - 3) * 3
    levels[i - 2] = levels[i - 2] - amounts[i - 2]
    store(KEYS[i], levels[i - 2], tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2]))
  end
end
local reply = {refused}
for i, level in ipairs(levels) do
  reply[i + 1] = string.format('%.17g', level)
end
return reply
"""
)

# One settlement: ARGV[3..4]: replica, '1' to release one of its slots; then per bucket
# (KEYS[3..]) the adjustment (> 0 gives back, < 0 charges), capacity, refill per second.
# Levels stay within [-capacity, capacity] (see ``limitstore/base.py``).
SETTLE = (
    _SLOTS
    + """
if ARGV[4] == '1' then
  local n = redis.call('HINCRBY', KEYS[1], ARGV[3], -1)
  if n <= 0 then
    redis.call('HDEL', KEYS[1], ARGV[3])
    redis.call('ZREM', KEYS[2], ARGV[3])
  end
end
for i = 3, #KEYS do
  local j = 5 + (i - 3) * 3
  local amount, capacity, rate = tonumber(ARGV[j]), tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])
  local level = level_of(KEYS[i], capacity, rate)
  store(KEYS[i], math.min(capacity, math.max(-capacity, level + amount)), capacity, rate)
end
return 1
"""
)

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
    gateways (or test runs) share one Redis under different prefixes. ``timeout_s`` bounds one
    command off the request path (pings, renewals); ``request_budget_s`` bounds what one
    request may wait on Redis in all (see ``RedisLimitStore``). The URL may hold a password,
    so ``repr`` shows only where it points.
    """

    url: str
    key_prefix: str = "gw:"
    timeout_s: float = 0.05
    request_budget_s: float = 0.02
    ping_interval_s: float = 1.0
    lease_ttl_s: float = 10.0

    @property
    def probe_max_s(self) -> float:
        """A ping slower than this keeps Redis out: half the budget, a request makes two calls."""
        return self.request_budget_s / 2

    def __repr__(self) -> str:
        where = self.url.rsplit("@", 1)[-1].split("://")[-1]
        return (
            f"RedisConfig(url=<{where}>, key_prefix={self.key_prefix!r}, timeout_s={self.timeout_s}, "
            f"request_budget_s={self.request_budget_s})"
        )


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
        self.request_budget_s = config.request_budget_s
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
        self._admit = self._redis.register_script(ADMIT)
        self._settle = self._redis.register_script(SETTLE)
        self._in_use = self._redis.register_script(IN_USE)
        self._renew = self._redis.register_script(RENEW)
        self._held: dict[str, int] = {}  # scope -> slots this replica holds in Redis
        self._pending: dict[str, int] = {}  # scope -> admissions/settlements with a slot in flight
        self._local: dict[str, int] = {}  # scope -> slots this replica holds in the fallback

    def _now(self) -> list[str]:
        if self._clock is None:
            return ["", ""]
        sec, usec = divmod(round(self._clock.now() * 1e6), 1_000_000)
        return [str(sec), str(usec)]

    def _keys(self, scope: str, buckets: list[Bucket]) -> list[str]:
        """The scope's slot hash and lease set, then its buckets: one hash tag, one cluster slot."""
        base = f"{self.config.key_prefix}{{{scope}}}"
        return [f"{base}:held", f"{base}:leases", *(f"{base}:{b.name}" for b in buckets)]

    async def _call(
        self, operation: str, remote: Callable[[], Awaitable[T]], local: Callable[[], Awaitable[T]], budget_s: float
    ) -> T:
        """``remote()`` while Redis is up and within ``budget_s``, else ``local()`` (the fallback)."""
        if self.up:
            try:
                if budget_s <= 0:
                    raise TimeoutError("the request's budget for Redis is spent")
                async with asyncio.timeout(min(budget_s, self.config.timeout_s * 4)):  # connect plus command
                    return await remote()
            except FAILURES as exc:
                self._failed(operation, exc)
        self._on_fallback(operation)
        return await local()

    def _budget(self, timeout_s: float | None) -> float:
        return self.config.request_budget_s if timeout_s is None else timeout_s

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

    async def admit(self, ask: Ask, *, timeout_s: float | None = None) -> Verdict:
        scope, slot = ask.scope, ask.slot_limit is not None

        async def remote() -> Verdict:
            if slot:
                # Counted as held before the answer, and marked in flight: a renewal meanwhile
                # only extends the lease and never writes a count that misses this slot.
                self._held[scope] = self._held.get(scope, 0) + 1
                self._pending[scope] = self._pending.get(scope, 0) + 1
            admitted = False
            try:
                args = [*self._now(), self.replica, "" if ask.slot_limit is None else str(ask.slot_limit)]
                args.append(repr(self.config.lease_ttl_s))
                for take in ask.takes:
                    b = take.bucket
                    args += [repr(float(take.amount)), repr(float(b.capacity)), repr(float(b.refill_per_s))]
                keys = self._keys(scope, [take.bucket for take in ask.takes])
                refused, *levels = await self._admit(keys=keys, args=args)
                admitted = refused == 0
            finally:
                if slot:
                    if not admitted:
                        self._held[scope] -= 1  # a lost answer may leave one counted: the renewal repairs it
                    self._done(scope)
            refused_by = None if admitted else "slot" if refused == 1 else ask.takes[refused - 2].bucket.name
            results = tuple(
                _result(float(level), take, admitted) for take, level in zip(ask.takes, levels, strict=True)
            )
            return Verdict(admitted, refused_by, results)

        async def local() -> Verdict:
            verdict = await self.fallback.admit(ask)
            if verdict.admitted and slot:
                self._local[scope] = self._local.get(scope, 0) + 1
            return verdict

        return await self._call("admit", remote, local, self._budget(timeout_s))

    async def settle(self, settlement: Settlement, *, timeout_s: float | None = None) -> None:
        """Slots are given back where they were taken: a fallback slot first (those are certain),
        else one held in Redis. A release that fails is not retried: the slot is counted out
        here, and the next renewal writes the true count to Redis."""
        scope = settlement.scope
        release_remote = False
        if settlement.release_slot:
            if self._local.get(scope, 0) > 0:
                self._local[scope] -= 1
                await self.fallback.settle(Settlement(scope=scope, release_slot=True))
            elif self._held.get(scope, 0) > 0:
                self._held[scope] -= 1
                release_remote = True
        if not release_remote and not settlement.adjusts:
            return

        async def remote() -> None:
            if release_remote:
                self._pending[scope] = self._pending.get(scope, 0) + 1
            try:
                args = [*self._now(), self.replica, "1" if release_remote else "0"]
                for adjust in settlement.adjusts:
                    b = adjust.bucket
                    args += [repr(float(adjust.amount)), repr(float(b.capacity)), repr(float(b.refill_per_s))]
                await self._settle(keys=self._keys(scope, [a.bucket for a in settlement.adjusts]), args=args)
            finally:
                if release_remote:
                    self._done(scope)

        async def local() -> None:
            await self.fallback.settle(Settlement(scope=scope, adjusts=settlement.adjusts))

        await self._call("settle", remote, local, self._budget(timeout_s))

    def _done(self, scope: str) -> None:
        pending = self._pending.get(scope, 0) - 1
        if pending > 0:
            self._pending[scope] = pending
        else:
            self._pending.pop(scope, None)

    async def slots_in_use(self, scope: str) -> int:
        async def remote() -> int:
            return int(await self._in_use(keys=self._keys(scope, []), args=self._now()))

        return await self._call("slots_in_use", remote, lambda: self.fallback.slots_in_use(scope), math.inf)

    async def check(self) -> bool:
        """Ping Redis (renewing this replica's leases on the way); sets and returns ``up``.

        A Redis that is down comes back only when the ping answers within ``probe_max_s``: one
        that answers, but slower than a request may wait for it, stays out like one that does
        not. A Redis that is up is taken out by a failed ping, not by a slow one: requests find
        out for themselves (their budget), and a ping's time includes the event loop's own
        delays, which must not flap the limits between shared and local."""
        loop = asyncio.get_running_loop()
        try:
            if not self.up:
                # Idle connections from before the outage may be dead (a partition sends no FIN).
                await self._redis.connection_pool.disconnect(inuse_connections=False)
            started = loop.time()
            async with asyncio.timeout(self.config.timeout_s * 4):
                await self._heartbeat()
            took = loop.time() - started
            if took > self.config.probe_max_s and not self.up:
                raise TimeoutError(f"a ping took {took * 1000:.1f} ms, over {self.config.probe_max_s * 1000:g} ms")
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
        for scope, held in list(self._held.items()):
            keys += self._keys(scope, [])
            counts.append("-1" if self._pending.get(scope) else str(max(0, held)))
        if not keys:
            await self._redis.ping()
            return
        args = [*self._now(), self.replica, repr(self.config.lease_ttl_s), *counts]
        await self._renew(keys=keys, args=args)
        for scope, held in list(self._held.items()):
            if held <= 0 and not self._pending.get(scope):
                del self._held[scope]

    async def run(self) -> None:
        """Ping every ``ping_interval_s`` until cancelled (the gateway owns the task)."""
        while True:
            await asyncio.sleep(self.config.ping_interval_s)
            await self.check()

    async def aclose(self) -> None:
        """Give back this replica's leases (best effort), then close the connections."""
        for scope in self._held:
            self._held[scope] = 0
        if self.up and self._held:
            try:
                async with asyncio.timeout(self.config.timeout_s * 4):
                    await self._heartbeat()
            except FAILURES:
                log.info("leases not given back at shutdown; they expire in %ss", self.config.lease_ttl_s)
        await self._redis.aclose()
        await self.fallback.aclose()


def _result(level: float, take: Take, admitted: bool) -> BucketResult:
    """A bucket's result from the level the script returned (after the take when admitted)."""
    b = take.bucket
    before = level + take.amount if admitted else level
    return BucketResult.of(before, take.amount, b.capacity, b.refill_per_s, admitted)
