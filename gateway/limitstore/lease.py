"""A process's leases of its tenants' limits: what it may spend without asking Redis.

**Why.** Asking Redis at every admission and every settlement cost two round trips per
request (issue 28, item 5: 2.03 measured); a thousand replicas at 2,000 requests a second
each would send Redis four million scripts a second. As quota-leasing rate limiters do
(Google's Doorman, Envoy's global quota), each process takes a *lease* of a tenant's budget
from Redis, a batch of tokens per bucket and a number of concurrency slots, and spends it
locally; it reports what it spent, and tops the lease up, in batches in the background.

**The rules** (``limitstore/scripts.py`` keeps the fleet's side of them, atomically):

* *The bound holds at every instant, fleet-wide.* Tokens leased out leave the bucket's level
  (whose ceiling is the capacity minus every lease), slots leased count in the limit: the
  sum of what is leased never exceeds the limit, so no process can spend more than what one
  token bucket would have admitted.
* *Sized from the observed rate, renewed before running out.* A lease aims at ``LEASE_S`` of
  the process's own spending (an exponentially weighted rate), at most ``MAX_SHARE`` of the
  capacity (a slot lease keeps at most ``SLOT_SPARE_SHARE`` of the limit spare). The
  background keeper tops it up when it falls under half of that (the watermark), and gives
  back what is over twice that, both in one pipeline for every tenant.
* *A dry lease asks at once.* An admission that finds its lease short asks Redis for what it
  lacks, in one round trip, with the refill of the lease on top: a tenant alone on one
  process is refused only when the bucket itself (plus its lease) does not hold the request,
  exactly as without leases.
* *Small limits stay exact.* When ``MAX_SHARE`` of a capacity is under one (rpm 60, tpm 60,
  max_concurrent under 16) nothing is prefetched and nothing spare is kept: the lease is
  the request's need, and what a settlement gives back goes to Redis at once. These tenants
  pay the old two round trips per request; their limit bounds their rate.
* *A refusal is heard.* When Redis refuses an ask, it remembers it for ``WANTED_S``; every
  process that syncs meanwhile learns it, gives back what it holds spare and prefetches
  nothing, so that a process holding spare tokens cannot starve another.
* *A lease expires.* Redis drops a replica's lease ``ttl`` after its last sync (its slots
  freed, its tokens counted spent); the process uses its lease only until ``ttl`` after it
  *sent* that sync (Redis's expiry is later), so a process cut off from Redis never spends a
  lease that Redis already gave to others.
* *What Redis is told is never counted twice in the tenant's favour.* A sync whose answer is
  lost may or may not have been applied: what it reported spent, and charged, is reported
  again (counted twice at worst, against the tenant), what it gave back is taken as given
  back, and Redis keeps the smaller of its own count and what the process believes it holds
  (so a grant whose answer was lost is given back by the next sync).

Pure bookkeeping: no I/O, no clock; ``limitstore/redis.py`` calls it and talks to Redis.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from gateway.limitstore.base import Ask, Bucket, BucketResult, LimitVerdict, SlotAt

LEASE_S = 1.0
"""A lease aims at this many seconds of the process's own spending."""
MAX_SHARE = 1 / 64
"""A prefetch (beyond an admission's need) is at most this share of a bucket's capacity."""
SLOT_SPARE_SHARE = 1 / 16
"""Spare slots a process keeps: at most this share of the concurrency limit."""
WANTED_S = 1.0
"""How long Redis remembers a refused ask: processes keep nothing spare meanwhile."""
RATE_HALF_LIFE_S = 1.0
"""The half-life of the spending rate's average."""


