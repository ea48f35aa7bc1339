"""Bounded label values: only the N busiest tenants get a metric label of their own.

Why: every distinct label value is a time series in Prometheus for ever (well, for the
retention), and a gateway with thousands of tenants would multiply each tenant-labelled
metric by thousands. So tenants beyond the ``top`` busiest are folded into ``other``.

Busiest is a decaying request count: each request adds 1, and a count halves every
``half_life_s`` seconds without traffic (an exponentially weighted count, so a tenant that
was busy an hour ago does not hold its slot for ever). It is kept without touching every
tenant on every request: a request at time t adds ``2^((t − t₀)/half_life)`` to its tenant's
score, which compares like the decayed counts; the scale is renormalised now and then.

Stability: the set of labelled tenants (the members) changes only at a refresh, every
``refresh_s`` seconds, and a challenger replaces the weakest member only when its score
beats that member's by ``hysteresis`` (25% by default), so two tenants of similar traffic do
not swap places at every refresh, and a tenant's series does not flap between its name and
``other``. Free slots are filled at once (the first ``top`` tenants are labelled from their
first request). ``-`` (no tenant: the request failed authentication) passes through.

Usage::

    labels = TenantLabels(top=20, clock=clock)
    metrics.rejections.labels(reason, priority_class, labels.label(exchange.tenant)).inc()
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable

from gateway.clock import Clock

OTHER = "other"
_RENORMALISE_EXPONENT = 64.0


class TenantLabels:
    """Maps a tenant to itself when it is among the busiest ``top``, else to ``other``."""

    def __init__(
        self,
        *,
        top: int,
        clock: Clock,
        half_life_s: float = 300.0,
        refresh_s: float = 10.0,
        hysteresis: float = 1.25,
        max_tracked: int = 10_000,
        passthrough: Iterable[str] = ("-",),
    ) -> None:
        if top < 0 or half_life_s <= 0 or refresh_s <= 0 or hysteresis < 1 or max_tracked < top:
            raise ValueError("top ≥ 0, half_life_s > 0, refresh_s > 0, hysteresis ≥ 1, max_tracked ≥ top")
        self.top = top
        self._clock = clock
        self._half_life = half_life_s
        self._refresh_s = refresh_s
        self._hysteresis = hysteresis
        self._max_tracked = max_tracked
        self._passthrough = frozenset(passthrough)
        self._origin = clock.now()
        self._next_refresh = self._origin + refresh_s
        self._scores: dict[str, float] = {}
        self._members: set[str] = set()

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def label(self, tenant: str) -> str:
        """Count one request of ``tenant`` and return the label to put on its metrics."""
        if tenant in self._passthrough:
            return tenant
        now = self._clock.now()
        self._count(tenant, now)
        if now >= self._next_refresh:
            self._refresh(now)
        elif tenant not in self._members and len(self._members) < self.top:
            self._members.add(tenant)
        return tenant if tenant in self._members else OTHER

    def score(self, tenant: str) -> float:
        """The decayed request count of ``tenant`` now (for tests and ``policy explain``)."""
        exponent = (self._clock.now() - self._origin) / self._half_life
        return self._scores.get(tenant, 0.0) / math.exp2(exponent)

    def _count(self, tenant: str, now: float) -> None:
        exponent = (now - self._origin) / self._half_life
        if exponent > _RENORMALISE_EXPONENT:
            self._renormalise(now, exponent)
            exponent = 0.0
        self._scores[tenant] = self._scores.get(tenant, 0.0) + math.exp2(exponent)

    def _renormalise(self, now: float, exponent: float) -> None:
        scale = math.exp2(-exponent)
        self._scores = {t: s * scale for t, s in self._scores.items() if s * scale > 1e-9 or t in self._members}
        self._origin = now

    def _refresh(self, now: float) -> None:
        self._next_refresh = now + self._refresh_s
        scores = self._scores
        if len(scores) > self._max_tracked:
            keep = heapq.nlargest(self._max_tracked // 2, scores, key=scores.__getitem__)
            self._scores = scores = {t: scores[t] for t in {*keep, *self._members} if t in scores}
        members = self._members
        for challenger in heapq.nlargest(self.top, scores, key=scores.__getitem__):
            if challenger in members:
                continue
            if len(members) < self.top:
                members.add(challenger)
                continue
            weakest = min(members, key=lambda t: scores.get(t, 0.0))
            if scores[challenger] > self._hysteresis * scores.get(weakest, 0.0):
                members.discard(weakest)
                members.add(challenger)
