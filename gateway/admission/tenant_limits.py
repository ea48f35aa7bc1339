"""Per-tenant admission: the request's priority class, then its rate limits.

Limits are checked in the order that wastes least: concurrency slot, requests per minute,
tokens per minute, all in one atomic store call (``LimitStore.admit``: with Redis, spent from
this process's lease of the tenant's budget, ``gateway/limitstore/lease.py``). Each
rate is a token bucket refilled continuously (capacity = the per-minute limit, refill = limit
/ 60 per second), so a tenant can burst up to its minute's allowance and then proceeds at its
rate.

**Tokens: reserved, then settled with what was really used.** At admission a request reserves
its prompt (estimated) plus its output bound times ``n``. At its end ``settle`` moves the bucket
to the real usage in one store call: the unused part comes back, and a usage *above* the
reservation is charged even when the bucket does not hold it (it goes negative, down to
``-tpm``), so a tenant whose estimates were low waits until the refill pays its debt instead of
finding its bucket full. What "really used" is, when the backend gave no usage, is
``charged_tokens``: a request that never reached a backend gives everything back, its request
included; a stream cut short pays its prompt and the output chunks it was sent.

**Refused requests pay too.** A request that authenticated but was refused before admission
(invalid body, unknown model, ...) costs the gateway CPU, so ``charge_rejected`` takes it from
the tenant's requests per minute. A tenant known to be out of requests is refused by
``precheck`` before its body is read, from what this replica learnt at its last refusal (no
store call): a stream of invalid bodies cannot outrun its rate limit.

**A concurrency refusal is remembered, not charged.** After the store refused a tenant's
slot, ``precheck`` refuses that tenant's next requests before their body is read or the store
is asked, until this process releases a slot of that tenant or ``SLOT_REFUSAL_MEMORY_S``
passes (a slot freed on another replica is seen that late at most). So a tenant hammering
at its concurrency limit costs each process a header parse per request and the store at most
one call per tenant every ``SLOT_REFUSAL_MEMORY_S``, instead of a body read and a store call
each. Charging the refusal to rpm instead was rejected: a client that fills its slots and
honours ``Retry-After`` (a batch job) would spend its rate limit for doing nothing wrong,
while the memory already makes a hammering client's refusals nearly free.

**Store latency is bounded per request**: admission and settlement share the store's
``request_budget_s``, counted in the event loop's free time (``gateway/limitstore/redis.py``:
past it the store answers from its fallback). While the store cannot enforce the limits at all
(``state.on_store_loss: closed``), a limited tenant is refused with 503 ``limits_unavailable``.

Every response carries OpenAI's ``x-ratelimit-*`` headers for the limits the tenant has, and
a refusal is a 429 whose ``Retry-After`` is the time until the bucket holds enough again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.clock import Clock, MonotonicClock
from gateway.errors import InvalidRequest, Overloaded
from gateway.limitstore.base import (
    UNAVAILABLE,
    Adjust,
    Ask,
    Bucket,
    BucketResult,
    LimitStore,
    LimitVerdict,
    Settlement,
    SlotAt,
    Take,
)
from gateway.policy.model import PriorityClass, Tenant
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.field_limits import choices
from gateway.types import InferenceRequest

Headers = list[tuple[bytes, bytes]]

REQUESTS, TOKENS = "rpm", "tpm"
SLOT_REFUSAL_MEMORY_S = 0.1
"""How long a concurrency refusal refuses the tenant's next requests before their body (module docstring)."""
SLOT_RETRY_AFTER_S = 1.0
"""The Retry-After of a concurrency refusal: when a slot frees is not known, a second is a fair guess."""


def resolve_class(tenant: Tenant, requested: bytes | None, snapshot: PolicySnapshot) -> tuple[str, PriorityClass]:
    """The tenant's default class, or a lower one named by ``x-priority`` (never a higher one)."""
    default = snapshot.priority_class(tenant.default_class)
    if not requested:
        return tenant.default_class, default
    name = requested.decode(errors="replace").strip()
    chosen = snapshot.policy.classes.get(name)
    if chosen is None:
        known = ", ".join(sorted(snapshot.policy.classes))
        raise InvalidRequest(f"x-priority '{name}' is not a priority class ({known}).", code="invalid_priority")
    if chosen.rank < default.rank:
        return tenant.default_class, default  # a client may lower its priority, never raise it
    return name, chosen


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


@dataclass(slots=True)
class Admission:
    """What one request holds against its tenant's limits until ``settle``.

    ``store_budget_s`` is what the request may still wait on the limit store."""

    tenant: Tenant
    reserved_tokens: int
    store_budget_s: float
    headers: Headers = field(default_factory=list)
    holds_slot: bool = False
    slot_at: SlotAt = "store"
    took_request: bool = False
    took_tokens: bool = False


