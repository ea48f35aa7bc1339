"""Who reaches a backend, by every path: a tenant naming a model, a model group (its targets,
fallbacks, class fallbacks, shadow) or ``"*"``.

Each case: the probed backend serves one member of group ``grp`` (or a plain model) and nothing
else; ``acme`` names the group, ``globex`` reaches the backend by the path of the case. The
backend must then count as reached by two cache scopes: a Messages request is not passed
through to it unsalted (``multi_scope_backends``), and an unsalted engine there is refused
under ``cache_isolation.unsalted: dedicated`` and named in a warning under ``shared``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.dialects.messages import MESSAGES
from gateway.policy.loader import PolicyError
from gateway.routing.reach import policy_reach
from gateway.service import parse_policy
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, NOWHERE, backend, build_policy, model, tenant

MEMBER = "probe-model"
"""The only model the probed backend serves."""

GROUPS: dict[str, dict[str, Any]] = {
    "target": {"targets": [{"model": MEMBER}]},
    "rollout candidate": {
        "targets": [{"model": "main"}, {"model": MEMBER, "weight": 0}],
        "rollout": {"baseline": "main", "candidate": MEMBER},
    },
    "fallback": {"targets": [{"model": "main"}], "fallbacks": [MEMBER]},
    "class fallback": {"targets": [{"model": "main"}], "class_fallbacks": {"batch": [MEMBER]}},
    "shadow": {"targets": [{"model": "main"}], "shadow": {"model": MEMBER, "percent": 5}},
}


def policy(
    path: str,
    kind: str = "sim",
    *,
    globex_names: list[str] | None = None,
    probed: dict[str, Any] | None = None,
    scope: str | None = None,
    **sections: Any,
) -> str:
    """The case's policy: ``grp`` reaches ``MEMBER`` (on backend ``probed``, of ``kind``, with the
    fields ``probed``) by ``path``; acme names ``grp``, globex ``globex_names`` (default: ``grp``
    as well); both in the shared cache scope ``scope`` when it is given."""
    shared = {} if scope is None else {"cache_scope": scope}
    return build_policy(
        NOWHERE,
        version="reach",
        models=[model("main"), model(MEMBER), model("plain")],
        model_groups=[{"name": "grp", **GROUPS[path]}],
        backends=[
            backend("main-engine", NOWHERE, ["main", "plain"], kind="sim"),
            backend("probed", NOWHERE, [MEMBER], kind=kind, **(probed or {})),
        ],
        tenants=[
            tenant("acme", KEY_ACME, models=["grp"], **shared),
            tenant("globex", KEY_GLOBEX, models=globex_names or ["grp"], **shared),
        ],
        cache_scopes={scope: {}} if scope else {},
        **sections,
    )


PATHS = list(GROUPS)
ISOLATION = {"cache_isolation": {"unsalted": "dedicated"}}


@pytest.mark.parametrize("path", PATHS, ids=[f"a tenant reaches a group's {p} backend" for p in PATHS])
@pytest.mark.parametrize("globex", [["grp"], ["*"]], ids=["by naming the group", "by naming every model"])
def test_a_backend_reached_only_through_a_group_counts_every_tenant_of_the_group(path: str, globex: list[str]) -> None:
    snapshot = parse_policy(policy(path, globex_names=globex), "policies/reach.yaml")
    reach = policy_reach(snapshot.policy)
    assert [access.tenant.name for access in reach.of("probed")] == ["acme", "globex"]
    assert {access.via for access in reach.of("probed")} == {"grp"}
    assert "probed" in snapshot.multi_scope_backends
    backend_entry = next(b for b in snapshot.policy.backends if b.name == "probed")
    assert MESSAGES.translation(backend_entry, "probed" in snapshot.multi_scope_backends) is not None


@pytest.mark.parametrize("path", PATHS, ids=[f"through a group's {p}" for p in PATHS])
@pytest.mark.parametrize("kind", ["llamacpp", "openai"])
def test_dedicated_refuses_an_unsalted_backend_two_scopes_reach_through_a_group(path: str, kind: str) -> None:
    with pytest.raises(PolicyError) as refused:
        parse_policy(policy(path, kind, **ISOLATION), "policies/reach.yaml")
    message = str(refused.value)
    assert f"'probed' ({kind}) is not salted" in message
    assert "'acme' (through model group 'grp'), 'globex' (through model group 'grp')" in message


@pytest.mark.parametrize("path", PATHS, ids=[f"through a group's {p}" for p in PATHS])
def test_shared_warns_of_an_unsalted_backend_two_scopes_reach_through_a_group(path: str) -> None:
    snapshot = parse_policy(policy(path, "openai"), "policies/reach.yaml")
    assert any("'probed' (openai) cannot salt its prefix cache" in w for w in snapshot.warnings), snapshot.warnings


@pytest.mark.parametrize(
    ("globex", "tenants", "scopes"),
    [
        pytest.param(["plain"], None, {"acme"}, id="a tenant that names another model does not reach the group"),
        pytest.param(["grp"], ["acme"], {"acme"}, id="a backend's tenants list keeps the group's other tenants out"),
    ],
)
def test_a_backend_one_scope_reaches_keeps_messages_passthrough(
    globex: list[str], tenants: list[str] | None, scopes: set[str]
) -> None:
    probed = None if tenants is None else {"tenants": tenants}
    snapshot = parse_policy(policy("target", globex_names=globex, probed=probed), "policies/reach.yaml")
    reach = policy_reach(snapshot.policy)
    assert {access.tenant.name for access in reach.of("probed")} == scopes
    assert "probed" not in snapshot.multi_scope_backends


def test_tenants_of_one_shared_scope_reaching_through_a_group_are_one_scope() -> None:
    snapshot = parse_policy(policy("target", "llamacpp", scope="team", **ISOLATION), "policies/reach.yaml")
    assert "probed" not in snapshot.multi_scope_backends


def test_a_tenant_stranded_by_the_tenants_lists_of_a_groups_target_is_warned_of() -> None:
    snapshot = parse_policy(policy("target", probed={"tenants": ["acme"]}), "policies/reach.yaml")
    assert any(
        "tenant 'globex' may use model 'probe-model' (through model group 'grp') but none of its backends" in w
        for w in snapshot.warnings
    ), snapshot.warnings


@pytest.mark.parametrize(
    ("unsalted", "flags", "exit_code"),
    [
        pytest.param("dedicated", (), 1, id="policy validate refuses dedicated with an unsalted group backend"),
        pytest.param("shared", ("--strict",), 1, id="policy validate --strict fails on the shared warning"),
        pytest.param("shared", (), 0, id="policy validate without --strict prints the warning and passes"),
    ],
)
def test_policy_validate_names_the_unsalted_backend_a_group_shares(
    tmp_path: Path, unsalted: str, flags: tuple[str, ...], exit_code: int
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy("fallback", "llamacpp", cache_isolation={"unsalted": unsalted}))
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "policy", "validate", *flags, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == exit_code, done.stdout + done.stderr
    assert "'probed' (llamacpp)" in done.stdout + done.stderr
