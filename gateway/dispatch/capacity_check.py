"""Each backend's capacity against what its engine reports (``engine_limits.py``): said where the
policy's figures disagree, taken where the policy says ``auto``.

Disagreements, per backend, only where the engine gives a figure and the policy declares one:

* ``max_concurrent`` above the engine's own limit (slots, ``max_running_requests``): the gateway
  sends more than the engine runs, and the surplus queues inside the engine, out of the gateway's
  sight (its classes, deadlines and fair shares no longer apply to it);
* ``max_concurrent`` below half the engine's limit: the engine could run twice what it is given,
  and its GPUs idle;
* ``kv_cache_tokens`` more than 10% off the engine's (either way): the routing prefix index, sized
  from it, forgets prefixes the engine still holds or remembers ones it evicted. Not declared: no
  comparison (nothing was claimed).

Each is a WARNING naming the backend and both figures, the gauges ``gateway_backend_capacity_
disagreement`` and ``gateway_backend_engine_limit``, and an entry of ``GET /admin/backends``;
``inference-gateway policy validate --live`` says the same (``live_check``).

Figures taken from the engine (``capacity: auto``, see ``Capacity``): once read, ``CapacityCheck``
puts the capacity with the engine's figures on the backend's ``BackendState`` (``apply``), where
every reader of a capacity finds it: the room rule, the prefix index (sized from
``kv_cache_tokens``), the fleet's ledger (each replica reports the capacity it read, as it would a
declared one: ``FleetCoordinator.reports``) and the fixed parts of ``--workers`` without a shared
store (``on_change`` resizes them). Until then the capacity holds no room
(``Capacity.awaiting_engine``): the backend takes no request, ``GET /admin/backends`` shows it not
ready, ``gateway_backend_held{reason="engine_limits_unread"}`` is 1, and a WARNING says so once.

When engines are read: at start; at every reload, every backend again (its last figures stay
applied meanwhile: a reload that keeps a backend's engine, its URL and kind, never makes it
unready, ``apply`` is called in the same step as the pool's install); when a backend that was down
answers again (its engine may have restarted with other flags); and, while a read failed or an
``auto`` figure is missing, on the health rounds, backing off from ``RETRY_FIRST_S`` doubling to
``RETRY_MAX_S``. A backend that is down is not read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import Gauge

from gateway.clock import Clock, MonotonicClock
from gateway.dispatch.backends import BackendState
from gateway.dispatch.engine_limits import EngineLimits, read_engine_limits
from gateway.policy.model import ENGINE_FIELDS, Backend, BackendKind, EngineField

log = logging.getLogger(__name__)

IDLE_BELOW = 0.5
"""Declared ``max_concurrent`` under this share of the engine's limit leaves it idle."""
KV_TOLERANCE = 0.10
"""Declared ``kv_cache_tokens`` further than this share from the engine's disagrees."""
FIELDS = ENGINE_FIELDS
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
"""Backoff of the reads that failed (or missed an ``auto`` figure): 1 s, doubling, at most 60 s."""


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
    """The disagreements between ``backend``'s declared capacity and ``limits`` (module docstring);
    a figure the policy takes from the engine (``auto``) is the engine's, never a disagreement."""
    found: list[Disagreement] = []
    auto = backend.capacity.from_engine
    declared, engine = backend.capacity.max_concurrent, limits.max_concurrent
    if engine is not None and "max_concurrent" not in auto:
        if declared > engine:
            why = "the engine would queue the surplus out of the gateway's sight"
            found.append(Disagreement(backend.name, "max_concurrent", declared, engine, why))
        elif declared < IDLE_BELOW * engine:
            why = f"under {IDLE_BELOW:.0%} of what the engine runs at once: its GPUs idle"
            found.append(Disagreement(backend.name, "max_concurrent", declared, engine, why))
    kv = None if "kv_cache_tokens" in auto else backend.capacity.kv_cache_tokens
    engine_kv = limits.kv_cache_tokens
    if kv is not None and engine_kv is not None and abs(kv - engine_kv) > KV_TOLERANCE * engine_kv:
        why = f"more than {KV_TOLERANCE:.0%} off: the prefix index is sized wrong"
        found.append(Disagreement(backend.name, "kv_cache_tokens", kv, engine_kv, why))
    return found


