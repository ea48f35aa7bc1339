"""Operator endpoints: ``POST /admin/reload``, ``GET /admin/policy``, ``GET|POST /admin/rollout``,
behind an admin key.

Admin keys are separate from tenant keys (``admin.key_hashes`` in the policy, SHA-256 like
tenants'); with none configured the endpoints answer 403, so a default install exposes no
control surface. ``/admin/policy`` tells an SRE which policy is in force (version, digest,
source) and how the last reload went; ``/admin/reload`` re-reads the file now, validates it
first and keeps the old policy if the new one is invalid (answering 422 with the errors).
``GET /admin/rollout`` shows every rollout (split, state, last verdict and its evidence, recent
decisions); ``POST /admin/rollout`` with ``{"group": ..., "action": "promote" | "rollback" |
"hold" | "resume", "reason": "..."}`` forces a verdict, saved like the canary's own
(``gateway/rollout/controller.py``); the operator is named by ``x-operator`` (else ``admin``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import AuthenticationFailed, GatewayError, InvalidRequest, ModelNotAllowed, NotFound, Overloaded
from gateway.keys import bearer_key, hash_api_key
from gateway.policy.snapshot import PolicySnapshot


class PolicyControl(Protocol):
    """What the admin endpoints drive (``gateway.service.Gateway``)."""

    def policy(self) -> PolicySnapshot: ...

    def reload(self, reason: str) -> bool: ...

    def policy_status(self) -> dict[str, object]: ...

    def rollout_status(self) -> list[dict[str, Any]]: ...

    async def force_rollout(self, group: str, action: str, who: str, reason: str) -> dict[str, Any]: ...


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
        async def act(current: PolicyControl, request: Request) -> Response:
            return action(current)

        return guarded_async(act)

    def guarded_async(action: Callable[[PolicyControl, Request], Awaitable[Response]]) -> Handler:
        async def handler(request: Request) -> Response:
            current = gateway()
            if current is None:
                return render(Overloaded("The gateway is starting.", status=503, code="starting", retry_after_s=1.0))
            try:
                _authorize(request, current)
                return await action(current, request)
            except GatewayError as error:
                return render(error)

        return handler

    async def rollout(current: PolicyControl, request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse({"rollouts": current.rollout_status()})
        group, action, reason = _rollout_order(await request.body())
        who = request.headers.get("x-operator", "admin")[:64]
        try:
            state = await current.force_rollout(group, action, who, reason)
        except KeyError:
            raise NotFound(f"Model group '{group}' has no rollout in the policy in force.", param="group") from None
        except ValueError as why:  # the transition is not allowed from the rollout's state
            raise InvalidRequest(str(why), code="invalid_field", param="action") from None
        return JSONResponse(state)

    def reload(current: PolicyControl) -> Response:
        applied = current.reload("admin")
        return JSONResponse(current.policy_status(), status_code=200 if applied else 422)

    def policy(current: PolicyControl) -> Response:
        return JSONResponse(current.policy_status())

    return {
        "/admin/reload": guarded(reload),
        "/admin/policy": guarded(policy),
        "/admin/rollout": guarded_async(rollout),
    }


ROLLOUT_ACTIONS = ("promote", "rollback", "hold", "resume")


def _rollout_order(body: bytes) -> tuple[str, str, str]:
    """``{"group", "action", "reason"}`` of ``POST /admin/rollout``, or 400 saying what is wrong."""
    try:
        order = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidRequest("The body must be a JSON object.", code="invalid_json") from None
    if not isinstance(order, dict):
        raise InvalidRequest("The body must be a JSON object.", code="invalid_json")
    group, action, reason = order.get("group"), order.get("action"), order.get("reason", "")
    if not isinstance(group, str) or not group:
        raise InvalidRequest("'group' must name a model group.", code="invalid_field", param="group")
    if action not in ROLLOUT_ACTIONS:
        raise InvalidRequest(
            f"'action' must be one of {', '.join(ROLLOUT_ACTIONS)}.", code="invalid_field", param="action"
        )
    if not isinstance(reason, str) or len(reason) > 500:
        raise InvalidRequest(
            "'reason' must be a string of at most 500 characters.", code="invalid_field", param="reason"
        )
    return group, action, reason
