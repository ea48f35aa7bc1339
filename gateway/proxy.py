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
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import httpx
import orjson
from starlette.types import Receive, Scope, Send

from gateway.admission import charged_tokens, output_events, resolve_class
from gateway.auth import authenticate, authorize_model
from gateway.breaker import CircuitBreaker
from gateway.endpoints import BackendState
from gateway.errors import GatewayError, InternalError, InvalidRequest, NotFound, UpstreamError, UpstreamTimeout
from gateway.intake import RequestHeaders, parse_json_object, read_body, read_headers
from gateway.migration import ask_for_progress, can_continue, continuation
from gateway.output_length import fit_output_length
from gateway.policy.loader import PolicySnapshot
from gateway.policy.model import Backend, BackendKind, PriorityClass, Tenant
from gateway.retry import Failure, is_retryable, retry_delay
from gateway.routing.base import RoutingDecision
from gateway.routing.isolation import SALTED_KINDS, tenant_scope
from gateway.streaming import SseRelay, StreamEnd, TokenTimer
from gateway.telemetry import UNKNOWN_LABEL
from gateway.tracing import INERT_ATTEMPT, INERT_REQUEST, AttemptSpan, RequestSpan
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
        "attempt",
        "backend",
        "decision",
        "extra_headers",
        "failure",
        "klass",
        "model",
        "on_first_token",
        "outcome",
        "queued_s",
        "relay",
        "request_id",
        "send",
        "span",
        "started",
        "status",
        "stream",
        "t_admit",
        "t_dispatch",
        "tenant",
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
        self.tenant = UNKNOWN_LABEL
        self.backend = ""
        self.decision: RoutingDecision | None = None
        self.queued_s = 0.0
        self.extra_headers: list[tuple[bytes, bytes]] = []
        self.on_first_token: Callable[[], None] | None = None
        self.failure: Failure | None = None
        self.t_admit: float | None = None
        self.stream = False
        self.t_dispatch: float | None = None
        self.relay: SseRelay | None = None
        self.span: RequestSpan = INERT_REQUEST
        self.attempt: AttemptSpan = INERT_ATTEMPT

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        headers.append((b"x-request-id", self.request_id.encode()))
        headers.extend(self.extra_headers)
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def respond(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        headers.append((b"content-length", str(len(body)).encode()))
        await self.start(status, headers)
        await self.send({"type": "http.response.body", "body": body})

    async def fail(self, error: GatewayError) -> None:
        """Render ``error`` as the whole response (the response must not have started)."""
        headers = [*JSON_HEADERS, *((k.encode(), v.encode()) for k, v in error.headers.items())]
        if error.headers:
            self.extra_headers = [h for h in self.extra_headers if h[0].decode() not in error.headers]
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
        if gateway.tracing.enabled:
            traceparent = headers.traceparent.decode(errors="replace") if headers.traceparent else None
            exchange.span = gateway.tracing.start_request(
                t=arrival, request_id=exchange.request_id, api=self.api, traceparent=traceparent
            )
        gateway.enter()
        try:
            await self._handle(exchange, headers, receive)
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
            gateway.leave()
            gateway.record(exchange)

    async def _handle(self, exchange: Exchange, headers: RequestHeaders, receive: Receive) -> None:
        gateway = self.gateway
        snapshot = gateway.policy()
        tenant = authenticate(headers.authorization, snapshot)
        exchange.tenant = tenant.name
        gateway.limiter.precheck(tenant)  # 429 before reading the body when its rpm is known spent
        try:
            request, class_name, klass, deadline = await self._intake(exchange, headers, receive, snapshot, tenant)
        except GatewayError:
            await gateway.limiter.charge_rejected(tenant)  # a refused request costs a request too
            raise
        admission = await gateway.limiter.admit(tenant, request)
        exchange.t_admit = gateway.clock.now()
        exchange.extra_headers = admission.headers
        disconnected = False
        try:
            await _until_disconnect(receive, self._dispatch(exchange, request, tenant, class_name, klass, deadline))
        except ClientDisconnected:
            disconnected = True
            raise
        finally:
            timer = exchange.timer
            used_tokens = charged_tokens(
                usage=timer.usage if timer else None,
                # a backend took it: its answer started, or the client left while it was being served
                reached_backend=exchange.started or (disconnected and bool(exchange.backend)),
                completed=exchange.outcome == "completed",
                reserved=admission.reserved_tokens,
                prompt_estimate=request.prompt_tokens,
                outputs_sent=output_events(timer),
            )
            await gateway.limiter.settle(admission, used_tokens)

    async def _intake(
        self, exchange: Exchange, headers: RequestHeaders, receive: Receive, snapshot: PolicySnapshot, tenant: Tenant
    ) -> tuple[InferenceRequest, str, PriorityClass, float]:
        """Body, model, class and validation: everything between authentication and admission."""
        gateway = self.gateway
        limits = snapshot.policy.limits
        raw = await read_body(receive, headers.content_length, limits.max_body_bytes)
        body = parse_json_object(raw, limits.max_json_depth, limits.max_json_containers, limits.max_json_keys)
        model = require_model(body)
        model_policy = snapshot.models.get(model)
        if model_policy is None:
            raise NotFound(f"The model '{model}' does not exist.", code="model_not_found", param="model")
        exchange.model = model
        authorize_model(tenant, model, snapshot)
        class_name, klass = resolve_class(tenant, headers.priority, snapshot)
        exchange.klass = class_name
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
        if headers.session_id:
            request.session_id = headers.session_id.decode(errors="replace")
        exchange.stream = request.stream
        exchange.span.describe(
            model=model, tenant=tenant.name, class_name=class_name, max_tokens=request.max_tokens, stream=request.stream
        )
        deadline = exchange.arrival + request_timeout(headers.request_timeout, klass.deadline_s)
        if request.stream:
            _ask_for_usage(request)
        return request, class_name, klass, deadline

    async def _dispatch(
        self,
        exchange: Exchange,
        request: InferenceRequest,
        tenant: Tenant,
        class_name: str,
        klass: PriorityClass,
        deadline: float,
    ) -> None:
        """Attempts until one answers; a failure once the stream started ends it with an error event."""
        try:
            await self._attempts(exchange, request, tenant, class_name, klass, deadline)
        except GatewayError as error:
            relay = exchange.relay
            if relay is None or not exchange.started:
                raise
            await relay.finish(error)
            exchange.outcome = StreamEnd.UPSTREAM_ERROR.value

    async def _attempts(
        self,
        exchange: Exchange,
        request: InferenceRequest,
        tenant: Tenant,
        class_name: str,
        klass: PriorityClass,
        deadline: float,
    ) -> None:
        """Bounded retries before the first byte; bounded migrations after it (same budget)."""
        gateway = self.gateway
        dispatcher, policy = gateway.dispatcher, gateway.policy().policy.retry
        gateway.retry_budget.record_request()
        span, model = exchange.span, request.model
        tried: frozenset[str] = frozenset()
        queued_s = 0.0
        for attempt in range(policy.max_retries + 1):
            t_ask = gateway.clock.now()
            grant = await dispatcher.acquire(request, tenant, class_name, klass, deadline, exclude=tried)
            now = gateway.clock.now()
            queued_s += grant.queued_s
            exchange.queued_s, exchange.decision = queued_s, grant.decision
            exchange.t_dispatch = now
            exchange.on_first_token = lambda grant=grant: dispatcher.first_token(model, grant)
            exchange.failure = None
            if span.recording:
                _trace_grant(span, grant.decision, t_ask, now, class_name)
            exchange.attempt = span.attempt(backend=grant.state.name, number=attempt + 1, t=now)
            delay = 0.0
            try:
                await self._forward(exchange, request, tenant, grant.state, klass.rank, policy.migrate_streams)
                return
            except StreamBroken as broken:
                follow_up = self._migration(exchange, request, broken, attempt, deadline, policy.max_retries)
                if follow_up is None:
                    raise broken.error from None
                request = follow_up
                gateway.metrics.retries.labels(grant.state.name, broken.error.code).inc()
                tried = tried | {grant.state.name}
            except GatewayError as error:
                failure = exchange.failure or Failure(error=error, client_bytes_sent=exchange.started)
                if attempt == policy.max_retries or not is_retryable(failure, statuses=policy.retryable_statuses):
                    raise
                if not gateway.retry_budget.try_spend():
                    gateway.metrics.retry_budget_exhausted.labels(request.model).inc()
                    raise
                next_delay = retry_delay(
                    policy, attempt + 1, failure, now=gateway.clock.now(), deadline=deadline, same_backend=False
                )
                if next_delay is None:
                    raise
                delay = next_delay
                gateway.metrics.retries.labels(grant.state.name, error.code).inc()
                tried = tried | {grant.state.name}
            finally:
                dispatcher.release(request.model, grant)
            if delay:
                await asyncio.sleep(delay)

    def _migration(
        self,
        exchange: Exchange,
        request: InferenceRequest,
        broken: StreamBroken,
        attempt: int,
        deadline: float,
        max_retries: int,
    ) -> InferenceRequest | None:
        """The continuation of a broken stream if one may start now; counts the verdict either way."""
        gateway = self.gateway
        relay = exchange.relay
        assert relay is not None
        assert relay.progress is not None
        follow_up = continuation(request, relay.progress)
        if follow_up is None:
            verdict = "not_continuable"
        elif attempt == max_retries:
            verdict = "attempts_exhausted"
        elif gateway.clock.now() >= deadline:
            verdict = "deadline"
        elif not gateway.retry_budget.try_spend():
            gateway.metrics.retry_budget_exhausted.labels(request.model).inc()
            verdict = "budget_exhausted"
        else:
            verdict = "continued"
        gateway.metrics.child(gateway.metrics.migrations, request.model, verdict).inc()
        log.warning(
            "request %s: stream from %s broke (%s) after %s tokens; migration: %s",
            exchange.request_id,
            exchange.backend,
            broken.error.code,
            relay.progress.tokens,
            verdict,
        )
        return follow_up if verdict == "continued" else None

    async def _forward(
        self,
        exchange: Exchange,
        request: InferenceRequest,
        tenant: Tenant,
        state: BackendState,
        rank: int,
        migrate: bool,
    ) -> None:
        gateway = self.gateway
        backend = state.backend
        exchange.backend = state.name
        track = self._fit_body(request, tenant, backend, rank, migrate)
        attempt = exchange.attempt
        breaker = state.breaker
        if breaker is not None and not breaker.try_acquire():
            attempt.end(t=gateway.clock.now(), error="breaker_open")
            raise UpstreamError(f"Backend '{state.name}' is failing; its circuit breaker is open.", code="breaker_open")
        try:
            response = await gateway.upstream.open(backend, request, trace=attempt)
        except GatewayError as error:
            attempt.end(t=gateway.clock.now(), error=error.code)
            if breaker is not None:
                breaker.on_failure()
            if error.code == "upstream_connect_error":
                gateway.pool.mark_down(state)
            raise
        # The breaker's verdict waits for the end of the answer: a backend that stalls or drops
        # streams after sending its headers is failing too. A request cut by its client is no
        # verdict at all.
        verdict: bool | None = None
        error_code: str | None = None
        try:
            status = response.status_code
            if status != 200:
                verdict = False if status >= 500 else None
                error_code = "upstream_status"
                body = await gateway.upstream.read_all(backend, response)
                exchange.failure = Failure.from_status(status, response.headers, client_bytes_sent=False)
                raise backend_error(backend, status, body)
            if request.stream:
                end = await self._relay(exchange, request, state, response, track)
                verdict = end is StreamEnd.COMPLETED
                error_code = None if verdict else end.value
            else:
                await self._pass_through(exchange, state, response)
                verdict = True
        except StreamBroken as broken:
            verdict, error_code = False, broken.error.code
            raise
        except GatewayError as error:
            verdict = False if verdict is None and response.status_code == 200 else verdict
            error_code = error_code or error.code
            raise
        finally:
            await response.aclose()
            attempt.end(t=gateway.clock.now(), status=response.status_code, error=error_code)
            if breaker is not None:
                _settle(breaker, verdict)

    def _fit_body(self, request: InferenceRequest, tenant: Tenant, backend: Backend, rank: int, migrate: bool) -> bool:
        """The fields this backend needs set for this request; True when its stream is tracked."""
        if fit_output_length(request.body, backend.kind, request.api, request.max_tokens):
            request.body_modified = True  # the one output-length field this kind obeys, no other alias
        if backend.engine_priority:
            request.body["priority"] = engine_priority(backend.kind, rank)
            request.body_modified = True
        if backend.kind in SALTED_KINDS:
            # Isolation: the engine's prefix cache is keyed by this; the client's own is overwritten.
            request.body["cache_salt"] = self.gateway.salter.salt(tenant_scope(tenant))
            request.body_modified = True
        track = migrate and can_continue(request, backend.kind)
        if track:
            ask_for_progress(request)
        return track

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
        self, exchange: Exchange, request: InferenceRequest, state: BackendState, response: httpx.Response, track: bool
    ) -> StreamEnd:
        """Relay the stream (or its continuation); raise ``StreamBroken`` when it could go on elsewhere."""
        relay = exchange.relay
        if relay is None:
            timer = TokenTimer(exchange.arrival, on_first=exchange.on_first_token)
            exchange.timer = timer
            await exchange.start(200, list(SSE_HEADERS))
            relay = SseRelay(
                exchange.send,
                timer,
                self.gateway.clock,
                strip_usage=not request.client_wants_usage,
                track=track,
                keep_continuous=request.client_wants_continuous_usage,
            )
            exchange.relay = relay
        else:
            relay.resume(on_output=exchange.on_first_token)
        stall_s = state.backend.timeouts.between_chunks_s
        failure = await relay.pump(_raw_chunks(response, state.backend.name, stall_s))
        if failure is not None:
            if relay.progress is not None and relay.progress.continuable:
                raise StreamBroken(failure)
            self.gateway.metrics.child(self.gateway.metrics.migrations, request.model, "not_continuable").inc()
        end = await relay.finish(failure)
        exchange.outcome = end.value if end is not StreamEnd.COMPLETED else "completed"
        return end


