"""A key written twice in a policy is refused everywhere a policy is read: never "the last one wins".

The issue's case: a second ``limits:`` under a tenant turned rpm 60 into 600,000 and dropped the
tenant's other limits, and ``policy validate`` said valid and a hot reload applied it. Here the
loader refuses it at any depth (``parse_policy``), ``policy validate`` and ``serve`` exit 1
naming it (the real command line), and a running gateway keeps the policy in force, counts the
failed reload and goes on enforcing the old limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from gateway.policy.loader import PolicyError
from gateway.policy.watch import PolicySource, ReloadOutcome
from gateway.service import POLICY_LOADER, parse_policy
from gateway.settings import Settings
from tests.cli.test_commands import run
from tests.fake_backend import FakeBackend
from tests.policy.positions import POLICY, SOURCE, edited
from tests.policy_builder import CHAT_MODEL, KEY_ACME, admin_keys, build_policy
from tests.servers import admin_url, free_port, metric, serve_gateway_in_thread, serve_in_thread

ADMIN_KEY = "admin-key-for-duplicate-tests"

ISSUE_CASE = edited(
    "    limits: {rpm: 60, tpm: 100000, max_concurrent: 4}\n",
    "    limits: {rpm: 60, tpm: 100000, max_concurrent: 4}\n    limits: {rpm: 600000}\n",
)
LAST_WINS = " (YAML would silently keep only the last)"
ISSUE_LINE = f"{SOURCE}:33:5: tenants[acme].limits: duplicate key, first at line 32, column 5"

DUPLICATED = [
    pytest.param(ISSUE_CASE, [ISSUE_LINE], id="a second limits under a tenant (the issue's case)"),
    pytest.param(
        edited("version: positions-1\n", "version: positions-1\nversion: positions-2\n"),
        [f"{SOURCE}:2:1: version: duplicate key, first at line 1, column 1"],
        id="a key of the top level",
    ),
    pytest.param(
        edited("e2e_ms: 60000}", "e2e_ms: 60000, ttft_ms: 5}"),
        [f"{SOURCE}:5:52: classes.interactive.slo.ttft_ms: duplicate key, first at line 5, column 11"],
        id="a key of a class's slo, in a flow mapping",
    ),
    pytest.param(
        edited("      itl_ms: 100\n", "      itl_ms: 100\n      itl_ms: 1000\n"),
        [f"{SOURCE}:11:7: classes.batch.slo.itl_ms: duplicate key, first at line 10, column 7"],
        id="a key of a class's slo, in a block mapping",
    ),
    pytest.param(
        edited(
            "    fallbacks: [big]\n",
            "    fallbacks: [big]\n    rollout:\n      baseline: chat-v1\n      candidate: chat-v2\n"
            "      steps: [1, 50, 100]\n      steps: [100]\n",
        ),
        [f"{SOURCE}:31:7: model_groups[assistant].rollout.steps: duplicate key, first at line 30, column 7"],
        id="a key of a model group's rollout",
    ),
    pytest.param(
        edited("    kind: vllm\n", "    kind: vllm\n    kind: llamacpp\n").replace(
            "rank: 1\n", "rank: 1\n    rank: 2\n"
        ),
        [
            f"{SOURCE}:8:5: classes.batch.rank: duplicate key, first at line 7, column 5",
            f"{SOURCE}:23:5: backends[gpu-a].kind: duplicate key, first at line 22, column 5",
        ],
        id="every duplicate at once, in the order of the file",
    ),
]


@pytest.mark.parametrize(("text", "lines"), DUPLICATED)
def test_a_key_written_twice_is_refused_at_any_depth(text: str, lines: list[str]) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, SOURCE)
    assert str(caught.value).splitlines() == [line + LAST_WINS for line in lines]


def test_the_policy_without_the_second_key_loads() -> None:
    assert parse_policy(POLICY, SOURCE).policy.tenants[0].limits.rpm == 60


def test_policy_validate_exits_1_naming_the_duplicate_with_its_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "prod.yaml"
    path.write_text(ISSUE_CASE)
    for flags in ((), ("--strict",)):
        result = run("policy", "validate", *flags, str(path))
        assert result.returncode == 1, result
        assert "valid (version" not in result.stdout
        assert result.stderr.splitlines() == [ISSUE_LINE.replace(SOURCE, str(path)) + LAST_WINS]


def test_serve_refuses_to_start_on_a_duplicate(tmp_path: Path) -> None:
    path = tmp_path / "prod.yaml"
    path.write_text(ISSUE_CASE)
    result = run("serve", "--policy", str(path), "--port", str(free_port()), "--admin-port", "0")
    assert result.returncode == 1
    assert f"{path}:33:5: tenants[acme].limits: duplicate key" in result.stderr


def test_the_watcher_keeps_the_policy_in_force_and_counts_the_refusal(tmp_path: Path) -> None:
    path = tmp_path / "prod.yaml"
    path.write_text(POLICY)
    source = PolicySource(path, POLICY_LOADER)
    before = source.current()
    path.write_text(ISSUE_CASE)
    result = source.poll()
    assert result is not None
    assert result.outcome is ReloadOutcome.INVALID
    assert source.current() is before
    assert source.reloads_invalid == 1
    assert source.last_error is not None
    assert source.last_error.startswith(f"{path}:33:5: tenants[acme].limits: duplicate key")


RPM = 3


def limited_policy(url: str) -> str:
    """The test policy with acme at ``RPM`` requests a minute, admin keys and no file polling."""
    acme = {"limits": {"rpm": RPM, "tpm": 100000, "max_concurrent": 4}}
    return build_policy(url, tenants={"acme": acme}, admin=admin_keys(ADMIN_KEY), lifecycle={"watch_interval_s": 0})


def with_second_limits(text: str) -> str:
    """``text`` with a second ``limits:`` under acme (the first is its last field): 600,000 rpm, nothing else."""
    first = f"  limits:\n    rpm: {RPM}\n    tpm: 100000\n    max_concurrent: 4\n"
    assert text.count(first) == 1, text
    return text.replace(first, first + "  limits:\n    rpm: 600000\n")


@contextmanager
def gateway(path: Path) -> Iterator[str]:
    fake = FakeBackend()
    with serve_in_thread(fake) as backend_url:
        path.write_text(limited_policy(backend_url))
        settings = Settings(policy_path=str(path), health_checks=False, port=0, admin_port=0)
        with serve_gateway_in_thread(settings, PolicySource(path, POLICY_LOADER).current()) as built:
            yield built.api_url


def chat(url: str) -> int:
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY_ACME}"})
    return reply.status_code


def test_a_hot_reload_of_a_duplicate_keeps_the_old_limits_enforced(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with gateway(path) as url:
        assert chat(url) == 200
        path.write_text(with_second_limits(path.read_text()))
        refused = httpx.post(f"{admin_url(url)}/admin/reload", headers=admin)
        assert refused.status_code == 422
        status = httpx.get(f"{admin_url(url)}/admin/policy", headers=admin).json()
        assert status["reloads"]["invalid"] == 1
        assert f"{path}:" in status["last_error"]
        assert "tenants[acme].limits: duplicate key, first at line" in status["last_error"]
        assert metric(url, "gateway_policy_reloads", result="invalid") == 1
        assert [chat(url) for _ in range(RPM)] == [200] * (RPM - 1) + [429], "acme's old rpm limit still applies"
