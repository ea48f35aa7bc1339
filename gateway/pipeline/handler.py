"""The inference request path, as one explicit pipeline (no middleware on the hot path).

    read_headers -> runtime (the policy in force, read once) -> authenticate
    -> read_body (byte limit) -> parse_json_object -> model lookup (404) -> authorize_model (the same 404)
    -> resolve_class -> build_request (400 limits) -> RequestContext (frozen)
    -> admit (tenant limits) -> Attempts.run (gateway/pipeline/attempts.py, each attempt
    gateway/pipeline/attempt.py) -> settle -> record

Each step raises a ``GatewayError``; ``InferenceHandler`` renders it as a JSON error before
the response starts (``gateway/pipeline/client_response.py``); once a stream started, the attempts end it with
an error event and ``[DONE]``. A client that disconnects cancels the work at once (the
upstream connection is closed in ``finally``); every counter the request touched is released
in ``finally``; the request ends as one frozen ``RequestOutcome`` given to the recorder.
The request's deadline (``x-request-timeout``, else its class's ``deadline_s``) bounds the
whole request: its wait, its retries and its answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.types import Receive, Scope, Send

from gateway.admission.build import build_request, require_model
from gateway.admission.tenant_limits import TenantLimiter, charged_tokens, resolve_class
from gateway.clock import Clock
from gateway.dialects.base import Dialect
from gateway.errors import (
    ErrorCode,
    GatewayError,
    InternalError,
    InvalidRequest,
    NotFound,
    UpstreamTimeout,
    code_of,
)
from gateway.pipeline.attempt import AttemptDeps
from gateway.pipeline.attempts import Answered, Attempts
from gateway.pipeline.client_response import ClientResponse
from gateway.pipeline.context import RequestContext
from gateway.pipeline.outcome import RequestOutcome, Result
from gateway.pipeline.recorder import Recorder
from gateway.pipeline.shadowing import ShadowCopy, Shadows
from gateway.policy.model import Slo, Tenant
from gateway.request.auth import authenticate, authorize_model
from gateway.request.disconnect import DisconnectSignal, disconnect_signal
from gateway.request.estimators import Estimators
from gateway.request.intake import (
    ClientDisconnected,
    RequestHeaders,
    check_headers,
    credential,
    parse_json_object,
    read_body,
    read_headers,
    require_json_content_type,
)
from gateway.responses.affinity import Holder
from gateway.routing.targets import TargetChoice, TargetPicker, lookup_public
from gateway.runtime import Runtime
from gateway.telemetry.metrics import UNKNOWN_LABEL
from gateway.telemetry.token_stats import TokenStats
from gateway.telemetry.tracing import RequestSpan

log = logging.getLogger(__name__)


class InFlight:
    """How many requests are being handled; a drain waits until it is zero (``gateway/server/lifecycle.py``)."""

    __slots__ = ("_idle", "count", "draining")

    def __init__(self) -> None:
        self.count = 0
        self.draining = False
        self._idle = asyncio.Event()

    def enter(self) -> None:
        self.count += 1

    def leave(self) -> None:
        self.count -= 1
        if self.draining and self.count == 0:
            self._idle.set()

    def drain(self) -> None:
        self.draining = True
        if self.count == 0:
            self._idle.set()

    async def idle(self) -> None:
        await self._idle.wait()


@dataclass(frozen=True, slots=True)
class PipelineDeps:
    """The collaborators the request path uses, and nothing else (built in ``gateway/service.py``)."""

    clock: Clock
    runtime: Callable[[], Runtime]
    limiter: TenantLimiter
    estimators: Callable[[], Estimators]
    """The policy in force's estimator per model (``gateway/request/estimators.py``)."""
    attempts: AttemptDeps
    recorder: Recorder
    in_flight: InFlight
    targets: TargetPicker
    shadows: Shadows


@dataclass(slots=True)
class _Known:
    """What the pipeline has learnt so far about a request, for its outcome if it ends early."""

    tenant: str = UNKNOWN_LABEL
    model: str = UNKNOWN_LABEL
    class_name: str = UNKNOWN_LABEL
    stream: bool = False
    slo: Slo | None = None
    t_admit: float | None = None
    attempts: Attempts | None = None
    """Only to end a started stream after a gateway bug (``end_started_stream``)."""
    answered: Answered | None = None
    """What the attempts did, frozen when they ended: all the outcome reads of them."""
    context: RequestContext | None = None


