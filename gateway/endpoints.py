"""The backend inventory: each backend's live state and its active health checks.

A ``BackendState`` is the run-time side of a policy ``Backend``: whether its last health
check passed, how much work the gateway has in flight on it (requests and tokens, in total
and per priority class) and the saturation signals last scraped from its ``/metrics``. The
``BackendPool`` owns one state per backend name and a task that checks ``/health`` of
every backend on the policy's interval; a connection failure seen by a request marks the
backend unhealthy at once, and the next passing check brings it back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import httpx

from gateway.policy.loader import PolicySnapshot
from gateway.policy.model import Backend

log = logging.getLogger(__name__)


class BackendState:
    """Live state of one backend; mutated only from the event loop."""

    __slots__ = (
        "backend",
        "class_in_flight",
        "class_tokens",
        "healthy",
        "in_flight",
        "in_flight_tokens",
        "kv_usage",
        "name",
        "scraped_at",
        "waiting",
    )

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name = backend.name
        self.healthy = True
        self.in_flight = 0
        self.in_flight_tokens = 0
        self.class_in_flight: dict[int, int] = {}
        self.class_tokens: dict[int, int] = {}
        self.waiting = 0.0
        self.kv_usage = 0.0
        self.scraped_at = -1e9

    def reserve(self, rank: int, tokens: int) -> None:
        self.in_flight += 1
        self.in_flight_tokens += tokens
        self.class_in_flight[rank] = self.class_in_flight.get(rank, 0) + 1
        self.class_tokens[rank] = self.class_tokens.get(rank, 0) + tokens

    def release(self, rank: int, tokens: int) -> None:
        self.in_flight -= 1
        self.in_flight_tokens -= tokens
        self.class_in_flight[rank] -= 1
        self.class_tokens[rank] -= tokens

    def __repr__(self) -> str:
        return f"BackendState({self.name!r}, healthy={self.healthy}, in_flight={self.in_flight})"


class BackendPool:
    """One ``BackendState`` per backend of the current policy, plus the health-check loop."""

    def __init__(self, snapshot: PolicySnapshot) -> None:
        self._states: dict[str, BackendState] = {}
        self._by_model: dict[str, tuple[BackendState, ...]] = {}
        self.apply(snapshot)

    def apply(self, snapshot: PolicySnapshot) -> None:
        """Follow a new policy: keep the state of backends that stay, add new ones."""
        states = {}
        for backend in snapshot.policy.backends:
            state = self._states.get(backend.name)
            if state is None or state.backend != backend:
                state = BackendState(backend)
            states[backend.name] = state
        self._states = states
        self._by_model = {
            model: tuple(states[b.name] for b in backends) for model, backends in snapshot.backends_by_model.items()
        }

    def for_model(self, model: str) -> tuple[BackendState, ...]:
        return self._by_model.get(model, ())

    def all(self) -> Iterable[BackendState]:
        return self._states.values()

    def unready_models(self) -> list[str]:
        """Models with no healthy backend (``/readyz`` fails while this is not empty)."""
        return [m for m, states in self._by_model.items() if not any(s.healthy for s in states)]

    async def check_all(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        states = list(self._states.values())
        results = await asyncio.gather(*(_probe(client, s.backend.url, timeout_s) for s in states))
        for state, ok in zip(states, results, strict=True):
            if ok != state.healthy:
                log.warning("backend %s is now %s", state.name, "healthy" if ok else "unhealthy")
            state.healthy = ok

    async def run_health_checks(self, client: httpx.AsyncClient, interval_s: float, timeout_s: float) -> None:
        """Check every backend every ``interval_s`` until cancelled."""
        while True:
            await self.check_all(client, timeout_s)
            await asyncio.sleep(interval_s)


async def _probe(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> bool:
    try:
        response = await client.get(base_url + "/health", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return response.status_code == 200
