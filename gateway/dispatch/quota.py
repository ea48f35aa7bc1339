"""This process's part of a backend's capacity (``Quota``), and the use it reports (``TenantUse``).

Why here and not in ``gateway/fleet/``: dispatch enforces the part, the fleet computes it. The
room rule (``capacity.has_room``) reads a backend's ``Quota`` and the other processes' waiting
and prefilling requests (``BackendState.quota``, ``others_waiting``); the dispatcher reports its
tenants' use in ``TenantUse`` entries, the busiest first (``tenant_load.py``, ``busiest``). The
fleet (above dispatch in the stage order, ``tests/test_import_graph.py``) sizes the part and
moves it between processes (``gateway/fleet/quota.py``, ``ledger.py``, ``coordinator.py``), and
imports these types from here; dispatch never imports the fleet. None here: the whole capacity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

EMPTY: Mapping[int, int] = MappingProxyType({})


class Share(NamedTuple):
    """The requests and tokens one class may hold of a backend (``max_share`` of its capacity)."""

    requests: int
    tokens: int


NO_SHARE = Share(0, 0)


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


TENANTS_REPORTED = 8
"""At most this many tenants per backend in a report (the busiest); the rest are summed in one entry."""


@dataclass(frozen=True, slots=True)
class TenantUse:
    """One tenant's use of one backend in one process, at one class rank: what the ledger shares
    each rank's capacity by, max-min fairly across tenants (``gateway/fleet/ledger.py``, rule 2)."""

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
