"""The workload parser: shipped examples load, and every error names the file and the path in it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from loadtests.loadgen.workload import Fixed, WorkloadError, load_workload, parse_workload

WORKLOADS = Path(__file__).parents[2] / "loadtests" / "workloads"

VALID: dict[str, Any] = {
    "name": "t",
    "model": "m",
    "classes": {
        "interactive": {"share": 0.5, "priority": "interactive", "slo": {"ttft_ms": 500, "tpot_ms": 30}},
        "batch": {"share": 0.5, "priority": "batch", "slo": {"ttft_ms": 2000, "tpot_ms": 100}},
    },
    "tenants": {"acme": {"share": 1, "api_key": "k"}},
    "prompt_tokens": {"dist": "fixed", "value": 10},
    "output_tokens": {"dist": "uniform", "min": 1, "max": 5},
}


def _with(path: str, value: Any) -> dict[str, Any]:
    """VALID with the dotted ``path`` set to ``value`` (``...=DELETE`` removes it)."""
    data = copy.deepcopy(VALID)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return data


DELETE = object()


@pytest.mark.parametrize("name", ["demo", "multiturn", "fewshot"])
def test_shipped_workloads_load(name: str) -> None:
    workload = load_workload(WORKLOADS / f"{name}.yaml")
    assert workload.name == name


def test_demo_uses_mlperf_slos_and_gateway_demo_tenants() -> None:
    demo = load_workload(WORKLOADS / "demo.yaml")
    assert (demo.classes["interactive"].slo.ttft_ms, demo.classes["interactive"].slo.tpot_ms) == (500, 30)
    assert (demo.classes["batch"].slo.ttft_ms, demo.classes["batch"].slo.tpot_ms) == (2000, 100)
    assert {name: t.resolve_key() for name, t in demo.tenants.items()} == {
        "acme": "demo-key-acme",
        "globex": "demo-key-globex",
    }


def test_multiturn_has_eight_tenants_with_long_system_prompts() -> None:
    workload = load_workload(WORKLOADS / "multiturn.yaml")
    assert len(workload.tenants) == 8
    assert workload.prefix.system_prompt_tokens >= 1000
    assert workload.conversation is not None


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (_with("classes.interactive.share", 1.5), "classes.interactive.share: must be between 0 and 1"),
        (_with("classes.batch.share", 0.2), "classes: shares must sum to 1, not 0.7"),
        (_with("tenants.acme.share", 0.5), "tenants: shares must sum to 1, not 0.5"),
        (_with("classes.batch.slo.ttft_ms", -1), "classes.batch.slo.ttft_ms: Input should be greater than 0"),
        (_with("classes.batch.slo.itl", 5), "classes.batch.slo.itl: Extra inputs are not permitted"),
        (_with("prompt_tokens", {"dist": "zipf"}), "prompt_tokens: Input tag 'zipf' found using 'dist'"),
        (
            _with("output_tokens", {"dist": "uniform", "min": 9, "max": 2}),
            "output_tokens.uniform: min must not exceed max",
        ),
        (_with("tenants.acme.api_key", DELETE), "tenants.acme: give exactly one of api_key and api_key_env"),
        (
            _with("tenants.acme", {"share": 1, "api_key_env": "LOADGEN_TEST_UNSET_KEY"}),
            "tenants.acme.api_key_env: environment variable LOADGEN_TEST_UNSET_KEY is not set",
        ),
        (_with("arrival", {"process": "gamma"}), "arrival: a gamma process needs cv"),
        (_with("arrival", {"process": "poisson", "cv": 2}), "arrival: cv applies only to gamma, not poisson"),
        (_with("model", DELETE), "model: Field required"),
        (
            _with("conversation", {"turns": {"dist": "fixed", "value": 3}, "active_per_tenant": 0}),
            "conversation.active_per_tenant: Input should be greater than or equal to 1",
        ),
    ],
    ids=[
        "a class share above one is out of range",
        "class shares that do not sum to one are refused",
        "tenant shares that do not sum to one are refused",
        "a negative TTFT SLO is refused",
        "an unknown SLO key is refused",
        "an unknown length distribution is refused",
        "a uniform length with min above max is refused",
        "a tenant without a key is refused",
        "a key read from an unset environment variable is refused",
        "a gamma process without cv is refused",
        "cv on a poisson process is refused rather than ignored",
        "a missing model is refused",
        "a conversation pool of zero is refused",
    ],
)
def test_parser_errors_name_the_file_and_the_path(data: dict[str, Any], expected: str) -> None:
    with pytest.raises(WorkloadError) as info:
        parse_workload(data, source="loadtests/workloads/x.yaml")
    assert f"loadtests/workloads/x.yaml: {expected}" in str(info.value)


def test_a_key_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOADGEN_TEST_KEY", "secret")
    workload = parse_workload(_with("tenants.acme", {"share": 1, "api_key_env": "LOADGEN_TEST_KEY"}), source="x")
    assert workload.tenants["acme"].resolve_key() == "secret"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("name: [unclosed", "not valid YAML"), ("- a list", "the top level must be a mapping")],
    ids=["broken YAML is reported with the file", "a list at the top level is refused"],
)
def test_file_level_errors(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=expected) as info:
        load_workload(path)
    assert str(info.value).startswith(str(path))


def test_a_missing_file_is_reported_with_its_path(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(tmp_path / "nope.yaml")


def test_a_class_may_override_the_lengths() -> None:
    data = _with("classes.batch.output_tokens", {"dist": "fixed", "value": 7})
    assert parse_workload(data, source="x").classes["batch"].output_tokens == Fixed(dist="fixed", value=7)