@dataclass(slots=True)
class BucketLease:
    """Tokens of one bucket that this process holds: ``unspent`` (it may spend them), ``spent``
    (since the last report sent; still counted as leased in Redis), ``adjust`` (for the level:
    give-backs that found no unreported spending to cancel, and charges beyond the lease)."""

    bucket: Bucket
    unspent: float = 0.0
    spent: float = 0.0
    adjust: float = 0.0
    level: float = 0.0
    """The bucket's level in Redis at the last sync (for the headers), and when."""
    level_at: float | None = None
    rate: float = 0.0
    counted: float = 0.0
    counted_since: float | None = None
    boost: float = 0.0
    """The prefetch of the last admission that found the lease dry: doubled at each (a burst
    reaches its lease in a few round trips, before the rate's average has seen it)."""

    @property
    def cap(self) -> int:
        return math.floor(self.bucket.capacity * MAX_SHARE)

    def target(self) -> float:
        """The lease this process aims at (0 for a small capacity: exact, no prefetch)."""
        return float(min(self.cap, math.ceil(self.rate * LEASE_S)))

    def aim(self) -> float:
        """The lease the keeper keeps: the rate's target, or a recent burst's prefetch."""
        return max(self.target(), self.boost)

    def spend(self, amount: float) -> None:
        self.unspent -= amount
        self.spent += amount
        self.counted += amount

    def give_back(self, amount: float) -> None:
        """A settlement's adjustment: > 0 gives back (into the lease, when spending not yet
        reported covers it: the lease in Redis is unchanged), < 0 charges (from the lease first)."""
        if amount > 0:
            local = min(amount, self.spent)
            self.spent -= local
            self.unspent += local
            self.adjust += amount - local
        elif amount < 0:
            local = min(-amount, max(0.0, self.unspent))
            self.unspent -= local
            self.spent += local
            self.adjust += amount + local

    def estimate(self, now: float) -> float:
        """The level in Redis now, as far as this process knows (never above the capacity)."""
        if self.level_at is None:
            return self.bucket.capacity
        return min(self.bucket.capacity, self.level + max(0.0, now - self.level_at) * self.bucket.refill_per_s)

    def sample(self, now: float) -> None:
        """Fold what was spent since the last sample into the rate."""
        if self.counted_since is None:
            self.counted_since, self.counted = now, 0.0
            return
        elapsed = now - self.counted_since
        if elapsed <= 0:
            return
        weight = 0.5 ** (elapsed / RATE_HALF_LIFE_S)
        self.rate = weight * self.rate + (1 - weight) * self.counted / elapsed
        self.counted_since, self.counted = now, 0.0


@dataclass(slots=True)
class SlotLease:
    """Concurrency slots this process holds in Redis (``held``) and runs requests in (``in_use``)."""

    limit: int
    held: int = 0
    in_use: int = 0
    peak: int = 0
    last_peak: int = 0
    peak_since: float = 0.0

    @property
    def spare_cap(self) -> int:
        return math.floor(self.limit * SLOT_SPARE_SHARE)


@dataclass(frozen=True, slots=True)
class SentBucket:
    name: str
    bucket: Bucket
    spent: float
    believed: float
    keep: float
    adjust: float
    need: float
    want: float


@dataclass(frozen=True, slots=True)
class SentSlots:
    limit: int
    in_use: int
    believed: int
    keep: int
    need: int
    want: int


@dataclass(frozen=True, slots=True)
class Sent:
    """One sync as sent (what the process gave up at send time is already gone from its lease)."""

    scope: str
    at: float
    slots: SentSlots | None
    buckets: tuple[SentBucket, ...]


@dataclass(frozen=True, slots=True)
class Reply:
    """Redis's answer to a sync: the refused section (0 none, 1 the slot, 1 + i the i-th bucket),
    whether a refusal is remembered, the slots held here and fleet-wide, and per bucket the
    tokens held here and the level."""

    refused: int
    wanted: bool
    slots_held: int
    slots_total: int
    buckets: tuple[tuple[float, float], ...]


