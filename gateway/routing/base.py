"""The routing extension point: a ``Router`` chooses a backend among candidates with room.

The dispatcher (``gateway/dispatch.py``) filters a model's backends by health and room, then
asks the model's ``Router`` to choose among them. Choosing is pure: ``pick`` reads state and
returns a ``RoutingDecision``; learning (a prefix index insert, a round-robin cursor) happens
in ``on_dispatch``, called once the request really goes to the chosen backend, so that a
decision that is not acted on (the request left the queue meanwhile) teaches nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gateway.policy.model import Tenant
from gateway.types import InferenceRequest

if TYPE_CHECKING:
    from gateway.backends import BackendState


@dataclass(frozen=True, slots=True)
class RouteDetail:
    """Everything a scored pick weighed, in candidate order (``policy explain`` prints it)."""

    backends: tuple[str, ...]
    matched: Sequence[int]
    """Leading prefix blocks each candidate is expected to hold."""
    prompt_blocks: int
    by_scorer: Mapping[str, Sequence[float]]
    totals: Sequence[float]
    load_bound: int
    """Most requests a candidate may hold after this one (bounded load); 0 when not applied."""


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """The chosen backend and why: the strategy, a reason code, matched prefix blocks, scores.

    ``pick_s`` is the time ``pick`` took (seconds), for the routing-cost figures.
    """

    state: BackendState
    strategy: str
    reason: str
    matched_blocks: int = 0
    scores: Mapping[str, float] = field(default_factory=dict)
    pick_s: float = 0.0
    detail: RouteDetail | None = None


class Router(Protocol):
    """Chooses one backend for a request among candidates that are all healthy and have room."""

    def pick(self, request: InferenceRequest, tenant: Tenant, candidates: Sequence[BackendState]) -> RoutingDecision:
        """Choose; ``candidates`` is never empty. Must not change any state."""
        ...

    def on_dispatch(self, request: InferenceRequest, tenant: Tenant, decision: RoutingDecision) -> None:
        """Learn from a decision that was acted on."""
        ...

    def forget_backend(self, backend: str) -> None:
        """The backend restarted or left: whatever was learnt about it is void."""
        ...
