"""Who reaches each backend: every tenant whose requests may be sent there, by every path.

Why a module of its own: each decision that keeps cache scopes apart rests on this one answer
(``isolation.check_isolation`` refusing an unsalted engine shared by two scopes, the Messages
API passing a request through unsalted, a shadow copy doing the same), and a path it forgets
is a cross-tenant cache leak. It once counted only the models a tenant names, so a backend
that serves only a model group's targets counted as reached by nobody, and every tenant's
Messages prompts met there unsalted. So it is computed once per policy load, by the isolation
check the loader runs (``isolation.check_isolation``), and what the request path needs of it
(``multi_scope_backends``) is kept on the snapshot and read everywhere else.

The paths, for a tenant ``t`` and a backend ``b``:

    t names      a plain model m             -> m
                 a model group g             -> every member of g: its targets (by weight or
                                                rollout), every class's fallbacks, its shadow
                 "*"                         -> every public name, hence every served model
    t reaches b  when t reaches one of b's models and b serves t (``b.tenants`` unset or
                 naming t: ``serves``, the lanes' own rule in ``gateway/dispatch/backends.py``)

A model that serves a group is never called by name (``loader.internal_models``), so naming
it is not a path; ``"*"`` reaches it through its group. A follow-up pinned to the backend that
holds a response, a retry, a migration and a fallback all stay within the paths above.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gateway.dispatch.backends import serves
from gateway.policy.model import Backend, Policy, Tenant


@dataclass(frozen=True, slots=True)
class Access:
    """One tenant reaching a backend, and the model group it comes through (None: by a model's name)."""

    tenant: Tenant
    via: str | None


@dataclass(frozen=True, slots=True)
class Reach:
    """The tenants that reach each backend (module docstring), in the policy's tenant order, or in
    the backend's ``tenants`` order when it has one. Usage::

        reach = policy_reach(policy)
        [a.tenant.name for a in reach.of("h100-a")]      # ['acme', 'globex']
        reach.models_of("acme")                          # {'llama-8b-v1': 'llama-3.1-8b', 'm': None}
    """

    by_backend: Mapping[str, tuple[Access, ...]]
    models_by_tenant: Mapping[str, Mapping[str, str | None]]
    """Per tenant, every served model it reaches, with the model group it comes through (or None)."""

    def of(self, backend: str) -> tuple[Access, ...]:
        return self.by_backend.get(backend, ())

    def models_of(self, tenant: str) -> Mapping[str, str | None]:
        return self.models_by_tenant.get(tenant, MappingProxyType({}))


def policy_reach(policy: Policy) -> Reach:
    """Every backend's ``Access`` list and every tenant's reached models, by the module's rule."""
    models = {t.name: MappingProxyType(dict(_reached_models(policy, t))) for t in policy.tenants}
    by_backend: dict[str, tuple[Access, ...]] = {}
    for backend in policy.backends:
        candidates = policy.tenants
        if backend.tenants is not None:
            by_name = {t.name: t for t in policy.tenants}
            candidates = [by_name[n] for n in dict.fromkeys(backend.tenants) if n in by_name]
        by_backend[backend.name] = tuple(
            Access(t, _via(models[t.name], backend))
            for t in candidates
            if _reaches(models[t.name], backend) and serves(backend, t.name)
        )
    return Reach(MappingProxyType(by_backend), MappingProxyType(models))


def _reaches(reached: Mapping[str, str | None], backend: Backend) -> bool:
    return any(m in reached for m in backend.models)


def _via(reached: Mapping[str, str | None], backend: Backend) -> str | None:
    """The group of the first of ``backend``'s models the tenant reaches (None: it names that model)."""
    return next(reached[m] for m in backend.models if m in reached)


def _reached_models(policy: Policy, tenant: Tenant) -> Iterator[tuple[str, str | None]]:
    """``(served model, its group or None)`` for every model a request of ``tenant`` may be sent to."""
    groups = {g.name: g for g in policy.model_groups}
    internal = {m for g in policy.model_groups for m in g.members()}
    everything = "*" in tenant.models
    names = [*groups, *(m.name for m in policy.models if m.name not in internal)] if everything else tenant.models
    seen: set[str] = set()
    for name in names:
        group = groups.get(name)
        members = sorted(group.members()) if group is not None else [name]
        for model in members:
            if model not in seen:
                seen.add(model)
                yield model, None if group is None else name
