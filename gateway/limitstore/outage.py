"""What one process enforces on its own while Redis is lost: ``state.on_store_loss``.

While Redis is up, a tenant's limits are the fleet's, in Redis. When it is lost (down, or
slower than the request budget), every process decides alone until it is back, and what
each may admit is the policy's choice:

* ``share`` (the default): each process enforces ``limit / N``, N the live gateway
  processes the fleet coordinator counted at its last ledger sync (read once, when Redis is
  lost). A process that never counted them uses ``fleet.processes_when_unknown``; unset, it
  refuses limited tenants like ``closed``: a process that has never seen the fleet must not
  assume it is alone, and guessing a number would be the silent default the policy forbids.
  Three things keep a tenant near its limit across an outage, not N times it:

  - a bucket starts from this process's share of the **last level it saw in Redis** (refilled
    to now at the full rate), not full: a tenant that had spent its minute before the outage
    cannot spend it again N times over;
  - **slots** already held in Redis by this process count against its share of the
    concurrency limit, and a slot taken here is given back here (``slot_at: "local"``);
  - what the process admitted meanwhile is **charged to Redis** when it is back
    (``debts``), so that Redis's bucket, which refilled while nobody could take from it, does
    not hand the outage's requests out a second time.

  The bound: over the outage, the fleet admits at most the limit's refill (plus the levels
  last seen), and a tenant's concurrency is at most ``floor(limit / N)`` per process beyond
  the slots each held in Redis before the loss (those drain as their requests end). A share
  below one request (a limit smaller than N) admits nothing.
* ``open``: the whole limit in each process, buckets full (up to N x the limit), nothing
  charged back: availability before accuracy, as before issue 28. Slots held in Redis count
  against the local limit too, so a process never holds more than the limit.
* ``closed``: a limited tenant is refused (``UNAVAILABLE``: 503 with Retry-After) until Redis
  is back; what requests admitted before the loss give back is remembered and paid to Redis.

No call awaits anything: each is atomic on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from gateway.clock import Clock, MonotonicClock
from gateway.limitstore.base import (
    UNAVAILABLE,
    Adjust,
    Ask,
    Bucket,
    BucketResult,
    LimitVerdict,
    Settlement,
    SlotAt,
    adjusted,
    refill,
)

LossMode = Literal["share", "open", "closed"]

Processes = Callable[[], int]
"""How many gateway processes share the limits, as the fleet last counted them (0: never)."""

Key = tuple[str, str]  # (scope, bucket name)


def _never_counted() -> int:
    return 0


class LocalLimits:
    """This process's own limits while Redis is lost (module docstring); the Redis store's fallback.

    The Redis store calls ``saw`` with every level Redis answers, ``lost`` when Redis is lost,
    ``admit``/``settle`` meanwhile, then ``debts``/``paid``/``recovered`` when it is back."""

    def __init__(
        self,
        mode: LossMode = "open",
        clock: Clock | None = None,
        *,
        processes: Processes = _never_counted,
        processes_when_unknown: int | None = None,
        retry_after_s: float = 1.0,
    ) -> None:
        self.mode = mode
        self.divisor: int | None = 1
        """N of the outage in force (1 but in ``share`` mode); None: unknown, so refuse."""
        self._clock = clock or MonotonicClock()
        self._processes = processes
        self._unknown = processes_when_unknown
        self._retry_after_s = retry_after_s
        self._seen: dict[Key, tuple[float, float]] = {}  # last level read in Redis, and when
        self._buckets: dict[Key, tuple[float, float]] = {}  # this outage's levels, and when
        self._spent: dict[Key, tuple[Bucket, float]] = {}  # net taken here since the loss
        self._slots: dict[str, int] = {}  # slots taken here and still held (across a recovery too)

    def saw(self, scope: str, bucket: str, level: float) -> None:
        """Redis answered ``level`` for this bucket just now."""
        self._seen[(scope, bucket)] = (level, self._clock.now())

    def lost(self) -> int | None:
        """Redis is lost: fix N for this outage (returned; None when unknown)."""
        if self.mode != "share":
            self.divisor = 1
        else:
            live = self._processes()
            self.divisor = live if live > 0 else self._unknown
        return self.divisor

    def terms(self, processes: int | None) -> str:
        """What this process enforces during the outage that gave N ``processes`` (for the log)."""
        if self.mode == "open":
            return "on_store_loss open: each process the whole limit"
        if self.mode == "closed" or processes is None:
            why = "on_store_loss closed" if self.mode == "closed" else "the fleet's processes were never counted"
            return f"{why}: limited tenants refused with 503 until Redis is back"
        return f"on_store_loss share: each process 1/{processes} of every limit"

    def refusing(self) -> bool:
        """Every limited tenant is refused (``closed``, or ``share`` with N still unknown)."""
        if self.divisor is None and self.mode == "share":
            self.divisor = self._processes() or None  # the fleet may have been counted since
        return self.mode == "closed" or self.divisor is None

    def admit(self, ask: Ask, *, held: int = 0) -> LimitVerdict:
        """The ask against this process's share; ``held``: slots of the scope it holds in Redis."""
        if self.refusing():
            return LimitVerdict(False, UNAVAILABLE, (), retry_after_s=self._retry_after_s)
        divisor = self.divisor or 1
        now, scope = self._clock.now(), ask.scope
        refused_by = None
        if ask.slot_limit is not None and held + self._slots.get(scope, 0) >= ask.slot_limit // divisor:
            refused_by = "slot"
        shares = [_share(take.bucket, divisor) for take in ask.takes]
        levels = [self._level(scope, take.bucket, share, now) for take, share in zip(ask.takes, shares, strict=True)]
        for take, level in zip(ask.takes, levels, strict=True):
            if refused_by is None and level < take.amount:
                refused_by = take.bucket.name
        admitted = refused_by is None
        if admitted:
            if ask.slot_limit is not None:
                self._slots[scope] = self._slots.get(scope, 0) + 1
            for take, level in zip(ask.takes, levels, strict=True):
                self._buckets[(scope, take.bucket.name)] = (level - take.amount, now)
                self._spend(scope, take.bucket, take.amount)
        results = tuple(
            BucketResult.of(level, take.amount, share.capacity, share.refill_per_s, admitted)
            for take, level, share in zip(ask.takes, levels, shares, strict=True)
        )
        slot_at: SlotAt | None = "local" if admitted and ask.slot_limit is not None else None
        return LimitVerdict(admitted, refused_by, results, slot_at=slot_at)

    def settle(self, settlement: Settlement) -> None:
        """Release a slot taken here (``slot_at == "local"``) and apply the adjustments here."""
        scope = settlement.scope
        if settlement.release_slot and settlement.slot_at == "local":
            self.release(scope)
        now = self._clock.now()
        for adjust in settlement.adjusts:
            self._spend(scope, adjust.bucket, -adjust.amount)
            if self.refusing():
                continue  # no local buckets: the adjustment is only remembered, for Redis
            share = _share(adjust.bucket, self.divisor or 1)
            level = adjusted(self._level(scope, adjust.bucket, share, now), adjust.amount, share.capacity)
            self._buckets[(scope, adjust.bucket.name)] = (level, now)

    def release(self, scope: str) -> None:
        held = self._slots.get(scope, 0) - 1
        if held > 0:
            self._slots[scope] = held
        else:
            self._slots.pop(scope, None)

    def slots_in_use(self, scope: str) -> int:
        return self._slots.get(scope, 0)

    def scopes_with_slots(self) -> dict[str, int]:
        return dict(self._slots)

    def debts(self) -> dict[str, tuple[Adjust, ...]]:
        """What this process took (net) since the loss, per scope, as charges for Redis (none when ``open``)."""
        if self.mode == "open":
            return {}
        owed: dict[str, list[Adjust]] = {}
        for (scope, _), (bucket, amount) in self._spent.items():
            if amount:
                owed.setdefault(scope, []).append(Adjust(bucket, -amount))
        return {scope: tuple(adjusts) for scope, adjusts in owed.items()}

    def paid(self, scope: str, adjusts: tuple[Adjust, ...]) -> None:
        """Redis was charged ``adjusts`` (from ``debts``); what was spent here since is still owed."""
        for adjust in adjusts:
            self._spend(scope, adjust.bucket, adjust.amount)

    def recovered(self) -> None:
        """Redis is the truth again: forget this outage's buckets (the next outage starts anew)."""
        self._buckets.clear()
        self._spent.clear()

    def _spend(self, scope: str, bucket: Bucket, amount: float) -> None:
        key = (scope, bucket.name)
        _, spent = self._spent.get(key, (bucket, 0.0))
        self._spent[key] = (bucket, spent + amount)

    def _level(self, scope: str, bucket: Bucket, share: Bucket, now: float) -> float:
        """The level of this process's share of ``bucket`` now: its own, else seeded (module docstring)."""
        state = self._buckets.get((scope, bucket.name))
        if state is not None:
            return refill(state[0], now - state[1], share)
        if self.mode == "open":
            return bucket.capacity
        seen = self._seen.get((scope, bucket.name))
        if seen is None:
            return share.capacity
        return min(share.capacity, refill(seen[0], now - seen[1], bucket) / (self.divisor or 1))


def _share(bucket: Bucket, divisor: int) -> Bucket:
    if divisor == 1:
        return bucket
    return Bucket(bucket.name, bucket.capacity / divisor, bucket.refill_per_s / divisor)
