"""The fleet's invariant over random interleavings: never more in flight than the capacity.

A hypothesis state machine plays 2 to 5 gateway processes sharing one backend of capacity 4
(400 tokens, batch limited to half) through the real ledger script on the real Redis, each
with the real coordinator (``gateway/fleet/coordinator.py``), the real backend state and the
real room rule (``gateway/dispatch/capacity.py``). Time is a ``FakeClock`` that both the ledger's script
and the processes read. A sync is three steps that other steps may come between: the report is
written (``begin_sync``), the script runs in Redis (``run_sync``, or fails: the process is cut
off, or Redis is down), its answer is applied (``apply_sync``) or lost to a timeout
(``lose_answer``). Meanwhile processes start requests of three tenants (weights 1, 2, 1; each process reports
its tenants' use and demand, so the ledger shares by tenant: its targets may fall below what a
process uses) when the room rule lets them, end them,
join, die (their requests die with them, and a neighbour on the host sees them gone), lose and
regain Redis, and time passes; a request still running at its deadline is cut, as the gateway
cuts it. After every step: the requests, tokens and batch requests in flight, summed over the
processes that live, are within the capacity.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gateway.dispatch.backends import BackendPool, BackendState
from gateway.dispatch.capacity import has_room
from gateway.dispatch.quota import TenantUse
from gateway.fleet.coordinator import FleetCoordinator
from gateway.fleet.ledger import BackendReport, FleetLedger, Sync
from gateway.policy.snapshot import PolicySnapshot
from gateway.service import parse_policy
from gateway.telemetry.metrics import Metrics
from tests.fake_clock import FakeClock
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix
from tests.policy_builder import NOWHERE, backend, build_policy

CAPACITY, TOKENS, BATCH_SHARE = 4, 400, 0.5
DEADLINE_S = 5.0
POLICY = build_policy(
    NOWHERE,
    classes={
        "interactive": {"rank": 0, "slo": {"ttft_ms": 500, "itl_ms": 50, "e2e_ms": 5000}, "deadline_s": DEADLINE_S},
        "batch": {
            "rank": 1,
            "slo": {"ttft_ms": 5000, "itl_ms": 100, "e2e_ms": 5000},
            "deadline_s": DEADLINE_S,
            "max_share": BATCH_SHARE,
        },
    },
    backends=[
        backend(
            "b",
            NOWHERE,
            ["test/chat", "test/other"],
            capacity={"max_concurrent": CAPACITY, "max_tokens_in_flight": TOKENS},
        )
    ],
    fleet={"sync_interval_s": 0.05, "lease_ttl_s": 2.0, "timeout_ms": 200, "outage_s": 3.0},
)


WEIGHTS = {"a": 1.0, "b": 2.0, "c": 1.0}


class Queue:
    """A process's queue for the backend: requests that found no room, waiting for a part.

    What the coordinator reads of the dispatcher (``Demand``): what waits, by class rank, and
    each tenant's use and demand."""

    def __init__(self) -> None:
        self.waiting_requests: list[tuple[int, int, str]] = []
        """(tokens, class rank, tenant) of each waiting request, in arrival order."""
        self.running: list[tuple[float, int, int, str]] = []
        """The process's requests in flight (``Process.requests``)."""

    def waiting(self) -> dict[str, dict[int, tuple[int, int]]]:
        by_rank: dict[int, tuple[int, int]] = {}
        for tokens, rank, _ in self.waiting_requests:
            count, total = by_rank.get(rank, (0, 0))
            by_rank[rank] = (count + 1, total + tokens)
        return {"b": by_rank}

    def tenants(self) -> dict[str, list[TenantUse]]:
        rows: dict[tuple[int, str], list[int]] = {}
        for _, tokens, rank, tenant in self.running:
            row = rows.setdefault((rank, tenant), [0, 0, 0, 0])
            row[0] += 1
            row[1] += tokens
        for tokens, rank, tenant in self.waiting_requests:
            row = rows.setdefault((rank, tenant), [0, 0, 0, 0])
            row[2] += 1
            row[3] += tokens
        return {"b": [TenantUse(t, rank, WEIGHTS[t], r[0], r[1], r[2], r[3]) for (rank, t), r in rows.items()]}

    def heard(self, backend: str, others: object) -> None:
        pass

    def hand_out_all(self) -> None:
        pass  # the machine hands out itself (``FleetMachine._hand_out``), where it can check each start


