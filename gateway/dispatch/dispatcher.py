"""Dispatch: give each request a backend with room, or queue it, or refuse it at once.

``Dispatcher.acquire`` is the only way to a backend. Its rule, per model:

1. Fast path: when nothing of the same or a higher class waits and some healthy backend has
   room (``capacity.has_room``), the request is placed at once, no queue involved. In a fleet whose
   parts move (``fleet_rebalances``), a new request (not a retry) whose router favourite among
   the backends with room fleet-wide has none in this process's part is queued instead (neither
   refused by the queue bound nor by the estimate: it had room) and waits for that part at most
   ``FAVOURITE_WAIT_S`` (the coordinator syncs at once), then takes what has room.
2. Otherwise it must wait, and is refused immediately (503, with ``Retry-After``) when
   - the class's queue already holds ``queue.max_depth`` requests (``queue_full``), or
   - its estimated wait exceeds the class's wait budget (``max_wait_s``; by default its TTFT
     objective less the measured dispatch-to-first-token time) or what is left of its
     deadline, with a 25% margin (``deadline_unmeetable``). The estimate is the work ahead of
     it in the fleet's fair order over the fleet's drain rate (``_ahead``, ``_drain_rate``): the requests of
     higher classes waiting anywhere, the tickets of its own queue whose start tag is at most
     the one it would get (``ClassQueue.ahead_of``), and, of the same class waiting in other
     processes, what fair order puts ahead of it (its own tenant's, and of each other tenant
     about as many as its own tenant's ahead of it, by weight); over the rate at which the
     lane's engines finish requests with every slot held (each backend's capacity over the
     measured time a request holds a slot: Little's law), or the dispatches per second of this
     process and of the others to the same backends when that is more. A light tenant's request
     is therefore judged by the short wait fair order gives it, not by a flooding neighbour's
     backlog, and neither one process's small part of an engine (a part of 0 after an idle
     spell) nor how little the fleet sent while idle makes a wait look long.
3. A queued request waits at most ``min(max_wait_s, deadline)`` (then ``queue_timeout``);
   a client that disconnects cancels the wait and leaves the queue at once.
4. Whenever capacity frees up (a request ends, a scrape or health check changes a backend),
   ``hand_out`` hands backends to waiting requests: classes in rank order (interactive always
   before batch), tenants within a class by fair queuing, until the head no longer fits.

When no backend of the model is healthy the request fails at once with 503
``no_healthy_backend`` rather than waiting for capacity that is not coming.
Among the backends with room, the model's ``Router`` chooses (``gateway/routing/``).

Queues are per lane, not per model: a tenant is only offered the backends that serve it
(``BackendPool.lane``), and tenants offered different sets wait in different queues, so that
a tenant whose dedicated backends are full never holds up one whose backends have room (one
queue would: its head does not fit, and nothing behind it is looked at). A model whose
backends serve every tenant has one lane, named by the model. A tenant left with no backend
of the model at all fails at once with 503 ``no_backend_for_tenant``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.clock import Clock
from gateway.dispatch.backends import BackendPool, BackendState, Lane
from gateway.dispatch.cache_report import CacheReport, cache_report
from gateway.dispatch.capacity import has_room
from gateway.dispatch.observers import DispatchObserver, QuietObserver
from gateway.dispatch.queueing import ClassQueue, DrainMeter, Ticket
from gateway.dispatch.quota import TenantUse
from gateway.dispatch.router import Router, RoutingDecision
from gateway.dispatch.tenant_load import Others, TenantLoad
from gateway.errors import NoHealthyBackend, NotFound, Overloaded
from gateway.policy.model import PriorityClass, Tenant
from gateway.policy.snapshot import PolicySnapshot
from gateway.types import InferenceRequest


@dataclass(slots=True)
class Grant:
    """A backend slot held by one request until ``Dispatcher.release``."""

    decision: RoutingDecision
    rank: int
    tokens: int
    queued_s: float
    dispatched_at: float = 0.0
    prefilling: bool = True
    lane: str = ""
    """The key of the lane it was granted in (``ModelQueues.key``); empty: the model's own."""
    tenant: str = ""
    """The tenant it serves (the fleet's ledger shares capacity by tenant)."""

    @property
    def state(self) -> BackendState:
        return self.decision.state


