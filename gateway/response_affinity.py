"""Where a stored response lives: a follow-up that names it goes to the backend that holds it.

The Responses API keeps state on the engine: ``previous_response_id`` (and ``store``) name a
response that one engine holds in its memory (vLLM's response store), so a follow-up must reach
that engine and no other. Each answer of an API that keeps state (``Dialect.keeps_state``) is
remembered here as ``(tenant, backend, model)`` under its id; a follow-up is pinned to that
backend and model (``InferenceRequest.pinned_backend``).

The map is tenant-scoped: a lookup names its tenant, and an id another tenant's request
created is answered exactly as an unknown id (404 ``previous_response_not_found``, the same
message), so a tenant can neither use nor probe another's responses. In the process it is
bounded (``max_entries``, least recently used first out) and entries expire after ``ttl_s``.
With ``state.backend: redis`` every replica also writes each entry to Redis (under a hash of
the id, with the same expiry) and looks there when it does not know an id, so a follow-up may
come through any replica; when Redis is unreachable a replica answers from what it knows
(a follow-up through another replica is then a 404, never a guess). When the holding backend
is down the follow-up is a 503 ``no_healthy_backend`` (the state may come back with it), once
the policy no longer has it a 404.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.clock import Clock

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Holder:
    """Who created a stored response, and where it lives."""

    tenant: str
    backend: str
    model: str
    expires_at: float


class ResponseAffinity:
    """Response id to its holder (module docstring); ``shared`` adds Redis to the process's map."""

    def __init__(
        self,
        clock: Clock,
        *,
        max_entries: int = 100_000,
        ttl_s: float = 3600.0,
        shared: aioredis.Redis | None = None,
        key_prefix: str = "gw:",
        timeout_s: float = 0.05,
    ) -> None:
        self.clock = clock
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.shared = shared
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self._holders: OrderedDict[str, Holder] = OrderedDict()
        self._writes: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._holders)

    def remember(self, response_id: str, tenant: str, backend: str, model: str) -> None:
        """Record where ``response_id`` lives: at once in the process, in Redis in the background
        (started as soon as the id is seen, so it is shared before the answer ends)."""
        holders = self._holders
        holders[response_id] = Holder(tenant, backend, model, self.clock.now() + self.ttl_s)
        holders.move_to_end(response_id)
        while len(holders) > self.max_entries:
            holders.popitem(last=False)
        if self.shared is not None:
            task = asyncio.get_running_loop().create_task(self._publish(response_id, tenant, backend, model))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def shared_now(self) -> None:
        """Wait until every entry remembered so far is in Redis (or failed to be): a whole answer
        is sent only then, so its follow-up may come through any replica at once."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def holder(self, response_id: str, tenant: str) -> Holder | None:
        """The holder of ``response_id`` if ``tenant`` created it and it has not expired; else None."""
        held = self._holders.get(response_id)
        if held is None and self.shared is not None:
            held = await self._lookup(response_id)
        if held is None or held.tenant != tenant:
            return None
        if held.expires_at <= self.clock.now():
            self._holders.pop(response_id, None)
            return None
        self._holders[response_id] = held
        self._holders.move_to_end(response_id)
        return held

    async def aclose(self) -> None:
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        if self.shared is not None:
            await self.shared.aclose()

    def _key(self, response_id: str) -> str:
        # A hash, not the id: the keyspace never holds an id a tenant could present.
        return f"{self.key_prefix}responses:{hashlib.sha256(response_id.encode()).hexdigest()}"

    async def _publish(self, response_id: str, tenant: str, backend: str, model: str) -> None:
        assert self.shared is not None
        value = orjson.dumps({"tenant": tenant, "backend": backend, "model": model})
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.shared.set(self._key(response_id), value, px=int(self.ttl_s * 1000))
        except (RedisError, OSError, TimeoutError) as error:
            log.warning("response affinity: could not share response %s... (%s)", response_id[:12], error)

    async def _lookup(self, response_id: str) -> Holder | None:
        assert self.shared is not None
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self.shared.get(self._key(response_id))
                ttl_ms = await self.shared.pttl(self._key(response_id)) if raw is not None else -2
        except (RedisError, OSError, TimeoutError) as error:
            log.warning("response affinity: Redis lookup failed (%s); answering from this process's map", error)
            return None
        if raw is None:
            return None
        try:
            entry = orjson.loads(raw)
            left_s = ttl_ms / 1000 if ttl_ms > 0 else self.ttl_s
            return Holder(str(entry["tenant"]), str(entry["backend"]), str(entry["model"]), self.clock.now() + left_s)
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None
