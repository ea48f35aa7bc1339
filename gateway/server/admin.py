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
``GET /admin/backends`` shows what the gateway knows of each backend of the policy in force (its
KV-event feed: live or not, the blocks its index holds).

An admin key is no reason to parse loosely; the data plane's rules hold here too. A header the
endpoints act on comes once (two ``Authorization`` lines: 400 ``duplicate_header``, as
``gateway/request/intake.py`` refuses them), a JSON body has no repeated key (400 ``duplicate_key``,
``parse_json_object``) and at most ``MAX_BODY_BYTES``, refused with 413 while it is read. The
operator's name and reason go into a WARNING line and the rollout's saved state, so they must
be one line of printable text of bounded length: a line break would let a caller forge log
lines, a terminal escape rewrite what an SRE sees (400 otherwise, never a silent rewrite).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import AuthenticationFailed, Forbidden, GatewayError, InvalidRequest, NotFound, Overloaded
from gateway.policy.groups import NAME_PATTERN
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.intake import (
    ClientDisconnected,
    RequestHeaders,
    check_headers,
    parse_json_object,
    read_body,
    read_headers,
)
from gateway.request.keys import bearer_key, hash_api_key

MAX_BODY_BYTES = 65_536
"""An admin body is three short fields; 64 KiB is plenty and bounds what a key holder can send."""
MAX_DEPTH = 4
MAX_REASON_CHARS = 500
MAX_OPERATOR_CHARS = 64
_GROUP = re.compile(NAME_PATTERN)


class PolicyControl(Protocol):
    """What the admin endpoints drive (``gateway.service.Gateway``)."""

    def policy(self) -> PolicySnapshot: ...

    def reload(self, reason: str) -> bool: ...

    def policy_status(self) -> dict[str, object]: ...

    def rollout_status(self) -> list[dict[str, Any]]: ...

    async def force_rollout(self, group: str, action: str, who: str, reason: str) -> dict[str, Any]: ...

    def backends_status(self) -> list[dict[str, Any]]: ...


def _authorize(headers: RequestHeaders, gateway: PolicyControl) -> None:
    check_headers(headers)
    allowed = gateway.policy().policy.admin.key_hashes
    if not allowed:
        raise Forbidden("Admin endpoints are disabled: the policy lists no admin key.", code="admin_disabled")
    key = bearer_key(headers.authorization)
    if key is None:
        raise AuthenticationFailed("Missing admin key: send 'Authorization: Bearer <admin key>'.")
    if hash_api_key(key) not in allowed:
        raise Forbidden("This key may not use the admin endpoints.", code="not_admin")


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
                _authorize(read_headers(request.scope["headers"]), current)
                return await action(current, request)
            except GatewayError as error:
                return render(error)
            except ClientDisconnected:
                return Response(status_code=400)  # gone: nobody reads it

        return handler

    async def rollout(current: PolicyControl, request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse({"rollouts": current.rollout_status()})
        declared = read_headers(request.scope["headers"]).content_length
        group, action, reason = _rollout_order(await read_body(request.receive, declared, MAX_BODY_BYTES))
        who = _operator(request)
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

    def backends(current: PolicyControl) -> Response:
        return JSONResponse({"backends": current.backends_status()})

    return {
        "/admin/reload": guarded(reload),
        "/admin/policy": guarded(policy),
        "/admin/rollout": guarded_async(rollout),
        "/admin/backends": guarded(backends),
    }


ROLLOUT_ACTIONS = ("promote", "rollback", "hold", "resume")


def _rollout_order(body: bytes) -> tuple[str, str, str]:
    """``{"group", "action", "reason"}`` of ``POST /admin/rollout``, or 400 saying what is wrong."""
    order = parse_json_object(body, MAX_DEPTH)
    group, action, reason = order.get("group"), order.get("action"), order.get("reason", "")
    if not isinstance(group, str) or not _GROUP.match(group):
        raise InvalidRequest("'group' must name a model group.", code="invalid_field", param="group")
    if action not in ROLLOUT_ACTIONS:
        raise InvalidRequest(
            f"'action' must be one of {', '.join(ROLLOUT_ACTIONS)}.", code="invalid_field", param="action"
        )
    if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS or not reason.isprintable():
        raise InvalidRequest(
            f"'reason' must be one line of at most {MAX_REASON_CHARS} printable characters "
            "(no line break, tab or other control character).",
            code="invalid_field",
            param="reason",
        )
    return group, action, reason


def _operator(request: Request) -> str:
    """Who forces a verdict (``x-operator``, else ``admin``): once, one short printable line."""
    names = request.headers.getlist("x-operator")
    if len(names) > 1:
        raise InvalidRequest(
            "The header 'x-operator' appears more than once; send it once.",
            code="duplicate_header",
            param="x-operator",
        )
    who = names[0] if names else "admin"
    if not 0 < len(who) <= MAX_OPERATOR_CHARS or not who.isprintable():
        raise InvalidRequest(
            f"'x-operator' must be 1 to {MAX_OPERATOR_CHARS} printable characters.",
            code="invalid_header",
            param="x-operator",
        )
    return who
