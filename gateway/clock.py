"""Monotonic time, injected so that latency arithmetic can be tested with a fake clock."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Seconds on a monotonic scale; only differences are meaningful."""

    def now(self) -> float: ...


class MonotonicClock:
    """The process's monotonic clock (`time.perf_counter`, the finest one available)."""

    __slots__ = ()

    def now(self) -> float:
        return time.perf_counter()
