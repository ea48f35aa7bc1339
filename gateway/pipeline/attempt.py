"""The attempts of one request: a backend, a body for it, the answer relayed, and what to do on failure.

The rule (``gateway/upstream/retry.py`` states when a failure is retryable, ``gateway/pipeline/migration.py``
when a broken stream can be continued):

1. Ask the dispatcher for a backend with room (it may queue, or refuse at once).
2. Build this attempt's body from the frozen request and that backend's kind
   (``gateway/upstream/body.py``): nothing one backend needed carries over to the next.
3. Ask the backend's breaker, send, and relay the answer: passed through whole when not
   streamed, event by event when streamed (``gateway/pipeline/relay.py``).
4. A failure before any byte reached the client is retried on another backend when it is
   retryable, attempts remain (``retry.max_retries``), the deadline allows and the retry
   budget has room; otherwise it is the request's error. A stream that breaks after bytes
   reached the client is continued on another backend under the same bounds (a migration is
   a retry), or ends with an error event and ``[DONE]``.

Every attempt gives its backend slot back when it ends, and reports one verdict to the
backend's breaker: success, failure, or none (the client left). Each attempt leaves an
``AttemptRecord`` in ``records``; the pipeline puts them in the request's outcome.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.clock import Clock
from gateway.dialects.base import Translation
from gateway.dialects.openai_answers import answer_text
from gateway.dispatch.backends import BackendPool, BackendState
from gateway.dispatch.breaker import CircuitBreaker
from gateway.dispatch.dispatcher import Dispatcher, Grant
from gateway.dispatch.router import RoutingDecision
from gateway.errors import (
    ErrorCode,
    GatewayError,
    NoHealthyBackend,
    NotFound,
    Overloaded,
    UpstreamError,
    code_of,
)
from gateway.pipeline.client_response import SSE_HEADERS, ClientResponse
from gateway.pipeline.context import RequestContext
from gateway.pipeline.migration import can_continue, continuation
from gateway.pipeline.outcome import AttemptRecord
from gateway.pipeline.relay import SseRelay, StreamEnd, TokenTimer, renaming
from gateway.responses.affinity import ResponseAffinity
from gateway.routing.targets import fits, retarget
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import AttemptSpan, RequestSpan
from gateway.types import InferenceRequest
from gateway.upstream.body import attempt_body, attempt_isolation, translated_request
from gateway.upstream.client import UpstreamClient, UpstreamResponse, new_engine_request_id
from gateway.upstream.errors import FaultLog
from gateway.upstream.retry import Failure, is_retryable, retry_delay

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AttemptDeps:
    """The collaborators an attempt uses, and nothing else."""

    clock: Clock
    dispatcher: Dispatcher
    upstream: UpstreamClient
    pool: BackendPool
    metrics: Metrics
    affinity: ResponseAffinity


class StreamBroken(Exception):
    """A started stream's upstream failed while the stream could still be continued elsewhere."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


