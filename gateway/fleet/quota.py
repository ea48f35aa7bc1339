"""What one process may hold of a backend's capacity: the rules that size its quota.

The ``Quota`` itself, and the ``TenantUse`` a process reports, are dispatch's
(``gateway/dispatch/quota.py``): dispatch enforces the part, the fleet computes it here.

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

from collections.abc import Mapping

from gateway.dispatch.quota import NO_SHARE, Quota, Share
from gateway.policy.model import Capacity, PriorityClass

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


def _within(share: Share, bound: Share) -> Share:
    return Share(min(share.requests, bound.requests), min(share.tokens, bound.tokens))