SERVICE_TTFT_WEIGHT = 1 / 8
SERVICE_DEV_WEIGHT = 1 / 4
"""Gains of the dispatch-to-first-token estimator (RFC 6298's alpha and beta)."""

FAVOURITE_WAIT_S = 0.25
"""How long a new request may wait for this process's part of the backend its router prefers when
that backend has room fleet-wide (another process's part is idle there) while another has room
here. The ledger moves a part at the next sync (the coordinator is woken at once: a few tens of
milliseconds), and the favourite usually holds the request's prefix (a conversation's slot): going
elsewhere computes the whole history again, seconds of prefill against this fraction of one. Never
more than half of what the request may wait, never for a retry (it left a backend on purpose)."""

ESTIMATE_MARGIN = 1.25
"""Refuse when the estimated wait is within 25% of what the request may wait: a request that
would likely time out in the queue is better refused at once, while its client can still retry."""


class _Hold:
    """``Dispatcher._place``'s answer when the request should wait for this process's part of its favourite."""


HOLD = _Hold()


def system_full(code: str, message: str, retry_after_s: float) -> Overloaded:
    """A 503 refusal: the system, not the tenant, is out of room; retry after the estimated drain."""
    return Overloaded(message, status=503, code=code, retry_after_s=max(1.0, retry_after_s))


class ModelQueues:
    """The class queues of one model, in rank order, with their drain meters."""

    __slots__ = ("classes", "key", "lane", "meter", "model", "service_ttft_dev_s", "service_ttft_s")

    def __init__(
        self,
        model: str,
        classes: dict[str, PriorityClass],
        key: str | None = None,
        lane: tuple[BackendState, ...] | None = None,
    ) -> None:
        self.model = model
        self.key = key or model
        self.lane = lane
        """The backends these queues wait for when only some of the model's (a tenant's lane)."""
        """The lane's key (``Lane.key``): the model's name for the lane of all its backends."""
        self.classes = sorted((ClassQueue(n, c) for n, c in classes.items()), key=lambda q: q.rank)
        self.meter = DrainMeter()
        self.service_ttft_s = 0.0
        """Smoothed dispatch-to-first-token: what a backend takes once a request reaches it."""
        self.service_ttft_dev_s = 0.0
        """Smoothed deviation of it, so that the budget covers its tail, not just its mean."""

    def observe_service_ttft(self, seconds: float) -> None:
        """RFC 6298's estimator (as TCP's retransmission timeout): mean and mean deviation."""
        self.service_ttft_dev_s += SERVICE_DEV_WEIGHT * (abs(seconds - self.service_ttft_s) - self.service_ttft_dev_s)
        self.service_ttft_s += SERVICE_TTFT_WEIGHT * (seconds - self.service_ttft_s)

    def service_ttft_tail_s(self) -> float:
        return self.service_ttft_s + 4 * self.service_ttft_dev_s

    def wait_budget(self, priority_class: PriorityClass) -> float:
        """How long a request of ``priority_class`` may wait here: the explicit ``max_wait_s``, else its TTFT
        objective less what the backends currently take to produce a first token, tail included
        (mean plus four mean deviations), so that a request let in still meets its objective."""
        if priority_class.queue.max_wait_s is not None:
            return priority_class.queue.max_wait_s
        return max(0.0, priority_class.slo.ttft_ms / 1000 - self.service_ttft_tail_s())

    def queue(self, class_name: str, priority_class: PriorityClass) -> ClassQueue:
        """The queue of ``class_name``; made now when a reload added the class after these queues
        were (or removed it while this request, admitted under the old policy, was on its way)."""
        for queue in self.classes:
            if queue.name == class_name:
                return queue
        queue = ClassQueue(class_name, priority_class)
        self.classes = sorted([*self.classes, queue], key=lambda q: q.rank)
        return queue

    def adopt(self, classes: Mapping[str, PriorityClass]) -> None:
        """A reloaded policy's classes: each queue takes its class's new settings (bound, wait,
        rank); a new class gets a queue; a removed class's queue stays while requests wait in it."""
        kept = []
        for queue in self.classes:
            new = classes.get(queue.name)
            if new is not None:
                queue.policy = new
                kept.append(queue)
            elif queue.depth:
                kept.append(queue)
        names = {queue.name for queue in kept}
        kept += [ClassQueue(name, c) for name, c in classes.items() if name not in names]
        self.classes = sorted(kept, key=lambda q: q.rank)

    def waiting_at_or_above(self, rank: int) -> int:
        return sum(q.depth for q in self.classes if q.rank <= rank)

    def waiting_above(self, rank: int) -> int:
        return sum(q.depth for q in self.classes if q.rank < rank)

    @property
    def depth(self) -> int:
        return sum(q.depth for q in self.classes)