def requests_bucket(rpm: int) -> Bucket:
    return Bucket(REQUESTS, rpm, rpm / 60)


def tokens_bucket(tpm: int) -> Bucket:
    return Bucket(TOKENS, tpm, tpm / 60)


def charged_tokens(
    *,
    usage: Mapping[str, Any] | None,
    reached_backend: bool,
    completed: bool,
    reserved: int,
    prompt_estimate: int,
    outputs_sent: int,
) -> int | None:
    """The tokens a finished request is charged, as far as they are known.

    1. The backend's usage, when it gave one (``total_tokens``, else prompt plus completion).
    2. None (everything given back, the request too) when no backend ever saw the request.
    3. The reservation, when it completed but reported no usage (a backend that never does).
    4. The prompt estimate plus the output chunks sent, when it ended early: cut by its client,
       broken off by its backend, or refused by it.
    """
    if usage:
        total = usage.get("total_tokens")
        if isinstance(total, int):
            return total
        return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
    if not reached_backend:
        return None
    if completed:
        return reserved
    return prompt_estimate + outputs_sent


class TenantLimiter:
    """Applies a tenant's ``limits`` (rpm, tpm, max_concurrent) through a ``LimitStore``."""

    def __init__(self, store: LimitStore, clock: Clock | None = None) -> None:
        self.store = store
        self._clock = clock or MonotonicClock()
        self._out_of_requests: dict[str, float] = {}  # tenant -> until when its rpm is known spent
        self._out_of_slots: dict[str, float] = {}  # tenant -> until when its slots are taken to be full

    def precheck(self, tenant: Tenant) -> None:
        """429 at once, before the body is read, while the tenant is known to be out of requests
        or (for ``SLOT_REFUSAL_MEMORY_S``) of concurrency slots.

        Known from this replica's last refusal of it (``Retry-After`` of its rpm bucket; the
        slot refusal, until this process releases one of the tenant's slots): no store call, so
        a refused tenant's requests cost nearly nothing. Conservative only by a request refunded
        meanwhile (one the system refused after admitting it), or a slot freed on another replica."""
        self._slots_precheck(tenant)
        until = self._out_of_requests.get(tenant.name)
        if until is None:
            return
        wait = until - self._clock.now()
        if wait <= 0:
            del self._out_of_requests[tenant.name]
            return
        rpm = tenant.limits.rpm
        raise Overloaded(
            f"Tenant '{tenant.name}' is over its limit of {rpm} requests per minute.",
            status=429,
            code="tenant_rate_limited",
            retry_after_s=wait,
        )

    def _slots_precheck(self, tenant: Tenant) -> None:
        until = self._out_of_slots.get(tenant.name)
        if until is None:
            return
        if until <= self._clock.now():
            del self._out_of_slots[tenant.name]
            return
        raise self._slots_full(tenant)

    @staticmethod
    def _slots_full(tenant: Tenant) -> Overloaded:
        return Overloaded(
            f"Tenant '{tenant.name}' already has {tenant.limits.max_concurrent} requests in flight, "
            "its concurrency limit.",
            status=429,
            code="tenant_concurrency_limited",
            retry_after_s=SLOT_RETRY_AFTER_S,
        )

    async def admit(self, tenant: Tenant, request: InferenceRequest) -> Admission:
        """Reserve the request against every limit of ``tenant`` at once; 429 naming the first that refuses."""
        limits = tenant.limits
        reserved = request.prompt_tokens + request.max_tokens * choices(request.body)
        admission = Admission(tenant, reserved, self.store.request_budget_s)
        if limits.tpm is not None and reserved > limits.tpm:
            raise self._larger_than_a_minute(tenant.name, reserved, limits.tpm)
        takes: list[Take] = []
        if limits.rpm is not None:
            takes.append(Take(requests_bucket(limits.rpm), 1))
        if limits.tpm is not None:
            takes.append(Take(tokens_bucket(limits.tpm), reserved))
        if limits.max_concurrent is None and not takes:
            return admission
        ask = Ask(scope=tenant.name, slot_limit=limits.max_concurrent, takes=tuple(takes))
        verdict = await self.store.admit(ask, timeout_s=admission.store_budget_s)
        admission.store_budget_s -= verdict.waited_s
        if verdict.refused_by == UNAVAILABLE:
            raise self._unavailable(tenant, verdict.retry_after_s)
        for take, result in zip(takes, verdict.buckets, strict=True):
            kind = "requests" if take.bucket.name == REQUESTS else "tokens"
            self._headers(admission.headers, kind, int(take.bucket.capacity), result)
        if not verdict.admitted:
            results = dict(zip((take.bucket.name for take in takes), verdict.buckets, strict=True))
            refusal = self._refusal(tenant, verdict, results, reserved)
            refusal.headers.update((k.decode(), v.decode()) for k, v in admission.headers)
            raise refusal
        admission.holds_slot = limits.max_concurrent is not None
        admission.slot_at = verdict.slot_at or "store"
        admission.took_request = limits.rpm is not None
        admission.took_tokens = limits.tpm is not None
        return admission

    @staticmethod
    def _unavailable(tenant: Tenant, retry_after_s: float) -> Overloaded:
        return Overloaded(
            f"Tenant '{tenant.name}' has limits that cannot be enforced now: the gateway's limit store is "
            "unreachable. Try again shortly.",
            status=503,
            code="limits_unavailable",
            retry_after_s=retry_after_s,
        )

    def _refusal(
        self, tenant: Tenant, verdict: LimitVerdict, results: dict[str, BucketResult], reserved: int
    ) -> Overloaded:
        limits = tenant.limits
        if verdict.refused_by == "slot":
            self._out_of_slots[tenant.name] = self._clock.now() + SLOT_REFUSAL_MEMORY_S
            return self._slots_full(tenant)
        result = results[verdict.refused_by or ""]
        if verdict.refused_by == REQUESTS:
            self._out_of_requests[tenant.name] = self._clock.now() + result.retry_after_s
            return Overloaded(
                f"Tenant '{tenant.name}' is over its limit of {limits.rpm} requests per minute.",
                status=429,
                code="tenant_rate_limited",
                retry_after_s=result.retry_after_s,
            )
        debt = " (it used more tokens than it reserved earlier: its bucket is in debt)" if result.remaining < 0 else ""
        return Overloaded(
            f"Tenant '{tenant.name}' is over its limit of {limits.tpm} tokens per minute "
            f"(this request reserves {reserved}){debt}.",
            status=429,
            code="tenant_token_limited",
            retry_after_s=result.retry_after_s,
        )

    @staticmethod
    def _larger_than_a_minute(tenant: str, reserved: int, tpm: int) -> Overloaded:
        refusal = Overloaded(
            f"This request needs up to {reserved} tokens (prompt plus max_tokens times n); tenant '{tenant}' "
            f"may use {tpm} tokens per minute. Lower max_tokens or the prompt.",
            status=429,
            code="tenant_token_limited",
            retry_after_s=60.0,
        )
        refusal.headers["x-should-retry"] = "false"
        return refusal

    @staticmethod
    def _headers(headers: Headers, kind: str, limit: int, result: BucketResult) -> None:
        remaining = max(0, int(result.remaining))
        headers.append((f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()))
        headers.append((f"x-ratelimit-remaining-{kind}".encode(), str(remaining).encode()))
        headers.append((f"x-ratelimit-reset-{kind}".encode(), format_duration(result.reset_s).encode()))

    async def settle(self, admission: Admission, used_tokens: int | None) -> None:
        """Release the slot and move the tokens to ``used_tokens`` (None: give back everything, the request too).

        Usage above the reservation is charged (the bucket may go negative, see the module docstring)."""
        tenant, limits = admission.tenant, admission.tenant.limits
        adjusts: list[Adjust] = []
        if admission.took_tokens and limits.tpm is not None:
            give_back = admission.reserved_tokens - (used_tokens or 0)
            if give_back:
                adjusts.append(Adjust(tokens_bucket(limits.tpm), give_back))
        if used_tokens is None and admission.took_request and limits.rpm is not None:
            adjusts.append(Adjust(requests_bucket(limits.rpm), 1))
            self._out_of_requests.pop(tenant.name, None)
        settlement = Settlement(
            scope=tenant.name, release_slot=admission.holds_slot, slot_at=admission.slot_at, adjusts=tuple(adjusts)
        )
        if admission.holds_slot:
            self._out_of_slots.pop(tenant.name, None)  # a slot of the tenant frees up in this process
        admission.holds_slot = admission.took_tokens = admission.took_request = False
        if settlement.release_slot or settlement.adjusts:
            admission.store_budget_s -= await self.store.settle(settlement, timeout_s=admission.store_budget_s)

    async def charge_rejected(self, tenant: Tenant) -> None:
        """Take one request from the tenant's rpm for a request refused before admission.

        When its rpm is spent, nothing is taken (the bucket never goes negative for requests)
        but the tenant is known to be out of requests: ``precheck`` refuses its next ones."""
        rpm = tenant.limits.rpm
        if rpm is None:
            return
        bucket = requests_bucket(rpm)
        ask = Ask(scope=tenant.name, takes=(Take(bucket, 1),))
        verdict = await self.store.admit(ask, timeout_s=self.store.request_budget_s)
        if not verdict.admitted and verdict.refused_by != UNAVAILABLE:
            self._out_of_requests[tenant.name] = self._clock.now() + verdict.buckets[0].retry_after_s
