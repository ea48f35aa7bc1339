"""In-process ``LimitStore``: exact, lock-free (one event loop), lost on restart.

The default for a single replica, and the fallback of the Redis store. Buckets are refilled
lazily on each use from the time elapsed, so idle keys cost nothing; a key whose bucket is
full and which holds no slot is dropped, so memory follows the active tenants, not all
tenants ever seen. No call awaits anything, so each is atomic on the event loop.
"""

from __future__ import annotations

import math

from gateway.clock import Clock, MonotonicClock
from gateway.limitstore.base import Ask, Bucket, BucketResult, LimitVerdict, Settlement, adjusted, refill


class MemoryLimitStore:
    """Token buckets and slot counters in dicts. ``MemoryLimitStore(clock=FakeClock())`` in tests."""

    request_budget_s = math.inf

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or MonotonicClock()
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # (scope, name) -> (level, time of level)
        self._slots: dict[str, int] = {}

    def _level(self, scope: str, bucket: Bucket, now: float) -> float:
        level, at = self._buckets.get((scope, bucket.name), (bucket.capacity, now))
        return refill(level, now - at, bucket)

    def _store(self, scope: str, bucket: Bucket, level: float, now: float) -> None:
        if level >= bucket.capacity:
            self._buckets.pop((scope, bucket.name), None)
        else:
            self._buckets[(scope, bucket.name)] = (level, now)

    async def admit(self, ask: Ask, *, timeout_s: float | None = None) -> LimitVerdict:
        now = self._clock.now()
        scope = ask.scope
        refused_by = None
        if ask.slot_limit is not None and self._slots.get(scope, 0) >= ask.slot_limit:
            refused_by = "slot"
        levels = [self._level(scope, take.bucket, now) for take in ask.takes]
        for take, level in zip(ask.takes, levels, strict=True):
            if refused_by is None and level < take.amount:
                refused_by = take.bucket.name
        admitted = refused_by is None
        if admitted:
            if ask.slot_limit is not None:
                self._slots[scope] = self._slots.get(scope, 0) + 1
            for take, level in zip(ask.takes, levels, strict=True):
                self._store(scope, take.bucket, level - take.amount, now)
        results = tuple(
            BucketResult.of(level, take.amount, take.bucket.capacity, take.bucket.refill_per_s, admitted)
            for take, level in zip(ask.takes, levels, strict=True)
        )
        return LimitVerdict(
            admitted, refused_by, results, slot_at="store" if admitted and ask.slot_limit is not None else None
        )

    async def settle(self, settlement: Settlement, *, timeout_s: float | None = None) -> float:
        now = self._clock.now()
        scope = settlement.scope
        if settlement.release_slot:
            used = self._slots.get(scope, 0) - 1
            if used > 0:
                self._slots[scope] = used
            else:
                self._slots.pop(scope, None)
        for adjust in settlement.adjusts:
            bucket = adjust.bucket
            level = adjusted(self._level(scope, bucket, now), adjust.amount, bucket.capacity)
            self._store(scope, bucket, level, now)
        return 0.0

    async def slots_in_use(self, scope: str) -> int:
        return self._slots.get(scope, 0)

    async def aclose(self) -> None:
        self._buckets.clear()
        self._slots.clear()
