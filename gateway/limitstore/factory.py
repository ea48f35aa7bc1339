"""Builds the ``LimitStore`` the policy's ``state`` section asks for.

Kept apart from the stores so that ``memory.py`` and ``redis.py`` know nothing of the policy
model, and the gateway asks for a store in one call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gateway.clock import Clock
from gateway.limitstore.memory import MemoryLimitStore
from gateway.limitstore.redis import RedisConfig, RedisLimitStore
from gateway.policy.model import StatePolicy


def _ignore(operation: str) -> None:
    return None


def redis_config(state: StatePolicy, env: Mapping[str, str] | None = None) -> RedisConfig:
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
    )


def build_limit_store(
    state: StatePolicy,
    clock: Clock,
    *,
    on_error: Callable[[str], None] = _ignore,
    on_fallback: Callable[[str], None] = _ignore,
) -> MemoryLimitStore | RedisLimitStore:
    """``MemoryLimitStore(clock)`` by default; a ``RedisLimitStore`` (on Redis's clock) for ``redis``."""
    if state.backend == "memory":
        return MemoryLimitStore(clock)
    return RedisLimitStore(redis_config(state), on_error=on_error, on_fallback=on_fallback)
