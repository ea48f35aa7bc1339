"""The ``inference-gateway`` command line, run as real subprocesses with deadlines."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.request.keys import hash_api_key
from loadtests.sim import build_engine_app
from loadtests.sim.profiles import BLOCK_SIZE
from tests.conftest import CHAT_MODEL, KEY_ACME, closed_port_url
from tests.dispatch.fake_llamacpp import FakeLlamacpp
from tests.policy_builder import backend, build_policy, model, session_policy, tenant
from tests.servers import free_port, serve_in_thread, wait_until

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


# --- policy validate --live: the declared capacity against live engines ---------------------------


@dataclass(frozen=True)
class Engines:
    """A simulated vLLM and a llama.cpp server on loopback ports, and a port where nothing listens."""

    sim: str
    sim_kv: int
    llama: str
    llama_engine: FakeLlamacpp
    closed: str


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    app = build_engine_app("fixed", model=CHAT_MODEL)
    llama = FakeLlamacpp(slots=3)
    with serve_in_thread(app) as sim_url, serve_in_thread(llama) as llama_url:
        yield Engines(sim_url, app.profile.num_kv_blocks * BLOCK_SIZE, llama_url, llama, closed_port_url())


def live_policy(tmp_path: Path, *backends: dict[str, Any]) -> str:
    path = tmp_path / "live.yaml"
    models = [model(CHAT_MODEL, max_prompt_tokens=64, max_output_tokens=32)]
    path.write_text(build_policy(backends=list(backends), models=models, tenants=[tenant("acme", KEY_ACME)]))
    return str(path)


def sim(url: str, **capacity: Any) -> dict[str, Any]:
    return backend("sim-a", url, [CHAT_MODEL], kind="sim", capacity=capacity)


def llama(url: str, capacity: Any = "auto") -> dict[str, Any]:
    return backend("llama-a", url, [CHAT_MODEL], kind="llamacpp", capacity=capacity)


def test_validate_live_exits_0_when_every_engine_agrees_and_prints_both_figures(
    tmp_path: Path, engines: Engines
) -> None:
    path = live_policy(tmp_path, sim(engines.sim, kv_cache_tokens=engines.sim_kv), llama(engines.llama))
    result = run("policy", "validate", "--live", path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{path}: valid (version test-1, digest ")
    assert lines[1:] == [
        f"backend sim-a (sim at {engines.sim}): max_concurrent: declared 256, engine not given; "
        f"kv_cache_tokens: declared {engines.sim_kv}, engine {engines.sim_kv} (vllm:cache_config_info on /metrics)",
        f"backend llama-a (llamacpp at {engines.llama}): max_concurrent: declared auto, engine 3; "
        f"kv_cache_tokens: declared auto, engine {engines.llama_engine.kv_cache_tokens} (GET /props)",
    ]


def test_validate_live_prints_the_gateways_warning_and_exits_3_on_a_disagreement(
    tmp_path: Path, engines: Engines
) -> None:
    wrong = engines.sim_kv // 4
    path = live_policy(tmp_path, sim(engines.sim, kv_cache_tokens=wrong), llama(engines.llama, {"max_concurrent": 8}))
    result = run("policy", "validate", "--live", path)
    assert result.returncode == 3, result.stderr
    assert result.stderr.splitlines() == [
        f"WARNING backend sim-a: capacity.kv_cache_tokens is {wrong} in the policy but the engine reports "
        f"{engines.sim_kv}: more than 10% off: the prefix index is sized wrong (vllm:cache_config_info on /metrics)",
        "WARNING backend llama-a: capacity.max_concurrent is 8 in the policy but the engine reports 3: the engine "
        "would queue the surplus out of the gateway's sight (GET /props)",
    ]


def test_validate_live_exits_3_for_an_auto_backend_whose_engine_cannot_be_read(
    tmp_path: Path, engines: Engines
) -> None:
    path = live_policy(tmp_path, sim(engines.sim), llama(engines.closed))
    result = run("policy", "validate", "--live", "--timeout", "1", path)
    assert result.returncode == 3, result.stderr
    assert f"backend llama-a (llamacpp at {engines.closed}): engine not read: unreadable: ConnectError" in result.stdout
    (error,) = result.stderr.splitlines()
    assert error.startswith(
        "ERROR backend llama-a: capacity.max_concurrent and capacity.kv_cache_tokens are auto but the engine's "
        "limits could not be read (unreadable: ConnectError"
    ), error
    assert error.endswith("): the gateway would send this backend no request")


@pytest.mark.parametrize(
    ("flags", "exit_code"),
    [
        pytest.param((), 0, id="an unreachable engine with a declared capacity is said and passes"),
        pytest.param(("--strict",), 3, id="and fails with --strict"),
    ],
)
def test_validate_live_says_which_engines_it_could_not_read(
    tmp_path: Path, engines: Engines, flags: tuple[str, ...], exit_code: int
) -> None:
    path = live_policy(tmp_path, sim(engines.closed, max_concurrent=8))
    result = run("policy", "validate", "--live", "--timeout", "1", *flags, path)
    assert result.returncode == exit_code, result.stderr
    assert f"backend sim-a (sim at {engines.closed}): engine not read: unreadable: ConnectError" in result.stdout
    assert result.stderr.splitlines() == ["WARNING backend sim-a: its engine's limits were not read, nothing compared"]


def test_validate_refuses_auto_for_a_figure_the_kind_does_not_publish_with_exit_1(
    tmp_path: Path, engines: Engines
) -> None:
    path = live_policy(tmp_path, sim(engines.sim, max_concurrent="auto"))
    for flags in ((), ("--live",)):
        result = run("policy", "validate", *flags, path)
        assert result.returncode == 1, "an invalid policy exits 1, with or without --live"
        assert result.stdout == ""
        assert result.stderr.strip() == (
            f"{path}: backends[sim-a].capacity.max_concurrent: auto, but an engine of kind sim does not publish it; "
            "declare it as a number (for vLLM and the simulator: their --max-num-seqs)"
        )
