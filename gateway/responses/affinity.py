"""Where a stored response lives: a follow-up that names it goes to the backend that holds it.

The Responses API keeps state on the engine: ``previous_response_id`` (and ``store``) name a
response that one engine holds in its memory (vLLM's response store), so a follow-up must reach
that engine and no other. Each answer of an API that keeps state (``Dialect.keeps_state``) is
remembered here as ``(tenant, backend, model)`` under its id; a follow-up is pinned to that
backend and model (``InferenceRequest.pinned_backend``).

**Each tenant has its own map.** A lookup names its tenant and looks in that tenant's map only,
so an id another tenant created is simply absent there: it takes the very path of an unknown id
(the same lookups, the same Redis command) and is answered the same way (404
``previous_response_not_found``, the same message). A tenant can neither use another's
responses nor learn that an id exists, not even from the time the answer takes.

**Bounded per tenant, then in all.** In the process each tenant's map is a least-recently-used
map of at most ``per_tenant`` entries (``Settings.responses_per_tenant``): a tenant that creates
more loses its own oldest, never another's. The maps together hold at most ``max_entries``;
past it the tenant holding the most loses its oldest (the one adding, when it holds more than
its fair share: no scan on a flood's path), so a tenant within its share is never evicted by
others. Entries expire ``ttl_s`` after they are created.

**Sealed ids, when the replicas share a secret** (``cache_isolation.secret_env``): the id the
client gets carries its holder, authenticated and bound to its tenant (``gateway/responses/ids.py``),
so nothing is stored, written or looked up, and every replica reads it back; what follows about
maps and Redis is for ids that are not sealed (no secret, or issued before it was set).

**Redis** (``state.backend: redis``): every replica also writes each entry there and looks
there when it does not know an id, so a follow-up may come through any replica
(``gateway/responses/sharing.py``: one round trip per lookup, timed as Redis's, and a write that
failed retried in the background until it lands). When Redis, not the id, fails a lookup (down,
or slower than its budget), the follow-up is a 503 ``response_lookup_unavailable`` with
``Retry-After``: retry it, the conversation is not lost; never the 404 that says to start
again, nor a guess. When the holding backend is down the follow-up is a 503
``no_healthy_backend`` (the state may come back with it), once the policy no longer has it a
404; when it answers that it lost the response, the entry is forgotten.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.clock import Clock
from gateway.errors import Overloaded
from gateway.responses.ids import Named, ResponseIds
from gateway.responses.sharing import Entry, SharedResponses, SharedUnavailable
from gateway.shared.connect import RedisClient

PER_TENANT = 10_000
"""The default bound per tenant (``Settings.responses_per_tenant``)."""
MAX_ENTRIES = 100_000
"""The bound of the process's maps together: about 30 MB."""
LOOKUP_RETRY_AFTER_S = 1.0
"""The ``Retry-After`` of a follow-up whose lookup Redis failed: about one ping of the store."""


@dataclass(frozen=True, slots=True)
class Holder:
    """Who created a stored response, and where it lives."""

    tenant: str
    backend: str
    model: str
    expires_at: float
    upstream_id: str = ""
    """The id its engine knows it by, when the client's is sealed (``gateway/responses/ids.py``)."""


