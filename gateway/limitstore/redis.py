"""Redis-backed ``LimitStore``: tenant limits shared by every gateway replica, spent from leases.

**Leases: a fraction of a round trip per request** (``limitstore/lease.py``). Each process
holds a lease of each active tenant's budget (tokens of each bucket, concurrency slots) and
admits from it without asking Redis; a request's settlement (its slot back, its tokens moved
to what it really used) is bookkeeping in the lease too. One script per tenant, SYNC
(``limitstore/scripts.py``), reports what was spent, gives back, charges, asks and renews, all
at once and atomically; the keeper (``run``) sends the scripts of every tenant that needs one
(under its watermark, holding too much, or due for renewal) in **one pipeline** per tick
(``sync_interval_s``), and an admission that finds its lease short sends its tenant's script
at once: one round trip, never a refusal that Redis would not have made. Pipelines carry
EVALSHA alone (a script Redis forgot is loaded and the failed calls sent again), so a tick is
one round trip. The keys of one tenant share its hash tag (``gw:{acme}:held``, ...): one Redis
Cluster slot per script, and no script spans tenants. On a cluster (``redis+cluster://``,
``shared/connect.py``) redis-py refuses EVALSHA in a pipeline: the tick's scripts go as
concurrent calls, one per tenant.

**Slots and tokens of a dead replica come back**: a replica's lease in Redis expires
``lease_ttl_s`` after its last sync (every ``ping_interval_s`` at least, while it holds
anything): its slots are freed, its tokens counted as spent. A live one keeps its slots for
requests of any length. The sync writes the slots running as the truth (the fallback's ones
included, once Redis is back: ``outage.py``), so a count that a lost answer left behind is
repaired by the next sync. A slot is released where it was taken (``LimitVerdict.slot_at``): in
the lease, or in the fallback.

**Failure: a local fallback, as the policy says** (``state.on_store_loss``,
``limitstore/outage.py``). A command that fails marks Redis down; from then on every
operation goes straight to this process's ``LocalLimits`` without waiting on Redis, until the
background ping succeeds again: by default each process enforces its share of every limit
(``share``); ``open`` is each the whole limit, ``closed`` refuses limited tenants. Leases are not
spent while Redis is lost (their spare goes back with the first sync after). When Redis is
back, what was admitted locally is charged to it before it is used again. ``up`` tells whether
the last command or ping succeeded; ``on_error``/``on_fallback`` count failures and the
operations answered locally.

**Slow is down: a latency budget per request, in the event loop's free time.** A Redis that
answers every command, but in 30 ms, would add 30 ms to every request that waits on it
without ever failing. So a request may wait on Redis ``request_budget_s`` in all (its
admission and its settlement share it, the caller passes what is left as ``timeout_s``); a
call that would exceed it is cut and answered by the fallback, and Redis is marked down as
for an outage. The background ping brings it back only when it answers within
``probe_max_s`` (half the budget), so a slow Redis costs one request its budget, not every
request, and is used again once fast. Every wait on Redis (the budget, the ping's timeout and
its time) is counted in the time the event loop was free to read the answer
(``shared/lag.py``): a process that is busy, or stalled by one long callback, has not
found Redis slow.

**The client is the process's shared store's** (``gateway/shared/store.py``): the ledger, the
prefix view, response affinity and the rollouts use the same pool, its options are the ones this
store needs (no socket timeouts: they would cut a reply that waits in the socket; no retries: a
failure falls back at once), every call here is bounded by ``SharedStore.budget`` (which also
judges Redis's health, ``gateway_redis_up``), and the store closes the client, not this. Built
without one (tests, benches), it opens a store of its own on ``config.url`` and closes that.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError

from gateway.clock import Clock
from gateway.limitstore.base import Adjust, Ask, LimitVerdict, Settlement
from gateway.limitstore.lease import WANTED_S, Reply, ScopeLease, Sent
from gateway.limitstore.outage import LocalLimits, LossMode, Processes
from gateway.limitstore.scripts import IN_USE, SYNC
from gateway.shared.connect import RedisClient
from gateway.shared.store import FAILURES, Budget, SharedStore

log = logging.getLogger(__name__)

T = TypeVar("T")
RECONCILE_ROUNDS = 5
"""Charging an outage to Redis awaits it; what was admitted meanwhile is charged in another round."""
ADMIT_SYNCS = 3
"""An admission whose lease was drained by others while its own ask was on the way asks again, this often at most."""
IDLE_S = 30.0
"""A tenant's lease that holds nothing is forgotten after this long unused (its rate with it)."""
CALL_TIMEOUTS = 4
"""A call off the request path (a ping, the keeper's sync) may take this many ``timeout_s``: a new
connection's handshake (a few round trips) and the command; and so may a request's, within its budget."""


