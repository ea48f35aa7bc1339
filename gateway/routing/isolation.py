"""Tenant isolation of prefix caches: the scope of a tenant, the ``cache_salt`` derived from it,
and what keeps tenants apart on engines that cannot be salted.

Every tenant is its own scope (``tenant:<name>``) unless it opted into a shared scope declared
in the policy (``scope:<name>``). The scope seeds the routing keys (``prefix_keys.py``) and,
for backends whose engine honours it (vLLM, SGLang and the simulator: ``EngineKind.salted`` in
``gateway/engines.py``, which says what each engine does with it), the request's ``cache_salt``:

    cache_salt = hex(HMAC-SHA256(secret, scope))[:32]

The engine seeds its block-hash chain with the salt, so the same prompt under two scopes never
shares a cached block, and nobody who lacks the secret can compute (or guess) another tenant's
salt. The secret is read from the environment variable the policy names
(``cache_isolation.secret_env``); without it each process draws a random one, which is safe but
means replicas do not share engine caches (a warning says so). A ``cache_salt`` sent by the
client is always overwritten.

The engine's cache is a side channel: a tenant that gets a prompt back faster than it could be
computed learns that another tenant sent it (measured through a shared llama.cpp: 3,008 cached
tokens in 24 ms against 141 ms). Engines without a salt (``llamacpp``, ``openai``) are kept
apart by the policy's ``cache_isolation.unsalted`` (``UnsaltedMode``), checked at load by
``check_isolation`` (one of the loader's ``PolicyChecks``, ``gateway/policy/checks.py``); the rule,
per backend, is:

    isolating = engine(kind).salted
                or (engine(kind).prompt_cache_switch and unsalted == no_prompt_cache)
    scopes    = the cache scopes of the tenants that reach it, by every path: the models they
                name, the model groups they name (targets, fallbacks, shadow), "*"
                (``gateway/routing/reach.py``), within ``Backend.tenants`` when it is set
    not isolating and len(scopes) > 1:  shared -> warning; no_prompt_cache, dedicated -> refused

The same ``scopes`` decide where a request may reach a salted engine without its salt: vLLM's
own ``/v1/messages`` drops ``cache_salt``, so a Messages request is passed through only to a
backend of one scope (``multi_scope_backends``), and translated to chat everywhere else.

Routing honours ``Backend.tenants`` for every kind (``serves``): a tenant is only ever offered
the backends that serve it, which is also how dedicated capacity is declared.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from gateway.dispatch.backends import serves
from gateway.engines import engine
from gateway.policy.checks import IsolationReport
from gateway.policy.model import Backend, BackendKind, Policy, Tenant, UnsaltedMode
from gateway.routing.reach import Access, Reach, policy_reach

log = logging.getLogger(__name__)

_NO_FIELDS: Mapping[str, object] = MappingProxyType({})
_NO_PROMPT_CACHE: Mapping[str, object] = MappingProxyType({"cache_prompt": False})
_NAMES_SHOWN = 10


def isolation_fields(
    kind: BackendKind, unsalted: UnsaltedMode, salter: CacheSalter, tenant: Tenant
) -> Mapping[str, object]:
    """The body fields that isolate ``tenant`` on a backend of ``kind``; they overwrite the client's.

    ``cache_salt`` for salted kinds; ``cache_prompt: false`` for kinds with the prompt-cache switch
    (llama.cpp) under ``no_prompt_cache``; nothing otherwise (isolation then rests on routing, see
    ``serves``). Both facts are the kind's record (``gateway/engines.py``)."""
    record = engine(kind)
    if record.salted:
        return {"cache_salt": salter.salt(tenant_scope(tenant))}
    if unsalted is UnsaltedMode.NO_PROMPT_CACHE and record.prompt_cache_switch:
        return _NO_PROMPT_CACHE
    return _NO_FIELDS


def isolates(kind: BackendKind, unsalted: UnsaltedMode) -> bool:
    """Whether a backend of ``kind`` keeps scopes apart by itself, whoever reaches it."""
    record = engine(kind)
    return record.salted or (unsalted is UnsaltedMode.NO_PROMPT_CACHE and record.prompt_cache_switch)


def tenant_scope(tenant: Tenant) -> str:
    """``scope:<shared scope>`` when the tenant opted into one, else ``tenant:<name>``."""
    return f"scope:{tenant.cache_scope}" if tenant.cache_scope else f"tenant:{tenant.name}"


class CacheSalter:
    """Salts per scope, memoised (the set of scopes is bounded by the policy's tenants).

    Usage: ``CacheSalter.from_env("GATEWAY_CACHE_SALT_SECRET").salt("tenant:acme")``.
    """

    __slots__ = ("_memo", "_secret", "shared")

    def __init__(self, secret: bytes, *, shared: bool = True) -> None:
        if not secret:
            raise ValueError("the cache-salt secret must not be empty")
        self._secret = secret
        self._memo: dict[str, str] = {}
        self.shared = shared
        """False when the secret is this process's own random one."""

    @classmethod
    def from_env(cls, env_name: str, environ: Mapping[str, str] | None = None) -> CacheSalter:
        value = (os.environ if environ is None else environ).get(env_name, "")
        if value:
            return cls(value.encode())
        log.warning(
            "%s is not set: cache_salt uses a random per-process secret, so gateway replicas "
            "will not share engine prefix caches (set it to the same secret on every replica)",
            env_name,
        )
        return cls(os.urandom(32), shared=False)

    def salt(self, scope: str) -> str:
        salt = self._memo.get(scope)
        if salt is None:
            salt = hmac.new(self._secret, scope.encode(), hashlib.sha256).hexdigest()[:32]
            self._memo[scope] = salt
        return salt

    def __repr__(self) -> str:
        return f"CacheSalter(shared={self.shared}, scopes={len(self._memo)})"


