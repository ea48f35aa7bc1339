"""Every way into a policy runs the checks that live above ``policy`` (``gateway/policy/checks.py``).

The loader no longer knows the routing registry, the shadow scorers or the isolation rule: the
composition root hands them in (``gateway/service.py``: ``POLICY_LOADER``). A policy naming an
unknown strategy, an unknown shadow scorer, or an unsalted engine shared by two cache scopes
must still be refused by each entry point: a file load (serve, workers, ``explain``), ``policy
validate``, a hot reload, and a time-scaled copy (the demo's).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.policy.loader import PolicyError
from gateway.policy.timescale import scale_policy_time
from gateway.policy.watch import PolicySource, ReloadOutcome
from gateway.service import POLICY_LOADER, load_policy, parse_policy
from tests.policy.positions import POLICY, SOURCE, edited

ROOT = Path(__file__).resolve().parents[2]
ISOLATION = "cache_isolation: {unsalted: dedicated}\n"

REFUSED = [
    pytest.param(
        edited("routing: {strategy: prefix_affinity}", "routing: {strategy: prefix_afinity}"),
        "models[big].routing.strategy: unknown strategy 'prefix_afinity'",
        id="routing: an unknown strategy",
    ),
    pytest.param(
        edited("    fallbacks: [big]\n", "    fallbacks: [big]\n    shadow: {model: big, percent: 5, scorer: vibes}\n"),
        "model_groups[assistant].shadow.scorer: unknown scorer 'vibes'",
        id="shadow: an unknown quality scorer",
    ),
    pytest.param(
        ISOLATION + edited("    kind: vllm\n", "    kind: llamacpp\n"),
        "backends[gpu-a]: 'gpu-a' (llamacpp) is not salted (cache_isolation.unsalted: dedicated)",
        id="isolation: an unsalted engine shared by two cache scopes",
    ),
]


def written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


def test_the_written_out_policy_is_valid_as_it_stands() -> None:
    assert parse_policy(POLICY, SOURCE).version == "positions-1"


@pytest.mark.parametrize(("text", "problem"), REFUSED)
@pytest.mark.parametrize("load", [load_policy, POLICY_LOADER.load], ids=["load_policy", "POLICY_LOADER.load"])
def test_a_file_load_refuses_it(tmp_path: Path, load: Callable[[Path], object], text: str, problem: str) -> None:
    with pytest.raises(PolicyError) as caught:
        load(written(tmp_path, text))
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems


@pytest.mark.parametrize(("text", "problem"), REFUSED)
def test_policy_validate_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, problem: str
) -> None:
    assert main(["policy", "validate", str(written(tmp_path, text))]) == 1
    assert problem in capsys.readouterr().err


@pytest.mark.parametrize(("text", "problem"), REFUSED)
def test_a_reload_refuses_it_and_keeps_the_policy_in_force(tmp_path: Path, text: str, problem: str) -> None:
    path = written(tmp_path, POLICY)
    source = PolicySource(path, POLICY_LOADER)
    path.write_text(text)
    result = source.reload("test")
    assert (result.outcome, source.current().version) == (ReloadOutcome.INVALID, "positions-1")
    assert problem in (result.error or "")


def test_a_time_scaled_policy_is_loaded_with_the_checks_its_original_passed() -> None:
    snapshot = parse_policy(POLICY, SOURCE)
    assert scale_policy_time(snapshot, 8).checks is snapshot.checks is POLICY_LOADER.checks


def test_only_the_composition_root_binds_the_checks() -> None:
    """A second ``PolicyChecks`` or ``PolicyLoader`` in the product or the bench could leave a check
    out; the time scaling builds a loader from the checks its snapshot passed."""
    allowed = {"gateway/service.py": {"PolicyChecks", "PolicyLoader"}, "gateway/policy/timescale.py": {"PolicyLoader"}}
    found: dict[str, set[str]] = {}
    for folder in ("gateway", "loadtests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            calls = {
                node.func.id
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("PolicyChecks", "PolicyLoader")
            }
            if calls:
                found[str(path.relative_to(ROOT))] = calls
    assert found == allowed
