"""The fleet's prefix view: each process's routing decisions folded into every other's index.

Prefix-affinity routing scores a backend by the prompt blocks it served lately
(``gateway/routing/prefix_index.py``). With several processes, each one alone sees only the
requests it routed: spread at random over three replicas, a conversation's next turn lands
on a replica that never saw its previous turns and goes wherever load says, and the cached
prefix is recomputed elsewhere. So every process publishes its decisions and folds in the
others':

* **Publish** (hot path, no I/O): ``routed`` (the dispatcher's observer call) appends ``(model, backend, blocks)`` to an
  in-memory batch; at most ``MAX_PENDING`` wait (past it the oldest are dropped and counted:
  a lost decision only costs a cache hit).
* **Exchange** (background, every ``fleet.prefix_flush_s``, 50 ms by default): one pipelined
  round trip writes the batch to one Redis stream as one entry (``prefix_wire.py``), trimmed
  to about ``fleet.prefix_history`` entries, and reads the entries written since the last
  read; each of the others' decisions goes into this process's index of that backend through
  the model's router (``PrefixLearner``), stamped with the time it was made (the entry id's
  milliseconds, on Redis's clock), so that the TTL and LRU order match the publisher's.
  Decisions about a backend this process has marked down, or of a model it does not route
  by prefix, are skipped. Polling rather than a blocking read: a blocking reader would wake
  for every flush of every replica, its own included; polling costs one round trip per
  interval whatever the fleet's size. The stream expires one index TTL after the last flush.
* **Corrections**: when an answer shows an engine holding less of a prompt than this process's
  index predicted (``gateway/dispatch/cache_report.py``), the router forgets what it sent that
  engine no later than the missing block (``on_answer``), and ``cache_missed`` queues the same
  correction for the others: the next entry carries the backend and how long ago that block was
  sent, and each reader forgets what it knows of that engine from before then (the engine is one,
  and every replica's index believed the same).
* **Catch up** (start-up): a new process reads what the stream holds of the last
  ``routing.index.ttl_s`` before it serves, so a replica added under load starts with the
  fleet's view.

No request ever waits on Redis: routing reads the in-memory index, which is at most two
intervals behind the fleet. Every call is bounded by ``fleet.timeout_ms`` (the ledger's budget:
both run off the request path, at the fleet's pace) in the event loop's free time
(``SharedStore.budget``, ``gateway/shared/store.py``: a busy process has not found Redis slow).
When Redis is unreachable or slower than that, each process routes on what it has seen (its own
decisions keep going in), drops its batches (counted) and tries again every second; nothing else
depends on it.

Tenant isolation is untouched: the hashes are those of ``prefix_keys``, seeded with a root of
the tenant's cache scope, so a decision can only ever match a request of the same scope. Only
processes with the same cache-salt secret share a stream (its key carries a digest of the
secret): with another secret, a tenant's blocks are another entry in the engines' caches, and
other chains (the secret keys their roots). The blocks are sealed with that secret
(``prefix_wire.py``): whoever reads the stream without it learns model and backend names and
prompt sizes, never a hash to check a guessed prompt against.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from gateway.clock import Clock
from gateway.dispatch.backends import BackendPool
from gateway.dispatch.cache_report import CacheReport
from gateway.dispatch.observers import DispatchObserver
from gateway.dispatch.router import Router, RoutingDecision
from gateway.fleet.prefix_wire import (
    Correction,
    Decision,
    MalformedEntry,
    decode,
    decode_corrections,
    decode_span,
    encode,
    origin_of,
)
from gateway.policy.model import Policy
from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.base import PrefixLearner
from gateway.routing.prefix_secret import PrefixSecret
from gateway.shared.connect import RedisClient
from gateway.shared.store import FAILURES, SharedStore
from gateway.telemetry.metrics import Metrics
from gateway.types import InferenceRequest

log = logging.getLogger(__name__)

MAX_PENDING = 20_000
"""Decisions waiting for the next flush, at most (about 0.2 s at 100,000 requests/s)."""
MAX_CORRECTIONS = 1_000
"""Corrections waiting for the next flush, at most (the oldest dropped: a later one says more)."""
READ_COUNT = 512
RETRY_S = 1.0
CATCH_UP_S = 2.0
"""What start-up waits for the catch-up at most, in all (each read has its own budget as well);
the reader goes on from where it stopped."""


def prefix_view_key(policy: Policy, secret_digest: str) -> str:
    """The stream of ``policy``'s cell for replicas sharing the secret whose digest is given.

    One stream per cell: the replicas of a cell front its engines, and a decision about another
    cell's engines is of no use to them. No hash tag: the whole key picks its cluster slot, so a
    cell's stream and its ledger (``{fleet:<cell>}``) may land on different shards."""
    cell = policy.fleet.cell
    where = f"fleet:{cell}:prefix-view" if cell else "fleet:prefix-view"
    return f"{policy.state.key_prefix}{where}:{secret_digest}"


