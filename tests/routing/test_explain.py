"""``inference-gateway policy explain``: class, queue, per-backend scores, matched blocks, the choice."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main
from gateway.errors import InvalidRequest
from gateway.routing.explain import api_of
from tests.routing.conftest import MODEL, SYSTEM, routing_policy


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my order?"}],
    }
    served = {**body, "messages": [*body["messages"][:1], {"role": "user", "content": "Hello"}]}
    paths = {
        "policy": tmp_path / "p.yaml",
        "key": tmp_path / "key",
        "request": tmp_path / "req.json",
        "state": tmp_path / "state.json",
    }
    paths["policy"].write_text(routing_policy())
    paths["key"].write_text("key-acme\n")
    paths["request"].write_text(json.dumps(body))
    paths["state"].write_text(json.dumps({"b2": {"in_flight": 1, "served": [served]}, "b0": {"healthy": False}}))
    return paths


def run(files: dict[str, Path], *extra: str) -> int:
    args = ["policy", "explain", "--policy", str(files["policy"]), "--api-key-file", str(files["key"])]
    return main([*args, "--request", str(files["request"]), *extra])


def test_explain_shows_the_class_queue_scores_and_the_backend_holding_the_prefix(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(files, "--backend-state", str(files["state"])) == 0
    out = capsys.readouterr().out
    assert "tenant:  acme (cache scope tenant:acme)" in out
    assert "class:   interactive (rank 0); queue: model 'm' class 'interactive'" in out
    assert "prefix-affinity-scorer" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  b")}
    assert lines["b0"].split()[1] == "unhealthy"
    assert lines["b1"].split()[3] == "0/6"
    assert lines["b2"].split()[3] == "6/6"  # the full blocks all lie in the shared system prompt
    assert "chosen:  b2 (prefix_match;" in out
    assert "cache_salt: set to HMAC-SHA256(secret, 'tenant:acme')" in out


def test_explain_without_state_chooses_on_load(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(files) == 0
    assert "(no_prefix; 0 prefix blocks expected cached)" in capsys.readouterr().out


def test_explain_reports_what_the_gateway_would_refuse(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    files["key"].write_text("wrong-key")
    assert run(files) == 1
    assert "the gateway would answer 401 invalid_api_key" in capsys.readouterr().err


def test_explain_rejects_an_unknown_backend_in_the_state_file(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    files["state"].write_text(json.dumps({"b9": {"in_flight": 1}}))
    assert run(files, "--backend-state", str(files["state"])) == 1
    assert "'b9' is not a backend of the policy" in capsys.readouterr().err


def backend_kinds(*specs: str) -> dict[str, Any]:
    """Backend ``b<i>`` of kind and tenants ``specs[i]`` (``llamacpp [acme]``): a ``backends`` edit."""
    edits = {}
    for i, spec in enumerate(specs):
        kind, _, tenants = spec.partition(" ")
        edits[f"b{i}"] = {"kind": kind, **({"tenants": yaml.safe_load(tenants)} if tenants else {})}
    return edits


@pytest.mark.parametrize(
    ("backends", "unsalted", "expected"),
    [
        pytest.param(
            backend_kinds("llamacpp [acme]", "llamacpp [globex]", "llamacpp [shared-a, shared-b]"),
            "dedicated",
            [
                "b1 other-tenants",
                "chosen:  b0 (",
                "cache_salt: not set (llamacpp backends do not read it); its prefix cache is shared by the tenants "
                "it serves: tenants acme (cache_isolation.unsalted: dedicated)",
            ],
            id="a dedicated backend is the only one offered, and said to be shared by its tenants only",
        ),
        pytest.param(
            backend_kinds("llamacpp", "llamacpp", "llamacpp"),
            "no_prompt_cache",
            [
                "cache_salt: not set (llamacpp backends do not read it); cache_prompt: set to false "
                "(cache_isolation.unsalted: no_prompt_cache): the engine reuses no cached prompt, whoever sent it"
            ],
            id="a llamacpp backend under no_prompt_cache is said to reuse no prompt",
        ),
        pytest.param(
            backend_kinds("sglang", "sglang", "sglang"),
            "shared",
            ["cache_salt: set to HMAC-SHA256(secret, 'tenant:acme') for this sglang backend"],
            id="an sglang backend is said to be salted",
        ),
        pytest.param(
            backend_kinds("vllm [globex]", "vllm [globex]", "vllm [globex]"),
            "shared",
            [
                "no backend of the model serves this tenant: the request would be refused: 503 no_backend_for_tenant",
                "b0: other-tenants",
            ],
            id="a tenant that no backend serves is said to be refused",
        ),
    ],
)
def test_explain_shows_the_tenants_backends_and_what_isolates_its_cache(
    files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    backends: dict[str, Any],
    unsalted: str,
    expected: list[str],
) -> None:
    files["policy"].write_text(routing_policy(backends=backends, cache_isolation={"unsalted": unsalted}))
    assert run(files) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    rooms = {" ".join(line.split()[:2]) for line in out.splitlines() if line.startswith("  b")}
    for line in expected:
        assert line in out or line in rooms


@pytest.mark.parametrize(
    ("body", "api"),
    [
        pytest.param({"model": MODEL, "messages": []}, "chat", id="messages make a chat"),
        pytest.param({"model": MODEL, "prompt": "Once"}, "completions", id="a prompt makes a completion"),
        pytest.param({"model": MODEL, "input": "a text", "dimensions": 8}, "embeddings", id="input makes an embedding"),
    ],
)
def test_explain_tells_the_api_of_a_body_by_its_prompt_field(body: dict[str, Any], api: str) -> None:
    assert api_of(body).name == api


def test_explain_refuses_a_body_without_a_prompt_naming_every_api_s_prompt_field() -> None:
    named = re.escape("'messages' (chat), 'prompt' (completions), 'input' (embeddings)")
    with pytest.raises(InvalidRequest, match=named):
        api_of({"model": MODEL})