@dataclass
class Process:
    name: str
    coordinator: FleetCoordinator
    state: BackendState
    demand: Queue
    alive: bool = True
    cut: bool = False
    written: tuple[list[BackendReport], float] | None = None
    answered: tuple[Sync, float] | None = None
    requests: list[tuple[float, int, int, str]] = field(default_factory=list)
    """Each request in flight: when it started, its tokens, its class rank, its tenant (the same list as
    ``demand.running``)."""


class FleetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock()
        self.prefix = unique_prefix()
        self.client = aioredis.Redis.from_url(REDIS_URL)
        self.snapshot: PolicySnapshot = parse_policy(POLICY, "fleet-machine.yaml")
        self.processes: list[Process] = []
        self.dead: set[str] = set()
        self.redis_down = False
        for _ in range(2):
            self._join()

    def teardown(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()
        drop_keys(REDIS_URL, self.prefix)

    def _join(self) -> None:
        name = f"p{len(self.processes)}"
        ledger = FleetLedger(
            self.client, key_prefix=self.prefix, replica=name, lease_ttl_s=1.0, drain_s=1.0, clock=self.clock
        )
        pool = BackendPool(self.snapshot)
        demand = Queue()
        coordinator = FleetCoordinator(
            ledger, pool, demand, lambda: self.snapshot, self.clock, Metrics(), exited=self.dead.__contains__
        )
        coordinator.adopt(self.snapshot)
        state = pool.named("b")
        assert state is not None
        process = Process(name, coordinator, state, demand)
        process.requests = demand.running
        self.processes.append(process)

    def _live(self) -> list[Process]:
        return [p for p in self.processes if p.alive]

    def _pick(self, index: int) -> Process:
        live = self._live()
        return live[index % len(live)]

    # --- the world ------------------------------------------------------------------------

    FAULTS = ("join", "die", "cut off", "reconnected", "redis down", "redis up", "answer lost")

    @rule(fault=st.sampled_from(FAULTS), index=st.integers(0, 4))
    def fault(self, fault: str, index: int) -> None:
        """One of the rarer events, together so that they come about as often as one common step."""
        process = self._pick(index)
        if fault == "join" and len(self._live()) < 5:
            self._join()
        elif fault == "die" and len(self._live()) > 1:
            process.alive = False
            self.dead.add(process.name)
            process.requests.clear()  # the engine aborts what a dead process's connections carried
        elif fault in ("cut off", "reconnected"):
            process.cut = fault == "cut off"
        elif fault in ("redis down", "redis up"):
            self.redis_down = fault == "redis down"
        elif fault == "answer lost" and process.answered is not None:
            process.answered = None
            process.coordinator.fall_back(self.snapshot, TimeoutError("the answer came too late"))

    @rule(seconds=st.sampled_from([0.01, 0.05, 0.3, 1.0, 2.5, 4.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        for process in self._live():
            for request in [r for r in process.requests if r[0] + DEADLINE_S <= self.clock.now()]:
                self._end(process, request)  # the gateway cuts a request at its deadline

    # --- requests -------------------------------------------------------------------------

    @rule(
        index=st.integers(0, 4),
        batch=st.booleans(),
        count=st.integers(1, 4),
        tokens=st.integers(10, 150),
        tenant=st.sampled_from(sorted(WEIGHTS)),
    )
    def arrive(self, index: int, batch: bool, count: int, tokens: int, tenant: str = "a") -> None:
        """Requests arrive at a process: each starts if the room rule lets it, else waits."""
        process = self._pick(index)
        rank = 1 if batch else 0
        process.demand.waiting_requests += [(tokens, rank, tenant)] * count
        self._hand_out(process)

    @rule(index=st.integers(0, 4), which=st.integers(0, 20))
    def end_request(self, index: int, which: int) -> None:
        process = self._pick(index)
        if process.requests:
            self._end(process, process.requests[which % len(process.requests)])
            self._hand_out(process)

    @rule(index=st.integers(0, 4))
    def give_up(self, index: int) -> None:
        """The waiting requests leave (their queue deadline, or their clients)."""
        self._pick(index).demand.waiting_requests.clear()

    def _hand_out(self, process: Process) -> None:
        """Start waiting requests in class order while the room rule lets them (the dispatcher's hand-out)."""
        fresh_s = self.snapshot.policy.scrape.fresh_s
        for tokens, rank, tenant in sorted(process.demand.waiting_requests, key=lambda item: item[1]):
            priority_class = self.snapshot.priority_class("batch" if rank else "interactive")
            if has_room(process.state, priority_class, tokens, self.clock.now(), fresh_s):
                process.state.reserve(rank, tokens)
                process.requests.append((self.clock.now(), tokens, rank, tenant))
                process.demand.waiting_requests.remove((tokens, rank, tenant))

    def _end(self, process: Process, request: tuple[float, int, int, str]) -> None:
        process.requests.remove(request)
        _, tokens, rank, _ = request
        process.state.unreserve(rank, tokens, prefilling=True)

    # --- syncs ----------------------------------------------------------------------------

    @rule(index=st.integers(0, 4))
    def begin_sync(self, index: int) -> None:
        process = self._pick(index)
        if process.written is None and process.answered is None:
            process.written = process.coordinator.reports(self.snapshot)

    @rule(index=st.integers(0, 4))
    def run_sync(self, index: int) -> None:
        process = self._pick(index)
        if process.written is None:
            return
        reports, sent = process.written
        process.written = None
        if process.cut or self.redis_down:
            process.coordinator.fall_back(self.snapshot, ConnectionError("unreachable"))
            return
        answer = self.loop.run_until_complete(process.coordinator.ledger.sync(reports, process.coordinator._reap))
        process.answered = (answer, sent)

    @rule(index=st.integers(0, 4))
    def sync(self, index: int) -> None:
        """A whole sync at once (most syncs): written, run, applied."""
        self.begin_sync(index)
        self.run_sync(index)
        self.apply_sync(index)

    @rule(
        first=st.integers(0, 4),
        second=st.integers(0, 4),
        arrivals=st.tuples(st.integers(0, 4), st.integers(0, 4)),
        batch=st.booleans(),
    )
    def crossed_syncs(self, first: int, second: int, arrivals: tuple[int, int], batch: bool) -> None:
        """The interleaving a sync leaves room for: one process writes its report, requests
        arrive there, its script runs; another process syncs, with its own arrivals; only then
        does the first one's answer arrive."""
        self.begin_sync(first)
        if arrivals[0]:
            self.arrive(first, batch, arrivals[0], 60)
        self.run_sync(first)
        if arrivals[1]:
            self.arrive(second, not batch, arrivals[1], 60)
        self.sync(second)
        self.apply_sync(first)

    @rule(arrivals=st.integers(1, 4))
    def join_under_load(self, arrivals: int) -> None:
        """A process joins, and requests reach it before its first sync."""
        if len(self._live()) < 5:
            self._join()
            self.arrive(len(self._live()) - 1, False, arrivals, 60)

    @rule(
        silent=st.integers(0, 4),
        other=st.integers(0, 4),
        late=st.sampled_from([0.5, 1.0, 2.0, 3.0, 4.0]),
        arrivals=st.integers(1, 4),
    )
    def long_outage(self, silent: int, other: int, late: float, arrivals: int) -> None:
        """One process loses Redis for longer than its lease and outage: requests reach it after
        ``late`` more seconds, then the others go on until its drain may be over."""
        cut = self._pick(silent)
        cut.cut = True
        self.time_passes(4.0)
        self.time_passes(late)
        self.arrive(silent, False, arrivals, 60)
        self.time_passes(4.0)
        self.time_passes(1.0)
        self.arrive(other, False, arrivals, 60)
        self.sync(other)
        cut.cut = False

    @rule(index=st.integers(0, 4))
    def apply_sync(self, index: int) -> None:
        process = self._pick(index)
        if process.answered is not None:
            answer, sent = process.answered
            process.answered = None
            process.coordinator.apply(answer, sent)
            quota = process.state.quota
            if quota is not None and process.state.in_flight > quota.requests and currently_in_test_context():
                event("a part told below what the process uses (its tenants over their share)")
            self._hand_out(process)

    # --- the invariant --------------------------------------------------------------------

    @invariant()
    def within_the_capacity(self) -> None:
        live = self._live()
        requests = sum(p.state.in_flight for p in live)
        if requests == CAPACITY and currently_in_test_context():
            event("the capacity in use in full")
        tokens = sum(p.state.in_flight_tokens for p in live)
        batch = sum(p.state.class_in_flight.get(1, 0) for p in live)
        assert requests <= CAPACITY, f"{requests} requests in flight on a capacity of {CAPACITY}"
        assert tokens <= TOKENS, f"{tokens} tokens in flight on a budget of {TOKENS}"
        assert batch <= int(CAPACITY * BATCH_SHARE), f"{batch} batch requests, beyond the class's share"


FleetMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestFleetInvariant = FleetMachine.TestCase


@contextmanager
def machine() -> Iterator[Any]:
    playing: Any = FleetMachine()
    try:
        yield playing
    finally:
        playing.teardown()


def in_flight(playing: Any) -> int:
    return sum(p.state.in_flight for p in playing.processes if p.alive)


def test_a_part_shrunk_while_its_answer_travels_is_never_given_away() -> None:
    """The interleaving behind 5 requests on a capacity of 4: A reports itself idle, starts 4
    requests on the part it still enforces, then its answer (a smaller part) is written; B syncs
    before A applies it. B must get nothing of the 4 A may be using."""
    with machine() as playing:
        a, b = 0, 1
        playing.sync(b)  # B alone: all of it as headroom
        playing.arrive(a, False, 4, 50)
        for index in (a, b, b, a):  # A's demand; B gives its part up, then says it applied that
            playing.sync(index)
        assert in_flight(playing) == CAPACITY
        for _ in range(CAPACITY):
            playing.end_request(a, 0)
        playing.begin_sync(a)  # A's report: idle, enforcing 4
        playing.arrive(a, False, 4, 50)  # ... and 4 start on the part it enforces
        playing.run_sync(a)  # the ledger shrinks A's part from that stale report
        playing.arrive(b, False, 4, 50)
        playing.sync(b)
        assert in_flight(playing) == CAPACITY
        playing.within_the_capacity()


def test_a_process_that_joins_starts_nothing_before_its_first_grant() -> None:
    with machine() as playing:
        for index in (0, 1):
            playing.arrive(index, False, 2, 50)
        for index in (0, 1, 0, 1, 0, 1):
            playing.sync(index)
        assert in_flight(playing) == CAPACITY
        playing.fault("join", 0)
        playing.arrive(2, False, 2, 50)
        assert playing.processes[2].state.in_flight == 0
        playing.within_the_capacity()


def test_a_process_cut_off_past_its_outage_starts_nothing_the_ledger_may_have_given_away() -> None:
    """Cut off from Redis, a process goes on within its part for its lease and ``outage_s``, then
    starts nothing: requests it started later could outlive the ledger's count of it."""
    with machine() as playing:
        a, b = 0, 1
        for index in (a, b):
            playing.sync(index)
        playing.fault("cut off", a)
        playing.time_passes(4.0)
        playing.time_passes(1.0)  # past A's lease and outage (1.85 s + 3 s)
        playing.arrive(a, False, 4, 50)
        assert playing.processes[a].state.in_flight == 0, "A's part has lapsed"
        playing.time_passes(4.0)
        playing.time_passes(1.0)  # past A's drain in the ledger (its lease, the outage, a deadline)
        playing.arrive(b, False, 4, 50)
        playing.sync(b)
        assert playing.processes[b].state.in_flight == CAPACITY, "A's part is B's once the drain is over"
        playing.within_the_capacity()
