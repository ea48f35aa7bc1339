"""One attempt of a request: a body for one backend, its breaker, the call, and the answer relayed.

Why apart from the attempts loop (``gateway/pipeline/attempts.py``): the loop decides (retry,
fall back, continue a broken stream); an attempt only does, and says how it went in one frozen
``AttemptResult``. Nothing of an attempt's decisions lives in the loop's state, and the loop
reads nothing of an attempt but its result.

An attempt, on the backend its grant names:

1. builds its body from the (frozen) request and that backend's kind
   (``gateway/upstream/body.py``): nothing one backend needed carries over to the next;
2. asks the backend's breaker, and sends;
3. passes a whole answer through, or relays a stream event by event
   (``gateway/pipeline/relay.py``); a stream's relay, timer and splice belong to the request's
   ``ClientAnswer`` and outlive the attempt, since a continuation writes to the same client stream;
4. reports one verdict to the breaker at the end of the answer: success, failure, or none
   (the client left).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from gateway.clock import Clock
from gateway.dialects.base import Translation
from gateway.dialects.openai_answers import answer_text
from gateway.dispatch.backends import BackendPool, BackendState
from gateway.dispatch.breaker import CircuitBreaker
from gateway.dispatch.dispatcher import Dispatcher, Grant
from gateway.errors import ErrorCode, GatewayError, NotFound, UpstreamError, code_of
from gateway.pipeline.client_response import SSE_HEADERS, ClientResponse
from gateway.pipeline.context import RequestContext
from gateway.pipeline.migration import StreamSplice, can_continue
from gateway.pipeline.relay import SseRelay, StreamEnd, TokenTimer, renaming
from gateway.responses.affinity import ResponseAffinity
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import AttemptSpan
from gateway.types import InferenceRequest
from gateway.upstream.body import attempt_body, attempt_isolation, translated_request
from gateway.upstream.client import UpstreamClient, UpstreamResponse
from gateway.upstream.errors import FaultLog
from gateway.upstream.retry import Failure

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


class AttemptResult(NamedTuple):
    """How one attempt went, frozen; the attempts loop decides from it alone.

    ``error`` None: the attempt answered, and ``ended`` says how its stream ended (None: completed,
    else the code of the error event it ended with). Otherwise it failed with ``error``:
    ``failure`` holds what the retry rules read (status, ``Retry-After``, bytes sent), and
    ``broken`` says a started stream broke where it may be continued elsewhere."""

    ended: ErrorCode | None = None
    error: GatewayError | None = None
    failure: Failure | None = None
    broken: bool = False


ANSWERED = AttemptResult()


class Target(NamedTuple):
    """Where the request is now, as the loop decided: the target (served model) it is on, and
    why it left its first target, if it did (``x-gateway-target``, ``x-gateway-fallback``)."""

    model: str
    fallback: str | None


class ClientAnswer:
    """The request's answer to its client, carried from attempt to attempt: a stream's relay,
    timer and splice once it started (a continuation writes to the same stream), the answer's
    id once seen, and its text when a shadow's scorer wants it. One per request; the attempts
    loop freezes what it holds into the request's ``Answered``."""

    __slots__ = ("answer_id", "relay", "splice", "texts", "timer")

    def __init__(self) -> None:
        self.timer: TokenTimer | None = None
        self.relay: SseRelay | None = None
        self.splice: StreamSplice | None = None
        self.answer_id: str | None = None
        """The id later requests may name the answer by (``Dialect.answer_id``), once seen."""
        self.texts: list[str] | None = None
        """A list when the answer's text (choice 0) is collected: a shadow's quality scorer compares it."""


class Translations:
    """The last request translated for a backend of another API, and its translation: built once
    per request state (a retry sends the same body, a fallback's retargeted request gets its own).
    One per request, shared by its attempts."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[InferenceRequest, InferenceRequest] | None = None

    def of(self, request: InferenceRequest, translation: Translation) -> InferenceRequest:
        """``request`` in the API ``translation`` calls the backend with."""
        last = self._last
        if last is not None and last[0] is request:
            return last[1]
        sent = translated_request(request, translation)
        self._last = (request, sent)
        return sent


class StreamBroken(Exception):
    """A started stream's upstream failed while the stream could still be continued elsewhere."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


