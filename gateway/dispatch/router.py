"""The routing extension point the dispatcher calls: a ``Router`` chooses a backend among candidates with room.

The dispatcher (``dispatcher.py``) filters a model's backends by health and room, then asks the
model's ``Router`` to choose among them. Choosing is pure: ``pick`` reads state and returns a
``RoutingDecision``; learning (a prefix index insert, a round-robin cursor) happens in
``on_dispatch``, called once the request really goes to the chosen backend, so that a decision
that is not acted on (the request left the queue meanwhile) teaches nothing.

Why in dispatch and not in ``gateway/routing/``: the consumer owns the protocol it calls. The
routers read the backends' state (``BackendState``, ``backends.py``), so routing sits above
dispatch in the stage order (``tests/test_import_graph.py``); the dispatcher, its queues and the
pipeline hold a ``RoutingDecision`` and call ``pick`` and ``on_dispatch``. With the protocol and
its decision here, dispatch never imports a router, and ``gateway/routing/`` implements them
(its strategies, the registry that builds one per model, ``explain``). What a router may offer
beyond this protocol, which only the stages above call (``PrefixLearner``, ``LoadBounded``),
stays in ``gateway/routing/base.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from gateway.dispatch.backends import BackendState
from gateway.policy.model import Tenant
from gateway.types import InferenceRequest


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
    matched_at: float | None = None
    """When the chosen backend was last sent the deepest matched block (the router's clock): the
    oldest of what it is expected to hold for this request. If the engine turns out not to hold
    it, it evicted what was last used then, and under LRU everything older too (``on_answer``)."""
    engine_reported: bool = False
    """``matched_blocks`` is the chosen engine's own report (its KV events,
    ``gateway/routing/engine_view.py``), not the router's estimate."""


class CacheReport(NamedTuple):
    """One answer's cache figures, in the engine's tokens (``cache_report.py`` computes it and says why)."""

    predicted_tokens: int
    """What the router expected the engine to hold of the prompt."""
    cached_tokens: int
    """What the engine said it reused."""
    prompt_tokens: int
    """The prompt, as the engine counted it."""
    missed: bool
    """The engine held less than predicted by more than ``cache_report.MISS_SLACK_BLOCKS`` of the router's blocks."""

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the engine computed (its prefill): what a better route would have saved."""
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def confirmed_tokens(self) -> int:
        """Predicted tokens the engine really held: the prediction's precision is this over ``predicted_tokens``."""
        return min(self.predicted_tokens, self.cached_tokens)


class Router(Protocol):
    """Chooses one backend for a request among candidates that are all healthy and have room.

    The contract, checked for every registered strategy by ``tests/dispatch/test_router.py``:

    * ``pick`` returns one of ``candidates`` in a decision that names the strategy (its registry
      name), a reason code (a snake_case word from a small fixed set: it is a metric label) and
      ``pick_s``, the seconds the pick took. A lone candidate is chosen, however loaded.
    * ``pick`` is pure and deterministic: a function of the router's state and its arguments. It
      may memoise what depends on its arguments alone (``InferenceRequest.prefix_keys``, a
      ``ChainMemo``) but changes nothing a later decision depends on, so picking again without
      ``on_dispatch`` gives the same decision. A strategy that wants randomness derives it from a
      hash of the request, or advances its generator in ``on_dispatch``.
    * Learning happens in ``on_dispatch`` and ``on_answer`` only, in the router: the dispatcher owns
      the ``BackendState`` counters (it has reserved the request before calling it). ``on_answer``
      may only forget (the engine held less than believed), never add what no dispatch taught.
    * ``forget_backend(b)`` voids what the requests sent to ``b`` taught about their content (the
      prefixes ``b`` holds): decisions are then those of a router whose dispatches to ``b`` carried
      other prompts. Content-free state (a rotation cursor) may stay, as may what was learnt about
      the other backends.
    * Tenant isolation: what one tenant's requests taught never changes another tenant's decision
      unless both share a cache scope (``gateway/routing/isolation.py``, ``tenant_scope``); tenants
      of one scope share it.
    * A router that applies the bounded-load rule (``gateway/routing/framework.py``) declares it
      (``LoadBounded``, ``gateway/routing/base.py``): no backend it chooses then holds more than
      ``ceil((1 + epsilon) × (L + 1) / n)`` with it, by this process's count; with other
      processes' requests in the figures, ``prefix_affinity`` lets the holder of a request's
      longest match go one over (its continuation slack: one of those may be the turn the
      request continues, already answered).
    """

    def pick(self, request: InferenceRequest, tenant: Tenant, candidates: Sequence[BackendState]) -> RoutingDecision:
        """Choose; ``candidates`` is never empty. Changes nothing a later decision depends on."""
        ...

    def on_dispatch(self, request: InferenceRequest, tenant: Tenant, decision: RoutingDecision) -> None:
        """Learn from a decision that was acted on."""
        ...

    def forget_backend(self, backend: str) -> None:
        """The backend restarted or left: whatever was learnt about it is void."""
        ...

    def on_answer(self, request: InferenceRequest, decision: RoutingDecision, report: CacheReport) -> None:
        """The engine answered ``request`` and said what it reused of the prompt (``report``):
        a router that predicts the engines' caches corrects itself when the engine held less."""
        ...