class ResponseAffinity:
    """Response id to its holder, per tenant (module docstring); ``shared`` adds Redis to the
    process's maps. ``ResponseAffinity(clock, per_tenant=10_000, shared=redis_client)``."""

    def __init__(
        self,
        clock: Clock,
        *,
        per_tenant: int = PER_TENANT,
        max_entries: int = MAX_ENTRIES,
        ttl_s: float = 3600.0,
        shared: RedisClient | None = None,
        key_prefix: str = "gw:",
        timeout_s: float = 0.05,
        ids: ResponseIds | None = None,
        owns_client: bool = False,
    ) -> None:
        self.clock = clock
        self.ids = ids
        self.per_tenant = per_tenant
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.shared = shared
        self.sharing = (
            None
            if shared is None
            else SharedResponses(
                shared,
                clock,
                key_prefix=key_prefix,
                per_tenant=per_tenant,
                timeout_s=timeout_s,
                owns_client=owns_client,
            )
        )
        self._tenants: dict[str, OrderedDict[str, Holder]] = {}
        self._count = 0
        self._writes: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return self._count

    def held_by(self, tenant: str) -> int:
        """How many entries the process holds for ``tenant``."""
        return len(self._tenants.get(tenant, ()))

    def remember(self, response_id: str, tenant: str, backend: str, model: str) -> str:
        """The id the client is to see for the engine's ``response_id``: sealed, when there are
        ``ids`` (nothing to record); else itself, recorded at once in the process, and in Redis in
        the background (started as soon as the id is seen, so it is shared before the answer ends)."""
        if self.ids is not None:
            return self.ids.seal(response_id, tenant, model, backend)
        expires_at = self.clock.now() + self.ttl_s
        self._keep(tenant, response_id, Holder(tenant, backend, model, expires_at))
        if self.sharing is not None:
            self._background(self.sharing.publish(Entry(tenant, response_id, backend, model, expires_at)))
        return response_id

    def forget(self, response_id: str, tenant: str) -> None:
        """Drop an entry whose backend no longer holds the response (it said so). With sealed ids
        nothing is recorded (an id from before the secret stays until it expires): a follow-up
        reaches the engine, which says so again, and no Redis write is spent on it."""
        if self.ids is not None:
            return
        held = self._tenants.get(tenant)
        if held is not None and held.pop(response_id, None) is not None:
            self._count -= 1
            if not held:
                del self._tenants[tenant]
        if self.sharing is not None:
            self.sharing.forget(response_id, tenant)
            self._background(self.sharing.unpublish(response_id, tenant))

    async def shared_now(self) -> None:
        """Wait until every entry remembered so far was written to Redis once (or failed to be,
        then retried in the background): a whole answer is sent only then, so its follow-up may
        come through any replica at once."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def holder(
        self, response_id: str, tenant: str, served: Mapping[str, Sequence[Named]] | None = None
    ) -> Holder | None:
        """The holder of ``response_id`` if ``tenant`` created it and it has not expired; else None,
        by the same path for an id of another tenant as for an unknown one. ``Overloaded`` (503
        ``response_lookup_unavailable``) when the answer was Redis's to give and it gave none.
        ``served`` (model → its backends, the policy's) finds a sealed id's holder."""
        if self.ids is not None and self.ids.sealed(response_id):
            opened = self.ids.open(response_id, tenant, served or {})
            if opened is None:
                return None
            expires_at = self.clock.now() + opened.left_s
            return Holder(tenant, opened.backend, opened.model, expires_at, upstream_id=opened.upstream_id)
        own = self._tenants.get(tenant)
        held = own.get(response_id) if own is not None else None
        if held is None and self.sharing is not None:
            held = await self._lookup(response_id, tenant)
        if held is None:
            return None
        if held.expires_at <= self.clock.now():
            self.forget(response_id, tenant)
            return None
        self._keep(tenant, response_id, held)  # the most recent now; kept here, if Redis had it
        return held

    async def aclose(self) -> None:
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        if self.sharing is not None:
            await self.sharing.aclose()

    # The process's maps

    def _keep(self, tenant: str, response_id: str, held: Holder) -> None:
        own = self._tenants.get(tenant)
        if own is None:
            own = self._tenants[tenant] = OrderedDict()
        if response_id not in own:
            self._count += 1
        own[response_id] = held
        own.move_to_end(response_id)
        if len(own) > self.per_tenant:
            own.popitem(last=False)
            self._count -= 1
        if self._count > self.max_entries:
            over_share = len(own) > 1 and len(own) * len(self._tenants) > self.max_entries
            self._evict_one(tenant if over_share else self._largest())

    def _largest(self) -> str:
        return max(self._tenants, key=lambda name: len(self._tenants[name]))

    def _evict_one(self, tenant: str) -> None:
        """The oldest entry of ``tenant`` goes (it holds more than its fair share)."""
        own = self._tenants[tenant]
        own.popitem(last=False)
        self._count -= 1
        if not own:
            del self._tenants[tenant]

    # Redis

    def _background(self, write: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(write)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _lookup(self, response_id: str, tenant: str) -> Holder | None:
        assert self.sharing is not None
        try:
            found = await self.sharing.lookup(response_id, tenant)
        except SharedUnavailable:
            raise Overloaded(
                "Where the previous response lives could not be read from the gateway's shared store "
                "just now; retry (the conversation is not lost).",
                status=503,
                code="response_lookup_unavailable",
                retry_after_s=LOOKUP_RETRY_AFTER_S,
            ) from None
        if found is None:
            return None
        return Holder(tenant, found.backend, found.model, self.clock.now() + found.left_s)
