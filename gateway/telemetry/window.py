"""Event counts over a sliding time window, in fixed buckets, O(1) per event.

A ``SlidingCounter(window_s=10, buckets=10)`` keeps ten one-second buckets; ``total(now)`` is
the count of the current bucket plus the nine before it, so the window covers between 9 and
10 seconds of history (the resolution is one bucket). Time comes from the caller (a ``Clock``
reading, monotonic seconds); a reading earlier than the latest one counts in the latest
bucket. Used by the circuit breaker's error rate and by the retry budget.

Usage::

    requests = SlidingCounter(window_s=10.0)
    requests.add(clock.now())
    if requests.total(clock.now()) >= 20: ...
"""

from __future__ import annotations

import math


class SlidingCounter:
    """A count of events in the last ``window_s`` seconds (see the module docstring)."""

    __slots__ = ("_counts", "_head", "_total", "_width", "window_s")

    def __init__(self, window_s: float, *, buckets: int = 10) -> None:
        if window_s <= 0 or buckets < 1:
            raise ValueError("window_s must be positive and buckets at least 1")
        self.window_s = window_s
        self._width = window_s / buckets
        self._counts = [0] * buckets
        self._head: int | None = None  # absolute index of the newest bucket
        self._total = 0

    def add(self, now: float, n: int = 1) -> None:
        self._advance(now)
        assert self._head is not None
        self._counts[self._head % len(self._counts)] += n
        self._total += n

    def total(self, now: float) -> int:
        self._advance(now)
        return self._total

    def clear(self) -> None:
        self._counts = [0] * len(self._counts)
        self._total = 0

    def _advance(self, now: float) -> None:
        index = math.floor(now / self._width)
        head = self._head
        if head is None or index <= head:
            if head is None:
                self._head = index
            return
        size = len(self._counts)
        if index - head >= size:
            self.clear()
        else:
            for i in range(head + 1, index + 1):
                slot = i % size
                self._total -= self._counts[slot]
                self._counts[slot] = 0
        self._head = index

    def __repr__(self) -> str:
        return f"SlidingCounter(window_s={self.window_s}, total={self._total})"