def _fail_waiting(mq: ModelQueues, error: Overloaded) -> None:
    for queue in mq.classes:
        while (ticket := queue.peek()) is not None:
            queue.pop(ticket)
            if not ticket.future.done():
                ticket.future.set_exception(error)


class Dispatcher:
    """Owns the queues of every model; see the module docstring for the rule.

    ``observer`` hears when a request must wait, when demand moves and each decision acted on
    (``gateway/dispatch/observers.py``: the shadow runner, the fleet coordinator, the prefix
    view); by default nothing does. ``fleet_rebalances``: a fleet ledger moves parts of each
    backend by demand (``gateway/fleet/``), so a request may wait for its favourite's part."""

    def __init__(
        self,
        pool: BackendPool,
        routers: Callable[[str], Router],
        clock: Clock,
        snapshot: PolicySnapshot,
        *,
        observer: DispatchObserver | None = None,
        fleet_rebalances: bool = False,
    ) -> None:
        self.pool = pool
        self.router_for = routers
        self.clock = clock
        self.draining = False
        self.observer: DispatchObserver = observer if observer is not None else QuietObserver()
        self.fleet_rebalances = fleet_rebalances
        self._hand_out_soon: set[str] = set()
        """The models whose hand-out a first token scheduled for the loop's next turn (``first_token``)."""
        self._queues: dict[str, ModelQueues] = {}
        self._lanes: dict[str, list[ModelQueues]] = {}
        self._api_lanes: dict[tuple[str, str], tuple[Lane, Lane]] = {}
        self._classes: dict[str, PriorityClass] = {}
        self._fresh_s = snapshot.policy.scrape.fresh_s
        self.load = TenantLoad()
        """Per-tenant use of each backend, what the fleet's ledger shares by (``gateway/dispatch/tenant_load.py``)."""
        self._holding: set[int] = set()
        """The tickets (by ``id``) within their ``FAVOURITE_WAIT_S``: ``_place`` holds them for their favourite."""
        self.adopt(snapshot)

    def adopt(self, snapshot: PolicySnapshot) -> None:
        """Follow a new policy: new models get queues; a model's waiting requests keep theirs
        (other lanes of a model are made on demand, and kept while requests wait in them).

        Requests waiting for a model the new policy removed end at once with 503
        ``model_removed`` (no backend for it will ever free up), rather than at their timeout."""
        self._classes = dict(snapshot.policy.classes)
        queues = {}
        for model in snapshot.models:
            old = self._queues.get(model)
            if old is not None:
                old.adopt(self._classes)
            queues[model] = old if old is not None else ModelQueues(model, self._classes)
        for key, old in self._queues.items():
            if key not in queues and old.model in snapshot.models and old.depth:
                old.adopt(self._classes)
                queues[key] = old
        removed = [mq for mq in self._queues.values() if mq.model not in snapshot.models]
        self._queues = queues
        self._lanes = {}
        for mq in queues.values():
            self._lanes.setdefault(mq.model, []).append(mq)
        self._fresh_s = snapshot.policy.scrape.fresh_s
        for mq in removed:
            _fail_waiting(mq, system_full("model_removed", "The model was removed by a policy reload.", 1.0))

    def queues(self) -> dict[str, ModelQueues]:
        """The queues of each model's own lane (all its backends), by model."""
        return {key: mq for key, mq in self._queues.items() if key == mq.model}

    def waiting(self) -> dict[str, dict[int, tuple[int, int]]]:
        """Requests and their tokens waiting for each backend, by class rank: a request waiting
        for a model counts for every backend that could take it (the demand a fleet shares out)."""
        out: dict[str, dict[int, tuple[int, int]]] = {}
        for mq in self._queues.values():
            if not mq.depth:
                continue
            states = mq.lane if mq.lane is not None else self.pool.for_model(mq.model)
            for queue in mq.classes:
                if not queue.depth:
                    continue
                for state in states:
                    by_rank = out.setdefault(state.name, {})
                    count, tokens = by_rank.get(queue.rank, (0, 0))
                    by_rank[queue.rank] = (count + queue.depth, tokens + queue.cost)
        return out

    def tenants(self) -> dict[str, list[TenantUse]]:
        """Each backend's busiest tenants here, by class rank: in flight, waiting (a request waiting
        for a lane counts for each of its backends), and served lately (``TenantLoad.tenants``)."""
        waiting = [
            (
                [state.name for state in (mq.lane if mq.lane is not None else self.pool.for_model(mq.model))],
                queue.rank,
                queue.by_tenant(),
            )
            for mq in self._queues.values()
            if mq.depth
            for queue in mq.classes
            if queue.depth
        ]
        return self.load.tenants(waiting, self.clock.now())

    def heard(self, backend: str, others: Others) -> None:
        """The fleet's ledger says what the other processes have waiting for ``backend``, by class and tenant."""
        self.load.heard(backend, others)

    def depth(self, model: str, rank: int) -> int:
        """Requests of class ``rank`` waiting for ``model``, in all its lanes."""
        return sum(q.depth for mq in self._lanes.get(model, ()) for q in mq.classes if q.rank == rank)

    def _lane_queues(self, lane: Lane) -> ModelQueues:
        mq = self._queues.get(lane.key)
        if mq is None:
            states = None if lane.key == lane.model else lane.states
            mq = self._queues[lane.key] = ModelQueues(lane.model, self._classes, lane.key, states)
            self._lanes.setdefault(lane.model, []).append(mq)
        return mq

    async def acquire(
        self,
        request: InferenceRequest,
        tenant: Tenant,
        class_name: str,
        priority_class: PriorityClass,
        deadline: float,
        exclude: frozenset[str] = frozenset(),
        max_wait_s: float | None = None,
    ) -> Grant:
        """A backend for ``request`` (see the module docstring); raises ``Overloaded``/``NoHealthyBackend``.

        ``max_wait_s`` shortens the wait below the class's budget (a model group's
        ``fallback_wait_s``: the request has somewhere else to go).

        While draining, only a request's later attempts (``exclude`` names the backends it
        tried: a retry or a stream migration) get a backend: the request is in flight, and
        draining lets what is in flight finish."""
        if self.draining and not exclude:
            raise system_full(
                "draining",
                "The gateway is shutting down and takes no new requests; retry (another replica will answer).",
                1.0,
            )
        mq = self._lane_queues(self._lane(request, tenant))
        tokens = request.prompt_tokens + request.max_tokens
        now = self.clock.now()
        if max_wait_s is not None:
            deadline = min(deadline, now + max_wait_s)
        held = False
        if mq.waiting_at_or_above(priority_class.rank) == 0:
            may_wait = min(mq.wait_budget(priority_class), deadline - now) > 0
            decision = self._place(request, tenant, priority_class, tokens, now, exclude, hold=may_wait)
            if decision is not None and not isinstance(decision, _Hold):
                self._commit(request, tenant, decision, priority_class.rank, tokens)
                mq.meter.count(now, drained=mq.depth == 0)
                return Grant(decision, priority_class.rank, tokens, 0.0, now, lane=mq.key, tenant=tenant.name)
            held = isinstance(decision, _Hold)
        return await self._wait(
            mq, request, tenant, class_name, priority_class, tokens, deadline, now, exclude, held=held
        )

    def place_now(self, request: InferenceRequest, tenant: Tenant, priority_class: PriorityClass) -> Grant | None:
        """A backend for ``request`` at once, or None: the fast path of ``acquire`` alone, never a queue.

        For work that may be dropped (a shadow copy, ``gateway/shadow/``): None while draining,
        when no backend of the tenant's lane has room for ``priority_class`` (its ``max_share``
        applies), when none is healthy, and for every backend some request waits for, in any
        queue of any model (a backend shared by two models must not go to the copy while the
        other model's request waits for it). Never raises. ``give_back`` ends the grant."""
        if self.draining:
            return None
        model = request.model
        lane = self.pool.lane(model, tenant.name)
        awaited = self._awaited_backends()
        candidates = [s for s in lane.states if s.name not in awaited]
        tokens = request.prompt_tokens + request.max_tokens
        now = self.clock.now()
        roomy = [s for s in candidates if has_room(s, priority_class, tokens, now, self._fresh_s)]
        if not roomy:
            return None
        mq = self._lane_queues(lane)
        decision = self.router_for(model).pick(request, tenant, roomy)
        self._commit(request, tenant, decision, priority_class.rank, tokens)
        mq.meter.count(now, drained=mq.depth == 0)
        return Grant(decision, priority_class.rank, tokens, 0.0, now, lane=mq.key, tenant=tenant.name)

    def _awaited_backends(self) -> set[str]:
        """The backends some queued request (of any model, any lane) may be handed."""
        awaited: set[str] = set()
        for mq in self._queues.values():
            if mq.depth:
                awaited.update(s.name for s in (mq.lane if mq.lane is not None else self.pool.for_model(mq.model)))
        return awaited

    async def _wait(
        self,
        mq: ModelQueues,
        request: InferenceRequest,
        tenant: Tenant,
        class_name: str,
        priority_class: PriorityClass,
        tokens: int,
        deadline: float,
        now: float,
        exclude: frozenset[str],
        held: bool = False,
    ) -> Grant:
        """Queue the request until a backend is handed to it. ``held``: it had room here already, only
        not on its favourite (``_place``): it is neither judged by the queue bound nor the wait estimate,
        and waits at most its hold, after which it takes what has room."""
        queue = mq.queue(class_name, priority_class)
        limit = priority_class.queue
        rate = self._drain_rate(mq, now)
        budget = min(mq.wait_budget(priority_class), deadline - now)
        hold_s = min(FAVOURITE_WAIT_S, budget / 2) if self.fleet_rebalances and not exclude else 0.0
        estimate = 0.0
        if not held:
            ahead = self._ahead(mq, queue, tenant, budget, rate)
            estimate = (ahead + 1) / rate if rate else 0.0
            if ahead == 0 and self._held_elsewhere(mq, priority_class.rank, tokens):
                estimate = 0.0  # room comes with the next sync (woken below), not with a request's end
            # Shadows give their slots back: a real request never waits on them.
            freed = self.observer.request_waits(mq.lane if mq.lane is not None else self.pool.for_model(mq.model))
            if ahead < freed:
                estimate = 0.0  # a slot a shadow gives back is this request's, in a moment
            elif queue.depth >= limit.max_depth:
                self._make_room(queue, request, tenant, class_name, limit.max_depth, estimate)
        if estimate * ESTIMATE_MARGIN > budget:
            raise system_full(
                "deadline_unmeetable",
                f"The estimated wait in the {class_name} queue for this model is {estimate:.1f}s "
                f"({ahead} ahead in fair order, served at {rate or 0:.1f}/s), more than this request can wait "
                f"({budget:.1f}s).",
                estimate,
            )
        future: asyncio.Future[RoutingDecision] = asyncio.get_running_loop().create_future()
        ticket = Ticket(request, tenant, tokens, now, future, exclude=exclude)
        queue.push(ticket)
        self.load.weigh(tenant.name, tenant.weight)
        if hold_s > 0:
            self._holding.add(id(ticket))
        self.observer.demand_changed()  # it is reported for every backend of its lane, its favourite's too
        try:
            async with asyncio.timeout(budget):
                if hold_s > 0:
                    await asyncio.wait((future,), timeout=hold_s)
                    self._holding.discard(id(ticket))
                    if not future.done():  # its hold is over: it takes what has room
                        self.hand_out(request.model)
                decision = await future
        except BaseException as exc:
            if future.done() and not future.cancelled() and future.exception() is None:
                # Granted in the same instant as we leave (timeout, client gone): give it back.
                self.give_back(
                    request.model, Grant(future.result(), priority_class.rank, tokens, 0.0, tenant=tenant.name)
                )
            else:
                queue.remove(ticket)
            if isinstance(exc, TimeoutError):
                raise system_full(
                    "queue_timeout",
                    f"Waited {self.clock.now() - now:.1f}s in the {class_name} queue for this model "
                    f"without a free backend (limit {budget:.1f}s).",
                    estimate,
                ) from None
            raise
        finally:
            self._holding.discard(id(ticket))
        granted_at = self.clock.now()
        return Grant(
            decision, priority_class.rank, tokens, granted_at - now, granted_at, lane=mq.key, tenant=tenant.name
        )

    def _ahead(self, mq: ModelQueues, queue: ClassQueue, tenant: Tenant, budget: float, rate: float | None) -> int:
        """The requests the fleet serves before a new one of ``tenant`` in ``queue`` (module docstring, 2).

        Counting stops once the wait is known to be too long (past ``budget`` at ``rate``)."""
        rank = queue.rank
        states = mq.lane if mq.lane is not None else self.pool.for_model(mq.model)
        above = mq.waiting_above(rank) + sum(
            max((state.others_waiting.get(other, 0) for state in states), default=0)
            for other in {other for state in states for other in state.others_waiting if other < rank}
        )
        limit = int(budget * rate / ESTIMATE_MARGIN) + 1 if rate else None
        here = queue.ahead_of(tenant.name, limit)
        elsewhere: dict[str, tuple[float, int]] = {}
        for state in states:  # a request waiting for a lane counts for each backend: the most, not the sum
            for name, (weight, count) in self.load.elsewhere(state.name).get(rank, {}).items():
                if count > elsewhere.get(name, (0.0, 0))[1]:
                    elsewhere[name] = (weight, count)
        mine = queue.waiting_of(tenant.name) + elsewhere.pop(tenant.name, (0.0, 0))[1]
        rounds = (mine + 1) / tenant.weight  # fair order: each other tenant is served about this much, by weight
        return (
            above
            + here
            + (mine - queue.waiting_of(tenant.name))
            + sum(min(count, math.ceil(rounds * weight)) for weight, count in elsewhere.values())
        )

    def _held_elsewhere(self, mq: ModelQueues, rank: int, tokens: int) -> bool:
        """Whether a backend of the lane has room fleet-wide that only this process's part lacks:
        other processes hold it unused (after a ledger reset, or a replica's arrival), and the
        ledger moves it here at the next sync. Not for a class with a ``max_share`` (its budget
        is the fleet's, and what the others use of it is not known here), nor with fixed parts
        (``--workers`` without a shared store: nothing moves)."""
        if not self.fleet_rebalances:
            return False
        states = mq.lane if mq.lane is not None else self.pool.for_model(mq.model)
        for state in states:
            quota, capacity = state.quota, state.backend.capacity
            if quota is None or rank in quota.shares or not self.pool.usable(state):
                continue
            if (
                state.fleet_in_flight < capacity.max_concurrent
                and state.fleet_in_flight_tokens + tokens <= capacity.max_tokens_in_flight
            ):
                return True
        return False

    def _drain_rate(self, mq: ModelQueues, now: float) -> float | None:
        """Requests per second leaving this queue's lane: what its usable engines finish with every
        slot held (``_service_rate``), or, when more, this process's dispatches plus the other
        processes' to the same backends (a slot freed anywhere serves the highest class waiting
        anywhere: ``gateway/fleet/``). None while neither is known.

        Dispatches per second measure the demand whenever the lane was not backlogged: a burst
        after an idle spell, judged by a process whose part was 0 before its first dispatch, read
        the last burst's tail spread over ten seconds (1.3 requests/s where the engine drained
        50) and estimated 28 s for what took 1."""
        own = mq.meter.rate(now)
        states = mq.lane if mq.lane is not None else self.pool.for_model(mq.model)
        measured = (own or 0.0) + sum(state.others_rate for state in states)
        engines = sum(self._service_rate(state) for state in states if self.pool.usable(state))
        return max(measured, engines) or None

    def _service_rate(self, state: BackendState) -> float:
        """What ``state``'s engine finishes per second for this queue: its whole capacity alone or in a
        fleet whose parts move to the demand (the ledger gives freed slots to whoever waits), only
        this process's part when parts are fixed (``--workers`` without a shared store)."""
        capacity, quota = state.backend.capacity, state.quota
        if quota is None or self.fleet_rebalances:
            return state.service_rate(capacity.max_concurrent, capacity.max_tokens_in_flight)
        return state.service_rate(quota.requests, quota.tokens)

    def _make_room(
        self,
        queue: ClassQueue,
        request: InferenceRequest,
        tenant: Tenant,
        class_name: str,
        max_depth: int,
        estimate: float,
    ) -> None:
        """A full queue takes the arrival only by pushing out the busiest tenant's newest ticket."""
        victim = queue.push_out(tenant.name) if max_depth > 0 else None
        if victim is None:
            raise system_full(
                "queue_full",
                f"The {class_name} queue for this model is full ({queue.depth} waiting, "
                f"limit {max_depth}); the backends are saturated.",
                estimate,
            )
        victim.future.set_exception(
            system_full(
                "queue_full",
                f"The {class_name} queue for this model is full ({max_depth} waiting) and this "
                f"tenant holds more of it than any other; its newest request gave way to another tenant's.",
                estimate,
            )
        )

    def _place(
        self,
        request: InferenceRequest,
        tenant: Tenant,
        priority_class: PriorityClass,
        tokens: int,
        now: float,
        exclude: frozenset[str] = frozenset(),
        hold: bool = False,
    ) -> RoutingDecision | _Hold | None:
        """The router's choice among the backends with room here; None when none has room.

        ``hold`` (a new request, not a retry, in a fleet whose parts move): ``HOLD`` when the
        router's favourite among the backends with room fleet-wide has none in this process's
        part while another has: the request waits for that part (``FAVOURITE_WAIT_S``)."""
        model = request.model
        candidates = self._lane(request, tenant).states
        roomy = [s for s in candidates if has_room(s, priority_class, tokens, now, self._fresh_s)]
        if exclude and len(roomy) > 1:  # a retry goes elsewhere when elsewhere has room
            roomy = [s for s in roomy if s.name not in exclude] or roomy
        if hold and roomy and not exclude and self.fleet_rebalances and len(roomy) < len(candidates):
            fleet_room = [
                s for s in candidates if self.pool.usable(s) and s.fleet_in_flight < s.backend.capacity.max_concurrent
            ]
            if len(fleet_room) > len(roomy):
                favourite = self.router_for(model).pick(request, tenant, fleet_room).state
                if favourite not in roomy:
                    return HOLD
        if roomy:
            return self.router_for(model).pick(request, tenant, roomy)
        if not any(self.pool.usable(s) for s in candidates):
            raise NoHealthyBackend(
                "No healthy backend serves this model right now (all down or their breakers open).",
                headers={"retry-after": "1"},
            )
        return None

    def _lane(self, request: InferenceRequest, tenant: Tenant) -> Lane:
        """The tenant's backends of the request's model; none at all (while the model has some) is a
        503 at once. A request pinned to a backend (it continues an answer that backend holds) has
        a lane of that one backend, and a queue of its own: it never holds up the model's others."""
        model = request.model
        lane = self.pool.lane(model, tenant.name)
        if not lane.states and self.pool.for_model(model):
            raise NoHealthyBackend(
                "No backend of this model serves this tenant: the policy dedicates each to other tenants.",
                code="no_backend_for_tenant",
            )
        lane = self._api_lane(lane, request)
        pinned = request.pinned_backend
        if pinned is not None:
            states = tuple(s for s in lane.states if s.name == pinned)
            if not states:
                raise NotFound(
                    f"The earlier response this request continues was held by backend '{pinned}', which no "
                    "longer serves it; start the conversation again.",
                    code="previous_response_not_found",
                    param="previous_response_id",
                )
            lane = Lane(f"{model} @{pinned}", model, states)
        return lane

    def _api_lane(self, lane: Lane, request: InferenceRequest) -> Lane:
        """``lane`` without the backends whose kind cannot answer the request's API (``Dialect.serves``:
        ``/tokenize`` or ``/v1/score`` on a llama.cpp server), memoised per lane and API; none left
        is a 404 at once (no backend of the model serves this API)."""
        api = request.api
        memo = self._api_lanes.get((lane.key, api.name))
        if memo is None or memo[0] is not lane:
            states = tuple(s for s in lane.states if api.serves(s.backend.kind))
            served = lane if states == lane.states else Lane(f"{lane.key} @{api.name}", lane.model, states)
            memo = self._api_lanes[(lane.key, api.name)] = (lane, served)
        if not memo[1].states and lane.states:
            raise NotFound(
                f"No backend of this model serves {api.path} (its kinds of engine do not answer it).",
                code="api_not_served",
            )
        return memo[1]

    def _commit(
        self, request: InferenceRequest, tenant: Tenant, decision: RoutingDecision, rank: int, tokens: int
    ) -> None:
        decision.state.reserve(rank, tokens)
        self.load.dispatched(decision.state.name, rank, tenant.name, tenant.weight, tokens, self.clock.now())
        self.router_for(request.model).on_dispatch(request, tenant, decision)
        self.observer.routed(request, decision)

    def answered(
        self, request: InferenceRequest, decision: RoutingDecision, usage: Mapping[str, Any] | None
    ) -> CacheReport | None:
        """The engine answered ``request`` (routed by ``decision``) with ``usage``: what it says it
        reused of the prompt against what the router expected (``cache_report.py``), heard by the
        model's router (its closed loop) and, on a miss, by the observers (the fleet's prefix
        view); None when the engine did not say."""
        report = cache_report(decision, usage)
        if report is not None:
            self.router_for(request.model).on_answer(request, decision, report)
            if report.missed:
                self.observer.cache_missed(request, decision, report)
        return report

    def first_token(self, model: str, grant: Grant) -> None:
        """The request's prefill is done: a class paced by ``max_prefilling`` may start another.

        Called from inside a stream's parse (the relay's ``TokenTimer``, the shadow runner's reader),
        so only the bookkeeping happens now: the backend's prefill count drops (a paced class's next
        prefill may start), and the dispatch-to-first-token time is measured. Handing the room to
        waiting requests (their routing, their grants) is scheduled for the loop's next turn, after
        the current chunk is handled: one request's parser never runs the scheduler for others, and
        the first tokens of one turn hand out once per model. Nothing overtakes the waiting requests
        meanwhile: a new request of their class or a lower one queues behind them (``acquire``)."""
        if grant.prefilling:
            grant.prefilling = False
            grant.state.prefilled(grant.rank)
            mq = self._queues.get(grant.lane or model)
            if mq is not None:
                mq.observe_service_ttft(self.clock.now() - grant.dispatched_at)
            if model not in self._hand_out_soon:
                self._hand_out_soon.add(model)
                asyncio.get_running_loop().call_soon(self._hand_out_after_first_token, model)

    def _hand_out_after_first_token(self, model: str) -> None:
        self._hand_out_soon.discard(model)
        self.hand_out(model)

    def give_back(self, model: str, grant: Grant) -> None:
        """Give the slot back and let waiting requests have it: those of every model the backend
        serves (a model group's targets may share an engine), the returning model's first."""
        state = grant.state
        state.unreserve(grant.rank, grant.tokens, grant.prefilling)
        if grant.dispatched_at:
            state.held(self.clock.now() - grant.dispatched_at, grant.tokens)
        grant.prefilling = False
        self.load.released(state.name, grant.rank, grant.tenant, grant.tokens)
        if state.others_waiting:
            self.observer.demand_changed()
        self.hand_out(model)
        served = state.backend.models
        if len(served) > 1:
            for other in served:
                if other != model:
                    self.hand_out(other)

    def hand_out(self, model: str) -> None:
        """Hand free capacity to waiting requests: by class rank across the model's lanes, then fair
        order within a queue; a lane whose head does not fit serves none of its lower classes."""
        lanes = self._lanes.get(model, ())
        now = self.clock.now()
        blocked: set[str] = set()
        for rank in sorted({q.rank for mq in lanes for q in mq.classes}):
            for mq in lanes:
                for queue in mq.classes:
                    if queue.rank == rank and mq.key not in blocked and not self._pump_queue(mq, queue, now):
                        blocked.add(mq.key)

    def _pump_queue(self, mq: ModelQueues, queue: ClassQueue, now: float) -> bool:
        """Dispatch ``queue``'s tickets in fair order until its head does not fit; True when it is empty."""
        while (ticket := queue.peek()) is not None:
            if ticket.future.done():  # its wait ended this instant; the waiter cleans up
                queue.remove(ticket)
                continue
            try:
                decision = self._place(
                    ticket.request,
                    ticket.tenant,
                    queue.policy,
                    ticket.cost,
                    now,
                    ticket.exclude,
                    hold=id(ticket) in self._holding,
                )
            except NoHealthyBackend as error:
                queue.pop(ticket)
                ticket.future.set_exception(error)
                continue
            if decision is None or isinstance(decision, _Hold):
                return False
            queue.pop(ticket)
            self._commit(ticket.request, ticket.tenant, decision, queue.rank, ticket.cost)
            mq.meter.count(now, drained=mq.depth == 0)
            ticket.future.set_result(decision)
        return queue.depth == 0

    def hand_out_all(self) -> None:
        for model in self._lanes:
            self.hand_out(model)
