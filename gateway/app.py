"""The ASGI application: the routes, and the lifespan that builds the ``Gateway``.

The inference endpoints (one per registered dialect, ``gateway/dialects/registry.py``) are
dispatched by a dict lookup on the path straight to their ``InferenceHandler`` (pure ASGI: no
routing or middleware layers on the hot path, which cost about 0.1 ms a request). Everything
else (health, readiness, metrics, the model list, admin) goes through a starlette ``Router``.
The ``Gateway`` (``gateway/service.py``) is built in the lifespan and its collaborators passed
explicitly; there are no module globals.

``build_server`` puts the app behind the gateway's server (``gateway/server/serve.py``), which
sits below the app in the stage order and takes it from here rather than importing it.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, Router
from starlette.types import Message, Receive, Scope, Send

from gateway.dialects.registry import DIALECTS
from gateway.errors import GatewayError, MethodNotAllowed, NotFound, Overloaded
from gateway.pipeline.client_response import COMMON_HEADERS
from gateway.pipeline.handler import InferenceHandler
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.auth import authenticate
from gateway.request.intake import check_headers, credential, read_headers
from gateway.routing.targets import unready_public
from gateway.server.admin import admin_routes
from gateway.server.connections import is_operator_request
from gateway.server.lifecycle import Drainable
from gateway.server.serve import GatewayServer, server_for
from gateway.service import Gateway, load_policy
from gateway.settings import Settings
from gateway.telemetry.metrics import ConnectionCounts

log = logging.getLogger(__name__)


def error_response(error: GatewayError, render: Callable[[GatewayError], bytes] = GatewayError.body) -> Response:
    """``error`` as a whole JSON response; ``render``: the API's error shape (``Dialect.error_body``)."""
    return Response(render(error), status_code=error.status, headers=error.headers, media_type="application/json")


def with_common_headers(scope: Scope, send: Send) -> Send:
    """``send`` that adds ``x-request-id`` (the client's valid one, else a new one) and
    ``x-content-type-options: nosniff`` to the response, as the inference responses carry them."""
    request_id = read_headers(scope["headers"]).request_id
    assert request_id is not None
    headers = [(b"x-request-id", request_id.encode()), *COMMON_HEADERS]

    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), *headers]
        await send(message)

    return send_with_headers


def starting() -> Response:
    """What every endpoint but the probes answers before the lifespan has built the gateway."""
    return error_response(Overloaded("The gateway is starting.", status=503, code="starting", retry_after_s=1.0))