class Attempt:
    """One attempt (module docstring): ``run`` once."""

    __slots__ = ("_failure", "_translations", "answer", "ctx", "deps", "grant", "response", "span", "target")

    def __init__(
        self,
        ctx: RequestContext,
        deps: AttemptDeps,
        response: ClientResponse,
        answer: ClientAnswer,
        grant: Grant,
        span: AttemptSpan,
        target: Target,
        translations: Translations,
    ) -> None:
        self.ctx, self.deps, self.response, self.answer = ctx, deps, response, answer
        self.grant, self.span, self.target = grant, span, target
        self._failure: Failure | None = None
        self._translations = translations

    async def run(self, request: InferenceRequest, engine_id: str, migrate: bool) -> AttemptResult:
        """Send ``request`` to the grant's backend and answer the client; never raises a ``GatewayError``."""
        try:
            ended = await self._forward(request, engine_id, migrate)
        except StreamBroken as broken:
            return AttemptResult(error=broken.error, broken=True)
        except GatewayError as error:
            return AttemptResult(error=error, failure=self._failure)
        return ANSWERED if ended is None else AttemptResult(ended)

    async def _forward(self, request: InferenceRequest, engine_id: str, migrate: bool) -> ErrorCode | None:
        """Send, then relay or pass the answer through."""
        ctx, deps, span = self.ctx, self.deps, self.span
        state = self.grant.state
        backend = state.backend
        track = migrate and can_continue(request, backend.kind)
        runtime = ctx.runtime
        isolation = attempt_isolation(request.api, backend, ctx.tenant, runtime.snapshot, runtime.salter)
        translation = isolation.translation
        sent = request if translation is None else self._translations.of(request, translation)
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
                ended = await self._relay(request, response, track, report, translation)
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

    async def _pass_through(
        self, state: BackendState, response: UpstreamResponse, report: FaultLog, translation: Translation | None
    ) -> None:
        body = await self.deps.upstream.read_all(state.backend, response)
        request = self.ctx.request
        api = request.api if translation is None else translation.upstream
        document = self.deps.upstream.answer(body, report, api)  # raises unless an answer of its API
        timer = TokenTimer(request.arrival)
        timer.usage = api.answer_usage(document)
        self.answer.timer = timer
        if isinstance(document, dict):
            if self.answer.texts is not None:
                self.answer.texts.append(answer_text(document))
            if translation is not None:
                document = translation.answer(document)
                body = orjson.dumps(document)
            if request.api.keeps_state:
                upstream_id = request.api.answer_id(document)
                public_id = self._remember(upstream_id)
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
        answer = self.answer
        if answer.texts is not None:
            answer.texts.append(answer_text(event))
        api = self.ctx.request.api
        if answer.answer_id is None and api.keeps_state:
            upstream_id = api.answer_id(event)
            public_id = self._remember(upstream_id)
            if public_id != upstream_id and upstream_id is not None and answer.relay is not None:
                answer.relay.rename_also(orjson.dumps(upstream_id), orjson.dumps(public_id))  # this event on

    def _remember(self, answer_id: str | None) -> str | None:
        """Where an answer of a stateful API lives, for the requests that will name it: as soon as
        its id is seen (a stream's first event), so that it is known everywhere before it ends.
        The id the client is to see (sealed, with a secret: ``gateway/responses/ids.py``)."""
        if answer_id is None:
            return None
        public_id = self.deps.affinity.remember(
            answer_id, self.ctx.tenant.name, self.grant.state.name, self.target.model
        )
        self.answer.answer_id = public_id
        return public_id

    def _target_headers(self) -> None:
        """Which target of its group answered the request, and why it fell back if it did."""
        if self.ctx.route.group is None:
            return
        headers = self.response.extra_headers
        headers.append((b"x-gateway-target", self.target.model.encode()))
        if self.target.fallback is not None:
            headers.append((b"x-gateway-fallback", self.target.fallback.encode()))

    async def _relay(
        self,
        request: InferenceRequest,
        response: UpstreamResponse,
        track: bool,
        report: FaultLog,
        translation: Translation | None,
    ) -> ErrorCode | None:
        """Relay the stream (or its continuation): None when it completed, else the code it ended
        with (after its error event); raise ``StreamBroken`` when it could go on elsewhere."""
        deps, answer, grant = self.deps, self.answer, self.grant
        model = request.model

        def first_token() -> None:
            """The prefill is done; called inside the chunk's parse (other requests are handed the room after it)."""
            deps.dispatcher.first_token(model, grant)

        relay = answer.relay
        if relay is None:
            timer = TokenTimer(request.arrival, on_first=first_token)
            answer.timer = timer
            self._target_headers()
            await self.response.start(200, list(SSE_HEADERS))
            answer.splice = StreamSplice() if track else None
            relay = SseRelay(
                self.response.send,
                timer,
                deps.clock,
                dialect=request.api if translation is None else translation.upstream,
                client=None if translation is None else request.api,
                translator=None if translation is None else translation.stream(),
                strip_usage=not request.client_wants_usage and translation is None,
                splice=answer.splice,
                keep_continuous=request.client_wants_continuous_usage,
                redactor=deps.upstream.redactor,
                rename=renaming(request.body.get("model"), self.ctx.route.public_name) + previous_renaming(request),
                on_event=self._on_event if answer.texts is not None or request.api.keeps_state else None,
            )
            answer.relay = relay
        else:
            assert answer.splice is not None  # a continuation follows a tracked stream only
            relay.resume()
            answer.splice.resume(on_output=first_token)
        backend = grant.state.backend
        failure = await relay.forward(response.stream(backend.name, backend.timeouts.between_chunks_s), report)
        if failure is not None:
            if answer.splice is not None and answer.splice.progress.continuable:
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


def _report_verdict(breaker: CircuitBreaker, verdict: bool | None) -> None:
    """An attempt's verdict to its backend's breaker: None (the client left) counts neither way."""
    if verdict is None:
        breaker.abstain()
    elif verdict:
        breaker.on_success()
    else:
        breaker.on_failure()
