"""The inference request path, as one explicit pipeline (no middleware on the hot path).

    read_headers -> authenticate -> read_body (byte limit) -> parse_json_object
    -> model lookup (404) -> authorize_model (403) -> build_request (400 limits)
    -> pick backend -> upstream.open -> relay (stream) | pass through (non-stream)
    -> record metrics

Each step raises a ``GatewayError``; ``handle`` renders it as a JSON error before the
response starts, or as an SSE error event followed by ``[DONE]`` once a stream has started.
A client that disconnects cancels the forwarding at once (the upstream connection is
closed in ``finally``), and every counter the request touched is released in ``finally``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING

import httpx
import orjson
from starlette.types import Receive, Scope, Send

from gateway.auth import authenticate, authorize_model
from gateway.endpoints import BackendState
from gateway.errors import GatewayError, InternalError, NotFound
from gateway.intake import parse_json_object, read_body, read_headers
from gateway.streaming import SseRelay, StreamEnd, TokenTimer
from gateway.telemetry import UNKNOWN_LABEL
from gateway.types import Api, InferenceRequest
from gateway.upstream import backend_error, map_upstream_errors
from gateway.validation import build_request, require_model

if TYPE_CHECKING:
    from gateway.app import Gateway


log = logging.getLogger(__name__)

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class Exchange:
    """One request's progress through the pipeline: what is known, what was sent."""

    __slots__ = (
        "api",
        "arrival",
        "klass",
        "model",
        "outcome",
        "request_id",
        "send",
        "started",
        "status",
        "timer",
    )

    def __init__(self, send: Send, api: Api, request_id: str, arrival: float) -> None:
        self.send = send
        self.api = api
        self.request_id = request_id
        self.arrival = arrival
        self.started = False
        self.status = 0
        self.model = UNKNOWN_LABEL
        self.klass = UNKNOWN_LABEL
        self.outcome = "error"
        self.timer: TokenTimer | None = None

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        headers.append((b"x-request-id", self.request_id.encode()))
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def respond(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        await self.start(status, headers)
        await self.send({"type": "http.response.body", "body": body})

    async def fail(self, error: GatewayError) -> None:
        """Render ``error`` as the whole response (the response must not have started)."""
        headers = [*JSON_HEADERS, *((k.encode(), v.encode()) for k, v in error.headers.items())]
        self.outcome = error.code
        await self.respond(error.status, error.body(), headers)


class InferenceHandler:
    """ASGI handler of one OpenAI inference endpoint (chat, completions or embeddings)."""

    def __init__(self, gateway: Gateway, api: Api) -> None:
        self.gateway = gateway
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway = self.gateway
        arrival = gateway.clock.now()
        headers = read_headers(scope["headers"])
        assert headers.request_id is not None
        exchange = Exchange(send, self.api, headers.request_id, arrival)
        try:
            await self._handle(exchange, headers.authorization, headers.content_length, receive)
        except ClientDisconnected:
            exchange.outcome = "client_disconnected"
            exchange.status = exchange.status or 499
        except GatewayError as error:
            if exchange.started:  # pragma: no cover - streams render their own errors
                raise
            await exchange.fail(error)
        except Exception:
            # The outermost catch-all of the request path: a bug, never the client's input.
            log.exception("request %s failed inside the gateway", exchange.request_id)
            if not exchange.started:
                await exchange.fail(InternalError("The gateway failed to handle this request."))
        finally:
            gateway.record(exchange)

    async def _handle(
        self, exchange: Exchange, authorization: bytes | None, content_length: int | None, receive: Receive
    ) -> None:
        gateway = self.gateway
        snapshot = gateway.policy()
        tenant = authenticate(authorization, snapshot)
        limits = snapshot.policy.limits
        raw = await read_body(receive, content_length, limits.max_body_bytes)
        body = parse_json_object(raw, limits.max_json_depth)
        model = require_model(body)
        model_policy = snapshot.models.get(model)
        if model_policy is None:
            raise NotFound(f"The model '{model}' does not exist.", code="model_not_found", param="model")
        exchange.model = model
        exchange.klass = tenant.default_class
        authorize_model(tenant, model, snapshot)
        request = build_request(
            api=self.api,
            body=body,
            raw_body=raw,
            request_id=exchange.request_id,
            arrival=exchange.arrival,
            model_policy=model_policy,
            limits=limits,
            estimator=gateway.estimator,
        )
        if request.stream:
            _ask_for_usage(request)
        state = gateway.picker.pick(model, gateway.pool.for_model(model))
        await _until_disconnect(receive, self._forward(exchange, request, state))

    async def _forward(self, exchange: Exchange, request: InferenceRequest, state: BackendState) -> None:
        gateway = self.gateway
        state.in_flight += 1
        state.in_flight_tokens += request.prompt_tokens + request.max_tokens
        try:
            response = await gateway.upstream.open(state.backend, request)
            try:
                if response.status_code != 200:
                    body = await gateway.upstream.read_all(state.backend, response)
                    raise backend_error(state.backend, response.status_code, body)
                if request.stream:
                    await self._relay(exchange, request, state, response)
                else:
                    await self._pass_through(exchange, state, response)
            finally:
                await response.aclose()
        except GatewayError as error:
            if error.status in (502, 504) and error.code == "upstream_connect_error":
                state.healthy = False
            raise
        finally:
            state.in_flight -= 1
            state.in_flight_tokens -= request.prompt_tokens + request.max_tokens

    async def _pass_through(self, exchange: Exchange, state: BackendState, response: httpx.Response) -> None:
        body = await self.gateway.upstream.read_all(state.backend, response)
        timer = TokenTimer(exchange.arrival)
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError:
            document = None
        if isinstance(document, dict) and isinstance(document.get("usage"), dict):
            timer.usage = document["usage"]
        exchange.timer = timer
        content_type = response.headers.get("content-type", "application/json").encode()
        await exchange.respond(200, body, [(b"content-type", content_type)])
        exchange.outcome = "completed"

    async def _relay(
        self, exchange: Exchange, request: InferenceRequest, state: BackendState, response: httpx.Response
    ) -> None:
        timer = TokenTimer(exchange.arrival)
        exchange.timer = timer
        await exchange.start(200, list(SSE_HEADERS))
        relay = SseRelay(exchange.send, timer, self.gateway.clock, strip_usage=not request.client_wants_usage)
        end = await relay.run(_raw_chunks(response, state.backend.name))
        exchange.outcome = end.value if end is not StreamEnd.COMPLETED else "completed"


def _ask_for_usage(request: InferenceRequest) -> None:
    """Make the backend report usage at the end of the stream, whatever the client asked."""
    if request.client_wants_usage:
        return
    options = request.body.get("stream_options")
    request.body["stream_options"] = {**(options or {}), "include_usage": True}
    request.body_modified = True


async def _raw_chunks(response: httpx.Response, backend: str) -> AsyncIterator[bytes]:
    with map_upstream_errors(backend):
        async for chunk in response.aiter_raw():
            yield chunk


class ClientDisconnected(Exception):
    """The client went away; nothing is sent back, the outcome is recorded as such."""


async def _until_disconnect(receive: Receive, work: Awaitable[None]) -> None:
    """Run ``work``; cancel it the moment the client disconnects (closing the upstream)."""
    task = asyncio.current_task()
    assert task is not None
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                task.cancel()
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await work
    except asyncio.CancelledError:
        if disconnected and task.uncancel() == 0:
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.cancel()