def engine_figures(limits: EngineLimits) -> dict[str, int | None]:
    return {"max_concurrent": limits.max_concurrent, "kv_cache_tokens": limits.kv_cache_tokens}


def missing(backend: Backend, limits: EngineLimits | None) -> tuple[EngineField, ...]:
    """The ``auto`` figures of ``backend`` that ``limits`` does not give (all of them without limits)."""
    figures = engine_figures(limits) if limits is not None else {}
    return tuple(f for f in ENGINE_FIELDS if f in backend.capacity.from_engine and figures.get(f) is None)


def with_engine(backend: Backend, limits: EngineLimits | None) -> Backend:
    """``backend`` with the engine's figures in its ``auto`` fields (as far as ``limits`` gives them)."""
    capacity = backend.capacity.as_written
    if limits is not None:
        capacity = capacity.with_engine(limits.max_concurrent, limits.kv_cache_tokens)
    return backend if capacity == backend.capacity else backend.model_copy(update={"capacity": capacity})


def as_written(backend: Backend) -> Backend:
    """``backend`` as the policy has it (its ``auto`` figures not read)."""
    return with_engine(backend, None)


def unreadable(limits: EngineLimits) -> bool:
    return limits.source.startswith("unreadable")


def not_given(absent: Sequence[str], limits: EngineLimits) -> str:
    """Why ``absent`` (``auto`` figures) are not known: ``capacity.kv_cache_tokens is auto but ...``."""
    names = " and ".join(f"capacity.{name}" for name in absent)
    verb, pronoun = ("is", "it") if len(absent) == 1 else ("are", "them")
    if unreadable(limits):
        return f"{names} {verb} auto but the engine's limits could not be read ({limits.source})"
    return f"{names} {verb} auto but the engine does not give {pronoun} ({limits.source})"


class CapacityGauges:
    """The two gauges (``gateway/telemetry/metrics.py``), by backend and field."""

    def __init__(self, disagreement: Gauge, engine_limit: Gauge) -> None:
        self._disagreement = disagreement
        self._engine_limit = engine_limit

    def show(self, backend: str, limits: EngineLimits, found: Iterable[Disagreement]) -> None:
        self.drop(backend)
        wrong = {d.field for d in found}
        for name, figure in engine_figures(limits).items():
            if figure is not None:
                self._engine_limit.labels(backend, name).set(figure)
                self._disagreement.labels(backend, name).set(1 if name in wrong else 0)

    def drop(self, backend: str) -> None:
        for name in FIELDS:
            for gauge in (self._disagreement, self._engine_limit):
                with contextlib.suppress(KeyError):  # not set: the engine did not report the field
                    gauge.remove(backend, name)


@dataclass(slots=True)
class _Engine:
    """What is known of one backend's engine (the one at ``url``, of ``kind``)."""

    url: str
    kind: BackendKind
    backend: Backend
    """The backend as the policy in force has it (``as_written``)."""
    limits: EngineLimits | None = None
    """The last read that answered; kept through failed reads and reloads."""
    read_for: Backend | None = None
    """The definition ``limits`` was compared with (a new one is read again)."""
    found: list[Disagreement] = field(default_factory=list)
    due: bool = False
    """Read again at the next check (a reload, a recovery)."""
    failures: int = 0
    retry_at: float = 0.0
    why_not: str = ""
    """Why the ``auto`` figures are not read, once a read said so."""
    said_unready: bool = False


