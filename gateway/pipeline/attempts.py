"""The attempts of one request: a backend, an attempt on it, and what to do when it fails.

The rule (``gateway/upstream/retry.py`` states when a failure is retryable, ``gateway/pipeline/migration.py``
when a broken stream can be continued):

1. Ask the dispatcher for a backend with room (it may queue, or refuse at once), on the
   request's target or down its fallback chain (``gateway/routing/targets.py``).
2. Run one attempt on it (``gateway/pipeline/attempt.py``): it answers, or says how it failed
   in a frozen ``AttemptResult``.
3. A failure before any byte reached the client is retried on another backend when it is
   retryable, attempts remain (``retry.max_retries``), the deadline allows and the retry
   budget has room; otherwise it is the request's error. A stream that breaks after bytes
   reached the client is continued on another backend under the same bounds (a migration is
   a retry), or ends with an error event and ``[DONE]``.

Every attempt gives its backend slot back when it ends. Each leaves an ``AttemptRecord``; when
the request ends, ``answered`` freezes what the attempts did (records, the target that answered,
the fallback's reason, the answer's timing and text) for the pipeline, which reads nothing else.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NamedTuple

from gateway.dispatch.cache_report import CacheReport
from gateway.dispatch.dispatcher import Grant
from gateway.dispatch.router import RoutingDecision
from gateway.errors import ErrorCode, GatewayError, NoHealthyBackend, Overloaded, code_of
from gateway.pipeline.attempt import Attempt, AttemptDeps, ClientAnswer, Target, Translations
from gateway.pipeline.client_response import ClientResponse
from gateway.pipeline.context import RequestContext
from gateway.pipeline.migration import continuation
from gateway.pipeline.outcome import AttemptRecord
from gateway.routing.targets import fits, retarget
from gateway.telemetry.token_stats import TokenStats
from gateway.telemetry.tracing import RequestSpan
from gateway.types import InferenceRequest
from gateway.upstream.client import new_engine_request_id
from gateway.upstream.retry import Failure, is_retryable, retry_delay

log = logging.getLogger(__name__)


class Answered(NamedTuple):
    """What the attempts of one request did, frozen: what its outcome and settlement read."""

    records: tuple[AttemptRecord, ...]
    model: str
    """The target (served model) that answered, or the last one tried."""
    fallback: str | None
    """Why the request left its first target (``gateway_fallbacks_total{reason}``), if it did."""
    tokens: TokenStats | None
    """The answer's output timing and usage, once a backend answered."""
    text: str | None
    """Choice 0's text, when collected for a shadow's scorer (``on_dispatched`` asked for it)."""
    cache: CacheReport | None
    """What the engine that answered said it reused of the prompt, against the router's prediction."""