class OpenAIRoute(Route):
    """A ``Route`` whose 405 has the OpenAI error shape (starlette's own is plain text)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.methods and scope["method"] not in self.methods:
            allowed = ", ".join(sorted(self.methods))
            error = MethodNotAllowed(f"{self.path} accepts {allowed} only.", headers={"allow": allowed})
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def request_path(scope: Scope) -> str | None:
    """The path as the client sent it, or None when it is percent-encoded.

    Routing uses the raw path: a decoded one would let ``/admin%2Fpolicy`` or ``/%6detrics``
    reach endpoints that a proxy or a rule in front of the gateway thinks it has filtered. No
    endpoint of the gateway has an escaped character in its path, so an escaped path is a 404."""
    raw: bytes | None = scope.get("raw_path")
    if raw is None:
        return str(scope["path"])
    if b"%" in raw:
        return None
    return raw.decode("latin-1")


class GatewayApp:
    """The ASGI entry point. ``GatewayApp(settings)`` loads the policy in its lifespan.

    Requests from the operator listener (``gateway/server/connections.py``) see only the operator
    routes (probes, ``/metrics``, ``/admin/*``); the API listener never serves those two, since
    they show tenants' costs and model names to whoever can connect."""

    def __init__(
        self, settings: Settings, snapshot: PolicySnapshot | None = None, connections: ConnectionCounts | None = None
    ) -> None:
        self.settings = settings
        self._snapshot = snapshot
        self.connections = connections
        self.gateway: Gateway | None = None
        self._hot: dict[str, InferenceHandler] = {}
        admin = admin_routes(lambda: self.gateway, error_response)
        self._ops = Router(
            routes=[
                OpenAIRoute("/healthz", self._healthz, methods=["GET", "HEAD"]),
                OpenAIRoute("/readyz", self._readyz, methods=["GET", "HEAD"]),
                OpenAIRoute("/v1/models", self._models, methods=["GET"]),
            ],
            default=self._not_found,
            redirect_slashes=False,  # a redirect would echo a forged Host header back to the client
        )
        self._operator = Router(
            routes=[
                OpenAIRoute("/healthz", self._healthz, methods=["GET", "HEAD"]),
                OpenAIRoute("/readyz", self._readyz, methods=["GET", "HEAD"]),
                OpenAIRoute("/metrics", self._metrics, methods=["GET"]),
                OpenAIRoute("/admin/reload", admin["/admin/reload"], methods=["POST"]),
                OpenAIRoute("/admin/policy", admin["/admin/policy"], methods=["GET"]),
                OpenAIRoute("/admin/rollout", admin["/admin/rollout"], methods=["GET", "POST"]),
                OpenAIRoute("/admin/backends", admin["/admin/backends"], methods=["GET"]),
            ],
            default=self._not_found,
            redirect_slashes=False,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = request_path(scope)
            if path is None:
                await self._not_found(scope, receive, with_common_headers(scope, send))
                return
            if is_operator_request(scope):
                await self._operator(scope, receive, with_common_headers(scope, send))
                return
            handler = self._hot.get(path)
            if handler is not None and scope["method"] == "POST":
                await handler(scope, receive, send)  # sets x-request-id itself
                return
            send = with_common_headers(scope, send)
            if handler is None:
                await self._ops(scope, receive, send)
            else:
                error = MethodNotAllowed(f"{path} accepts POST only.", headers={"allow": "POST"})
                await error_response(error, handler.api.error_body)(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    def drainable(self) -> Drainable | None:
        """What a drain needs (``gateway/server/lifecycle.py``); None until the lifespan built the gateway."""
        return self.gateway.drainable() if self.gateway else None

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        try:
            snapshot = self._snapshot or load_policy(self.settings.policy_path)
            gateway = Gateway(self.settings, snapshot)
            await gateway.start()
        except Exception as exc:
            log.error("gateway failed to start: %s", exc)
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        self.gateway = gateway
        deps = gateway.pipeline_deps()
        self._hot = {path: InferenceHandler(dialect, deps) for path, dialect in DIALECTS.items()}
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await gateway.aclose()
        await send({"type": "lifespan.shutdown.complete"})

    async def _healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok")

    async def _readyz(self, request: Request) -> Response:
        gateway = self.gateway
        if gateway is None:
            return JSONResponse({"ready": False, "reason": "starting"}, status_code=503)
        if gateway.draining:
            return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
        unready = unready_public(gateway.policy(), gateway.pool.unready_models())
        if unready:
            return JSONResponse({"ready": False, "models_without_healthy_backend": unready}, status_code=503)
        return JSONResponse({"ready": True, "policy_version": gateway.policy().version})

    async def _metrics(self, request: Request) -> Response:
        if self.gateway is None:
            return starting()
        if self.connections is not None:
            self.gateway.metrics.export_connections(self.connections)
        body = self.gateway.export_metrics()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _models(self, request: Request) -> Response:
        if self.gateway is None:
            return starting()
        snapshot = self.gateway.policy()
        try:
            headers = read_headers(request.scope["headers"])
            check_headers(headers)
            tenant = authenticate(credential(headers), snapshot)
        except GatewayError as error:
            return error_response(error)
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "inference-gateway"}
            for m in snapshot.public_models  # a group's targets are its own business
            if snapshot.tenant_may_use(tenant, m)
        ]
        return JSONResponse({"object": "list", "data": data})

    async def _not_found(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = NotFound(f"No route for {scope.get('method', '')} {scope.get('path', '')}.")
        await error_response(error)(scope, receive, send)


def build_server(
    settings: Settings,
    snapshot: PolicySnapshot | None = None,
    *,
    sockets: tuple[socket.socket, socket.socket] | None = None,
    after_drain: Callable[[], Awaitable[None]] | None = None,
) -> GatewayServer:
    """This app behind the gateway's server, both listeners bound (``server_for``); ``OSError``
    when a port is taken. A worker's (``gateway/workers/child.py``) gives ``sockets``, the API and
    operator sockets its supervisor bound, and ``after_drain``, its wait for the other workers."""
    return server_for(
        settings,
        lambda listeners: GatewayApp(settings, snapshot, connections=listeners),
        sockets=sockets,
        after_drain=after_drain,
    )
