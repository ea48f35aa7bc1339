"""Policy files: every problem is reported as ``<file>:<line>:<column>: <path>: <problem>``, all at once.

Each case edits a copy of the valid test policy (the session gateway's, ``tests/policy_builder.py``)
and names the one message the loader must give for it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.policy.loader import PolicyError
from gateway.request.keys import hash_api_key
from gateway.service import load_policy, parse_policy
from tests.conftest import CHAT_MODEL, KEY_ACME, KEY_GLOBEX, OTHER_MODEL
from tests.policy_builder import session_policy

REPO = Path(__file__).resolve().parent.parent
BASE: dict[str, Any] = yaml.safe_load(session_policy())
SOURCE = "policies/prod.yaml"

Edit = Callable[[dict[str, Any]], object]


def edited(edit: Edit) -> str:
    document = copy.deepcopy(BASE)
    edit(document)
    return yaml.safe_dump(document, sort_keys=False)


def add_model(name: str) -> Edit:
    return lambda d: d["models"].append({"name": name})


BAD_POLICIES = [
    pytest.param(
        lambda d: d["tenants"][0]["limits"].update(rpm=0),
        "tenants[acme].limits.rpm: must be greater than 0",
        id="a zero rate limit is refused with its path",
    ),
    pytest.param(
        lambda d: d["limits"].update(max_body_bytes=-1),
        "limits.max_body_bytes: must be greater than 0",
        id="a negative body limit is refused",
    ),
    pytest.param(
        lambda d: d["health_checks"].update(interval_s=0),
        "health_checks.interval_s: must be greater than 0",
        id="a zero health-check interval is refused",
    ),
    pytest.param(lambda d: d.update(colour="red"), "colour: unknown key", id="an unknown top-level key is refused"),
    pytest.param(
        lambda d: d["backends"][0].update(weight=2),
        "backends[fake].weight: unknown key",
        id="an unknown key inside a backend is refused",
    ),
    pytest.param(
        lambda d: d["tenants"][1].update(limits={"rmp": 10}),
        "tenants[globex].limits.rmp: unknown key; did you mean 'rpm'?",
        id="a misspelt limit is refused, not ignored",
    ),
    pytest.param(
        lambda d: d["backends"][0]["models"].append("test/nope"),
        "backends[fake].models[2]: unknown model 'test/nope' (declare it under models)",
        id="a backend serving an undeclared model is refused",
    ),
    pytest.param(
        lambda d: d["tenants"][1]["models"].append("test/nope"),
        "tenants[globex].models[1]: unknown model 'test/nope'",
        id="a tenant allowed an undeclared model is refused",
    ),
    pytest.param(
        lambda d: d["tenants"][0].update(default_class="gold"),
        "tenants[acme].default_class: unknown class 'gold'",
        id="a tenant with an undeclared class is refused",
    ),
    pytest.param(
        add_model("test/orphan"),
        "models[test/orphan]: no backend serves 'test/orphan'",
        id="a model that no backend serves is refused",
    ),
    pytest.param(
        add_model(CHAT_MODEL),
        "models[2].name: duplicate name 'test/chat'",
        id="a duplicate model name is refused",
    ),
    pytest.param(
        lambda d: d["backends"].append({**d["backends"][0]}),
        "backends[1].name: duplicate name 'fake'",
        id="a duplicate backend name is refused",
    ),
    pytest.param(
        lambda d: d["tenants"].append({**d["tenants"][1], "key_hashes": [hash_api_key("other")]}),
        "tenants[2].name: duplicate name 'globex'",
        id="a duplicate tenant name is refused",
    ),
    pytest.param(
        lambda d: d["tenants"][1].update(key_hashes=d["tenants"][0]["key_hashes"]),
        "tenants[globex].key_hashes[0]: already a key of tenant 'acme'",
        id="one key for two tenants is refused",
    ),
    pytest.param(
        lambda d: d.update(admin={"key_hashes": [hash_api_key("admin-key"), d["tenants"][1]["key_hashes"][0]]}),
        "admin.key_hashes[1]: already a key of tenant 'globex' (admin keys must be separate)",
        id="a tenant's key as an admin key is refused, since that tenant's clients would hold it",
    ),
    pytest.param(
        lambda d: d["tenants"][0].update(key_hashes=[KEY_ACME]),
        "tenants[acme].key_hashes: must be 'sha256:' followed by 64 lowercase hex digits "
        "(make one with `inference-gateway keys hash`); never a raw key",
        id="a raw key instead of its hash is refused",
    ),
    pytest.param(
        lambda d: d["tenants"][0].update(key_hashes=[hash_api_key(KEY_ACME).upper()]),
        "tenants[acme].key_hashes: must be 'sha256:' followed by 64 lowercase hex digits "
        "(make one with `inference-gateway keys hash`); never a raw key",
        id="an uppercase hash is refused",
    ),
    pytest.param(
        lambda d: d["models"][0].update(default_max_tokens=64),
        "models[test/chat].default_max_tokens: must not exceed max_output_tokens",
        id="a default max_tokens over the model's cap is refused",
    ),
    pytest.param(lambda d: d.pop("version"), "version: is required", id="a policy without a version is refused"),
    pytest.param(
        lambda d: d["classes"]["batch"]["slo"].pop("itl_ms"),
        "classes.batch.slo.itl_ms: is required",
        id="a class without an ITL target is refused",
    ),
    pytest.param(
        lambda d: d["backends"][0].update(kind="tgi"),
        "backends[fake].kind: must be 'vllm', 'sglang', 'llamacpp', 'openai' or 'sim'",
        id="an unknown backend kind is refused",
    ),
    pytest.param(
        lambda d: d["limits"].update(max_tokens_over_limit="truncate"),
        "limits.max_tokens_over_limit: must be 'reject' or 'clamp'",
        id="an unknown over-limit mode is refused",
    ),
    pytest.param(
        lambda d: d["limits"].update(max_body_bytes="1MB"),
        "limits.max_body_bytes: must be a valid integer, unable to parse string as an integer",
        id="a size with a unit is refused",
    ),
    pytest.param(
        lambda d: d["tenants"][0].update(models=[]),
        "tenants[acme].models: must have at least 1 item after validation, not 0",
        id="a tenant with no models is refused",
    ),
    pytest.param(
        lambda d: d["classes"]["batch"].update(rank=101),
        "classes.batch.rank: must be less than or equal to 100",
        id="a class rank over 100 is refused",
    ),
]


@pytest.mark.parametrize(("edit", "problem"), BAD_POLICIES)
def test_a_bad_policy_is_refused_with_file_path_and_problem(edit: Edit, problem: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(edited(edit), SOURCE)
    assert caught.value.problems == [problem]
    assert re.fullmatch(rf"{re.escape(SOURCE)}:\d+:\d+: {re.escape(problem)}", str(caught.value))


def test_every_problem_is_reported_at_once() -> None:
    def edit(d: dict[str, Any]) -> None:
        d["tenants"][0]["limits"]["rpm"] = 0
        d["tenants"][1]["key_hashes"] = [KEY_GLOBEX]

    with pytest.raises(PolicyError) as caught:
        parse_policy(edited(edit), SOURCE)
    lines = str(caught.value).splitlines()
    at = rf"{re.escape(SOURCE)}:\d+:\d+: "
    assert any(re.fullmatch(rf"{at}tenants\[acme\]\.limits\.rpm: must be greater than 0", line) for line in lines)
    assert any(re.match(rf"{at}tenants\[globex\]\.key_hashes: must be 'sha256:'", line) for line in lines)
    assert len(lines) == 2


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        pytest.param("- a\n- b\n", "the top level must be a mapping", id="a list is not a policy"),
        pytest.param("", "the top level must be a mapping", id="an empty file is not a policy"),
        pytest.param("version: [", "not valid YAML", id="broken YAML is reported as such"),
    ],
)
def test_a_file_that_is_not_a_policy_document_is_refused(text: str, problem: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, SOURCE)
    assert str(caught.value).startswith(f"{SOURCE}:1:")
    assert caught.value.problems[0].startswith(problem)


def test_a_missing_file_is_reported_with_its_name(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(PolicyError) as caught:
        load_policy(missing)
    assert str(caught.value) == f"{missing}: cannot read: No such file or directory"


def test_the_test_policy_loads_with_its_indexes() -> None:
    snapshot = parse_policy(session_policy(), SOURCE)
    assert snapshot.version == "test-1"
    assert set(snapshot.models) == {CHAT_MODEL, OTHER_MODEL}
    acme = snapshot.tenants_by_key_hash[hash_api_key(KEY_ACME)]
    globex = snapshot.tenants_by_key_hash[hash_api_key(KEY_GLOBEX)]
    assert (acme.name, globex.name) == ("acme", "globex")
    assert snapshot.tenant_may_use(acme, OTHER_MODEL)
    assert not snapshot.tenant_may_use(globex, OTHER_MODEL)
    assert [b.name for b in snapshot.backends_by_model[CHAT_MODEL]] == ["fake"]


def test_the_demo_policy_is_valid_and_its_keys_match_the_readme() -> None:
    snapshot = load_policy(REPO / "policies" / "demo.yaml")
    assert snapshot.tenants_by_key_hash[hash_api_key("demo-key-acme")].name == "acme"
    assert snapshot.tenants_by_key_hash[hash_api_key("demo-key-globex")].name == "globex"
    assert {"interactive", "batch"} <= set(snapshot.policy.classes)


def test_the_production_example_is_valid_and_shares_state_through_redis() -> None:
    """``policies/prod.yaml`` is the Kubernetes example's policy (``deploy/kubernetes/overlays/example``
    deploys the same, ``tests/deploy/test_kubernetes.py`` checks it): it must load."""
    snapshot = load_policy(REPO / "policies" / "prod.yaml")
    policy = snapshot.policy
    assert policy.state.backend == "redis"
    assert [b.name for b in policy.backends] == ["vllm-0", "vllm-1", "vllm-2"]
    assert all(b.credential_env == "VLLM_API_KEY" and b.price_per_gpu_hour for b in policy.backends)


def test_the_same_text_gives_the_same_digest_and_an_edit_changes_it() -> None:
    text = session_policy()
    assert parse_policy(text, "a").digest == parse_policy(text, "b").digest
    assert parse_policy(text.replace("test-1", "test-2"), "a").digest != parse_policy(text, "a").digest


def test_a_time_scaled_policy_keeps_the_files_digest_so_the_watcher_does_not_reload_it() -> None:
    from gateway.policy.timescale import scale_policy_time
    from gateway.service import load_policy

    original = load_policy("policies/demo.yaml")
    scaled = scale_policy_time(original, 8)
    assert scaled.digest == original.digest
    assert scaled.policy.classes["interactive"].slo.ttft_ms == 8 * original.policy.classes["interactive"].slo.ttft_ms
    assert scaled.policy.classes["interactive"].slo.objective == original.policy.classes["interactive"].slo.objective
