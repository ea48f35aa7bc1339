"""A circuit breaker per backend: Closed, Open, HalfOpen, on an injected clock.

The rule:

* **Closed** lets everything through and watches outcomes. It opens after
  ``consecutive_failures`` failures in a row, or when at least ``min_requests`` outcomes were
  seen in the last ``window_s`` seconds and the share of failures among them is at or above
  ``failure_ratio`` (either rule can be switched off with ``null``).
* **Open** lets nothing through for the open interval: ``open_s`` on the first trip, multiplied
  by ``open_growth`` on each trip that follows without a stable recovery in between, capped at
  ``max_open_s``. The streak is forgotten once the breaker has stayed closed for ``max_open_s``.
  Outcomes of requests that started before the trip are ignored.
* **HalfOpen** (once the open interval has passed) lets at most ``half_open_probes`` probe
  requests be in flight. A probe success closes the breaker with fresh counters; a probe
  failure opens it again, for a longer interval. A probe that never reports (a caller bug) is
  forgotten after ``probe_timeout_s`` so a backend is never shut out for good.

What counts: report ``on_failure()`` for connection errors, timeouts and 5xx answers; report
``on_success()`` when the backend answered with a 2xx status line (for a stream, at its
headers, so that a probe does not wait for a long generation); a 4xx says nothing about the
backend and a 429 is the backend's admission, so neither is reported (call ``abstain()``).

Two calls guard a request, because routing filters many candidates but sends to one:
``allow()`` is a pure check for filters (Closed, or HalfOpen with a free probe slot);
``try_acquire()`` takes the probe slot when the request is really sent to this backend (always
true when Closed) and must be followed by exactly one of ``on_success()``, ``on_failure()`` or
``abstain()`` (cancelled, no verdict).

Defaults follow what an Envoy or Hystrix user expects: 5 consecutive failures (Envoy's
``consecutive_5xx``), 50 % of at least 20 requests over 10 s (Hystrix), open 30 s growing to at
most 300 s (Envoy's ``base_ejection_time`` and ``max_ejection_time``), one probe.

Usage::

    breaker = CircuitBreaker("h100-a", BreakerPolicy(), clock)
    candidates = [b for b in backends if breakers[b.name].allow()]
    if breakers[picked].try_acquire(): ...send, then on_success() / on_failure() / abstain()
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import StrEnum

from gateway.clock import Clock
from gateway.policy.model import BreakerPolicy
from gateway.telemetry.window import SlidingCounter

log = logging.getLogger(__name__)


class BreakerState(StrEnum):
    """The breaker's state; the values are the ``state`` metric label."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


Transition = Callable[[str, BreakerState, BreakerState], None]


class CircuitBreaker:
    """The breaker of one backend (see the module docstring); used from the event loop only."""

    __slots__ = (
        "_clock",
        "_closed_at",
        "_consecutive",
        "_failures",
        "_on_transition",
        "_open_until",
        "_probe_at",
        "_probes",
        "_requests",
        "_state",
        "_streak",
        "name",
        "policy",
        "refused",
        "trips",
    )

    def __init__(
        self, name: str, policy: BreakerPolicy, clock: Clock, *, on_transition: Transition | None = None
    ) -> None:
        self.name = name
        self.policy = policy
        self._clock = clock
        self._on_transition = on_transition
        self._state = BreakerState.CLOSED
        self._requests = SlidingCounter(policy.window_s)
        self._failures = SlidingCounter(policy.window_s)
        self._consecutive = 0
        self._open_until = 0.0
        self._closed_at = float("-inf")
        self._streak = 0  # trips since the last stable recovery
        self._probes = 0  # probes in flight while half-open
        self._probe_at = 0.0
        self.trips = 0  # times opened, for telemetry
        self.refused = 0  # try_acquire() calls refused, for telemetry

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock.now() >= self._open_until:
            self._move(BreakerState.HALF_OPEN)
            self._probes = 0
        return self._state

    @property
    def open_until(self) -> float:
        """When the current (or last) open interval ends, on the clock's scale."""
        return self._open_until

    def allow(self) -> bool:
        """Whether a request could go to this backend now; no side effect but the clock's."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            return False
        if self._probes and self._clock.now() - self._probe_at >= self.policy.probe_timeout_s:
            log.warning("breaker %s: %d probe(s) never reported; forgetting them", self.name, self._probes)
            self._probes = 0
        return self._probes < self.policy.half_open_probes

    def try_acquire(self) -> bool:
        """Take the right to send one request (a probe slot when half-open)."""
        if not self.allow():
            self.refused += 1
            return False
        if self._state is BreakerState.HALF_OPEN:
            self._probes += 1
            self._probe_at = self._clock.now()
        return True

    def on_success(self) -> None:
        state = self.state
        if state is BreakerState.CLOSED:
            self._consecutive = 0
            self._requests.add(self._clock.now())
        elif state is BreakerState.HALF_OPEN:
            self._close()

    def on_failure(self) -> None:
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._open()
        elif state is BreakerState.CLOSED:
            now = self._clock.now()
            self._consecutive += 1
            self._requests.add(now)
            self._failures.add(now)
            if self._should_trip(now):
                self._open()

    def abstain(self) -> None:
        """The acquired request ended without a verdict (cancelled, or a 4xx/429 answer)."""
        if self.state is BreakerState.HALF_OPEN and self._probes:
            self._probes -= 1

    def _should_trip(self, now: float) -> bool:
        p = self.policy
        if p.consecutive_failures is not None and self._consecutive >= p.consecutive_failures:
            return True
        if p.failure_ratio is None:
            return False
        seen = self._requests.total(now)
        return seen >= p.min_requests and self._failures.total(now) >= p.failure_ratio * seen

    def _open(self) -> None:
        now = self._clock.now()
        p = self.policy
        if self._state is BreakerState.CLOSED and now - self._closed_at >= p.max_open_s:
            self._streak = 0
        self._streak += 1
        self.trips += 1
        interval = min(p.max_open_s, p.open_s * p.open_growth ** (self._streak - 1))
        self._open_until = now + interval
        self._probes = 0
        self._move(BreakerState.OPEN, f"for {interval:g}s")

    def _close(self) -> None:
        self._closed_at = self._clock.now()
        self._consecutive = 0
        self._probes = 0
        self._requests.clear()
        self._failures.clear()
        self._move(BreakerState.CLOSED)

    def _move(self, state: BreakerState, detail: str = "") -> None:
        before, self._state = self._state, state
        log.warning("breaker %s: %s -> %s %s", self.name, before.value, state.value, detail)
        if self._on_transition is not None:
            self._on_transition(self.name, before, state)

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.name!r}, state={self._state.value}, trips={self.trips})"