def check_isolation(policy: Policy, reach: Reach | None = None) -> IsolationReport:
    """The load-time half of the rule in the module docstring, with a path in every message, and
    the policy's ``multi_scope_backends`` (the snapshot keeps them for the request path).

    ``reach``: the policy's ``policy_reach``, when the caller has computed it already."""
    reach = policy_reach(policy) if reach is None else reach
    problems: list[str] = []
    warnings: list[str] = []
    tenants = {t.name: t for t in policy.tenants}
    mode = policy.cache_isolation.unsalted
    for i, backend in enumerate(policy.backends):
        accesses = reach.of(backend.name)
        for j, name in enumerate(backend.tenants or ()):
            if name not in tenants:
                problems.append(f"backends[{i}].tenants[{j}]: unknown tenant '{name}'")
            elif not any(a.tenant.name == name for a in accesses):
                warnings.append(f"backends[{i}].tenants[{j}]: tenant '{name}' may use none of this backend's models")
        if isolates(backend.kind, mode) or len(_scopes(accesses)) < 2:
            continue
        if mode is UnsaltedMode.SHARED:
            warnings.append(_shared_warning(i, backend, accesses))
        elif mode is UnsaltedMode.DEDICATED and backend.tenants is not None:
            problems.extend(_shared_tenants(i, backend, accesses))
        else:
            problems.append(_shared_problem(i, backend, accesses, mode))
    warnings.extend(_stranded_tenants(policy, reach))
    return IsolationReport(tuple(problems), tuple(warnings), multi_scope_backends(policy, reach))


def multi_scope_backends(policy: Policy, reach: Reach | None = None) -> frozenset[str]:
    """The backends that tenants of two cache scopes or more may reach, by any path: on these, and
    only these, a request that reached the engine without its ``cache_salt`` could share cached
    blocks with another scope's (the Messages API decides passthrough by it,
    ``gateway/dialects/messages.py``, and so do shadow copies)."""
    reach = policy_reach(policy) if reach is None else reach
    return frozenset(b.name for b in policy.backends if len(_scopes(reach.of(b.name))) > 1)


def _scopes(accesses: tuple[Access, ...]) -> set[str]:
    return {tenant_scope(a.tenant) for a in accesses}


def _shared_warning(i: int, backend: Backend, reach: tuple[Access, ...]) -> str:
    remedy = "no_prompt_cache or dedicated" if engine(backend.kind).prompt_cache_switch else "dedicated"
    return (
        f"backends[{i}]: '{backend.name}' ({backend.kind.value}) cannot salt its prefix cache and serves tenants of "
        f"different cache scopes: {_listing(reach)}; each can time whether another sent a prompt "
        f"(cache_isolation.unsalted is shared; set it to {remedy}, or give the backend tenants: of one scope)"
    )


def _shared_problem(i: int, backend: Backend, reach: tuple[Access, ...], mode: UnsaltedMode) -> str:
    if mode is UnsaltedMode.NO_PROMPT_CACHE:
        why = "has no switch to turn prompt caching off (cache_isolation.unsalted: no_prompt_cache)"
        remedy = "give it tenants: of one cache scope, or set cache_isolation.unsalted: dedicated"
    else:
        why = "is not salted (cache_isolation.unsalted: dedicated)"
        remedy = "list in its tenants: the tenants it serves, all of one cache scope"
    return (
        f"backends[{i}]: '{backend.name}' ({backend.kind.value}) {why} and serves tenants of different cache "
        f"scopes: {_listing(reach)}; {remedy}"
    )


def _shared_tenants(i: int, backend: Backend, reach: tuple[Access, ...]) -> Iterator[str]:
    """One problem per tenant of ``backend.tenants`` whose scope is not the first tenant's."""
    first = reach[0].tenant
    assert backend.tenants is not None
    for j, name in enumerate(backend.tenants):
        access = next((a for a in reach if a.tenant.name == name), None)
        if access is not None and tenant_scope(access.tenant) != tenant_scope(first):
            yield (
                f"backends[{i}].tenants[{j}]: tenant '{name}'{_through(access)} shares unsalted backend "
                f"'{backend.name}' with '{first.name}' (another cache scope; cache_isolation.unsalted is dedicated)"
            )


def _stranded_tenants(policy: Policy, reach: Reach) -> Iterator[str]:
    """Tenants that reach a model no backend of which serves them: their requests for it get a 503."""
    by_model: dict[str, list[Backend]] = {}
    for backend in policy.backends:
        for model in backend.models:
            by_model.setdefault(model, []).append(backend)
    for i, tenant in enumerate(policy.tenants):
        for model, via in reach.models_of(tenant.name).items():
            backends = by_model.get(model)
            if backends and not any(serves(b, tenant.name) for b in backends):
                through = f" (through model group '{via}')" if via is not None else ""
                yield (
                    f"tenants[{i}]: tenant '{tenant.name}' may use model '{model}'{through} but none of its "
                    f"backends serves this tenant (their tenants: lists leave it out); its requests for it get 503 "
                    f"no_backend_for_tenant"
                )


def _through(access: Access) -> str:
    """`` (through model group 'g')`` when the tenant reaches the backend through a group."""
    return f" (through model group '{access.via}')" if access.via is not None else ""


def _listing(reach: tuple[Access, ...]) -> str:
    """``'acme', 'shared-a' (scope 'public-bot'), 'globex' (through 'grp')`` ..., at most
    ``_NAMES_SHOWN`` names."""
    shown = [
        f"'{a.tenant.name}'" + (f" (scope '{a.tenant.cache_scope}')" if a.tenant.cache_scope else "") + _through(a)
        for a in reach[:_NAMES_SHOWN]
    ]
    more = len(reach) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")