class CapacityCheck:
    """Reads each backend's engine limits, says where they disagree, applies the ``auto`` figures
    (module docstring). ``on_change`` is called after a check changed some backend's capacity."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        gauges: CapacityGauges,
        timeout_s: float = 2.0,
        *,
        clock: Clock | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._client = client
        self._gauges = gauges
        self._timeout_s = timeout_s
        self._clock: Clock = clock or MonotonicClock()
        self._on_change = on_change or _nothing
        self._engines: dict[str, _Engine] = {}
        self._one_at_a_time = asyncio.Lock()  # a reload's check and a health round's never read a backend twice

    async def check(self, states: Iterable[BackendState]) -> list[Disagreement]:
        """Read the healthy backends that are due (module docstring), record what they say, apply the
        ``auto`` figures; forget the backends not in ``states``. Returns the disagreements found now."""
        async with self._one_at_a_time:
            states = list(states)
            now = self._clock.now()
            due = [(s, self._engine(s)) for s in states if self._due(s, now)]
            results = await asyncio.gather(
                *(read_engine_limits(self._client, engine.backend, self._timeout_s) for _, engine in due)
            )
            found: list[Disagreement] = []
            for (state, engine), limits in zip(due, results, strict=True):
                if self._engines.get(state.name) is engine:  # not replaced by a reload meanwhile
                    found += self._record(engine, limits)
            if self.apply(states):
                self._on_change()
            return found

    def apply(self, states: Iterable[BackendState], *, reloaded: bool = False) -> bool:
        """Put each backend's last engine figures in its ``auto`` fields (at once: no I/O); forget the
        backends not in ``states``. ``reloaded``: a new policy is in force, read every engine again.
        True when some backend's capacity changed."""
        states = list(states)
        for name in set(self._engines) - {s.name for s in states}:
            del self._engines[name]
            self._gauges.drop(name)
        changed = False
        for state in states:
            engine = self._engine(state)
            if reloaded:
                engine.due, engine.retry_at = True, 0.0
            target = with_engine(engine.backend, engine.limits)
            if target != state.backend:
                state.backend, changed = target, True
                self._said_ready(engine, target)
        return changed

    def _engine(self, state: BackendState) -> _Engine:
        """The record of ``state``'s engine, new when the backend is new or points elsewhere now."""
        written = as_written(state.backend)
        engine = self._engines.get(state.name)
        if engine is None or (engine.url, engine.kind) != (written.url, written.kind):
            engine = self._engines[state.name] = _Engine(written.url, written.kind, written, due=True)
            self._gauges.drop(state.name)
        engine.backend = written
        return engine

    def _due(self, state: BackendState, now: float) -> bool:
        engine = self._engine(state)
        if not state.healthy:  # read again once it answers: it may come back with other flags
            engine.due, engine.retry_at = True, 0.0
            return False
        stale = engine.due or engine.read_for != engine.backend or bool(missing(engine.backend, engine.limits))
        return stale and now >= engine.retry_at

    def _record(self, engine: _Engine, limits: EngineLimits) -> list[Disagreement]:
        backend = engine.backend
        found: list[Disagreement] = []
        if unreadable(limits):
            log.debug("limits of backend %s not read: %s", backend.name, limits.source)
        else:
            engine.limits, engine.read_for, engine.due = limits, backend, False
            engine.found = found = compare(backend, limits)
            for disagreement in found:
                log.warning("%s (%s)", disagreement.message(), limits.source)
            self._gauges.show(backend.name, limits, found)
        absent = missing(backend, engine.limits)
        if not unreadable(limits) and not absent:
            engine.failures = 0
            return found
        engine.failures += 1
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (engine.failures - 1))
        engine.retry_at = self._clock.now() + delay
        if absent:
            self._said_unready(engine, absent, limits, delay)
        return found

    def _said_unready(self, engine: _Engine, absent: Sequence[str], limits: EngineLimits, delay: float) -> None:
        engine.why_not = not_given(absent, limits)
        if not engine.said_unready:
            engine.said_unready = True
            log.warning(
                "backend %s is not ready: %s; it takes no request until then (next try in %.0f s, backing off)",
                engine.backend.name,
                engine.why_not,
                delay,
            )

    def _said_ready(self, engine: _Engine, backend: Backend) -> None:
        if backend.capacity.awaiting_engine or not backend.capacity.from_engine or engine.limits is None:
            return
        figures = ", ".join(f"{f} {getattr(backend.capacity, f)}" for f in sorted(backend.capacity.from_engine))
        if engine.said_unready:
            log.warning("backend %s is now ready: its capacity from the engine: %s", backend.name, figures)
        else:
            log.info("backend %s: its capacity from the engine: %s (%s)", backend.name, figures, engine.limits.source)
        engine.said_unready, engine.why_not = False, ""

    def status(self) -> dict[str, dict[str, Any]]:
        """Per backend whose engine answered, or whose capacity awaits it: the declared and the
        engine's figures, where they came from, the disagreements, and whether it is ready."""
        return {
            name: _status(engine)
            for name, engine in self._engines.items()
            if engine.limits is not None or engine.backend.capacity.from_engine
        }


