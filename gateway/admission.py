"""Per-tenant admission: the request's priority class, then its rate limits.

Limits are checked in the order that wastes least: concurrency slot, requests per minute,
tokens per minute. Each is a token bucket refilled continuously (capacity = the per-minute
limit, refill = limit / 60 per second), so a tenant can burst up to its minute's allowance
and then proceeds at its rate. Tokens are reserved at admission as prompt (estimated) plus
``max_tokens``, and settled at the end with the real usage the backend reported; a request
the system rejects later (full queue, dead backend) gives back everything it took.

Every response carries OpenAI's ``x-ratelimit-*`` headers for the limits the tenant has, and
a refusal is a 429 whose ``Retry-After`` is the time until the bucket holds enough again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.errors import InvalidRequest, Overloaded
from gateway.policy.model import PriorityClass, Tenant
from gateway.policy.snapshot import PolicySnapshot
from gateway.state.base import BucketResult, LimitStore
from gateway.types import InferenceRequest

Headers = list[tuple[bytes, bytes]]


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
    """What one request holds against its tenant's limits until ``settle``."""

    tenant: Tenant
    reserved_tokens: int
    headers: Headers = field(default_factory=list)
    holds_slot: bool = False
    took_request: bool = False
    took_tokens: bool = False


class TenantLimiter:
    """Applies a tenant's ``limits`` (rpm, tpm, max_concurrent) through a ``LimitStore``."""

    def __init__(self, store: LimitStore) -> None:
        self.store = store

    async def admit(self, tenant: Tenant, request: InferenceRequest) -> Admission:
        """Reserve the request against every limit of ``tenant``; 429 on the first that refuses."""
        limits = tenant.limits
        admission = Admission(tenant, request.prompt_tokens + request.max_tokens)
        try:
            if limits.max_concurrent is not None:
                if not await self.store.acquire_slot(f"conc:{tenant.name}", limits.max_concurrent):
                    raise Overloaded(
                        f"Tenant '{tenant.name}' already has {limits.max_concurrent} requests in flight, "
                        "its concurrency limit.",
                        status=429,
                        code="tenant_concurrency_limited",
                        retry_after_s=1.0,
                    )
                admission.holds_slot = True
            if limits.rpm is not None:
                result = await self.store.take(f"rpm:{tenant.name}", 1, limits.rpm, limits.rpm / 60)
                self._headers(admission.headers, "requests", limits.rpm, result)
                if not result.allowed:
                    raise Overloaded(
                        f"Tenant '{tenant.name}' is over its limit of {limits.rpm} requests per minute.",
                        status=429,
                        code="tenant_rate_limited",
                        retry_after_s=result.retry_after_s,
                    )
                admission.took_request = True
            if limits.tpm is not None:
                await self._take_tokens(admission, limits.tpm)
        except Overloaded as refusal:
            refusal.headers.update((k.decode(), v.decode()) for k, v in admission.headers)
            await self.settle(admission, None)
            raise
        return admission

    async def _take_tokens(self, admission: Admission, tpm: int) -> None:
        tenant, amount = admission.tenant, admission.reserved_tokens
        if amount > tpm:
            refusal = Overloaded(
                f"This request needs up to {amount} tokens (prompt plus max_tokens); tenant '{tenant.name}' "
                f"may use {tpm} tokens per minute. Lower max_tokens or the prompt.",
                status=429,
                code="tenant_token_limited",
                retry_after_s=60.0,
            )
            refusal.headers["x-should-retry"] = "false"
            raise refusal
        result = await self.store.take(f"tpm:{tenant.name}", amount, tpm, tpm / 60)
        self._headers(admission.headers, "tokens", tpm, result)
        if not result.allowed:
            raise Overloaded(
                f"Tenant '{tenant.name}' is over its limit of {tpm} tokens per minute "
                f"(this request reserves {amount}).",
                status=429,
                code="tenant_token_limited",
                retry_after_s=result.retry_after_s,
            )
        admission.took_tokens = True

    @staticmethod
    def _headers(headers: Headers, kind: str, limit: int, result: BucketResult) -> None:
        headers.append((f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()))
        headers.append((f"x-ratelimit-remaining-{kind}".encode(), str(int(result.remaining)).encode()))
        headers.append((f"x-ratelimit-reset-{kind}".encode(), format_duration(result.reset_s).encode()))

    async def settle(self, admission: Admission, used_tokens: int | None) -> None:
        """Release the slot and give back what was not used (everything when ``used_tokens`` is None)."""
        tenant, limits = admission.tenant, admission.tenant.limits
        if admission.holds_slot:
            admission.holds_slot = False
            await self.store.release_slot(f"conc:{tenant.name}")
        if admission.took_tokens and limits.tpm is not None:
            admission.took_tokens = False
            unused = admission.reserved_tokens - (used_tokens or 0)
            if used_tokens is None or unused > 0:
                refund = admission.reserved_tokens if used_tokens is None else unused
                await self.store.refund(f"tpm:{tenant.name}", refund, limits.tpm, limits.tpm / 60)
        if used_tokens is None and admission.took_request and limits.rpm is not None:
            admission.took_request = False
            await self.store.refund(f"rpm:{tenant.name}", 1, limits.rpm, limits.rpm / 60)
