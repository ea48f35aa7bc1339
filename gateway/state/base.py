"""Where shared admission state lives: the ``LimitStore`` protocol.

Rate limits must hold across gateway replicas, so their state sits behind this interface:
``state/memory.py`` keeps it in the process (one replica, the default), ``state/redis.py``
shares it between replicas through Redis (the policy's ``state`` section picks one,
``state/factory.py`` builds it). Every operation is one atomic step on one key, so that a Redis implementation is
one Lua script per call and never a read-modify-write race between replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class BucketResult:
    """The outcome of taking ``amount`` from a token bucket.

    ``remaining`` is what is left after the take (or before it, when refused);
    ``retry_after_s`` is how long until ``amount`` would be available (0 when taken);
    ``reset_s`` is how long until the bucket is full again.
    """

    allowed: bool
    remaining: float
    retry_after_s: float
    reset_s: float


class LimitStore(Protocol):
    """Token buckets (requests and tokens per minute) and concurrency slots, by key."""

    async def take(self, key: str, amount: float, capacity: float, refill_per_s: float) -> BucketResult:
        """Take ``amount`` if the bucket (refilled since last use) holds it; never goes negative."""
        ...

    async def refund(self, key: str, amount: float, capacity: float, refill_per_s: float) -> None:
        """Give back part of a take (a request that used fewer tokens, or was rejected later)."""
        ...

    async def acquire_slot(self, key: str, limit: int) -> bool:
        """Take one of ``limit`` concurrency slots; False when all are taken."""
        ...

    async def release_slot(self, key: str) -> None: ...

    async def slots_in_use(self, key: str) -> int: ...

    async def aclose(self) -> None: ...
