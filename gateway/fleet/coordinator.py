"""Keeps this process's part of every backend's capacity in step with the fleet (``ledger.py``).

Three ways a process gets its parts (``quota.py`` states the rule for each):

* ``FleetCoordinator``, when the policy shares state through Redis: every
  ``fleet.sync_interval_s``, and soon (coalesced: ``run``) when a request has to wait for lack of
  this process's part or when this process frees room another process waits for, it reports
  each backend's use, waiting demand, its busiest tenants' use and demand, and the part it
  enforces to the ledger, and applies what it may hold. No request ever waits on Redis:
  dispatch reads the parts in memory.
* ``partition_quotas``, for ``--workers N`` without a shared store: a fixed ``1/N`` each.
* neither, for one process alone: the whole capacity (``quota`` None).

The coordinator's side of the ledger's invariant (``ledger.py``, rules 1, 3 and 4):

* **A grant lapses, counted from when the sync was sent**, not from when its answer arrived:
  ``Quota.until = sent + (entry_ttl + outage_s) x (1 - MAX_CLOCK_DRIFT)``. The ledger's lease
  starts when its script runs, later, on Redis's clock; the two clocks may run at rates that
  differ by ``MAX_CLOCK_DRIFT`` at most (NTP bounds a disciplined clock's slew to 500 ppm). So
  this process stops starting requests before the ledger's count of it could end (the ledger
  keeps it ``drain_s`` past its lease: ``outage_s`` and the longest deadline). A sync that
  fails changes nothing: through a Redis outage the last grant holds for ``outage_s``, then
  lapses by itself.
* **Nothing before the first grant** (``PENDING``), unless the policy bounds how many
  processes run without the ledger (``fleet.processes_when_unknown``).
* **Dead neighbours are reaped**: the ledger names its tombstones; one whose process ran on this
  host, in this process's pid namespace, and has exited is named in the next sync, and its part
  is free at once instead of after the drain (``replica_id`` carries what that check needs).
* **A ledger that lost its keys** (a new epoch) knows nothing of what the others may still be
  using; for ``drain_s`` this process keeps within the part it had (``at_most``).
* **Leaving**: on a graceful exit, once nothing is in flight, ``leave`` frees the part at once.

After each change the dispatcher hands freed room to waiting requests (``Demand.hand_out_all``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from gateway.clock import Clock
from gateway.dispatch.backends import BackendPool, BackendState
from gateway.dispatch.observers import DispatchObserver
from gateway.dispatch.queueing import IDLE_GAP_S
from gateway.dispatch.quota import EMPTY, Quota, Share, TenantUse
from gateway.fleet.ledger import BackendReport, FleetLedger, Sync
from gateway.fleet.quota import at_most, fallback, paced, partition, shared
from gateway.policy.snapshot import PolicySnapshot
from gateway.shared.store import FAILURES, Budget
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0
"""The window of the dispatch rate each process reports (the same as a queue's ``DrainMeter``)."""
WAKE_SPACING = 0.5
"""The least time between two syncs, as a fraction of ``fleet.sync_interval_s`` (bounds syncs a second)."""
MAX_CLOCK_DRIFT = 5e-4
"""How much faster one clock may run than another (NTP's maximum slew, 500 ppm)."""


class Demand(Protocol):
    """What the coordinator reads of the dispatcher (what waits, by class; each tenant's use and
    demand), what it tells it (who waits elsewhere, by tenant), and the one thing it asks of it."""

    def waiting(self) -> Mapping[str, Mapping[int, tuple[int, int]]]: ...

    def tenants(self) -> Mapping[str, Sequence[TenantUse]]: ...

    def heard(self, backend: str, others: Mapping[int, Mapping[str, tuple[float, int]]]) -> None: ...

    def hand_out_all(self) -> None: ...


def replica_id() -> str:
    """This process's name in the ledger: ``host:pidns:pid:start:random``. The pid namespace and
    the process's start time (``/proc/self/stat``) let a process of the same host tell whether
    this one is still running (``exited``); the random part makes a restarted pid another process."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{_pid_namespace()}:{pid}:{_start_time(pid)}:{os.urandom(4).hex()}"


def exited(replica: str, host: str | None = None, namespace: str | None = None) -> bool:
    """Whether ``replica`` (an id of ``replica_id``) names a process of this host and pid namespace
    that is not running any more. Another host's, or another namespace's, is never judged."""
    parts = replica.split(":")
    if len(parts) != 5:
        return False
    name, space, pid, start, _ = parts
    if name != (host or socket.gethostname()) or space != (namespace or _pid_namespace()) or not pid.isdigit():
        return False
    return _start_time(int(pid)) != start


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return "-"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22); '' when
    it is gone, or a zombie (it has exited, its parent has not collected it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return ""
    return "" if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def partition_quotas(pool: BackendPool, snapshot: PolicySnapshot, workers: int) -> None:
    """``--workers N`` without a shared store: each worker takes ``1/N`` of every backend."""
    classes = snapshot.policy.classes
    for state in pool.all():
        state.quota = None if workers <= 1 else partition(state.backend.capacity, classes, workers)


class FleetCoordinator(DispatchObserver):
    """Syncs this process with the ledger (module docstring); ``run`` is its background loop.

    A sync is three steps, apart so that tests can interleave them with requests: ``reports``
    (what is sent, and when), the ledger's script, then ``apply`` or ``fall_back``."""

    def __init__(
        self,
        ledger: FleetLedger,
        pool: BackendPool,
        demand: Demand,
        policy: Callable[[], PolicySnapshot],
        clock: Clock,
        metrics: Metrics,
        exited: Callable[[str], bool] = exited,
    ) -> None:
        self.ledger = ledger
        self.pool = pool
        self.demand = demand
        self.policy = policy
        self.clock = clock
        self.metrics = metrics
        self.exited = exited
        self.live = 0
        """Processes seen in the last successful sync (0: none yet)."""
        self.up = False
        self.epoch = ""
        self._down_logged = False
        self._frozen: dict[str, Quota] = {}
        self._recovering_until = 0.0
        self._reap: tuple[str, ...] = ()
        self._wake = asyncio.Event()
        self._sent: dict[str, deque[tuple[float, int]]] = {}
        self._last_sent: dict[str, float] = {}  # when each backend's count last moved
        """Each backend's ``dispatched`` count at recent syncs, for this process's rate."""

    def wake(self) -> None:
        """Sync as soon as the loop can: a request waits for this process's part, or this process
        freed room that another waits for."""
        self._wake.set()

    def demand_changed(self) -> None:
        """The dispatcher queued a request, or freed room another process waits for (``DispatchObserver``)."""
        self.wake()

    async def run(self) -> None:
        """Sync every ``fleet.sync_interval_s``, or sooner when woken: wakes coalesce (one loop, so
        at most one sync in flight, and never two within ``WAKE_SPACING`` of the interval). A process
        therefore makes ``1 / sync_interval_s`` syncs a second when nothing waits (20 at the default
        0.05 s) and at most ``1 / (WAKE_SPACING x sync_interval_s)`` under a flood (40), whatever
        its request rate: 0.02 round trips per request at 2,000 requests a second."""
        while True:
            interval = self.policy().policy.fleet.sync_interval_s
            started = self.clock.now()
            await self.sync_once()
            rest = interval * WAKE_SPACING - (self.clock.now() - started)
            if rest > 0:
                await asyncio.sleep(rest)
            try:
                async with asyncio.timeout(max(interval - interval * WAKE_SPACING, 0.0)):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def sync_once(self) -> None:
        """One sync: report, apply the grants (or fall back), hand out freed room."""
        snapshot = self.policy()
        reports, sent = self.reports(snapshot)
        try:
            async with self._budget(snapshot):
                answer = await self.ledger.sync(reports, self._reap)
        except FAILURES as exc:
            self.fall_back(snapshot, exc)
        else:
            self.apply(answer, sent)
        self.demand.hand_out_all()

    def reports(self, snapshot: PolicySnapshot) -> tuple[list[BackendReport], float]:
        """What this process tells the ledger, and when (its next grant's lease runs from then)."""
        policy = snapshot.policy
        self.ledger.lease_ttl_s = policy.fleet.entry_ttl_s
        self.ledger.drain_s = policy.fleet_drain_s
        classes = policy.classes
        bounds = paced(classes)
        waiting = self.demand.waiting()
        tenants = self.demand.tenants()
        now = self.clock.now()
        reports = [
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
                rate=self._rate(state.name, state.dispatched, now, bool(waiting.get(state.name))),
                applied=state.quota,
                tenants=tenants.get(state.name, ()),
            )
            for state in self.pool.all()
        ]
        return reports, now

    def apply(self, answer: Sync, sent: float) -> None:
        """The ledger's answer to a sync sent at ``sent``: every backend's new part, until its lease ends."""
        now = self.clock.now()
        policy = self.policy().policy
        if not self.up:
            log.warning("fleet: capacity shared with %d live process(es) through the ledger", answer.live)
        if self.epoch and answer.epoch != self.epoch:
            log.warning("fleet: the ledger lost its state (a new epoch); each part kept as it was for the drain")
            self._frozen = {state.name: state.quota for state in self.pool.all() if state.quota is not None}
            self._recovering_until = now + policy.fleet_drain_s
        self.epoch = answer.epoch
        self.up, self.live, self._down_logged = True, answer.live, False
        if now >= self._recovering_until:
            self._frozen = {}
        until = sent + (policy.fleet.entry_ttl_s + policy.fleet.outage_s) * (1 - MAX_CLOCK_DRIFT)
        self._reap = tuple(replica for replica in answer.tombstones if self.exited(replica))
        self.metrics.child(self.metrics.fleet_syncs, "ok").inc()
        self.metrics.fleet_processes.set(answer.live)
        for state in self.pool.all():
            grant = answer.grants.get(state.name)
            if grant is None:
                continue
            capacity = state.backend.capacity
            whole = grant.tokens >= capacity.max_tokens_in_flight and grant.requests >= capacity.max_concurrent
            quota = Quota(grant.requests, grant.tokens, grant.prefills, grant.shares, whole=whole, until=until)
            frozen = self._frozen.get(state.name)
            before, state.quota = state.quota, quota if frozen is None else at_most(quota, frozen)
            if before is not None and _shrunk(state.quota, before):
                self.wake()  # the ledger counts the larger part until this process says it applied the smaller
            state.others_waiting = grant.others_waiting
            state.others_prefilling = grant.others_prefilling
            state.others_rate = grant.others_rate
            state.others_in_flight = grant.others_requests
            state.others_in_flight_tokens = grant.others_tokens
            self.demand.heard(state.name, grant.others_tenants)

    def fall_back(self, snapshot: PolicySnapshot, error: BaseException) -> None:
        """The ledger is out of reach: every part stays as it is and lapses at its lease's end
        (``quota.fallback``); the others' waiting and load are no longer known."""
        if self.up or not self._down_logged:
            log.warning(
                "fleet: the ledger is unreachable (%s); each part lapses at its lease's end", type(error).__name__
            )
            self._down_logged = True
        self.up = False
        self.metrics.child(self.metrics.fleet_syncs, "failed").inc()
        unknown = snapshot.policy.fleet.processes_when_unknown
        classes = snapshot.policy.classes
        for state in self.pool.all():
            state.quota = fallback(state.quota, state.backend.capacity, classes, unknown)
            state.others_waiting = EMPTY
            state.others_prefilling = EMPTY
            state.others_rate = 0.0
            state.others_in_flight = state.others_in_flight_tokens = 0
            self.demand.heard(state.name, {})

    async def leave(self) -> None:
        """A graceful exit, nothing in flight: out of the ledger at once (best effort; else the drain)."""
        try:
            async with self._budget(self.policy()):
                await self.ledger.leave()
        except FAILURES as exc:
            log.info("fleet: could not leave the ledger (%s); the part is freed after the drain", type(exc).__name__)

    def _budget(self, snapshot: PolicySnapshot) -> Budget:
        """One call to the ledger, bounded by ``fleet.timeout_ms`` in the event loop's free time (a
        busy loop is not a slow Redis: ``SharedStore.budget``), read at each call (a reload may
        change it). Longer than the store's default (``state.timeout_ms``): the sync's script reads
        every process's entry of the backends it reports, so it costs more as the fleet grows
        (``deploy/README.md``, "Redis for many replicas"), and it runs off every request's path."""
        return self.ledger.store.budget(snapshot.policy.fleet.timeout_ms / 1000)

    def _rate(self, backend: str, dispatched: int, now: float, backlogged: bool) -> float:
        """Requests per second this process sent to ``backend`` over the last ``RATE_WINDOW_S``,
        since it last went idle (nothing waiting and nothing sent for ``IDLE_GAP_S``: see
        ``DrainMeter``)."""
        samples = self._sent.setdefault(backend, deque())
        moved = bool(samples) and samples[-1][1] != dispatched
        if moved:
            self._last_sent[backend] = now
        idle_for = now - self._last_sent.setdefault(backend, now)
        if samples and not backlogged and not moved and idle_for >= IDLE_GAP_S:
            # Idle: the others would read this spell's demand as the drain rate. Cleared at every
            # sync while idle, so that the next burst's rate starts one sync before its first
            # dispatch (clearing once, then counting 2 s of idle samples again, read 0.6/s for 10/s).
            samples.clear()
        samples.append((now, dispatched))
        while len(samples) > 2 and samples[1][0] <= now - RATE_WINDOW_S:
            samples.popleft()
        first_at, first = samples[0]
        return (dispatched - first) / (now - first_at) if now > first_at else 0.0

    def adopt(self, snapshot: PolicySnapshot) -> None:
        """Backends without a part (at start, or added by a reload) wait for the ledger's grant:
        nothing, or the share of ``processes_when_unknown``; never the whole capacity."""
        adopt_pending(self.pool.all(), snapshot)


def adopt_pending(states: Iterable[BackendState], snapshot: PolicySnapshot) -> None:
    """Give every backend state without a part its part before the first grant (``PENDING``)."""
    unknown = snapshot.policy.fleet.processes_when_unknown
    for state in states:
        if state.quota is None:
            state.quota = fallback(None, state.backend.capacity, snapshot.policy.classes, unknown)


def _shrunk(now: Quota, before: Quota) -> bool:
    return now.requests < before.requests or now.tokens < before.tokens


EMPTY_WAITING: dict[int, tuple[int, int]] = {}
