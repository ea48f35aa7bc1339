"""In-process ``LimitStore``: exact, lock-free (one event loop), lost on restart.

The default for a single replica. Buckets are refilled lazily on each use from the time
elapsed, so idle keys cost nothing; a key whose bucket is full and which holds no slot is
dropped, so memory follows the active tenants, not all tenants ever seen.
"""

from __future__ import annotations

from gateway.clock import Clock, MonotonicClock
from gateway.state.base import BucketResult


class MemoryLimitStore:
    """Token buckets and slot counters in dicts. ``MemoryLimitStore(clock=FakeClock())`` in tests."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or MonotonicClock()
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (level, time of level)
        self._slots: dict[str, int] = {}

    def _level(self, key: str, capacity: float, refill_per_s: float, now: float) -> float:
        level, at = self._buckets.get(key, (capacity, now))
        return min(capacity, level + (now - at) * refill_per_s)

    async def take(self, key: str, amount: float, capacity: float, refill_per_s: float) -> BucketResult:
        now = self._clock.now()
        level = self._level(key, capacity, refill_per_s, now)
        if level >= amount:
            level -= amount
            self._buckets[key] = (level, now)
            return BucketResult(True, level, 0.0, (capacity - level) / refill_per_s)
        self._buckets[key] = (level, now)
        return BucketResult(False, level, (amount - level) / refill_per_s, (capacity - level) / refill_per_s)

    async def refund(self, key: str, amount: float, capacity: float, refill_per_s: float) -> None:
        now = self._clock.now()
        level = min(capacity, self._level(key, capacity, refill_per_s, now) + amount)
        if level >= capacity:
            self._buckets.pop(key, None)
        else:
            self._buckets[key] = (level, now)

    async def acquire_slot(self, key: str, limit: int) -> bool:
        used = self._slots.get(key, 0)
        if used >= limit:
            return False
        self._slots[key] = used + 1
        return True

    async def release_slot(self, key: str) -> None:
        used = self._slots.get(key, 0) - 1
        if used > 0:
            self._slots[key] = used
        else:
            self._slots.pop(key, None)

    async def slots_in_use(self, key: str) -> int:
        return self._slots.get(key, 0)

    async def aclose(self) -> None:
        self._buckets.clear()
        self._slots.clear()
