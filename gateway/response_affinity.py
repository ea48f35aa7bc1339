"""Where a stored response lives: a follow-up that names it goes to the backend that holds it.

The Responses API keeps state on the engine: ``previous_response_id`` (and ``store``) name a
response that one engine holds in its memory (vLLM's response store), so a follow-up must reach
that engine and no other. Each answer of an API that keeps state (``Dialect.keeps_state``) is
remembered here as ``(tenant, backend, model)`` under its id; a follow-up is pinned to that
backend and model (``InferenceRequest.pinned_backend``).

The map is tenant-scoped: a lookup names its tenant, and an id another tenant's request
created is answered exactly as an unknown id (404 ``previous_response_not_found``, the same
message), so a tenant can neither use nor probe another's responses. It is bounded
(``max_entries``, least recently used first out) and entries expire after ``ttl_s``; a
response the gateway does not know (expired here, created through another replica without a
shared store, or never stored) is a 404 rather than a guess. When the holding backend is down
or was removed, the follow-up cannot be answered: 503 ``no_healthy_backend`` while it is down
(the state may come back with it), 404 once the policy no longer has it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gateway.clock import Clock


@dataclass(frozen=True, slots=True)
class Holder:
    """Who created a stored response, and where it lives."""

    tenant: str
    backend: str
    model: str
    expires_at: float


class ResponseAffinity:
    """Response id to its holder (module docstring)."""

    def __init__(self, clock: Clock, *, max_entries: int = 100_000, ttl_s: float = 3600.0) -> None:
        self.clock = clock
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._holders: OrderedDict[str, Holder] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def remember(self, response_id: str, tenant: str, backend: str, model: str) -> None:
        holders = self._holders
        holders[response_id] = Holder(tenant, backend, model, self.clock.now() + self.ttl_s)
        holders.move_to_end(response_id)
        while len(holders) > self.max_entries:
            holders.popitem(last=False)

    def holder(self, response_id: str, tenant: str) -> Holder | None:
        """The holder of ``response_id`` if ``tenant`` created it and it has not expired; else None."""
        held = self._holders.get(response_id)
        if held is None or held.tenant != tenant:
            return None
        if held.expires_at <= self.clock.now():
            del self._holders[response_id]
            return None
        self._holders.move_to_end(response_id)
        return held
