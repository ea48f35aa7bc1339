"""Redis-backed ``LimitStore``: tenant limits shared by every gateway replica.

**One round trip per step.** An admission (the tenant's concurrency slot, its requests and
its tokens per minute) is one Lua script, and so is a settlement (the slot back, the tokens
adjusted to the real usage); the scripts are in ``limitstore/scripts.py``, registered once and
run by EVALSHA (redis-py loads them again after a ``NOSCRIPT``, e.g. when Redis restarted).
Each is atomic, so replicas never race on a read-modify-write. A tenant's keys share one hash
tag (``gw:{acme}:rpm``, ...): one Redis Cluster slot per script, and the lease renewal is one
script per tenant too (pipelined), never one across tenants.

**Concurrency slots: a lease per replica, renewed while it holds slots.** A slot key is a hash
``replica -> slots it holds`` plus a sorted set ``replica -> lease expiry``. A replica renews
its leases (and rewrites its counts from what it really holds, the slots it took in its
fallback included) every ``ping_interval_s``; an admission first drops the replicas whose
lease expired. So a replica that dies holding slots frees them ``lease_ttl_s`` later, while a
live one keeps slots for requests of any length. The alternative, a plain counter with a TTL
longer than the longest request deadline (600 s by default), would block a tenant for ten
minutes after a crash, and never free a leaked slot at all while traffic keeps refreshing the
TTL. The rewrite also repairs a count that a failed release left behind, within one renewal.
A slot is released where it was taken (``Verdict.slot_at``): in Redis, or in the fallback.

**Failure: a local fallback, as the policy says** (``state.on_store_loss``,
``limitstore/outage.py``). A command that fails marks Redis down; from then on every
operation goes straight to this process's ``LocalLimits`` without waiting on Redis, until the
background ping succeeds again: by default each process enforces its share of every limit
(``share``); ``open`` is each the whole limit, ``closed`` refuses limited tenants. When Redis is
back, what was admitted locally is charged to it before it is used again. ``up`` tells whether
the last command or ping succeeded; ``on_error``/``on_fallback`` count failures and the
operations answered locally.

**Slow is down: a latency budget per request, in the event loop's free time.** A Redis that
answers every command, but in 30 ms, would add 30 ms to every request per round trip without
ever failing. So a request may wait on Redis ``request_budget_s`` in all (its admission and
its settlement share it, the caller passes what is left as ``timeout_s``); a call that would
exceed it is cut and answered by the fallback, and Redis is marked down as for an outage. The
background ping brings it back only when it answers within ``probe_max_s`` (half the budget: a
request makes two calls), so a slow Redis costs one request its budget, not every request, and
is used again once fast. Every wait on Redis (the budget, the ping's timeout and its time) is
counted in the time the event loop was free to read the answer (``limitstore/lag.py``): a
process that is busy, or stalled by one long callback, has not found Redis slow. redis-py's
own socket timeouts are therefore off (they would cut a reply that waits in the socket).
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
from gateway.limitstore.base import Adjust, Ask, Bucket, BucketResult, Settlement, Take, Verdict
from gateway.limitstore.connect import redis_client
from gateway.limitstore.lag import FreeTimeout, LoopLag, timed_out
from gateway.limitstore.outage import LocalLimits, LossMode, Processes
from gateway.limitstore.scripts import ADMIT, IN_USE, RENEW, SETTLE

log = logging.getLogger(__name__)

T = TypeVar("T")
FAILURES = (RedisError, OSError, TimeoutError)
RECONCILE_ROUNDS = 5
"""Charging an outage to Redis awaits it; what was admitted meanwhile is charged in another round."""


def _ignore(operation: str) -> None:
    return None


def _never_counted() -> int:
    return 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisConfig:
    """Where the shared state lives, how long to wait for it, and what to do without it.

    ``RedisConfig(url="redis://127.0.0.1:6379/0", key_prefix="gw:", timeout_s=0.05)``; several
    gateways (or test runs) share one Redis under different prefixes. ``timeout_s`` bounds one
    command off the request path (pings, renewals); ``request_budget_s`` bounds what one
    request may wait on Redis in all (see ``RedisLimitStore``); ``on_store_loss`` and
    ``processes_when_unknown`` are ``limitstore/outage.py``'s. The URL may hold a password, so
    ``repr`` shows only where it points.
    """

    url: str
    key_prefix: str = "gw:"
    timeout_s: float = 0.05
    request_budget_s: float = 0.02
    ping_interval_s: float = 1.0
    lease_ttl_s: float = 10.0
    on_store_loss: LossMode = "open"
    processes_when_unknown: int | None = None

    @property
    def probe_max_s(self) -> float:
        """A ping slower than this keeps Redis out: half the budget, a request makes two calls."""
        return self.request_budget_s / 2

    def __repr__(self) -> str:
        where = self.url.rsplit("@", 1)[-1].split("://")[-1]
        return (
            f"RedisConfig(url=<{where}>, key_prefix={self.key_prefix!r}, timeout_s={self.timeout_s}, "
            f"request_budget_s={self.request_budget_s}, on_store_loss={self.on_store_loss!r})"
        )


class RedisLimitStore:
    """``LimitStore`` in Redis, with a local fallback while Redis is lost (see the module docstring).

    Built in the lifespan; ``await store.check()`` once, then ``run()`` as an owned task (pings,
    renews leases, brings Redis back after an outage); ``aclose()`` at shutdown. ``processes``
    is how many gateway processes the fleet counts (``share`` divides the limits by it)."""

    def __init__(
        self,
        config: RedisConfig,
        *,
        clock: Clock | None = None,
        on_error: Callable[[str], None] = _ignore,
        on_fallback: Callable[[str], None] = _ignore,
        processes: Processes = _never_counted,
    ) -> None:
        self.config = config
        self.request_budget_s = config.request_budget_s
        self.replica = uuid.uuid4().hex[:16]
        self.up = True  # optimistic until a command fails; check() at start-up tells for sure
        self.lag = LoopLag()
        self.fallback = LocalLimits(
            config.on_store_loss,
            clock,
            processes=processes,
            processes_when_unknown=config.processes_when_unknown,
            retry_after_s=config.ping_interval_s,
        )
        self._clock = clock
        self._on_error = on_error
        self._on_fallback = on_fallback
        self._redis: aioredis.Redis = redis_client(
            config.url,
            socket_timeout=None,  # every call is bounded in free time instead (module docstring)
            socket_connect_timeout=None,
            retry=Retry(NoBackoff(), 0),  # no retry: a failure falls back at once
        )
        self._admit = self._redis.register_script(ADMIT)
        self._settle = self._redis.register_script(SETTLE)
        self._in_use = self._redis.register_script(IN_USE)
        self._renew = self._redis.register_script(RENEW)
        self._held: dict[str, int] = {}  # scope -> slots this replica holds in Redis
        self._pending: dict[str, int] = {}  # scope -> admissions/settlements with a slot in flight
        self._adopted: dict[str, int] = {}  # scope -> fallback slots the last renewal wrote into Redis's count

    def _now(self) -> list[str]:
        if self._clock is None:
            return ["", ""]
        sec, usec = divmod(round(self._clock.now() * 1e6), 1_000_000)
        return [str(sec), str(usec)]

    def _keys(self, scope: str, buckets: list[Bucket]) -> list[str]:
        """The scope's slot hash and lease set, then its buckets: one hash tag, one cluster slot."""
        base = f"{self.config.key_prefix}{{{scope}}}"
        return [f"{base}:held", f"{base}:leases", *(f"{base}:{b.name}" for b in buckets)]

    async def _within(self, remote: Callable[[], Awaitable[T]], limit_s: float) -> tuple[T, float]:
        """``remote()`` cut after ``limit_s`` of the loop's free time; its result and the free time taken."""
        deadline = FreeTimeout(self.lag, limit_s)
        try:
            async with deadline:
                result = await remote()
        except TimeoutError as exc:
            raise timed_out(exc, deadline) from exc
        return result, deadline.free_s

    async def _call(
        self, operation: str, remote: Callable[[], Awaitable[T]], local: Callable[[], T], budget_s: float
    ) -> tuple[T, float]:
        """``remote()`` while Redis is up and within ``budget_s``, else ``local()`` (the fallback);
        with the free time spent waiting on Redis."""
        waited = 0.0
        if self.up:
            deadline = FreeTimeout(self.lag, min(budget_s, self.config.timeout_s * 4))  # connect plus command
            try:
                if budget_s <= 0:
                    raise TimeoutError("the request's budget for Redis is spent")
                async with deadline:
                    result = await remote()
                return result, deadline.free_s
            except FAILURES as exc:
                self._failed(operation, timed_out(exc, deadline))
            waited = deadline.free_s
        self._on_fallback(operation)
        return local(), waited

    def _budget(self, timeout_s: float | None) -> float:
        return self.config.request_budget_s if timeout_s is None else timeout_s

    def _failed(self, operation: str, exc: BaseException) -> None:
        self._on_error(operation)
        if self.up:
            processes = self.fallback.lost()
            log.warning(
                "Redis %r failed on %s (%s: %s): tenant limits now enforced by this process alone (%s)",
                self.config,
                operation,
                type(exc).__name__,
                exc,
                self.fallback.terms(processes),
            )
        self.up = False

    def _saw(self, scope: str, buckets: list[Bucket], levels: list[bytes]) -> None:
        for bucket, level in zip(buckets, levels, strict=True):
            self.fallback.saw(scope, bucket.name, float(level))

    async def admit(self, ask: Ask, *, timeout_s: float | None = None) -> Verdict:
        scope, slot = ask.scope, ask.slot_limit is not None
        buckets = [take.bucket for take in ask.takes]

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
                refused, *levels = await self._admit(keys=self._keys(scope, buckets), args=args)
                admitted = refused == 0
            finally:
                if slot:
                    if not admitted:
                        self._held[scope] -= 1  # a lost answer may leave one counted: the renewal repairs it
                    self._done(scope)
            self._saw(scope, buckets, levels)
            refused_by = None if admitted else "slot" if refused == 1 else ask.takes[refused - 2].bucket.name
            results = tuple(
                _result(float(level), take, admitted) for take, level in zip(ask.takes, levels, strict=True)
            )
            return Verdict(admitted, refused_by, results, slot_at="store" if admitted and slot else None)

        def local() -> Verdict:
            return self.fallback.admit(ask, held=self._held.get(scope, 0))

        verdict, waited = await self._call("admit", remote, local, self._budget(timeout_s))
        return Verdict(
            verdict.admitted, verdict.refused_by, verdict.buckets, verdict.slot_at, waited, verdict.retry_after_s
        )

    async def settle(self, settlement: Settlement, *, timeout_s: float | None = None) -> float:
        """The slot goes back where it was taken: a fallback slot to the fallback, a Redis slot to
        Redis. A release that fails is not retried: the slot is counted out here, and the next
        renewal writes the true count to Redis."""
        scope = settlement.scope
        release_remote = False
        if settlement.release_slot:
            if settlement.slot_at == "local":
                self.fallback.release(scope)
                if self.up and self._adopted.get(scope, 0) > 0:  # Redis counts it since a renewal
                    self._adopted[scope] -= 1
                    release_remote = True
            elif self._held.get(scope, 0) > 0:
                self._held[scope] -= 1
                release_remote = True
        if not release_remote and not settlement.adjusts:
            return 0.0

        async def remote() -> None:
            if release_remote:
                self._pending[scope] = self._pending.get(scope, 0) + 1
            try:
                await self._adjust(scope, settlement.adjusts, release_remote)
            finally:
                if release_remote:
                    self._done(scope)

        def local() -> None:
            self.fallback.settle(Settlement(scope=scope, adjusts=settlement.adjusts))

        _, waited = await self._call("settle", remote, local, self._budget(timeout_s))
        return waited

    def _done(self, scope: str) -> None:
        pending = self._pending.get(scope, 0) - 1
        if pending > 0:
            self._pending[scope] = pending
        else:
            self._pending.pop(scope, None)

    async def slots_in_use(self, scope: str) -> int:
        async def remote() -> int:
            return int(await self._in_use(keys=self._keys(scope, []), args=self._now()))

        def local() -> int:
            return self._held.get(scope, 0) + self.fallback.slots_in_use(scope)

        used, _ = await self._call("slots_in_use", remote, local, math.inf)
        return used

    async def check(self) -> bool:
        """Ping Redis (renewing this replica's leases on the way); sets and returns ``up``.

        A Redis that is down comes back only when the ping answers within ``probe_max_s`` (of
        free time) and what was admitted locally meanwhile is charged to it. One that answers,
        but slower than a request may wait for it, stays out like one that does not. A Redis
        that is up is taken out by a failed ping, not by a slow one: requests find out for
        themselves (their budget)."""
        try:
            if not self.up:
                # Idle connections from before the outage may be dead (a partition sends no FIN).
                await self._redis.connection_pool.disconnect(inuse_connections=False)
            _, took = await self._within(self._heartbeat, self.config.timeout_s * 4)
            if not self.up:
                if took > self.config.probe_max_s:
                    raise TimeoutError(f"a ping took {took * 1000:.1f} ms, over {self.config.probe_max_s * 1000:g} ms")
                if not await self._reconcile():
                    return False
        except FAILURES as exc:
            self._failed("ping", exc)
            return False
        if not self.up:
            log.warning("Redis %r is reachable again: tenant limits are shared again", self.config)
            self.fallback.recovered()
        self.up = True
        return True

    async def _reconcile(self) -> bool:
        """Charge Redis what this process admitted on its own during the outage (``outage.py``);
        True once nothing is left to charge (requests admitted meanwhile go in another round)."""
        for _ in range(RECONCILE_ROUNDS):
            debts = self.fallback.debts()
            if not debts:
                return True
            for scope, adjusts in debts.items():
                await self._within(lambda: self._adjust(scope, adjusts), self.config.timeout_s * 4)  # noqa: B023
                self.fallback.paid(scope, adjusts)
        return False

    async def _adjust(self, scope: str, adjusts: tuple[Adjust, ...], release: bool = False) -> None:
        """One SETTLE script: ``adjusts`` to the scope's buckets, and one of its slots back if ``release``."""
        buckets = [adjust.bucket for adjust in adjusts]
        args = [*self._now(), self.replica, "1" if release else "0"]
        for adjust in adjusts:
            b = adjust.bucket
            args += [repr(float(adjust.amount)), repr(float(b.capacity)), repr(float(b.refill_per_s))]
        levels = await self._settle(keys=self._keys(scope, buckets), args=args)
        self._saw(scope, buckets, levels)

    def _holdings(self) -> dict[str, str]:
        """What this replica holds per scope, as the renewal writes it: its Redis slots and its
        fallback slots (both run on the tenant's behalf), or -1 while a slot operation is in flight."""
        local = self.fallback.scopes_with_slots()
        counts: dict[str, str] = {}
        for scope in set(self._held) | set(local) | set(self._adopted):
            held = max(0, self._held.get(scope, 0)) + local.get(scope, 0)
            counts[scope] = "-1" if self._pending.get(scope) else str(held)
        return counts

    async def _heartbeat(self, counts: dict[str, str] | None = None) -> None:
        """Renew this replica's leases with ``counts`` (default ``_holdings()``): one script per
        scope (its own hash tag), all in one pipeline; a plain PING when it holds nothing.

        A count written includes the fallback slots still held (``_adopted``): from then on,
        releasing one of them releases it in Redis too."""
        local = self.fallback.scopes_with_slots()
        counts = self._holdings() if counts is None else counts
        if not counts:
            await self._redis.ping()
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for scope, count in counts.items():
                args = [*self._now(), self.replica, repr(self.config.lease_ttl_s), count]
                await self._renew(keys=self._keys(scope, []), args=args, client=pipe)
            await pipe.execute()
        for scope, count in counts.items():
            if count != "-1":
                self._adopted[scope] = min(local.get(scope, 0), self.fallback.slots_in_use(scope))
            if not self._adopted.get(scope):
                self._adopted.pop(scope, None)
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
        counts = {scope: "0" for scope in self._holdings()}
        if self.up and counts:
            try:
                await self._within(lambda: self._heartbeat(counts), self.config.timeout_s * 4)
            except FAILURES:
                log.info("leases not given back at shutdown; they expire in %ss", self.config.lease_ttl_s)
        await self._redis.aclose()


def _result(level: float, take: Take, admitted: bool) -> BucketResult:
    """A bucket's result from the level the script returned (after the take when admitted)."""
    b = take.bucket
    before = level + take.amount if admitted else level
    return BucketResult.of(before, take.amount, b.capacity, b.refill_per_s, admitted)