def _settle(breaker: CircuitBreaker, verdict: bool | None) -> None:
    """An attempt's verdict to its backend's breaker: None (the client left) counts neither way."""
    if verdict is None:
        breaker.release()
    elif verdict:
        breaker.on_success()
    else:
        breaker.on_failure()


def engine_priority(kind: BackendKind, rank: int) -> int:
    """The class rank as the engine's ``priority``: vLLM runs lower numbers first, SGLang higher."""
    return -rank if kind is BackendKind.SGLANG else rank


def request_timeout(header: bytes | None, default_s: float) -> float:
    """Seconds the client gives the request (``x-request-timeout``), else the class deadline."""
    if header is None:
        return default_s
    try:
        value = float(header)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86_400:
        raise InvalidRequest(
            "x-request-timeout must be a number of seconds between 0 and 86400.", code="invalid_header"
        )
    return value


def _ask_for_usage(request: InferenceRequest) -> None:
    """Make the backend report usage at the end of the stream, whatever the client asked."""
    options = request.body.get("stream_options")
    request.client_wants_continuous_usage = bool(options and options.get("continuous_usage_stats"))
    if request.client_wants_usage:
        return
    request.body["stream_options"] = {**(options or {}), "include_usage": True}
    request.body_modified = True


async def _raw_chunks(response: httpx.Response, backend: str, stall_s: float) -> AsyncIterator[bytes]:
    """The upstream body, chunk by chunk; a gap longer than ``stall_s`` ends it with a 504 error.

    One ``asyncio.timeout`` per stream, moved forward at each chunk (cheaper than one per read).
    """
    loop = asyncio.get_running_loop()
    chunks = response.aiter_raw()
    try:
        async with asyncio.timeout_at(loop.time() + stall_s) as stall:
            with map_upstream_errors(backend):  # inside the timeout: TimeoutError is an OSError
                async for chunk in chunks:
                    stall.reschedule(None)
                    yield chunk
                    stall.reschedule(loop.time() + stall_s)
    except TimeoutError:
        raise UpstreamTimeout(
            f"Backend '{backend}' sent nothing for {stall_s:g}s in the middle of the stream.",
            code="upstream_stalled",
        ) from None
    except UpstreamError as error:
        if error.code != "upstream_connect_error":
            raise
        raise UpstreamError(
            f"Backend '{backend}' dropped the connection in the middle of the stream.", code="upstream_disconnected"
        ) from error


class StreamBroken(Exception):
    """A started stream's upstream failed while the stream could still be continued elsewhere."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


def _trace_grant(span: RequestSpan, decision: RoutingDecision, asked: float, granted: float, class_name: str) -> None:
    """The queue wait and the routing decision of one attempt, as spans (sampled requests only)."""
    span.queue(start=asked, end=granted - decision.pick_s, class_name=class_name)
    span.route(
        start=granted - decision.pick_s,
        end=granted,
        backend=decision.state.name,
        strategy=decision.strategy,
        reason=decision.reason,
        matched_blocks=decision.matched_blocks,
        scores=decision.scores,
    )


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
