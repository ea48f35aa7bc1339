"""The policy-dependent part of the running gateway: built whole, swapped whole.

The rule (a reload is one computed swap):

1. Everything a new policy needs is built from (the runtime in force, the new policy) by
   ``RuntimeBuilder.plan`` *before* anything changes: the routers, the backend pool's new
   states, the upstream credentials and URLs, the tracer, the cache salter and the prefix
   secret (both from ``cache_isolation``, rebuilt together; a new secret makes new chains, so
   every router is rebuilt with it), the retry budget, the tenant labels. A part whose policy
   section did not change is carried over with what it learnt (a router's prefix index, the
   retry budget's window, the tracer's export thread); the others are built new.
2. If any part cannot be built (a backend whose ``credential_env`` is unset, ...), ``plan``
   raises ``ReloadRefused`` with the reason and nothing has changed: the policy in force,
   ``/readyz``, ``/admin/policy`` and ``gateway_policy_info`` all still say the old version.
3. Otherwise the gateway installs the plan (``gateway/service.py``) in one step on the event
   loop: no request runs in between, so none sees half of it.

A request reads the ``Runtime`` once, at arrival, and keeps it to the end: its tenant, limits,
classes and tracer are those of the policy it started with. The live, policy-independent
state (backend load, queues, breakers' history) lives in the long-lived components
(``BackendPool``, ``Dispatcher``), which ``install`` updates in place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gateway.clock import Clock
from gateway.dispatch.backends import BackendPool, PoolPlan
from gateway.dispatch.router import Router
from gateway.policy.model import TracingConfig
from gateway.policy.snapshot import PolicySnapshot
from gateway.policy.watch import ReloadRefused
from gateway.routing.engine_view import EngineView
from gateway.routing.isolation import CacheSalter
from gateway.routing.prefix_secret import PrefixSecret
from gateway.routing.registry import build_routers, update_routers
from gateway.telemetry.labels import TenantLabels
from gateway.telemetry.tracing import Tracing
from gateway.upstream.client import MissingCredential, UpstreamClient, UpstreamTargets
from gateway.upstream.retry import RetryBudget

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Runtime:
    """What one policy decides for the request path; a request keeps the one it arrived under."""

    snapshot: PolicySnapshot
    routers: Mapping[str, Router]
    tracing: Tracing
    salter: CacheSalter
    prefix_secret: PrefixSecret
    """The salter's secret keying the prefix chains (``gateway/routing/prefix_secret.py``)."""
    retry_budget: RetryBudget
    tenant_labels: TenantLabels

    def router(self, model: str) -> Router:
        return self.routers[model]


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """A new ``Runtime`` and what installing it changes in the long-lived components."""

    runtime: Runtime
    pool: PoolPlan
    upstream: UpstreamTargets
    retired_tracing: Tracing | None
    """The tracer the new runtime replaces: flushed and stopped once the plan is installed."""


class RuntimeBuilder:
    """Builds the first runtime and plans each reload (see the module docstring)."""

    def __init__(
        self,
        clock: Clock,
        *,
        epoch_offset: float,
        telemetry: bool,
        on_spans_dropped: Callable[[int], None],
        engines: EngineView | None = None,
    ) -> None:
        """``telemetry=False`` (``GATEWAY_TELEMETRY=off``) keeps tracing off whatever the policy says."""
        self.clock = clock
        self.epoch_offset = epoch_offset
        self.telemetry = telemetry
        self._on_spans_dropped = on_spans_dropped
        self.engines = engines
        """What the engines report holding (KV events), given to every prefix router it builds."""

    def first(self, snapshot: PolicySnapshot) -> Runtime:
        policy = snapshot.policy
        secret = PrefixSecret.from_env(policy.cache_isolation.secret_env)
        return Runtime(
            snapshot=snapshot,
            routers=MappingProxyType(build_routers(snapshot, self.clock, secret, self.engines)),
            tracing=self._tracing(self.tracing_config(snapshot)),
            salter=CacheSalter.from_env(policy.cache_isolation.secret_env),
            prefix_secret=secret,
            retry_budget=RetryBudget.from_policy(policy.retry, self.clock),
            tenant_labels=TenantLabels(top=policy.telemetry.top_tenants, clock=self.clock),
        )

    def plan(self, current: Runtime, new: PolicySnapshot, pool: BackendPool) -> ReloadPlan:
        """Everything ``new`` needs, built now; ``ReloadRefused`` (and nothing changed) if a part cannot be."""
        old, policy = current.snapshot.policy, new.policy
        try:
            targets = UpstreamClient.prepare({b.name: b for b in policy.backends})
        except MissingCredential as exc:
            raise ReloadRefused(str(exc)) from exc
        if policy.state != old.state:
            log.warning("policy section 'state' changed: the limit store keeps its settings until a restart")
        if policy.fleet.cell != old.fleet.cell:
            log.warning("fleet.cell changed: this process stays in cell %r until a restart", old.fleet.cell)
        same_secret = policy.cache_isolation == old.cache_isolation
        secret = current.prefix_secret if same_secret else PrefixSecret.from_env(policy.cache_isolation.secret_env)
        routers = (
            update_routers(current.routers, current.snapshot, new, self.clock, secret, self.engines)
            if same_secret
            else build_routers(new, self.clock, secret, self.engines)
        )
        pool_plan = pool.plan(new)
        retry, old_retry = policy.retry, old.retry
        same_budget = (retry.budget_ratio, retry.budget_min_per_s, retry.budget_window_s) == (
            old_retry.budget_ratio,
            old_retry.budget_min_per_s,
            old_retry.budget_window_s,
        )
        tracing_config = self.tracing_config(new)
        same_tracing = tracing_config == current.tracing.config
        runtime = Runtime(
            snapshot=new,
            routers=MappingProxyType(routers),
            # Built last: a new tracer starts an export thread, which a refusal above would leak.
            tracing=current.tracing if same_tracing else self._tracing(tracing_config),
            salter=current.salter if same_secret else CacheSalter.from_env(policy.cache_isolation.secret_env),
            prefix_secret=secret,
            retry_budget=current.retry_budget if same_budget else RetryBudget.from_policy(retry, self.clock),
            tenant_labels=current.tenant_labels
            if policy.telemetry.top_tenants == old.telemetry.top_tenants
            else TenantLabels(top=policy.telemetry.top_tenants, clock=self.clock),
        )
        return ReloadPlan(runtime, pool_plan, targets, None if same_tracing else current.tracing)

    def tracing_config(self, snapshot: PolicySnapshot) -> TracingConfig:
        """The policy's ``telemetry.tracing``, else the standard ``OTEL_*`` variables; off without telemetry."""
        if not self.telemetry:
            return TracingConfig()
        return snapshot.policy.telemetry.tracing or TracingConfig.from_env()

    def _tracing(self, config: TracingConfig) -> Tracing:
        return Tracing(config, epoch_offset=self.epoch_offset, on_dropped=self._on_spans_dropped)
