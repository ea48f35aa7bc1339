"""The backend inventory: each backend's live state and its active health checks.

A ``BackendState`` is the run-time side of a policy ``Backend``: whether its last health
check passed, how much work the gateway has in flight on it (requests and tokens, in total
and per priority class) and the saturation signals last scraped from its ``/metrics``. The
``BackendPool`` owns one state per backend name and a task that checks ``/health`` of
every backend on the policy's interval; a connection failure seen by a request marks the
backend unhealthy at once (``mark_down``), and the next passing check brings it back.

Whenever a backend goes down, restarts (``restarted``, seen by the scraper) or leaves the
policy, ``on_forget(name)`` is called: whatever a router learnt about it (which prefixes it
caches) is void, since it may come back empty.

A tenant is only offered the backends that serve it (``Backend.tenants``, see
``routing/isolation.py``): ``lane(model, tenant)`` gives them, as a ``Lane`` whose ``key`` names
that set. Tenants with the same set share a lane and its queues; tenants of disjoint sets never
wait behind each other (``dispatcher.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import httpx

from gateway.dispatch.breaker import CircuitBreaker
from gateway.dispatch.quota import EMPTY, Quota
from gateway.policy.model import Backend
from gateway.policy.snapshot import PolicySnapshot

log = logging.getLogger(__name__)

HOLD_WEIGHT = 1 / 8
"""Gain of the smoothed holding time and size of a request (``BackendState.held``)."""


def serves(backend: Backend, tenant: str) -> bool:
    """Whether routing may offer ``backend`` to ``tenant`` (its ``tenants`` list, when it has one).

    Here, beside the lanes it shapes (``BackendPool.lane``), and not with the reach that counts
    every path to a backend (``gateway/routing/reach.py``): dispatch is where a tenant is kept off
    the backends that are not its own, and routing, above dispatch, reads the same rule from here,
    so that the cache-isolation check and the lanes cannot disagree."""
    return backend.tenants is None or tenant in backend.tenants


class BackendState:
    """Live state of one backend; mutated only from the event loop."""

    __slots__ = (
        "backend",
        "breaker",
        "class_in_flight",
        "class_prefilling",
        "class_tokens",
        "dispatched",
        "finished_since_scrape",
        "healthy",
        "hold_s",
        "hold_tokens",
        "in_flight",
        "in_flight_tokens",
        "kv_usage",
        "name",
        "others_in_flight",
        "others_in_flight_tokens",
        "others_prefilling",
        "others_rate",
        "others_waiting",
        "quota",
        "reports_cached",
        "scraped_at",
        "waiting",
    )

    def __init__(self, backend: Backend, breaker: CircuitBreaker | None = None) -> None:
        self.backend = backend
        self.breaker = breaker
        self.name = backend.name
        self.healthy = True
        self.in_flight = 0
        self.in_flight_tokens = 0
        self.class_in_flight: dict[int, int] = {}
        self.class_tokens: dict[int, int] = {}
        self.class_prefilling: dict[int, int] = {}
        self.waiting = 0.0
        self.finished_since_scrape = 0
        """Requests of this process that ended here since ``waiting`` was scraped: each freed a slot
        the engine gave to one it had waiting (``capacity.held``)."""
        self.kv_usage = 0.0
        self.scraped_at = -1e9
        self.quota: Quota | None = None
        """This process's part of the backend's capacity (``quota.py``, sized by ``gateway/fleet/``); None: all."""
        self.others_waiting: Mapping[int, int] = EMPTY
        """Requests other processes have waiting for this backend, by class rank (``gateway/fleet/``)."""
        self.others_prefilling: Mapping[int, int] = EMPTY
        """Prefills other processes have running on this backend, by class rank."""
        self.dispatched = 0
        """Requests this process has sent here since it started (the fleet reports its rate)."""
        self.others_rate = 0.0
        """Requests per second the other processes send here: with this process's own rate, how
        fast a queue for this backend drains fleet-wide (``Dispatcher`` estimates waits with it)."""
        self.others_in_flight = 0
        self.others_in_flight_tokens = 0
        """Requests and tokens other processes have in flight here, as of the last sync: routing
        weighs the fleet's load (``fleet_in_flight``), not this process's part of it."""
        self.hold_s = 0.0
        """Smoothed seconds a request of this process held a slot here (grant to release); 0: none
        measured yet. A property of the engine, not of this process's part nor of how busy the
        fleet was lately: with the capacity it says how fast the engine drains a backlog
        (``service_rate``)."""
        self.hold_tokens = 0.0
        """Smoothed tokens (prompt plus output bound) of those requests."""
        self.reports_cached = False
        """The engine has said in an answer how much of a prompt it reused (``cache_report.py``): from
        then on, an answer that does not say means it reused nothing."""

    @property
    def fleet_in_flight(self) -> int:
        """Requests in flight here from every process (the others' as of the last sync)."""
        return self.in_flight + self.others_in_flight

    @property
    def fleet_in_flight_tokens(self) -> int:
        return self.in_flight_tokens + self.others_in_flight_tokens

    def reserve(self, rank: int, tokens: int) -> None:
        self.dispatched += 1
        self.in_flight += 1
        self.in_flight_tokens += tokens
        self.class_in_flight[rank] = self.class_in_flight.get(rank, 0) + 1
        self.class_tokens[rank] = self.class_tokens.get(rank, 0) + tokens
        self.class_prefilling[rank] = self.class_prefilling.get(rank, 0) + 1

    def prefilled(self, rank: int) -> None:
        """The request's first token arrived: its prefill no longer weighs on the engine's steps."""
        self.class_prefilling[rank] -= 1

    def unreserve(self, rank: int, tokens: int, prefilling: bool) -> None:
        self.finished_since_scrape += 1
        self.in_flight -= 1
        self.in_flight_tokens -= tokens
        self.class_in_flight[rank] -= 1
        self.class_tokens[rank] -= tokens
        if prefilling:
            self.class_prefilling[rank] -= 1

    def held(self, seconds: float, tokens: int) -> None:
        """A request held a slot here for ``seconds`` (its grant was given back)."""
        if self.hold_s <= 0.0:
            self.hold_s, self.hold_tokens = seconds, float(tokens)
            return
        self.hold_s += HOLD_WEIGHT * (seconds - self.hold_s)
        self.hold_tokens += HOLD_WEIGHT * (tokens - self.hold_tokens)

    def service_rate(self, slots: int, tokens: int) -> float:
        """Requests per second this backend finishes while ``slots`` requests (and at most ``tokens``)
        are held on it: the requests of the measured size that fit, over the measured holding time
        (Little's law). This is the drain rate of a backlog: a request waits only while the slots it
        may use are all held. 0 while nothing has been measured."""
        if self.hold_s <= 0.0:
            return 0.0
        fit = min(float(slots), tokens / self.hold_tokens) if self.hold_tokens > 0 else float(slots)
        return fit / self.hold_s

    def __repr__(self) -> str:
        return f"BackendState({self.name!r}, healthy={self.healthy}, in_flight={self.in_flight})"


@dataclass(frozen=True, slots=True)
class Lane:
    """The backends of ``model`` that one tenant may use. ``key`` is the model's name when they are
    all its backends, else ``<model> [<backend>,...]`` (never a model name: those have no spaces)."""

    key: str
    model: str
    states: tuple[BackendState, ...]


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """The pool a new policy needs, computed without touching the live one (``BackendPool.plan``).

    A backend that keeps its name, URL and kind keeps its ``BackendState``: the requests in
    flight on it stay counted against its (possibly new) capacity, and what routers learnt
    about it stays true. Its new settings are applied at ``install`` (``reconfigured``). A
    backend whose URL or kind changed is another server: it gets a new state, and the old
    one is forgotten like a removed backend (its requests in flight finish on it).
    """

    states: Mapping[str, BackendState]
    by_model: Mapping[str, tuple[BackendState, ...]]
    reconfigured: tuple[tuple[BackendState, Backend, CircuitBreaker | None], ...]
    forgotten: tuple[str, ...]
    breaker_policy: object


class BackendPool:
    """One ``BackendState`` per backend of the current policy, plus the health-check loop."""

    def __init__(
        self,
        snapshot: PolicySnapshot,
        on_forget: Callable[[str], None] | None = None,
        breakers: Callable[[str, PolicySnapshot], CircuitBreaker] | None = None,
    ) -> None:
        self._states: dict[str, BackendState] = {}
        self._by_model: Mapping[str, tuple[BackendState, ...]] = {}
        self._whole: dict[str, Lane] = {}
        self._restricted: frozenset[str] = frozenset()
        self._lanes: dict[tuple[str, str], Lane] = {}
        self._on_forget = on_forget or _ignore
        self._breakers = breakers
        self._breaker_policy: object = None
        self.install(self.plan(snapshot))

    def adopt(self, snapshot: PolicySnapshot) -> None:
        """Follow a new policy at once (``plan`` then ``install``)."""
        self.install(self.plan(snapshot))

    def plan(self, snapshot: PolicySnapshot) -> PoolPlan:
        """What ``snapshot`` needs (see ``PoolPlan``); changes nothing."""
        new_breakers = snapshot.policy.breaker != self._breaker_policy
        states: dict[str, BackendState] = {}
        reconfigured: list[tuple[BackendState, Backend, CircuitBreaker | None]] = []
        for backend in snapshot.policy.backends:
            old = self._states.get(backend.name)
            if old is not None and (old.backend.url, old.backend.kind) == (backend.url, backend.kind):
                breaker = self._breakers(backend.name, snapshot) if self._breakers and new_breakers else None
                if breaker is not None or old.backend != backend:
                    reconfigured.append((old, backend, breaker))
                states[backend.name] = old
            else:
                breaker = self._breakers(backend.name, snapshot) if self._breakers else None
                states[backend.name] = BackendState(backend, breaker)
        forgotten = tuple(name for name, old in self._states.items() if states.get(name) is not old)
        by_model = {
            model: tuple(states[b.name] for b in backends) for model, backends in snapshot.backends_by_model.items()
        }
        return PoolPlan(
            MappingProxyType(states),
            MappingProxyType(by_model),
            tuple(reconfigured),
            forgotten,
            snapshot.policy.breaker,
        )

    def install(self, plan: PoolPlan) -> None:
        """Make ``plan`` the pool: new settings on kept states, new states in, forgotten ones out."""
        for state, backend, breaker in plan.reconfigured:
            state.backend = backend
            if breaker is not None:
                state.breaker = breaker
        self._states = dict(plan.states)
        self._by_model = plan.by_model
        self._whole = {model: Lane(model, model, states) for model, states in plan.by_model.items()}
        self._restricted = frozenset(
            model for model, states in plan.by_model.items() if any(s.backend.tenants is not None for s in states)
        )
        self._lanes = {}
        self._breaker_policy = plan.breaker_policy
        for name in plan.forgotten:
            self._on_forget(name)

    def for_model(self, model: str) -> tuple[BackendState, ...]:
        return self._by_model.get(model, ())

    def lane(self, model: str, tenant: str) -> Lane:
        """The backends of ``model`` that serve ``tenant`` (all of them unless some list their tenants)."""
        if model not in self._restricted:
            return self._whole.get(model) or Lane(model, model, ())
        lane = self._lanes.get((model, tenant))
        if lane is None:
            every = self._by_model[model]
            mine = tuple(s for s in every if serves(s.backend, tenant))
            key = model if mine == every else f"{model} [{','.join(s.name for s in mine)}]"
            lane = self._lanes[(model, tenant)] = Lane(key, model, mine)
        return lane

    def all(self) -> Iterable[BackendState]:
        return self._states.values()

    def named(self, name: str) -> BackendState | None:
        return self._states.get(name)

    def usable(self, state: BackendState) -> bool:
        """Healthy, and its breaker (if any) lets requests through."""
        return state.healthy and (state.breaker is None or state.breaker.allow())

    def unready_models(self) -> list[str]:
        """Models with no healthy backend (``/readyz`` fails while this is not empty)."""
        return [m for m, states in self._by_model.items() if not any(s.healthy for s in states)]

    async def check_all(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        states = list(self._states.values())
        results = await asyncio.gather(*(_probe(client, s.backend.url, timeout_s) for s in states))
        for state, ok in zip(states, results, strict=True):
            if ok and not state.healthy:
                log.warning("backend %s is now healthy", state.name)
                state.healthy = True
            elif not ok:
                self.mark_down(state)

    def mark_down(self, state: BackendState) -> None:
        """The backend failed a check or a connection: no new work, and its learnt state is void."""
        if state.healthy:
            log.warning("backend %s is now unhealthy", state.name)
            state.healthy = False
            self._on_forget(state.name)

    def restarted(self, state: BackendState) -> None:
        """The backend restarted between two health checks (``scrape.py`` saw it): its learnt state is void."""
        log.warning("backend %s restarted: forgetting what was learnt about it", state.name)
        self._on_forget(state.name)


def _ignore(name: str) -> None:
    pass


async def _probe(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> bool:
    try:
        response = await client.get(base_url + "/health", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return response.status_code == 200
