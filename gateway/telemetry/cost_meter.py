"""Cost on the running gateway: finished requests feed a ``CostAccountant``; each closed
interval is added to the ``gateway_cost_*`` counters.

Why a module of its own: ``gateway/telemetry/cost.py`` is the arithmetic (no clock, no metrics, no
policy), and the ``Gateway`` should only say *when* things happen: a request finished
(``record``), the policy changed (``reprice``), and a timer fired (``run`` closes an interval
every ``telemetry.cost_interval_s`` seconds, read again each time so a reload applies).

What is exported at each close: per (tenant label, model, class) the dollars, requests and
goodput requests of the interval; per backend the dollars nobody could be charged
(``gateway_cost_unattributed_dollars_total``, a priced backend that finished nothing: idle,
down, or drained), so that attributed plus unattributed dollars add up to the bill; and the
dollars per goodput request since start per model and class, a gauge to read at a glance.

Shadow copies (``gateway/shadow/runner.py``) run on priced backends too, often beside other
tenants' traffic. A copy is charged as the request a backend finished that it is
(``charge_copy``), under the tenant label ``~shadow:<group>`` (``shadow_label``), the shadow
model and the class it ran in, and never as goodput (it answers nobody). Uncharged, its engine
time would be split among the backend's real requests, i.e. billed to other tenants. Why a
label of the group's rather than unattributed dollars: the shadow is an expense somebody chose
(evaluating a candidate model), and the dollars-by-tenant panel then answers "what does this
shadow cost" beside the tenants, while unattributed keeps meaning capacity nobody used (idle,
down, drained). ``~`` starts no tenant name (``policy.model.NAME_PATTERN``), so the label never
meets a tenant's, and it is not folded into ``other``: there is one per group. Its dollars count
in the model's cost per goodput request, which they raise: money spent for no answer.

A reload that changes prices or the backend list first charges the running interval at the
old prices, then the new list applies: a removed backend stops costing (requests still in
flight on it finish and count, at 0 dollars), an added one costs from the reload on.

Usage (what ``gateway/service.py`` and the recorder do)::

    costs = CostMeter(metrics, snapshot.policy.backends, clock)
    costs.charge(outcome, tenant_label, met)           # by the recorder, once per request
    costs.charge_copy(group=..., model=..., class_name=..., backend=..., tokens=...)  # by the shadow runner
    costs.reprice(new_snapshot.policy.backends)        # on a policy reload
    spawn(costs.run(lambda: policy().telemetry.cost_interval_s))
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from gateway.clock import Clock
from gateway.telemetry.cost import CostAccountant, CostKey, CostTotal, Priced, prices_per_hour
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.token_stats import TokenStats

SHADOW_LABEL = "~shadow:"
"""The tenant label's prefix of a group's shadow copies: ``~shadow:<group>`` (module docstring)."""


def shadow_label(group: str) -> str:
    return SHADOW_LABEL + group


class ChargedRequest(Protocol):
    """What the cost meter reads of a finished request (``gateway/pipeline/outcome.py``'s
    ``RequestOutcome`` is one): declared here, since the pipeline that builds the outcome is above
    telemetry. ``backend`` is the last attempt's ('' when none was dispatched)."""

    @property
    def backend(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def class_name(self) -> str: ...
    @property
    def tokens(self) -> TokenStats | None: ...


class CostMeter:
    """The gateway's one ``CostAccountant``, fed per request and exported per interval."""

    def __init__(self, metrics: Metrics, backends: Iterable[Priced], clock: Clock, *, share: float = 1.0) -> None:
        """``share``: the part of each backend's bill this process pays. A worker of ``serve
        --workers N`` pays 1/N (``Settings.workers``), so that the set's exported dollars and
        prices add up to the bill once, not N times."""
        self._metrics = metrics
        self._clock = clock
        self._share = share
        prices = self._prices(backends)
        self.accountant = CostAccountant(prices, now=clock.now())
        self._show_prices(prices)

    def charge(self, outcome: ChargedRequest, tenant: str, goodput: bool) -> None:
        """One finished request, under its tenant *label*; one that reached no backend used no GPU time."""
        backend = outcome.backend
        if not backend:
            return
        self.accountant.add_request(
            backend=backend,
            key=CostKey(tenant, outcome.model, outcome.class_name),
            tokens=outcome.tokens.total_tokens if outcome.tokens else 0,
            goodput=goodput,
        )

    def charge_copy(self, *, group: str, model: str, class_name: str, backend: str, tokens: int) -> None:
        """One shadow copy of ``group`` that held a slot of ``backend``: charged under the group's
        label, never goodput (module docstring)."""
        key = CostKey(shadow_label(group), model, class_name)
        self.accountant.add_request(backend=backend, key=key, tokens=tokens, goodput=False)

    def reprice(self, backends: Iterable[Priced], now: float | None = None) -> None:
        """A reloaded policy: charge the running interval at the old prices, then follow the new ones."""
        prices = self._prices(backends)
        if prices == self.accountant.prices:
            return  # unchanged: keep the interval running
        self._export(self.accountant.set_prices(prices, now=self._clock.now() if now is None else now))
        self._show_prices(prices)

    def _prices(self, backends: Iterable[Priced]) -> dict[str, float]:
        return {name: per_hour * self._share for name, per_hour in prices_per_hour(backends).items()}

    def close_interval(self, now: float | None = None) -> dict[CostKey, CostTotal]:
        """Charge the interval ending ``now`` (the clock's by default), export it, return its deltas."""
        deltas = self.accountant.close_interval(self._clock.now() if now is None else now)
        self._export(deltas)
        return deltas

    async def run(self, interval_s: Callable[[], float]) -> None:
        """Close an interval every ``interval_s()`` seconds (its length is the clock's, not the sleep's)."""
        while True:
            await asyncio.sleep(interval_s())
            self.close_interval()

    def _export(self, deltas: Mapping[CostKey, CostTotal]) -> None:
        m = self._metrics
        for key, delta in deltas.items():
            labels = (key.tenant, key.model, key.class_name)
            m.child(m.cost_dollars, *labels).inc(delta.dollars)
            m.child(m.cost_requests, *labels).inc(delta.requests)
            m.child(m.cost_goodput_requests, *labels).inc(delta.goodput_requests)
        for backend, dollars in self.accountant.last_unattributed.items():
            m.child(m.cost_unattributed, backend).inc(dollars)
        for key, total in self.accountant.by(model=True, class_name=True).items():
            per_goodput = total.per_goodput_request
            if per_goodput is not None:
                m.child(m.cost_per_goodput_request, key.model, key.class_name).set(per_goodput)

    def _show_prices(self, prices: Mapping[str, float]) -> None:
        """The price gauge follows the policy; every priced backend gets its unattributed series at 0."""
        m = self._metrics
        m.backend_price.clear()
        for backend, per_hour in prices.items():
            m.backend_price.labels(backend).set(per_hour)
            m.child(m.cost_unattributed, backend)
