"""The policy's ``state`` section: validated at load, and the store the gateway builds from it."""

from __future__ import annotations

import pytest
import yaml

from gateway.limitstore.factory import build_limit_store, redis_config
from gateway.limitstore.memory import MemoryLimitStore
from gateway.limitstore.redis import RedisLimitStore
from gateway.policy.loader import PolicyError
from gateway.policy.model import StatePolicy
from gateway.service import parse_policy
from tests.fake_clock import FakeClock
from tests.policy_builder import session_policy


def with_state(section: str) -> str:
    return session_policy(state=yaml.safe_load(section))


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        pytest.param("{backend: etcd}", "state.backend: must be 'memory' or 'redis'", id="an unknown backend"),
        pytest.param(
            "{backend: redis, redis_url: 'http://cache:6379'}",
            "state.redis_url: must match pattern '^(rediss?(\\+sentinel|\\+cluster)?|unix)://\\S+$'",
            id="a URL that is not redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://",
        ),
        pytest.param("{timeout_ms: 0}", "state.timeout_ms: must be greater than 0", id="a zero timeout"),
        pytest.param(
            "{request_budget_ms: 0}", "state.request_budget_ms: must be greater than 0", id="a zero request budget"
        ),
        pytest.param("{key_prefix: 'gw {x}'}", "state.key_prefix: must match pattern", id="a prefix with spaces"),
        pytest.param(
            "{ping_interval_s: 5, lease_ttl_s: 10}",
            "state: lease_ttl_s must be at least 3 x ping_interval_s",
            id="a lease that could lapse between two renewals",
        ),
        pytest.param("{backend: redis, url: 'redis://x'}", "state.url: unknown key", id="an unknown key"),
        pytest.param(
            "{on_store_loss: ignore}",
            "state.on_store_loss: must be 'share', 'open' or 'closed'",
            id="an unknown behaviour on store loss",
        ),
    ],
)
def test_a_bad_state_section_is_refused_at_load(section: str, problem: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(with_state(section), "p.yaml")
    assert problem in str(caught.value)


def test_the_state_is_in_memory_unless_the_policy_says_otherwise() -> None:
    state = parse_policy(session_policy(), "p.yaml").policy.state
    assert state.backend == "memory"
    assert state.request_budget_ms == 20
    assert isinstance(build_limit_store(state, FakeClock()), MemoryLimitStore)


async def test_a_redis_state_builds_a_redis_store_with_its_settings() -> None:
    section = (
        "{backend: redis, redis_url: 'redis://cache:6379/2', key_prefix: 'eu:', timeout_ms: 20, request_budget_ms: 8}"
    )
    state = parse_policy(with_state(section), "p.yaml").policy.state
    store = build_limit_store(state, FakeClock())
    assert isinstance(store, RedisLimitStore)
    assert (store.config.url, store.config.key_prefix, store.config.timeout_s) == ("redis://cache:6379/2", "eu:", 0.02)
    assert store.request_budget_s == store.config.request_budget_s == 0.008
    assert store.config.probe_max_s == 0.004
    await store.aclose()


async def test_each_process_enforces_its_share_of_the_limits_when_redis_is_lost_unless_told_otherwise() -> None:
    state = parse_policy(with_state("{backend: redis, redis_url: 'redis://cache:6379/0'}"), "p.yaml").policy.state
    assert state.on_store_loss == "share"
    store = build_limit_store(state, FakeClock(), processes=lambda: 3, processes_when_unknown=5)
    assert isinstance(store, RedisLimitStore)
    assert (store.config.on_store_loss, store.config.processes_when_unknown) == ("share", 5)
    assert store.fallback.lost() == 3  # the fleet's count when Redis is lost
    await store.aclose()
    closed = parse_policy(with_state("{backend: redis, redis_url: 'redis://c:6379', on_store_loss: closed}"), "p.yaml")
    assert redis_config(closed.policy.state, {}).on_store_loss == "closed"


def test_the_url_variable_replaces_the_policys_url() -> None:
    state = StatePolicy(backend="redis", redis_url="redis://127.0.0.1:6379/0")
    secret = "redis://:s3cret@redis.prod:6379/0"
    assert redis_config(state, {"GATEWAY_REDIS_URL": secret}).url == secret
    assert redis_config(state, {}).url == "redis://127.0.0.1:6379/0"
    assert "s3cret" not in repr(redis_config(state, {"GATEWAY_REDIS_URL": secret}))


def test_a_redis_state_without_any_url_is_refused_at_start_up() -> None:
    state = StatePolicy(backend="redis", url_env="NO_SUCH_REDIS_URL_VARIABLE")
    with pytest.raises(ValueError, match=r"neither state.redis_url nor \$NO_SUCH_REDIS_URL_VARIABLE is set"):
        redis_config(state, {})
