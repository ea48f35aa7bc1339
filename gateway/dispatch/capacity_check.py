"""Whether each backend's declared capacity agrees with what its engine reports (``engine_limits.py``).

Rules, per backend, only where the engine gives a figure:

* ``max_concurrent`` above the engine's own limit (slots, ``max_running_requests``): the gateway
  sends more than the engine runs, and the surplus queues inside the engine, out of the gateway's
  sight (its classes, deadlines and fair shares no longer apply to it);
* ``max_concurrent`` below half the engine's limit: the engine could run twice what it is given,
  and its GPUs idle;
* ``kv_cache_tokens`` more than 10% off the engine's (either way): the routing prefix index, sized
  from it, forgets prefixes the engine still holds or remembers ones it evicted. Not declared: no
  comparison (nothing was claimed).

Saying so is all this does: admission and dispatch still run on the declared figures. The
``CapacityCheck`` reads each healthy backend once per backend definition (at start, after a
reload that changes it, when a backend first answers), logs a WARNING per disagreement, sets
``gateway_backend_capacity_disagreement`` and ``gateway_backend_engine_limit``, and keeps the
engine's figures for ``/admin/backends``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import Gauge

from gateway.dispatch.backends import BackendState
from gateway.dispatch.engine_limits import EngineLimits, read_engine_limits
from gateway.policy.model import Backend

log = logging.getLogger(__name__)

IDLE_BELOW = 0.5
"""Declared ``max_concurrent`` under this share of the engine's limit leaves it idle."""
KV_TOLERANCE = 0.10
"""Declared ``kv_cache_tokens`` further than this share from the engine's disagrees."""
FIELDS = ("max_concurrent", "kv_cache_tokens")


@dataclass(frozen=True, slots=True)
class Disagreement:
    backend: str
    field: str
    declared: int
    engine: int
    why: str

    def message(self) -> str:
        return (
            f"backend {self.backend}: capacity.{self.field} is {self.declared} in the policy but the engine "
            f"reports {self.engine}: {self.why}"
        )


def compare(backend: Backend, limits: EngineLimits) -> list[Disagreement]:
    """The disagreements between ``backend``'s declared capacity and ``limits`` (module docstring)."""
    found: list[Disagreement] = []
    declared, engine = backend.capacity.max_concurrent, limits.max_concurrent
    if engine is not None and declared > engine:
        why = "the engine would queue the surplus out of the gateway's sight"
        found.append(Disagreement(backend.name, "max_concurrent", declared, engine, why))
    elif engine is not None and declared < IDLE_BELOW * engine:
        why = f"under {IDLE_BELOW:.0%} of what the engine runs at once: its GPUs idle"
        found.append(Disagreement(backend.name, "max_concurrent", declared, engine, why))
    kv, engine_kv = backend.capacity.kv_cache_tokens, limits.kv_cache_tokens
    if kv is not None and engine_kv is not None and abs(kv - engine_kv) > KV_TOLERANCE * engine_kv:
        why = f"more than {KV_TOLERANCE:.0%} off: the prefix index is sized wrong"
        found.append(Disagreement(backend.name, "kv_cache_tokens", kv, engine_kv, why))
    return found


def engine_figures(limits: EngineLimits) -> dict[str, int | None]:
    return {"max_concurrent": limits.max_concurrent, "kv_cache_tokens": limits.kv_cache_tokens}


class CapacityGauges:
    """The two gauges (``gateway/telemetry/metrics.py``), by backend and field."""

    def __init__(self, disagreement: Gauge, engine_limit: Gauge) -> None:
        self._disagreement = disagreement
        self._engine_limit = engine_limit

    def show(self, backend: str, limits: EngineLimits, found: Iterable[Disagreement]) -> None:
        self.drop(backend)
        wrong = {d.field for d in found}
        for field, figure in engine_figures(limits).items():
            if figure is not None:
                self._engine_limit.labels(backend, field).set(figure)
                self._disagreement.labels(backend, field).set(1 if field in wrong else 0)

    def drop(self, backend: str) -> None:
        for field in FIELDS:
            for gauge in (self._disagreement, self._engine_limit):
                with contextlib.suppress(KeyError):  # not set: the engine did not report the field
                    gauge.remove(backend, field)


class CapacityCheck:
    """Reads each healthy backend's limits once per definition and says where they disagree."""

    def __init__(self, client: httpx.AsyncClient, gauges: CapacityGauges, timeout_s: float = 2.0) -> None:
        self._client = client
        self._gauges = gauges
        self._timeout_s = timeout_s
        self._checked: dict[str, tuple[Backend, EngineLimits, list[Disagreement]]] = {}
        self._one_at_a_time = asyncio.Lock()  # a reload's check and a health round's never read a backend twice

    async def check(self, states: Iterable[BackendState]) -> list[Disagreement]:
        """Check the healthy backends not yet checked as they are defined now; forget the others.
        An engine that could not be read is tried again next time."""
        async with self._one_at_a_time:
            return await self._check(list(states))

    async def _check(self, states: list[BackendState]) -> list[Disagreement]:
        for name in set(self._checked) - {s.name for s in states}:
            del self._checked[name]
            self._gauges.drop(name)
        due = [s.backend for s in states if s.healthy and self._due(s.backend)]
        results = await asyncio.gather(*(read_engine_limits(self._client, b, self._timeout_s) for b in due))
        found: list[Disagreement] = []
        for backend, limits in zip(due, results, strict=True):
            found += self._record(backend, limits)
        return found

    def _due(self, backend: Backend) -> bool:
        checked = self._checked.get(backend.name)
        return checked is None or checked[0] != backend

    def _record(self, backend: Backend, limits: EngineLimits) -> list[Disagreement]:
        if limits.source.startswith("unreadable"):
            log.debug("limits of backend %s not read: %s", backend.name, limits.source)
            return []
        found = compare(backend, limits)
        for disagreement in found:
            log.warning("%s (%s)", disagreement.message(), limits.source)
        self._checked[backend.name] = (backend, limits, found)
        self._gauges.show(backend.name, limits, found)
        return found

    def status(self) -> dict[str, dict[str, Any]]:
        """Per checked backend: the engine's figures, where they came from, the disagreements."""
        return {name: _status(backend, limits, found) for name, (backend, limits, found) in self._checked.items()}


def _status(backend: Backend, limits: EngineLimits, found: list[Disagreement]) -> dict[str, Any]:
    declared: Mapping[str, int | None] = {
        "max_concurrent": backend.capacity.max_concurrent,
        "kv_cache_tokens": backend.capacity.kv_cache_tokens,
    }
    return {
        "declared": dict(declared),
        "engine": engine_figures(limits),
        "engine_source": limits.source,
        "disagreements": [{"field": d.field, "declared": d.declared, "engine": d.engine, "why": d.why} for d in found],
    }