class Attempts:
    """The attempts of one request (see the module docstring); ``run`` once, then ``answered``.

    ``on_dispatched`` is called once, when the first attempt has its backend (a group's shadow
    copy starts then), and says whether to collect the answer's text for the copy's scorer."""

    __slots__ = (
        "_answer",
        "_cache",
        "_fallback",
        "_next_target",
        "_on_dispatched",
        "_records",
        "_translations",
        "ctx",
        "deps",
        "model",
        "response",
    )

    def __init__(
        self,
        ctx: RequestContext,
        deps: AttemptDeps,
        response: ClientResponse,
        on_dispatched: Callable[[], bool] | None = None,
    ) -> None:
        self.ctx = ctx
        self.deps = deps
        self.response = response
        self._on_dispatched = on_dispatched
        self._records: list[AttemptRecord] = []
        self._answer = ClientAnswer()
        self._translations = Translations()
        self._next_target = 1
        """Index in ``ctx.route.targets`` of the next fallback target to try."""
        self._fallback: str | None = None
        self._cache: CacheReport | None = None
        self.model = ctx.request.model
        """The target (served model) the request is on now: its first, or the fallback it moved to."""

    async def run(self) -> ErrorCode | None:
        """Answer the request; None when the answer completed, else the code its stream ended with.

        Raises the ``GatewayError`` that ended the request while nothing was sent yet; once a
        stream started, a failure ends it with an error event and ``[DONE]`` instead."""
        try:
            return await self._attempts()
        except GatewayError as error:
            if not await self.end_started_stream(error):
                raise
            return code_of(error)

    async def end_started_stream(self, error: GatewayError) -> bool:
        """End the client's stream with ``error``'s event and the API's end, if a stream started
        (the deadline passed, or the gateway failed, while it ran); False when none did."""
        relay = self._answer.relay
        if relay is None or not self.response.started:
            return False
        await relay.finish(error)
        return True

    def answered(self) -> Answered:
        """What the attempts did so far, frozen (the request's outcome keeps it)."""
        answer = self._answer
        timer = answer.timer
        texts = answer.texts
        return Answered(
            tuple(self._records),
            self.model,
            self._fallback,
            timer.stats() if timer is not None else None,
            "".join(texts) if texts is not None else None,
            self._cache,
        )

    async def _attempts(self) -> ErrorCode | None:
        ctx, deps = self.ctx, self.deps
        retry = ctx.runtime.snapshot.policy.retry
        budget = ctx.runtime.retry_budget
        budget.record_request()
        request = ctx.request
        tried: frozenset[str] = frozenset()
        continued = False
        for attempt in range(retry.max_retries + 1):
            t_ask = deps.clock.now()
            request, grant = await self._grant(request, tried)
            self.model = request.model
            if self._on_dispatched is not None:
                started, self._on_dispatched = self._on_dispatched, None
                if started():
                    self._answer.texts = []
            now = deps.clock.now()
            if ctx.span.recording:
                _trace_grant(ctx.span, grant.decision, t_ask, now, ctx.class_name)
            engine_id = new_engine_request_id()
            self._records.append(AttemptRecord(grant.state.name, grant.decision, grant.queued_s, now, engine_id))
            span = ctx.span.attempt(backend=grant.state.name, number=attempt + 1, t=now)
            target = Target(self.model, self._fallback)
            one = Attempt(ctx, deps, self.response, self._answer, grant, span, target, self._translations)
            try:
                result = await one.run(request, engine_id, retry.migrate_streams)
            finally:
                deps.dispatcher.give_back(request.model, grant)
            if result.error is None:
                if not continued:  # a continuation's usage is spliced: not its own prompt's figures
                    timer = self._answer.timer
                    self._cache = deps.dispatcher.answered(request, grant.decision, timer.usage if timer else None)
                return result.ended
            error = result.error
            self._records[-1] = self._records[-1]._replace(error=code_of(error))
            if result.broken:
                follow_up = self._migration(request, error, attempt, retry.max_retries)
                if follow_up is None:
                    raise error
                request = follow_up
                continued = True
                deps.metrics.retries.labels(grant.state.name, error.code).inc()
                tried = tried | {grant.state.name}
                continue
            failure = result.failure or Failure(error=error, client_bytes_sent=self.response.started)
            if attempt == retry.max_retries:
                raise error
            tried = tried | {grant.state.name}
            moved = self._fall_back_after(request, failure, error, tried)
            if moved is not None:
                request, tried = moved, frozenset()
                continue
            if not is_retryable(failure, statuses=retry.retryable_statuses):
                raise error
            if not budget.try_spend():
                deps.metrics.retry_budget_exhausted.labels(request.model).inc()
                raise error
            delay = retry_delay(
                retry, attempt + 1, failure, now=deps.clock.now(), deadline=ctx.deadline, same_backend=False
            )
            if delay is None:
                raise error
            deps.metrics.retries.labels(grant.state.name, error.code).inc()
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
            self._fallback = reason
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

    def _migration(
        self, request: InferenceRequest, error: GatewayError, attempt: int, max_retries: int
    ) -> InferenceRequest | None:
        """The continuation of a broken stream if one may start now; counts the verdict either way."""
        ctx, deps = self.ctx, self.deps
        splice = self._answer.splice
        assert splice is not None  # only a tracked stream breaks continuably
        progress = splice.progress
        follow_up = continuation(request, progress)
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
            self._records[-1].backend,
            error.code,
            progress.tokens,
            verdict,
        )
        return follow_up if verdict == "continued" else None


def _refused(failure: Failure) -> bool:
    """The engine answered 429 or 503: it has no room for the request (another target may)."""
    return failure.status in (429, 503) and not failure.client_bytes_sent


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
