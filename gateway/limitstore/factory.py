"""Builds the ``LimitStore`` the policy's ``state`` section asks for.

Kept apart from the stores so that ``memory.py`` and ``redis.py`` know nothing of the policy
model, and the gateway asks for a store in one call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gateway.clock import Clock
from gateway.limitstore.memory import MemoryLimitStore
from gateway.limitstore.outage import Processes
from gateway.limitstore.redis import RedisConfig, RedisLimitStore
from gateway.policy.model import StatePolicy
from gateway.shared.store import SharedStore


def _ignore(operation: str) -> None:
    return None


def _never_counted() -> int:
    return 0


def redis_config(
    state: StatePolicy, env: Mapping[str, str] | None = None, *, processes_when_unknown: int | None = None
) -> RedisConfig:
    """The Redis settings of ``state``; refuses a Redis backend with no URL anywhere."""
    url = state.resolved_url(env)
    if url is None:
        raise ValueError(f"state.backend is redis but neither state.redis_url nor ${state.url_env} is set")
    return RedisConfig(
        url=url,
        key_prefix=state.key_prefix,
        timeout_s=state.timeout_ms / 1000,
        request_budget_s=state.request_budget_ms / 1000,
        ping_interval_s=state.ping_interval_s,
        lease_ttl_s=state.lease_ttl_s,
        on_store_loss=state.on_store_loss,
        processes_when_unknown=processes_when_unknown,
    )


def build_limit_store(
    state: StatePolicy,
    clock: Clock,
    *,
    on_error: Callable[[str], None] = _ignore,
    on_fallback: Callable[[str], None] = _ignore,
    processes: Processes = _never_counted,
    processes_when_unknown: int | None = None,
    shared: SharedStore | None = None,
) -> MemoryLimitStore | RedisLimitStore:
    """``MemoryLimitStore(clock)`` by default; a ``RedisLimitStore`` (on Redis's clock) for ``redis``.

    ``processes`` counts the live gateway processes (the fleet coordinator's last count, 0 when
    it has none) and ``processes_when_unknown`` stands in when it has none
    (``fleet.processes_when_unknown``): what ``state.on_store_loss: share`` divides limits by.
    ``shared``: the process's shared store (``gateway/shared/store.py``), whose client the limit
    store uses; without one, the limit store opens a store of its own (tests, benches)."""
    if state.backend == "memory":
        return MemoryLimitStore(clock)
    config = redis_config(state, processes_when_unknown=processes_when_unknown)
    return RedisLimitStore(config, on_error=on_error, on_fallback=on_fallback, processes=processes, shared=shared)
