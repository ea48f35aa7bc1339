"""One frozen value per request: everything decided about it before its first attempt.

Built once by the pipeline (``gateway/pipeline/handler.py``) when a request passed authentication,
validation and class resolution; read by every attempt (``gateway/pipeline/attempt.py``) and never
changed. What changes while the request runs (attempts made, tokens timed) is recorded by
the attempt module and ends in the request's frozen ``RequestOutcome``.
"""

from __future__ import annotations

from typing import NamedTuple

from gateway.policy.model import PriorityClass, Tenant
from gateway.routing.targets import TargetChoice
from gateway.runtime import Runtime
from gateway.telemetry.tracing import RequestSpan
from gateway.types import InferenceRequest


class RequestContext(NamedTuple):
    """A validated request, its tenant and class, its deadline, and the policy it runs under.

    A ``NamedTuple``: immutable, and cheap to build once per request (``gateway/pipeline/outcome.py``).
    ``deadline`` is on the gateway clock: arrival plus ``x-request-timeout`` or the class's
    ``deadline_s``; it bounds the queue wait, every retry and the answer itself. ``runtime``
    is the policy in force at arrival (``gateway/runtime.py``), kept to the end. ``route`` is the
    public name the client called, the target drawn for it and its fallback chain
    (``gateway/routing/targets.py``).
    """

    request: InferenceRequest
    tenant: Tenant
    class_name: str
    priority_class: PriorityClass
    deadline: float
    runtime: Runtime
    span: RequestSpan
    route: TargetChoice

    @property
    def rank(self) -> int:
        return self.priority_class.rank