class InferenceHandler:
    """ASGI handler of one inference endpoint: the pipeline, for the API ``api`` (its dialect)."""

    def __init__(self, api: Dialect, deps: PipelineDeps) -> None:
        self.api = api
        self.deps = deps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        deps = self.deps
        arrival = deps.clock.now()
        runtime = deps.runtime()
        headers = read_headers(scope["headers"])
        assert headers.request_id is not None
        response = ClientResponse(send, headers.request_id, self.api.error_body)
        span = runtime.tracing.start_request(
            t=arrival,
            request_id=headers.request_id,
            api=self.api,
            traceparent=headers.traceparent.decode(errors="replace") if headers.traceparent else None,
        )
        known = _Known()
        result: Result = Result.FAILED
        error: ErrorCode | None = ErrorCode.INTERNAL_ERROR
        deps.in_flight.enter()
        try:
            ended = await self._handle(runtime, headers, receive, response, span, arrival, known, scope)
            result, error = (Result.COMPLETED, None) if ended is None else (Result.FAILED, ended)
        except ClientDisconnected:
            result, error = Result.CLIENT_DISCONNECTED, None
        except GatewayError as failure:
            error = code_of(failure)
            await response.fail(failure)
        except Exception:
            # The outermost catch-all of the request path: a bug, never the client's input.
            log.exception("request %s failed inside the gateway", headers.request_id)
            await self._fail_after_bug(response, known)
        finally:
            deps.in_flight.leave()
            outcome = _outcome(self.api, response, known, arrival, deps.clock.now(), result, error, span)
            deps.recorder.record(outcome, runtime.tenant_labels)

    async def _handle(
        self,
        runtime: Runtime,
        headers: RequestHeaders,
        receive: Receive,
        response: ClientResponse,
        span: RequestSpan,
        arrival: float,
        known: _Known,
        scope: Scope,
    ) -> ErrorCode | None:
        deps = self.deps
        check_headers(headers)  # a repeated Authorization would make the tenant ambiguous
        tenant = authenticate(credential(headers), runtime.snapshot)
        known.tenant = tenant.name
        deps.limiter.precheck(tenant)  # 429 before reading the body when its rpm is known spent
        try:
            ctx = await self._intake(runtime, tenant, headers, receive, span, arrival, known)
        except GatewayError:
            await deps.limiter.charge_rejected(tenant)  # a refused request costs a request too
            raise
        known.context = ctx
        request = ctx.request
        admission = await deps.limiter.admit(tenant, request)
        known.t_admit = deps.clock.now()
        response.extra_headers = admission.headers
        group = ctx.route.group
        shadow = _ShadowStart(deps.shadows, ctx) if group is not None and group.shadow is not None else None
        attempts = known.attempts = Attempts(ctx, deps.attempts, response, shadow.start if shadow else None)
        ended: ErrorCode | None = ErrorCode.INTERNAL_ERROR
        disconnected = False
        try:
            ended = await self._answer(attempts, receive, disconnect_signal(scope), ctx.deadline)
            return ended
        except ClientDisconnected:
            disconnected = True
            raise
        finally:
            answered = known.answered = attempts.answered()
            if shadow is not None:
                shadow.primary_ended(answered.text if ended is None else None)
            tokens = answered.tokens
            used_tokens = charged_tokens(
                usage=tokens.usage if tokens else None,
                # a backend took it: its answer started, or the client left while it was being served
                reached_backend=response.started or (disconnected and bool(answered.records)),
                completed=ended is None,
                reserved=admission.reserved_tokens,
                prompt_estimate=request.prompt_tokens,
                outputs_sent=output_events(tokens),
            )
            await deps.limiter.settle(admission, used_tokens)

    async def _intake(
        self,
        runtime: Runtime,
        tenant: Tenant,
        headers: RequestHeaders,
        receive: Receive,
        span: RequestSpan,
        arrival: float,
        known: _Known,
    ) -> RequestContext:
        """Body, model, class and validation: everything between authentication and admission."""
        snapshot = runtime.snapshot
        limits = snapshot.policy.limits
        require_json_content_type(headers)
        raw = await read_body(receive, headers.content_length, limits.max_body_bytes)
        body = parse_json_object(
            raw, limits.max_json_depth, limits.max_json_containers, limits.max_json_keys, snapshot.json_values
        )
        stripped = self.api.screen(body, limits, tenant)  # the tenant's opt-ins: allowlists.EngineGrants
        model = require_model(body)
        public = lookup_public(snapshot, model)
        known.model = model
        authorize_model(tenant, model, snapshot)
        class_name, priority_class = resolve_class(tenant, headers.priority, snapshot)
        route = self.deps.targets.choose(snapshot, public, tenant, class_name)
        previous = self.api.previous_id(body)
        held = await self._holder(previous, tenant, route) if previous is not None else None
        renamed = False
        if held is not None:  # the answer it continues lives on one backend: go there, and only there
            route = dataclasses.replace(route, primary=snapshot.models[held.model], chain=())
            if held.upstream_id and held.upstream_id != previous:  # a sealed id: the engine knows its own
                body["previous_response_id"] = held.upstream_id
                renamed = True
        model_policy = route.primary
        known.model = model_policy.name
        known.class_name, known.slo = class_name, priority_class.slo
        request = build_request(
            api=self.api,
            body=body,
            raw_body=raw,
            request_id=headers.request_id or "",
            arrival=arrival,
            model_policy=model_policy,
            limits=limits,
            estimator=self.deps.estimators().for_model(model_policy.name),
        )
        if headers.session_id or stripped or renamed:
            session_id = headers.session_id.decode(errors="replace") if headers.session_id else None
            modified = request.body_modified or stripped or renamed
            request = dataclasses.replace(request, session_id=session_id, body_modified=modified)
        if held is not None:
            request.pinned_backend = held.backend
            if renamed:
                request.public_previous_id = previous
        known.stream = request.stream
        span.describe(
            model=model, tenant=tenant.name, class_name=class_name, max_tokens=request.max_tokens, stream=request.stream
        )
        deadline = arrival + request_timeout(headers.request_timeout, priority_class.deadline_s)
        return RequestContext(request, tenant, class_name, priority_class, deadline, runtime, span, route)

    async def _holder(self, previous: str, tenant: Tenant, route: TargetChoice) -> Holder:
        """Where the answer ``previous`` lives, if ``tenant`` created it with the model it now asks
        for (a target of the same public name: ``gateway/responses/affinity.py``); 404 otherwise,
        the same for an unknown id, another tenant's and another model's."""
        snapshot = self.deps.runtime().snapshot
        held = await self.deps.attempts.affinity.holder(previous, tenant.name, snapshot.backends_by_model)
        allowed = {m.name for m in route.targets}
        if route.group is not None:
            allowed |= {t.model for t in route.group.targets}
        if held is None or held.model not in allowed or held.model not in snapshot.models:
            raise NotFound(
                f"Previous response '{previous[:64]}' is not known to this gateway (never stored, expired, or "
                "not this key's).",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        return held

    async def _answer(
        self, attempts: Attempts, receive: Receive, signal: DisconnectSignal | None, deadline: float
    ) -> ErrorCode | None:
        """``attempts.run()``, cut when the client leaves (``ClientDisconnected``) or at the request's
        deadline (504 ``deadline_exceeded``, or the stream's error event once it started)."""
        try:
            left_s = deadline - self.deps.clock.now()
            return await _until_disconnect_or(left_s, receive, signal, attempts.run())
        except DeadlineExpired:
            error = UpstreamTimeout(
                f"The request did not finish within its deadline ({deadline - attempts.ctx.request.arrival:g}s: "
                "x-request-timeout, or its class's deadline_s).",
                code="deadline_exceeded",
            )
            if not await attempts.end_started_stream(error):
                raise error from None
            return ErrorCode.DEADLINE_EXCEEDED

    async def _fail_after_bug(self, response: ClientResponse, known: _Known) -> None:
        """End the response after a gateway bug: a 500, or the stream's error event and ``[DONE]``."""
        error = InternalError("The gateway failed to handle this request.")
        try:
            if not response.started:
                await response.fail(error)
            elif known.attempts is not None:
                await known.attempts.end_started_stream(error)
        except Exception:  # the client may be gone too; the outcome is recorded either way
            log.debug("could not send the error of request %s", response.request_id)


class _ShadowStart:
    """A group's shadow copy of one request, started once the request itself has its backend (so
    that a copy only ever takes room the request left: ``gateway/shadow/``)."""

    __slots__ = ("ctx", "handle", "shadows")

    def __init__(self, shadows: Shadows, ctx: RequestContext) -> None:
        self.shadows, self.ctx = shadows, ctx
        self.handle: ShadowCopy | None = None

    def start(self) -> bool:
        """Start the copy (``Attempts``' ``on_dispatched``); whether its scorer wants the primary's text."""
        group = self.ctx.route.group
        assert group is not None
        self.handle = self.shadows.copy(self.ctx, group)
        return self.handle is not None and self.handle.wants_primary_text

    def primary_ended(self, text: str | None) -> None:
        """Give the copy's scorer the primary's answer (None unless it completed)."""
        if self.handle is not None:
            self.handle.primary_answered(text)


def _outcome(
    api: Dialect,
    response: ClientResponse,
    known: _Known,
    arrival: float,
    end: float,
    result: Result,
    error: ErrorCode | None,
    span: RequestSpan,
) -> RequestOutcome:
    answered = known.answered
    status = response.status
    if result is Result.CLIENT_DISCONNECTED and not status:
        status = 499
    return RequestOutcome(
        request_id=response.request_id,
        api=api,
        arrival=arrival,
        end=end,
        tenant=known.tenant,
        model=answered.model if answered is not None else known.model,
        class_name=known.class_name,
        stream=known.stream,
        status=status,
        result=result,
        error=error,
        attempts=answered.records if answered is not None else (),
        t_admit=known.t_admit,
        tokens=answered.tokens if answered is not None else None,
        slo=known.slo,
        span=span,
        context=known.context,
        fallback=answered.fallback if answered is not None else None,
        cache=answered.cache if answered is not None else None,
    )


def request_timeout(header: bytes | None, default_s: float) -> float:
    """Seconds the client gives the request (``x-request-timeout``), else the class deadline.

    A client may shorten its deadline, never lengthen it past its class's ``deadline_s``: the
    class's deadline is the longest any request runs, which the fleet's ledger counts on to
    know when a silent process's requests have all ended (``fleet.drain_s``)."""
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
    return min(value, default_s)


class DeadlineExpired(Exception):
    """The request's deadline passed while it was being answered."""


async def _until_disconnect_or(
    left_s: float, receive: Receive, signal: DisconnectSignal | None, work: Awaitable[ErrorCode | None]
) -> ErrorCode | None:
    """Run ``work``; cancel it the moment the client disconnects (closing the upstream), or once
    ``left_s`` seconds have passed.

    One timer per request, and the server's ``signal`` (``gateway/request/disconnect.py``), both
    cancelling the request's own task: cheaper than an ``asyncio.timeout`` around a second
    cancellation scope. Under a server without the signal, a watcher task waits on ``receive()``."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    why: list[type[Exception]] = []

    def cut(reason: type[Exception]) -> None:
        if not why:
            why.append(reason)
            task.cancel()

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                cut(ClientDisconnected)
                return

    def client_left() -> None:
        cut(ClientDisconnected)

    watcher = None
    if signal is None:
        watcher = loop.create_task(watch())
    else:
        signal.listen(client_left)
    timer = loop.call_later(max(left_s, 0.0), cut, DeadlineExpired)
    try:
        return await work
    except asyncio.CancelledError:
        if why and task.uncancel() == 0:
            raise why[0]() from None
        raise
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()
        elif signal is not None:
            signal.clear()


def output_events(tokens: TokenStats | None) -> int:
    """Output chunks a client was sent (each carries at least one token): what a request that
    ended early is charged for (``charged_tokens``)."""
    if tokens is None or tokens.first_output is None:
        return 0
    return 1 + len(tokens.gaps)
