"""Bounded wait queues: one per model and priority class, fair across tenants within a class.

A ``ClassQueue`` orders its tickets by start-time fair queuing (SFQ) on tokens: a ticket of
tenant t and cost c (prompt plus ``max_tokens``) gets the start tag S = max(V, F_t) and
moves t's finish tag to F_t = S + c / weight_t, where V is the start tag of the ticket
last dispatched. The ticket with the smallest start tag goes first. A tenant that sends ten
times more therefore advances its own tags ten times faster and waits behind the others:
each tenant gets capacity in proportion to its weight, whatever the others offer.

Removal is lazy: a ticket whose client left or whose wait timed out is marked and skipped
when it reaches the head, but ``depth`` drops at once, so the bound and the metrics are exact.

The depth bound is shared fairly too: when the queue is full, an arrival from a tenant with
fewer tickets waiting than the busiest tenant pushes out the busiest tenant's newest ticket
(``push_out``), so a flooding tenant cannot fill the queue and lock the others out.

``DrainMeter`` measures how fast a queue is served (dispatches in a sliding window), from
which the estimated wait of a new arrival and the ``Retry-After`` of a refusal are computed.
The work ahead of an arrival is counted in the queue's own order (``ahead_of``): the tickets
whose start tag is at most the one the arrival would get. A light tenant's ticket takes the
virtual time, so only the few tickets at that tag are ahead of it, however deep a flooding
tenant's backlog is; counting one ticket per waiting tenant instead, as this module once did,
refused a light tenant's requests that fair order would have served first.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from dataclasses import dataclass, field
from itertools import count

from gateway.dispatch.router import RoutingDecision
from gateway.policy.model import PriorityClass, Tenant
from gateway.types import InferenceRequest


@dataclass(eq=False, slots=True)
class Ticket:
    """A request waiting for a backend; ``future`` receives the backend it was given."""

    request: InferenceRequest
    tenant: Tenant
    cost: int
    enqueued_at: float
    future: asyncio.Future[RoutingDecision]
    start_tag: float = 0.0
    removed: bool = False
    exclude: frozenset[str] = frozenset()

    @property
    def tenant_name(self) -> str:
        return self.tenant.name


@dataclass(slots=True)
class ClassQueue:
    """The queue of one model for one priority class: SFQ across tenants, bounded depth."""

    name: str
    policy: PriorityClass
    depth: int = 0
    cost: int = 0
    """Tokens (prompt plus output bound) of the tickets waiting: the queue's demand on a backend."""
    _virtual_time: float = 0.0
    _finish_tags: dict[str, float] = field(default_factory=dict)
    _per_tenant: dict[str, deque[Ticket]] = field(default_factory=dict)
    _heads: list[tuple[float, int, str]] = field(default_factory=list)
    _seq: count[int] = field(default_factory=count)
    _live: dict[str, int] = field(default_factory=dict)  # tickets waiting, per tenant
    _live_cost: dict[str, int] = field(default_factory=dict)  # their tokens, per tenant

    @property
    def rank(self) -> int:
        return self.policy.rank

    def push(self, ticket: Ticket) -> None:
        start = max(self._virtual_time, self._finish_tags.get(ticket.tenant_name, 0.0))
        ticket.start_tag = start
        self._finish_tags[ticket.tenant_name] = start + ticket.cost / ticket.tenant.weight
        waiting = self._per_tenant.get(ticket.tenant_name)
        if waiting is None:
            waiting = self._per_tenant[ticket.tenant_name] = deque()
        if not waiting:
            heapq.heappush(self._heads, (start, next(self._seq), ticket.tenant_name))
        waiting.append(ticket)
        self.depth += 1
        self.cost += ticket.cost
        self._live[ticket.tenant_name] = self._live.get(ticket.tenant_name, 0) + 1
        self._live_cost[ticket.tenant_name] = self._live_cost.get(ticket.tenant_name, 0) + ticket.cost

    def remove(self, ticket: Ticket) -> None:
        """Take a ticket out (client gone, timed out); it is skipped when it reaches the head."""
        if not ticket.removed:
            ticket.removed = True
            self._leave(ticket)

    def _leave(self, ticket: Ticket) -> None:
        tenant = ticket.tenant_name
        self.depth -= 1
        self.cost -= ticket.cost
        left = self._live[tenant] - 1
        if left:
            self._live[tenant] = left
            self._live_cost[tenant] -= ticket.cost
        else:
            del self._live[tenant]
            del self._live_cost[tenant]

    def start_tag(self, tenant: str) -> float:
        """The start tag a new ticket of ``tenant`` would get now (``push``)."""
        return max(self._virtual_time, self._finish_tags.get(tenant, 0.0))

    def ahead_of(self, tenant: str, limit: int | None = None) -> int:
        """How many tickets a new one of ``tenant`` would wait behind in fair order: those whose
        start tag is at most the one it would get (a tie goes to the ticket pushed first). Its own
        tenant's are all ahead; a tenant that sent more than its share has its later tickets behind.
        Counting stops past ``limit`` (the caller only needs to know the wait is too long).

        Cost: one step per tenant waiting and per ticket counted (a tenant's tickets are in tag order)."""
        start = self.start_tag(tenant)
        ahead = 0
        for waiting in self._per_tenant.values():
            for ticket in waiting:
                if ticket.start_tag > start:
                    break
                ahead += not ticket.removed
                if limit is not None and ahead > limit:
                    return ahead
        return ahead

    def waiting_of(self, tenant: str) -> int:
        """Tickets of ``tenant`` waiting here."""
        return self._live.get(tenant, 0)

    def by_tenant(self) -> dict[str, tuple[int, int]]:
        """Tickets and their tokens waiting here, per tenant."""
        return {tenant: (count, self._live_cost[tenant]) for tenant, count in self._live.items()}

    def push_out(self, arriving_tenant: str) -> Ticket | None:
        """Make room for ``arriving_tenant`` in a full queue by removing the newest ticket of the
        busiest tenant, when that tenant has at least two more waiting; None when none qualifies."""
        if not self._live:
            return None
        busiest = max(self._live, key=self._live.__getitem__)
        if self._live[busiest] < self._live.get(arriving_tenant, 0) + 2:
            return None
        for ticket in reversed(self._per_tenant[busiest]):
            if not ticket.removed:
                self.remove(ticket)
                return ticket
        return None  # pragma: no cover - _live says there is one

    def peek(self) -> Ticket | None:
        """The next ticket by start tag, dropping removed ones on the way."""
        while self._heads:
            _, _, tenant = self._heads[0]
            waiting = self._per_tenant[tenant]
            while waiting and waiting[0].removed:
                waiting.popleft()
            if waiting:
                head = waiting[0]
                if head.start_tag != self._heads[0][0]:  # the old head left: re-key the tenant
                    heapq.heapreplace(self._heads, (head.start_tag, next(self._seq), tenant))
                    continue
                return head
            heapq.heappop(self._heads)
            del self._per_tenant[tenant]
        return None

    def pop(self, ticket: Ticket) -> None:
        """Dispatch ``ticket``, which ``peek`` just returned."""
        _, _, tenant = heapq.heappop(self._heads)
        waiting = self._per_tenant[tenant]
        waiting.popleft()
        ticket.removed = True
        self._leave(ticket)
        self._virtual_time = ticket.start_tag
        if waiting:
            heapq.heappush(self._heads, (waiting[0].start_tag, next(self._seq), tenant))
        else:
            del self._per_tenant[tenant]
        if not self._per_tenant:
            self._finish_tags.clear()  # idle queue: history no longer matters