def _status(engine: _Engine) -> dict[str, Any]:
    backend, limits = engine.backend, engine.limits
    capacity = backend.capacity
    absent = missing(backend, limits)
    declared: Mapping[str, int | str | None] = {
        f: "auto" if f in capacity.from_engine else getattr(capacity, f) for f in ENGINE_FIELDS
    }
    entry: dict[str, Any] = {
        "declared": dict(declared),
        "engine": engine_figures(limits) if limits is not None else None,
        "engine_source": limits.source if limits is not None else None,
        "disagreements": [
            {"field": d.field, "declared": d.declared, "engine": d.engine, "why": d.why} for d in engine.found
        ],
        "ready": not absent,
    }
    if absent:
        entry["not_ready"] = {"awaiting": list(absent), "why": engine.why_not or "not read yet"}
    return entry


def _nothing() -> None:
    pass


# --- policy validate --live ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LiveReport:
    """One backend's declared capacity against its engine, read now (``policy validate --live``)."""

    backend: Backend
    limits: EngineLimits
    found: tuple[Disagreement, ...]
    missing: tuple[EngineField, ...]
    """``auto`` figures the engine did not give: the gateway would send this backend nothing."""

    @property
    def agrees(self) -> bool:
        return not self.found and not self.missing

    @property
    def unreachable(self) -> bool:
        return unreadable(self.limits)

    def summary(self) -> str:
        """``backend b (llamacpp at http://...): max_concurrent: declared auto, engine 4; ... (GET /props)``."""
        b, figures = self.backend, engine_figures(self.limits)
        head = f"backend {b.name} ({b.kind.value} at {b.url})"
        if self.unreachable:
            return f"{head}: engine not read: {self.limits.source}"
        parts = []
        for name in ENGINE_FIELDS:
            declared = "auto" if name in b.capacity.from_engine else getattr(b.capacity, name)
            engine = figures[name] if figures[name] is not None else "not given"
            parts.append(f"{name}: declared {'not set' if declared is None else declared}, engine {engine}")
        return f"{head}: {'; '.join(parts)} ({self.limits.source})"

    def problems(self) -> list[str]:
        """The WARNINGs the gateway would log (``CapacityCheck``'s words), then the ``auto`` figures missing."""
        lines = [f"WARNING {d.message()} ({self.limits.source})" for d in self.found]
        if self.unreachable and not self.missing:
            lines.append(f"WARNING backend {self.backend.name}: its engine's limits were not read, nothing compared")
        if self.missing:
            why = not_given(self.missing, self.limits)
            lines.append(f"ERROR backend {self.backend.name}: {why}: the gateway would send this backend no request")
        return lines


async def live_check(backends: Iterable[Backend], client: httpx.AsyncClient, timeout_s: float) -> list[LiveReport]:
    """Read every backend's engine limits now, in parallel, and compare (``LiveReport``)."""
    listed = list(backends)
    read = await asyncio.gather(*(read_engine_limits(client, b, timeout_s) for b in listed))
    return [
        LiveReport(b, limits, tuple(compare(b, limits)), missing(b, None if unreadable(limits) else limits))
        for b, limits in zip(listed, read, strict=True)
    ]
