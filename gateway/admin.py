"""Operator endpoints: ``POST /admin/reload`` and ``GET /admin/policy``, behind an admin key.

Admin keys are separate from tenant keys (``admin.key_hashes`` in the policy, SHA-256 like
tenants'); with none configured the endpoints answer 403, so a default install exposes no
control surface. ``/admin/policy`` tells an SRE which policy is in force (version, digest,
source) and how the last reload went; ``/admin/reload`` re-reads the file now, validates it
first and keeps the old policy if the new one is invalid (answering 422 with the errors).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import AuthenticationFailed, GatewayError, ModelNotAllowed, Overloaded
from gateway.keys import bearer_key, hash_api_key
from gateway.policy.snapshot import PolicySnapshot


class PolicyControl(Protocol):
    """What the admin endpoints drive (``gateway.service.Gateway``)."""

    def policy(self) -> PolicySnapshot: ...

    def reload(self, reason: str) -> bool: ...

    def policy_status(self) -> dict[str, object]: ...


def _authorize(request: Request, gateway: PolicyControl) -> None:
    allowed = gateway.policy().policy.admin.key_hashes
    if not allowed:
        raise ModelNotAllowed("Admin endpoints are disabled: the policy lists no admin key.", code="admin_disabled")
    key = bearer_key(request.headers.get("authorization", "").encode())
    if key is None:
        raise AuthenticationFailed("Missing admin key: send 'Authorization: Bearer <admin key>'.")
    if hash_api_key(key) not in allowed:
        raise ModelNotAllowed("This key may not use the admin endpoints.", code="not_admin")


Handler = Callable[[Request], Awaitable[Response]]


def admin_routes(
    gateway: Callable[[], PolicyControl | None], render: Callable[[GatewayError], Response]
) -> dict[str, Handler]:
    """The handlers by path, for the app's router; each checks the admin key first."""

    def guarded(action: Callable[[PolicyControl], Response]) -> Handler:
        async def handler(request: Request) -> Response:
            current = gateway()
            if current is None:
                return render(Overloaded("The gateway is starting.", status=503, code="starting", retry_after_s=1.0))
            try:
                _authorize(request, current)
            except GatewayError as error:
                return render(error)
            return action(current)

        return handler

    def reload(current: PolicyControl) -> Response:
        applied = current.reload("admin")
        return JSONResponse(current.policy_status(), status_code=200 if applied else 422)

    def policy(current: PolicyControl) -> Response:
        return JSONResponse(current.policy_status())

    return {"/admin/reload": guarded(reload), "/admin/policy": guarded(policy)}