IDLE_GAP_S = 2.0
"""A lane that left its queue empty and dispatched nothing for this long was idle, not slow: its
drain rate is measured again from the next dispatch (``DrainMeter``)."""


class DrainMeter:
    """Dispatches per second over a sliding window, to estimate how long a queue takes to drain.

    The rate is measured since the lane was last idle: a dispatch that left nothing waiting
    (``drained``) followed by none for ``IDLE_GAP_S``. A window that spans an idle spell counts
    the demand of that spell, not what the engines can drain: a burst arriving 8 s after the
    previous one ended once found the last few dispatches of that one in the window, a rate of
    0.4 a second where the engines drained 30, and was refused ``deadline_unmeetable`` by the
    tens. A slow lane whose queue never empties (long requests) keeps its whole window."""

    __slots__ = ("_drained_at", "_times", "_window_s")

    def __init__(self, window_s: float = 10.0) -> None:
        self._window_s = window_s
        self._times: deque[float] = deque()
        self._drained_at: float | None = None

    def count(self, now: float, *, drained: bool = False) -> None:
        """A dispatch at ``now``; ``drained``: it left nothing waiting in the queue."""
        if self._drained_at is not None and now - self._drained_at >= IDLE_GAP_S:
            self._times.clear()  # the lane was idle: measure afresh
        self._drained_at = now if drained else None
        self._times.append(now)
        self._trim(now)

    def rate(self, now: float) -> float | None:
        """Dispatches per second, or None while there are too few to say, or while the lane is idle
        (the window then holds the last busy spell's tail, spread over the idle one: the next
        dispatch clears it, but a request may be judged before that one)."""
        if self._drained_at is not None and now - self._drained_at >= IDLE_GAP_S:
            return None
        self._trim(now)
        if len(self._times) < 4:
            return None
        span = max(now - self._times[0], 1e-3)
        return len(self._times) / span

    def _trim(self, now: float) -> None:
        horizon = now - self._window_s
        times = self._times
        while times and times[0] < horizon:
            times.popleft()
