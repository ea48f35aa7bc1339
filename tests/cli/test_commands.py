"""The ``inference-gateway`` command line, run as real subprocesses with deadlines."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.request.keys import hash_api_key
from tests.conftest import KEY_ACME
from tests.policy_builder import session_policy
from tests.servers import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
INVALID = "tests/policies/invalid.yaml"
DEADLINE_S = 30


@pytest.fixture
def valid(tmp_path: Path) -> str:
    """A file holding the session gateway's policy (valid, version test-1)."""
    path = tmp_path / "gateway.yaml"
    path.write_text(session_policy())
    return str(path)


def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``inference-gateway ARGS`` (as ``python -m gateway``, from the repository root)."""
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )


def test_validate_accepts_a_valid_policy_with_exit_0(valid: str) -> None:
    result = run("policy", "validate", valid)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{valid}: valid (version test-1, digest ")


def test_validate_prints_every_error_and_exits_1() -> None:
    result = run("policy", "validate", INVALID)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"{INVALID}:11:17: tenants[acme].key_hashes: must be 'sha256:' followed by 64 lowercase hex digits "
        "(make one with `inference-gateway keys hash`); never a raw key",
        f"{INVALID}:14:19: tenants[acme].limits.rpm: must be greater than 0",
    ]


def test_validate_checks_every_file_and_fails_if_one_is_invalid(valid: str) -> None:
    result = run("policy", "validate", valid, INVALID, "policies/demo.yaml")
    assert result.returncode == 1
    assert f"{valid}: valid" in result.stdout
    assert "policies/demo.yaml: valid" in result.stdout
    assert f"{INVALID}:14:19: tenants[acme].limits.rpm" in result.stderr


def test_validate_reports_a_missing_file() -> None:
    result = run("policy", "validate", "tests/policies/missing.yaml")
    assert result.returncode == 1
    assert result.stderr.strip() == "tests/policies/missing.yaml: cannot read: No such file or directory"


@pytest.mark.parametrize(
    ("flags", "exit_code"),
    [
        pytest.param((), 0, id="warnings are printed and the policy is valid"),
        pytest.param(("--strict",), 1, id="with --strict a warning fails the validation"),
    ],
)
def test_validate_prints_the_policys_warnings_with_file_and_path(
    tmp_path: Path, flags: tuple[str, ...], exit_code: int
) -> None:
    path = tmp_path / "shared-llama.yaml"
    path.write_text(session_policy(backends={"fake": {"kind": "llamacpp"}}))
    result = run("policy", "validate", *flags, str(path))
    assert result.returncode == exit_code
    assert result.stdout.startswith(f"{path}: valid (version test-1, digest ")
    (warning,) = result.stderr.splitlines()
    assert re.match(
        rf"{re.escape(str(path))}:\d+:\d+: warning: backends\[fake\]: 'fake' \(llamacpp\) cannot salt its prefix "
        "cache and serves tenants of different cache scopes: 'acme', 'globex'",
        warning,
    ), warning


def test_keys_hash_reads_the_key_on_stdin_and_prints_the_policy_form() -> None:
    result = run("keys", "hash", stdin="  key-acme \n")  # surrounding whitespace is not part of the key
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == hash_api_key(KEY_ACME)
    assert hash_api_key(KEY_ACME) in session_policy()


def test_keys_hash_without_a_key_exits_1() -> None:
    result = run("keys", "hash", stdin="")
    assert result.returncode == 1
    assert "no key on stdin" in result.stderr


def test_the_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "inference-gateway"
    result = subprocess.run(
        [str(script), "keys", "hash"], input="key-acme\n", capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert result.stdout.strip() == hash_api_key(KEY_ACME)


def test_serve_refuses_an_invalid_policy_with_exit_1() -> None:
    result = run("serve", "--policy", INVALID, "--port", str(free_port()))
    assert result.returncode == 1
    assert f"{INVALID}:14:19: tenants[acme].limits.rpm: must be greater than 0" in result.stderr


@pytest.fixture
def serving(tmp_path: Path, backend_credential: str) -> Iterator[tuple[str, str]]:
    """``inference-gateway serve`` in a subprocess, in front of a closed port; yields its API and
    operator URLs."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(session_policy("http://127.0.0.1:9"))
    port, admin_port = free_port(), free_port()
    argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--port", str(port)]
    argv += ["--admin-port", str(admin_port)]
    process = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    finally:
        process.terminate()
        process.wait(timeout=DEADLINE_S)
        assert process.stderr is not None
        process.stderr.close()


def test_serve_starts_the_gateway_on_the_given_ports(serving: tuple[str, str]) -> None:
    api, admin = serving

    def alive() -> bool:
        try:
            return httpx.get(api + "/healthz").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(alive, timeout=DEADLINE_S, what="the served gateway to answer /healthz")
    # Its only backend is at a closed port, so it is alive but not ready, on both listeners.
    assert httpx.get(api + "/readyz").status_code == 503
    assert httpx.get(admin + "/readyz").status_code == 503
    # The operator endpoints answer on the operator listener only.
    assert httpx.get(api + "/metrics").status_code == 404
    assert httpx.get(admin + "/metrics").status_code == 200


def test_serve_refuses_one_port_for_both_listeners_with_exit_1(valid: str) -> None:
    port = str(free_port())
    result = run("serve", "--policy", valid, "--port", port, "--admin-port", port)
    assert result.returncode == 1
    assert f"the admin port must differ from the API port ({port})" in result.stderr


def test_serve_reports_a_taken_port_with_exit_1(valid: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("serve", "--policy", valid, "--port", str(free_port()), "--admin-port", str(port))
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_demo_names_the_policy_it_was_given(tmp_path: Path) -> None:
    """``demo --policy P`` runs P, and says so (not policies/demo.yaml)."""
    engines = [free_port(), free_port()]
    demo = (REPO / "policies" / "demo.yaml").read_text()
    policy = tmp_path / "mine.yaml"
    policy.write_text(demo.replace("18001", str(engines[0])).replace("18002", str(engines[1])))
    port, admin_port = free_port(), free_port()
    argv = [sys.executable, "-m", "gateway", "demo", "--policy", str(policy), "--port", str(port)]
    argv += ["--admin-port", str(admin_port), "--time-scale", "0.01"]
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert process.stdout is not None
        lines = iter(process.stdout.readline, "")
        banner = [line for line, _ in zip(lines, range(6), strict=False)]
    finally:
        process.terminate()
        process.wait(timeout=DEADLINE_S)
        if process.stdout is not None:
            process.stdout.close()
    assert f"Policy: {policy}\n" in banner, banner
