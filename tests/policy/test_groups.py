"""Model groups in the policy file: what loads, what is refused and why, and what ``policy explain`` says."""

from __future__ import annotations

import random
from typing import Any

import pytest

from gateway.policy.loader import PolicyError
from gateway.policy.snapshot import PolicySnapshot
from gateway.routing.explain import explain
from gateway.routing.targets import Role, TargetPicker, lookup_public, unready_public
from gateway.service import parse_policy
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, NOWHERE, backend, build_policy, model, tenant


def policy(group: dict[str, Any] | None = None, **sections: Any) -> str:
    groups = [{"name": "pub", "targets": [{"model": "v1", "weight": 3}, {"model": "v2", "weight": 1}], **(group or {})}]
    defaults: dict[str, Any] = {
        "models": [model("v1"), model("v2"), model("big", max_prompt_tokens=8192), model("solo")],
        "backends": [
            backend("b1", NOWHERE, ["v1", "v2"], price_per_gpu_hour=2.0),
            backend("b2", NOWHERE, ["big"], price_per_gpu_hour=9.0),
            backend("b3", NOWHERE, ["solo"]),
        ],
        "model_groups": groups,
        "tenants": [tenant("acme", KEY_ACME), tenant("globex", KEY_GLOBEX, allow_costlier_fallback=False)],
    }
    return build_policy(**{**defaults, **sections})


def load(text: str) -> PolicySnapshot:
    return parse_policy(text, "p.yaml")


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as error:
        load(text)
    return error.value.problems


def test_a_group_hides_its_targets_and_lists_itself() -> None:
    snapshot = load(policy({"fallbacks": ["big"]}))
    assert sorted(snapshot.public_models) == ["pub", "solo"]
    assert snapshot.internal == {"v1", "v2", "big"}
    assert lookup_public(snapshot, "pub") is snapshot.groups["pub"]
    with pytest.raises(Exception, match="does not exist"):
        lookup_public(snapshot, "v1")


@pytest.mark.parametrize(
    ("group", "sections", "expected"),
    [
        ({"targets": [{"model": "nope"}]}, {}, "model_groups[pub].targets[0].model: unknown model 'nope'"),
        ({"fallbacks": ["ghost"]}, {}, "model_groups[pub].fallbacks[0]: unknown model 'ghost'"),
        ({"class_fallbacks": {"vip": ["big"]}}, {}, "model_groups[pub].class_fallbacks.vip: unknown class 'vip'"),
        ({"name": "solo"}, {}, "model_groups[solo].name: 'solo' is also a model under models"),
        ({"shadow": {"model": "big", "percent": 5, "scorer": "vibes"}}, {}, "shadow.scorer: unknown scorer 'vibes'"),
        ({"shadow": {"model": "v1", "percent": 5}}, {}, "shadow.model: 'v1' is a target already"),
        (
            {},
            {"tenants": [tenant("acme", KEY_ACME, models=["v1"])]},
            "tenants[acme].models[0]: 'v1' serves model group 'pub' and cannot be called by name",
        ),
    ],
)
def test_cross_checks(group: dict[str, Any], sections: dict[str, Any], expected: str) -> None:
    assert any(expected in problem for problem in problems(policy(group, **sections))), problems(
        policy(group, **sections)
    )


@pytest.mark.parametrize(
    ("rollout", "expected"),
    [
        ({"baseline": "v1", "candidate": "big"}, "rollout.candidate must be one of the targets"),
        ({"baseline": "v1", "candidate": "v2", "steps": [5, 50]}, "the last step must be 100"),
        ({"baseline": "v1", "candidate": "v2", "steps": [50, 5, 100]}, "steps must grow strictly"),
        ({"baseline": "v1", "candidate": "v1"}, "baseline and candidate must differ"),
    ],
)
def test_rollouts_are_checked(rollout: dict[str, Any], expected: str) -> None:
    assert any(expected in problem for problem in problems(policy({"rollout": rollout})))


def test_the_rollout_splits_the_pair_s_weight_and_the_chain_drops_dearer_targets_for_a_frugal_tenant() -> None:
    snapshot = load(
        policy(
            {
                "targets": [{"model": "v1", "weight": 2}, {"model": "v2", "weight": 2}, {"model": "solo", "weight": 1}],
                "fallbacks": ["big", "v1"],
                "rollout": {"baseline": "v1", "candidate": "v2", "steps": [10, 100]},
            }
        )
    )
    group = snapshot.groups["pub"]
    picker = TargetPicker(candidate_share=lambda g: 10.0, rng=random.Random(7))
    assert picker.weights(group) == pytest.approx({"v1": 3.6, "v2": 0.4, "solo": 1.0})
    unknown = TargetPicker(candidate_share=lambda g: None)
    assert unknown.weights(group)["v2"] == 0  # no state read yet: nothing to the candidate
    acme, globex = snapshot.policy.tenants
    draws = [picker.choose(snapshot, group, acme, "interactive") for _ in range(2000)]
    roles = {d.primary.name: d.role for d in draws}
    assert roles == {"v1": Role.BASELINE, "v2": Role.CANDIDATE, "solo": Role.WEIGHTED}
    assert abs(sum(d.primary.name == "v2" for d in draws) / 2000 - 0.08) < 0.025
    v1 = next(d for d in draws if d.primary.name == "v1")
    assert [t.name for t in v1.chain] == ["big"]  # the drawn target itself is not its own fallback
    globex_draws = (picker.choose(snapshot, group, globex, "interactive") for _ in range(1000))
    frugal = next(d for d in globex_draws if d.primary.name == "v2")
    assert [t.name for t in frugal.chain] == ["v1"]  # big costs 9 $/h against v2's 2 $/h


def test_readiness_is_judged_by_public_name() -> None:
    snapshot = load(policy({"fallbacks": ["big"], "shadow": {"model": "solo", "percent": 1}}))
    assert unready_public(snapshot, ["solo"]) == []  # a shadow's health is not the group's
    assert unready_public(snapshot, ["v1", "v2"]) == []  # the fallback still serves
    assert unready_public(snapshot, ["v1", "v2", "big"]) == ["pub"]


def test_explain_names_the_group_its_split_fallbacks_and_rollout() -> None:
    snapshot = load(
        policy(
            {
                "fallbacks": ["big"],
                "fallback_wait_s": 0.2,
                "shadow": {"model": "solo", "percent": 5},
                "rollout": {"baseline": "v1", "candidate": "v2", "steps": [25, 100]},
            }
        )
    )
    body = {"model": "pub", "messages": [{"role": "user", "content": "hi"}]}
    lines = explain(snapshot, KEY_GLOBEX, body, rollouts={"pub": (25.0, "progressing, candidate at 25%")})
    text = "\n".join(lines)
    assert "group:   pub -> v1 (75% of requests, baseline), v2 (25% of requests, candidate)" in text
    assert "explained on v1" in text
    assert "fallback (interactive): none (not big: costlier" in text
    assert "shadow:  5% copied to solo" in text
    assert "rollout: v1 -> v2, steps 25%, 100%: progressing, candidate at 25%" in text
    acme = "\n".join(explain(snapshot, KEY_ACME, body))
    assert "fallback (interactive): big; waits at most 0.2s for room first" in acme
    assert "v1 (100% of requests, baseline), v2 (0% of requests, candidate)" in acme  # state unknown
