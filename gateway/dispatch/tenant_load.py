"""Per-tenant load on each backend, as this process sees it: what the fleet's ledger shares by.

The ledger (``gateway/fleet/``) splits each backend's capacity max-min fairly by tenant weight, so a
process reports, per backend and class rank, its busiest tenants' use: requests and tokens in
flight, waiting, the tokens of their latest dispatch and the most they had in flight at once lately
(``TenantUse``, ``busiest``). It hears back what the other processes have waiting, which the wait
estimate's fair order reads (``Dispatcher._ahead``).

Kept apart from ``gateway/dispatch/dispatcher.py`` because it is bookkeeping, not a dispatch rule: the
dispatcher tells it each grant and each release (``dispatched``, ``released``), the coordinator
reads it through the dispatcher (``Demand.tenants``, ``Demand.heard``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gateway.dispatch.quota import TenantUse, busiest

RECENT_S = 10.0
"""A tenant served this recently, idle now, is still reported to the fleet's ledger (headroom for its next arrival)."""

Others = Mapping[int, Mapping[str, tuple[float, int]]]
"""What the other processes have waiting for a backend: by class rank, by tenant, (weight, requests)."""

NO_OTHERS: Others = {}


@dataclass(slots=True)
class Served:
    """A tenant's latest dispatch to a backend (for the fleet's ledger: ``TenantLoad.tenants``)."""

    at: float
    tokens: int
    peak: int
    """The most requests it had in flight there at once, reached at ``peak_at`` (within ``RECENT_S``)."""
    peak_at: float


class TenantLoad:
    """Requests and tokens in flight per backend by (class rank, tenant), recent dispatches and
    their peaks, the tenants' weights, and what the other processes have waiting."""

    __slots__ = ("_elsewhere", "_served", "_use", "_weights")

    def __init__(self) -> None:
        self._use: dict[str, dict[tuple[int, str], list[int]]] = {}
        """Requests and tokens in flight per backend, by (class rank, tenant)."""
        self._served: dict[str, dict[tuple[int, str], Served]] = {}
        """When each (class rank, tenant) was last given each backend, that request's tokens, and
        the most it has had in flight there lately."""
        self._weights: dict[str, float] = {}
        self._elsewhere: dict[str, Others] = {}
        """What the other processes of the fleet have waiting per backend, by class rank and tenant."""

    def weigh(self, tenant: str, weight: float) -> None:
        """The tenant's weight as the latest request of it says (a reload may change it)."""
        self._weights[tenant] = weight

    def dispatched(self, backend: str, rank: int, tenant: str, weight: float, tokens: int, now: float) -> None:
        """A request of ``tenant`` was given ``backend``."""
        key = (rank, tenant)
        use = self._use.setdefault(backend, {}).setdefault(key, [0, 0])
        use[0] += 1
        use[1] += tokens
        seen = self._served.setdefault(backend, {}).get(key)
        if seen is None:
            self._served[backend][key] = Served(now, tokens, use[0], now)
        else:
            seen.at, seen.tokens = now, tokens
            if use[0] >= seen.peak or seen.peak_at < now - RECENT_S:
                seen.peak, seen.peak_at = use[0], now
        self._weights[tenant] = weight

    def released(self, backend: str, rank: int, tenant: str, tokens: int) -> None:
        """A request of ``tenant`` gave ``backend`` back."""
        uses = self._use.get(backend, {})
        use = uses.get((rank, tenant))
        if use is not None:
            use[0] -= 1
            use[1] -= tokens
            if use[0] <= 0:
                del uses[(rank, tenant)]

    def heard(self, backend: str, others: Others) -> None:
        """The fleet's ledger says what the other processes have waiting for ``backend``, by class and tenant."""
        if others:
            self._elsewhere[backend] = others
        else:
            self._elsewhere.pop(backend, None)

    def elsewhere(self, backend: str) -> Others:
        return self._elsewhere.get(backend, NO_OTHERS)

    def tenants(
        self, waiting: Iterable[tuple[Iterable[str], int, Mapping[str, tuple[int, int]]]], now: float
    ) -> dict[str, list[TenantUse]]:
        """Each backend's busiest tenants here, by class rank: in flight, waiting, and served lately.

        ``waiting``: (backends, class rank, requests and tokens waiting by tenant) per queue; a
        request waiting for a lane counts for each of its backends."""
        rows: dict[str, dict[tuple[int, str], list[int]]] = {}
        for backend, uses in self._use.items():
            for key, (count, tokens) in uses.items():
                rows.setdefault(backend, {})[key] = [count, tokens, 0, 0]
        for backends, rank, by_tenant in waiting:
            names = list(backends)
            for tenant, (count, tokens) in by_tenant.items():
                for name in names:
                    row = rows.setdefault(name, {}).setdefault((rank, tenant), [0, 0, 0, 0])
                    row[2] += count
                    row[3] += tokens
        horizon = now - RECENT_S
        for backend, served in self._served.items():
            for key in [key for key, seen in served.items() if seen.at < horizon]:
                del served[key]
            for key in served:
                rows.setdefault(backend, {}).setdefault(key, [0, 0, 0, 0])
        return {
            backend: busiest([self._tenant_use(backend, key, row) for key, row in entries.items()])
            for backend, entries in rows.items()
        }

    def _tenant_use(self, backend: str, key: tuple[int, str], row: list[int]) -> TenantUse:
        rank, tenant = key
        count, tokens, waiting, waiting_tokens = row
        seen = self._served.get(backend, {}).get(key)
        latest, peak = (seen.tokens, seen.peak) if seen is not None else (0, 0)
        weight = self._weights.get(tenant, 1.0)
        return TenantUse(tenant, rank, weight, count, tokens, waiting, waiting_tokens, latest, peak)
