"""Shadow copies of a model group's requests: sent to the group's shadow target, measured, never answered.

The rule, per request of a group with a ``shadow`` (``gateway/policy/groups.py``):

1. Copy it with probability ``percent / 100`` (the runner's own random source), if its API
   streams (a copy is measured from its stream: an embedding is never copied), its prompt is
   within the shadow model's ``max_prompt_tokens`` and the runner is not closed.
2. Count it ``at_cap`` and drop it while ``max_concurrent`` copies of the group run.
3. Place it at once or never (``Dispatcher.place_now``) in the policy's lowest class (highest
   ``rank``, batch), its ``max_share`` applying: no room now, or a real request waiting for the
   backend, is ``no_room``. It never waits in a queue and never retries.
4. Send it as a stream that reports usage, with the tenant's isolation fields for that backend
   (its ``cache_salt``: a copy warms, and may only read, the tenant's own cache scope), bounded
   by the request's deadline. The tenant is not charged for it (no limiter is asked), and nor
   are the backend's other tenants: the copy pays its share of the backend's bill under its
   group (step 7).
5. Read the stream to its end with the request's dialect: TTFT from the copy's dispatch, the
   gaps between output events, output tokens from the engine's usage; the output text only when
   the group names a quality scorer.
6. The moment a real request has to wait for a backend (``DispatchObserver.request_waits``: the
   runner observes the dispatcher), every copy holding a slot there is cancelled (``preempted``); its slot goes
   to that request as it is given back.
7. Whatever ends it, the slot is given back once (in the task's done callback, so even a copy
   cancelled before it started) and one outcome is counted in
   ``gateway_shadow_requests{group,target,outcome}``: ``completed``, ``error``, ``no_room``,
   ``at_cap``, ``preempted``, ``cancelled`` (``aclose``). A copy that held a slot is then
   charged like a request the backend finished (``CostMeter.charge_copy``): its tokens as the
   engine reported them (none without usage, as for a request), under the tenant label
   ``~shadow:<group>``, the shadow model and the class it ran in; without that, the backend's
   bill for the interval would be split among the real requests alone.

A copy's answer reaches no client: the runner holds no response, and a ``ShadowHandle`` only
takes the primary's text for the scorer. A copy's failure is counted and logged at debug with
its error code; no log line holds prompt or completion text. Every copy is a task the runner
owns, removed from its set when done; ``aclose`` cancels and awaits them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import orjson

from gateway.clock import Clock
from gateway.dialects.base import Dialect
from gateway.dialects.openai_answers import answer_text
from gateway.dispatch.backends import BackendState
from gateway.dispatch.dispatcher import Dispatcher, Grant
from gateway.dispatch.observers import DispatchObserver
from gateway.errors import GatewayError, InvalidRequest
from gateway.policy.groups import ModelGroup
from gateway.policy.model import ModelPolicy, PriorityClass, Tenant
from gateway.runtime import Runtime
from gateway.shadow.scorers import SCORERS, QualityScorer
from gateway.telemetry.cost_meter import CostMeter
from gateway.telemetry.metrics import Metrics
from gateway.types import InferenceRequest
from gateway.upstream.body import attempt_body, attempt_isolation, translated_request
from gateway.upstream.client import StreamChunks, UpstreamClient, new_engine_request_id
from gateway.upstream.errors import is_error_document
from gateway.upstream.sse_reader import SseEventTooLong, SseReader, single_data, sse_fields

log = logging.getLogger(__name__)


class ShadowedRequest(Protocol):
    """What a copy is made from (the pipeline's ``RequestContext`` is one): the shadow runner owns
    the protocol it consumes, so it imports nothing of the pipeline."""

    @property
    def request(self) -> InferenceRequest: ...
    @property
    def tenant(self) -> Tenant: ...
    @property
    def runtime(self) -> Runtime: ...
    @property
    def deadline(self) -> float: ...


class ShadowHandle:
    """The pipeline's side of one running copy (its ``ShadowCopy``, ``gateway/pipeline/shadowing.py``):
    it hands over the primary's answer, nothing else.

    ``primary_answered(text)`` once, when the primary ends: its output text, or None when not
    known (failed, not collected). With a scorer, the copy is scored once both texts are in,
    whichever ends first; without one, the call does nothing and keeps nothing
    (``wants_primary_text`` says whether collecting the primary's text is worth it)."""

    __slots__ = ("_judge", "_primary", "_primary_known", "_shadow", "_shadow_known")

    def __init__(self, judge: Callable[[str, str], None] | None) -> None:
        self._judge = judge
        self._primary: str | None = None
        self._shadow: str | None = None
        self._primary_known = False
        self._shadow_known = False

    @property
    def wants_primary_text(self) -> bool:
        """Whether ``primary_answered`` uses a text (the group's shadow has a scorer)."""
        return self._judge is not None

    def primary_answered(self, text: str | None) -> None:
        if self._primary_known:
            return
        self._primary_known = True
        self._primary = text if self._judge is not None else None
        self._settle()

    def _shadow_answered(self, text: str | None) -> None:
        self._shadow_known = True
        self._shadow = text if self._judge is not None else None
        self._settle()

    def _settle(self) -> None:
        """Score once both answers are in; as soon as either is missing, drop the other's text."""
        if not (self._primary_known and self._shadow_known):
            if (self._primary_known and self._primary is None) or (self._shadow_known and self._shadow is None):
                self._judge = None
                self._primary = self._shadow = None
            return
        judge, primary, shadow = self._judge, self._primary, self._shadow
        self._judge = self._primary = self._shadow = None
        if judge is not None and primary is not None and shadow is not None:
            judge(primary, shadow)


@dataclasses.dataclass(slots=True, eq=False)
class _Shadow:
    """One running copy: whose it is, the slot it holds, what was measured of it so far."""

    group: str
    target: str
    request: InferenceRequest
    grant: Grant
    handle: ShadowHandle
    class_name: str
    """The class it runs in (the lowest): its cost is charged under it."""
    task: asyncio.Task[str] | None = None
    ended_by: str | None = None
    """``preempted`` or ``cancelled`` once the runner cancelled it."""
    first_output: float | None = None
    last_output: float = 0.0
    gaps: list[float] = dataclasses.field(default_factory=list)
    usage: Mapping[str, Any] | None = None
    pieces: list[str] = dataclasses.field(default_factory=list)


class ShadowFailed(Exception):
    """A copy's answer was not a whole stream (a status, an error event, a cut); ``code`` is logged."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class ShadowRunner(DispatchObserver):
    """Runs the shadow copies of every group (see the module docstring); one per gateway, the
    pipeline's ``Shadows`` (``gateway/pipeline/shadowing.py``).

    Usage::

        runner = ShadowRunner(clock, dispatcher, upstream, metrics, costs=cost_meter)
        observers.add(runner)                     # the Observers the dispatcher was built with
        handle = runner.copy(ctx, group)          # after the request is admitted
        ...                                       # the primary is answered
        if handle is not None:
            handle.primary_answered(text_or_none)
        await runner.aclose()                     # at shutdown, after the dispatcher drains
    """

    def __init__(
        self,
        clock: Clock,
        dispatcher: Dispatcher,
        upstream: UpstreamClient,
        metrics: Metrics,
        rng: random.Random | None = None,
        *,
        costs: CostMeter,
    ) -> None:
        self._clock = clock
        self._dispatcher = dispatcher
        self._upstream = upstream
        self._metrics = metrics
        self._costs = costs
        self._random = (rng or random.Random()).random
        self._shadows: set[_Shadow] = set()
        self._per_group: dict[str, int] = {}
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Copies running now, all groups together."""
        return len(self._shadows)

    def copy(self, ctx: ShadowedRequest, group: ModelGroup) -> ShadowHandle | None:
        """Start a copy of ``ctx.request`` on ``group``'s shadow target, or not; never blocks nor raises."""
        policy = group.shadow
        request = ctx.request
        if policy is None or self._closed or not _streams(request.api) or request.pinned_backend is not None:
            return None  # a follow-up of a stored answer only makes sense where that answer lives
        if self._random() * 100 >= policy.percent:
            return None
        runtime = ctx.runtime
        target = runtime.snapshot.models.get(policy.model)
        if target is None or request.prompt_tokens > target.max_prompt_tokens:
            return None
        if self._per_group.get(group.name, 0) >= policy.max_concurrent:
            self._count(group.name, policy.model, "at_cap")
            return None
        copy = shadow_request(request, target)
        class_name = lowest_class_name(runtime.snapshot.policy.classes)
        priority_class = runtime.snapshot.policy.classes[class_name]
        grant = self._dispatcher.place_now(copy, ctx.tenant, priority_class)
        if grant is None:
            self._count(group.name, policy.model, "no_room")
            return None
        backend = grant.state.backend
        isolation = attempt_isolation(copy.api, backend, ctx.tenant, runtime.snapshot, runtime.salter)
        if isolation.translation is not None:  # as the request's own attempts do (Messages through chat)
            copy = translated_request(copy, isolation.translation)
        body = attempt_body(copy, backend, isolation=isolation.fields, rank=priority_class.rank, track=False)
        scorer = SCORERS.get(policy.scorer) if policy.scorer else None
        handle = ShadowHandle(self._judge(group.name, policy.model, scorer) if scorer is not None else None)
        shadow = _Shadow(group.name, policy.model, copy, grant, handle, class_name)
        task = asyncio.get_running_loop().create_task(self._run(shadow, body, ctx.deadline), name="shadow")
        shadow.task = task
        self._shadows.add(shadow)
        self._per_group[group.name] = self._per_group.get(group.name, 0) + 1
        task.add_done_callback(lambda done: self._finished(shadow, done))
        return handle

    def request_waits(self, states: Sequence[BackendState]) -> int:
        """A real request must wait for one of ``states`` (``DispatchObserver``): cancel every copy
        holding a slot on one of them (preempt it); how many slots come back (each when its copy's
        task has ended, on the next turns of the loop)."""
        if not self._shadows:
            return 0
        wanted = set(states)
        freed = 0
        for shadow in self._shadows:
            if shadow.ended_by is None and shadow.grant.state in wanted and _cancel(shadow):
                shadow.ended_by = "preempted"
                freed += 1
        return freed

    async def aclose(self) -> None:
        """Take no more copies; cancel the running ones and wait until each has given its slot back."""
        self._closed = True
        tasks = []
        for shadow in self._shadows:
            if shadow.ended_by is None and _cancel(shadow):
                shadow.ended_by = "cancelled"
            if shadow.task is not None:
                tasks.append(shadow.task)
        if tasks:
            # Each task's own done callback (``_finished``) was added before ``wait``'s, so it has
            # run, and the slot is back, by the time ``wait`` returns.
            await asyncio.wait(tasks)

    async def _run(self, shadow: _Shadow, body: bytes, deadline: float) -> str:
        """Send the copy and read its stream to the end; ``completed`` or ``error``."""
        backend = shadow.grant.state.backend
        request = shadow.request
        engine_id = new_engine_request_id()
        try:
            async with asyncio.timeout(max(0.0, deadline - self._clock.now())):
                response = await self._upstream.open(
                    backend, request.api, body, request_id=request.request_id, engine_request_id=engine_id
                )
                try:
                    if response.status_code != 200:
                        raise ShadowFailed(f"status_{response.status_code}")
                    await self._read(shadow, response.stream(backend.name, backend.timeouts.between_chunks_s))
                finally:
                    await response.aclose()
        except (GatewayError, ShadowFailed, TimeoutError) as exc:
            code = exc.code if isinstance(exc, GatewayError | ShadowFailed) else "deadline"
            log.debug(
                "shadow of request %s (group %s) on backend %s, engine request %s: failed (%s)",
                request.request_id,
                shadow.group,
                backend.name,
                engine_id,
                code,
            )
            return "error"
        return "completed"

    async def _read(self, shadow: _Shadow, chunks: StreamChunks) -> None:
        """Read every event of the stream, framed as the relay frames it (``SseReader``, its bound
        included: an event growing past it ends the copy as an error)."""
        reader = SseReader()
        done = False
        async for data in chunks:
            try:
                events = reader.feed(data)
            except SseEventTooLong as exc:
                raise ShadowFailed("event_too_long") from exc
            now = self._clock.now()
            for event in events:
                done = self._event(shadow, event, now) or done
        for event in reader.end():  # a last CR ends a line
            done = self._event(shadow, event, self._clock.now()) or done
        if not done:
            raise ShadowFailed("stream_cut")

    def _event(self, shadow: _Shadow, event: bytes, t: float) -> bool:
        """Measure one event; True at ``[DONE]``."""
        payload = _data(event)
        if payload is None:
            return False
        if payload == b"[DONE]":
            return True
        try:
            document = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(document, dict):
            return False
        if is_error_document(document):
            raise ShadowFailed("error_event")
        output, usage, _, _ = shadow.request.api.read_chunk(document)
        if usage:
            shadow.usage = usage
        if output:
            if shadow.first_output is None:
                shadow.first_output = t
                self._dispatcher.first_token(shadow.request.model, shadow.grant)
            else:
                shadow.gaps.append(t - shadow.last_output)
            shadow.last_output = t
            if shadow.handle.wants_primary_text:  # a scorer, and no side known to be missing yet
                shadow.pieces.append(answer_text(document))
        return False

    def _finished(self, shadow: _Shadow, task: asyncio.Task[str]) -> None:
        """The copy ended, however: its slot back, its outcome and measurements recorded, once."""
        self._shadows.discard(shadow)
        left = self._per_group[shadow.group] - 1
        if left:
            self._per_group[shadow.group] = left
        else:
            del self._per_group[shadow.group]
        self._give_back(shadow)
        if task.cancelled():
            outcome = shadow.ended_by or "cancelled"
        elif (exc := task.exception()) is not None:  # not a failure of the copy's: a fault of the runner's
            log.warning("shadow of request %s broke: %s", shadow.request.request_id, type(exc).__name__)
            outcome = "error"
        else:
            outcome = task.result()
        self._record(shadow, outcome)
        self._bill(shadow)
        shadow.handle._shadow_answered("".join(shadow.pieces) if outcome == "completed" else None)

    def _give_back(self, shadow: _Shadow) -> None:
        """The slot back, handed to whoever waits for it, of any model the backend serves (a real
        request that preempted the copy may be another model's: ``Dispatcher.give_back``)."""
        self._dispatcher.give_back(shadow.request.model, shadow.grant)

    def _record(self, shadow: _Shadow, outcome: str) -> None:
        m, labels = self._metrics, (shadow.group, shadow.target)
        self._count(*labels, outcome)
        if shadow.first_output is not None:
            m.child(m.shadow_ttft, *labels).observe(shadow.first_output - shadow.grant.dispatched_at)
        if shadow.gaps:
            m.observe_many(m.child(m.shadow_itl, *labels), shadow.gaps)
        tokens = shadow.usage.get("completion_tokens") if shadow.usage else None
        if isinstance(tokens, int) and tokens > 0:
            m.child(m.shadow_output_tokens, *labels).inc(tokens)

    def _bill(self, shadow: _Shadow) -> None:
        """The copy's share of its backend's bill, to its group (module docstring, step 7)."""
        usage = shadow.usage or {}
        tokens = sum(n for key in ("prompt_tokens", "completion_tokens") if isinstance(n := usage.get(key), int))
        self._costs.charge_copy(
            group=shadow.group,
            model=shadow.request.model,
            class_name=shadow.class_name,
            backend=shadow.grant.state.name,
            tokens=tokens,
        )

    def _count(self, group: str, target: str, outcome: str) -> None:
        self._metrics.child(self._metrics.shadow_requests, group, target, outcome).inc()

    def _judge(self, group: str, target: str, scorer: QualityScorer) -> Callable[[str, str], None]:
        histogram = self._metrics.child(self._metrics.shadow_quality, group, target, scorer.name)

        def judge(primary: str, shadow: str) -> None:
            histogram.observe(min(1.0, max(0.0, scorer.score(primary, shadow))))

        return judge


def shadow_request(request: InferenceRequest, target: ModelPolicy) -> InferenceRequest:
    """The copy of ``request`` for ``target``: its model, its served name in the body, streamed,
    its output bound within the target's cap; usage is asked for by ``attempt_body``."""
    body = {**request.body, "model": target.upstream_name or target.name, "stream": True}
    return dataclasses.replace(
        request,
        request_id=f"{request.request_id}.shadow",
        model=target.name,
        body=body,
        body_modified=True,
        stream=True,
        client_wants_usage=False,
        max_tokens=min(request.max_tokens, target.max_output_tokens),
        prefix_keys=None,  # rooted in the model's name: the target's router computes its own
    )


def lowest_class_name(classes: Mapping[str, PriorityClass]) -> str:
    """The class served last (highest ``rank``): the batch class in the usual policies."""
    return max(classes, key=lambda name: classes[name].rank)


def _streams(api: Dialect) -> bool:
    """Whether ``api`` answers as a stream at all (an embedding does not)."""
    try:
        api.stream_flags({"stream": True})
    except InvalidRequest:
        return False
    return True


def _cancel(shadow: _Shadow) -> bool:
    return shadow.task is not None and shadow.task.cancel()


def _data(event: bytes) -> bytes | None:
    """The ``data`` of one SSE event (its ``data:`` lines joined), None when it has none."""
    payload = single_data(event)
    return payload if payload is not None else sse_fields(event).data
