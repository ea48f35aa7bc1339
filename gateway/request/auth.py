"""API key to tenant.

Keys are never stored: the policy holds ``sha256:`` digests and the presented key is hashed
and looked up (``gateway/request/keys.py`` says why that lookup is safe).
"""

from __future__ import annotations

from gateway.errors import AuthenticationFailed, ModelNotAllowed
from gateway.policy.model import Tenant
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.keys import bearer_key, hash_api_key


def authenticate(authorization: bytes | None, snapshot: PolicySnapshot) -> Tenant:
    """The tenant owning the bearer key in ``authorization``; 401 when missing or unknown."""
    if not authorization:
        raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key")
    key = bearer_key(authorization)
    if key is None:
        raise AuthenticationFailed("Malformed Authorization header: expected 'Bearer <key>'.", code="invalid_api_key")
    tenant = snapshot.tenants_by_key_hash.get(hash_api_key(key))
    if tenant is None:
        raise AuthenticationFailed("Incorrect API key provided.", code="invalid_api_key")
    return tenant


def authorize_model(tenant: Tenant, model: str, snapshot: PolicySnapshot) -> None:
    """404 when ``tenant`` may not use ``model`` (which the caller already knows exists), the very
    answer an unknown model gets (``ModelNotAllowed``): a tenant cannot learn that it exists."""
    if not snapshot.tenant_may_use(tenant, model):
        raise ModelNotAllowed(model)