class Attempts:
    """The attempts of one request (see the module docstring); ``run`` once."""

    __slots__ = (
        "_failure",
        "_next_target",
        "_translation",
        "answer_id",
        "ctx",
        "deps",
        "fallback",
        "model",
        "on_dispatched",
        "records",
        "relay",
        "response",
        "texts",
        "timer",
    )

    def __init__(self, ctx: RequestContext, deps: AttemptDeps, response: ClientResponse) -> None:
        self.ctx = ctx
        self.deps = deps
        self.response = response
        self.records: list[AttemptRecord] = []
        self.timer: TokenTimer | None = None
        self.relay: SseRelay | None = None
        self._failure: Failure | None = None
        self._next_target = 1
        """Index in ``ctx.route.targets`` of the next fallback target to try."""
        self.fallback: str | None = None
        """Why the request left its first target (``gateway_fallbacks_total{reason}``), if it did."""
        self.model = ctx.request.model
        """The target (served model) the request is on now: its first, or the fallback it moved to."""
        self.answer_id: str | None = None
        """The id later requests may name the answer by (``Dialect.answer_id``), once seen."""
        self.on_dispatched: Callable[[], None] | None = None
        """Called once, when the first attempt has its backend (a group's shadow copy starts then)."""
        self._translation: tuple[InferenceRequest, InferenceRequest] | None = None
        """The last request translated for a backend of another API, and its translation (``_translated``)."""
        self.texts: list[str] | None = None
        """Set to a list to collect the answer's text (choice 0): a shadow's quality scorer compares it."""

    async def run(self) -> ErrorCode | None:
        """Answer the request; None when the answer completed, else the code its stream ended with.

        Raises the ``GatewayError`` that ended the request while nothing was sent yet; once a
        stream started, a failure ends it with an error event and ``[DONE]`` instead."""
        try:
            return await self._attempts()
        except GatewayError as error:
            if self.relay is None or not self.response.started:
                raise
            await self.relay.finish(error)
            return code_of(error)

    async def _attempts(self) -> ErrorCode | None:
        ctx, deps = self.ctx, self.deps
        retry = ctx.runtime.snapshot.policy.retry
        budget = ctx.runtime.retry_budget
        budget.record_request()
        request = ctx.request
        tried: frozenset[str] = frozenset()
        for attempt in range(retry.max_retries + 1):
            t_ask = deps.clock.now()
            request, grant = await self._grant(request, tried)
            self.model = request.model
            if self.on_dispatched is not None:
                started, self.on_dispatched = self.on_dispatched, None
                started()
            now = deps.clock.now()
            if ctx.span.recording:
                _trace_grant(ctx.span, grant.decision, t_ask, now, ctx.class_name)
            engine_id = new_engine_request_id()
            self.records.append(AttemptRecord(grant.state.name, grant.decision, grant.queued_s, now, engine_id))
            span = ctx.span.attempt(backend=grant.state.name, number=attempt + 1, t=now)
            self._failure = None
            delay = 0.0
            granted_model = request.model
            try:
                return await self._forward(request, grant, span, engine_id, retry.migrate_streams)
            except StreamBroken as broken:
                self._mark(broken.error)
                follow_up = self._migration(request, broken, attempt, retry.max_retries)
                if follow_up is None:
                    raise broken.error from None
                request = follow_up
                deps.metrics.retries.labels(grant.state.name, broken.error.code).inc()
                tried = tried | {grant.state.name}
            except GatewayError as error:
                self._mark(error)
                failure = self._failure or Failure(error=error, client_bytes_sent=self.response.started)
                if attempt == retry.max_retries:
                    raise
                tried = tried | {grant.state.name}
                moved = self._fall_back_after(request, failure, error, tried)
                if moved is not None:
                    request, tried = moved, frozenset()
                    continue
                if not is_retryable(failure, statuses=retry.retryable_statuses):
                    raise
                if not budget.try_spend():
                    deps.metrics.retry_budget_exhausted.labels(request.model).inc()
                    raise
                next_delay = retry_delay(
                    retry, attempt + 1, failure, now=deps.clock.now(), deadline=ctx.deadline, same_backend=False
                )
                if next_delay is None:
                    raise
                delay = next_delay
                deps.metrics.retries.labels(grant.state.name, error.code).inc()
            finally:
                deps.dispatcher.give_back(granted_model, grant)
            if delay:
                await asyncio.sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover

    async def _grant(self, request: InferenceRequest, tried: frozenset[str]) -> tuple[InferenceRequest, Grant]:
        """A backend for ``request``: on its target, or down the fallback chain when the target has
        no room within the wait allowed, or no usable backend (``gateway/routing/targets.py``)."""
        ctx = self.ctx
        while True:
            has_next = self._next_target < len(ctx.route.targets) and request.pinned_backend is None
            group = ctx.route.group
            wait = group.fallback_wait_s if has_next and group is not None else None
            try:
                grant = await self.deps.dispatcher.acquire(
                    request, ctx.tenant, ctx.class_name, ctx.priority_class, ctx.deadline, tried, wait
                )
            except Overloaded as error:
                if error.code == "draining" or not has_next:
                    raise
                moved = self._fall_back(request, "no_room", error)
            except NoHealthyBackend as error:
                if not has_next:
                    raise
                moved = self._fall_back(request, "unavailable", error)
            else:
                return request, grant
            request, tried = moved, frozenset()

    def _fall_back_after(
        self, request: InferenceRequest, failure: Failure, error: GatewayError, tried: frozenset[str]
    ) -> InferenceRequest | None:
        """The next target after a failed attempt, when the chain has one and the failure calls for
        it: a refusal (429, 503) at once; a retryable failure once no untried backend of this
        target is usable. None: retry on this target, or give up (a client error never falls back)."""
        if self._next_target >= len(self.ctx.route.targets) or failure.client_bytes_sent:
            return None
        if _refused(failure):
            reason = "refused"
        elif is_retryable(failure, statuses=self.ctx.runtime.snapshot.policy.retry.retryable_statuses):
            pool = self.deps.pool
            if any(s.name not in tried and pool.usable(s) for s in pool.for_model(request.model)):
                return None
            reason = "failed"
        else:
            return None
        try:
            return self._fall_back(request, reason, error)
        except GatewayError:
            return None

    def _fall_back(self, request: InferenceRequest, reason: str, error: GatewayError) -> InferenceRequest:
        """Move ``request`` to the next target of its chain that can take it, within the deadline
        and the retry budget (a fallback is a retry: it must not amplify an overload); else raise
        ``error``, the reason the current target could not answer."""
        ctx, deps = self.ctx, self.deps
        targets = ctx.route.targets
        budget = ctx.runtime.retry_budget
        while self._next_target < len(targets):
            target = targets[self._next_target]
            self._next_target += 1
            if not fits(ctx.request, target):
                continue  # validated against the first target; this one's limits are smaller
            if deps.clock.now() >= ctx.deadline:
                break
            if not budget.try_spend():
                deps.metrics.retry_budget_exhausted.labels(request.model).inc()
                break
            group = ctx.route.public_name
            deps.metrics.child(deps.metrics.fallbacks, group, request.model, target.name, reason).inc()
            self.fallback = reason
            log.info(
                "request %s: %s on %s (%s), falling back to %s",
                request.request_id,
                reason,
                request.model,
                error.code,
                target.name,
            )
            return retarget(request, target)
        raise error

    def _mark(self, error: GatewayError) -> None:
        """Record how the latest attempt ended."""
        self.records[-1] = self.records[-1]._replace(error=code_of(error))

    def _migration(
        self, request: InferenceRequest, broken: StreamBroken, attempt: int, max_retries: int
    ) -> InferenceRequest | None:
        """The continuation of a broken stream if one may start now; counts the verdict either way."""
        ctx, deps = self.ctx, self.deps
        relay = self.relay
        assert relay is not None
        assert relay.progress is not None
        follow_up = continuation(request, relay.progress)
        if follow_up is None:
            verdict = "not_continuable"
        elif attempt == max_retries:
            verdict = "attempts_exhausted"
        elif deps.clock.now() >= ctx.deadline:
            verdict = "deadline"
        elif not ctx.runtime.retry_budget.try_spend():
            deps.metrics.retry_budget_exhausted.labels(request.model).inc()
            verdict = "budget_exhausted"
        else:
            verdict = "continued"
        deps.metrics.child(deps.metrics.migrations, request.model, verdict).inc()
        log.warning(
            "request %s: stream from %s broke (%s) after %s tokens; migration: %s",
            request.request_id,
            self.records[-1].backend,
            broken.error.code,
            relay.progress.tokens,
            verdict,
        )
        return follow_up if verdict == "continued" else None

    async def _forward(
        self, request: InferenceRequest, grant: Grant, span: AttemptSpan, engine_id: str, migrate: bool
    ) -> ErrorCode | None:
        """One attempt on ``grant``'s backend: send, then relay or pass the answer through."""
        ctx, deps = self.ctx, self.deps
        state = grant.state
        backend = state.backend
        track = migrate and can_continue(request, backend.kind)
        runtime = ctx.runtime
        isolation = attempt_isolation(request.api, backend, ctx.tenant, runtime.snapshot, runtime.salter)
        translation = isolation.translation
        sent = request if translation is None else self._translated(request, translation)
        body = attempt_body(sent, backend, isolation=isolation.fields, rank=ctx.rank, track=track)
        breaker = state.breaker
        if breaker is not None and not breaker.try_acquire():
            span.end(t=deps.clock.now(), error="breaker_open")
            raise UpstreamError(f"Backend '{state.name}' is failing; its circuit breaker is open.", code="breaker_open")
        report = FaultLog(state.name, request.request_id, engine_id, span)
        try:
            response = await deps.upstream.open(
                backend, sent.api, body, request_id=request.request_id, engine_request_id=engine_id, trace=span
            )
        except GatewayError as error:
            span.end(t=deps.clock.now(), error=error.code)
            if breaker is not None:
                breaker.on_failure()
            if error.code == "upstream_connect_error":
                deps.pool.mark_down(state)
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
                self._failure = Failure.from_status(status, response.headers, client_bytes_sent=False)
                answered = await deps.upstream.error_for(backend, response, report)
                if status == 404 and request.pinned_backend is not None:
                    previous = request.api.previous_id(request.body)
                    if previous is not None:  # gone from its backend: an unknown id from now on
                        deps.affinity.forget(previous, ctx.tenant.name)
                    raise _lost_previous(request)
                raise answered
            if request.stream:
                ended = await self._relay(request, grant, response, track, report, translation)
                verdict = ended is None
                error_code = None if ended is None else ended.value
                return ended
            await self._pass_through(state, response, report, translation)
            verdict = True
            return None
        except StreamBroken as broken:
            verdict, error_code = False, broken.error.code
            raise
        except GatewayError as error:
            verdict = False if verdict is None and response.status_code == 200 else verdict
            error_code = error_code or error.code
            raise
        finally:
            await response.aclose()
            span.end(t=deps.clock.now(), status=response.status_code, error=error_code)
            if breaker is not None:
                _report_verdict(breaker, verdict)

    def _translated(self, request: InferenceRequest, translation: Translation) -> InferenceRequest:
        """``request`` in the API ``translation`` calls the backend with (built once per request state:
        a retry sends the same body, a fallback's retargeted request gets its own)."""
        memo = self._translation
        if memo is not None and memo[0] is request:
            return memo[1]
        sent = translated_request(request, translation)
        self._translation = (request, sent)
        return sent

    async def _pass_through(
        self, state: BackendState, response: UpstreamResponse, report: FaultLog, translation: Translation | None
    ) -> None:
        body = await self.deps.upstream.read_all(state.backend, response)
        request = self.ctx.request
        api = request.api if translation is None else translation.upstream
        document = self.deps.upstream.answer(body, report, api)  # raises unless an answer of its API
        timer = TokenTimer(request.arrival)
        timer.usage = api.answer_usage(document)
        self.timer = timer
        if isinstance(document, dict):
            if self.texts is not None:
                self.texts.append(answer_text(document))
            if translation is not None:
                document = translation.answer(document)
                body = orjson.dumps(document)
            if request.api.keeps_state:
                upstream_id = request.api.answer_id(document)
                public_id = self._remember(upstream_id, state.name, self.model)
                if public_id != upstream_id:  # sealed: the client continues with the id that says where
                    document["id"] = public_id
                    body = orjson.dumps(document)
                previous = request.public_previous_id
                if (
                    previous is not None
                    and document.get("previous_response_id") == request.body["previous_response_id"]
                ):
                    document["previous_response_id"] = previous  # named back as the client named it
                    body = orjson.dumps(document)
                await self.deps.affinity.shared_now()  # a follow-up may come through another replica at once
        public = self.ctx.route.public_name
        if isinstance(document, dict) and document.get("model", public) != public:
            document["model"] = public  # the client sees the name it asked for, not the engine's
            body = orjson.dumps(document)
        self._target_headers()
        await self.response.respond(200, body, [(b"content-type", b"application/json")])

    def _on_event(self, event: dict[str, Any]) -> None:
        """A relayed event: its text for a shadow's scorer, its answer id for follow-ups."""
        if self.texts is not None:
            self.texts.append(answer_text(event))
        api = self.ctx.request.api
        if self.answer_id is None and api.keeps_state and self.records:
            upstream_id = api.answer_id(event)
            public_id = self._remember(upstream_id, self.records[-1].backend, self.model)
            if public_id != upstream_id and upstream_id is not None and self.relay is not None:
                self.relay.rename_also(orjson.dumps(upstream_id), orjson.dumps(public_id))  # this event on

    def _remember(self, answer_id: str | None, backend: str, model: str) -> str | None:
        """Where an answer of a stateful API lives, for the requests that will name it: as soon as
        its id is seen (a stream's first event), so that it is known everywhere before it ends.
        The id the client is to see (sealed, with a secret: ``gateway/responses/ids.py``)."""
        if answer_id is None:
            return None
        public_id = self.deps.affinity.remember(answer_id, self.ctx.tenant.name, backend, model)
        self.answer_id = public_id
        return public_id

    def _target_headers(self) -> None:
        """Which target of its group answered the request, and why it fell back if it did."""
        if self.ctx.route.group is None:
            return
        headers = self.response.extra_headers
        headers.append((b"x-gateway-target", self.model.encode()))
        if self.fallback is not None:
            headers.append((b"x-gateway-fallback", self.fallback.encode()))

    async def _relay(
        self,
        request: InferenceRequest,
        grant: Grant,
        response: UpstreamResponse,
        track: bool,
        report: FaultLog,
        translation: Translation | None,
    ) -> ErrorCode | None:
        """Relay the stream (or its continuation): None when it completed, else the code it ended
        with (after its error event); raise ``StreamBroken`` when it could go on elsewhere."""
        deps = self.deps
        model = request.model

        def first_token() -> None:
            """The prefill is done; called inside the chunk's parse (other requests are handed the room after it)."""
            deps.dispatcher.first_token(model, grant)

        relay = self.relay
        if relay is None:
            timer = TokenTimer(request.arrival, on_first=first_token)
            self.timer = timer
            self._target_headers()
            await self.response.start(200, list(SSE_HEADERS))
            relay = SseRelay(
                self.response.send,
                timer,
                deps.clock,
                dialect=request.api if translation is None else translation.upstream,
                client=None if translation is None else request.api,
                translator=None if translation is None else translation.stream(),
                strip_usage=not request.client_wants_usage and translation is None,
                track=track,
                keep_continuous=request.client_wants_continuous_usage,
                redactor=deps.upstream.redactor,
                rename=renaming(request.body.get("model"), self.ctx.route.public_name) + previous_renaming(request),
                on_event=self._on_event if self.texts is not None or request.api.keeps_state else None,
            )
            self.relay = relay
        else:
            relay.resume(on_output=first_token)
        backend = grant.state.backend
        failure = await relay.forward(response.stream(backend.name, backend.timeouts.between_chunks_s), report)
        if failure is not None:
            if relay.progress is not None and relay.progress.continuable:
                raise StreamBroken(failure)
            deps.metrics.child(deps.metrics.migrations, model, "not_continuable").inc()
        if await relay.finish(failure) is StreamEnd.COMPLETED:
            return None
        return code_of(failure) if failure is not None else ErrorCode.UPSTREAM_ERROR


