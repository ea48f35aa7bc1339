"""Time sources for the simulated engine.

The engine never reads the wall clock directly: it asks a `Clock` for monotonic seconds, so tests
can inject a fake and the step loop can schedule steps on absolute deadlines.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds; only differences are meaningful."""

    def now(self) -> float: ...


class MonotonicClock:
    """`time.monotonic()`: the production clock."""

    def now(self) -> float:
        return time.monotonic()