def _ignore(operation: str) -> None:
    return None


def _never_counted() -> int:
    return 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisConfig:
    """Where the shared state lives, how long to wait for it, and what to do without it.

    ``RedisConfig(url="redis://127.0.0.1:6379/0", key_prefix="gw:", timeout_s=0.05)``; several
    gateways (or test runs) share one Redis under different prefixes. ``timeout_s`` bounds one
    command off the request path (pings, the keeper's syncs); ``request_budget_s`` bounds what
    one request may wait on Redis in all (see ``RedisLimitStore``); ``sync_interval_s`` is the
    keeper's tick (leases below their watermark are topped up, small limits' returns sent);
    ``on_store_loss`` and ``processes_when_unknown`` are ``limitstore/outage.py``'s. The URL may
    hold a password, so ``repr`` shows only where it points.
    """

    url: str
    key_prefix: str = "gw:"
    timeout_s: float = 0.05
    request_budget_s: float = 0.02
    ping_interval_s: float = 1.0
    lease_ttl_s: float = 10.0
    sync_interval_s: float = 0.1
    on_store_loss: LossMode = "open"
    processes_when_unknown: int | None = None

    @property
    def probe_max_s(self) -> float:
        """A ping slower than this keeps Redis out: half the budget."""
        return self.request_budget_s / 2

    def __repr__(self) -> str:
        where = self.url.rsplit("@", 1)[-1].split("://")[-1]
        return (
            f"RedisConfig(url=<{where}>, key_prefix={self.key_prefix!r}, timeout_s={self.timeout_s}, "
            f"request_budget_s={self.request_budget_s}, on_store_loss={self.on_store_loss!r})"
        )


