"""Prefix-affinity routing: send a request where its prompt prefix is cached, within a load bound.

The rule, per request, among the candidates (healthy, serving the model, with room):

1. Keys: the prompt's chained block hashes, seeded with a root keyed by the cache-salt secret,
   the tenant's scope and the model (``prefix_keys.py``), computed once per request; a
   conversation's next turn continues the chain of its previous turn from the router's
   ``ChainMemo`` instead of rehashing it.
2. Affinity: ``matched_b``, the leading blocks backend b holds. From the engine's own word
   when it has one (``engine_view.py``: a live KV-event feed, the request hashed as the engine
   hashes it; its held share of the prompt, ``held / engine blocks``, in this chain's blocks),
   else the estimate: the leading blocks b was sent within the index TTL (``prefix_index.py``).
   The prefix scorer rates it ``matched_b / blocks``.
3. Load: the in-flight, queue-depth and KV-usage scorers rate each backend's headroom.
4. Total: the weighted mean of the scores (weights from the policy; default prefix 3,
   in-flight 1, queue depth 1, KV usage 0.5). With the defaults a full prefix match outweighs
   any load difference short of the bound, and with no match anywhere the load alone decides.
5. Bounded load: a candidate that would hold more than ``ceil((1 + epsilon) × (L + 1) / n)``
   requests is out (``framework.load_bound``), whatever its affinity. The least loaded
   candidate always passes, so a hot prefix spills to the next best backend, which then
   caches it too (hot prefixes replicate instead of queueing behind one engine).
   Continuation slack: a candidate holding the longest match is let over the bound by one
   request when its load includes other processes' requests (``others_in_flight``). Those are
   counted as of their last report (a fleet sync ago), and a request that continues a prompt
   is sent by its client once the previous turn's answer is read: when another process served
   that turn, its figure still counts it for up to a sync interval. Without the slack, at low
   load (``L`` of 1 or 2, where the bound is 2) that ghost alone pushes a conversation off the
   engine holding its history, and on an engine that keeps only its slots' prompts (llama.cpp
   with ``--cache-ram 0``) the whole history is computed again elsewhere (issue 28,
   ``loadtests/results/routing-fleet-running/``). One process alone has no others' part, so its
   rule is unchanged; at high load one request over ``(1 + epsilon)`` times the average is noise.
6. The highest total wins; an exact tie (an idle pool, a first request) goes to the
   rendezvous-hash favourite of the tenant's scope, so tenants spread across an idle pool
   and each keeps coming back to the same backend.

Reason codes: ``prefix_match`` (the winner holds the longest match), ``load_bound`` (a longer
match was over the bound), ``load_over_prefix`` (a longer match lost on load), ``no_prefix``
(no candidate holds any block: chosen on load).

Learning happens in ``on_dispatch``: the request's chain goes into the chosen backend's
index; and in ``on_answer``, which only forgets: when the engine says it held less than the
index matched (``gateway/dispatch/cache_report.py``), every block the index had from that
backend no later than the match's own entry goes, since the engine evicted past it (the closed
loop, ``routing.index.closed_loop``). With several processes, ``learn`` folds the other
processes' decisions into the same index (``gateway/fleet/prefix_sync.py``), so every replica
scores what the fleet sent where.
``forget_backend`` drops a backend's index when it restarts or leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter
from typing import TYPE_CHECKING

from gateway.clock import Clock
from gateway.dispatch.cache_report import CacheReport
from gateway.dispatch.router import RouteDetail, RoutingDecision
from gateway.policy.model import Routing, Tenant
from gateway.routing.engine_view import EngineView
from gateway.routing.framework import Cycle, Profile, load_bound, rendezvous
from gateway.routing.prefix_index import BackendIndexes
from gateway.routing.prefix_keys import ChainMemo, Splitter, prefix_keys
from gateway.routing.prefix_secret import PrefixSecret
from gateway.types import InferenceRequest, PrefixKeys

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendState


class PrefixAffinityRouter:
    """Scored prefix affinity with bounded load (see the module docstring for the rule)."""

    __slots__ = (
        "_clock",
        "_engines",
        "_fresh_s",
        "_indexes",
        "_tokenizer",
        "memo",
        "profile",
        "routing",
        "secret",
    )
    strategy = "prefix_affinity"

    def __init__(
        self,
        routing: Routing,
        profile: Profile,
        clock: Clock,
        secret: PrefixSecret,
        *,
        fresh_s: float,
        tokenizer: Splitter | None = None,
        engines: EngineView | None = None,
    ) -> None:
        self.routing = routing
        self.profile = profile
        self._clock = clock
        self.secret = secret
        """Keys the chains' roots (``prefix_secret.py``): replicas with one secret share a view."""
        self._fresh_s = fresh_s
        self._tokenizer = tokenizer
        self._indexes = BackendIndexes(routing.index.ttl_s)
        self._engines = engines
        """The engines' KV-event indexes (``engine_view.py``); None: the estimate alone."""
        self.memo: ChainMemo | None = ChainMemo()
        """Chains of recent prompts (``prefix_keys.ChainMemo``); None hashes every prompt whole."""

    def pick(self, request: InferenceRequest, tenant: Tenant, candidates: Sequence[BackendState]) -> RoutingDecision:
        start = perf_counter()
        keys = self.keys(request, tenant)
        cycle = self.cycle(request, keys, candidates, tenant)
        matched = cycle.matched
        if len(candidates) == 1:  # nothing to weigh: skip the scorers, keep what the metrics need
            only = candidates[0]
            detail = RouteDetail((only.name,), matched, len(keys.blocks), {}, (1.0,), 0)
            reason = "prefix_match" if matched[0] else "no_prefix"
            at = self._matched_at(only, keys.blocks, matched[0], cycle)
            return RoutingDecision(
                only,
                self.strategy,
                reason,
                matched[0],
                {},
                perf_counter() - start,
                detail,
                at,
                engine_reported=only.name in cycle.engine_reported,
            )
        scored = self.profile.run(request, candidates, cycle)
        bound = load_bound(candidates, self.routing.epsilon)
        totals = scored.totals
        eligible = [i for i, state in enumerate(candidates) if _within(state, matched, i, bound)]
        top = max(totals[i] for i in eligible)
        tied = [i for i in eligible if totals[i] == top]
        best = tied[0] if len(tied) == 1 else max(tied, key=lambda i: rendezvous(keys.root, candidates[i].name))
        chosen = candidates[best]
        names = tuple(s.name for s in candidates)
        detail = RouteDetail(names, matched, len(keys.blocks), scored.by_scorer, totals, bound)
        return RoutingDecision(
            chosen,
            self.strategy,
            _reason(candidates, matched, best, bound),
            matched_blocks=matched[best],
            scores=dict(zip(names, totals, strict=True)),
            pick_s=perf_counter() - start,
            detail=detail,
            matched_at=self._matched_at(chosen, keys.blocks, matched[best], cycle),
            engine_reported=chosen.name in cycle.engine_reported,
        )

    def _matched_at(self, state: BackendState, blocks: Sequence[int], matched: int, cycle: Cycle) -> float | None:
        """When ``state`` was last sent the deepest block it is expected to hold (one lookup); None
        for a match the engine itself reported (the closed loop corrects the estimate only)."""
        if not matched or state.name in cycle.engine_reported:
            return None
        return self._indexes.served_at(state.name, blocks[matched - 1])

    @property
    def epsilon(self) -> float:
        return self.routing.epsilon

    def keys(self, request: InferenceRequest, tenant: Tenant) -> PrefixKeys:
        """The request's block hashes under the tenant's scope (memoised on the request)."""
        return prefix_keys(request, tenant, self.routing.block_tokens, self._tokenizer, self.memo, secret=self.secret)

    def cycle(
        self,
        request: InferenceRequest,
        keys: PrefixKeys,
        candidates: Sequence[BackendState],
        tenant: Tenant | None = None,
    ) -> Cycle:
        """What the scorers read: each candidate's matched leading blocks of ``keys``, now: the
        engine's report where it has one (and ``tenant`` is given), else the estimate."""
        now = self._clock.now()
        engines = self._engines
        if engines is None or tenant is None:
            matched = [self._indexes.match(s.name, keys.blocks, now) for s in candidates]
            return Cycle(now, self._fresh_s, keys, matched, request.prompt_tokens + request.max_tokens)
        matched = []
        reported: set[str] = set()
        blocks = len(keys.blocks)
        for state in candidates:
            report = engines.held(state, request, tenant)
            if report is None:
                matched.append(self._indexes.match(state.name, keys.blocks, now))
                continue
            reported.add(state.name)
            matched.append(report.held * blocks // report.blocks if report.blocks else 0)
        return Cycle(now, self._fresh_s, keys, matched, request.prompt_tokens + request.max_tokens, frozenset(reported))

    def on_dispatch(self, request: InferenceRequest, tenant: Tenant, decision: RoutingDecision) -> None:
        keys = request.prefix_keys
        if keys is None or not keys.blocks:
            return
        self.learn(decision.state, keys.blocks, self._clock.now())

    def learn(self, state: BackendState, blocks: Sequence[int], at: float) -> None:
        """Index ``blocks`` as served by ``state``'s backend at ``at``: this process's dispatch, or
        another process's (``gateway/fleet/prefix_sync.py``), which scores the same from then on."""
        if blocks:
            self._indexes.insert(state.name, self.index_blocks(state), blocks, at)

    def forget_backend(self, backend: str) -> None:
        self._indexes.forget(backend)

    def on_answer(self, request: InferenceRequest, decision: RoutingDecision, report: CacheReport) -> None:
        """The closed loop: the engine held less than matched, so it evicted the deepest matched block
        (last sent at ``decision.matched_at``) and, being LRU, all it was sent no later: forget
        them. The request's own chain stays (this dispatch sent it again after that, and the
        engine holds it now). Only forgets: no answer makes a block match that no dispatch sent.
        A decision made on the engine's own word goes to the engine view instead (its check that
        the hashing is the engine's, ``engine_view.py``)."""
        if decision.engine_reported and self._engines is not None:
            self._engines.heard(decision.state.name, report)
        elif report.missed and decision.matched_at is not None and self.routing.index.closed_loop:
            self._indexes.forget_before(decision.state.name, decision.matched_at)

    def forget_before(self, state: BackendState, at: float) -> int:
        return self._indexes.forget_before(state.name, at)

    def index_blocks(self, state: BackendState) -> int:
        """The index bound of a backend: the policy's, else its KV capacity in blocks."""
        index = self.routing.index
        if index.max_blocks is not None:
            return index.max_blocks
        capacity = state.backend.capacity
        tokens = capacity.kv_cache_tokens or capacity.max_tokens_in_flight
        return max(1, tokens // self.routing.block_tokens)

    def indexed_blocks(self, backend: str) -> int:
        return self._indexes.size(backend)


def continuation_slack(state: BackendState, matched: Sequence[int], i: int) -> int:
    """1 when candidate ``i`` holds the longest match and its load counts other processes'
    requests (one of them may be the turn this request continues, already answered), else 0."""
    return 1 if matched[i] > 0 and matched[i] == max(matched) and state.others_in_flight > 0 else 0


def _within(state: BackendState, matched: Sequence[int], i: int, bound: int) -> bool:
    return state.fleet_in_flight + 1 - continuation_slack(state, matched, i) <= bound


def _reason(candidates: Sequence[BackendState], matched: Sequence[int], best: int, bound: int) -> str:
    top = max(matched)
    if top == 0:
        return "no_prefix"
    if matched[best] == top:
        return "prefix_match"
    over = any(
        m == top and not _within(s, matched, i, bound) for i, (s, m) in enumerate(zip(candidates, matched, strict=True))
    )
    return "load_bound" if over else "load_over_prefix"
