"""Where shared admission state lives: the ``LimitStore`` protocol.

Rate limits must hold across gateway replicas, so their state sits behind this interface:
``limitstore/memory.py`` keeps it in the process (one replica, the default), ``limitstore/redis.py``
shares it between replicas through Redis (the policy's ``state`` section picks one,
``limitstore/factory.py`` builds it).

**Two operations per request.** ``admit`` takes a tenant's concurrency slot and every bucket
it asks for (requests, tokens) all at once or not at all; ``settle`` releases the slot and
adjusts the buckets to what the request really cost. The in-process store does each in one
step. The Redis store spends leases (``limitstore/lease.py``): each process holds a batch of a
tenant's tokens and slots, taken from Redis atomically by one Lua script per tenant and
renewed in the background, so that an admission or a settlement costs Redis a small fraction
of a round trip at a steady rate; an admission whose lease is short asks Redis at once (one
round trip), so the answer is the one a single shared bucket would give. Never a
read-modify-write race between replicas.

**Buckets may go negative, down to ``-capacity``.** Tokens are reserved at admission from an
estimate (prompt plus the output bound); when the real usage is higher, ``settle`` charges the
difference even when the bucket does not hold it, so a tenant that overran waits until the
refill pays its debt (a take is refused while the level is below the amount, and its
``retry_after_s`` includes the debt). The floor at ``-capacity`` bounds that wait to two
minutes of refill for a per-minute limit: a usage figure that is wrong (a backend that ignored
the output bound, or reported nonsense) must not lock a tenant out for hours.

**A slot is given back where it was taken.** A store that keeps slots in more than one place
(the Redis store's local fallback, while Redis is lost) says where in ``LimitVerdict.slot_at``; the
caller hands it back in ``Settlement.slot_at``. Releasing "a slot" wherever one is found would
free a fallback slot for a request that holds one in Redis, and let a tenant run past its
limit (issue 28: 12 for a limit of 4 on two replicas).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

SlotAt = Literal["store", "local"]
"""Where a slot was taken: the store proper, or a local fallback of it."""

UNAVAILABLE = "unavailable"
"""``LimitVerdict.refused_by`` when the store refuses because it cannot enforce the limits at all
(``state.on_store_loss: closed`` while Redis is lost): a 503, not the tenant's 429."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket of a scope: ``name`` (``rpm``, ``tpm``), its capacity and refill per second."""

    name: str
    capacity: float
    refill_per_s: float


@dataclass(frozen=True, slots=True)
class Take:
    """Take ``amount`` from ``bucket`` at admission (refused when the bucket does not hold it)."""

    bucket: Bucket
    amount: float


@dataclass(frozen=True, slots=True)
class Adjust:
    """Change ``bucket`` at settlement: ``amount > 0`` gives back (up to capacity), ``< 0`` charges.

    A charge is taken even from a bucket that does not hold it (down to ``-capacity``)."""

    bucket: Bucket
    amount: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Ask:
    """One admission: a concurrency slot of ``scope`` (when ``slot_limit``) and every take, or nothing.

    ``scope`` is whose limits these are (the tenant): every key of one ask lives under it (one
    Redis Cluster hash slot)."""

    scope: str
    slot_limit: int | None = None
    takes: tuple[Take, ...] = ()


@dataclass(frozen=True, slots=True)
class BucketResult:
    """The state of one bucket after an ask.

    ``allowed``: the bucket held the amount asked; ``remaining``: its level after the take
    (before it, when the ask was refused; negative while a debt is paid off);
    ``retry_after_s``: how long until it holds the amount (0 when it does);
    ``reset_s``: how long until it is full again.
    """

    allowed: bool
    remaining: float
    retry_after_s: float
    reset_s: float

    @classmethod
    def of(cls, level: float, amount: float, capacity: float, refill_per_s: float, taken: bool) -> BucketResult:
        """The result for a bucket at ``level`` before the take (after it when ``taken``)."""
        remaining = level - amount if taken else level
        wait = max(0.0, (amount - level) / refill_per_s)
        return cls(level >= amount, remaining, 0.0 if taken else wait, (capacity - remaining) / refill_per_s)


@dataclass(frozen=True, slots=True)
class LimitVerdict:
    """The answer to an ``Ask``: admitted (slot and every take done) or refused (nothing done).

    ``refused_by`` names the first limit that refused, in the order checked: ``"slot"``, then
    each take's bucket name. ``buckets`` has one result per take, in the ask's order."""

    admitted: bool
    refused_by: str | None
    buckets: tuple[BucketResult, ...]
    slot_at: SlotAt | None = None
    """Where the slot was taken (when the ask had one and was admitted): give it back there."""
    waited_s: float = 0.0
    """What the call cost the request's budget: seconds it waited on a shared store (the event
    loop's free time, ``shared/lag.py``)."""
    retry_after_s: float = 0.0
    """For ``UNAVAILABLE``: when to try again."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settlement:
    """What one request gives back or owes at its end: its slot (where it took it: ``slot_at``
    of its verdict), and adjustments of its buckets."""

    scope: str
    release_slot: bool = False
    slot_at: SlotAt = "store"
    adjusts: tuple[Adjust, ...] = ()


def refill(level: float, elapsed_s: float, bucket: Bucket) -> float:
    """The level of a bucket ``elapsed_s`` after it was at ``level`` (never above capacity)."""
    return min(bucket.capacity, level + max(0.0, elapsed_s) * bucket.refill_per_s)


def adjusted(level: float, amount: float, capacity: float) -> float:
    """``level + amount`` kept within ``[-capacity, capacity]`` (see the module docstring)."""
    return min(capacity, max(-capacity, level + amount))


class LimitStore(Protocol):
    """Token buckets and concurrency slots per scope (tenant), each step atomic.

    ``timeout_s`` is what the caller may still wait on the store for this request (what is left
    of its budget, see ``RedisLimitStore``; None: a whole budget); past it, the call is answered
    from a local fallback instead. ``request_budget_s`` is the budget a request starts with
    (``inf`` for an in-process store). ``admit`` tells what it cost the budget in
    ``LimitVerdict.waited_s``, ``settle`` returns it. ``slots_in_use`` is the slots the fleet
    holds for the scope (a lease's spare slots included).
    """

    request_budget_s: float

    async def admit(self, ask: Ask, *, timeout_s: float | None = None) -> LimitVerdict: ...

    async def settle(self, settlement: Settlement, *, timeout_s: float | None = None) -> float: ...

    async def slots_in_use(self, scope: str) -> int: ...

    async def aclose(self) -> None: ...
