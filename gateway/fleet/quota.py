"""What one process may hold of a backend's capacity: its quota, and the rules that size it.

A backend's capacity in the policy (``max_concurrent`` requests, ``max_tokens_in_flight``
tokens, ``max_prefilling`` prefills per paced class, ``max_share`` of both per shared class)
is the fleet's: every process of every
replica together must stay within it. Each process therefore dispatches against a ``Quota``,
its part of each budget, and the quotas of all processes sum to at most the capacity:

* alone (one process, no shared store): the whole capacity (``quota`` None on the backend);
* ``--workers N`` without a shared store: ``capacity / N`` each, fixed (``partition``);
* with Redis: what the ledger grants (``gateway/fleet/ledger.py``), moved between processes
  by their demand every ``fleet.sync_interval_s``, valid until the process's lease ends
  (``Quota.until``): past it, nothing more starts until a sync succeeds;
* with Redis unreachable: its last grant, for the rest of its lease (the ledger counts it
  meanwhile, and as a tombstone after). An equal share among the processes last seen would not
  keep the sum: a process that held little could then start requests while one that held much
  still has its own in flight. A process that never reached the ledger holds nothing
  (``PENDING``), or, when the policy bounds how many run without it
  (``fleet.processes_when_unknown``), an equal share among them.

Sizes are whole units, rounded down: a share never rounds up past the capacity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from gateway.policy.model import Capacity, PriorityClass

EMPTY: Mapping[int, int] = MappingProxyType({})


class Share(NamedTuple):
    """The requests and tokens one class may hold of a backend (``max_share`` of its capacity)."""

    requests: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Quota:
    """This process's part of one backend's budgets (requests, tokens, prefills by class rank).

    ``whole`` says it holds the backend's entire token budget: then, like a process alone, it
    may send an idle backend a request larger than the budget (which could never run otherwise).
    """

    requests: int
    tokens: int
    prefills: Mapping[int, int] = field(default_factory=dict)
    shares: Mapping[int, Share] = field(default_factory=dict)
    """What each class with a ``max_share`` below 1 may hold, by rank (this process's part of the share)."""
    whole: bool = False
    until: float = math.inf
    """When this part stops letting requests start (the process's lease, on its clock); inf: never."""


PENDING = Quota(0, 0)
"""The part of a process that has not heard from the ledger yet: nothing (others may hold everything)."""


def paced(classes: Mapping[str, PriorityClass]) -> dict[int, int]:
    """The prefill bound of each paced class, by rank."""
    return {c.rank: c.max_prefilling for c in classes.values() if c.max_prefilling is not None}


def shared(capacity: Capacity, classes: Mapping[str, PriorityClass]) -> dict[int, Share]:
    """What each class with a ``max_share`` below 1 may hold of the whole capacity, by rank."""
    return {
        c.rank: Share(int(c.max_share * capacity.max_concurrent), int(c.max_share * capacity.max_tokens_in_flight))
        for c in classes.values()
        if c.max_share < 1.0
    }


def partition(capacity: Capacity, classes: Mapping[str, PriorityClass], parts: int) -> Quota:
    """One of ``parts`` equal shares, rounded down (at least nothing: a share may be 0)."""
    if parts <= 1:
        whole = Quota(capacity.max_concurrent, capacity.max_tokens_in_flight, paced(classes), whole=True)
        return Quota(whole.requests, whole.tokens, whole.prefills, shared(capacity, classes), whole=True)
    prefills = {rank: bound // parts for rank, bound in paced(classes).items()}
    shares = {
        rank: Share(bound.requests // parts, bound.tokens // parts) for rank, bound in shared(capacity, classes).items()
    }
    return Quota(capacity.max_concurrent // parts, capacity.max_tokens_in_flight // parts, prefills, shares)


def fallback(
    last: Quota | None, capacity: Capacity, classes: Mapping[str, PriorityClass], unknown: int | None
) -> Quota:
    """The part to hold while the ledger cannot be reached (module docstring): the last grant
    (it lapses at its own ``until``), else nothing, or an equal share among ``unknown`` processes."""
    if last is not None and last is not PENDING:
        return last
    return PENDING if unknown is None else partition(capacity, classes, unknown)


def at_most(grant: Quota, bound: Quota) -> Quota:
    """``grant`` within ``bound``, budget by budget (a grant applied while the fleet re-forms)."""
    prefills = {rank: min(value, bound.prefills.get(rank, 0)) for rank, value in grant.prefills.items()}
    shares = {rank: _within(value, bound.shares.get(rank, NO_SHARE)) for rank, value in grant.shares.items()}
    return Quota(
        min(grant.requests, bound.requests),
        min(grant.tokens, bound.tokens),
        prefills,
        shares,
        grant.whole and bound.whole,
        grant.until,
    )


NO_SHARE = Share(0, 0)


def _within(share: Share, bound: Share) -> Share:
    return Share(min(share.requests, bound.requests), min(share.tokens, bound.tokens))


TENANTS_REPORTED = 8
"""At most this many tenants per backend in a report (the busiest); the rest are summed in one entry."""


@dataclass(frozen=True, slots=True)
class TenantUse:
    """One tenant's use of one backend in one process, at one class rank: what the ledger shares
    each rank's capacity by, max-min fairly across tenants (``ledger.py``, rule 2)."""

    name: str
    """The tenant's name; '' for the tenants a report sums into one entry (their weights summed)."""
    rank: int
    weight: float
    requests: int = 0
    tokens: int = 0
    waiting: int = 0
    waiting_tokens: int = 0
    next_tokens: int = 0
    """Tokens of its latest request: the headroom its next arrival needs (0: the mean of its use)."""
    peak: int = 0
    """The most requests it had in flight here at once lately: the ledger keeps room for as many
    (a tenant whose requests come and go keeps the room its next ones need)."""

    def as_json(self) -> list[Any]:
        return [
            self.name,
            self.rank,
            self.weight,
            self.requests,
            self.tokens,
            self.waiting,
            self.waiting_tokens,
            self.next_tokens,
            self.peak,
        ]


def busiest(entries: Sequence[TenantUse], at_most: int = TENANTS_REPORTED) -> list[TenantUse]:
    """A compact report: the ``at_most`` busiest entries (requests in flight and waiting, then the
    latest request's size: a tenant served lately and idle now still gets headroom), the rest summed
    into one entry per rank named '' (weights summed: together they weigh what they weigh apart)."""
    ranked = sorted(entries, key=lambda e: (-(e.requests + e.waiting), -e.next_tokens, e.name, e.rank))
    kept, rest = ranked[:at_most], ranked[at_most:]
    summed: dict[int, TenantUse] = {}
    for entry in rest:
        have = summed.get(entry.rank)
        summed[entry.rank] = (
            entry
            if have is None
            else TenantUse(
                "",
                entry.rank,
                have.weight + entry.weight,
                have.requests + entry.requests,
                have.tokens + entry.tokens,
                have.waiting + entry.waiting,
                have.waiting_tokens + entry.waiting_tokens,
                max(have.next_tokens, entry.next_tokens),
                have.peak + entry.peak,
            )
        )
    return kept + [
        TenantUse("", rank, e.weight, e.requests, e.tokens, e.waiting, e.waiting_tokens, e.next_tokens, e.peak)
        for rank, e in sorted(summed.items())
    ]
