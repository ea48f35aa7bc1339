"""The frozen value a policy file becomes: the validated policy plus the hot path's lookup tables.

A module of its own, apart from the loader, so that every component can name the snapshot
without importing the loader. What the snapshot knows of the stages above ``policy`` (which
backends tenants of several cache scopes reach) is handed to it by the loader's checks
(``gateway/policy/checks.py``), never computed here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gateway.policy.checks import PolicyChecks
from gateway.policy.groups import ModelGroup
from gateway.policy.model import Backend, ModelPolicy, Policy, PriorityClass, Tenant


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    """A validated policy plus its lookup tables; never mutated, swapped whole on reload."""

    policy: Policy
    source: str
    digest: str
    tenants_by_key_hash: Mapping[str, Tenant] = field(repr=False)
    models: Mapping[str, ModelPolicy] = field(repr=False)
    backends_by_model: Mapping[str, tuple[Backend, ...]] = field(repr=False)
    checks: PolicyChecks = field(repr=False, compare=False)
    """The checks this policy passed (``gateway/policy/checks.py``): a policy derived from it
    (``gateway/policy/timescale.py``) is loaded with the same ones."""
    warnings: tuple[str, ...] = ()
    """Allowed but probably not meant, each as ``<file>:<line>:<column>: warning: <path>: <problem>``
    (``gateway/policy/loader.py``)."""
    groups: Mapping[str, ModelGroup] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    internal: frozenset[str] = frozenset()
    """Models that only serve groups (targets, fallbacks, shadows): never called, nor listed, by name."""
    multi_scope_backends: frozenset[str] = frozenset()
    """Backends tenants of several cache scopes may reach, by any path (``isolation.multi_scope_backends``,
    computed by the isolation check): no request may reach one of these without its tenant's salt."""
    json_values: int | None = None
    """The bound on a body's array elements and object members (``RequestLimits.max_json_values``, or
    the default it derives from the models)."""

    @property
    def public_models(self) -> list[str]:
        """The names clients may call: every group, and every model that serves none."""
        return [*self.groups, *(m for m in self.models if m not in self.internal)]

    @property
    def version(self) -> str:
        return self.policy.version

    def priority_class(self, name: str) -> PriorityClass:
        return self.policy.classes[name]

    def tenant_may_use(self, tenant: Tenant, model: str) -> bool:
        return "*" in tenant.models or model in tenant.models


def content_digest(data: bytes) -> str:
    """A policy file's digest: the first 12 hex digits of the SHA-256 of its bytes."""
    return hashlib.sha256(data).hexdigest()[:12]


def index_policy(
    policy: Policy,
    source: str,
    digest: str,
    checks: PolicyChecks,
    warnings: tuple[str, ...],
    multi_scope_backends: frozenset[str],
) -> PolicySnapshot:
    """The snapshot of a ``policy`` that passed ``checks``, with what they found (``warnings``,
    ``multi_scope_backends``: ``IsolationReport``)."""
    by_key = {key_hash: tenant for tenant in policy.tenants for key_hash in tenant.key_hashes}
    by_model: dict[str, list[Backend]] = {}
    for backend in policy.backends:
        for model in backend.models:
            by_model.setdefault(model, []).append(backend)
    return PolicySnapshot(
        policy=policy,
        source=source,
        digest=digest,
        tenants_by_key_hash=MappingProxyType(by_key),
        models=MappingProxyType({m.name: m for m in policy.models}),
        backends_by_model=MappingProxyType({m: tuple(bs) for m, bs in by_model.items()}),
        checks=checks,
        warnings=warnings,
        groups=MappingProxyType({g.name: g for g in policy.model_groups}),
        internal=frozenset(m for g in policy.model_groups for m in g.members()),
        multi_scope_backends=multi_scope_backends,
        json_values=json_values_bound(policy),
    )


def json_values_bound(policy: Policy) -> int:
    """``limits.max_json_values``, or when unset the largest prompt in tokens (as token ids, the
    longest list a body may need) plus the keys and containers the other bounds allow."""
    limits = policy.limits
    if limits.max_json_values is not None:
        return limits.max_json_values
    longest = max(m.max_prompt_tokens for m in policy.models)
    return longest + limits.max_json_keys + limits.max_json_containers
