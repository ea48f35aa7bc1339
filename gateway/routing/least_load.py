"""Least-loaded picking: the healthy backend with the fewest requests (then tokens) in flight.

Ties, which are the rule at low load, rotate through the tied backends, so that an idle
pool spreads requests instead of sending all of them to the first backend listed. The
prefix-affinity router replaces this as the default; it stays as the ``least_load`` strategy.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

from gateway.endpoints import BackendState
from gateway.errors import NoHealthyBackend


class LeastLoadPicker:
    """Pick the healthy candidate with the lowest (in_flight, in_flight_tokens)."""

    __slots__ = ("_turn",)

    def __init__(self) -> None:
        self._turn = count()

    def pick(self, model: str, candidates: Sequence[BackendState]) -> BackendState:
        best: list[BackendState] = []
        best_load = (0, 0)
        for state in candidates:
            if not state.healthy:
                continue
            load = (state.in_flight, state.in_flight_tokens)
            if not best or load < best_load:
                best, best_load = [state], load
            elif load == best_load:
                best.append(state)
        if not best:
            raise NoHealthyBackend(
                f"No healthy backend serves model '{model}' right now; retry shortly.",
                headers={"retry-after": "1"},
            )
        return best[0] if len(best) == 1 else best[next(self._turn) % len(best)]
