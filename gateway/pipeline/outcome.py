"""What a finished request leaves behind: one frozen ``RequestOutcome``, read by the recorder.

Why a value of its own: every consumer of a finished request (metrics, goodput, cost, the
trace log, the trace span) needs the same facts, and each used to read them from the object
the pipeline was still writing into. The pipeline now builds this value once, at the end,
and hands it to ``gateway/pipeline/recorder.py``; nothing downstream can change what another sees.

The values here are ``NamedTuple``s rather than frozen dataclasses: as immutable, and three
times cheaper to build (a frozen dataclass sets each field through ``object.__setattr__``),
which matters for values built once per request. The answer's timing and usage (``TokenStats``)
is telemetry's value (``gateway/telemetry/token_stats.py``), as is what goodput and the cost meter
read of a finished request (``judge_slo``'s ``JudgedRequest``, ``CostMeter.charge``'s
``ChargedRequest``): telemetry is below the pipeline, and ``RequestOutcome`` is one of each.

The ``outcome`` label of ``gateway_requests_total`` is ``label``: ``completed``,
``client_disconnected``, or the error code that ended the request (``queue_full``,
``upstream_stalled``, ...), all members of ``Result`` or ``gateway.errors.ErrorCode``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple

from gateway.dialects.base import Dialect
from gateway.errors import ErrorCode
from gateway.telemetry.token_stats import TokenStats

if TYPE_CHECKING:
    from gateway.dispatch.cache_report import CacheReport
    from gateway.dispatch.router import RoutingDecision
    from gateway.pipeline.context import RequestContext
    from gateway.policy.model import Slo
    from gateway.routing.targets import TargetChoice
    from gateway.telemetry.tracing import RequestSpan


class Result(StrEnum):
    """How a request ended, before any detail: the label when no error code says more."""

    COMPLETED = "completed"
    CLIENT_DISCONNECTED = "client_disconnected"
    FAILED = "failed"
    """Ended by a ``GatewayError`` (its ``ErrorCode`` is the label) or an error event in a stream."""


class AttemptRecord(NamedTuple):
    """One attempt on one backend: its routing decision, its wait, and how it ended."""

    backend: str
    decision: RoutingDecision
    queued_s: float
    t_dispatch: float
    engine_request_id: str
    error: ErrorCode | None = None


class RequestOutcome(NamedTuple):
    """Everything known of a request once its response ended (see the module docstring).

    ``tenant``, ``model`` and ``class_name`` are ``-`` when the request ended before they were
    known; ``slo`` is the class's objectives in the policy the request started with (None
    when it never got a class); ``status`` 0 (or 499) means no response reached the client.
    """

    request_id: str
    api: Dialect
    arrival: float
    end: float
    tenant: str
    model: str
    class_name: str
    stream: bool
    status: int
    result: Result
    error: ErrorCode | None
    attempts: tuple[AttemptRecord, ...]
    t_admit: float | None
    tokens: TokenStats | None
    slo: Slo | None
    span: RequestSpan
    context: RequestContext | None = None
    """The validated request, its tenant and policy (None when it ended before validation): the
    trace log's prefix signature and session are computed from it, and only when there is one."""
    fallback: str | None = None
    """Why a model group's request left the target first drawn for it (``gateway/routing/targets.py``)."""
    cache: CacheReport | None = None
    """What the engine that answered said it reused of the prompt, against the router's prediction
    (None: no answer, or an engine that does not say: ``gateway/dispatch/cache_report.py``)."""

    @property
    def label(self) -> str:
        """The ``outcome`` label: the error code when there is one, else the result."""
        return self.error.value if self.error is not None else self.result.value

    @property
    def completed(self) -> bool:
        return self.result is Result.COMPLETED

    @property
    def client_left(self) -> bool:
        return self.result is Result.CLIENT_DISCONNECTED

    @property
    def failed(self) -> bool:
        return self.result is Result.FAILED

    @property
    def route(self) -> TargetChoice | None:
        """Where the request was sent by name (None when it ended before it was resolved)."""
        return self.context.route if self.context is not None else None

    @property
    def backend(self) -> str:
        """The backend of the last attempt ('' when none was dispatched)."""
        return self.attempts[-1].backend if self.attempts else ""

    @property
    def decision(self) -> RoutingDecision | None:
        return self.attempts[-1].decision if self.attempts else None

    @property
    def t_dispatch(self) -> float | None:
        return self.attempts[-1].t_dispatch if self.attempts else None

    @property
    def queued_s(self) -> float:
        """Time spent waiting for a backend, over every attempt."""
        total = 0.0
        for attempt in self.attempts:
            total += attempt.queued_s
        return total

    @property
    def e2e_s(self) -> float:
        return self.end - self.arrival