class PrefixSync(DispatchObserver):
    """Publishes this process's routing decisions and folds in the others' (module docstring)."""

    def __init__(
        self,
        client: RedisClient,
        *,
        key: str,
        origin: str,
        routers: Callable[[], Mapping[str, Router]],
        secret: PrefixSecret,
        pool: BackendPool,
        policy: Callable[[], PolicySnapshot],
        clock: Clock,
        metrics: Metrics,
    ) -> None:
        self.client = client
        self.store = SharedStore.of(client)
        """Bounds every call and hears how it ended (``gateway/shared/store.py``)."""
        self.key = key
        self.origin = origin
        self.routers = routers
        self.secret = secret
        """Seals and opens the entries: the cache-salt secret's, as the stream's key is."""
        self.pool = pool
        self.policy = policy
        self.clock = clock
        self.metrics = metrics
        self._pending: deque[Decision] = deque()
        self._oldest = 0.0
        """When the oldest pending decision was made (this process's clock)."""
        self._corrections: deque[tuple[str, str, float]] = deque(maxlen=MAX_CORRECTIONS)
        """(model, backend, when the evicted block was last sent, on this process's clock)."""
        self._cursor: str | None = None
        """The last entry read; None until the first read places it (``_start_cursor``)."""
        self._redis_ahead_ms = 0.0
        """Redis's clock minus this process's wall clock, in ms (entry ids are Redis's ms)."""
        self._last_stamp = float("-inf")
        self._down = False
        self._expire_due = float("-inf")
        self._published = metrics.child(metrics.fleet_prefix_decisions, "published")
        self._received = metrics.child(metrics.fleet_prefix_decisions, "received")
        self._dropped = metrics.child(metrics.fleet_prefix_decisions, "dropped")
        self._corrected = metrics.child(metrics.fleet_prefix_decisions, "correction_received")

    def routed(self, request: InferenceRequest, decision: RoutingDecision) -> None:
        """The dispatcher acted on a decision (``DispatchObserver``, once per dispatch): queue it for
        the next flush."""
        keys = request.prefix_keys
        if keys is None or not keys.blocks:
            return
        pending = self._pending
        if not pending:
            self._oldest = self.clock.now()
        pending.append(Decision(request.model, decision.state.name, keys.blocks))
        if len(pending) > MAX_PENDING:
            pending.popleft()
            self._dropped.inc()

    def cache_missed(self, request: InferenceRequest, decision: RoutingDecision, report: CacheReport) -> None:
        """An engine held less than predicted (``DispatchObserver``; this process's router has
        forgotten already): queue the correction for the others."""
        if decision.matched_at is not None and self._closed_loop(request.model):
            self._corrections.append((request.model, decision.state.name, decision.matched_at))

    def _closed_loop(self, model: str) -> bool:
        """Whether ``model``'s index is corrected from the engines' answers (``routing.index.closed_loop``)."""
        policy = self.policy().models.get(model)
        return policy is not None and policy.routing.index.closed_loop

    async def catch_up(self) -> None:
        """Fold the decisions of the last index TTL (start-up, before serving), for ``CATCH_UP_S``
        at most; the reader goes on from where this stopped, or starts it if Redis is away."""
        whole = asyncio.timeout(CATCH_UP_S)
        try:
            async with whole:
                while await self._read_once() == READ_COUNT:
                    pass
        except FAILURES as exc:
            if whole.expired():
                log.warning("fleet prefix view: catch-up unfinished after %.0f s; the reader goes on", CATCH_UP_S)
            else:
                self._note_down(exc)

    async def run(self) -> None:
        """Every ``fleet.prefix_flush_s``: publish the pending decisions and fold the others' in one
        round trip (``exchange``); every ``RETRY_S`` while Redis is away."""
        while True:
            await asyncio.sleep(RETRY_S if self._down else self.policy().policy.fleet.prefix_flush_s)
            await self.exchange()

    async def exchange(self) -> None:
        """One round trip: the batch of decisions out (with the stream's expiry, now and then),
        the entries after the cursor in; more reads while a read comes back full."""
        batch = list(self._pending)
        self._pending.clear()
        now = self.clock.now()
        span_s = max(0.0, now - self._oldest) if batch else 0.0
        corrections = [Correction(model, backend, max(0.0, now - at)) for model, backend, at in self._corrections]
        self._corrections.clear()
        fleet = self.policy().policy.fleet
        try:
            async with self.store.budget(fleet.timeout_ms / 1000):
                if self._cursor is None:
                    await self._start_cursor()
                async with self.client.pipeline(transaction=False) as pipe:
                    if batch or corrections:
                        fields: dict[Any, Any] = encode(self.origin, batch, self.secret, corrections, span_s)
                        pipe.xadd(self.key, fields, maxlen=fleet.prefix_history, approximate=True)
                        now = self.clock.now()
                        if now >= self._expire_due:  # the stream is gone an index TTL after the fleet
                            ttl_s = max(self._ttl_s(), 1.0)
                            pipe.pexpire(self.key, int(ttl_s * 1000))
                            self._expire_due = now + ttl_s / 10
                    pipe.xread({self.key: self._cursor or "$"}, count=READ_COUNT)
                    answers = await pipe.execute()
        except FAILURES as exc:
            self._dropped.inc(len(batch))
            self._note_down(exc)
            return
        self._published.inc(len(batch))
        self._note_up()
        read = self._fold_answer(answers[-1])
        try:
            while read == READ_COUNT:
                read = await self._read_once()
        except FAILURES as exc:
            self._note_down(exc)

    async def _read_once(self) -> int:
        """Read and fold one batch of entries after the cursor (bounded as ``exchange`` is); how
        many entries there were."""
        async with self.store.budget(self.policy().policy.fleet.timeout_ms / 1000):
            if self._cursor is None:
                await self._start_cursor()
            answer = await self.client.xread({self.key: self._cursor or "$"}, count=READ_COUNT)
        return self._fold_answer(answer)

    def _fold_answer(self, answer: Any) -> int:
        if not answer:
            return 0
        entries = answer[0][1]
        for entry_id, fields in entries:
            self._cursor = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            if origin_of(fields) != self.origin:
                self._fold(self._cursor, fields)
        return len(entries)

    async def _start_cursor(self) -> None:
        """Start at the entries of the last index TTL, on Redis's clock (entry ids are its ms)."""
        seconds, micros = await self.client.time()
        now_ms = seconds * 1000 + micros / 1000
        self._redis_ahead_ms = now_ms - time.time() * 1000
        self._cursor = f"{int(now_ms - max(self._ttl_s(), 1.0) * 1000)}-0"

    def _fold(self, entry_id: str, fields: Mapping[bytes, bytes]) -> None:
        try:
            decisions = decode(fields, self.secret)
            corrections = decode_corrections(fields)
            span_s = decode_span(fields)
        except MalformedEntry as exc:
            log.warning("fleet prefix view: skipped entry %s: %s", entry_id, exc)
            return
        routers = self.routers()
        made = self._made(entry_id)
        at = self._stamp(made - span_s)
        for decision in decisions:
            router = routers.get(decision.model)
            state = self.pool.named(decision.backend)
            if isinstance(router, PrefixLearner) and state is not None and state.healthy:
                router.learn(state, decision.blocks, at)
                self._received.inc()
        for correction in corrections:
            router = routers.get(correction.model)
            state = self.pool.named(correction.backend)
            if isinstance(router, PrefixLearner) and state is not None and self._closed_loop(correction.model):
                router.forget_before(state, made - correction.age_s)
                self._corrected.inc()

    def _made(self, entry_id: str) -> float:
        """When the entry was written, on this process's clock (its id is Redis's ms)."""
        made_ms = float(entry_id.partition("-")[0])
        return self.clock.now() - max(0.0, (time.time() * 1000 + self._redis_ahead_ms - made_ms) / 1000)

    def _stamp(self, at: float) -> float:
        """The time an entry's decisions are indexed at: ``at``, the entry's time less the span of its
        batch (so no decision is stamped later than it was made, and a correction, which forgets what
        was sent no later than a time, reaches every decision of a batch made before that time),
        never later than now, never earlier than the last stamp (the index's LRU order stays the
        order of its times)."""
        stamp = min(self.clock.now(), max(at, self._last_stamp))
        self._last_stamp = stamp
        return stamp

    def _ttl_s(self) -> float:
        snapshot = self.policy()
        return max((model.routing.index.ttl_s for model in snapshot.models.values()), default=0.0)

    def _note_down(self, error: BaseException) -> None:
        if not self._down:
            log.warning("fleet prefix view: Redis unreachable (%s); routing on this process's view", error)
        self._down = True

    def _note_up(self) -> None:
        if self._down:
            log.warning("fleet prefix view: Redis reachable again; folding the fleet's decisions")
        self._down = False