class RedisLimitStore:
    """``LimitStore`` in Redis through leases, with a local fallback while Redis is lost (module docstring).

    Built in the lifespan on the process's ``shared`` store; ``await store.check()`` once, then
    ``run()`` as an owned task (the keeper: tops leases up, renews them, pings, brings Redis back
    after an outage); ``aclose()`` at shutdown gives every lease back (and closes the store only
    when it opened it: ``shared`` None). ``processes`` is how many gateway processes the fleet
    counts (``share`` divides the limits by it). ``flush()`` sends every tenant's pending
    reports and returns now (tests, benchmarks)."""

    def __init__(
        self,
        config: RedisConfig,
        *,
        clock: Clock | None = None,
        on_error: Callable[[str], None] = _ignore,
        on_fallback: Callable[[str], None] = _ignore,
        processes: Processes = _never_counted,
        shared: SharedStore | None = None,
    ) -> None:
        self.config = config
        self.request_budget_s = config.request_budget_s
        self.replica = uuid.uuid4().hex[:16]
        self.up = True  # optimistic until a command fails; check() at start-up tells for sure
        self._owns_shared = shared is None
        self.shared = (
            shared
            if shared is not None
            else SharedStore.open(config.url, key_prefix=config.key_prefix, timeout_s=config.timeout_s)
        )
        """Where the client, the budgets and the health are (module docstring)."""
        if self.shared.client is None:
            raise ValueError("the limit store needs a shared store with a Redis client (state.backend: redis)")
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
        self._redis: RedisClient = self.shared.client
        self._sync = self._redis.register_script(SYNC)
        self._in_use = self._redis.register_script(IN_USE)
        self._leases: dict[str, ScopeLease] = {}
        self._wake = asyncio.Event()

    def _time(self) -> float:
        return self._clock.now() if self._clock is not None else time.monotonic()

    def _now(self) -> list[str]:
        if self._clock is None:
            return ["", ""]
        sec, usec = divmod(round(self._clock.now() * 1e6), 1_000_000)
        return [str(sec), str(usec)]

    def _keys(self, scope: str, names: Iterable[str]) -> list[str]:
        """The scope's held hash and lease set, then its buckets: one hash tag, one cluster slot."""
        base = f"{self.config.key_prefix}{{{scope}}}"
        return [f"{base}:held", f"{base}:leases", *(f"{base}:{name}" for name in names)]

    def _busy(self, scope: str) -> int:
        """Slots of the scope running on the fallback's account: every sync writes them into
        Redis's count (they run), so that once Redis is back they count against the limit."""
        return self.fallback.slots_in_use(scope)

    def _bounded(self, limit_s: float | None = None) -> Budget:
        """One call to Redis, cut after ``limit_s`` of the loop's free time (by default a call off the
        request path's, ``CALL_TIMEOUTS`` times ``timeout_s``). Only around a call that reaches
        Redis: the shared store judges Redis's health by what the block ends in."""
        return self.shared.budget(self.config.timeout_s * CALL_TIMEOUTS if limit_s is None else limit_s)

    async def _call(
        self, operation: str, remote: Callable[[], Awaitable[T]], local: Callable[[], T], budget_s: float
    ) -> tuple[T, float]:
        """``remote()`` while Redis is up and within ``budget_s``, else ``local()`` (the fallback);
        with the free time spent waiting on Redis. ``remote()`` calls Redis at least once."""
        waited = 0.0
        if self.up:
            deadline = self._bounded(min(budget_s, self.config.timeout_s * CALL_TIMEOUTS))
            try:
                if budget_s <= 0:
                    raise TimeoutError("the request's budget for Redis is spent")
                async with deadline:
                    result = await remote()
                return result, deadline.free_s
            except FAILURES as exc:
                self._failed(operation, exc)
            waited = deadline.free_s
        self._on_fallback(operation)
        return local(), waited

    def _budget(self, timeout_s: float | None) -> float:
        return self.config.request_budget_s if timeout_s is None else timeout_s

    def _failed(self, operation: str, exc: BaseException) -> None:
        self._on_error(operation)
        if self.up:
            processes = self.fallback.lost()
            for lease in self._leases.values():
                lease.lost()
            log.warning(
                "Redis %r failed on %s (%s: %s): tenant limits now enforced by this process alone (%s)",
                self.config,
                operation,
                type(exc).__name__,
                exc,
                self.fallback.terms(processes),
            )
        self.up = False

    def _running(self, scope: str) -> int:
        """Requests of the scope running on a slot of this process's lease."""
        lease = self._leases.get(scope)
        return lease.slots.in_use if lease is not None and lease.slots is not None else 0

    def _lease(self, scope: str) -> ScopeLease:
        lease = self._leases.get(scope)
        if lease is None:
            lease = self._leases[scope] = ScopeLease(scope)
        return lease

    # -- one sync -----------------------------------------------------------------------------

    def _args(self, sent: Sent) -> tuple[list[str], list[str]]:
        args = [*self._now(), self.replica, repr(self.config.lease_ttl_s), repr(WANTED_S)]
        if sent.slots is None:
            args += ["", "0", "0", "0", "0", "0"]
        else:
            s = sent.slots
            args += [str(s_) for s_ in (s.limit, s.in_use, s.believed, s.keep, s.need, s.want)]
        for b in sent.buckets:
            bucket = b.bucket
            values = (bucket.capacity, bucket.refill_per_s, b.spent, b.believed, b.keep, b.adjust, b.need, b.want)
            args += [b.name, *(repr(float(v)) for v in values)]
        return self._keys(sent.scope, (b.name for b in sent.buckets)), args

    def _applied(self, lease: ScopeLease, sent: Sent, raw: list[Any]) -> Reply:
        refused, wanted, held, total, *levels = raw
        buckets = tuple((float(levels[i]), float(levels[i + 1])) for i in range(0, len(levels), 2))
        reply = Reply(int(refused), bool(int(wanted)), int(held), int(total), buckets)
        for b, (_, level) in zip(sent.buckets, buckets, strict=True):
            self.fallback.saw(sent.scope, b.name, level)
        lease.applied(sent, reply, self._time(), self.config.lease_ttl_s, self._busy(sent.scope))
        return reply

    async def _send(self, lease: ScopeLease, needs: dict[str, float] | None) -> tuple[Sent, Reply]:
        """One SYNC of ``lease`` (the caller holds its lock): one round trip."""
        sent = lease.prepare(self._time(), self._busy(lease.scope), needs)
        keys, args = self._args(sent)
        try:
            raw = await self._sync(keys=keys, args=args)
        except BaseException:
            lease.failed(sent, self._busy(lease.scope))
            raise
        return sent, self._applied(lease, sent, raw)

    async def _send_all(self, leases: list[ScopeLease]) -> None:
        """One SYNC per lease, every one in one pipeline (one round trip, bounded: ``_bounded``);
        each lease's lock is taken without waiting (a lease whose admission is asking already is
        left for the next tick). Nothing is sent, and nothing judged, when no lease is left."""
        mine = [lease for lease in leases if not lease.lock.locked()]
        if not mine:
            return
        for lease in mine:
            await lease.lock.acquire()
        try:
            now = self._time()
            batch = [(lease, lease.prepare(now, self._busy(lease.scope))) for lease in mine]
            try:
                async with self._bounded():
                    await self._pipeline(batch)
            except BaseException:
                for lease, sent in batch:
                    if sent is not None:
                        lease.failed(sent, self._busy(lease.scope))
                raise
        finally:
            for lease in mine:
                lease.lock.release()

    async def _pipeline(self, batch: list[tuple[ScopeLease, Sent]]) -> None:
        """EVALSHA alone (redis-py's script pipelining asks SCRIPT EXISTS first: a second round
        trip); the calls that found the script unknown are sent again after loading it."""
        if isinstance(self._redis, RedisCluster):  # its pipelines refuse EVALSHA: one call per tenant, at once
            raws = await asyncio.gather(*(self._sync(keys=k, args=a) for k, a in (self._args(s) for _, s in batch)))
            for (lease, sent), raw in zip(batch, raws, strict=True):
                self._applied(lease, sent, raw)
            return
        todo = batch
        for _ in range(2):
            if not todo:
                return
            async with self._redis.pipeline(transaction=False) as pipe:
                for _, sent in todo:
                    keys, args = self._args(sent)
                    pipe.evalsha(self._sync.sha, len(keys), *keys, *args)
                results = await pipe.execute(raise_on_error=False)
            again = []
            for (lease, sent), result in zip(todo, results, strict=True):
                if isinstance(result, NoScriptError):
                    again.append((lease, sent))
                elif isinstance(result, BaseException):
                    raise result
                else:
                    self._applied(lease, sent, result)
            if again:
                self._sync.sha = await self._redis.script_load(SYNC)
            todo = again
        if todo:
            raise RedisError("the sync script could not be loaded")

    # -- the LimitStore protocol ----------------------------------------------------------------

    async def admit(self, ask: Ask, *, timeout_s: float | None = None) -> LimitVerdict:
        scope = ask.scope
        lease = self._lease(scope)
        lease.fit(ask)  # while Redis is lost too: the sync after knows the limit of the fallback's slots
        if self.up:
            now = self._time()
            if not lease.shortfall(ask, now, self._busy(scope)):
                return lease.take(ask, now)

        lacking: dict[str, float] = {}

        async def remote() -> LimitVerdict:
            wanted = lacking  # the first round asks for what was found lacking under the lock
            for _ in range(ADMIT_SYNCS):
                if not wanted:
                    now = self._time()
                    wanted = lease.shortfall(ask, now, self._busy(scope))
                    if not wanted:
                        return lease.take(ask, now)
                sent, reply = await self._send(lease, wanted)
                if reply.refused:
                    return lease.refusal(ask, reply, sent, self._time())
                wanted = {}
            now = self._time()
            if not lease.shortfall(ask, now, self._busy(scope)):
                return lease.take(ask, now)
            return lease.refusal(ask, reply, sent, now)

        def local() -> LimitVerdict:
            return self.fallback.admit(ask, held=self._running(scope))

        # The wait for another admission's sync of the tenant is not the request's wait on Redis:
        # that sync is bounded by its own budget, and its grant may cover this ask: then no call,
        # and not in ``_call``, whose block must reach Redis (the shared store judges it).
        async with lease.lock:
            budget_s = self._budget(timeout_s)
            now = self._time()
            lacking = lease.shortfall(ask, now, self._busy(scope))
            if self.up and budget_s > 0 and not lacking:
                return lease.take(ask, now)
            verdict, waited = await self._call("admit", remote, local, budget_s)
        return LimitVerdict(
            verdict.admitted, verdict.refused_by, verdict.buckets, verdict.slot_at, waited, verdict.retry_after_s
        )

    async def settle(self, settlement: Settlement, *, timeout_s: float | None = None) -> float:
        """The slot goes back where it was taken: a fallback slot to the fallback, a lease slot to
        the lease; the adjustments go to the lease (Redis hears of them at the next sync). A
        small limit's lease gives back at once what another process may be waiting for."""
        scope = settlement.scope
        lease = self._leases.get(scope)
        if settlement.release_slot:
            if settlement.slot_at == "local":
                self.fallback.release(scope)
            elif lease is not None:
                lease.release()
        if not self.up:
            if settlement.release_slot or settlement.adjusts:
                self._on_fallback("settle")
                self.fallback.settle(Settlement(scope=scope, adjusts=settlement.adjusts))
            return 0.0
        if settlement.adjusts:
            lease = self._lease(scope)
            for adjust in settlement.adjusts:
                lease.bucket(adjust.bucket).give_back(adjust.amount)
        if lease is None or not lease.exact_return_due(self._busy(scope)):
            return 0.0
        if lease.lock.locked():  # a sync of the tenant is on its way: the keeper returns it right after
            self.wake()
            return 0.0

        async def remote() -> None:
            await self._send(lease, None)

        def local() -> None:
            return None

        async with lease.lock:
            _, waited = await self._call("settle", remote, local, self._budget(timeout_s))
        return waited

    async def slots_in_use(self, scope: str) -> int:
        """Slots held fleet-wide (running, and spare in some process's lease)."""

        async def remote() -> int:
            return int(await self._in_use(keys=self._keys(scope, ()), args=self._now()))

        def local() -> int:
            return self._running(scope) + self.fallback.slots_in_use(scope)

        used, _ = await self._call("slots_in_use", remote, local, math.inf)
        return used

    # -- the keeper -----------------------------------------------------------------------------

    async def flush(self, *, every: bool = True) -> None:
        """Sync every lease holding anything (``every``: the renewal), or only those the keeper
        finds due (under the watermark, over twice the target, a small limit's return): one pipeline."""
        now = self._time()
        renew_before = now + self.config.lease_ttl_s - 2 * self.config.ping_interval_s
        leases = []
        for scope, lease in list(self._leases.items()):
            if lease.idle(now, IDLE_S):
                del self._leases[scope]
            elif lease.pending() and (every or lease.due(now, self._busy(scope), renew_before)):
                leases.append(lease)
        if leases:
            await self._send_all(leases)
        elif every:
            async with self._bounded():
                await self._redis.ping()

    async def check(self) -> bool:
        """Ping Redis (syncing every lease on the way: renewal, reports); sets and returns ``up``.

        A Redis that is down comes back only when a ping answers within ``probe_max_s`` (of
        free time) and what was admitted locally meanwhile is charged to it. One that answers,
        but slower than a request may wait for it, stays out like one that does not. A Redis
        that is up is taken out by a failed ping, not by a slow one: requests find out for
        themselves (their budget)."""
        try:
            if not self.up:
                # Idle connections from before the outage may be dead (a partition sends no FIN).
                if isinstance(self._redis, aioredis.Redis):  # a cluster client reconnects per node itself
                    await self._redis.connection_pool.disconnect(inuse_connections=False)
                async with self._bounded() as ping:
                    await self._redis.ping()
                took = ping.free_s
                if took > self.config.probe_max_s:
                    raise TimeoutError(f"a ping took {took * 1000:.1f} ms, over {self.config.probe_max_s * 1000:g} ms")
                if not await self._reconcile():
                    return False
            await self.flush()
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
            leases = []
            for scope, adjusts in debts.items():
                lease = self._lease(scope)
                for adjust in adjusts:
                    lease.bucket(adjust.bucket).adjust += adjust.amount
                leases.append(lease)
            try:
                await self._send_all(leases)
            except BaseException:
                for lease in leases:  # not charged: the fallback still owes it
                    for adjust in debts[lease.scope]:
                        lease.bucket(adjust.bucket).adjust -= adjust.amount
                raise
            for scope, adjusts in debts.items():
                self.fallback.paid(scope, adjusts)
        return False

    def wake(self) -> None:
        """Ask the keeper for a tick now (a small limit's return, say)."""
        self._wake.set()

    async def run(self) -> None:
        """The keeper, until cancelled (the gateway owns the task): every ``sync_interval_s`` the
        leases that are due, every ``ping_interval_s`` all of them (renewal) or a ping."""
        loop = asyncio.get_running_loop()
        next_ping = loop.time() + self.config.ping_interval_s
        while True:
            try:
                async with asyncio.timeout(self.config.sync_interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            if loop.time() >= next_ping or not self.up:
                if not self.up and loop.time() < next_ping:
                    continue
                next_ping = loop.time() + self.config.ping_interval_s
                await self.check()
                continue
            try:
                await self.flush(every=False)
            except FAILURES as exc:
                self._failed("sync", exc)

    async def aclose(self) -> None:
        """Give back every lease (best effort); close the shared store only if this store opened it
        (the process's is closed by its owner, after every user: ``gateway/service.py``)."""
        if self.up and self._leases:
            for lease in self._leases.values():
                lease.lost()  # keep only what runs: the rest goes back
            try:
                await self._send_all(list(self._leases.values()))
            except FAILURES:
                log.info("leases not given back at shutdown; they expire in %ss", self.config.lease_ttl_s)
        if self._owns_shared:
            await self.shared.aclose()


__all__ = ["Adjust", "RedisConfig", "RedisLimitStore"]
