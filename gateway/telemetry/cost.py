"""Cost attribution: every request pays its share of its backend's GPU time, idle time included.

Why: a platform team compares configurations (routing policies, batch shares, fleet sizes)
by *cost per useful answer*. Tokens alone miss idle capacity; wall time alone misses that
one request of 4,000 tokens weighs more than one of 40. So the rule is:

* a backend costs ``price_per_hour`` (its price per GPU-hour times its GPUs) for every
  second it is in the fleet, busy or not;
* time is cut into accounting intervals (the caller's timer, e.g. every 15 s). Over an
  interval of ``d`` seconds a backend costs ``price_per_hour · d / 3600``, split over the
  requests it *finished* in that interval in proportion to their tokens (prompt +
  completion): request i pays ``cost · tokens_i / Σ tokens``. When every request of the
  interval has 0 tokens (all failed early), they split it equally. Idle seconds are therefore
  paid by the requests around them, so cost per request rises when capacity idles;
* an interval in which a backend finished no request cannot be charged to anyone: it is
  kept as ``unattributed[backend]`` (export it, so that totals still add up to the bill);
* a backend without a price costs nothing; its requests count with 0 dollars;
* whatever a backend finished counts, a model group's shadow copies included (under their
  group's key, ``gateway/telemetry/cost_meter.py``): a copy left out would have its engine time paid by
  the other requests of its interval, i.e. by other tenants.

Totals are kept per ``CostKey`` (tenant, model, class; pass the tenant *label*, already
folded by ``gateway.telemetry.labels``, so the key set stays bounded), with the number of requests
and of goodput requests (those that met every SLO of their class), so that
``cost_per_goodput_request`` is the dollars over the goodput requests of the same intervals.
A request is counted in the interval it finishes in: with intervals of a few times the
typical E2E the distortion is small, and it needs no per-request timeline.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

K = TypeVar("K")

SECONDS_PER_HOUR = 3600.0


class Priced(Protocol):
    """What a price list needs of a backend (``gateway.policy.model.Backend`` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def price_per_gpu_hour(self) -> float | None: ...
    @property
    def gpus(self) -> int: ...


def prices_per_hour(backends: Iterable[Priced]) -> dict[str, float]:
    """Dollars an hour of every priced backend (price per GPU-hour × GPUs); unpriced ones are left out."""
    return {b.name: b.price_per_gpu_hour * b.gpus for b in backends if b.price_per_gpu_hour is not None}


@dataclass(frozen=True, slots=True)
class CostKey:
    tenant: str
    model: str
    class_name: str


@dataclass(slots=True)
class CostTotal:
    """Dollars, requests, goodput requests and tokens of one key (a running total or a delta)."""

    dollars: float = 0.0
    requests: int = 0
    goodput_requests: int = 0
    tokens: int = 0

    def add(self, other: CostTotal) -> None:
        self.dollars += other.dollars
        self.requests += other.requests
        self.goodput_requests += other.goodput_requests
        self.tokens += other.tokens

    @property
    def per_request(self) -> float | None:
        return self.dollars / self.requests if self.requests else None

    @property
    def per_goodput_request(self) -> float | None:
        return self.dollars / self.goodput_requests if self.goodput_requests else None


def split_cost(cost: float, weights: Sequence[tuple[K, int]]) -> dict[K, float]:
    """``cost`` split over keys in proportion to their weights (equally when all are 0).

    A key may appear several times; its shares add up. No weights: nothing to split onto.
    """
    out: dict[K, float] = {}
    if not weights:
        return out
    total = sum(w for _, w in weights)
    for key, weight in weights:
        share = cost * weight / total if total > 0 else cost / len(weights)
        out[key] = out.get(key, 0.0) + share
    return out


class CostAccountant:
    """Collects finished requests per backend and charges each interval when the timer closes it.

    Usage::

        costs = CostAccountant({"h100-a": 2 * 4.0}, now=clock.now())   # 2 GPUs at $4/GPU-hour
        costs.add_request(backend="h100-a", key=CostKey("acme", "llama", "interactive"), tokens=812, goodput=True)
        for key, delta in costs.close_interval(clock.now()).items(): ...   # every 15 s
    """

    def __init__(self, prices_per_hour: Mapping[str, float], *, now: float) -> None:
        self._prices = dict(prices_per_hour)
        self._start = now
        self._pending: dict[str, dict[CostKey, CostTotal]] = {}
        self.totals: dict[CostKey, CostTotal] = {}
        self.unattributed: dict[str, float] = {}
        """Dollars per backend of intervals in which it finished no request."""
        self.last_unattributed: dict[str, float] = {}
        """The same, of the last closed interval only (what to add to the counter)."""

    @property
    def interval_start(self) -> float:
        """When the running interval began (the ``now`` of the last close, or of construction)."""
        return self._start

    @property
    def prices(self) -> Mapping[str, float]:
        """Dollars an hour per priced backend, as in force."""
        return self._prices

    @property
    def pending_requests(self) -> int:
        """Requests recorded in the running interval, not yet charged."""
        return sum(p.requests for served in self._pending.values() for p in served.values())

    def add_request(self, *, backend: str, key: CostKey, tokens: int, goodput: bool) -> None:
        """One finished request that a backend served (call once, from ``Gateway.record``)."""
        per_backend = self._pending.setdefault(backend, {})
        pending = per_backend.get(key)
        if pending is None:
            pending = per_backend[key] = CostTotal()
        pending.requests += 1
        pending.goodput_requests += 1 if goodput else 0
        pending.tokens += max(0, tokens)

    def close_interval(self, now: float) -> dict[CostKey, CostTotal]:
        """Charge the interval ending at ``now``; return this interval's delta per key (for counters)."""
        seconds = max(0.0, now - self._start)
        self._start = now
        deltas: dict[CostKey, CostTotal] = {}
        self.last_unattributed = {}
        for backend in self._prices.keys() | self._pending.keys():
            cost = self._prices.get(backend, 0.0) * seconds / SECONDS_PER_HOUR
            served = self._pending.pop(backend, {})
            if not served:
                if cost:
                    self.unattributed[backend] = self.unattributed.get(backend, 0.0) + cost
                    self.last_unattributed[backend] = cost
                continue
            shares = split_cost(cost, _weights(served))
            for key, pending in served.items():
                pending.dollars = shares[key]
                deltas.setdefault(key, CostTotal()).add(pending)
        for key, delta in deltas.items():
            self.totals.setdefault(key, CostTotal()).add(delta)
        return deltas

    def set_prices(self, prices_per_hour: Mapping[str, float], *, now: float) -> dict[CostKey, CostTotal]:
        """New prices (a policy reload): the running interval is charged at the old ones first."""
        deltas = self.close_interval(now)
        self._prices = dict(prices_per_hour)
        return deltas

    def by(self, *, class_name: bool = True, model: bool = False, tenant: bool = False) -> dict[CostKey, CostTotal]:
        """Totals rolled up to the chosen dimensions (the others become ``*``)."""
        out: dict[CostKey, CostTotal] = {}
        for key, total in self.totals.items():
            rolled = CostKey(
                key.tenant if tenant else "*", key.model if model else "*", key.class_name if class_name else "*"
            )
            out.setdefault(rolled, CostTotal()).add(total)
        return out


def _weights(served: Mapping[CostKey, CostTotal]) -> list[tuple[CostKey, int]]:
    """Tokens per key; when no request carried tokens, the request count (an equal split per request)."""
    if any(p.tokens for p in served.values()):
        return [(key, p.tokens) for key, p in served.items()]
    return [(key, p.requests) for key, p in served.items()]
