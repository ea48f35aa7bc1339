"""Policy validation of the routing section, cache scopes and cache isolation, with paths."""

from __future__ import annotations

import pytest
import yaml

from gateway.policy.loader import PolicyError
from gateway.service import parse_policy
from tests.routing.conftest import MODEL, routing_policy


@pytest.mark.parametrize(
    ("routing", "extra", "problem"),
    [
        pytest.param(
            "routing: {strategy: random}",
            "",
            "models[m].routing.strategy: unknown strategy 'random' (known: least_load, prefix_affinity, "
            "round_robin, session_affinity)",
            id="an unknown strategy is refused with the known ones",
        ),
        pytest.param(
            "routing: {weights: {prefix: 1}}",
            "",
            "models[m].routing.weights.prefix: unknown scorer",
            id="an unknown scorer in the weights is refused",
        ),
        pytest.param(
            "routing: {weights: {in-flight-scorer: 0}}",
            "",
            "models[m].routing.weights: at least one weight must be greater than 0",
            id="weights that are all zero are refused",
        ),
        pytest.param(
            "routing: {epsilon: -1}",
            "",
            "models[m].routing.epsilon: must be greater than or equal to 0",
            id="a negative epsilon is refused",
        ),
        pytest.param(
            "routing: {block_tokens: 1}",
            "",
            "models[m].routing.block_tokens: must be greater than or equal to 4",
            id="a tiny block is refused",
        ),
        pytest.param(
            "routing: {index: {ttl_s: 0}}",
            "",
            "models[m].routing.index.ttl_s: must be greater than 0",
            id="a zero index ttl is refused",
        ),
        pytest.param(
            "routing: {strategy: prefix_affinity, sticky: true}",
            "",
            "models[m].routing.sticky: unknown key",
            id="an unknown routing key is refused",
        ),
        pytest.param(
            "routing: {tokenizer: llama}",
            "",
            "models[m].routing.tokenizer: must be 'estimate' or 'words'",
            id="an unknown tokenizer is refused",
        ),
        pytest.param(
            "",
            "cache_isolation: {secret_env: lower-case}",
            "cache_isolation.secret_env: must match pattern",
            id="a malformed secret variable name is refused",
        ),
    ],
)
def test_invalid_routing_policies_fail_with_their_path(routing: str, extra: str, problem: str) -> None:
    text = routing_policy(models={MODEL: yaml.safe_load(routing) or {}}, **(yaml.safe_load(extra) or {}))
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "p.yaml")
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems


def test_a_tenant_naming_an_undeclared_cache_scope_is_refused() -> None:
    text = routing_policy(tenants={"shared-a": {"cache_scope": "public-bott"}})
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "p.yaml")
    assert caught.value.problems == [
        "tenants[shared-a].cache_scope: unknown cache scope 'public-bott' (declare it under cache_scopes)"
    ]


def test_a_cache_scope_with_an_unknown_key_is_refused() -> None:
    text = routing_policy(cache_scopes={"public-bot": {"members": ["acme"]}})
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "p.yaml")
    assert caught.value.problems == ["cache_scopes.public-bot.members: unknown key (valid keys: description)"]


def test_the_routing_defaults_are_prefix_affinity_with_bounded_load() -> None:
    routing = parse_policy(routing_policy(), "p.yaml").models["m"].routing
    assert (routing.strategy, routing.block_tokens, routing.epsilon, routing.tokenizer) == (
        "prefix_affinity",
        64,
        0.25,
        "estimate",
    )