def previous_renaming(request: InferenceRequest) -> tuple[tuple[bytes, bytes], ...]:
    """The byte replacement that names the earlier answer back as the client named it, when its
    sealed id was swapped for the engine's own in the body (``InferenceRequest.public_previous_id``)."""
    public = request.public_previous_id
    if public is None:
        return ()
    return ((orjson.dumps(request.body["previous_response_id"]), orjson.dumps(public)),)


def _lost_previous(request: InferenceRequest) -> NotFound:
    """The 404 of the engine that held the earlier answer ``request`` continues: it no longer has it
    (it restarted, or evicted it). Not the gateway's misconfiguration, nor worth a retry elsewhere:
    the client's conversation state is gone."""
    return NotFound(
        f"The backend '{request.pinned_backend}' that held the earlier response no longer has it (it restarted "
        "or evicted it); start the conversation again.",
        code="previous_response_not_found",
        param="previous_response_id",
    )


def _refused(failure: Failure) -> bool:
    """The engine answered 429 or 503: it has no room for the request (another target may)."""
    return failure.status in (429, 503) and not failure.client_bytes_sent


def _report_verdict(breaker: CircuitBreaker, verdict: bool | None) -> None:
    """An attempt's verdict to its backend's breaker: None (the client left) counts neither way."""
    if verdict is None:
        breaker.abstain()
    elif verdict:
        breaker.on_success()
    else:
        breaker.on_failure()


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
