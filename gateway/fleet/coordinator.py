"""Keeps this process's part of every backend's capacity in step with the fleet (``ledger.py``).

Three ways a process gets its parts (``quota.py`` states the rule for each):

* ``FleetCoordinator``, when the policy shares state through Redis: every
  ``fleet.sync_interval_s``, and at once when a request has to wait for lack of this process's
  part or when this process frees room another process waits for, it reports each backend's use
  and waiting demand to the ledger and applies what it may hold. No request ever waits on
  Redis: dispatch reads the parts in memory. A sync that fails or is slower than
  ``fleet.timeout_ms`` puts every backend on its fallback part until one succeeds.
* ``partition_quotas``, for ``--workers N`` without a shared store: a fixed ``1/N`` each.
* neither, for one process alone: the whole capacity (``quota`` None).

After each change the dispatcher hands freed room to waiting requests (``on_change``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections import deque
from collections.abc import Callable

from redis.exceptions import RedisError

from gateway.backends import BackendPool
from gateway.clock import Clock
from gateway.dispatch import Dispatcher
from gateway.fleet.ledger import BackendReport, FleetLedger, Sync
from gateway.fleet.quota import EMPTY, Quota, Share, at_most, fallback, paced, partition, shared
from gateway.policy.snapshot import PolicySnapshot
from gateway.telemetry import Metrics

log = logging.getLogger(__name__)

FAILURES = (RedisError, OSError, TimeoutError)
RATE_WINDOW_S = 10.0
"""The window of the dispatch rate each process reports (the same as a queue's ``DrainMeter``)."""


def replica_id() -> str:
    """This process's name in the ledger: host, pid and a random part (a restarted pid is another process)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"


def partition_quotas(pool: BackendPool, snapshot: PolicySnapshot, workers: int) -> None:
    """``--workers N`` without a shared store: each worker takes ``1/N`` of every backend."""
    classes = snapshot.policy.classes
    for state in pool.all():
        state.quota = None if workers <= 1 else partition(state.backend.capacity, classes, workers)


class FleetCoordinator:
    """Syncs this process with the ledger (module docstring); ``run`` is its background loop."""

    def __init__(
        self,
        ledger: FleetLedger,
        pool: BackendPool,
        dispatcher: Dispatcher,
        policy: Callable[[], PolicySnapshot],
        clock: Clock,
        metrics: Metrics,
    ) -> None:
        self.ledger = ledger
        self.pool = pool
        self.dispatcher = dispatcher
        self.policy = policy
        self.clock = clock
        self.metrics = metrics
        self.live = 0
        """Processes seen in the last successful sync (0: none yet)."""
        self.up = False
        self._down_logged = False
        self._frozen: dict[str, Quota] = {}
        self._recovering_until = 0.0
        self._wake = asyncio.Event()
        self._sent: dict[str, deque[tuple[float, int]]] = {}
        """Each backend's ``dispatched`` count at recent syncs, for this process's rate."""

    def wake(self) -> None:
        """Sync as soon as the loop can: a request waits for this process's part, or this process
        freed room that another waits for."""
        self._wake.set()

    async def run(self) -> None:
        """Sync every ``fleet.sync_interval_s``, or sooner when woken (never twice within a fifth of it)."""
        while True:
            interval = self.policy().policy.fleet.sync_interval_s
            started = self.clock.now()
            await self.sync_once()
            rest = interval / 5 - (self.clock.now() - started)
            if rest > 0:
                await asyncio.sleep(rest)
            try:
                async with asyncio.timeout(max(interval - interval / 5, 0.0)):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def sync_once(self) -> None:
        """One sync: report, apply the grants (or the fallback parts), hand out freed room."""
        snapshot = self.policy()
        fleet = snapshot.policy.fleet
        reports = self._reports(snapshot)
        self.ledger.lease_ttl_s = fleet.entry_ttl_s
        try:
            async with asyncio.timeout(fleet.timeout_ms / 1000):
                answer = await self.ledger.sync(reports)
        except FAILURES as exc:
            self._fall_back(snapshot, exc)
        else:
            self._apply(answer)
        self.dispatcher.hand_out_all()

    def _reports(self, snapshot: PolicySnapshot) -> list[BackendReport]:
        classes = snapshot.policy.classes
        bounds = paced(classes)
        waiting = self.dispatcher.waiting()
        now = self.clock.now()
        return [
            BackendReport(
                name=state.name,
                max_requests=state.backend.capacity.max_concurrent,
                max_tokens=state.backend.capacity.max_tokens_in_flight,
                max_prefills=bounds,
                max_shares=shared(state.backend.capacity, classes),
                requests=state.in_flight,
                tokens=state.in_flight_tokens,
                prefilling={rank: n for rank, n in state.class_prefilling.items() if n},
                class_use={
                    rank: Share(count, state.class_tokens.get(rank, 0)) for rank, count in state.class_in_flight.items()
                },
                waiting=waiting.get(state.name, EMPTY_WAITING),
                rate=self._rate(state.name, state.dispatched, now),
            )
            for state in self.pool.all()
        ]

    def _apply(self, answer: Sync) -> None:
        now = self.clock.now()
        if not self.up:
            log.warning("fleet: capacity shared with %d live process(es) through the ledger", answer.live)
            if self._frozen:  # back from an outage: grants within the frozen parts for one lease
                self._recovering_until = now + self.policy().policy.fleet.lease_ttl_s
        self.up, self.live, self._down_logged = True, answer.live, False
        recovering = now < self._recovering_until
        if not recovering:
            self._frozen = {}
        self.metrics.child(self.metrics.fleet_syncs, "ok").inc()
        self.metrics.fleet_processes.set(answer.live)
        for state in self.pool.all():
            grant = answer.grants.get(state.name)
            if grant is None:
                continue
            capacity = state.backend.capacity
            whole = grant.tokens >= capacity.max_tokens_in_flight and grant.requests >= capacity.max_concurrent
            quota = Quota(grant.requests, grant.tokens, grant.prefills, grant.shares, whole=whole)
            frozen = self._frozen.get(state.name) if recovering else None
            state.quota = quota if frozen is None else at_most(quota, frozen)
            state.others_waiting = grant.others_waiting
            state.others_prefilling = grant.others_prefilling
            state.others_rate = grant.others_rate
            state.others_in_flight = grant.others_requests
            state.others_in_flight_tokens = grant.others_tokens

    def _fall_back(self, snapshot: PolicySnapshot, error: BaseException) -> None:
        """The ledger is out of reach: every backend on its fallback part (``quota.fallback``)."""
        if self.up or not self.live:
            log.warning(
                "fleet: the ledger is unreachable (%s); each backend on its fallback share", type(error).__name__
            )
        self.up = False
        self.metrics.child(self.metrics.fleet_syncs, "failed").inc()
        unknown = snapshot.policy.fleet.processes_when_unknown
        classes = snapshot.policy.classes
        for state in self.pool.all():
            state.quota = fallback(state.quota, state.backend.capacity, classes, unknown)
            self._frozen[state.name] = state.quota
            state.others_waiting = EMPTY
            state.others_prefilling = EMPTY
            state.others_rate = 0.0
            state.others_in_flight = state.others_in_flight_tokens = 0

    def _rate(self, backend: str, dispatched: int, now: float) -> float:
        """Requests per second this process sent to ``backend`` over the last ``RATE_WINDOW_S``."""
        samples = self._sent.setdefault(backend, deque())
        samples.append((now, dispatched))
        while len(samples) > 2 and samples[1][0] <= now - RATE_WINDOW_S:
            samples.popleft()
        first_at, first = samples[0]
        return (dispatched - first) / (now - first_at) if now > first_at else 0.0

    def adopt(self, snapshot: PolicySnapshot) -> None:
        """Backends a reload added start on their fallback part until the next sync, never on
        the whole capacity (other processes may be using it)."""
        unknown = snapshot.policy.fleet.processes_when_unknown
        for state in self.pool.all():
            if state.quota is None:
                state.quota = fallback(None, state.backend.capacity, snapshot.policy.classes, unknown)


EMPTY_WAITING: dict[int, tuple[int, int]] = {}
