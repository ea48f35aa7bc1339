"""The policy's engine-feature bounds (``limits``) and a tenant's opt-ins: they load, or fail the load
naming the entry, never a silent default."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.policy.loader import PolicyError
from gateway.service import parse_policy
from tests.policy_builder import build_policy

SOURCE = "policy.yaml"


def test_a_tenants_opt_ins_and_the_bounds_load_as_written() -> None:
    text = build_policy(
        limits={"max_stop_sequences": 4, "max_bad_words": 8, "max_logit_bias": 16, "max_logprobs": 5},
        tenants={
            "acme": {
                "allow_builtin_tools": ["web_search_preview", "mcp", "web_search_20250305"],
                "allow_content_parts": ["image_embeds"],
            }
        },
    )
    policy = parse_policy(text, SOURCE).policy
    acme, globex = policy.tenants
    assert acme.allow_builtin_tools == {"web_search_preview", "mcp", "web_search_20250305"}
    assert acme.allow_content_parts == {"image_embeds"}
    assert (globex.allow_builtin_tools, globex.allow_content_parts) == (frozenset(), frozenset())
    limits = policy.limits
    assert (limits.max_stop_sequences, limits.max_bad_words, limits.max_logit_bias, limits.max_logprobs) == (
        4,
        8,
        16,
        5,
    )


REFUSED = [
    pytest.param(
        {"tenants": {"acme": {"allow_content_parts": ["image_url"]}}},
        "tenants[acme].allow_content_parts: 'image_url' is not a part type to opt into",
        id="a content part that is no tensor part",
    ),
    pytest.param(
        {"tenants": {"acme": {"allow_builtin_tools": ["Web Search"]}}},
        "tenants[acme].allow_builtin_tools[0]: must match pattern",
        id="a tool type that is no type name",
    ),
    pytest.param(
        {"limits": {"max_stop_sequences": 0}},
        "limits.max_stop_sequences: must be greater than 0",
        id="no stop string at all",
    ),
    pytest.param(
        {"limits": {"max_list_items": -1}}, "limits.max_list_items: must be greater than 0", id="a negative list bound"
    ),
    pytest.param(
        {"limits": {"max_logprobs": 100_000}},
        "limits.max_logprobs: must be less than or equal to 1000",
        id="logprobs beyond any vocabulary's use",
    ),
]


@pytest.mark.parametrize(("edit", "problem"), REFUSED)
def test_a_bad_bound_or_opt_in_fails_the_load_naming_it(edit: dict[str, Any], problem: str) -> None:
    with pytest.raises(PolicyError) as refused:
        parse_policy(build_policy(**edit), SOURCE)
    assert problem in str(refused.value)