@dataclass(slots=True)
class ScopeLease:
    """Everything this process holds of one tenant (scope)."""

    scope: str
    slots: SlotLease | None = None
    buckets: dict[str, BucketLease] = field(default_factory=dict)
    valid_until: float = -math.inf
    wanted_until: float = -math.inf
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = 0.0
    stale: bool = False
    """Redis may hold for this process what it no longer does (a sync failed, or Redis was
    lost): the next sync must tell it, even when the lease now holds nothing."""

    def fit(self, ask: Ask) -> None:
        """Know the ask's slot limit and buckets (the policy may have changed them)."""
        if ask.slot_limit is not None:
            if self.slots is None:
                self.slots = SlotLease(ask.slot_limit)
            self.slots.limit = ask.slot_limit
        for take in ask.takes:
            self.bucket(take.bucket)

    def bucket(self, bucket: Bucket) -> BucketLease:
        lease = self.buckets.get(bucket.name)
        if lease is None:
            lease = self.buckets[bucket.name] = BucketLease(bucket)
        lease.bucket = bucket
        return lease

    def valid(self, now: float) -> bool:
        return now < self.valid_until

    def shortfall(self, ask: Ask, now: float, busy: int) -> dict[str, float]:
        """What the ask lacks locally, per section (``"slot"`` or a bucket name); ``busy``: the
        scope's slots running outside the lease (the fallback's, since Redis counts them)."""
        valid = self.valid(now)
        lacking: dict[str, float] = {}
        if ask.slot_limit is not None and self.slots is not None:
            free = self.slots.held - self.slots.in_use - busy if valid else 0
            if free < 1:
                lacking["slot"] = 1
        for take in ask.takes:
            have = self.buckets[take.bucket.name].unspent if valid else 0.0
            if have < take.amount:
                lacking[take.bucket.name] = take.amount - max(0.0, have)
        return lacking

    def take(self, ask: Ask, now: float) -> LimitVerdict:
        """Spend the ask from the lease (the caller checked ``shortfall`` is empty)."""
        self.last_used = now
        if ask.slot_limit is not None and self.slots is not None:
            self.slots.in_use += 1
            self.slots.peak = max(self.slots.peak, self.slots.in_use)
        results = []
        for take in ask.takes:
            lease = self.buckets[take.bucket.name]
            before = lease.estimate(now) + lease.unspent
            lease.spend(take.amount)
            b = take.bucket
            results.append(BucketResult.of(before, take.amount, b.capacity, b.refill_per_s, True))
        slot_at: SlotAt | None = "store" if ask.slot_limit is not None else None
        return LimitVerdict(True, None, tuple(results), slot_at=slot_at)

    def refusal(self, ask: Ask, reply: Reply, sent: Sent, now: float) -> LimitVerdict:
        """The verdict of an ask that Redis refused (or that its answer did not cover)."""
        names = [b.name for b in sent.buckets]
        refused_by = "slot" if reply.refused == 1 else names[reply.refused - 2] if reply.refused else None
        results = []
        for take in ask.takes:
            lease = self.buckets[take.bucket.name]
            level = lease.estimate(now) + max(0.0, lease.unspent)
            b = take.bucket
            results.append(BucketResult.of(level, take.amount, b.capacity, b.refill_per_s, False))
            if refused_by is None and level < take.amount:
                refused_by = take.bucket.name
        return LimitVerdict(False, refused_by or "slot", tuple(results))

    def release(self) -> None:
        if self.slots is not None and self.slots.in_use > 0:
            self.slots.in_use -= 1

    def exact_return_due(self, busy: int) -> bool:
        """A small limit's lease holds something back that another process may be waiting for."""
        if self.slots is not None and self.slots.spare_cap == 0 and self.slots.held > self.slots.in_use + busy:
            return True
        return any(b.cap == 0 and (b.unspent > 0 or b.adjust > 0) for b in self.buckets.values())

    def pending(self) -> bool:
        """Anything that Redis must hear of, or keep renewed."""
        if self.stale:
            return True
        if self.slots is not None and (self.slots.held or self.slots.in_use):
            return True
        return any(b.unspent or b.spent or b.adjust for b in self.buckets.values())

    def due(self, now: float, busy: int, renew_before: float) -> bool:
        """The keeper should sync this scope now: below the watermark, over twice the target,
        owing a small limit's return, or the lease lapsing before ``renew_before``."""
        if not self.pending():
            return False
        if self.valid_until < renew_before or self.exact_return_due(busy):
            return True
        wanted = now < self.wanted_until
        for b in self.buckets.values():
            b.sample(now)
            target = 0.0 if wanted else b.aim()
            if b.unspent > 2 * target + 1 or (b.unspent < target / 2 and b.estimate(now) >= 1):
                return True
        if self.slots is not None:
            keep, want = self._slot_plan(now, busy)
            if keep < self.slots.held or want > 0:
                return True
        return False

    def _slot_plan(self, now: float, busy: int) -> tuple[int, int]:
        """(slots to keep, slots to ask for) by the keeper: the recent peak plus the spare."""
        s = self.slots
        assert s is not None
        if now - s.peak_since >= LEASE_S:
            s.last_peak, s.peak, s.peak_since = s.peak, s.in_use + busy, now
        running = s.in_use + busy
        wanted = now < self.wanted_until
        recent = now - self.last_used < LEASE_S
        spare = 0 if wanted or not recent else s.spare_cap
        desired = running if s.spare_cap == 0 or wanted else min(s.limit, max(running, s.peak, s.last_peak) + spare)
        keep = max(running, min(s.held, desired))
        want = max(0, desired - max(s.held, running)) if spare > 0 and s.held - running < spare / 2 else 0
        return keep, want

    def prepare(self, now: float, busy: int, needs: dict[str, float] | None = None) -> Sent:
        """The sync to send now, with the lease already reduced to what it keeps; ``needs``: an
        admission's shortfall (all or nothing), None for the keeper (watermark top-up)."""
        wanted = now < self.wanted_until
        slots: SentSlots | None = None
        if self.slots is not None:
            s = self.slots
            running = s.in_use + busy
            if needs is not None:
                need = int(needs.get("slot", 0))
                spare = 0 if wanted or need == 0 else s.spare_cap
                keep, want = s.held, spare
            else:
                need = 0
                keep, want = self._slot_plan(now, busy)
            slots = SentSlots(s.limit, running, s.held, keep, need, want)
            s.held = keep
        sent: list[SentBucket] = []
        for name, b in self.buckets.items():
            b.sample(now)
            target = 0.0 if wanted else b.aim()
            need_b = needs.get(name, 0.0) if needs is not None else 0.0
            unspent = max(0.0, b.unspent)
            if need_b > 0:
                b.boost = 0.0 if wanted else min(b.cap, max(b.target(), 2 * b.boost, math.ceil(need_b)))
                keep_b, want_b = unspent, b.boost
                need_b = math.ceil(need_b)
            elif needs is not None:  # an admission's sync never gives back what the ask may take
                keep_b = unspent
                want_b = max(0.0, b.boost - unspent) if unspent < b.boost / 2 and not wanted else 0.0
            else:
                b.boost = max(b.target(), b.boost / 2)
                keep_b = min(unspent, 2 * target + 1) if not wanted else 0.0
                if b.cap == 0:
                    keep_b = 0.0
                want_b = max(0.0, target - keep_b)  # syncing anyway: every bucket back to its aim at once
            sent.append(SentBucket(name, b.bucket, b.spent, b.spent + unspent, keep_b, b.adjust, need_b, want_b))
            b.unspent = keep_b
            b.spent = 0.0
            b.adjust = 0.0
        return Sent(self.scope, now, slots, tuple(sent))

    def applied(self, sent: Sent, reply: Reply, now: float, ttl_s: float, busy: int) -> None:
        """Redis answered ``sent``: hold what it says this process holds, less what was spent
        from the lease while the answer was on its way."""
        self.valid_until = sent.at + ttl_s
        self.stale = False
        if reply.wanted:
            self.wanted_until = now + WANTED_S
        if self.slots is not None and sent.slots is not None:
            self.slots.held = max(reply.slots_held, self.slots.in_use + busy)
        for (held, level), s in zip(reply.buckets, sent.buckets, strict=True):
            b = self.buckets[s.name]
            spent_meanwhile = b.spent
            b.unspent = max(0.0, held - spent_meanwhile)
            b.level, b.level_at = level, now

    def failed(self, sent: Sent, busy: int) -> None:
        """The sync's answer never came: what it reported spent, or charged, is reported again;
        what it gave back is taken as gone (module docstring)."""
        self.stale = True
        if self.slots is not None:
            self.slots.held = max(self.slots.held, self.slots.in_use + busy)
        for s in sent.buckets:
            b = self.buckets.get(s.name)
            if b is not None:
                b.spent += s.spent
                b.adjust += min(0.0, s.adjust)

    def lost(self) -> None:
        """Redis is lost: the lease is not spent while it is (the fallback decides), and what
        it held spare is given back by the first sync after."""
        self.valid_until = -math.inf
        self.stale = True
        for b in self.buckets.values():
            b.unspent = 0.0
        if self.slots is not None:
            self.slots.held = self.slots.in_use

    def idle(self, now: float, after_s: float) -> bool:
        return not self.pending() and now - self.last_used > after_s and not self.lock.locked()
