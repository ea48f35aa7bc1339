"""Tenant isolation of prefix caches: the scope of a tenant and the ``cache_salt`` derived from it.

Every tenant is its own scope (``tenant:<name>``) unless it opted into a shared scope declared
in the policy (``scope:<name>``). The scope seeds the routing keys (``prefix_keys.py``) and,
for backends whose engine honours it (vLLM and the simulator), the request's ``cache_salt``:

    cache_salt = hex(HMAC-SHA256(secret, scope))[:32]

The engine seeds its block-hash chain with the salt, so the same prompt under two scopes never
shares a cached block, and nobody who lacks the secret can compute (or guess) another tenant's
salt. The secret is read from the environment variable the policy names
(``cache_isolation.secret_env``); without it each process draws a random one, which is safe but
means replicas do not share engine caches (a warning says so). A ``cache_salt`` sent by the
client is always overwritten.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping

from gateway.policy.model import BackendKind, Tenant

log = logging.getLogger(__name__)

SALTED_KINDS = frozenset({BackendKind.VLLM, BackendKind.SIM})
"""Backends whose engine reads ``cache_salt`` (vLLM >= 0.9, the simulator)."""


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
