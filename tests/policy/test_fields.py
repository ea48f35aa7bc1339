"""The valid keys of each policy section, found from ``Policy`` through models, lists and dicts, and the
message for a key none of them is."""

from __future__ import annotations

import pytest

from gateway.policy.fields import section_keys, unknown_key_message
from gateway.policy.model import Policy


@pytest.mark.parametrize(
    ("loc", "keys"),
    [
        pytest.param(["tenants", 0, "limits"], ["rpm", "tpm", "max_concurrent"], id="a list item's section"),
        pytest.param(["classes", "batch", "slo"], ["ttft_ms", "itl_ms", "e2e_ms", "objective"], id="a dict value"),
        pytest.param(["model_groups", 0, "targets", 3], ["model", "weight"], id="a tuple item of a group"),
        pytest.param(
            ["model_groups", 0, "rollout", "test"], ["alpha", "relative_risk", "slow_quantile"], id="optional"
        ),
        pytest.param(["models", 0, "routing", "weights"], [], id="a dict of free keys has none"),
        pytest.param(["tenants", 0, "name"], [], id="a scalar has none"),
        pytest.param(["nowhere"], [], id="a section that does not exist has none"),
    ],
)
def test_the_valid_keys_of_a_section(loc: list[str | int], keys: list[str]) -> None:
    assert section_keys(Policy, loc) == keys


@pytest.mark.parametrize(
    ("loc", "message"),
    [
        pytest.param(["tenants", 0, "limts"], "unknown key; did you mean 'limits'?", id="a typo gets its key"),
        pytest.param(["tenant"], "unknown key; did you mean 'tenants'?", id="a singular gets the section"),
        pytest.param(["tenants", 0, "limits", "burst"], "unknown key (valid keys: rpm, tpm, max_concurrent)", id="few"),
        pytest.param(["colour"], "unknown key", id="many valid keys, none close: no list"),
    ],
)
def test_an_unknown_key_is_told_the_closest_valid_one(loc: list[str | int], message: str) -> None:
    assert unknown_key_message(Policy, loc) == message
