"""API key to tenant.

Keys are never stored: the policy holds ``sha256:`` digests and the presented key is hashed
and looked up. The comparison is a dict lookup on the digest, so its timing depends on the
digest (which an attacker cannot steer towards a valid key), not on the key's prefix.
"""

from __future__ import annotations

import hashlib

from gateway.errors import AuthenticationFailed, ModelNotAllowed
from gateway.policy.model import Tenant
from gateway.policy.snapshot import PolicySnapshot


def authenticate(authorization: bytes | None, snapshot: PolicySnapshot) -> Tenant:
    """The tenant owning the bearer key in ``authorization``; 401 when missing or unknown."""
    if not authorization:
        raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key")
    scheme, _, key = authorization.partition(b" ")
    key = key.strip()
    if scheme.lower() != b"bearer" or not key:
        raise AuthenticationFailed("Malformed Authorization header: expected 'Bearer <key>'.", code="invalid_api_key")
    tenant = snapshot.tenants_by_key_hash.get("sha256:" + hashlib.sha256(key).hexdigest())
    if tenant is None:
        raise AuthenticationFailed("Incorrect API key provided.", code="invalid_api_key")
    return tenant


def authorize_model(tenant: Tenant, model: str, snapshot: PolicySnapshot) -> None:
    """403 when ``tenant`` may not use ``model`` (which the caller already knows exists)."""
    if not snapshot.tenant_may_use(tenant, model):
        raise ModelNotAllowed(f"Tenant '{tenant.name}' is not allowed to use model '{model}'.", param="model")
